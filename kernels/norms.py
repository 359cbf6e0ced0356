"""RMSNorm variants of the Qwen3.5 / Qwen3-Next family.

- `rms_norm`: layer norm with a zero-centred weight, `x / rms(x) * (1 + w)`, optionally fused
  with the residual add that precedes it (`x + residual` is normalised and also returned as
  the new residual stream).
- `gated_rms_norm`: the GDN output norm, `x / rms(x) * w * silu(z)` per value head (plain `w`).

Math is done in float32 and rounded once at the end, as HF transformers does. `rms_norm` and
`gated_rms_norm` are the Triton kernels (one program per row / per block of rows), the
`_reference` functions their torch oracles. Knows nothing about layers or models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import dependent_prologue, pdl


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H]; weight: [H]. Returns (normed, new_residual).

    new_residual = x + residual (or x when residual is None), kept in x's dtype.
    """
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return normed.to(x.dtype), x


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
    """x, gate: [..., D] (one value head per row); weight: [D]. Returns x's dtype.

    HF rounds the normalised value to the input dtype before multiplying by `w`; we keep fp32
    throughout, which differs only below the input dtype's precision.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float() * F.silu(gate.float())).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x, residual, weight, out, residual_out, stride_x, stride_residual, eps,
                     H: tl.constexpr, BH: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """One row: s = x (+ residual, rounded to x's dtype: the new residual stream);
    out = s / sqrt(mean(s^2) + eps) * (1 + w), in float32, rounded once."""
    dependent_prologue(DEPENDENT_LAUNCH)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BH)
    mask = offs < H
    h = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(residual + row * stride_residual + offs, mask=mask, other=0.0).to(tl.float32))
        h = h.to(residual_out.dtype.element_ty)
        tl.store(residual_out + row * H + offs, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h) / H + eps)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * H + offs, (h * rstd * (1.0 + w)).to(out.dtype.element_ty), mask=mask)


def _check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x: [T, H], unit stride along H"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), "weight: contiguous [H]"
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype, \
            "residual: x's shape and dtype, unit stride along H"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rms_norm_reference. x, residual [T, H] with unit stride along H; outputs contiguous.
    Without a residual the returned residual is x itself (no copy), as the reference."""
    _check_rms_norm_args(x, weight, residual)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        new_residual = torch.empty_like(out)
    else:
        new_residual = x
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](x, residual if residual is not None else x, weight, out, new_residual,
                                        x.stride(0), residual.stride(0) if residual is not None else 0, eps,
                                        H=hidden, BH=block, HAS_RESIDUAL=residual is not None,
                                        num_warps=min(16, max(1, block // 512)), **pdl(x.device))
    return out, new_residual


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(x, gate, weight, out, num_rows, inner, stride_x_outer, stride_x_inner,
                           stride_gate_outer, stride_gate_inner, eps,
                           D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """BR rows of D: out = x / sqrt(mean(x^2) + eps) * w * silu(gate), float32, rounded once.
    Row r is (r // inner, r % inner) of the [outer, inner, D] views."""
    dependent_prologue(DEPENDENT_LAUNCH)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    offs = tl.arange(0, BD)
    mask = (rows < num_rows)[:, None] & (offs < D)[None, :]
    outer, within = rows // inner, rows % inner
    h = tl.load(x + (outer * stride_x_outer + within * stride_x_inner)[:, None] + offs[None, :],
                mask=mask, other=0.0).to(tl.float32)
    z = tl.load(gate + (outer * stride_gate_outer + within * stride_gate_inner)[:, None] + offs[None, :],
                mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight + offs, mask=offs < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)
    y = h * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
    tl.store(out + rows[:, None] * D + offs[None, :], y.to(out.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> a view [outer, inner, D]: [T, D] -> [T, 1, D]; more than two leading dims
    are merged into the first (they must be mergeable without a copy)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.view(-1, *t.shape[-2:]) if t.dim() > 3 else t


def _check_gated_rms_norm_args(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.shape == gate.shape and x.dim() >= 2 and x.stride(-1) == 1 and gate.stride(-1) == 1, \
        "x, gate: [..., D] of one shape, unit stride along D"
    assert weight.shape == (x.shape[-1],) and weight.is_contiguous(), "weight: contiguous [D]"


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton gated_rms_norm_reference. x, gate [..., D] with unit stride along D (gate may be a
    strided view, e.g. z of the GDN projection as [T, HV, V]). Returns a contiguous x.dtype tensor."""
    _check_gated_rms_norm_args(x, gate, weight)
    dim = x.shape[-1]
    x3, gate3 = _as_3d(x), _as_3d(gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows:
        block_d = triton.next_power_of_2(dim)
        block_rows = max(1, min(16, 4096 // block_d))
        _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x3, gate3, weight, out, num_rows, x3.shape[1], x3.stride(0), x3.stride(1), gate3.stride(0),
            gate3.stride(1), eps, D=dim, BD=block_d, BR=block_rows, num_warps=4, **pdl(x.device))
    return out
