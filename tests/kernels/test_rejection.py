"""Rejection sampling (kernels/rejection.py): the Triton kernel against its torch reference, token
for token, and the reference (on the GPU the kernel too) for exactness of distribution.

Kernel vs reference: drafts of 0..k tokens, sampled and greedy (one-hot) drafts; every buffer the
launcher allocates starts as garbage (`torch.empty` is poisoned). A greedy (one-hot) target
accepts the longest draft prefix equal to its argmax, then emits the argmax. Distribution: 200k
rows, chi-square at p = 0.001 for the first emitted token, the token after one acceptance and
the bonus token, with sampled and with greedy (one-hot) drafts.
CPU: the interpreter. GPU (`gpu` marker): the 200k-row distribution test on the Triton kernel.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels.rejection import rejection_sample, rejection_sample_reference
from kernel_helpers import CHI2_CRITICAL_P001, on


def rejection_case(gen: torch.Generator, batch: int, max_draft: int, vocab: int, device: str):
    p = torch.softmax(torch.randn(batch, max_draft + 1, vocab, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(batch, max_draft, vocab, generator=gen) * 2, -1)
    draft = torch.randint(0, vocab, (batch, max_draft), generator=gen)
    num_draft = torch.randint(0, max_draft + 1, (batch,), generator=gen)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (batch,), generator=gen)
    offsets = torch.randint(0, 10 ** 6, (batch,), generator=gen)
    return [x.to(device) for x in (p, q, draft, num_draft, seeds, offsets)]


@pytest.mark.parametrize("max_draft,vocab", [(0, 30), (1, 9), (3, 50), (4, 300)])
def test_rejection_kernel_matches_reference(kernel_device, poisoned_empty, max_draft, vocab):
    gen = torch.Generator().manual_seed(90 + max_draft)
    p, q, draft, num_draft, seeds, offsets = rejection_case(gen, 7, max_draft, vocab, kernel_device)
    for draft_probs in (q, None):
        expected = rejection_sample_reference(p, draft_probs, draft, num_draft, seeds, offsets)
        tokens, accepted = poisoned_empty(rejection_sample, p, draft_probs, draft, num_draft, seeds, offsets)
        assert torch.equal(accepted, expected[1]) and torch.equal(tokens, expected[0])
        assert bool((accepted <= num_draft).all())


def test_rejection_greedy_target_is_argmax_matching(kernel_device):
    """One-hot p (a greedy target): accept the longest prefix equal to the argmax, then emit
    the argmax at the first mismatch (or the bonus argmax)."""
    gen = torch.Generator().manual_seed(100)
    batch, max_draft, vocab = 16, 3, 12
    best = torch.randint(0, vocab, (batch, max_draft + 1), generator=gen)
    p = torch.nn.functional.one_hot(best, vocab).float()
    draft = torch.where(torch.rand(batch, max_draft, generator=gen) < 0.7, best[:, :max_draft],
                        torch.randint(0, vocab, (batch, max_draft), generator=gen))
    num_draft = torch.randint(0, max_draft + 1, (batch,), generator=gen)
    seeds, offsets = torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
    tokens, accepted = rejection_sample(*on(kernel_device, [p, None, draft, num_draft, seeds, offsets]))
    tokens, accepted = tokens.cpu(), accepted.cpu()
    for b in range(batch):
        n = 0
        while n < num_draft[b] and draft[b, n] == best[b, n]:
            n += 1
        assert accepted[b].item() == n
        assert tokens[b, :n + 1].tolist() == draft[b, :n].tolist() + [best[b, n].item()]
        assert (tokens[b, n + 1:] == -1).all()


P_FIXED = torch.tensor([[0.30, 0.05, 0.20, 0.15, 0.25, 0.05],
                        [0.10, 0.40, 0.05, 0.05, 0.10, 0.30],
                        [0.05, 0.15, 0.35, 0.25, 0.10, 0.10]])

Q_FIXED = torch.tensor([[0.10, 0.30, 0.10, 0.30, 0.10, 0.10],
                        [0.25, 0.15, 0.25, 0.05, 0.25, 0.05]])


def chi_square(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=expected.numel()).double()
    n = counts.sum()
    return float(((counts - n * expected.double()) ** 2 / (n * expected.double())).sum())


def check_rejection_distribution(fn, device: str, greedy_drafts: bool) -> None:
    """200k rows, 2 drafts each, fixed p (3 positions) and q; drafts drawn from q, or for greedy
    drafts fixed tokens (0, 1) with draft_probs None (one-hot q). Emitted token 0 ~ p_0; given one
    acceptance token 1 ~ p_1; given both, the bonus token 2 ~ p_2."""
    rows, max_draft = 200_000, 2
    gen = torch.Generator().manual_seed(110 + greedy_drafts)
    if greedy_drafts:
        draft = torch.tensor([0, 1]).expand(rows, max_draft).clone()
    else:
        draft = torch.stack([torch.multinomial(Q_FIXED[i], rows, replacement=True, generator=gen)
                             for i in range(max_draft)], 1)
    args = [P_FIXED.expand(rows, -1, -1).contiguous(),
            None if greedy_drafts else Q_FIXED.expand(rows, -1, -1).contiguous(), draft,
            torch.full((rows,), max_draft), torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=gen),
            torch.randint(0, 2 ** 40, (rows,), generator=gen)]
    tokens, accepted = fn(*on(device, args))
    tokens, accepted = tokens.cpu(), accepted.cpu()
    for position in range(max_draft + 1):
        reached = accepted >= position
        stat = chi_square(tokens[reached, position], P_FIXED[position])
        assert stat < CHI2_CRITICAL_P001[5], f"position {position}: chi-square {stat:.1f}, {int(reached.sum())} rows"
        assert int(reached.sum()) > 10_000


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_rejection_reference_emits_target_distribution(greedy_drafts):
    check_rejection_distribution(rejection_sample_reference, "cpu", greedy_drafts)


@pytest.mark.gpu
@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_rejection_kernel_emits_target_distribution(greedy_drafts):
    check_rejection_distribution(rejection_sample, "cuda", greedy_drafts)
