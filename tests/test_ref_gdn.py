"""The GDN and causal-conv1d torch references (kernels/gdn.py, kernels/conv1d.py) against naive
float64 implementations written here: per-token, per-head loops and per-row F.conv1d.

These references are the CPU backend and the oracle of the Triton kernels, so they are checked
against code that shares nothing with them. Contracts checked:
  - chunked varlen prefill = the token-by-token recurrence (outputs and final state), with and
    without an initial state read from a permuted slot, HV = HK and HV = 2 HK;
  - causal conv1d prefill = F.conv1d over (initial window ++ row), final window = last W-1 inputs;
  - deferred commit is exact (docs/design.md, "Deferred commit"): one prefill, commit decode steps, or verify
    steps with pending counts 0..k and rollback give the same outputs and final state; a verify
    step commits its first token at once, and committed state + pending raw inputs and g, beta
    reproduce the state of running only the accepted tokens;
  - slots not in the batch are bit-identical after every call; slot 0 is scratch for pad rows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deltaspec.kernels import REFERENCE_OPS

# Through the backend table, so the test follows the references wherever they live.
causal_conv1d_prefill_reference = REFERENCE_OPS.causal_conv1d_prefill
causal_conv1d_decode_reference = REFERENCE_OPS.causal_conv1d_decode
gdn_chunked_reference = REFERENCE_OPS.gdn_chunked
gdn_decode_reference = REFERENCE_OPS.gdn_decode

RTOL = 1e-4  # fp32 kernels vs float64 oracles
REPLICAS = 2  # of each pending g / beta in the pool (kernels/gdn.py): the reference reads the first, writes all


# ----------------------------------------------------------------------------------------------
# Helpers (independent of kernels/: no shared code)
# ----------------------------------------------------------------------------------------------

def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL, what: str = "") -> None:
    """Elementwise |a - e| <= rtol * (|e| + max|e|): relative, with an absolute floor at the
    tensor's scale so entries near zero do not demand impossible precision."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    error = (actual - expected).abs()
    bound = rtol * (expected.abs() + scale)
    worst = float((error - bound).max()) if error.numel() else 0.0
    assert worst <= 0, f"{what}: max abs error {float(error.max()):.3e} (scale {scale:.3e}, rtol {rtol:.0e})"


def bits(x: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-identical comparison (NaN-safe)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(view)


def assert_slots_untouched(pool: dict[str, torch.Tensor], before: dict[str, torch.Tensor],
                           touched: set[int]) -> None:
    """Every slot outside `touched` is bit-identical in every pool tensor."""
    for name, tensor in pool.items():
        for slot in range(tensor.shape[0]):
            if slot not in touched:
                assert torch.equal(bits(tensor[slot]), bits(before[name][slot])), f"{name}[{slot}] changed"


def naive_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: float, beta: float) -> torch.Tensor:
    """One token on one value head's state [K, V] in float64; k not yet normalised."""
    k = k / torch.sqrt((k * k).sum() + 1e-6)
    s = math.exp(g) * state
    return s + torch.outer(k, beta * (v - s.T @ k))


