"""Causal conv1d prefill (kernels/conv1d.py) at prompt shapes: device time of one call, in a CUDA
graph (triton.testing.do_bench_cudagraph), for the GDN conv channels of the shipped model (768)
and the 0.8B shape (6144), with rows of one prompt, two, one 8K-token prompt and 16 short ones.
Compare two trees by running it in each (bench/tools/ab.sh).

    python bench/kernels_conv.py [--out DIR]  -> DIR/kernels_conv-<gpu>.json
"""

from __future__ import annotations

import argparse
from itertools import accumulate
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from common import write_result
from deltaspec.kernels.conv1d import causal_conv1d_prefill
from deltaspec.server.acceptance_benchmark import device_name

CHANNELS = (768, 6144)
ROWS = {"1 x 545": [545], "2 x 545": [545, 545], "1 x 8192": [8192], "16 x 64": [64] * 16}


def time_us(channels: int, lengths: list[int], width: int = 4) -> float:
    device, dtype = "cuda", torch.bfloat16
    x = torch.randn(sum(lengths), channels, device=device, dtype=dtype)
    weight = torch.randn(channels, width, device=device, dtype=dtype)
    cu_seqlens = torch.tensor([0, *accumulate(lengths)], device=device, dtype=torch.int32)
    slots = torch.arange(1, len(lengths) + 1, device=device, dtype=torch.int32)
    initial = torch.ones(len(lengths), dtype=torch.bool, device=device)
    state = torch.randn(len(lengths) + 1, width - 1, channels, device=device, dtype=dtype)
    return do_bench_cudagraph(lambda: causal_conv1d_prefill(x, weight, cu_seqlens, slots, initial, state)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    results = {}
    for channels in CHANNELS:
        for name, lengths in ROWS.items():
            results[f"C={channels}, rows {name}"] = us = time_us(channels, lengths)
            print(f"C={channels:5d} rows {name:9s}: {us:7.1f} us")
    write_result(args.out, "kernels_conv", device_name("cuda"), {"us": results})


if __name__ == "__main__":
    main()
