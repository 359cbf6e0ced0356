"""Programs of one launch that combine their work without a second launch: the "last arriver"
pattern (linear.py: split-K partial sums) and a group barrier (attention.py: the split merge).

Each of a group of programs does its part, then `last_to_arrive` bumps the group's counter; the
one that sees the count reach the group size knows every other member's memory effects are
visible to it, does the group's final work, and calls `reset_arrivals`, so the counters are zero
again between launches (launches of one stream never overlap).

`wait_for_group` is the barrier form, for work that the whole group shares out once every part
is done: each member counts in and spins until the group has, then does its share, then
`leave_group` counts it out, and the last to leave zeroes the counter (no member can still be
spinning by then). Spinning programs hold their SMs, so a launch may use it only when every
program of the grid is resident at once (device.py, resident_programs): a member that never
got an SM would never count in. Knows nothing about what the groups compute.
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
def wait_for_group(counter, group_size):
    """Count this program in at `counter` and spin until all group_size members have: then every
    member's prior stores are visible to this program's later loads from L2 (.cg). The CTA
    barriers order the threads' stores before the release and their later loads after the
    acquire (CUTLASS's semaphore: __syncthreads around one thread's atomics). The spin reads the
    counter with volatile loads, which L2 serves side by side; atomics on one address queue one
    behind another, so spinning by atomics would delay the members still counting in."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1
    while arrived < group_size:
        arrived = tl.load(counter, volatile=True)
    tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def leave_group(counter, group_size):
    """After wait_for_group: count this program out; the last of the group to leave zeroes the
    counter for the next launch (the count runs group_size .. 2 group_size - 1 while members
    leave, so none still spinning can miss the group being complete)."""
    if tl.atomic_add(counter, 1, sem="relaxed", scope="gpu") == 2 * group_size - 1:
        tl.store(counter, 0)


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

