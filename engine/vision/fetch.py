"""The limits on fetching media, and the offline API's fetch of an image or video URL.

`LLM.chat` takes image_url and video_url parts as vLLM's offline chat does: data: URLs are read
in place (`image.data_url_bytes`), http(s) URLs are fetched here, synchronously, with the
limits the server applies to the same URLs (server/media.py fetches them asynchronously, over
the app's session, with its --allowed-media-domains on top): vLLM's VLLM_IMAGE_FETCH_TIMEOUT and
VLLM_VIDEO_FETCH_TIMEOUT for the whole fetch, a byte cap per modality cut off while the body
streams, redirects to http(s) only, at most MAX_REDIRECTS of them. file: URLs are read only
under a directory the user allowed (vLLM's allowed_local_media_path; `read_file_url`, which the
server's --allowed-local-media-path uses too). Anything else is a ValueError naming why. Knows
nothing of what the bytes hold.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"  # vLLM's variable, in seconds
DEFAULT_FETCH_TIMEOUT = 5.0  # vLLM's default
VIDEO_FETCH_TIMEOUT_ENV = "VLLM_VIDEO_FETCH_TIMEOUT"  # vLLM's variable, in seconds
DEFAULT_VIDEO_FETCH_TIMEOUT = 30.0  # vLLM's default
# A fetched or read image's bytes at most. A 4K screenshot as PNG is ~5-10 MB; past this a file
# is no picture a client meant to send, and the server would hold it in memory while it decodes.
# The body is read in chunks and cut off here, never read whole first.
MAX_IMAGE_BYTES = 20 * 2**20
# A fetched or read video's bytes at most: a video is compressed across frames, so its bytes say
# little about its tokens (the processor samples at most max_frames frames, whatever its
# length), and clips run larger than pictures: 1080p H.264 is ~0.5-1 MB a second, so this takes
# a few minutes of it. The server holds these bytes while the video decodes, and the app fetches
# and decodes only a few videos at once (`app.MAX_VIDEOS_AT_ONCE`), so a burst of requests holds
# at most that many times this. Cut off while streaming, as an image's.
MAX_VIDEO_BYTES = 256 * 2**20
MAX_REDIRECTS = 10  # aiohttp's and requests' default bound
CHUNK_BYTES = 1 << 16


def seconds_from_env(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None


def fetch_limits(modality: str) -> tuple[float, str, int]:
    """(seconds for the whole fetch, the variable that sets them, bytes at most) of an image or
    a video."""
    if modality == "image":
        return seconds_from_env(FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT), FETCH_TIMEOUT_ENV, MAX_IMAGE_BYTES
    return (seconds_from_env(VIDEO_FETCH_TIMEOUT_ENV, DEFAULT_VIDEO_FETCH_TIMEOUT), VIDEO_FETCH_TIMEOUT_ENV,
            MAX_VIDEO_BYTES)


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed to http(s) targets only (urllib's own follows ftp: too)."""

    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise ValueError(f"redirected to {newurl[:64]!r}, not an http: or https: URL")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpOnlyRedirects)


def fetch_url(url: str, modality: str) -> bytes:
    """The body at an http(s) URL, within fetch_limits(modality). ValueError naming why not:
    another scheme, a status other than 200, too slow, too large, unreachable."""
    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
        raise ValueError(f"{url[:64]!r} is not an http: or https: URL")
    timeout, variable, max_bytes = fetch_limits(modality)
    deadline = time.monotonic() + timeout
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "deltaspec"})
        with _OPENER.open(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise ValueError(f"{url[:64]!r} is {length} bytes, more than the {max_bytes} a {modality} may have")
            body = bytearray()
            while chunk := response.read(CHUNK_BYTES):
                body += chunk
                if len(body) > max_bytes:
                    raise ValueError(f"{url[:64]!r} holds more than the {max_bytes} bytes a {modality} may have")
                if time.monotonic() > deadline:
                    raise TimeoutError
            return bytes(body)
    except urllib.error.HTTPError as error:
        raise ValueError(f"{url[:64]!r} answered HTTP {error.code} {error.reason or ''}".rstrip()) from None
    except (TimeoutError, socket.timeout):
        raise ValueError(f"{url[:64]!r} was not fetched within {timeout:g}s ({variable})") from None
    except urllib.error.URLError as error:
        raise ValueError(f"cannot fetch {url[:64]!r}: {error.reason}") from None


def read_file_url(url: str, root: str, max_bytes: int, setting: str) -> bytes:
    """A file: URL's bytes, from under the directory root only (setting: what allowed it, for
    the refusals). ValueError naming why not: another host, a path out of root (symlinks and ".."
    resolved first: a link out of the directory is as refused as a path out of it), an unreadable
    file, more than max_bytes."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"a file: URL names this machine's files, not host {parsed.netloc!r}")
    path = Path(urllib.request.url2pathname(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"the file is not under {setting} {root}")
    try:
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as error:
        raise ValueError(f"cannot read the file: {error.strerror or error}") from None
    if len(data) > max_bytes:
        raise ValueError(f"the file is larger than {max_bytes} bytes")
    return data
