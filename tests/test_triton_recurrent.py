"""Triton kernels of the recurrent path against their torch references: GDN deferred-commit
decode/verify (kernels/gdn_decode.py), causal conv1d prefill/decode (kernels/conv1d.py),
rms_norm / gated_rms_norm (kernels/norms.py) and q/k norm + partial RoPE (kernels/rope.py).

The references are checked against float64 oracles in test_ref_*.py; here they are the oracle.
Inputs are fresh seeded random draws (no zeros); kernel outputs are poisoned with NaN before the
kernel writes them (launch_* entry points) or freshly allocated; every pool slot a batch does
not own holds finite garbage and must stay bit-identical. Batches are ragged (1 to P tokens per
row, a sequence of length 1), slots permuted, pad rows point at scratch slot 0 (whose pending
count is garbage), pending counts range over 0..P, q/k/v are strided views of the conv output
and a/b of the projection, exactly as engine/models/layers.py passes them.

CPU: the interpreter, fp32, tiny head dims (16/32), HV = HK and HV = 2 HK, one V tile and two.
GPU (`gpu` marker): bf16 activations, K = V = 128, fp32 and bf16 state pools, every V-tile
config, capture in a CUDA graph, realistic conv/norm/rope widths and long positions.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels.conv1d import (causal_conv1d_decode, causal_conv1d_decode_reference, causal_conv1d_prefill,
                                      causal_conv1d_prefill_reference)
from deltaspec.kernels.gdn_decode import (DecodeConfig, arrival_counters, decode_config, gdn_decode_reference,
                                          launch_gdn_decode)
from deltaspec.kernels.norms import gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference
from deltaspec.kernels.rope import qk_norm_rope, qk_norm_rope_reference

PAD_SLOT = 0
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Max error relative to the largest reference magnitude; NaN never passes."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual.double() - expected.double()).abs().max()
    scale = expected.double().abs().max()
    assert bool(error <= rtol * scale), f"{what}: max abs error {float(error):.3e} (scale {float(scale):.3e})"


def bits(x: torch.Tensor) -> torch.Tensor:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(view)


def assert_slots_untouched(pool: dict[str, torch.Tensor], before: dict[str, torch.Tensor], owned: set[int]) -> None:
    for name, tensor in pool.items():
        for slot in range(tensor.shape[0]):
            if slot not in owned:
                assert torch.equal(bits(tensor[slot]), bits(before[name][slot])), f"{name}[{slot}] changed"


def cu_seqlens_of(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(device)


def clone(pool: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in pool.items()}


# ----------------------------------------------------------------------------------------------
# GDN decode / verify
# ----------------------------------------------------------------------------------------------

class GDNCase:
    """A GDN layer's pool (every slot finite garbage, counts per slot) and one step's inputs,
    sliced like the model slices them: q|k|v from one conv output row, a|b from the projection."""

    def __init__(self, seed: int, hk: int, hv: int, key_dim: int, value_dim: int, max_pending: int,
                 num_slots: int, dtype: torch.dtype, state_dtype: torch.dtype, device: str) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.hk, self.hv, self.key_dim, self.value_dim = hk, hv, key_dim, value_dim
        self.dtype, self.device = dtype, device
        gen, s, p = self.gen, num_slots, max_pending
        self.A_log = (torch.rand(hv, generator=gen) * 5.0 - 4.0).to(device)
        self.dt_bias = (0.5 * torch.randn(hv, generator=gen)).to(device)
        self.pool = dict(
            state=(0.5 * torch.randn(s, hv, key_dim, value_dim, generator=gen)).to(state_dtype).to(device),
            pending_k=torch.randn(s, p, hk, key_dim, generator=gen).to(dtype).to(device),
            pending_v=torch.randn(s, p, hv, value_dim, generator=gen).to(dtype).to(device),
            pending_g=(-torch.rand(s, p, hv, generator=gen) - 0.01).to(device),
            pending_beta=(torch.rand(s, p, hv, generator=gen) * 0.98 + 0.01).to(device),
            pending_counts=torch.randint(0, p + 1, (s,), generator=gen, dtype=torch.int32).to(device),
        )
        self.pool["pending_counts"][PAD_SLOT] = p

    def inputs(self, num_tokens: int):
        gen, hk, hv = self.gen, self.hk, self.hv
        key, value = hk * self.key_dim, hv * self.value_dim
        conv_out = torch.randn(num_tokens, 2 * key + value, generator=gen).to(self.dtype).to(self.device)
        q, k, v = conv_out.split((key, key, value), dim=-1)
        projection = torch.randn(num_tokens, 3 + 2 * hv, generator=gen).to(self.dtype).to(self.device)
        b, a = projection[:, 3:3 + hv], projection[:, 3 + hv:]
        return (q.view(num_tokens, hk, self.key_dim), k.view(num_tokens, hk, self.key_dim),
                v.view(num_tokens, hv, self.value_dim), a, b)

    def run(self, kernel: bool, pool, inputs, lengths: list[int], slots: list[int], commit: bool,
            config: DecodeConfig | None = None) -> torch.Tensor:
        q, k, v, a, b = inputs
        args = (q, k, v, a, b, self.A_log, self.dt_bias, cu_seqlens_of(lengths, self.device),
                torch.tensor(slots, dtype=torch.int32, device=self.device), pool["state"], pool["pending_k"],
                pool["pending_v"], pool["pending_g"], pool["pending_beta"], pool["pending_counts"], commit)
        if not kernel:
            return gdn_decode_reference(*args)
        out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device)
        config = config or decode_config(len(slots), self.hv, self.key_dim, self.value_dim, commit, v.device)
        launch_gdn_decode(out, *args, config)
        return out


def check_gdn_step(case: GDNCase, lengths: list[int], slots: list[int], commit: bool,
                   config: DecodeConfig | None = None) -> None:
    """One call, kernel vs reference on copies of the same pool: outputs of real rows, every
    tensor of every real slot, and bit-identity of every slot outside the batch."""
    inputs = case.inputs(sum(lengths))
    before = clone(case.pool)
    expected_pool, actual_pool = clone(case.pool), clone(case.pool)
    expected = case.run(False, expected_pool, inputs, lengths, slots, commit)
    actual = case.run(True, actual_pool, inputs, lengths, slots, commit, config)
    rtol = TOLERANCE[case.dtype]
    start = 0
    for length, slot in zip(lengths, slots):
        if slot != PAD_SLOT:
            span = slice(start, start + length)
            assert_close(actual[span], expected[span], rtol, f"output of slot {slot}")
            # a bf16 state rounds each store
            tolerance = max(rtol, TOLERANCE[actual_pool["state"].dtype])
            assert_close(actual_pool["state"][slot], expected_pool["state"][slot], tolerance, f"state[{slot}]")
            written = 0 if commit else length  # pending entries past those are left as they were
            for name in ("pending_k", "pending_v", "pending_g", "pending_beta"):
                actual_entries, expected_entries = actual_pool[name][slot], expected_pool[name][slot]
                if written:
                    assert_close(actual_entries[:written], expected_entries[:written], rtol, f"{name}[{slot}]")
                assert torch.equal(bits(actual_entries[written:]), bits(before[name][slot, written:])), name
        start += length
    assert_slots_untouched(actual_pool, before, owned=set(slots))
    assert int(arrival_counters(torch.device(case.device), 1).abs().sum()) == 0, "arrival counters not reset"


# Rows: (new tokens, slot, pending count of the slot); pad rows (slot 0) last, as CUDA graphs pad.
RAGGED = [(1, 5, 0), (4, 2, 4), (2, 7, 3), (1, 3, 1), (3, 8, 0), (1, PAD_SLOT, None), (1, PAD_SLOT, None)]


def ragged_case(seed: int, hk: int, hv: int, dim: int, state_dtype: torch.dtype, device: str) -> GDNCase:
    case = GDNCase(seed, hk, hv, dim, dim, max_pending=4, num_slots=10, dtype=torch.float32,
                   state_dtype=state_dtype, device=device)
    for _, slot, count in RAGGED:
        if count is not None:
            case.pool["pending_counts"][slot] = count
    return case


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)], ids=["HV=2HK", "HV=HK"])
def test_gdn_decode_ragged_batch(kernel_device, hk, hv, commit):
    case = ragged_case(10 + hv, hk, hv, 16, torch.float32, kernel_device)
    check_gdn_step(case, [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED], commit)


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
def test_gdn_decode_two_v_tiles_bf16_state(kernel_device, commit):
    """K = V = 32 with 16-column tiles: 2 V tiles x 2 value heads share each key head's pending
    k, so the verify step's arrival ordering is exercised; the state pool is bf16."""
    case = ragged_case(20, 2, 4, 32, torch.bfloat16, kernel_device)
    check_gdn_step(case, [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED], commit,
                   DecodeConfig(block_v=16, num_warps=1))


