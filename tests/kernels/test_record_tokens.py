"""record_tokens (kernels/penalties.py): the torch reference against the update written token by
token here, then the Triton kernel against the reference.

Fresh random statistics (counts, lengths, recent tokens with -1 before the first), statistics
rows in any order, tokens that repeat within a row, every emitted count from 0 to W (and W when
none is given). CPU: the interpreter. GPU (`gpu` marker): 64 rows of a 248,320 vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.penalties import record_tokens

RECENT = 15


def random_case(num_rows: int, width: int, vocab: int, seed: int, counted: bool, device: str = "cpu"):
    """(counts, num_output, recent, stats, tokens, num_emitted): tokens drawn from a few ids so
    that they repeat."""
    gen = torch.Generator().manual_seed(seed)
    num_stats = num_rows + 3
    counts = torch.randint(0, 4, (num_stats, vocab), generator=gen, dtype=torch.int32)
    num_output = torch.randint(0, 50, (num_stats,), generator=gen)
    recent = torch.randint(-1, vocab, (num_stats, RECENT), generator=gen)
    stats = torch.randperm(num_stats, generator=gen)[:num_rows]
    tokens = torch.randint(0, vocab, (3,), generator=gen)[torch.randint(0, 3, (num_rows, width), generator=gen)]
    num_emitted = torch.randint(0, width + 1, (num_rows,), generator=gen) if counted else None
    return tuple(t.to(device) if t is not None else None for t in (counts, num_output, recent, stats, tokens,
                                                                    num_emitted))


def test_reference_follows_the_definition():
    counts, num_output, recent, stats, tokens, num_emitted = random_case(4, 3, 20, seed=1, counted=True)
    expected = [t.clone() for t in (counts, num_output, recent)]
    for p in range(4):
        s, taken = int(stats[p]), tokens[p, :int(num_emitted[p])].tolist()
        for t in taken:
            expected[0][s, t] += 1
        expected[1][s] += len(taken)
        expected[2][s] = torch.tensor((recent[s].tolist() + taken)[-RECENT:])
    REFERENCE_OPS.record_tokens(counts, num_output, recent, stats, tokens, num_emitted)
    for out, want in zip((counts, num_output, recent), expected):
        assert torch.equal(out, want)


@pytest.mark.parametrize("num_rows,width,counted", [(0, 1, False), (1, 1, False), (5, 1, False), (5, 4, True),
                                                    (3, 4, False)])
def test_triton_equals_reference(kernel_device, num_rows, width, counted):
    case = random_case(num_rows, width, 300, seed=num_rows * 7 + width, counted=counted, device=kernel_device)
    expected = [t.clone() for t in case[:3]]
    REFERENCE_OPS.record_tokens(*expected, *case[3:])
    record_tokens(*case)
    for out, want in zip(case[:3], expected):
        assert torch.equal(out, want)


def test_triton_reads_a_column_of_a_wider_buffer(kernel_device):
    """Tokens as the runner passes them: a [P, 1] view with strides of its own."""
    counts, num_output, recent, stats, tokens, _ = random_case(4, 3, 64, seed=3, counted=False, device=kernel_device)
    column = tokens[:, 1:2]
    expected = [t.clone() for t in (counts, num_output, recent)]
    REFERENCE_OPS.record_tokens(*expected, stats, column)
    record_tokens(counts, num_output, recent, stats, column)
    for out, want in zip((counts, num_output, recent), expected):
        assert torch.equal(out, want)


def test_bad_arguments_are_refused():
    counts, num_output, recent, stats, tokens, num_emitted = random_case(2, 2, 64, seed=2, counted=True)
    with pytest.raises(AssertionError):
        record_tokens(counts.long(), num_output, recent, stats, tokens, num_emitted)
    with pytest.raises(AssertionError):
        record_tokens(counts, num_output, recent, stats, tokens.int(), num_emitted)
    with pytest.raises(AssertionError):
        record_tokens(counts, num_output, recent, stats[:1], tokens, num_emitted)
    with pytest.raises(AssertionError):
        record_tokens(counts, num_output, recent, stats, tokens, num_emitted.float())


@pytest.mark.gpu
def test_triton_at_full_vocabulary():
    case = random_case(64, 4, 248_320, seed=5, counted=True, device="cuda")
    expected = [t.clone() for t in case[:3]]
    REFERENCE_OPS.record_tokens(*expected, *case[3:])
    record_tokens(*case)
    for out, want in zip(case[:3], expected):
        assert torch.equal(out, want)
