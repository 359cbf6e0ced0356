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
