"""Triton kernels of the recurrent path against their torch references: GDN deferred-commit
decode/verify (kernels/gdn_decode.py), causal conv1d prefill/decode (kernels/conv1d.py),
rms_norm / gated_rms_norm (kernels/norms.py), silu_and_mul (kernels/activation.py) and q/k norm
+ partial RoPE (kernels/rope.py).

The references are checked against float64 oracles in test_ref_*.py; here they are the oracle.
Inputs are fresh seeded random draws (no zeros); kernel outputs are poisoned with NaN before the
kernel writes them (launch_* entry points) or freshly allocated; every pool slot a batch does
not own holds finite garbage and must stay bit-identical. Batches are ragged (1 to P+1 tokens
per row, a sequence of length 1), slots permuted, pad rows point at scratch slot 0 (whose
pending count is garbage), pending counts range over 0..P (P = k; P = 0 for plain decode), q/k/v
and the pending k/v of the step buffer are strided views of conv outputs and a/b of the
projection, exactly as engine/models/layers.py passes them. Step-buffer entries past a row's
pending count are NaN (the conv kernel leaves them unwritten). A layer test chains the conv and
GDN kernels through verify steps, acceptance and commit steps against plain decode. The `out=`
views the layer passes (row slices of its step buffers, the conv's also column-strided) are
written in place by kernels and references alike, and nothing outside them is.

CPU: the interpreter, fp32, tiny head dims (16/32), HV = HK and HV = 2 HK, one V tile and two.
GPU (`gpu` marker): bf16 activations, K = V = 128, fp32 and bf16 state pools, every V-tile
config, capture in a CUDA graph, realistic conv/norm/rope/SwiGLU widths and long positions.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels.activation import silu_and_mul, silu_and_mul_reference
from deltaspec.kernels.conv1d import (causal_conv1d_decode, causal_conv1d_decode_reference, causal_conv1d_prefill,
                                      causal_conv1d_prefill_reference)
from deltaspec.kernels.gdn import pending_replicas
import deltaspec.kernels.gdn_decode as gdn_decode_module
from deltaspec.kernels.gdn_decode import decode_config, gdn_decode, gdn_decode_reference, launch_gdn_decode
from deltaspec.kernels.norms import gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference
from deltaspec.kernels.rope import qk_norm_rope, qk_norm_rope_reference
from deltaspec.kernels.tiles import TileConfig

PAD_SLOT = 0
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Max error relative to the largest reference magnitude; NaN never passes."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not actual.numel():
        return
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


def replicated(entries: torch.Tensor, value_dim: int) -> torch.Tensor:
    """Pending g or beta [S, P, HV] as the pool keeps them: [S, P, HV, R], R equal replicas."""
    return entries[..., None].repeat(1, 1, 1, pending_replicas(value_dim))


def clone(pool: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in pool.items()}


# ----------------------------------------------------------------------------------------------
# GDN decode / verify
# ----------------------------------------------------------------------------------------------

class GDNCase:
    """A GDN layer's pool (every slot finite garbage, counts per slot) and one step's inputs,
    sliced like the model slices them: q|k|v from one conv output row, a|b from the projection,
    pending k|v from the conv's step buffer [rows, P, conv_dim]."""

    def __init__(self, seed: int, hk: int, hv: int, key_dim: int, value_dim: int, max_pending: int,
                 num_slots: int, dtype: torch.dtype, state_dtype: torch.dtype, device: str) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.hk, self.hv, self.key_dim, self.value_dim = hk, hv, key_dim, value_dim
        self.max_pending, self.dtype, self.device = max_pending, dtype, device
        gen, s, p = self.gen, num_slots, max_pending
        self.A_log = (torch.rand(hv, generator=gen) * 5.0 - 4.0).to(device)
        self.dt_bias = (0.5 * torch.randn(hv, generator=gen)).to(device)
        self.pool = dict(
            state=(0.5 * torch.randn(s, hv, key_dim, value_dim, generator=gen)).to(state_dtype).to(device),
            pending_g=replicated(-torch.rand(s, p, hv, generator=gen) - 0.01, value_dim).to(device),
            pending_beta=replicated(torch.rand(s, p, hv, generator=gen) * 0.98 + 0.01, value_dim).to(device),
            pending_counts=torch.randint(0, p + 1, (s,), generator=gen, dtype=torch.int32).to(device),
        )
        self.pool["pending_counts"][PAD_SLOT] = p

    def split(self, conv_out: torch.Tensor):
        """[..., conv_dim] -> views q, k [..., HK, K], v [..., HV, V]."""
        key, value = self.hk * self.key_dim, self.hv * self.value_dim
        q, k, v = conv_out.split((key, key, value), dim=-1)
        return (q.unflatten(-1, (self.hk, self.key_dim)), k.unflatten(-1, (self.hk, self.key_dim)),
                v.unflatten(-1, (self.hv, self.value_dim)))

    def inputs(self, num_tokens: int):
        gen, hv = self.gen, self.hv
        conv_dim = 2 * self.hk * self.key_dim + hv * self.value_dim
        q, k, v = self.split(torch.randn(num_tokens, conv_dim, generator=gen).to(self.dtype).to(self.device))
        projection = torch.randn(num_tokens, 3 + 2 * hv, generator=gen).to(self.dtype).to(self.device)
        b, a = projection[:, 3:3 + hv], projection[:, 3 + hv:]
        return q, k, v, a, b

    def pending_inputs(self, slots: list[int], counts: torch.Tensor):
        """Step buffer views (pending k, pending v) of the rows; NaN past each slot's count."""
        conv_dim = 2 * self.hk * self.key_dim + self.hv * self.value_dim
        buffer = torch.randn(len(slots), self.max_pending, conv_dim, generator=self.gen).to(self.dtype)
        counts = counts.cpu()
        for row, slot in enumerate(slots):
            buffer[row, int(counts[slot]):] = float("nan")
        _, pending_k, pending_v = self.split(buffer.to(self.device))
        return pending_k, pending_v

    def args(self, pool, inputs, pending, lengths: list[int], slots: list[int], commit: bool) -> tuple:
        """The arguments of gdn_decode / gdn_decode_reference."""
        return (*inputs, self.A_log, self.dt_bias, cu_seqlens_of(lengths, self.device),
                torch.tensor(slots, dtype=torch.int32, device=self.device), pool["state"], *pending,
                pool["pending_g"], pool["pending_beta"], pool["pending_counts"], commit)

    def run(self, kernel: bool, pool, inputs, pending, lengths: list[int], slots: list[int], commit: bool,
            config: TileConfig | None = None) -> torch.Tensor:
        args = self.args(pool, inputs, pending, lengths, slots, commit)
        if not kernel:
            return gdn_decode_reference(*args)
        v = inputs[2]
        out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device)
        config = config or decode_config(len(slots), self.hv, self.key_dim, self.value_dim, commit, v.device)
        launch_gdn_decode(out, *args, config)
        return out


