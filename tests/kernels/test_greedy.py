"""greedy_argmax (kernels/greedy.py): the torch reference against numpy's argmax (first maximum,
NaN first) and a per-group scan for non-finite values, then the Triton kernel against the
reference.

Logits are random with planted ties (the maximum repeated later in the row), rows holding a
NaN, +inf or -inf, and -0.0 beside +0.0 as a row's maximum; groups of width 1 (plain decode) and
K + 1 (verify); vocabularies that are not a multiple of the kernel's tile, so rows split over
several programs with a ragged last one. Outputs are poisoned (`poisoned_empty`) or written
into given buffers holding garbage. CPU: the interpreter. GPU (`gpu` marker): a 248,320
vocabulary, bf16, and a CUDA-graph replay of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.arrivals import arrival_counters
from deltaspec.kernels import greedy
from deltaspec.kernels.greedy import greedy_argmax


def random_logits(num_rows: int, vocab: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 4
    for row in range(num_rows):
        kind = int(torch.randint(0, 8, (1,), generator=gen))
        columns = torch.randperm(vocab, generator=gen)[:2].sort().values.tolist()
        if kind == 0 and vocab > 1:   # a tie: the first maximum wins
            logits[row, columns] = logits[row].max() + 1
        elif kind == 1:               # NaN: the first NaN wins, the row's group is flagged
            logits[row, columns[-1]] = float("nan")
        elif kind == 2:
            logits[row, columns[0]] = float("inf")
        elif kind == 3:
            logits[row, columns[0]] = float("-inf")
        elif kind == 4 and vocab > 1:  # -0.0 then +0.0 as the maximum: equal, the first wins
            logits[row] = -logits[row].abs() - 1
            logits[row, columns[0]], logits[row, columns[-1]] = -0.0, 0.0
        elif kind == 5:               # nothing above -inf: the first column
            logits[row] = float("-inf")
        elif kind == 6:               # two NaNs: the first
            logits[row, columns] = float("nan")
    return logits.to(dtype).to(device)


def expected(logits: torch.Tensor, width: int) -> tuple[list[int], list[int]]:
    values = logits.float().cpu().numpy()
    tokens = [int(np.argmax(row)) for row in values]  # numpy: first maximum, NaN first
    groups = values.reshape(-1, width * values.shape[1])
    return tokens, [int(not np.isfinite(group).all()) for group in groups]


@pytest.mark.parametrize("num_rows,width,vocab", [(4, 1, 37), (6, 3, 300)])
def test_reference_is_the_first_maximum_and_flags_nonfinite_groups(num_rows, width, vocab):
    logits = random_logits(num_rows, vocab, torch.float32, seed=num_rows + vocab)
    tokens, flags = REFERENCE_OPS.greedy_argmax(logits, width)
    assert (tokens.tolist(), flags.tolist()) == expected(logits, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_rows,width,vocab", [(1, 1, 200), (3, 1, 64), (8, 4, 333), (10, 2, 17)])
def test_triton_equals_reference(kernel_device, poisoned_empty, dtype, num_rows, width, vocab):
    logits = random_logits(num_rows, vocab, dtype, seed=num_rows * 31 + vocab, device=kernel_device)
    tokens, flags = poisoned_empty(greedy_argmax, logits, width)
    reference = REFERENCE_OPS.greedy_argmax(logits, width)
    assert torch.equal(tokens, reference[0]) and torch.equal(flags, reference[1])
    assert not arrival_counters(logits.device, num_rows).any()  # left at zero for the next launch


def test_triton_keeps_a_maximum_found_before_the_vocabulary_ends(kernel_device, poisoned_empty):
    """Every logit negative, each row's maximum in a column whose program lane next reads past
    the vocabulary (eight blocks of columns, the last partial; on the interpreter's 4 SMs two a
    program): those masked reads must not displace it."""
    block = greedy._block(4)
    vocab, num_rows = 7 * block + block // 2 + 3, 8
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    logits = -(torch.randn(num_rows, vocab, generator=gen).abs() + 1)
    columns = torch.randint(6 * block + block // 2 + 3, 7 * block, (num_rows,), generator=gen)
    logits[torch.arange(num_rows), columns] = -0.5
    tokens, flags = poisoned_empty(greedy_argmax, logits.to(kernel_device), 1)
    assert tokens.tolist() == columns.tolist() and not flags.any()


def test_triton_writes_given_buffers(kernel_device):
    """Into views of a larger buffer, as the decode step's outputs are; twice (counters reset)."""
    outputs = torch.full((3, 8), -5, dtype=torch.int64, device=kernel_device)
    for seed in (1, 2):
        logits = random_logits(6, 150, torch.float32, seed=seed, device=kernel_device)
        tokens, flags = greedy_argmax(logits, 3, tokens=outputs[0, :6], nonfinite=outputs[2, :2])
        assert tokens.data_ptr() == outputs[0].data_ptr() and flags.data_ptr() == outputs[2].data_ptr()
        assert (outputs[0, :6].tolist(), outputs[2, :2].tolist()) == expected(logits, 3)
    assert outputs[1].tolist() == [-5] * 8 and outputs[0, 6:].tolist() == [-5] * 2


