"""The FP8 one-row form (kernels/fp8.py `_fp8_gemv_kernel`) on the 9B shape's decode chain: the
128 block-FP8 projections of a batch-1 step (24 GDN layers: in_proj_qkvz, out_proj, gate_up,
down; 8 attention layers: qkv with the output gate, o_proj, gate_up, down), each its own weights,
graph-replayed with PDL as a decode step runs them, x arriving quantized (as the norms and
silu_and_mul hand it over). fp8_gemv_config's tiles against other program sizes (bytes of W a
program holds) and warps: what the config's defaults are picked from on FP8 weights.

    python bench/tools/fp8_gemv_chain.py [--out bench/results]  -> fp8_gemv_chain-<gpu>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import graph_time_us, write_result  # noqa: E402
from deltaspec.kernels.fp8 import fp8_gemv_config, launch_fp8_gemv, quantize_blocks  # noqa: E402
from deltaspec.kernels.quantize import quantize_activation  # noqa: E402

GROUP = 128
# (N, K) of the 9B shape's FP8 projections in step order, per layer kind.
GDN = [(12288, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
ATTENTION = [(10240, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
LAYERS = [ATTENTION if i % 4 == 3 else GDN for i in range(32)]


def tile(n: int, k: int, device: torch.device, program_bytes: int, num_warps: int):
    """fp8_gemv_config with other program sizes and warps; a row of the down projection (K = 12288,
    16 KB padded) is the least a program holds."""
    return fp8_gemv_config(n, k, GROUP, device, program_bytes=max(program_bytes, triton.next_power_of_2(k)),
                           num_warps=num_warps)


def chain_weights(device: torch.device) -> list:
    """Random block-FP8 weights (fp8, scales) of every projection of LAYERS, each its own."""
    torch.manual_seed(0)
    return [[quantize_blocks(torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5, (1, GROUP))
             for n, k in layer] for layer in LAYERS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    device = torch.device("cuda")
    weights = chain_weights(device)
    outputs = [[torch.empty(1, n, device=device, dtype=torch.bfloat16) for n, _ in layer] for layer in LAYERS]
    inputs = {k: quantize_activation(torch.randn(1, k, device=device, dtype=torch.bfloat16), GROUP)
              for k in {k for layer in LAYERS for _, k in layer}}
    weight_bytes = sum(w.numel() + s.numel() * 4 for layer in weights for w, s in layer)

    def chain(configs):
        for shapes, layer_weights, layer_outputs in zip(LAYERS, weights, outputs):
            for (n, k), (w, s), y in zip(shapes, layer_weights, layer_outputs):
                launch_fp8_gemv(y, inputs[k], w, s, GROUP, configs[n, k])

    shapes = {shape for layer in LAYERS for shape in layer}
    variants = [("fp8_gemv_config", {(n, k): fp8_gemv_config(n, k, GROUP, device) for n, k in shapes})]
    variants += [(f"{b >> 10} KB, {w} warps", {(n, k): tile(n, k, device, b, w) for n, k in shapes})
                 for b in (8 << 10, 16 << 10, 32 << 10) for w in (2, 4, 8)]
    rows = []
    for name, configs in variants:
        us = graph_time_us(lambda _: chain(configs), 2, replays=10)
        rows.append({"variant": name, "block_n": {f"{n}x{k}": c.block_n for (n, k), c in sorted(configs.items())},
                     "num_warps": next(iter(configs.values())).num_warps, "us": us,
                     "gb_per_s": weight_bytes / us / 1e3})
        print(f"{name:18s}: {us:7.1f} us  {rows[-1]['gb_per_s']:5.0f} GB/s  block_n {rows[-1]['block_n']}")
    write_result(args.out, "fp8_gemv_chain", torch.cuda.get_device_name(),
                 {"layers": LAYERS, "group": GROUP, "weight_bytes": weight_bytes, "variants": rows})


if __name__ == "__main__":
    main()
