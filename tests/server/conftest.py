"""Fixtures the server tests share: a module's `engine` (each test file defines its own) served
in-process, its URL, an `openai` client and a raw HTTP session; and the shared tiny checkpoint
with Qwen3.5's chat template (qwen3_5_chat_template.jinja, the published one) for the files that
test tools, reasoning and the other API shapes."""

import json
import shutil
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio

from deltaspec.server.config import ServerConfig
from deltaspec.server.serve import start

MODEL = "tiny"  # the served model name every server test uses
QWEN3_5_TEMPLATE = (Path(__file__).parent / "qwen3_5_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def qwen3_5_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The shared tiny checkpoint, copied, with Qwen3.5's chat template."""
    directory = tmp_path_factory.mktemp("qwen3_5_template") / "model"
    shutil.copytree(checkpoint("qwen3_5"), directory)
    config_file = directory / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": QWEN3_5_TEMPLATE}))
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(engine):
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, shutdown_timeout=1))
    yield running
    await running.stop()


@pytest.fixture
def base_url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


@pytest_asyncio.fixture(loop_scope="module")
async def client(base_url):
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def fail_a_decode_step(engine, monkeypatch):
    """A function that makes the engine's next step decoding a request's third token or later
    raise (an injected device error), once: its steps `run` and `launch` both checked. Returns
    the list the failed step's plan goes into (clear it to fail one more)."""

    def install() -> list:
        runner, faults = engine.core.runner, []

        def fail_once_decoding(method):
            def call(plan):
                if not faults and any(len(row.request.output_token_ids) >= 2 for row in plan.rows):
                    faults.append(plan)
                    raise RuntimeError("CUDA out of memory (injected)")
                return method(plan)
            return call

        for name in ("run", "launch"):
            monkeypatch.setattr(runner, name, fail_once_decoding(getattr(runner, name)))
        return faults

    return install
