"""GDN deferred-commit decode/verify (kernels/gdn_decode.py): the torch reference, driven as one GDN
layer with the conv1d and chunked-prefill references, against a naive float64 recurrence written
here; then the Triton kernel against the reference, alone and chained with the conv decode kernel
(kernels/conv1d.py) as the layer drives them.

Reference. Contracts checked: deferred commit is exact (docs/design.md, "Deferred commit"): one
prefill, commit decode steps, or verify steps with pending counts 0..k and rollback give the same
outputs and final state; a verify step commits its first token at once, and committed state +
pending raw inputs and g, beta reproduce the state of running only the accepted tokens; pending
columns past the count are never read; slots not in the batch are bit-identical after every
call; slot 0 is scratch for pad rows.

Triton kernel, with the reference as the oracle. Inputs are fresh seeded random draws (no zeros);
outputs are poisoned with NaN before the kernel writes them (launch_gdn_decode) or freshly
allocated; every pool slot a batch does not own holds finite garbage and must stay bit-identical.
Batches are ragged (1 to P+1 tokens per row, a sequence of length 1), slots permuted, pad rows
point at scratch slot 0 (whose pending count is garbage), pending counts range over 0..P (P = k;
P = 0 for plain decode), q/k/v and the pending k/v of the step buffer are strided views of conv
outputs and a/b of the projection, exactly as engine/models/layers.py passes them. Step-buffer
entries past a row's pending count are NaN (the conv kernel leaves them unwritten). A layer test
chains the conv and GDN kernels through verify steps, acceptance and commit steps against plain
decode. The `out=` view the layer passes (a row slice of its step buffer) is written in place by
kernel and reference alike, and nothing outside it is.

CPU: the interpreter, fp32, tiny head dims (16/32), HV = HK and HV = 2 HK, one V tile and two.
GPU (`gpu` marker): bf16 activations, K = V = 128, fp32 and bf16 state pools, every V-tile
config, capture in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.gdn import pending_replicas
import deltaspec.kernels.gdn_decode as gdn_decode_module
from deltaspec.kernels.gdn_decode import decode_config, gdn_decode, launch_gdn_decode
from deltaspec.kernels.tiles import TileConfig
from kernel_helpers import (PAD_SLOT, RAGGED, TOLERANCE, assert_close, assert_close_elementwise,
                            assert_slots_untouched, bits, clone, conv_pool, cu_seqlens_of, naive_conv, naive_gdn,
                            naive_step, random_gating_params, run_conv_decode)


# Through the backend table, so the tests follow the references wherever they live.
causal_conv1d_prefill_reference = REFERENCE_OPS.causal_conv1d_prefill
causal_conv1d_decode_reference = REFERENCE_OPS.causal_conv1d_decode
gdn_chunked_reference = REFERENCE_OPS.gdn_chunked
gdn_decode_reference = REFERENCE_OPS.gdn_decode


# ----------------------------------------------------------------------------------------------
# Torch reference: deferred commit of a conv + GDN layer, prefill vs commit decode vs verify
# with rollback, against float64 truth
# ----------------------------------------------------------------------------------------------

WIDTH, KEY_DIM, VALUE_DIM, NUM_SLOTS, MAX_PENDING, SEQ_LEN = 4, 8, 6, 9, 3, 10  # MAX_PENDING = k

REPLICAS = 2  # of each pending g / beta in the pool (kernels/gdn.py): the reference reads the first, writes all


class Layer:
    """One GDN layer as the model drives it: conv over the q|k|v channels, split, recurrence."""

    def __init__(self, gen: torch.Generator, num_key_heads: int, num_value_heads: int) -> None:
        self.hk, self.hv = num_key_heads, num_value_heads
        self.channels = 2 * num_key_heads * KEY_DIM + num_value_heads * VALUE_DIM
        self.weight = torch.randn(self.channels, WIDTH, generator=gen) * 0.6
        self.A_log, self.dt_bias = random_gating_params(gen, num_value_heads)

    def split(self, conv_out: torch.Tensor):
        """[..., C] -> q, k [..., HK, K], v [..., HV, V]."""
        key = self.hk * KEY_DIM
        q, k, v = conv_out.split((key, key, self.hv * VALUE_DIM), dim=-1)
        return (q.unflatten(-1, (self.hk, KEY_DIM)), k.unflatten(-1, (self.hk, KEY_DIM)),
                v.unflatten(-1, (self.hv, VALUE_DIM)))

    def naive(self, x, a, b, window, state):
        """Whole sequence in float64: -> (outputs [L, HV, V], final state, final window)."""
        sequence = torch.cat([window.double(), x.double()])
        q, k, v = self.split(naive_conv(sequence, self.weight))
        out, final = naive_gdn(q, k, v, a, b, self.A_log, self.dt_bias, state)
        return out, final, sequence[-(WIDTH - 1):]

    def naive_fold(self, pool, slot: int):
        """Committed state and window of a slot with its pending drafts folded in, float64, from
        what the pool keeps of them: raw conv inputs and g, beta. -> (state, window)."""
        count = int(pool["pending_counts"][slot])
        sequence = torch.cat([pool["conv"][slot], pool["pending_conv"][slot, :count]]).double()
        _, k, v = self.split(naive_conv(sequence, self.weight))
        state = pool["state"][slot].double().clone()
        group = self.hv // self.hk
        for name in ("pending_g", "pending_beta"):  # every replica of a valid entry holds the same value
            entries = pool[name][slot, :count]
            assert torch.equal(entries, entries[..., :1].expand_as(entries)), f"{name}[{slot}] replicas differ"
        for t in range(count):
            for h in range(self.hv):
                state[h] = naive_step(state[h], k[t, h // group], v[t, h], float(pool["pending_g"][slot, t, h, 0]),
                                      float(pool["pending_beta"][slot, t, h, 0]))
        return state, sequence[-(WIDTH - 1):]

    def new_pool(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Every slot filled with finite garbage (stale contents), random pending counts."""
        s, p = NUM_SLOTS, MAX_PENDING
        return dict(
            state=0.5 * torch.randn(s, self.hv, KEY_DIM, VALUE_DIM, generator=gen),
            conv=torch.randn(s, WIDTH - 1, self.channels, generator=gen),
            pending_conv=torch.randn(s, p, self.channels, generator=gen),
            pending_g=-torch.rand(s, p, self.hv, 1, generator=gen).repeat(1, 1, 1, REPLICAS),
            pending_beta=torch.rand(s, p, self.hv, 1, generator=gen).repeat(1, 1, 1, REPLICAS),
            pending_counts=torch.randint(0, p + 1, (s,), generator=gen, dtype=torch.int32),
        )

    def prefill(self, pool, x, a, b, lengths, slots, has_initial):
        cu, slot_ids = cu_seqlens_of(lengths), torch.tensor(slots, dtype=torch.int32)
        conv_out = causal_conv1d_prefill_reference(x, self.weight, cu, slot_ids, torch.tensor(has_initial), pool["conv"])
        q, k, v = self.split(conv_out)
        return gdn_chunked_reference(q, k, v, a, b, self.A_log, self.dt_bias, cu, slot_ids,
                                     torch.tensor(has_initial), pool["state"])

    def decode(self, pool, x, a, b, lengths, slots, commit):
        cu, slot_ids = cu_seqlens_of(lengths), torch.tensor(slots, dtype=torch.int32)
        conv_out, pending_out = causal_conv1d_decode_reference(x, self.weight, cu, slot_ids, pool["conv"],
                                                               pool["pending_conv"], pool["pending_counts"], commit)
        q, k, v = self.split(conv_out)
        _, pending_k, pending_v = self.split(pending_out)
        return gdn_decode_reference(q, k, v, a, b, self.A_log, self.dt_bias, cu, slot_ids, pool["state"],
                                    pending_k, pending_v, pool["pending_g"], pool["pending_beta"],
                                    pool["pending_counts"], commit)


