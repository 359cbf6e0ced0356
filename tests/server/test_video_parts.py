"""Video input through the server (chat's video_url parts, /tokenize), against an engine stand-in
that records what it is given: every video part reaches `generate` as the VideoInput the real
`VideoProcessor.decode` makes of its bytes, in prompt order beside the images, with the prompt's
one video token per video expanded to its temporal patches' times and tokens; fetching follows
vLLM's MediaConnector as for images (data:, http(s) from a loopback server with
VLLM_VIDEO_FETCH_TIMEOUT and the video byte cap, allowed domains, file: under
--allowed-local-media-path); --limit-mm-per-prompt counts videos; a request's
mm_processor_kwargs sample its videos; decoding runs a few videos at once, off the event loop;
and every video that cannot be read, or a model that reads none, is a 400 that names why. Videos
are fresh random pixels each run, encoded here with PyAV, so a test cannot pass by luck. The last
tests run the real engine with the tiny vision checkpoint.
"""

import asyncio
import base64
import contextlib
import io
import threading
import time
from pathlib import Path

import aiohttp
import av
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from PIL import Image

from deltaspec.engine import AsyncLLM, EngineConfig, RequestDelta, SamplingParams
from deltaspec.engine.engine_process import EngineProcess
from deltaspec.engine.tokenizer import Tokenizer
from deltaspec.engine.vision.preprocess import ImageProcessor, ImageProcessorConfig
from deltaspec.engine.vision.prompt import expand_video_tokens
from deltaspec.engine.vision.video import VideoProcessor, VideoProcessorConfig
from deltaspec.server import app as server_app, cli, media
from deltaspec.server.config import ServerConfig
from deltaspec.server.media import MediaPolicy
from deltaspec.server.serve import start
from fixtures import VISION_TOKENS, make_tokenizer, make_vision_checkpoint

in_module_loop = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
QWEN3_5_TEMPLATE = (Path(__file__).parent / "qwen3_5_chat_template.jinja").read_text()
NO_THINKING = {"enable_thinking": False}
_rng = np.random.default_rng()


def random_video(num_frames: int = 8, height: int | None = None, width: int | None = None, fps: int = 4,
                 container: str = "mp4") -> bytes:
    """A video of random pixels and (by default) a random even size of 32 to 64 pixels a side:
    mpeg4 in mp4, or lossless ffv1 in Matroska ("mkv"); 8 frames at 4 fps by default (2 s: 4
    frames sampled at the processor's 2 fps, two temporal patches)."""
    height = height or 2 * int(_rng.integers(16, 33))
    width = width or 2 * int(_rng.integers(16, 33))
    frames = _rng.integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    codec, format_name = {"mp4": ("mpeg4", "mp4"), "mkv": ("ffv1", "matroska")}[container]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=format_name) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            output.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        output.mux(stream.encode())  # the encoder's last packets
    return buffer.getvalue()


