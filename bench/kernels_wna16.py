"""Weight-only int4 / int8 kernels (kernels/wna16.py) against bf16 cuBLAS and the FP8 kernel on one GPU.

    source bench/tools/device_setup.sh && python3 bench/kernels_wna16.py [--rows 1,8,64,8192] [--out DIR]
    source bench/tools/device_setup.sh && python3 bench/kernels_wna16.py --sweep [--out DIR]

(from the repo root; without --out it writes to bench/results). Writes kernels_wna16-<gpu>.json
(or, with --sweep, kernels_wna16_sweep-<gpu>.json) through common.write_result, rewritten as
parts finish, and prints a table.

GEMMs: the Qwen3.5-9B dense projections (bench/kernels_linear.py's `projections`, the shapes
bench/kernels_fp8.py times), 4-bit, groups of 128, symmetric (RTN of random weights), at each M:
  wna16   kernels.wna16.wna16_linear on bf16 x (the packed split-K GEMM up to 64 rows, the
          prefill tiles below DEQUANT_MIN_ROWS, dequantize + cuBLAS from there)
  bf16    torch.matmul (cuBLAS) on the same shape in bf16, and up to 64 rows kernels.linear.linear
          (the engine's bf16 op)
  fp8     kernels.fp8.fp8_linear (block-FP8 weights, the engine's FP8 op)
Each is first checked against wna16_linear_reference / the fp32 product (max error relative to
the largest output), then timed as a CUDA graph of R calls over R weight copies (R x W >= 256
MiB: no call finds its weight in L2), per call (`*_us`), and eagerly by do_bench's median after
a warm-up (`*_eager_us`). `wna16_share_of_copy` = packed bytes (int4 weight + fp32 scales) /
time / the copy bandwidth measured in the same run: the bar is >= 0.75 at M = 1; at 8192 rows
`wna16_over_bf16` (cuBLAS time / ours) is the bar's >= 0.8.

MoE: kernels.wna16.wna16_moe_experts (4-bit, groups of 128) vs kernels.moe.moe_experts (bf16)
at the 35B-A3B expert shape (256 experts, top-8, H 2048, I 512), random routing, at 1, 64 and
4096 tokens; `share_of_copy` over the packed bytes of the experts the batch touches.

--sweep (its own run) times alternatives the launchers' rules were not measured on: the MoE
per-token tiles at 1 and 8 tokens, the skinny GEMM's tiles (block_n x block_k x stages x
programs per SM) at M = 1, 8, 64 on out_proj, gate_up and down (with the tile wna16_config
chooses), and the prefill crossover on gate_up and down (packed GEMM tiles vs dequantize +
cuBLAS at 256 .. 8192 rows); each case records every config's time and the best.
"""

from __future__ import annotations

import argparse
import pathlib
import traceback

import torch
import triton

from common import copy_bandwidth, graph_time_us, write_result  # noqa: E402
from kernels_linear import projections  # noqa: E402
from deltaspec.kernels.fp8 import block_scales, fp8_linear, quantize_blocks
from deltaspec.kernels.linear import cublas_linear, linear, split_k_for
from deltaspec.kernels.moe import moe_experts, route
from deltaspec.kernels.tiles import TileConfig
from deltaspec.kernels.wna16 import (SKINNY_MAX_ROWS, dequantize, launch_wna16_gemm, quantize_reference, wna16_config,
                                     wna16_linear, wna16_linear_reference, wna16_moe_experts,
                                     wna16_moe_experts_per_token, wna16_moe_experts_reference)

NINE_B = dict(hidden=4096, key_heads=16, value_heads=32, heads=16, kv_heads=4, intermediate=12288, layers=32)
MOE = dict(num_experts=256, top_k=8, hidden=2048, inter=512)
GROUP, BITS = 128, 4
L2_DEFEAT_BYTES = 256 << 20
MAX_COPIES = 32


