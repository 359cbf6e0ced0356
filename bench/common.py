"""Measurement helpers shared by the GPU benchmarks (run as scripts from the repo root, so
`from common import ...` resolves to this file)."""

from __future__ import annotations

import os
import subprocess

import torch
import triton

from deltaspec.server.acceptance_benchmark import device_tag  # noqa: F401  (the results' device naming)


def random_model(config, device: str, dtype: torch.dtype):
    """A HybridLM with its MTP layer and random weights at the scales a trained model has
    (A_log in [0, 2.7], vectors ~0.1, matrices ~1/sqrt(fan-in)): what the benchmarks time.
    A config with block-FP8 quantization gets random e4m3 values and block scales of the same
    magnitude, drawn in place (no bf16 copy: a 35B-A3B-shape model fits one H100)."""
    from deltaspec.engine.models import HybridLM
    from deltaspec.kernels import select_ops

    with torch.device(device):
        model = HybridLM(config, select_ops(device), dtype, with_mtp=True)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if p.dtype == torch.float8_e4m3fn:   # block FP8: e4m3 values ~N(0, 64) ...
            for chunk in p.data.view(-1, p.shape[-1]).split(4096):
                chunk.copy_(torch.randn(chunk.shape, device=device, generator=generator).mul_(64).clamp_(-448, 448))
        elif name.endswith("_scale"):          # ... times 1 / (64 sqrt(fan-in)): the bf16 weights' scale
            p.data.fill_((p.shape[-1] * 128) ** -0.5 / 64)
        elif name.endswith("A_log"):
            p.data.uniform_(0.0, 2.7, generator=generator)
        elif p.dim() == 1:
            p.data.normal_(0.0, 0.1, generator=generator)
        else:
            p.data.normal_(0.0, p.shape[-1] ** -0.5, generator=generator)
    model.finish_loading()
    return model.eval()


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy of random data (median)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def graph_time_us(launch, repeats: int, replays: int = 20) -> float:
    """Median replay time of a CUDA graph of `repeats` calls of launch(r), per call, in µs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for r in range(min(repeats, 2)):
            launch(r)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(repeats):
            launch(r)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / repeats)
    del graph
    return sorted(times)[len(times) // 2]


def commit_id() -> str:
    """The checkout's commit; the GPU machine's copy has no .git, so callers pass DELTASPEC_COMMIT."""
    return os.environ.get("DELTASPEC_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"


def eager_time_us(launch, repeats: int, rounds: int = 9) -> float:
    """Median over rounds of (events around launch(0..repeats-1), back to back) / repeats, in µs.
    For code that cannot be captured in a graph (host syncs, autotuning on first call)."""
    for r in range(repeats):
        launch(r)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for r in range(repeats):
            launch(r)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / repeats)
    return sorted(times)[len(times) // 2]
