"""Compile, without launching, every Triton kernel of the engine for an sm_90 GPU (H100/H200) on
a machine without one, and print the names of the kernels compiled (one JSON list).

    python tests/kernels/compile_for_hopper.py

Triton's frontend, its LLVM passes and ptxas (shipped in the triton wheel) all run on the CPU;
only loading and launching need the driver. So the active driver is replaced by one that names
an sm_90 target, every launch becomes a warm-up (compile, no launch) and each autotuner config
is compiled once. The engine then runs tiny checkpoints of every family through its GPU kernel
table — prefill chunks, decode, draft and verify steps — plus the sampling kernels and the
split GDN prefill, with real launch geometry (an H100's 132 SMs). Outputs are garbage (nothing
ran): the engine inspects them only for shapes on these greedy paths, and for non-finite logits,
which fail the requests (NonFiniteLogitsError, expected here); the launchers whose outputs it
reads as indices (decode metadata, greedy tokens, top-k ids) return their torch reference's after
compiling.

This catches what the interpreter cannot: code that does not compile for the GPU (types, layouts,
register limits at ptxas). Run by tests/kernels/test_compile.py in a subprocess, because the
suite's interpreter mode is fixed when the kernel modules are first imported.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import pkgutil
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported

import torch  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

SMS = 132  # an H100's SMs: the launch geometry the kernels' configs see
TARGET = GPUTarget("cuda", 90, 32)


class CompileOnlyDriver:
    """The parts of Triton's active driver a warm-up touches, for an sm_90 target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):
        # An autotuner "times" each config by calling it: every config compiles, all tie.
        return lambda fn, quantiles=None, **kwargs: (fn(), [1.0, 1.0, 1.0])[1]


def compile_only() -> collections.Counter:
    """Install the driver and the warm-up launches; returns the counter of compiled kernels."""
    driver.set_active(CompileOnlyDriver())
    compiled: collections.Counter = collections.Counter()
    run = jit.JITFunction.run

    def warm_up(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled[self.fn.__name__] += 1
        return kernel

    jit.JITFunction.run = warm_up
    import deltaspec.kernels as kernels
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"deltaspec.kernels.{info.name}")
        if hasattr(module, "num_sms"):
            module.num_sms = lambda device: SMS
        if hasattr(module, "dependent_launch"):   # an sm_90 target has grid dependency control
            module.dependent_launch = lambda device: True
    # The engine reads these launchers' outputs as indices (token ids, positions, slots): after
    # compiling, they return their torch reference's result, so the run goes on with valid ones.
    from deltaspec.kernels import decode_metadata, greedy, logprobs
    for module, name in ((decode_metadata, "decode_metadata"), (greedy, "greedy_argmax"), (logprobs, "top_logits")):
        setattr(module, name, compiled_then_reference(getattr(module, name), getattr(module, f"{name}_reference")))
    return compiled


def compiled_then_reference(launcher, reference):
    def call(*args, **kwargs):
        launcher(*args, **kwargs)
        return reference(*args, **kwargs)
    return call


