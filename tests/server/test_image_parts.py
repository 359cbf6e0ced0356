"""Image input through the server's three chat APIs (and /tokenize, count_tokens), against an engine
stand-in that records what it is given: every image part reaches `generate` as the ImageInput the
real `ImageProcessor.resize` makes of its bytes, in prompt order, with the prompt's image tokens
expanded to each image's count; fetching follows vLLM's MediaConnector (data:, http(s) from a
loopback server with its timeout, size cap, redirects and allowed domains, file: under
--allowed-local-media-path), and every image that cannot be read, or a model that reads none, is
a 400 that names why. Images are fresh random pixels each run, so a test cannot pass by luck.
"""

import asyncio
import base64
import contextlib
import io
import os
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from PIL import Image

from deltaspec.engine import AsyncLLM, EngineConfig, RequestDelta, SamplingParams
from deltaspec.engine.engine_process import EngineProcess
from deltaspec.engine.tokenizer import Tokenizer
from deltaspec.engine.vision.preprocess import ImageProcessor, ImageProcessorConfig
from deltaspec.server import cli, media
from deltaspec.server.anthropic_api import chat_request
from deltaspec.server.anthropic_protocol import MessagesRequest
from deltaspec.server.config import ServerConfig
from deltaspec.server.errors import APIError
from deltaspec.server.media import MediaPolicy
from deltaspec.server.serve import start
from fixtures import VISION_TOKENS, make_tokenizer, make_vision_checkpoint

in_module_loop = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
QWEN3_5_TEMPLATE = (Path(__file__).parent / "qwen3_5_chat_template.jinja").read_text()
NO_THINKING = {"enable_thinking": False}
_rng = np.random.default_rng()


def random_png(height: int | None = None, width: int | None = None) -> bytes:
    """A PNG of random pixels and (by default) a random size: 1 to 16 tokens at the processor's bounds."""
    height = height or int(_rng.integers(24, 140))
    width = width or int(_rng.integers(24, 140))
    buffer = io.BytesIO()
    Image.fromarray(_rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, **fields) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **fields}}


class FakeEngine:
    """The serving API the server uses (AsyncLLM's, EngineProcess's) over a real tokenizer and
    image processor: `generate` records each request (prompt ids, params, fork, images) and
    answers "ok" at once."""

    def __init__(self, tokenizer: Tokenizer, image_processor: ImageProcessor | None, max_model_len: int = 4096,
                 images_refused: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.images_refused = images_refused
        self.max_model_len = max_model_len
        self.max_num_seqs = 8
        self.generation_defaults = {}
        self.error = None
        self.requests: list[dict] = []

    def generate(self, prompt, params, request_id=None, fork_of=None, images=(), videos=()):
        async def stream():
            self.requests.append(dict(prompt=list(prompt), params=params, fork_of=fork_of, images=tuple(images)))
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
def tokenizer_dir(tmp_path_factory):
    """The test tokenizer with Qwen3.5's vision tokens and chat template."""
    return make_tokenizer(tmp_path_factory.mktemp("vision_tokenizer"), extra_special=VISION_TOKENS,
                          chat_template=QWEN3_5_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def processor(tokenizer) -> ImageProcessor:
    """Qwen3.5's processor with small pixel bounds: 32 x 32 to 128 x 128 pixels, 1 to 16 tokens."""
    pad = tokenizer.encode("<|image_pad|>")
    assert len(pad) == 1
    return ImageProcessor(ImageProcessorConfig(min_pixels=32 * 32, max_pixels=128 * 128), image_token_id=pad[0])


@pytest.fixture
def engine(tokenizer, processor) -> FakeEngine:
    return FakeEngine(tokenizer, processor)


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
async def images_host():
    """A loopback image server: /img/NAME (what `served` holds), /together/NAME (the same, once
    two such requests are waiting at once: 504 for one alone), /slow (answers after 30 s), /big
    (chunked, no length, past any cap), /declared-big (a Content-Length past the cap), /missing
    (404), /redirect/N (N redirects, then /img/a), /away (a redirect to localhost). Yields (url,
    served)."""
    served: dict[str, bytes] = {}
    waiting: list[asyncio.Event] = []

    async def image(request):
        return web.Response(body=served[request.match_info["name"]], content_type="image/png")

    async def together(request):
        arrived = asyncio.Event()
        waiting.append(arrived)
        if len(waiting) % 2 == 0:
            for event in waiting[-2:]:
                event.set()
        try:
            await asyncio.wait_for(arrived.wait(), 3)
        except TimeoutError:
            return web.Response(status=504)
        return await image(request)

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

    async def redirect(request):
        hops = int(request.match_info["hops"])
        raise web.HTTPFound(f"/redirect/{hops - 1}" if hops > 1 else "/img/a")

    async def away(request):
        raise web.HTTPFound(f"http://localhost:{request.url.port}/img/a")

    app = web.Application()
    app.router.add_get("/img/{name}", image)
    app.router.add_get("/together/{name}", together)
    app.router.add_get("/slow", slow)
    app.router.add_get("/big", big)
    app.router.add_get("/declared-big", declared_big)
    app.router.add_get("/redirect/{hops}", redirect)
    app.router.add_get("/away", away)
    # handler_cancellation: a handler still sleeping when its client goes is cancelled.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", served
    await runner.cleanup()


def expanded(tokenizer: Tokenizer, processor: ImageProcessor, messages: list[dict], images: list[bytes],
             **template_kwargs) -> list[int]:
    """The prompt the server should run: the template rendered over the messages (as template
    messages: image parts as {"type": "image"}), its one image token per image repeated to the
    image's count (by hand here, not through expand_image_tokens)."""
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs))
    pad = processor.image_token_id
    assert ids.count(pad) == len(images)
    counts = iter(processor.num_tokens(processor.resize(image)) for image in images)
    return [t for token in ids for t in ([pad] * next(counts) if token == pad else [token])]