def check_gdn_step(case: GDNCase, lengths: list[int], slots: list[int], commit: bool,
                   config: TileConfig | None = None) -> None:
    """One call, kernel vs reference on copies of the same pool: outputs of real rows, every
    tensor of every real slot, and bit-identity of every slot outside the batch."""
    inputs = case.inputs(sum(lengths))
    pending = case.pending_inputs(slots, case.pool["pending_counts"])
    before = clone(case.pool)
    expected_pool, actual_pool = clone(case.pool), clone(case.pool)
    expected = case.run(False, expected_pool, inputs, pending, lengths, slots, commit)
    actual = case.run(True, actual_pool, inputs, pending, lengths, slots, commit, config)
    rtol = TOLERANCE[case.dtype]
    start = 0
    for length, slot in zip(lengths, slots):
        if slot != PAD_SLOT:
            span = slice(start, start + length)
            assert_close(actual[span], expected[span], rtol, f"output of slot {slot}")
            # a bf16 state rounds each store
            tolerance = max(rtol, TOLERANCE[actual_pool["state"].dtype])
            assert_close(actual_pool["state"][slot], expected_pool["state"][slot], tolerance, f"state[{slot}]")
            written = 0 if commit else length - 1  # the drafts' g, beta; entries past those stay as they were
            for name in ("pending_g", "pending_beta"):
                actual_entries, expected_entries = actual_pool[name][slot], expected_pool[name][slot]
                if written:
                    assert_close(actual_entries[:written], expected_entries[:written], rtol, f"{name}[{slot}]")
                assert torch.equal(bits(actual_entries[written:]), bits(before[name][slot, written:])), name
        start += length
    assert_slots_untouched(actual_pool, before, owned=set(slots))


