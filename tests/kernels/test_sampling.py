"""The sampling torch reference (kernels/sampling.py) against naive float64 formulas and
statistics computed here.

Contracts checked: temperature-0 rows are argmax; the filtered distribution is softmax(logits/T)
truncated by top-k, then top-p (on the renormalised top-k mass), then min-p, renormalised;
draws follow it (chi-square at p = 0.001, with fixed seeds so the outcome is deterministic) and
never leave its support; a row's draw depends only on its own (seed, offset): reproducible,
independent of the other rows, of batch order and of batch size; the counter-based noise lies
strictly in (0, 1) and is uniform.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.noise import uniform_noise
from deltaspec.kernels.sampling import filter_probs_reference

sample_reference = REFERENCE_OPS.sample

# Upper 0.1% points of the chi-square distribution, by degrees of freedom (no scipy needed).
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
                      8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123,
                      15: 37.697}


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


def test_uniform_noise_is_per_row_per_token_and_uniform():
    """u(seed, offset, v) does not depend on other rows or on the vocabulary size; values lie
    strictly in (0, 1) with a flat histogram (chi-square, 16 bins, p = 0.001)."""
    gen = torch.Generator().manual_seed(4)
    seeds = torch.randint(-2**62, 2**62, (256,), generator=gen)
    offsets = torch.randint(0, 2**40, (256,), generator=gen)
    u = uniform_noise(seeds, offsets, 1024)
    assert u.dtype == torch.float32 and u.shape == (256, 1024)
    assert torch.equal(uniform_noise(seeds[7:8], offsets[7:8], 1024), u[7:8])
    assert torch.equal(uniform_noise(seeds, offsets, 100), u[:, :100])
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.double().mean()) - 0.5) < 3e-3
    counts = torch.histc(u.double(), bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < CHI2_CRITICAL_P001[15], f"histogram chi-square {stat:.1f}"
    flat = u.double().flatten()
    lag1 = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]
    assert abs(float(lag1)) < 0.01


# Found by search: with 24 random bits b, (b + 0.5) / 2^24 is computed in float32, where b + 0.5
# needs 25 bits: b = 2^24 - 1 rounds to 2^24 and u becomes exactly 1.0 (~V / 2^24 of draws hit a
# u = 1 token: ~0.9% at V = 151936). Then -log(-log u) = +inf and that token wins the race even
# when filtered out (log 0 + inf = nan, which argmax also picks).
U_ONE_SEED, U_ONE_OFFSET, U_ONE_TOKEN, U_ONE_VOCAB = 1234, 152, 5330, 151936


def test_uniform_noise_never_reaches_one():
    u = uniform_noise(torch.tensor([U_ONE_SEED]), torch.tensor([U_ONE_OFFSET]), U_ONE_VOCAB)
    assert float(u[0, U_ONE_TOKEN]) < 1.0, "uniform_noise returned exactly 1.0"


def test_sampled_token_stays_inside_top_k():
    """top_k = 1 must return the argmax whatever the noise."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(1, U_ONE_VOCAB, generator=gen)
    tokens, _ = sample_reference(logits, *params(1, 1.0, 1, 1.0, 0.0), torch.tensor([U_ONE_SEED]),
                                 torch.tensor([U_ONE_OFFSET]))
    assert tokens.item() == logits.argmax().item(), f"top_k=1 sampled token {tokens.item()}"
