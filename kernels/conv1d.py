"""Causal depthwise conv1d (kernel W, SiLU) over the GDN q|k|v channels, by slot.

State layout (per GDN layer), time-major so a token's channels are contiguous:
  conv_state   [num_slots, W-1, C]   the last W-1 *committed* inputs of each slot
  pending_conv [num_slots, P, C]     raw inputs of drafts accepted but not yet folded in (P = k)
  pending_counts [num_slots]         how many pending columns are valid (shared by all layers)

Rollback uses the same deferred-commit idea as the recurrent state. Per row, a decode/verify
step sees seq = committed(W-1) ++ pending(p) ++ new(n) and convolves every token of
pending ++ new: the new tokens' outputs are the step's output, the pending tokens' outputs (the
k and v the GDN kernel folds; recomputed here rather than kept per slot) go to a step buffer
[rows, P, C]. The first new token of a verify row is always accepted (drafts follow it), so the
window becomes the last W-1 of committed ++ pending ++ new token 0 and the raw inputs of new
tokens 1..n-1 become the pending columns. After acceptance the engine only sets the pending
count (accepted drafts), so rejected columns are never read again. With `commit=True` (plain
decode) every new input is folded at once and nothing is recorded.

`causal_conv1d_prefill` / `causal_conv1d_decode` are the Triton kernels (one launch each, SiLU
fused); the `_reference` functions are their torch oracles. Both take x as a row view of the
projection output (unit channel stride, any row stride: no copy of the q|k|v columns) and write
the outputs of the new tokens into `out` when the caller passes one (a row slice of the step's
conv-output buffer, so nothing is copied afterwards). The decode conv of a channel tile,
`conv_decode_tile`, is also the epilogue of the projection that produces x (kernels/linear.py,
`ConvDecode`: one launch fewer per GDN layer). Knows nothing about models or the scheduler: rows
are described by cu_seqlens and slot ids.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .device import INTERPRETED
from .launch import dependent_prologue, pdl
from .varlen import into, pad_rows, row_layout

MAX_SPLITS = 64  # programs along a prefill row's tokens (causal_conv1d_prefill)


def _depthwise(window: torch.Tensor, weight: torch.Tensor, num_out: int) -> torch.Tensor:
    """window [B, W-1+L, C], weight [C, W] -> silu(conv) [B, num_out, C] in float32.

    out[t] = sum_j weight[:, j] * window[t + j]: tap W-1 multiplies the newest input.
    """
    taps = weight.shape[1]
    w = weight.float()
    acc = sum(window[:, j:j + num_out].float() * w[:, j] for j in range(taps))
    return F.silu(acc)


def causal_conv1d_prefill_reference(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                                    slot_ids: torch.Tensor, has_initial_state: torch.Tensor,
                                    conv_state: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen prefill. x: [T, C], weight: [C, W]. Reads the slot's window when has_initial_state
    (else zeros), writes the last W-1 inputs back to conv_state[slot]. Returns [T, C] (`out`
    when given: varlen.into)."""
    num_rows = slot_ids.numel()
    width = weight.shape[1]
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, x.shape[0])
    # Select, never multiply: a fresh row must not read whatever its slot's last owner left.
    initial = torch.where(has_initial_state.view(-1, 1, 1), conv_state[slot_ids.long()], 0)
    window = torch.cat([initial.to(x.dtype), pad_rows(x, row, index_in_row, num_rows, max_len)], dim=1)
    result = _depthwise(window, weight, max_len)[row, index_in_row]
    # Final window of row b: inputs at window positions [len_b, len_b + W-1).
    tail = lengths.view(-1, 1) + torch.arange(width - 1, device=x.device).view(1, -1)
    conv_state[slot_ids.long()] = torch.gather(
        window, 1, tail.unsqueeze(-1).expand(-1, -1, window.shape[-1])).to(conv_state.dtype)
    return into(out, result.to(x.dtype))