# Rows: (new tokens, slot, pending count of the slot) with P = k = 4: 1..k+1 new tokens over 0..k
# pending; pad rows (slot 0) last, as CUDA graphs pad.
RAGGED = [(1, 5, 0), (5, 2, 4), (2, 7, 3), (1, 3, 1), (3, 8, 0), (5, 4, 0), (1, PAD_SLOT, None),
          (1, PAD_SLOT, None)]


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
    """K = V = 32 with 16-column tiles: 2 V tiles per value head, each owning 1 of its 2 pending
    g / beta replicas (every replica is checked against the reference's); the state pool is bf16."""
    case = ragged_case(20, 2, 4, 32, torch.bfloat16, kernel_device)
    check_gdn_step(case, [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED], commit,
                   TileConfig(block_n=16, num_warps=1))


def test_gdn_decode_verify_steps_across_tile_widths(kernel_device):
    """Verify steps on one pool whose tile width changes every step (16, 64, 32 of V = 64 columns,
    as the batch size moves decode_config): a step folds the pending g / beta that tiles of
    another width wrote (a tile reads the first replica it owns), against the reference run on
    its own copy of the pool; each step accepts some drafts (the new pending counts)."""
    case = ragged_case(21, 2, 4, 64, torch.float32, kernel_device)
    lengths, slots = [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED]
    expected_pool, actual_pool = clone(case.pool), clone(case.pool)
    for step, block_v in enumerate((16, 64, 32)):
        inputs = case.inputs(sum(lengths))
        pending = case.pending_inputs(slots, expected_pool["pending_counts"])
        expected = case.run(False, expected_pool, inputs, pending, lengths, slots, False)
        actual = case.run(True, actual_pool, inputs, pending, lengths, slots, False,
                          TileConfig(block_n=block_v, num_warps=1))
        start = 0
        for length, slot in zip(lengths, slots):
            if slot != PAD_SLOT:
                what = f"step {step}, slot {slot}"
                assert_close(actual[start:start + length], expected[start:start + length], 1e-4, what)
                for name in ("state", "pending_g", "pending_beta"):
                    assert_close(actual_pool[name][slot], expected_pool[name][slot], 1e-4, f"{what}: {name}")
                accepted = int(torch.randint(0, length, (), generator=case.gen))  # drafts accepted: 0..n-1
                for pool in (expected_pool, actual_pool):
                    pool["pending_counts"][slot] = accepted
            start += length


def test_gdn_decode_rejects_a_tile_narrower_than_a_replica():
    """A tile must own whole pending replicas: 8 columns of V = 32 (16 columns a replica) is refused."""
    case = ragged_case(22, 2, 4, 32, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="whole pending replicas"):
        case.run(True, clone(case.pool), case.inputs(1), case.pending_inputs([5], case.pool["pending_counts"]),
                 [1], [5], False, TileConfig(block_n=8, num_warps=1))


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
def test_gdn_decode_one_token_rows_fold_pending(kernel_device, commit):
    """Every row runs exactly one new token (the kernel's one-token path, no loads ahead) after
    folding its slot's 0..k pending tokens: a speculative step whose rows drafted nothing."""
    case = ragged_case(27, 2, 4, 32, torch.float32, kernel_device)
    check_gdn_step(case, [1] * len(RAGGED), [s for _, s, _ in RAGGED], commit)


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
def test_gdn_decode_strongly_decaying_heads(kernel_device, commit):
    """Heads whose decay underflows fp32 within a token or a few (g down to about -100, pending g
    -60), one that decays by about e^-8 a token (the kernel's running decay scale crosses 2^-60
    mid-row and is folded into the tile) and a mild one: exp(g) = 0 wipes the state, and nothing
    divides by it."""
    case = ragged_case(25, 2, 4, 16, torch.float32, kernel_device)
    case.A_log = torch.tensor([3.0, 2.5, 4.0, -2.0], device=kernel_device)
    case.dt_bias = torch.tensor([5.0, 0.0, 2.0, 0.0], device=kernel_device)
    case.pool["pending_g"][:, :, 0] = -60.0
    check_gdn_step(case, [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED], commit)


