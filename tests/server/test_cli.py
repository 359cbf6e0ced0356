"""The `deltaspec` command line: `serve` as a real process (signals, graceful shutdown, exit code,
a busy port, its engine's process dying, a vLLM command line) and `generate` in-process (streamed
text equals the engine's greedy completion). test_vllm_flags.py checks vLLM's flags one by one."""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from deltaspec.engine import LLM, SamplingParams
from deltaspec.server import cli

MODEL = "tiny"


@contextlib.asynccontextmanager
async def serve_process(checkpoint_path, *options: str):
    """`deltaspec serve` on a free port; yields (process, port, all of stderr read to the end)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deltaspec.server.cli", "serve", str(checkpoint_path), "--port", "0",
        "--max-model-len", "256", "--served-model-name", MODEL, *options, stderr=asyncio.subprocess.PIPE)
    try:
        port, head = None, b""
        while port is None:
            line = await asyncio.wait_for(process.stderr.readline(), 60)
            assert line, "the server exited before listening"
            head += line
            if match := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)/v1", line.decode()):
                port = int(match.group(1))

        async def rest() -> bytes:
            return head + await process.stderr.read()

        stderr = asyncio.create_task(rest())  # keep the pipe from filling
        yield process, port, stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("options", [(), ("--single-process",)], ids=["engine-process", "single-process"])
async def test_serve_drains_in_flight_requests_on_sigterm_and_exits_0(checkpoint, options):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with serve_process(checkpoint("qwen3_5"), *options) as (process, port, stderr), \
            aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            first = await response.content.readline()
            process.send_signal(signal.SIGTERM)  # mid-stream: the request finishes, then the server exits
            events = sse_events((first + await response.content.read()).decode())
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert "stopped" in (await stderr).decode()


async def test_second_sigint_aborts_in_flight_requests(checkpoint):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with serve_process(checkpoint("qwen3_5"), "--shutdown-timeout", "60") as (process, port, stderr), \
            aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            first = await response.content.readline()
            process.send_signal(signal.SIGINT)
            await asyncio.sleep(0.2)  # two signals close together could merge into one
            process.send_signal(signal.SIGINT)
            events = sse_events((first + await response.content.read()).decode())
        assert json.loads(events[-1])["error"]["code"] == "aborted"
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert "aborting in-flight requests" in (await stderr).decode()


async def test_a_busy_port_fails_at_once_in_one_line(checkpoint):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deltaspec.server.cli", "serve", str(checkpoint("qwen3_5")), "--port", str(port),
            stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    lines = stderr.decode().strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], lines


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


async def test_when_the_engine_process_dies_health_says_so(checkpoint):
    """Every request would fail: /health and the routes answer 503 (a probe restarts the server)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    async with serve_process(checkpoint("qwen3_5")) as (process, port, stderr), aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{port}"
        async with http.get(f"{url}/health") as response:
            assert response.status == 200
        # The engine's process is the server's spawned child (not multiprocessing's resource tracker).
        engines = [child for child in _children(process.pid)
                   if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]
        assert len(engines) == 1
        os.kill(engines[0], signal.SIGKILL)
        for _ in range(100):
            async with http.get(f"{url}/health") as response:
                status, health = response.status, await response.json()
            if status == 503:
                break
            await asyncio.sleep(0.05)
        assert status == 503 and health["error"]["code"] == "engine_dead"
        async with http.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 503
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert "the engine process exited unexpectedly" in (await stderr).decode()


