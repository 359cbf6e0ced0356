"""`deltaspec bench serve` on the CPU with the shipped model, briefly: it starts its own server
process, runs closed-loop streams over HTTP and the same load in-process, fires the abuse
prompts, and writes JSON with every field the report promises (tiny numbers) and a PNG."""

import json

import pytest

from deltaspec.server.cli import main


@pytest.mark.slow
def test_bench_serve_writes_its_report(tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "serve", "--streams", "1", "2", "--requests-per-stream", "2", "--max-tokens", "4",
            "--num-prompts", "4", "--max-prompt-chars", "300", "--max-model-len", "512", "--max-running", "4",
            "--abuse", "--abuse-prompts", "2", "--abuse-bytes", "200000", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "serve-cpu.json").read_text())
    assert report["device"] == "cpu" and report["command"] == "deltaspec bench serve " + " ".join(argv[2:])
    assert report["date"] and report["commit"] and report["max_tokens"] == 4
    for mode in ("served", "in_process"):
        assert [r["streams"] for r in report[mode]] == [1, 2]
        for r in report[mode]:
            assert r["num_requests"] == 2 * r["streams"] and r["output_tokens"] == 4 * r["num_requests"]
            assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
            for key in ("ttft_s", "itl_s", "e2e_s"):
                assert 0 < r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
            assert len(r["ttft_cdf"]) == r["num_requests"] and isinstance(r["client_bound"], bool)
            assert (r["client_cpu_fraction"] is None) == (mode == "in_process")
    assert [r["streams"] for r in report["served_over_in_process"]] == [1, 2]
    assert all(r["output_tokens_per_s"] > 0 for r in report["served_over_in_process"])
    abuse = report["abuse"]
    # Prompts far over the 512-token context: each is refused after tokenizing, never a 5xx.
    assert abuse["abuse_statuses"] == [400, 400]
    assert abuse["itl_p99_without_s"] > 0 and abuse["itl_p99_with_s"] > 0 and abuse["itl_p99_ratio"] > 0
    assert abuse["health_s"]["count"] > 10 and abuse["health_s"]["max"] > 0  # polled through the run
    assert (out / "serve-cpu.png").stat().st_size > 1000


def test_closed_loop_counts_requests_that_start_after_every_warm_up():
    """Stream 0's requests take 10 ms, stream 1's 60 ms: stream 0 sends several requests while
    stream 1 warms up; none of them may count, and every counted one starts in the window. The
    warm-ups ask for 1/2 and 2/2 of the output (spreading the streams); the rest for all of it."""
    import asyncio
    import time

    from deltaspec.server.serve_benchmark import Load, Sample, closed_loop

    sent: list[tuple[str, float, int | None]] = []

    async def send(prompt: str, origin: float, max_tokens: int | None = None) -> Sample:
        start = time.perf_counter() - origin
        sent.append((prompt, start, max_tokens))
        await asyncio.sleep(0.01 if prompt.startswith("fast") else 0.06)
        return Sample(start, 0.001, [], [], time.perf_counter() - origin - start, 4)

    load = Load(["fast", "slow"], 2, 7, 3, None)
    seconds = asyncio.run(closed_loop(load, send))
    assert [(prompt, tokens) for prompt, _, tokens in sent[:2]] == [("fast", 4), ("slow", 7)]
    assert all(tokens is None for _, _, tokens in sent[2:])
    assert 0.06 <= load.window_start < 0.1
    assert len(load.samples) == 6 and all(s.start >= load.window_start for s in load.samples)
    early = [start for prompt, start, _ in sent[2:] if prompt == "fast" and start < load.window_start]
    assert len(early) >= 3  # stream 0's requests during the warm-up: sent, not counted
    assert seconds == max(s.start + s.e2e for s in load.samples) - load.window_start
