"""`deltaspec bench acceptance --quick` runs on the CPU and writes JSON, markdown and a PNG; each
configuration's warm-up (where the GPU compiles its kernels) is neither timed nor counted."""

import json

from deltaspec.engine import EngineConfig, SamplingParams
from deltaspec.engine.core import EngineCore
from deltaspec.server import acceptance_benchmark
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
        assert r["warmup_seconds"] > 0 and r["baseline_warmup_seconds"] > 0
    assert (out / "acceptance-cpu.md").read_text().startswith("# Speculation acceptance")
    assert (out / "acceptance-cpu.png").stat().st_size > 1000


def test_warm_up_is_neither_timed_nor_counted(checkpoint, monkeypatch):
    """On the GPU the first step of a configuration compiles Triton kernels (a B=1 baseline took
    31 s instead of 8.6 s). Here the first step costs 1000 s of a fake clock: run_config must
    time only the steps after the warm-up, and report the acceptance counters of the timed
    requests alone (those of a fresh engine running just them)."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    config = EngineConfig(model=path, max_num_seqs=2, num_draft_tokens=2, adaptive_draft_length=False)
    prompts = ["def add(a, b):", "class Cache:", "for i in range(3):", "import os"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    reference = EngineCore(config)
    for start in (0, 2):
        for p in prompts[start:start + 2]:
            reference.add_request(p, params)
        while reference.has_work:
            reference.step()
    expected = reference.stats()["spec"]

    core = EngineCore(config, reference.model, reference.tokenizer)
    clock, steps = [0.0], []
    real_step = core.step

    def step():
        clock[0] += 1.0 if steps else 1000.0
        steps.append(clock[0])
        return real_step()

    monkeypatch.setattr(core, "step", step)
    monkeypatch.setattr(acceptance_benchmark.time, "perf_counter", lambda: clock[0])
    measured = acceptance_benchmark.run_config(core, prompts, params, batch=2)

    assert measured["warmup_seconds"] >= 1000.0
    assert 0 < measured["seconds"] < 1000.0
    assert measured["tokens"] == len(prompts) * params.max_tokens
    assert measured["num_verify_steps"] == expected["num_verify_steps"]
    assert measured["acceptance_by_position"] == expected["acceptance_by_position"]
    assert measured["mean_accepted_length"] == expected["mean_accepted_length"]


def test_device_names(monkeypatch):
    """The GPU's name and its short tag in results files (a typo here once crashed the GPU runs
    only, after their measurements)."""
    monkeypatch.setattr(acceptance_benchmark.torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    assert acceptance_benchmark.device_name("cuda") == "NVIDIA H100 80GB HBM3"
    assert acceptance_benchmark.device_tag(acceptance_benchmark.device_name("cuda:0")) == "h100"
    assert acceptance_benchmark.device_name("cpu") == "cpu"
