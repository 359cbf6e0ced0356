"""Fixtures shared by the kernel tests of this folder (tests/conftest.py sets up the interpreter,
`kernel_device` and the `gpu` marker for every test).

`poisoned_empty`: the MoE and sampling launchers run with `torch.empty` returning
garbage (NaN for floats, a large negative number for integers). test_gdn_chunked.py overrides it
with its own, which poisons float buffers only.
"""

from __future__ import annotations

import pytest
import torch


INT_POISON = -(2 ** 30) + 7


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns garbage-filled tensors while a kernel launcher runs."""
    empty = torch.empty

    def garbage_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        if x.dtype == torch.bool:
            return x
        return x.fill_(float("nan") if x.is_floating_point() else INT_POISON)

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "empty", garbage_empty)
            return fn(*args, **kwargs)

    return run