@pytest.mark.parametrize("num_rows,vocab", [(1, 200), (5, 333)])
def test_triton_maps_columns_to_token_ids(kernel_device, poisoned_empty, num_rows, vocab):
    """A reduced draft vocabulary: column c of the scores is token token_ids[c], a random
    sparse subset of a larger vocabulary."""
    logits = random_logits(num_rows, vocab, torch.float32, seed=vocab, device=kernel_device)
    token_ids = torch.randperm(50_000)[:vocab].to(kernel_device)
    tokens, flags = poisoned_empty(greedy_argmax, logits, 1, token_ids=token_ids)
    columns, expected_flags = expected(logits, 1)
    assert tokens.tolist() == token_ids[columns].tolist() and flags.tolist() == expected_flags
    reference = REFERENCE_OPS.greedy_argmax(logits, 1, token_ids=token_ids)
    assert torch.equal(tokens, reference[0]) and torch.equal(flags, reference[1])


def test_bad_arguments_are_refused():
    logits = random_logits(4, 20, torch.float32, seed=0)
    with pytest.raises(AssertionError):
        greedy_argmax(logits, 3)  # 4 rows are not groups of 3
    with pytest.raises(AssertionError):
        greedy_argmax(logits.long(), 1)
    with pytest.raises(AssertionError):
        greedy_argmax(logits, 1, tokens=torch.empty(4, dtype=torch.int32))
    with pytest.raises(AssertionError):
        greedy_argmax(logits, 1, token_ids=torch.arange(19))  # one id per column


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows,width", [(1, 1), (64, 1), (32, 4)])
def test_triton_at_full_vocabulary(num_rows, width):
    logits = random_logits(num_rows, 248_320, torch.bfloat16, seed=num_rows, device="cuda")
    tokens, flags = greedy_argmax(logits, width)
    reference = REFERENCE_OPS.greedy_argmax(logits, width)
    assert torch.equal(tokens, reference[0]) and torch.equal(flags, reference[1])


@pytest.mark.gpu
def test_triton_replays_in_a_cuda_graph():
    logits = random_logits(2, 248_320, torch.float32, seed=3, device="cuda")
    tokens, flags = greedy_argmax(logits, 1)  # warm-up: compiles, sizes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, flags = greedy_argmax(logits, 1)
    for seed in (4, 5, 6):
        logits.copy_(random_logits(2, 248_320, torch.float32, seed=seed, device="cuda"))
        graph.replay()
        reference = REFERENCE_OPS.greedy_argmax(logits, 1)
        assert torch.equal(tokens, reference[0]) and torch.equal(flags, reference[1])
