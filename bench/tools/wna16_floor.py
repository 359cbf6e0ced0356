"""What holds the packed int4 GEMM at one row (kernels/wna16.py): the 9B's projections, 4-bit,
groups of 128, each timed as a CUDA graph over weight copies (no call finds its weight in L2):

  engine   kernels.wna16.wna16_linear at one row (the split-K MMA form, wna16_config's tiles)
  read     a kernel that only reads the same packed words in tiles [rows x words] with the
           given K splits and XORs them: the floor the tile shape and the split leave
  gemv     a CUDA-core GEMV written here (no MMA: values unpacked by shift, mask and fp32's
           magic number, times x, summed): what the bytes cost without tensor cores

Each figure is (µs, share of the copy bandwidth over the packed bytes and the fp32 scales); the
GEMV also its largest error relative to the largest output of wna16_linear_reference.
The GEMV kernel is an experiment here, not what the engine runs. `ncu` over the engine's kernel
and the GEMV (bench/results/wna16_floor-h200.json's notes) says where their time goes.

    python bench/tools/wna16_floor.py [--out bench/results]   -> wna16_floor-<gpu>.json
"""
import argparse
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from common import copy_bandwidth, graph_time_us, write_result  # noqa: E402
from kernels_wna16 import GROUP, num_copies, packed_weights  # noqa: E402
from deltaspec.kernels.wna16 import wna16_linear, wna16_linear_reference  # noqa: E402

SHAPES = {"in_proj": (12352, 4096), "gate_up": (24576, 4096), "down": (4096, 12288), "out_proj": (4096, 4096)}
READ_TILES = [(128, 16, 2), (128, 16, 8), (128, 32, 2), (64, 64, 2), (16, 128, 1), (16, 64, 1), (8, 128, 1),
              (32, 128, 1), (8, 256, 1), (4, 512, 1)]                   # rows, words, K splits
GEMV_TILES = [(16, 64, 1, 4), (8, 64, 1, 4), (16, 32, 1, 4), (32, 32, 1, 4), (8, 128, 1, 4), (16, 64, 2, 4),
              (4, 128, 1, 4), (16, 64, 1, 8), (8, 64, 4, 4)]             # rows, words, K splits, warps


@triton.jit
def _read_tiles(w, out, words_per_row, N, steps_per_split, BN: tl.constexpr, BW: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.minimum(pid_n * BN + tl.arange(0, BN), N - 1).to(tl.int64)
    acc = tl.zeros((BN, BW), tl.int32)
    for step in range(pid_k * steps_per_split, (pid_k + 1) * steps_per_split):
        acc ^= tl.load(w + rows[:, None] * words_per_row + (step * BW + tl.arange(0, BW))[None, :])
    tl.store(out + pid_n * 1024 + pid_k, tl.sum(acc))


@triton.jit
def _gemv(x, w, scales, y, words_per_row, N, num_groups, steps_per_split, BN: tl.constexpr, BW: tl.constexpr,
          SPLIT: tl.constexpr):
    """y[n] = sum_k (q[n, k] - 8) s[n, k // 128] x[k]: x one fp32 row, W [N, K / 8] int32."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs = pid_n * BN + tl.arange(0, BN)
    rows = tl.minimum(offs, N - 1).to(tl.int64)
    GW: tl.constexpr = 16                                                   # words a group
    acc = tl.zeros((BN,), tl.float32)
    shifts = tl.arange(0, 8) * 4
    for step in range(pid_k * steps_per_split, (pid_k + 1) * steps_per_split):
        words = step * BW + tl.arange(0, BW)
        q = tl.load(w + rows[:, None] * words_per_row + words[None, :])                    # [BN, BW]
        xs = tl.load(x + words[:, None] * 8 + tl.arange(0, 8)[None, :])                     # [BW, 8]
        # 2^23 + q as fp32's bits, less 2^23 + 8: q - 8 exactly
        v = (((q[:, :, None] >> shifts[None, None, :]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) \
            - 8388616.0
        part = tl.sum(tl.reshape(tl.sum(v * xs[None, :, :], axis=2), (BN, BW // GW, GW)), axis=2)
        g = step * (BW // GW) + tl.arange(0, BW // GW)
        acc += tl.sum(part * tl.load(scales + rows[:, None] * num_groups + g[None, :]), axis=1)
    if SPLIT == 1:
        tl.store(y + offs, acc, mask=offs < N)
    else:
        tl.atomic_add(y + offs, acc, mask=offs < N)


def measure(name: str, n: int, k: int, bandwidth: float) -> dict:
    copies = num_copies(n * k // 2)
    packed = packed_weights(n, k, copies)
    nbytes = n * k // 2 + n * (k // GROUP) * 4
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    reference = wna16_linear_reference(x.float(), *packed[0], None, None, GROUP, 4).reshape(-1)
    share = lambda us: round(nbytes / (us * 1e-6) / bandwidth, 3)  # noqa: E731
    row = {"shape": name, "N": n, "K": k, "packed_bytes": nbytes}
    us = graph_time_us(lambda r: wna16_linear(x, *packed[r % copies], None, None, GROUP, 4), copies)
    row["engine"] = (round(us, 2), share(us))
    out = torch.empty(1 << 22, dtype=torch.int32, device="cuda")
    words_per_row = k // 8
    for rows, words, splits in READ_TILES:
        steps = words_per_row // words
        if steps % splits or n % rows:
            continue
        for warps in (4, 8):
            us = graph_time_us(lambda r: _read_tiles[(n // rows, splits)](
                packed[r % copies][0], out, words_per_row, n, steps // splits, BN=rows, BW=words, num_warps=warps),
                copies)
            row[f"read_{rows}x{words}x{splits}_w{warps}"] = (round(us, 2), share(us))
    x32 = x.float().reshape(-1)
    for rows, words, splits, warps in GEMV_TILES:
        steps = words_per_row // words
        if steps % splits or n % rows:
            continue
        y = torch.zeros(n, device="cuda")

        def call(r, y=y, rows=rows, words=words, splits=splits, warps=warps, steps=steps):
            if splits > 1:
                y.zero_()
            _gemv[(n // rows, splits)](x32, packed[r % copies][0], packed[r % copies][1], y, words_per_row, n,
                                       k // GROUP, steps // splits, BN=rows, BW=words, SPLIT=splits, num_warps=warps)
        call(0)
        error = ((y - reference).abs().max() / reference.abs().max()).item()
        us = graph_time_us(call, copies)
        row[f"gemv_{rows}x{words}x{splits}_w{warps}"] = (round(us, 2), share(us), round(error, 6))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    results = {"copy_bandwidth_bytes_per_s": bandwidth, "group_size": GROUP, "bits": 4, "rows": []}
    for name, (n, k) in SHAPES.items():
        results["rows"].append(measure(name, n, k, bandwidth))
        print(results["rows"][-1], flush=True)
    write_result(args.out, "wna16_floor", torch.cuda.get_device_name(), results)


if __name__ == "__main__":
    main()
