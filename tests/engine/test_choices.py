"""n > 1: the choices of one prompt are prefilled once (the forks restore the parent's
prompt-end checkpoint) and each equals its single-request twin (choice i: seed + i), with
speculation on and off, and with the prefix cache off (then every choice prefills)."""

import random
import re

import pytest

from deltaspec.engine import LLM, SamplingParams
from fixtures import GPU_SHAPE, assert_idle

# Prompts longer than one step's token budget: the parent prefills over several steps while
# its forks wait.
OPTIONS = dict(checkpoint_interval=64, max_num_batched_tokens=128, max_num_seqs=8, adaptive_draft_length=False)
N = 4


def prompts(num: int, length: int = 150) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(num)]


def choice_params(sampled: bool) -> SamplingParams:
    if sampled:
        return SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
    return SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("k, sampled, cache", [(0, False, True), (0, True, True), (2, False, True), (2, True, True),
                                               (2, True, False)])
def test_n_choices_equal_their_twins_and_prefill_once(checkpoint, k, sampled, cache):
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    params = choice_params(sampled)
    batch = prompts(2)
    llm = LLM(path, num_draft_tokens=k, enable_prefix_cache=cache, **OPTIONS)
    outputs = llm.generate(batch, params, n=N)
    assert len(outputs) == 2 * N
    twins = LLM(path, num_draft_tokens=k, enable_prefix_cache=False, **OPTIONS)
    for p, prompt in enumerate(batch):
        for i, choice in enumerate(params.for_choices(N)):
            twin = twins.generate(prompt, choice)[0]
            assert outputs[p * N + i].token_ids == twin.token_ids, (p, i)
    if sampled:  # seed + i: the choices differ
        assert len({tuple(o.token_ids) for o in outputs[:N]}) == N
    stats = llm.core.stats()
    # Each prompt computed once: the N - 1 forks of each restore all of it.
    reused = stats["prefix_cache"]["reused_tokens"]
    assert stats["prefix_cache"]["prompt_tokens"] == 2 * N * 150
    assert reused == (2 * (N - 1) * 150 if cache else 0)
    assert_idle(stats)


def test_unseeded_choices_differ_and_fork_of_needs_the_same_prompt(checkpoint):
    llm = LLM(checkpoint("qwen3_5"), **OPTIONS)
    prompt = prompts(1)[0]
    outputs = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), n=N)
    assert len({tuple(o.token_ids) for o in outputs}) == N
    parent = llm.core.add_request(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="different prompt"):
        llm.core.add_request(prompt[1:], SamplingParams(max_tokens=2), fork_of=parent.request_id)
    with pytest.raises(ValueError, match="n must be"):
        llm.generate(prompt, SamplingParams(), n=0)
    while llm.core.has_work:
        llm.core.step()
    assert_idle(llm.core.stats())


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 3])
def test_choices_through_the_cuda_graphs(checkpoint, k):
    """On the GPU (float32, CUDA graphs, overlapped steps): n = 4 sampled choices, one of them
    constrained to a regex in another batch, each equal to its single-request twin, and the
    prompt computed once."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True, **GPU_SHAPE)
    options = dict(OPTIONS, device="cuda", dtype="float32", num_draft_tokens=k)
    batch = prompts(2)
    constrained = SamplingParams(max_tokens=16, temperature=0.9, seed=5, structured=("regex", r"[a-f]{3,12}\.?"))
    for params in (choice_params(sampled=True), constrained):
        llm = LLM(path, **options)
        outputs = llm.generate(batch, params, n=N)
        twins = LLM(path, **dict(options, enable_prefix_cache=False))
        for p, prompt in enumerate(batch):
            for i, choice in enumerate(params.for_choices(N)):
                assert outputs[p * N + i].token_ids == twins.generate(prompt, choice)[0].token_ids, (p, i)
        if params.structured is not None:
            assert all(o.finish_reason == "stop" and re.fullmatch(r"[a-f]{3,12}\.?", o.text) for o in outputs)
        stats = llm.core.stats()
        assert stats["prefix_cache"]["reused_tokens"] == 2 * (N - 1) * 150
        assert_idle(stats)
