"""Skinny GEMM for decode and verify batches: y[M, N] = x[M, K] @ W[N, K]^T with M <= 64.

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

`linear` is the entry point (the `Ops.linear` of the GPU table): the kernel where `use_kernel`
says it beats cuBLAS, F.linear elsewhere (prefill, wide N, more than 16 rows at larger N).
`launch_linear` runs the kernel with an explicit config (tests, the tuning sweep of
bench/kernels_linear.py); `linear_reference` is the torch oracle.

The kernel can also form its input from the op before it, in its prologue, saving that op's
launch on the decode path: `silu_and_mul_linear` (SwiGLU, then the down projection) and
`gated_rms_norm_linear` (the GDN output norm, then out_proj), each with its `launch_*`
(explicit config) and `*_reference` (the composition of the parts' references). Where the
kernel is not picked they run the parts (silu_and_mul or gated_rms_norm, then `linear`), so a
prefill's numerics are the unfused path's. Knows nothing about which projection it computes.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_and_mul, silu_and_mul_reference, silu_mul
from .arrivals import arrival_counters, last_to_arrive, reset_arrivals
from .device import INTERPRETED, num_sms
from .launch import dependent_prologue, dot_precision, pdl
from .norms import AddRMSNorm, add_rms_norm_after, add_rms_norm_after_reference, add_rms_norm_row, gated_rms_norm, \
    gated_rms_norm_reference, gated_rms_normalize
from .tiles import TileConfig

MAX_ROWS = 64               # the kernel's limit (x is padded to a power of two >= 16 rows)
KERNEL_MAX_ROWS = 32        # use_kernel never picks the kernel for more rows


def linear_reference(x: torch.Tensor, weight: torch.Tensor, then: AddRMSNorm | None = None):
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype; with `then` (norms.AddRMSNorm) its
    (normed, new residual) instead."""
    return add_rms_norm_after_reference(F.linear(x, weight), then)


# What _linear_kernel computes from x's tile before the product (the PROLOGUE constexpr).
PLAIN, SILU_AND_MUL, GATED_RMS_NORM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