async def post(base_url: str, route: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(f"{base_url}{route}", json=body) as response:
        return response.status, await response.json()


async def chat(base_url: str, messages: list[dict], **fields) -> tuple[int, dict]:
    return await post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4,
                                                         "chat_template_kwargs": NO_THINKING, **fields})


def error_of(reply: tuple[int, dict]) -> dict:
    """A 400's error object (OpenAI's and Anthropic's shapes alike)."""
    status, body = reply
    assert status == 400, body
    return body["error"]


# Each API's image parts reach the engine --------------------------------------------------------

@in_module_loop
async def test_chat_images_reach_the_engine_in_order_with_the_prompt_expanded(engine, tokenizer, processor,
                                                                             images_host):
    """A data: URL and an http URL (the bare-string form vLLM takes, and detail, which changes
    nothing), in two messages: the engine gets both resized images in prompt order and the
    prompt with each image's tokens; usage counts them."""
    host, served = images_host
    first, second = random_png(), random_png()
    served["second"] = second
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             image_part(data_url(first), detail="low")]},
                {"role": "assistant", "content": "A picture."},
                {"role": "user", "content": [{"type": "image_url", "image_url": f"{host}/img/second"},
                                             {"type": "text", "text": "And this?"}]}]
    async with serving(engine) as base_url:
        status, body = await chat(base_url, messages)
    assert status == 200, body
    [request] = engine.requests
    assert request["images"] == (processor.resize(first), processor.resize(second))
    template_messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]},
                         {"role": "assistant", "content": "A picture."},
                         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]}]
    prompt = expanded(tokenizer, processor, template_messages, [first, second], **NO_THINKING)
    assert request["prompt"] == prompt and body["usage"]["prompt_tokens"] == len(prompt)
    assert request["params"].max_tokens == 4


@in_module_loop
async def test_choices_share_the_images(engine, processor):
    image = random_png()
    async with serving(engine) as base_url:
        status, body = await chat(base_url, [{"role": "user", "content": [image_part(data_url(image))]}], n=2)
    assert status == 200 and len(body["choices"]) == 2, body
    first, fork = engine.requests
    assert first["images"] == fork["images"] == (processor.resize(image),)
    assert first["prompt"] == fork["prompt"] and first["fork_of"] is None and fork["fork_of"] is not None


