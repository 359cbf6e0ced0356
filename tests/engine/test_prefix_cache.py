"""Prompt-prefix reuse: output with the prefix cache on equals output with it off (greedy and
seeded sampling, speculation on and off) for shared system prompts, a multi-turn chat, prompts
that diverge inside a block and at a block boundary, fully cached prompts, two requests
restoring one checkpoint at once, eviction to the host tier and back, memory pressure and saved
sessions; nothing leaks. Plus the pure-Python cache's own rules."""

import asyncio
import dataclasses
import gc
import random

import pytest
import torch

from deltaspec.engine import AsyncLLM, EngineConfig, SamplingParams
from deltaspec.engine.allocators import BlockAllocator, SlotAllocator
from deltaspec.engine.core import EngineCore
from deltaspec.engine.prefix_cache import PrefixCache
from deltaspec.engine.model_config import ModelConfig
from deltaspec.engine.state_pool import KVPool, StatePool
from fixtures import COMMON_DEFAULTS, GPU_SHAPE, assert_idle
from harness import check_isolation

VOCAB = 512
# A fixed draft count where speculation is on: the adaptive one depends on the batch and on
# observed step times, and the tests compare per-position acceptance between engines.
OPTIONS = dict(checkpoint_interval=64, max_num_batched_tokens=128, max_num_seqs=8, adaptive_draft_length=False)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def params(sampled: bool, i: int, max_tokens: int = 10) -> SamplingParams:
    if sampled:
        return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_batches(core: EngineCore, batches: list[list[tuple[list[int], SamplingParams]]]) -> list:
    """Submit each batch at once and run it to completion before the next one."""
    results = []
    for batch in batches:
        requests = [core.add_request(prompt, p) for prompt, p in batch]
        while core.has_work:
            core.step()
        results += [(r.output_token_ids, r.spec_stats.as_dict()["accepted_by_position"]) for r in requests]
    return results


def scenario(seed: int, sampled: bool) -> list[list[tuple[list[int], SamplingParams]]]:
    """Shared system prompt (first alone, then 4 concurrent users), prompts diverging inside a
    block and exactly at block boundaries (one of them a checkpoint boundary), fully cached
    prompts (a prompt end, a checkpoint boundary), and two identical prompts at once."""
    rng = random.Random(seed)
    system = tokens(rng, 150)
    users = [tokens(rng, n) for n in (5, 17, 40, 64)]
    n = iter(range(100))
    return [
        [(system + tokens(rng, 9), params(sampled, next(n)))],
        [(system + u, params(sampled, next(n))) for u in users],
        [(system[:70] + tokens(rng, 30), params(sampled, next(n))),   # inside a block
         (system[:80] + tokens(rng, 20), params(sampled, next(n))),   # at a block boundary
         (system[:128] + tokens(rng, 3), params(sampled, next(n)))],  # at a checkpoint boundary
        [(system + users[1], params(sampled, next(n))),               # fully cached: a prompt end
         (system[:128], params(sampled, next(n)))],                   # fully cached: a boundary
        [(system + users[2], params(sampled, next(n))), (system + users[2], params(sampled, next(n)))],
    ]


def chat(core: EngineCore, seed: int, sampled: bool, turns: int = 6) -> list[list[int]]:
    """Each turn's prompt is the previous prompt + its answer + a new user message."""
    rng = random.Random(seed)
    conversation, answers = tokens(rng, 40), []
    for turn in range(turns):
        request = core.add_request(conversation, params(sampled, turn, max_tokens=12))
        while core.has_work:
            core.step()
        answers.append(request.output_token_ids)
        conversation = conversation + request.output_token_ids + tokens(rng, rng.randint(3, 30))
    return answers


@pytest.mark.parametrize("family, k, sampled", [
    ("qwen3_5", 0, False), ("qwen3_5", 0, True), ("qwen3_5", 3, False), ("qwen3_5", 3, True),
    pytest.param("qwen3_5_moe", 3, True, marks=pytest.mark.slow),
    pytest.param("qwen3_next", 3, True, marks=pytest.mark.slow)])
