"""Where a model step's GPU time goes: per-kernel device time of one decode (or verify) step of a
random checkpoint, grouped by kernel, beside the step's CUDA-graph replay time. The kernels are
profiled in replays of the step's graph, so they and their count are the graph's (an eager step
also stages the rows of its cuBLAS GEMMs: kernels/linear.py cublas_linear). The gap between the
replay and the sum of kernel times is what the graph's node launches cost (negative where
programmatic dependent launch overlaps kernels). Under PDL a kernel's own time includes its wait
for the one before it, so each kernel also gets its share of the critical path (the device
timeline, each launch from the end of the ones before it) and the step its idle device time:
those say what removing a kernel would save. With --draft-vocab N, also the MTP draft step of
each batch (the MTP layer, the head over N token ids and the argmax: what the runner runs per
draft depth, as spec_step.py times it; N = the vocabulary size scores all of it).

    python bench/profile_step.py [--shape 0.8b|9b] [--quantization fp8] [--batches 1,64] [--verify-drafts 3]
                                 [--draft-vocab 32768] [--timeline]

Writes bench/results/profile[_<shape>][_fp8]-<gpu>.json (no suffix for the 0.8b shape in bf16) and prints
the top kernels per step.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common import capture_graph, commit_id, device_tag, graph_time_us  # noqa: E402
from spec_step import BLOCK, CONTEXT, GRAPH_CALLS, random_model  # noqa: E402
from deltaspec.engine.batch import ForwardBatch, Row  # noqa: E402
from deltaspec.engine.state_pool import KVPool, StatePool  # noqa: E402

PROFILED_STEPS = 5


def kernel_table(step, steps: int) -> tuple[list[dict], int, float, list[dict]]:
    """(kernels grouped by name, kernel launches per step, idle device µs per step, the step's
    launches in device order with each one's critical-path µs averaged over the replays) of
    `steps` replays of step's CUDA graph. Per kernel: its device µs per step (`us_per_step`: a PDL
    kernel's includes the wait for its predecessor that overlaps it) and its share of the
    step's critical path (`critical_us_per_step`: in device order, each launch counts from the
    later of its start and the end of the kernels before it to its end, so the column sums,
    with the idle gaps, to the span of the replays)."""
    graph = capture_graph(lambda _: step())
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    critical: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    busy_until, idle = (events[0].time_range.start if events else 0.0), 0.0
    on_path = []  # each launch's share of the critical path, in device order
    for event in events:
        start, end = event.time_range.start, event.time_range.end
        totals[event.name] += event.device_time
        counts[event.name] += 1
        idle += max(0.0, start - busy_until)
        on_path.append(max(0.0, end - max(start, busy_until)))
        critical[event.name] += on_path[-1]
        busy_until = max(busy_until, end)
    rows = [{"kernel": name[:120], "us_per_step": t / steps, "critical_us_per_step": critical[name] / steps,
             "launches_per_step": counts[name] / steps}
            for name, t in sorted(totals.items(), key=lambda kv: -critical[kv[0]])]
    launches = len(events) // steps
    # Every replay runs the same launches in the same order: launch i of a step is events[s * launches + i].
    timeline = [{"kernel": events[i].name[:60],
                 "critical_us": sum(on_path[s * launches + i] for s in range(steps)) / steps}
                for i in range(launches)] if len(events) == launches * steps else []
    return rows, launches, idle / steps, timeline


def profiled(step, batch: int, tokens: int, kind: str, timeline: bool) -> dict:
    """The graph replay time and kernel table of step(), already warmed up (with `timeline`, also
    its launches one by one: which projection or layer a kernel's time belongs to)."""
    graph_us = graph_time_us(lambda _: step(), GRAPH_CALLS)
    kernels, launches, idle_us, launch_times = kernel_table(step, PROFILED_STEPS)
    kernel_us = sum(k["us_per_step"] for k in kernels)
    return {"step": kind, "batch": batch, "tokens_per_row": tokens, "graph_replay_us": graph_us,
            "kernel_sum_us": kernel_us, "critical_sum_us": sum(k["critical_us_per_step"] for k in kernels),
            "idle_us": idle_us, "launches_per_step": launches, "graph_overhead_us": graph_us - kernel_us,
            "kernels": kernels[:40], **({"timeline": launch_times} if timeline else {})}


def measure(model, batch: int, num_drafts: int, timeline: bool = False) -> dict:
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

        def step():  # the engine's step past the model: model-dtype logits, then its greedy tokens and flags
            return model.ops.greedy_argmax(model.logits(model(step_batch, states, kv)), tokens)[0]

        for _ in range(3):
            step()
        return profiled(step, batch, tokens, "verify" if num_drafts else "decode", timeline)


def measure_draft(model, batch: int, draft_vocab: int, timeline: bool = False) -> dict:
    """One MTP draft step of `batch` rows over a 512-token context, scoring draft_vocab ids."""
    config, dtype, device = model.config, torch.bfloat16, "cuda"
    blocks_per_row = (CONTEXT + 1) // BLOCK + 1
    kv = KVPool(model.num_kv_layers, batch * blocks_per_row + 1, BLOCK, config.num_key_value_heads, config.head_dim,
                dtype, device)
    tables = [list(range(1 + r * blocks_per_row, 1 + (r + 1) * blocks_per_row)) for r in range(batch)]
    generator = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, config.vocab_size, (batch,), generator=generator).tolist()
    model.use_draft_vocab(None if draft_vocab >= config.vocab_size else torch.arange(draft_vocab))
    with torch.inference_mode():
        hidden = torch.randn(batch, config.hidden_size, generator=generator).to(dtype).to(device)
        draft = ForwardBatch.build([], [Row([tokens[r]], CONTEXT, r + 1, tables[r]) for r in range(batch)], BLOCK,
                                   device)

        def step():
            return model.draft_tokens(model.draft_hidden(draft.input_ids, hidden, draft, kv))

        for _ in range(3):
            step()
        result = profiled(step, batch, 1, f"draft ({draft_vocab} ids)", timeline)
    model.use_draft_vocab(None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--verify-drafts", type=int, default=3, help="also profile verify with this many drafts (0: no)")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="also profile the MTP draft step scoring this many token ids (0: no)")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="the shape's block-FP8 twin (weights drawn in place)")
    parser.add_argument("--timeline", action="store_true",
                        help="also record each step's launches one by one, with their critical-path µs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = random_model(args.shape, "cuda", torch.bfloat16, args.quantization)
    name = torch.cuda.get_device_name()
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        for drafts in sorted({0, args.verify_drafts}):
            results.append(measure(model, batch, drafts, args.timeline))
        if args.draft_vocab:
            results.append(measure_draft(model, batch, args.draft_vocab, args.timeline))
    report = {"benchmark": "profile_step", "device": name, "shape": args.shape, "dtype": "bfloat16",
              "quantization": args.quantization,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "context": CONTEXT,
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    variant = "".join(f"_{part}" for part in (args.shape, args.quantization) if part not in (None, "0.8b"))
    path = args.out / f"profile{variant}-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    for r in results:
        print(f"\n{r['step']} B={r['batch']} tokens/row={r['tokens_per_row']}: graph {r['graph_replay_us']:.0f} us, kernels "
              f"{r['kernel_sum_us']:.0f} us in {r['launches_per_step']} launches; critical path "
              f"{r['critical_sum_us']:.0f} us of kernels, {r['idle_us']:.0f} us idle")
        for k in r["kernels"][:14]:
            print(f"  {k['critical_us_per_step']:8.1f} us critical {k['us_per_step']:8.1f} us own  "
                  f"x{k['launches_per_step']:5.1f}  {k['kernel'][:80]}")
    print("wrote", path)


if __name__ == "__main__":
    main()