@in_module_loop
async def test_responses_input_images_reach_the_engine(engine, tokenizer, processor, images_host):
    """input_image parts (an http URL with detail, a data: URL in a function_call_output's output)."""
    host, served = images_host
    photo, screenshot = random_png(), random_png()
    served["photo"] = photo
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                          {"type": "input_image", "image_url": f"{host}/img/photo", "detail": "high"}]},
             {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1",
              "output": [{"type": "input_image", "image_url": data_url(screenshot)}]}]
    async with serving(engine) as base_url:
        status, body = await post(base_url, "/v1/responses", {"model": MODEL, "input": items, "max_output_tokens": 4})
    assert status == 200, body
    [request] = engine.requests
    assert request["images"] == (processor.resize(photo), processor.resize(screenshot))
    template_messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "image"}]}]
    prompt = expanded(tokenizer, processor, template_messages, [photo, screenshot])
    assert request["prompt"] == prompt and body["usage"]["input_tokens"] == len(prompt)


@in_module_loop
async def test_anthropic_image_blocks_reach_the_engine_in_prompt_order(engine, tokenizer, processor, images_host):
    """A base64 source in a tool_result (as Claude Code sends screenshots) and a url source in
    the user's text: the tool result renders first (a tool message before the user's), so its
    image is the first; count_tokens counts every image token."""
    host, served = images_host
    screenshot, photo = random_png(), random_png()
    served["anthropic"] = photo
    messages = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare with"},
            {"type": "image", "source": {"type": "url", "url": f"{host}/img/anthropic"},
             "cache_control": {"type": "ephemeral"}},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(screenshot).decode()}}]}]}]
    body = {"model": MODEL, "messages": messages, "thinking": {"type": "disabled"}}
    async with serving(engine) as base_url:
        status, message = await post(base_url, "/v1/messages", {**body, "max_tokens": 4})
        assert status == 200, message
        status, counted = await post(base_url, "/v1/messages/count_tokens", body)
    [request] = engine.requests
    assert request["images"] == (processor.resize(screenshot), processor.resize(photo))
    template_messages = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "screenshot", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": [{"type": "image"}]},
        {"role": "user", "content": [{"type": "text", "text": "Compare with"}, {"type": "image"}]}]
    prompt = expanded(tokenizer, processor, template_messages, [screenshot, photo], **NO_THINKING)
    assert request["prompt"] == prompt
    assert message["usage"]["input_tokens"] == counted["input_tokens"] == len(prompt)


@in_module_loop
async def test_tokenize_counts_image_tokens(engine, tokenizer, processor):
    image = random_png()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part(data_url(image))]}]
    async with serving(engine) as base_url:
        status, body = await post(base_url, "/tokenize", {"messages": messages})
    assert status == 200, body
    template_messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]}]
    prompt = expanded(tokenizer, processor, template_messages, [image])
    assert body["tokens"] == prompt and body["count"] == len(prompt)


# Where images may come from -----------------------------------------------------------------------

@in_module_loop
async def test_http_fetches_follow_redirects_within_bounds(engine, processor, images_host):
    host, served = images_host
    served["a"] = random_png()
    async with serving(engine) as base_url:
        status, body = await chat(base_url, [{"role": "user", "content": [image_part(f"{host}/redirect/3")]}])
        assert status == 200, body
        assert engine.requests[0]["images"] == (processor.resize(served["a"]),)
        error = error_of(await chat(base_url, [{"role": "user", "content": [image_part(f"{host}/redirect/11")]}]))
    assert "more than 10 redirects" in error["message"] and len(engine.requests) == 1