def test_gdn_decode_ignores_nonfinite_pending_past_the_count(kernel_device):
    case = ragged_case(30, 2, 4, 16, torch.float32, kernel_device)
    for _, slot, count in RAGGED:
        if count is not None:
            for name in ("pending_k", "pending_v", "pending_g", "pending_beta"):
                case.pool[name][slot, count:] = float("nan")
    check_gdn_step(case, [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED], commit=False)


def test_gdn_decode_verify_rollback_sequence(kernel_device):
    """Verify steps whose pending entries were written by the kernel itself are folded by the
    kernel at the next step: kernel and reference pools evolve side by side through acceptance
    (the engine only sets counts: 0, some, all k+1) and a final commit step."""
    lengths, slots = [4, 2, 1, 3], [6, 1, 4, 9]
    accepted = [[0, 2, 1, 3], [4, 1, 1, 0], [2, 2, 0, 3]]
    case = GDNCase(40, 2, 4, 16, 16, max_pending=4, num_slots=10, dtype=torch.float32,
                   state_dtype=torch.float32, device=kernel_device)
    expected_pool, actual_pool = clone(case.pool), clone(case.pool)
    for slot in slots:
        for pool in (expected_pool, actual_pool):
            pool["pending_counts"][slot] = 0
    before = clone(actual_pool)
    for step, counts in enumerate(accepted + [None]):
        commit = counts is None
        inputs = case.inputs(sum(lengths))
        expected = case.run(False, expected_pool, inputs, lengths, slots, commit)
        actual = case.run(True, actual_pool, inputs, lengths, slots, commit)
        assert_close(actual, expected, TOLERANCE[torch.float32], f"outputs of step {step}")
        for pool in (expected_pool, actual_pool):
            for slot, count in zip(slots, counts or [0] * len(slots)):
                pool["pending_counts"][slot] = count
    for name in ("state", "pending_k", "pending_v", "pending_g", "pending_beta"):
        assert_close(actual_pool[name][slots], expected_pool[name][slots], TOLERANCE[torch.float32], name)
    assert_slots_untouched(actual_pool, before, owned=set(slots))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
