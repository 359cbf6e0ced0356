"""All-reduce + residual add + RMSNorm of a tensor-parallel block's output in one kernel.

Under tensor parallelism each rank holds a partial sum x_r [T, H] of a row-parallel block
(mixer, MLP), and the next op is always the fused residual add + RMSNorm (kernels/norms.py). For
decode-size messages this kernel does copy + all-reduce + add + norm in one launch, through
symmetric memory (a buffer of every rank mapped into every peer's address space):

    1. copy this rank's rows of x into its own buffer;
    2. meet the peers at a barrier (this program and the same program of every peer);
    3. per row: s = sum_r x_r read from every rank's buffer (float32, in rank order, rounded once
       to x's dtype: every rank gets the same bits, and at two ranks the one correctly rounded
       addition NCCL makes), then rms_norm(s, weight, eps, residual) exactly as norms.py;
    4. meet the peers again: no rank leaves before every peer has read its buffer, so the next
       launch (the next layer's, the next CUDA graph replay) may overwrite it at once.

The barrier is blockwise over the signal pads of torch's symmetric memory: slot [program, peer]
of a rank's pad is peer's flag for this program. A program's threads 0..tp-1 each set their
flag in peer t's pad (compare-and-swap 0 -> 1, system-scope release: spins until the peer has
consumed the last one) and consume peer t's flag in its own pad (1 -> 0, acquire), between two
__syncthreads. The pads return to zero at every barrier, so barriers pair up over any number of
launches and graph replays with no host work, and this kernel shares the pads with torch's
one_shot/two_shot kernels (the same layout): a dead peer's stand-in writes
(engine/symmetric_all_reduce.py) release this kernel's barriers too. No multicast or multimem op.

Without signal pads the kernel runs one rank alone with its peers' rows already in their buffers
(the interpreter's test on the CPU: there is no peer to meet). Knows nothing about process
groups or models: the caller gives the buffers' and pads' addresses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import num_sms
from .launch import dependent_prologue, pdl
from .norms import add_rms_normalize, check_rms_norm_args, rms_norm_reference


def all_reduce_rms_norm_reference(partials: torch.Tensor, weight: torch.Tensor, eps: float,
                                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """partials [tp, T, H]: every rank's x. The sum over ranks in float32, in rank order, rounded
    to x's dtype, then rms_norm_reference with the residual. Returns (normed, new_residual)."""
    summed = partials[0].float()
    for part in partials[1:]:
        summed = summed + part.float()
    return rms_norm_reference(summed.to(partials.dtype), weight, eps, residual)


# One asm block per thread (scalar operands: executed once by every thread of the program, whatever
# layout Triton picks for tensors). Thread t < tp meets peer t: its pointer table entries, then
# the flag this rank sends (peer t's pad, slot [block, rank]) and the one it waits for (own pad,
# slot [block, t]). Labels and registers are scoped by the braces (the block appears twice).
_MEET_PEERS_ASM = tl.constexpr("""
{
    .reg .u32 %t, %slot, %old;
    .reg .u64 %entry, %send, %wait, %bytes;
    .reg .pred %idle, %again;
    mov.u32 %t, %tid.x;
    setp.ge.u32 %idle, %t, $4;
    @%idle bra meet_done;
    mul.wide.u32 %entry, %t, 8;
    add.u64 %entry, %entry, $1;
    ld.global.u64 %send, [%entry];
    mul.wide.u32 %entry, $3, 8;
    add.u64 %entry, %entry, $1;
    ld.global.u64 %wait, [%entry];
    mad.lo.u32 %slot, $2, $4, $3;
    mul.wide.u32 %bytes, %slot, 4;
    add.u64 %send, %send, %bytes;
    mad.lo.u32 %slot, $2, $4, %t;
    mul.wide.u32 %bytes, %slot, 4;
    add.u64 %wait, %wait, %bytes;
meet_send:
    atom.global.release.sys.cas.b32 %old, [%send], 0, 1;
    setp.ne.u32 %again, %old, 0;
    @%again bra meet_send;
meet_wait:
    atom.global.acquire.sys.cas.b32 %old, [%wait], 1, 0;
    setp.ne.u32 %again, %old, 1;
    @%again bra meet_wait;
meet_done:
    mov.u32 $0, 0;
}
""")


