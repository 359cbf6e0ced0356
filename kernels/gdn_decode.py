"""GDN decode/verify with deferred commit (DESIGN.md, "Deferred commit"): one call per layer for
the whole batch. Each row loads its slot's committed state once, folds the slot's pending tokens
(drafts accepted last step), runs its first new token (always accepted: the newest emitted token,
or the only token of a plain decode row), stores the state, then runs its other new tokens (up
to k drafts) producing outputs only and records their g, beta as pending. So the slot keeps no
per-token k or v: the conv decode kernel recomputes the pending tokens' conv outputs from the raw
inputs it keeps (conv1d.py) into a step buffer this kernel folds from. Recurrence and pool
layout: gdn.py. Knows nothing about models or the scheduler.

`gdn_decode` is the Triton kernel (one launch per layer), `gdn_decode_reference` its torch
oracle; both write into a caller's `out` view when given one (a row slice of the layer's output
buffer: no copy after the launch). Kernel grid: one program per (V tile, value head, row); a
program owns the [K, BV] tile of its slot's state, so the state needs no coordination, and reads
the step buffer, which nothing writes. Only pending g / beta (one per value head) are shared, by
the V tiles of a head: all of them read the old entries [0, p) to fold, and the new entries
[0, n-1) overwrite them. See `_gdn_decode_kernel` for how that is ordered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters, last_to_arrive, num_sms, reset_arrivals
from .gdn import expand_heads, gdn_gating_reference, l2norm, recurrent_steps
from .varlen import into, pad_rows, row_layout


def gdn_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                         slot_ids: torch.Tensor, state: torch.Tensor, pending_k: torch.Tensor,
                         pending_v: torch.Tensor, pending_g: torch.Tensor, pending_beta: torch.Tensor,
                         pending_counts: torch.Tensor, commit: bool,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode/verify with deferred commit; shapes as gdn_chunked_reference, 1..P+1 new tokens per row.

    pending_k [B, P, HK, K] and pending_v [B, P, HV, V] are per row: the conv outputs of the
    row's pending tokens (causal_conv1d_decode's step buffer; k not yet l2-normalised).
    pending_g, pending_beta [S, P, HV] are the pool's. Per row: load the committed state, fold
    the slot's p pending tokens and new token 0, store it; run new tokens 1..n-1 producing
    outputs and record their g, beta as pending entries [0, n-1). With commit, fold them too.
    Returns o [T, HV, V] in v's dtype (`out` when given: varlen.into)."""
    num_rows, num_value_heads = slot_ids.numel(), v.shape[1]
    max_pending = pending_g.shape[1]
    slots = slot_ids.long()
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, v.shape[0])
    # Entries past a slot's pending count are stale: select them away (g = beta = 0, k = v = 0
    # is an exact no-op step), never multiply them in.
    valid = (torch.arange(max_pending, device=v.device).view(1, -1)
             < pending_counts[slots].long().view(-1, 1))                          # [B, P]

    def pending(values: torch.Tensor) -> torch.Tensor:
        """[B, P, ...] -> float, zero past each row's count."""
        return torch.where(valid.view(*valid.shape, *[1] * (values.dim() - 2)), values.float(), 0.0)

    folded, _ = recurrent_steps(state[slots].float(), None, pending(expand_heads(l2norm(pending_k), num_value_heads)),
                                pending(pending_v), pending(pending_g[slots]), pending(pending_beta[slots]))
    g, beta = gdn_gating_reference(a, b, A_log, dt_bias)
    qn = expand_heads(l2norm(q), num_value_heads) * q.shape[-1] ** -0.5
    new = [pad_rows(x, row, index_in_row, num_rows, max_len)
           for x in (qn, expand_heads(l2norm(k), num_value_heads), v.float(), g, beta)]
    first, out_first = recurrent_steps(folded, *(x[:, :1] for x in new))     # new token 0: committed
    final, out_rest = recurrent_steps(first, *(x[:, 1:] for x in new))
    state[slots] = (final if commit else first).to(state.dtype)
    if not commit:
        later = index_in_row > 0  # new tokens 1..n-1 (the drafts) become pending entries 0..n-2
        pending_slots, entry = slots[row[later]], index_in_row[later] - 1
        pending_g[pending_slots, entry] = g[later]
        pending_beta[pending_slots, entry] = beta[later]
    return into(out, torch.cat([out_first, out_rest], dim=1)[row, index_in_row].to(v.dtype))


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
def _inverse_norms(x):
    """1 / ||row|| of a [R, C] block, as the l2norm of gdn.py (eps 1e-6 inside the root)."""
    x = x.to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)


