"""Per-head q/k RMSNorm fused with partial rotary position embedding.

Gated attention normalises every query and key head with its own `(1 + w)` RMSNorm and then
rotates only the first `rotary_dim` channels (partial RoPE, Qwen3.5: 0.25 of head_dim) with
the rotate-half convention: pairs are (i, i + rotary_dim/2). Frequencies are RoPE's
theta^(-2i / rotary_dim), or YaRN's blend of those and their interpolation (`Yarn`, with its
cos/sin scale, as HF's `_compute_yarn_parameters`). `qk_norm_rope` is the Triton
kernel (one launch for q and k), `qk_norm_rope_reference` its torch oracle. Knows nothing about
the KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from .launch import dependent_prologue, pdl


@dataclass(frozen=True)
class Yarn:
    """YaRN context extension. Frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those turning more than beta_fast
    times kept, with a linear ramp between; cos and sin are scaled by attention_factor (the
    config resolves it from factor / mscale as HF does)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if not (self.factor > 0 and self.original_max_position_embeddings > 0 and self.beta_fast > 0
                and self.beta_slow > 0 and self.attention_factor > 0):
            raise ValueError(f"invalid YaRN parameters {self}")

    def correction_range(self, rotary_dim: int, theta: float) -> tuple[float, float]:
        """Frequency indices (of rotary_dim / 2) where the ramp from extrapolation to
        interpolation starts and ends: dim i turns L / (2 pi theta^(2i/d)) times over L."""
        def index(num_rotations: float) -> float:
            return (rotary_dim * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                    / (2 * math.log(theta)))
        low, high = index(self.beta_fast), index(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rotary_dim - 1)


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str, yarn: Yarn | None = None) -> torch.Tensor:
    """[rotary_dim // 2] float32: theta^(-2i / rotary_dim), YaRN-blended when given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    if yarn is None:
        return inv_freq
    low, high = yarn.correction_range(rotary_dim, theta)
    high = high + 0.001 if low == high else high      # as HF: no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp        # 1: keep the frequency (fast dims), 0: interpolate it
    return inv_freq / yarn.factor * (1 - extrapolated) + inv_freq * extrapolated


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                 yarn: Yarn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> cos, sin: [T, rotary_dim // 2] float32 (times YaRN's attention factor)."""
    freqs = positions.float()[:, None] * rope_inv_freq(rotary_dim, theta, positions.device, yarn)[None, :]
    if yarn is None:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * yarn.attention_factor, freqs.sin() * yarn.attention_factor


