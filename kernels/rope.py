"""Per-head q/k RMSNorm fused with partial rotary position embedding, and the KV write after it.

Gated attention normalises every query and key head with its own `(1 + w)` RMSNorm and then
rotates only the first `rotary_dim` channels (partial RoPE, Qwen3.5: 0.25 of head_dim) with
the rotate-half convention: pairs are (i, i + rotary_dim/2). Frequencies are RoPE's
theta^(-2i / rotary_dim), or YaRN's blend of those and their interpolation (`Yarn`, with its
cos/sin scale, as HF's `_compute_yarn_parameters`). Positions are one per token [T], or three
[3, T] (multimodal RoPE of image tokens: temporal, height, width; engine/vision/prompt.py),
frequency i then turning by the position of axis `mrope_axes(...)[i]` (Qwen3.5's interleaved
sections). `qk_norm_rope_reference` is the torch
oracle of the norm and rotation. `QKNormRopeKV` is all the attention does between its qkv
projection and attending: q normalised and rotated, k normalised, rotated and stored with v into
the KV pool by slot. `qk_norm_rope_kv` runs it as one Triton launch, a program per (token, head);
its device functions (`rope_factors`, `norm_rope_head`, `pool_offset`) also serve the one-row
projection that runs it in its epilogue (linear.py). Knows the KV pool only as a slot-addressed
array; nothing of block tables or attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention import check_pool, to_kv, write_kv_reference
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


def mrope_axes(rotary_dim: int, mrope_section: tuple[int, ...]) -> torch.Tensor:
    """[rotary_dim // 2] int64: the axis (0 temporal, 1 height, 2 width) whose position turns
    frequency i under interleaved multimodal RoPE (HF Qwen3.5's `recomposition_frequencies`):
    height at i = 1 mod 3 below 3 * section[1], width at i = 2 mod 3 below 3 * section[2], the
    temporal axis elsewhere."""
    i = torch.arange(rotary_dim // 2)
    height, width = 3 * mrope_section[1], 3 * mrope_section[2]
    return torch.where((i % 3 == 1) & (i < height), 1, torch.where((i % 3 == 2) & (i < width), 2, 0))


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, yarn: Yarn | None = None,
                 mrope_section: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T], or [3, T] with mrope_section -> cos, sin: [T, rotary_dim // 2] float32
    (times YaRN's attention factor)."""
    inv_freq = rope_inv_freq(rotary_dim, theta, positions.device, yarn)[None, :]
    if positions.dim() == 2:
        assert positions.shape[0] == 3 and len(mrope_section) == 3, "[3, T] positions need an mrope_section"
        axes = mrope_axes(rotary_dim, mrope_section).to(positions.device)
        freqs = positions.float().T.gather(1, axes[None, :].expand(positions.shape[1], -1)) * inv_freq
    else:
        freqs = positions.float()[:, None] * inv_freq
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
                           theta: float, eps: float, yarn: Yarn | None = None,
                           mrope_section: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T] (or [3, T]: rope_cos_sin). Returns
    normalised, rotated (q, k)."""
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, yarn, mrope_section)
    return _norm_rope(q, q_weight, cos, sin, eps), _norm_rope(k, k_weight, cos, sin, eps)


class QKNormRopeKV(NamedTuple):
    """What the gated attention does to its qkv projection's output before attending, on
    qkv [T, Hq * 2D + 2 * Hkv * D] ([q_h | gate_h] per query head, as q_proj stores them, then
    k, then v): each query head RMS-normalised with q_weight and rotated into q_out [T, Hq, D];
    each key head normalised with k_weight, rotated and stored, with its value head, into the KV
    pool (k_cache, v_cache [blocks, block_size, Hkv, D]) at slot_mapping [T] (flat block *
    block_size + offset). qkv itself is left as it was. Run after the projection
    (qk_norm_rope_kv) or by it (kernels/linear.py, one row, positions [T]); q_out is the
    caller's. positions [3, T] (image tokens' multimodal RoPE) take mrope_section."""
    q_out: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    positions: torch.Tensor
    rotary_dim: int
    theta: float
    eps: float
    yarn: Yarn | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    mrope_section: tuple[int, ...] = ()

    @property
    def attention_factor(self) -> float:
        """The rotary channels' cos/sin scale: YaRN's, else 1."""
        return 1.0 if self.yarn is None else self.yarn.attention_factor

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The rotary frequencies on `device` (_inv_freq_table: cached; first call before capture)."""
        return _inv_freq_table(self.rotary_dim, self.theta, device, self.yarn)

    def heads(self, width: int) -> tuple[int, int, int]:
        """(Hq, Hkv, D) of a qkv row `width` columns wide."""
        head_dim, num_kv_heads = self.q_weight.shape[0], self.k_cache.shape[2]
        num_q_heads, ragged = divmod(width - 2 * num_kv_heads * head_dim, 2 * head_dim)
        assert num_q_heads > 0 and not ragged, f"qkv rows of {width} are not [q | gate]_h | k | v of D = {head_dim}"
        return num_q_heads, num_kv_heads, head_dim


