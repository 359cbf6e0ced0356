"""Block-FP8 W8A8 linear layers: y = x W^T with W in float8_e4m3fn and block scales, x quantized
on the fly per token in groups of G columns (dynamic activation scales, as vLLM's
per_token_group_quant_fp8 and w8a8_block_fp8_matmul).

Layouts (M rows of x, N output features, K input features, G the group = the weight block's
columns, KB = ceil(K / G)):
    weight        [N, K]  float8_e4m3fn
    weight_scale  [N, KB] float32: the checkpoint's `weight_scale_inv` [ceil(N / bn), KB]
                  repeated over each block's bn rows, so fused projections whose parts are not
                  multiples of bn rows concatenate row by row (4 bytes per G weights, 3% at 128)
    x_fp8         [M, K]  float8_e4m3fn, x_scale [M, KB] float32 (scale = group amax / 448)
The real weight is weight * weight_scale and the real x is x_fp8 * x_scale, elementwise over
their groups; the product sums them exactly in fp32 up to summation order.

`fp8_linear_reference` (the CPU table, and the oracle) dequantizes both and runs one fp32 GEMM;
`fp8_linear` (the GPU table) runs `_quantize_groups_kernel` then `_fp8_gemm_kernel`, a plain
tiled GEMM with one tl.dot on fp8 tiles per group (needs sm_89+) scaled by both groups' scales.
`fp8_moe_experts_reference` is the MoE expert op on FP8 expert weights. Knows nothing about
checkpoints: scales arrive already repeated over rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_reference
from .device import INTERPRETED
from .moe import by_expert_reference

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0           # largest finite e4m3fn
SCALE_FLOOR = 1e-10       # an all-zero group gets this amax (vLLM's eps), never a 0 scale


def expand_groups(scale: torch.Tensor, group_size: int, num_columns: int) -> torch.Tensor:
    """[..., KB] per-group scales -> [..., K] per-column scales."""
    return scale.repeat_interleave(group_size, dim=-1)[..., :num_columns]


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


def dequantize_reference(values: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp8 values [..., K] and their group scales [..., KB] -> float32 [..., K]."""
    return values.float() * expand_groups(scale, group_size, values.shape[-1])


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """x [M, K] (float) @ dequantized weight [N, K]^T -> [M, N] in x's dtype, with x quantized
    per token group first, as the kernel does."""
    x_fp8, x_scale = quantize_groups_reference(x, group_size)
    product = dequantize_reference(x_fp8, x_scale, group_size) @ dequantize_reference(weight, weight_scale, group_size).T
    return product.to(x.dtype)


def fp8_moe_experts_reference(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                              w_gate_up: torch.Tensor, gate_up_scale: torch.Tensor, w_down: torch.Tensor,
                              down_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """moe_experts_reference with FP8 experts: w_gate_up [E, 2I, H] fp8 + gate_up_scale
    [E, 2I, ceil(H/G)], w_down [E, H, I] fp8 + down_scale [E, H, ceil(I/G)]; both GEMM inputs
    (x and the SwiGLU output) quantized per token group. x: [T, H]; weights, experts: [T, k]."""
    def mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = fp8_linear_reference(rows, w_gate_up[expert], gate_up_scale[expert], group_size)
        return fp8_linear_reference(silu_and_mul_reference(gate_up), w_down[expert], down_scale[expert], group_size)

    return by_expert_reference(x, weights, experts, w_gate_up.shape[0], mlp)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _quantize_groups_kernel(x, x_fp8, x_scale, K, stride_xm, num_groups, GROUP: tl.constexpr):
    """Program (row m, group g): quantize_groups_reference for one group of one row."""
    m, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    k = g * GROUP + tl.arange(0, GROUP)
    values = tl.load(x + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    # IEEE-rounded divisions (div_rn): Triton's `/` on float32 is the approximate PTX division,
    # whose last bit differs from torch's and so would the scale and the rounding of the values.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(values), axis=0), 1e-10), 448.0)
    quantized = tl.clamp(tl.math.div_rn(values, scale), -448.0, 448.0)
    tl.store(x_fp8 + m * K + k, quantized.to(x_fp8.dtype.element_ty), mask=k < K)
    tl.store(x_scale + m * num_groups + g, scale)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(x_fp8, x_scale, w, w_scale, y, M, N, K, num_groups, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Program (m tile, n tile): y = sum over groups g of (x_fp8[:, g] @ w[:, g]^T) * x_scale[:, g]
    (per row) * w_scale[:, g] (per output feature), fp32 accumulation. One K step is one group,
    so each partial product has exactly one scale per row and per column. Out-of-range rows,
    columns and the K tail load as 0 (fp8 0 is exact)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows_x, rows_w = offs_m.to(tl.int64), offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(num_groups):
        k = g * GROUP + offs_k
        k_ok = k < K
        a = tl.load(x_fp8 + rows_x[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + rows_w[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(x_scale + rows_x * num_groups + g, mask=m_ok, other=0.0)
        b_scale = tl.load(w_scale + rows_w * num_groups + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]
    tl.store(y + rows_x[:, None] * stride_ym + offs_n[None, :], acc.to(y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


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


def quantize_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton quantize_groups_reference; x_fp8 comes back contiguous."""
    num_rows, num_columns = x.shape
    num_groups = triton.cdiv(num_columns, group_size)
    x_fp8 = torch.empty(num_rows, num_columns, dtype=FP8, device=x.device)
    x_scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_groups_kernel[(num_rows, num_groups)](x, x_fp8, x_scale, num_columns, x.stride(0), num_groups,
                                                        GROUP=group_size, num_warps=1 if group_size <= 128 else 4)
    return x_fp8, x_scale


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             group_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8 [M, K] (x_scale [M, KB]) @ weight [N, K]^T (weight_scale [N, KB]) -> [M, N] out_dtype.
    Decode-sized M gets 16-row tiles (tl.dot's minimum), larger M 64-row tiles."""
    num_rows, num_columns = x_fp8.shape
    num_features = weight.shape[0]
    assert x_fp8.dtype == FP8 and x_fp8.is_contiguous() and x_scale.shape == (num_rows, weight_scale.shape[1]) \
        and x_scale.is_contiguous(), "x_fp8: contiguous [M, K] float8_e4m3fn, x_scale: contiguous [M, KB]"
    y = torch.empty(num_rows, num_features, dtype=out_dtype, device=x_fp8.device)
    if num_rows == 0:
        return y
    block_m = 16 if num_rows <= 16 or INTERPRETED else 64
    block_n = 32 if INTERPRETED else 128
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_features, block_n))
    _fp8_gemm_kernel[grid](x_fp8, x_scale, weight, weight_scale, y, num_rows, num_features, num_columns,
                           x_scale.shape[1], y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, GROUP=group_size,
                           num_warps=4)
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Triton fp8_linear_reference (same arguments and result up to fp32 summation order):
    the group quantizer, then the GEMM."""
    _check_fp8_linear_args(x, weight, weight_scale, group_size)
    x_fp8, x_scale = quantize_groups(x, group_size)
    return fp8_gemm(x_fp8, x_scale, weight, weight_scale, group_size, x.dtype)