@pytest.mark.parametrize("path, policy, message", [
    ("/missing", {}, "answered HTTP 404 Not Found"),
    ("/slow", {"fetch_timeout": 0.3}, "not fetched within 0.3s (VLLM_IMAGE_FETCH_TIMEOUT)"),
    ("/big", {}, "more than the 65536 bytes an image may have"),
    ("/declared-big", {}, "1000000000 bytes, more than the 65536"),
    ("/img/a", {"allowed_domains": ("images.example.com",)}, "host '127.0.0.1' is not an allowed media domain"),
    ("/away", {"allowed_domains": ("127.0.0.1",)}, "host 'localhost' is not an allowed media domain"),
])
@in_module_loop
async def test_http_fetches_that_fail_are_400s_naming_the_image(engine, images_host, monkeypatch, path, policy,
                                                                message):
    host, served = images_host
    served["a"] = random_png()
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 65536)
    text = {"type": "text", "text": "Hi"}
    async with serving(engine, **policy) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [text, image_part(f"{host}{path}")]}]))
    assert error["message"].startswith(f"image 1 ({host}{path}): ") and message in error["message"], error
    assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_image_url"
    assert engine.requests == []


@in_module_loop
async def test_a_requests_images_are_fetched_at_once(engine, processor, images_host):
    """Each of the two images is served only while the other is being fetched too."""
    host, served = images_host
    served["left"], served["right"] = random_png(), random_png()
    parts = [image_part(f"{host}/together/left"), image_part(f"{host}/together/right")]
    async with serving(engine) as base_url:
        status, body = await chat(base_url, [{"role": "user", "content": parts}])
    assert status == 200, body
    assert engine.requests[0]["images"] == (processor.resize(served["left"]), processor.resize(served["right"]))


@in_module_loop
async def test_the_first_image_that_fails_ends_the_others_fetches(engine, images_host):
    host, _ = images_host
    parts = [image_part(f"{host}/slow"), image_part(f"{host}/missing")]
    async with serving(engine) as base_url:
        started = asyncio.get_running_loop().time()
        error = error_of(await chat(base_url, [{"role": "user", "content": parts}]))
        assert asyncio.get_running_loop().time() - started < 3  # not the 5 s /slow's fetch may take
    assert error["message"].startswith(f"image 2 ({host}/missing)") and error["param"] == "messages[0].content[1]"


@in_module_loop
async def test_allowed_domains_take_their_hosts(engine, processor, images_host):
    host, served = images_host
    served["a"] = random_png()
    async with serving(engine, allowed_domains=("127.0.0.1",)) as base_url:
        status, body = await chat(base_url, [{"role": "user", "content": [image_part(f"{host}/img/a")]}])
    assert status == 200 and engine.requests[0]["images"] == (processor.resize(served["a"]),), body


@in_module_loop
async def test_file_urls_only_under_the_allowed_local_path(engine, processor, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    inside_image, outside_image = random_png(), random_png()
    (allowed / "in.png").write_bytes(inside_image)
    (outside / "out.png").write_bytes(outside_image)
    (allowed / "link.png").symlink_to(outside / "out.png")

    def user(url: str) -> list[dict]:
        return [{"role": "user", "content": [image_part(url)]}]

    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, user(f"file://{allowed}/in.png")))
        assert "only under --allowed-local-media-path, which this server was not started with" in error["message"]
    async with serving(engine, allowed_local_path=str(allowed)) as base_url:
        status, body = await chat(base_url, user(f"file://{allowed}/in.png"))
        assert status == 200 and engine.requests[0]["images"] == (processor.resize(inside_image),), body
        for escape in (f"file://{allowed}/../outside/out.png", f"file://{allowed}/link.png", f"file://{outside}/out.png"):
            error = error_of(await chat(base_url, user(escape)))
            assert f"the file is not under --allowed-local-media-path {allowed.resolve()}" in error["message"], \
                escape
        error = error_of(await chat(base_url, user(f"file://{allowed}/none.png")))
        assert "cannot read the file: No such file or directory" in error["message"]
        error = error_of(await chat(base_url, user(f"file://otherhost{allowed}/in.png")))
        assert "not host 'otherhost'" in error["message"]
    assert len(engine.requests) == 1


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,not*base64", "the data is not valid base64"),
    ("data:text/plain;base64,aGk=", "a data: URL of media type 'text/plain' is not an image"),
    ("data:;base64,aGk=", "media type 'text/plain' is not an image"),
    ("data:image/png,rawbytes", "only base64 data: URLs are read"),
    ("data:image/png;base64", "needs a comma"),
    ("ftp://example.com/a.png", "URLs of scheme 'ftp' are not read"),
    ("/var/images/a.png", "not a URL"),
    (data_url(b"these bytes are no image"), "not an image Pillow can read"),
])
@in_module_loop
async def test_urls_that_cannot_be_read_are_400s(engine, url, message):
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [image_part(url)]}]))
    assert error["message"].startswith("image 1 (") and message in error["message"], error
    assert error["param"] == "messages[0].content[0]"
    assert error["code"] == ("invalid_image" if "Pillow" in message else "invalid_image_url")


