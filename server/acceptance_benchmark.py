"""The speculation-acceptance benchmark: how often the MTP drafts are accepted, and what that is
worth in tokens/s, for a model and a prompt set.

For each temperature and batch size it runs the engine once without speculation (the baseline)
and once per draft length k (fixed k: adaptive length off, so positions are comparable), and
records per-position acceptance, mean accepted length (tokens per verify step), tokens/s, the
speedup over the baseline and the engine's measured step costs. Writes JSON, a markdown table
and a PNG (acceptance by position for each k; speedup by k).

Every configuration, baseline included, is measured the same way (`run_config`): its engine is
built (decode CUDA graphs are captured then), runs one untimed warm-up group of requests shaped
like the timed ones, and only then is the whole prompt set timed, between two device syncs.
Without the warm-up, the first configuration at each batch size paid Triton's compilation and
autotuning (a B=1 baseline took 31 s instead of 8.6 s). The engine instances share one loaded
model.

Prompts: held-out code files cut at random points — files given on the command line, a JSONL
file of {"prompt": ...} lines, or by default the held-out stdlib modules listed in the model's
training.json. Knows nothing about HTTP; used by `deltaspec bench acceptance` and
bench/acceptance_benchmark.py.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import subprocess
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine import EngineConfig, SamplingParams
from ..engine.core import EngineCore
from ..engine.model_source import resolve_model


def load_prompts(model: Path, sources: list[str], count: int, max_chars: int, seed: int) -> list[str]:
    """Cut `count` prompts at random line boundaries from the given files / JSONL, or from the
    model's held-out stdlib modules."""
    rng = random.Random(seed)
    if sources and all(s.endswith(".jsonl") for s in sources):
        lines = [json.loads(line)["prompt"] for s in sources for line in Path(s).read_text().splitlines() if line]
        return (lines * (count // max(len(lines), 1) + 1))[:count]
    files = [Path(s) for s in sources] or _held_out_files(model)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    prompts = []
    for i in range(count):
        text = texts[i % len(texts)]
        lines = text.splitlines(keepends=True)
        cut = rng.randint(min(20, len(lines) - 1), max(len(lines) - 1, 1))
        prompts.append("".join(lines[:cut])[-max_chars:])
    return prompts


def _held_out_files(model: Path) -> list[Path]:
    report = model / "training.json"
    if not report.exists():
        raise ValueError(f"{model} has no training.json naming held-out modules: pass prompt files or a JSONL")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held = json.loads(report.read_text())["held_out_modules"]
    files = sorted(p for p in stdlib.rglob("*.py") if any(str(p.relative_to(stdlib)).startswith(h) for h in held))
    if not files:
        raise ValueError(f"none of the held-out modules {held} is in this interpreter's stdlib {stdlib}")
    return files


def run_config(core: EngineCore, prompts: list[str], params: SamplingParams, batch: int) -> dict:
    """Generate for every prompt, `batch` requests in flight at a time; returns speed + counters
    of the timed run only (the warm-up group before it is neither timed nor counted)."""
    warmup_seconds = _timed(core, lambda: warm_up(core, prompts[:batch], params))
    core.reset_counters()  # count the timed steps only
    generated = 0

    def generate() -> None:
        nonlocal generated
        for start in range(0, len(prompts), batch):
            requests = [core.add_request(p, params) for p in prompts[start:start + batch]]
            while core.has_work:
                core.step()
            generated += sum(len(r.output_token_ids) for r in requests)

    seconds = _timed(core, generate)
    spec = core.stats()["spec"]
    return {"tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds,
            "warmup_seconds": warmup_seconds, "num_verify_steps": spec["num_verify_steps"],
            "acceptance_by_position": spec["acceptance_by_position"],
            "mean_accepted_length": spec["mean_accepted_length"], "step_costs": core.stats()["step_costs"]}


def warm_up(core: EngineCore, prompts: list[str], params: SamplingParams) -> None:
    """Run one group of requests like the timed ones (same lengths, batch and sampling), so the
    timed run pays no Triton compilation, autotuning or first-use allocation. Each prompt has
    its first token changed: the text, and so the acceptance pattern and catch-up lengths, stay
    nearly the same, but no prefix of it matches a timed prompt, so the prefix cache serves the
    timed run nothing the warm-up left behind."""
    vocab_size = core.model_config.vocab_size
    for prompt in prompts:
        token_ids = core.tokenizer.encode(prompt)
        core.add_request([(token_ids[0] + 1) % vocab_size, *token_ids[1:]], params)
    while core.has_work:
        core.step()


def _timed(core: EngineCore, work) -> float:
    """Wall seconds of work(), between device syncs on CUDA (no queued kernel is left out or
    let in)."""
    synchronize = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    work()
    synchronize()
    return time.perf_counter() - started


def benchmark(args: argparse.Namespace) -> dict:
    model = resolve_model(args.model)
    prompts = load_prompts(model, args.prompts, args.num_prompts, args.max_prompt_chars, args.seed)
    results = []
    configs = [(t, b) for t in args.temperatures for b in args.batch_sizes]
    loaded: tuple = ()  # (model, tokenizer) of the first engine; later engines reuse them

    def measure(params: SamplingParams, batch: int, **options) -> dict:
        nonlocal loaded
        core = EngineCore(EngineConfig(model=model, device=args.device, dtype=args.dtype, max_num_seqs=batch,
                                       max_model_len=args.max_model_len, **options), *loaded)
        loaded = core.model, core.tokenizer
        measured = run_config(core, prompts, params, batch)
        # Engines hold reference cycles (graphs, pools): collect now, so the next
        # engine sizes its pools from memory this one no longer holds.
        del core
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return measured

    with tqdm(total=len(configs) * (1 + len(args.draft_lengths)), desc="acceptance") as bar:
        for temperature, batch in configs:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=args.seed,
                                    ignore_eos=True)
            base = measure(params, batch, num_draft_tokens=0)
            bar.update()
            for k in args.draft_lengths:
                measured = measure(params, batch, num_draft_tokens=k, adaptive_draft_length=False,
                                   draft_vocab_size=args.draft_vocab_size)
                measured.update(temperature=temperature, batch=batch, k=k,
                                baseline_tokens_per_s=base["tokens_per_s"],
                                baseline_warmup_seconds=base["warmup_seconds"],
                                speedup=measured["tokens_per_s"] / base["tokens_per_s"])
                results.append(measured)
                bar.update()
    return {"benchmark": "acceptance", "model": str(model), "device": device_name(args.device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("DELTASPEC_COMMIT") or subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "command": args.command, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
            "draft_vocab_size": args.draft_vocab_size,
            "timing": "per configuration: one untimed warm-up group of `batch` requests, then all prompts "
                      "timed between device syncs",
            "results": results}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return "cpu"


def device_tag(name: str) -> str:
    """Short lowercase device name for results file names (h100, h200, cpu, ...): one scheme for
    this benchmark and bench/'s, which imports it."""
    lowered = name.lower()
    for tag in ("h200", "h100", "a100", "l40s", "b200"):
        if tag in lowered:
            return tag
    return "".join(c if c.isalnum() else "-" for c in lowered).strip("-")


def markdown(report: dict) -> str:
    lines = [f"# Speculation acceptance — {report['model']} on {report['device']}", "",
             f"Timing: {report['timing']}.", "",
             "| T | batch | k | acceptance by position | mean accepted length | tok/s | baseline tok/s | speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        by_position = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        lines.append(f"| {r['temperature']} | {r['batch']} | {r['k']} | {by_position} | "
                     f"{r['mean_accepted_length']:.2f} | {r['tokens_per_s']:.1f} | {r['baseline_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in report["results"]:
        if r["batch"] == min(x["batch"] for x in report["results"]) and r["temperature"] == 0:
            left.plot(range(1, len(r["acceptance_by_position"]) + 1), r["acceptance_by_position"], marker="o",
                      label=f"k={r['k']}")
    left.set(title="acceptance by draft position (T=0)", xlabel="position", ylabel="acceptance rate", ylim=(0, 1))
    left.legend()
    for temperature in sorted({r["temperature"] for r in report["results"]}):
        for batch in sorted({r["batch"] for r in report["results"]}):
            rows = [r for r in report["results"] if r["temperature"] == temperature and r["batch"] == batch]
            right.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="o", label=f"T={temperature} B={batch}")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(title="speedup over no speculation", xlabel="draft length k", ylabel="speedup")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser, default_model: Path) -> None:
    parser.add_argument("--model", default=str(default_model), help="a checkpoint directory or a Hub repo id")
    parser.add_argument("--prompts", nargs="*", default=[], help="code files or a JSONL of {\"prompt\": ...}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-chars", type=int, default=2000)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--draft-vocab-size", type=int, default=0,
                        help="draft from the N most frequent tokens (the model's draft_vocab.json); 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true", help="a small CPU run (under a minute)")


def main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.quick:
        args.draft_lengths, args.temperatures, args.batch_sizes = [1, 3], [0.0, 0.7], [1, 4]
        args.num_prompts, args.max_tokens, args.max_prompt_chars = 4, 24, 400
    args.command = "deltaspec bench acceptance " + " ".join(argv)
    report = benchmark(args)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "acceptance-" + device_tag(report["device"])
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"{name}.md").write_text(markdown(report))
    plot(report, args.out / f"{name}.png")
    print(markdown(report))
    print(f"wrote {args.out / name}.{{json,md,png}}")
    return 0
