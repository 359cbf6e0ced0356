"""Skinny GEMM for decode and verify batches: y[M, N] = x[M, K] @ W[N, K]^T with M <= 64, and the
block ops around a projection fused into its epilogue. Two forms: the MMA form (below) for 2-64
rows, and the one-row form (_gemv_kernel) for a single row.

At such M a projection only streams its weight, so its time is W's bytes over the memory
bandwidth plus fixed latency. cuBLAS tiles along N only for these shapes (H100: a 64x8 tile),
so a projection whose output is the hidden size (N = 1024) runs 16 CTAs on 132 SMs (and the
down projection adds a split-K reduce launch). This kernel splits K as well, so the grid fills
the SMs whatever N is, and sums the split-K partials in the same launch: every program stores
its fp32 partial tile, and the last program of an N tile to arrive (arrivals.py) adds the
tile's partials in split order (deterministic, whichever program is last) and writes y. No
fp32 output to memset, no reduce or cast launch; scratch is one torch.empty per call, so the
call can be captured in a CUDA graph.

Up to 16 rows it beats cuBLAS at N = 1024 and N = 4096 (measured:
bench/results/kernels_linear-h100.json). What it pays beyond streaming W is the split-K tail:
partial stores made visible, the counter atomic and the partial loads, three dependent L2 round
trips (H100 breakdown in commit 8b76c27).

Fusions (keyword options of `linear`, each a constexpr of the kernel), for a decoder block whose
residual stream is materialised (engine/models/layers.py, DecoderLayer.forward_stream):
  norm_eps   x is the residual stream and the projection reads it RMS-normalised: the norm's
             weight is folded into W's columns at load time, so the main loop streams W and the
             raw x as ever, also summing x^2 per row; the epilogue scales row m by
             rsqrt(mean(x_m^2) + eps) (per split, then summed by the last arriver).
  glu        W is [gate; up] (2I rows): a program's tile takes BLOCK_N / 2 rows of each for the
             same output columns and stores silu(gate) * up [M, I].
  residual   y = residual + x W^T, stored into the residual stream itself.
  conv       (a ConvDecode, conv1d.py) the GDN's decode conv of y's first C columns (its q|k|v
             channels): the program of an N tile holding conv channels, having stored y, runs
             conv1d.py's conv_decode_tile over the batch's rows for its columns (the conv is
             depthwise, so a tile's channels need no other tile's), in place of the conv launch.
             Its rows run one after another, so `linear` fuses it up to CONV_EPILOGUE_MAX_ROWS
             rows and launches the conv kernel after the GEMM above.
  rope_kv    (one-row form; a rope.QKNormRopeKV) the gated attention's q/k norm, RoPE and KV
             write of y: the last program of a query or key head to arrive (arrivals.py)
             normalises and rotates the head, a value tile's program copies it into the pool,
             in place of qk_norm_rope_kv's launch after the projection.
Each changes what the last store does (and what the loop adds to a register), never how W
streams: fusing into the loop's x operand (a computed tile) halved the weight stream's rate
(bench/results/attempts/fused_block_ops).

The one-row form (a decode step of one sequence, a draft of one): each program holds its whole
share of W, a few rows by all of K, in registers, loaded before its PDL wait, so a projection's
weight read overlaps the kernel before it; after the wait it reads x, sums the products and runs
the same epilogue. Tiles are small enough that N alone fills the SMs: no split-K and no tail. x
is one row, so computing it in the kernel is cheap here: the GDN's gated norm (gated_norm, a
norms.GatedNorm) runs in every program of its out_proj in place of its own launch.

`linear` is the entry point (the `Ops.linear` of the GPU table): the one-row form for one row
where gemv_config fits a row of W; the MMA form where `use_kernel` says it beats cuBLAS, or ties
it and saves launches by fusing; elsewhere cuBLAS (prefill, wide N, more than 16 rows at larger
N; rows padded to a bucket outside graph capture, `cublas_linear`) with the fusions as the
separate kernels they replace.
`launch_linear` and `launch_gemv` run the forms with an explicit config (tests, the tuning sweep
of bench/kernels_linear.py); `linear_reference` is the torch oracle. Knows nothing about which
projection it computes.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_and_mul, silu_and_mul_reference
from .arrivals import arrival_counters, last_to_arrive, reset_arrivals
from .attention import to_kv
from .conv1d import (ConvDecode, causal_conv1d_decode, causal_conv1d_decode_reference, check_conv_decode_args,
                     conv_decode_tile, decode_tile_constants)
from .device import INTERPRETED, num_sms
from .launch import dependent_prologue, dot_precision, pdl, prefetch_l2
from .norms import GatedNorm, gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference
from .rope import (QKNormRopeKV, check_qk_norm_rope_kv_args, norm_rope_head, pool_offset, qk_norm_rope_kv,
                   qk_norm_rope_kv_reference, rope_factors)
from .tiles import TileConfig

MAX_ROWS = 64               # the kernel's limit (x is padded to a power of two >= 16 rows)
KERNEL_MAX_ROWS = 32        # use_kernel never picks the kernel for more rows
# The conv epilogue's rows are serial in each tile's program: a 0.8B step at 1 row (1 or 4 tokens)
# read 0.98 / 0.99x with it, at 8 rows 1.05 / 1.08x, at 32 rows 1.19x (H100, d7c891a against
# 03dacec: bench/results/conv_epilogue-h100.json).
CONV_EPILOGUE_MAX_ROWS = 1
# The one-row form (_gemv_kernel): W bytes a program holds in registers (padded K included), and
# its warps. A chain of the 0.8B's 96 projections at 1 row: 8-32 KB programs of 4 or 8 warps
# 467-514 us, 64 KB ones 530-558 us, the MMA form 613 us (H100: bench/results/gemv-h100.json).
GEMV_PROGRAM_BYTES = 16 << 10
GEMV_WARPS = 4
# A row of W wider than GEMV_PROGRAM_BYTES (the 9B's down projection: 12288 bf16, 32 KB padded)
# still takes the one-row form up to this width, one row a program, its warps grown with the row
# so that a thread holds what it holds in a GEMV_PROGRAM_BYTES program; wider rows (64 KB
# programs were slower on the 0.8B's chain, above) take the MMA form.
GEMV_ROW_BYTES = 32 << 10


def linear_reference(x: torch.Tensor, weight: torch.Tensor, *, norm_eps: float | None = None, glu: bool = False,
                     residual: torch.Tensor | None = None, conv: ConvDecode | None = None,
                     gated_norm: GatedNorm | None = None, rope_kv: QKNormRopeKV | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, with the block ops the kernel fuses, as
    the separate ops they replace: norm_eps: x RMS-normalised first (unit weight: the norm's
    weight is folded into W); gated_norm: x gated-RMS-normalised by heads first (not with
    norm_eps); glu: W = [gate; up] and the result silu(gate) * up [M, N / 2]; residual: the
    result added into `residual` [M, N] (in place), which is returned; conv: the decode conv of
    the result's first conv.weight.shape[0] columns, into conv.out and conv.pending_out (neither
    glu nor residual with it); rope_kv: the gated attention's q/k norm, RoPE and KV write of the
    result (rope.py QKNormRopeKV; none of glu, residual and conv with it); out (no fusion): the
    result written into out [M, N] of x's dtype or float32 (rounded to x's dtype, then widened:
    y.float()), which is returned."""
    if out is not None:
        assert norm_eps is None and not glu and all(op is None for op in (residual, conv, gated_norm, rope_kv)), \
            "linear: out takes no fused ops"
        return out.copy_(F.linear(x, weight))
    if gated_norm is not None:
        x = _by_heads(gated_rms_norm_reference, x, gated_norm)
    if norm_eps is not None:
        x, _ = rms_norm_reference(x, None, norm_eps)
    y = F.linear(x, weight)
    if glu:
        y = silu_and_mul_reference(y)
    if conv is not None:
        causal_conv1d_decode_reference(y[:, :conv.weight.shape[0]], *conv)
    if rope_kv is not None:
        qk_norm_rope_kv_reference(y, rope_kv)
    return y if residual is None else residual.add_(y)