# Verify schedules: per sequence, (tokens fed, drafts accepted) per step. The first fed token is
# always accepted; the accepted drafts set the slot's pending count (0 = every draft rolled
# back, k = all kept) and the next step re-feeds from the first rejected draft. The rest of the
# sequence is then fed in commit steps of at most k+1 tokens.
SCHEDULES = {
    5: [(4, 0), (4, 3), (4, 1), (2, 1)],   # k=3: full rollback, then pending k, ...; final 1 token over 1
    2: [(2, 1), (2, 1), (2, 0), (2, 1)],   # k=1; final 3 tokens over 1 pending
    7: [(1, 0), (1, 0), (1, 0), (1, 0)],   # no drafts: plain decode through the verify path; final 4 + 2
    3: [(3, 2), (3, 0), (3, 2), (1, 0)],   # k=2; final 2 tokens over 0 pending
}

SLOTS = list(SCHEDULES)  # batch order: permuted slots, never 0


class Sequences:
    """SEQ_LEN tokens per slot (conv inputs x, gating inputs a, b), an initial committed state
    and window, and the float64 truth for the whole sequence."""

    def __init__(self, gen: torch.Generator, layer: Layer) -> None:
        self.layer = layer
        self.x = {s: torch.randn(SEQ_LEN, layer.channels, generator=gen) for s in SLOTS}
        self.a = {s: torch.randn(SEQ_LEN, layer.hv, generator=gen) for s in SLOTS}
        self.b = {s: torch.randn(SEQ_LEN, layer.hv, generator=gen) for s in SLOTS}
        self.state0 = {s: 0.5 * torch.randn(layer.hv, KEY_DIM, VALUE_DIM, generator=gen) for s in SLOTS}
        self.window0 = {s: torch.randn(WIDTH - 1, layer.channels, generator=gen) for s in SLOTS}
        self.truth = {s: self.truth_after(s, SEQ_LEN) for s in SLOTS}

    def truth_after(self, s: int, n: int):
        """float64 (outputs, state, window) after the first n >= 1 tokens of slot s."""
        return self.layer.naive(self.x[s][:n], self.a[s][:n], self.b[s][:n], self.window0[s], self.state0[s])

    def install(self, pool: dict[str, torch.Tensor]) -> None:
        """Committed state as a finished prefill leaves it: nothing pending."""
        for s in SLOTS:
            pool["state"][s] = self.state0[s]
            pool["conv"][s] = self.window0[s]
            pool["pending_counts"][s] = 0