def test_prefix_cache_is_exact(checkpoint, family, k, sampled):
    path = checkpoint(family)
    common = dict(OPTIONS, num_draft_tokens=k)
    off = EngineCore(EngineConfig(model=path, enable_prefix_cache=False, **common))
    on = EngineCore(EngineConfig(model=path, **common))
    # Equal per-position acceptance too: the MTP's restored KV and hidden states are exact.
    assert run_batches(on, scenario(1, sampled)) == run_batches(off, scenario(1, sampled))
    assert chat(on, 2, sampled) == chat(off, 2, sampled)
    stats = on.stats()["prefix_cache"]
    assert stats["reused_tokens"] > 0.5 * stats["prompt_tokens"]
    assert off.stats()["prefix_cache"]["reused_tokens"] == 0
    for core in (on, off):
        assert_idle(core.stats())
        core.clear_prefix_cache()
        stats = core.stats()
        assert stats["num_free_slots"] == stats["num_slots"] and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("k", [0, 3])
def test_host_tier_evicts_and_restores_exactly(checkpoint, k):
    """One GPU checkpoint slot: checkpoints keep moving to the host tier and come back."""
    path = checkpoint("qwen3_5")
    common = dict(OPTIONS, num_draft_tokens=k, max_num_seqs=2)
    off = EngineCore(EngineConfig(model=path, enable_prefix_cache=False, **common))
    on = EngineCore(EngineConfig(model=path, num_checkpoint_slots=1, host_cache_bytes=1 << 30, **common))
    assert run_batches(on, scenario(3, True)) == run_batches(off, scenario(3, True))
    assert chat(on, 4, False) == chat(off, 4, False)
    stats = on.stats()["prefix_cache"]
    assert stats["offloads"] > 0 and stats["host_restores"] > 0 and stats["host_checkpoints"] > 0
    assert_idle(on.stats())
    on.clear_prefix_cache()
    assert not on.runner.checkpoint_io.host and on.cache.host_bytes == 0


def test_cache_shrinks_instead_of_failing(checkpoint):
    """A KV pool for about two sequences: cached prefixes are evicted to make room, every
    request completes with the output of an uncached run."""
    path = checkpoint("qwen3_5")
    rng = random.Random(5)
    batches = [[(tokens(rng, rng.randint(100, 200)), params(False, i))] for i in range(8)]
    batches.append([(batches[0][0][0], params(False, 0))])
    common = dict(OPTIONS, num_kv_blocks=30)
    off = EngineCore(EngineConfig(model=path, enable_prefix_cache=False, **common))
    on = EngineCore(EngineConfig(model=path, **common))
    assert run_batches(on, batches) == run_batches(off, batches)
    assert on.stats()["prefix_cache"]["evictions"] > 0
    assert_idle(on.stats())


def test_concurrent_restores_and_isolation(checkpoint):
    """Many requests restoring the same checkpoints in one step, staggered, some aborted: each
    equals its run alone."""
    core = check_isolation(checkpoint("qwen3_next"), 24, seed=7, checkpoint_interval=64, max_num_seqs=8,
                           num_checkpoint_slots=64,
                           max_num_batched_tokens=128)
    assert core.stats()["prefix_cache"]["reused_tokens"] > 0


@pytest.mark.parametrize("k", [0, 3])
def test_saved_session_resumes_without_prefill(checkpoint, k):
    path = checkpoint("qwen3_5")
    rng = random.Random(9)
    first, second = tokens(rng, 90), tokens(rng, 25)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, **OPTIONS))
    request = core.add_request(first, params(True, 0, max_tokens=14))
    while core.has_work:
        core.step()
    handle = core.save_checkpoint(request.request_id)
    assert list(handle.token_ids) == first + request.output_token_ids
    resumed = core.add_request(second, params(True, 1, max_tokens=14), resume_from=handle)
    while core.has_work:
        core.step()
    reused = core.stats()["prefix_cache"]["reused_tokens"]
    assert reused >= len(handle.token_ids) - (k + 2)  # all but the tokens never fed
    reference = EngineCore(EngineConfig(model=path, num_draft_tokens=k, enable_prefix_cache=False, **OPTIONS))
    expected = reference.add_request(list(handle.token_ids) + second, params(True, 1, max_tokens=14))
    while reference.has_work:
        reference.step()
    assert resumed.output_token_ids == expected.output_token_ids
    # A session survives cache pressure (pinned) until released.
    core.clear_prefix_cache()
    again = core.add_request([], params(True, 1, max_tokens=14), resume_from=handle)
    while core.has_work:
        core.step()
    fresh = reference.add_request(list(handle.token_ids), params(True, 1, max_tokens=14))
    while reference.has_work:
        reference.step()
    assert again.output_token_ids == fresh.output_token_ids
    core.release_checkpoint(handle)
    with pytest.raises(ValueError, match="not a saved session"):
        core.add_request(second, params(True, 1), resume_from=handle)
    with pytest.raises(ValueError, match="no checkpoint"):
        core.save_checkpoint("unknown")
    assert_idle(core.stats())


