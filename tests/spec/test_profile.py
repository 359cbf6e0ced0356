"""Forced acceptance for benchmarks (spec/profile.py): AcceptanceProfile's draws against an
independent count over many rows. by_position[i] is the unconditional chance that draft i + 1 is
accepted, so the fraction of rows with at least i + 1 accepted drafts must match it; a row never
accepts more than it drafted, nor past the profile's length; `set` swaps the profile in place
(the tensor a captured graph reads is the one updated); bad profiles are refused. CPU tensors."""

import pytest
import torch

from deltaspec.spec import AcceptanceProfile

ROWS = 200_000
SHIPPED = [0.86, 0.62, 0.47]


def reach(accepted: torch.Tensor, depths: int) -> list[float]:
    """Per-position acceptance: the fraction of rows with accepted >= i, for i = 1..depths."""
    return [(accepted >= i).double().mean().item() for i in range(1, depths + 1)]


@pytest.mark.parametrize("by_position", [SHIPPED, [0.5, 0.5, 0.5], [0.95, 0.3, 0.0], [1.0, 1.0, 1.0]])
def test_draws_follow_the_profile(by_position):
    torch.manual_seed(0)
    profile = AcceptanceProfile(by_position)
    accepted = profile.draw(torch.full((ROWS,), 3), max_drafts=3)
    assert accepted.shape == (ROWS,) and accepted.dtype == torch.int64
    assert accepted.min() >= 0 and accepted.max() <= 3
    assert reach(accepted, 3) == pytest.approx(by_position, abs=0.01)


def test_depths_past_the_profile_are_never_accepted():
    torch.manual_seed(1)
    accepted = AcceptanceProfile([0.8, 0.4]).draw(torch.full((ROWS,), 3), max_drafts=3)
    assert reach(accepted, 3) == pytest.approx([0.8, 0.4, 0.0], abs=0.01)
    assert accepted.max() == 2


def test_num_drafts_caps_the_count():
    torch.manual_seed(2)
    num_drafts = torch.randint(0, 4, (ROWS,))
    accepted = AcceptanceProfile(SHIPPED).draw(num_drafts, max_drafts=3)
    assert bool((accepted <= num_drafts).all())
    assert bool((accepted[num_drafts == 0] == 0).all())
    # Below the cap the profile still holds: among rows that drafted n, depths 1..n follow it.
    for n in (1, 2, 3):
        rows = accepted[num_drafts == n]
        assert reach(rows, n) == pytest.approx(SHIPPED[:n], abs=0.01)
    # A profile that accepts everything returns exactly num_drafts.
    assert torch.equal(AcceptanceProfile([1.0, 1.0, 1.0]).draw(num_drafts, max_drafts=3), num_drafts)


def test_set_changes_the_draws_in_place():
    torch.manual_seed(3)
    profile = AcceptanceProfile([0.3, 0.1, 0.0])
    num_drafts = torch.full((ROWS,), 3)
    before = profile.draw(num_drafts, max_drafts=3)
    assert reach(before, 3) == pytest.approx([0.3, 0.1, 0.0], abs=0.01)
    tensors = dict(profile._tensors)          # what a graph captured with the old profile reads
    same = profile
    profile.set([0.9, 0.6, 0.2])
    assert profile is same and profile.by_position == (0.9, 0.6, 0.2)
    assert all(profile._tensors[key] is tensor for key, tensor in tensors.items())
    after = profile.draw(num_drafts, max_drafts=3)
    assert reach(after, 3) == pytest.approx([0.9, 0.6, 0.2], abs=0.01)


@pytest.mark.parametrize("bad", [[0.5, 0.6], [0.9, 0.2, 0.3], [1.2], [-0.1], [0.5, -0.1], []])
def test_bad_profiles_are_refused(bad):
    with pytest.raises(ValueError):
        AcceptanceProfile(bad)
    profile = AcceptanceProfile(SHIPPED)
    with pytest.raises(ValueError):
        profile.set(bad)
    assert profile.by_position == tuple(SHIPPED)   # a refused profile changes nothing