def batch_of(seqs: Sequences, gen: torch.Generator, layer: Layer, spans: dict[int, tuple[int, int]],
             num_pad_rows: int = 0):
    """Pack token ranges [start, end) per slot (in SLOTS order), then 1-token pad rows on
    scratch slot 0 (as CUDA-graph padding does: several rows may share it)."""
    xs = [seqs.x[s][i:j] for s, (i, j) in spans.items()]
    as_ = [seqs.a[s][i:j] for s, (i, j) in spans.items()]
    bs = [seqs.b[s][i:j] for s, (i, j) in spans.items()]
    lengths, slots = [j - i for i, j in spans.values()], list(spans)
    for _ in range(num_pad_rows):
        xs.append(torch.randn(1, layer.channels, generator=gen))
        as_.append(torch.randn(1, layer.hv, generator=gen))
        bs.append(torch.randn(1, layer.hv, generator=gen))
        lengths.append(1)
        slots.append(PAD_SLOT)
    return torch.cat(xs), torch.cat(as_), torch.cat(bs), lengths, slots


def check_outputs(out: torch.Tensor, seqs: Sequences, spans: dict[int, tuple[int, int]], what: str) -> None:
    start = 0
    for s, (i, j) in spans.items():
        assert_close_elementwise(out[start:start + j - i], seqs.truth[s][0][i:j], what=f"{what}: slot {s} tokens {i}..{j - 1}")
        start += j - i