def causal_conv1d_decode_reference(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                                   slot_ids: torch.Tensor, conv_state: torch.Tensor,
                                   pending_conv: torch.Tensor, pending_counts: torch.Tensor,
                                   commit: bool, out: torch.Tensor | None = None,
                                   pending_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode/verify with deferred commit. x: [T, C] new tokens (1..P+1 per row).

    Returns (out [T, C], pending_out [B, P, C]): silu(conv) of the new tokens, and of row b's p_b
    pending tokens in pending_out[b, :p_b] (entries past p_b are unspecified); each into the
    caller's tensor when given (varlen.into)."""
    num_rows = slot_ids.numel()
    width = weight.shape[1]
    max_pending = pending_conv.shape[1]
    slots = slot_ids.long()
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, x.shape[0])
    counts = pending_counts[slots].long()
    # Per row, the sequence committed(W-1) ++ pending(p) ++ new(n) built by gathering from the
    # concatenation committed ++ pending(P) ++ new(max_len): position m >= W-1+p reads new[m-W+1-p].
    source = torch.cat([conv_state[slots].to(x.dtype), pending_conv[slots].to(x.dtype),
                        pad_rows(x, row, index_in_row, num_rows, max_len)], dim=1)
    m = torch.arange(width - 1 + max_pending + max_len, device=x.device).view(1, -1)
    boundary = (width - 1) + counts.view(-1, 1)
    index = torch.where(m < boundary, m, m - counts.view(-1, 1) + max_pending).clamp(max=source.shape[1] - 1)
    sequence = torch.gather(source, 1, index.unsqueeze(-1).expand(-1, -1, source.shape[-1]))
    # Token t of pending ++ new sees sequence[t .. t+W-1]: pending j is t = j, new token i is t = p+i.
    conv = _depthwise(sequence, weight, max_pending + max_len)                 # [B, P + max_len, C]
    new_out = conv[row, counts[row] + index_in_row]
    # Fold: the committed window becomes the last W-1 columns of committed ++ pending ++ new
    # token 0 (verify: the first fed token is always accepted) or ++ every new token (commit).
    folded = counts + (lengths if commit else 1)
    tail = folded.view(-1, 1) + torch.arange(width - 1, device=x.device).view(1, -1)
    conv_state[slots] = torch.gather(sequence, 1, tail.unsqueeze(-1).expand(-1, -1, sequence.shape[-1])).to(conv_state.dtype)
    if not commit:
        later = index_in_row > 0  # new tokens 1..n-1 (the drafts) become pending columns 0..n-2
        pending_conv[slots[row[later]], index_in_row[later] - 1] = x[later].to(pending_conv.dtype)
    return into(out, new_out.to(x.dtype)), into(pending_out, conv[:, :max_pending].to(x.dtype))


# ----------------------------------------------------------------------------------------------
# Triton kernels: one program per (channel tile, row) touches a row's slot (prefill: its split
# 0; the other splits read only x); it owns its channels of the slot (window, pending columns), so
# the only ordering it needs is its own: every read of the slot's window / pending columns
# happens before the CTA barrier, every write after it. Rows own distinct slots, except pad
# rows, which all point at scratch slot 0.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def _prefill_sequence_at(m, x, conv_state, bos, length, slot, initial_end, offs_c, mask_c, stride_x,
                         C: tl.constexpr, WIDTH: tl.constexpr):
    """Element m [M] of the row's sequence (initial window ++ row) at channels offs_c -> [M, BC] in
    x's dtype: positions < initial_end read the slot's window (initial_end = W-1 with an initial
    state, else 0: the window is then zeros and the slot is never read)."""
    from_x = m >= WIDTH - 1
    in_row = m < WIDTH - 1 + length
    x_val = tl.load(x + (bos + m - (WIDTH - 1))[:, None] * stride_x + offs_c[None, :],
                    mask=(from_x & in_row)[:, None] & mask_c[None, :], other=0.0)
    state_val = tl.load(conv_state + (slot * (WIDTH - 1) + m)[:, None] * C + offs_c[None, :],
                        mask=(m < initial_end)[:, None] & mask_c[None, :], other=0.0)
    return tl.where(from_x[:, None], x_val, state_val.to(x_val.dtype))


