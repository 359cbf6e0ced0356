"""Prompt log-probabilities (SamplingParams.prompt_logprobs): every prompt token scored under the
logits of the position before it, against an independent reference (LLM.score's logits at every
position, normalised here), through chunked prefill, a warm prefix cache, n choices, speculation
and the streaming deltas; and the inputs it refuses."""

from __future__ import annotations

import asyncio
import random
from functools import lru_cache

import pytest
import torch

from deltaspec.engine import LLM, AsyncLLM, SamplingParams
from fixtures import GPU_SHAPE


@pytest.fixture
def path(checkpoint):
    return checkpoint("qwen3_5")


@lru_cache(maxsize=None)
def _llm(path, **options):
    return LLM(path, **options)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(length)]


def check_against_reference(llm: LLM, prompt: list[int], entries, top_n: int, atol: float = 1e-4) -> None:
    """entries: RequestOutput.prompt_logprobs of `prompt` asked with prompt_logprobs=top_n."""
    scores = torch.log_softmax(llm.score(prompt).double(), dim=-1)  # [T, V]: position t scores token t + 1
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry, row = entries[i], scores[i - 1]
        assert entry.logprob == pytest.approx(float(row[prompt[i]]), abs=atol)
        # 1 + the tokens more likely, up to ties within rounding.
        assert int((row > row[prompt[i]] + atol).sum()) + 1 <= entry.rank <= int((row >= row[prompt[i]] - atol).sum())
        assert len(entry.top) == top_n
        values = row.topk(top_n).values.tolist() if top_n else []
        assert [v for _, v in entry.top] == pytest.approx(values, abs=atol)
        for token, value in entry.top:
            assert float(row[token]) == pytest.approx(value, abs=atol)


@pytest.mark.parametrize("top_n", [0, 3])
def test_prompt_logprobs_match_the_reference(path, top_n):
    llm = _llm(path)
    prompt = _prompt(top_n, 37)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=top_n, logprobs=2)
    out = llm.generate([prompt], params)[0]
    check_against_reference(llm, prompt, out.prompt_logprobs, top_n)
    assert len(out.logprobs) == 3 and all(entry.rank >= 1 for entry in out.logprobs)
    # The greedy token is the most likely: rank 1, its log-probability the top one.
    assert all(entry.rank == 1 and entry.top[0][1] == pytest.approx(entry.logprob) for entry in out.logprobs)
    assert llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].prompt_logprobs \
        is None


def test_prompt_logprobs_over_chunks_cache_and_choices(path):
    """A prompt split over several prefill chunks, the same prompt again once its prefix is
    cached (the cache must not skip scored positions), n = 3 choices of it (forks restore the
    prompt: they copy its scores), beside requests that ask for none."""
    llm = _llm(path, max_num_batched_tokens=64, checkpoint_interval=64)
    prompt = _prompt(7, 203)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    asking = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    first = llm.generate([prompt, _prompt(8, 90)], [asking, plain])
    check_against_reference(llm, prompt, first[0].prompt_logprobs, 2)
    assert first[1].prompt_logprobs is None
    # Its prefix is cached now: the rest is prefilled from a checkpoint, in other row blocks than
    # the first time, whose products the CPU's GEMM may round otherwise (they differed in the 7th
    # digit on a 2-core CI machine): the reference's tolerance, not equality.
    again = llm.generate([prompt], asking)[0]
    check_against_reference(llm, prompt, again.prompt_logprobs, 2)
    assert again.token_ids == first[0].token_ids
    choices = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True,
                                                    prompt_logprobs=2), n=3)
    assert len(choices) == 3
    check_against_reference(llm, prompt, choices[0].prompt_logprobs, 2)
    for choice in choices[1:]:   # the forks copy the one prefill's scores
        assert choice.prompt_logprobs == choices[0].prompt_logprobs


def test_prompt_logprobs_with_speculation_unchanged_tokens(path):
    prompt = _prompt(11, 50)
    base = dict(max_tokens=12, temperature=0, ignore_eos=True)
    plain = _llm(path, num_draft_tokens=0).generate([prompt], SamplingParams(**base))[0]
    spec = _llm(path, num_draft_tokens=3).generate([prompt], SamplingParams(**base, prompt_logprobs=1))[0]
    assert spec.token_ids == plain.token_ids
    check_against_reference(_llm(path, num_draft_tokens=0), prompt, spec.prompt_logprobs, 1)


def test_prompt_logprobs_come_once_on_the_first_delta(path):
    prompt = _prompt(5, 30)

    async def run():
        engine = AsyncLLM(path)
        try:
            return [d async for d in engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0,
                                                                            ignore_eos=True, prompt_logprobs=1))]
        finally:
            await engine.shutdown()

    deltas = asyncio.run(run())
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is deltas[0] and deltas[0].token_ids
    check_against_reference(_llm(path), prompt, carrying[0].prompt_logprobs, 1)


def test_prompt_logprobs_one_token_prompt(path):
    out = _llm(path).generate([[42]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=4))[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_prompt_logprobs_validated(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_refused_on_a_resumed_session(path):
    llm = _llm(path)
    first = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0))[0]
    handle = llm.save_checkpoint(first.request_id)
    try:
        with pytest.raises(ValueError, match="prompt_logprobs.*resume_from"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2, prompt_logprobs=1), resume_from=handle)
    finally:
        llm.release_checkpoint(handle)


@pytest.mark.gpu
def test_prompt_logprobs_on_gpu(checkpoint):
    """The GPU path, CUDA and prefill graphs on (the scores read the replayed graph's hidden
    states) and the Triton kernels, in float32 (bf16 would differ from the reference's
    unchunked forward by its rounding), against the same engine's scored logits."""
    llm = LLM(checkpoint("qwen3_5", **GPU_SHAPE), device="cuda", dtype="float32", max_num_batched_tokens=256)
    prompts = [_prompt(20 + i, n) for i, n in enumerate((17, 300, 64))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=5))
    for prompt, out in zip(prompts, outs):
        check_against_reference(llm, prompt, out.prompt_logprobs, 5, atol=1e-3)
