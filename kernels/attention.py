"""Paged attention over the KV pool: varlen prefill over a cached prefix, decode and verify.

KV pool (per attention layer): k_cache, v_cache [num_blocks, block_size, Hkv, D]. A row's
tokens live at positions [0, context_len) mapped through its block table; the row's q_len
query tokens are its last q_len positions, causal among themselves. Decode (q_len 1),
verify (q_len k+1) and prefill chunks (any q_len, any cached prefix) are the same call.
Softmax in float32. An optional output gate (the gated attention of the Qwen3.5 family: the
output is attention * sigmoid(gate), gate a [T, Hq, D] view of the q projection) is applied in
float32 before the output's single rounding. Knows nothing about sequences beyond block tables
and lengths.

`write_kv_reference` puts this step's K/V into the pool by slot_mapping (the Triton form runs
with the q/k norm and RoPE: rope.py qk_norm_rope_kv). `paged_attention` is one Triton
flash-attention kernel for every row kind. A program owns one query
tile of one row and one KV head: the tile packs TOKENS consecutive query tokens x the GROUP
query heads of that KV head into its BLOCK_M rows (m -> token m // GROUP, head m % GROUP), so
K/V are read once per KV head for all its query heads, and a decode or verify row (q_len <= 8)
is one tile. Optionally the key range of a tile is split over num_splits programs (long contexts,
few rows); a second small kernel merges their partial (max, sum, acc). Both are programmatic
dependent launches on sm_90+ (launch.py). The gate is multiplied in by whichever kernel stores
the output (the attention kernel's epilogue, or the merge), so it costs no launch of its own.
Launch geometry depends only on tensor shapes, never on tensor values, so both launchers run
inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import num_sms
from .launch import dependent_prologue, dot_precision, pdl
from .quantize import round_to_e4m3
from .tiles import TileConfig
from .varlen import pad_rows, row_layout

# An FP8 pool (EngineConfig.kv_cache_dtype "fp8", vLLM's) holds e4m3 with a scale of 1, as vLLM's
# does without calibrated scales: K and V are rounded from the model dtype, saturating at 448.
FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = 448.0


def to_kv_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (in the model dtype) as the pool stores it: cast, or clamped to e4m3's range and rounded."""
    return x.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype) if dtype == FP8_KV else x.to(dtype)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] flat index block * block_size + offset."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping.long()] = to_kv_reference(k, k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping.long()] = to_kv_reference(v, v_cache.dtype)


@triton.jit
def to_kv(x, cache):
    """x (rounded to the model dtype already) as `cache`'s pool stores it (to_kv_reference): for an
    FP8 pool clamped and rounded on the e4m3 grid before the cast (exact on the GPU and under the
    interpreter, whose own cast can lose a carry: quantize.round_to_e4m3)."""
    if cache.dtype.element_ty == tl.float8e4nv:
        return round_to_e4m3(tl.clamp(x.to(tl.float32), -448.0, 448.0)).to(tl.float8e4nv)
    return x.to(cache.dtype.element_ty)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
                              context_lens: torch.Tensor, scale: float,
                              gate: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; block_tables: [B, M]; cu_seqlens: [B+1] query offsets; context_lens: [B]
    keys per row (cached prefix + this step's tokens, already written); gate (optional) [T, Hq, D].
    Returns [T, Hq, D]: attention, times sigmoid(gate) when given, rounded once to q's dtype."""
    num_rows, (num_heads, head_dim) = block_tables.shape[0], q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    lengths, row, index_in_row, max_q = row_layout(cu_seqlens, q.shape[0])
    context = context_lens.long()
    max_k = int(context.max())
    key_pos = torch.arange(max_k, device=q.device)
    blocks = block_tables.long().gather(1, (key_pos // block_size).clamp(max=block_tables.shape[1] - 1)
                                        .expand(num_rows, -1))
    flat = blocks * block_size + key_pos % block_size                          # [B, max_k]
    keys = k_cache.view(-1, num_kv_heads, head_dim)[flat].float()              # [B, max_k, Hkv, D]
    # Positions past a row's context may hold anything (NaN too); probability 0 times NaN is NaN.
    owned = (key_pos.view(1, -1) < context.view(-1, 1)).view(num_rows, max_k, 1, 1)
    values = v_cache.view(-1, num_kv_heads, head_dim)[flat].float().where(owned, 0.0)
    groups = num_heads // num_kv_heads
    keys, values = keys.repeat_interleave(groups, dim=2), values.repeat_interleave(groups, dim=2)
    queries = pad_rows(q.float(), row, index_in_row, num_rows, max_q)         # [B, max_q, Hq, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", queries, keys) * scale
    query_pos = context.view(-1, 1) - lengths.view(-1, 1) + torch.arange(max_q, device=q.device).view(1, -1)
    allowed = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)                # [B, max_q, max_k]
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                     # padded queries: all -inf
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)[row, index_in_row]
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out.to(q.dtype)


