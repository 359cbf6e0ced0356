"""Sampling (kernels/sampling.py): the torch reference against naive float64 formulas and
statistics computed here, then the Triton kernel against the reference.

Reference. Contracts checked: temperature-0 rows are argmax; the filtered distribution is
softmax(logits/T) truncated by top-k, then top-p (on the renormalised top-k mass), then min-p,
renormalised; draws follow it (chi-square at p = 0.001, with fixed seeds so the outcome is
deterministic) and never leave its support (top_k = 1 is the argmax whatever the noise); a row's
draw depends only on its own (seed, offset): reproducible, independent of the other rows, of
batch order and of batch size. (The noise itself: test_noise.py.)

Triton kernel, with the reference as the oracle. Every buffer the launcher allocates starts as
garbage (`torch.empty` is poisoned), and the tiling is shrunk so that every path runs (greedy,
no filter, window found in the first or second histogram round, last resort). It must draw the
same token as the reference (the noise is bit-identical), from its own (seed, offset) only.
CPU: the interpreter on tiny vocabularies, fp32, fp16 and bf16 logits. GPU (`gpu` marker): a
248,320 vocabulary (peaked and flat rows).
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.noise import uniform_noise
from deltaspec.kernels.sampling import (GREEDY, LAST_RESORT, NO_FILTER, WINDOW, filter_probs_reference, launch_sample,
                                        sample)
from kernel_helpers import CHI2_CRITICAL_P001, U_ONE_OFFSET, U_ONE_SEED, U_ONE_VOCAB, assert_close, on


# Through the backend table, so the tests follow the reference wherever it lives.
sample_reference = REFERENCE_OPS.sample


# ----------------------------------------------------------------------------------------------
# Torch reference vs float64 formulas and statistics
# ----------------------------------------------------------------------------------------------

def params(batch: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Per-row parameter tensors (scalars broadcast to the batch)."""
    full = lambda value, dtype: torch.as_tensor(value, dtype=dtype).expand(batch).clone()
    return (full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
            full(min_p, torch.float32))


def naive_filtered(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Expected distribution in float64, one filter after the other on the sorted vocabulary."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if 0 < top_k < len(order):
        order = order[:top_k]
    top = scaled[order[0]]
    weights = {i: math.exp(scaled[i] - top) for i in order}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    kept, mass_before = [], 0.0
    for i in order:  # top-p: smallest prefix reaching top_p; the top token always stays
        if mass_before < top_p or not kept:
            kept.append(i)
        mass_before += probs[i]
    kept = [i for i in kept if probs[i] >= min_p * probs[order[0]]]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(logits))]


def chi_square(counts: torch.Tensor, expected_probs: list[float]) -> tuple[float, int]:
    """-> (statistic over the support, degrees of freedom). Draws outside the support fail."""
    n = int(counts.sum())
    outside = [v for v, p in enumerate(expected_probs) if p == 0.0 and counts[v] > 0]
    assert not outside, f"tokens {outside} drawn although filtered out"
    support = [v for v, p in enumerate(expected_probs) if p > 0.0]
    stat = sum((float(counts[v]) - n * expected_probs[v]) ** 2 / (n * expected_probs[v]) for v in support)
    return stat, len(support) - 1


# Small vocabulary, logits deliberately not in sorted order (the filter must scatter back).
LOGITS8 = [0.1, 2.0, -0.8, 0.9, -1.5, 1.4, -0.3, 0.5]

# (temperature, top_k, top_p, min_p); thresholds are chosen away from ties and mass boundaries.
FILTER_CASES = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 3, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.25),
    (0.9, 6, 0.9, 0.05),
    (2.0, 5, 0.6, 0.0),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTER_CASES)