def random_png(height: int = 64, width: int = 64) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(_rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


class FakeEngine:
    """The serving API the server uses (AsyncLLM's, EngineProcess's) over a real tokenizer and
    image and video processors: `generate` records each request (prompt ids, params, images,
    videos) and answers "ok" at once."""

    def __init__(self, tokenizer: Tokenizer, image_processor: ImageProcessor | None,
                 video_processor: VideoProcessor | None, max_model_len: int = 4096,
                 images_refused: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor, self.video_processor = image_processor, video_processor
        self.images_refused = images_refused
        self.max_model_len = max_model_len
        self.max_num_seqs = 8
        self.generation_defaults = {}
        self.error = None
        self.requests: list[dict] = []

    def generate(self, prompt, params, request_id=None, fork_of=None, images=(), videos=()):
        async def stream():
            self.requests.append(dict(prompt=list(prompt), params=params, fork_of=fork_of, images=tuple(images),
                                      videos=tuple(videos)))
            yield RequestDelta(request_id, [0], "ok", "stop", num_cached_tokens=0)
        return stream()

    async def abort(self, request_id: str) -> bool:
        return False

    def pause(self, request_id: str) -> bool:
        return False

    def resume(self, request_id: str) -> bool:
        return False

    async def fetch_stats(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """The test tokenizer with Qwen3.5's vision tokens and chat template."""
    return Tokenizer.from_dir(make_tokenizer(tmp_path_factory.mktemp("video_tokenizer"), extra_special=VISION_TOKENS,
                                             chat_template=QWEN3_5_TEMPLATE))


def token_id(tokenizer: Tokenizer, text: str) -> int:
    [single] = tokenizer.encode(text)
    return single


@pytest.fixture(scope="module")
def image_processor(tokenizer) -> ImageProcessor:
    return ImageProcessor(ImageProcessorConfig(min_pixels=32 * 32, max_pixels=128 * 128),
                          image_token_id=token_id(tokenizer, "<|image_pad|>"))


@pytest.fixture(scope="module")
def processor(tokenizer) -> VideoProcessor:
    """Qwen3.5's video processor with small bounds (the vision fixture's): 2 fps, 2 to 8 frames,
    a video's pixels over all its frames between 2 x 32 x 32 and 8 x 64 x 64."""
    config = VideoProcessorConfig(min_pixels=2 * 32 * 32, max_pixels=8 * 64 * 64, fps=2, min_frames=2, max_frames=8)
    return VideoProcessor(config, *(token_id(tokenizer, t) for t in ("<|video_pad|>", "<|vision_start|>",
                                                                     "<|vision_end|>")))


@pytest.fixture
def engine(tokenizer, image_processor, processor) -> FakeEngine:
    return FakeEngine(tokenizer, image_processor, processor)


@contextlib.asynccontextmanager
async def serving(engine, **media_policy):
    """A server over `engine` with these media settings; yields its URL."""
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, shutdown_timeout=1,
                                               media=MediaPolicy(**media_policy)))
    try:
        yield f"http://127.0.0.1:{running.port}"
    finally:
        await running.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def videos_host():
    """A loopback video server: /video/NAME (what `served` holds), /slow (answers after 30 s),
    /big (chunked, no length, 256 KiB), /declared-big (a Content-Length of 1 GB), /away (a
    redirect to localhost). Yields (url, served)."""
    served: dict[str, bytes] = {}

    async def video(request):
        return web.Response(body=served[request.match_info["name"]], content_type="video/mp4")

    async def slow(request):
        await asyncio.sleep(30)
        return web.Response(body=b"")

    async def big(request):
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(64):
            await response.write(b"\0" * 4096)
        return response

    async def declared_big(request):
        response = web.StreamResponse()
        response.content_length = 10**9
        await response.prepare(request)
        await response.write(b"\0" * 100)
        await asyncio.sleep(30)  # (cancelled when the client goes)
        return response

    async def away(request):
        raise web.HTTPFound(f"http://localhost:{request.url.port}/video/a")

    app = web.Application()
    app.router.add_get("/video/{name}", video)
    app.router.add_get("/slow", slow)
    app.router.add_get("/big", big)
    app.router.add_get("/declared-big", declared_big)
    app.router.add_get("/away", away)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", served
    await runner.cleanup()


def expanded(tokenizer: Tokenizer, image_processor: ImageProcessor, processor: VideoProcessor, messages: list[dict],
             images: list[bytes], videos: list, **template_kwargs) -> list[int]:
    """The prompt the server should run: the template rendered over the messages (as template
    messages: {"type": "image"}, {"type": "video"}), each image token repeated to its image's
    count (by hand), each video token expanded by the engine's expand_video_tokens (the server
    must give the engine the prompt the engine itself would make)."""
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs))
    pad = image_processor.image_token_id
    assert ids.count(pad) == len(images) and ids.count(processor.video_token_id) == len(videos)
    counts = iter(image_processor.num_tokens(image_processor.resize(image)) for image in images)
    ids = [t for token in ids for t in ([pad] * next(counts) if token == pad else [token])]
    return expand_video_tokens(ids, videos, processor.video_token_id, token_id(tokenizer, "<|vision_start|>"),
                               token_id(tokenizer, "<|vision_end|>"), processor.num_tokens, tokenizer.encode)