def qk_norm_rope_kv_reference(qkv: torch.Tensor, spec: QKNormRopeKV) -> None:
    """QKNormRopeKV's contract by qk_norm_rope_reference and write_kv_reference."""
    num_tokens = qkv.shape[0]
    hq, hkv, d = spec.heads(qkv.shape[1])
    q = qkv[:, :2 * hq * d].view(num_tokens, hq, 2 * d)[..., :d]
    k, v = qkv[:, 2 * hq * d:].view(num_tokens, 2, hkv, d).unbind(1)
    q, k = qk_norm_rope_reference(q, k, spec.q_weight, spec.k_weight, spec.positions, spec.rotary_dim, spec.theta,
                                  spec.eps, spec.yarn, spec.mrope_section)
    spec.q_out.copy_(q)
    write_kv_reference(k, v, spec.k_cache, spec.v_cache, spec.slot_mapping)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def rope_factors(positions, t, inv_freq, attention_factor, R: tl.constexpr, BD: tl.constexpr,
                 axis_stride, MROPE_HEIGHT: tl.constexpr, MROPE_WIDTH: tl.constexpr):
    """(partner, cos, sin) [BD] of token t: channel i < R/2 pairs with i + R/2 (out = x1 c - x2 s),
    R/2 <= i < R with i - R/2 (out = x2 c + x1 s), so sin carries the sign; angle = position *
    inv_freq[i mod R/2] in float32, as the reference; the rotary channels' cos and sin scaled by
    attention_factor (YaRN; 1.0 otherwise); channels >= R: cos 1, sin 0. MROPE_HEIGHT > 0:
    positions [3, axis_stride], frequency f turned by axis mrope_axes(f) (height at f = 1 mod 3
    below MROPE_HEIGHT, width at f = 2 mod 3 below MROPE_WIDTH, else temporal)."""
    offs = tl.arange(0, BD)
    half = R // 2
    rotary = offs < R
    first = offs < half
    partner = tl.where(rotary, tl.where(first, offs + half, offs - half), offs)
    f = tl.where(first, offs, offs - half)
    freq = tl.load(inv_freq + f, mask=rotary, other=0.0)
    if MROPE_HEIGHT > 0:
        axis = tl.where((f % 3 == 1) & (f < MROPE_HEIGHT), 1, tl.where((f % 3 == 2) & (f < MROPE_WIDTH), 2, 0))
        angle = tl.load(positions + axis * axis_stride + t).to(tl.float32) * freq
    else:
        angle = tl.load(positions + t).to(tl.float32) * freq
    cos = tl.where(rotary, tl.cos(angle) * attention_factor, 1.0)
    sin = tl.where(rotary, tl.where(first, -1.0, 1.0) * tl.sin(angle) * attention_factor, 0.0)
    return partner, cos, sin