def test_cache_off_frees_finished_requests(checkpoint):
    """With the prefix cache off nothing is kept: idle, every slot and KV block is free (a
    finished request's slot used to stay taken as a checkpoint nobody could reuse)."""
    rng = random.Random(3)
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), num_draft_tokens=2, enable_prefix_cache=False,
                                   **OPTIONS))
    requests = [core.add_request(tokens(rng, 40), params(i % 2 == 1, i)) for i in range(3)]
    while core.has_work:
        core.step()
    stats = core.stats()
    assert stats["num_free_slots"] == stats["num_slots"] and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    with pytest.raises(ValueError, match="prefix cache is off"):
        core.save_checkpoint(requests[0].request_id)


async def test_async_sessions(checkpoint):
    """AsyncLLM: save a finished request, resume it twice concurrently (a fork), release."""
    path = checkpoint("qwen3_5")
    engine = AsyncLLM(path, num_draft_tokens=2, **OPTIONS)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = [t async for delta in engine.generate(list(range(1, 80)), params, request_id="turn1")
             for t in delta.token_ids]
    handle = engine.save_checkpoint("turn1")
    assert list(handle.token_ids) == list(range(1, 80)) + first

    async def resume(prompt):
        return [t async for delta in engine.generate(prompt, params, resume_from=handle) for t in delta.token_ids]

    forks = await asyncio.gather(resume([5, 6, 7]), resume([8, 9]))
    reference = EngineCore(EngineConfig(model=path, num_draft_tokens=2, enable_prefix_cache=False, **OPTIONS))
    for prompt, fork in zip(([5, 6, 7], [8, 9]), forks):
        request = reference.add_request(list(handle.token_ids) + prompt, params)
        while reference.has_work:
            reference.step()
        assert fork == request.output_token_ids
    handle.release()
    with pytest.raises(ValueError, match="not a saved session"):
        engine.release_checkpoint(handle)
    assert_idle(engine.stats())
    await engine.shutdown()


# The pure-Python cache --------------------------------------------------------------------------

def make_cache(num_slots: int = 8, num_blocks: int = 32, host: int = 0) -> PrefixCache:
    return PrefixCache(SlotAllocator(num_slots), BlockAllocator(num_blocks, 4), checkpoint_interval=8,
                       host_capacity_bytes=host, checkpoint_bytes=lambda n: 100 + n)


def adopt(cache: PrefixCache, token_ids: list[int], name: str, salt: str = "") -> None:
    slot = cache.slots.allocate(1)[0]
    blocks = cache.blocks.allocate(cache.blocks.blocks_needed(len(token_ids)))
    assert cache.adopt(name, token_ids, token_ids, len(token_ids), slot, blocks, salt)


def test_lookup_takes_the_longest_restorable_prefix():
    cache = make_cache()
    adopt(cache, [1, 2, 3, 4, 5, 6], "a")
    adopt(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    adopt(cache, [1, 2, 3, 9], "c")
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).position == 9
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8]).position == 6
    assert cache.lookup([1, 2, 3, 9, 9]).position == 4
    assert cache.lookup([1, 2, 3, 4, 5, 7]) is None
    # Adopted checkpoints keep no hidden state: they never serve a fully cached prompt.
    assert cache.lookup([1, 2, 3, 4, 5, 6]) is None
    assert not cache.adopt("d", [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 0], 6, 7, [])  # cached already


