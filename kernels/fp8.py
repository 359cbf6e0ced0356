"""Block-FP8 W8A8 linear layers: y = x W^T with W in float8_e4m3fn and block scales, x quantized
on the fly per token in groups of G columns (dynamic activation scales, as vLLM's
per_token_group_quant_fp8 and w8a8_block_fp8_matmul).

Layouts (M rows of x, N output features, K input features, G the group = the weight block's
columns, KB = ceil(K / G)):
    weight        [N, K]  float8_e4m3fn
    weight_scale  [N, KB] float32: the checkpoint's `weight_scale_inv` [ceil(N / bn), KB]
                  repeated over each block's bn rows, so fused projections whose parts are not
                  multiples of bn rows concatenate row by row (4 bytes per G weights, 3% at 128)
    x_fp8         [M, K]  float8_e4m3fn, x_scale [M, KB] float32 (scale = group amax / 448;
                  quantize.py)
The real weight is weight * weight_scale and the real x is x_fp8 * x_scale, elementwise over
their groups; the product sums them exactly in fp32 up to summation order.

`fp8_linear_reference` (the CPU table, and the oracle) dequantizes both and runs one fp32 GEMM;
`fp8_linear` (the GPU table) runs the group quantizer then `_fp8_gemm_kernel`, a tiled GEMM
with one tl.dot on fp8 tiles per group (needs sm_89+) scaled by both groups' scales. For decode,
verify and draft batches (<= 64 rows) the same kernel splits K over the SMs (the weight's bytes
are the time: half of bf16's) and its last program per tile sums the partials (arrivals.py);
one row (a decode step of one sequence, a draft) takes the one-row form (`_fp8_gemv_kernel`,
linear.py's for FP8 weights), whose programs hold their share of W in registers, loaded before
the PDL wait, and quantize x themselves where it comes plain.
The GDN's decode conv of its first columns (`conv`, linear.py's epilogue) runs in the one-row
form's launch too.
Prefill batches of a weight whose scales are whole 128 x 128 blocks (`block_scales`) run cuBLAS's
block-scaled FP8 GEMM on sm_90 instead (1.6x bf16 there; the Triton GEMM is 0.7x). Both ops
take x plain or as a QuantizedActivation (quantize.py): an op before the projection that fused the
quantizer (the norms, silu_and_mul at decode batches), whose x_fp8 and x_scale the GEMM reads
instead of quantizing x again.

`fp8_moe_experts_reference` is the MoE expert op on FP8 expert weights; `fp8_moe_experts` its
Triton twin, over moe.py's expert-sorted row blocks (one way of routing pairs to experts for the
bf16 and the FP8 experts), with the down GEMM's activation quantizer fused into the gate/up GEMM.
Every launch is sized from shapes: graph-safe. Quantizing kernels round as quantize.py's
(`quantize_tile`), bit-equal to the reference under the interpreter too. Knows nothing about
checkpoints: scales arrive already repeated over rows.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_reference
from .arrivals import arrival_counters, store_split_k
from .conv1d import ConvDecode, causal_conv1d_decode, causal_conv1d_decode_reference, check_conv_decode_args
from .device import INTERPRETED, num_sms
from .launch import dependent_prologue, pdl
from .linear import conv_arguments, conv_constants, conv_epilogue, conv_shape, gemv_config, split_k_for
from .moe import block_rows, by_expert_reference, grouped_config, sort_pairs, store_weighted_pairs, sum_slots
from .quantize import (FP8, FP8_MAX, SCALE_FLOOR, Activation, QuantizedActivation, activation_values,
                       quantize_groups, quantize_groups_reference, quantize_tile, quantized_groups)
from .tiles import TileConfig

def expand_groups(scale: torch.Tensor, group_size: int, num_columns: int) -> torch.Tensor:
    """[..., KB] per-group scales -> [..., K] per-column scales."""
    return scale.repeat_interleave(group_size, dim=-1)[..., :num_columns]


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (float8_e4m3fn [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)]
    float32): the official checkpoints' block format, each bn x bk block's amax mapped to 448
    (weight ~= fp8 * scale_inv over the block). Runs on the weight's device (online FP8 loading
    quantizes on the GPU), in float32 with IEEE divisions: bit-equal on every device."""
    *batch, num_rows, num_columns = weight.shape
    bn, bk = block
    nb, kb = triton.cdiv(num_rows, bn), triton.cdiv(num_columns, bk)
    padded = weight.new_zeros(*batch, nb * bn, kb * bk, dtype=torch.float32)
    padded[..., :num_rows, :num_columns] = weight
    blocks = padded.view(*batch, nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=SCALE_FLOOR) / FP8_MAX
    quantized = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view(*batch, nb * bn, kb * bk)[..., :num_rows, :num_columns].contiguous(), scale