def check_committed(pool: dict[str, torch.Tensor], seqs: Sequences, slot: int, n: int, what: str) -> None:
    """The slot's committed state and window (pending ignored) are those after n tokens."""
    _, state, window = seqs.truth_after(slot, n)
    assert_close_elementwise(pool["state"][slot], state, what=f"{what}: committed state of slot {slot}")
    assert_close_elementwise(pool["conv"][slot], window, what=f"{what}: committed window of slot {slot}")


def check_final_state(pool: dict[str, torch.Tensor], seqs: Sequences, what: str) -> None:
    for s in SLOTS:
        check_committed(pool, seqs, s, SEQ_LEN, what)


def commit_rest(layer: Layer, seqs: Sequences, gen: torch.Generator, pool, position: dict[int, int]) -> None:
    """Feed every slot's remaining tokens in commit steps of at most k+1 tokens (pad rows too),
    checking outputs; rows with nothing left drop out."""
    while any(p < SEQ_LEN for p in position.values()):
        spans = {s: (p, min(p + MAX_PENDING + 1, SEQ_LEN)) for s, p in position.items() if p < SEQ_LEN}
        x, a, b, lengths, slots = batch_of(seqs, gen, layer, spans, num_pad_rows=2)
        check_outputs(layer.decode(pool, x, a, b, lengths, slots, commit=True), seqs, spans, "commit step")
        for s, (_, j) in spans.items():
            position[s] = j
            pool["pending_counts"][s] = 0  # folded (the engine's runner does not run commit over pending)


@pytest.fixture(params=[(2, 4), (2, 2)], ids=["HV=2HK", "HV=HK"])
def setup(request):
    gen = torch.Generator().manual_seed(7 + request.param[1])
    layer = Layer(gen, *request.param)
    return gen, layer, Sequences(gen, layer)


def test_deferred_commit_one_prefill(setup):
    """(a) All sequences as one varlen prefill from their committed state."""
    gen, layer, seqs = setup
    pool = layer.new_pool(gen)
    seqs.install(pool)
    before = {name: t.clone() for name, t in pool.items()}
    spans = {s: (0, SEQ_LEN) for s in SLOTS}
    x, a, b, lengths, slots = batch_of(seqs, gen, layer, spans, )
    out = layer.prefill(pool, x, a, b, lengths, slots, [True] * len(slots))
    check_outputs(out, seqs, spans, "prefill")
    check_final_state(pool, seqs, "prefill")
    assert_slots_untouched(pool, before, owned=set(SLOTS))


def test_deferred_commit_decode_steps(setup):
    """(b) SEQ_LEN batched decode steps with commit=True, one token per row, plus two pad rows on
    scratch slot 0 (pending count garbage): no other slot may change."""
    gen, layer, seqs = setup
    pool = layer.new_pool(gen)
    seqs.install(pool)
    pool["pending_counts"][PAD_SLOT] = MAX_PENDING
    before = {name: t.clone() for name, t in pool.items()}
    for t in range(SEQ_LEN):
        spans = {s: (t, t + 1) for s in SLOTS}
        x, a, b, lengths, slots = batch_of(seqs, gen, layer, spans, num_pad_rows=2)
        out = layer.decode(pool, x, a, b, lengths, slots, commit=True)
        check_outputs(out, seqs, spans, f"decode step {t}")
    check_final_state(pool, seqs, "decode")
    assert_slots_untouched(pool, before, owned=set(SLOTS) | {PAD_SLOT})