def test_eviction_is_lru_skips_pinned_and_keeps_sessions():
    cache = make_cache(num_slots=4, host=250)  # room on the host for two checkpoints (102 bytes each)
    adopt(cache, [1, 2, 3, 4, 5], "a")
    adopt(cache, [6, 7, 8, 9, 1], "b")
    adopt(cache, [2, 2, 2, 2, 2], "c")
    a = cache.lookup([1, 2, 3, 4, 5, 0])                  # a is now the most recent ...
    cache.pin(a)                                           # ... and pinned
    handle = cache.save("b")
    b, c = cache.session(handle), cache.lookup([2, 2, 2, 2, 2, 0])
    assert cache.make_room(1, 0) and b.on_host and not c.on_host   # the least recent moves first
    assert cache.make_room(2, 0) and c.on_host and a.slot is not None
    assert not cache.make_room(3, 0)                        # only the pinned one is left
    assert [o.checkpoint_id for o in cache.take_ops().offloads] == [b.id, c.id]
    assert cache.lookup([2, 2, 2, 2, 2, 0]) is c            # host checkpoints are still found
    adopt(cache, [3, 3, 3, 3, 3], "d")
    assert cache.make_room(2, 0)                           # d to the host: c (unpinned) is dropped
    assert cache.get(c.id) is None and cache.session(handle).on_host
    cache.release(handle)
    with pytest.raises(ValueError):
        cache.release(handle)


def test_a_hash_collision_cannot_restore_the_wrong_prefix(monkeypatch):
    cache = make_cache()
    monkeypatch.setattr(cache, "_chain", lambda token_ids, salt: [0] * (len(token_ids) // 4 + 1))
    adopt(cache, [1, 2, 3, 4, 5], "a")                     # every chain hash collides
    adopt(cache, [7, 7, 7, 7, 7], "b", salt="s")
    assert cache.lookup([9, 9, 9, 9, 5, 1]) is None
    assert cache.lookup([1, 2, 3, 4, 5, 1], salt="s") is None      # the tokens match, not the salt
    assert cache.lookup([7, 7, 7, 7, 7, 1]) is None
    assert cache.lookup([7, 7, 7, 7, 7, 1], salt="s").position == 5


def test_salts_keep_prefixes_apart():
    """vLLM's cache_salt: a prefix is found in its own salt's namespace only ("" is unsalted),
    the same tokens may be cached once per namespace, and writes are refused as cached only
    within one."""
    cache = make_cache()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    adopt(cache, tokens, "salted", salt="tenant-a")
    for salt in ("", "tenant-b", "tenant-a "):
        assert cache.lookup(tokens + [10], salt) is None
    salted = cache.lookup(tokens + [10], "tenant-a")
    assert salted.position == 9 and salted.salt == "tenant-a"
    adopt(cache, tokens, "plain")                                       # not cached in "": taken
    plain = cache.lookup(tokens + [10])
    assert plain is not salted and plain.salt == "" and cache.lookup(tokens + [10], "tenant-a") is salted
    assert not cache.adopt("again", tokens, tokens, 9, 7, [], "tenant-a")   # cached in its namespace
    table = cache.blocks.allocate(3)                                     # a running sequence's blocks
    assert cache.reserve_write(tokens, table, ends_tokens=True, salt="tenant-b") is not None
    assert cache.reserve_write(tokens, table, ends_tokens=True, salt="tenant-a") is None
    written, = cache.take_writes()
    cache.register_writes([written])
    assert cache.lookup(tokens, "tenant-b") is written and written.salt == "tenant-b"   # it kept the hidden state
    assert cache.lookup(tokens, "tenant-a") is None                    # adopted: no hidden state


def test_cache_salt_shares_prefixes_within_a_salt_only(checkpoint):
    """A request reuses the cached prefixes of its own salt's requests only (LLM's prompt dicts'
    cache_salt, SamplingParams.cache_salt), and the outputs are those of an uncached engine."""
    from deltaspec.engine import LLM
    path = checkpoint("qwen3_5")
    rng = random.Random(9)
    system = tokens(rng, 150)
    prompts = [system + tokens(rng, 12) for _ in range(5)]
    salts = [None, "a", "a", "b", None]          # each prompt after the first shares `system`
    llm = LLM(path, **OPTIONS)
    reference = EngineCore(EngineConfig(model=path, enable_prefix_cache=False, **OPTIONS))
    greedy = params(False, 0)
    reused = []
    for prompt, salt in zip(prompts, salts):
        before = llm.core.stats()["prefix_cache"]["reused_tokens"]
        given = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        output = llm.generate(given, greedy, use_tqdm=False)[0]
        reused.append(llm.core.stats()["prefix_cache"]["reused_tokens"] - before)
        request = reference.add_request(prompt, greedy)
        while reference.has_work:
            reference.step()
        assert list(output.outputs[0].token_ids) == request.output_token_ids
    assert reused[0] == reused[1] == reused[3] == 0 and reused[2] >= 128 and reused[4] >= 128
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": "a", "cache_salt": ""}, use_tqdm=False)
    first = llm.core.add_request(prompts[0], greedy)
    with pytest.raises(ValueError, match="different prompt or cache_salt"):
        llm.core.add_request(prompts[0], dataclasses.replace(greedy, cache_salt="a"), fork_of=first.request_id)
    while llm.core.has_work:
        llm.core.step()
    assert_idle(llm.core.stats())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 3])
