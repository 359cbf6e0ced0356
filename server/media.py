"""The bytes of a request's images, fetched as vLLM's MediaConnector fetches them.

An image part names its image by URL (every API's part becomes chat's `image_url` part first):

    data:image/png;base64,...   decoded here (base64 only; the media type must be an image's)
    http://, https://           fetched with the server's one HTTP session: within
                                VLLM_IMAGE_FETCH_TIMEOUT seconds (vLLM's variable, default 5) for
                                the whole fetch, redirects included, at most MAX_IMAGE_BYTES, only
                                from --allowed-media-domains when it is given (each redirect's
                                host too); any answer but 200 is refused
    file://                     read only under --allowed-local-media-path (symlinks resolved first)

Anything else (ftp:, a bare path, a stored file's id) is refused. Every refusal is a 400 naming
the image (`ImagePart.error`): what the client sent cannot be read, nothing about the server.
Decoding and resizing are the engine's `ImageProcessor.resize` (the app runs it off the loop).

Knows nothing about the APIs' shapes or the engine.
"""

from __future__ import annotations

import asyncio
import os
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from yarl import URL

from ..engine.vision.image import data_url_bytes
from .errors import APIError

FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"  # vLLM's variable, in seconds
DEFAULT_FETCH_TIMEOUT = 5.0  # vLLM's default
# A fetched or read image's bytes at most. A 4K screenshot as PNG is ~5-10 MB; past this a file
# is no picture a client meant to send, and the server would hold it in memory while it decodes.
# The body is read in chunks and cut off here, never read whole first.
MAX_IMAGE_BYTES = 20 * 2**20
MAX_REDIRECTS = 10  # aiohttp's and requests' default bound
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_CHUNK_BYTES = 1 << 16
_PREVIEW_CHARS = 64  # of a URL in an error message (a data: URL is the whole image)