# What a request or model cannot have ---------------------------------------------------------------

@in_module_loop
async def test_bad_image_parts_and_requests_are_400s(engine, processor):
    image = data_url(random_png(64, 64))  # 4 tokens
    async with serving(engine, max_images=1) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [image_part(image), image_part(image)]}]))
        assert "the request holds 2 images; at most 1 are taken per prompt (--limit-mm-per-prompt)" in \
            error["message"] and error["param"] == "messages[0].content[1]"
        error = error_of(await chat(base_url, [{"role": "system", "content": [image_part(image)]},
                                               {"role": "user", "content": "hi"}]))
        assert "System message cannot contain images" in error["message"]
        error = error_of(await chat(base_url, [{"role": "user", "content": [{"type": "image_url"}]}]))
        assert "messages[0].content[0].image_url is required" in error["message"]
        error = error_of(await chat(base_url, [{"role": "user", "content": [{"type": "input_audio"}]}]))
        assert "content parts of type 'input_audio' are not supported (text, image_url and video_url are)" in \
            error["message"]
        error = error_of(await chat(base_url, [{"role": "user", "content": [image_part(image)]}],
                                    truncate_prompt_tokens=8))
        assert "a prompt with images is not cut" in error["message"]
        error = error_of(await chat(base_url, [{"role": "user", "content": [
            {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}, image_part(image)]}]))
        assert "the prompt holds 2 image tokens" in error["message"]
        error = error_of(await post(base_url, "/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]}))
        assert "input[0].content[0].file_id is not supported: no files are stored here" in error["message"]
        error = error_of(await post(base_url, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "file_1"}}]}]}))
        assert "messages[0].content[0].source: file sources are not supported" in error["message"]
        error = error_of(await post(base_url, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]}))
        assert "content blocks of type 'document' are not supported: documents are not read" in error["message"]
    assert engine.requests == []


@in_module_loop
async def test_image_tokens_count_against_the_context(tokenizer, processor):
    """A prompt that fits as rendered but not with its image's 16 tokens is refused, counting them."""
    messages = [{"role": "user", "content": [image_part(data_url(random_png(128, 128)))]}]
    rendered = len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=True, **NO_THINKING)))
    engine = FakeEngine(tokenizer, processor, max_model_len=rendered + 8)
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, messages))
    assert f"you requested {rendered + 15 + 4} tokens ({rendered + 15} in the messages, 4 in the completion)" in \
        error["message"] and error["code"] == "context_length_exceeded"


@in_module_loop
async def test_a_template_that_reads_no_parts_places_no_image(tokenizer_dir, processor):
    """The tiny checkpoint's ChatML template joins a message's text: no image token, a 400."""
    chatml = Tokenizer.from_dir(tokenizer_dir)
    chatml.set_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine = FakeEngine(chatml, processor)
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"}, image_part(data_url(random_png()))]}]))
    assert "the chat template places no image tokens for 1 of the request's 1 images" in error["message"]
    assert engine.requests == []


