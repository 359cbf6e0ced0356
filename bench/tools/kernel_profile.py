"""Which CUDA kernels a serving-like closed loop spends the device's time on: EngineCore on a
checkpoint (default: the shipped model), --streams requests kept in flight (each finished one
replaced by a new prompt at once, as `deltaspec bench serve`'s closed loop does; held-out code,
every prompt unique), stepped in a loop; after --warm-up steps, torch.profiler records the CUDA
kernels of --steps steps. Prints and writes each kernel's total time and launches, the kernel
time per step, and the window's step counts by kind (decode, admitting).

    python bench/tools/kernel_profile.py [--drafts 0|default] [--streams 16] [--temperature 0.7]
        [--steps 1500] [--out DIR]  -> DIR/kernel_profile_<drafts>-<gpu>.json

The profiler slows the host loop several times over (admissions batch up in the window): read
kernel times, not the loop's wall time or its mix of steps. A kernel's time is its own, so a
PDL kernel's includes the wait for its predecessor that overlaps it. Knows nothing about which
kernel belongs to which op beyond its name.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import closed_loop, write_result  # noqa: E402
from deltaspec.engine import EngineConfig, SamplingParams  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.server.acceptance_benchmark import device_name, load_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def stepper(core: EngineCore, texts: list[str], streams: int, params: SamplingParams):
    """--streams requests of unique prompts sent; returns run(steps, counts), which steps the
    closed loop and counts its steps by kind, rows and finished requests into `counts`."""
    sent = [0]

    def send() -> None:
        sent[0] += 1
        core.add_request(core.tokenizer.encode(f"# {sent[0]:x}-{time.time_ns():x}\n" + texts[sent[0] % len(texts)]),
                         params)

    for _ in range(streams):
        send()

    def run(steps: int, counts: Counter) -> None:
        for plan, _, finished in closed_loop(core, send, steps):
            # Not StepPlan.admits: this runs in baseline trees older than it (bench/tools/ab.sh).
            counts["admit" if plan.prefill_rows or plan.cached_rows else "decode"] += 1
            counts["prefill_rows"] += len(plan.prefill_rows)
            counts["prefill_tokens"] += sum(r.num_tokens for r in plan.prefill_rows)
            counts["decode_rows"] += len(plan.decode_rows)
            counts["finished"] += finished

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--drafts", default="0", help="num_draft_tokens, or 'default' (the engine's)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--warm-up", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--top", type=int, default=45, help="kernels printed")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    drafts = {} if args.drafts == "default" else {"num_draft_tokens": int(args.drafts)}
    core = EngineCore(EngineConfig(model=args.model, device="cuda", dtype=args.dtype, **drafts))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    run = stepper(core, load_prompts(args.model, [], 128, 2000, 0), args.streams, params)
    run(args.warm_up, Counter())
    counts: Counter = Counter()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(args.steps, counts)
        torch.cuda.synchronize()
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])  # name -> [us, launches]
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time_total
            kernels[event.name][1] += 1
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
    total_us = sum(us for us, _ in kernels.values())
    print(f"{args.steps} steps {dict(counts)}: kernels {total_us / 1e3:.1f} ms, {total_us / args.steps:.1f} us a step")
    for name, (us, launches) in ranked[:args.top]:
        print(f"{us / 1e3:9.2f} ms {launches:7d}  {name[:100]}")
    write_result(args.out, f"kernel_profile_{args.drafts}", device_name("cuda"), {
        "streams": args.streams, "temperature": args.temperature, "steps": args.steps, "counts": dict(counts),
        "kernel_us_per_step": total_us / args.steps,
        "kernels": [{"name": name, "us": us, "launches": launches} for name, (us, launches) in ranked]})


if __name__ == "__main__":
    main()
