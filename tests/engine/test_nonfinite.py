"""Non-finite logits: a row whose logits hold a NaN fails its request alone.

A NaN is injected into one request's target logits (the model's `logits`, as the runner and the
speculator call it) in the step that gives its first token (a prefill row) or a later one (a
decode row), beside plain and sampled requests, with and without speculation; or, as a real
fault would, into its slot's recurrent state (also on the GPU, through the CUDA graphs). The flag is
computed on the device beside the tokens and read with them; the request fails (finish reason
"error", NonFiniteLogitsError naming it), its slot and blocks are freed, and every other request's
output equals the same batch's without the fault.
"""

import asyncio
import random
import re

import pytest

from deltaspec.engine import LLM, AsyncLLM, NonFiniteLogitsError, SamplingParams
from deltaspec.engine.request import NONFINITE_LOGITS
from fixtures import GPU_SHAPE, assert_idle


def poison(engine, victim_prompt: list[int], after_tokens: int) -> list:
    """Set NaN in the target logits of the request with victim_prompt, once, in the first
    forward that runs it with at least after_tokens output tokens: its decode row's 1 + K
    positions (the verify; an MTP draft's logits have one row a decode row), or its prefill
    row's one. Returns the list the poisoned row's kind ("decode" or "prefill") goes to."""
    runner, model = engine.runner, engine.model
    current, poisoned = {}, []

    def tracking(method, kind):
        def call(*args):
            current["rows"], current["kind"] = args[-1], kind  # the forward's rows
            return method(*args)
        return call

    runner._launch_decode = tracking(runner._launch_decode, "decode")
    runner._prefill = tracking(runner._prefill, "prefill")
    logits_of = model.logits

    def logits(hidden, out=None):
        result = logits_of(hidden, out=out)
        rows = current.get("rows")
        if rows is None or poisoned:
            return result
        if current["kind"] == "decode":
            width = 1 + max(r.num_draft_tokens for r in rows)
        else:
            width, rows = 1, [r for r in rows if r.sample]
        if result.shape[0] != len(rows) * width:
            return result  # an MTP draft's logits
        for i, row in enumerate(rows):
            request = row.request
            if request.prompt_token_ids == victim_prompt and len(request.output_token_ids) >= after_tokens:
                result[i * width:(i + 1) * width] = float("nan")
                poisoned.append(current["kind"])
        return result

    model.logits = logits
    return poisoned


def poison_state(engine, victim_prompt: list[int], after_tokens: int) -> list:
    """Fill the recurrent state of the victim's slot with NaN (first GDN layer), once, before the
    first step that runs it with at least after_tokens output tokens. Returns the list "decode"
    goes to then."""
    runner, poisoned = engine.runner, []

    def poisoning(method):
        def call(plan):
            for row in plan.decode_rows:
                request = row.request
                if not poisoned and request.prompt_token_ids == victim_prompt \
                        and len(request.output_token_ids) >= after_tokens:
                    engine.states.layers[0].recurrent[row.slot] = float("nan")
                    poisoned.append("decode")
            return method(plan)
        return call

    runner.run, runner.launch = poisoning(runner.run), poisoning(runner.launch)
    return poisoned


def check_fails_alone(llm: LLM, inject, after_tokens: int, num_draft_tokens: int) -> None:
    """Run a batch, then the same batch with `inject` (poison or poison_state) aimed at one
    request: it fails alone, the others' output is unchanged, nothing is held, and the batch
    gives the same output after."""
    prompts, params = _batch(seed=after_tokens + num_draft_tokens)
    expected = [output.token_ids for output in llm.generate(prompts, params)]
    llm.core.clear_prefix_cache()  # the victim prefills again (not a cached row)
    victim = 1
    poisoned = inject(llm.core, prompts[victim], after_tokens)
    with pytest.raises(NonFiniteLogitsError, match=re.escape(NONFINITE_LOGITS)) as raised:
        llm.generate(prompts, params)
    assert poisoned == ["prefill" if after_tokens == 0 else "decode"]
    outputs = raised.value.outputs
    assert raised.value.request_ids == [outputs[victim].request_id]
    assert outputs[victim].request_id in str(raised.value)
    assert outputs[victim].finish_reason == "error"
    # The victim keeps what steps before the faulty one produced (with the step in flight when
    # it was launched: at most 1 + K tokens more), nothing of the faulty step.
    assert outputs[victim].token_ids == expected[victim][:len(outputs[victim].token_ids)]
    assert len(outputs[victim].token_ids) <= after_tokens + (num_draft_tokens + 1 if after_tokens else 0)
    for i, output in enumerate(outputs):
        if i != victim:
            assert output.token_ids == expected[i] and output.finish_reason == "length"
    assert_idle(llm.core.stats())
    llm.core.clear_prefix_cache()
    # Healthy after, the failed request's slot and blocks reused.
    assert [output.token_ids for output in llm.generate(prompts, params)] == expected