def test_decode_config_by_batch(monkeypatch):
    """On a 132-SM GPU (HV = 16, K = V = 128): verify takes 16-column tiles up to four programs of
    16 columns per SM (B = 4), 32 above; decode 16 columns up to eight per SM (B = 8), 32 up to
    sixteen (B = 16), 64 on two warps above."""
    monkeypatch.setattr(gdn_decode_module, "INTERPRETED", False)
    monkeypatch.setattr(gdn_decode_module, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    tiles = lambda batch, commit: decode_config(batch, 16, 128, 128, commit, cuda)  # noqa: E731
    assert [tiles(b, False) for b in (1, 2, 4, 5, 8, 256)] == \
        [TileConfig(block_n=16, num_warps=1)] * 3 + [TileConfig(block_n=32, num_warps=1)] * 3
    assert [tiles(b, True) for b in (1, 8, 9, 16, 17, 256)] == \
        [TileConfig(block_n=16, num_warps=1)] * 2 + [TileConfig(block_n=32, num_warps=1)] * 2 \
        + [TileConfig(block_n=64, num_warps=2)] * 2


def test_gdn_decode_ignores_nonfinite_pending_past_the_count(kernel_device):
    """Pool g / beta past each count are NaN too (the step buffer's always are)."""
    case = ragged_case(30, 2, 4, 16, torch.float32, kernel_device)
    for _, slot, count in RAGGED:
        if count is not None:
            for name in ("pending_g", "pending_beta"):
                case.pool[name][slot, count:] = float("nan")
    check_gdn_step(case, [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED], commit=False)


def test_gdn_decode_plain_decode_without_pending_buffers(kernel_device):
    """P = 0 (no speculation): empty pending buffers, one token per row, commit."""
    case = GDNCase(35, 2, 4, 16, 16, max_pending=0, num_slots=6, dtype=torch.float32,
                   state_dtype=torch.float32, device=kernel_device)
    check_gdn_step(case, [1, 1, 1, 1], [4, 1, 3, PAD_SLOT], commit=True)


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "reference"])
def test_gdn_decode_writes_into_a_row_slice(kernel_device, kernel):
    """out= a row slice of a NaN-poisoned buffer (the decode rows of the layer's output, which
    prefill rows follow): the slice holds what a fresh output holds, every other row stays NaN."""
    case = ragged_case(33, 2, 4, 16, torch.float32, kernel_device)
    lengths, slots = [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED]
    num_tokens = sum(lengths)
    inputs = case.inputs(num_tokens)
    pending = case.pending_inputs(slots, case.pool["pending_counts"])
    expected_pool, actual_pool = clone(case.pool), clone(case.pool)
    expected = case.run(False, expected_pool, inputs, pending, lengths, slots, commit=False)
    buffer = torch.full((num_tokens + 5, case.hv, case.value_dim), float("nan"), device=kernel_device)
    out = buffer[2:2 + num_tokens]
    fn = gdn_decode if kernel else gdn_decode_reference
    returned = fn(*case.args(actual_pool, inputs, pending, lengths, slots, False), out=out)
    assert returned.data_ptr() == out.data_ptr() and returned.shape == out.shape
    start = 0
    for length, slot in zip(lengths, slots):
        if slot != PAD_SLOT:  # pad rows share scratch slot 0: their outputs are garbage
            span = slice(start, start + length)
            assert_close(out[span], expected[span], TOLERANCE[torch.float32], f"output of slot {slot}")
            assert_close(actual_pool["state"][slot], expected_pool["state"][slot], TOLERANCE[torch.float32],
                         f"state[{slot}]")
        start += length
    assert buffer[:2].isnan().all() and buffer[2 + num_tokens:].isnan().all(), "rows outside out were written"


