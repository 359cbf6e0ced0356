"""RMSNorm variants of the Qwen3.5 / Qwen3-Next family.

- `rms_norm`: layer norm with a zero-centred weight, `x / rms(x) * (1 + w)`, optionally fused
  with the residual add that precedes it (`x + residual` is normalised and also returned as
  the new residual stream). No weight (None): `x / rms(x)`, the norm whose weight the
  projection after it holds (linear.py, norm_eps).
- `gated_rms_norm`: the GDN output norm, `x / rms(x) * w * silu(z)` per value head (plain `w`).
- `mtp_input`: the MTP's fc input, `cat[rms_norm(embedding of the ids), rms_norm(hidden)]` (both
  zero-centred weights): the token embedding gathered by id, the two norms and the cat of a draft
  step in one launch.

Math is done in float32 and rounded once at the end, as HF transformers does. `rms_norm`,
`gated_rms_norm` and `mtp_input` are the Triton kernels (one program per row / per block of
rows / per token), the `_reference` functions their torch oracles.

`quantize_group` > 0 (the group size of the FP8 projections the output feeds): `rms_norm` and
`gated_rms_norm` also return the output's per-token-group FP8 quantization, as a
QuantizedActivation (quantize.py), exactly quantize_groups_reference of the output they return.
The kernels quantize the rounded output while they hold it, saving the projection's quantizer
its launch and its pass over the output. Knows nothing about layers or models.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import dependent_prologue, pdl
from .quantize import (Activation, QuantizedActivation, check_group_size, quantize_activation,
                       quantize_activation_reference, quantized_outputs, store_groups)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
                       quantize_group: int = 0) -> tuple[Activation, torch.Tensor]:
    """x, residual: [T, H]; weight: [H] or None (unit). Returns (normed, new_residual).

    new_residual = x + residual (or x when residual is None), kept in x's dtype; normed is a
    QuantizedActivation when quantize_group > 0.
    """
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed if weight is None else normed * (1.0 + weight.float())).to(x.dtype)
    return (quantize_activation_reference(normed, quantize_group) if quantize_group else normed), x


def mtp_input_reference(input_ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
                        embed_norm_weight: torch.Tensor, hidden_norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """input_ids [T]; embed_weight [V, H]; hidden [T, H] -> x [T, 2H]: x[:, :H] the rms_norm of the
    ids' embedding rows (weight embed_norm_weight), x[:, H:] hidden's (weight hidden_norm_weight)."""
    embedded, _ = rms_norm_reference(embed_weight[input_ids], embed_norm_weight, eps)
    normed, _ = rms_norm_reference(hidden, hidden_norm_weight, eps)
    return torch.cat([embedded, normed], dim=-1)


class GatedNorm(NamedTuple):
    """gated_rms_norm of a projection's input x [T, H * D] by heads of D = weight.shape[0], run by
    the projection (kernels/linear.py): gate [T, H * D] (unit stride along it; a row-strided view,
    e.g. z of the GDN's in_proj), the norm's weight [D] and eps."""
    gate: torch.Tensor
    weight: torch.Tensor
    eps: float


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                             quantize_group: int = 0) -> Activation:
    """x, gate: [T, ..., D] (one value head per row); weight: [D]. Returns x's dtype; with
    quantize_group > 0 a QuantizedActivation of the output as [T, ...*D] rows (what the
    projection after it reads).

    HF rounds the normalised value to the input dtype before multiplying by `w`; we keep fp32
    throughout, which differs only below the input dtype's precision.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * weight.float() * F.silu(gate.float())).to(x.dtype)
    return quantize_activation_reference(out.reshape(x.shape[0], -1), quantize_group) if quantize_group else out


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def add_rms_normalize(h, residual_row, residual_out_row, w, offs, mask, eps, H: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr):
    """One row h [BH] (x's dtype, 0 past H) of the stream: s = h (+ the residual at residual_row,
    rounded to the stream's dtype and stored at residual_out_row: the new residual stream);
    returns s / sqrt(mean(s^2) + eps) * (1 + w) in float32 (w: the weight in float32)."""
    if HAS_RESIDUAL:
        h = h.to(tl.float32) + tl.load(residual_row + offs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(residual_out_row.dtype.element_ty)
        tl.store(residual_out_row + offs, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h) / H + eps)
    return h * rstd * (1.0 + w)


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, residual_out, out_fp8, out_scale, stride_x, stride_residual, eps,
                     H: tl.constexpr, BH: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """One row: s = x (+ residual, rounded to x's dtype: the new residual stream);
    out = s / sqrt(mean(s^2) + eps) * (1 + w) (w = 0 without HAS_WEIGHT), in float32, rounded
    once. GROUP > 0: out (as rounded) also quantized in groups of GROUP columns into out_fp8
    [T, H] and out_scale [T, ceil(H / GROUP)] (the columns past H are 0 here, as the reference
    pads). BH is next_pow2(H) with or without GROUP, so the sum of squares, and with it out, is
    the same reduction either way; a row narrower than a group is its one group:
    GROUP_TILE = min(BH, GROUP)."""
    dependent_prologue(DEPENDENT_LAUNCH)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BH)
    mask = offs < H
    h = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_WEIGHT:
        w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros((BH,), dtype=tl.float32)
    normed = add_rms_normalize(h, residual + row * stride_residual, residual_out + row * H, w, offs, mask, eps, H,
                               HAS_RESIDUAL).to(out.dtype.element_ty)
    tl.store(out + row * H + offs, normed, mask=mask)
    if GROUP > 0:
        store_groups(normed.to(tl.float32), out_fp8 + row * H, out_scale + row * tl.cdiv(H, GROUP), 0, H,
                     N=BH, GROUP=GROUP_TILE)


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                         quantize_group: int) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x: [T, H], unit stride along H"
    check_group_size(quantize_group)
    assert weight is None or (weight.shape == (x.shape[1],) and weight.is_contiguous()), "weight: contiguous [H]"
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype, \
            "residual: x's shape and dtype, unit stride along H"


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             quantize_group: int = 0) -> tuple[Activation, torch.Tensor]:
    """Triton rms_norm_reference. x, residual [T, H] with unit stride along H; outputs contiguous.
    Without a residual the returned residual is x itself (no copy), as the reference. With
    quantize_group the one kernel also writes the quantized output."""
    check_rms_norm_args(x, weight, residual, quantize_group)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        new_residual = torch.empty_like(out)
    else:
        new_residual = x
    out_fp8, out_scale = quantized_outputs(num_tokens, hidden, quantize_group, x.device) if quantize_group else (out, out)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](x, residual if residual is not None else x, x if weight is None else weight,
                                        out, new_residual, out_fp8, out_scale, x.stride(0),
                                        residual.stride(0) if residual is not None else 0, eps, H=hidden, BH=block,
                                        HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None,
                                        GROUP=quantize_group, GROUP_TILE=min(block, quantize_group),
                                        num_warps=row_warps(block), **pdl(x.device))
    if quantize_group:
        return QuantizedActivation(out, out_fp8, out_scale, quantize_group), new_residual
    return out, new_residual