@triton.jit
def _meet_peers(signal_pads, block, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Program `block` of every rank meets here. Every access a thread of this program made
    before is visible to the peers' programs after, and theirs to this program's threads
    (__syncthreads, then release / acquire at system scope, then __syncthreads)."""
    tl.debug_barrier()
    tl.inline_asm_elementwise(_MEET_PEERS_ASM, "=r,l,r,r,r",
                              [signal_pads, block, tl.full([], RANK, tl.int32), tl.full([], WORLD_SIZE, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit(do_not_specialize=["num_rows"])
def _all_reduce_rms_norm_kernel(x, residual, weight, out, residual_out, buffers, signal_pads, num_rows, stride_x,
                                stride_residual, eps, H: tl.constexpr, BH: tl.constexpr, RANK: tl.constexpr,
                                WORLD_SIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, MEET: tl.constexpr,
                                DEPENDENT_LAUNCH: tl.constexpr):
    """Rows pid, pid + programs, ...: each rank's buffer holds its x as [rows, H]. buffers,
    signal_pads: int64 [tp] addresses (this process's view of every rank's buffer and pad)."""
    dependent_prologue(DEPENDENT_LAUNCH)
    pid = tl.program_id(0)
    first, step = pid.to(tl.int64), tl.num_programs(0).to(tl.int64)  # 64-bit row offsets
    offs = tl.arange(0, BH)
    mask = offs < H
    # Buffers start 16-byte aligned and rows are whole 16-byte words (the launcher checks): vector
    # loads and stores, which Triton cannot prove for an address read from memory.
    own = tl.multiple_of(tl.load(buffers + RANK).to(tl.pointer_type(x.dtype.element_ty)), 16)
    for row in range(first, num_rows, step):
        tl.store(own + row * H + offs, tl.load(x + row * stride_x + offs, mask=mask), mask=mask)
    if MEET:
        _meet_peers(signal_pads, pid, RANK, WORLD_SIZE)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(first, num_rows, step):
        h = tl.zeros([BH], dtype=tl.float32)
        for peer in tl.static_range(WORLD_SIZE):
            if peer == RANK:  # this rank's term straight from x: the bits its buffer holds
                part = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
            else:
                peer_buffer = tl.multiple_of(tl.load(buffers + peer).to(tl.pointer_type(x.dtype.element_ty)), 16)
                part = tl.load(peer_buffer + row * H + offs, mask=mask, other=0.0)
            h += part.to(tl.float32)
        h = h.to(out.dtype.element_ty)  # the all-reduced message, as an all-reduce hands it over
        if not HAS_RESIDUAL:  # the new residual stream is the sum itself (with one, s + residual)
            tl.store(residual_out + row * H + offs, h, mask=mask)
        normed = add_rms_normalize(h, residual + row * stride_residual, residual_out + row * H, w, offs, mask, eps, H,
                                   HAS_RESIDUAL)
        tl.store(out + row * H + offs, normed.to(out.dtype.element_ty), mask=mask)
    if MEET:
        _meet_peers(signal_pads, pid, RANK, WORLD_SIZE)


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, buffers: torch.Tensor,
                signal_pads: torch.Tensor | None, rank: int, capacity: int) -> None:
    check_rms_norm_args(x, weight, residual, 0)
    assert 0 < x.numel() <= capacity, f"x: 1 to {capacity} elements (the buffers' size), got {x.numel()}"
    assert x.shape[1] * x.element_size() % 16 == 0, "x: rows of whole 16-byte words (vector access to the buffers)"
    assert buffers.dtype == torch.int64 and buffers.dim() == 1 and 0 <= rank < buffers.numel(), \
        "buffers: int64 [tp] addresses, rank < tp"
    assert signal_pads is None or (signal_pads.dtype == torch.int64 and signal_pads.shape == buffers.shape), \
        "signal_pads: int64 [tp] addresses, or None"
    assert buffers.device == x.device and (signal_pads is None or signal_pads.device == x.device), \
        "buffers, signal_pads: address tables on x's device"


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                        buffers: torch.Tensor, signal_pads: torch.Tensor | None, rank: int, capacity: int,
                        num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(sum of every rank's x, weight, eps, residual) -> (normed, new_residual), as
    all_reduce_rms_norm_reference; collective: every rank calls it with its x of the same shape.
    buffers: int64 [tp], the address of every rank's buffer of `capacity` elements of x's dtype
    in this process; signal_pads: int64 [tp], every rank's signal pad (None: no barrier, one rank
    alone, its peers' rows already in their buffers); num_slots: the pads' slots per rank. One
    program per row, at most one per pad slot (each meets its peers on its own) and per SM (all
    must be resident at once: a program spinning at the barrier holds its SM)."""
    _check_args(x, weight, residual, buffers, signal_pads, rank, capacity)
    num_rows, hidden = x.shape
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out)
    block = triton.next_power_of_2(hidden)
    _all_reduce_rms_norm_kernel[(min(num_rows, num_slots, num_sms(x.device)),)](
        x, residual if residual is not None else x, weight, out, new_residual, buffers,
        signal_pads if signal_pads is not None else buffers, num_rows, x.stride(0),
        residual.stride(0) if residual is not None else 0, eps, H=hidden, BH=block, RANK=rank,
        WORLD_SIZE=buffers.numel(), HAS_RESIDUAL=residual is not None, MEET=signal_pads is not None,
        num_warps=min(16, max(1, block // 512)), **pdl(x.device))
    return out, new_residual
