"""What it would cost the FP8 one-row form to make its own x (#30): the 9B shape's 128 block-FP8
projections of a batch-1 step (bench/tools/fp8_gemv_chain.py's chain), graph-replayed with PDL,

  launches    x arriving quantized, with the step's quantizing launches between the projections:
              the residual add + RMSNorm after out_proj / o_proj and down (rms_norm), SwiGLU after
              gate_up (silu_and_mul), the GDN's gated norm before out_proj (gated_rms_norm);
  prologue    no such launch: every program of a projection computes its x from the bf16 row
              itself, the RMSNorm (in_proj, qkv, gate_up: the row's sum of squares, the (1 + w)
              weight, rounded to bf16), the gated norm (out_proj: by heads of 128, w, silu(z)) or
              nothing (o_proj, down), then quantizes it per group of 128, with
                exact  quantize.py's quantize_tile (IEEE division, the e4m3 rounding in float32),
                fast   the reciprocal of the scale once a group, the quotient corrected by one
                       fma (the correctly rounded quotient but in rare cases), the hardware cast;
  quantized   x arriving quantized, nothing between the projections (the floor of the two).

The prologue kernel here is an experiment: what the one-row form would run, not what it runs.

    python bench/tools/fp8_prologue_chain.py [--out bench/results]  -> fp8_prologue_chain-<gpu>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import graph_time_us, write_result  # noqa: E402
from deltaspec.kernels.activation import silu_and_mul  # noqa: E402
from deltaspec.kernels.fp8 import fp8_gemv_config, launch_fp8_gemv  # noqa: E402
from deltaspec.kernels.launch import dependent_prologue, pdl  # noqa: E402
from deltaspec.kernels.norms import gated_rms_norm, rms_norm  # noqa: E402
from deltaspec.kernels.quantize import quantize_activation, quantize_tile  # noqa: E402
from fp8_gemv_chain import GROUP, LAYERS, chain_weights  # noqa: E402  (this folder: the same chain)

HIDDEN, HEAD = 4096, 128
PLAIN, NORM, GATED = 0, 1, 2


@triton.jit
def _fast_quantize(values):
    """quantize_tile's values and scales, from one division a group instead of one an element."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(values), axis=1), 1e-10), 448.0)
    inverse = tl.math.div_rn(1.0, scale)[:, None]
    quotient = values * inverse
    quotient = tl.fma(tl.fma(-quotient, scale[:, None], values), inverse, quotient)
    return tl.clamp(quotient, -448.0, 448.0).to(tl.float8e4nv).to(tl.float32), scale