# M varies with the batch: not compile-time (one binary serves a BLOCK_M).
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x, w, y, partials, arrivals, gate, norm_weight, residual, add_norm_weight, normed, residual_out,
                   M, N, K, k_per_split, stride_xm, stride_wn, stride_ym, stride_gm, stride_rm, eps, add_norm_eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr, ADD_RMS_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
                   PRECISION: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (N tile pid_n, K split pid_k): acc[BLOCK_N, BLOCK_M] = W[n tile, k split] @ a[:, k split]^T,
    i.e. y^T, so that the wide side (W's rows) is the MMA's M and the padded batch (>= 16 rows
    for tl.dot) its N. K splits are k_per_split long (a multiple of BLOCK_K); the last may be
    short or empty. Rows of W past N and of x past M are clamped to the last row instead of
    masked, so the loads along K stay unpredicated 16-byte vectors; their products land in
    columns that are never stored.

    a is the GEMM's input as the prologue forms it from x, tile by tile, rounded to W's dtype
    (the value the unfused kernel would have stored):
      PLAIN           a = x [M, K]
      SILU_AND_MUL    a = silu(x[:, :K]) * x[:, K:2K]   (x: the MLP's gate|up [M, 2K])
      GATED_RMS_NORM  a = per value head of BLOCK_K columns, x / rms(x) * norm_weight *
                      silu(gate)   (x, gate [M, K], gate row stride stride_gm; EVEN_K)
    The fused activations cost nothing extra: x is a few KB that every program reads anyway
    (from L2), while the launch they replace costs a graph node.

    SPLIT_K > 1: partials [SPLIT_K, M, N] fp32 (scratch); arrivals[pid_n] counts the tile's
    programs in. The last one sums the partials in split order and writes y. The sum is
    unrolled so that its SPLIT_K loads are in flight together: that tail is one L2 round trip,
    not SPLIT_K of them (a loop was slower; H100 A/B in commit 8b76c27).

    ADD_RMS_NORM (the epilogue): y's rows then take the residual add + RMSNorm that follows the
    projection: residual_out = y + residual, normed = rms_norm(residual_out) * (1 + add_norm_weight)
    (norms.add_rms_norm_row, contiguous [M, N] outputs, y the scratch it reads). A row needs
    every N tile, so each tile's writer counts in at arrivals[number of N tiles] and the last of
    them normalises the M rows (BLOCK_H >= N columns at a time): one more L2 round trip and M
    rows of work on one SM, for a whole launch saved."""
    dependent_prologue(DEPENDENT_LAUNCH)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w + rows_w[:, None] * stride_wn + (k_start + offs_k)[None, :]     # [BLOCK_N, BLOCK_K]
    x_ptrs = x + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]     # [BLOCK_M, BLOCK_K]
    g_ptrs = gate + rows_x[:, None] * stride_gm + (k_start + offs_k)[None, :]  # GATED_RMS_NORM only
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w_tile = tl.load(w_ptrs)
            x_tile = tl.load(x_ptrs)
            if PROLOGUE == SILU_AND_MUL:
                x_tile = silu_mul(x_tile, tl.load(x_ptrs + K)).to(w_tile.dtype)
        else:  # zero both sides past K: garbage there may be inf or NaN (silu(0) * 0 = 0)
            in_k = (k + offs_k) < K
            w_tile = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
            x_tile = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
            if PROLOGUE == SILU_AND_MUL:
                x_tile = silu_mul(x_tile, tl.load(x_ptrs + K, mask=in_k[None, :], other=0.0)).to(w_tile.dtype)
        if PROLOGUE == GATED_RMS_NORM:
            norm_w = tl.load(norm_weight + offs_k).to(tl.float32)
            x_tile = gated_rms_normalize(x_tile.to(tl.float32), tl.load(g_ptrs).to(tl.float32), norm_w, eps,
                                         BLOCK_K).to(w_tile.dtype)
            g_ptrs += BLOCK_K
        acc = tl.dot(w_tile, tl.trans(x_tile), acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    out = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = y + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=out)
        if ADD_RMS_NORM:
            _add_rms_norm_rows(y, residual, add_norm_weight, normed, residual_out, arrivals + tl.num_programs(0),
                               tl.num_programs(0), M, N, stride_rm, add_norm_eps, BLOCK_H)
    else:
        tile = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]                # within one [M, N] partial
        tl.store(partials + pid_k.to(tl.int64) * M * N + tile, acc, mask=out)
        if last_to_arrive(arrivals + pid_n, SPLIT_K):
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other SMs' stores are, never a stale L1 line
                total += tl.load(partials + s * M * N + tile, mask=out, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y.dtype.element_ty), mask=out)
            reset_arrivals(arrivals + pid_n)
            if ADD_RMS_NORM:
                _add_rms_norm_rows(y, residual, add_norm_weight, normed, residual_out, arrivals + tl.num_programs(0),
                                   tl.num_programs(0), M, N, stride_rm, add_norm_eps, BLOCK_H)


@triton.jit
def _add_rms_norm_rows(y, residual, weight, normed, residual_out, counter, num_tiles, M, N, stride_rm, eps,
                       BLOCK_H: tl.constexpr):
    """Called by each N tile's writer once its y tile is stored: the last of the num_tiles
    writers to arrive at `counter` sees every tile and normalises the M rows of y (contiguous)."""
    if last_to_arrive(counter, num_tiles):
        for m in range(M):   # M <= EPILOGUE_MAX_ROWS, N <= EPILOGUE_MAX_COLUMNS: int32 offsets
            add_rms_norm_row(y + m * N, residual + m * stride_rm, weight, normed + m * N, residual_out + m * N, eps, N,
                             BLOCK_H, True)
        reset_arrivals(counter)


def block_m(num_rows: int) -> int:
    """x rows per program: the batch padded to a power of two, >= 16 for an MMA."""
    return max(16, triton.next_power_of_2(num_rows))


def split_k_for(num_k_blocks: int, wanted: int) -> int:
    """At most `wanted` splits of whole K blocks, cdiv(num_k_blocks, wanted) blocks each (the last
    may be shorter), never an empty one."""
    per_split = triton.cdiv(num_k_blocks, max(1, min(wanted, num_k_blocks)))
    return triton.cdiv(num_k_blocks, per_split)


def kernel_config(num_rows: int, out_features: int, in_features: int, sms: int) -> TileConfig:
    """Tiles for x [num_rows, in_features] @ W[out_features, in_features]^T on a GPU of `sms` SMs:
    block_n rows of W (columns of y) per program, block_k the K step of its loop, num_splits
    programs per N tile (each over a run of whole K blocks), num_stages the pipelining depth of
    the W / x loads. The batch is one tile of block_m(num_rows) rows, not a field.

    BLOCK_K = 128 (a warp reads 256-byte stretches of W's rows in 16-byte vectors), 4 warps, 4
    stages; BLOCK_N 64 up to 8 rows, 32 above; split-K for at most one program per SM and at
    least num_stages K blocks per split (shorter splits pay the pipeline's prologue and the
    split-K tail for fewer bytes). Within a few percent of the fastest swept config for every
    shape use_kernel gives the kernel (measured: bench/results/kernels_linear-h100.json)."""
    block_n = 64 if num_rows <= 8 else 32
    block_k, num_stages = 128, 4
    num_tiles, num_k_blocks = triton.cdiv(out_features, block_n), triton.cdiv(in_features, block_k)
    split_k = split_k_for(num_k_blocks, min(triton.cdiv(sms, num_tiles), max(1, num_k_blocks // num_stages)))
    return TileConfig(block_n=block_n, block_k=block_k, num_splits=split_k, num_warps=4, num_stages=num_stages)


def use_kernel(num_rows: int, out_features: int, sms: int) -> bool:
    """The rule between this kernel and cuBLAS (measured: bench/results/kernels_linear-h100.json):
      - N >= 32 per SM (the 0.8B in_proj, qkv, gate_up; every 9B one but out/o_proj and down):
        cuBLAS's own N tiles fill the GPU; it ties or wins;
      - up to 16 rows otherwise: the kernel;
      - 17..32 rows: the kernel up to 16 features per SM; at N = 4096 cuBLAS switches to a
        faster kernel there;
      - more than 32 rows: cuBLAS (x's re-reads from L2 and the fp32 partials grow with M)."""
    if not 0 < num_rows <= KERNEL_MAX_ROWS or out_features >= 32 * sms:
        return False
    return num_rows <= 16 or out_features <= 16 * sms


@cache
def linear_config(num_rows: int, out_features: int, in_features: int, device: torch.device) -> TileConfig | None:
    """The config `linear` launches for these shapes on `device`, or None for cuBLAS. Shapes and
    the SM count only: CUDA graphs replay the choice. The interpreter gets one small config."""
    if INTERPRETED:
        if not 0 < num_rows <= KERNEL_MAX_ROWS:
            return None
        return TileConfig(block_n=16, block_k=32, num_splits=split_k_for(triton.cdiv(in_features, 32), 2),
                          num_warps=1, num_stages=1)
    sms = num_sms(device)
    if not use_kernel(num_rows, out_features, sms):
        return None
    return kernel_config(num_rows, out_features, in_features, sms)


# The add + RMSNorm epilogue normalises every row on the one SM that arrives last: worth a launch
# for a few rows only (decode at small batch, a batch-1 verify of 3 drafts).
EPILOGUE_MAX_ROWS = 4
EPILOGUE_MAX_COLUMNS = 8192


@cache
def _launch_plan(x_shape: torch.Size, weight_shape: torch.Size, y_shape: torch.Size, dtype: torch.dtype,
                 weight_dtype: torch.dtype, y_dtype: torch.dtype, config: TileConfig,
                 prologue: tl.constexpr, add_rms_norm: bool) -> tuple[tuple[int, int], int, dict]:
    """Shape and dtype checks, then (grid, K per split, compile-time arguments): once per shape,
    so that a call pays only for its stride checks, its scratch and the launch (an eager step is
    bound by the host's launches). x_shape: the kernel's x, [M, 2K] for SILU_AND_MUL."""
    in_features = x_shape[1] // 2 if prologue == SILU_AND_MUL else x_shape[1]
    assert len(x_shape) == 2 and len(weight_shape) == 2 and weight_shape[1] == in_features, \
        f"linear: x {tuple(x_shape)} and weight {tuple(weight_shape)} do not chain"
    num_rows, out_features = x_shape[0], weight_shape[0]
    assert dtype == weight_dtype == y_dtype and dtype in (torch.bfloat16, torch.float16, torch.float32), \
        f"linear: x {dtype}, weight {weight_dtype}, y {y_dtype}"
    assert y_shape == (num_rows, out_features), f"linear: y {tuple(y_shape)}"
    assert 0 < num_rows <= MAX_ROWS, f"linear kernel takes 1..{MAX_ROWS} rows, got {num_rows}"
    block_h = triton.next_power_of_2(out_features)
    assert not add_rms_norm or block_h <= EPILOGUE_MAX_COLUMNS, \
        f"linear: the add + RMSNorm epilogue takes rows of at most {EPILOGUE_MAX_COLUMNS}, got {out_features}"
    k_per_split = triton.cdiv(triton.cdiv(in_features, config.num_splits), config.block_k) * config.block_k
    meta = dict(BLOCK_M=block_m(num_rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.num_splits,
                EVEN_K=in_features % config.block_k == 0, PROLOGUE=prologue.value, ADD_RMS_NORM=add_rms_norm,
                BLOCK_H=block_h if add_rms_norm else 1, PRECISION=dot_precision(dtype),
                **config.launch_options())
    return (triton.cdiv(out_features, config.block_n), config.num_splits), k_per_split, meta


def _check_linear_args(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, then: AddRMSNorm | None) -> None:
    """What a call must check itself (_launch_plan checks shapes and dtypes once per shape)."""
    assert x.stride(1) == 1 and weight.stride(1) == 1, "linear: x and weight need unit stride along K"
    assert y.is_contiguous(), "linear: y must be contiguous"
    assert weight.device == x.device == y.device, "linear: x, weight and y on one device"
    if then is not None:
        assert then.residual.shape == y.shape and then.residual.stride(1) == 1 and then.residual.dtype == y.dtype, \
            "linear: the epilogue's residual is y's shape and dtype, unit stride along N"
        assert then.weight.shape == (y.shape[1],) and then.weight.is_contiguous(), \
            "linear: the epilogue's norm weight is contiguous [N]"


def _launch(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, config: TileConfig, prologue: tl.constexpr,
            gate: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            then: AddRMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    grid, k_per_split, meta = _launch_plan(x.shape, weight.shape, y.shape, x.dtype, weight.dtype, y.dtype, config,
                                           prologue, then is not None)
    _check_linear_args(y, x, weight, then)
    device = x.device
    num_rows, (out_features, in_features) = x.shape[0], weight.shape
    partials = arrivals = y  # never touched unless split or normalised
    if config.num_splits > 1:
        partials = torch.empty((config.num_splits, num_rows, out_features), dtype=torch.float32, device=device)
    if config.num_splits > 1 or then is not None:
        arrivals = arrival_counters(device, grid[0] + 1)   # one per N tile, then the epilogue's
    gate = x if gate is None else gate                      # never read but by GATED_RMS_NORM
    norm_weight = x if norm_weight is None else norm_weight
    normed = residual_out = None
    if then is not None:
        normed, residual_out = torch.empty_like(y), torch.empty_like(y)
    residual, add_norm_weight = (then.residual, then.weight) if then is not None else (y, y)
    _linear_kernel[grid](x, weight, y, partials, arrivals, gate, norm_weight, residual, add_norm_weight,
                         normed if then is not None else y, residual_out if then is not None else y,
                         num_rows, out_features, in_features, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
                         gate.stride(0), residual.stride(0), eps, then.eps if then is not None else 0.0, **meta,
                         **pdl(x.device))
    return None if then is None else (normed, residual_out)


def launch_linear(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, config: TileConfig,
                  then: AddRMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """y [M, N] = x [M, K] @ weight [N, K]^T with an explicit config. x and weight: same dtype
    (bf16, fp16 or fp32), unit stride along K (x may be a row-strided view); y contiguous, same
    dtype. Accumulates in fp32; fp32 inputs multiply in full fp32 (no tf32). With `then` (the
    residual [M, N], unit stride along N): also returns its (normed, new residual), new
    contiguous tensors, from the same launch."""
    return _launch(y, x, weight, config, PLAIN, then=then)


def launch_silu_and_mul_linear(y: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor, config: TileConfig,
                               then: AddRMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """y [M, N] = silu_and_mul(gate_up) @ weight [N, K]^T in one launch: gate_up [M, 2K] (gate
    columns first, unit column stride, any row stride), otherwise as launch_linear."""
    return _launch(y, gate_up, weight, config, SILU_AND_MUL, then=then)


def _flat_heads(t: torch.Tensor) -> torch.Tensor:
    """[M, H, D] with unit stride along D and heads adjacent -> the view [M, H * D]."""
    assert t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2], \
        f"gated_rms_norm_linear: [M, H, D] with adjacent heads, unit stride along D (got {tuple(t.shape)}, " \
        f"strides {t.stride()})"
    return t.flatten(1)


def launch_gated_rms_norm_linear(y: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor,
                                 eps: float, weight: torch.Tensor, config: TileConfig,
                                 then: AddRMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """y [M, N] = gated_rms_norm(x, gate, norm_weight, eps) @ weight [N, H * D]^T in one launch.
    x, gate [M, H, D] (any row stride; heads adjacent, unit stride along D), norm_weight [D]
    contiguous; config.block_k == D (a K tile is one value head), otherwise as launch_linear."""
    head_dim = x.shape[-1]
    assert gate.shape == x.shape and gate.dtype == x.dtype, "gated_rms_norm_linear: gate must match x"
    assert norm_weight.shape == (head_dim,) and norm_weight.is_contiguous(), \
        "gated_rms_norm_linear: norm_weight contiguous [D]"
    assert config.block_k == head_dim, \
        f"gated_rms_norm_linear: block_k {config.block_k} must be the head dim {head_dim}"
    return _launch(y, _flat_heads(x), weight, config, GATED_RMS_NORM, _flat_heads(gate), norm_weight, eps, then)


def _epilogue(then: AddRMSNorm | None, num_rows: int, out_features: int) -> AddRMSNorm | None:
    """`then` where the kernel should apply it (few rows, a row that fits, a residual it can
    read), else None: the caller applies it apart."""
    if then is None or num_rows > EPILOGUE_MAX_ROWS or triton.next_power_of_2(out_features) > EPILOGUE_MAX_COLUMNS:
        return None
    if then.residual.shape != (num_rows, out_features) or then.residual.stride(1) != 1:
        return None
    return then


def _finish(y: torch.Tensor, then: AddRMSNorm | None, fused: tuple | None):
    """What a projection entry returns: y, or `then` on y (from the launch when it fused it)."""
    if then is None:
        return y
    return fused if fused is not None else add_rms_norm_after(y, then)


def linear(x: torch.Tensor, weight: torch.Tensor, then: AddRMSNorm | None = None, fused: bool = True):
    """linear_reference through the kernel where linear_config picks it, else through F.linear;
    `then` applied to the output, in the kernel's epilogue where _epilogue allows (fused=False:
    always apart, the A/B of backend.py)."""
    if x.dim() != 2:
        return add_rms_norm_after(F.linear(x, weight), then)
    (num_rows, in_features), out_features, device = x.shape, weight.shape[0], x.device
    config = linear_config(num_rows, out_features, in_features, device)
    if config is None:
        return add_rms_norm_after(F.linear(x, weight), then)
    y = torch.empty((num_rows, out_features), dtype=x.dtype, device=device)
    epilogue = _epilogue(then, num_rows, out_features) if fused else None
    return _finish(y, then, launch_linear(y, x, weight, config, epilogue))


def silu_and_mul_linear_reference(gate_up: torch.Tensor, weight: torch.Tensor, then: AddRMSNorm | None = None):
    """gate_up [M, 2I] -> silu(gate) * up [M, I] (rounded to gate_up's dtype) @ weight [N, I]^T,
    then `then` (norms.AddRMSNorm) when given."""
    return linear_reference(silu_and_mul_reference(gate_up), weight, then)


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, then: AddRMSNorm | None = None,
                        fused: bool = True):
    """silu_and_mul_linear_reference: one launch where linear_config picks the kernel (decode,
    draft and verify batches), else silu_and_mul and `linear` (prefill: the unfused path's
    numerics). fused=False: always the parts, `then` apart too (A/B of the fusion, backend.py)."""
    num_rows, in_features, out_features = gate_up.shape[0], gate_up.shape[1] // 2, weight.shape[0]
    config = linear_config(num_rows, out_features, in_features, gate_up.device) if fused else None
    if config is None or gate_up.stride(1) != 1:
        return add_rms_norm_after(linear(silu_and_mul(gate_up), weight), then)
    y = torch.empty((num_rows, out_features), dtype=gate_up.dtype, device=gate_up.device)
    return _finish(y, then, launch_silu_and_mul_linear(y, gate_up, weight, config,
                                                       _epilogue(then, num_rows, out_features)))


def gated_rms_norm_linear_reference(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                    weight: torch.Tensor, then: AddRMSNorm | None = None):
    """x, gate [M, H, D] -> gated_rms_norm per head, flattened to [M, H * D], @ weight [N, H * D]^T,
    then `then` when given."""
    return linear_reference(gated_rms_norm_reference(x, gate, norm_weight, eps).flatten(1), weight, then)


def gated_config(config: TileConfig, head_dim: int, in_features: int) -> TileConfig | None:
    """`config` with K tiles of one value head each (the gated norm's prologue normalises a tile
    on its own), as many splits as the heads allow; None where the heads cannot be tiles (a
    head dim that is no power of two >= 16: tl.dot's minimum)."""
    if head_dim < 16 or head_dim & (head_dim - 1) or in_features % head_dim:
        return None
    return replace(config, block_k=head_dim, num_splits=split_k_for(in_features // head_dim, config.num_splits))


def gated_rms_norm_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, then: AddRMSNorm | None = None, fused: bool = True):
    """gated_rms_norm_linear_reference: one launch where linear_config picks the kernel and the
    heads make whole K tiles, else gated_rms_norm and `linear`. fused=False: always the parts."""
    num_rows, num_heads, head_dim = x.shape
    in_features, out_features = num_heads * head_dim, weight.shape[0]
    config = linear_config(num_rows, out_features, in_features, x.device) if fused else None
    if config is not None:
        config = gated_config(config, head_dim, in_features)
    if config is None or x.stride(1) != head_dim or gate.stride(1) != head_dim:
        return add_rms_norm_after(linear(gated_rms_norm(x, gate, norm_weight, eps).flatten(1), weight), then)
    y = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    return _finish(y, then, launch_gated_rms_norm_linear(y, x, gate, norm_weight, eps, weight, config,
                                                         _epilogue(then, num_rows, out_features)))