class LayerCase:
    """One GDN layer's decode path as the model drives it: the conv decode kernel (window ++
    pending raw inputs -> conv outputs of new and pending tokens), then the GDN decode kernel
    folding the pending k, v from the conv's step buffer. Pool: conv window, pending raw
    inputs, recurrent state, pending g / beta, counts."""

    def __init__(self, seed: int, max_pending: int, slots: list[int], seq_len: int, device: str) -> None:
        self.gdn = GDNCase(seed, 2, 4, 16, 16, max_pending, num_slots=10, dtype=torch.float32,
                           state_dtype=torch.float32, device=device)
        gen, self.device = self.gdn.gen, device
        self.channels = 2 * 2 * 16 + 4 * 16
        self.weight = (0.6 * torch.randn(self.channels, 4, generator=gen)).to(device)
        self.pool = {**conv_pool(gen, 10, max_pending, self.channels, 4, device), **self.gdn.pool}
        self.pool["pending_counts"][slots] = 0  # a finished prefill: nothing pending
        self.x = {s: torch.randn(seq_len, self.channels, generator=gen).to(device) for s in slots}
        self.ab = {s: torch.randn(seq_len, 2 * 4, generator=gen).to(device) for s in slots}

    def step(self, kernel: bool, pool, spans: dict[int, tuple[int, int]], commit: bool) -> dict[int, torch.Tensor]:
        """Feed tokens [i, j) of each slot; -> outputs per slot."""
        lengths, slots = [j - i for i, j in spans.values()], list(spans)
        x = torch.cat([self.x[s][i:j] for s, (i, j) in spans.items()])
        ab = torch.cat([self.ab[s][i:j] for s, (i, j) in spans.items()])
        conv_out, pending_out = run_conv_decode(kernel, x, self.weight, lengths, slots, pool, commit)
        q, k, v = self.gdn.split(conv_out)
        _, pending_k, pending_v = self.gdn.split(pending_out)
        out = self.gdn.run(kernel, pool, (q, k, v, ab[:, :4], ab[:, 4:]), (pending_k, pending_v), lengths, slots,
                           commit)
        return dict(zip(slots, out.split(lengths)))


def test_layer_verify_rollback_matches_plain_decode(kernel_device):
    """Conv + GDN kernels through verify steps whose pending inputs the kernels wrote themselves,
    acceptance (the engine only sets counts: 0, some, all k drafts) and commit steps, side by side
    with the references. Every output must equal plain one-token decode of the same sequence,
    and the final state and window too: committed state + pending inputs reproduce the state of
    the accepted tokens alone."""
    k, seq_len = 3, 12
    # per slot, (tokens fed, drafts accepted) per verify step; then commit steps finish the rest
    schedules = {6: [(4, 0), (4, 3), (4, 1)], 1: [(2, 1), (2, 0), (1, 0)], 4: [(1, 0), (3, 2), (4, 3)],
                 9: [(4, 3), (4, 3), (2, 1)]}
    slots = list(schedules)
    case = LayerCase(40, k, slots, seq_len, kernel_device)
    plain_pool = clone(case.pool)
    plain = {s: [] for s in slots}
    for t in range(seq_len):
        for s, out in case.step(True, plain_pool, {s: (t, t + 1) for s in slots}, commit=True).items():
            plain[s].append(out)
    plain = {s: torch.cat(outs) for s, outs in plain.items()}

    rtol = TOLERANCE[torch.float32]
    before = clone(case.pool)
    expected_pool, actual_pool = clone(case.pool), clone(case.pool)
    position = {s: 0 for s in slots}

    def step(spans, commit, what):
        expected = case.step(False, expected_pool, spans, commit)
        actual = case.step(True, actual_pool, spans, commit)
        for s, (i, j) in spans.items():
            assert_close(actual[s], expected[s], rtol, f"{what}: slot {s} vs reference")
            assert_close(actual[s], plain[s][i:j], rtol, f"{what}: slot {s} vs plain decode")

    for step_index in range(3):
        step({s: (position[s], position[s] + schedules[s][step_index][0]) for s in slots}, False,
             f"verify step {step_index}")
        for s in slots:
            accepted = schedules[s][step_index][1]
            for pool in (expected_pool, actual_pool):
                pool["pending_counts"][s] = accepted
            position[s] += 1 + accepted
    while any(p < seq_len for p in position.values()):
        spans = {s: (p, min(p + k + 1, seq_len)) for s, p in position.items() if p < seq_len}
        step(spans, True, "commit step")
        for s, (_, j) in spans.items():
            position[s] = j
            for pool in (expected_pool, actual_pool):
                pool["pending_counts"][s] = 0
    for name in ("state", "conv"):
        assert_close(actual_pool[name][slots], expected_pool[name][slots], rtol, f"{name} vs reference")
        assert_close(actual_pool[name][slots], plain_pool[name][slots], rtol, f"{name} vs plain decode")
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
    tiles = ((16, 1), (32, 1), (32, 2), (64, 2), (64, 8))
    configs = [None] + [TileConfig(block_n=block_v, num_warps=warps) for block_v, warps in tiles]
    for config in configs:
        check_gdn_step(case, lengths, slots, commit, config)


