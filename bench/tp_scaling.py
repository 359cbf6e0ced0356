"""Tensor-parallel scaling on the GPU: decode tokens/s at TP 1, 2 (and 4) on the same shapes and
batches, the collectives' share of a decode step, and MTP speculation's speedup with the shipped
model's acceptance profile, side by side in one run.

Shapes: random-weight Qwen3.5-9B, Qwen3.5-35B-A3B and Qwen3.5-122B-A10B (bf16, with their MTP
layer: the shapes of bench/spec_e2e.py; the 122B needs tp >= 4 on H100s), drawn by every rank on
its own GPU with `load_format="dummy"` from a config.json (each rank builds only its shard; the
JSON records each engine's start-up seconds). For each
shape and TP size one engine (CUDA graphs on, warm-up off: decode steps are timed, never eager
prefills) runs, per batch, plain decoding (K = 0) and speculation (adaptive, up to 3 drafts) with
each verify row's accepted count drawn from the shipped profile (spec/profile.py, as spec_e2e
forces it; every rank draws the same counts). tokens/s: generated tokens over the decode steps'
wall time (prefill off the clock). Collectives' share: rank 0's collective kernel time (NCCL's
kernels and the symmetric-memory all-reduce kernels) over its CUDA time across a few plain
decode steps at each batch (torch.profiler; the time a rank waits in an all-reduce for a slower
peer counts as collective time). `--all-reduce nccl,one_shot,auto` runs each tp >= 2 engine once
per setting (EngineConfig.all_reduce; records tp2-nccl, tp2-one_shot, tp2-auto, ... side by side,
each with the path its small all-reduces took: one_shot then the norm, or auto's fused kernel). NVLink multicast is off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1: the device notes' rule).

    python bench/tp_scaling.py [--shapes 9b,35b-a3b] [--tp 1,2] [--batches 1,16,64] [--expert-parallel]
                               [--all-reduce nccl,one_shot,auto] [--out DIR]

Writes DIR (default bench/results)/tp_scaling-<gpu>-<shapes>[-ep].json and .png.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import make_tokenizer  # noqa: E402

from common import commit_id, device_tag  # noqa: E402
from deltaspec.engine import EngineConfig, SamplingParams  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.spec import AcceptanceProfile, DraftPolicy  # noqa: E402
from spec_e2e import COMMON, PROFILES, PROMPT_LEN, SHAPES, run, synchronize  # noqa: E402

MAX_DRAFTS = 3
PROFILED_STEPS = 8
# Kernel names of the collectives: NCCL's, torch's symmetric-memory all-reduces
# (one_shot_all_reduce_kernel, two_shot_all_reduce_kernel) and the fused all-reduce + RMSNorm
# (_all_reduce_rms_norm_kernel: its norm counted with it).
COLLECTIVE_KERNELS = ("nccl", "all_reduce_kernel", "all_reduce_rms_norm_kernel")


def checkpoint_dir(shape: str, root: Path) -> Path:
    """A config.json (and a tokenizer) of the shape: what load_format "dummy" needs."""
    directory = root / shape
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**COMMON, **SHAPES[shape]}))
    make_tokenizer(directory)
    return directory


def engine(directory: Path, device: str, tp: int, max_batch: int, expert_parallel: bool,
           all_reduce: str) -> EngineCore:
    config = EngineConfig(model=directory, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                          tensor_parallel_size=tp, all_reduce=all_reduce,
                          enable_expert_parallel=expert_parallel and tp > 1, load_format="dummy",
                          max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * (PROMPT_LEN // 4)),
                          max_model_len=1024, num_draft_tokens=MAX_DRAFTS, enable_prefix_cache=False,
                          gpu_memory_utilization=0.5, warm_up=False)
    return EngineCore(config, forced_acceptance=AcceptanceProfile(PROFILES["shipped"]))


def use_drafts(core: EngineCore, costs, max_drafts: int) -> None:
    """Plain decoding (0) or adaptive speculation up to max_drafts on the same engine (its pools
    and graphs cover both)."""
    core.scheduler.draft_policy = DraftPolicy(max_drafts, costs, adaptive=True) if max_drafts else None


def collective_share(core: EngineCore, batch: int) -> dict:
    """Rank 0's collective kernel time / its CUDA time over PROFILED_STEPS plain decode steps."""
    params = SamplingParams(max_tokens=PROFILED_STEPS + 12, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(7)
    requests = [core.add_request(torch.randint(0, core.model_config.vocab_size, (PROMPT_LEN,),
                                               generator=generator).tolist(), params) for _ in range(batch)]
    while any(len(r.output_token_ids) < 4 for r in requests):
        core.step()
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            core.step()
        synchronize()
    while core.has_work:
        core.step()
    # Kernels only (self device time; torch < 2.4 names it self_cuda_time_total).
    times = [(e.key, getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0))
             for e in prof.key_averages()]
    total = sum(t for _, t in times)
    # On the CPU (smoke runs) nothing is.
    collective = sum(t for key, t in times if any(name in key.lower() for name in COLLECTIVE_KERNELS))
    return {"collective_us_per_step": collective / PROFILED_STEPS, "cuda_us_per_step": total / PROFILED_STEPS,
            "share": collective / total if total else None}