# num_splits follows the step's token count: not compile-time (one binary serves every count > 1).
@triton.jit(do_not_specialize=["num_splits"])
def _conv_prefill_kernel(x, weight, out, cu_seqlens, slot_ids, has_initial_state, conv_state,
                         stride_x, stride_out, num_splits,
                         C: tl.constexpr, WIDTH: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, SPLIT_ROWS: tl.constexpr):
    """Program (channel tile, row, split s): the row's token blocks s, s + num_splits, .. of BT
    tokens; out[t] = silu(sum_j w[:, j] * seq[t + j]) over seq = initial(W-1) ++ row. Only block
    0 reads the slot's window (its tokens < W-1), so split 0 alone then writes the last W-1
    entries of seq as the new window, after its own reads. Without SPLIT_ROWS (num_splits = 1)
    the loop is the unsplit kernel's, with a compile-time step: on the split loop, one program a
    row ran 1.3-1.6x slower than that kernel on the same grid (H100,
    bench/results/conv_prefill_ab-h100.json; the cause not isolated)."""
    i_c, row, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + row).to(tl.int64)
    length = tl.load(cu_seqlens + row + 1).to(tl.int64) - bos
    slot = tl.load(slot_ids + row).to(tl.int64)
    initial_end = (WIDTH - 1) * tl.load(has_initial_state + row).to(tl.int32)
    offs_c = i_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    if SPLIT_ROWS:
        first, step = split * BT, num_splits * BT
    else:
        first, step = 0, BT
    for start in range(first, length, step):
        offs_t = start + tl.arange(0, BT)
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            w_j = tl.load(weight + offs_c * WIDTH + j, mask=mask_c, other=0.0).to(tl.float32)
            seq = _prefill_sequence_at(offs_t + j, x, conv_state, bos, length, slot, initial_end, offs_c, mask_c,
                                       stride_x, C, WIDTH)
            acc += seq.to(tl.float32) * w_j[None, :]
        tl.store(out + (bos + offs_t)[:, None] * stride_out + offs_c[None, :], _silu(acc).to(out.dtype.element_ty),
                 mask=(offs_t < length)[:, None] & mask_c[None, :])
    if split == 0:
        offs_w = tl.arange(0, BW)
        window = _prefill_sequence_at(length + offs_w, x, conv_state, bos, length, slot, initial_end, offs_c,
                                      mask_c, stride_x, C, WIDTH)
        tl.debug_barrier()
        tl.store(conv_state + (slot * (WIDTH - 1) + offs_w)[:, None] * C + offs_c[None, :],
                 window.to(conv_state.dtype.element_ty), mask=(offs_w < WIDTH - 1)[:, None] & mask_c[None, :])


def _check_causal_conv1d_prefill_args(x, weight, cu_seqlens, slot_ids, has_initial_state, conv_state) -> None:
    _check_conv_args(x, weight, cu_seqlens, slot_ids, conv_state)
    assert has_initial_state.shape == (slot_ids.numel(),) and has_initial_state.dtype == torch.bool, \
        "has_initial_state: [B] bool"