@pytest.mark.parametrize("hk,hv", [(16, 32), (16, 16)], ids=["HV=2HK", "HV=HK"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
def test_gdn_decode_gpu_bf16(hk, hv, commit, state_dtype):
    gen = torch.Generator().manual_seed(50)
    num_rows = 37
    lengths = torch.randint(1, 5, (num_rows,), generator=gen).tolist()
    slots = (torch.randperm(60, generator=gen)[:num_rows] + 1).tolist()
    lengths += [1, 1]
    slots += [PAD_SLOT, PAD_SLOT]
    case = GDNCase(51, hk, hv, 128, 128, max_pending=4, num_slots=64, dtype=torch.bfloat16,
                   state_dtype=state_dtype, device="cuda")
    configs = [None] + [DecodeConfig(block_v, warps) for block_v, warps in ((8, 1), (16, 1), (32, 2), (64, 8))]
    for config in configs:
        check_gdn_step(case, lengths, slots, commit, config)


@pytest.mark.gpu
def test_gdn_decode_cuda_graph_replay():
    """Captured once, replayed over steps whose pending counts and inputs change in place."""
    case = GDNCase(60, 16, 32, 128, 128, max_pending=4, num_slots=12, dtype=torch.bfloat16,
                   state_dtype=torch.float32, device="cuda")
    lengths, slots = [4, 4, 4, 4], [3, 7, 1, 10]
    static = case.inputs(sum(lengths))
    pool = clone(case.pool)
    expected_pool = clone(case.pool)
    out = torch.empty_like(static[2], memory_format=torch.contiguous_format)
    cu, slot_ids = cu_seqlens_of(lengths, "cuda"), torch.tensor(slots, dtype=torch.int32, device="cuda")
    config = decode_config(len(slots), case.hv, 128, 128, False, torch.device("cuda"))

    def step(p):
        launch_gdn_decode(out, *static, case.A_log, case.dt_bias, cu, slot_ids, p["state"], p["pending_k"],
                          p["pending_v"], p["pending_g"], p["pending_beta"], p["pending_counts"], False, config)

    step(clone(pool))  # warm-up on a scratch copy: compiles, sizes the arrival counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pool)
    for i in range(3):
        fresh = case.inputs(sum(lengths))
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        expected = case.run(False, expected_pool, fresh, lengths, slots, commit=False)
        assert_close(out, expected, TOLERANCE[torch.bfloat16], f"replay {i}")
        for slot, count in zip(slots, (i, 4, 1, 3)):
            pool["pending_counts"][slot] = count
            expected_pool["pending_counts"][slot] = count
    assert_close(pool["state"][slots], expected_pool["state"][slots], TOLERANCE[torch.bfloat16], "state")


# ----------------------------------------------------------------------------------------------
# Causal conv1d
# ----------------------------------------------------------------------------------------------

def conv_inputs(gen: torch.Generator, num_tokens: int, channels: int, dtype, device):
    """x as the model's mixed q|k|v rows: a strided view of a wider projection output."""
    wide = torch.randn(num_tokens, channels + 5, generator=gen).to(dtype).to(device)
    return wide[:, 2:2 + channels]


@pytest.mark.parametrize("channels", [24, 160])
def test_conv1d_prefill(kernel_device, channels):
    """Rows shorter than, equal to and longer than W-1 and than a token block (16 under the
    interpreter), with and without an initial window (the stale window of a fresh row is NaN)."""
    gen = torch.Generator().manual_seed(channels)
    width, num_slots = 4, 9
    lengths = [1, 2, 3, 5, 40, 1, 17]
    slots = [5, 2, 8, 1, 6, 3, 7]
    has_initial = [True, False, True, True, False, True, False]
    x = conv_inputs(gen, sum(lengths), channels, torch.float32, kernel_device)
    weight = torch.randn(channels, width, generator=gen).to(kernel_device)
    conv_state = torch.randn(num_slots, width - 1, channels, generator=gen).to(kernel_device)
    for slot, initial in zip(slots, has_initial):
        if not initial:
            conv_state[slot] = float("nan")
    before = conv_state.clone()
    args = (cu_seqlens_of(lengths, kernel_device), torch.tensor(slots, dtype=torch.int32, device=kernel_device),
            torch.tensor(has_initial, device=kernel_device))
    expected_state, actual_state = conv_state.clone(), conv_state.clone()
    expected = causal_conv1d_prefill_reference(x, weight, *args, expected_state)
    actual = causal_conv1d_prefill(x, weight, *args, actual_state)
    assert_close(actual, expected, TOLERANCE[torch.float32], "output")
    assert torch.equal(actual_state[slots], expected_state[slots]), "final windows"
    assert_slots_untouched({"conv": actual_state}, {"conv": before}, owned=set(slots))


def conv_pool(gen: torch.Generator, num_slots: int, max_pending: int, channels: int, width: int, device: str):
    pool = dict(conv=torch.randn(num_slots, width - 1, channels, generator=gen).to(device),
                pending_conv=torch.randn(num_slots, max_pending, channels, generator=gen).to(device),
                pending_counts=torch.randint(0, max_pending + 1, (num_slots,), generator=gen,
                                             dtype=torch.int32).to(device))
    pool["pending_counts"][PAD_SLOT] = max_pending
    return pool


def run_conv_decode(kernel: bool, x, weight, lengths, slots, pool, commit):
    device = x.device
    fn = causal_conv1d_decode if kernel else causal_conv1d_decode_reference
    return fn(x, weight, cu_seqlens_of(lengths, device), torch.tensor(slots, dtype=torch.int32, device=device),
              pool["conv"], pool["pending_conv"], pool["pending_counts"], commit)


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
def test_conv1d_decode_ragged_batch(kernel_device, commit):
    """1..P new tokens per row over 0..P pending columns (NaN past the count), pad rows on slot 0."""
    gen = torch.Generator().manual_seed(70)
    channels, width, max_pending, num_slots = 40, 4, 4, 10
    pool = conv_pool(gen, num_slots, max_pending, channels, width, kernel_device)
    for _, slot, count in RAGGED:
        if count is not None:
            pool["pending_counts"][slot] = count
            pool["pending_conv"][slot, count:] = float("nan")
    lengths, slots = [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED]
    x = conv_inputs(gen, sum(lengths), channels, torch.float32, kernel_device)
    weight = torch.randn(channels, width, generator=gen).to(kernel_device)
    before = clone(pool)
    expected_pool, actual_pool = clone(pool), clone(pool)
    expected = run_conv_decode(False, x, weight, lengths, slots, expected_pool, commit)
    actual = run_conv_decode(True, x, weight, lengths, slots, actual_pool, commit)
    start = 0
    for length, slot in zip(lengths, slots):
        if slot != PAD_SLOT:
            span = slice(start, start + length)
            assert_close(actual[span], expected[span], TOLERANCE[torch.float32], f"output of slot {slot}")
            assert torch.equal(actual_pool["conv"][slot], expected_pool["conv"][slot]), f"window of slot {slot}"
            assert torch.equal(bits(actual_pool["pending_conv"][slot]), bits(expected_pool["pending_conv"][slot]))
        start += length
    assert_slots_untouched(actual_pool, before, owned=set(slots))


def test_conv1d_decode_verify_rollback_sequence(kernel_device):
    gen = torch.Generator().manual_seed(71)
    channels, width, max_pending = 24, 4, 4
    pool = conv_pool(gen, 8, max_pending, channels, width, kernel_device)
    lengths, slots = [4, 1, 3], [6, 2, 5]
    pool["pending_counts"][slots] = 0
    weight = torch.randn(channels, width, generator=gen).to(kernel_device)
    expected_pool, actual_pool = clone(pool), clone(pool)
    for step, counts in enumerate([[3, 1, 0], [0, 1, 3], [4, 0, 2], None]):
        x = conv_inputs(gen, sum(lengths), channels, torch.float32, kernel_device)
        commit = counts is None
        expected = run_conv_decode(False, x, weight, lengths, slots, expected_pool, commit)
        actual = run_conv_decode(True, x, weight, lengths, slots, actual_pool, commit)
        assert_close(actual, expected, TOLERANCE[torch.float32], f"step {step}")
        for pool_ in (expected_pool, actual_pool):
            pool_["pending_counts"][slots] = torch.tensor(counts or [0, 0, 0], dtype=torch.int32,
                                                          device=kernel_device)
    assert torch.equal(actual_pool["conv"][slots], expected_pool["conv"][slots])


@pytest.mark.gpu
def test_conv1d_gpu_bf16():
    """The real conv width (2 x 16 x 128 + 32 x 128 channels), a long prefill row, bf16."""
    gen = torch.Generator().manual_seed(80)
    channels, width, max_pending = 8192, 4, 4
    lengths, slots, has_initial = [1, 3, 1000, 70], [3, 1, 7, 5], [True, False, True, True]
    x = conv_inputs(gen, sum(lengths), channels, torch.bfloat16, "cuda")
    weight = torch.randn(channels, width, generator=gen).to(torch.bfloat16).cuda()
    pool = conv_pool(gen, 9, max_pending, channels, width, "cuda")
    pool = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in pool.items()}
    args = (cu_seqlens_of(lengths, "cuda"), torch.tensor(slots, dtype=torch.int32, device="cuda"),
            torch.tensor(has_initial, device="cuda"))
    expected_state, actual_state = pool["conv"].clone(), pool["conv"].clone()
    expected = causal_conv1d_prefill_reference(x, weight, *args, expected_state)
    actual = causal_conv1d_prefill(x, weight, *args, actual_state)
    assert_close(actual, expected, TOLERANCE[torch.bfloat16], "prefill output")
    assert torch.equal(actual_state, expected_state)
    for commit in (True, False):
        lengths, slots = [1, 4, 2, 1], [3, 1, 7, PAD_SLOT]
        x = conv_inputs(gen, sum(lengths), channels, torch.bfloat16, "cuda")
        expected_pool, actual_pool = clone(pool), clone(pool)
        expected = run_conv_decode(False, x, weight, lengths, slots, expected_pool, commit)
        actual = run_conv_decode(True, x, weight, lengths, slots, actual_pool, commit)
        assert_close(actual[:-1], expected[:-1], TOLERANCE[torch.bfloat16], "decode output")
        assert torch.equal(actual_pool["conv"][slots[:-1]], expected_pool["conv"][slots[:-1]])
        assert torch.equal(actual_pool["pending_conv"][slots[:-1]], expected_pool["pending_conv"][slots[:-1]])


# ----------------------------------------------------------------------------------------------
# Norms and q/k norm + RoPE
# ----------------------------------------------------------------------------------------------

def norm_cases(device: str, dtype: torch.dtype, hidden: int, tokens: int = 5, seed: int = 90):
    gen = torch.Generator().manual_seed(seed)
    wide = (3 * torch.randn(tokens, hidden + 7, generator=gen)).to(dtype).to(device)
    x = wide[:, 7:]  # a strided row view
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    weight = (0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [48, 100])
def test_rms_norm(kernel_device, hidden, with_residual):
    x, residual, weight = norm_cases(kernel_device, torch.float32, hidden)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual if with_residual else None)
    actual, actual_residual = rms_norm(x, weight, 1e-6, residual if with_residual else None)
    assert_close(actual, expected, TOLERANCE[torch.float32], "normed")
    assert torch.equal(actual_residual, expected_residual), "new residual is x + residual, in x's dtype"