def _batch(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [rng.choices(range(3, 500), k=rng.randint(4, 40)) for _ in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=seed, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    return prompts, params


@pytest.mark.parametrize("num_draft_tokens", [0, 2])
@pytest.mark.parametrize("after_tokens", [0, 3], ids=["prefill", "decode"])
def test_nonfinite_logits_fail_their_request_alone(checkpoint, num_draft_tokens, after_tokens):
    llm = LLM(checkpoint("qwen3_5"), num_draft_tokens=num_draft_tokens, adaptive_draft_length=False)
    check_fails_alone(llm, poison, after_tokens, num_draft_tokens)


@pytest.mark.parametrize("num_draft_tokens", [0, 2])
def test_a_nan_state_fails_its_request_alone(checkpoint, num_draft_tokens):
    llm = LLM(checkpoint("qwen3_5"), num_draft_tokens=num_draft_tokens, adaptive_draft_length=False)
    check_fails_alone(llm, poison_state, 3, num_draft_tokens)


def test_a_failed_prefill_admitted_ahead_keeps_no_checkpoint(checkpoint):
    """A prompt admitted by a step launched ahead (while another request decodes) whose logits
    are not finite: its request fails, and the prompt-end checkpoint its forward was writing is
    dropped with it (the write belongs to that step, not to the one committed before it), so the
    same prompt sent again is prefilled afresh and answered as by a healthy engine."""
    path = checkpoint("qwen3_5")
    options = dict(num_draft_tokens=2, adaptive_draft_length=False)
    rng = random.Random(3)
    victim = rng.choices(range(3, 500), k=40)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = LLM(path, **options).generate([victim], params)[0].token_ids
    core = LLM(path, **options).core
    core.add_request(rng.choices(range(3, 500), k=20), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    core.step()
    core.step()
    launched, launch = [], core.runner.launch
    core.runner.launch = lambda plan: launched.append(plan) or launch(plan)
    poisoned = poison(core, victim, 0)
    request = core.add_request(victim, params)
    while not request.finished:
        core.step()
    assert poisoned == ["prefill"] and request.finish_reason == "error"
    admitting = [plan for plan in launched if any(row.request is request for row in plan.prefill_rows)]
    assert admitting and any(row.fed_from is not None for row in admitting[0].decode_rows)  # planned ahead
    reused = core.stats()["prefix_cache"]["reused_tokens"]
    again = core.add_request(victim, params)
    while not again.finished:
        core.step()
    assert core.stats()["prefix_cache"]["reused_tokens"] == reused
    assert again.output_token_ids == expected


@pytest.mark.gpu
@pytest.mark.parametrize("num_draft_tokens", [0, 2])
def test_a_nan_state_fails_its_request_alone_through_the_graphs(checkpoint, num_draft_tokens):
    """On the GPU: decode steps replay CUDA graphs and run overlapped; the flag is computed
    inside the graphs and copied to the host with the tokens."""
    llm = LLM(checkpoint("qwen3_5", **GPU_SHAPE), device="cuda", dtype="bfloat16",
              num_draft_tokens=num_draft_tokens, adaptive_draft_length=False)
    runner = llm.core.runner
    assert (runner.spec_graphs if num_draft_tokens else runner.graphs) is not None
    check_fails_alone(llm, poison_state, 3, num_draft_tokens)


async def test_async_llm_raises_for_the_failed_request_only(checkpoint, caplog):
    engine = AsyncLLM(checkpoint("qwen3_5"), num_draft_tokens=2, adaptive_draft_length=False)
    prompts, params = _batch(seed=7)

    async def consume(prompt, p):
        return [t async for delta in engine.generate(prompt, p) for t in delta.token_ids]

    expected = await asyncio.gather(*(consume(prompt, p) for prompt, p in zip(prompts, params)))
    engine.core.clear_prefix_cache()
    poison(engine.core, prompts[0], 2)
    results = await asyncio.gather(*(consume(prompt, p) for prompt, p in zip(prompts, params)),
                                   return_exceptions=True)
    assert isinstance(results[0], NonFiniteLogitsError) and NONFINITE_LOGITS in str(results[0])
    assert results[1:] == expected[1:]
    assert_idle(engine.stats())
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 1 and NONFINITE_LOGITS in lines[0]
    await engine.shutdown()