def prefill_splits(num_tokens: int, num_rows: int, block_t: int) -> int:
    """Programs along each row's tokens: its blocks of block_t tokens in parallel, not one program
    looping over the row, whose few channel tiles would keep a handful of SMs busy (the shipped
    model's 768 channels: 6 programs, ~30 us whatever the prompt; H100 in
    bench/results/conv_prefill_ab-h100.json). As many as an average row has blocks (at most
    MAX_SPLITS): a longer row's splits loop, a shorter row's extra ones exit at once, and a batch
    of short rows keeps one program per row, as many as there is work for."""
    return max(1, min(triton.cdiv(num_tokens, num_rows * block_t), MAX_SPLITS))


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor,
                          has_initial_state: torch.Tensor, conv_state: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton causal_conv1d_prefill_reference. x [T, C] and out (optional) [T, C] with unit
    channel stride, any row stride; weight [C, W], conv_state [S, W-1, C] contiguous;
    has_initial_state bool [B]."""
    _check_causal_conv1d_prefill_args(x, weight, cu_seqlens, slot_ids, has_initial_state, conv_state)
    channels = x.shape[1]
    width = weight.shape[1]
    num_rows = slot_ids.numel()
    out = _conv_output(x, out)
    if num_rows == 0:
        return out
    block_c = min(128, triton.next_power_of_2(channels))
    block_t = 16 if INTERPRETED else 64
    splits = prefill_splits(x.shape[0], num_rows, block_t)
    grid = (triton.cdiv(channels, block_c), num_rows, splits)
    _conv_prefill_kernel[grid](x, weight, out, cu_seqlens, slot_ids, has_initial_state.view(torch.uint8), conv_state,
                               x.stride(0), out.stride(0), splits, C=channels, WIDTH=width,
                               BW=triton.next_power_of_2(width - 1), BT=block_t, BC=block_c, SPLIT_ROWS=splits > 1,
                               num_warps=4)
    return out


@triton.jit
def _decode_sequence_at(m, x, conv_state, pending_conv, bos, num_new, slot, num_pending, offs_c, mask_c, stride_x,
                        C: tl.constexpr, WIDTH: tl.constexpr, P: tl.constexpr):
    """Element m [M] of the row's sequence committed(W-1) ++ pending(p) ++ new(n) at channels
    offs_c -> [M, BC] in x's dtype."""
    committed = m < WIDTH - 1
    pending = ~committed & (m < WIDTH - 1 + num_pending)
    new = m - (WIDTH - 1) - num_pending
    from_x = (new >= 0) & (new < num_new)
    x_val = tl.load(x + (bos + new)[:, None] * stride_x + offs_c[None, :],
                    mask=from_x[:, None] & mask_c[None, :], other=0.0)
    state_val = tl.load(conv_state + (slot * (WIDTH - 1) + m)[:, None] * C + offs_c[None, :],
                        mask=committed[:, None] & mask_c[None, :], other=0.0)
    pending_val = tl.load(pending_conv + (slot * P + m - (WIDTH - 1))[:, None] * C + offs_c[None, :],
                          mask=pending[:, None] & mask_c[None, :], other=0.0)
    return tl.where(committed[:, None], state_val.to(x_val.dtype),
                    tl.where(pending[:, None], pending_val.to(x_val.dtype), x_val))