def row_warps(block: int) -> int:
    """Warps of a program that normalises rows of `block` (padded) columns: one per 512."""
    return min(16, max(1, block // 512))


@triton.jit
def _mtp_input_kernel(input_ids, embed_weight, hidden, embed_norm_weight, hidden_norm_weight, out, stride_ids,
                      stride_hidden, eps, H: tl.constexpr, BH: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """One token: out[:H] = e / sqrt(mean(e^2) + eps) * (1 + w_e) with e its id's embedding row,
    out[H:] the same of its hidden row with w_h; each half in float32, rounded once, as
    _rms_norm_kernel's rows (the same reduction: BH = next_pow2(H)). The id is widened before
    it scales: V * H may pass 2^31."""
    dependent_prologue(DEPENDENT_LAUNCH)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BH)
    mask = offs < H
    token = tl.load(input_ids + row * stride_ids).to(tl.int64)
    embedded = tl.load(embed_weight + token * H + offs, mask=mask, other=0.0)
    h = tl.load(hidden + row * stride_hidden + offs, mask=mask, other=0.0)
    w_e = tl.load(embed_norm_weight + offs, mask=mask, other=0.0).to(tl.float32)
    w_h = tl.load(hidden_norm_weight + offs, mask=mask, other=0.0).to(tl.float32)
    # No residual: its row pointers are never read.
    embedded = add_rms_normalize(embedded, out, out, w_e, offs, mask, eps, H, False)
    h = add_rms_normalize(h, out, out, w_h, offs, mask, eps, H, False)
    tl.store(out + row * 2 * H + offs, embedded.to(out.dtype.element_ty), mask=mask)
    tl.store(out + row * 2 * H + H + offs, h.to(out.dtype.element_ty), mask=mask)


def _check_mtp_input_args(input_ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
                          embed_norm_weight: torch.Tensor, hidden_norm_weight: torch.Tensor) -> None:
    assert hidden.dim() == 2 and hidden.stride(1) == 1, "hidden: [T, H], unit stride along H"
    num_tokens, width = hidden.shape
    assert input_ids.shape == (num_tokens,) and input_ids.dtype in (torch.int32, torch.int64), \
        "input_ids: [T] int32 or int64"
    assert embed_weight.dim() == 2 and embed_weight.shape[1] == width and embed_weight.is_contiguous(), \
        "embed_weight: contiguous [V, H]"
    assert embed_weight.dtype == hidden.dtype, "embed_weight: hidden's dtype"
    for weight in (embed_norm_weight, hidden_norm_weight):
        assert weight.shape == (width,) and weight.is_contiguous(), "norm weights: contiguous [H]"


def mtp_input(input_ids: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
              embed_norm_weight: torch.Tensor, hidden_norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton mtp_input_reference, one launch: a contiguous [T, 2H] in hidden's dtype. hidden may
    be a row-strided view, input_ids any 1-D view; ids must lie in [0, V) (not checked: that
    would need the host to read them)."""
    _check_mtp_input_args(input_ids, embed_weight, hidden, embed_norm_weight, hidden_norm_weight)
    num_tokens, width = hidden.shape
    out = torch.empty((num_tokens, 2 * width), dtype=hidden.dtype, device=hidden.device)
    if num_tokens:
        block = triton.next_power_of_2(width)
        _mtp_input_kernel[(num_tokens,)](input_ids, embed_weight, hidden, embed_norm_weight, hidden_norm_weight, out,
                                         input_ids.stride(0), hidden.stride(0), eps, H=width, BH=block,
                                         num_warps=row_warps(block), **pdl(hidden.device))
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(x, gate, weight, out, out_fp8, out_scale, num_rows, inner, stride_x_outer, stride_x_inner,
                           stride_gate_outer, stride_gate_inner, eps, D: tl.constexpr, BD: tl.constexpr,
                           BR: tl.constexpr, GROUP: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """BR rows of D: out = x / sqrt(mean(x^2) + eps) * w * silu(gate), float32, rounded once.
    Row r is (r // inner, r % inner) of the [outer, inner, D] views.

    GROUP > 0 (D == BD, a multiple of GROUP): out (as rounded) also quantized in groups of GROUP
    columns of its [outer, inner * D] rows. The program's rows are one contiguous span of out
    (BR * D values from row pid * BR on) and no group straddles two rows of D, so the span's
    groups are groups of the quantized rows: group j of the span is group pid * BR * D / GROUP + j
    of the flat [outer * inner * D / GROUP] scales."""
    dependent_prologue(DEPENDENT_LAUNCH)
    first_row = tl.program_id(0).to(tl.int64) * BR
    rows = first_row + tl.arange(0, BR)
    offs = tl.arange(0, BD)
    mask = (rows < num_rows)[:, None] & (offs < D)[None, :]
    outer, within = rows // inner, rows % inner
    h = tl.load(x + (outer * stride_x_outer + within * stride_x_inner)[:, None] + offs[None, :],
                mask=mask, other=0.0).to(tl.float32)
    z = tl.load(gate + (outer * stride_gate_outer + within * stride_gate_inner)[:, None] + offs[None, :],
                mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight + offs, mask=offs < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)
    y = (h * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))).to(out.dtype.element_ty)
    tl.store(out + rows[:, None] * D + offs[None, :], y, mask=mask)
    if GROUP > 0:
        start = first_row * D
        store_groups(tl.reshape(y.to(tl.float32), [BR * D]), out_fp8 + start, out_scale + start // GROUP, 0,
                     num_rows * D - start, N=BR * D, GROUP=GROUP)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> a view [outer, inner, D]: [T, D] -> [T, 1, D]; more than two leading dims
    are merged into the first (they must be mergeable without a copy)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.view(-1, *t.shape[-2:]) if t.dim() > 3 else t


def _check_gated_rms_norm_args(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                               quantize_group: int) -> None:
    assert x.shape == gate.shape and x.dim() >= 2 and x.stride(-1) == 1 and gate.stride(-1) == 1, \
        "x, gate: [..., D] of one shape, unit stride along D"
    assert weight.shape == (x.shape[-1],) and weight.is_contiguous(), "weight: contiguous [D]"
    check_group_size(quantize_group)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   quantize_group: int = 0) -> Activation:
    """Triton gated_rms_norm_reference. x, gate [..., D] with unit stride along D (gate may be a
    strided view, e.g. z of the GDN projection as [T, HV, V]). Returns a contiguous x.dtype tensor,
    or with quantize_group its QuantizedActivation as [T, ...*D] rows: quantized by the same
    kernel where a head is whole groups (D a power of two and a multiple of the group: Qwen's
    128 value columns per head, 128 per group), else by the standalone quantizer after it."""
    _check_gated_rms_norm_args(x, gate, weight, quantize_group)
    dim = x.shape[-1]
    x3, gate3 = _as_3d(x), _as_3d(gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x3.shape[0] * x3.shape[1]
    block_d = triton.next_power_of_2(dim)
    fused = quantize_group > 0 and block_d == dim and dim % quantize_group == 0
    rows_out = out.view(x.shape[0], -1)
    out_fp8, out_scale = quantized_outputs(*rows_out.shape, quantize_group, x.device) if fused else (out, out)
    if num_rows:
        block_rows = max(1, min(16, 4096 // block_d))
        _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x3, gate3, weight, out, out_fp8, out_scale, num_rows, x3.shape[1], x3.stride(0), x3.stride(1),
            gate3.stride(0), gate3.stride(1), eps, D=dim, BD=block_d, BR=block_rows,
            GROUP=quantize_group if fused else 0, num_warps=4, **pdl(x.device))
    if fused:
        return QuantizedActivation(rows_out, out_fp8, out_scale, quantize_group)
    return quantize_activation(rows_out, quantize_group) if quantize_group else out
