"""Start-up warm-up: dummy requests through the engine's own steps, so that serving never waits
for a Triton compile or an autotuning run.

Triton compiles one binary per specialization of a kernel's arguments (an integer equal to 1 or
divisible by 16, a pointer aligned to 16 bytes, each constexpr value) and autotunes once per key;
on an H200 a compile costs ~0.1-0.3 s and an autotuning run ~0.5 s. Decode-only steps replay
CUDA graphs captured at start-up, but steps with prefill chunks run eagerly with shapes set by
the traffic: the first step of each new kind (a prefill row count in a new power-of-two bucket,
the prefill group starting at an odd token offset, a row past the checkpoint interval, a
sampled row, a draft count) stalled every running stream for up to a second
(bench/step_trace.py). Kernel arguments that vary with the step and need no specialization are
marked do_not_specialize (kernels/); this covers the rest by running, before the first request,
steps of every kind: prefill rows in each bucket 1, 2, 4, .. max_num_seqs, beside an odd and an
even number of decode rows, 1, 2 and 4 prompts alone filling a step, short and
checkpoint-crossing prompts, greedy and sampled rows, a cached prompt, small steps of a few short
prompts beside a few decode rows, and rows sampled as users configure them (penalties, logit
bias, bad words, min_tokens, a JSON grammar, log-probabilities, prompt scores), beside plain rows, as whole
batches and mixed in one batch, at every draft count (the policy pinned to each in turn). An engine with a draft editor
(tests) is not warmed up: the editor sees every request.

Afterwards the engine is as new: the prefix cache is cleared, counters and the draft policy's
observations are reset. What it missed shows while serving: a Triton compile after a warm-up
(no warm-up under way) is logged as a warning naming the kernel, and counted
(`num_compiles_after_warm_up`, one process-wide hook on Triton's JIT cache misses). Knows
nothing about kernels: it only submits requests and steps.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Callable

import numpy as np
from PIL import Image

from .sampling_params import SamplingParams
from .structured import Structured
from .vision.image import ImageInput

logger = logging.getLogger("deltaspec")

SMALL_STEPS = 48
SMALL_PROMPT = 600  # small steps' prompts are log-uniform in 1 .. this: contexts short and long
LONG_PROMPT = 2048  # the long-context phase's prompts reach this (the attention splits keys by context)


class _Compiles:
    """Triton compiles in this process, seen through the JIT's cache-miss hook (installed once,
    chained to any hook set before it)."""

    installed = False
    warm_ups_running = 0
    warmed_up = False  # a warm-up has ended: compiles from now on are late
    after_warm_up = 0


def _install_compile_hook() -> None:
    if _Compiles.installed:
        return
    _Compiles.installed = True
    try:
        from triton import knobs
    except ImportError:  # a Triton without knobs: nothing is watched
        return
    previous = knobs.runtime.jit_cache_hook

    def on_compile(*args, **kwargs) -> bool:
        if _Compiles.warmed_up and not _Compiles.warm_ups_running:
            _Compiles.after_warm_up += 1
            logger.warning("Triton compiled %s after the warm-up: every running request waited for it (a "
                           "shape class the warm-up does not cover)", kwargs["fn"].name if "fn" in kwargs else "?")
        return previous(*args, **kwargs) if previous is not None else False

    knobs.runtime.jit_cache_hook = on_compile


def num_compiles_after_warm_up() -> int:
    """Triton compiles (or loads from its disk cache) in this process while no warm-up ran,
    after the first warm-up ended."""
    return _Compiles.after_warm_up


def warm_up(core) -> float:
    """Run the warm-up on `core` (an EngineCore with no requests). Returns its seconds."""
    _install_compile_hook()
    _Compiles.warm_ups_running += 1
    try:
        return _run(core)
    finally:
        _Compiles.warm_ups_running -= 1
        _Compiles.warmed_up = True


def _configured(greedy: SamplingParams, sampled: SamplingParams, vocab: int) -> list[SamplingParams]:
    """Greedy and sampled variants of penalized (alone, and with bias, bans and min_tokens),
    constrained, both (with a bias and without), log-probability rows and prompt-scoring ones."""
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.1)
    biased = dict(penalties, logit_bias={vocab // 2: 2.0, vocab // 3: -2.0}, bad_words=("the",), min_tokens=2)
    structured = Structured("json_object")
    # The penalty pass has a variant with logit bias and one without.
    variants = [penalties, biased, dict(structured=structured), dict(penalties, structured=structured),
                dict(biased, structured=structured), dict(logprobs=2), dict(prompt_logprobs=1)]
    return [dataclasses.replace(base, **variant) for base in (greedy, sampled) for variant in variants]


def _image_prompt(core, rng: random.Random, text: Callable[[int], list[int]]) -> tuple[list[int], list[ImageInput]]:
    """A short prompt (random text) around two random images of the processor's smallest size:
    (token ids, one image token each; the images)."""
    processor = core.image_processor
    side = processor.config.factor * max(1, round(processor.config.min_pixels ** 0.5 / processor.config.factor))
    images = [processor.resize(Image.fromarray(np.random.default_rng(rng.randrange(1 << 30)).integers(
        0, 256, (side, side, 3), dtype=np.uint8))) for _ in range(2)]
    pad = [processor.image_token_id]
    return text(5) + pad + text(3) + pad + text(4), images


def _run(core) -> float:
    started = time.perf_counter()
    config, scheduler = core.config, core.scheduler
    rng = random.Random(0)
    vocab = core.model_config.vocab_size
    budget = config.max_num_batched_tokens
    # Enough output tokens that each wave is still decoding when the next one is admitted.
    greedy = SamplingParams(max_tokens=4 + core.num_draft_tokens, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4 + core.num_draft_tokens, temperature=0.7, top_p=0.9, seed=0,
                             ignore_eos=True)
    long_prompt = min(config.checkpoint_interval + 17, budget // 2, core.max_model_len - greedy.max_tokens - 1)
    waves = sorted({n for n in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256) if n <= config.max_num_seqs}
                   | {config.max_num_seqs})

    media_tokens = {core.model_config.image_token_id, core.model_config.video_token_id} - {None}
    plain_token = next(t for t in range(vocab) if t not in media_tokens)

    def prompt(length: int) -> list[int]:
        # Random text: never an image or video token, which needs its media (`image_prompt`).
        text = [rng.randrange(vocab) for _ in range(max(1, length))]
        return [t if t not in media_tokens else plain_token for t in text]

    shared = prompt(min(48, long_prompt))  # submitted twice: the second restores a cached prefix
    for index, rows in enumerate(waves):
        per_row = max(1, min(budget // (2 * rows), core.max_model_len - greedy.max_tokens - 1))
        for row in range(rows):
            # Log-uniform in 1 .. per_row: single tokens to full chunks.
            length = long_prompt if row == 0 and index % 2 else round(per_row ** rng.random())
            core.add_request(prompt(length), sampled if row % 3 == 1 else greedy)
        core.add_request(shared, greedy)
        # Two steps per wave: the wave's prefill lands beside the previous wave's decode rows.
        for _ in range(2):
            if core.has_work:
                core.step()
    # A prompt with images, alone and beside decode rows: the vision encoder, the [3, T] RoPE
    # variant and the eager prefill image tokens take (prefill_graphs skip them), plain and MTP.
    if core.image_processor is not None:
        for _ in range(2):
            tokens, images = _image_prompt(core, rng, prompt)
            core.add_request(tokens, greedy, images=images)
            core.add_request(prompt(8), greedy)
            for _ in range(2):
                if core.has_work:
                    core.step()
    # Prompts alone in their step, 1, 2 and 4 of them filling its budget: steps of few long rows,
    # past the prefill graphs' buckets (where capturing stopped paying), run eagerly with no
    # padding row beside them, a shape class no graphed step and none of the waves above reach.
    while core.has_work:
        core.step()
    for rows in (1, 2, 4):
        if rows > config.max_num_seqs:
            break
        for _ in range(rows):
            core.add_request(prompt(min(budget // rows, core.max_model_len - greedy.max_tokens - 1)), greedy)
        while core.has_work:
            core.step()
    # Small steps: a few prompts, mostly short, beside a few decode rows of various contexts (a
    # step of a few dozen tokens takes other GEMM and attention tiles than a full chunk does).
    for _ in range(SMALL_STEPS):
        for _ in range(rng.randint(1, 3)):
            length = min(round(SMALL_PROMPT ** rng.random()), core.max_model_len // 2)
            params = SamplingParams(max_tokens=min(rng.randint(2, 12), core.max_model_len - length),
                                    temperature=rng.choice((0.0, 0.7)), seed=0, ignore_eos=True)
            core.add_request(prompt(length), params)
        core.step()
    # Decode rows of long contexts beside a single short prompt: steps of few, short rows (the
    # attention's split-key decode tiles) at the contexts long prompts reach.
    for num_long in (1, 2, 3, 4, 6, 8):
        for _ in range(num_long):
            core.add_request(prompt(round(min(LONG_PROMPT, budget, core.max_model_len // 2) ** rng.uniform(0.6, 1))),
                             greedy)
        for _ in range(6):
            if core.has_work:
                core.step()
            core.add_request(prompt(rng.randint(1, 4)), greedy)
    # Rows sampled as users configure them, the kernels their steps add (penalty pass, bans,
    # grammar masks, log-probabilities of outputs and of prompts) in each variant: a few such
    # rows beside plain ones, then a batch of nothing else (every row redecided), greedy and sampled. Once at every draft
    # count: those kernels read the step's logits as [rows, K + 1, V], whose strides (and so the
    # kernels' specializations) change with K, which an adaptive policy picks from the costs it
    # measures (another machine or another build, another K).
    while core.has_work:
        core.step()
    policy = scheduler.draft_policy
    pinned = [None] if policy is None else [policy.pin(k) for k in range(policy.max_draft_tokens + 1)]
    configured = _configured(greedy, sampled, vocab)
    # Every variant in one batch, then those without a logit bias: a speculative step decides its
    # constrained rows together (Speculator.launch's deferred rows), so the penalty pass then runs
    # over those of them that are penalized (its variant with a row index, and drafts), biased or not.
    mixed = (configured, [params for params in configured if not params.logit_bias])
    for pinned_policy in pinned:  # swapped between phases, with no request in flight
        scheduler.draft_policy = pinned_policy
        for params in configured:
            for together in (False, True):
                for _ in range(3):
                    core.add_request(prompt(rng.randint(1, 64)), params)
                if not together:
                    core.add_request(prompt(rng.randint(1, 64)), greedy)
                while core.has_work:
                    core.step()
        for batch in mixed:
            for params in batch:
                core.add_request(prompt(rng.randint(1, 64)), params)
            while core.has_work:
                core.step()
    scheduler.draft_policy = policy
    core.clear_prefix_cache(reset_stats=True)
    core.reset_counters()
    if scheduler.draft_policy is not None:
        scheduler.draft_policy = scheduler.draft_policy.fresh()
    core.reset_arrivals()
    return time.perf_counter() - started
