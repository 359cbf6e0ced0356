"""The all-reduce through symmetric memory (engine/symmetric_all_reduce.py) and how TensorParallel
picks it: on the CPU, which messages fit its kernels, the settings, the fallback to NCCL at
every step of its set-up (the ranks' agreement simulated), and which all-reduces a norm follows
go through the fused kernel (all_reduce_rms_norm) and which through all-reduce then norm; on two
GPUs, its sums against NCCL's and the fused kernel against NCCL + rms_norm on random tensors of
several sizes, eagerly and inside a CUDA graph replayed with new inputs."""

import argparse
import datetime
import logging
import multiprocessing as mp
import os
import socket
import types

import pytest
import torch
import torch.distributed as dist

from deltaspec.engine import EngineConfig
from deltaspec.engine import symmetric_all_reduce as sar
from deltaspec.engine.symmetric_all_reduce import SymmetricAllReduce
from deltaspec.engine.tensor_parallel import TensorParallel
from deltaspec.kernels import REFERENCE_OPS
from deltaspec.server.engine_args import add_engine_options, engine_flags, engine_options


def host_symmetric(algorithm: str, dtype: torch.dtype, capacity: int) -> SymmetricAllReduce:
    """A SymmetricAllReduce over a plain CPU buffer: enough to ask what fits (no kernel runs)."""
    buffer = torch.zeros(capacity, dtype=dtype)
    handle = types.SimpleNamespace(rank=0, world_size=2, buffer_ptrs=[buffer.data_ptr(), 0],
                                   signal_pad_ptrs=[0, 0], signal_pad_size=4096)
    return SymmetricAllReduce(algorithm, buffer, handle, "test")


@pytest.mark.parametrize("algorithm", sar.ALGORITHMS)
def test_what_fits_the_kernels(algorithm):
    symmetric = host_symmetric(algorithm, torch.bfloat16, 4096)
    whole = torch.zeros(8192, dtype=torch.bfloat16)
    assert symmetric.fits(whole[:4096].view(64, 64))                  # up to the capacity
    assert not symmetric.fits(whole[:4098])                           # past it
    assert not symmetric.fits(whole[:4096].float())                   # another dtype
    assert not symmetric.fits(whole[:4096].half())
    assert not symmetric.fits(whole[:0])                              # nothing to sum
    assert not symmetric.fits(whole[:4096].view(64, 64).t())          # not contiguous
    assert not symmetric.fits(whole[:3])                              # 6 bytes: not whole 4-byte words
    # The kernels' vectors: an offset must be at least as aligned as the size (16 bytes here).
    assert symmetric.fits(whole[8:8 + 64])                            # 16-byte offset, 128 bytes
    assert not symmetric.fits(whole[2:2 + 64])                        # 4-byte offset, 128 bytes
    assert symmetric.fits(whole[2:2 + 6])                             # 4-byte offset, 12 bytes (4-aligned)
    assert not symmetric.fits(whole[1:1 + 2])                         # 2-byte offset
    fp32 = host_symmetric(algorithm, torch.float32, 1024)
    assert fp32.fits(torch.zeros(2048)[4:4 + 1024]) and not fp32.fits(torch.zeros(2048)[1:1 + 1024])
    assert fp32.fits(torch.zeros(3))                                  # 12 bytes at offset 0


def test_what_fits_the_fused_kernel():
    symmetric = host_symmetric("one_shot", torch.bfloat16, 4096)
    assert symmetric.num_slots == 4096 // 4 // 2 and symmetric.peer_buffers.tolist()[0] == symmetric.buffer.data_ptr()
    rows = torch.zeros(64, 72, dtype=torch.bfloat16)
    assert symmetric.fits_rows(rows[:, 8:])                           # [64, 64]: the capacity, strided rows
    assert not symmetric.fits_rows(rows[:, 8:].reshape(-1))           # not [T, H]
    assert not symmetric.fits_rows(torch.zeros(65, 64, dtype=torch.bfloat16))   # past the capacity
    assert not symmetric.fits_rows(torch.zeros(2, 64))                # another dtype
    assert not symmetric.fits_rows(rows[:, 8:].t())                   # H not the unit stride
    assert not symmetric.fits_rows(torch.zeros(2, 12, dtype=torch.bfloat16))    # rows of 24 bytes
    assert not symmetric.fits_rows(rows[:0, 8:])                      # nothing to sum