@in_module_loop
async def test_a_text_only_model_refuses_images_in_every_api(tokenizer):
    reason = "this model reads no images (its config.json has no vision_config)"
    engine = FakeEngine(tokenizer, None, images_refused=reason)
    image = data_url(random_png())
    async with serving(engine) as base_url:
        error = error_of(await chat(base_url, [{"role": "user", "content": [image_part(image)]}]))
        assert error["message"] == f"image input is not supported: {reason}"
        assert error["param"] == "messages[0].content[0]" and error["code"] == "unsupported_parameter"
        error = error_of(await post(base_url, "/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": image}]}]}))
        assert error["message"] == f"image input is not supported: {reason}" and error["param"] == "input"
        blocks = [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]
        for route, fields in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
            error = error_of(await post(base_url, route, {"model": MODEL, **fields,
                                                          "messages": [{"role": "user", "content": blocks}]}))
            assert error == {"type": "invalid_request_error",
                             "message": f"messages: image input is not supported: {reason}"}
        status, body = await chat(base_url, [{"role": "user", "content": "text still works"}])
    assert status == 200 and len(engine.requests) == 1 and engine.requests[0]["images"] == (), body


# The real engine -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    """A tiny random Qwen3.5 vision-language checkpoint (its template places image parts)."""
    return make_vision_checkpoint(tmp_path_factory.mktemp("vision"), seed=5)


@in_module_loop
@pytest.mark.parametrize("in_process", [True, False], ids=["async-llm", "engine-process"])
async def test_the_engine_answers_as_it_answers_the_same_prompt_and_images(vision_checkpoint, in_process):
    """Through the server (over AsyncLLM, or an engine in its own process: the images cross its
    socket), a chat request with two images gets the tokens the engine gives the template's
    prompt with those images (the engine expanding its one token per image itself)."""
    first, second = random_png(), random_png(40, 100)
    messages = [{"role": "user", "content": [image_part(data_url(first)), {"type": "text", "text": "and"},
                                             image_part(data_url(second))]}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = AsyncLLM(str(vision_checkpoint), max_model_len=512, num_draft_tokens=0)
    try:
        processor = reference.image_processor
        prompt = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]))
        deltas = [delta async for delta in reference.generate(prompt, params, images=[
            processor.resize(first), processor.resize(second)])]
        expected_text = "".join(delta.text for delta in deltas)
        num_prompt_tokens = len(prompt) - 2 + sum(processor.num_tokens(processor.resize(i)) for i in (first, second))
        engine = reference if in_process else await EngineProcess.start(EngineConfig(
            model=str(vision_checkpoint), max_model_len=512, num_draft_tokens=0))
        try:
            async with serving(engine) as base_url:
                status, body = await chat(base_url, messages, max_tokens=6, temperature=0, ignore_eos=True)
        finally:
            if engine is not reference:
                await engine.shutdown()
    finally:
        await reference.shutdown()
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected_text
    assert body["usage"]["prompt_tokens"] == num_prompt_tokens


# Settings ------------------------------------------------------------------------------------------

def test_media_policy_checks_its_settings(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="allowed local media path '.*none' is not a directory"):
        MediaPolicy(allowed_local_path=str(tmp_path / "none"))
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "7.5")
    assert MediaPolicy().fetch_timeout == 7.5 and ServerConfig(model_name="m").media.fetch_timeout == 7.5
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT must be a number of seconds, got 'soon'"):
        MediaPolicy()
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "0")
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        MediaPolicy()
    monkeypatch.delenv("VLLM_IMAGE_FETCH_TIMEOUT")
    assert MediaPolicy().fetch_timeout == 5.0
    assert MediaPolicy(allowed_domains=("Images.Example.com",)).allowed_domains == ("images.example.com",)


@pytest.mark.parametrize("limit, images", [('{"image": 3, "video": 0}', 3), ("image=2,video=1", 2),
                                           ('{"image": {"count": 5, "width": 512, "height": 512}}', 5),
                                           ('{"video": 1}', None)])