@pytest.mark.gpu
def test_gdn_decode_cuda_graph_replay():
    """Captured once, replayed over steps whose pending counts and inputs change in place."""
    case = GDNCase(60, 16, 32, 128, 128, max_pending=3, num_slots=12, dtype=torch.bfloat16,
                   state_dtype=torch.float32, device="cuda")
    lengths, slots = [4, 4, 4, 4], [3, 7, 1, 10]
    static = case.inputs(sum(lengths)) + case.pending_inputs(slots, case.pool["pending_counts"])
    pool = clone(case.pool)
    expected_pool = clone(case.pool)
    out = torch.empty_like(static[2], memory_format=torch.contiguous_format)
    cu, slot_ids = cu_seqlens_of(lengths, "cuda"), torch.tensor(slots, dtype=torch.int32, device="cuda")
    config = decode_config(len(slots), case.hv, 128, 128, False, torch.device("cuda"))

    def step(p):
        launch_gdn_decode(out, *static[:5], case.A_log, case.dt_bias, cu, slot_ids, p["state"], *static[5:],
                          p["pending_g"], p["pending_beta"], p["pending_counts"], False, config)

    step(clone(pool))  # warm-up on a scratch copy: compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pool)
    for i in range(3):
        fresh = case.inputs(sum(lengths)) + case.pending_inputs(slots, pool["pending_counts"])
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        expected = case.run(False, expected_pool, fresh[:5], fresh[5:], lengths, slots, commit=False)
        assert_close(out, expected, TOLERANCE[torch.bfloat16], f"replay {i}")
        for slot, count in zip(slots, (i, 3, 1, 3)):
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


def check_conv_step(pool, x, weight, lengths: list[int], slots: list[int], commit: bool, rtol: float) -> None:
    """One call, kernel vs reference on copies of the pool: outputs of the new tokens and of the
    pending tokens (step buffer, first p entries) of real rows, windows and pending columns of
    real slots bit for bit, every other slot untouched."""
    before = clone(pool)
    expected_pool, actual_pool = clone(pool), clone(pool)
    expected, expected_pending = run_conv_decode(False, x, weight, lengths, slots, expected_pool, commit)
    actual, actual_pending = run_conv_decode(True, x, weight, lengths, slots, actual_pool, commit)
    start = 0
    for row, (length, slot) in enumerate(zip(lengths, slots)):
        if slot != PAD_SLOT:
            span = slice(start, start + length)
            assert_close(actual[span], expected[span], rtol, f"output of slot {slot}")
            count = int(before["pending_counts"][slot])
            assert_close(actual_pending[row, :count], expected_pending[row, :count], rtol, f"pending of slot {slot}")
            assert torch.equal(actual_pool["conv"][slot], expected_pool["conv"][slot]), f"window of slot {slot}"
            assert torch.equal(bits(actual_pool["pending_conv"][slot]), bits(expected_pool["pending_conv"][slot]))
        start += length
    assert_slots_untouched(actual_pool, before, owned=set(slots))


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
def test_conv1d_decode_ragged_batch(kernel_device, commit):
    """1..P+1 new tokens per row over 0..P pending columns (NaN past the count), pad rows on slot 0."""
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
    check_conv_step(pool, x, weight, lengths, slots, commit, TOLERANCE[torch.float32])


def test_conv1d_plain_decode_without_pending_buffers(kernel_device):
    """P = 0 (no speculation): empty pending buffers, one token per row, commit."""
    gen = torch.Generator().manual_seed(72)
    pool = conv_pool(gen, 6, 0, 40, 4, kernel_device)
    x = conv_inputs(gen, 4, 40, torch.float32, kernel_device)
    weight = torch.randn(40, 4, generator=gen).to(kernel_device)
    check_conv_step(pool, x, weight, [1, 1, 1, 1], [4, 1, 3, PAD_SLOT], True, TOLERANCE[torch.float32])


