"""The start-up warm-up (engine/warm_up.py): it leaves the engine as new (same outputs, ids from
"0", zeroed counters, an empty prefix cache, a policy that has observed nothing), and on the GPU
serving a staggered mix of requests afterwards (plain, and sampled as users configure it)
compiles no Triton kernel and tunes nothing."""

import contextlib
import dataclasses
import random

import pytest
import torch

from deltaspec.engine import EngineConfig, SamplingParams, Structured
from deltaspec.engine.core import EngineCore
from deltaspec.engine.warm_up import warm_up

from harness import assert_all_free, generate, make_jobs, prompts, run_staggered
from fixtures import GPU_SHAPE

SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def test_warm_up_leaves_the_engine_as_new(checkpoint):
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    config = EngineConfig(model=path, max_num_seqs=4, num_draft_tokens=2, checkpoint_interval=64)
    batch = prompts(3, seed=7)
    fresh = EngineCore(config)
    expected = generate(fresh, batch), generate(fresh, batch, SAMPLED)

    core = EngineCore(config)
    seconds = warm_up(core)
    assert seconds > 0
    assert_all_free(core)
    stats = core.stats()
    assert stats["spec"]["num_verify_steps"] == 0 and stats["num_preempted"] == 0
    assert stats["prefix_cache"]["gpu_checkpoints"] == 0 and stats["prefix_cache"]["reused_tokens"] == 0
    assert core.scheduler.draft_policy.observed == {}
    first = core.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    assert first.request_id == "0"
    core.abort(first.request_id)
    while core.has_work:
        core.step()
    core.reset_arrivals()
    assert (generate(core, batch), generate(core, batch, SAMPLED)) == expected


@pytest.mark.slow
def test_warm_up_reaches_every_variant_of_the_penalty_pass(checkpoint):
    """The penalty pass (kernels/penalties.py) compiles a variant per (drafts, a row index, a
    logit bias): a speculative engine's warm-up runs all eight, whatever the traffic later brings
    (a constrained row beside a constrained and penalized one decides with drafts over a subset
    of rows: once only served traffic reached that, and the GPU compiled mid-serving)."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    core = EngineCore(EngineConfig(model=path, max_num_seqs=8, num_draft_tokens=2, checkpoint_interval=64,
                                   warm_up=False))
    penalties = core.runner.sampler.penalties
    penalize_rows, reached = penalties.ops.penalize_rows, set()

    def recording(logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts=None, rows=None,
                  bias_tokens=None, bias_values=None, out=None):
        reached.add((drafts is not None and logits.shape[1] > 1, rows is not None, bias_tokens is not None))
        return penalize_rows(logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts, rows,
                             bias_tokens, bias_values, out)

    penalties.ops = dataclasses.replace(penalties.ops, penalize_rows=recording)
    warm_up(core)
    assert reached == {(drafts, rows, bias) for drafts in (False, True) for rows in (False, True)
                       for bias in (False, True)}


@contextlib.contextmanager
def compiles_and_tunings():
    """Every Triton compile (its specialization) and autotuning run inside the block."""
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    compiled = []
    bench = Autotuner._bench

    def tuned(self, *args, **kwargs):
        compiled.append(f"autotune:{self.base_fn.__name__}")
        return bench(self, *args, **kwargs)

    knobs.runtime.jit_cache_hook = lambda *args, **kwargs: compiled.append(kwargs["repr"])
    Autotuner._bench = tuned
    try:
        yield compiled
    finally:
        knobs.runtime.jit_cache_hook = None
        Autotuner._bench = bench
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("num_draft_tokens", [0, None])
def test_no_compile_or_tuning_while_serving_after_warm_up(checkpoint, num_draft_tokens):
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True, **GPU_SHAPE)
    core = EngineCore(EngineConfig(model=path, device="cuda", dtype="bfloat16", max_num_seqs=16,
                                   num_draft_tokens=num_draft_tokens, checkpoint_interval=64))
    # Plain jobs, then the same with every third one sampled as users configure it (penalties,
    # bias, bans, a JSON grammar, log-probabilities: each its variant of the redecided steps).
    configured = [dict(presence_penalty=1.2, logit_bias={7: 3.0}), dict(structured=Structured("json_object")),
                  dict(frequency_penalty=0.4, repetition_penalty=1.2, structured=Structured("json_object")),
                  dict(bad_words=("ab",), min_tokens=3), dict(logprobs=1)]
    jobs = make_jobs(40, seed=3, max_prompt=300)
    jobs += [dataclasses.replace(job, params=dataclasses.replace(job.params, **configured[i % len(configured)]))
             if i % 3 == 0 else job for i, job in enumerate(make_jobs(40, seed=4, max_prompt=300))]
    with compiles_and_tunings() as compiled:
        run_staggered(core, jobs)
    assert compiled == [], "compiled or tuned while serving:\n" + "\n".join(sorted(set(compiled)))
    assert_all_free(core)


@pytest.mark.gpu
def test_no_compile_for_long_prompts_alone_after_warm_up(checkpoint, monkeypatch):
    """A prompt alone in its step, longer than every captured prefill graph, runs eagerly as one
    row with no padding row beside it (as a long prompt sent to an idle server does): the
    warm-up must have run that step. Graphs captured up to 512 tokens, as where capturing stops
    paying for a larger model."""
    from deltaspec.engine import prefill_graphs

    monkeypatch.setattr(prefill_graphs, "token_buckets", lambda max_tokens: [64, 128, 256, 512])
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True, **GPU_SHAPE)
    core = EngineCore(EngineConfig(model=path, device="cuda", dtype="bfloat16", max_num_seqs=8,
                                   max_num_batched_tokens=4096, max_model_len=8192, checkpoint_interval=64))
    rng = random.Random(11)
    with compiles_and_tunings() as compiled:
        for length in (4096, 2900, 7000):  # a full step, a part of one, two chunks and a remainder
            generate(core, [[rng.randrange(512) for _ in range(length)]])
    assert compiled == [], "compiled or tuned while serving:\n" + "\n".join(sorted(set(compiled)))
    assert_all_free(core)


def test_compiles_after_a_warm_up_are_counted_and_logged(monkeypatch, caplog):
    """The JIT hook counts and names a compile only once a warm-up has ended and none runs,
    and passes every call on to the hook that was there before it."""
    import logging
    from types import SimpleNamespace

    from triton import knobs

    from deltaspec.engine import warm_up as module

    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *args, **kwargs: earlier.append(kwargs) or False)
    for name, value in {"installed": False, "warm_ups_running": 0, "warmed_up": False, "after_warm_up": 0}.items():
        monkeypatch.setattr(module._Compiles, name, value)
    module._install_compile_hook()
    hook = knobs.runtime.jit_cache_hook
    kernel = SimpleNamespace(name="_late_kernel")
    with caplog.at_level(logging.WARNING, logger="deltaspec"):
        assert hook(fn=kernel) is False  # before any warm-up: start-up compiles
        monkeypatch.setattr(module._Compiles, "warmed_up", True)
        monkeypatch.setattr(module._Compiles, "warm_ups_running", 1)
        hook(fn=kernel)  # another engine's warm-up
        assert module.num_compiles_after_warm_up() == 0 and "_late_kernel" not in caplog.text
        monkeypatch.setattr(module._Compiles, "warm_ups_running", 0)
        hook(fn=kernel)
    assert module.num_compiles_after_warm_up() == 1 and "Triton compiled _late_kernel after the warm-up" in caplog.text
    assert len(earlier) == 3