def _fetch_timeout_from_env() -> float:
    text = os.environ.get(FETCH_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_FETCH_TIMEOUT
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{FETCH_TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how many a request may hold (vLLM's flags)."""

    # --allowed-media-domains: the hosts http(s) images may come from (None: any).
    allowed_domains: tuple[str, ...] | None = None
    # --allowed-local-media-path: the directory file:// images may be read under (None: no file://).
    allowed_local_path: str | None = None
    # --limit-mm-per-prompt's image count: images a request may hold at most (None: the context's room).
    max_images: int | None = None
    fetch_timeout: float = field(default_factory=_fetch_timeout_from_env)  # seconds for one http(s) image

    def __post_init__(self) -> None:
        problems = []
        if self.allowed_domains is not None:
            if isinstance(self.allowed_domains, str) or not all(isinstance(d, str) and d for d in self.allowed_domains):
                problems.append(f"allowed media domains must be a list of host names, got {self.allowed_domains!r}")
            else:  # host names compare lowercased (yarl lowercases a URL's host)
                object.__setattr__(self, "allowed_domains", tuple(d.lower() for d in self.allowed_domains))
        if self.allowed_local_path is not None:
            root = Path(self.allowed_local_path).expanduser().resolve()
            if not root.is_dir():
                problems.append(f"allowed local media path {self.allowed_local_path!r} is not a directory")
            object.__setattr__(self, "allowed_local_path", str(root))
        if self.max_images is not None and self.max_images < 0:
            problems.append(f"the image limit per prompt must be >= 0, got {self.max_images}")
        if not self.fetch_timeout > 0:
            problems.append(f"the image fetch timeout ({FETCH_TIMEOUT_ENV}) must be > 0 seconds, "
                            f"got {self.fetch_timeout}")
        if problems:
            raise ValueError("invalid media settings: " + "; ".join(problems))


@dataclass(frozen=True)
class ImagePart:
    """An image part of a request: its URL, its number among the request's images (from 1, in
    prompt order) and the field an error about it names."""

    url: str
    number: int
    param: str

    def error(self, reason: str, code: str = "invalid_image_url") -> APIError:
        """A 400 naming this image: by number and URL, which read the same in every API (their
        parts are numbered differently)."""
        url = self.url if len(self.url) <= _PREVIEW_CHARS else self.url[:_PREVIEW_CHARS] + "..."
        return APIError(400, f"image {self.number} ({url}): {reason}", param=self.param, code=code)


class MediaConnector:
    """Fetches images' bytes under a `MediaPolicy`. Its HTTP session is the app's, opened when
    the app starts and closed when it stops (`session`, a cleanup context)."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None

    async def session(self, app: web.Application) -> AsyncIterator[None]:
        # One session (its connection pool) for every request's images. trust_env: the proxies
        # HTTP(S)_PROXY name, as vLLM's session. No timeout of aiohttp's: `fetch` bounds the whole
        # fetch, redirects and body included.
        async with aiohttp.ClientSession(trust_env=True, timeout=aiohttp.ClientTimeout(total=None)) as session:
            self._session = session
            yield
            self._session = None

    async def fetch(self, part: ImagePart) -> bytes:
        scheme = part.url.partition(":")[0].lower() if ":" in part.url else ""
        if scheme == "data":
            return _data_url_bytes(part)
        if scheme in ("http", "https"):
            return await self._fetch_http(part)
        if scheme == "file":
            return await asyncio.to_thread(self._read_file, part)
        if not scheme:
            raise part.error("not a URL: send a data:, http: or https: URL (or file: under "
                             "--allowed-local-media-path)")
        raise part.error(f"URLs of scheme {scheme!r} are not read (data:, http:, https: and, under "
                         f"--allowed-local-media-path, file: are)")

    async def _fetch_http(self, part: ImagePart) -> bytes:
        timeout = self.policy.fetch_timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._follow(part, URL(part.url))
        except TimeoutError:
            raise part.error(f"not fetched within {timeout:g}s ({FETCH_TIMEOUT_ENV})") from None
        except (aiohttp.ClientError, ValueError) as error:  # (ValueError: a URL yarl cannot parse)
            raise part.error(f"cannot fetch it: {type(error).__name__}: {error}") from None

    async def _follow(self, part: ImagePart, url: URL) -> bytes:
        """The body at url, redirects followed here (not by aiohttp) so that each hop's host is
        checked against the allowed domains."""
        for _ in range(MAX_REDIRECTS + 1):
            self._check_host(part, url)
            async with self._session.get(url, allow_redirects=False) as response:
                location = response.headers.get("Location")
                if response.status in _REDIRECT_STATUSES and location:
                    url = url.join(URL(location))
                    continue
                if response.status != 200:
                    raise part.error(f"{url} answered HTTP {response.status} {response.reason or ''}".rstrip())
                return await _capped_body(part, response)
        raise part.error(f"more than {MAX_REDIRECTS} redirects")

    def _check_host(self, part: ImagePart, url: URL) -> None:
        if url.scheme not in ("http", "https"):
            raise part.error(f"redirected to {url.scheme}:, not http: or https:")
        allowed = self.policy.allowed_domains
        if allowed is not None and url.host not in allowed:
            raise part.error(f"host {url.host!r} is not an allowed media domain (--allowed-media-domains: "
                             f"{', '.join(allowed)})")

    def _read_file(self, part: ImagePart) -> bytes:
        """A file: URL's bytes, from under the allowed directory only (runs in a thread)."""
        root = self.policy.allowed_local_path
        if root is None:
            raise part.error("file: URLs are read only under --allowed-local-media-path, which this server "
                             "was not started with")
        parsed = urllib.parse.urlsplit(part.url)
        if parsed.netloc not in ("", "localhost"):
            raise part.error(f"a file: URL names this machine's files, not host {parsed.netloc!r}")
        # Resolved first (symlinks and ".." followed), then checked: a link out of the directory
        # is as refused as a path out of it.
        path = Path(urllib.request.url2pathname(parsed.path)).resolve()
        if not path.is_relative_to(root):
            raise part.error(f"the file is not under --allowed-local-media-path {root}")
        try:
            with open(path, "rb") as file:
                data = file.read(MAX_IMAGE_BYTES + 1)
        except OSError as error:
            raise part.error(f"cannot read the file: {error.strerror or error}") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise part.error(f"the file is larger than {MAX_IMAGE_BYTES} bytes")
        return data


def _data_url_bytes(part: ImagePart) -> bytes:
    try:
        return data_url_bytes(part.url)
    except ValueError as error:
        raise part.error(str(error)) from None


async def _capped_body(part: ImagePart, response: aiohttp.ClientResponse) -> bytes:
    """The body, read in chunks and refused once past MAX_IMAGE_BYTES (the connection is closed
    then, the rest never read)."""
    if response.content_length is not None and response.content_length > MAX_IMAGE_BYTES:
        raise part.error(f"{response.content_length} bytes, more than the {MAX_IMAGE_BYTES} an image may have")
    body = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
        body += chunk
        if len(body) > MAX_IMAGE_BYTES:
            raise part.error(f"more than the {MAX_IMAGE_BYTES} bytes an image may have")
    return bytes(body)
