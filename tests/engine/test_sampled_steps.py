"""Sampled decode steps: a step with plainly sampled rows draws them itself (DecodeStep.draw, the
function its CUDA graph captures, run eagerly here), and in a speculative step accepts them by
rejection sampling, rollback included. Each row's tokens (and log-probabilities) equal those of
the runner's eager redecision after a greedy step, the path penalized rows take: a zero
logit bias sends a sampled row there without changing its distribution. Checked for mixes of
greedy, plainly sampled and redecided rows, without speculation and with k = 3 drafts whose
acceptance counts are forced (every count 0..k occurs). The GPU tests (test_gpu_engine.py:
sampled_graphs_match, release_destroys) check the captured graphs themselves."""

import dataclasses

import pytest

from deltaspec.engine import EngineConfig, SamplingParams
from deltaspec.engine.core import EngineCore

from harness import ScriptedDrafter, assert_all_free, prompts

K = 3
PARAMS = [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, top_k=40, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.0, seed=12, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=14, temperature=0.7, min_p=0.05, seed=13, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.2, top_k=5, seed=14, ignore_eos=True),
]


def redecided(params: SamplingParams) -> SamplingParams:
    """The same distribution through the eager redecision: a bias of 0.0 changes no logit but
    makes the row penalized."""
    return dataclasses.replace(params, logit_bias={0: 0.0})


def mixes() -> dict[str, list[SamplingParams]]:
    """Every sampled row drawn in the step; every one redecided (the old path: no step draws);
    half and half (the step draws, then the redecided rows are decided again over its result)."""
    sampled = [i for i, p in enumerate(PARAMS) if not p.greedy]
    return {"in_step": PARAMS,
            "redecided": [redecided(p) if i in sampled else p for i, p in enumerate(PARAMS)],
            "both": [redecided(p) if i in sampled[::2] else p for i, p in enumerate(PARAMS)]}


def counter(owner, name: str, counted) -> list:
    """Counts the calls of owner.name (an instance's method) whose arguments satisfy `counted`."""
    calls, method = [], getattr(owner, name)

    def counting(*args, **kwargs):
        if counted(*args):
            calls.append(1)
        return method(*args, **kwargs)

    setattr(owner, name, counting)
    return calls


def run(core: EngineCore, batch: list[list[int]], params: list[SamplingParams]) -> tuple[list, dict[str, int]]:
    """Each request's tokens and log-probabilities, and how many decode steps drew in the step
    and how many redecided rows after it."""
    runner = core.runner
    draws = counter(runner.decode, "draw", lambda *args: True)
    redecisions = counter(runner, "_decide_plain", lambda tokens, redecision, *rest: redecision is not None)
    if runner.speculator is not None:
        redecisions = counter(runner.speculator, "decide", lambda resampling, *rest: resampling is not None)
    requests = [core.add_request(p, q) for p, q in zip(batch, params)]
    while core.has_work:
        core.step()
    outputs = [(r.output_token_ids, r.output_logprobs) for r in requests]
    return outputs, {"draws": len(draws), "redecisions": len(redecisions)}


def test_drawn_in_step_is_plain_sampling_only():
    greedy, sampled = PARAMS[0], PARAMS[1]
    assert not greedy.drawn_in_step and not greedy.redecided
    assert sampled.drawn_in_step and not sampled.redecided
    assert not redecided(sampled).drawn_in_step and redecided(sampled).redecided
    assert not redecided(greedy).drawn_in_step and redecided(greedy).redecided


@pytest.mark.parametrize("k", [0, K])
def test_sampled_steps_equal_the_eager_redecision(checkpoint, k):
    """Token for token and log-probability for log-probability, with k = 0 and with k drafts
    whose acceptance counts are forced: every mix gives the redecided mix's outputs, and with
    speculation the tokens without it."""
    path = checkpoint("qwen3_5")
    batch = prompts(len(PARAMS), seed=40 + k)
    plain = run(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch, PARAMS)[0] if k else None
    outputs, counts = {}, {}
    for name, params in mixes().items():
        if k:
            drafter = ScriptedDrafter({str(i): tokens for i, (tokens, _) in enumerate(plain)}, seed=k)
            core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False),
                              edit_drafts=drafter)
        else:
            core = EngineCore(EngineConfig(model=path, num_draft_tokens=0))
        outputs[name], counts[name] = run(core, batch, params)
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