async def test_serve_takes_a_vllm_command_line(checkpoint, tmp_path):
    """vLLM's flags: --speculative-config sets the drafts per step, --max-num-seqs the running
    requests, --chat-template (a file) replaces the checkpoint's template, --served-model-name the
    names requests may use (responses name the first), --block-size the KV block's tokens;
    --gpu-memory-utilization, --enforce-eager, --disable-custom-all-reduce and the flags whose
    behaviour is this server's anyway are taken; --language-model-only reaches the engine (an
    image part is refused: the checkpoint reads none either way)."""
    path = checkpoint("qwen3_5")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    options = ("--speculative-config", '{"method": "qwen3_next_mtp", "num_speculative_tokens": 1}',
               "--max-num-seqs", "3", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--enable-prefix-caching",
               "--enable-auto-tool-choice", "--trust-remote-code", "--chat-template", str(template),
               "--served-model-name", MODEL, "org/alias", "--block-size", "32", "--disable-custom-all-reduce",
               "--kv-cache-dtype", "auto", "--distributed-executor-backend", "mp", "--enable-chunked-prefill",
               "--language-model-only", "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level", "debug")
    async with serve_process(path, *options) as (process, port, stderr), aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{port}"
        async with http.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}) as response:
            tokens = (await response.json())["tokens"]
        assert tokens == LLM(path, num_draft_tokens=0).tokenizer.encode("[user] hi\n[assistant] ")
        body = {"model": "org/alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200 and (await response.json())["model"] == MODEL
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 400
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        log = (await stderr).decode()
    assert "1 drafts per step" in log and "pools: 3 sequence" in log and "KV blocks x 32 tokens" in log, log
    assert f"serving {MODEL} on" in log, log


@pytest.mark.parametrize("flags, message", [
    (("--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'), "method 'eagle3'"),
    (("--speculative-config", '{"num_speculative_tokens": 2, "model": "x"}'), "unsupported keys ['model']"),
    (("--speculative-config", '{"num_speculative_tokens": -1}'), "num_speculative_tokens must be"),
    (("--speculative-config", "{"), "not JSON"),
])
def test_vllm_flags_that_cannot_be_honoured_fail_at_once(checkpoint, capsys, flags, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", str(checkpoint("qwen3_5")), "--port", "0", *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_conflicting_draft_counts_and_a_missing_chat_template_are_named(checkpoint, capsys, tmp_path):
    path = str(checkpoint("qwen3_5"))
    assert cli.main(["generate", "hi", "--model", path, "--num-draft-tokens", "2",
                     "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']) == 2
    assert "give one" in capsys.readouterr().err
    assert cli.main(["serve", path, "--port", "0", "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "--chat-template: no file" in capsys.readouterr().err


def test_generate_streams_the_greedy_completion(checkpoint, capsys, tmp_path):
    path = checkpoint("qwen3_5")
    assert cli.main(["generate", "Hello", "--model", str(path), "--max-tokens", "6", "--temperature", "0"]) == 0
    expected = LLM(path).generate("Hello", SamplingParams(max_tokens=6, temperature=0))[0].text
    assert capsys.readouterr().out == "Hello" + expected + "\n"
    # --generation-config none: the checkpoint's sampling defaults are not used.
    (tmp_path / "gen").mkdir()
    for file in path.iterdir():
        (tmp_path / "gen" / file.name).symlink_to(file)
    (tmp_path / "gen" / "generation_config.json").unlink(missing_ok=True)
    (tmp_path / "gen" / "generation_config.json").write_text('{"temperature": 0.0, "repetition_penalty": 0.2}')
    assert cli.main(["generate", "Hello", "--model", str(tmp_path / "gen"), "--max-tokens", "6",
                     "--generation-config", "none", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "Hello" + expected + "\n"


def test_without_a_model_the_cli_says_so(tmp_path, capsys):
    assert cli.main(["serve", str(tmp_path), "--port", "0"]) == 2
    assert f"no model at {tmp_path}" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert f"no model at {tmp_path}" in capsys.readouterr().err


def test_the_shipped_model_is_the_default(capsys):
    """`deltaspec generate` with no --model loads models/default and writes Python-looking text."""
    assert cli.DEFAULT_MODEL.joinpath("config.json").exists()
    assert cli.main(["generate", "def fibonacci(n):", "--max-tokens", "24", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):") and len(out) > len("def fibonacci(n):") + 20


def test_tensor_parallel_size_that_does_not_divide_the_model_is_named(checkpoint, capsys):
    assert cli.main(["generate", "hi", "--model", str(checkpoint("qwen3_5")), "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size=3 must divide" in capsys.readouterr().err


async def test_serve_tensor_parallel_streams_with_speculation_and_exits_0(checkpoint):
    """Two ranks (gloo) behind the server: a streamed request equals the one-device output."""
    path = checkpoint("qwen3_5")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    expected = LLM(path).generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    async with serve_process(path, "--tensor-parallel-size", "2") as (process, port, stderr), \
            aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            events = sse_events((await response.content.read()).decode())
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        assert text == expected
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