@triton.jit
def norm_rope_head(src, weight, dst, partner, cos, sin, eps, D: tl.constexpr, BD: tl.constexpr):
    """One head of D values at src -> dst (never the same memory): n = round(x / rms(x) * (1 + w));
    out = round(n cos + n[partner] sin) (rope_factors), both rounded to src's dtype (the model's),
    then stored as dst holds it (to_kv: an FP8 key pool rounds it again). The partner half is
    re-loaded and normalised with the same rms rather than permuted in registers. Loads go to L2
    (.cg): src may hold other SMs' stores of this launch (linear.py's one-row form)."""
    offs = tl.arange(0, BD)
    mask = offs < D
    h = tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    h_partner = tl.load(src + partner, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    w_partner = tl.load(weight + partner, mask=mask, other=0.0).to(tl.float32)
    n = (h * rstd * (1.0 + w)).to(src.dtype.element_ty).to(tl.float32)
    n_partner = (h_partner * rstd * (1.0 + w_partner)).to(src.dtype.element_ty).to(tl.float32)
    tl.store(dst + offs, to_kv((n * cos + sin * n_partner).to(src.dtype.element_ty), dst), mask=mask)


@triton.jit
def pool_offset(slot_mapping, t, kv_head, stride_block, stride_offset, stride_head, BLOCK_SIZE: tl.constexpr):
    """Element offset (int64) of token t's KV head kv_head in a pool [blocks, BLOCK_SIZE, Hkv, D]."""
    slot = tl.load(slot_mapping + t).to(tl.int64)
    return (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset + kv_head * stride_head


@triton.jit
def _qk_norm_rope_kv_kernel(qkv, q_weight, k_weight, q_out, positions, inv_freq, k_cache, v_cache, slot_mapping,
                            stride_t, stride_q_t, stride_block, stride_offset, stride_head, eps, attention_factor,
                            axis_stride, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                            BD: tl.constexpr, BLOCK_SIZE: tl.constexpr, MROPE_HEIGHT: tl.constexpr,
                            MROPE_WIDTH: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (token t, head h): h < HQ the query head h into q_out; else KV head h - HQ, its
    key normalised and rotated and its value copied into the pool. A head a program: a decode
    token's heads run side by side, not one after another."""
    dependent_prologue(DEPENDENT_LAUNCH)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    partner, cos, sin = rope_factors(positions, t, inv_freq, attention_factor, R, BD, axis_stride, MROPE_HEIGHT,
                                     MROPE_WIDTH)
    row = qkv + t * stride_t
    if h < HQ:
        norm_rope_head(row + h * 2 * D, q_weight, q_out + t * stride_q_t + h * D, partner, cos, sin, eps, D, BD)
    else:
        kv_head = h - HQ
        at = pool_offset(slot_mapping, t, kv_head, stride_block, stride_offset, stride_head, BLOCK_SIZE)
        norm_rope_head(row + 2 * HQ * D + kv_head * D, k_weight, k_cache + at, partner, cos, sin, eps, D, BD)
        offs = tl.arange(0, BD)
        value = tl.load(row + (2 * HQ + HKV) * D + kv_head * D + offs, mask=offs < D)
        tl.store(v_cache + at + offs, to_kv(value, v_cache), mask=offs < D)


@cache
def _inv_freq_table(rotary_dim: int, theta: float, device: torch.device, yarn: Yarn | None) -> torch.Tensor:
    """rope_inv_freq, computed once per (rotary_dim, theta, device, yarn) by the reference's own
    formula: the first call must come before CUDA-graph capture."""
    return rope_inv_freq(rotary_dim, theta, device, yarn)


def check_qk_norm_rope_kv_args(qkv: torch.Tensor, spec: QKNormRopeKV) -> tuple[int, int, int]:
    """The kernels' contract on qkv and spec; returns (Hq, Hkv, D)."""
    hq, hkv, d = spec.heads(qkv.shape[1])
    num_tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.stride(1) == 1, "qkv: [T, width], unit stride along the width"
    assert spec.q_weight.shape == spec.k_weight.shape == (d,) and spec.q_weight.is_contiguous() \
        and spec.k_weight.is_contiguous(), "q_weight, k_weight: contiguous [D]"
    assert spec.q_out.shape == (num_tokens, hq, d) and spec.q_out.dtype == qkv.dtype \
        and spec.q_out.stride(2) == 1 and spec.q_out.stride(1) == d, "q_out: [T, Hq, D] in qkv's dtype, heads packed"
    assert spec.positions.shape[-1:] == (num_tokens,) and spec.positions.is_contiguous() \
        and not spec.positions.is_floating_point(), "positions: contiguous [T] or [3, T] integers"
    assert spec.positions.dim() == 1 or (spec.positions.shape[0] == 3 and len(spec.mrope_section) == 3), \
        "positions [3, T] (multimodal RoPE) need a 3-axis mrope_section"
    assert spec.rotary_dim % 2 == 0 and 0 < spec.rotary_dim <= d, f"rotary_dim {spec.rotary_dim}: even, in (0, D]"
    k_cache, v_cache = spec.k_cache, spec.v_cache
    check_pool(k_cache, v_cache)
    assert k_cache.shape[3] == d, f"pool head_dim {k_cache.shape[3]}, qkv heads of {d}"
    assert spec.slot_mapping.shape == (num_tokens,) and spec.slot_mapping.dtype in (torch.int32, torch.int64), \
        "slot_mapping: [T] int32 or int64"
    assert len({t.device for t in (qkv, spec.q_out, k_cache, v_cache, spec.positions, spec.slot_mapping)}) == 1, \
        "qkv, q_out, the pool, positions and slot_mapping on one device"
    return hq, hkv, d


def _mrope_bounds(spec: QKNormRopeKV) -> dict[str, int]:
    """rope_factors' MROPE_HEIGHT / MROPE_WIDTH: 0 (one position a token) unless positions are [3, T]."""
    if spec.positions.dim() == 1:
        return dict(MROPE_HEIGHT=0, MROPE_WIDTH=0)
    return dict(MROPE_HEIGHT=3 * spec.mrope_section[1], MROPE_WIDTH=3 * spec.mrope_section[2])


def qk_norm_rope_kv(qkv: torch.Tensor, spec: QKNormRopeKV) -> None:
    """Triton qk_norm_rope_kv_reference: one launch, a program per (token, query or KV head)."""
    hq, hkv, d = check_qk_norm_rope_kv_args(qkv, spec)
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    k_cache = spec.k_cache
    _qk_norm_rope_kv_kernel[(num_tokens, hq + hkv)](
        qkv, spec.q_weight, spec.k_weight, spec.q_out, spec.positions, spec.inv_freq(qkv.device), k_cache,
        spec.v_cache, spec.slot_mapping, qkv.stride(0), spec.q_out.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), spec.eps, spec.attention_factor, num_tokens,
        HQ=hq, HKV=hkv, D=d, R=spec.rotary_dim, BD=triton.next_power_of_2(d), BLOCK_SIZE=k_cache.shape[1],
        **_mrope_bounds(spec), num_warps=max(1, min(4, d // 64)), **pdl(qkv.device))
