"""Tile sweep of the FP8 GEMM (kernels/fp8.py launch_fp8_gemm) on the 9B projections: every
config's time as a CUDA graph of calls over weight copies (>= 256 MiB, so weights come from
HBM and the host's launch cost is not timed). The data gemm_config is chosen from.

    source bench/tools/device_setup.sh && cd bench && python3 tools/fp8_sweep.py [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from common import copy_bandwidth, device_tag, graph_time_us  # noqa: E402
from deltaspec.kernels.fp8 import FP8, gemm_config, launch_fp8_gemm, quantize_groups  # noqa: E402
from deltaspec.kernels.linear import split_k_for  # noqa: E402
from deltaspec.kernels.tiles import TileConfig  # noqa: E402

SHAPES = ((12352, 4096), (4096, 12288), (4096, 4096), (24576, 4096))


def configs(m: int, n: int, groups: int, sms: int):
    if m <= 64:
        for bn, stages, per_sm in [(32, 4, 2), *itertools.product((64, 128), (4,), (1, 2, 4)), (64, 6, 2)]:
            bm = max(16, triton.next_power_of_2(m))
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            split = split_k_for(groups, min(triton.cdiv(per_sm * sms, tiles), max(1, groups // 2)))
            yield TileConfig(block_m=bm, block_n=bn, num_splits=split, num_warps=4, num_stages=stages)
    else:
        for bm, bn, warps, stages in ((128, 128, 8, 3), (64, 128, 4, 3), (128, 128, 4, 3), (128, 256, 8, 3),
                                      (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 4), (64, 128, 4, 4)):
            yield TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,16,64,2048,8192")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "results"))
    args = parser.parse_args()
    bandwidth, sms = copy_bandwidth(), torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for (n, k), m in itertools.product(SHAPES, [int(r) for r in args.rows.split(",")]):
        copies = max(1, min(32, (256 << 20) // (n * k)))
        weights = [(torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(FP8) for _ in range(copies)]
        scale = torch.full((n, k // 128), 1e-3, device="cuda")
        x_fp8, x_scale = quantize_groups(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), 128)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        timed = []
        for config in configs(m, n, k // 128, sms):
            try:
                us = graph_time_us(lambda r: launch_fp8_gemm(y, x_fp8, x_scale, weights[r % copies], scale, 128,
                                                             config), copies, replays=10)
            except Exception as e:  # out of shared memory, say
                print("skip", config, type(e).__name__)
                continue
            timed.append((us, config))
        chosen = gemm_config(m, n, k // 128, sms)
        chosen_us = graph_time_us(lambda r: launch_fp8_gemm(y, x_fp8, x_scale, weights[r % copies], scale, 128,
                                                            chosen), copies, replays=10)
        best_us, best = min(timed, key=lambda t: t[0])
        row = {"N": n, "K": k, "M": m, "best_us": best_us, "best": repr(best), "chosen_us": chosen_us,
               "chosen": repr(chosen), "best_share_of_copy": (n * k + m * k + 2 * m * n) / (best_us * 1e-6) / bandwidth,
               "best_tflops": 2 * m * n * k / best_us / 1e6,
               "all": [(round(us, 2), repr(c)) for us, c in sorted(timed, key=lambda t: t[0])[:5]]}
        rows.append(row)
        print(f"N {n} K {k} M {m}: best {best_us:.1f} us ({100 * row['best_share_of_copy']:.0f}% bw, "
              f"{row['best_tflops']:.0f} TF) {best}; chosen {chosen_us:.1f} us", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fp8_sweep-{device_tag(torch.cuda.get_device_name())}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