@triton.jit
def _unit_lower_inverse(A, offs, num_rows):
    """(I + A)^-1 for a strictly lower-triangular [M, M] block A whose rows from num_rows on are
    zero (their rows of the inverse are those of I). Forward substitution, row i of L = T - I:
    L[i] = -A[i] - sum_{j<i} A[i, j] L[j] (a select and two sums per row: registers cannot be
    indexed)."""
    L = -A
    for i in range(1, num_rows):
        row_i = tl.sum(tl.where((offs == i)[:, None], L, 0.0), axis=0)          # -A[i]
        row_i += tl.sum(row_i[:, None] * L, axis=0)                           # - sum_j A[i, j] L[j]
        L = tl.where((offs == i)[:, None], row_i[None, :], L)
    return L + tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)


@triton.jit
def _gdn_step_kernel(
    q, k, v, a, b, A_log, dt_bias, slot_ids, state, out,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
):
    """Plain decode (P = 0: one token per row, token i of row i). Program (V tile i_v, value
    head i_h, row); state tile [K, BV] fp32 in registers (K, V and BV are powers of two,
    BV <= V: no masks, so state accesses vectorise); the token's inputs load beside it."""
    i_v, i_h, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // (HV // HK)
    slot = tl.load(slot_ids + row).to(tl.int64)
    token = row.to(tl.int64)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    state_ptrs = state + (slot * HV + i_h) * (K * V) + offs_k[:, None] * V + offs_v[None, :]
    h = tl.load(state_ptrs).to(tl.float32)
    q_t = tl.load(q + token * stride_q_t + i_kh * stride_q_h + offs_k).to(tl.float32)
    k_t = tl.load(k + token * stride_k_t + i_kh * stride_k_h + offs_k).to(tl.float32)
    v_t = tl.load(v + token * stride_v_t + i_h * stride_v_h + offs_v).to(tl.float32)
    g, beta = _gating(tl.load(a + token * stride_a_t + i_h).to(tl.float32),
                      tl.load(b + token * stride_b_t + i_h).to(tl.float32),
                      tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h).to(tl.float32))
    k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t) + 1e-6)
    q_t = q_t * (tl.rsqrt(tl.sum(q_t * q_t) + 1e-6) * scale)
    h = _delta_rule_step(h, k_t, v_t, g, beta)
    tl.store(out + (token * HV + i_h) * V + offs_v, tl.sum(h * q_t[:, None], axis=0).to(out.dtype.element_ty))
    tl.store(state_ptrs, h.to(state.dtype.element_ty))


