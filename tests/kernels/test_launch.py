"""Launch options (kernels/launch.py): when a skinny GEMM prefetches its weight before the PDL wait."""

import pytest
import torch

from deltaspec.kernels import launch


@pytest.fixture
def dependent(monkeypatch):
    """A device with programmatic dependent launch (an sm_90 GPU), prefetch setting unread."""
    monkeypatch.setattr(launch, "dependent_launch", lambda device: True)
    launch.prefetch_weights.cache_clear()
    yield monkeypatch
    launch.prefetch_weights.cache_clear()


def test_prefetch_needs_dependent_launch():
    weight = torch.empty(64, 128, dtype=torch.bfloat16)
    assert launch.pdl_prefetch(torch.device("cpu"), weight)["PREFETCH"] is False  # no PDL on the CPU


def test_prefetch_needs_16_byte_aligned_rows(dependent):
    device = torch.device("cpu")
    storage = torch.empty(64 * 136, dtype=torch.bfloat16)
    aligned = storage[:64 * 128].view(64, 128)                   # rows of 256 bytes from an aligned start
    assert launch.pdl_prefetch(device, aligned) == {"DEPENDENT_LAUNCH": True, "launch_pdl": True, "PREFETCH": True}
    assert not launch.pdl_prefetch(device, storage[1:1 + 64 * 128].view(64, 128))["PREFETCH"]  # start off by 2 B
    assert launch.pdl_prefetch(device, storage.view(64, 136)[:, :100])["PREFETCH"]              # 272-byte rows
    assert not launch.pdl_prefetch(device, storage[:63 * 132].view(63, 132)[:, :128])["PREFETCH"]  # 264-byte rows


def test_prefetch_can_be_turned_off(dependent):
    dependent.setenv("DELTASPEC_PREFETCH_WEIGHTS", "0")
    launch.prefetch_weights.cache_clear()
    weight = torch.empty(64, 128, dtype=torch.bfloat16)
    assert launch.pdl_prefetch(torch.device("cpu"), weight) == {"DEPENDENT_LAUNCH": True, "launch_pdl": True,
                                                                 "PREFETCH": False}