def run_engine() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for fixtures.py
    from fixtures import make_checkpoint

    from deltaspec.engine import LLM, SamplingParams
    from deltaspec.engine.errors import NonFiniteLogitsError

    gpu_shape = dict(linear_key_head_dim=64, linear_value_head_dim=64)  # the GPU kernels' minimum
    prompts = [[1 + i for i in range(n)] for n in (3, 70, 130)]
    runs = (("qwen3_5", 0, {}), ("qwen3_5", 3, {}), ("qwen3_next", 0, {}), ("qwen3_5_moe", 2, {}),
            # FP8: the group quantizer and the block-scaled GEMM; decode batches quantize in the ops
            # before the projections, the GDN's gated norm too with heads of 128 value columns
            ("qwen3_5", 2, {"fp8": True, "linear_value_head_dim": 128}),
            ("qwen3_5_moe", 0, {"fp8": True}))   # FP8 experts
    for family, num_draft_tokens, options in runs:
        path = make_checkpoint(Path(tempfile.mkdtemp()), family, **{**gpu_shape, **options})
        llm = LLM(path, device="cpu", dtype="bfloat16", kernel_backend="triton", enable_cuda_graphs=False,
                  num_draft_tokens=num_draft_tokens, max_num_seqs=4)
        # The prompts together, then one alone: its every step is one row (the one-row forms),
        # which a batch of three reaches only when the scheduler happens to split it.
        for batch in (prompts, prompts[1:2]):
            try:
                llm.generate(batch, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            except NonFiniteLogitsError:
                pass  # uninitialized outputs: the kernels compiled, which is what this checks


def run_kernels() -> None:
    """Kernels the greedy engine runs above do not reach: sampling, penalties and their statistics, grammar masks,
    log-probabilities, MoE's per-token path, the split GDN prefill (few long rows on a real GPU; the tiny engine
    batches here look like CPU tensors, which take the fused path), the tensor-parallel
    all-reduce + RMSNorm with its barrier (signal pads given), the FP8 one-row form (the
    engine reaches it only when a lone request's garbage logits happen to be finite), and the
    weight-only integer GEMM's three paths and experts (no packed checkpoint in the engine above)."""
    from deltaspec.kernels import all_reduce_norm, fp8, gdn_chunked, logprobs, moe, penalties, sampling, token_bitmask

    vocab, rows = 1000, 4
    column = lambda value, dtype: torch.full((rows,), value, dtype=dtype)  # noqa: E731
    sampling.sample(torch.randn(rows, vocab), column(0.8, torch.float32), column(20, torch.int64),
                    column(0.9, torch.float32), column(0.05, torch.float32), column(1, torch.int64),
                    column(5, torch.int64))
    slots, width = 3, 2
    for drafts in (None, torch.zeros(rows, width - 1, dtype=torch.int64)):  # a verify step's drafts counted
        penalties.penalize_rows(torch.randn(rows, width, vocab), torch.zeros(slots, vocab, dtype=torch.int32),
                                torch.zeros(slots, vocab, dtype=torch.bool), torch.zeros(rows, dtype=torch.int64),
                                column(1.1, torch.float32), column(0.2, torch.float32), column(0.3, torch.float32),
                                drafts)
    # The engine's pass: bf16 logits into a float32 output, a subset of the rows, their logit bias.
    penalties.penalize_rows(torch.randn(rows, 1, vocab, dtype=torch.bfloat16),
                            torch.zeros(slots, vocab, dtype=torch.int32), torch.zeros(slots, vocab, dtype=torch.bool),
                            torch.zeros(2, dtype=torch.int64), torch.full((2,), 1.1), torch.full((2,), 0.2),
                            torch.full((2,), 0.3), None,
                            torch.tensor([3, 1]), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4),
                            out=torch.empty(rows, 1, vocab))
    for num_emitted in (None, column(1, torch.int64)):  # plain steps' tokens, then verify rows'
        penalties.record_tokens(torch.zeros(slots, vocab, dtype=torch.int32), torch.zeros(slots, dtype=torch.int64),
                                torch.zeros(slots, 15, dtype=torch.int64), torch.arange(rows) % slots,
                                torch.zeros(rows, width, dtype=torch.int64), num_emitted)
    token_bitmask.apply_token_bitmask(torch.randn(rows, vocab), torch.full((rows, (vocab + 31) // 32), -1,
                                                                            dtype=torch.int32))
    logprobs.token_logprobs(torch.randn(rows, vocab, dtype=torch.bfloat16), torch.zeros(rows, dtype=torch.int64))
    logprobs.top_logits(torch.randn(rows, vocab, dtype=torch.bfloat16), 5)
    experts, top_k, hidden, inner = 8, 2, 128, 64
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    weights, ids = torch.rand(1, top_k), torch.tensor([[1, 5]])
    moe.moe_experts_per_token(x, weights, ids, torch.randn(experts, 2 * inner, hidden, dtype=torch.bfloat16),
                              torch.randn(experts, hidden, inner, dtype=torch.bfloat16))
    tokens, heads, dim = 130, 2, 64
    qkv = torch.randn(3, tokens, heads, dim, dtype=torch.bfloat16)
    gates = torch.randn(2, tokens, heads, dtype=torch.bfloat16)
    gdn_chunked.gdn_chunked(*qkv, *gates, torch.randn(heads), torch.randn(heads),
                            torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                            torch.tensor([True]), torch.randn(2, heads, dim, dim), split=True)
    fp8.fp8_linear(torch.randn(1, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.float8_e4m3fn),
                   torch.ones(64, 2), 128)
    addresses = torch.zeros(2, dtype=torch.int64)
    all_reduce_norm.all_reduce_rms_norm(torch.randn(rows, hidden, dtype=torch.bfloat16),
                                        torch.randn(hidden, dtype=torch.bfloat16), 1e-6,
                                        torch.randn(rows, hidden, dtype=torch.bfloat16), addresses, addresses, 1,
                                        rows * hidden, num_slots=1024)
    from deltaspec.kernels import wna16
    packed = wna16.pack_reference(torch.zeros(256, 256, dtype=torch.int64), 4)
    for rows in (1, 100, wna16.DEQUANT_MIN_ROWS):    # skinny split-K, prefill tiles, dequantize + cuBLAS
        wna16.wna16_linear(torch.randn(rows, 256, dtype=torch.bfloat16), packed, torch.ones(256, 2), None, None, 128, 4)
    experts = dict(w_gate_up=packed.view(4, 64, 32), gate_up_scales=torch.ones(4, 64, 2), gate_up_zeros=None,
                   w_down=torch.zeros(4, 256, 4, dtype=torch.int32), down_scales=torch.ones(4, 256, 1), down_zeros=None)
    for tokens in (1, 8):                            # the per-token path, the grouped path
        wna16.wna16_moe_experts(torch.randn(tokens, 256, dtype=torch.bfloat16), torch.rand(tokens, 1),
                                torch.zeros(tokens, 1, dtype=torch.int64), **experts, group_size=128, bits=4)


def main() -> None:
    compiled = compile_only()
    run_engine()
    run_kernels()
    print(json.dumps(sorted(compiled)))


if __name__ == "__main__":
    main()