def test_all_reduce_setting_is_validated_and_a_flag():
    assert EngineConfig(model="x").all_reduce == "nccl"
    assert EngineConfig(model="x", tensor_parallel_size=2, all_reduce="two_shot").all_reduce == "two_shot"
    with pytest.raises(ValueError, match="all_reduce must be one of auto, nccl, one_shot, two_shot, got 'nvls'"):
        EngineConfig(model="x", tensor_parallel_size=2, all_reduce="nvls")
    with pytest.raises(ValueError, match="all_reduce='auto' needs tensor_parallel_size > 1"):
        EngineConfig(model="x", all_reduce="auto")
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["-tp", "2", "--all-reduce", "nccl"])
    assert engine_options(args)["all_reduce"] == "nccl" and "--all-reduce" in engine_flags(args)
    assert "all_reduce" not in engine_options(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--all-reduce", "multimem"])


class FakeSymmetric:
    """What SymmetricAllReduce.create returns in the selection tests: sums by doubling (two
    ranks holding the same x) or, `wrong`, by tripling; the fused kernel likewise, then the
    reference norm."""

    def __init__(self, algorithm: str, dtype: torch.dtype, capacity: int, wrong: bool = False,
                 fused_error: Exception | None = None) -> None:
        self.algorithm, self.dtype, self.capacity, self.wrong = algorithm, dtype, capacity, wrong
        self.fused_error = fused_error
        self.buffer = torch.zeros(capacity, dtype=dtype)
        self.calls = self.fused_calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.capacity

    def fits_rows(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.numel() <= self.capacity

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mul_(3 if self.wrong else 2)

    def all_reduce_rms_norm(self, x, weight, eps, residual):
        if self.fused_error is not None:
            raise self.fused_error
        self.fused_calls += 1
        return REFERENCE_OPS.rms_norm(x * (3 if self.wrong else 2), weight, eps, residual)


class SimulatedRanks(TensorParallel):
    """Rank 0 of two on a CUDA device (never touched), with rank 1's answers to the agreements
    given; NCCL's all-reduce is a doubling (both ranks hold the same x)."""

    def __init__(self, others: dict[str, bool]) -> None:
        super().__init__(0, 2, torch.device("cuda:0"), store=None)
        self.others, self.agreements = others, []

    def min_over_ranks(self, value: int) -> int:
        step = ("available", "created", "checked")[len(self.agreements)]
        self.agreements.append(step)
        return min(value, int(self.others.get(step, True)))


@pytest.fixture
def set_up(monkeypatch):
    """SimulatedRanks whose set-up steps succeed or fail as asked; returns (group, log records)."""
    monkeypatch.setattr(dist, "all_reduce", lambda x, op=None: x.mul_(2))

    def make(others=None, reason=None, error=None, wrong=False, fused_error=None):
        monkeypatch.setattr(sar, "unavailable", lambda *args: reason)
        monkeypatch.setattr(sar, "register_group", lambda store, rank, size: "group")

        def create(algorithm, dtype, capacity, device, group_name):
            if error is not None:
                raise error
            return FakeSymmetric(algorithm, dtype, capacity, wrong, fused_error)  # buffer, check: CPU
        monkeypatch.setattr(SymmetricAllReduce, "create", staticmethod(create))
        return SimulatedRanks(others or {})
    return make


@pytest.mark.parametrize("case, expected, agreements", [
    (dict(reason="its kernels sum bfloat16 and float32, not torch.float16"), "not torch.float16", 1),
    (dict(others={"available": False}), "another rank cannot use it", 1),
    (dict(error=RuntimeError("CUDA driver error: invalid argument")), "RuntimeError: CUDA driver error", 2),
    (dict(others={"created": False}), "another rank cannot use it", 2),
    (dict(wrong=True), "its check all-reduce differed from NCCL's", 3),
    (dict(others={"checked": False}), "its check all-reduce differed from NCCL's", 3),
    (dict(fused_error=RuntimeError("PTX .version")), "check all-reduce failed (RuntimeError: PTX .version)", 3),
])
def test_a_failed_set_up_step_keeps_nccl_and_says_why(set_up, caplog, case, expected, agreements):
    group = set_up(**case)
    with caplog.at_level(logging.WARNING, logger="deltaspec"):
        group.use_symmetric_memory("auto", torch.bfloat16, 64, 64)
    assert group.symmetric is None and not group.fuse_norm
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NCCL only, not one_shot" in warnings[0] and expected in warnings[0]
    # Every rank takes part in the same agreements up to the step that failed, none after it.
    assert group.agreements == ["available", "created", "checked"][:agreements]
    x = torch.ones(8, dtype=torch.bfloat16)
    assert group.all_reduce(x) is x and x.tolist() == [2.0] * 8  # NCCL's


@pytest.mark.parametrize("choice, algorithm, kind", [("auto", "one_shot", "one_shot+rms_norm"),
                                                     ("one_shot", "one_shot", "one_shot"),
                                                     ("two_shot", "two_shot", "two_shot")])
def test_small_messages_take_the_symmetric_path_once_checked(set_up, choice, algorithm, kind):
    group = set_up()
    group.use_symmetric_memory(choice, torch.bfloat16, 64, 64)
    assert group.agreements == ["available", "created", "checked"]
    assert group.symmetric is not None and group.symmetric.algorithm == algorithm
    assert group.all_reduce_kind == kind and group.fuse_norm == (choice == "auto")
    calls = group.symmetric.calls
    small, large = torch.ones(4096, dtype=torch.bfloat16), torch.ones(4097, dtype=torch.bfloat16)
    assert group.all_reduce(small) is small and group.symmetric.calls == calls + 1
    assert group.all_reduce(large) is large and group.symmetric.calls == calls + 1  # NCCL's
    assert small.sum() == large[:4096].sum() == 2 * 4096


def test_nccl_setting_and_the_cpu_set_nothing_up(set_up):
    group = set_up()
    group.use_symmetric_memory("nccl", torch.bfloat16, 64, 64)
    assert group.symmetric is None and group.agreements == []
    cpu = TensorParallel(0, 2, torch.device("cpu"))
    cpu.use_symmetric_memory("auto", torch.float32, 64, 64)  # gloo: NCCL-equivalent as before
    assert cpu.symmetric is None and not cpu.fuse_norm


@pytest.mark.parametrize("choice", ["auto", "one_shot", "nccl"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_what_fits_goes_fused_and_the_rest_reduces_then_norms(set_up, choice, with_residual):
    """all_reduce_rms_norm: a message that fits the buffer takes the fused kernel under "auto";
    a larger one (a prefill chunk), and every one under the other settings, is all-reduced (the
    symmetric kernel or NCCL, by size) and then normed by the rms_norm given. Either way the
    result is the norm of the sum (two ranks holding the same x: 2x)."""
    group = set_up()
    group.use_symmetric_memory(choice, torch.float32, 4, 16)  # capacity: 4 rows of 16
    symmetric = group.symmetric or FakeSymmetric(choice, torch.float32, 0)  # "nccl": none
    norms = []

    def rms_norm(x, weight, eps, residual, quantize_group=0):
        norms.append(x.shape[0])
        return REFERENCE_OPS.rms_norm(x, weight, eps, residual, quantize_group=quantize_group)

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, generator=gen)
    for rows, fused in [(4, choice == "auto"), (1, choice == "auto"), (5, False)]:
        x = torch.randn(rows, 16, generator=gen)
        residual = torch.randn(rows, 16, generator=gen) if with_residual else None
        expected = REFERENCE_OPS.rms_norm(2 * x, weight, 1e-6, residual)
        calls, fused_calls, normed = symmetric.calls, symmetric.fused_calls, len(norms)
        got = group.all_reduce_rms_norm(x.clone(), weight, 1e-6, residual, rms_norm)
        assert symmetric.fused_calls == fused_calls + fused and len(norms) == normed + (not fused)
        # Unfused: the symmetric kernel where the message fits it (not "nccl"), NCCL above.
        assert symmetric.calls == calls + (not fused and rows <= 4 and choice != "nccl")
        for actual, want in zip(got, expected):
            assert torch.equal(actual, want), (rows, fused)


@pytest.mark.parametrize("released", [True, False])
def test_abort_stands_in_for_the_dead_peers(caplog, released):
    """A peer died: the symmetric-memory barriers get their stand-in (no process group needed
    for it), and one that cannot drain the device in time is logged."""
    group = TensorParallel(0, 2, torch.device("cpu"))
    calls = []
    group.symmetric = types.SimpleNamespace(stand_in_for_peers=lambda: calls.append(1) or released)
    with caplog.at_level(logging.ERROR, logger="deltaspec"):
        group.abort()
    assert calls == [1]
    assert ("still waits for a dead peer" in caplog.text) is not released


def test_each_engine_names_its_group_afresh():
    """The default group's name repeats for every engine a process starts; symmetric memory's
    name for it does not, and resolves to the group of the moment."""
    from torch._C._distributed_c10d import _resolve_process_group

    names = []
    for _ in range(2):
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            names.append(sar.register_group(store, 0, 1))
            assert _resolve_process_group(names[-1]).group_name == dist.group.WORLD.group_name
        finally:
            dist.destroy_process_group()
    assert names[0] != names[1] and all(n.startswith("deltaspec-") for n in names)


# GPU: two ranks, torch's kernels and the fused kernel against NCCL --------------------------------

SIZES = (2, 4096, 3 * 4096 + 6, 64 * 4 * 512)  # elements: a word, one row, rows + a tail, the capacity
# [rows, hidden] of the fused kernel: a decode row, a verify of 3 drafts, a width that is not a
# power of two, the capacity (more rows than an H100 has SMs: programs loop over rows)
FUSED_SHAPES = ((1, 4096), (4, 4096), (7, 1040), (256, 512))
# The fused kernel's normed rows against rms_norm's after NCCL: one rounding of the same float32
# value apart at most (bf16: 2^-8 relative; the new residual is equal bit for bit).
NORM_RTOL = {torch.bfloat16: 2 ** -7, torch.float32: 1e-6}


def _rank_main(rank: int, port: int, failures) -> None:
    try:
        device = torch.device(f"cuda:{rank}")
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
        tp = TensorParallel.join(rank, 2, device, store)
        assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        group_name = sar.register_group(store, rank, 2)
        generator = torch.Generator(device=device).manual_seed(rank)
        for algorithm in sar.ALGORITHMS:
            for dtype in sar.DTYPES:
                symmetric = SymmetricAllReduce.create(algorithm, dtype, SIZES[-1], device, group_name)
                _check_against_nccl(symmetric, dtype, generator, device, f"{algorithm} {dtype}")
                if algorithm == "one_shot":
                    _check_fused_against_nccl(symmetric, dtype, generator, device, f"fused {dtype}")
        tp.leave()
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        failures.put(f"rank {rank}: {type(error).__name__}: {error}")
        raise


def _check_against_nccl(symmetric, dtype, generator, device, label: str) -> None:
    """Eager sums of random tensors, then one graph of all four sizes back to back (the buffer
    reused at once) replayed with new inputs: each equal to NCCL's sum of the same inputs (two
    ranks: one correctly rounded addition either way)."""
    def fresh(numel):
        return torch.randn(numel, generator=generator, device=device).to(dtype)

    def nccl_sum(x):
        expected = x.clone()
        dist.all_reduce(expected)
        return expected

    for numel in SIZES:
        x = fresh(numel)
        expected = nccl_sum(x)
        assert symmetric.fits(x), (label, numel)
        assert torch.equal(symmetric(x), expected), (label, numel, "eager")
    inputs = [fresh(numel) for numel in SIZES]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in inputs:
            symmetric(x)
    for replay in range(16):
        for x in inputs:
            x.copy_(fresh(x.numel()))
        expected = [nccl_sum(x) for x in inputs]
        graph.replay()
        for x, e, numel in zip(inputs, expected, SIZES):
            assert torch.equal(x, e), (label, numel, "replay", replay)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_symmetric_all_reduce_and_fused_norm_equal_nccl_eager_and_in_graphs():
    context = mp.get_context("spawn")
    failures = context.Queue()
    with socket.socket() as probe:  # a free port for the ranks' store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = [context.Process(target=_rank_main, args=(rank, port, failures)) for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(300)
    for p in processes:
        if p.is_alive():
            p.kill()
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert all(p.exitcode == 0 for p in processes) and not errors, errors


def _check_fused_against_nccl(symmetric, dtype, generator, device, label: str) -> None:
    """all_reduce_rms_norm of random rows against NCCL's all-reduce then the rms_norm kernel:
    eagerly, then one graph holding every shape back to back, each followed by torch's one_shot
    of another message (the buffer and the signal pads reused at once by both kernels), replayed
    with new inputs."""
    from deltaspec.kernels.norms import rms_norm

    def fresh(rows, hidden, scale=2.0):
        return (scale * torch.randn(rows, hidden, generator=generator, device=device)).to(dtype)

    def check(got, x, weight, residual, what):
        summed = x.clone()
        dist.all_reduce(summed)
        expected, expected_residual = rms_norm(summed, weight, 1e-6, residual)
        assert torch.equal(got[1], expected_residual), (label, what, "new residual")
        torch.testing.assert_close(got[0], expected, rtol=NORM_RTOL[dtype], atol=NORM_RTOL[dtype],
                                   msg=f"{label} {what} normed")

    cases = [(fresh(r, h), fresh(h, 1, 0.1).view(h), fresh(r, h)) for r, h in FUSED_SHAPES]
    for x, weight, residual in cases:
        check(symmetric.all_reduce_rms_norm(x, weight, 1e-6, residual), x, weight, residual, ("eager", x.shape))
        check(symmetric.all_reduce_rms_norm(x, weight, 1e-6, None), x, weight, None, ("no residual", x.shape))
    plain = [fresh(1, 4096).view(-1) for _ in cases]
    graph, outputs = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        for (x, weight, residual), y in zip(cases, plain):
            outputs.append(symmetric.all_reduce_rms_norm(x, weight, 1e-6, residual))
            symmetric(y)
    for replay in range(16):
        for (x, weight, residual), y in zip(cases, plain):
            for t in (x, weight, residual, y):
                t.copy_(fresh(t.numel(), 1).view(t.shape))
        before = [y.clone() for y in plain]
        graph.replay()
        for (x, weight, residual), got, y, y0 in zip(cases, outputs, plain, before):
            check(got, x, weight, residual, ("replay", replay, x.shape))
            dist.all_reduce(y0)
            assert torch.equal(y, y0), (label, "one_shot after the fused kernel", replay)
    torch.cuda.synchronize()