def test_deferred_commit_verify_with_rollback(setup):
    """(c) Verify steps (commit=False) with different token counts per row. Each stores the
    committed state up to its first fed token (always accepted); the engine then only sets the
    pending count to the accepted drafts (0..k), and committed + pending must equal the state
    of the accepted tokens alone. The next step re-feeds from the first rejected draft; commit
    steps fold pending + the remaining tokens. Every output and the final state/window must
    equal the whole-sequence truth."""
    gen, layer, seqs = setup
    pool = layer.new_pool(gen)
    seqs.install(pool)
    pool["pending_counts"][PAD_SLOT] = MAX_PENDING
    before = {name: t.clone() for name, t in pool.items()}
    position = {s: 0 for s in SLOTS}
    num_steps = len(next(iter(SCHEDULES.values())))
    for step in range(num_steps):
        spans = {s: (position[s], position[s] + SCHEDULES[s][step][0]) for s in SLOTS}
        x, a, b, lengths, slots = batch_of(seqs, gen, layer, spans, num_pad_rows=2)
        out = layer.decode(pool, x, a, b, lengths, slots, commit=False)
        check_outputs(out, seqs, spans, f"verify step {step}")
        for s in SLOTS:
            check_committed(pool, seqs, s, position[s] + 1, f"verify step {step}")
            accepted = SCHEDULES[s][step][1]
            pool["pending_counts"][s] = accepted  # acceptance: the only thing the engine does to the pool
            position[s] += 1 + accepted
            _, state, window = seqs.truth_after(s, position[s])
            folded_state, folded_window = layer.naive_fold(pool, s)
            assert_close_elementwise(folded_state, state, what=f"step {step}: committed + pending state of slot {s}")
            assert_close_elementwise(folded_window, window, what=f"step {step}: committed + pending window of slot {s}")
    assert all(p < SEQ_LEN for p in position.values())
    commit_rest(layer, seqs, gen, pool, position)
    check_final_state(pool, seqs, "verify + fold")
    assert_slots_untouched(pool, before, owned=set(SLOTS) | {PAD_SLOT})


def test_rejected_drafts_are_never_read():
    """With every draft rejected twice in a row (pending count 0), each verify step leaves the
    state of its first token alone, and the rest of the sequence behaves as if the drafts had
    never been fed."""
    gen = torch.Generator().manual_seed(11)
    layer = Layer(gen, 2, 4)
    seqs = Sequences(gen, layer)
    pool = layer.new_pool(gen)
    seqs.install(pool)
    for start in range(2):
        spans = {s: (start, start + 3) for s in SLOTS}
        x, a, b, lengths, slots = batch_of(seqs, gen, layer, spans, )
        layer.decode(pool, x, a, b, lengths, slots, commit=False)
        for s in SLOTS:
            pool["pending_counts"][s] = 0
            check_committed(pool, seqs, s, start + 1, "after rejected drafts")
    for t in range(2, SEQ_LEN):
        spans = {s: (t, t + 1) for s in SLOTS}
        x, a, b, lengths, slots = batch_of(seqs, gen, layer, spans, )
        check_outputs(layer.decode(pool, x, a, b, lengths, slots, commit=True), seqs, spans, f"step {t}")
    check_final_state(pool, seqs, "after rollbacks")


# ----------------------------------------------------------------------------------------------
# Stale state must never be read (design: pending columns past the count are rejected tokens). A
# previous owner that diverged can leave inf/NaN there; multiplying by 0 instead of selecting
# lets it leak into a new sequence.
# ----------------------------------------------------------------------------------------------

def test_gdn_decode_ignores_nonfinite_pending_columns_past_the_count():
    gen = torch.Generator().manual_seed(23)
    layer = Layer(gen, 2, 4)
    seqs = Sequences(gen, layer)
    pool = layer.new_pool(gen)
    seqs.install(pool)
    for name in ("pending_g", "pending_beta", "pending_conv"):
        pool[name][SLOTS] = float("nan")  # count is 0: none of these columns is valid
    spans = {s: (0, 1) for s in SLOTS}
    x, a, b, lengths, slots = batch_of(seqs, gen, layer, spans, )
    out = layer.decode(pool, x, a, b, lengths, slots, commit=True)
    check_outputs(out, seqs, spans, "decode over NaN rejected columns")