async def post(base_url: str, route: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(f"{base_url}{route}", json=body) as response:
        return response.status, await response.json()


async def chat(base_url: str, messages: list[dict], **fields) -> tuple[int, dict]:
    return await post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4,
                                                         "chat_template_kwargs": NO_THINKING, **fields})


def error_of(reply: tuple[int, dict]) -> dict:
    status, body = reply
    assert status == 400, body
    return body["error"]


# Videos reach the engine ---------------------------------------------------------------------------

@in_module_loop
async def test_chat_videos_reach_the_engine_with_their_tokens(engine, tokenizer, image_processor, processor,
                                                              videos_host):
    """A data: URL (mp4) and an http URL (Matroska, the bare-string form vLLM takes) in two
    messages: the engine gets both decoded videos in prompt order and the prompt with each
    video's patches (their times as text, their tokens); usage counts them."""
    host, served = videos_host
    first, second = random_video(), random_video(num_frames=12, container="mkv")
    served["second"] = second
    messages = [{"role": "user", "content": [{"type": "text", "text": "What happens?"}, video_part(data_url(first))]},
                {"role": "assistant", "content": "A clip."},
                {"role": "user", "content": [{"type": "video_url", "video_url": f"{host}/video/second"},
                                             {"type": "text", "text": "And here?"}]}]
    async with serving(engine) as base_url:
        status, body = await chat(base_url, messages)
    assert status == 200, body
    [request] = engine.requests
    videos = (processor.decode(first), processor.decode(second))
    assert request["videos"] == videos and request["images"] == ()
    assert [len(video.patches) for video in videos] == [2, 3]  # 4 and 6 frames sampled at 2 fps
    template_messages = [{"role": "user", "content": [{"type": "text", "text": "What happens?"}, {"type": "video"}]},
                         {"role": "assistant", "content": "A clip."},
                         {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And here?"}]}]
    prompt = expanded(tokenizer, image_processor, processor, template_messages, [], list(videos), **NO_THINKING)
    assert request["prompt"] == prompt and body["usage"]["prompt_tokens"] == len(prompt)
    # The prompt, read back: every patch's time as text, every patch's tokens.
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    for video in videos:
        for seconds in video.timestamps:
            assert f"<{seconds:.1f} seconds><|vision_start|><|video_pad|>" in text
    assert prompt.count(processor.video_token_id) == sum(processor.num_tokens(p) for v in videos for p in v.patches)


@in_module_loop
async def test_images_and_videos_keep_their_order(engine, tokenizer, image_processor, processor):
    """An image, a video, then another image in one message: the images reach the engine as
    images, the video as a video, each in its place in the prompt ("Picture 1", "Video 1",
    "Picture 2" with add_vision_id); n = 2 choices share them."""
    first_image, video, second_image = random_png(64, 64), random_video(), random_png(32, 96)
    messages = [{"role": "user", "content": [
        image_part(data_url(first_image, "image/png")), video_part(data_url(video)),
        {"type": "text", "text": "compare"}, image_part(data_url(second_image, "image/png"))]}]
    kwargs = {**NO_THINKING, "add_vision_id": True}
    async with serving(engine) as base_url:
        status, body = await chat(base_url, messages, chat_template_kwargs=kwargs, n=2)
    assert status == 200 and len(body["choices"]) == 2, body
    first, fork = engine.requests
    decoded = processor.decode(video)
    assert first["images"] == fork["images"] == (image_processor.resize(first_image),
                                                 image_processor.resize(second_image))
    assert first["videos"] == fork["videos"] == (decoded,)
    template_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                      {"type": "text", "text": "compare"}, {"type": "image"}]}]
    prompt = expanded(tokenizer, image_processor, processor, template_messages, [first_image, second_image],
                      [decoded], **kwargs)
    assert first["prompt"] == fork["prompt"] == prompt
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.index("Picture 1: ") < text.index("Video 1: ") < text.index("compare") < text.index("Picture 2: ")
    image_tokens = [i for i, t in enumerate(prompt) if t == image_processor.image_token_id]
    video_tokens = [i for i, t in enumerate(prompt) if t == processor.video_token_id]
    first_count = image_processor.num_tokens(image_processor.resize(first_image))
    assert image_tokens[first_count - 1] < video_tokens[0] and video_tokens[-1] < image_tokens[first_count]