def _by_heads(norm, x: torch.Tensor, gated_norm: GatedNorm) -> torch.Tensor:
    """norm (gated_rms_norm or its reference) of x [M, H * D] by heads, as [M, H * D]."""
    gate, weight, eps = gated_norm
    heads = (x.shape[0], -1, weight.shape[0])
    return norm(x.view(heads), gate.view(heads), weight, eps).reshape(x.shape)


# M (and the conv's rows) vary with the batch: not compile-time (one binary serves a BLOCK_M).
@triton.jit(do_not_specialize=["M", "eps", "conv_rows"])
def _linear_kernel(x, w, y, residual, partials, row_sq, arrivals, M, N, K, k_per_split, eps,
                   stride_xm, stride_wn, stride_ym, stride_rm,
                   conv_weight, conv_out, conv_pending_out, cu_seqlens, slot_ids, conv_state, pending_conv,
                   pending_counts, conv_rows, stride_conv_out,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
                   RESIDUAL: tl.constexpr, LINE: tl.constexpr, CONV: tl.constexpr,
                   C: tl.constexpr, WIDTH: tl.constexpr, P: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
                   BN: tl.constexpr, COMMIT: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (N tile pid_n, K split pid_k): acc[BLOCK_N, BLOCK_M] = W[tile rows, k split] @ x[:, k split]^T,
    i.e. y^T, so that the wide side (W's rows) is the MMA's M and the padded batch (>= 16 rows
    for tl.dot) its N. K splits are k_per_split long (a multiple of BLOCK_K); the last may be
    short or empty. Rows of W past N and of x past M are clamped to the last row instead of
    masked, so the loads along K stay unpredicated 16-byte vectors; their products land in
    columns that are never stored. N is y's width: with GLU, W has 2N rows and tile pid_n reads
    rows pid_n * BLOCK_N / 2 + [0, BLOCK_N / 2) of the gate half and the same of the up half.

    SPLIT_K > 1: partials [SPLIT_K, M, grid_n * BLOCK_N] fp32 (scratch, by tile row), row_sq
    [grid_n, SPLIT_K, BLOCK_M] fp32 (NORM: each split's sum of x^2); arrivals[pid_n] counts the
    tile's programs in. The last one sums the partials in split order and finishes the tile
    (_finish_tile). The sum is unrolled so that its SPLIT_K loads are in flight together: that
    tail is one L2 round trip, not SPLIT_K of them (a loop was slower; H100 A/B in commit 8b76c27).
    LINE: W's elements per 128-byte line (at most BLOCK_K), the stride of the L2 prefetch.
    CONV: the program that stores a tile then runs the conv of its columns (conv_epilogue; the
    conv_* arguments, conv_rows rows, and C .. COMMIT are conv1d.py's conv_decode_tile's)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_N)  # the tile's rows of W
    rows_w = _tile_rows(pid_n, offs_r, N, BLOCK_N, GLU)
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if DEPENDENT_LAUNCH:
        # W is never written by a step: stream the program's [BLOCK_N, k split] share of it into
        # L2 while the predecessor kernel still runs (launch.py), one prefetch per 128-byte line.
        # Past K (a ragged last step) the offsets clamp to W's last column: never a line outside W.
        line_starts = tl.arange(0, BLOCK_K // LINE) * LINE
        for k in range(k_start, k_end, BLOCK_K):
            prefetch_l2(w + rows_w[:, None] * stride_wn + tl.minimum(k + line_starts, K - 1)[None, :])
    dependent_prologue(DEPENDENT_LAUNCH)
    w_ptrs = w + rows_w[:, None] * stride_wn + (k_start + offs_k)[None, :]     # [BLOCK_N, BLOCK_K]
    x_ptrs = x + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]     # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)  # NORM: sum of x^2 over the split, per row
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w_tile = tl.load(w_ptrs)
            x_tile = tl.load(x_ptrs)
        else:  # zero both sides past K: garbage there may be inf or NaN
            in_k = (k + offs_k) < K
            w_tile = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
            x_tile = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
        acc = tl.dot(w_tile, tl.trans(x_tile), acc, input_precision=PRECISION)
        if NORM:
            x_values = x_tile.to(tl.float32)
            sq += tl.sum(x_values * x_values, axis=1)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    if SPLIT_K == 1:
        _finish_tile(acc, sq, y, residual, pid_n, offs_m, offs_r, M, N, K, eps, stride_ym, stride_rm,
                     x.dtype.element_ty, BLOCK_M, BLOCK_N, NORM, GLU, RESIDUAL)
        if CONV:
            conv_epilogue(y, stride_ym, pid_n * BLOCK_N, conv_weight, conv_out, conv_pending_out,
                          cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts, conv_rows, stride_conv_out,
                          C, WIDTH, P, BW, BT, BN, BLOCK_N, COMMIT)
    else:
        width = tl.num_programs(0) * BLOCK_N
        tile = offs_m[None, :].to(tl.int64) * width + (pid_n * BLOCK_N + offs_r)[:, None]  # within one partial
        real_rows = (offs_m < M)[None, :]
        tl.store(partials + pid_k.to(tl.int64) * M * width + tile, acc, mask=real_rows)
        sq_ptrs = row_sq + pid_n * SPLIT_K * BLOCK_M + offs_m
        if NORM:
            tl.store(sq_ptrs + pid_k * BLOCK_M, sq)
        if last_to_arrive(arrivals + pid_n, SPLIT_K):
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            total_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other SMs' stores are, never a stale L1 line
                total += tl.load(partials + s * M * width + tile, mask=real_rows, other=0.0, cache_modifier=".cg")
                if NORM:
                    total_sq += tl.load(sq_ptrs + s * BLOCK_M, cache_modifier=".cg")
            _finish_tile(total, total_sq, y, residual, pid_n, offs_m, offs_r, M, N, K, eps, stride_ym, stride_rm,
                         x.dtype.element_ty, BLOCK_M, BLOCK_N, NORM, GLU, RESIDUAL)
            reset_arrivals(arrivals + pid_n)
            if CONV:
                conv_epilogue(y, stride_ym, pid_n * BLOCK_N, conv_weight, conv_out, conv_pending_out,
                              cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts, conv_rows,
                              stride_conv_out, C, WIDTH, P, BW, BT, BN, BLOCK_N, COMMIT)


@triton.jit
def _tile_rows(pid_n, offs_r, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """W's rows [BLOCK_N] (int64) of N tile pid_n, clamped to the last row: with GLU the first
    half of the tile's rows from the gate half of W, the second from the up half (same columns)."""
    if GLU:
        half = BLOCK_N // 2
        rows_w = tl.minimum(pid_n * half + offs_r % half, N - 1) + tl.where(offs_r < half, 0, N)
    else:
        rows_w = tl.minimum(pid_n * BLOCK_N + offs_r, N - 1)
    return rows_w.to(tl.int64)


@triton.jit(do_not_specialize=["eps"])
def _gemv_kernel(x, w, y, residual, gate, norm_weight, N, K, eps, stride_wn, stride_ym, stride_rm,
                 conv_weight, conv_out, conv_pending_out, cu_seqlens, slot_ids, conv_state, pending_conv,
                 pending_counts, stride_conv_out,
                 arrivals, q_weight, k_weight, q_out, positions, inv_freq, k_cache, v_cache, slot_mapping,
                 stride_block, stride_offset, stride_head, rope_eps, attention_factor,
                 BLOCK_N: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, HEAD: tl.constexpr, GLU: tl.constexpr,
                 RESIDUAL: tl.constexpr, CONV: tl.constexpr,
                 C: tl.constexpr, WIDTH: tl.constexpr, P: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
                 BN: tl.constexpr, COMMIT: tl.constexpr, ROPE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                 D: tl.constexpr, R: tl.constexpr, BLOCK_SIZE: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """The one-row form: program pid_n computes y[0, tile] = W[tile rows, :] . x[0, :] with the
    whole of its [BLOCK_N, K] share of W in registers (K padded to KP, a power of two), loaded
    before the PDL wait: W is never written by a step, so the program's weight read overlaps the
    predecessor kernel and, after the wait, only x (K elements, from L2), the products' sums
    and the epilogue remain. No split-K, hence no partials and no arrival tail: BLOCK_N is small
    enough (gemv_config) that the N tiles alone fill the SMs. The epilogue (_finish_tile, then
    the conv) is the MMA form's, on a one-row tile.
    HEAD > 0: x is gated-RMS-normalised by heads of HEAD columns first (norms.py
    gated_rms_norm: gate's row and the norm's weight norm_weight [HEAD], eps), rounded to x's
    dtype as that kernel stores it: every program normalises the whole row (K values) itself, in
    place of the norm's launch.
    ROPE: the gated attention's QKNormRopeKV of y (rope.py; the arrivals .. attention_factor
    arguments, HQ query and HKV KV heads of D, R rotary channels, pool blocks of BLOCK_SIZE) in
    place of its launch (_rope_kv_epilogue)."""
    pid_n = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK_N)
    rows_w = _tile_rows(pid_n, offs_r, N, BLOCK_N, GLU)
    offs_k = tl.arange(0, KP)
    in_k = (offs_k < K)[None, :]
    w_tile = tl.load(w + rows_w[:, None] * stride_wn + offs_k[None, :], mask=in_k, other=0.0)  # [BLOCK_N, KP]
    dependent_prologue(DEPENDENT_LAUNCH)
    offs_m = tl.arange(0, 1)
    x_row = tl.load(x + offs_k[None, :], mask=in_k, other=0.0).to(tl.float32)                       # [1, KP]
    if HEAD > 0:
        heads = tl.reshape(x_row, (KP // HEAD, HEAD))
        rstd = tl.rsqrt(tl.sum(heads * heads, axis=1) / HEAD + eps)   # padded heads: 0 * rsqrt(eps)
        z = tl.load(gate + offs_k[None, :], mask=in_k, other=0.0).to(tl.float32)
        scale = tl.load(norm_weight + offs_k % HEAD).to(tl.float32)[None, :]
        x_row = tl.reshape(heads * rstd[:, None], (1, KP)) * scale * (z * tl.sigmoid(z))
        x_row = x_row.to(x.dtype.element_ty).to(tl.float32)
    acc = tl.sum(w_tile.to(tl.float32) * x_row, axis=1)[:, None]                                     # [BLOCK_N, 1]
    sq = tl.sum(x_row * x_row, axis=1)                                                                # [1]
    _finish_tile(acc, sq, y, residual, pid_n, offs_m, offs_r, 1, N, K, eps, stride_ym, stride_rm,
                 x.dtype.element_ty, 1, BLOCK_N, NORM, GLU, RESIDUAL)
    if CONV:
        conv_epilogue(y, stride_ym, pid_n * BLOCK_N, conv_weight, conv_out, conv_pending_out, cu_seqlens, slot_ids,
                      conv_state, pending_conv, pending_counts, 1, stride_conv_out,
                      C, WIDTH, P, BW, BT, BN, BLOCK_N, COMMIT)
    if ROPE:
        _rope_kv_epilogue(y, pid_n * BLOCK_N, arrivals, q_weight, k_weight, q_out, positions, inv_freq, k_cache,
                          v_cache, slot_mapping, stride_block, stride_offset, stride_head, rope_eps, attention_factor,
                          HQ, HKV, D, R, BLOCK_SIZE, BLOCK_N)


@triton.jit
def _rope_kv_epilogue(y, first_col, arrivals, q_weight, k_weight, q_out, positions, inv_freq, k_cache, v_cache,
                      slot_mapping, stride_block, stride_offset, stride_head, eps, attention_factor,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """QKNormRopeKV (rope.py) of y's one row, by the program that stored its columns first_col +
    [0, BLOCK_N), which lie in one head (BLOCK_N divides D). A query or key head spans D / BLOCK_N
    programs: each counts in at arrivals[head], and the last to arrive, seeing the others' stores,
    normalises and rotates the head from y into q_out or the key pool. A value tile's program
    copies its own columns into the value pool. Gate columns need nothing."""
    QUERIES: tl.constexpr = 2 * HQ * D
    if first_col < QUERIES:
        head = first_col // (2 * D)
        if first_col % (2 * D) < D:
            if last_to_arrive(arrivals + head, D // BLOCK_N):
                partner, cos, sin = rope_factors(positions, 0, inv_freq, attention_factor, R, D, 0, 0, 0)
                norm_rope_head(y + head * 2 * D, q_weight, q_out + head * D, partner, cos, sin, eps, D, D)
                reset_arrivals(arrivals + head)
    elif first_col < QUERIES + HKV * D:
        kv_head = (first_col - QUERIES) // D
        if last_to_arrive(arrivals + HQ + kv_head, D // BLOCK_N):
            partner, cos, sin = rope_factors(positions, 0, inv_freq, attention_factor, R, D, 0, 0, 0)
            at = pool_offset(slot_mapping, 0, kv_head, stride_block, stride_offset, stride_head, BLOCK_SIZE)
            norm_rope_head(y + QUERIES + kv_head * D, k_weight, k_cache + at, partner, cos, sin, eps, D, D)
            reset_arrivals(arrivals + HQ + kv_head)
    else:
        column = first_col - QUERIES - HKV * D
        at = pool_offset(slot_mapping, 0, column // D, stride_block, stride_offset, stride_head, BLOCK_SIZE)
        cols = tl.arange(0, BLOCK_N)
        tl.debug_barrier()  # every thread's y stores before any thread reads them back (bar.sync orders them)
        value = tl.load(y + first_col + cols)
        tl.store(v_cache + at + column % D + cols, to_kv(value, v_cache))


@triton.jit
def conv_epilogue(y, stride_ym, first_col, conv_weight, conv_out, conv_pending_out, cu_seqlens, slot_ids,
                  conv_state, pending_conv, pending_counts, conv_rows, stride_conv_out,
                  C: tl.constexpr, WIDTH: tl.constexpr, P: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
                  BN: tl.constexpr, BLOCK_N: tl.constexpr, COMMIT: tl.constexpr):
    """The decode conv of y's columns first_col + [0, BLOCK_N) that are conv channels (< C), row
    by row, reading the y tile this program has just stored (every row of it: the batch is one
    tile)."""
    cols = first_col + tl.arange(0, BLOCK_N)
    if first_col < C:
        tl.debug_barrier()  # every thread's y stores before any thread's conv reads (bar.sync orders them)
        for row in range(conv_rows):
            conv_decode_tile(y, conv_weight, conv_out, conv_pending_out, cu_seqlens, slot_ids, conv_state, pending_conv,
                             pending_counts, stride_ym, stride_conv_out, row, cols, cols < C,
                             C, WIDTH, P, BW, BT, BN, BLOCK_N, COMMIT)


@triton.jit
def _finish_tile(acc, sq, y, residual, pid_n, offs_m, offs_r, M, N, K, eps, stride_ym, stride_rm,
                 value_ty: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
                 GLU: tl.constexpr, RESIDUAL: tl.constexpr):
    """Store a tile's sums acc [BLOCK_N, BLOCK_M] (y^T) with the fused ops, in the order the
    separate ops would run: the norm's 1 / rms of each x row (sq: its sum of squares over K),
    the projection's output rounded to value_ty (x's dtype), silu(gate) * up rounded again, the
    residual added in fp32 and rounded once; stored as y's dtype (wider than value_ty only
    without fusions: a float32 copy of the rounded product, the logits a sampler reads)."""
    if NORM:
        acc = acc * tl.rsqrt(sq / K + eps)[None, :]
    out = acc.to(value_ty)
    if GLU:
        half = tl.permute(tl.reshape(out.to(tl.float32), (2, BLOCK_N // 2, BLOCK_M)), (1, 2, 0))
        gate, up = tl.split(half)                                    # [BLOCK_N / 2, BLOCK_M] each
        out = (gate * tl.sigmoid(gate) * up).to(value_ty)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        cols = pid_n * BLOCK_N + offs_r
    mask = (cols < N)[:, None] & (offs_m < M)[None, :]
    rows = offs_m[None, :].to(tl.int64)
    if RESIDUAL:
        stream = tl.load(residual + rows * stride_rm + cols[:, None], mask=mask, other=0.0)
        out = (out.to(tl.float32) + stream.to(tl.float32)).to(value_ty)
    tl.store(y + rows * stride_ym + cols[:, None], out.to(y.dtype.element_ty), mask=mask)


def block_m(num_rows: int) -> int:
    """x rows per program: the batch padded to a power of two, >= 16 for an MMA."""
    return max(16, triton.next_power_of_2(num_rows))


def split_k_for(num_k_blocks: int, wanted: int) -> int:
    """At most `wanted` splits of whole K blocks, cdiv(num_k_blocks, wanted) blocks each (the last
    may be shorter), never an empty one."""
    per_split = triton.cdiv(num_k_blocks, max(1, min(wanted, num_k_blocks)))
    return triton.cdiv(num_k_blocks, per_split)


LONG_K = 4096              # kernel_config's long rows of W (the 0.8B's reach 3584)


def kernel_config(num_rows: int, out_features: int, in_features: int, sms: int, element_size: int = 2) -> TileConfig:
    """Tiles for x [num_rows, in_features] @ W[out_features, in_features]^T on a GPU of `sms` SMs:
    block_n rows of W (columns of y) per program, block_k the K step of its loop, num_splits
    programs per N tile (each over a run of whole K blocks), num_stages the pipelining depth of
    the W / x loads. The batch is one tile of block_m(num_rows) rows, not a field.

    BLOCK_K = 128 (a warp reads 256-byte stretches of W's rows in 16-byte vectors), 4 warps, 4
    stages; BLOCK_N 64 up to 8 rows, 32 above; split-K for at most one program per SM and at
    least num_stages K blocks per split (shorter splits pay the pipeline's prologue and the
    split-K tail for fewer bytes). For N >= 32 per SM (the wide projections the fusions bring
    here: the 0.8B in_proj, qkv, gate_up) no split, 64-row tiles, and K steps of 256 up to 8
    rows of 2-byte inputs: the sweep's best there, tying cuBLAS (4 stages of fp32 tiles that
    wide would need 320 KB of shared memory, past an H100's 227 KB; element_size: x's bytes).
    Long K (>= LONG_K, the 9B's out_proj, o_proj and down) up to 8 rows of 2-byte inputs: K steps
    of 256 and splits for at most one program per SM, rounded down (the 9B's N = 4096 at 4 rows:
    2 splits, 12.7 / 35.0 µs for K = 4096 / 12288 against 15.3 / 41.2 with steps of 128 and 3
    splits; H200: bench/results/kernels_linear_9b-h200.json). Within a few percent of the
    fastest swept config for every shape (measured: bench/results/kernels_linear-h100.json)."""
    block_k, num_stages = 128, 4
    short_rows = num_rows <= 8 and element_size <= 2
    if out_features >= 32 * sms:
        return TileConfig(block_n=64, block_k=256 if short_rows else 128, num_splits=1, num_warps=4,
                          num_stages=num_stages)
    block_n = 64 if num_rows <= 8 else 32
    long_k = short_rows and in_features >= LONG_K
    if long_k:
        block_k = 256
    num_tiles, num_k_blocks = triton.cdiv(out_features, block_n), triton.cdiv(in_features, block_k)
    per_sm = max(1, sms // num_tiles) if long_k else triton.cdiv(sms, num_tiles)
    split_k = split_k_for(num_k_blocks, min(per_sm, max(1, num_k_blocks // num_stages)))
    return TileConfig(block_n=block_n, block_k=block_k, num_splits=split_k, num_warps=4, num_stages=num_stages)


@cache
def kernel_everywhere() -> bool:
    """DELTASPEC_LINEAR_KERNEL=always: the kernel for every shape up to KERNEL_MAX_ROWS rows, cuBLAS
    for none (A/B timing of whole steps, where the kernel's PDL launch overlaps its predecessor and
    a cuBLAS GEMM's does not; use_kernel's rule was measured one call at a time)."""
    return os.environ.get("DELTASPEC_LINEAR_KERNEL") == "always"


# Fused projections take the kernel up to here, whatever N: a 0.8B step's projections with the
# block ops fused read 0.83-0.94x their separate time (cuBLAS for the wide ones) at 1-32 rows, the
# 9B's 0.97-0.99x (bench/kernels_block_fusion.py: results/block_fusion-h100/).
FUSED_MAX_ROWS = KERNEL_MAX_ROWS
# ...but a wide W (N >= 32 per SM) of more bytes than this goes to cuBLAS, fused ops and all: at the
# 9B's sizes (84-201 MB) cuBLAS streams it at 4 rows 25-35% faster than the wide tiles (H200:
# gate_up 52.4 against 70.4 µs, in_proj 30.7 against 39.0, qkv 24.4 against 33.2;
# bench/results/kernels_linear_9b-h200.json), more than the norm's and SwiGLU's launches cost
# (~3 µs each); at the 0.8B's (10-17 MB) fusing them won.
FUSED_WIDE_MAX_BYTES = 64 << 20


def use_kernel(num_rows: int, out_features: int, sms: int, fused: bool = False, *, weight_bytes: int) -> bool:
    """The rule between this kernel and cuBLAS (measured: bench/results/kernels_linear-h100.json):
      - N >= 32 per SM (the 0.8B in_proj, qkv, gate_up; every 9B one but out/o_proj and down):
        cuBLAS's own N tiles fill the GPU; it ties (with kernel_config's wide tiles) or wins,
        so the kernel takes these only where it fuses ops (`fused`) up to FUSED_MAX_ROWS rows
        and W (weight_bytes) is at most FUSED_WIDE_MAX_BYTES;
      - up to 16 rows otherwise: the kernel;
      - 17..32 rows: the kernel up to 16 features per SM; at N = 4096 cuBLAS switches to a
        faster kernel there;
      - more than 32 rows: cuBLAS (x's re-reads from L2 and the fp32 partials grow with M)."""
    if not 0 < num_rows <= KERNEL_MAX_ROWS:
        return False
    if kernel_everywhere():
        return True
    wide = out_features >= 32 * sms
    if fused and num_rows <= FUSED_MAX_ROWS:
        return not wide or weight_bytes <= FUSED_WIDE_MAX_BYTES
    if wide:
        return False
    return num_rows <= 16 or out_features <= 16 * sms


@cache
def linear_config(num_rows: int, out_features: int, in_features: int, device: torch.device,
                  fused: bool = False, element_size: int = 2) -> TileConfig | None:
    """The config `linear` launches for these shapes on `device` (out_features: W's rows), or
    None for cuBLAS. Shapes, the inputs' element size, whether the call fuses ops, and the SM
    count only: CUDA graphs replay the choice. The interpreter gets one small config."""
    if INTERPRETED:
        if not 0 < num_rows <= KERNEL_MAX_ROWS:
            return None
        return TileConfig(block_n=16, block_k=32, num_splits=split_k_for(triton.cdiv(in_features, 32), 2),
                          num_warps=1, num_stages=1)
    sms = num_sms(device)
    if not use_kernel(num_rows, out_features, sms, fused, weight_bytes=out_features * in_features * element_size):
        return None
    return kernel_config(num_rows, out_features, in_features, sms, element_size)


def _check_plan(x_shape: torch.Size, weight_shape: torch.Size, y_shape: torch.Size, dtype: torch.dtype,
                weight_dtype: torch.dtype, y_dtype: torch.dtype, config: TileConfig, glu: bool, residual: bool,
                conv: tuple | None) -> dict:
    """Both forms' shape and dtype checks; returns the epilogue's compile-time arguments. conv:
    (channels, taps, pending columns P, commit) or None."""
    assert len(x_shape) == 2 and len(weight_shape) == 2 and weight_shape[1] == x_shape[1], \
        f"linear: x {tuple(x_shape)} and weight {tuple(weight_shape)} do not chain"
    num_rows, weight_rows = x_shape[0], weight_shape[0]
    assert dtype == weight_dtype and dtype in (torch.bfloat16, torch.float16, torch.float32), \
        f"linear: x {dtype}, weight {weight_dtype}"
    assert y_dtype == dtype or (y_dtype == torch.float32 and not (glu or residual or conv)), \
        f"linear: y {y_dtype} for x {dtype}: x's dtype, or float32 without glu, residual and conv"
    assert not glu or weight_rows % 2 == 0, f"linear: glu needs [gate; up], an even number of rows, got {weight_rows}"
    assert not glu or config.block_n >= 2, "linear: glu needs block_n >= 2"
    out_features = weight_rows // 2 if glu else weight_rows
    assert y_shape == (num_rows, out_features), f"linear: y {tuple(y_shape)}"
    assert 0 < num_rows <= MAX_ROWS, f"linear kernel takes 1..{MAX_ROWS} rows, got {num_rows}"
    assert conv is None or not (glu or residual), "linear: conv fuses with neither glu nor residual"
    assert conv is None or conv[0] <= out_features, "linear: conv channels past y's columns"
    return dict(GLU=glu, RESIDUAL=residual, **conv_constants(conv))


def _grid_n(out_features: int, config: TileConfig, glu: bool) -> int:
    """N tiles of y's out_features columns (a GLU tile's block_n rows of W give half as many)."""
    return triton.cdiv(out_features, config.block_n // 2 if glu else config.block_n)


@cache
def _launch_plan(x_shape: torch.Size, weight_shape: torch.Size, y_shape: torch.Size, dtype: torch.dtype,
                 weight_dtype: torch.dtype, y_dtype: torch.dtype, config: TileConfig, norm: bool, glu: bool,
                 residual: bool, conv: tuple | None) -> tuple[tuple[int, int], int, dict]:
    """Shape and dtype checks, then (grid, K per split, compile-time arguments): once per shape,
    so that a call pays only for its stride checks, its scratch and the launch (an eager step is
    bound by the host's launches)."""
    epilogue = _check_plan(x_shape, weight_shape, y_shape, dtype, weight_dtype, y_dtype, config, glu, residual, conv)
    (num_rows, in_features), out_features = x_shape, y_shape[1]
    k_per_split = triton.cdiv(triton.cdiv(in_features, config.num_splits), config.block_k) * config.block_k
    meta = dict(BLOCK_M=block_m(num_rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.num_splits,
                EVEN_K=in_features % config.block_k == 0, PRECISION=dot_precision(dtype), NORM=norm,
                LINE=min(128 // weight_dtype.itemsize, config.block_k), **epilogue, **config.launch_options())
    return (_grid_n(out_features, config, glu), config.num_splits), k_per_split, meta


@cache
def _gemv_plan(x_shape: torch.Size, weight_shape: torch.Size, y_shape: torch.Size, dtype: torch.dtype,
               weight_dtype: torch.dtype, y_dtype: torch.dtype, config: TileConfig, norm: bool, head: int, glu: bool,
               residual: bool, conv: tuple | None, rope: tuple | None) -> tuple[tuple[int], dict]:
    """_launch_plan for the one-row form: (grid, compile-time arguments). head: the gated norm's
    head width, 0 without it; rope: QKNormRopeKV's (Hq, Hkv, D, rotary_dim, block_size) or None."""
    epilogue = _check_plan(x_shape, weight_shape, y_shape, dtype, weight_dtype, y_dtype, config, glu, residual, conv)
    num_rows, in_features = x_shape
    assert num_rows == 1, f"linear: the one-row form takes 1 row, got {num_rows}"
    assert config.block_k >= in_features and config.block_k == triton.next_power_of_2(config.block_k), \
        f"linear: the one-row form's block_k must be a power of two >= K = {in_features}, got {config.block_k}"
    assert not (head and norm), "linear: the gated norm and the RMS norm of x are exclusive"
    assert not head or (in_features % head == 0 and head == triton.next_power_of_2(head)), \
        f"linear: gated norm heads of {head} columns must be a power of two dividing K = {in_features}"
    num_q_heads, num_kv_heads, head_dim, rotary_dim, block_size = rope or (0, 0, 0, 0, 0)
    assert rope is None or not (glu or residual or conv), "linear: rope_kv fuses with neither glu, residual nor conv"
    assert rope is None or y_dtype == dtype, "linear: rope_kv reads y back in x's dtype"
    assert rope is None or _rope_fits(head_dim, config), \
        f"linear: rope_kv needs heads of a power of two columns, each whole tiles of {config.block_n}; got {head_dim}"
    meta = dict(BLOCK_N=config.block_n, KP=config.block_k, NORM=norm, HEAD=head, **epilogue, ROPE=rope is not None,
                HQ=num_q_heads, HKV=num_kv_heads, D=head_dim, R=rotary_dim, BLOCK_SIZE=block_size,
                num_warps=config.num_warps)
    return (_grid_n(y_shape[1], config, glu),), meta


def _check_linear_args(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """What a call must check itself (_launch_plan checks shapes and dtypes once per shape)."""
    assert x.stride(1) == 1 and weight.stride(1) == 1, "linear: x and weight need unit stride along K"
    assert y.is_contiguous(), "linear: y must be contiguous"
    assert weight.device == x.device == y.device, "linear: x, weight and y on one device"
    if residual is not None:
        assert residual.shape == y.shape and residual.dtype == y.dtype and residual.stride(1) == 1, \
            "linear: residual of y's shape and dtype, unit stride along N"


def launch_linear(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, config: TileConfig, *,
                  norm_eps: float | None = None, glu: bool = False, residual: torch.Tensor | None = None,
                  conv: ConvDecode | None = None) -> None:
    """y [M, N] = x [M, K] @ weight [N, K]^T with an explicit config and the fusions of
    linear_reference (with glu, weight is [2N, K]; residual may be y itself). x and weight:
    same dtype (bf16, fp16 or fp32), unit stride along K (x may be a row-strided view); y
    contiguous, same dtype, or float32 without fusions (the product rounded to x's dtype, then
    widened). Accumulates in fp32; fp32 inputs multiply in full fp32 (no tf32)."""
    grid, k_per_split, meta = _launch_plan(x.shape, weight.shape, y.shape, x.dtype, weight.dtype, y.dtype, config,
                                           norm_eps is not None, glu, residual is not None, conv_shape(conv))
    _check_linear_args(y, x, weight, residual)
    if conv is not None:  # the conv launcher's checks, on the columns it reads
        check_conv_decode_args(y[:, :conv.weight.shape[0]], conv)
    device = x.device
    (num_rows, in_features), out_features = x.shape, y.shape[1]
    if config.num_splits > 1:
        partials = torch.empty((config.num_splits, num_rows, grid[0] * config.block_n), dtype=torch.float32,
                               device=device)
        row_sq = torch.empty((grid[0], config.num_splits, meta["BLOCK_M"]), dtype=torch.float32, device=device) \
            if norm_eps is not None else partials
        arrivals = arrival_counters(device, grid[0])
    else:  # never touched
        partials = row_sq = arrivals = y
    stream = y if residual is None else residual
    (conv_weight, cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts, conv_out, pending_out, conv_rows,
     stride_conv_out) = conv_arguments(y, conv)
    _linear_kernel[grid](x, weight, y, stream, partials, row_sq, arrivals, num_rows, out_features, in_features,
                         k_per_split, 0.0 if norm_eps is None else norm_eps,
                         x.stride(0), weight.stride(0), y.stride(0), stream.stride(0),
                         conv_weight, conv_out, pending_out, cu_seqlens, slot_ids, conv_state, pending_conv,
                         pending_counts, conv_rows, stride_conv_out, **meta, **pdl(x.device))


def conv_arguments(y: torch.Tensor, conv: ConvDecode | None) -> tuple:
    """The kernels' conv_* arguments in their order (conv weight, cu_seqlens, slot_ids, state,
    pending columns, pending counts, out, pending out, rows, out's row stride); without a conv,
    placeholders the kernel never touches."""
    if conv is None:
        return (y,) * 8 + (0, 0)
    return (*conv[:6], conv.out, conv.pending_out, conv.slot_ids.numel(), conv.out.stride(0))


def conv_shape(conv: ConvDecode | None) -> tuple | None:
    """What a launch plan keys on of a conv: (channels, taps, pending columns P, commit)."""
    return None if conv is None else (*conv.weight.shape, conv.pending_conv.shape[1], conv.commit)


def conv_constants(shape: tuple | None) -> dict:
    """The conv epilogue's compile-time arguments for a conv of this conv_shape: CONV and
    conv_decode_tile's (placeholders without a conv, which the kernel never reads)."""
    return dict(CONV=shape is not None, **decode_tile_constants(*(shape or (1, 2, 0, True))))


@cache
def gemv_config(out_features: int, in_features: int, device: torch.device, glu: bool = False,
                element_size: int = 2, program_bytes: int = GEMV_PROGRAM_BYTES,
                num_warps: int = GEMV_WARPS) -> TileConfig | None:
    """The one-row form's tile (_gemv_kernel) for W [out_features, in_features] of element_size
    bytes: block_k is K padded to a power of two, block_n the most rows of W whose padded share
    fits program_bytes, halved (down to one row, two with glu) until the N tiles give every SM a
    program. Where that least share passes program_bytes, it alone up to GEMV_ROW_BYTES, with
    num_warps scaled by share / program_bytes; None past that. Shapes only (graphs replay the
    choice); program_bytes and num_warps other than the defaults: bench/tools/gemv_chain.py."""
    k_padded = triton.next_power_of_2(in_features)
    fitting = program_bytes // (k_padded * element_size)
    least = 2 if glu else 1
    if fitting < least:
        share = least * k_padded * element_size
        if share > GEMV_ROW_BYTES:
            return None
        return TileConfig(block_n=least, block_k=k_padded, num_warps=num_warps * share // program_bytes)
    block_n = 1 << (fitting.bit_length() - 1)
    sms = 1 if INTERPRETED else num_sms(device)
    while block_n > least and triton.cdiv(out_features, block_n) < sms:
        block_n //= 2
    return TileConfig(block_n=block_n, block_k=k_padded, num_warps=num_warps)


def launch_gemv(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, config: TileConfig, *,
                norm_eps: float | None = None, glu: bool = False, residual: torch.Tensor | None = None,
                conv: ConvDecode | None = None, gated_norm: GatedNorm | None = None,
                rope_kv: QKNormRopeKV | None = None) -> None:
    """launch_linear's contract for one row of x, through the one-row form (_gemv_kernel) with
    an explicit config (gemv_config's: block_n rows of W a program, block_k >= K a power of
    two), and gated_norm and rope_kv (linear_reference's) fused too (rope_kv: block_n dividing
    the head width)."""
    head = 0 if gated_norm is None else gated_norm.weight.shape[0]
    rope = None if rope_kv is None else \
        (*check_qk_norm_rope_kv_args(y, rope_kv), rope_kv.rotary_dim, rope_kv.k_cache.shape[1])
    grid, meta = _gemv_plan(x.shape, weight.shape, y.shape, x.dtype, weight.dtype, y.dtype, config,
                            norm_eps is not None, head, glu, residual is not None, conv_shape(conv), rope)
    _check_linear_args(y, x, weight, residual)
    if conv is not None:
        check_conv_decode_args(y[:, :conv.weight.shape[0]], conv)
    gate, norm_weight, eps = (x, x, norm_eps or 0.0) if gated_norm is None else gated_norm
    if gated_norm is not None:
        assert gate.shape == x.shape and gate.stride(1) == 1 and gate.dtype == x.dtype and norm_weight.dim() == 1, \
            f"linear: gated norm's gate {tuple(gate.shape)} ({gate.dtype}) as x {tuple(x.shape)}, unit stride"
    stream = y if residual is None else residual
    (conv_weight, cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts, conv_out, pending_out, _,
     stride_conv_out) = conv_arguments(y, conv)
    _gemv_kernel[grid](x, weight, y, stream, gate, norm_weight, y.shape[1], x.shape[1], eps,
                       weight.stride(0), y.stride(0), stream.stride(0),
                       conv_weight, conv_out, pending_out, cu_seqlens, slot_ids, conv_state, pending_conv,
                       pending_counts, stride_conv_out, *_rope_arguments(y, rope_kv, meta["HQ"] + meta["HKV"]),
                       **meta, **pdl(x.device))


def _rope_arguments(y: torch.Tensor, rope_kv: QKNormRopeKV | None, num_heads: int) -> tuple:
    """The one-row form's arrivals .. attention_factor arguments in their order (arrival counters
    for num_heads heads, then rope_kv's tensors and scalars); without rope_kv, placeholders the
    kernel never touches."""
    if rope_kv is None:
        return (y,) * 9 + (0, 0, 0, 0.0, 1.0)
    k_cache = rope_kv.k_cache
    return (arrival_counters(y.device, num_heads), rope_kv.q_weight, rope_kv.k_weight, rope_kv.q_out,
            rope_kv.positions, rope_kv.inv_freq(y.device), k_cache, rope_kv.v_cache, rope_kv.slot_mapping,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), rope_kv.eps, rope_kv.attention_factor)


def linear(x: torch.Tensor, weight: torch.Tensor, *, norm_eps: float | None = None, glu: bool = False,
           residual: torch.Tensor | None = None, conv: ConvDecode | None = None,
           gated_norm: GatedNorm | None = None, rope_kv: QKNormRopeKV | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_reference through the one-row form for one row (every fusion in it), the kernel
    where linear_config picks it (with the fusions in its epilogue; the result written into
    `residual` when given), else through cuBLAS (`cublas_linear`) and the separate kernels of
    the fused ops; the conv of more than CONV_EPILOGUE_MAX_ROWS rows by its own kernel after the
    projection, the gated norm outside the one-row form by its own kernel before it, rope_kv
    outside it by its own kernel after it. `out` (a model's head: its logits, in x's dtype or
    float32) is written by the one-row form itself, elsewhere by a copy of the result."""
    fused = norm_eps is not None or glu or residual is not None or conv is not None or gated_norm is not None \
        or rope_kv is not None
    assert out is None or not fused, "linear: out takes no fused ops"
    if x.dim() != 2:
        assert not fused, "linear: fused ops take [M, K] activations"
        return F.linear(x, weight) if out is None else out.copy_(F.linear(x, weight))
    (num_rows, in_features), weight_rows, device = x.shape, weight.shape[0], x.device
    head = 0 if gated_norm is None else gated_norm.weight.shape[0]
    if num_rows == 1 and head == triton.next_power_of_2(head):  # the kernel's heads: powers of two
        config = gemv_config(weight_rows, in_features, device, glu, x.element_size())
        if config is not None and (rope_kv is None or (rope_kv.positions.dim() == 1
                                                      and _rope_fits(rope_kv.q_weight.shape[0], config))):
            y = residual if residual is not None else out if out is not None else \
                torch.empty((1, weight_rows // 2 if glu else weight_rows), dtype=x.dtype, device=device)
            launch_gemv(y, x, weight, config, norm_eps=norm_eps, glu=glu, residual=residual, conv=conv,
                        gated_norm=gated_norm, rope_kv=rope_kv)
            return y
    if out is not None:
        return out.copy_(linear(x, weight))
    if rope_kv is not None:
        y = linear(x, weight, norm_eps=norm_eps, glu=glu, residual=residual, conv=conv, gated_norm=gated_norm)
        qk_norm_rope_kv(y, rope_kv)
        return y
    if gated_norm is not None:
        return linear(_by_heads(gated_rms_norm, x, gated_norm), weight, norm_eps=norm_eps, glu=glu, residual=residual,
                      conv=conv)
    if conv is not None and conv.slot_ids.numel() > CONV_EPILOGUE_MAX_ROWS:
        y = linear(x, weight, norm_eps=norm_eps, glu=glu, residual=residual)
        causal_conv1d_decode(y[:, :conv.weight.shape[0]], *conv)
        return y
    config = linear_config(num_rows, weight_rows, in_features, device, fused, x.element_size())
    if config is None:
        if norm_eps is not None:
            x, _ = rms_norm(x, None, norm_eps)
        y = cublas_linear(x, weight)
        if glu:
            y = silu_and_mul(y)
        if conv is not None:
            causal_conv1d_decode(y[:, :conv.weight.shape[0]], *conv)
        return y if residual is None else residual.add_(y)
    y = residual if residual is not None else \
        torch.empty((num_rows, weight_rows // 2 if glu else weight_rows), dtype=x.dtype, device=device)
    launch_linear(y, x, weight, config, norm_eps=norm_eps, glu=glu, residual=residual, conv=conv)
    return y


def _rope_fits(head_dim: int, config: TileConfig) -> bool:
    """Whether the one-row form with this config runs rope_kv in its epilogue: heads of a power of
    two columns, each a whole number of its tiles."""
    return head_dim == triton.next_power_of_2(head_dim) and head_dim % config.block_n == 0


# cuBLAS chooses its kernel per GEMM shape on the host and caches the choice: a row count M it
# has not seen costs ~135-290 us of host time against ~17-30 us for one it has (two H100s,
# bench/tools/cublas_shapes.py), and eager steps bring a new M each time (the MTP's prefill of
# every prompt, prefills past the captured graphs), on the critical path of a host-bound step.
# Rows padded to a multiple of CUBLAS_ROWS bound the shapes it ever sees.
CUBLAS_ROWS = 128


def cublas_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear, on CUDA outside graph capture (where a shape's choice is paid once) over x's
    rows padded to a multiple of CUBLAS_ROWS."""
    if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return F.linear(x, weight)
    return padded_linear(x, weight, CUBLAS_ROWS)


def padded_linear(x: torch.Tensor, weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """F.linear(x, weight) computed over x's rows staged into a buffer of a multiple of `multiple`
    rows (one copy of x). The padding rows are left as allocated: each output row depends on its
    own input row alone, and theirs are dropped (the result is the leading rows, contiguous)."""
    num_rows = x.shape[0]
    padded = -(-num_rows // multiple) * multiple
    if padded == num_rows:
        return F.linear(x, weight)
    staged = x.new_empty(padded, x.shape[1])
    staged[:num_rows] = x
    return F.linear(staged, weight)[:num_rows]
