"""GDN decode/verify with deferred commit (docs/design.md, "Deferred commit"): one call per layer for
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
the step buffer, which nothing writes. Pending g / beta (one per value head) would be shared by
the V tiles of a head; the pool keeps a replica per 16 value columns instead, and a program
reads and writes only its own (`_gdn_decode_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import INTERPRETED, num_sms
from .gdn import expand_heads, gdn_gating_reference, l2norm, recurrent_steps
from .launch import dependent_prologue, pdl
from .tiles import TileConfig
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
    pending_g, pending_beta [S, P, HV, R] are the pool's (R equal replicas, gdn.py: read the
    first, write all). Per row: load the committed state, fold the slot's p pending tokens and
    new token 0, store it; run new tokens 1..n-1 producing outputs and record their g, beta as
    pending entries [0, n-1). With commit, fold them too.
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

    # A state pool below fp32 rounds the state after every token, as one token a step would.
    round_to = None if state.dtype == torch.float32 else state.dtype
    folded, _ = recurrent_steps(state[slots].float(), None, pending(expand_heads(l2norm(pending_k), num_value_heads)),
                                pending(pending_v), pending(pending_g[slots, ..., 0]),
                                pending(pending_beta[slots, ..., 0]), round_to)
    g, beta = gdn_gating_reference(a, b, A_log, dt_bias)
    qn = expand_heads(l2norm(q), num_value_heads) * q.shape[-1] ** -0.5
    new = [pad_rows(x, row, index_in_row, num_rows, max_len)
           for x in (qn, expand_heads(l2norm(k), num_value_heads), v.float(), g, beta)]
    first, out_first = recurrent_steps(folded, *(x[:, :1] for x in new), round_to)     # new token 0: committed
    final, out_rest = recurrent_steps(first, *(x[:, 1:] for x in new), round_to)
    state[slots] = (final if commit else first).to(state.dtype)
    if not commit:
        later = index_in_row > 0  # new tokens 1..n-1 (the drafts) become pending entries 0..n-2
        pending_slots, entry = slots[row[later]], index_in_row[later] - 1
        pending_g[pending_slots, entry] = g[later, :, None]
        pending_beta[pending_slots, entry] = beta[later, :, None]
    return into(out, torch.cat([out_first, out_rest], dim=1)[row, index_in_row].to(v.dtype))


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _delta_rule_step(tile, scale, k, k_norm, v, g, beta, q, q_norm, qk, OUTPUT: tl.constexpr):
    """One token on a [BK, BV] state tile held as S = scale * tile, with the decay kept apart as
    a scalar so that a step does no [BK, BV] multiply for it. With e = exp(g), the unit key
    k^ = k / |k| (k_norm = 1 / |k|, applied to [BV] vectors, never to the [BK] row) and the
    scaled unit query q^ = q_norm q:
        S' = e S + k^ delta^T,   delta = beta (v - e S^T k^)
    is  scale' = e scale,  tile' = tile + k (delta / (|k| scale'))^T,
    and the token's output (OUTPUT) is taken from the tile before its update,
        o = S'^T q^ = q_norm (e scale tile^T q + (q . k) k_norm delta),
    so its reduction runs beside the key's (qk = q . k, the raw rows' dot, needs no state): a
    step's chain is one reduction, a few [BV] operations and the rank-one update.
    Once scale' falls below 2^-60 it is folded into the tile (tile' = scale' tile, scale' = 1)
    first: 1 / scale' stays far inside fp32's range, and e = 0 (g = -inf) zeroes the tile as the
    plain form does. k, q [BK] fp32, v [BV] fp32; k_norm, g, beta, scale, q_norm, qk fp32
    scalars (q, q_norm, qk unused without OUTPUT). Returns (tile', scale', o [BV])."""
    carried = scale * tl.exp(g)  # e S = carried * tile
    delta = beta * (v - (carried * k_norm) * tl.sum(tile * k[:, None], axis=0))
    o = delta  # without OUTPUT: a placeholder the caller drops
    if OUTPUT:
        o = q_norm * (carried * tl.sum(tile * q[:, None], axis=0) + (qk * k_norm) * delta)
    scale = carried
    if scale < 8.673617379884035e-19:  # 2^-60
        # The barrier (the condition is uniform over the program) keeps ptxas from predicating
        # this rare block's multiplies into every step.
        tl.debug_barrier()
        tile = tile * scale
        scale = tl.full([], 1.0, tl.float32)
    return tile + k[:, None] * (delta * (k_norm / scale))[None, :], scale, o


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
def _entry(vector, offs, j):
    """Entry j of an [R] vector held in registers (a select and a sum: registers cannot be indexed)."""
    return tl.sum(tl.where(offs == j, vector, 0.0), axis=0)


@triton.jit
def _rounded(h, h_scale, state):
    """The state scale * h rounded to the pool's dtype after a token (ROUND_STATE: a pool below
    fp32), as storing it after a one-token step rounds it: every token of a verify row or a fold
    sees the state a token a step would, so speculation stays exact on such a pool."""
    return (h * h_scale).to(state.dtype.element_ty).to(tl.float32), tl.full([], 1.0, tl.float32)


@triton.jit
def _first_owned_replica(slot, entry, i_h, i_v, HV: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
                         BV: tl.constexpr, V: tl.constexpr):
    """Offset in pending_g / pending_beta [S, P, HV, R] of the first replica of `entry` (any
    shape) that V tile i_v owns; it owns BV * R / V of them, the replicas of its columns."""
    return ((slot * P + entry) * HV + i_h) * R + i_v * (BV * R // V)


@triton.jit
def _gdn_decode_kernel(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state,
    pending_k, pending_v, pending_g, pending_beta, pending_counts, out,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
    stride_pk_r, stride_pk_p, stride_pk_h, stride_pv_r, stride_pv_p, stride_pv_h,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
    P_BLOCK: tl.constexpr, T_BLOCK: tl.constexpr, BV: tl.constexpr,
    ONE_TOKEN: tl.constexpr, COMMIT: tl.constexpr, ROUND_STATE: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
):
    """Program (V tile i_v, value head i_h, row). State tile [K, BV] fp32 in registers (K, V and
    BV are powers of two, BV <= V: no masks, so state accesses vectorise).

    The token steps are a dependent chain on the tile. Each step's k, v (and q) rows are loaded
    one step ahead, so a load's latency overlaps the step before it and no step picks its row
    out of a register block (a select per element and a cross-lane sum, which cost more than
    the step's own arithmetic). The first rows, and whole [*, K] blocks of the q and k rows for
    their norms, are loaded beside the state. The tile carries no per-step decay multiply
    (_delta_rule_step).

    Pending g / beta (one per value head) would be shared by the head's V // BV programs, which
    all read the old entries [slot, 0..p) and whose new entries [slot, 0..n-1) overwrite them:
    with no grid-wide barrier, that needs ordering, and an arrival counter measured slower
    (bench/results/kernels_gdn_decode_replicas-h100.json). So the pool keeps R replicas of each,
    one per V // R columns (gdn.py), and a program owns the replicas of its columns: it reads the
    first, writes all of them, and touches no other. Programs of one launch own disjoint
    replicas; a launch with another tile width reads replicas that their last owner wrote with
    the same values. The step buffer (pending k, v) and the new tokens are never written here.
    Invariant: rows in a launch own distinct slots, except pad rows, which all point at scratch
    slot 0, whose contents are never read as real state.
    """
    dependent_prologue(DEPENDENT_LAUNCH)
    i_v, i_h, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // (HV // HK)
    slot = tl.load(slot_ids + row).to(tl.int64)
    bos = tl.load(cu_seqlens + row).to(tl.int64)
    num_new = tl.load(cu_seqlens + row + 1).to(tl.int64) - bos
    if P > 0:
        num_pending = tl.minimum(tl.load(pending_counts + slot), P)
    else:
        num_pending = 0

    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_p = tl.arange(0, P_BLOCK)
    offs_t = tl.arange(0, T_BLOCK)
    # state [S, HV, K, V]; pending_g/beta [S, P, HV, R]; step buffer pending_k [B, P, HK, K], pending_v [B, P, HV, V]
    state_ptrs = state + (slot * HV + i_h) * (K * V) + offs_k[:, None] * V + offs_v[None, :]
    h = tl.load(state_ptrs).to(tl.float32)
    h_scale = tl.full([], 1.0, tl.float32)  # the state is h_scale * h (_delta_rule_step)

    # Every load the steps start from is issued here, before any arithmetic on them.
    # Step-buffer rows of entry 0 and every pending g / beta: all P entries, not the first
    # num_pending, so the loads wait for the slot id alone, not for the count read through it.
    # Entries past the count may be stale or NaN; no step reads them (_entry selects).
    pk_ptrs = pending_k + row * stride_pk_r + i_kh * stride_pk_h + offs_k
    pv_ptrs = pending_v + row * stride_pv_r + i_h * stride_pv_h + offs_v
    if P > 0:
        k_j, v_j = tl.load(pk_ptrs), tl.load(pv_ptrs)
    in_buffer = offs_p < P
    pk_block = tl.load(pk_ptrs[None, :] + offs_p[:, None] * stride_pk_p, mask=in_buffer[:, None], other=0.0)
    first_owned = _first_owned_replica(slot, offs_p, i_h, i_v, HV, P, R, BV, V)
    pg = tl.load(pending_g + first_owned, mask=in_buffer, other=0.0)
    pbeta = tl.load(pending_beta + first_owned, mask=in_buffer, other=0.0)

    # The new tokens' q and k rows as whole [T_BLOCK, K] blocks, for their norms (off the steps'
    # chain; the loads also bring the rows the steps read into L1), and new token 0 (a row may
    # have none: every load masked).
    q_ptrs = q + i_kh * stride_q_h + offs_k
    k_ptrs = k + i_kh * stride_k_h + offs_k
    v_ptrs = v + i_h * stride_v_h + offs_v
    tokens = bos + offs_t
    # One token per row: no masks (masked loads made plain decode slower; H100 A/B in commit
    # 6dc8cf0), and the blocks are the rows.
    if ONE_TOKEN:
        q_block = tl.load(q_ptrs[None, :] + tokens[:, None] * stride_q_t)
        k_block = tl.load(k_ptrs[None, :] + tokens[:, None] * stride_k_t)
        q_i, k_i = tl.sum(q_block.to(tl.float32), axis=0), tl.sum(k_block.to(tl.float32), axis=0)
        v_i = tl.load(v_ptrs + bos * stride_v_t)
        a_i = tl.load(a + bos * stride_a_t + i_h).to(tl.float32)
        b_i = tl.load(b + bos * stride_b_t + i_h).to(tl.float32)
    else:
        is_new = (offs_t < num_new)[:, None]
        q_block = tl.load(q_ptrs[None, :] + tokens[:, None] * stride_q_t, mask=is_new, other=0.0)
        k_block = tl.load(k_ptrs[None, :] + tokens[:, None] * stride_k_t, mask=is_new, other=0.0)
        first_k = offs_k < tl.where(num_new > 0, K, 0)
        q_i = tl.load(q_ptrs + bos * stride_q_t, mask=first_k, other=0.0)
        k_i = tl.load(k_ptrs + bos * stride_k_t, mask=first_k, other=0.0)
        v_i = tl.load(v_ptrs + bos * stride_v_t, mask=offs_v < tl.where(num_new > 0, V, 0), other=0.0)
        a_i = tl.load(a + bos * stride_a_t + i_h, mask=num_new > 0, other=0.0).to(tl.float32)
        b_i = tl.load(b + bos * stride_b_t + i_h, mask=num_new > 0, other=0.0).to(tl.float32)
    A_log_h, dt_bias_h = tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h).to(tl.float32)

    pk_norms = _inverse_norms(pk_block)
    q_scales = _inverse_norms(q_block) * scale
    k_scales = _inverse_norms(k_block)
    qk = tl.sum(q_block.to(tl.float32) * k_block.to(tl.float32), axis=1)  # raw q . k per token

    if P > 0:
        for j in range(0, num_pending):
            ahead = tl.minimum(j + 1, P - 1)  # inside the buffer; unused past the count
            k_ahead, v_ahead = tl.load(pk_ptrs + ahead * stride_pk_p), tl.load(pv_ptrs + ahead * stride_pv_p)
            # no output: the query arguments are placeholders
            h, h_scale, _ = _delta_rule_step(h, h_scale, k_j.to(tl.float32), _entry(pk_norms, offs_p, j),
                                             v_j.to(tl.float32), _entry(pg, offs_p, j), _entry(pbeta, offs_p, j),
                                             k_j, h_scale, h_scale, OUTPUT=False)
            if ROUND_STATE:
                h, h_scale = _rounded(h, h_scale, state)
            k_j, v_j = k_ahead, v_ahead
    # num_new <= P + 1 (the launcher's contract); ONE_TOKEN: every row runs one (plain decode),
    # and nothing is loaded ahead.
    for i in range(0, 1 if ONE_TOKEN else num_new):
        if not ONE_TOKEN:
            ahead = bos + tl.minimum(i + 1, num_new - 1)
            q_ahead = tl.load(q_ptrs + ahead * stride_q_t)
            k_ahead = tl.load(k_ptrs + ahead * stride_k_t)
            v_ahead = tl.load(v_ptrs + ahead * stride_v_t)
            a_ahead = tl.load(a + ahead * stride_a_t + i_h).to(tl.float32)
            b_ahead = tl.load(b + ahead * stride_b_t + i_h).to(tl.float32)
        g_i, beta_i = _gating(a_i, b_i, A_log_h, dt_bias_h)
        h, h_scale, o_i = _delta_rule_step(h, h_scale, k_i.to(tl.float32), _entry(k_scales, offs_t, i),
                                           v_i.to(tl.float32), g_i, beta_i, q_i.to(tl.float32),
                                           _entry(q_scales, offs_t, i), _entry(qk, offs_t, i), OUTPUT=True)
        if ROUND_STATE and not ONE_TOKEN:  # one token: the store rounds it
            h, h_scale = _rounded(h, h_scale, state)
        tl.store(out + ((bos + i) * HV + i_h) * V + offs_v, o_i.to(out.dtype.element_ty))
        if not COMMIT:
            if i == 0:  # the committed state ends at new token 0
                tl.store(state_ptrs, (h * h_scale).to(state.dtype.element_ty))
            else:
                # new tokens 1..n-1 (drafts) become pending entries 0..n-2; a row never carries
                # more than P drafts: guard the buffer anyway
                entry = _first_owned_replica(slot, i - 1, i_h, i_v, HV, P, R, BV, V) + tl.arange(0, BV * R // V)
                tl.store(pending_g + entry, g_i, mask=i - 1 < P)
                tl.store(pending_beta + entry, beta_i, mask=i - 1 < P)
        if not ONE_TOKEN:
            q_i, k_i, v_i, a_i, b_i = q_ahead, k_ahead, v_ahead, a_ahead, b_ahead

    if COMMIT:
        tl.store(state_ptrs, (h * h_scale).to(state.dtype.element_ty))


def decode_config(num_rows: int, num_value_heads: int, key_dim: int, value_dim: int, commit: bool,
                  device: torch.device) -> TileConfig:
    """The tile of _gdn_decode_kernel (block_n value columns per program, a power of two, and
    num_warps) by how many programs of 16 columns the batch makes per SM (n = rows x HV x V / 16
    / SMs): few programs want narrow tiles (a launch of few programs is bound by one warp's
    chain of steps, so more of shorter chains finish first), many want wide ones (the per-step
    work that does not scale with the tile, its gating, row loads and norms, is paid once for
    more columns). A warp holds up to 4096 state values (128 a thread), so at K = 128 tiles of up
    to 32 columns are one warp and 64 columns are two.
        verify: 16 columns for n <= 4, else 32
        decode: 16 columns for n <= 8, 32 for n <= 16, else 64 (two warps)
    Never narrower than 16 columns, the width of a pending g / beta replica (gdn.py): 8-column
    verify tiles won only at HV = 16, B = 1, by 2% (measured:
    bench/results/kernels_gdn_decode_replicas-h100.json), and would double the replicas. The
    thresholds are the sweep of bench/kernels_gdn_decode.py at K = V = 128, HV = 16 (measured:
    bench/results/kernels_gdn_decode-h100.json)."""
    if INTERPRETED:
        return TileConfig(block_n=min(16, value_dim), num_warps=1)
    per_sm = num_rows * num_value_heads * (value_dim // 16) / num_sms(device)
    if commit:
        block_n = 16 if per_sm <= 8 else 32 if per_sm <= 16 else 64
    else:
        block_n = 16 if per_sm <= 4 else 32
    block_n = min(block_n, value_dim)
    return TileConfig(block_n=block_n, num_warps=max(1, key_dim * block_n // 4096))


def _check_gdn_decode_args(out, q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state, pending_k, pending_v,
                           pending_g, pending_beta, pending_counts, config) -> None:
    num_tokens, num_key_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1], v.shape[2]
    num_slots, max_pending = pending_g.shape[0], pending_g.shape[1]
    num_rows = slot_ids.numel()
    assert k.shape == q.shape and v.shape[0] == num_tokens and num_value_heads % num_key_heads == 0, \
        "q, k [T, HK, K] and v [T, HV, V], HV a multiple of HK"
    assert a.shape == (num_tokens, num_value_heads) and b.shape == a.shape, "a, b [T, HV]"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and a.stride(1) == 1 and b.stride(1) == 1, \
        "q, k, v, a, b: unit stride along the last dim"
    assert A_log.shape == (num_value_heads,) and dt_bias.shape == A_log.shape, "A_log, dt_bias [HV]"
    assert A_log.is_contiguous() and dt_bias.is_contiguous(), "A_log, dt_bias: contiguous"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape == (num_rows + 1,), "cu_seqlens: int32 [B+1]"
    assert slot_ids.dtype == torch.int32 and pending_counts.dtype == torch.int32, "slot_ids, pending_counts: int32"
    assert state.shape == (num_slots, num_value_heads, key_dim, value_dim), "state [S, HV, K, V]"
    assert state.dtype in (torch.float32, torch.bfloat16), "state: fp32 or bf16"
    assert key_dim & (key_dim - 1) == 0 and value_dim & (value_dim - 1) == 0, "K and V must be powers of two"
    assert config.block_n <= value_dim and config.block_n & (config.block_n - 1) == 0, \
        "config: block_n a power of two <= V"
    assert pending_k.shape == (num_rows, max_pending, num_key_heads, key_dim) and pending_k.stride(3) == 1, \
        "pending_k [B, P, HK, K], unit stride along K"
    assert pending_v.shape == (num_rows, max_pending, num_value_heads, value_dim) and pending_v.stride(3) == 1, \
        "pending_v [B, P, HV, V], unit stride along V"
    replicas = pending_g.shape[3]
    assert pending_g.shape == (num_slots, max_pending, num_value_heads, replicas), "pending_g [S, P, HV, R]"
    assert pending_beta.shape == pending_g.shape, "pending_beta: pending_g's shape"
    assert replicas & (replicas - 1) == 0 and value_dim % replicas == 0, "R a power of two dividing V"
    assert config.block_n * replicas >= value_dim, "a tile must own whole pending replicas (gdn.py)"
    assert pending_g.dtype == torch.float32 and pending_beta.dtype == torch.float32, "pending_g, pending_beta: fp32"
    assert pending_counts.shape == (num_slots,), "pending_counts [S]"
    for t in (state, pending_g, pending_beta, pending_counts, cu_seqlens, slot_ids):
        assert t.is_contiguous(), "state, pending_g, pending_beta, pending_counts, cu_seqlens, slot_ids: contiguous"
    assert out.shape == v.shape and out.dtype == v.dtype and out.is_contiguous(), "out: contiguous, v's shape and dtype"
    assert num_tokens <= num_rows * (max_pending + 1), "a row runs at most P + 1 new tokens"


def launch_gdn_decode(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                      slot_ids: torch.Tensor, state: torch.Tensor, pending_k: torch.Tensor,
                      pending_v: torch.Tensor, pending_g: torch.Tensor, pending_beta: torch.Tensor,
                      pending_counts: torch.Tensor, commit: bool, config: TileConfig) -> None:
    """gdn_decode into `out` [T, HV, V] (contiguous) with an explicit tile config. Each row runs
    1..P+1 new tokens (the kernel holds P + 1 at most; the total is checked here).

    q, k [T, HK, K] and v [T, HV, V] may be strided views (the split of the conv output) with
    unit stride along the head dim; a, b [T, HV] unit stride along heads; so may the step buffer
    views pending_k [B, P, HK, K] and pending_v [B, P, HV, V] (P may be 0). The pool tensors are
    contiguous, laid out as gdn.py says; state fp32 or bf16 (math in fp32 either way)."""
    _check_gdn_decode_args(out, q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state, pending_k, pending_v,
                           pending_g, pending_beta, pending_counts, config)
    num_tokens, num_key_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1], v.shape[2]
    max_pending, replicas = pending_g.shape[1], pending_g.shape[3]
    num_rows = slot_ids.numel()
    if num_rows == 0:
        return
    one_token = num_tokens == num_rows  # every row runs one token (plain decode)
    grid = (triton.cdiv(value_dim, config.block_n), num_value_heads, num_rows)
    _gdn_decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state,
        pending_k, pending_v, pending_g, pending_beta, pending_counts, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        *pending_k.stride()[:3], *pending_v.stride()[:3],
        key_dim ** -0.5,
        HK=num_key_heads, HV=num_value_heads, K=key_dim, V=value_dim, P=max_pending, R=replicas,
        ONE_TOKEN=one_token,
        P_BLOCK=triton.next_power_of_2(max(max_pending, 1)),
        T_BLOCK=1 if one_token else triton.next_power_of_2(max_pending + 1),
        BV=config.block_n, COMMIT=commit, ROUND_STATE=state.dtype != torch.float32,
        **config.launch_options(), **pdl(v.device),
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
    config = decode_config(slot_ids.numel(), v.shape[1], q.shape[2], v.shape[2], commit, v.device)
    launch_gdn_decode(out, q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, state, pending_k, pending_v,
                      pending_g, pending_beta, pending_counts, commit, config)
    return out
