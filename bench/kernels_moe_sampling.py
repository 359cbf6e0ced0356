"""MoE experts / routing (kernels/moe.py) and sampling (kernels/sampling.py)
against their torch references and the copy-bandwidth roofline, on one GPU.

MoE: the Qwen3-Next layer shape (512 experts, top-10, renormalised, hidden 2048, expert
intermediate 512, bf16), tokens = 1, 2, 4, 8, 16, 32, 64, 256, 4096. Both expert paths are timed
with several tile configs (the per-token path up to 256 tokens); `moe_experts` is the launcher's
own choice. Roofline: bytes of the distinct experts the batch touches (3 x H x I x 2 each) plus
x and out, over the copy bandwidth. Timing: a CUDA graph of R calls over R input sets with
different routing (so weights are not served from L2), median of 20 replays / R. The torch
reference syncs (bincount().tolist()), so it is timed with events around R eager calls.

Sampling: B = 64 rows over a 248,320 vocabulary, fp32 logits, per case of parameters and logit
shape (peaked: a head of ~20 strong tokens over a N(0, 2) bulk, like an LLM's; medium: N(0, 3);
flat: N(0, 1), whose top-p nucleus holds ~60% of the vocabulary). Both the Triton `sample` and the
sort-based `sample_reference` run as CUDA graphs over 2 logit sets (128 MiB > L2); roofline: one
read of the logits. Tokens are compared with the reference; the row paths are counted.

Usage: python bench/kernels_moe_sampling.py [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import sys
import traceback

import torch
import triton

from common import commit_id, copy_bandwidth, device_tag, eager_time_us, graph_time_us  # noqa: E402
from deltaspec.kernels.moe import (grouped_config, moe_experts, moe_experts_grouped, moe_experts_per_token,
                                   moe_experts_reference, route, route_reference, use_per_token_path)
from deltaspec.kernels.sampling import launch_sample, sample_reference
from deltaspec.kernels.tiles import TileConfig

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 512, 10, 2048, 512
TOKENS = (1, 2, 4, 8, 16, 32, 64, 256, 4096)
# per-token: (gate/up tile, down tile) from gate_n x down_n x block_k x num_warps
PER_TOKEN_SWEEP = [(TileConfig(block_n=gate_n, block_k=bk, num_warps=w),
                    TileConfig(block_n=down_n, block_k=bk, num_warps=w))
                   for gate_n, down_n, bk, w in ((16, 16, 256, 4), (16, 4, 256, 4), (32, 8, 128, 4), (8, 8, 512, 4),
                                                 (16, 16, 256, 8), (8, 4, 256, 4))]
# grouped: block_m x block_n x block_k x num_warps x num_stages
GROUPED_SWEEP_SMALL = [TileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                       for bm, bn, bk, w, s in ((16, 64, 64, 4, 3), (16, 64, 128, 4, 3), (16, 128, 64, 4, 3),
                                                (16, 32, 128, 4, 4), (32, 64, 64, 4, 3))]
GROUPED_SWEEP_LARGE = [TileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                       for bm, bn, bk, w, s in ((64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
                                                (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3),
                                                (128, 64, 64, 4, 3))]
BATCH, VOCAB = 64, 248_320


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def per_token_name(gate_up: TileConfig, down: TileConfig) -> str:
    return f"{gate_up.block_n}x{down.block_n}x{gate_up.block_k}x{gate_up.num_warps}"


def grouped_name(c: TileConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k}x{c.num_warps}x{c.num_stages}"


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------

def bench_moe(bandwidth: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.03
    expert_bytes = 3 * HIDDEN * INTER * 2
    rows = []
    for tokens in TOKENS:
        row = dict(tokens=tokens)
        try:
            repeats = 8 if tokens <= 8 else 4
            xs = [torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16() for _ in range(repeats)]
            logits = [torch.randn(tokens, NUM_EXPERTS, generator=gen, device="cuda").bfloat16() for _ in range(repeats)]
            routed = [route_reference(lg, TOP_K, True) for lg in logits]
            distinct = sum(int(torch.unique(e).numel()) for _, e in routed) / repeats
            moved = distinct * expert_bytes + 2 * tokens * HIDDEN * 2
            row.update(distinct_experts=distinct, roofline_us=moved / bandwidth * 1e6,
                       per_token_path=use_per_token_path(tokens * TOP_K, NUM_EXPERTS))
            # correctness of both paths and the routing at replica 0
            weights, experts = route(logits[0], TOP_K, True)
            probs = torch.softmax(logits[0].float(), dim=-1)  # ties (bf16 logits) may swap experts
            row["route_same_probabilities"] = bool(torch.equal(probs.gather(1, experts), probs.gather(1, routed[0][1])))
            expected = moe_experts_reference(xs[0], *routed[0], w_gate_up, w_down)
            grouped = moe_experts_grouped(xs[0], *routed[0], w_gate_up, w_down)
            row["grouped_rel_error"] = relative_error(grouped, expected)
            if tokens <= 256:
                row["per_token_rel_error"] = relative_error(
                    moe_experts_per_token(xs[0], *routed[0], w_gate_up, w_down), expected)

            row["route_us"] = graph_time_us(lambda r: route(logits[r], TOP_K, True), repeats)
            row["route_reference_us"] = graph_time_us(lambda r: route_reference(logits[r], TOP_K, True), repeats)
            row["reference_us"] = eager_time_us(
                lambda r: moe_experts_reference(xs[r], *routed[r], w_gate_up, w_down), repeats)
            row["experts_us"] = graph_time_us(lambda r: moe_experts(xs[r], *routed[r], w_gate_up, w_down), repeats)
            row["layer_us"] = graph_time_us(
                lambda r: moe_experts(xs[r], *route(logits[r], TOP_K, True), w_gate_up, w_down), repeats)
            if tokens <= 256:
                row["per_token_us"] = {
                    per_token_name(*c): graph_time_us(
                        lambda r, c=c: moe_experts_per_token(xs[r], *routed[r], w_gate_up, w_down, *c), repeats)
                    for c in PER_TOKEN_SWEEP}
            sweep = GROUPED_SWEEP_LARGE if tokens >= 1024 else GROUPED_SWEEP_SMALL
            row["grouped_default"] = grouped_name(grouped_config(tokens * TOP_K, NUM_EXPERTS))
            row["grouped_us"] = {
                grouped_name(c): graph_time_us(
                    lambda r, c=c: moe_experts_grouped(xs[r], *routed[r], w_gate_up, w_down, c), repeats)
                for c in sweep}
            row["experts_vs_roofline"] = row["experts_us"] / row["roofline_us"]
            row["speedup_vs_reference"] = row["reference_us"] / row["experts_us"]
            best_per_token = min(row.get("per_token_us", {"-": float("inf")}).values())
            print(f"MoE T={tokens:5d}: distinct {distinct:6.1f} roofline {row['roofline_us']:8.1f} us | "
                  f"experts {row['experts_us']:8.1f} us ({row['experts_vs_roofline']:.2f}x roofline) | best per-token "
                  f"{best_per_token:8.1f} | best grouped {min(row['grouped_us'].values()):8.1f} | reference "
                  f"{row['reference_us']:9.1f} | route {row['route_us']:.1f} vs {row['route_reference_us']:.1f} us",
                  flush=True)
        except Exception:  # noqa: BLE001 - recorded, the other sizes still run
            row["error"] = traceback.format_exc()
            print(row["error"], flush=True)
        rows.append(row)
    del w_gate_up, w_down
    torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------

def make_logits(shape: str, gen: torch.Generator) -> torch.Tensor:
    if shape == "peaked":
        logits = torch.randn(BATCH, VOCAB, generator=gen, device="cuda") * 2.0
        head = torch.randint(0, VOCAB, (BATCH, 20), generator=gen, device="cuda")
        logits.scatter_(1, head, 10.0 + 8.0 * torch.rand(BATCH, 20, generator=gen, device="cuda"))
        return logits
    return torch.randn(BATCH, VOCAB, generator=gen, device="cuda") * {"medium": 3.0, "flat": 1.0}[shape]


SAMPLING_CASES = [  # name, logit shape, temperature, top_k, top_p, min_p
    ("top_p_0.9", "peaked", 1.0, 0, 0.9, 0.0),
    ("qwen_default_T0.7_k20_p0.8", "peaked", 0.7, 20, 0.8, 0.0),
    ("temperature_only", "peaked", 1.0, 0, 1.0, 0.0),
    ("min_p_0.05", "peaked", 1.0, 0, 1.0, 0.05),
    ("greedy", "peaked", 0.0, 0, 1.0, 0.0),
    ("top_p_0.9_medium", "medium", 1.0, 0, 0.9, 0.0),
    ("top_p_0.9_flat", "flat", 1.0, 0, 0.9, 0.0),
    ("top_k_1000_flat", "flat", 1.0, 1000, 1.0, 0.0),
]
SAMPLING_SWEEP_CASES = ("top_p_0.9", "temperature_only")
SAMPLING_SWEEP = [dict(chunk=c, block=b, capacity=cap) for c, b, cap in
                  ((8192, 1024, 4096), (16384, 2048, 2048), (32768, 2048, 4096), (16384, 1024, 4096))]


def bench_sampling(bandwidth: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for name, shape, temperature, top_k, top_p, min_p in SAMPLING_CASES:
        row = dict(case=name, logits=shape, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        try:
            logit_sets = [make_logits(shape, gen) for _ in range(2)]
            full = lambda value, dtype: torch.full((BATCH,), value, dtype=dtype, device="cuda")
            params = [full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
                      full(min_p, torch.float32)]
            seeds = torch.randint(0, 2 ** 62, (BATCH,), generator=gen, device="cuda")
            offsets = torch.randint(0, 10 ** 6, (BATCH,), generator=gen, device="cuda")
            statuses = torch.zeros(BATCH, dtype=torch.int32, device="cuda")
            tokens, logprobs = launch_sample(logit_sets[0], *params, seeds, offsets, statuses=statuses)
            expected_tokens, expected_logprobs = sample_reference(logit_sets[0], *params, seeds, offsets)
            row["token_mismatches"] = int((tokens != expected_tokens).sum())
            row["logprob_max_error"] = float((logprobs - expected_logprobs).abs().max())
            row["row_paths"] = dict(collections.Counter(
                ["greedy", "no_filter", "refine", "window", "last_resort"][s] for s in statuses.tolist()))
            row["triton_us"] = graph_time_us(lambda r: launch_sample(logit_sets[r], *params, seeds, offsets), 2)
            row["reference_us"] = graph_time_us(lambda r: sample_reference(logit_sets[r], *params, seeds, offsets), 2)
            row["roofline_us"] = BATCH * VOCAB * 4 / bandwidth * 1e6
            row["speedup_vs_reference"] = row["reference_us"] / row["triton_us"]
            if name in SAMPLING_SWEEP_CASES:
                row["tilings_us"] = {
                    "x".join(map(str, tiling.values())): graph_time_us(
                        lambda r, t=tiling: launch_sample(logit_sets[r], *params, seeds, offsets, **t), 2)
                    for tiling in SAMPLING_SWEEP}
            print(f"sample {name:28s}: triton {row['triton_us']:8.1f} us, reference {row['reference_us']:8.1f} us "
                  f"({row['speedup_vs_reference']:5.1f}x), roofline {row['roofline_us']:.1f} us, mismatches "
                  f"{row['token_mismatches']}, paths {row['row_paths']}", flush=True)
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()
            print(row["error"], flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--skip", nargs="*", default=[], choices=["moe", "sampling"])
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    commit = commit_id()
    bandwidth = copy_bandwidth()
    result = dict(
        benchmark="kernels_moe_sampling", device=props.name, num_sms=props.multi_processor_count,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit,
        command=" ".join([sys.executable] + sys.argv), torch=torch.__version__, triton=triton.__version__,
        copy_bandwidth_GBps=bandwidth / 1e9,
        moe_shape=dict(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER, dtype="bf16",
                       renormalize=True),
        timing=("CUDA graph of R calls over R input sets, median of 20 replays / R (the MoE reference: events "
                "around R eager calls, it syncs)"),
    )
    print(f"{props.name}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"kernels_moe_sampling-{device_tag(props.name)}.json"
    if "moe" not in args.skip:
        result["moe"] = bench_moe(bandwidth)
        path.write_text(json.dumps(result, indent=1))
    if "sampling" not in args.skip:
        result["sampling"] = bench_sampling(bandwidth)
        path.write_text(json.dumps(result, indent=1))
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
