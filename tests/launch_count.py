"""Counting the device launches of a step on the CPU, where there is no profiler to ask.

A CUDA step's launches are its Triton kernels plus the torch ops that run a device kernel of
their own (elementwise ops, reductions, copies, fills, cuBLAS GEMMs). On the CPU the Triton table
runs in the interpreter, so `count_launches` counts (a) every interpreted Triton launch, by
kernel name, and (b) every aten op dispatched outside a Triton launch, less those that launch
nothing on a GPU (allocations, views, no-op conversions: `launches_a_kernel`). A cuBLAS GEMM
counts as one (cuBLAS may add a split-K reduce kernel on the GPU: bench/profile_step.py counts
the real launches there). Knows nothing about models; the tests decide what a step is.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

aten = torch.ops.aten

# Allocations: no kernel on a GPU (a fill such as zeros does launch one).
ALLOCATIONS = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (list, tuple)) else []


def launches_a_kernel(func, args, out) -> bool:
    """Whether aten op `func` (called on args, returning out) runs a kernel on a GPU: an op that
    writes elements does; one that only allocates, whose output is empty, or whose output
    aliases an input (a view, a no-op conversion or contiguous) does not."""
    outputs = _tensors(out)
    if func.overloadpacket in ALLOCATIONS or not any(t.numel() for t in outputs):
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return True
    inputs = {t.untyped_storage().data_ptr() for a in args for t in _tensors(a)}
    return not any(t.untyped_storage().data_ptr() in inputs for t in outputs)


class Launches(TorchDispatchMode):
    """What ran while active: `kernels` (Triton, by name) and `torch_ops` (aten ops that launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: collections.Counter = collections.Counter()
        self.torch_ops: collections.Counter = collections.Counter()
        self.inside_kernel = 0

    @property
    def total(self) -> int:
        return sum(self.kernels.values()) + sum(self.torch_ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside_kernel and launches_a_kernel(func, args, out):
            self.torch_ops[func.overloadpacket.__name__] += 1
        return out


@contextmanager
def count_launches() -> Iterator[Launches]:
    """Count the launches of what runs inside (TRITON_INTERPRET=1: the CPU suite's mode)."""
    launches = Launches()
    run = InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches.kernels[self.fn.__name__] += 1
        launches.inside_kernel += 1   # the interpreter's own torch ops are the kernel's
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            launches.inside_kernel -= 1

    InterpretedFunction.run = counted
    try:
        with launches:
            yield launches
    finally:
        InterpretedFunction.run = run