@triton.jit
def _prologue_gemv(x, gate, norm_weight, w, w_scale, y, N, K, num_groups, eps, BLOCK_N: tl.constexpr,
                   GROUPS: tl.constexpr, GROUP: tl.constexpr, INPUT: tl.constexpr, FAST: tl.constexpr,
                   HEAD: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """fp8.py's _fp8_gemv_kernel with x [1, K] bf16 made into its quantized input by every program:
    INPUT PLAIN as it is, NORM x / rms(x) * (1 + w), GATED x / rms(head) * w * silu(gate) by
    heads of HEAD (GROUP == HEAD), each rounded to bf16, then quantized (FAST: _fast_quantize)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1).to(tl.int64)
    groups = tl.arange(0, GROUPS)
    k = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    in_k = k < K
    w_tile = tl.load(w + rows[:, None, None] * K + k[None, :, :], mask=in_k[None, :, :], other=0.0)
    w_scales = tl.load(w_scale + rows[:, None] * num_groups + groups[None, :], mask=(groups < num_groups)[None, :],
                       other=0.0)
    dependent_prologue(DEPENDENT_LAUNCH)
    v = tl.load(x + k, mask=in_k, other=0.0).to(tl.float32)
    if INPUT == 1:
        rstd = tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / K + eps)
        weight = tl.load(norm_weight + k, mask=in_k, other=0.0).to(tl.float32)
        v = (v * rstd * (1.0 + weight)).to(tl.bfloat16).to(tl.float32)
    if INPUT == 2:
        rstd = tl.rsqrt(tl.sum(v * v, axis=1) / HEAD + eps)
        z = tl.load(gate + k, mask=in_k, other=0.0).to(tl.float32)
        weight = tl.load(norm_weight + k % HEAD).to(tl.float32)
        v = (v * rstd[:, None] * weight * (z * tl.sigmoid(z))).to(tl.bfloat16).to(tl.float32)
    if FAST:
        values, scales = _fast_quantize(v)
    else:
        values, scales = quantize_tile(v)
    sums = tl.sum(w_tile.to(tl.float32) * values[None, :, :], axis=2)
    acc = tl.sum(sums * w_scales * scales[None, :], axis=1)
    tl.store(y + cols, acc.to(y.dtype.element_ty), mask=cols < N)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    device = torch.device("cuda")
    bf16 = dict(device=device, dtype=torch.bfloat16)
    weights = chain_weights(device)
    configs = {shape: fp8_gemv_config(*shape, GROUP, device) for layer in LAYERS for shape in layer}
    outputs = {n: torch.empty(1, n, **bf16) for layer in LAYERS for n, _ in layer}
    rows = {k: torch.randn(1, k, **bf16) for k in (HIDDEN, 12288)}
    quantized = {k: quantize_activation(row, GROUP) for k, row in rows.items()}
    norm_weight, head_weight = torch.randn(HIDDEN, **bf16) * 0.1, torch.randn(HEAD, **bf16)
    gate, stream = torch.randn(1, HIDDEN, **bf16), torch.randn(1, HIDDEN, **bf16)
    gate_up_out = torch.randn(1, 24576, **bf16)

    def quantized_chain():
        for layer, layer_weights in zip(LAYERS, weights):
            for (n, k), (w, s) in zip(layer, layer_weights):
                launch_fp8_gemv(outputs[n], quantized[k], w, s, GROUP, configs[n, k])

    def launches_chain():
        residual = stream
        for index, (layer, layer_weights) in enumerate(zip(LAYERS, weights)):
            x = quantized[HIDDEN]
            for position, ((n, k), (w, s)) in enumerate(zip(layer, layer_weights)):
                if position == 1 and index % 4 != 3:   # the GDN's gated norm before out_proj
                    x = gated_rms_norm(rows[HIDDEN].view(1, -1, HEAD), gate.view(1, -1, HEAD), head_weight, 1e-6,
                                       quantize_group=GROUP)
                elif position == 3:                    # SwiGLU of gate_up before down
                    x = silu_and_mul(gate_up_out, GROUP)
                launch_fp8_gemv(outputs[n], x, w, s, GROUP, configs[n, k])
                if position in (1, 3):                 # the residual add + norm after the block
                    x, residual = rms_norm(outputs[n], norm_weight, 1e-6, residual, GROUP)

    def prologue_chain(fast: bool):
        for index, (layer, layer_weights) in enumerate(zip(LAYERS, weights)):
            for position, ((n, k), (w, s)) in enumerate(zip(layer, layer_weights)):
                mode = NORM if position in (0, 2) else GATED if position == 1 and index % 4 != 3 else PLAIN
                config = configs[n, k]
                _prologue_gemv[(triton.cdiv(n, config.block_n),)](
                    rows[k], gate, head_weight if mode == GATED else norm_weight, w, s, outputs[n], n, k,
                    s.shape[1], 1e-6, BLOCK_N=config.block_n, GROUPS=config.block_k // GROUP, GROUP=GROUP,
                    INPUT=mode, FAST=fast, HEAD=HEAD, num_warps=config.num_warps, **pdl(device))

    variants = {"quantized (no launches between)": (quantized_chain, 128),
                "launches (today's quantizing ops)": (launches_chain, 128 + 64 + 32 + 24),
                "prologue, exact quantization": (lambda: prologue_chain(False), 128),
                "prologue, fast quantization": (lambda: prologue_chain(True), 128)}
    results = []
    for name, (chain, launches) in variants.items():
        us = graph_time_us(lambda _: chain(), 2, replays=10)
        results.append({"variant": name, "us": us, "launches": launches})
        print(f"{name:36s}: {us:7.1f} us  ({launches} launches)")
    # The prologue's output against the launches' (rms_norm quantizing, then the one-row form) for
    # in_proj on 64 random rows: elements that differ, and by how much.
    (n, k), (w, s) = LAYERS[0][0], weights[0][0]
    config, agreement = configs[n, k], {}
    for fast in (False, True):
        differing, worst = 0, 0.0
        for seed in range(64):
            torch.manual_seed(seed + 1)
            row = torch.randn(1, k, **bf16)
            expected = torch.empty(1, n, **bf16)
            launch_fp8_gemv(expected, rms_norm(row, norm_weight, 1e-6, quantize_group=GROUP)[0], w, s, GROUP, config)
            actual = torch.empty(1, n, **bf16)
            _prologue_gemv[(triton.cdiv(n, config.block_n),)](
                row, gate, norm_weight, w, s, actual, n, k, s.shape[1], 1e-6, BLOCK_N=config.block_n,
                GROUPS=config.block_k // GROUP, GROUP=GROUP, INPUT=NORM, FAST=fast, HEAD=HEAD,
                num_warps=config.num_warps, **pdl(device))
            differing += int((actual != expected).sum())
            worst = max(worst, float((actual.float() - expected.float()).abs().max() / expected.float().abs().max()))
        agreement["fast" if fast else "exact"] = {"differing_outputs": differing, "of": 64 * n,
                                                   "worst_relative_to_the_row_max": worst}
        print(f"in_proj prologue, {'fast' if fast else 'exact'}: {differing} of {64 * n} outputs differ from the "
              f"launches', worst {worst:.2e} of the row's largest")
    write_result(args.out, "fp8_prologue_chain", torch.cuda.get_device_name(),
                 {"layers": LAYERS, "group": GROUP, "variants": results, "agreement": agreement})


if __name__ == "__main__":
    main()
