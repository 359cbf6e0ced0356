"""The bytes of a request's images and videos, fetched as vLLM's MediaConnector fetches them.

An image or video part names its media by URL (every API's image part becomes chat's
`image_url` part first; videos come in chat's `video_url` parts only):

    data:image/png;base64,...   decoded here (base64 only; the media type must be an image's, or
    data:video/mp4;base64,...   a video's for a video part)
    http://, https://           fetched with the server's one HTTP session: within
                                VLLM_IMAGE_FETCH_TIMEOUT seconds for an image (vLLM's variable,
                                default 5), VLLM_VIDEO_FETCH_TIMEOUT for a video (default 30), for
                                the whole fetch, redirects included, at most MAX_IMAGE_BYTES or
                                MAX_VIDEO_BYTES, only from --allowed-media-domains when it is given
                                (each redirect's host too); any answer but 200 is refused
    file://                     read only under --allowed-local-media-path (symlinks resolved first)

Anything else (ftp:, a bare path, a stored file's id) is refused. Every refusal is a 400 naming
the image or video (`MediaPart.error`): what the client sent cannot be read, nothing about the
server. Decoding is the engine's `ImageProcessor.resize` and `VideoProcessor.decode` (the app
runs them off the loop).

Knows nothing about the APIs' shapes or the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
from aiohttp import web
from yarl import URL

from ..engine.vision.fetch import (CHUNK_BYTES, DEFAULT_FETCH_TIMEOUT, DEFAULT_VIDEO_FETCH_TIMEOUT, FETCH_TIMEOUT_ENV,
                                   MAX_IMAGE_BYTES, MAX_REDIRECTS, MAX_VIDEO_BYTES, VIDEO_FETCH_TIMEOUT_ENV,
                                   read_file_url, seconds_from_env)
from ..engine.vision.image import data_url_bytes
from .errors import APIError

_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_PREVIEW_CHARS = 64  # of a URL in an error message (a data: URL is the whole image or video)


@dataclass(frozen=True)
class MediaPolicy:
    """Where images and videos may come from, and how many a request may hold (vLLM's flags)."""

    # --allowed-media-domains: the hosts http(s) images and videos may come from (None: any).
    allowed_domains: tuple[str, ...] | None = None
    # --allowed-local-media-path: the directory file:// media may be read under (None: no file://).
    allowed_local_path: str | None = None
    # --limit-mm-per-prompt's image and video counts: images, videos a request may hold at most
    # (None: the context's room).
    max_images: int | None = None
    max_videos: int | None = None
    # Seconds for one http(s) image, one http(s) video (vLLM's variables, read when made).
    fetch_timeout: float = field(default_factory=lambda: seconds_from_env(FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT))
    video_fetch_timeout: float = field(
        default_factory=lambda: seconds_from_env(VIDEO_FETCH_TIMEOUT_ENV, DEFAULT_VIDEO_FETCH_TIMEOUT))

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
        for modality, limit in (("image", self.max_images), ("video", self.max_videos)):
            if limit is not None and limit < 0:
                problems.append(f"the {modality} limit per prompt must be >= 0, got {limit}")
        for modality, timeout, name in (("image", self.fetch_timeout, FETCH_TIMEOUT_ENV),
                                        ("video", self.video_fetch_timeout, VIDEO_FETCH_TIMEOUT_ENV)):
            if not timeout > 0:
                problems.append(f"the {modality} fetch timeout ({name}) must be > 0 seconds, got {timeout}")
        if problems:
            raise ValueError("invalid media settings: " + "; ".join(problems))


@dataclass(frozen=True)
class MediaPart:
    """An image or video part of a request: its URL, its number among the request's images or
    videos (from 1, in prompt order), the field an error about it names, and which it is."""

    url: str
    number: int
    param: str
    modality: Literal["image", "video"] = "image"

    @property
    def noun(self) -> str:
        return "an image" if self.modality == "image" else "a video"

    @property
    def max_bytes(self) -> int:
        """The bytes a fetched or read file may have (read when asked: tests lower the caps)."""
        return MAX_IMAGE_BYTES if self.modality == "image" else MAX_VIDEO_BYTES

    def error(self, reason: str, code: str | None = None) -> APIError:
        """A 400 naming this image or video: by number and URL, which read the same in every API
        (their parts are numbered differently). code: invalid_image_url / invalid_video_url
        unless given."""
        url = self.url if len(self.url) <= _PREVIEW_CHARS else self.url[:_PREVIEW_CHARS] + "..."
        return APIError(400, f"{self.modality} {self.number} ({url}): {reason}", param=self.param,
                        code=code or f"invalid_{self.modality}_url")


class MediaConnector:
    """Fetches images' and videos' bytes under a `MediaPolicy`. Its HTTP session is the app's,
    opened when the app starts and closed when it stops (`session`, a cleanup context)."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None

    async def session(self, app: web.Application) -> AsyncIterator[None]:
        # One session (its connection pool) for every request's media. trust_env: the proxies
        # HTTP(S)_PROXY name, as vLLM's session. No timeout of aiohttp's: `fetch` bounds the whole
        # fetch, redirects and body included.
        async with aiohttp.ClientSession(trust_env=True, timeout=aiohttp.ClientTimeout(total=None)) as session:
            self._session = session
            yield
            self._session = None

    async def fetch(self, part: MediaPart) -> bytes:
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

    async def _fetch_http(self, part: MediaPart) -> bytes:
        timeout, name = (self.policy.fetch_timeout, FETCH_TIMEOUT_ENV) if part.modality == "image" \
            else (self.policy.video_fetch_timeout, VIDEO_FETCH_TIMEOUT_ENV)
        try:
            async with asyncio.timeout(timeout):
                return await self._follow(part, URL(part.url))
        except TimeoutError:
            raise part.error(f"not fetched within {timeout:g}s ({name})") from None
        except (aiohttp.ClientError, ValueError) as error:  # (ValueError: a URL yarl cannot parse)
            raise part.error(f"cannot fetch it: {type(error).__name__}: {error}") from None

    async def _follow(self, part: MediaPart, url: URL) -> bytes:
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

    def _check_host(self, part: MediaPart, url: URL) -> None:
        if url.scheme not in ("http", "https"):
            raise part.error(f"redirected to {url.scheme}:, not http: or https:")
        allowed = self.policy.allowed_domains
        if allowed is not None and url.host not in allowed:
            raise part.error(f"host {url.host!r} is not an allowed media domain (--allowed-media-domains: "
                             f"{', '.join(allowed)})")

    def _read_file(self, part: MediaPart) -> bytes:
        """A file: URL's bytes, from under the allowed directory only (runs in a thread)."""
        if self.policy.allowed_local_path is None:
            raise part.error("file: URLs are read only under --allowed-local-media-path, which this server "
                             "was not started with")
        try:
            return read_file_url(part.url, self.policy.allowed_local_path, part.max_bytes,
                                 "--allowed-local-media-path")
        except ValueError as error:
            raise part.error(str(error)) from None


def _data_url_bytes(part: MediaPart) -> bytes:
    try:
        return data_url_bytes(part.url, part.modality)
    except ValueError as error:
        raise part.error(str(error)) from None


async def _capped_body(part: MediaPart, response: aiohttp.ClientResponse) -> bytes:
    """The body, read in chunks and refused once past the part's cap (the connection is closed
    then, the rest never read)."""
    max_bytes = part.max_bytes
    if response.content_length is not None and response.content_length > max_bytes:
        raise part.error(f"{response.content_length} bytes, more than the {max_bytes} {part.noun} may have")
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise part.error(f"more than the {max_bytes} bytes {part.noun} may have")
    return bytes(body)
