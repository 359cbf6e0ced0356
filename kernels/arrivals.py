"""The "last arriver" pattern, for kernels whose programs must combine work without a second
launch or a grid-wide barrier (linear.py: split-K partial sums).

Each of a group of programs does its part, then `last_to_arrive` bumps the group's counter; the
one that sees the count reach the group size knows every other member's memory effects are
visible to it, does the group's final work, and calls `reset_arrivals`, so the counters are zero
again between launches (launches of one stream never overlap). `store_split_k` is the pattern's
split-K end for the GEMMs that need nothing else of it (fp8.py, wna16.py). Knows nothing about
what the groups compute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def last_to_arrive(counter, group_size):
    """Count this program in at `counter`; true for exactly one program of the group, the last.

    The CTA barrier orders every thread's prior loads and stores before the atomic, which is
    acq_rel at gpu scope: the last arriver's later loads see the others' stores (the pattern of
    CUTLASS's split-K semaphore: __syncthreads, then one release by the CTA)."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1) == group_size - 1


@triton.jit
def reset_arrivals(counter):
    """The last arriver puts its group's counter back to zero for the next launch."""
    tl.store(counter, 0)


@triton.jit
def store_split_k(acc, y_ptrs, mask, partials, tile, partial_size, pid_k, counter, SPLIT_K: tl.constexpr):
    """The end of a split-K GEMM program holding its fp32 sum `acc` over its share of K (any
    tile shape; y_ptrs, mask and tile alike): with one split, acc is the tile, stored at
    y_ptrs in their dtype. Otherwise the program stores acc as its partial, at
    partials + pid_k * partial_size + tile, and counts in at `counter` (one per output tile);
    the tile's last arriver adds the SPLIT_K partials in split order (so the sum is the same
    whichever program arrives last) and stores it at y_ptrs."""
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(partials + pid_k.to(tl.int64) * partial_size + tile, acc, mask=mask)
        if last_to_arrive(counter, SPLIT_K):
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other SMs' stores are, never a stale L1 line
                total += tl.load(partials + s * partial_size + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
            reset_arrivals(counter)


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counters (at least `size`), kept at zero between launches by the kernels
    themselves. One buffer per device, shared by every kernel and layer: launches on one stream
    run one after another, and each leaves its counters at zero. Grows outside CUDA-graph
    capture only (warm up first)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = _ARRIVALS.get(device)
    if buffer is None or buffer.numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("arrival counters must be sized before CUDA-graph capture; "
                               "run the largest batch once eagerly first")
        buffer = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        _ARRIVALS[device] = buffer
    return buffer

