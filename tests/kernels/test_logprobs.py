"""token_logprobs (kernels/logprobs.py): the torch reference against float64 log_softmax and a
count of larger logits, then the Triton kernel against the reference; top_logits against
torch's topk.

Logits are random with a wide spread, planted ties with the chosen token (equal logits do not
count against its rank), -inf columns (a masked vocabulary) and a chosen token at the first and
last columns; vocabularies that are not a multiple of the kernel's block, a strided row view,
no rows. CPU: the interpreter in float32 and float16. GPU (`gpu` marker): a 248,320 vocabulary
in bf16 as the prompt scores run it.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels.logprobs import top_logits, top_logits_reference, token_logprobs, token_logprobs_reference


def case(rows: int, vocab: int, dtype: torch.dtype, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 6
    chosen = torch.randint(0, vocab, (rows,), generator=gen)
    chosen[0], chosen[-1] = 0, vocab - 1
    for row in range(1, rows, 3):  # ties with the chosen token
        logits[row, torch.randint(0, vocab, (3,), generator=gen)] = float(logits[row, chosen[row]])
    for row in range(2, rows, 4):  # masked columns, never the chosen one
        masked = torch.randint(0, vocab, (vocab // 3,), generator=gen)
        logits[row, masked[masked != chosen[row]]] = float("-inf")
    return logits.to(dtype).to(device), chosen.to(device)


def float64_truth(logits: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = logits.double().cpu()
    scores = torch.log_softmax(values, dim=-1).gather(1, chosen.cpu()[:, None])[:, 0]
    ranks = torch.tensor([int((row > row[t]).sum()) + 1 for row, t in zip(values, chosen.cpu().tolist())])
    return scores, ranks


def test_reference_against_float64():
    logits, chosen = case(9, 777, torch.float32, 0, "cpu")
    logprob, rank, lse = token_logprobs_reference(logits, chosen)
    scores, ranks = float64_truth(logits, chosen)
    torch.testing.assert_close(logprob.double(), scores, rtol=0, atol=1e-5)
    assert rank.tolist() == ranks.tolist()
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), -1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("vocab", [1, 100, 4096 + 5], ids=lambda v: f"V{v}")
def test_kernel_matches_reference(dtype, vocab, kernel_device):
    logits, chosen = case(7, vocab, dtype, vocab, kernel_device)
    logprob, rank, lse = token_logprobs(logits, chosen)
    want = token_logprobs_reference(logits, chosen)
    torch.testing.assert_close(logprob, want[0], rtol=0, atol=1e-5)
    assert torch.equal(rank, want[1])
    torch.testing.assert_close(lse, want[2], rtol=0, atol=1e-5)
    scores, ranks = float64_truth(logits, chosen)
    torch.testing.assert_close(logprob.double().cpu(), scores, rtol=0, atol=1e-4)
    assert rank.cpu().tolist() == ranks.tolist()


def test_kernel_strided_rows_and_no_rows(kernel_device):
    wide, chosen = case(5, 300, torch.float32, 3, kernel_device)
    view = wide[:, :200]  # rows 300 apart
    chosen = chosen % 200
    logprob, rank, _ = token_logprobs(view, chosen)
    want = token_logprobs_reference(view, chosen)
    torch.testing.assert_close(logprob, want[0], rtol=0, atol=1e-5)
    assert torch.equal(rank, want[1])
    empty = token_logprobs(wide[:0], chosen[:0])
    assert [t.shape for t in empty] == [(0,), (0,), (0,)]
    with pytest.raises(AssertionError, match="chosen"):
        token_logprobs(wide, chosen.int())


@pytest.mark.gpu
def test_kernel_full_vocabulary_bf16():
    logits, chosen = case(135, 248_320, torch.bfloat16, 11, "cuda")
    logprob, rank, lse = token_logprobs(logits, chosen)
    want = token_logprobs_reference(logits, chosen)
    torch.testing.assert_close(logprob, want[0], rtol=0, atol=1e-3)
    assert torch.equal(rank, want[1])
    torch.testing.assert_close(lse, want[2], rtol=0, atol=1e-3)
    for k in (1, 5, 20):
        check_top(logits, k, *top_logits(logits, k))


def check_top(logits: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor) -> None:
    """The k largest values in order, each id holding its value, no id twice (ties may come in
    any order)."""
    want, _ = top_logits_reference(logits, k)
    torch.testing.assert_close(values, want, rtol=0, atol=0)
    assert torch.equal(logits.float().gather(1, ids), values)
    assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("vocab, k", [(20, 20), (300, 1), (2048 * 2 + 7, 5), (2048 * 3, 20)],
                         ids=lambda v: str(v))
def test_top_logits_kernel(dtype, vocab, k, kernel_device):
    """Planted ties and -inf columns; every block's candidates, the last block partial."""
    logits, _ = case(6, vocab, dtype, vocab + k, kernel_device)
    logits[0, :k + 3] = logits[0].max() + 1  # ties at the top, across the first candidates
    check_top(logits, k, *top_logits(logits, k))
    view = logits[:, 1:]  # a strided row view
    check_top(view, min(k, vocab - 1), *top_logits(view, min(k, vocab - 1)))
    assert [t.shape for t in top_logits(logits[:0], k)] == [(0, k), (0, k)]
    with pytest.raises(AssertionError, match="k must be"):
        top_logits(logits, min(vocab, 20) + 1)
