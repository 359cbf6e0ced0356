"""GDN decode/verify with deferred commit (DESIGN.md, "Deferred commit"): one call per layer for
the whole batch; each row loads its slot's committed state once, folds the pending tokens of
the previous step, stores the result, then runs its new tokens (1 for decode, up to k+1 for
verify) producing outputs, and records their inputs as pending. Recurrence and pool layout:
gdn.py. Knows nothing about models or the scheduler.

`gdn_decode` is the Triton kernel (one launch per layer), `gdn_decode_reference` its torch
oracle. Kernel grid: one program per (V tile, value head, row); a program owns the [K, BV] tile
of its slot's state and the BV columns of its value head's pending v, so state and pending v
need no coordination. pending k (one per key head) and pending g/beta (one per value head) are
shared by every program of a key-head group: all of them read the old entries [0, p) to fold,
and the new entries [0, n) overwrite them. See `_gdn_decode_kernel` for how that is ordered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from .gdn import expand_heads, gdn_gating_reference, l2norm, recurrent_steps
from .varlen import pad_rows, row_layout


def gdn_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                         slot_ids: torch.Tensor, state: torch.Tensor, pending_k: torch.Tensor,
                         pending_v: torch.Tensor, pending_g: torch.Tensor, pending_beta: torch.Tensor,
                         pending_counts: torch.Tensor, commit: bool) -> torch.Tensor:
    """Decode/verify with deferred commit; shapes as gdn_chunked_reference, 1..P tokens per row.

    Per row: load the committed state, fold the slot's pending tokens, store it; run the new
    tokens producing outputs; record their inputs as pending (or fold them too when commit)."""
    num_rows, num_value_heads = slot_ids.numel(), v.shape[1]
    max_pending = pending_k.shape[1]
    slots = slot_ids.long()
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, v.shape[0])
    # Columns past a slot's pending count are stale: select them away (g = beta = 0, k = v = 0
    # is an exact no-op step), never multiply them in.
    valid = (torch.arange(max_pending, device=v.device).view(1, -1)
             < pending_counts[slots].long().view(-1, 1))[..., None]             # [B, P, 1]

    def pending(buffer: torch.Tensor) -> torch.Tensor:
        values = buffer[slots].float()
        return torch.where(valid.view(*valid.shape, *[1] * (values.dim() - 3)), values, 0.0)

    folded, _ = recurrent_steps(state[slots].float(), None, expand_heads(pending(pending_k), num_value_heads),
                                pending(pending_v), pending(pending_g), pending(pending_beta))
    g, beta = gdn_gating_reference(a, b, A_log, dt_bias)
    kn = l2norm(k)
    qn = expand_heads(l2norm(q), num_value_heads) * q.shape[-1] ** -0.5
    pad = lambda x: pad_rows(x, row, index_in_row, num_rows, max_len)
    final, out = recurrent_steps(folded, pad(qn), pad(expand_heads(kn, num_value_heads)), pad(v.float()),
                                  pad(g), pad(beta))
    if commit:
        state[slots] = final.to(state.dtype)
    else:
        state[slots] = folded.to(state.dtype)
        tok_slots = slots[row]
        pending_k[tok_slots, index_in_row] = kn.to(pending_k.dtype)
        pending_v[tok_slots, index_in_row] = v.to(pending_v.dtype)
        pending_g[tok_slots, index_in_row] = g.to(pending_g.dtype)
        pending_beta[tok_slots, index_in_row] = beta.to(pending_beta.dtype)
    return out[row, index_in_row].to(v.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _delta_rule_step(state, k, v, g, beta):
    """One token on a [BK, BV] state tile: S = exp(g) S; S += k (beta (v - S^T k))^T.
    k [BK] fp32 (l2-normalised), v [BV] fp32, g, beta fp32 scalars."""
    state = state * tl.exp(g)
    delta = beta * (v - tl.sum(state * k[:, None], axis=0))
    return state + k[:, None] * delta[None, :]


@triton.jit
def _gating(a, b, A_log, dt_bias):
    """g = -exp(A_log) softplus(a + dt_bias) (softplus(x) = x above 20, as torch); beta = sigmoid(b)."""
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return -tl.exp(A_log) * softplus, tl.sigmoid(b)


@triton.jit
def _gdn_decode_kernel(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state,
    pending_k, pending_v, pending_g, pending_beta, pending_counts, out, arrivals,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, P: tl.constexpr,
    BV: tl.constexpr, BG: tl.constexpr, COMMIT: tl.constexpr,
):
    """Program (V tile i_v, value head i_h, row). State tile [K, BV] fp32 in registers (K, V and
    BV are powers of two, BV <= V: no masks, so state accesses vectorise).

    Ordering of the shared pending k / g / beta (commit=False only): every program of a key-head
    group (G value heads x NV tiles, G = HV/HK) reads the old entries [slot, 0..p) while folding,
    and the new entries [slot, 0..n) overwrite them. Programs of one launch have no grid-wide
    barrier, so each program, after its fold (whose result it has stored, so every pending load
    has returned) and a CTA barrier, increments the group's arrival counter (acq_rel, gpu scope).
    The program that arrives last knows that every reader is done; it alone writes the group's
    new k and its G heads' g/beta, then resets the counter to 0, so the counters are zero
    between launches (launches of one stream never overlap). pending v and the state tile are
    private to each program: its own CTA barrier orders its reads before its writes.
    Invariant: rows in a launch own distinct slots, except pad rows, which all point at scratch
    slot 0, whose contents are never read as real state.
    """
    i_v, i_h, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    G = HV // HK
    i_kh = i_h // G
    slot = tl.load(slot_ids + row).to(tl.int64)
    bos = tl.load(cu_seqlens + row).to(tl.int64)
    num_new = tl.load(cu_seqlens + row + 1).to(tl.int64) - bos
    num_pending = tl.minimum(tl.load(pending_counts + slot), P)

    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    # state [S, HV, K, V], pending_k [S, P, HK, K], pending_v [S, P, HV, V], pending_g/beta [S, P, HV]
    state_ptrs = state + (slot * HV + i_h) * (K * V) + offs_k[:, None] * V + offs_v[None, :]
    h = tl.load(state_ptrs).to(tl.float32)

    for j in range(0, num_pending):
        pend = slot * P + j
        k_j = tl.load(pending_k + (pend * HK + i_kh) * K + offs_k).to(tl.float32)
        v_j = tl.load(pending_v + (pend * HV + i_h) * V + offs_v).to(tl.float32)
        g_j = tl.load(pending_g + pend * HV + i_h)
        beta_j = tl.load(pending_beta + pend * HV + i_h)
        h = _delta_rule_step(h, k_j, v_j, g_j, beta_j)

    is_last = False
    if not COMMIT:
        if num_pending > 0:  # with nothing pending the committed state stays as it is
            tl.store(state_ptrs, h.to(state.dtype.element_ty))
        tl.debug_barrier()
        arrival = arrivals + row * HK + i_kh
        is_last = tl.atomic_add(arrival, 1) == G * (V // BV) - 1

    A = tl.load(A_log + i_h).to(tl.float32)
    bias = tl.load(dt_bias + i_h).to(tl.float32)
    # The group's G value heads, for the last arriver's pending g / beta.
    group_heads = i_kh * G + tl.arange(0, BG)
    mask_g = tl.arange(0, BG) < G
    for i in range(0, num_new):
        t = bos + i
        q_t = tl.load(q + t * stride_q_t + i_kh * stride_q_h + offs_k).to(tl.float32)
        k_t = tl.load(k + t * stride_k_t + i_kh * stride_k_h + offs_k).to(tl.float32)
        v_t = tl.load(v + t * stride_v_t + i_h * stride_v_h + offs_v)
        q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t) + 1e-6) * scale
        k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t) + 1e-6)
        g_t, beta_t = _gating(tl.load(a + t * stride_a_t + i_h).to(tl.float32),
                              tl.load(b + t * stride_b_t + i_h).to(tl.float32), A, bias)
        h = _delta_rule_step(h, k_t, v_t.to(tl.float32), g_t, beta_t)
        o_t = tl.sum(h * q_t[:, None], axis=0)
        tl.store(out + (t * HV + i_h) * V + offs_v, o_t.to(out.dtype.element_ty))
        if not COMMIT:
            pend = slot * P + i
            fits = i < P  # a row never carries more than P tokens; guard the buffer anyway
            tl.store(pending_v + (pend * HV + i_h) * V + offs_v, v_t.to(pending_v.dtype.element_ty),
                     mask=fits)
            write = fits & is_last
            tl.store(pending_k + (pend * HK + i_kh) * K + offs_k, k_t.to(pending_k.dtype.element_ty),
                     mask=write)
            g_group, beta_group = _gating(
                tl.load(a + t * stride_a_t + group_heads, mask=mask_g & write, other=0.0).to(tl.float32),
                tl.load(b + t * stride_b_t + group_heads, mask=mask_g & write, other=0.0).to(tl.float32),
                tl.load(A_log + group_heads, mask=mask_g & write, other=0.0).to(tl.float32),
                tl.load(dt_bias + group_heads, mask=mask_g & write, other=0.0).to(tl.float32))
            tl.store(pending_g + pend * HV + group_heads, g_group, mask=mask_g & write)
            tl.store(pending_beta + pend * HV + group_heads, beta_group, mask=mask_g & write)

    if COMMIT:
        tl.store(state_ptrs, h.to(state.dtype.element_ty))
    elif is_last:
        tl.store(arrivals + row * HK + i_kh, 0)


@dataclass(frozen=True)
class DecodeConfig:
    block_v: int    # value columns per program (power of two)
    num_warps: int


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def decode_config(num_rows: int, num_value_heads: int, key_dim: int, value_dim: int, commit: bool,
                  device: torch.device) -> DecodeConfig:
    """16-column tiles of one warp; decode batches with >= 8 programs of 32 columns per SM take
    32-column tiles of two warps (64 state values per thread either way). From the tile sweep in
    bench/results/kernels_gdn_decode-h200.json: 16x1 is fastest for verify at every batch (by
    1.2-1.8x at B >= 64) and for decode up to B = 8; 32x2 gains ~4% on large decode batches."""
    if INTERPRETED:
        return DecodeConfig(block_v=min(16, value_dim), num_warps=1)
    block_v = 16
    if commit and num_rows * num_value_heads * (value_dim // 32) >= 8 * _num_sms(device):
        block_v = 32
    block_v = min(block_v, value_dim)
    return DecodeConfig(block_v, num_warps=max(1, key_dim * block_v // 2048))


@cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (row, key head), kept at zero between launches by the kernel
    itself (its last arriver resets them). One buffer per device, shared by every layer: launches
    on one stream run one after another. Grows outside CUDA-graph capture only (warm up first)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = _ARRIVALS.get(device)
    if buffer is None or buffer.numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gdn_decode: arrival counters must be sized before CUDA-graph capture; "
                               "run the largest batch once eagerly first")
        buffer = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        _ARRIVALS[device] = buffer
    return buffer


def launch_gdn_decode(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                      slot_ids: torch.Tensor, state: torch.Tensor, pending_k: torch.Tensor,
                      pending_v: torch.Tensor, pending_g: torch.Tensor, pending_beta: torch.Tensor,
                      pending_counts: torch.Tensor, commit: bool, config: DecodeConfig) -> None:
    """gdn_decode into `out` [T, HV, V] (contiguous) with an explicit tile config.

    q, k [T, HK, K] and v [T, HV, V] may be strided views (the split of the conv output) with
    unit stride along the head dim; a, b [T, HV] unit stride along heads. The pool tensors are
    contiguous, laid out as gdn.py says; state fp32 or bf16 (math in fp32 either way)."""
    num_tokens, num_key_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1], v.shape[2]
    num_slots, max_pending = pending_k.shape[0], pending_k.shape[1]
    num_rows = slot_ids.numel()
    assert k.shape == q.shape and v.shape[0] == num_tokens and num_value_heads % num_key_heads == 0
    assert a.shape == (num_tokens, num_value_heads) and b.shape == a.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert A_log.shape == (num_value_heads,) and dt_bias.shape == A_log.shape
    assert A_log.is_contiguous() and dt_bias.is_contiguous()
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape == (num_rows + 1,)
    assert slot_ids.dtype == torch.int32 and pending_counts.dtype == torch.int32
    assert state.shape == (num_slots, num_value_heads, key_dim, value_dim)
    assert state.dtype in (torch.float32, torch.bfloat16)
    assert key_dim & (key_dim - 1) == 0 and value_dim & (value_dim - 1) == 0, "K and V must be powers of two"
    assert config.block_v <= value_dim and config.block_v & (config.block_v - 1) == 0
    assert pending_k.shape == (num_slots, max_pending, num_key_heads, key_dim)
    assert pending_v.shape == (num_slots, max_pending, num_value_heads, value_dim)
    assert pending_g.shape == (num_slots, max_pending, num_value_heads) and pending_beta.shape == pending_g.shape
    assert pending_g.dtype == torch.float32 and pending_beta.dtype == torch.float32
    assert pending_counts.shape == (num_slots,)
    for t in (state, pending_k, pending_v, pending_g, pending_beta, pending_counts, cu_seqlens, slot_ids):
        assert t.is_contiguous()
    assert out.shape == v.shape and out.dtype == v.dtype and out.is_contiguous()
    if num_rows == 0:
        return
    arrivals = arrival_counters(v.device, num_rows * num_key_heads)
    grid = (triton.cdiv(value_dim, config.block_v), num_value_heads, num_rows)
    _gdn_decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state,
        pending_k, pending_v, pending_g, pending_beta, pending_counts, out, arrivals,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        key_dim ** -0.5,
        HK=num_key_heads, HV=num_value_heads, K=key_dim, V=value_dim, P=max_pending,
        BV=config.block_v,
        BG=triton.next_power_of_2(num_value_heads // num_key_heads), COMMIT=commit,
        num_warps=config.num_warps,
    )


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor,
               state: torch.Tensor, pending_k: torch.Tensor, pending_v: torch.Tensor, pending_g: torch.Tensor,
               pending_beta: torch.Tensor, pending_counts: torch.Tensor, commit: bool) -> torch.Tensor:
    """Triton gdn_decode_reference: same arguments, same effects, one launch."""
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    config = decode_config(slot_ids.numel(), v.shape[1], q.shape[2], v.shape[2], commit, v.device)
    launch_gdn_decode(out, q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state, pending_k, pending_v,
                      pending_g, pending_beta, pending_counts, commit, config)
    return out