@triton.jit
def conv_decode_tile(x, weight, out, pending_out, cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts,
                     stride_x, stride_out, row, offs_c, mask_c,
                     C: tl.constexpr, WIDTH: tl.constexpr, P: tl.constexpr, BW: tl.constexpr,
                     BT: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, COMMIT: tl.constexpr):
    """Row `row`'s conv at channels offs_c [BC] (mask_c: those < C). Token t of pending(p) ++ new(n)
    (t < p + n <= 2P + 1 <= BT) sees seq[t .. t + W-1]; pending tokens' outputs go to
    pending_out[row, t], new tokens' to out. The window becomes seq[f .. f + W-1) with f = p + 1
    (verify: new token 0 is committed) or p + n (commit); in verify the inputs of new tokens
    1..n-1 become pending columns [0, n-1). All reads of the slot precede the barrier, all writes
    follow it."""
    bos = tl.load(cu_seqlens + row).to(tl.int64)
    num_new = tl.load(cu_seqlens + row + 1).to(tl.int64) - bos
    slot = tl.load(slot_ids + row).to(tl.int64)
    num_pending = tl.minimum(tl.load(pending_counts + slot), P).to(tl.int64)
    offs_t = tl.arange(0, BT)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        w_j = tl.load(weight + offs_c * WIDTH + j, mask=mask_c, other=0.0).to(tl.float32)
        seq = _decode_sequence_at(offs_t + j, x, conv_state, pending_conv, bos, num_new, slot,
                                  num_pending, offs_c, mask_c, stride_x, C, WIDTH, P)
        acc += seq.to(tl.float32) * w_j[None, :]
    y = _silu(acc)
    tl.store(pending_out + (row * P + offs_t)[:, None] * C + offs_c[None, :], y.to(pending_out.dtype.element_ty),
             mask=(offs_t < num_pending)[:, None] & mask_c[None, :])
    new = offs_t - num_pending
    tl.store(out + (bos + new)[:, None] * stride_out + offs_c[None, :], y.to(out.dtype.element_ty),
             mask=((new >= 0) & (new < num_new))[:, None] & mask_c[None, :])
    if COMMIT:
        fold = num_pending + num_new
    else:
        fold = num_pending + 1
    offs_w = tl.arange(0, BW)
    window = _decode_sequence_at(fold + offs_w, x, conv_state, pending_conv, bos, num_new, slot, num_pending,
                                 offs_c, mask_c, stride_x, C, WIDTH, P)
    if not COMMIT:
        offs_i = tl.arange(0, BN)
        # a row never carries more than P drafts; guard the buffer anyway
        mask_drafts = ((offs_i < num_new - 1) & (offs_i < P))[:, None] & mask_c[None, :]
        drafts = tl.load(x + (bos + 1 + offs_i)[:, None] * stride_x + offs_c[None, :], mask=mask_drafts, other=0.0)
    tl.debug_barrier()
    tl.store(conv_state + (slot * (WIDTH - 1) + offs_w)[:, None] * C + offs_c[None, :],
             window.to(conv_state.dtype.element_ty), mask=(offs_w < WIDTH - 1)[:, None] & mask_c[None, :])
    if not COMMIT:
        tl.store(pending_conv + (slot * P + offs_i)[:, None] * C + offs_c[None, :],
                 drafts.to(pending_conv.dtype.element_ty), mask=mask_drafts)


@triton.jit
def _conv_decode_kernel(x, weight, out, pending_out, cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts,
                        stride_x, stride_out,
                        C: tl.constexpr, WIDTH: tl.constexpr, P: tl.constexpr, BW: tl.constexpr,
                        BT: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, COMMIT: tl.constexpr,
                        DEPENDENT_LAUNCH: tl.constexpr):
    """Program (channel tile, row): conv_decode_tile."""
    dependent_prologue(DEPENDENT_LAUNCH)
    i_c, row = tl.program_id(0), tl.program_id(1)
    offs_c = i_c * BC + tl.arange(0, BC)
    conv_decode_tile(x, weight, out, pending_out, cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts,
                     stride_x, stride_out, row, offs_c, offs_c < C, C, WIDTH, P, BW, BT, BN, BC, COMMIT)


