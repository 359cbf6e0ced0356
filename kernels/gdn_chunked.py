"""Chunked varlen GDN prefill: many sequences of different lengths in one call, each starting
from its slot's committed state (or zero) and writing its final state back to the slot, and
optionally saving the state at chosen prefix lengths (checkpoints for the prefix cache).
Recurrence and pool layout: gdn.py. Knows nothing about models or the scheduler.

Rows are cut into chunks of CHUNK_SIZE tokens from each row's start (the last chunk of a row may
be short). Per chunk and value head, with G = cumsum of g inside the chunk (WY representation):
    A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)            for j < i     (strictly lower)
    U = (I + A)^-1 (beta * V),  W = (I + A)^-1 (beta * exp(G) * K)
    P[i, j] = K^-1/2 (q_i . k_j) exp(G_i - G_j)            for j <= i
and then, sequentially over the chunks of a row, with S the state [K, V] at the chunk start:
    V' = U - W S
    O  = K^-1/2 exp(G) * (Q S) + P V'
    S  = exp(G_last) S + (K * exp(G_last - G))^T V'
(q, k l2-normalised with eps 1e-6; g and beta from the gating of gdn.py.)

Triton path, three kernels (four when split):
  1. `_gdn_chunk_solve_kernel` and `_gdn_chunk_wy_kernel`, one program per (chunk, value head),
     all chunks in parallel. Solve: the gating and chunk-local cumsum of g (per 16-token
     sub-chunk, plus the sums of the sub-chunks before it), A from 16x16 blocks
     of raw k k^T over column slices of k (few live registers, few warps), and the 64x64 unit
     lower-triangular solve as four 16x16 diagonal inverses (forward substitution) merged into
     the blocks below them; stores the inverse ([T, HV, 64], dot dtype). WY: the q/k inverse
     norms, P, and U, W as 64-row dots (beta, exp(G) and 1/|k| scale the rows of V and of raw
     K on the way in, so one inverse serves both, as fla's recompute_w_u). Writes
     g_cum, q_scale = K^-1/2 exp(G) / |q|, k_scale = exp(G_last - G) / |k| ([T, HV] fp32),
     w [T, HV, K], u [T, HV, V], attn = P [T, HV, 64]. Chunks are located from cu_seqlens inside
     the kernels (no host sync, no index tensors): the grid has an upper bound of T // 64 + rows
     programs per head; surplus ones exit.
  2. `_gdn_chunk_state_kernel`, one program per (row, value head, V tile), sequential over the
     row's chunks with the state tile in registers: reads the initial state from state[slot]
     (only when has_initial_state: a fresh slot's stale contents are never read), computes V'
     and O for every chunk, writes O, the checkpoints, and the final state to state[slot]. Raw
     q and k tiles go to the tensor cores as loaded; l2norm, scale and decays are applied as row
     scales on the [64, BV] side (q_scale, k_scale), which keeps the loop free of spills.
  3. Split (`split_output`: when the state kernel's programs would fill at most a quarter of
     the SMs, i.e. few long rows): the state kernel leaves O out of its chain. It stores each
     chunk's starting state (chunk_states [chunk id, HV, K, V], dot dtype) and V' (over u), and
     `_gdn_chunk_output_kernel` computes O for every (chunk, value head, V tile) in parallel.
     Scratch: (T / 64 + rows) x HV x K x V in the activation dtype (34 MB for one 2048-token
     row at HV = 32, K = V = 128; 0.5 GB for 32K tokens in one call).
  Dots take the activation dtype (bf16 on the GPU) with fp32 accumulation, as fla does; the
  inverse runs in fp32 operands (tf32 on the GPU; exact fp32 everywhere for fp32 activations);
  the state stays fp32 in registers whatever the pool dtype.

Invariants: slot ids of one call are distinct; checkpoint lengths of a row are increasing, in
(0, row length], and each a multiple of CHUNK_SIZE or the row length (checked, with a host sync,
only when checkpoints are requested).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import INTERPRETED, num_sms
from .gdn import expand_heads, gdn_gating_reference, l2norm
from .launch import dot_precision
from .tiles import TileConfig, autotune_configs
from .varlen import into, pad_rows, row_layout

CHUNK_SIZE = 64
SUB_CHUNK = 16     # the solve works on 4 x 4 blocks of 16 x 16
L2NORM_EPS = 1e-6

# ---------------------------------------------------------------------------------------------
# torch reference

def _chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, chunk_size: int,
             keep_chunk_states: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Chunk-parallel form of `recurrent_steps` (WY representation). Shapes as there, with the
    padded length a multiple of chunk_size. Within a chunk (positions i, j; G = cumsum g):
        A[i, j]  = beta_i (k_i . k_j) exp(G_i - G_j)            for j < i
        (I + A) U = beta * V,  (I + A) W = beta * exp(G) * K     (unit lower-triangular solves)
        V'  = U - W S_0,   O = exp(G) * (Q S_0) + (QK^T * exp(G_i - G_j), j <= i) V'
        S_1 = exp(G_last) S_0 + (K * exp(G_last - G))^T V'
    Returns (final state, outputs, the state after each chunk when keep_chunk_states else [])."""
    batch, length, heads, _ = k.shape
    n = length // chunk_size
    shape = lambda x: x.reshape(batch, n, chunk_size, heads, -1).transpose(2, 3)  # [B, n, H, C, *]
    q, k, v = shape(q), shape(k), shape(v)
    g = g.reshape(batch, n, chunk_size, heads).transpose(2, 3)       # [B, n, H, C]
    beta = beta.reshape(batch, n, chunk_size, heads).transpose(2, 3)
    cum = g.cumsum(-1)
    diff = cum[..., :, None] - cum[..., None, :]
    ones = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device)
    decay = torch.where(ones.tril(), diff, torch.full_like(diff, float("-inf"))).exp()   # j <= i
    strictly_lower = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay * ones.tril(-1)
    system = strictly_lower + torch.eye(chunk_size, device=k.device)
    u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, beta[..., None] * cum.exp()[..., None] * k, upper=False,
                                      unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    outputs = torch.empty_like(u)
    chunk_states = []
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ state
        outputs[:, c] = (q[:, c] * cum[:, c, :, :, None].exp()) @ state + intra[:, c] @ v_new
        last = cum[:, c, :, -1:]
        state = state * last.exp()[..., None] + (k[:, c] * (last - cum[:, c]).exp()[..., None]).transpose(-1, -2) @ v_new
        if keep_chunk_states:
            chunk_states.append(state)
    return state, outputs.transpose(2, 3).reshape(batch, length, heads, -1), chunk_states