def test_conv1d_decode_verify_rollback_sequence(kernel_device):
    gen = torch.Generator().manual_seed(71)
    channels, width, max_pending = 24, 4, 3
    pool = conv_pool(gen, 8, max_pending, channels, width, kernel_device)
    lengths, slots = [4, 1, 3], [6, 2, 5]
    pool["pending_counts"][slots] = 0
    weight = torch.randn(channels, width, generator=gen).to(kernel_device)
    expected_pool, actual_pool = clone(pool), clone(pool)
    for step, counts in enumerate([[3, 0, 0], [0, 0, 2], [1, 0, 2], None]):  # accepted drafts
        x = conv_inputs(gen, sum(lengths), channels, torch.float32, kernel_device)
        commit = counts is None
        expected, _ = run_conv_decode(False, x, weight, lengths, slots, expected_pool, commit)
        actual, _ = run_conv_decode(True, x, weight, lengths, slots, actual_pool, commit)
        assert_close(actual, expected, TOLERANCE[torch.float32], f"step {step}")
        for pool_ in (expected_pool, actual_pool):
            pool_["pending_counts"][slots] = torch.tensor(counts or [0, 0, 0], dtype=torch.int32,
                                                          device=kernel_device)
    assert torch.equal(actual_pool["conv"][slots], expected_pool["conv"][slots])


def check_conv_layer_buffers(kernel: bool, channels: int, dtype: torch.dtype, device: str, rtol: float) -> None:
    """The conv as the GDN layer drives it: x is the q|k|v column view of one projection output
    (row stride C + 9), decode rows (verify, pending 0..P) first and prefill rows after, each
    group writing its rows of one NaN-poisoned buffer through out= (itself a strided view: the
    buffer is wider than C). Outputs and windows equal the reference's fresh outputs; rows and
    columns outside the view stay NaN."""
    gen = torch.Generator().manual_seed(73 + channels)
    width, max_pending = 4, 4
    pool = conv_pool(gen, 10, max_pending, channels, width, device)
    pool = {name: t.to(dtype) if t.is_floating_point() else t for name, t in pool.items()}
    decode_lengths, decode_slots, counts = [1, 5, 3], [5, 2, 8], [0, 4, 2]
    prefill_lengths, prefill_slots, has_initial = [7, 1, 20], [3, 9, 6], [True, False, True]
    pool["pending_counts"][decode_slots] = torch.tensor(counts, dtype=torch.int32, device=device)
    num_decode, num_prefill = sum(decode_lengths), sum(prefill_lengths)
    num_tokens = num_decode + num_prefill
    projection = torch.randn(num_tokens, channels + 9, generator=gen).to(dtype).to(device)
    mixed = projection[:, :channels]                               # the q|k|v columns; z, b, a follow
    weight = torch.randn(channels, width, generator=gen).to(dtype).to(device)
    ids = lambda slots: torch.tensor(slots, dtype=torch.int32, device=device)  # noqa: E731
    decode_args = (cu_seqlens_of(decode_lengths, device), ids(decode_slots))
    prefill_args = (cu_seqlens_of(prefill_lengths, device), ids(prefill_slots),
                    torch.tensor(has_initial, device=device))

    expected_pool, actual_pool = clone(pool), clone(pool)
    expected_decode, expected_pending = causal_conv1d_decode_reference(
        mixed[:num_decode], weight, *decode_args, expected_pool["conv"], expected_pool["pending_conv"],
        expected_pool["pending_counts"], False)
    expected_prefill = causal_conv1d_prefill_reference(mixed[num_decode:], weight, *prefill_args, expected_pool["conv"])

    buffer = torch.full((num_tokens + 3, channels + 2), float("nan"), dtype=dtype, device=device)
    conv_out = buffer[1:1 + num_tokens, 1:1 + channels]
    decode = causal_conv1d_decode if kernel else causal_conv1d_decode_reference
    prefill = causal_conv1d_prefill if kernel else causal_conv1d_prefill_reference
    returned, pending = decode(mixed[:num_decode], weight, *decode_args, actual_pool["conv"],
                               actual_pool["pending_conv"], actual_pool["pending_counts"], False,
                               out=conv_out[:num_decode])
    assert returned.data_ptr() == conv_out.data_ptr() and returned.shape == (num_decode, channels)
    returned = prefill(mixed[num_decode:], weight, *prefill_args, actual_pool["conv"], out=conv_out[num_decode:])
    assert returned.data_ptr() == conv_out[num_decode:].data_ptr() and returned.shape == (num_prefill, channels)

    assert_close(conv_out[:num_decode], expected_decode, rtol, "decode rows")
    assert_close(conv_out[num_decode:], expected_prefill, rtol, "prefill rows")
    for row, count in enumerate(counts):
        assert_close(pending[row, :count], expected_pending[row, :count], rtol, f"pending outputs of row {row}")
    for slot in decode_slots + prefill_slots:
        assert torch.equal(actual_pool["conv"][slot], expected_pool["conv"][slot]), f"window of slot {slot}"
    outside = torch.ones(buffer.shape, dtype=torch.bool, device=device)
    outside[1:1 + num_tokens, 1:1 + channels] = False
    assert buffer[outside].isnan().all(), "the launchers wrote outside out"


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "reference"])
def test_conv1d_strided_inputs_write_into_out_views(kernel_device, kernel):
    check_conv_layer_buffers(kernel, 40, torch.float32, kernel_device, TOLERANCE[torch.float32])