def test_vllm_media_flags_reach_the_configs(checkpoint, tmp_path, monkeypatch, limit, images):
    served = {}

    async def serve(engine_config, server_config, single_process=False):
        served.update(engine=engine_config, server=server_config)

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **options: None)
    assert cli.main(["serve", str(checkpoint("qwen3_5")), "--allowed-media-domains", "upload.wikimedia.org",
                     "example.com", "--allowed-local-media-path", str(tmp_path), "--limit-mm-per-prompt", limit,
                     "--language-model-only"]) == 0
    policy = served["server"].media
    assert policy.allowed_domains == ("upload.wikimedia.org", "example.com")
    assert policy.allowed_local_path == str(tmp_path.resolve()) and policy.max_images == images
    assert served["engine"].language_model_only is True
    assert cli.main(["serve", str(checkpoint("qwen3_5"))]) == 0
    assert served["server"].media == MediaPolicy() and served["engine"].language_model_only is False


@pytest.mark.parametrize("flags, message", [
    (("--limit-mm-per-prompt", '{"image": -1}'), "the image limit must be a count >= 0"),
    (("--limit-mm-per-prompt", '{"audio": 1, "pictures": 2}'), "unknown modalities ['pictures']"),
    (("--limit-mm-per-prompt", "four"), "expected a JSON object like"),
    (("--allowed-local-media-path", os.devnull), "is not a directory"),
])
def test_media_flags_that_cannot_be_honoured_exit_2(checkpoint, capsys, flags, message):
    try:
        code = cli.main(["serve", str(checkpoint("qwen3_5")), "--port", "0", *flags])
    except SystemExit as exited:  # argparse's refusals
        code = exited.code
    assert code == 2 and message in capsys.readouterr().err


def test_anthropic_image_source_types_are_checked():
    """An unknown source type is a 400 naming the field."""
    request = msgspec.convert({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "s3", "bucket": "b"}}]}]}, MessagesRequest)
    with pytest.raises(APIError) as raised:
        chat_request(request)
    assert raised.value.status == 400 and raised.value.param == "messages[0].content[0].source.type"


@in_module_loop
async def test_mm_processor_kwargs_bound_a_requests_images(engine, processor):
    """vLLM's request field mm_processor_kwargs: max_pixels resizes this request's image smaller
    (fewer tokens); the next request without it gets the server's bounds; a key the processor
    does not take is a 400 naming the field."""
    image = random_png(128, 128)
    messages = [{"role": "user", "content": [image_part(data_url(image))]}]
    async with serving(engine) as base_url:
        assert (await chat(base_url, messages, mm_processor_kwargs={"max_pixels": 64 * 64}))[0] == 200
        assert (await chat(base_url, messages))[0] == 200
        error = error_of(await chat(base_url, messages, mm_processor_kwargs={"sampling_rate": 1}))
    small, default = (request["images"][0] for request in engine.requests)
    assert small == processor.with_pixels(max_pixels=64 * 64).resize(image)
    assert default == processor.resize(image) and small.height * small.width < default.height * default.width
    assert error["param"] == "mm_processor_kwargs" and "sampling_rate" in error["message"]


def test_mm_processor_kwargs_flag_sets_the_engines_pixel_bounds(checkpoint, monkeypatch, capsys):
    served = {}

    async def serve(engine_config, server_config, single_process=False):
        served.update(engine=engine_config)

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **options: None)
    assert cli.main(["serve", str(checkpoint("qwen3_5")), "--mm-processor-kwargs",
                     '{"size": {"shortest_edge": 3136, "longest_edge": 1003520}}']) == 0
    assert (served["engine"].image_min_pixels, served["engine"].image_max_pixels) == (3136, 1003520)
    try:
        code = cli.main(["serve", str(checkpoint("qwen3_5")), "--mm-processor-kwargs", '{"max_pixels": 1000}',
                         "--image-max-pixels", "2000"])
    except SystemExit as exited:
        code = exited.code
    assert code == 2 and "--mm-processor-kwargs means --image-max-pixels 1000" in capsys.readouterr().err