def measure(core: EngineCore, batches: list[int], tokens: int, results: dict, save: Callable[[], None]) -> None:
    """Each batch's row into results, saved as soon as it is measured."""
    costs = core.scheduler.draft_policy.costs
    for batch in batches:
        steps = max(tokens, min(256, 2048 // batch))
        row = {}
        for name, max_drafts in (("plain", 0), ("speculative", MAX_DRAFTS)):
            use_drafts(core, costs, max_drafts)
            run(core, batch, 8, 0.0, seed=0)  # untimed
            row[f"{name}_tokens_per_s"] = run(core, batch, steps, 0.0, seed=1)
        row["speculation_speedup"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
        if core.config.tensor_parallel_size > 1:
            use_drafts(core, costs, 0)
            row["collectives"] = collective_share(core, batch)
        results[batch] = row
        save()
        print(f"  batch {batch}: {json.dumps(row)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="9b,35b-a3b")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=48, help="decode tokens per request at least")
    parser.add_argument("--expert-parallel", action="store_true", help="MoE shapes: whole experts per rank")
    parser.add_argument("--all-reduce", default="nccl",
                        help="EngineConfig.all_reduce settings each tp >= 2 engine runs with, comma-separated "
                             "(auto, nccl, one_shot, two_shot)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (--shapes tiny; gloo)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                        help="directory of the JSON and PNG")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    sizes = [int(t) for t in args.tp.split(",")]
    all_reduces = args.all_reduce.split(",")
    num_devices = torch.cuda.device_count() if args.device == "cuda" else max(sizes)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"device": device_tag(name), "num_gpus": torch.cuda.device_count(),
              "date": datetime.date.today().isoformat(),
              "commit": commit_id(), "command": " ".join(["python", *sys.argv]), "profile": PROFILES["shipped"],
              "expert_parallel": args.expert_parallel, "shapes": {}}
    # One file per device, shapes and expert placement: the runs of one GPU session do not overwrite each other.
    suffix = args.shapes.replace(",", "_") + ("-ep" if args.expert_parallel else "")
    out = Path(args.out) / f"tp_scaling-{report['device']}-{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        """After every batch: a run cut short by its time limit keeps what it measured."""
        out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        plot(report, batches, out.with_suffix(".png"))

    with tempfile.TemporaryDirectory() as root:
        for shape in args.shapes.split(","):
            directory = checkpoint_dir(shape, Path(root))
            runs = report["shapes"][shape] = {}
            for tp in sizes:
                if tp > num_devices:
                    print(f"{shape} tp={tp}: skipped, {num_devices} GPUs")
                    continue
                for all_reduce in all_reduces if tp > 1 else ["nccl"]:
                    key = f"tp{tp}" + (f"-{all_reduce}" if tp > 1 and len(all_reduces) > 1 else "")
                    print(f"{shape} {key}", flush=True)
                    record = runs[key] = {}
                    run_engine(directory, args, tp, all_reduce, batches, record, save)
                    scale_over_tp1(runs)
                    save()
    print(f"wrote {out}.json and .png")


def run_engine(directory: Path, args: argparse.Namespace, tp: int, all_reduce: str, batches: list[int],
               record: dict, save: Callable[[], None]) -> None:
    """One engine's start-up seconds, the path its small all-reduces took and its measurements
    into record; an engine that fails (it does not fit, a collective breaks) is recorded with
    its error and the run goes on."""
    started = time.perf_counter()
    try:
        core = engine(directory, args.device, tp, max(batches), args.expert_parallel, all_reduce)
    except Exception as error:  # noqa: BLE001 - recorded in the JSON, the other engines still run
        print(f"  failed to start: {error!r}", flush=True)
        record["error"] = repr(error)
        return
    record["start_s"] = time.perf_counter() - started
    if core.tp is not None:
        record["all_reduce"] = {"setting": all_reduce, "small_messages": core.tp.all_reduce_kind}
    print(f"  started in {record['start_s']:.1f} s" + (f"; small all-reduces: {core.tp.all_reduce_kind}"
                                                      if core.tp is not None else ""), flush=True)
    try:
        measure(core, batches, args.tokens, record.setdefault("batches", {}), save)
    except Exception as error:  # noqa: BLE001
        print(f"  failed: {error!r}", flush=True)
        record["error"] = repr(error)
    finally:
        core.close()
        del core
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def scale_over_tp1(runs: dict) -> None:
    """Each measured engine's plain tokens/s over tp=1's at the same batch."""
    base = runs.get("tp1", {}).get("batches", {})
    for record in runs.values():
        for batch, row in record.get("batches", {}).items():
            if batch in base:
                row["plain_scaling_over_tp1"] = row["plain_tokens_per_s"] / base[batch]["plain_tokens_per_s"]


def plot(report: dict, batches: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(report["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.8), squeeze=False)
    for axis, shape in zip(axes[0], shapes):
        for key, value in report["shapes"][shape].items():
            rows = value.get("batches", {})
            if any(b not in rows for b in batches):
                continue
            for name, style in (("plain", "-"), ("speculative", "--")):
                axis.plot(batches, [rows[b][f"{name}_tokens_per_s"] for b in batches], marker="o", linestyle=style,
                          label=f"{key} {name}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(f"{shape} ({report['device']})", fontsize=9)
        axis.set_xlabel("batch")
        axis.set_ylabel("decode tokens/s")
        if axis.lines:
            axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