def num_copies(weight_bytes: int) -> int:
    return max(1, min(MAX_COPIES, L2_DEFEAT_BYTES // weight_bytes))


def times_us(call, copies: int) -> tuple[float, float]:
    """(per call in a CUDA graph cycling through the weight copies, do_bench's eager median);
    call(r) runs on copy r."""
    call(0)
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(lambda: call(0), warmup=25, rep=100, return_mode="median") * 1e3
    return graph_time_us(call, copies), eager


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def packed_weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`copies` RTN-quantized random weights [N, K] (4-bit, G = 128, symmetric): (qweight, scales)."""
    weights = []
    for _ in range(copies):
        qweight, scales, _ = quantize_reference(torch.randn(n, k, device="cuda") / k ** 0.5, GROUP, BITS, True)
        weights.append((qweight, scales))
    return weights


def gemm_row(name: str, n: int, k: int, m: int, bandwidth: float) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    copies = num_copies(n * k // 2)
    packed = packed_weights(n, k, copies)
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(num_copies(2 * n * k))]
    fp8 = []
    for _ in range(num_copies(n * k)):
        values, scale_inv = quantize_blocks(torch.randn(n, k, device="cuda") / k ** 0.5, (128, 128))
        per_row = scale_inv.repeat_interleave(128, dim=0)[:n].contiguous()
        fp8.append((values, per_row, block_scales(per_row, 128)))
    errors = {"wna16": relative_error(wna16_linear(x, *packed[0], None, None, GROUP, BITS),
                                      wna16_linear_reference(x, *packed[0], None, None, GROUP, BITS)),
              "fp8": relative_error(fp8_linear(x, fp8[0][0], fp8[0][1], 128, fp8[0][2]),
                                    x.float() @ (fp8[0][0].float() * fp8[0][1].repeat_interleave(128, 1)[:, :k]).T)}
    times = {"wna16": times_us(lambda r: wna16_linear(x, *packed[r % copies], None, None, GROUP, BITS), copies),
             "bf16_matmul": times_us(lambda r: torch.matmul(x, dense[r % len(dense)].T), len(dense)),
             "fp8": times_us(lambda r: fp8_linear(x, *fp8[r % len(fp8)][:2], 128, fp8[r % len(fp8)][2]), len(fp8))}
    if m <= SKINNY_MAX_ROWS:
        times["bf16_linear"] = times_us(lambda r: linear(x, dense[r % len(dense)]), len(dense))
    packed_bytes = n * k // 2 + packed[0][1].numel() * 4
    graph = {key: value[0] for key, value in times.items()}
    row = {"projection": name, "N": n, "K": k, "M": m, "packed_bytes": packed_bytes,
           **{f"{key}_us": value[0] for key, value in times.items()},
           **{f"{key}_eager_us": value[1] for key, value in times.items()},
           **{f"{key}_error": value for key, value in errors.items()},
           "wna16_share_of_copy": packed_bytes / (graph["wna16"] * 1e-6) / bandwidth,
           "wna16_over_bf16": graph["bf16_matmul"] / graph["wna16"],
           "wna16_over_fp8": graph["fp8"] / graph["wna16"]}
    if m >= 256:
        flops = 2 * m * n * k
        row.update(wna16_tflops=flops / graph["wna16"] / 1e6, bf16_tflops=flops / graph["bf16_matmul"] / 1e6,
                   wna16_over_bf16_eager=times["bf16_matmul"][1] / times["wna16"][1])
    return row


def moe_weights(num_experts: int, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed experts [E, rows, columns / 8] and scales, quantized an expert at a time."""
    parts = [quantize_reference(torch.randn(rows, columns, device="cuda") / columns ** 0.5, GROUP, BITS, True)[:2]
             for _ in range(num_experts)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def moe_case(tokens: int):
    """x [T, H] and random top-k routing over the experts."""
    e, top_k = MOE["num_experts"], MOE["top_k"]
    x = torch.randn(tokens, MOE["hidden"], device="cuda", dtype=torch.bfloat16)
    weights, experts = route(torch.randn(tokens, e, device="cuda", dtype=torch.bfloat16), top_k, True)
    return x, weights, experts


def moe_row(tokens: int, packed: tuple, dense: tuple, bandwidth: float) -> dict:
    """One copy of a layer's experts (~200 MiB packed, 1.5 GiB in bf16) already defeats L2."""
    x, weights, experts = moe_case(tokens)
    args = (x, weights, experts, packed[0], packed[1], None, packed[2], packed[3], None, GROUP, BITS)
    error = relative_error(wna16_moe_experts(*args), wna16_moe_experts_reference(*args))
    ours = times_us(lambda r: wna16_moe_experts(*args), 1)
    bf16 = times_us(lambda r: moe_experts(x, weights, experts, *dense), 1)
    touched = int(torch.unique(experts).numel())
    per_expert = sum(t[0].numel() * 4 + t[1].numel() * 4 for t in ((packed[0], packed[1]), (packed[2], packed[3]))) \
        // MOE["num_experts"]
    return {"tokens": tokens, "wna16_us": ours[0], "bf16_us": bf16[0], "wna16_eager_us": ours[1],
            "bf16_eager_us": bf16[1], "wna16_error": error, "experts_touched": touched,
            "share_of_copy": touched * per_expert / (ours[0] * 1e-6) / bandwidth, "wna16_over_bf16": bf16[0] / ours[0]}


def sweep_skinny(name: str, n: int, k: int, m: int) -> dict:
    """launch_wna16_gemm over tiles x split-K for 1, 2 and 4 programs per SM."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    copies = num_copies(n * k // 2)
    packed = packed_weights(n, k, copies)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_m = max(16, triton.next_power_of_2(m))
    results = []
    for block_n in (64, 128):
        for block_k in (64, 128):
            for stages in (3, 4):
                for per_sm in (1, 2, 4):
                    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
                    splits = split_k_for(triton.cdiv(k, block_k), triton.cdiv(per_sm * sms, tiles))
                    config = TileConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_splits=splits,
                                        num_warps=4, num_stages=stages)
                    try:
                        us = graph_time_us(lambda r: launch_wna16_gemm(y, x, *packed[r % copies], None, None, GROUP,
                                                                       BITS, config), copies)
                    except Exception as exc:  # noqa: BLE001 (shared memory past the device's: recorded, skipped)
                        results.append({"config": repr(config), "error": str(exc)[:200]})
                        continue
                    results.append({"config": repr(config), "us": us})
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"])
    chosen = repr(wna16_config(m, n, k, GROUP, x.device))
    return {"projection": name, "N": n, "K": k, "M": m, "best": best, "chosen": chosen, "configs": results}


def sweep_prefill(name: str, n: int, k: int, m: int) -> dict:
    """Packed GEMM (wna16_config's prefill tile and a 64-row one) vs dequantize + cuBLAS."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    copies = num_copies(n * k // 2)
    packed = packed_weights(n, k, copies)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    configs = {"tiles_128": TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
               "tiles_64": TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
               "tiles_128x256": TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)}
    row = {"projection": name, "N": n, "K": k, "M": m}
    for key, config in configs.items():
        row[f"{key}_us"] = graph_time_us(
            lambda r: launch_wna16_gemm(y, x, *packed[r % copies], None, None, GROUP, BITS, config), copies)
    row["dequantize_us"] = graph_time_us(lambda r: dequantize(*packed[r % copies], None, GROUP, BITS, x.dtype), copies)
    row["dequantize_cublas_us"] = graph_time_us(
        lambda r: cublas_linear(x, dequantize(*packed[r % copies], None, GROUP, BITS, x.dtype)), copies)
    return row


def sweep_moe_per_token(tokens: int, packed: tuple) -> dict:
    x, weights, experts = moe_case(tokens)
    results = []
    for block_n in (16, 32, 64):
        for warps in (1, 2, 4):
            for stages in (3, 4):
                config = TileConfig(block_n=block_n, block_k=128, num_warps=warps, num_stages=stages)
                us = graph_time_us(lambda r: wna16_moe_experts_per_token(
                    x, weights, experts, packed[0], packed[1], None, packed[2], packed[3], None, GROUP, BITS,
                    config, config), 1)
                results.append({"config": repr(config), "us": us})
    return {"tokens": tokens, "best": min(results, key=lambda r: r["us"]), "configs": results}


def run_sweeps(out: pathlib.Path, gpu: str) -> None:
    """The --sweep run: kernels_wna16_sweep-<gpu>.json, rewritten after each part."""
    e, h, i = MOE["num_experts"], MOE["hidden"], MOE["inter"]
    packed = (*moe_weights(e, 2 * i, h), *moe_weights(e, h, i))
    shapes = [p for p in projections(**NINE_B) if p[0] in ("gdn.out_proj", "mlp.gate_up", "mlp.down")]
    results = {"torch": torch.__version__, "triton": triton.__version__, "group_size": GROUP, "bits": BITS}
    parts = (("moe_per_token", lambda: [sweep_moe_per_token(tokens, packed) for tokens in (1, 8)]),
             ("skinny", lambda: [sweep_skinny(name, n, k, m) for name, n, k, _ in shapes for m in (1, 8, 64)]),
             ("prefill", lambda: [sweep_prefill(name, n, k, m) for name, n, k, _ in shapes[1:]
                                  for m in (256, 1024, 2048, 8192)]))
    for key, run in parts:
        try:
            results[key] = run()
        except Exception:  # noqa: BLE001 (keep what the other parts measured)
            results[key] = {"error": traceback.format_exc()[-2000:]}
        print(key, "done")
        write_result(out, "kernels_wna16_sweep", gpu, results)
    for row in results["skinny"] if isinstance(results["skinny"], list) else []:
        print(f"{row['projection']:14} M {row['M']:3}: best {row['best']['us']:7.1f} us {row['best']['config']}; "
              f"chosen {row['chosen']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,64,8192")
    parser.add_argument("--moe-tokens", default="1,64,4096")
    parser.add_argument("--sweep", action="store_true", help="the sweeps instead of the main table")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    out = pathlib.Path(args.out)
    if args.sweep:
        run_sweeps(out, gpu)
        return
    bandwidth = copy_bandwidth()
    results = {"torch": torch.__version__, "triton": triton.__version__, "copy_bandwidth_bytes_per_s": bandwidth,
               "group_size": GROUP, "bits": BITS, "gemm": [], "moe": []}
    print(f"{gpu}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'projection':14} {'N':>6} {'K':>6} {'M':>5} {'wna16 us':>9} {'%copy':>6} {'bf16 us':>8} {'fp8 us':>8} "
          f"{'x bf16':>7} {'x fp8':>6} {'error':>8}")
    for name, n, k, _ in projections(**NINE_B):
        for m in (int(r) for r in args.rows.split(",")):
            row = gemm_row(name, n, k, m, bandwidth)
            results["gemm"].append(row)
            print(f"{name:14} {n:6} {k:6} {m:5} {row['wna16_us']:9.1f} {100 * row['wna16_share_of_copy']:5.1f}% "
                  f"{row['bf16_matmul_us']:8.1f} {row['fp8_us']:8.1f} {row['wna16_over_bf16']:7.2f} "
                  f"{row['wna16_over_fp8']:6.2f} {row['wna16_error']:8.1e}")
        write_result(out, "kernels_wna16", gpu, results)
    e, h, i = MOE["num_experts"], MOE["hidden"], MOE["inter"]
    packed = (*moe_weights(e, 2 * i, h), *moe_weights(e, h, i))
    dense = (torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5,
             torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i ** 0.5)
    for tokens in (int(t) for t in args.moe_tokens.split(",")):
        row = moe_row(tokens, packed, dense, bandwidth)
        results["moe"].append(row)
        print(f"moe {tokens:5} tokens: wna16 {row['wna16_us']:8.1f} us ({100 * row['share_of_copy']:.0f}% of copy "
              f"over {row['experts_touched']} experts), bf16 {row['bf16_us']:8.1f} us, x{row['wna16_over_bf16']:.2f}, "
              f"error {row['wna16_error']:.1e}")
    write_result(out, "kernels_wna16", gpu, results)


if __name__ == "__main__":
    main()
