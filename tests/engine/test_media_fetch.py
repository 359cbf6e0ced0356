"""The offline API's fetch of media URLs (engine/vision/fetch.py) against a local HTTP server:
the body of a 200 whole; another status, a redirect out of http(s), a body over the modality's
byte cap (declared or streamed) and a server slower than the modality's timeout are ValueErrors
naming why; LLM.chat reads an http(s) image part, and a file: one under its
allowed_local_media_path, as it reads the same image inline."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import numpy as np
import pytest
from PIL import Image

from deltaspec.engine.vision import fetch
from deltaspec.engine.vision.fetch import fetch_url

PAYLOAD = np.random.default_rng().bytes(200_000)


class Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PAYLOAD)))
            self.end_headers()
            for start in range(0, len(PAYLOAD), 20_000):
                self.wfile.write(PAYLOAD[start:start + 20_000])
                self.wfile.flush()
                time.sleep(0.1)
            return
        status, headers, body = self.routes.get(self.path, (404, {}, b"no"))
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", Handler.routes
    httpd.shutdown()


def test_fetch_url(server, monkeypatch):
    base, routes = server
    routes.update({"/payload": (200, {}, PAYLOAD), "/moved": (302, {"Location": "/payload"}, b""),
                   "/to-ftp": (302, {"Location": "ftp://example.com/x"}, b""), "/gone": (410, {}, b"")})
    assert fetch_url(f"{base}/payload", "image") == PAYLOAD
    assert fetch_url(f"{base}/moved", "video") == PAYLOAD
    with pytest.raises(ValueError, match="HTTP 410"):
        fetch_url(f"{base}/gone", "image")
    with pytest.raises(ValueError, match="not an http: or https: URL"):
        fetch_url(f"{base}/to-ftp", "image")
    with pytest.raises(ValueError, match="not an http: or https: URL"):
        fetch_url("file:///etc/passwd", "image")
    monkeypatch.setattr(fetch, "MAX_IMAGE_BYTES", 100_000)
    with pytest.raises(ValueError, match="200000 bytes, more than the 100000"):
        fetch_url(f"{base}/payload", "image")
    assert fetch_url(f"{base}/payload", "video") == PAYLOAD  # the video cap is its own
    monkeypatch.setenv("VLLM_VIDEO_FETCH_TIMEOUT", "0.3")
    with pytest.raises(ValueError, match=r"not fetched within 0.3s \(VLLM_VIDEO_FETCH_TIMEOUT\)"):
        fetch_url(f"{base}/slow", "video")
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT must be a number"):
        fetch_url(f"{base}/payload", "image")


@pytest.mark.slow
def test_llm_chat_fetches_http_and_reads_file_image_parts(server, vision_checkpoint_path, tmp_path):
    """An image_url part naming an http URL, or a file: URL under allowed_local_media_path
    (vLLM's LLM argument), gives what the same image as a data: URL gives; a file: URL out of
    that directory, or without it, is refused by name."""
    from deltaspec.engine import LLM, SamplingParams
    base, routes = server
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 80, 3), dtype=np.uint8))
    png = io.BytesIO()
    image.save(png, format="PNG")
    routes["/picture.png"] = (200, {"Content-Type": "image/png"}, png.getvalue())
    inline = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "picture.png").write_bytes(png.getvalue())
    (tmp_path / "outside.png").write_bytes(png.getvalue())
    with pytest.raises(ValueError, match="is not a directory"):
        LLM(str(vision_checkpoint_path), device="cpu", allowed_local_media_path=tmp_path / "none")
    llm = LLM(str(vision_checkpoint_path), dtype="float32", device="cpu", num_draft_tokens=0,
              allowed_local_media_path=tmp_path / "media")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def chat(llm, url):
        return llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                        params, use_tqdm=False)[0]
    picture = (tmp_path / "media" / "picture.png").as_uri()
    fetched, read, given = chat(llm, f"{base}/picture.png"), chat(llm, picture), chat(llm, inline)
    for output in (fetched, read):
        assert output.prompt_token_ids == given.prompt_token_ids
        assert output.outputs[0].token_ids == given.outputs[0].token_ids
    with pytest.raises(ValueError, match="not under allowed_local_media_path"):
        chat(llm, f"{picture.rpartition('/')[0]}/../outside.png")
    with pytest.raises(ValueError, match=r"messages\[0\]: .*HTTP 404"):
        chat(llm, f"{base}/missing.png")
    with pytest.raises(ValueError, match="data: or http"):
        chat(llm, "ftp://example.com/x.png")
    plain = LLM(str(vision_checkpoint_path), dtype="float32", device="cpu", num_draft_tokens=0)
    with pytest.raises(ValueError, match=r"file: URLs under LLM\(allowed_local_media_path"):
        chat(plain, picture)


@pytest.fixture(scope="module")
def vision_checkpoint_path(tmp_path_factory):
    from fixtures import make_vision_checkpoint
    return make_vision_checkpoint(tmp_path_factory.mktemp("fetch_vision"), seed=4)