def test_prefix_cache_is_exact_on_gpu(checkpoint, k):
    path = checkpoint("qwen3_5", **GPU_SHAPE)
    common = dict(OPTIONS, device="cuda", dtype="float32", num_draft_tokens=k)
    off = EngineCore(EngineConfig(model=path, enable_prefix_cache=False, **common))
    on = EngineCore(EngineConfig(model=path, host_cache_bytes=1 << 30, **common))
    assert run_batches(on, scenario(11, True)) == run_batches(off, scenario(11, True))
    assert chat(on, 12, False) == chat(off, 12, False)
    assert_idle(on.stats())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_copies_never_wait_for_the_device():
    """A restore's block copies queue behind the step in flight instead of waiting for it: the
    block ids reach the device from pinned memory (a pageable copy synchronizes the stream)."""
    pool = KVPool(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                  device="cuda")
    for layer in pool.layers:
        for cache in layer:
            cache.copy_(torch.randn(cache.shape, device="cuda"))
    expected = [[cache.clone() for cache in layer] for layer in pool.layers]
    for layer in expected:
        for cache in layer:
            cache[[5, 6]] = cache[[1, 3]]
    saved = pool.save_blocks([2])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.copy_blocks([(1, 5), (3, 6)])
        pool.load_blocks([7], saved)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for layer, want in zip(pool.layers, expected):
        for cache, wanted in zip(layer, want):
            wanted[7] = wanted[2]
            assert torch.equal(cache, wanted)


def test_a_steps_slot_copies_and_block_copies_move_every_layers_state():
    """copy_slots / copy_blocks copy every pair of a step at once: each destination equals its
    source in every per-slot tensor of every layer (and the kept hidden states), its pending count
    is zero, and nothing else changes."""
    config = ModelConfig.from_dict({"model_type": "qwen3_5_text", **COMMON_DEFAULTS})
    states = StatePool(config, 8, 2, torch.float32, "cpu", keep_mtp_hidden=True, keep_last_hidden=True)
    kv = KVPool(num_layers=2, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                device="cpu")
    per_slot = [t for layer in states.layers for t in layer[:5]] + [states.mtp_hidden, states.last_hidden]
    caches = [cache for layer in kv.layers for cache in layer]
    for t in per_slot + caches:
        t.copy_(torch.randn(t.shape))
    states.pending_counts.copy_(torch.randint(1, 3, (8,), dtype=torch.int32))
    want_slots, want_caches = [t.clone() for t in per_slot], [c.clone() for c in caches]
    want_counts = states.pending_counts.clone()
    for t in want_slots:
        t[[5, 6, 7]] = t[[1, 3, 1]]
    for c in want_caches:
        c[[7, 8]] = c[[2, 4]]
    want_counts[[5, 6, 7]] = 0
    states.copy_slots([(1, 5), (3, 6), (1, 7)])
    kv.copy_blocks([(2, 7), (4, 8)])
    assert all(torch.equal(t, want) for t, want in zip(per_slot, want_slots))
    assert all(torch.equal(c, want) for c, want in zip(caches, want_caches))
    assert torch.equal(states.pending_counts, want_counts)


def test_the_garbage_collector_walks_no_token_of_the_cache():
    slots, blocks = SlotAllocator(8), BlockAllocator(32, 4)
    cache = PrefixCache(slots, blocks, checkpoint_interval=8)
    slot, table = slots.allocate(1)[0], blocks.allocate(3)
    tokens = list(range(100, 111))
    assert cache.adopt("r0", tokens[:10], tokens, 10, slot, table)
    hit = cache.lookup(tokens[:10] + [7])
    assert hit is not None and hit.position == 10
    assert len(gc.get_referents(hit.token_ids)) <= 1  # what a collection walks: its type at most, no ints
    assert cache.save("r0").token_ids == tuple(tokens)
