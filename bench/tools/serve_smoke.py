"""A short `deltaspec serve --tensor-parallel-size N --load-format dummy` smoke: start the server
on a random-weight checkpoint of a bench shape (bench/spec_e2e.py SHAPES, MTP speculation on),
stream one completion over HTTP, shut it down with SIGINT, and check that no process of its
group is left. Times each stage.

    python bench/tools/serve_smoke.py --shape 35b-a3b --tp 2 [--expert-parallel] [--quantization fp8] [--out DIR]
    python bench/tools/serve_smoke.py --device cpu --shape tiny --tp 2       (a CPU run, gloo)

Writes DIR/serve_smoke-<device>-<shape>-tp<N>[-ep][-fp8].json (and the server's log beside it); exits
1 when a stage fails, naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from common import free_port  # noqa: E402
from tp_scaling import checkpoint_dir  # noqa: E402

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 32


def wait_healthy(server: subprocess.Popen, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy in time")


def stream_completion(url: str) -> dict:
    """One streamed greedy completion of MAX_TOKENS tokens: seconds to the first chunk and in
    all, the text, the finish reason and the usage (random weights' tokens past the test
    tokenizer's vocabulary decode to nothing, so the text may be short or empty: the token
    count is what is checked)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    started, first, chunks, text = time.monotonic(), None, 0, ""
    finish_reason, usage = None, None
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            usage = event.get("usage") or usage
            if not event.get("choices"):
                continue
            first = first if first is not None else time.monotonic() - started
            chunks += 1
            text += event["choices"][0]["text"]
            finish_reason = event["choices"][0].get("finish_reason") or finish_reason
    completion = {"first_chunk_s": first, "total_s": time.monotonic() - started, "chunks": chunks, "text": text,
                  "finish_reason": finish_reason, "usage": usage}
    if finish_reason != "length" or not usage or usage.get("completion_tokens") != MAX_TOKENS:
        raise RuntimeError(f"expected {MAX_TOKENS} tokens ending in 'length': {completion}")
    return completion


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="35b-a3b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="serve the shape's block-FP8 form (random e4m3 weights and block scales)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--out", default=str(BENCH / "results"))
    args = parser.parse_args()
    # A time limit's SIGTERM unwinds main, whose finally stops the server's process group.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (f"serve_smoke-{args.device}-{args.shape}-tp{args.tp}" + ("-ep" if args.expert_parallel else "")
            + (f"-{args.quantization}" if args.quantization else ""))
    report = {"shape": args.shape, "tp": args.tp, "expert_parallel": args.expert_parallel,
              "quantization": args.quantization, "device": args.device,
              "commit": os.environ.get("DELTASPEC_COMMIT"), "command": " ".join(["python", *sys.argv])}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as root, open(out / f"{name}.log", "w") as log:
        directory = checkpoint_dir(args.shape, Path(root))
        command = [sys.executable, "-m", "deltaspec.server.cli", "serve", str(directory), "--port", str(port),
                   "--device", args.device, "--dtype", "bfloat16" if args.device == "cuda" else "float32",
                   "--tensor-parallel-size", str(args.tp), "--load-format", "dummy", "--max-model-len", "1024",
                   "--max-running", "8", "--shutdown-timeout", "5",
                   *(["--enable-expert-parallel"] if args.expert_parallel else []),
                   *(["--quantization", args.quantization] if args.quantization else [])]
        report["server_command"] = " ".join(command)
        started = time.monotonic()
        # A session of its own: its process group holds the server and its workers, and no more.
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stage = "start"
        try:
            wait_healthy(server, url, started + args.start_timeout)
            report["start_s"] = time.monotonic() - started
            stage = "stream"
            report["completion"] = stream_completion(url)
            stage = "shutdown"
            stopping = time.monotonic()
            server.send_signal(signal.SIGINT)
            report["exit_code"] = server.wait(timeout=60)
            while group_alive(server.pid) and time.monotonic() - stopping < 30:
                time.sleep(0.2)
            report["shutdown_s"] = time.monotonic() - stopping
            report["processes_left"] = group_alive(server.pid)
            if report["exit_code"] != 0 or report["processes_left"]:
                raise RuntimeError(f"exit code {report['exit_code']}, processes left: {report['processes_left']}")
            report["ok"] = True
        except Exception as error:  # noqa: BLE001 - recorded, and the exit code says it
            report["ok"], report["failed_stage"], report["error"] = False, stage, repr(error)
        finally:
            if group_alive(server.pid):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