def _check_causal_conv1d_decode_args(x, weight, cu_seqlens, slot_ids, conv_state, pending_conv,
                                     pending_counts) -> None:
    _check_conv_args(x, weight, cu_seqlens, slot_ids, conv_state)
    num_slots, channels = conv_state.shape[0], x.shape[1]
    assert pending_conv.shape == (num_slots, pending_conv.shape[1], channels) and pending_conv.is_contiguous(), \
        "pending_conv: contiguous [S, P, C]"
    assert pending_counts.shape == (num_slots,) and pending_counts.dtype == torch.int32, "pending_counts: [S] int32"


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor,
                         conv_state: torch.Tensor, pending_conv: torch.Tensor, pending_counts: torch.Tensor,
                         commit: bool, out: torch.Tensor | None = None,
                         pending_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton causal_conv1d_decode_reference. x [T, C] (1..P+1 tokens per row) and out
    (optional) [T, C] with unit channel stride, any row stride; pending_conv [S, P, C] (P may be
    0) and pending_counts [S] int32 contiguous; pending_out (optional) contiguous [B, P, C]."""
    _check_causal_conv1d_decode_args(x, weight, cu_seqlens, slot_ids, conv_state, pending_conv, pending_counts)
    channels = x.shape[1]
    num_rows = slot_ids.numel()
    out = _conv_output(x, out)
    pending_out = _pending_output(x, slot_ids, pending_conv, pending_out)
    if num_rows == 0:
        return out, pending_out
    block_c = min(256, triton.next_power_of_2(channels))
    grid = (triton.cdiv(channels, block_c), num_rows)
    _conv_decode_kernel[grid](x, weight, out, pending_out, cu_seqlens, slot_ids, conv_state, pending_conv,
                              pending_counts, x.stride(0), out.stride(0), BC=block_c,
                              **decode_tile_constants(*weight.shape, pending_conv.shape[1], commit), num_warps=4,
                              **pdl(x.device))
    return out, pending_out


def decode_tile_constants(channels: int, width: int, max_pending: int, commit: bool) -> dict:
    """conv_decode_tile's compile-time arguments: C channels, a conv of `width` taps, P pending
    columns."""
    return dict(C=channels, WIDTH=width, P=max_pending, BW=triton.next_power_of_2(width - 1),
                BT=triton.next_power_of_2(2 * max_pending + 1), BN=triton.next_power_of_2(max(max_pending, 1)),
                COMMIT=commit)


def check_conv_decode_args(x: torch.Tensor, conv: ConvDecode) -> None:
    """causal_conv1d_decode's checks of its arguments and outputs, for a launch that runs the
    conv in another kernel's epilogue (x: the columns it reads)."""
    _check_causal_conv1d_decode_args(x, conv.weight, conv.cu_seqlens, conv.slot_ids, conv.conv_state,
                                     conv.pending_conv, conv.pending_counts)
    _conv_output(x, conv.out)
    _pending_output(x, conv.slot_ids, conv.pending_conv, conv.pending_out)


class ConvDecode(NamedTuple):
    """causal_conv1d_decode of the first C = weight.shape[0] columns of a projection's output, run
    by the projection itself (kernels/linear.py): the arguments after x, with both outputs the
    caller's (out [T, C] unit channel stride, pending_out contiguous [B, P, C])."""
    weight: torch.Tensor
    cu_seqlens: torch.Tensor
    slot_ids: torch.Tensor
    conv_state: torch.Tensor
    pending_conv: torch.Tensor
    pending_counts: torch.Tensor
    commit: bool
    out: torch.Tensor
    pending_out: torch.Tensor


def _pending_output(x: torch.Tensor, slot_ids: torch.Tensor, pending_conv: torch.Tensor,
                    pending_out: torch.Tensor | None) -> torch.Tensor:
    """The decode launcher's pending-token outputs: a fresh [B, P, C], or the caller's."""
    shape = (slot_ids.numel(), pending_conv.shape[1], x.shape[1])
    if pending_out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    assert pending_out.shape == shape and pending_out.dtype == x.dtype and pending_out.is_contiguous(), \
        f"pending_out: contiguous {shape} in x's dtype"
    return pending_out


def _conv_output(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The launchers' output: a fresh [T, C], or the caller's view (which must not overlap x:
    a program reads the inputs of its row's other tokens after storing outputs)."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device, "out: x's shape and dtype"
    assert out.stride(1) == 1, "out: unit channel stride"
    return out


def _check_conv_args(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor,
                     conv_state: torch.Tensor) -> None:
    """The arguments both launchers take."""
    channels, width = weight.shape
    assert x.dim() == 2 and x.shape[1] == channels, "x: [T, C]"
    assert x.stride(1) == 1, "x: unit channel stride (any row stride: e.g. the q|k|v columns of the projection)"
    assert weight.is_contiguous() and width >= 2, "weight: contiguous [C, W], W >= 2"
    assert conv_state.shape[1:] == (width - 1, channels) and conv_state.is_contiguous(), \
        "conv_state: contiguous [S, W-1, C]"
    assert cu_seqlens.dtype == torch.int32 and slot_ids.dtype == torch.int32, "cu_seqlens, slot_ids: int32"
    assert cu_seqlens.shape == (slot_ids.numel() + 1,) and cu_seqlens.is_contiguous() and slot_ids.is_contiguous(), \
        "cu_seqlens [B+1], slot_ids [B]: contiguous"
