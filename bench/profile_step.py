"""Where a model step's GPU time goes: per-kernel device time of one decode (or verify) step of a
random checkpoint, grouped by kernel, beside the step's CUDA-graph replay time, for each kernel
table named (side by side in one run: `--backends triton,triton-unfused` is the fused decode
path against the same kernels unfused, kernels/backend.py).

Per step: launches (the profiler's kernel count) and the split of its time
    kernels_us   the sum of its kernels' device times
    gaps_us      graph replay - kernels: the device idle between the graph's nodes (launch
                 latency of each node; what fewer launches remove)
    host_us      the host's time to issue the step eagerly (no graph), which a step run outside
                 a graph waits on: a launch-bound step's cost without CUDA graphs

    python bench/profile_step.py [--shape 0.8b] [--batches 1,64] [--verify-drafts 3]
                                 [--backends triton,triton-unfused]

Writes bench/results/profile-<gpu>.json and prints the top kernels per step.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common import commit_id, device_tag, graph_time_us  # noqa: E402
from spec_step import BLOCK, CONTEXT, random_model  # noqa: E402
from deltaspec.engine.batch import ForwardBatch, Row  # noqa: E402
from deltaspec.engine.state_pool import KVPool, StatePool  # noqa: E402
from deltaspec.kernels.backend import select_ops  # noqa: E402

PROFILED_STEPS = 5
HOST_STEPS = 20


def kernel_table(step, steps: int) -> tuple[list[dict], int]:
    """(kernels grouped by name with device µs per step, kernel launches per step)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    rows = [{"kernel": name[:120], "us_per_step": t / steps, "launches_per_step": counts[name] / steps}
            for name, t in sorted(totals.items(), key=lambda kv: -kv[1])]
    return rows, sum(counts.values()) // steps


def host_time_us(step, steps: int) -> float:
    """Host wall time to issue one step eagerly (the device drained first; not waited on after,
    unless its queue fills), median of `steps`."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def measure(model, batch: int, num_drafts: int) -> dict:
    config, dtype, device = model.config, torch.bfloat16, "cuda"
    blocks_per_row = (CONTEXT + num_drafts + 1) // BLOCK + 1
    states = StatePool(config, batch + 1, num_drafts, dtype, device, keep_mtp_hidden=num_drafts > 0)
    kv = KVPool(model.num_kv_layers, batch * blocks_per_row + 1, BLOCK, config.num_key_value_heads, config.head_dim,
                dtype, device)
    tables = [list(range(1 + r * blocks_per_row, 1 + (r + 1) * blocks_per_row)) for r in range(batch)]
    generator = torch.Generator().manual_seed(batch)
    tokens = num_drafts + 1
    with torch.inference_mode():
        prefill = ForwardBatch.build([], [Row(torch.randint(0, config.vocab_size, (CONTEXT,), generator=generator)
                                              .tolist(), 0, r + 1, tables[r]) for r in range(batch)], BLOCK, device)
        model(prefill, states, kv)
        rows = [Row(torch.randint(0, config.vocab_size, (tokens,), generator=generator).tolist(), CONTEXT, r + 1,
                    tables[r], num_logits=tokens) for r in range(batch)]
        step_batch = ForwardBatch.build(rows, [], BLOCK, device, commit=num_drafts == 0)

        def step():
            return model.compute_logits(model(step_batch, states, kv)).argmax(dim=-1)

        for _ in range(3):
            step()
        graph_us = graph_time_us(lambda _: step(), 4)
        host_us = host_time_us(step, HOST_STEPS)
        kernels, launches = kernel_table(step, PROFILED_STEPS)
    kernel_us = sum(k["us_per_step"] for k in kernels)
    return {"backend": model.ops.name, "batch": batch, "tokens_per_row": tokens, "graph_replay_us": graph_us,
            "kernel_sum_us": kernel_us, "launches_per_step": launches, "graph_overhead_us": graph_us - kernel_us,
            "split_us": {"kernels": kernel_us, "gaps": graph_us - kernel_us, "host": host_us},
            "kernels": kernels[:40]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--verify-drafts", type=int, default=3, help="also profile verify with this many drafts (0: no)")
    parser.add_argument("--backends", default="triton",
                        help="kernel tables to profile side by side (kernels/backend.py), e.g. triton,triton-unfused")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = random_model(args.shape, "cuda", torch.bfloat16)
    name = torch.cuda.get_device_name()
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        for drafts in sorted({0, args.verify_drafts}):
            for backend in args.backends.split(","):
                model.ops = select_ops("cuda", backend)
                results.append(measure(model, batch, drafts))
    report = {"benchmark": "profile_step", "device": name, "shape": args.shape, "dtype": "bfloat16",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "context": CONTEXT,
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    for r in results:
        split = r["split_us"]
        print(f"\n{r['backend']} B={r['batch']} tokens/row={r['tokens_per_row']}: graph {r['graph_replay_us']:.0f} us "
              f"in {r['launches_per_step']} launches (kernels {split['kernels']:.0f} us, gaps {split['gaps']:.0f} us; "
              f"host {split['host']:.0f} us eager)")
        for k in r["kernels"][:14]:
            print(f"  {k['us_per_step']:8.1f} us  x{k['launches_per_step']:5.1f}  {k['kernel'][:90]}")
    print("wrote", path)


if __name__ == "__main__":
    main()