@in_module_loop
async def test_tokenize_counts_video_tokens(engine, tokenizer, image_processor, processor):
    video = random_video()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, video_part(data_url(video))]}]
    async with serving(engine) as base_url:
        status, body = await post(base_url, "/tokenize", {"messages": messages})
        options_status, options_body = await post(base_url, "/tokenize", {"messages": messages,
                                                                          "mm_processor_kwargs": {"fps": 1}})
    assert status == 200 and options_status == 200, (body, options_body)
    template_messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "video"}]}]
    prompt = expanded(tokenizer, image_processor, processor, template_messages, [], [processor.decode(video)])
    assert body["tokens"] == prompt and body["count"] == len(prompt)
    fewer = expanded(tokenizer, image_processor, processor, template_messages, [],
                     [processor.with_options(fps=1).decode(video)])
    assert options_body["tokens"] == fewer and len(fewer) < len(prompt)


@in_module_loop
async def test_mm_processor_kwargs_sample_a_requests_videos(engine, processor):
    """vLLM's request field: fps 1 samples 2 of the 2 s video's 8 frames (one temporal patch)
    where the server's 2 fps samples 4; num_frames takes that many; the next request without it
    gets the server's options; a value the processor refuses is a 400 naming the field."""
    video = random_video()
    messages = [{"role": "user", "content": [video_part(data_url(video))]}]
    async with serving(engine) as base_url:
        assert (await chat(base_url, messages, mm_processor_kwargs={"fps": 1}))[0] == 200
        assert (await chat(base_url, messages, mm_processor_kwargs={"num_frames": 6, "do_sample_frames": True}))[0] \
            == 200
        assert (await chat(base_url, messages))[0] == 200
        errors = [error_of(await chat(base_url, messages, mm_processor_kwargs=kwargs))
                  for kwargs in ({"fps": -1}, {"num_frames": "8"}, {"num_frames": 100}, {"sampling_rate": 16000})]
    one_fps, six_frames, default = (request["videos"][0] for request in engine.requests)
    assert one_fps == processor.with_options(fps=1).decode(video) and len(one_fps.patches) == 1
    assert six_frames == processor.with_options(num_frames=6).decode(video) and len(six_frames.patches) == 3
    assert default == processor.decode(video) and len(default.patches) == 2
    assert len(engine.requests) == 3
    for error, field in zip(errors, ("fps", "num_frames", "num_frames", "sampling_rate")):
        assert error["param"] == "mm_processor_kwargs" and field in error["message"], error


# Where videos may come from -----------------------------------------------------------------------

@pytest.mark.parametrize("path, policy, message", [
    ("/slow", {"video_fetch_timeout": 0.3}, "not fetched within 0.3s (VLLM_VIDEO_FETCH_TIMEOUT)"),
    ("/big", {}, "more than the 65536 bytes a video may have"),
    ("/declared-big", {}, "1000000000 bytes, more than the 65536 a video may have"),
    ("/video/a", {"allowed_domains": ("videos.example.com",)}, "host '127.0.0.1' is not an allowed media domain"),
    ("/away", {"allowed_domains": ("127.0.0.1",)}, "host 'localhost' is not an allowed media domain"),
])
@in_module_loop
async def test_http_fetches_that_fail_are_400s_naming_the_video(engine, videos_host, monkeypatch, path, policy,
                                                                message):
    host, served = videos_host
    served["a"] = random_video()
    monkeypatch.setattr(media, "MAX_VIDEO_BYTES", 65536)
    text = {"type": "text", "text": "Hi"}
    async with serving(engine, **policy) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [text, video_part(f"{host}{path}")]}]))
    assert error["message"].startswith(f"video 1 ({host}{path}): ") and message in error["message"], error
    assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_video_url"
    assert engine.requests == []


