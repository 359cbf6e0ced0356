"""`deltaspec bench acceptance --quick` runs on the CPU and writes JSON, markdown and a PNG."""

import json

from deltaspec.server.cli import main


def test_quick_acceptance_benchmark(checkpoint, tmp_path):
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "class Cache:", "for i in"]))
    out = tmp_path / "out"
    assert main(["bench", "acceptance", "--model", str(path), "--prompts", str(prompts), "--quick",
                 "--out", str(out)]) == 0
    report = json.loads((out / "acceptance-cpu.json").read_text())
    assert {r["k"] for r in report["results"]} == {1, 3}
    assert {r["temperature"] for r in report["results"]} == {0.0, 0.7}
    for r in report["results"]:
        assert len(r["acceptance_by_position"]) == r["k"] and r["tokens"] > 0 and r["speedup"] > 0
    assert (out / "acceptance-cpu.md").read_text().startswith("# Speculation acceptance")
    assert (out / "acceptance-cpu.png").stat().st_size > 1000
