"""What launchers ask of the device: whether Triton interprets the kernels, how many SMs the GPU
has, and whether it can launch a kernel that waits on-chip for its predecessor (launch.py).
Knows nothing about any kernel.

Launchers pick tiles and size grids from these facts and from tensor shapes, never from tensor
values, so their choices replay inside CUDA graphs.
"""

from __future__ import annotations

import os
from functools import cache

import torch

# Triton runs every kernel in its interpreter (NumPy on CPU tensors: the tests without a GPU) when
# TRITON_INTERPRET=1 as the kernel modules are imported; launchers then take small tiles.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (what grids are sized against). Any other device
    runs the kernels in the interpreter, which gets a small machine of 4: grids stay tiny there,
    yet a launcher that splits work across SMs (long attention contexts) still splits."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@cache
def supports_dependent_launch(device: torch.device) -> bool:
    """Grid dependency control (griddepcontrol: sm_90 and newer), which programmatic dependent
    launch needs; never under the interpreter."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device) >= (9, 0)


def resident_programs(kernel, device: torch.device) -> int:
    """How many programs of a compiled Triton kernel (what `warmup` returns) one SM of `device`
    holds at once: the least of what its threads, registers (allocated per warp in units of 256)
    and shared memory (plus the 1 KB the driver reserves per block) allow, and 32 blocks."""
    if getattr(kernel, "n_regs", None) is None:
        kernel._init_handles()   # a warmed-up kernel learns its registers when loaded
    properties = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    registers_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    shared = kernel.metadata.shared + 1024
    return min(properties.max_threads_per_multi_processor // (32 * warps),
               properties.regs_per_multiprocessor // max(1, registers_per_warp * warps),
               properties.shared_memory_per_multiprocessor // shared,
               32)