def check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The KV pool's contract for the kernels that read or write it (here, and rope.py's KV write)."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache, v_cache: [num_blocks, block_size, Hkv, D]"
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share one layout (one offset serves both)"
    assert k_cache.dtype == v_cache.dtype and k_cache.device == v_cache.device, "k_cache, v_cache: one dtype and device"
    assert k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16, FP8_KV), \
        "the pool: the model dtype or float8_e4m3fn"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "pool head_dim must be contiguous"
    head_dim = k_cache.shape[3]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of 2 >= 16"


# ---------------------------------------------------------------------------------------------
# paged attention


@triton.jit
def _find_row(cu_seqlens_ptr, tile, num_rows, TOKENS: tl.constexpr):
    """Row r owns tile slots [cu[r] // TOKENS + r, cu[r+1] // TOKENS + r + 1): at least
    cdiv(q_len_r, TOKENS) of them, the surplus empty. Returns the largest r with
    cu[r] // TOKENS + r <= tile (binary search; slot starts strictly increase with r)."""
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_ptr + mid) // TOKENS + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _step_block(start, hi, table, BLOCK_SIZE: tl.constexpr):
    """Block id (int64) of key start, 0 when start >= hi (never read past the row's keys)."""
    return tl.load(table + start // BLOCK_SIZE, mask=start < hi, other=0).to(tl.int64)


@triton.jit
def _key_rows(start, hi, carried, table, kv_head, stride_block, stride_offset, stride_head, BLOCK_SIZE: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Pool offsets (elements, int64) of keys [start, start + BLOCK_N) of one KV head, for K and V
    alike (the two pools share a layout), and the block for the next step. start is a multiple of
    BLOCK_N. When one of BLOCK_N and BLOCK_SIZE divides the other, a step lies inside one block or
    covers whole blocks, so the key -> (block, offset) split costs no per-key division and the
    in-block part of the offset is loop-invariant. A step inside one block takes its block id
    from the previous step (`carried`, loaded one step ahead): K/V addresses then never wait on a
    table load of their own step, which would leave the software pipeline one K/V tile in flight.
    Table entries of keys >= hi are never read (MASKED: the row's last step may run past its table)."""
    lane = tl.arange(0, BLOCK_N)
    if BLOCK_SIZE % BLOCK_N == 0:
        block = carried                                                                   # one block
        inner = (start % BLOCK_SIZE + lane) * stride_offset
        carried = _step_block(start + BLOCK_N, hi, table, BLOCK_SIZE)
    elif BLOCK_N % BLOCK_SIZE == 0:
        index = start // BLOCK_SIZE + lane // BLOCK_SIZE                                  # whole blocks
        if MASKED:
            block = tl.load(table + index, mask=start + lane < hi, other=0).to(tl.int64)
        else:
            block = tl.load(table + index).to(tl.int64)
        inner = (lane % BLOCK_SIZE) * stride_offset
    else:
        key_pos = start + lane
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_pos < hi, other=0).to(tl.int64)
        inner = (key_pos % BLOCK_SIZE) * stride_offset
    return block * stride_block + inner + kv_head * stride_head, carried


@triton.jit
def _attend_block(acc, m_i, l_i, block, q, start, hi, query_pos, table, k_cache_ptr, v_cache_ptr, kv_head,
                  stride_block, stride_offset, stride_head, qk_scale, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """Online softmax over keys [start, start + BLOCK_N) ∩ [.., hi); block carries a step's block
    id to the next (_key_rows). Scores are in the log2 domain (qk_scale = scale * log2 e). Keys
    >= hi are never loaded (they may be stale or NaN); MASKED hides them and also key > query
    position (off when the whole block is visible, which implies every key < hi). A row that has
    seen no key keeps m = -inf, l = 0, acc = 0 (m_safe avoids inf - inf)."""
    key_pos = start + tl.arange(0, BLOCK_N)
    offsets, block = _key_rows(start, hi, block, table, kv_head, stride_block, stride_offset, stride_head,
                               BLOCK_SIZE, BLOCK_N, MASKED)
    rows = offsets[:, None] + tl.arange(0, HEAD_DIM)[None, :]                            # [BLOCK_N, D]
    if MASKED:
        in_range = key_pos < hi
        k = tl.load(k_cache_ptr + rows, mask=in_range[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + rows)
        v = tl.load(v_cache_ptr + rows)
    k, v = k.to(q.dtype), v.to(q.dtype)  # an FP8 pool's keys and values widen exactly (scale 1)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale                   # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where((key_pos[None, :] <= query_pos[:, None]) & in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i, block


@triton.jit(do_not_specialize=["num_rows", "num_tile_slots", "num_splits", "stride_table_row"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, gate_ptr,
        out_ptr, partial_acc_ptr, partial_stats_ptr, qk_scale, num_rows, num_tile_slots, num_splits,
        stride_q_token, stride_q_head, stride_kv_block, stride_kv_offset, stride_kv_head, stride_table_row,
        stride_gate_token, stride_gate_head, stride_out_token, stride_out_head,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_GATE: tl.constexpr,
        PRECISION: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Grid (tile slot, KV head, split). Tile rows m < TOKENS * GROUP hold query token
    first + m // GROUP of the row, query head kv_head * GROUP + m % GROUP.

    Query token i of a row (0 <= i < q_len) sits at position prefix + i, prefix = context - q_len,
    and sees keys [0, prefix + i]. The tile therefore needs keys [0, end), end = min(context,
    prefix + first + TOKENS); keys [0, prefix + first + 1) are visible to all of its queries and
    skip the causal mask. With SPLIT, split s of num_splits takes the BLOCK_N-aligned s-th chunk of
    [0, end) and writes unnormalised (acc, m, l) for _combine_splits_kernel (which then applies
    the gate); else the tile stores acc / l, times sigmoid(gate) with HAS_GATE."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    dependent_prologue(DEPENDENT_LAUNCH)
    tile = num_tile_slots - 1 - tl.program_id(0)          # a row's last (longest) tiles start first
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = _find_row(cu_seqlens_ptr, tile, num_rows, TOKENS)
    q_start = tl.load(cu_seqlens_ptr + row)
    q_len = tl.load(cu_seqlens_ptr + row + 1) - q_start
    first = (tile - q_start // TOKENS - row) * TOKENS
    if first >= q_len:
        return
    context = tl.load(context_lens_ptr + row)
    prefix = context - q_len

    m = tl.arange(0, BLOCK_M)
    token = first + m // GROUP
    head = kv_head * GROUP + m % GROUP
    valid = (m < TOKENS * GROUP) & (token < q_len)
    query_pos = prefix + token
    q_row = (q_start + token).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (q_row * stride_q_token + head * stride_q_head)[:, None] + d, mask=valid[:, None], other=0.0)

    end = tl.minimum(context, prefix + first + TOKENS)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(end, num_splits), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * chunk, end)
        hi = tl.minimum(lo + chunk, end)
    else:
        lo = 0
        hi = end
    unmasked_hi = lo + tl.maximum(tl.minimum(prefix + first + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N

    table = block_tables_ptr + row.to(tl.int64) * stride_table_row
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if BLOCK_SIZE % BLOCK_N == 0:    # steps inside one block carry their block id (_key_rows)
        block = _step_block(lo, hi, table, BLOCK_SIZE)
    else:
        block = tl.full([], 0, tl.int64)
    for start in range(lo, unmasked_hi, BLOCK_N):
        acc, m_i, l_i, block = _attend_block(acc, m_i, l_i, block, q, start, hi, query_pos, table, k_cache_ptr,
                                             v_cache_ptr, kv_head, stride_kv_block, stride_kv_offset, stride_kv_head,
                                             qk_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, False)
    for start in range(unmasked_hi, hi, BLOCK_N):
        acc, m_i, l_i, block = _attend_block(acc, m_i, l_i, block, q, start, hi, query_pos, table, k_cache_ptr,
                                             v_cache_ptr, kv_head, stride_kv_block, stride_kv_offset, stride_kv_head,
                                             qk_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, True)

    if SPLIT:
        partial = (q_row * NUM_HEADS + head) * num_splits + split                    # [T, Hq, S]
        tl.store(partial_acc_ptr + partial[:, None] * HEAD_DIM + d, acc, mask=valid[:, None])
        tl.store(partial_stats_ptr + partial * 2, m_i, mask=valid)
        tl.store(partial_stats_ptr + partial * 2 + 1, l_i, mask=valid)
    else:
        out = acc / l_i[:, None]
        if HAS_GATE:
            gate = tl.load(gate_ptr + (q_row * stride_gate_token + head * stride_gate_head)[:, None] + d,
                           mask=valid[:, None], other=0.0).to(tl.float32)
            out = out * tl.sigmoid(gate)
        tl.store(out_ptr + (q_row * stride_out_token + head * stride_out_head)[:, None] + d,
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(partial_acc_ptr, partial_stats_ptr, gate_ptr, out_ptr, num_splits, stride_gate_token,
                           stride_gate_head, stride_out_token, stride_out_head, NUM_HEADS: tl.constexpr,
                           SPLIT_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           HAS_GATE: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """One program per (token, query head, BLOCK_D columns): out = sum_s 2^(m_s - M) acc_s /
    sum_s 2^(m_s - M) l_s, M = max_s m_s, times sigmoid(gate) with HAS_GATE. The splits stream
    through in chunks of SPLIT_CHUNK (any split count, bounded registers), folded in with a running
    max (as the attention kernel folds key steps); a chunk's loop is unrolled, its loads going out
    together, so a row of <= SPLIT_CHUNK splits costs one memory round trip. Each thread owns its
    columns: the sums over splits are its own adds, no reduction across threads. (A [splits,
    BLOCK_D] tile summed with tl.sum left copies of a sum in several threads, which Triton's
    layout conversion before the store all wrote to one shared-memory word: racecheck's
    write-after-write hazard, triton-lang/triton#7264, with copies that may differ in the last
    bit.) Splits that saw no key (m = -inf, l = 0, acc = 0) weigh 0."""
    dependent_prologue(DEPENDENT_LAUNCH)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    base = (token * NUM_HEADS + head) * num_splits
    m_run = tl.full([], float("-inf"), tl.float32)
    denominator = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # Split i past num_splits reads the last split's values (no masked scalar loads) at weight 0.
    for start in range(0, num_splits, SPLIT_CHUNK):
        m_chunk = tl.full([], float("-inf"), tl.float32)
        for s in tl.static_range(SPLIT_CHUNK):
            split = base + tl.minimum(start + s, num_splits - 1)
            m_chunk = tl.maximum(m_chunk, tl.load(partial_stats_ptr + split * 2))
        m_new = tl.maximum(m_run, m_chunk)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no split so far saw a key
        alpha = tl.exp2(m_run - m_safe)
        denominator = denominator * alpha
        acc = acc * alpha
        for s in tl.static_range(SPLIT_CHUNK):
            split = base + tl.minimum(start + s, num_splits - 1)
            weight = tl.where(start + s < num_splits, tl.exp2(tl.load(partial_stats_ptr + split * 2) - m_safe), 0.0)
            denominator += weight * tl.load(partial_stats_ptr + split * 2 + 1)
            acc += weight * tl.load(partial_acc_ptr + split * HEAD_DIM + d)
        m_run = m_new
    out = acc / denominator
    if HAS_GATE:
        gate = tl.load(gate_ptr + token * stride_gate_token + head * stride_gate_head + d).to(tl.float32)
        out = out * tl.sigmoid(gate)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + d, out.to(out_ptr.dtype.element_ty))


# The merge streams any number of splits; more than 128 never ran faster (measured:
# bench/results/kernels_attn-h100.json), and each split adds [Hq, D] fp32 of partials.
MAX_SPLITS = 128
# The merge of a decode row is a latency chain: a chunk's loads go out together, and narrow D
# blocks spread a row over more programs, one warp each, a column a thread (no sums across threads).
# 32 splits a chunk: a 128-split chunk's unrolled loads spilled registers (2x slower at 128 splits:
# bench/results/attempts/combine_per_thread/).
COMBINE_SPLIT_CHUNK = 32
COMBINE_BLOCK_D = 32
COMBINE_WARPS = COMBINE_BLOCK_D // 32


def attention_config(num_tokens: int, num_rows: int, num_kv_heads: int, group: int, max_context: int,
                     num_sms: int, *, block_size: int) -> TileConfig:
    """The tile of _paged_attention_kernel (block_m packed (token, head) rows per tile, >= GROUP;
    block_n keys a step; num_splits key-range splits per tile), picked from shapes alone (never
    device values, so CUDA graphs can capture the call). The table is what won in
    bench/kernels_attn.py at 8 q / 2 kv heads, D 256 (measured: bench/results/kernels_attn-h200.json;
    small decode batches: bench/results/kernels_attn_small-h100.json); D 128 uses the same tiles.

    Average q_len <= 8 (decode/verify batches): a tile holds a row's tokens x its GROUP heads in
    the smallest power of two >= 16 rows (tl.dot's minimum); memory-bound: 64 keys a step, 4 warps,
    3 stages. Longer rows (prefill): 128-row tiles, 64 keys a step, 8 warps (two warpgroups), 2
    stages. One decode program is latency-bound, far below the memory bandwidth, so when tiles x
    KV heads leave SMs idle the key range is split until the grid holds 1-2 programs per SM (a
    power of two, >= one key step per split, <= MAX_SPLITS). Such split programs run a few key
    steps each, where a software pipeline's prologue costs more than it hides: decode rows that
    fill at most 1/8 of the SMs before splitting take 32 keys a step, unpipelined (a program costs
    least when it runs a single key step), unless a split still walks more than two key steps
    over the table, which wants its 3 stages back (measured:
    bench/results/kernels_attn_small-h100.json).
    Those rows whose splits hold more than 32 keys, over blocks of a multiple of 16 keys, take
    16-key steps on 2 warps, 3 stages instead: each step lies inside one block whose id was loaded
    a step ahead (_key_rows), so two K/V tiles are in flight per program: faster for decode rows
    than 32-key steps that read their block ids in the same step, for verify rows from slightly
    slower to faster (measured: bench/results/kernels_attn_decode_steps-h100.json)."""
    if num_tokens <= 8 * num_rows:
        tokens_per_row = triton.cdiv(num_tokens, max(num_rows, 1))
        block_m = max(16, triton.next_power_of_2(group * min(tokens_per_row, 8)))
        num_warps, num_stages = 4, 3
    else:
        block_m = max(128, triton.next_power_of_2(group))
        num_warps, num_stages = 8, 2
    block_n = 64
    programs = max(num_rows, triton.cdiv(num_tokens, block_m // group), 1) * num_kv_heads
    num_splits = 1
    if programs < num_sms:
        few_rows = num_tokens <= 8 * num_rows and 8 * programs <= num_sms
        if few_rows:
            block_n, num_stages = 32, 1
        wanted = triton.cdiv(2 * num_sms, programs)
        num_splits = max(1, min(1 << (wanted.bit_length() - 1), max_context // block_n, MAX_SPLITS))
        split_keys = max_context // num_splits
        if few_rows and block_size % 16 == 0 and split_keys > 32:
            block_n, num_warps, num_stages = 16, 2, 3     # 16-key steps, each inside one block
        elif few_rows and split_keys > 2 * block_n:
            num_stages = 3                  # long splits (many key steps each) want their pipeline back
    return TileConfig(block_m=block_m, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
                      num_stages=num_stages)


def _check_paged_attention_args(out, q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, gate,
                                config) -> None:
    check_pool(k_cache, v_cache)
    num_rows = block_tables.shape[0]
    assert q.dim() == 3 and q.shape[2] == k_cache.shape[3], "q: [T, Hq, D] with the pool's D"
    assert q.shape[1] % k_cache.shape[2] == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and (q.dtype == k_cache.dtype or k_cache.dtype == FP8_KV), \
        "q: D contiguous, the pool's dtype (any over an FP8 pool)"
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, \
        "out: q's shape and dtype, D contiguous"
    if gate is not None:
        assert gate.shape == q.shape and gate.dtype == q.dtype and gate.stride(-1) == 1, \
            "gate: [T, Hq, D] in q's dtype, D contiguous (any token/head strides)"
        assert gate.device == q.device, "gate on q's device"
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, \
        "block_tables: [B, M] int32, unit stride along M"
    assert cu_seqlens.shape == (num_rows + 1,) and cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous(), \
        "cu_seqlens: contiguous [B+1] int32"
    assert context_lens.shape == (num_rows,) and context_lens.dtype == torch.int32 and context_lens.is_contiguous(), \
        "context_lens: contiguous [B] int32"
    assert len({t.device for t in (out, q, k_cache, block_tables, cu_seqlens, context_lens)}) == 1, \
        "out, q, the pool and the row tensors on one device"
    group = q.shape[1] // k_cache.shape[2]
    assert config.block_m >= group and config.block_m >= 16 and 1 <= config.num_splits, \
        f"config: block_m >= max(16, GROUP = {group}), num_splits >= 1"


def launch_paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, config: TileConfig, gate: torch.Tensor | None = None) -> None:
    """paged_attention with an explicit config, writing into out [T, Hq, D] (tests, benchmarks)."""
    _check_paged_attention_args(out, q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, gate, config)
    num_tokens, num_heads, head_dim = q.shape
    num_rows, num_kv_heads = block_tables.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_tokens == 0:
        return
    tokens_per_tile = config.block_m // group
    num_tile_slots = num_tokens // tokens_per_tile + num_rows
    splits = config.num_splits
    partial_acc = partial_stats = out                      # unused unless splits > 1
    has_gate = gate is not None
    gate_strides = (gate.stride(0), gate.stride(1)) if has_gate else (0, 0)
    gate = gate if has_gate else q                         # never read without HAS_GATE
    if splits > 1:
        partial_acc = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        partial_stats = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(num_tile_slots, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, gate, out, partial_acc, partial_stats,
        scale * 1.4426950408889634, num_rows, num_tile_slots, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *gate_strides,
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, SPLIT=splits > 1, HAS_GATE=has_gate,
        PRECISION=dot_precision(q.dtype),
        **config.launch_options(), **pdl(q.device))
    if splits > 1:
        block_d = min(COMBINE_BLOCK_D, head_dim)
        _combine_splits_kernel[(num_tokens, num_heads, head_dim // block_d)](
            partial_acc, partial_stats, gate, out, splits, *gate_strides, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, SPLIT_CHUNK=min(COMBINE_SPLIT_CHUNK, triton.next_power_of_2(splits)),
            HEAD_DIM=head_dim, BLOCK_D=block_d, HAS_GATE=has_gate, num_warps=COMBINE_WARPS, **pdl(q.device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """Triton paged_attention_reference (same arguments, same result): q and gate (optional)
    [T, Hq, D] with any token/head strides; block_tables [B, M] int32; cu_seqlens [B+1],
    context_lens [B] int32."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_kv_heads = k_cache.shape[2]
    config = attention_config(q.shape[0], block_tables.shape[0], num_kv_heads, q.shape[1] // num_kv_heads,
                              block_tables.shape[1] * k_cache.shape[1], num_sms(q.device),
                              block_size=k_cache.shape[1])
    launch_paged_attention(out, q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, scale, config, gate)
    return out