def dequantize_reference(values: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp8 values [..., K] and their group scales [..., KB] -> float32 [..., K]."""
    return values.float() * expand_groups(scale, group_size, values.shape[-1])


def fp8_linear_reference(x: Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
                         group_size: int, block_scale: torch.Tensor | None = None,
                         conv: ConvDecode | None = None) -> torch.Tensor:
    """x [M, K] (float) @ dequantized weight [N, K]^T -> [M, N] in x's dtype, with x quantized
    per token group first, as the kernel does (or as it comes: a QuantizedActivation). block_scale
    (the same scales per block of rows, for fp8_linear's cuBLAS path) changes nothing here.
    conv: the GDN's decode conv of the result's first conv.weight.shape[0] columns, into
    conv.out and conv.pending_out (linear_reference's)."""
    x_fp8, x_scale = quantized_groups(x, group_size, quantize_groups_reference)
    product = dequantize_reference(x_fp8, x_scale, group_size) @ dequantize_reference(weight, weight_scale, group_size).T
    y = product.to(activation_values(x).dtype)
    if conv is not None:
        causal_conv1d_decode_reference(y[:, :conv.weight.shape[0]], *conv)
    return y


def fp8_moe_experts_reference(x: Activation, weights: torch.Tensor, experts: torch.Tensor,
                              w_gate_up: torch.Tensor, gate_up_scale: torch.Tensor, w_down: torch.Tensor,
                              down_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """moe_experts_reference with FP8 experts: w_gate_up [E, 2I, H] fp8 + gate_up_scale
    [E, 2I, ceil(H/G)], w_down [E, H, I] fp8 + down_scale [E, H, ceil(I/G)]; both GEMM inputs
    (x and the SwiGLU output) quantized per token group. x: [T, H]; weights, experts: [T, k].
    A QuantizedActivation x is read as its values: each expert requantizes its rows, which gives
    the same groups (the quantization is row by row)."""
    def mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = fp8_linear_reference(rows, w_gate_up[expert], gate_up_scale[expert], group_size)
        return fp8_linear_reference(silu_and_mul_reference(gate_up), w_down[expert], down_scale[expert], group_size)

    return by_expert_reference(activation_values(x), weights, experts, w_gate_up.shape[0], mlp)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "groups_per_split"])
def _fp8_gemm_kernel(x_fp8, x_scale, w, w_scale, y, partials, arrivals, M, N, K, num_groups, groups_per_split,
                     stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (m tile, n tile, K split): y = sum over groups g of (x_fp8[:, g] @ w[:, g]^T) *
    x_scale[:, g] (per row) * w_scale[:, g] (per output feature), fp32 accumulation. One K step
    is one group, so each partial product has exactly one scale per row and per column.
    Out-of-range rows, columns and the K tail load as 0 (fp8 0 is exact).

    SPLIT_K > 1 (decode shapes: few m tiles times n tiles would leave SMs idle): the program
    sums groups [pid_k * groups_per_split, +groups_per_split) into its fp32 partial
    [SPLIT_K, M, N]; the last program of an (m, n) tile to arrive (arrivals.py) adds the
    partials in split order (deterministic) and writes y, as kernels/linear.py does.

    Tiles run in groups of GROUP_M m tiles down each n tile (the matmul tutorial's order), so
    the programs in flight share x's rows and W's rows in L2 instead of streaming x once per n
    tile."""
    dependent_prologue(DEPENDENT_LAUNCH)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m_tiles, num_n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n_tiles)) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n_tiles)) % group_rows
    pid_n = (pid % (GROUP_M * num_n_tiles)) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows_x, rows_w = offs_m.to(tl.int64), offs_n.to(tl.int64)
    first = pid_k * groups_per_split
    last = tl.minimum(first + groups_per_split, num_groups)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(first, last):
        k = g * GROUP + offs_k
        k_ok = k < K
        a = tl.load(x_fp8 + rows_x[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + rows_w[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(x_scale + rows_x * num_groups + g, mask=m_ok, other=0.0)
        b_scale = tl.load(w_scale + rows_w * num_groups + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]
    tile = rows_x[:, None] * N + offs_n[None, :]                         # within one [M, N] partial
    store_split_k(acc, y + rows_x[:, None] * stride_ym + offs_n[None, :], m_ok[:, None] & n_ok[None, :], partials,
                  tile, M * N, pid_k, arrivals + pid, SPLIT_K)


@triton.jit
def _fp8_gemv_kernel(x, x_fp8, x_scale, w, w_scale, y, N, K, num_groups,
                     conv_weight, cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts, conv_out,
                     conv_pending_out, conv_rows, stride_conv_out,
                     BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr, QUANTIZE: tl.constexpr,
                     CONV: tl.constexpr, C: tl.constexpr, WIDTH: tl.constexpr,
                     P: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, COMMIT: tl.constexpr,
                     DEPENDENT_LAUNCH: tl.constexpr):
    """The one-row form (linear.py's _gemv_kernel, for block-FP8 weights): program pid computes
    y[0, tile] for BLOCK_N rows of W, holding its whole [BLOCK_N, K] share of W (as [BLOCK_N,
    GROUPS, GROUP] fp8, K padded to GROUPS whole groups) and their scales [BLOCK_N, GROUPS] in
    registers, loaded before the PDL wait (no step writes a weight), so the weight read overlaps
    the kernel before. After the wait it reads x's one row: quantized by the op before (x_fp8,
    x_scale), or with QUANTIZE the row x itself, which every program quantizes as quantize.py's
    kernels do (the same fp8 values and scales: K values, cheaper than a launch). Then
    y = sum_g (sum_{k in g} w * x_fp8) * w_scale[:, g] * x_scale[g] in fp32. No split-K: N alone
    fills the SMs (gemv_config).
    CONV (a conv1d.ConvDecode: the GDN's decode conv of y's first C columns, the conv_* to
    COMMIT arguments): linear.py's conv epilogue, each program convolving the channels of its own
    tile, in place of the conv's launch."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1).to(tl.int64)
    groups = tl.arange(0, GROUPS)
    k = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]                            # [GROUPS, GROUP]
    in_k = k < K
    w_tile = tl.load(w + rows[:, None, None] * K + k[None, :, :], mask=in_k[None, :, :], other=0.0)
    w_scales = tl.load(w_scale + rows[:, None] * num_groups + groups[None, :], mask=(groups < num_groups)[None, :],
                       other=0.0)                                                           # [BLOCK_N, GROUPS]
    dependent_prologue(DEPENDENT_LAUNCH)
    if QUANTIZE:
        values, scales = quantize_tile(tl.load(x + k, mask=in_k, other=0.0).to(tl.float32))
    else:
        values = tl.load(x_fp8 + k, mask=in_k, other=0.0).to(tl.float32)
        scales = tl.load(x_scale + groups, mask=groups < num_groups, other=0.0)
    sums = tl.sum(w_tile.to(tl.float32) * values[None, :, :], axis=2)                      # [BLOCK_N, GROUPS]
    acc = tl.sum(sums * w_scales * scales[None, :], axis=1)
    tl.store(y + cols, acc.to(y.dtype.element_ty), mask=cols < N)
    if CONV:
        conv_epilogue(y, N, pid * BLOCK_N, conv_weight, conv_out, conv_pending_out, cu_seqlens, slot_ids, conv_state,
                      pending_conv, pending_counts, conv_rows, stride_conv_out, C, WIDTH, P, BW, BT, BN, BLOCK_N,
                      COMMIT)


def _check_fp8_linear_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int) -> None:
    num_features, num_columns = weight.shape
    assert x.dim() == 2 and x.shape[1] == num_columns, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert weight.dtype == FP8 and weight.is_contiguous(), "weight: contiguous float8_e4m3fn [N, K]"
    assert weight_scale.shape == (num_features, triton.cdiv(num_columns, group_size)) \
        and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous(), \
        f"weight_scale: contiguous float32 [N, ceil(K/{group_size})], got {tuple(weight_scale.shape)}"
    assert group_size >= 16 and group_size & (group_size - 1) == 0, \
        f"group size {group_size}: a power of two >= 16 (one tl.dot K step)"
    assert x.stride(1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16), \
        "x: float rows with unit column stride"
    assert x.device == weight.device == weight_scale.device, "x, weight, weight_scale: one device"


def block_scales(weight_scale: torch.Tensor, block_rows: int) -> torch.Tensor | None:
    """Per-row scales [N, KB] -> the checkpoint's block scales [ceil(N / block_rows), KB] when
    every aligned block of rows shares one scale row (a projection, or fused ones whose parts
    start at multiples of block_rows), else None (Qwen3-Next's regrouped per-head projections,
    parts of odd sizes). Reads the scales back: once, at load."""
    blocks = weight_scale[::block_rows].contiguous()
    expanded = blocks.repeat_interleave(block_rows, dim=0)[:weight_scale.shape[0]]
    return blocks if torch.equal(expanded, weight_scale) else None


SKINNY_MAX_ROWS = 64      # decode / verify / draft shapes: split-K fills the SMs


def gemm_config(num_rows: int, num_features: int, num_groups: int, sms: int) -> TileConfig:
    """Tiles of `_fp8_gemm_kernel` (block_k is the group). Skinny batches (<= 64 rows): the
    batch in one tile of 16, 32 or 64 rows (16 is tl.dot's minimum) x 64 features (32 above 16
    rows), K split over whole groups until about two programs per SM, each split at least 4
    groups long (the pipeline's depth): the time is the weight's bytes, so the grid must fill the
    GPU. Prefill: 64 x 128 tiles, 4 warps, 4 stages. Each the fastest or within 5% of it in a
    sweep of the 9B projections (bench/tools/fp8_sweep.py; results/fp8_sweep-h200.json), except
    at 17..64 rows where block_n 32 is within 25%."""
    if INTERPRETED:
        return TileConfig(block_m=16, block_n=32, num_splits=split_k_for(num_groups, 2), num_warps=4, num_stages=1)
    if num_rows <= SKINNY_MAX_ROWS:
        block_m = max(16, triton.next_power_of_2(num_rows))
        block_n = 64 if num_rows <= 16 else 32
        num_tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(num_features, block_n)
        wanted = min(triton.cdiv(2 * sms, num_tiles), max(1, num_groups // 4))
        return TileConfig(block_m=block_m, block_n=block_n, num_splits=split_k_for(num_groups, wanted),
                          num_warps=4, num_stages=4)
    return TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)


def launch_fp8_gemm(y: torch.Tensor, x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor, group_size: int, config: TileConfig) -> None:
    """y [M, N] = x_fp8 [M, K] (x_scale [M, KB]) @ weight [N, K]^T (weight_scale [N, KB]) with an
    explicit config (tests, benchmark sweeps). Scratch is torch.empty and the shared arrival
    counters: capturable in a CUDA graph."""
    (num_rows, num_columns), num_features = x_fp8.shape, weight.shape[0]
    num_groups = weight_scale.shape[1]
    assert x_fp8.dtype == FP8 and x_fp8.is_contiguous() and x_scale.shape == (num_rows, num_groups) \
        and x_scale.is_contiguous(), "x_fp8: contiguous [M, K] float8_e4m3fn, x_scale: contiguous [M, KB]"
    assert y.shape == (num_rows, num_features) and y.stride(1) == 1, f"y {tuple(y.shape)}"
    if num_rows == 0:
        return
    groups_per_split = triton.cdiv(num_groups, config.num_splits)
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(num_features, config.block_n), config.num_splits)
    if config.num_splits > 1:
        partials = torch.empty((config.num_splits, num_rows, num_features), dtype=torch.float32, device=y.device)
        arrivals = arrival_counters(y.device, grid[0])
    else:  # never touched
        partials = arrivals = y
    _fp8_gemm_kernel[grid](x_fp8, x_scale, weight, weight_scale, y, partials, arrivals, num_rows, num_features,
                           num_columns, num_groups, groups_per_split, y.stride(0), BLOCK_M=config.block_m,
                           BLOCK_N=config.block_n, GROUP=group_size, SPLIT_K=config.num_splits, GROUP_M=8,
                           **config.launch_options(), **pdl(y.device))


def fp8_gemv_config(num_features: int, num_columns: int, group_size: int, device: torch.device,
                    **gemv_options) -> TileConfig | None:
    """The one-row form's tile (_fp8_gemv_kernel) for an FP8 weight [N, K]: linear.py's
    gemv_config at a byte an element (16 KB of W a program: 4 rows of the 9B's K = 4096, 1 of
    its down projection's 12288), block_k K padded to whole groups; None where a row does not fit.
    gemv_options: gemv_config's program_bytes and num_warps (bench/tools/fp8_gemv_chain.py)."""
    config = gemv_config(num_features, num_columns, device, element_size=1, **gemv_options)
    if config is None:
        return None
    return TileConfig(block_n=config.block_n, block_k=max(config.block_k, group_size), num_warps=config.num_warps)


def launch_fp8_gemv(y: torch.Tensor, x: Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
                    group_size: int, config: TileConfig, conv: ConvDecode | None = None) -> None:
    """y [1, N] = x [1, K] @ weight [N, K]^T (weight_scale [N, KB]) through the one-row form with
    an explicit config (fp8_gemv_config's: block_n rows of W a program, block_k >= K whole
    groups); x plain (quantized in the kernel) or a QuantizedActivation (its fp8 and scales read).
    conv: the decode conv of y's first columns in the same launch."""
    values = activation_values(x)
    _check_fp8_linear_args(values, weight, weight_scale, group_size)
    num_features, num_columns = weight.shape
    assert values.shape[0] == 1 and y.shape == (1, num_features) and y.is_contiguous(), \
        f"the one-row form: x [1, K], y contiguous [1, N]; got x {tuple(values.shape)}, y {tuple(y.shape)}"
    assert config.block_k % group_size == 0 and config.block_k >= num_columns, \
        f"config: block_k whole groups of {group_size} covering K = {num_columns}, got {config.block_k}"
    quantize = not isinstance(x, QuantizedActivation)
    if quantize:
        x_fp8 = x_scale = values
    else:
        x_fp8, x_scale = quantized_groups(x, group_size, quantize_groups)
    if conv is not None:
        check_conv_decode_args(y[:, :conv.weight.shape[0]], conv)
    _fp8_gemv_kernel[(triton.cdiv(num_features, config.block_n),)](
        values, x_fp8, x_scale, weight, weight_scale, y, num_features, num_columns, weight_scale.shape[1],
        *conv_arguments(y, conv), BLOCK_N=config.block_n, GROUPS=config.block_k // group_size,
        GROUP=group_size, QUANTIZE=quantize, **conv_constants(conv_shape(conv)), num_warps=config.num_warps,
        **pdl(y.device))


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             group_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8 [M, K] (x_scale [M, KB]) @ weight [N, K]^T (weight_scale [N, KB]) -> [M, N] out_dtype,
    with gemm_config's tiles (shapes and the SM count only: CUDA graphs replay the choice)."""
    num_rows, num_features = x_fp8.shape[0], weight.shape[0]
    y = torch.empty(num_rows, num_features, dtype=out_dtype, device=x_fp8.device)
    config = gemm_config(num_rows, num_features, weight_scale.shape[1], num_sms(x_fp8.device))
    launch_fp8_gemm(y, x_fp8, x_scale, weight, weight_scale, group_size, config)
    return y


@cache
def _cublas_blockwise(device: torch.device) -> bool:
    """cuBLAS's block-scaled FP8 GEMM (torch._scaled_mm with 1x128 activation and 128x128 weight
    scales) runs on sm_90: 1.6-1.7x bf16 at prefill shapes on the H200 (measured alone with
    torch._scaled_mm at 8192 x {12352, 24576, 4000} x 4096 and 8192 x 4096 x 12288), where the
    Triton GEMM reaches 0.7x (bench/results/kernels_fp8-h200.json)."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device) == (9, 0)


def fp8_linear(x: Activation, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
               block_scale: torch.Tensor | None = None, conv: ConvDecode | None = None) -> torch.Tensor:
    """Triton fp8_linear_reference (same arguments and result up to fp32 summation order): the
    group quantizer (skipped when x comes quantized), then the GEMM; one row through the one-row
    form (its quantizer in the kernel) where a row of W fits it. Batches past SKINNY_MAX_ROWS
    in bf16 with the weight's block scales (`block_scales`, 128 x 128) go to cuBLAS's block-scaled
    GEMM on sm_90 instead (the same W8A8 product; graph-capturable), which reads column-major
    scales: there x is quantized again from its values (layers.py fuses at skinny batches only).
    conv (fp8_linear_reference's): in the one-row form's launch, elsewhere its own after the GEMM."""
    activation, x = x, activation_values(x)
    _check_fp8_linear_args(x, weight, weight_scale, group_size)
    (num_rows, num_columns), num_features = x.shape, weight.shape[0]
    # Not while a CUDA graph is captured (verify steps past 64 rows): that path is unmeasured there.
    if (block_scale is not None and num_rows > SKINNY_MAX_ROWS and group_size == 128 and x.dtype == torch.bfloat16
            and num_columns % 128 == 0 and num_features % 16 == 0 and _cublas_blockwise(x.device)
            and not torch.cuda.is_current_stream_capturing()):
        # cuBLAS rejects a column-major scale whose leading dimension (M) is not a multiple of
        # 4 (16 bytes; CUBLAS_STATUS_NOT_SUPPORTED at M = 65): pad M, slice the padding off.
        x_fp8, x_scale = quantize_groups(x, group_size, scale_column_major=True, row_multiple=4)
        y = torch._scaled_mm(x_fp8, weight.t(), x_scale, block_scale.t(), out_dtype=x.dtype)[:num_rows]
    else:
        config = fp8_gemv_config(num_features, num_columns, group_size, x.device) if num_rows == 1 else None
        if config is not None:
            y = torch.empty(1, num_features, dtype=x.dtype, device=x.device)
            launch_fp8_gemv(y, activation, weight, weight_scale, group_size, config, conv=conv)
            return y
        x_fp8, x_scale = quantized_groups(activation, group_size, quantize_groups)
        y = fp8_gemm(x_fp8, x_scale, weight, weight_scale, group_size, x.dtype)
    if conv is not None:
        causal_conv1d_decode(y[:, :conv.weight.shape[0]], *conv)
    return y


# ----------------------------------------------------------------------------------------------
# Grouped FP8 experts: moe.py's expert-sorted row blocks (sort_pairs, block_rows, sum_slots)
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_m_blocks"])
def _fp8_gate_up_grouped_kernel(x_fp8, x_scale, counts, sorted_pairs, w, w_scale, act_fp8, act_scale, H, I, E,
                                num_m_blocks, num_h_groups, num_i_groups, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                                BLOCK_M: tl.constexpr, GROUP: tl.constexpr, ACT_DTYPE: tl.constexpr):
    """Program (row block, group of I), row blocks fastest so an expert's blocks share its weight
    tiles in L2: act = silu(x W_gate^T) * (x W_up^T) over the block's pairs for one group of GROUP
    intermediate columns (rows n and I + n of w[e]), each K step one group of H scaled as in
    _fp8_gemm_kernel; gate and up rounded to ACT_DTYPE, then act too (as the reference's
    fp8_linear -> silu_and_mul), then quantized per row over this group — the down GEMM's
    activation quantizer fused here: act_fp8 [pairs, I] and act_scale [pairs, IB], rows in
    expert order."""
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    expert, position, valid, pair = block_rows(counts, sorted_pairs, m_block, E, E_PAD, BLOCK_M)
    if expert >= E:
        return
    token = (pair // TOP_K).to(tl.int64)
    group_i = pid // num_m_blocks
    n = group_i * GROUP + tl.arange(0, GROUP)
    n_ok = n < I
    offs_k = tl.arange(0, GROUP)
    w += expert.to(tl.int64) * (2 * I * H)
    w_scale += expert.to(tl.int64) * (2 * I * num_h_groups)
    gate = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)
    for g in range(num_h_groups):
        k = g * GROUP + offs_k
        k_ok = k < H
        a = tl.load(x_fp8 + token[:, None] * H + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(x_scale + token * num_h_groups + g, mask=valid, other=0.0)[:, None]
        b_ok = k_ok[:, None] & n_ok[None, :]
        b_gate = tl.load(w + n[None, :] * H + k[:, None], mask=b_ok, other=0.0)
        b_up = tl.load(w + (n + I)[None, :] * H + k[:, None], mask=b_ok, other=0.0)
        s_gate = tl.load(w_scale + n * num_h_groups + g, mask=n_ok, other=0.0)[None, :]
        s_up = tl.load(w_scale + (n + I) * num_h_groups + g, mask=n_ok, other=0.0)[None, :]
        gate += tl.dot(a, b_gate) * a_scale * s_gate
        up += tl.dot(a, b_up) * a_scale * s_up
    gate = gate.to(ACT_DTYPE).to(tl.float32)
    up = up.to(ACT_DTYPE).to(tl.float32)
    act = (gate * tl.sigmoid(gate) * up).to(ACT_DTYPE).to(tl.float32)   # 0 past I (gate 0 there)
    quantized, scale = quantize_tile(act)
    rows = position.to(tl.int64)
    tl.store(act_fp8 + rows[:, None] * I + n[None, :], quantized.to(act_fp8.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])
    tl.store(act_scale + rows * num_i_groups + group_i, scale, mask=valid)


@triton.jit(do_not_specialize=["num_m_blocks"])
def _fp8_down_grouped_kernel(act_fp8, act_scale, counts, sorted_pairs, weights, w, w_scale, out_pairs, H, I, E,
                             num_m_blocks, num_i_groups, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Program (row block, tile of H): out_pairs[pair, n] = w[pair] * (act W_down^T)[row, n], the
    FP8 product summed per group of I as in _fp8_gemm_kernel."""
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    expert, position, valid, pair = block_rows(counts, sorted_pairs, m_block, E, E_PAD, BLOCK_M)
    if expert >= E:
        return
    n = (pid // num_m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    offs_k = tl.arange(0, GROUP)
    rows = position.to(tl.int64)
    w += expert.to(tl.int64) * (H * I)
    w_scale += expert.to(tl.int64) * (H * num_i_groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(num_i_groups):
        k = g * GROUP + offs_k
        k_ok = k < I
        a = tl.load(act_fp8 + rows[:, None] * I + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(act_scale + rows * num_i_groups + g, mask=valid, other=0.0)[:, None]
        b = tl.load(w + n[None, :] * I + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b_scale = tl.load(w_scale + n * num_i_groups + g, mask=n_ok, other=0.0)[None, :]
        acc += tl.dot(a, b) * a_scale * b_scale
    store_weighted_pairs(out_pairs, acc, weights, pair, valid, n, n_ok, H)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def fp8_moe_config(num_pairs: int, num_experts: int) -> TileConfig:
    """Tiles of the FP8 expert kernels (block_k is the group; gate/up tiles are one group of I
    wide, so block_n is the down GEMM's): moe.grouped_config's block_m by pairs per expert,
    capped at 64 rows (gate/up keep two [block_m, group] fp32 accumulators: 8 warps at 64 rows,
    or they spill: 3x slower at 2048 tokens; bench/results/kernels_fp8-h200.json)."""
    if INTERPRETED:
        return TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    block_m = min(64, grouped_config(num_pairs, num_experts).block_m)
    return TileConfig(block_m=block_m, block_n=128, num_warps=8 if block_m >= 64 else 4, num_stages=3)


def _check_fp8_moe_args(x, weights, experts, w_gate_up, gate_up_scale, w_down, down_scale, group_size) -> None:
    num_tokens, hidden = x.shape
    num_experts, two_inter, hidden_2 = w_gate_up.shape
    inter = two_inter // 2
    assert hidden_2 == hidden and two_inter % 2 == 0, f"w_gate_up {tuple(w_gate_up.shape)} vs x {tuple(x.shape)}"
    assert w_down.shape == (num_experts, hidden, inter), f"w_down {tuple(w_down.shape)}"
    assert w_gate_up.dtype == w_down.dtype == FP8, "expert weights: float8_e4m3fn"
    assert gate_up_scale.shape == (num_experts, two_inter, triton.cdiv(hidden, group_size)) \
        and down_scale.shape == (num_experts, hidden, triton.cdiv(inter, group_size)) \
        and gate_up_scale.dtype == down_scale.dtype == torch.float32, \
        f"scales: float32 [E, 2I, ceil(H/G)] and [E, H, ceil(I/G)], got {tuple(gate_up_scale.shape)}, " \
        f"{tuple(down_scale.shape)}"
    assert group_size >= 16 and group_size & (group_size - 1) == 0, f"group size {group_size}: a power of two >= 16"
    assert experts.dim() == 2 and experts.shape[0] == num_tokens and weights.shape == experts.shape, \
        "weights, experts: [T, k]"
    assert experts.dtype in (torch.int64, torch.int32), f"experts: dtype {experts.dtype}"
    assert x.dtype in _TL_DTYPES, f"x: dtype {x.dtype}"
    for name, t in (("x", x), ("weights", weights), ("experts", experts), ("w_gate_up", w_gate_up),
                    ("gate_up_scale", gate_up_scale), ("w_down", w_down), ("down_scale", down_scale)):
        assert t.is_contiguous(), f"{name} must be contiguous"
        assert t.device == x.device, f"{name} on {t.device}, x on {x.device}"


def fp8_moe_experts(x: Activation, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, w_down: torch.Tensor, down_scale: torch.Tensor, group_size: int,
                    config: TileConfig | None = None) -> torch.Tensor:
    """Triton fp8_moe_experts_reference (same arguments; result up to fp32 summation order and
    the rare activation that rounds to the neighbouring e4m3 value because of it): x quantized
    per token group, the pairs sorted by expert (moe.sort_pairs), the gate/up GEMM with SiLU*up
    and the down GEMM's activation quantizer fused, the down GEMM with the routing weight, the
    slots summed (x's quantizer skipped when it comes quantized). Launch sizes depend on shapes
    only: CUDA-graph safe at every batch."""
    activation, x = x, activation_values(x)
    _check_fp8_moe_args(x, weights, experts, w_gate_up, gate_up_scale, w_down, down_scale, group_size)
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = w_gate_up.shape[0], experts.shape[1], w_down.shape[2]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    config = config or fp8_moe_config(num_pairs, num_experts)
    num_h_groups, num_i_groups = triton.cdiv(hidden, group_size), triton.cdiv(inter, group_size)
    x_fp8, x_scale = quantized_groups(activation, group_size, quantize_groups)
    pairs = sort_pairs(experts, num_experts, config.block_m)
    act_fp8 = torch.empty(num_pairs, inter, dtype=FP8, device=x.device)                 # rows in expert order
    act_scale = torch.empty(num_pairs, num_i_groups, dtype=torch.float32, device=x.device)
    _fp8_gate_up_grouped_kernel[(pairs.num_m_blocks * num_i_groups,)](
        x_fp8, x_scale, pairs.counts, pairs.sorted_pairs, w_gate_up, gate_up_scale, act_fp8, act_scale, hidden,
        inter, num_experts, pairs.num_m_blocks, num_h_groups, num_i_groups, TOP_K=top_k, E_PAD=pairs.e_pad,
        BLOCK_M=config.block_m, GROUP=group_size, ACT_DTYPE=_TL_DTYPES[x.dtype], **config.launch_options())
    out_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)            # rows by pair
    _fp8_down_grouped_kernel[(pairs.num_m_blocks * triton.cdiv(hidden, config.block_n),)](
        act_fp8, act_scale, pairs.counts, pairs.sorted_pairs, weights, w_down, down_scale, out_pairs, hidden, inter,
        num_experts, pairs.num_m_blocks, num_i_groups, E_PAD=pairs.e_pad, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, GROUP=group_size, **config.launch_options())
    sum_slots(out_pairs, experts, num_experts, out)
    return out