@triton.jit
def _gdn_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state,
    pending_k, pending_v, pending_g, pending_beta, pending_counts, out, arrivals,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
    stride_pk_r, stride_pk_p, stride_pk_h, stride_pv_r, stride_pv_p, stride_pv_h,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, P: tl.constexpr,
    M: tl.constexpr, BV: tl.constexpr, COMMIT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Deferred commit, P >= 1. Program (V tile i_v, value head i_h, row); state tile [K, BV]
    fp32 in registers (K, V, BV powers of two, BV <= V).

    The row's tokens form one small chunk of M >= 2P + 1 positions: pending entries at [0, P),
    new token i at P + i. Positions past the slot's pending count or the row's token count are
    identity steps (g = beta = 0, k = v = q = 0), so the committed state, which ends at new
    token 0, is the state at position c* = P (c* = M - 1 with COMMIT). With G the cumsum of g
    over the chunk, D[c, d] = exp(G_c - G_d) for d <= c (0 above), and S the committed state
    (the WY form of gdn_chunked.py for one chunk):
        A = strictly-lower(beta_c (k_c . k_d) D)       T = (I + A)^-1   (forward substitution)
        W = T (beta exp(G) * K)                        U = T (beta * V) - W S
        O = exp(G) * (Q S) + (D * (Q K^T)) U           (rows of the new tokens)
        S' = exp(G_c*) S + (K * D[c*, :])^T U           (rows d <= c*)
    T and W need no state: they run while the state tile is in flight. Matrix products go to
    the tensor cores in fp32 operands (tf32 on the GPU for bf16 activations: a 2^-11 rounding
    of each operand, against the bf16 operands of the chunked prefill; exact fp32 under the
    interpreter or for fp32 activations).

    Entries past the counts may be stale or NaN: they are loaded (so the loads wait for the
    slot id alone, not for the count read through it) and then selected away, never multiplied.

    Ordering of the shared pending g / beta (commit=False only): the V // BV programs of a value
    head read the old entries [slot, 0..p) (loaded up front), and the new entries
    [slot, 0..n-1) overwrite them. Programs of one launch have no grid-wide barrier, so each
    program, after its loads and a CTA barrier, increments the head's arrival counter
    (acq_rel, gpu scope: its loads happen before the last arriver's stores). The program that
    arrives last knows that every reader is done; it alone writes the head's new g / beta, then
    resets the counter to 0, so the counters are zero between launches (launches of one stream
    never overlap).
    Invariant: rows in a launch own distinct slots, except pad rows, which all point at scratch
    slot 0, whose contents are never read as real state.
    """
    i_v, i_h, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // (HV // HK)
    slot = tl.load(slot_ids + row).to(tl.int64)
    bos = tl.load(cu_seqlens + row).to(tl.int64)
    num_new = tl.minimum(tl.load(cu_seqlens + row + 1).to(tl.int64) - bos, P + 1)  # the launcher's contract
    num_pending = tl.minimum(tl.load(pending_counts + slot), P)

    offs_c = tl.arange(0, M)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    # state [S, HV, K, V]; pending_g/beta [S, P, HV]; step buffer pending_k [B, P, HK, K], pending_v [B, P, HV, V]
    state_ptrs = state + (slot * HV + i_h) * (K * V) + offs_k[:, None] * V + offs_v[None, :]
    h = tl.load(state_ptrs).to(tl.float32)

    in_buffer = offs_c < P
    new_index = offs_c - P
    is_new = (new_index >= 0) & (new_index < num_new)
    active = (offs_c < num_pending) | is_new
    tokens = bos + new_index
    # Raw k and q rows go to the tensor cores as loaded (bf16 values are exact in tf32); their
    # l2norms, the scale, beta and the decays apply as row scales on the small side.
    pk = tl.load(pending_k + row * stride_pk_r + offs_c[:, None] * stride_pk_p + i_kh * stride_pk_h + offs_k[None, :],
                 mask=in_buffer[:, None], other=0.0)
    nk = tl.load(k + tokens[:, None] * stride_k_t + i_kh * stride_k_h + offs_k[None, :], mask=is_new[:, None], other=0.0)
    kc = tl.where(active[:, None], tl.where(in_buffer[:, None], pk.to(tl.float32), nk.to(tl.float32)), 0.0)  # [M, K]
    k_norms = _inverse_norms(kc)
    pv = tl.load(pending_v + row * stride_pv_r + offs_c[:, None] * stride_pv_p + i_h * stride_pv_h + offs_v[None, :],
                 mask=in_buffer[:, None], other=0.0)
    nv = tl.load(v + tokens[:, None] * stride_v_t + i_h * stride_v_h + offs_v[None, :], mask=is_new[:, None], other=0.0)
    vc = tl.where(active[:, None], tl.where(in_buffer[:, None], pv.to(tl.float32), nv.to(tl.float32)), 0.0)  # [M, BV]
    qc = tl.load(q + tokens[:, None] * stride_q_t + i_kh * stride_q_h + offs_k[None, :], mask=is_new[:, None],
                 other=0.0).to(tl.float32)                                                              # [M, K]
    q_norms = tl.where(is_new, _inverse_norms(qc) * scale, 0.0)
    ng, nbeta = _gating(tl.load(a + tokens * stride_a_t + i_h, mask=is_new, other=0.0).to(tl.float32),
                        tl.load(b + tokens * stride_b_t + i_h, mask=is_new, other=0.0).to(tl.float32),
                        tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h).to(tl.float32))
    pg = tl.load(pending_g + (slot * P + offs_c) * HV + i_h, mask=in_buffer, other=0.0)
    pbeta = tl.load(pending_beta + (slot * P + offs_c) * HV + i_h, mask=in_buffer, other=0.0)
    g = tl.where(active, tl.where(in_buffer, pg, ng), 0.0)
    beta = tl.where(active, tl.where(in_buffer, pbeta, nbeta), 0.0)

    is_last = False
    if not COMMIT:
        is_last = last_to_arrive(arrivals + row * HV + i_h, V // BV)

    G = tl.cumsum(g, axis=0)
    causal = offs_c[:, None] >= offs_c[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)      # D [M, M]
    kk = tl.dot(kc, tl.trans(kc), input_precision=PRECISION) * decay * k_norms[None, :]
    T = _unit_lower_inverse(tl.where(offs_c[:, None] > offs_c[None, :], (beta * k_norms)[:, None] * kk, 0.0),
                            offs_c, P + num_new)
    qk = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * decay * (q_norms[:, None] * k_norms[None, :])

    # U = T (beta * (V - exp(G) * K S)), K l2-normalised
    ks = tl.dot(kc, h, input_precision=PRECISION)                                                 # [M, BV]
    u = tl.dot(T, beta[:, None] * (vc - (tl.exp(G) * k_norms)[:, None] * ks), input_precision=PRECISION)
    o = tl.dot(qk, u, tl.dot(qc, h, input_precision=PRECISION) * (tl.exp(G) * q_norms)[:, None],
               input_precision=PRECISION)
    tl.store(out + (tokens[:, None] * HV + i_h) * V + offs_v[None, :], o.to(out.dtype.element_ty),
             mask=is_new[:, None])

    LAST: tl.constexpr = M - 1 if COMMIT else P  # c*
    G_last = tl.sum(tl.where(offs_c == LAST, G, 0.0), axis=0)
    k_decay = tl.where(offs_c <= LAST, tl.exp(G_last - G) * k_norms, 0.0)
    h = tl.dot(tl.trans(kc), u * k_decay[:, None], h * tl.exp(G_last), input_precision=PRECISION)
    tl.store(state_ptrs, h.to(state.dtype.element_ty))
    if not COMMIT:
        # new tokens 1..n-1 (drafts) become pending entries 0..n-2 (n - 1 <= P)
        write = tl.where(is_last, is_new & (new_index >= 1), False)
        tl.store(pending_g + (slot * P + new_index - 1) * HV + i_h, ng, mask=write)
        tl.store(pending_beta + (slot * P + new_index - 1) * HV + i_h, nbeta, mask=write)
        if is_last:
            reset_arrivals(arrivals + row * HV + i_h)


@dataclass(frozen=True)
class DecodeConfig:
    block_v: int    # value columns per program (power of two; >= 16 for the verify kernel's dots)
    num_warps: int


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def decode_config(num_rows: int, num_value_heads: int, key_dim: int, value_dim: int, max_pending: int,
                  device: torch.device) -> DecodeConfig:
    """Plain decode (P = 0): 16-column tiles of one warp; batches with >= 8 programs of 32
    columns per SM take 32-column tiles of two warps (64 state values per thread either way).
    Verify (P > 0): TODO sweep. From the tile sweeps of bench/kernels_gdn_decode.py (--sweep;
    results/kernels_gdn_decode-*.json)."""
    if INTERPRETED:
        return DecodeConfig(block_v=min(16, value_dim), num_warps=1)
    if max_pending:
        return DecodeConfig(block_v=min(32, value_dim), num_warps=2)
    block_v = 16
    if num_rows * num_value_heads * (value_dim // 32) >= 8 * num_sms(device):
        block_v = 32
    block_v = min(block_v, value_dim)
    return DecodeConfig(block_v, num_warps=max(1, key_dim * block_v // 2048))


def launch_gdn_decode(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                      slot_ids: torch.Tensor, state: torch.Tensor, pending_k: torch.Tensor,
                      pending_v: torch.Tensor, pending_g: torch.Tensor, pending_beta: torch.Tensor,
                      pending_counts: torch.Tensor, commit: bool, config: DecodeConfig) -> None:
    """gdn_decode into `out` [T, HV, V] (contiguous) with an explicit tile config. Each row runs
    1..P+1 new tokens (the kernels hold P + 1 at most; the total is checked here); with P = 0,
    one token per row (plain decode: `_gdn_step_kernel`), else `_gdn_verify_kernel`.

    q, k [T, HK, K] and v [T, HV, V] may be strided views (the split of the conv output) with
    unit stride along the head dim; a, b [T, HV] unit stride along heads; so may the step buffer
    views pending_k [B, P, HK, K] and pending_v [B, P, HV, V] (P may be 0). The pool tensors are
    contiguous, laid out as gdn.py says; state fp32 or bf16 (math in fp32 either way)."""
    num_tokens, num_key_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1], v.shape[2]
    num_slots, max_pending = pending_g.shape[0], pending_g.shape[1]
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
    assert pending_k.shape == (num_rows, max_pending, num_key_heads, key_dim) and pending_k.stride(3) == 1
    assert pending_v.shape == (num_rows, max_pending, num_value_heads, value_dim) and pending_v.stride(3) == 1
    assert pending_g.shape == (num_slots, max_pending, num_value_heads) and pending_beta.shape == pending_g.shape
    assert pending_g.dtype == torch.float32 and pending_beta.dtype == torch.float32
    assert pending_counts.shape == (num_slots,)
    for t in (state, pending_g, pending_beta, pending_counts, cu_seqlens, slot_ids):
        assert t.is_contiguous()
    assert out.shape == v.shape and out.dtype == v.dtype and out.is_contiguous()
    assert num_tokens <= num_rows * (max_pending + 1), "a row runs at most P + 1 new tokens"
    if num_rows == 0:
        return
    grid = (triton.cdiv(value_dim, config.block_v), num_value_heads, num_rows)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0))
    if max_pending == 0:
        # Nothing pending, no drafts: commit or not, the one token is committed.
        assert num_tokens == num_rows, "without pending buffers (P = 0) every row runs one token"
        _gdn_step_kernel[grid](q, k, v, a, b, A_log, dt_bias, slot_ids, state, out, *strides, key_dim ** -0.5,
                               HK=num_key_heads, HV=num_value_heads, K=key_dim, V=value_dim, BV=config.block_v,
                               num_warps=config.num_warps)
        return
    assert config.block_v >= 16 and key_dim >= 16, "the verify kernel's dots need 16 columns"
    # Plain decode (commit) writes nothing shared and never touches the counters.
    arrivals = arrival_counters(v.device, 0 if commit else num_rows * num_value_heads)
    _gdn_verify_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state,
        pending_k, pending_v, pending_g, pending_beta, pending_counts, out, arrivals,
        *strides, *pending_k.stride()[:3], *pending_v.stride()[:3], key_dim ** -0.5,
        HK=num_key_heads, HV=num_value_heads, K=key_dim, V=value_dim, P=max_pending,
        M=max(16, triton.next_power_of_2(2 * max_pending + 1)), BV=config.block_v, COMMIT=commit,
        PRECISION="ieee" if v.dtype == torch.float32 else "tf32",      # fp32 activations: exact fp32 dots
        num_warps=config.num_warps,
    )


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor,
               state: torch.Tensor, pending_k: torch.Tensor, pending_v: torch.Tensor, pending_g: torch.Tensor,
               pending_beta: torch.Tensor, pending_counts: torch.Tensor, commit: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton gdn_decode_reference: same arguments, same effects, one launch. `out` (optional):
    a contiguous [T, HV, V] view in v's dtype, e.g. a row slice of the layer's output buffer."""
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    config = decode_config(slot_ids.numel(), v.shape[1], q.shape[2], v.shape[2], pending_g.shape[1],
                           v.device)
    launch_gdn_decode(out, q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state, pending_k, pending_v,
                      pending_g, pending_beta, pending_counts, commit, config)
    return out
