"""penalize_rows (kernels/penalties.py): the torch reference against the penalties written
element by element here (vLLM's definitions), then the Triton kernel against the reference.

Fresh random logits of both signs, counts (mostly zero, some large), prompt flags, statistics
rows in any order (a row's statistics need not be its index), several positions per row, and
verify rows' drafts (repeating, some in the prompt or already generated) counted at the
positions after them.
Logit bias entries (in several column tiles, padded with (0, 0.0)) added before the penalties;
logits of a narrower dtype, with a row stride of their own, written into a separate float32
output, for a subset of the rows (the others left untouched).
CPU: the interpreter, small vocabularies, several column tiles. GPU (`gpu` marker): 64 rows of
a 248,320 vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.penalties import penalize_rows


def random_case(num_rows: int, width: int, vocab: int, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    num_stats = num_rows + 3
    logits = torch.randn(num_rows, width, vocab, generator=gen) * 4
    counts = torch.randint(0, 5, (num_stats, vocab), generator=gen, dtype=torch.int32)
    counts *= torch.rand(num_stats, vocab, generator=gen) < 0.3
    prompt_mask = torch.rand(num_stats, vocab, generator=gen) < 0.2
    stats = torch.randperm(num_stats, generator=gen)[:num_rows]
    repetition = 1 + torch.rand(num_rows, generator=gen)
    frequency, presence = torch.rand(num_rows, generator=gen) * 2 - 0.5, torch.rand(num_rows, generator=gen) * 2
    return tuple(t.to(device) for t in (logits, counts, prompt_mask, stats, repetition, frequency, presence))


def test_reference_follows_the_definitions():
    logits, counts, prompt_mask, stats, repetition, frequency, presence = random_case(3, 2, 50, seed=1)
    out = REFERENCE_OPS.penalize_rows(logits, counts, prompt_mask, stats, repetition, frequency, presence)
    for p in range(3):
        s = int(stats[p])
        for j in range(2):
            for v in range(50):
                x, c = float(logits[p, j, v]), int(counts[s, v])
                if c > 0 or prompt_mask[s, v]:
                    x = x / float(repetition[p]) if x > 0 else x * float(repetition[p])
                x -= float(frequency[p]) * c + float(presence[p]) * (c > 0)
                assert float(out[p, j, v]) == pytest.approx(x, rel=1e-5, abs=1e-5)


def random_drafts(num_rows: int, width: int, vocab: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """[P, W - 1] drafts drawn from a few ids, so that they repeat within a row."""
    gen = torch.Generator().manual_seed(seed)
    few = torch.randint(0, vocab, (3,), generator=gen)
    return few[torch.randint(0, 3, (num_rows, width - 1), generator=gen)].to(device)


def test_reference_counts_the_drafts_before_each_position():
    logits, counts, prompt_mask, stats, repetition, frequency, presence = random_case(3, 4, 30, seed=3)
    drafts = random_drafts(3, 4, 30, seed=4)
    out = REFERENCE_OPS.penalize_rows(logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts)
    for p in range(3):
        s = int(stats[p])
        for j in range(4):
            for v in range(30):
                x, c = float(logits[p, j, v]), int(counts[s, v]) + drafts[p, :j].tolist().count(v)
                if c > 0 or prompt_mask[s, v]:
                    x = x / float(repetition[p]) if x > 0 else x * float(repetition[p])
                x -= float(frequency[p]) * c + float(presence[p]) * (c > 0)
                assert float(out[p, j, v]) == pytest.approx(x, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("num_rows,width,vocab,drafted", [(0, 1, 40, False), (1, 1, 33, False),
                                                          (3, 4, 2048 + 77, False), (3, 4, 2048 + 77, True),
                                                          (2, 1, 50, True)])
def test_triton_equals_reference(kernel_device, num_rows, width, vocab, drafted):
    case = random_case(num_rows, width, vocab, seed=num_rows * 5 + vocab, device=kernel_device)
    drafts = random_drafts(num_rows, width, vocab, seed=vocab, device=kernel_device) if drafted else None
    expected = REFERENCE_OPS.penalize_rows(*case, drafts)
    out = penalize_rows(case[0].clone(), *case[1:], drafts)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def random_bias(num_rows: int, width: int, vocab: int, seed: int, device: str = "cpu"):
    """[P, B] logit_bias entries: distinct tokens per row (one in the last column tile), padded
    with (token 0, 0.0) as the engine pads rows with fewer entries."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:width] for _ in range(num_rows)])
    tokens[:, 0] = vocab - 1
    values = (torch.rand(num_rows, width, generator=gen) * 16 - 8).to(torch.float32)
    tokens[-1, -2:], values[-1, -2:] = 0, 0.0  # padding
    return tokens.to(device), values.to(device)