@in_module_loop
async def test_videos_have_their_own_cap_and_timeout(engine, processor, videos_host, monkeypatch):
    """A video past the image cap is fetched (the video cap is larger), and the images' timeout
    does not cut a video's fetch short: each modality has its own."""
    host, served = videos_host
    served["long"] = video = random_video(num_frames=16, height=64, width=64)
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 1024)
    assert len(video) > 1024
    async with serving(engine, allowed_domains=("127.0.0.1",), fetch_timeout=1e-6) as base_url:
        status, body = await chat(base_url, [{"role": "user", "content": [video_part(f"{host}/video/long")]}])
    assert status == 200 and engine.requests[0]["videos"] == (processor.decode(video),), body


@in_module_loop
async def test_file_urls_only_under_the_allowed_local_path(engine, processor, tmp_path, monkeypatch):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    inside_video, outside_video = random_video(container="mkv"), random_video()
    (allowed / "in.mkv").write_bytes(inside_video)
    (outside / "out.mp4").write_bytes(outside_video)
    (allowed / "link.mp4").symlink_to(outside / "out.mp4")

    def user(url: str) -> list[dict]:
        return [{"role": "user", "content": [video_part(url)]}]

    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, user(f"file://{allowed}/in.mkv")))
        assert "only under --allowed-local-media-path, which this server was not started with" in error["message"]
    async with serving(engine, allowed_local_path=str(allowed)) as base_url:
        status, body = await chat(base_url, user(f"file://{allowed}/in.mkv"))
        assert status == 200 and engine.requests[0]["videos"] == (processor.decode(inside_video),), body
        for escape in (f"file://{allowed}/../outside/out.mp4", f"file://{allowed}/link.mp4"):
            error = error_of(await chat(base_url, user(escape)))
            assert f"the file is not under --allowed-local-media-path {allowed.resolve()}" in error["message"]
            assert error["message"].startswith("video 1 (") and error["code"] == "invalid_video_url"
        monkeypatch.setattr(media, "MAX_VIDEO_BYTES", 1024)
        error = error_of(await chat(base_url, user(f"file://{allowed}/in.mkv")))
        assert "the file is larger than 1024 bytes" in error["message"]
    assert len(engine.requests) == 1


@pytest.mark.parametrize("url, message, code", [
    ("data:video/mp4;base64,not*base64", "the data is not valid base64", "invalid_video_url"),
    (data_url(random_png(), "image/png"), "a data: URL of media type 'image/png' is not a video", "invalid_video_url"),
    ("data:video/mp4,rawbytes", "only base64 data: URLs are read", "invalid_video_url"),
    ("ftp://example.com/a.mp4", "URLs of scheme 'ftp' are not read", "invalid_video_url"),
    ("/var/videos/a.mp4", "not a URL", "invalid_video_url"),
    (data_url(b"these bytes are no video"), "not a video PyAV can read", "invalid_video"),
    (data_url(random_png(), "video/mp4"), "not a video PyAV can read", "invalid_video"),
])
@in_module_loop
async def test_videos_that_cannot_be_read_are_400s(engine, url, message, code):
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [
            {"type": "text", "text": "Look"}, image_part(data_url(random_png(), "image/png")), video_part(url)]}]))
    assert error["message"].startswith("video 1 (") and message in error["message"], error
    assert error["param"] == "messages[0].content[2]" and error["code"] == code
    assert engine.requests == []


# What a request or model cannot have ---------------------------------------------------------------

@in_module_loop
async def test_limit_mm_per_prompt_counts_videos(engine, processor):
    video, image = data_url(random_video()), data_url(random_png(), "image/png")
    async with serving(engine, max_images=1, max_videos=1) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [video_part(video), video_part(video)]}]))
        assert "the request holds 2 videos; at most 1 are taken per prompt (--limit-mm-per-prompt)" in \
            error["message"] and error["param"] == "messages[0].content[1]" and error["code"] == "invalid_value"
        # One image and one video: each under its own limit.
        status, body = await chat(base_url, [{"role": "user", "content": [image_part(image), video_part(video)]}])
        assert status == 200, body
    async with serving(engine, max_videos=0) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [video_part(video)]}]))
        assert "the request holds 1 videos; at most 0 are taken per prompt" in error["message"]
        status, body = await chat(base_url, [{"role": "user", "content": [image_part(image), image_part(image)]}])
        assert status == 200, body
    assert len(engine.requests) == 2 and len(engine.requests[0]["videos"]) == 1


