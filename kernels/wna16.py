"""Weight-only integer linear layers and MoE experts: int4 / int8 weights with group scales and
optional zero points, float activations (the "WNA16" checkpoints of GPTQ, AWQ and
compressed-tensors' pack-quantized format, once the engine has converted them to the layout
below). Knows nothing about checkpoint formats or which projection it computes, only this layout.

Layout (N output features, K input features, G the group size, P = 32 // bits values a word):
    qweight  [N, K // P] int32: column k's unsigned value q in bits [(k % P) * bits, +bits) of
             word k // P (the top value makes the word negative: shifts are masked)
    scales   [N, ceil(K / G)] float32 (float16 / bfloat16 accepted)
    zeros    None (symmetric: every zero point is 2^(bits - 1)) or [N, ceil(K / G)] uint8
    perm     None or [K] int32 (act-order checkpoints): the projection's input is x[:, perm]
    W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G];   y = x[:, perm] @ W^T
G is a power of two >= 16 that P divides (the last group partial where G does not divide K), or
K itself (per-channel scales, any K that P divides). MoE experts are these per expert, stacked
([E, 2I, H // P] gate and up, [E, H, I // P] down; no perm).

References (the CPU table and the oracle): `wna16_linear_reference` dequantizes to float32 and
multiplies in float32; `wna16_moe_experts_reference` runs moe.py's expert MLP the same way.
`pack_reference` / `quantize_reference` build weights (tests, benchmarks, random models).

Triton: the weight stays packed in HBM; each K step a program dequantizes its [BLOCK_N, BLOCK_K]
tile in registers straight into the MMA's operand (`_unpack_pairs`):
  - Two values 16 bits apart in a word (j and j + P/2: (P/2) * bits = 16) come out together:
    (word >> j * bits) & (mask at bits 0 and 16) | (magic at both halves) is two 16-bit floats
    c + q (0x6400 | q = 1024 + q in fp16; 0x4300 | q = 128 + q in bf16, q < 128), one shift
    and one LOP3 for two operand values, which the register holds as the MMA's pair of adjacent
    K positions. A tile's K order is therefore, within each word, j, j + P/2, j + 1, ...; x's
    tile is permuted the same way in registers (`_pair_order`), which leaves the product as it
    is. bf16 with 8 bits (bf16 holds 7 bits of payload) and fp32 activations go through fp32's
    magic (0x4B000000 | q = 2^23 + q), a subtraction and a conversion instead.
  - The offset c and the zero point leave a rank-one term: sum_k (c + q - c - z) x_k =
    dot(c + q, x) - (c + z) sum_k x_k. The linear layer's GEMM subtracts c + z from each value
    (exact: small integers). Taking sum_k x_k from a second MMA with a tile of ones instead
    keeps 64 registers of constants and a second wgmma a step, and measured slower at decode
    shapes (H200, gate_up at one row: 45 against 36 µs; bench/results/
    wna16_zero_by_dot-h200/). The MoE kernels' tiles of up to 32 rows still take it
    (ZERO_BY_DOT; not measured against). The step's fp32 product is then scaled by its
    group's scale (a step never straddles groups: BLOCK_K divides G, or G = K).
ptxas (sm_90, compile-only: tests/kernels/compile_for_hopper.py's driver) gave the skinny loop
(bf16, 4-bit, 128-row tiles, with the ones-MMA) ~3 instructions per weight value, x's
permutation included; unpacking value by value (shift, mask, convert) gave ~4.7 and a trip
through shared memory. An H200 streams ~36 weight values a clock per SM at its copy bandwidth against 128
instruction issues. Measured there (ncu, gate_up at one row): 3.9 instructions a value, issued on
a quarter of the cycles: 3 warps a scheduler (167 registers) stall on the words' shared-memory
loads and the step's barriers. The loop is latency-bound at ~25% of the copy bandwidth, where a
read of the same bytes in the same tiles reaches 85% (bench/results/wna16_floor-h200.json).

`wna16_linear` (the GPU table's) by rows M, from shapes alone (CUDA graphs replay the choice):
  M <= SKINNY_MAX_ROWS   decode, verify and draft batches: bandwidth-bound; one MMA tile of the
                         batch padded to >= 16 rows, K split over the SMs, the split-K partials
                         summed by the last program of a tile to arrive (arrivals.py, as fp8.py);
                         before its PDL wait a program prefetches its share of W into L2.
  below DEQUANT_MIN_ROWS the same kernel with prefill tiles and no split.
  from DEQUANT_MIN_ROWS  W dequantized to x's dtype by `dequantize` (one pass: reads the packed
                         weight, writes 2 bytes a value), then cuBLAS: ~2.5 N K bytes of traffic
                         against the GEMM's 2 M N K flops, ~240 / M of the GEMM's time at an
                         H200's bandwidth and peak (estimated, not measured: 3% at 8192 rows),
                         less than a Triton mixed-input GEMM is expected to lose to cuBLAS there
                         (bench/kernels_wna16.py --sweep measures the crossover). The 16-bit W is
                         transient: N K x 2 bytes from the caching allocator.
`wna16_moe_experts`: moe.py's two paths on the packed experts, chosen by moe.py's rule: per
token (decode: a program per pair and tile of I for gate/up with SiLU*up, then one per token and
tile of H summing its slots' down projections) or grouped over moe.py's expert-sorted row blocks
(sort_pairs, block_rows, store_weighted_pairs, sum_slots). Another rank's pairs (expert ids
outside [0, E)) contribute nothing. Every launch is sized from shapes: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_reference
from .arrivals import arrival_counters, store_split_k
from .device import INTERPRETED, num_sms
from .launch import dependent_prologue, dot_precision, pdl, prefetch_l2
from .linear import cublas_linear, split_k_for
from .moe import block_rows, by_expert_reference, grouped_config, sort_pairs, store_weighted_pairs, sum_slots, \
    use_per_token_path
from .tiles import TileConfig

BITS = (4, 8)


def values_per_word(bits: int) -> int:
    """P: values packed in one int32 word."""
    assert bits in BITS, f"bits {bits}: 4 or 8"
    return 32 // bits


def _check_group_size(group_size: int, num_columns: int, bits: int) -> None:
    """G: a power of two >= 16 that P divides, or K itself (per-channel)."""
    words = values_per_word(bits)
    assert num_columns % words == 0, f"K = {num_columns}: a multiple of {words} values a word"
    assert group_size == num_columns or (group_size >= 16 and group_size & (group_size - 1) == 0
                                         and group_size % words == 0), \
        f"group size {group_size}: a power of two >= 16 that {words} divides, or K = {num_columns}"


# ----------------------------------------------------------------------------------------------
# Torch references
# ----------------------------------------------------------------------------------------------

def pack_reference(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [..., K] integers in [0, 2^bits) -> qweight [..., K // P] int32 (value k in bits
    (k % P) * bits of word k // P)."""
    words = values_per_word(bits)
    assert values.shape[-1] % words == 0, f"K = {values.shape[-1]}: a multiple of {words}"
    shifts = torch.arange(words, device=values.device, dtype=torch.int64) * bits
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], -1, words)
    packed = (grouped << shifts).sum(-1)                                 # [0, 2^32): wraps into int32
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def unpack_reference(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight [..., K // P] int32 -> the unsigned values [..., K] int32."""
    words = values_per_word(bits)
    shifts = torch.arange(words, device=qweight.device, dtype=torch.int32) * bits
    values = (qweight[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*qweight.shape[:-1], -1)


def _expand_groups(per_group: torch.Tensor, group_size: int, num_columns: int) -> torch.Tensor:
    """[..., ceil(K / G)] -> [..., K]: each group's entry over its columns."""
    return per_group.repeat_interleave(group_size, dim=-1)[..., :num_columns]


def dequantize_reference(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                         bits: int) -> torch.Tensor:
    """The real weight [..., N, K] float32: (q - zero) * scale over each group."""
    values = unpack_reference(qweight, bits).float()
    num_columns = values.shape[-1]
    zero = 2.0 ** (bits - 1) if zeros is None else _expand_groups(zeros.float(), group_size, num_columns)
    return (values - zero) * _expand_groups(scales.float(), group_size, num_columns)


def quantize_reference(weight: torch.Tensor, group_size: int, bits: int,
                       symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest quantization of weight [..., N, K] in groups of G columns ->
    (qweight, scales float32, zeros uint8 or None). Symmetric: scale = amax / (2^(bits-1) - 1),
    zero 2^(bits-1) (values within +-(2^(bits-1) - 1) of it); otherwise scale = (max - min) /
    (2^bits - 1) and zero = round(-min / scale), the group's range mapped onto [0, 2^bits)."""
    num_columns = weight.shape[-1]
    _check_group_size(group_size, num_columns, bits)
    num_groups = triton.cdiv(num_columns, group_size)
    padded = weight.new_zeros(*weight.shape[:-1], num_groups * group_size, dtype=torch.float32)
    padded[..., :num_columns] = weight
    groups = padded.view(*weight.shape[:-1], num_groups, group_size)
    largest = 2 ** bits - 1
    if symmetric:
        scale = groups.abs().amax(-1).clamp(min=1e-8) / (2 ** (bits - 1) - 1)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((high - low) / largest).clamp(min=1e-8)
        zero = torch.round(-low / scale).clamp(0, largest)
    values = torch.round(groups / scale[..., None] + zero[..., None]).clamp(0, largest)
    values = values.view(*weight.shape[:-1], -1)[..., :num_columns]
    return pack_reference(values, bits), scale, None if symmetric else zero.to(torch.uint8)


def wna16_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                           perm: torch.Tensor | None, group_size: int, bits: int) -> torch.Tensor:
    """x [M, K] -> x[:, perm] @ W^T [M, N] in x's dtype, float32 math."""
    if perm is not None:
        x = x[:, perm.long()]
    return (x.float() @ dequantize_reference(qweight, scales, zeros, group_size, bits).T).to(x.dtype)


def wna16_moe_experts_reference(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                w_gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
                                gate_up_zeros: torch.Tensor | None, w_down: torch.Tensor, down_scales: torch.Tensor,
                                down_zeros: torch.Tensor | None, group_size: int, bits: int) -> torch.Tensor:
    """moe.py's moe_experts_reference on the dequantized experts, float32 math, result in x's
    dtype: x [T, H]; weights, experts [T, k]; w_gate_up [E, 2I, H // P] (gate rows first) with
    scales / zeros [E, 2I, ceil(H / G)]; w_down [E, H, I // P] with [E, H, ceil(I / G)]."""
    def dequantized(packed, scales, zeros, expert):
        return dequantize_reference(packed[expert], scales[expert], None if zeros is None else zeros[expert],
                                    group_size, bits)

    def mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = rows @ dequantized(w_gate_up, gate_up_scales, gate_up_zeros, expert).T
        return silu_and_mul_reference(gate_up) @ dequantized(w_down, down_scales, down_zeros, expert).T

    return by_expert_reference(x.float(), weights.float(), experts, w_gate_up.shape[0], mlp).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton: the shared step (unpack, x in pair order, product with the zero point and scale)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _unpack_pairs(words, pair_mask, BITS: tl.constexpr, HALF_MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                  DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """words [BLOCK_N, BLOCK_K / P] int32 -> [BLOCK_N, BLOCK_K] in DTYPE, each value c + q
    exactly (c = OFFSET), in pair order: position 2j + h of a word's P holds its value j + h P/2.
    pair_mask = the value mask at bits 0 and 16 (a kernel argument: as an immediate, ptxas
    rematerialises it before every LOP3). HALF_MAGIC: the 16-bit magic (0x6400 fp16, 0x4300
    bf16 4-bit), 0 for fp32's."""
    P: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, P // 2) * BITS
    pairs = (words[:, :, None] >> shifts[None, None, :]) & pair_mask          # [BLOCK_N, BLOCK_K / P, P / 2]
    if HALF_MAGIC != 0:
        pairs = pairs | (HALF_MAGIC * 0x10001)
        low = pairs.to(tl.int16).to(DTYPE, bitcast=True)
        high = (pairs >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    else:  # 2^23 + q, less 2^23 - c: exact in fp32, and in DTYPE (|c + q| < 2^8)
        low = ((pairs & 0xFFFF) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 - OFFSET)
        high = ((pairs >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 - OFFSET)
        low, high = low.to(DTYPE), high.to(DTYPE)
    return tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))


@triton.jit
def _pair_order(tile, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr):
    """tile [ROWS, BLOCK_K] in column order -> _unpack_pairs' order (within each P columns,
    position 2j + h takes column j + h P/2): a permutation within registers."""
    split = tl.reshape(tile, (ROWS, BLOCK_K // P, 2, P // 2))
    return tl.reshape(tl.permute(split, (0, 1, 3, 2)), (ROWS, BLOCK_K))


@triton.jit
def _x_tile(x, rows, stride_xm, perm, k0, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr,
            HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):
    """x[rows, k0 + [0, BLOCK_K)] (rows [BLOCK_M] int64; columns through perm when given) in
    pair order, 0 past K."""
    k = k0 + tl.arange(0, BLOCK_K)
    if HAS_PERM:  # gather the permuted columns, their indices put in pair order first
        k = tl.reshape(tl.permute(tl.reshape(k, (BLOCK_K // P, 2, P // 2)), (0, 2, 1)), (BLOCK_K,))
        if EVEN_K:
            columns = tl.load(perm + k)
        else:
            columns = tl.load(perm + k, mask=k < K, other=0)
        return tl.load(x + rows[:, None] * stride_xm + columns[None, :], mask=(k < K)[None, :], other=0.0)
    if EVEN_K:
        tile = tl.load(x + rows[:, None] * stride_xm + k[None, :])
    else:
        tile = tl.load(x + rows[:, None] * stride_xm + k[None, :], mask=(k < K)[None, :], other=0.0)
    return _pair_order(tile, BLOCK_M, BLOCK_K, P)


@triton.jit
def _row_tile(row, k0, K, BLOCK_K: tl.constexpr, P: tl.constexpr, EVEN_K: tl.constexpr):
    """One row's columns k0 + [0, BLOCK_K) (row: its pointer) in pair order, 0 past K, as the
    16 equal rows of an MMA tile [16, BLOCK_K] (loaded once, broadcast in registers)."""
    k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        values = tl.load(row + k)
    else:
        values = tl.load(row + k, mask=k < K, other=0.0)
    return tl.broadcast_to(_pair_order(values[None, :], 1, BLOCK_K, P), (16, BLOCK_K))


@triton.jit
def _group_params(scales, zeros, rows_w, num_groups, k0, group_size, BITS: tl.constexpr, OFFSET: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """The scale and the shift c + z of group k0 // group_size for rows_w [BLOCK_N] -> two
    [BLOCK_N] float32. The K loops ask for a step's pair one step ahead: a row's scale is a
    line of its own, and Triton pipelines only the MMA's operands, so a load at its use would
    stall every step on a DRAM round trip (ncu: among the step's largest stalls, bench/results/
    wna16_floor_ncu-h200.txt)."""
    group = rows_w * num_groups + k0 // group_size
    scale = tl.load(scales + group).to(tl.float32)
    if HAS_ZEROS:
        shift = tl.load(zeros + group).to(tl.float32) + OFFSET
    else:
        shift = tl.full([BLOCK_N], 2 ** (BITS - 1) + OFFSET, tl.float32)
    return scale, shift


@triton.jit
def _step_product(x_tile, qweight, scale, shift, rows_w, words_per_row, k0, pair_mask, BITS: tl.constexpr,
                  HALF_MAGIC: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ZERO_BY_DOT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """One K step: sum over k in [k0, k0 + BLOCK_K) of W[rows_w, k] x[:, k] -> [BLOCK_N, BLOCK_M]
    float32 (y^T's tile), x_tile [BLOCK_M, BLOCK_K] in pair order (0 past K), rows_w [BLOCK_N]
    int64 rows of qweight [.., words_per_row]. The step lies in one group, whose scale and
    shift c + z (_group_params) make the product (dot(c + q, x) - (c + z) sum x) * scale."""
    P: tl.constexpr = 32 // BITS
    word = k0 // P + tl.arange(0, BLOCK_K // P)
    word_ptrs = qweight + rows_w[:, None] * words_per_row + word[None, :]
    if EVEN_K:
        words = tl.load(word_ptrs)
    else:  # past K: value 0 (c + 0 against x = 0)
        words = tl.load(word_ptrs, mask=(word < words_per_row)[None, :], other=0)
    values = _unpack_pairs(words, pair_mask, BITS, HALF_MAGIC, OFFSET, x_tile.dtype, BLOCK_N, BLOCK_K)
    x_t = tl.trans(x_tile)
    if ZERO_BY_DOT:
        ones = tl.full([BLOCK_N, BLOCK_K], 1.0, x_tile.dtype)
        product = tl.dot(values, x_t, input_precision=PRECISION) \
            - shift[:, None] * tl.dot(ones, x_t, input_precision=PRECISION)
    else:
        product = tl.dot(values - shift.to(x_tile.dtype)[:, None], x_t, input_precision=PRECISION)
    return product * scale[:, None]


# ----------------------------------------------------------------------------------------------
# Triton: the linear layer
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "steps_per_split"])
def _wna16_gemm_kernel(x, qweight, scales, zeros, perm, y, partials, arrivals, pair_mask, M, N, K, group_size,
                       num_groups, steps_per_split, stride_xm, stride_ym, BITS: tl.constexpr, HALF_MAGIC: tl.constexpr,
                       OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                       EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                       DEPENDENT_LAUNCH: tl.constexpr):
    """Program (m tile x n tile, K split): acc [BLOCK_N, BLOCK_M] = W[tile rows] x[tile rows]^T
    (y^T: W's rows are the MMA's M side, so that a decode batch padded to 16 rows is its N) over
    the split's K steps [pid_k * steps_per_split, +steps_per_split), each _step_product. Rows
    of W past N and of x past M are clamped to the last row (their products are never stored).

    SPLIT_K > 1 (decode shapes): the program stores its fp32 partial [SPLIT_K, M, N]; the last
    program of a tile to arrive (arrivals.py) adds the partials in split order (deterministic)
    and writes y, as fp8.py's GEMM. Tiles run in groups of GROUP_M m tiles down each n tile
    (the matmul tutorial's order) so that programs in flight share rows in L2.
    DEPENDENT_LAUNCH: before its PDL wait the program asks L2 for its share of W (never written
    by a step), one prefetch per 128-byte line, as linear.py's kernel does."""
    P: tl.constexpr = 32 // BITS
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m_tiles, num_n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n_tiles)) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n_tiles)) % group_rows
    pid_n = (pid % (GROUP_M * num_n_tiles)) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    words_per_row = K // P
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    if DEPENDENT_LAUNCH:
        line_words: tl.constexpr = 32
        for word in range(first * (BLOCK_K // P), tl.minimum(last * (BLOCK_K // P), words_per_row), line_words):
            prefetch_l2(qweight + rows_w * words_per_row + word)
    dependent_prologue(DEPENDENT_LAUNCH)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    scale, shift = _group_params(scales, zeros, rows_w, num_groups, first * BLOCK_K, group_size, BITS, OFFSET,
                                 BLOCK_N, HAS_ZEROS)
    for step in range(first, last):
        k0 = step * BLOCK_K
        ahead = tl.minimum(step + 1, last - 1) * BLOCK_K
        next_scale, next_shift = _group_params(scales, zeros, rows_w, num_groups, ahead, group_size, BITS, OFFSET,
                                               BLOCK_N, HAS_ZEROS)
        x_tile = _x_tile(x, rows_x, stride_xm, perm, k0, K, BLOCK_M, BLOCK_K, P, HAS_PERM, EVEN_K)
        acc += _step_product(x_tile, qweight, scale, shift, rows_w, words_per_row, k0, pair_mask, BITS, HALF_MAGIC,
                             OFFSET, BLOCK_N, BLOCK_K, False, EVEN_K, PRECISION)
        scale, shift = next_scale, next_shift
    tile = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]                 # within one [M, N] partial
    store_split_k(acc, y + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None],
                  (offs_n < N)[:, None] & (offs_m < M)[None, :], partials, tile, M * N, pid_k, arrivals + pid, SPLIT_K)


@triton.jit
def _wna16_dequantize_kernel(qweight, scales, zeros, out, N, K, group_size, num_groups, BITS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Program (n tile, k tile within one group): out[n, k] = (q - zero) * scale in float32,
    stored in out's dtype, columns in order."""
    P: tl.constexpr = 32 // BITS
    rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    word = k0 // P + tl.arange(0, BLOCK_K // P)
    words = tl.load(qweight + rows[:, None] * (K // P) + word[None, :], mask=(word < K // P)[None, :], other=0)
    shifts = tl.arange(0, P) * BITS
    values = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (BLOCK_N, BLOCK_K))
    group = rows * num_groups + k0 // group_size
    if HAS_ZEROS:
        zero = tl.load(zeros + group).to(tl.float32)
    else:
        zero = tl.full([BLOCK_N], 2 ** (BITS - 1), tl.float32)
    weight = (values.to(tl.float32) - zero[:, None]) * tl.load(scales + group).to(tl.float32)[:, None]
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out + rows[:, None] * K + k[None, :], weight.to(out.dtype.element_ty), mask=(k < K)[None, :])


SKINNY_MAX_ROWS = 64       # decode / verify / draft batches: split-K over the SMs
DEQUANT_MIN_ROWS = 1024    # from here: dequantize W, then cuBLAS (module docstring)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _unpack_constants(dtype: torch.dtype, bits: int) -> dict:
    """_unpack_pairs' HALF_MAGIC and OFFSET c for activations of `dtype`: the 16-bit magic where
    the dtype's mantissa holds `bits` bits at exponent 2^mantissa (fp16: 10; bf16: 7, so 4-bit
    only), else fp32's, less 128 for bf16 (q - 128 in [-128, 128): exact in bf16), 0 for fp32."""
    if dtype == torch.float16:
        return dict(HALF_MAGIC=0x6400, OFFSET=1024.0)
    if dtype == torch.bfloat16:
        return dict(HALF_MAGIC=0x4300, OFFSET=128.0) if bits == 4 else dict(HALF_MAGIC=0, OFFSET=-128.0)
    return dict(HALF_MAGIC=0, OFFSET=0.0)


def pair_mask(bits: int) -> int:
    """The value mask at bits 0 and 16 (_unpack_pairs' pair_mask argument)."""
    return ((1 << bits) - 1) * 0x10001


def step_limit(group_size: int, num_columns: int) -> int | None:
    """The largest BLOCK_K whose steps stay within one group (G itself), None for per-channel
    scales (any)."""
    return None if group_size >= num_columns else group_size


def _block_k(wanted: int, group_size: int, num_columns: int) -> int:
    limit = step_limit(group_size, num_columns)
    return wanted if limit is None else min(wanted, limit)


def wna16_config(num_rows: int, num_features: int, num_columns: int, group_size: int,
                 device: torch.device) -> TileConfig:
    """Tiles of _wna16_gemm_kernel (shapes and the SM count only: CUDA graphs replay the
    choice). Skinny batches (<= SKINNY_MAX_ROWS): the batch in one tile of 16..64 rows, K steps
    of 128 (at most G), K split into splits of at least 4 steps (the pipeline's depth) until
      - up to 16 rows where N / 128 tiles fill the SMs: 128 rows of W, ~2 programs per SM,
        4 stages;
      - else 64 rows of W, ~4 programs per SM, 3 stages: the loop is latency-bound (the module
        docstring), and more, smaller programs hide more of it (H200: 15-20% on the 9B's
        narrower projections at 1 and 8 rows, at 32 rows too; bench/results/attempts/
        wna16_mma_v2_tiles-h200.json; the stages: bench/results/wna16_zero_by_dot-h200/).
    Prefill: 128 x 128 tiles (64 rows of x below 128), K steps of 64, 8 warps, 3 stages
    (unmeasured starting points: bench/kernels_wna16.py --sweep times alternatives)."""
    num_steps = lambda block_k: triton.cdiv(num_columns, block_k)  # noqa: E731
    if INTERPRETED:
        block_k = _block_k(32, group_size, num_columns)
        return TileConfig(block_m=16, block_n=16, block_k=block_k, num_splits=split_k_for(num_steps(block_k), 2),
                          num_warps=4, num_stages=1)
    if num_rows <= SKINNY_MAX_ROWS:
        block_m = max(16, triton.next_power_of_2(num_rows))
        wide = num_rows <= 16 and triton.cdiv(num_features, 128) >= num_sms(device)
        block_n, per_sm, stages = (128, 2, 4) if wide else (64, 4, 3)
        block_k = _block_k(128, group_size, num_columns)
        num_tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(num_features, block_n)
        wanted = min(triton.cdiv(per_sm * num_sms(device), num_tiles), max(1, num_steps(block_k) // 4))
        return TileConfig(block_m=block_m, block_n=block_n, block_k=block_k,
                          num_splits=split_k_for(num_steps(block_k), wanted), num_warps=4, num_stages=stages)
    return TileConfig(block_m=128 if num_rows >= 128 else 64, block_n=128,
                      block_k=_block_k(64, group_size, num_columns), num_warps=8, num_stages=3)


def _check_packed(name: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  num_columns: int, group_size: int, bits: int) -> None:
    """qweight [..., N, K // P] int32, scales and zeros [..., N, ceil(K / G)], all contiguous."""
    words = values_per_word(bits)
    _check_group_size(group_size, num_columns, bits)
    groups = (*qweight.shape[:-1], triton.cdiv(num_columns, group_size))
    assert qweight.dtype == torch.int32 and qweight.shape[-1] * words == num_columns and qweight.is_contiguous(), \
        f"{name}: contiguous int32 [..., N, K / {words}] for K = {num_columns}, got {tuple(qweight.shape)}"
    assert scales.shape == groups and scales.dtype in _TL_DTYPES and scales.is_contiguous(), \
        f"{name} scales: contiguous float {groups}, got {tuple(scales.shape)} {scales.dtype}"
    assert zeros is None or (zeros.shape == groups and zeros.dtype == torch.uint8 and zeros.is_contiguous()), \
        f"{name} zeros: None or contiguous uint8 {groups}"
    for tensor in (scales, zeros):
        assert tensor is None or tensor.device == qweight.device, f"{name}: one device"


def _check_wna16_linear_args(x, qweight, scales, zeros, perm, group_size, bits) -> None:
    assert x.dim() == 2 and x.dtype in _TL_DTYPES and x.stride(1) == 1, \
        f"x: float [M, K] with unit column stride, got {tuple(x.shape)} {x.dtype}"
    assert qweight.dim() == 2, f"qweight: [N, K / P], got {tuple(qweight.shape)}"
    _check_packed("qweight", qweight, scales, zeros, x.shape[1], group_size, bits)
    assert perm is None or (perm.shape == (x.shape[1],) and perm.dtype == torch.int32 and perm.is_contiguous()), \
        "perm: None or contiguous int32 [K]"
    assert x.device == qweight.device and (perm is None or perm.device == x.device), "x, weight, perm: one device"


def launch_wna16_gemm(y: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None, perm: torch.Tensor | None, group_size: int, bits: int,
                      config: TileConfig) -> None:
    """y [M, N] = x[:, perm] [M, K] @ W^T through _wna16_gemm_kernel with an explicit config
    (tests, benchmark sweeps): block_k a multiple of P, at least 16, within one group
    (step_limit); num_splits > 1 splits K. Scratch
    is torch.empty and the shared arrival counters: capturable in a CUDA graph."""
    _check_wna16_linear_args(x, qweight, scales, zeros, perm, group_size, bits)
    (num_rows, num_columns), num_features = x.shape, qweight.shape[0]
    assert y.shape == (num_rows, num_features) and y.stride(1) == 1 and y.dtype == x.dtype, f"y {tuple(y.shape)}"
    limit = step_limit(group_size, num_columns)
    assert config.block_k >= 16 and config.block_k % values_per_word(bits) == 0 \
        and (limit is None or limit % config.block_k == 0), \
        f"block_k {config.block_k}: >= 16, whole words, dividing the group of {group_size}"
    if num_rows == 0:
        return
    num_steps = triton.cdiv(num_columns, config.block_k)
    steps_per_split = triton.cdiv(num_steps, config.num_splits)
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(num_features, config.block_n),
            triton.cdiv(num_steps, steps_per_split))
    if grid[1] > 1:
        partials = torch.empty((grid[1], num_rows, num_features), dtype=torch.float32, device=x.device)
        arrivals = arrival_counters(x.device, grid[0])
    else:  # never touched
        partials = arrivals = y
    _wna16_gemm_kernel[grid](
        x, qweight, scales, qweight if zeros is None else zeros, qweight if perm is None else perm, y, partials,
        arrivals, pair_mask(bits), num_rows, num_features, num_columns, group_size, scales.shape[1], steps_per_split,
        x.stride(0), y.stride(0), BITS=bits, **_unpack_constants(x.dtype, bits), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=grid[1], GROUP_M=8, HAS_ZEROS=zeros is not None,
        HAS_PERM=perm is not None, EVEN_K=num_columns % config.block_k == 0,
        PRECISION=dot_precision(x.dtype), **config.launch_options(), **pdl(x.device))


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Triton dequantize_reference of qweight [N, K // P]: W [N, K] in `dtype`."""
    num_features, num_columns = qweight.shape[0], qweight.shape[1] * values_per_word(bits)
    _check_packed("qweight", qweight, scales, zeros, num_columns, group_size, bits)
    out = torch.empty(num_features, num_columns, dtype=dtype, device=qweight.device)
    block_n, block_k = (16, _block_k(32, group_size, num_columns)) if INTERPRETED else \
        (32, _block_k(256, group_size, num_columns))
    _wna16_dequantize_kernel[(triton.cdiv(num_features, block_n), triton.cdiv(num_columns, block_k))](
        qweight, scales, qweight if zeros is None else zeros, out, num_features, num_columns, group_size,
        scales.shape[1], BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k, HAS_ZEROS=zeros is not None, num_warps=4)
    return out


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 perm: torch.Tensor | None, group_size: int, bits: int) -> torch.Tensor:
    """Triton wna16_linear_reference (same arguments; the result up to float32 summation order
    and, in 16-bit x, the rounding of the dequantized W): the packed GEMM below
    DEQUANT_MIN_ROWS rows, W dequantized to x's dtype and cuBLAS from there."""
    _check_wna16_linear_args(x, qweight, scales, zeros, perm, group_size, bits)
    num_rows, num_columns = x.shape
    if num_rows >= DEQUANT_MIN_ROWS:
        weight = dequantize(qweight, scales, zeros, group_size, bits, x.dtype)
        return cublas_linear(x if perm is None else x.index_select(1, perm), weight)
    y = torch.empty(num_rows, qweight.shape[0], dtype=x.dtype, device=x.device)
    config = wna16_config(num_rows, qweight.shape[0], num_columns, group_size, x.device)
    launch_wna16_gemm(y, x, qweight, scales, zeros, perm, group_size, bits, config)
    return y


# ----------------------------------------------------------------------------------------------
# Triton: MoE experts over moe.py's routing (per token, or expert-sorted row blocks)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _gate_up_params(scales, zeros, gate_rows, I, num_groups, k0, group_size, BITS: tl.constexpr,
                    OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """_group_params of the gate rows and of the up rows I below them: (gate scale, gate shift,
    up scale, up shift)."""
    gate_scale, gate_shift = _group_params(scales, zeros, gate_rows, num_groups, k0, group_size, BITS, OFFSET,
                                           BLOCK_N, HAS_ZEROS)
    up_scale, up_shift = _group_params(scales, zeros, gate_rows + I, num_groups, k0, group_size, BITS, OFFSET,
                                       BLOCK_N, HAS_ZEROS)
    return gate_scale, gate_shift, up_scale, up_shift


@triton.jit
def _gate_up_product(x_tile, w, gate_scale, gate_shift, up_scale, up_shift, gate_rows, I, words_per_row, k0,
                     pair_mask, BITS: tl.constexpr, HALF_MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ZERO_BY_DOT: tl.constexpr, EVEN_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """One K step of the gate rows `gate_rows` and of the up rows I below them -> (gate, up)."""
    gate = _step_product(x_tile, w, gate_scale, gate_shift, gate_rows, words_per_row, k0, pair_mask, BITS,
                         HALF_MAGIC, OFFSET, BLOCK_N, BLOCK_K, ZERO_BY_DOT, EVEN_K, PRECISION)
    up = _step_product(x_tile, w, up_scale, up_shift, gate_rows + I, words_per_row, k0, pair_mask, BITS, HALF_MAGIC,
                       OFFSET, BLOCK_N, BLOCK_K, ZERO_BY_DOT, EVEN_K, PRECISION)
    return gate, up


@triton.jit
def _silu_times(gate, up):
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _first_column(tile):
    """tile [BLOCK_N, 16] -> its column 0 [BLOCK_N] (the per-token kernels' 16 equal columns)."""
    return tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :], tile, 0.0), axis=1)


@triton.jit
def _wna16_gate_up_per_pair_kernel(x, experts, w, scales, zeros, act, pair_mask, H, I, E, num_groups, group_size,
                                   TOP_K: tl.constexpr, BITS: tl.constexpr, HALF_MAGIC: tl.constexpr,
                                   OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                   HAS_ZEROS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                                   DEPENDENT_LAUNCH: tl.constexpr):
    """Program (pair, tile of I), pair = token * TOP_K + slot: act[pair, n] = silu(g_n) * u_n,
    g and u the pair's expert's gate and up rows (w viewed as [E * 2I, H / P]) times its token's
    x. The token's row fills the MMA's 16 columns (the tile's minimum); column 0 is kept.
    Nothing for another rank's pair (its act row is never read)."""
    P: tl.constexpr = 32 // BITS
    dependent_prologue(DEPENDENT_LAUNCH)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(experts + pair).to(tl.int64)
    if (expert < 0) | (expert >= E):
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_rows = expert * 2 * I + tl.minimum(n, I - 1)
    x_row = x + (pair // TOP_K) * H
    gate = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    params = _gate_up_params(scales, zeros, gate_rows, I, num_groups, 0, group_size, BITS, OFFSET, BLOCK_N, HAS_ZEROS)
    for k0 in range(0, H, BLOCK_K):
        next_params = _gate_up_params(scales, zeros, gate_rows, I, num_groups, tl.minimum(k0 + BLOCK_K, H - 1),
                                      group_size, BITS, OFFSET, BLOCK_N, HAS_ZEROS)
        x_tile = _row_tile(x_row, k0, H, BLOCK_K, P, EVEN_K)
        gate_step, up_step = _gate_up_product(x_tile, w, *params, gate_rows, I, H // P, k0, pair_mask, BITS,
                                              HALF_MAGIC, OFFSET, BLOCK_N, BLOCK_K, True, EVEN_K, PRECISION)
        gate += gate_step
        up += up_step
        params = next_params
    tl.store(act + pair * I + n, _first_column(_silu_times(gate, up)).to(act.dtype.element_ty), mask=n < I)


@triton.jit
def _wna16_down_per_token_kernel(act, weights, experts, w, scales, zeros, out, pair_mask, H, I, E, num_groups,
                                 group_size, TOP_K: tl.constexpr, BITS: tl.constexpr, HALF_MAGIC: tl.constexpr,
                                 OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 HAS_ZEROS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                                 DEPENDENT_LAUNCH: tl.constexpr):
    """Program (token, tile of H): out[token, n] = sum over its slots j (in order) of
    w[token, j] * (W_down[e_j] act[token * TOP_K + j])_n, fp32 sums over this rank's pairs (w
    viewed as [E * H, I / P]); the act row fills the MMA's 16 columns, column 0 is kept."""
    P: tl.constexpr = 32 // BITS
    dependent_prologue(DEPENDENT_LAUNCH)
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for slot in range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(experts + pair).to(tl.int64)
        if (expert >= 0) & (expert < E):
            rows = expert * H + tl.minimum(n, H - 1)
            acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
            scale, shift = _group_params(scales, zeros, rows, num_groups, 0, group_size, BITS, OFFSET, BLOCK_N,
                                         HAS_ZEROS)
            for k0 in range(0, I, BLOCK_K):
                next_scale, next_shift = _group_params(scales, zeros, rows, num_groups, tl.minimum(k0 + BLOCK_K, I - 1),
                                                       group_size, BITS, OFFSET, BLOCK_N, HAS_ZEROS)
                x_tile = _row_tile(act + pair * I, k0, I, BLOCK_K, P, EVEN_K)
                acc += _step_product(x_tile, w, scale, shift, rows, I // P, k0, pair_mask, BITS, HALF_MAGIC, OFFSET,
                                     BLOCK_N, BLOCK_K, True, EVEN_K, PRECISION)
                scale, shift = next_scale, next_shift
            total += tl.load(weights + pair).to(tl.float32) * acc
    tl.store(out + token * H + n, _first_column(total).to(out.dtype.element_ty), mask=n < H)


@triton.jit(do_not_specialize=["num_m_blocks"])
def _wna16_gate_up_grouped_kernel(x, counts, sorted_pairs, w, scales, zeros, act, pair_mask, H, I, E, num_m_blocks,
                                  num_groups, group_size, TOP_K: tl.constexpr, E_PAD: tl.constexpr, BITS: tl.constexpr,
                                  HALF_MAGIC: tl.constexpr, OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
                                  ZERO_BY_DOT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row block, tile of I), row blocks fastest so an expert's blocks share its weight
    tile in L2: act[position, n] = silu(x W_gate^T) * (x W_up^T) over the block's pairs (rows in
    expert order; moe.py's _gate_up_grouped_kernel on packed weights)."""
    P: tl.constexpr = 32 // BITS
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    expert, position, valid, pair = block_rows(counts, sorted_pairs, m_block, E, E_PAD, BLOCK_M)
    if expert >= E:
        return
    token = (pair // TOP_K).to(tl.int64)
    n = (pid // num_m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_rows = expert.to(tl.int64) * 2 * I + tl.minimum(n, I - 1)
    gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    params = _gate_up_params(scales, zeros, gate_rows, I, num_groups, 0, group_size, BITS, OFFSET, BLOCK_N, HAS_ZEROS)
    for k0 in range(0, H, BLOCK_K):
        next_params = _gate_up_params(scales, zeros, gate_rows, I, num_groups, tl.minimum(k0 + BLOCK_K, H - 1),
                                      group_size, BITS, OFFSET, BLOCK_N, HAS_ZEROS)
        x_tile = _x_tile(x, token, H, x, k0, H, BLOCK_M, BLOCK_K, P, False, EVEN_K)
        gate_step, up_step = _gate_up_product(x_tile, w, *params, gate_rows, I, H // P, k0, pair_mask, BITS,
                                              HALF_MAGIC, OFFSET, BLOCK_N, BLOCK_K, ZERO_BY_DOT, EVEN_K, PRECISION)
        gate += gate_step
        up += up_step
        params = next_params
    tl.store(act + position[None, :].to(tl.int64) * I + n[:, None], _silu_times(gate, up).to(act.dtype.element_ty),
             mask=valid[None, :] & (n < I)[:, None])


@triton.jit(do_not_specialize=["num_m_blocks"])
def _wna16_down_grouped_kernel(act, counts, sorted_pairs, weights, w, scales, zeros, out_pairs, pair_mask, H, I, E,
                               num_m_blocks, num_groups, group_size, E_PAD: tl.constexpr, BITS: tl.constexpr,
                               HALF_MAGIC: tl.constexpr, OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
                               ZERO_BY_DOT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row block, tile of H): out_pairs[pair, n] = w[pair] * (act W_down^T)[row, n]."""
    P: tl.constexpr = 32 // BITS
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    expert, position, valid, pair = block_rows(counts, sorted_pairs, m_block, E, E_PAD, BLOCK_M)
    if expert >= E:
        return
    n = (pid // num_m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = expert.to(tl.int64) * H + tl.minimum(n, H - 1)
    act_rows = tl.where(valid, position, 0).to(tl.int64)     # padding rows: any written row, never stored
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    scale, shift = _group_params(scales, zeros, rows, num_groups, 0, group_size, BITS, OFFSET, BLOCK_N, HAS_ZEROS)
    for k0 in range(0, I, BLOCK_K):
        next_scale, next_shift = _group_params(scales, zeros, rows, num_groups, tl.minimum(k0 + BLOCK_K, I - 1),
                                               group_size, BITS, OFFSET, BLOCK_N, HAS_ZEROS)
        x_tile = _x_tile(act, act_rows, I, act, k0, I, BLOCK_M, BLOCK_K, P, False, EVEN_K)
        acc += _step_product(x_tile, w, scale, shift, rows, I // P, k0, pair_mask, BITS, HALF_MAGIC, OFFSET, BLOCK_N,
                             BLOCK_K, ZERO_BY_DOT, EVEN_K, PRECISION)
        scale, shift = next_scale, next_shift
    store_weighted_pairs(out_pairs, tl.trans(acc), weights, pair, valid, n, n < H, H)


# Tiles of the per-token path: gate/up programs cover block_n rows of I (and of the up half),
# down programs block_n rows of H; K steps of block_k (at most G). Small tiles for many
# programs in flight, as moe.py's (16 rows: the MMA's minimum), one warp each: ptxas gives the
# one-warp gate/up loop ~2.3 instructions a weight value, two or four warps on 16 rows twice
# that. Unmeasured starting points (bench/kernels_wna16.py --sweep).
PER_TOKEN_GATE_UP = TileConfig(block_n=16, block_k=128, num_warps=1, num_stages=4)
PER_TOKEN_DOWN = TileConfig(block_n=16, block_k=128, num_warps=1, num_stages=4)


def wna16_moe_config(num_pairs: int, num_experts: int, group_size: int, hidden: int, inter: int) -> TileConfig:
    """Tiles of the grouped path: moe.grouped_config's block_m (pairs per row block) by pairs per
    expert, capped at 64 (gate/up keep two accumulators), 64 rows of W, K steps of 128 (64 from
    64-row blocks; at most G) where both GEMMs' groups allow. Unmeasured starting points."""
    if INTERPRETED:
        return TileConfig(block_m=16, block_n=16, block_k=_moe_block_k(32, group_size, hidden, inter), num_warps=4,
                          num_stages=1)
    block_m = min(64, grouped_config(num_pairs, num_experts).block_m)
    block_k = _moe_block_k(64 if block_m >= 64 else 128, group_size, hidden, inter)
    return TileConfig(block_m=block_m, block_n=64, block_k=block_k, num_warps=4, num_stages=3)


def _moe_block_k(wanted: int, group_size: int, hidden: int, inter: int) -> int:
    """A K step within one group of both GEMMs (K = H for gate/up, I for down)."""
    return min(_block_k(wanted, group_size, hidden), _block_k(wanted, group_size, inter))


def _check_wna16_moe_args(x, weights, experts, w_gate_up, gate_up_scales, gate_up_zeros, w_down, down_scales,
                          down_zeros, group_size, bits) -> None:
    num_tokens, hidden = x.shape
    words = values_per_word(bits)
    assert w_gate_up.dim() == 3 and w_down.dim() == 3, "w_gate_up, w_down: [E, rows, K / P]"
    num_experts, two_inter = w_gate_up.shape[:2]
    inter = two_inter // 2
    assert two_inter % 2 == 0 and w_down.shape == (num_experts, hidden, inter // words), \
        f"w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)} for H = {hidden}"
    _check_packed("w_gate_up", w_gate_up, gate_up_scales, gate_up_zeros, hidden,
                  hidden if group_size >= hidden else group_size, bits)
    _check_packed("w_down", w_down, down_scales, down_zeros, inter, inter if group_size >= inter else group_size,
                  bits)
    assert (gate_up_zeros is None) == (down_zeros is None), "zeros: for both GEMMs or neither"
    assert experts.dim() == 2 and experts.shape[0] == num_tokens and weights.shape == experts.shape, \
        "weights, experts: [T, k]"
    assert experts.dtype in (torch.int64, torch.int32), f"experts: dtype {experts.dtype}"
    assert x.dtype in _TL_DTYPES, f"x: dtype {x.dtype}"
    for name, t in (("x", x), ("weights", weights), ("experts", experts)):
        assert t.is_contiguous(), f"{name} must be contiguous"
    for t in (weights, experts, w_gate_up, w_down):
        assert t.device == x.device, f"one device: {t.device}, x on {x.device}"


def _moe_constants(x: torch.Tensor, zeros: torch.Tensor | None, bits: int, block_k: int, hidden: int,
                   inter: int) -> dict:
    return dict(BITS=bits, **_unpack_constants(x.dtype, bits), BLOCK_K=block_k, HAS_ZEROS=zeros is not None,
                EVEN_K=hidden % block_k == 0 and inter % block_k == 0, PRECISION=dot_precision(x.dtype))


def wna16_moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                      gate_up_scales: torch.Tensor, gate_up_zeros: torch.Tensor | None, w_down: torch.Tensor,
                      down_scales: torch.Tensor, down_zeros: torch.Tensor | None, group_size: int,
                      bits: int) -> torch.Tensor:
    """Triton wna16_moe_experts_reference (same arguments; the result up to float32 summation
    order and the activation's rounding to x's dtype between the GEMMs): moe.py's per-token path
    for decode-sized batches (its rule), the grouped path otherwise."""
    args = (x, weights, experts, w_gate_up, gate_up_scales, gate_up_zeros, w_down, down_scales, down_zeros,
            group_size, bits)
    if use_per_token_path(experts.numel(), w_gate_up.shape[0]):
        return wna16_moe_experts_per_token(*args)
    return wna16_moe_experts_grouped(*args)


def wna16_moe_experts_per_token(x, weights, experts, w_gate_up, gate_up_scales, gate_up_zeros, w_down, down_scales,
                                down_zeros, group_size, bits, gate_up_config: TileConfig = PER_TOKEN_GATE_UP,
                                down_config: TileConfig = PER_TOKEN_DOWN) -> torch.Tensor:
    """The per-token path (any batch; meant for decode), with the tiles of its two kernels."""
    _check_wna16_moe_args(x, weights, experts, w_gate_up, gate_up_scales, gate_up_zeros, w_down, down_scales,
                          down_zeros, group_size, bits)
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = w_gate_up.shape[0], experts.shape[1], w_gate_up.shape[1] // 2
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    zeros_args = (_or_placeholder(gate_up_zeros, w_gate_up), _or_placeholder(down_zeros, w_down))
    gate_up_k, down_k = (_moe_block_k(32 if INTERPRETED else config.block_k, group_size, hidden, inter)
                         for config in (gate_up_config, down_config))
    _wna16_gate_up_per_pair_kernel[(num_tokens * top_k, triton.cdiv(inter, gate_up_config.block_n))](
        x, experts, w_gate_up, gate_up_scales, zeros_args[0], act, pair_mask(bits), hidden, inter, num_experts,
        gate_up_scales.shape[-1], min(group_size, hidden), TOP_K=top_k, BLOCK_N=gate_up_config.block_n,
        **_moe_constants(x, gate_up_zeros, bits, gate_up_k, hidden, inter), **gate_up_config.launch_options(),
        **pdl(x.device))
    _wna16_down_per_token_kernel[(num_tokens, triton.cdiv(hidden, down_config.block_n))](
        act, weights, experts, w_down, down_scales, zeros_args[1], out, pair_mask(bits), hidden, inter, num_experts,
        down_scales.shape[-1], min(group_size, inter), TOP_K=top_k, BLOCK_N=down_config.block_n,
        **_moe_constants(x, down_zeros, bits, down_k, hidden, inter), **down_config.launch_options(), **pdl(x.device))
    return out


def _or_placeholder(zeros: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A kernel's zeros argument: the tensor, or one it never reads."""
    return placeholder if zeros is None else zeros


def wna16_moe_experts_grouped(x, weights, experts, w_gate_up, gate_up_scales, gate_up_zeros, w_down, down_scales,
                              down_zeros, group_size, bits, config: TileConfig | None = None) -> torch.Tensor:
    """The grouped path (any batch; meant for prefill and large batches), over moe.py's
    expert-sorted row blocks; the zero point by MMA for blocks of at most 32 rows."""
    _check_wna16_moe_args(x, weights, experts, w_gate_up, gate_up_scales, gate_up_zeros, w_down, down_scales,
                          down_zeros, group_size, bits)
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = w_gate_up.shape[0], experts.shape[1], w_gate_up.shape[1] // 2
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    config = config or wna16_moe_config(num_pairs, num_experts, group_size, hidden, inter)
    pairs = sort_pairs(experts, num_experts, config.block_m)
    common = dict(E_PAD=pairs.e_pad, BLOCK_M=config.block_m, BLOCK_N=config.block_n, ZERO_BY_DOT=config.block_m <= 32,
                  **_moe_constants(x, gate_up_zeros, bits, config.block_k, hidden, inter), **config.launch_options())
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)                 # rows in expert order
    _wna16_gate_up_grouped_kernel[(pairs.num_m_blocks * triton.cdiv(inter, config.block_n),)](
        x, pairs.counts, pairs.sorted_pairs, w_gate_up, gate_up_scales, _or_placeholder(gate_up_zeros, w_gate_up), act,
        pair_mask(bits), hidden, inter, num_experts, pairs.num_m_blocks, gate_up_scales.shape[-1],
        min(group_size, hidden), TOP_K=top_k, **common)
    out_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)            # rows by pair
    _wna16_down_grouped_kernel[(pairs.num_m_blocks * triton.cdiv(hidden, config.block_n),)](
        act, pairs.counts, pairs.sorted_pairs, weights, w_down, down_scales, _or_placeholder(down_zeros, w_down),
        out_pairs, pair_mask(bits), hidden, inter, num_experts, pairs.num_m_blocks, down_scales.shape[-1],
        min(group_size, inter), **common)
    sum_slots(out_pairs, experts, num_experts, out)
    return out
