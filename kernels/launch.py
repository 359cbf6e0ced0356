"""Launch options the launchers share: programmatic dependent launch (PDL) of the decode-path
kernels, on sm_90 and newer, and tl.dot's input precision by activation dtype.

A step is a long chain of small kernels (a 0.8B model's batch-1 decode step: ~250 launches of a
few microseconds each; measured: bench/results/profile-h100.json), so the gap between one
kernel's end and the next one's start is a real share of it. A kernel launched with
`**pdl(device)` may be scheduled while its predecessor still runs: its programs start with
`dependent_prologue`, which waits on-chip (griddepcontrol.wait) until the predecessor grid has
finished and its stores are visible, and then lets its own successor launch. The wait comes
before any memory access to what a step writes, so a dependent kernel orders exactly like a plain
one (reads after the predecessor's writes, writes after its reads). What a kernel may touch before
the wait is memory no kernel of a step ever writes, the weights: `prefetch_l2` pulls them into L2
while the predecessor still runs (the skinny GEMMs, kernels/linear.py; its one-row form loads
its share into registers there), so that a step streams weights across kernel boundaries
instead of starting each kernel's stream cold. A predecessor
that never signals (a cuBLAS GEMM, the interpreter) simply completes first. Knows nothing about
what the kernels compute.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

from .device import supports_dependent_launch


@cache
def dependent_launch(device: torch.device) -> bool:
    """PDL where the device supports it (device.py); DELTASPEC_DEPENDENT_LAUNCH=0 turns it off
    (debugging, A/B timing)."""
    return os.environ.get("DELTASPEC_DEPENDENT_LAUNCH", "1") != "0" and supports_dependent_launch(device)


def pdl(device: torch.device) -> dict:
    """Launch options of a kernel that starts with dependent_prologue(DEPENDENT_LAUNCH)."""
    dependent = dependent_launch(device)
    return {"DEPENDENT_LAUNCH": dependent, "launch_pdl": dependent}


@triton.jit
def dependent_prologue(DEPENDENT_LAUNCH: tl.constexpr):
    """First statement of a PDL kernel: wait for the predecessor grid, then let the successor
    launch (after the wait, so at most one kernel's programs sit waiting at a time)."""
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding `ptrs` (any shape; one prefetch per element), without
    waiting for them or holding registers: on the GPU only (inline PTX; callers guard it with
    DEPENDENT_LAUNCH, which the interpreter never sets)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for activations of `dtype`: fp32 stays exact fp32 ("ieee", no
    tf32); otherwise "tf32", which leaves bf16 / fp16 operands as they are and lets fp32 ones that
    a kernel forms itself (gdn_chunked's inverse) round to tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"