@in_module_loop
async def test_bad_video_parts_and_requests_are_400s(engine, tokenizer, processor):
    video = data_url(random_video())
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [{"type": "video_url"}]}]))
        assert "messages[0].content[0].video_url is required in a part of type 'video_url'" in error["message"]
        error = error_of(await chat(base_url, [{"role": "system", "content": [video_part(video)]},
                                               {"role": "user", "content": "hi"}]))
        assert "System message cannot contain videos" in error["message"]
        error = error_of(await chat(base_url, [{"role": "user", "content": [video_part(video)]}],
                                    truncate_prompt_tokens=8))
        assert "a prompt with videos is not cut" in error["message"]
        error = error_of(await chat(base_url, [{"role": "user", "content": [
            {"type": "text", "text": "<|vision_start|><|video_pad|><|vision_end|>"}, video_part(video)]}]))
        assert "the prompt holds 2 video tokens" in error["message"]
        error = error_of(await chat(base_url, [{"role": "user", "content": [{"type": "video"}]}]))
        assert "content parts of type 'video' are not supported" in error["message"]
        # Completions take no media; the Responses and Messages APIs have no video content.
        error = error_of(await post(base_url, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                                  "video_url": video}))
        assert error["code"] == "unknown_parameter"
        error = error_of(await post(base_url, "/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_video", "video_url": video}]}]}))
        assert "content parts of type 'input_video' are not supported" in error["message"]
        error = error_of(await post(base_url, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "video", "source": {"type": "url", "url": video}}]}]}))
        assert "content blocks of type 'video' are not supported" in error["message"]
    assert engine.requests == []


@in_module_loop
async def test_video_tokens_count_against_the_context(tokenizer, image_processor, processor):
    """A prompt that fits as rendered but not with its video's patches is refused, counting them."""
    video = random_video(height=64, width=64)  # 2 patches of 4 tokens, with their times
    rendered = len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}]}], add_generation_prompt=True, **NO_THINKING)))
    full = len(expanded(tokenizer, image_processor, processor, [{"role": "user", "content": [{"type": "video"}]}],
                        [], [processor.decode(video)], **NO_THINKING))
    assert full > rendered + 8
    engine = FakeEngine(tokenizer, image_processor, processor, max_model_len=rendered + 8)
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [video_part(data_url(video))]}]))
    assert f"you requested {full + 4} tokens ({full} in the messages, 4 in the completion)" in error["message"]
    assert error["code"] == "context_length_exceeded" and engine.requests == []


@in_module_loop
async def test_a_template_that_reads_no_parts_places_no_video(tokenizer, image_processor, processor, tmp_path):
    chatml = Tokenizer.from_dir(make_tokenizer(tmp_path, extra_special=VISION_TOKENS))
    chatml.set_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine = FakeEngine(chatml, image_processor, processor)
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"}, video_part(data_url(random_video()))]}]))
    assert "the chat template places no video tokens for 1 of the request's 1 videos" in error["message"]
    assert engine.requests == []


@in_module_loop
async def test_a_text_only_model_refuses_videos(tokenizer):
    reason = "this engine runs the language model only (language_model_only / --language-model-only)"
    engine = FakeEngine(tokenizer, None, None, images_refused=reason)
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [
            {"type": "text", "text": "Hi"}, video_part(data_url(random_video()))]}]))
        assert error["message"] == f"video input is not supported: {reason}"
        assert error["param"] == "messages[0].content[1]" and error["code"] == "unsupported_parameter"
        error = error_of(await post(base_url, "/tokenize", {"messages": [{"role": "user", "content": [
            video_part("https://example.com/a.mp4")]}]}))
        assert error["message"] == f"video input is not supported: {reason}"
        status, body = await chat(base_url, [{"role": "user", "content": "text still works"}])
    assert status == 200 and len(engine.requests) == 1 and engine.requests[0]["videos"] == (), body