@pytest.mark.parametrize("leading", [(6,), (5, 3)], ids=["2d", "3d"])
def test_gated_rms_norm(kernel_device, leading):
    """gate is a strided view (z of the GDN projection)."""
    gen = torch.Generator().manual_seed(91)
    dim = 24
    x = torch.randn(*leading, dim, generator=gen).to(kernel_device)
    wide = torch.randn(leading[0], dim * (leading[1] if len(leading) > 1 else 1) + 9, generator=gen).to(kernel_device)
    gate = wide[:, 9:].view(*leading, dim)
    weight = torch.randn(dim, generator=gen).to(kernel_device)
    assert_close(gated_rms_norm(x, gate, weight, 1e-6), gated_rms_norm_reference(x, gate, weight, 1e-6),
                 TOLERANCE[torch.float32], "gated norm")


def rope_case(device: str, dtype: torch.dtype, tokens: int, hq: int, hk: int, head_dim: int, max_position: int,
              seed: int):
    """q sliced from [q | gate] per head and k from a fused qkv row, as GatedAttention does."""
    gen = torch.Generator().manual_seed(seed)
    q_gate = torch.randn(tokens, hq, 2 * head_dim, generator=gen).to(dtype).to(device)
    kv = torch.randn(tokens, 2 * hk * head_dim, generator=gen).to(dtype).to(device)
    q, k = q_gate[..., :head_dim], kv[:, :hk * head_dim].view(tokens, hk, head_dim)
    q_weight = (0.1 * torch.randn(head_dim, generator=gen)).to(dtype).to(device)
    k_weight = (0.1 * torch.randn(head_dim, generator=gen)).to(dtype).to(device)
    positions = torch.randint(0, max_position, (tokens,), generator=gen).to(device)
    return q, k, q_weight, k_weight, positions


