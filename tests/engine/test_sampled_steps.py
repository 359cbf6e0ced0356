"""Sampled decode steps: a step with plainly sampled rows draws them itself (DecodeStep.draw, the
function its CUDA graph captures, run eagerly here), and in a speculative step accepts them by
rejection sampling, rollback included. Each row's tokens (and log-probabilities) equal those of
the runner's eager redecision after a greedy step, the path penalized rows take: a zero
logit bias sends a sampled row there without changing its distribution. Checked for mixes of
greedy, plainly sampled and redecided rows, without speculation and with k = 3 drafts whose
acceptance counts are forced (every count 0..k occurs). The GPU tests (test_gpu_engine.py:
sampled_graphs_match, release_destroys) check the captured graphs themselves."""

import pytest

from deltaspec.engine import EngineConfig
from deltaspec.engine.core import EngineCore

from harness import SAMPLED_MIX, ScriptedDrafter, assert_all_free, mixes, prompts, redecided, run_counted


def test_drawn_in_step_is_plain_sampling_only():
    greedy, sampled = SAMPLED_MIX[0], SAMPLED_MIX[1]
    assert not greedy.drawn_in_step and not greedy.redecided
    assert sampled.drawn_in_step and not sampled.redecided
    assert not redecided(sampled).drawn_in_step and redecided(sampled).redecided
    assert not redecided(greedy).drawn_in_step and redecided(greedy).redecided


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_steps_equal_the_eager_redecision(checkpoint, k):
    """Token for token and log-probability for log-probability, with k = 0 and with k drafts
    whose acceptance counts are forced: every mix gives the redecided mix's outputs, and with
    speculation the tokens without it."""
    path = checkpoint("qwen3_5")
    batch = prompts(len(SAMPLED_MIX), seed=40 + k)
    plain = run_counted(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch, SAMPLED_MIX)[0] if k else None
    outputs, counts = {}, {}
    for name, params in mixes().items():
        if k:
            drafter = ScriptedDrafter({str(i): tokens for i, (tokens, _) in enumerate(plain)}, seed=k)
            core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False),
                              edit_drafts=drafter)
        else:
            core = EngineCore(EngineConfig(model=path, num_draft_tokens=0))
        outputs[name], counts[name] = run_counted(core, batch, params)
        if k:
            assert set(drafter.forced) == set(range(k + 1))
        assert_all_free(core)
    assert counts["in_step"]["draws"] > 0 and counts["in_step"]["redecisions"] == 0
    assert counts["redecided"]["draws"] == 0 and counts["redecided"]["redecisions"] > 0
    assert counts["both"]["draws"] > 0 and counts["both"]["redecisions"] > 0
    tokens = {name: [t for t, _ in output] for name, output in outputs.items()}
    assert tokens["in_step"] == tokens["redecided"] == tokens["both"]
    assert outputs["in_step"] == outputs["redecided"] == outputs["both"]
    if k:
        assert tokens["in_step"] == [t for t, _ in plain]