# Decoding off the loop, a few at once -------------------------------------------------------------

class GatedDecoder:
    """A video processor whose decode waits for its gate before decoding, recording how many
    decodes run at once (its other attributes are the real processor's)."""

    def __init__(self, processor: VideoProcessor) -> None:
        self.processor = processor
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most_running = self.started = 0

    def decode(self, data: bytes):
        with self.lock:
            self.running += 1
            self.started += 1
            self.most_running = max(self.most_running, self.running)
        try:
            self.gate.wait(10)
            return self.processor.decode(data)
        finally:
            with self.lock:
                self.running -= 1

    def __getattr__(self, name):
        return getattr(self.processor, name)


@in_module_loop
async def test_decoding_runs_off_the_loop_a_few_at_once(tokenizer, image_processor, processor):
    """Eight video requests at once: at most two decode at a time, in threads (/health answers
    meanwhile), and all eight answer once decoding may go on."""
    decoder = GatedDecoder(processor)
    engine = FakeEngine(tokenizer, image_processor, decoder)
    video = random_video()
    async with serving(engine) as base_url:
        requests = [asyncio.create_task(chat(base_url, [{"role": "user", "content": [video_part(data_url(video))]}]))
                    for _ in range(8)]
        for _ in range(200):
            if decoder.started >= 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # room for more decodes to start, were they allowed to
        assert decoder.running == 2 and decoder.started == 2
        started = time.monotonic()
        async with aiohttp.ClientSession() as http, http.get(f"{base_url}/health") as response:
            assert response.status == 200 and time.monotonic() - started < 1
        decoder.gate.set()
        replies = await asyncio.gather(*requests)
    assert all(status == 200 for status, _ in replies), replies
    assert decoder.most_running == 2 and decoder.started == 8
    assert all(request["videos"] == (processor.decode(video),) for request in engine.requests)


@in_module_loop
async def test_a_gone_clients_decode_keeps_its_place_until_it_ends(tokenizer, image_processor, processor,
                                                                   monkeypatch):
    """With one place for videos: a request whose client disconnects while its video decodes
    holds the place until that decode ends (a thread cannot be stopped), so the next request's
    video waits for it rather than a second decode starting beside it."""
    monkeypatch.setattr(server_app, "MAX_VIDEOS_AT_ONCE", 1)
    decoder = GatedDecoder(processor)
    engine = FakeEngine(tokenizer, image_processor, decoder)
    messages = [{"role": "user", "content": [video_part(data_url(random_video()))]}]
    async with serving(engine) as base_url:
        gone = asyncio.create_task(chat(base_url, messages))
        for _ in range(200):
            if decoder.started:
                break
            await asyncio.sleep(0.01)
        gone.cancel()  # the client goes away while its video decodes
        await asyncio.gather(gone, return_exceptions=True)
        waiting = asyncio.create_task(chat(base_url, messages))
        await asyncio.sleep(0.3)
        assert decoder.started == 1 and not waiting.done()  # its fetch and decode wait for the place
        decoder.gate.set()
        status, body = await waiting
    assert status == 200 and decoder.most_running == 1 and decoder.started == 2, body


# Settings ------------------------------------------------------------------------------------------

def test_media_policy_reads_the_video_fetch_timeout(monkeypatch):
    monkeypatch.setenv("VLLM_VIDEO_FETCH_TIMEOUT", "45")
    assert MediaPolicy().video_fetch_timeout == 45 and ServerConfig(model_name="m").media.video_fetch_timeout == 45
    monkeypatch.setenv("VLLM_VIDEO_FETCH_TIMEOUT", "later")
    with pytest.raises(ValueError, match="VLLM_VIDEO_FETCH_TIMEOUT must be a number of seconds, got 'later'"):
        MediaPolicy()
    monkeypatch.setenv("VLLM_VIDEO_FETCH_TIMEOUT", "-1")
    with pytest.raises(ValueError, match=r"the video fetch timeout \(VLLM_VIDEO_FETCH_TIMEOUT\) must be > 0"):
        MediaPolicy()
    monkeypatch.delenv("VLLM_VIDEO_FETCH_TIMEOUT")
    assert MediaPolicy().video_fetch_timeout == 30.0
    with pytest.raises(ValueError, match="the video limit per prompt must be >= 0, got -1"):
        MediaPolicy(max_videos=-1)


