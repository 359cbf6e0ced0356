"""Shared test fixtures: tiny random checkpoints of each family (built once per session), the
device Triton kernels are tested on, engines on the CPU unless a test names a device, and the
`gpu` marker (skipped without CUDA).

Without CUDA, Triton kernels run under the interpreter on CPU tensors: TRITON_INTERPRET must be
set before any kernel module is imported, hence at the top of this file."""

import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# An engine whose device is "auto" (the default) runs on the CPU in the tests, as in CI, whatever
# the machine has: the GPU tests name their device.
os.environ.setdefault("DELTASPEC_DEVICE", "cpu")

import pytest  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from fixtures import make_checkpoint  # noqa: E402

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family, **options) -> path; identical requests share one directory."""
    cache: dict = {}

    def build(family: str, **options) -> pathlib.Path:
        key = (family, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(family), family, **options)
        return cache[key]

    return build


@pytest.fixture(scope="module", autouse=True)
def _module_caches(request):
    """What a test module caches with functools.lru_cache (LLMs, each with 1 GiB of CPU pools; HF
    models; dequantized checkpoints) is released when its tests are done: caches that lived for
    the session held a dozen engines, 13 GB, by the suite's end."""
    yield
    for value in vars(request.module).values():
        cached_here = getattr(value, "__module__", None) == request.module.__name__
        if cached_here and callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def _gpu_share():
    """bench/gpu_session.sh runs the GPU tests as DELTASPEC_TEST_GPU_SHARDS processes on one GPU.
    An engine sizes its pools from 90% of the device, less what it holds, never more than is free
    when it starts, so the first shards' engines would take what the others then fail to find
    ("not enough memory for the KV pool", out of memory). Each process here sees at most its share of the device as free:
    total / shards less what it already holds."""
    shards = int(os.environ.get("DELTASPEC_TEST_GPU_SHARDS", "1"))
    if shards <= 1 or not torch.cuda.is_available():
        yield
        return
    real = torch.cuda.mem_get_info

    def shared(device=None):
        free, total = real(device)
        return max(0, min(free, total // shards - torch.cuda.memory_reserved(device))), total

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "mem_get_info", shared)
        yield


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where Triton kernel tests run: the GPU when there is one, else the interpreter on CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param
