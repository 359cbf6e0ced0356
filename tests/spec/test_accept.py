"""Greedy acceptance (spec/accept.py), pure tensor math without an engine: each row accepts its
drafts up to the first that differs from the target's token, and emits the target's tokens."""

import torch

from deltaspec.spec import greedy_accept


def test_greedy_accept_math():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 9], [5, 6, 7], [1, 2, 3]])
    accepted, emitted = greedy_accept(target, drafts, torch.tensor([3, 3, 1]))
    assert accepted.tolist() == [2, 3, 1]
    assert emitted[0, :3].tolist() == [5, 6, 7]
