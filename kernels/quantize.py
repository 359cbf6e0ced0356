"""Per-token-group FP8 quantization of activations: what an FP8 (W8A8) projection reads.

A row of x [M, K] is cut into groups of G columns (G = the weight block's columns, KB =
ceil(K / G)); each group is scaled so its absolute maximum maps to 448 (e4m3's largest finite
value) and rounded to e4m3 (vLLM's per_token_group_quant_fp8, dynamic scales):
    x_fp8   [M, K]  float8_e4m3fn, contiguous
    x_scale [M, KB] float32, contiguous (or column-major for cuBLAS), scale = amax / 448
so that x ~= x_fp8 * x_scale group by group.

- `quantize_groups_reference`: the torch oracle; `quantize_groups`: its Triton kernel, a launch of
  its own (an FP8 projection whose input comes plain).
- `QuantizedActivation`: an activation with its quantization, from an op that fused the
  quantizer into its own kernel (the norms, silu_and_mul): the projections after it skip theirs.
  `quantize_activation` / `quantize_activation_reference` build one after the fact (the
  launchers' fallback where their tile cannot fuse; the references).
- `quantize_tile`, `store_groups`: the jit helpers every quantizing kernel calls, so all of them
  round alike. They round on the e4m3 grid in float32 before the cast, bit-equal to the
  reference on the GPU and under the interpreter.

Knows nothing about weights, GEMMs or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device import INTERPRETED
from .launch import dependent_prologue, pdl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0           # largest finite e4m3fn
SCALE_FLOOR = 1e-10       # an all-zero group gets this amax (vLLM's eps), never a 0 scale


def quantize_groups_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], x_scale [M, KB] float32): each row's groups of group_size
    columns scaled so their absolute maximum maps to 448, then rounded to e4m3 (round to nearest:
    relative error <= 2^-4 per element above the subnormals)."""
    num_rows, num_columns = x.shape
    num_groups = triton.cdiv(num_columns, group_size)
    padded = x.float().new_zeros(num_rows, num_groups * group_size)
    padded[:, :num_columns] = x.float()
    groups = padded.view(num_rows, num_groups, group_size)
    scale = groups.abs().amax(dim=-1).clamp(min=SCALE_FLOOR) / FP8_MAX
    x_fp8 = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x_fp8.view(num_rows, -1)[:, :num_columns].contiguous(), scale


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation [M, K] in the model dtype together with its group quantization: values
    for the projections kept in bf16 (the GDN's b|a, the MoE router), fp8 [M, K] and scale
    [M, KB] (contiguous, row-major: the layout the Triton FP8 GEMM reads) for the FP8 ones.
    fp8 and scale are exactly quantize_groups_reference(values, group_size)."""
    values: torch.Tensor
    fp8: torch.Tensor
    scale: torch.Tensor
    group_size: int


Activation = torch.Tensor | QuantizedActivation


def activation_values(x: Activation) -> torch.Tensor:
    """The activation itself, quantized or not (for a consumer that reads it in bf16)."""
    return x.values if isinstance(x, QuantizedActivation) else x


def quantize_activation_reference(values: torch.Tensor, group_size: int) -> QuantizedActivation:
    return QuantizedActivation(values, *quantize_groups_reference(values, group_size), group_size)


def quantize_activation(values: torch.Tensor, group_size: int) -> QuantizedActivation:
    """values [M, K] with its quantization by the standalone kernel (a launch of its own)."""
    return QuantizedActivation(values, *quantize_groups(values, group_size), group_size)


def check_group_size(group_size: int) -> None:
    """A launcher's quantize_group: 0 (no quantization) or a power of two (a tile dimension)."""
    assert group_size >= 0 and group_size & (group_size - 1) == 0, f"quantize group {group_size}: 0 or a power of two"


def quantized_groups(x: Activation, group_size: int, quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8, x_scale) of x for a projection of this group size: the quantization x carries,
    else quantize(x, group_size) (quantize_groups or its reference)."""
    if isinstance(x, QuantizedActivation):
        assert x.group_size == group_size, f"activation quantized in groups of {x.group_size}, projection reads " \
                                           f"{group_size}"
        return x.fp8, x.scale
    return quantize(x, group_size)


# ----------------------------------------------------------------------------------------------
# Triton: the helpers every quantizing kernel shares, and the standalone quantizer
# ----------------------------------------------------------------------------------------------

@triton.jit
def round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to nearest even on the e4m3 grid, still float32, so the
    cast to fp8 that follows is exact: spacing 2^(e-3) in the binade [2^e, 2^(e+1)), 2^-9 below
    2^-6 (subnormals). Adding and subtracting 1.5 * 2^(e+20) rounds v to that spacing in one
    IEEE fp32 addition (the sum's ulp is 2^(e-3)); a negative v that rounds to zero comes out +0,
    so v's sign bit is put back (torch's cast gives -0: the fp8 codes are bit-equal). Equal to a
    direct rounding cast on the GPU; the interpreter's own cast loses the carry of a mantissa
    rounded up to 2.0 (124.3 -> 64)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((exponent + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = ((v + magic) - magic).to(tl.int32, bitcast=True)
    return (rounded | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile(values):
    """values [R, GROUP] float32, one group per row -> (e4m3 values rounded, still float32;
    scale [R]) as quantize_groups_reference. IEEE-rounded divisions (div_rn): Triton's `/` on
    float32 is the approximate PTX division, whose last bit differs from torch's."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(values), axis=1), 1e-10), 448.0)
    quantized = tl.clamp(tl.math.div_rn(values, scale[:, None]), -448.0, 448.0)
    return round_to_e4m3(quantized), scale


@triton.jit
def store_groups(values, x_fp8, x_scale, first_group, num_columns, N: tl.constexpr, GROUP: tl.constexpr):
    """Quantize and store N consecutive columns of one row, starting at group first_group:
    values [N] float32 (N a multiple of GROUP), already rounded to the activation's dtype (the
    quantization is that of the stored activation); x_fp8, x_scale point at the row's first
    column and first scale. Columns from num_columns on are not stored: their values must be 0
    (masked loads), as the reference pads the last group."""
    quantized, scale = quantize_tile(tl.reshape(values, [N // GROUP, GROUP]))
    groups = first_group + tl.arange(0, N // GROUP)
    columns = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(x_fp8 + columns, quantized.to(x_fp8.dtype.element_ty), mask=columns < num_columns)
    tl.store(x_scale + groups, scale, mask=groups * GROUP < num_columns)


@triton.jit
def _quantize_groups_kernel(x, x_fp8, x_scale, M, K, stride_xm, stride_sm, stride_sg, BLOCK_M: tl.constexpr,
                            GROUP: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (block of rows, group g): quantize_groups_reference for one group of BLOCK_M rows."""
    dependent_prologue(DEPENDENT_LAUNCH)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    k = g * GROUP + tl.arange(0, GROUP)
    rows = m.to(tl.int64)
    ok = (m < M)[:, None] & (k < K)[None, :]
    values = tl.load(x + rows[:, None] * stride_xm + k[None, :], mask=ok, other=0.0).to(tl.float32)
    quantized, scale = quantize_tile(values)
    tl.store(x_fp8 + rows[:, None] * K + k[None, :], quantized.to(x_fp8.dtype.element_ty), mask=ok)
    tl.store(x_scale + rows * stride_sm + g * stride_sg, scale, mask=m < M)


def quantize_groups(x: torch.Tensor, group_size: int, scale_column_major: bool = False,
                    row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton quantize_groups_reference (bit-equal); x_fp8 comes back contiguous, x_scale [M, KB]
    row-major, or column-major (strides (1, M): what cuBLAS's blockwise scaled GEMM reads).
    row_multiple: both come back with M rounded up to a multiple of it, the rows past x's
    unwritten (a row's product depends on that row alone: slice them off the result)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: [M, K] with unit column stride"
    num_rows, num_columns = x.shape
    num_groups = triton.cdiv(num_columns, group_size)
    padded_rows = triton.cdiv(num_rows, row_multiple) * row_multiple
    x_fp8 = torch.empty(padded_rows, num_columns, dtype=FP8, device=x.device)
    if scale_column_major:
        x_scale = torch.empty(num_groups, padded_rows, dtype=torch.float32, device=x.device).t()
    else:
        x_scale = torch.empty(padded_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows:
        block_m = 1 if INTERPRETED else 4
        _quantize_groups_kernel[(triton.cdiv(num_rows, block_m), num_groups)](
            x, x_fp8, x_scale, num_rows, num_columns, x.stride(0), x_scale.stride(0), x_scale.stride(1),
            BLOCK_M=block_m, GROUP=group_size, num_warps=4, **pdl(x.device))
    return x_fp8, x_scale


def quantized_outputs(num_rows: int, num_columns: int, group_size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (x_fp8 [M, K], x_scale [M, KB]) for a kernel that fuses the quantizer."""
    return (torch.empty(num_rows, num_columns, dtype=FP8, device=device),
            torch.empty(num_rows, triton.cdiv(num_columns, group_size), dtype=torch.float32, device=device))