@pytest.mark.parametrize("limit, images, videos", [('{"image": 4, "video": 1}', 4, 1), ("image=2,video=0", 2, 0),
                                                   ('{"video": {"count": 3, "num_frames": 32}}', None, 3),
                                                   ('{"image": 5, "audio": 1}', 5, None)])
def test_limit_mm_per_prompt_reaches_the_policy(checkpoint, monkeypatch, limit, images, videos):
    served = {}

    async def serve(engine_config, server_config, single_process=False):
        served.update(server=server_config)

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **options: None)
    assert cli.main(["serve", str(checkpoint("qwen3_5")), "--limit-mm-per-prompt", limit]) == 0
    policy = served["server"].media
    assert (policy.max_images, policy.max_videos) == (images, videos)


@pytest.mark.parametrize("limit, message", [('{"video": -1}', "the video limit must be a count >= 0"),
                                            ('{"video": "one"}', "the video limit must be a count >= 0"),
                                            ('{"videos": 1}', "unknown modalities ['videos']")])
def test_bad_video_limits_exit_2(checkpoint, capsys, limit, message):
    try:
        code = cli.main(["serve", str(checkpoint("qwen3_5")), "--port", "0", "--limit-mm-per-prompt", limit])
    except SystemExit as exited:  # argparse's refusals
        code = exited.code
    assert code == 2 and message in capsys.readouterr().err


def test_serve_help_names_videos(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "VLLM_VIDEO_FETCH_TIMEOUT" in text and "'{\"image\": 4, \"video\": 1}'" in text


# The real engine -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    """A tiny random Qwen3.5 vision-language checkpoint (its template places image and video parts)."""
    return make_vision_checkpoint(tmp_path_factory.mktemp("vision"), seed=7)


@in_module_loop
@pytest.mark.parametrize("in_process", [True, False], ids=["async-llm", "engine-process"])
async def test_the_engine_answers_a_video_as_it_answers_the_same_prompt_and_video(vision_checkpoint, in_process):
    """Through the server (over AsyncLLM, or an engine in its own process: the video crosses its
    socket), a chat request with a video and an image gets the tokens the engine gives the
    template's prompt with them (the engine expanding its one token per video itself), and usage
    counts every token the engine ran."""
    video, image = random_video(num_frames=12), random_png(48, 80)
    messages = [{"role": "user", "content": [video_part(data_url(video)), {"type": "text", "text": "and"},
                                             image_part(data_url(image, "image/png"))]}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = AsyncLLM(str(vision_checkpoint), max_model_len=512, num_draft_tokens=0)
    try:
        tokenizer, images, videos = reference.tokenizer, reference.image_processor, reference.video_processor
        prompt = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"}]}]))
        decoded, resized = videos.decode(video), images.resize(image)
        deltas = [delta async for delta in reference.generate(prompt, params, images=[resized], videos=[decoded])]
        expected_text = "".join(delta.text for delta in deltas)
        num_prompt_tokens = len(expanded(tokenizer, images, videos, [{"role": "user", "content": [
            {"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"}]}], [image], [decoded]))
        assert num_prompt_tokens > len(prompt) + 2 * len(decoded.patches)
        engine = reference if in_process else await EngineProcess.start(EngineConfig(
            model=str(vision_checkpoint), max_model_len=512, num_draft_tokens=0))
        try:
            async with serving(engine) as base_url:
                status, body = await chat(base_url, messages, max_tokens=6, temperature=0, ignore_eos=True,
                                          chat_template_kwargs={})
        finally:
            if engine is not reference:
                await engine.shutdown()
    finally:
        await reference.shutdown()
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected_text
    assert body["usage"]["prompt_tokens"] == num_prompt_tokens