def check_checkpoints(cu_seqlens: torch.Tensor, checkpoint_cu: torch.Tensor | None,
                      checkpoint_lengths: torch.Tensor | None, checkpoint_states: torch.Tensor | None,
                      state: torch.Tensor, lengths_checked: bool = False) -> bool:
    """Validates the checkpoint arguments (all three or none); returns whether there are any.

    checkpoint_cu [rows+1] int32: CSR offsets, row i owns checkpoints checkpoint_cu[i] ..
    checkpoint_cu[i+1]-1. checkpoint_lengths [N] int32: increasing within a row, each in
    (0, row length] and a multiple of CHUNK_SIZE or the row length. checkpoint_states
    [N, HV, K, V] (fp32 or bf16, contiguous): written. Reads the lengths on the host (a sync)
    unless the caller says it built them checked (lengths_checked)."""
    given = [x is not None for x in (checkpoint_cu, checkpoint_lengths, checkpoint_states)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError("checkpoint_cu, checkpoint_lengths and checkpoint_states go together")
    num_rows, num_checkpoints = cu_seqlens.numel() - 1, checkpoint_lengths.numel()
    if checkpoint_cu.shape != (num_rows + 1,) or checkpoint_cu.dtype != torch.int32:
        raise ValueError(f"checkpoint_cu must be int32 [{num_rows + 1}], got {checkpoint_cu.dtype} "
                         f"{tuple(checkpoint_cu.shape)}")
    if checkpoint_lengths.dim() != 1 or checkpoint_lengths.dtype != torch.int32:
        raise ValueError("checkpoint_lengths must be a 1-d int32 tensor")
    if (checkpoint_states.shape != (num_checkpoints,) + tuple(state.shape[1:])
            or checkpoint_states.dtype not in (torch.float32, torch.bfloat16)
            or not checkpoint_states.is_contiguous()):
        raise ValueError(f"checkpoint_states must be contiguous fp32/bf16 {(num_checkpoints,) + tuple(state.shape[1:])}, "
                         f"got {checkpoint_states.dtype} {tuple(checkpoint_states.shape)}")
    if lengths_checked:
        return True
    cu = checkpoint_cu.long().cpu()
    counts = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != num_checkpoints or bool((counts < 0).any()):
        raise ValueError(f"checkpoint_cu must rise from 0 to {num_checkpoints}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
    row = torch.repeat_interleave(torch.arange(num_rows), counts, output_size=num_checkpoints)
    position, row_length = checkpoint_lengths.long().cpu(), lengths[row]
    valid = (position > 0) & (position <= row_length) & ((position % CHUNK_SIZE == 0) | (position == row_length))
    increasing = (position[1:] > position[:-1]) | (row[1:] != row[:-1])
    if not bool(valid.all()) or not bool(increasing.all()):
        raise ValueError(f"checkpoint lengths must increase within a row and be multiples of {CHUNK_SIZE} "
                         f"or the row length, in (0, row length]; got {position.tolist()} for rows of "
                         f"lengths {row_length.tolist()}")
    return True


def gdn_chunked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                          slot_ids: torch.Tensor, has_initial_state: torch.Tensor, state: torch.Tensor,
                          checkpoint_cu: torch.Tensor | None = None, checkpoint_lengths: torch.Tensor | None = None,
                          checkpoint_states: torch.Tensor | None = None, lengths_checked: bool = False,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen prefill. q, k: [T, HK, K]; v: [T, HV, V]; a, b: [T, HV]; cu_seqlens [rows+1] int32;
    slot_ids [rows] int32 (distinct); has_initial_state [rows] bool; state [slots, HV, K, V].
    Reads the slot's state when has_initial_state (else zeros; the slot is not read) and writes
    the final state back to state[slot]. Checkpoints (optional, see `check_checkpoints`):
    checkpoint_states[j] = the state after the first checkpoint_lengths[j] tokens of its row.
    Returns o [T, HV, V] in v's dtype (`out` when given: varlen.into)."""
    has_checkpoints = check_checkpoints(cu_seqlens, checkpoint_cu, checkpoint_lengths, checkpoint_states, state,
                                        lengths_checked)
    num_rows, num_value_heads = slot_ids.numel(), v.shape[1]
    slots = slot_ids.long()
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, v.shape[0])
    padded_len = -(-max_len // CHUNK_SIZE) * CHUNK_SIZE
    g, beta = gdn_gating_reference(a, b, A_log, dt_bias)
    qn = expand_heads(l2norm(q, L2NORM_EPS), num_value_heads) * q.shape[-1] ** -0.5
    kn = expand_heads(l2norm(k, L2NORM_EPS), num_value_heads)
    pad = lambda x: pad_rows(x, row, index_in_row, num_rows, padded_len)
    # Select, never multiply: a fresh row must not read whatever its slot's last owner left.
    initial = torch.where(has_initial_state.view(-1, 1, 1, 1), state[slots].float(), 0.0)
    final, outputs, chunk_states = _chunked(initial, pad(qn), pad(kn), pad(v.float()), pad(g), pad(beta),
                                            CHUNK_SIZE, keep_chunk_states=has_checkpoints)
    if has_checkpoints and checkpoint_lengths.numel():
        # Padded tokens carry g = beta = 0, so the state after chunk c is the state after
        # min(64 (c+1), length) tokens: a checkpoint at p is the state after chunk ceil(p/64)-1.
        counts = (checkpoint_cu[1:] - checkpoint_cu[:-1]).long()
        checkpoint_row = torch.repeat_interleave(torch.arange(num_rows, device=v.device), counts,
                                                 output_size=checkpoint_lengths.numel())
        checkpoint_chunk = (checkpoint_lengths.long() + CHUNK_SIZE - 1) // CHUNK_SIZE - 1
        checkpoint_states.copy_(torch.stack(chunk_states)[checkpoint_chunk, checkpoint_row])
    state[slots] = final.to(state.dtype)
    return into(out, outputs[row, index_in_row].to(v.dtype))


# ---------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _softplus(x):
    # torch's F.softplus (threshold 20) without libdevice's log1p.
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _load_rows(ptr, tok, valid, stride_t, col0, D: tl.constexpr):
    """Rows `tok` [R] of a token-major tensor, columns col0 .. col0+D-1 -> [R, D] (0 where not
    valid), in the tensor's dtype."""
    cols = tl.arange(0, D)
    return tl.load(ptr + tok[:, None] * stride_t + col0 + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _inverse_norm(x, EPS: tl.constexpr):
    """1 / sqrt(sum x^2 + eps) per row of x [R, D]: the l2norm is applied as a row scale, so the
    raw tile goes to the tensor cores unchanged."""
    x = x.to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, 1) + EPS)


@triton.jit
def _store_rows(ptr, x, tok, valid, stride_t, col0, D: tl.constexpr):
    cols = tl.arange(0, D)
    tl.store(ptr + tok[:, None] * stride_t + col0 + cols[None, :], x.to(ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _decayed(s, gi, gj, ci, cj, mask):
    """ci s_ij cj exp(g_i - g_j) where mask, else 0: one [16, 16] block of A (s = raw k_i . k_j)."""
    # G is non-increasing, so exponents of selected entries are <= 0; the clamp keeps the
    # unselected ones (j > i) from overflowing.
    decay = tl.exp(tl.minimum(gi[:, None] - gj[None, :], 0.0))
    return tl.where(mask, s * ci[:, None] * cj[None, :] * decay, 0.0)


@triton.jit
def _unit_lower_inverse(A, SUB: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular [SUB, SUB] A by forward substitution: with
    N = (I + A)^-1 - I, row i of N is -A_i - sum_{j<i} A_ij N_j (rows 0 and 1 are -A_i)."""
    o = tl.arange(0, SUB)
    inv = -A
    for i in tl.static_range(2, SUB):
        row = tl.sum(tl.where((o == i)[:, None], -A, 0.0), 0)          # -A_i, zero from column i on
        row = row + tl.sum(row[:, None] * inv, 0)
        inv = tl.where((o == i)[:, None], row[None, :], inv)
    return inv + (o[:, None] == o[None, :]).to(tl.float32)


@triton.jit
def _store_inverse(ptr, I00, I10, I11, I20, I21, I22, I30, I31, I32, I33, t0, t1, t2, t3, m0, m1, m2, m3,
                   HV: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, DTYPE: tl.constexpr):
    """The lower triangle of (I + A)^-1 into a [T, HV, CHUNK] buffer (ptr already at the value
    head), block by block: block (s, t) at rows t_s (where m_s), columns 16 t.., rounded to DTYPE."""
    o = tl.arange(0, SUB)
    base = ptr + o[None, :]
    tl.store(base + t0[:, None] * (HV * CHUNK), I00.to(DTYPE), mask=m0[:, None])
    tl.store(base + t1[:, None] * (HV * CHUNK), I10.to(DTYPE), mask=m1[:, None])
    tl.store(base + t1[:, None] * (HV * CHUNK) + SUB, I11.to(DTYPE), mask=m1[:, None])
    tl.store(base + t2[:, None] * (HV * CHUNK), I20.to(DTYPE), mask=m2[:, None])
    tl.store(base + t2[:, None] * (HV * CHUNK) + SUB, I21.to(DTYPE), mask=m2[:, None])
    tl.store(base + t2[:, None] * (HV * CHUNK) + 2 * SUB, I22.to(DTYPE), mask=m2[:, None])
    tl.store(base + t3[:, None] * (HV * CHUNK), I30.to(DTYPE), mask=m3[:, None])
    tl.store(base + t3[:, None] * (HV * CHUNK) + SUB, I31.to(DTYPE), mask=m3[:, None])
    tl.store(base + t3[:, None] * (HV * CHUNK) + 2 * SUB, I32.to(DTYPE), mask=m3[:, None])
    tl.store(base + t3[:, None] * (HV * CHUNK) + 3 * SUB, I33.to(DTYPE), mask=m3[:, None])


@triton.jit
def _chunk_gating(a, b, A_log, dt_bias, tok, valid, h, stride_at, stride_bt):
    """Per token of a run of tokens (a chunk or a 16-token sub-chunk): G = the run-local cumsum
    of g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), and sum g; invalid tokens get
    g = beta = 0."""
    a_t = tl.load(a + tok * stride_at + h, mask=valid, other=0.0).to(tl.float32)
    b_t = tl.load(b + tok * stride_bt + h, mask=valid, other=0.0).to(tl.float32)
    g = tl.where(valid, -tl.exp(tl.load(A_log + h).to(tl.float32)) * _softplus(a_t + tl.load(dt_bias + h)), 0.0)
    return tl.cumsum(g, 0), tl.where(valid, tl.sigmoid(b_t), 0.0), tl.sum(g, 0)


@triton.jit
def _row_chunks(cu_seqlens, num_rows, ROWS_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk ids number the chunks of all rows in order: row r owns ceil(len_r / CHUNK)
    consecutive ids. -> (r = arange(ROWS_POW2), ceil(len_r / CHUNK), 0 past the last row)."""
    r = tl.arange(0, ROWS_POW2)
    start = tl.load(cu_seqlens + r, mask=r < num_rows, other=0)
    end = tl.load(cu_seqlens + r + 1, mask=r < num_rows, other=0)
    return r, (end - start + CHUNK - 1) // CHUNK


@triton.jit
def _chunk_of(cu_seqlens, chunk_id, num_rows, ROWS_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """(row, first token of the chunk, int64) of chunk_id (`_row_chunks`); row = num_rows for
    ids past the last chunk (the surplus of an upper-bound grid, which exits: cu_seqlens[row]
    is still in bounds, cu_seqlens[row + 1] is not)."""
    r, row_chunks = _row_chunks(cu_seqlens, num_rows, ROWS_POW2, CHUNK)
    row = tl.sum((tl.cumsum(row_chunks, 0) <= chunk_id).to(tl.int32), 0)
    chunk = chunk_id - tl.sum(tl.where(r < row, row_chunks, 0), 0)
    return row, tl.load(cu_seqlens + row).to(tl.int64) + chunk * CHUNK


@triton.jit
def _first_chunk(cu_seqlens, row, num_rows, ROWS_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """The chunk id of chunk 0 of `row` (`_row_chunks`)."""
    r, row_chunks = _row_chunks(cu_seqlens, num_rows, ROWS_POW2, CHUNK)
    return tl.sum(tl.where(r < row, row_chunks, 0), 0)


@triton.jit(do_not_specialize=["num_rows"])
def _gdn_chunk_solve_kernel(k, a, b, A_log, dt_bias, cu_seqlens, inverse, num_rows,
                            stride_kt, stride_at, stride_bt,
                            HV: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                            ROWS_POW2: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, EPS: tl.constexpr,
                            DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One (chunk, value head): (I + A)^-1, stored to inverse ([T, HV, CHUNK] in the dot dtype,
    lower triangle only). A is built in 16 x 16 blocks from BK-column slices of raw k (few live
    registers), scaled by beta, the inverse norms and the decays afterwards; the diagonal blocks
    are inverted by forward substitution, then merged into the blocks below them. Few warps suit
    the substitution: its row picks and reductions stay inside a warp."""
    chunk_id, h = tl.program_id(0) // HV, tl.program_id(0) % HV   # a chunk's heads side by side
    hk = h // (HV // HK)
    row, chunk_start = _chunk_of(cu_seqlens, chunk_id, num_rows, ROWS_POW2, CHUNK)
    if row >= num_rows:
        return  # surplus program of the T // CHUNK + rows upper bound
    num_valid = tl.load(cu_seqlens + row + 1).to(tl.int64) - chunk_start   # may exceed CHUNK
    # 16-token sub-chunks s: tokens t_s, masks m_s, and their G (the chunk's cumsum: each
    # sub-chunk's own plus the sums before it) and beta.
    o = tl.arange(0, SUB)
    t0, t1, t2, t3 = chunk_start + o, chunk_start + SUB + o, chunk_start + 2 * SUB + o, chunk_start + 3 * SUB + o
    m0, m1, m2, m3 = o < num_valid, SUB + o < num_valid, 2 * SUB + o < num_valid, 3 * SUB + o < num_valid
    g0, b0, s0 = _chunk_gating(a, b, A_log, dt_bias, t0, m0, h, stride_at, stride_bt)
    g1, b1, s1 = _chunk_gating(a, b, A_log, dt_bias, t1, m1, h, stride_at, stride_bt)
    g2, b2, s2 = _chunk_gating(a, b, A_log, dt_bias, t2, m2, h, stride_at, stride_bt)
    g3, b3, _ = _chunk_gating(a, b, A_log, dt_bias, t3, m3, h, stride_at, stride_bt)
    g1, g2, g3 = g1 + s0, g2 + (s0 + s1), g3 + (s0 + s1 + s2)

    # Raw k_i . k_j in 16 x 16 blocks (strictly lower diagonal blocks, full blocks below them)
    # and the squared norms, over BK-column slices of k.
    zero = tl.zeros([SUB, SUB], dtype=tl.float32)
    A00, A11, A22, A33, A10, A20, A21, A30, A31, A32 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero
    n0, n1, n2, n3 = tl.zeros([SUB], dtype=tl.float32), tl.zeros([SUB], dtype=tl.float32), \
        tl.zeros([SUB], dtype=tl.float32), tl.zeros([SUB], dtype=tl.float32)
    for col in range(0, K, BK):
        k0 = _load_rows(k, t0, m0, stride_kt, hk * K + col, BK).to(DOT_DTYPE)
        k1 = _load_rows(k, t1, m1, stride_kt, hk * K + col, BK).to(DOT_DTYPE)
        k2 = _load_rows(k, t2, m2, stride_kt, hk * K + col, BK).to(DOT_DTYPE)
        k3 = _load_rows(k, t3, m3, stride_kt, hk * K + col, BK).to(DOT_DTYPE)
        n0 += tl.sum(k0.to(tl.float32) * k0.to(tl.float32), 1)
        n1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), 1)
        n2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), 1)
        n3 += tl.sum(k3.to(tl.float32) * k3.to(tl.float32), 1)
        A00 = tl.dot(k0, tl.trans(k0), A00, input_precision=PRECISION)
        A11 = tl.dot(k1, tl.trans(k1), A11, input_precision=PRECISION)
        A22 = tl.dot(k2, tl.trans(k2), A22, input_precision=PRECISION)
        A33 = tl.dot(k3, tl.trans(k3), A33, input_precision=PRECISION)
        A10 = tl.dot(k1, tl.trans(k0), A10, input_precision=PRECISION)
        A20 = tl.dot(k2, tl.trans(k0), A20, input_precision=PRECISION)
        A21 = tl.dot(k2, tl.trans(k1), A21, input_precision=PRECISION)
        A30 = tl.dot(k3, tl.trans(k0), A30, input_precision=PRECISION)
        A31 = tl.dot(k3, tl.trans(k1), A31, input_precision=PRECISION)
        A32 = tl.dot(k3, tl.trans(k2), A32, input_precision=PRECISION)
    rk0, rk1 = tl.rsqrt(n0 + EPS), tl.rsqrt(n1 + EPS)
    rk2, rk3 = tl.rsqrt(n2 + EPS), tl.rsqrt(n3 + EPS)
    lower = o[:, None] > o[None, :]
    A00 = _decayed(A00, g0, g0, b0 * rk0, rk0, lower & m0[:, None])
    A11 = _decayed(A11, g1, g1, b1 * rk1, rk1, lower & m1[:, None])
    A22 = _decayed(A22, g2, g2, b2 * rk2, rk2, lower & m2[:, None])
    A33 = _decayed(A33, g3, g3, b3 * rk3, rk3, lower & m3[:, None])
    A10 = _decayed(A10, g1, g0, b1 * rk1, rk0, m1[:, None] & m0[None, :])
    A20 = _decayed(A20, g2, g0, b2 * rk2, rk0, m2[:, None] & m0[None, :])
    A21 = _decayed(A21, g2, g1, b2 * rk2, rk1, m2[:, None] & m1[None, :])
    A30 = _decayed(A30, g3, g0, b3 * rk3, rk0, m3[:, None] & m0[None, :])
    A31 = _decayed(A31, g3, g1, b3 * rk3, rk1, m3[:, None] & m1[None, :])
    A32 = _decayed(A32, g3, g2, b3 * rk3, rk2, m3[:, None] & m2[None, :])
    # (I + A)^-1 blockwise: diagonal blocks by substitution, then the blocks below them
    # (X_st = -X_ss sum_{t<=j<s} A_sj X_jt), in fp32 operands.
    I00, I11 = _unit_lower_inverse(A00, SUB), _unit_lower_inverse(A11, SUB)
    I22, I33 = _unit_lower_inverse(A22, SUB), _unit_lower_inverse(A33, SUB)
    I10 = -tl.dot(tl.dot(I11, A10, input_precision=PRECISION), I00, input_precision=PRECISION)
    I21 = -tl.dot(tl.dot(I22, A21, input_precision=PRECISION), I11, input_precision=PRECISION)
    I32 = -tl.dot(tl.dot(I33, A32, input_precision=PRECISION), I22, input_precision=PRECISION)
    I20 = -tl.dot(I22, tl.dot(A20, I00, input_precision=PRECISION) + tl.dot(A21, I10, input_precision=PRECISION),
                  input_precision=PRECISION)
    I31 = -tl.dot(I33, tl.dot(A31, I11, input_precision=PRECISION) + tl.dot(A32, I21, input_precision=PRECISION),
                  input_precision=PRECISION)
    I30 = -tl.dot(I33, tl.dot(A30, I00, input_precision=PRECISION) + tl.dot(A31, I10, input_precision=PRECISION)
                  + tl.dot(A32, I20, input_precision=PRECISION), input_precision=PRECISION)

    _store_inverse(inverse + h * CHUNK, I00, I10, I11, I20, I21, I22, I30, I31, I32, I33,
                   t0, t1, t2, t3, m0, m1, m2, m3, HV, CHUNK, SUB, DOT_DTYPE)


@triton.jit(do_not_specialize=["num_rows"])
def _gdn_chunk_wy_kernel(q, k, v, a, b, A_log, dt_bias, cu_seqlens, inverse, g_cum, q_scale, k_scale,
                         w, u, attn, num_rows, scale, stride_qt, stride_kt, stride_vt, stride_at, stride_bt,
                         HV: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         ROWS_POW2: tl.constexpr, CHUNK: tl.constexpr, EPS: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One (chunk, value head): U = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta exp(G)
    / |k|) K_raw (64-row dots on rows scaled in registers), P, and the per-token scales:
    g_cum = G, q_scale = K^-1/2 exp(G) / |q|, k_scale = exp(G_last - G) / |k| ([T, HV] fp32),
    w [T, HV, K], u [T, HV, V], attn = P [T, HV, CHUNK]."""
    chunk_id, h = tl.program_id(0) // HV, tl.program_id(0) % HV   # a chunk's heads side by side
    hk = h // (HV // HK)
    row, chunk_start = _chunk_of(cu_seqlens, chunk_id, num_rows, ROWS_POW2, CHUNK)
    if row >= num_rows:
        return  # surplus program of the T // CHUNK + rows upper bound
    ct = tl.arange(0, CHUNK)
    tok = chunk_start + ct
    valid = tok < tl.load(cu_seqlens + row + 1)
    gc, beta, g_last = _chunk_gating(a, b, A_log, dt_bias, tok, valid, h, stride_at, stride_bt)
    tl.store(g_cum + tok * HV + h, gc, mask=valid)
    key = _load_rows(k, tok, valid, stride_kt, hk * K, K)           # raw [C, K]
    query = _load_rows(q, tok, valid, stride_qt, hk * K, K)
    rk = _inverse_norm(key, EPS)
    cq = _inverse_norm(query, EPS) * scale
    tl.store(q_scale + tok * HV + h, cq * tl.exp(gc), mask=valid)                # K^-1/2 exp(G) / |q|
    tl.store(k_scale + tok * HV + h, rk * tl.exp(g_last - gc), mask=valid)       # exp(G_last - G) / |k|
    # P = K^-1/2 (q_i . k_j) exp(G_i - G_j) / (|q_i| |k_j|), j <= i
    causal = valid[:, None] & (ct[:, None] >= ct[None, :])
    p = tl.dot(query.to(DOT_DTYPE), tl.trans(key.to(DOT_DTYPE)), input_precision=PRECISION)
    decay = tl.exp(tl.minimum(gc[:, None] - gc[None, :], 0.0))
    p = tl.where(causal, p * cq[:, None] * rk[None, :] * decay, 0.0)
    _store_rows(attn, p, tok, valid, HV * CHUNK, h * CHUNK, CHUNK)   # zeros above the diagonal too
    # The inverse's upper triangle was never stored: selected away after a load with row masks
    # only (a mask per element would split the vectorised loads into scalar ones).
    solved = tl.where(causal, tl.load(inverse + tok[:, None] * (HV * CHUNK) + h * CHUNK + ct[None, :],
                                      mask=valid[:, None], other=0.0), 0.0)
    key = (key.to(tl.float32) * (beta * tl.exp(gc) * rk)[:, None]).to(DOT_DTYPE)
    _store_rows(w, tl.dot(solved, key, input_precision=PRECISION), tok, valid, HV * K, h * K, K)
    values = _load_rows(v, tok, valid, stride_vt, h * V, V)
    values = (values.to(tl.float32) * beta[:, None]).to(DOT_DTYPE)
    _store_rows(u, tl.dot(solved, values, input_precision=PRECISION), tok, valid, HV * V, h * V, V)


@triton.jit
def _chunk_output(o_chunk, q_chunk, attn_chunk, q_scale_chunk, S_dot, v_new, valid, ct, vv, stride_qt,
                  HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CHUNK: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """O = K^-1/2 exp(G) / |q| * (Q_raw S) + P V' for one chunk and V tile, stored to o [T, HV, V].
    The *_chunk pointers are at the chunk's first token and this head (o, attn, q_scale of the
    value head, q of its key head); offsets inside the chunk are int32. S_dot [K, BV] (the state
    at the chunk start, dot dtype), v_new = V' [C, BV]."""
    kk = tl.arange(0, K)
    cq = tl.load(q_scale_chunk + ct * HV, mask=valid, other=0.0)
    qc = tl.load(q_chunk + ct[:, None] * stride_qt + kk[None, :], mask=valid[:, None], other=0.0)     # [C, K]
    p = tl.load(attn_chunk + ct[:, None] * (HV * CHUNK) + ct[None, :], mask=valid[:, None], other=0.0)  # 0 above
    out = tl.dot(qc.to(DOT_DTYPE), S_dot, input_precision=PRECISION) * cq[:, None]
    out = tl.dot(p.to(DOT_DTYPE), v_new.to(DOT_DTYPE), out, input_precision=PRECISION)
    tl.store(o_chunk + ct[:, None] * (HV * V) + vv[None, :], out.to(o_chunk.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["num_rows"])
def _gdn_chunk_output_kernel(q, q_scale, u, attn, o, cu_seqlens, chunk_states, num_rows, stride_qt,
                             HV: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                             BV: tl.constexpr, ROWS_POW2: tl.constexpr, CHUNK: tl.constexpr,
                             DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One (chunk, value head, V tile) of the split path: the outputs from the chunk's starting
    state and V' that `_gdn_chunk_state_kernel` (SPLIT_O) stored, every chunk in parallel."""
    chunk_id, h, tile_v = tl.program_id(0) // HV, tl.program_id(0) % HV, tl.program_id(1)
    row, chunk_start = _chunk_of(cu_seqlens, chunk_id, num_rows, ROWS_POW2, CHUNK)
    if row >= num_rows:
        return  # surplus program of the T // CHUNK + rows upper bound
    hk = h // (HV // HK)
    ct = tl.arange(0, CHUNK)
    kk = tl.arange(0, K)
    vv = tile_v * BV + tl.arange(0, BV)
    tok = chunk_start + ct
    valid = tok < tl.load(cu_seqlens + row + 1)
    S_dot = tl.load(chunk_states + (chunk_id.to(tl.int64) * HV + h) * (K * V) + kk[:, None] * V + vv[None, :])
    v_new = tl.load(u + tok[:, None] * (HV * V) + h * V + vv[None, :], mask=valid[:, None], other=0.0)
    _chunk_output(o + chunk_start * (HV * V) + h * V, q + chunk_start * stride_qt + hk * K,
                  attn + chunk_start * (HV * CHUNK) + h * CHUNK, q_scale + chunk_start * HV + h,
                  S_dot, v_new, valid, ct, vv, stride_qt, HV, K, V, CHUNK, DOT_DTYPE, PRECISION)


@triton.jit(do_not_specialize=["row_bucket", "num_rows"])
def _gdn_chunk_state_kernel(q, k, g_cum, q_scale, k_scale, w, u, attn, o, state, cu_seqlens, slot_ids,
                            has_initial_state, checkpoint_cu, checkpoint_lengths, checkpoint_states,
                            chunk_states, num_rows, stride_qt, stride_kt, row_bucket,
                            HV: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BV: tl.constexpr, CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                            PRECISION: tl.constexpr, HAS_CHECKPOINTS: tl.constexpr, SPLIT_O: tl.constexpr,
                            ROWS_POW2: tl.constexpr):
    """One (row, value head, V tile): the state tile S [K, BV] lives in registers across the
    row's chunks. Raw q and k tiles go to the tensor cores as loaded; their l2norm, scale and
    decays are row scales on the [C, BV] side (q_scale, k_scale from the wy kernel).
    row_bucket only keys the autotuner (few long rows want narrow V tiles).
    SPLIT_O: the outputs are left to `_gdn_chunk_output_kernel`, which runs all chunks at once:
    this kernel stores each chunk's starting state (chunk_states[chunk id], in the dot dtype,
    as the fused O dot would use it) and V' (over u, in place), and its loop carries two dots
    instead of four."""
    # V tiles of a head, then the heads of a row, side by side: programs that share k (and w)
    # tiles run together, so the repeats come from L2 (H100 A/B in commit 3d23aed).
    program = tl.program_id(0)
    row, h, tile_v = program // (HV * (V // BV)), program // (V // BV) % HV, program % (V // BV)
    hk = h // (HV // HK)
    bos = tl.load(cu_seqlens + row).to(tl.int64)
    length = tl.load(cu_seqlens + row + 1) - tl.load(cu_seqlens + row)
    kk = tl.arange(0, K)
    vv = tile_v * BV + tl.arange(0, BV)
    ct = tl.arange(0, CHUNK)
    tile = kk[:, None] * V + vv[None, :]                                   # [K, BV] inside one [K, V]
    state_tile = state + (tl.load(slot_ids + row).to(tl.int64) * HV + h) * (K * V) + tile
    S = tl.zeros([K, BV], dtype=tl.float32)
    if tl.load(has_initial_state + row) != 0:
        S = tl.load(state_tile).to(tl.float32)
    if HAS_CHECKPOINTS:
        checkpoint = tl.load(checkpoint_cu + row)
        checkpoint_end = tl.load(checkpoint_cu + row + 1)
        checkpoint_at = tl.load(checkpoint_lengths + checkpoint, mask=checkpoint < checkpoint_end, other=-1)

    # The loop advances scalar pointers to the chunk's first token; the offsets inside a chunk
    # are int32 and loop-invariant, so no per-element 64-bit address arithmetic in the loop.
    k_chunk = k + bos * stride_kt + hk * K
    w_chunk = w + bos * (HV * K) + h * K
    u_chunk = u + bos * (HV * V) + h * V
    scale_chunk = k_scale + bos * HV + h
    g_chunk = g_cum + bos * HV + h
    kt_offsets = ct[None, :] * stride_kt + kk[:, None]                     # [K, C]
    w_offsets = ct[:, None] * (HV * K) + kk[None, :]                       # [C, K]
    u_offsets = ct[:, None] * (HV * V) + vv[None, :]                       # [C, BV]
    if SPLIT_O:
        states_chunk = chunk_states + _first_chunk(cu_seqlens, row, num_rows, ROWS_POW2, CHUNK).to(tl.int64) \
            * (HV * K * V) + h * (K * V) + tile
    else:
        o_chunk = o + bos * (HV * V) + h * V
        q_chunk = q + bos * stride_qt + hk * K
        attn_chunk = attn + bos * (HV * CHUNK) + h * CHUNK
        q_scale_chunk = q_scale + bos * HV + h
    for c in range(0, tl.cdiv(length, CHUNK)):
        valid = c * CHUNK + ct < length
        num_valid = tl.minimum(length - c * CHUNK, CHUNK)
        g_last = tl.load(g_chunk + (num_valid - 1) * HV)
        ck = tl.load(scale_chunk + ct * HV, mask=valid, other=0.0)
        kt = tl.load(k_chunk + kt_offsets, mask=valid[None, :], other=0.0)                   # [K, C]
        wc = tl.load(w_chunk + w_offsets, mask=valid[:, None], other=0.0)
        uc = tl.load(u_chunk + u_offsets, mask=valid[:, None], other=0.0)
        S_dot = S.to(DOT_DTYPE)
        v_new = uc.to(tl.float32) - tl.dot(wc.to(DOT_DTYPE), S_dot, input_precision=PRECISION)   # V' = U - W S
        if SPLIT_O:
            tl.store(states_chunk, S_dot)
            tl.store(u_chunk + u_offsets, v_new.to(u.dtype.element_ty), mask=valid[:, None])
            states_chunk += HV * K * V
        else:
            _chunk_output(o_chunk, q_chunk, attn_chunk, q_scale_chunk, S_dot, v_new, valid, ct, vv, stride_qt,
                          HV, K, V, CHUNK, DOT_DTYPE, PRECISION)
            o_chunk += CHUNK * HV * V
            q_chunk += CHUNK * stride_qt
            attn_chunk += CHUNK * HV * CHUNK
            q_scale_chunk += CHUNK * HV
        # S = exp(G_last) S + (K exp(G_last - G) / |k|)^T V'
        S = S * tl.exp(g_last) + tl.dot(kt.to(DOT_DTYPE), (v_new * ck[:, None]).to(DOT_DTYPE),
                                        input_precision=PRECISION)
        if HAS_CHECKPOINTS:
            if checkpoint_at == c * CHUNK + num_valid:
                tl.store(checkpoint_states + (checkpoint.to(tl.int64) * HV + h) * (K * V) + tile,
                         S.to(checkpoint_states.dtype.element_ty))
                checkpoint += 1
                checkpoint_at = tl.load(checkpoint_lengths + checkpoint, mask=checkpoint < checkpoint_end, other=-1)
        k_chunk += CHUNK * stride_kt
        w_chunk += CHUNK * HV * K
        u_chunk += CHUNK * HV * V
        scale_chunk += CHUNK * HV
        g_chunk += CHUNK * HV
    tl.store(state_tile, S.to(state.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Launch configuration. The interpreter runs exactly one config; on the GPU the autotuner picks
# (once per key). The state kernel updates the pool in place, so tuning runs restore it.

def _solve_configs() -> list[TileConfig]:
    if INTERPRETED:
        return [TileConfig(block_k=16, num_warps=1)]
    # The substitution's row picks want one warp: on an H100 (HV 16 and 32, all bench shapes)
    # BK 32 / 1 warp won against 2 and 4 warps and 64-column slices; since the solve stores one
    # inverse, 2 stages beat 1 (H100 A/B in commit 5f40532). The runners-up are kept, the rest
    # dropped (each config is also an sm_90 compile in CI).
    return [TileConfig(block_k=block_k, num_warps=num_warps, num_stages=num_stages)
            for block_k, num_warps, num_stages in ((32, 1, 1), (32, 1, 2), (32, 2, 1), (64, 1, 1))]


def _wy_configs() -> list[TileConfig]:
    if INTERPRETED:
        return [TileConfig(num_warps=4)]
    return [TileConfig(num_warps=num_warps, num_stages=num_stages)
            for num_warps, num_stages in ((4, 1), (4, 2), (8, 1))]


def _state_configs() -> list[TileConfig]:
    # Stages: at 2 the pipeliner issues chunk c+1's async copies at the end of chunk c and waits
    # for them at the top of c+1, so the whole load latency sits on the chain (ncu: over half the
    # stall cycles on the scoreboard); 3-4 stages keep a chunk's loads in flight behind the next
    # (H100 A/B in commit ca0660b).
    if INTERPRETED:
        return [TileConfig(block_n=16, num_warps=4)]   # V = 32 in the CPU tests: two V tiles
    return [TileConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
            for block_n, num_warps, num_stages in ((32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3),
                                                   (64, 8, 2), (128, 8, 2), (128, 8, 3))]


def _output_configs() -> list[TileConfig]:
    if INTERPRETED:
        return [TileConfig(block_n=16, num_warps=4)]
    return [TileConfig(block_n=block_n, num_warps=num_warps) for block_n, num_warps in ((64, 4), (128, 4), (128, 8))]


def _fitting_v_tiles(configs, named_args, **kwargs):
    """V tiles no wider than V. On the GPU, tiles under 64 columns only for the split state
    kernel (two dots): with the four dots of the fused loop, narrow tiles hit a Triton
    shared-memory bug on sm_90 (illegal address, seen on an H200 with Triton 3.6 at BV = 16;
    pytorch/helion PR #1905, triton-lang/triton #10486, #11366)."""
    value_dim = kwargs.get("V", named_args.get("V"))
    narrow_ok = INTERPRETED or kwargs.get("SPLIT_O", named_args.get("SPLIT_O", False))
    return [c for c in configs if c.kwargs["BV"] <= value_dim and (narrow_ok or c.kwargs["BV"] >= 64)]


# cache_results: tuning results persist in Triton's cache directory, so a restarted server (and
# the engine's start-up warm-up, engine/warm_up.py) does not tune again.
_solve = triton.autotune(autotune_configs(_solve_configs(), BK="block_k"),
                         key=["HV", "HK", "K"], cache_results=True)(_gdn_chunk_solve_kernel)
_wy = triton.autotune(autotune_configs(_wy_configs()), key=["HV", "HK", "K", "V"],
                      cache_results=True)(_gdn_chunk_wy_kernel)
# The split state kernel writes V' over u: tuning runs restore it as well as the pool.
_state = triton.autotune(autotune_configs(_state_configs(), BV="block_n"),
                         key=["HV", "HK", "K", "V", "row_bucket", "HAS_CHECKPOINTS", "SPLIT_O"],
                         prune_configs_by={"early_config_prune": _fitting_v_tiles},
                         restore_value=["state", "u"], cache_results=True)(_gdn_chunk_state_kernel)
_output = triton.autotune(autotune_configs(_output_configs(), BV="block_n"), key=["HV", "HK", "K", "V"],
                          prune_configs_by={"early_config_prune": _fitting_v_tiles},
                          cache_results=True)(_gdn_chunk_output_kernel)


def split_output(num_rows: int, num_value_heads: int, value_dim: int, device: torch.device) -> bool:
    """Whether the outputs get their own all-chunks-parallel kernel: when the fused state kernel
    (a program per row, value head and 64-column V tile) would occupy at most a quarter of the
    SMs. Then its chain of chunks is the critical path; the split takes the two output dots off
    it and lets the state kernel use 32-column tiles (twice the programs), which beats the
    traffic of the stored chunk states (fla's layout, chunk_fwd_h + chunk_fwd_o). On an H100 at
    K = V = 128, one long row is faster split at HV = 16 (32 programs) and fused at HV = 32 (64
    programs) (measured: bench/results/kernels_gdn-h100.json). The interpreter keeps the fused
    path unless told (tests force both)."""
    return device.type == "cuda" and num_rows * num_value_heads * max(1, value_dim // 64) <= num_sms(device) // 4


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _check_gdn_chunked_args(q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, has_initial_state, state,
                            out) -> None:
    num_tokens, num_key_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1], v.shape[2]
    num_rows = slot_ids.numel()
    assert k.shape == q.shape and v.shape[0] == num_tokens, "q, k [T, HK, K] and v [T, HV, V]"
    assert a.shape == b.shape == (num_tokens, num_value_heads), "a, b [T, HV]"
    assert num_value_heads % num_key_heads == 0, "value heads must be a multiple of key heads"
    assert q.dtype == k.dtype == v.dtype and q.dtype in _TL_DTYPE, "q, k, v share one float dtype"
    for name, dim in (("K", key_dim), ("V", value_dim)):
        assert 16 <= dim <= 256 and dim & (dim - 1) == 0, f"{name} = {dim} must be a power of two in 16..256"
    assert INTERPRETED or value_dim >= 64, "V >= 64 on the GPU (V tiles below 64 are unsafe: _state_configs)"
    for name, x, head_stride in (("q", q, key_dim), ("k", k, key_dim), ("v", v, value_dim), ("a", a, 1), ("b", b, 1)):
        assert x.stride(-1) == 1 and (x.dim() == 2 or x.stride(-2) == head_stride), f"{name}: heads must be packed"
    assert A_log.shape == dt_bias.shape == (num_value_heads,), "A_log, dt_bias [HV]"
    assert cu_seqlens.shape == (num_rows + 1,) and cu_seqlens.dtype == torch.int32, "cu_seqlens int32 [rows+1]"
    assert slot_ids.dtype == torch.int32 and has_initial_state.shape == (num_rows,) \
        and has_initial_state.dtype == torch.bool, "slot_ids int32 [rows], has_initial_state bool [rows]"
    assert state.shape[1:] == (num_value_heads, key_dim, value_dim) and state.is_contiguous() \
        and state.dtype in (torch.float32, torch.bfloat16), "state pool contiguous fp32/bf16 [slots, HV, K, V]"
    if out is not None:
        assert out.shape == v.shape and out.dtype == v.dtype and out.is_contiguous() and out.device == q.device, \
            "out: contiguous [T, HV, V] in v's dtype"


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                slot_ids: torch.Tensor, has_initial_state: torch.Tensor, state: torch.Tensor,
                checkpoint_cu: torch.Tensor | None = None, checkpoint_lengths: torch.Tensor | None = None,
                checkpoint_states: torch.Tensor | None = None, lengths_checked: bool = False,
                out: torch.Tensor | None = None, split: bool | None = None) -> torch.Tensor:
    """Triton `gdn_chunked_reference` (same arguments and semantics). q, k, v may be views with
    any token stride (e.g. splits of the conv output) as long as each token's heads are packed;
    a, b likewise. `out` (optional): a contiguous [T, HV, V] view in v's dtype, e.g. a row slice
    of the layer's output buffer. K and V are powers of two, 16 .. 256 (V >= 64 on the GPU).
    `split`: outputs by their own kernel (True) or inside the state kernel (False); None picks
    by `split_output`."""
    _check_gdn_chunked_args(q, k, v, a, b, A_log, dt_bias, cu_seqlens, slot_ids, has_initial_state, state, out)
    has_checkpoints = check_checkpoints(cu_seqlens, checkpoint_cu, checkpoint_lengths, checkpoint_states, state,
                                        lengths_checked)
    num_tokens, num_key_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[1], v.shape[2]
    num_rows = slot_ids.numel()
    device = q.device
    if out is None:
        out = torch.empty(num_tokens, num_value_heads, value_dim, dtype=v.dtype, device=device)
    if num_rows == 0:
        return out
    g_cum, q_scale, k_scale = torch.empty(3, num_tokens, num_value_heads, dtype=torch.float32, device=device)
    w = torch.empty(num_tokens, num_value_heads, key_dim, dtype=q.dtype, device=device)
    u = torch.empty(num_tokens, num_value_heads, value_dim, dtype=q.dtype, device=device)
    attn, inverse = torch.empty(2, num_tokens, num_value_heads, CHUNK_SIZE, dtype=q.dtype, device=device)
    scale = key_dim ** -0.5
    dot_dtype = _TL_DTYPE[q.dtype]
    precision = dot_precision(q.dtype)
    rows_pow2 = max(64, triton.next_power_of_2(num_rows))
    # T // 64 + rows bounds the chunks. Program ids run over the value heads of a chunk first, so
    # the heads that share a key head (HV > HK) run side by side and its second read of q and k
    # comes from L2 (chunk-major, the sibling ran a whole head's chunks earlier and HV32 read them
    # twice from memory; H100 A/B in commit 058d68a).
    grid = ((num_tokens // CHUNK_SIZE + num_rows) * num_value_heads,)
    _solve[grid](k, a, b, A_log, dt_bias, cu_seqlens, inverse, num_rows,
                 k.stride(0), a.stride(0), b.stride(0),
                 HV=num_value_heads, HK=num_key_heads, K=key_dim, ROWS_POW2=rows_pow2, CHUNK=CHUNK_SIZE,
                 SUB=SUB_CHUNK, EPS=L2NORM_EPS, DOT_DTYPE=dot_dtype, PRECISION=precision)
    _wy[grid](q, k, v, a, b, A_log, dt_bias, cu_seqlens, inverse, g_cum, q_scale, k_scale, w, u, attn,
              num_rows, scale, q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0),
              HV=num_value_heads, HK=num_key_heads, K=key_dim, V=value_dim, ROWS_POW2=rows_pow2, CHUNK=CHUNK_SIZE,
              EPS=L2NORM_EPS, DOT_DTYPE=dot_dtype, PRECISION=precision)
    if split is None:
        split = split_output(num_rows, num_value_heads, value_dim, device)
    num_chunk_ids = num_tokens // CHUNK_SIZE + num_rows     # an upper bound of the chunks of all rows
    chunk_states = (torch.empty(num_chunk_ids, num_value_heads, key_dim, value_dim, dtype=q.dtype, device=device)
                    if split else w)
    _state[lambda meta: (num_rows * num_value_heads * (value_dim // meta["BV"]),)](
        q, k, g_cum, q_scale, k_scale, w, u, attn, out, state, cu_seqlens, slot_ids,
        has_initial_state.view(torch.uint8),
        checkpoint_cu if has_checkpoints else slot_ids, checkpoint_lengths if has_checkpoints else slot_ids,
        checkpoint_states if has_checkpoints else state, chunk_states, num_rows,
        q.stride(0), k.stride(0), min(triton.next_power_of_2(num_rows), 64),
        HV=num_value_heads, HK=num_key_heads, K=key_dim, V=value_dim, CHUNK=CHUNK_SIZE,
        DOT_DTYPE=dot_dtype, PRECISION=precision, HAS_CHECKPOINTS=has_checkpoints, SPLIT_O=split,
        ROWS_POW2=rows_pow2 if split else 1)
    if split:
        _output[lambda meta: (num_chunk_ids * num_value_heads, value_dim // meta["BV"])](
            q, q_scale, u, attn, out, cu_seqlens, chunk_states, num_rows, q.stride(0),
            HV=num_value_heads, HK=num_key_heads, K=key_dim, V=value_dim, ROWS_POW2=rows_pow2, CHUNK=CHUNK_SIZE,
            DOT_DTYPE=dot_dtype, PRECISION=precision)
    return out