def test_conv1d_launchers_check_channel_strides(kernel_device):
    """Rows may be strided, channels may not (the kernels load a channel tile as one vector)."""
    gen = torch.Generator().manual_seed(74)
    pool = conv_pool(gen, 4, 2, 16, 4, kernel_device)
    weight = torch.randn(16, 4, generator=gen).to(kernel_device)
    x = torch.randn(16, 3, generator=gen).to(kernel_device).t()          # [3, 16], channel stride 3
    good = conv_inputs(gen, 3, 16, torch.float32, kernel_device)
    args = (cu_seqlens_of([3], kernel_device), torch.tensor([1], dtype=torch.int32, device=kernel_device))
    flags = torch.tensor([False], device=kernel_device)
    with pytest.raises(AssertionError):
        causal_conv1d_prefill(x, weight, *args, flags, pool["conv"])
    with pytest.raises(AssertionError, match="unit channel stride"):
        causal_conv1d_prefill(good, weight, *args, flags, pool["conv"], out=torch.empty_like(x))
    with pytest.raises(AssertionError):
        causal_conv1d_decode(x, weight, *args, pool["conv"], pool["pending_conv"], pool["pending_counts"], False)


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
        lengths, slots = [1, 5, 2, 1], [3, 1, 7, PAD_SLOT]
        x = conv_inputs(gen, sum(lengths), channels, torch.bfloat16, "cuda")
        check_conv_step(pool, x, weight, lengths, slots, commit, TOLERANCE[torch.bfloat16])
    check_conv_layer_buffers(True, channels, torch.bfloat16, "cuda", TOLERANCE[torch.bfloat16])


# ----------------------------------------------------------------------------------------------
# Norms, SwiGLU activation and q/k norm + RoPE
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


def check_silu_and_mul(num_tokens: int, intermediate: int, dtype: torch.dtype, device: str, rtol: float,
                       monkeypatch) -> None:
    """gate_up as F.linear returns it or as a strided row view (a wider buffer's columns); the
    output is allocated NaN (torch.empty poisoned), so an unwritten element fails."""
    gen = torch.Generator().manual_seed(num_tokens + intermediate)
    wide = (2 * torch.randn(num_tokens, 2 * intermediate + 11, generator=gen)).to(dtype).to(device)
    for gate_up in (wide[:, 3:3 + 2 * intermediate], wide[:, :2 * intermediate].contiguous()):
        expected = silu_and_mul_reference(gate_up)
        with monkeypatch.context() as patch:
            empty = torch.empty
            patch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan")))
            actual = silu_and_mul(gate_up)
        assert actual.dtype == dtype and actual.is_contiguous()
        assert_close(actual, expected, rtol, f"silu_and_mul T={num_tokens} I={intermediate}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,intermediate", [(0, 24), (1, 40), (6, 24), (2, 1100)],
                         ids=["empty", "decode", "tokens", "two-column-tiles"])
def test_silu_and_mul(kernel_device, monkeypatch, num_tokens, intermediate, dtype):
    """fp16 rounds once (fp32 math), as the reference: they may differ by one fp16 ulp."""
    rtol = {torch.float32: 2e-5, torch.float16: 1e-3}[dtype]
    check_silu_and_mul(num_tokens, intermediate, dtype, kernel_device, rtol, monkeypatch)


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


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_silu_and_mul_gpu_bf16(monkeypatch, num_tokens):
    """bf16 at the 0.8B dense width (3584), a wide dense one (12288), the Qwen3-Next expert and
    shared-expert width (512) and one that is no multiple of the tile (1000). The reference rounds
    once from fp32 too, so they agree to a bf16 ulp."""
    for intermediate in (3584, 12288, 512, 1000):
        check_silu_and_mul(num_tokens, intermediate, torch.bfloat16, "cuda", 1e-2, monkeypatch)