# ----------------------------------------------------------------------------------------------
# Triton kernel vs the torch reference
# ----------------------------------------------------------------------------------------------

def replicated(entries: torch.Tensor, value_dim: int) -> torch.Tensor:
    """Pending g or beta [S, P, HV] as the pool keeps them: [S, P, HV, R], R equal replicas."""
    return entries[..., None].repeat(1, 1, 1, pending_replicas(value_dim))


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
    # A bf16 state is rounded after every token: where the kernel's fp32 state and the reference's
    # differ in their last bits, a rounding can go the other way, a bf16 step (2^-8 of a value)
    # in the state and in every output after it, at each token of a row (two steps a token here).
    tolerance = rtol
    if actual_pool["state"].dtype != torch.float32:
        tolerance = max(rtol, TOLERANCE[actual_pool["state"].dtype], max(lengths) * 2 ** -7)
    start = 0
    for length, slot in zip(lengths, slots):
        if slot != PAD_SLOT:
            span = slice(start, start + length)
            assert_close(actual[span], expected[span], tolerance, f"output of slot {slot}")
            assert_close(actual_pool["state"][slot], expected_pool["state"][slot], tolerance, f"state[{slot}]")
            written = 0 if commit else length - 1  # the drafts' g, beta; entries past those stay as they were
            for name in ("pending_g", "pending_beta"):
                actual_entries, expected_entries = actual_pool[name][slot], expected_pool[name][slot]
                if written:
                    assert_close(actual_entries[:written], expected_entries[:written], rtol, f"{name}[{slot}]")
                assert torch.equal(bits(actual_entries[written:]), bits(before[name][slot, written:])), name
        start += length
    assert_slots_untouched(actual_pool, before, owned=set(slots))


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


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "triton"])
def test_bf16_state_verify_and_fold_equal_one_token_steps(kernel_device, kernel):
    """On a bf16 pool a verify row of 4 tokens, all drafts accepted, then a step folding them with
    a 5th token, gives the outputs and state of 5 one-token steps to fp32 precision: the state is
    rounded after every token as a one-token step's store rounds it (without that, the two differ
    by bf16's rounding, ~1e-3 of the state)."""
    case = GDNCase(70, 2, 4, 32, 32, max_pending=4, num_slots=4, dtype=torch.float32,
                   state_dtype=torch.bfloat16, device=kernel_device)
    slot = 2
    case.pool["pending_counts"].zero_()
    q, k, v, a, b = case.inputs(5)
    none = case.pending_inputs([slot], case.pool["pending_counts"])      # no pending entries
    plain_pool, spec_pool = clone(case.pool), clone(case.pool)
    plain = torch.cat([case.run(kernel, plain_pool, tuple(x[t:t + 1] for x in (q, k, v, a, b)), none, [1], [slot],
                                commit=True) for t in range(5)])
    verified = case.run(kernel, spec_pool, tuple(x[:4] for x in (q, k, v, a, b)), none, [4], [slot], commit=False)
    spec_pool["pending_counts"][slot] = 3                                  # every draft accepted
    pending = (torch.cat([k[1:4], torch.zeros_like(k[:1])])[None], torch.cat([v[1:4], torch.zeros_like(v[:1])])[None])
    folded = case.run(kernel, spec_pool, tuple(x[4:5] for x in (q, k, v, a, b)), pending, [1], [slot], commit=True)
    assert_close(torch.cat([verified, folded]), plain, 1e-5, "outputs: verify + fold vs one token a step")
    assert_close(spec_pool["state"][slot].float(), plain_pool["state"][slot].float(), 1e-5, "state")


@pytest.mark.slow
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


@pytest.mark.slow
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