def test_reference_adds_the_bias_first():
    logits, counts, prompt_mask, stats, repetition, frequency, presence = random_case(3, 2, 40, seed=6)
    bias_tokens, bias_values = random_bias(3, 4, 40, seed=7)
    out = REFERENCE_OPS.penalize_rows(logits, counts, prompt_mask, stats, repetition, frequency, presence,
                                      bias_tokens=bias_tokens, bias_values=bias_values)
    for p in range(3):
        s = int(stats[p])
        bias = {}
        for t, b in zip(bias_tokens[p].tolist(), bias_values[p].tolist()):
            bias[t] = bias.get(t, 0.0) + b
        for j in range(2):
            for v in range(40):
                x, c = float(logits[p, j, v]) + bias.get(v, 0.0), int(counts[s, v])
                if c > 0 or prompt_mask[s, v]:
                    x = x / float(repetition[p]) if x > 0 else x * float(repetition[p])
                x -= float(frequency[p]) * c + float(presence[p]) * (c > 0)
                assert float(out[p, j, v]) == pytest.approx(x, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width,drafted,subset,biased", [(1, False, False, True), (1, False, True, True),
                                                         (3, True, True, True), (3, True, False, False),
                                                         (1, False, True, False)])
def test_triton_into_a_float32_output_equals_reference(kernel_device, dtype, width, drafted, subset, biased):
    """Logits of any float dtype with a row stride of their own, written into a separate float32
    output (rows: a subset of the step's rows, the others left as they were), the bias added."""
    num_rows, vocab = 4, 2048 + 77
    case = random_case(num_rows, width, vocab, seed=width * 11 + subset, device=kernel_device)
    wide = torch.zeros(num_rows, width, vocab + 40, dtype=dtype, device=kernel_device)
    wide[..., :vocab] = case[0]
    logits = wide[..., :vocab]
    rows = torch.tensor([3, 0], device=kernel_device) if subset else None
    take = (lambda t: t[:2]) if subset else (lambda t: t)  # noqa: E731
    penalized = tuple(take(t) for t in case[3:])            # stats, repetition, frequency, presence
    drafts = take(random_drafts(num_rows, width, vocab, seed=3, device=kernel_device)) if drafted else None
    bias = tuple(take(t) for t in random_bias(num_rows, 5, vocab, seed=4, device=kernel_device)) if biased \
        else (None, None)
    expected = REFERENCE_OPS.penalize_rows(logits, case[1], case[2], *penalized, drafts, rows, *bias,
                                           out=torch.full((num_rows, width, vocab), 7.0, device=kernel_device))
    out = penalize_rows(logits, case[1], case[2], *penalized, drafts, rows, *bias,
                        out=torch.full((num_rows, width, vocab), 7.0, device=kernel_device))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    if subset:
        assert (out[[1, 2]] == 7.0).all()  # not penalized: left as they were


def test_bad_arguments_are_refused():
    logits, counts, prompt_mask, stats, repetition, frequency, presence = random_case(2, 1, 64, seed=2)
    with pytest.raises(AssertionError):
        penalize_rows(logits.double(), counts, prompt_mask, stats, repetition, frequency, presence)
    with pytest.raises(AssertionError):
        penalize_rows(logits, counts.long(), prompt_mask, stats, repetition, frequency, presence)
    with pytest.raises(AssertionError):
        penalize_rows(logits, counts, prompt_mask, stats[:1], repetition, frequency, presence)
    with pytest.raises(AssertionError):  # one draft too many for W = 1
        penalize_rows(logits, counts, prompt_mask, stats, repetition, frequency, presence, random_drafts(2, 2, 64, 1))


@pytest.mark.gpu
def test_triton_at_full_vocabulary():
    case = random_case(64, 1, 248_320, seed=5, device="cuda")
    expected = REFERENCE_OPS.penalize_rows(*case)
    torch.testing.assert_close(penalize_rows(case[0].clone(), *case[1:]), expected, rtol=1e-6, atol=1e-6)
    case = random_case(64, 4, 248_320, seed=6, device="cuda")
    drafts = random_drafts(64, 4, 248_320, seed=7, device="cuda")
    expected = REFERENCE_OPS.penalize_rows(*case, drafts)
    torch.testing.assert_close(penalize_rows(case[0].clone(), *case[1:], drafts), expected, rtol=1e-6, atol=1e-6)
    # The engine's pass: bf16 logits into a float32 output, 48 of 64 rows, a logit bias each.
    case = random_case(64, 1, 248_320, seed=8, device="cuda")
    logits, rows = case[0].bfloat16(), torch.randperm(64, device="cuda")[:48]
    bias = tuple(t[:48] for t in random_bias(64, 8, 248_320, seed=9, device="cuda"))
    penalized = tuple(t[:48] for t in case[3:])
    expected = REFERENCE_OPS.penalize_rows(logits, case[1], case[2], *penalized, None, rows, *bias,
                                           out=torch.zeros(64, 1, 248_320, device="cuda"))
    out = penalize_rows(logits, case[1], case[2], *penalized, None, rows, *bias,
                        out=torch.zeros(64, 1, 248_320, device="cuda"))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
