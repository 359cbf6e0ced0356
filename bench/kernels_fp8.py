"""Block-FP8 kernels (kernels/fp8.py) against their bf16 twins on one GPU, side by side in one run.

    source bench/tools/device_setup.sh && python3 bench/kernels_fp8.py [--rows 1,16,64,256,2048,8192] [--out DIR]

(from the repo root; without --out it writes to bench/results). Writes kernels_fp8-<gpu>.json
and .png and prints a table.

GEMMs: the dense projections of the Qwen3.5-9B and 35B-A3B shapes (bench/kernels_linear.py's
`projections`; 35B-A3B's MLP is its shared expert), y[M, N] = x[M, K] @ W[N, K]^T at each M:
  fp8   kernels.fp8.fp8_linear on bf16 x (group quantizer + Triton GEMM, split-K up to 64 rows;
        past 64 rows cuBLAS's block-scaled GEMM on sm_90)
  fp8 GEMM  up to 64 rows, the GEMM alone on x quantized beforehand (a QuantizedActivation): how
        the engine's decode, verify and draft batches call it, the op before having quantized x
        (the bar's figure: `fp8_gemm_share_of_copy`)
  bf16  kernels.linear.linear (the engine's bf16 op: the skinny kernel where its rule picks it,
        else F.linear) and torch.matmul (cuBLAS) in bf16
read floor  up to 64 rows, a kernel that only reads the fp8 weight once (bench/stream_read.py,
        decode_floor.py's read kernel), timed the same way: no GEMM that reads
        those bytes can be faster, so `fp8_gemm_over_read_floor` says how far the GEMM is from
        the physics of the shape (launch, ramp-up and tail included), not just from the copy
        bandwidth of a large buffer
Time, two ways: `*_us` a CUDA graph of R calls over R weight copies (R x W >= 256 MiB, so no call
finds its weight in L2), per call — the kernels' time, as the engine's graphed decode steps see
it; `*_eager_us` triton.testing.do_bench's median after a warm-up (L2 flushed before every
call) — with the host's launch cost where it exceeds the kernels' (short calls). Bytes = weight
(+ fp8 block scales) + x + y; `share_of_copy` = bytes / time / copy bandwidth measured in the
same run (bench/common.py); TFLOP/s = 2MNK / time.
The issue's bars: the skinny FP8 GEMM >= 80% of copy bandwidth on the 9B projections at M = 1,
FP8 >= 1.3x torch.matmul bf16 at 8K rows. Prefill batches run eagerly in the engine (cuBLAS's
block-scaled GEMM is not used under graph capture), so at M >= 256 `prefill_speedup` is the eager
figure: torch.matmul's do_bench median over fp8_linear's.

MoE: kernels.fp8.fp8_moe_experts vs kernels.moe.moe_experts (bf16) at the 35B-A3B expert shape
(256 experts, top-8, H 2048, I 512), random routing, at each M tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
import triton

from common import commit_id, copy_bandwidth, device_tag, graph_time_us  # noqa: E402
from kernels_linear import projections  # noqa: E402
from stream_read import ReadConfig, stream_read  # noqa: E402
from deltaspec.kernels.fp8 import FP8, SKINNY_MAX_ROWS, block_scales, fp8_linear, fp8_moe_experts
from deltaspec.kernels.linear import linear
from deltaspec.kernels.quantize import quantize_activation
from deltaspec.kernels.moe import moe_experts, route

MODELS = {
    "9b": dict(hidden=4096, key_heads=16, value_heads=32, heads=16, kv_heads=4, intermediate=12288, layers=32),
    "35b-a3b": dict(hidden=2048, key_heads=16, value_heads=32, heads=16, kv_heads=2, intermediate=512, layers=40),
}
MOE = dict(num_experts=256, top_k=8, hidden=2048, inter=512)
GROUP = 128
L2_DEFEAT_BYTES = 256 << 20
READ = ReadConfig()  # the read floor's launch: 2048-word tiles, 4 programs per SM


def times_us(call, num_copies: int) -> tuple[float, float]:
    """(per call in a CUDA graph cycling through the weight copies, do_bench eager median);
    call(r) runs on copy r."""
    call(0)
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(lambda: call(0), warmup=25, rep=100, return_mode="median") * 1e3
    return graph_time_us(call, num_copies), eager


def num_copies(weight_bytes: int) -> int:
    return max(1, min(32, L2_DEFEAT_BYTES // weight_bytes))


def fp8_weight(num_rows: int, num_columns: int, *batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = (torch.randn(*batch, num_rows, num_columns, device="cuda") * 64).clamp(-448, 448).to(FP8)
    scale = torch.full((*batch, num_rows, triton.cdiv(num_columns, GROUP)), 1 / (64 * num_columns ** 0.5),
                       device="cuda")
    return values, scale


def gemm_row(model: str, name: str, n: int, k: int, m: int, bandwidth: float) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    copies = num_copies(n * k)
    w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    w8 = [(*w_s, block_scales(w_s[1], GROUP)) for w_s in (fp8_weight(n, k) for _ in range(copies))]
    times = {"fp8": times_us(lambda r: fp8_linear(x, *w8[r % copies][:2], GROUP, w8[r % copies][2]), copies),
             "bf16_linear": times_us(lambda r: linear(x, w[r % copies]), copies),
             "bf16_matmul": times_us(lambda r: torch.matmul(x, w[r % copies].T), copies)}
    if m <= SKINNY_MAX_ROWS:
        quantized = quantize_activation(x, GROUP)
        times["fp8_gemm"] = times_us(lambda r: fp8_linear(quantized, *w8[r % copies][:2], GROUP, w8[r % copies][2]),
                                     copies)
        words = [w8[r][0].view(torch.int32).reshape(-1) for r in range(copies)]
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        sums = torch.empty(READ.num_programs(words[0].numel(), num_sms), dtype=torch.int32, device="cuda")
        times["read_floor"] = times_us(lambda r: stream_read(words[r % copies], sums, READ, False), copies)
    activations = m * k * 2 + m * n * 2
    fp8_bytes = n * k + w8[0][1].numel() * 4 + activations
    bf16_bytes = n * k * 2 + activations
    graph = {key: value[0] for key, value in times.items()}
    row = {"model": model, "projection": name, "N": n, "K": k, "M": m,
           **{f"{key}_us": value[0] for key, value in times.items()},
           **{f"{key}_eager_us": value[1] for key, value in times.items()},
           "fp8_share_of_copy": fp8_bytes / (graph["fp8"] * 1e-6) / bandwidth,
           "bf16_linear_share_of_copy": bf16_bytes / (graph["bf16_linear"] * 1e-6) / bandwidth,
           "speedup_vs_bf16_linear": graph["bf16_linear"] / graph["fp8"],
           "speedup_vs_bf16_matmul": graph["bf16_matmul"] / graph["fp8"]}
    if "fp8_gemm" in graph:  # fp8 x and its scales in, bf16 y out
        gemm_bytes = n * k + w8[0][1].numel() * 4 + m * k + quantized.scale.numel() * 4 + m * n * 2
        row.update(fp8_gemm_share_of_copy=gemm_bytes / (graph["fp8_gemm"] * 1e-6) / bandwidth,
                   fp8_gemm_speedup_vs_bf16_linear=graph["bf16_linear"] / graph["fp8_gemm"],
                   read_floor_share_of_copy=n * k / (graph["read_floor"] * 1e-6) / bandwidth,
                   fp8_gemm_over_read_floor=graph["fp8_gemm"] / graph["read_floor"])
    if m >= 256:
        flops = 2 * m * n * k
        eager = {key: value[1] for key, value in times.items()}
        row.update(fp8_tflops=flops / graph["fp8"] / 1e6, bf16_matmul_tflops=flops / graph["bf16_matmul"] / 1e6,
                   prefill_speedup=eager["bf16_matmul"] / eager["fp8"])
    return row


def moe_row(m: int) -> dict:
    """One copy of a layer's experts (512 MiB in FP8) already defeats L2."""
    e, top_k, h, i = MOE["num_experts"], MOE["top_k"], MOE["hidden"], MOE["inter"]
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    weights, experts = route(torch.randn(m, e, device="cuda", dtype=torch.bfloat16), top_k, True)
    w_gate_up = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5
    w_down = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i ** 0.5
    gu8, gus = fp8_weight(2 * i, h, e)
    dn8, dns = fp8_weight(h, i, e)
    fp8 = times_us(lambda r: fp8_moe_experts(x, weights, experts, gu8, gus, dn8, dns, GROUP), 1)
    bf16 = times_us(lambda r: moe_experts(x, weights, experts, w_gate_up, w_down), 1)
    return {"tokens": m, "fp8_us": fp8[0], "bf16_us": bf16[0], "fp8_eager_us": fp8[1], "bf16_eager_us": bf16[1],
            "speedup": bf16[0] / fp8[0], "experts_touched": int(torch.unique(experts).numel())}


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for model in MODELS:
        for name in dict.fromkeys(r["projection"] for r in result["gemm"] if r["model"] == model):
            rows = [r for r in result["gemm"] if r["model"] == model and r["projection"] == name]
            left.plot([r["M"] for r in rows], [r["speedup_vs_bf16_linear"] for r in rows], marker="o",
                      label=f"{model} {name}")
    left.axhline(1.0, color="gray", lw=0.8)
    left.set(xscale="log", xlabel="rows M", ylabel="bf16 linear time / fp8 time", title="FP8 GEMM speedup")
    left.legend(fontsize=7)
    moe = result["moe"]
    right.plot([r["tokens"] for r in moe], [r["speedup"] for r in moe], marker="o")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xscale="log", xlabel="tokens", ylabel="bf16 time / fp8 time", title="35B-A3B experts: FP8 vs bf16")
    fig.suptitle(f"{result['device']} @ {result['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,16,64,256,2048,8192")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    result = {"benchmark": "kernels_fp8", "device": gpu,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python3"] + sys.argv), "torch": torch.__version__,
              "triton": triton.__version__, "copy_bandwidth_bytes_per_s": bandwidth, "gemm": [], "moe": []}
    print(f"{gpu}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'model':8} {'projection':14} {'N':>6} {'K':>6} {'M':>5} {'fp8 us':>8} {'bf16 us':>8} {'mm us':>8} "
          f"{'x bf16':>7} {'fp8 %bw':>8} {'fp8 TF':>7} {'mm TF':>7} {'gemm us':>8} {'gemm %bw':>9} {'floor us':>9} "
          f"{'eager x mm':>10}")
    for model, shape in MODELS.items():
        for name, n, k, _ in projections(**shape):
            for m in rows:
                row = gemm_row(model, name, n, k, m, bandwidth)
                result["gemm"].append(row)
                print(f"{model:8} {name:14} {n:6} {k:6} {m:5} {row['fp8_us']:8.1f} {row['bf16_linear_us']:8.1f} "
                      f"{row['bf16_matmul_us']:8.1f} {row['speedup_vs_bf16_linear']:7.2f} "
                      f"{100 * row['fp8_share_of_copy']:7.1f}% {row.get('fp8_tflops', 0):7.0f} "
                      f"{row.get('bf16_matmul_tflops', 0):7.0f} {row.get('fp8_gemm_us', 0):8.1f} "
                      f"{100 * row.get('fp8_gemm_share_of_copy', 0):8.1f}% {row.get('read_floor_us', 0):9.1f} "
                      f"{row.get('prefill_speedup', 0):10.2f}")
    for m in rows:
        row = moe_row(m)
        result["moe"].append(row)
        print(f"moe {m:5} tokens: fp8 {row['fp8_us']:8.1f} us, bf16 {row['bf16_us']:8.1f} us, x{row['speedup']:.2f}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernels_fp8-{device_tag(gpu)}.json"
    path.write_text(json.dumps(result, indent=2))
    plot(result, path.with_suffix(".png"))
    print("wrote", path)


if __name__ == "__main__":
    main()