@pytest.mark.parametrize("rotary_dim", [8, 32])
def test_qk_norm_rope(kernel_device, rotary_dim):
    args = rope_case(kernel_device, torch.float32, 6, 4, 2, 32, 5000, seed=92)
    expected = qk_norm_rope_reference(*args, rotary_dim, 10_000.0, 1e-6)
    actual = qk_norm_rope(*args, rotary_dim, 10_000.0, 1e-6)
    for a, e, name in zip(actual, expected, "qk"):
        assert_close(a, e, TOLERANCE[torch.float32], name)


@pytest.mark.gpu
def test_norms_and_rope_gpu_bf16():
    """Model widths in bf16: hidden 2048 / 5120, GDN output heads 32 x 128, attention heads
    16 q / 2 kv of 256 with rotary 64 at positions up to 256k."""
    for hidden in (2048, 5120):
        x, residual, weight = norm_cases("cuda", torch.bfloat16, hidden, tokens=300)
        for res in (None, residual):
            expected, expected_residual = rms_norm_reference(x, weight, 1e-6, res)
            actual, actual_residual = rms_norm(x, weight, 1e-6, res)
            assert_close(actual, expected, TOLERANCE[torch.bfloat16], f"rms_norm {hidden}")
            assert torch.equal(actual_residual, expected_residual)
    gen = torch.Generator().manual_seed(93)
    core = torch.randn(300, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    z = torch.randn(300, 32 * 128 + 64, generator=gen).to(torch.bfloat16).cuda()[:, 64:].view(300, 32, 128)
    weight = torch.randn(128, generator=gen).to(torch.bfloat16).cuda()
    assert_close(gated_rms_norm(core, z, weight, 1e-6), gated_rms_norm_reference(core, z, weight, 1e-6),
                 TOLERANCE[torch.bfloat16], "gated_rms_norm")
    args = rope_case("cuda", torch.bfloat16, 300, 16, 2, 256, 262_144, seed=94)
    expected = qk_norm_rope_reference(*args, 64, 10_000_000.0, 1e-6)
    actual = qk_norm_rope(*args, 64, 10_000_000.0, 1e-6)
    for a, e, name in zip(actual, expected, "qk"):
        assert_close(a, e, TOLERANCE[torch.bfloat16], name)
