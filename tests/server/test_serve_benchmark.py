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