def _norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               eps: float) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, R/2]
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    # HF rounds after the norm, then rotates in the activation dtype.
    h = h.to(x.dtype).float()
    half = cos.shape[-1]
    x1, x2, rest = h[..., :half], h[..., half:2 * half], h[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return rotated.to(x.dtype)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                           theta: float, eps: float, yarn: Yarn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T]. Returns normalised, rotated (q, k)."""
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, yarn)
    return _norm_rope(q, q_weight, cos, sin, eps), _norm_rope(k, k_weight, cos, sin, eps)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _norm_rope_heads(x, weight, out, t, cos, sin, partner, sign, stride_t, stride_h, eps,
                     H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    """All H heads of token t: n = round(x / rms(x) * (1 + w)); out = n cos + sign n[partner] sin
    on the rotary channels (cos = 1, sin = 0 elsewhere). The partner half is re-loaded and
    normalised with the same per-head rms rather than permuted in registers."""
    heads = tl.arange(0, BH)
    offs = tl.arange(0, BD)
    mask = (heads < H)[:, None] & (offs < D)[None, :]
    base = x + t * stride_t + heads[:, None] * stride_h
    h = tl.load(base + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    h_partner = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)[:, None]
    w = tl.load(weight + offs, mask=offs < D, other=0.0).to(tl.float32)
    w_partner = tl.load(weight + partner, mask=offs < D, other=0.0).to(tl.float32)
    n = (h * rstd * (1.0 + w[None, :])).to(out.dtype.element_ty).to(tl.float32)
    n_partner = (h_partner * rstd * (1.0 + w_partner[None, :])).to(out.dtype.element_ty).to(tl.float32)
    rotated = n * cos[None, :] + (sign * sin)[None, :] * n_partner
    tl.store(out + (t * H + heads[:, None]) * D + offs[None, :], rotated.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q, k, q_weight, k_weight, q_out, k_out, positions, inv_freq,
                         stride_q_t, stride_q_h, stride_k_t, stride_k_h, eps, attention_factor,
                         HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                         BHQ: tl.constexpr, BHK: tl.constexpr, BD: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """One token: every q and k head. Channel i < R/2 pairs with i + R/2 (out = x1 c - x2 s),
    R/2 <= i < R with i - R/2 (out = x2 c + x1 s); angle = position * inv_freq[i mod R/2] in
    float32, as the reference; the rotary channels' cos and sin scaled by attention_factor
    (YaRN; 1.0 otherwise)."""
    dependent_prologue(DEPENDENT_LAUNCH)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    half = R // 2
    rotary = offs < R
    first = offs < half
    partner = tl.where(rotary, tl.where(first, offs + half, offs - half), offs)
    sign = tl.where(first, -1.0, 1.0)
    freq = tl.load(inv_freq + tl.where(first, offs, offs - half), mask=rotary, other=0.0)
    angle = tl.load(positions + t).to(tl.float32) * freq
    cos = tl.where(rotary, tl.cos(angle) * attention_factor, 1.0)
    sin = tl.where(rotary, tl.sin(angle) * attention_factor, 0.0)
    _norm_rope_heads(q, q_weight, q_out, t, cos, sin, partner, sign, stride_q_t, stride_q_h, eps, HQ, D, BHQ, BD)
    _norm_rope_heads(k, k_weight, k_out, t, cos, sin, partner, sign, stride_k_t, stride_k_h, eps, HK, D, BHK, BD)


@cache
def _inv_freq_table(rotary_dim: int, theta: float, device: torch.device, yarn: Yarn | None) -> torch.Tensor:
    """rope_inv_freq, computed once per (rotary_dim, theta, device, yarn) by the reference's own formula."""
    return rope_inv_freq(rotary_dim, theta, device, yarn)


def _check_qk_norm_rope_args(q, k, q_weight, k_weight, positions, rotary_dim) -> None:
    num_tokens, _, head_dim = q.shape
    assert k.shape == (num_tokens, k.shape[1], head_dim) and q.stride(2) == 1 and k.stride(2) == 1, \
        "q [T, Hq, D], k [T, Hk, D], unit stride along D"
    assert q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,), "q_weight, k_weight: [D]"
    assert q_weight.is_contiguous() and k_weight.is_contiguous(), "q_weight, k_weight: contiguous"
    assert positions.shape == (num_tokens,) and positions.is_contiguous() and not positions.is_floating_point(), \
        "positions: contiguous [T] integers"
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, f"rotary_dim {rotary_dim}: even, in (0, D]"


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 positions: torch.Tensor, rotary_dim: int, theta: float, eps: float,
                 yarn: Yarn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton qk_norm_rope_reference. q [T, Hq, D], k [T, Hk, D] may be strided views with unit
    stride along D (q is sliced from [q | gate] per head); positions [T] int. Returns contiguous
    (q, k). The first call per (rotary_dim, theta, device) builds the frequency table: do it
    before CUDA-graph capture."""
    _check_qk_norm_rope_args(q, k, q_weight, k_weight, positions, rotary_dim)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens:
        block_d = triton.next_power_of_2(head_dim)
        block_q = triton.next_power_of_2(num_q_heads)
        _qk_norm_rope_kernel[(num_tokens,)](
            q, k, q_weight, k_weight, q_out, k_out, positions, _inv_freq_table(rotary_dim, theta, q.device, yarn),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps, 1.0 if yarn is None else yarn.attention_factor,
            HQ=num_q_heads, HK=num_k_heads, D=head_dim, R=rotary_dim, BHQ=block_q,
            BHK=triton.next_power_of_2(num_k_heads), BD=block_d,
            num_warps=min(8, max(1, block_q * block_d // 1024)), **pdl(q.device))
    return q_out, k_out