def naive_gdn(q, k, v, a, b, A_log, dt_bias, initial):
    """Token-by-token gated delta rule in float64, one value head at a time.

    q, k [L, HK, K]; v [L, HV, V]; a, b [L, HV]; initial [HV, K, V]. -> (o [L, HV, V], S [HV, K, V]).
    """
    q, k, v, initial = q.double(), k.double(), v.double(), initial.double()
    length, num_key_heads, key_dim = q.shape
    num_value_heads = v.shape[1]
    group = num_value_heads // num_key_heads
    a, b, A_log, dt_bias = a.tolist(), b.tolist(), A_log.tolist(), dt_bias.tolist()
    state = initial.clone()
    out = torch.empty(length, num_value_heads, v.shape[2], dtype=torch.float64)
    for t in range(length):
        for h in range(num_value_heads):
            qt = q[t, h // group]
            qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) * key_dim ** -0.5
            g = -math.exp(A_log[h]) * math.log1p(math.exp(a[t][h] + dt_bias[h]))
            beta = 1.0 / (1.0 + math.exp(-b[t][h]))
            state[h] = naive_step(state[h], k[t, h // group], v[t, h], g, beta)
            out[t, h] = state[h].T @ qt
    return out, state


def naive_conv(sequence: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) in float64 by F.conv1d. sequence [W-1+L, C] (window ++ row),
    weight [C, W] -> [L, C]: output t sees sequence[t .. t+W-1], tap W-1 on the newest."""
    channels, width = weight.shape
    if sequence.shape[0] == width - 1:  # L = 0
        return torch.zeros(0, channels, dtype=torch.float64)
    out = F.conv1d(sequence.double().T[None], weight.double()[:, None, :], groups=channels)[0].T
    return F.silu(out)


def random_gating_params(gen: torch.Generator, num_value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log spans slow (exp(A_log) ~ 0.02: long memory) to fast decay (~2.7)."""
    A_log = torch.rand(num_value_heads, generator=gen) * 5.0 - 4.0
    dt_bias = 0.5 * torch.randn(num_value_heads, generator=gen)
    return A_log, dt_bias


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# 1. Chunked varlen prefill
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_key_heads,num_value_heads", [(2, 4), (2, 2)])
def test_gdn_chunked_prefill_matches_naive_recurrence(num_key_heads, num_value_heads):
    """Varlen rows across chunk boundaries (1 .. 200 tokens, CHUNK_SIZE 64), initial state read
    from permuted slots for some rows, zeros for the others (whose slots hold stale garbage)."""
    gen = torch.Generator().manual_seed(100 + num_value_heads)
    key_dim, value_dim, num_slots = 16, 12, 11
    lengths = [1, 5, 64, 65, 130, 200]
    slots = [7, 3, 9, 1, 4, 8]
    has_initial = [True, False, True, True, False, True]
    total = sum(lengths)
    q = torch.randn(total, num_key_heads, key_dim, generator=gen)
    k = torch.randn(total, num_key_heads, key_dim, generator=gen)
    v = torch.randn(total, num_value_heads, value_dim, generator=gen)
    a = torch.randn(total, num_value_heads, generator=gen)
    b = torch.randn(total, num_value_heads, generator=gen)
    A_log, dt_bias = random_gating_params(gen, num_value_heads)
    state = 0.5 * torch.randn(num_slots, num_value_heads, key_dim, value_dim, generator=gen)
    before = state.clone()

    out = gdn_chunked_reference(q, k, v, a, b, A_log, dt_bias, cu_seqlens_of(lengths),
                                torch.tensor(slots, dtype=torch.int32), torch.tensor(has_initial), state)

    assert out.shape == v.shape and out.dtype == v.dtype
    start = 0
    for length, slot, initial in zip(lengths, slots, has_initial):
        span = slice(start, start + length)
        init = before[slot] if initial else torch.zeros_like(before[slot])
        expected_out, expected_state = naive_gdn(q[span], k[span], v[span], a[span], b[span], A_log, dt_bias, init)
        assert_close(out[span], expected_out, what=f"output of row len {length}")
        assert_close(state[slot], expected_state, what=f"final state of slot {slot}")
        start += length
    assert_slots_untouched({"state": state}, {"state": before}, touched=set(slots))


# ----------------------------------------------------------------------------------------------
# 3. Causal conv1d prefill
# ----------------------------------------------------------------------------------------------

def test_conv1d_prefill_matches_f_conv1d():
    """Per row: silu(F.conv1d(initial window ++ row)); the final window is the last W-1 inputs of
    (initial ++ row), which for rows shorter than W-1 still holds initial-state columns."""
    gen = torch.Generator().manual_seed(3)
    channels, width, num_slots = 10, 4, 9
    lengths = [1, 2, 3, 7, 20, 1, 2]
    slots = [5, 2, 8, 1, 6, 3, 7]
    has_initial = [True, True, True, False, True, False, False]
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    conv_state = torch.randn(num_slots, width - 1, channels, generator=gen)
    before = conv_state.clone()

    out = causal_conv1d_prefill_reference(x, weight, cu_seqlens_of(lengths), torch.tensor(slots, dtype=torch.int32),
                                          torch.tensor(has_initial), conv_state)

    start = 0
    for length, slot, initial in zip(lengths, slots, has_initial):
        rows = x[start:start + length]
        window = before[slot] if initial else torch.zeros(width - 1, channels)
        sequence = torch.cat([window, rows])
        assert_close(out[start:start + length], naive_conv(sequence, weight), what=f"row len {length}")
        assert torch.equal(conv_state[slot], sequence[-(width - 1):]), f"final window of slot {slot}"
        start += length
    assert_slots_untouched({"conv": conv_state}, {"conv": before}, touched=set(slots))


# ----------------------------------------------------------------------------------------------
# 2. Deferred commit: conv + GDN layer, prefill vs commit decode vs verify with rollback
# ----------------------------------------------------------------------------------------------

WIDTH, KEY_DIM, VALUE_DIM, NUM_SLOTS, MAX_PENDING, SEQ_LEN = 4, 8, 6, 9, 3, 10  # MAX_PENDING = k


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
PAD_SLOT = 0


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
        assert_close(out[start:start + j - i], seqs.truth[s][0][i:j], what=f"{what}: slot {s} tokens {i}..{j - 1}")
        start += j - i


def check_committed(pool: dict[str, torch.Tensor], seqs: Sequences, slot: int, n: int, what: str) -> None:
    """The slot's committed state and window (pending ignored) are those after n tokens."""
    _, state, window = seqs.truth_after(slot, n)
    assert_close(pool["state"][slot], state, what=f"{what}: committed state of slot {slot}")
    assert_close(pool["conv"][slot], window, what=f"{what}: committed window of slot {slot}")


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
    assert_slots_untouched(pool, before, touched=set(SLOTS))


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
    assert_slots_untouched(pool, before, touched=set(SLOTS) | {PAD_SLOT})


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
            assert_close(folded_state, state, what=f"step {step}: committed + pending state of slot {s}")
            assert_close(folded_window, window, what=f"step {step}: committed + pending window of slot {s}")
    assert all(p < SEQ_LEN for p in position.values())
    commit_rest(layer, seqs, gen, pool, position)
    check_final_state(pool, seqs, "verify + fold")
    assert_slots_untouched(pool, before, touched=set(SLOTS) | {PAD_SLOT})


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
# Stale state must never be read (design: a fresh slot's "state is not read until written";
# pending columns past the count are rejected tokens). A previous owner that diverged can leave
# inf/NaN there; multiplying by 0 instead of selecting lets it leak into a new sequence.
# ----------------------------------------------------------------------------------------------

def test_gdn_prefill_without_initial_state_ignores_nonfinite_stale_slot():
    gen = torch.Generator().manual_seed(21)
    hk, hv, key_dim, value_dim = 2, 4, 8, 6
    q = torch.randn(5, hk, key_dim, generator=gen)
    k = torch.randn(5, hk, key_dim, generator=gen)
    v = torch.randn(5, hv, value_dim, generator=gen)
    a, b = torch.randn(5, hv, generator=gen), torch.randn(5, hv, generator=gen)
    A_log, dt_bias = random_gating_params(gen, hv)
    state = torch.full((4, hv, key_dim, value_dim), float("nan"))
    out = gdn_chunked_reference(q, k, v, a, b, A_log, dt_bias, cu_seqlens_of([5]), torch.tensor([2], dtype=torch.int32),
                                torch.tensor([False]), state)
    expected, final = naive_gdn(q, k, v, a, b, A_log, dt_bias, torch.zeros(hv, key_dim, value_dim))
    assert_close(out, expected, what="output from a fresh (stale NaN) slot")
    assert_close(state[2], final, what="final state from a fresh (stale NaN) slot")


def test_conv_prefill_without_initial_state_ignores_nonfinite_stale_slot():
    gen = torch.Generator().manual_seed(22)
    channels, width = 6, 4
    x = torch.randn(3, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    conv_state = torch.full((4, width - 1, channels), float("inf"))
    out = causal_conv1d_prefill_reference(x, weight, cu_seqlens_of([3]), torch.tensor([1], dtype=torch.int32),
                                          torch.tensor([False]), conv_state)
    sequence = torch.cat([torch.zeros(width - 1, channels), x])
    assert_close(out, naive_conv(sequence, weight), what="output from a fresh (stale inf) slot")
    assert torch.equal(conv_state[1], sequence[-(width - 1):])


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