def test_filter_probs_matches_naive_truncation(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.stack([torch.tensor(LOGITS8), torch.randn(8, generator=gen) * 2])
    probs = filter_probs_reference(logits, *params(2, temperature, top_k, top_p, min_p))
    for row in range(2):
        expected = naive_filtered(logits[row].tolist(), temperature, top_k, top_p, min_p)
        assert torch.allclose(probs[row].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
        assert ((probs[row] == 0) == (torch.tensor(expected) == 0)).all(), "support differs"


@pytest.mark.parametrize("case", range(len(FILTER_CASES)))
def test_draws_follow_filtered_distribution(case):
    """20k+ draws of one 8-token row, varying the offset (and, in case 0, the seed instead):
    counts match the expected truncated, renormalised distribution by chi-square at p = 0.001."""
    temperature, top_k, top_p, min_p = FILTER_CASES[case]
    n = 24_000
    logits = torch.tensor(LOGITS8).expand(n, -1)
    if case == 0:
        seeds, offsets = torch.arange(n, dtype=torch.int64) * 7919 + 3, torch.full((n,), 11, dtype=torch.int64)
    else:
        seeds, offsets = torch.full((n,), 1000 + case, dtype=torch.int64), torch.arange(n, dtype=torch.int64) * 3 + case
    tokens, _ = sample_reference(logits, *params(n, temperature, top_k, top_p, min_p), seeds, offsets)
    counts = torch.bincount(tokens, minlength=8)
    stat, dof = chi_square(counts, naive_filtered(LOGITS8, temperature, top_k, top_p, min_p))
    assert stat < CHI2_CRITICAL_P001[dof], f"chi-square {stat:.1f} >= {CHI2_CRITICAL_P001[dof]} (dof {dof})"


def test_greedy_rows_are_argmax_and_logprobs_are_raw():
    """Temperature 0 ignores filters and seeds; logprobs are log_softmax of the raw logits at
    the chosen token for every row."""
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 16, 50
    logits = torch.randn(batch, vocab, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.8] * 8)
    top_k = torch.tensor([0, 5, 1, 0] * 4)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0] * 4)
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.3] * 4)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    offsets = torch.randint(0, 10_000, (batch,), generator=gen)
    tokens, logprobs = sample_reference(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    assert tokens.dtype == torch.int64 and tokens.shape == (batch,)
    for row in range(batch):
        values = logits[row].tolist()
        if temperature[row] == 0:
            assert tokens[row] == max(range(vocab), key=lambda i: values[i])
        top = max(values)
        log_z = top + math.log(sum(math.exp(x - top) for x in values))
        assert abs(float(logprobs[row]) - (values[int(tokens[row])] - log_z)) < 1e-5


def _mixed_rows(gen: torch.Generator, batch: int, vocab: int):
    logits = torch.randn(batch, vocab, generator=gen) * 2
    temperature = torch.rand(batch, generator=gen) * 1.5 + 0.3
    temperature[0] = 0.0
    top_k = torch.randint(0, vocab, (batch,), generator=gen)
    top_p = torch.rand(batch, generator=gen) * 0.5 + 0.5
    min_p = torch.rand(batch, generator=gen) * 0.1
    seeds = torch.randint(-2**62, 2**62, (batch,), generator=gen)
    offsets = torch.randint(0, 100_000, (batch,), generator=gen)
    return logits, temperature, top_k, top_p, min_p, seeds, offsets


def test_draw_depends_only_on_own_seed_and_offset():
    """Same call twice: same tokens. Reversed batch, each row alone, and the rows scattered in a
    bigger batch of strangers: every row draws the same token."""
    gen = torch.Generator().manual_seed(3)
    rows = _mixed_rows(gen, 8, 64)
    tokens, logprobs = sample_reference(*rows)
    again, _ = sample_reference(*rows)
    assert torch.equal(tokens, again)
    reversed_tokens, _ = sample_reference(*(x.flip(0) for x in rows))
    assert torch.equal(reversed_tokens.flip(0), tokens)
    for r in range(8):
        alone, _ = sample_reference(*(x[r:r + 1] for x in rows))
        assert alone.item() == tokens[r].item(), f"row {r} alone"
    strangers = _mixed_rows(gen, 24, 64)
    places = torch.randperm(32, generator=gen)
    big = [torch.empty((32,) + x.shape[1:], dtype=x.dtype) for x in rows]
    for merged, mine, theirs in zip(big, rows, strangers):
        merged[places[:8]] = mine
        merged[places[8:]] = theirs
    big_tokens, _ = sample_reference(*big)
    assert torch.equal(big_tokens[places[:8]], tokens)


def test_offset_and_seed_change_the_draw():
    """A fresh position (offset) or seed gives fresh noise: a flat row does not repeat a token
    over many offsets, and seeds differing only in their high 32 bits differ."""
    vocab = 64
    logits = torch.zeros(1, vocab)
    draws = {sample_reference(logits, *params(1), torch.tensor([42]), torch.tensor([o]))[0].item() for o in range(64)}
    assert len(draws) > 20
    low = uniform_noise(torch.tensor([5]), torch.tensor([9]), vocab)
    high = uniform_noise(torch.tensor([5 + (1 << 32)]), torch.tensor([9]), vocab)
    assert not torch.equal(low, high)


def test_sampled_token_stays_inside_top_k():
    """top_k = 1 must return the argmax whatever the noise."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(1, U_ONE_VOCAB, generator=gen)
    tokens, _ = sample_reference(logits, *params(1, 1.0, 1, 1.0, 0.0), torch.tensor([U_ONE_SEED]),
                                 torch.tensor([U_ONE_OFFSET]))
    assert tokens.item() == logits.argmax().item(), f"top_k=1 sampled token {tokens.item()}"


# ----------------------------------------------------------------------------------------------
# Triton kernel vs the torch reference
# ----------------------------------------------------------------------------------------------

def sampling_rows(gen: torch.Generator, batch: int, vocab: int, flat: bool = False):
    """Mixed rows: greedy, plain temperature, min-p, top-k, top-p, both, ranks just above and
    below the vocabulary; peaked logits (a few strong tokens) unless flat."""
    logits = torch.randn(batch, vocab, generator=gen) * (0.4 if flat else 2.0)
    if not flat:
        logits[:, :5] += 6.0 * torch.rand(batch, 5, generator=gen)
        logits = logits[:, torch.randperm(vocab, generator=gen)]
    pattern = [  # temperature, top_k, top_p, min_p
        (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.1), (1.2, 10, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0), (0.7, 20, 0.8, 0.0), (1.5, vocab + 3, 0.95, 0.02), (0.9, 1, 0.5, 0.0),
        (1.0, vocab - 1, 0.999, 0.0), (2.0, 0, 0.6, 0.0),
    ]
    rows = [pattern[i % len(pattern)] for i in range(batch)]
    columns = list(zip(*rows))
    temperature = torch.tensor(columns[0], dtype=torch.float32)
    top_k = torch.tensor(columns[1], dtype=torch.int64)
    top_p = torch.tensor(columns[2], dtype=torch.float32)
    min_p = torch.tensor(columns[3], dtype=torch.float32)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (batch,), generator=gen)
    offsets = torch.randint(0, 10 ** 6, (batch,), generator=gen)
    return [logits, temperature, top_k, top_p, min_p, seeds, offsets]


# chunk, block, bins, capacity: the launcher's own; 2 splits and a window found by the first
# histogram round; a tiny capacity that sends the wide windows to the second round or the last resort
TILINGS = [dict(), dict(chunk=128, block=64, num_bins=64, capacity=256),
           dict(chunk=64, block=64, num_bins=16, capacity=8)]


@pytest.mark.parametrize("tiling", [0, 1, pytest.param(2, marks=pytest.mark.slow)])
def test_sample_matches_reference(kernel_device, poisoned_empty, tiling):
    gen = torch.Generator().manual_seed(50 + tiling)
    args = sampling_rows(gen, 10, 200)
    expected_tokens, expected_logprobs = sample_reference(*args)
    statuses = torch.zeros(10, dtype=torch.int32, device=kernel_device)
    tokens, logprobs = poisoned_empty(launch_sample, *on(kernel_device, args), **TILINGS[tiling], statuses=statuses)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens.cpu(), expected_tokens)
    assert_close(logprobs.cpu(), expected_logprobs, 1e-5, "logprobs")
    seen = set(statuses.tolist())
    assert {GREEDY.value, NO_FILTER.value} <= seen
    assert (WINDOW.value in seen) and (tiling < 2 or LAST_RESORT.value in seen), seen


@pytest.mark.parametrize("drawing", ["reference", "triton"])
def test_sample_into_a_token_buffer(kernel_device, drawing):
    """out: the tokens written into a view of a wider buffer (a step's token row), its other
    entries untouched; the same tokens as a fresh output."""
    gen = torch.Generator().manual_seed(55)
    args = on(kernel_device, sampling_rows(gen, 6, 200))
    draw = sample_reference if drawing == "reference" else sample
    expected, _ = draw(*args)
    buffer = torch.full((10,), -5, dtype=torch.int64, device=kernel_device)
    tokens, _ = draw(*args, out=buffer[:6])
    assert tokens.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:6], expected)
    assert (buffer[6:] == -5).all()


def test_sample_flat_rows_refine_and_low_precision_logits(kernel_device):
    """Flat logits (wide top-p windows, re-binned) in fp16 and bf16: the reference's tokens."""
    gen = torch.Generator().manual_seed(60)
    args = sampling_rows(gen, 10, 300, flat=True)
    for dtype in (torch.float16, torch.bfloat16):
        args[0] = args[0].to(dtype)
        expected_tokens, expected_logprobs = sample_reference(*args)
        tokens, logprobs = launch_sample(*on(kernel_device, args), chunk=256, block=128, num_bins=32, capacity=64)
        assert torch.equal(tokens.cpu(), expected_tokens), dtype
        assert_close(logprobs.cpu(), expected_logprobs, 1e-5, f"{dtype} logprobs")


def test_sample_draw_depends_only_on_own_seed_and_offset(kernel_device):
    """Each row alone, and the rows scattered among strangers in a bigger batch, draw the same
    tokens as the batch did; the same call twice gives the same tokens."""
    gen = torch.Generator().manual_seed(70)
    rows = sampling_rows(gen, 6, 150)
    tokens, _ = sample(*on(kernel_device, rows))
    assert torch.equal(sample(*on(kernel_device, rows))[0], tokens)
    for r in (1, 4):
        alone, _ = sample(*on(kernel_device, [x[r:r + 1] for x in rows]))
        assert alone.item() == tokens[r].item(), f"row {r} alone"
    strangers = sampling_rows(gen, 5, 150)
    places = torch.randperm(11, generator=gen)
    big = [torch.empty((11,) + x.shape[1:], dtype=x.dtype) for x in rows]
    for merged, mine, theirs in zip(big, rows, strangers):
        merged[places[:6]] = mine
        merged[places[6:]] = theirs
    big_tokens, _ = sample(*on(kernel_device, big))
    assert torch.equal(big_tokens[places[:6].to(kernel_device)], tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("flat", [False, True])
def test_sample_full_vocabulary(flat):
    """B = 20 rows over a 248,320 vocabulary, fp32 and bf16 logits."""
    gen = torch.Generator().manual_seed(80 + flat)
    args = sampling_rows(gen, 20, 248_320, flat=flat)
    for dtype in (torch.float32, torch.bfloat16):
        args[0] = args[0].to(dtype)
        expected_tokens, expected_logprobs = sample_reference(*on("cuda", args))
        statuses = torch.zeros(20, dtype=torch.int32, device="cuda")
        tokens, logprobs = launch_sample(*on("cuda", args), statuses=statuses)
        assert torch.equal(tokens, expected_tokens), (dtype, statuses.tolist())
        assert_close(logprobs, expected_logprobs, 1e-5, f"{dtype} logprobs")
