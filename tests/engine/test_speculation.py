"""MTP speculative decoding: lossless greedy output for every acceptance count (on bf16-state and
FP8-KV pools too), isolation with speculation on, rollback as a counter (the pool after partial
acceptance), adaptive length in the engine. The spec package's pure math (acceptance, the draft
policy) is tested in tests/spec/."""

import pytest
import torch
import torch.nn.functional as F

from deltaspec.engine import EngineConfig, ModelConfig, SamplingParams
from deltaspec.engine.core import EngineCore
from deltaspec.engine.scheduler import Scheduler
from deltaspec.engine.speculation import HostDrafts
from deltaspec.engine.state_pool import StatePool
from deltaspec.kernels.gdn import expand_heads, l2norm, recurrent_steps
from deltaspec.spec import DraftPolicy

from harness import ScriptedDrafter, assert_all_free, check_isolation, generate, make_jobs, prompts, run_staggered


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_is_lossless_for_every_acceptance_count(family, checkpoint, k):
    path = checkpoint(family)
    batch = prompts(5, seed=k)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch)
    truth = {str(i): tokens for i, tokens in enumerate(base)}
    drafter = ScriptedDrafter(truth, seed=k)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False), edit_drafts=drafter)
    assert generate(core, batch) == base
    assert set(drafter.forced) == set(range(k + 1))          # every acceptance count happened
    stats = core.stats()["spec"]
    assert stats["mean_accepted_length"] > 1.2
    assert_all_free(core)


# Lower-precision pools: (EngineConfig options, the pool tensor they change, its dtype then).
LOW_PRECISION_POOLS = {
    "bf16-state": (dict(mamba_ssm_cache_dtype="bfloat16"), lambda core: core.states.layers[0].recurrent,
                   torch.bfloat16),
    "fp8-kv": (dict(kv_cache_dtype="fp8"), lambda core: core.kv.layers[0].k_cache, torch.float8_e4m3fn),
}


@pytest.mark.parametrize("pool", sorted(LOW_PRECISION_POOLS))
def test_greedy_is_lossless_on_lower_precision_pools(checkpoint, pool):
    """mamba_ssm_cache_dtype="bfloat16" (the recurrent state in bf16) and kv_cache_dtype="fp8"
    (keys and values in e4m3): the pool holds that dtype in fewer bytes, the logits stay within
    its rounding of the full-precision pool's, and speculation with every acceptance count still
    gives plain decoding's tokens on the same pool (a verify row rounds the state after each token
    as one token a step does; keys and values are rounded once, as they are stored)."""
    options, tensor, dtype = LOW_PRECISION_POOLS[pool]
    path, k = checkpoint("qwen3_5"), 3
    batch = prompts(5, seed=7)
    full = EngineCore(EngineConfig(model=path, num_draft_tokens=0))
    plain = EngineCore(EngineConfig(model=path, num_draft_tokens=0, **options))
    assert tensor(full).dtype == torch.float32 and tensor(plain).dtype == dtype
    assert plain.states.bytes_per_slot + plain.kv.block_bytes < full.states.bytes_per_slot + full.kv.block_bytes
    # The emitted tokens' log-probabilities move by the rounding (while both pools choose the
    # same tokens).
    scored = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    exact, rounded = (core.add_request(batch[0], scored) for core in (full, plain))
    for core in (full, plain):
        while core.has_work:
            core.step()
    same = next((i for i, (a, b) in enumerate(zip(exact.output_token_ids, rounded.output_token_ids)) if a != b), 12)
    moved = [abs(a.logprob - b.logprob) for a, b in zip(exact.output_logprobs[:same], rounded.output_logprobs[:same])]
    assert same >= 4 and 0 < max(moved) < 0.1, moved
    base = generate(plain, batch)
    drafter = ScriptedDrafter({str(i): tokens for i, tokens in enumerate(base)}, seed=k)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False, **options),
                      edit_drafts=drafter)
    assert generate(core, batch) == base
    assert set(drafter.forced) == set(range(k + 1))
    assert_all_free(core)


def test_pool_dtypes_this_engine_does_not_keep_are_refused(checkpoint):
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of auto, float32, bfloat16"):
        EngineConfig(model=checkpoint("qwen3_5"), mamba_ssm_cache_dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(model=checkpoint("qwen3_5"), kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_the_real_mtp_drafter_is_lossless(family, checkpoint, k):
    path = checkpoint(family, mtp_copy_of_last_layer=True)
    batch = prompts(4, seed=10 + k)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False))
    assert generate(core, batch) == base
    assert core.stats()["spec"]["num_verify_steps"] > 0


@pytest.mark.parametrize("n", [3, pytest.param(16, marks=pytest.mark.slow), pytest.param(64, marks=pytest.mark.slow)])
def test_isolation_with_speculation(checkpoint, n):
    """Every surviving request's output with speculation on, in a staggered batch with aborts,
    equals its output alone — and for greedy requests equals the output without speculation."""
    path = checkpoint("qwen3_next", mtp_copy_of_last_layer=True)
    core = check_isolation(path, n, seed=100 + n, num_draft_tokens=3, max_num_seqs=16, max_num_batched_tokens=256)
    jobs = [j for j in make_jobs(n, 100 + n) if j.params.greedy and j.abort_after is None]
    plain = EngineCore(EngineConfig(model=path, max_num_seqs=16, max_num_batched_tokens=256, num_draft_tokens=0))
    spec = run_staggered(core, jobs)
    base = run_staggered(plain, jobs)
    assert [spec[i].output_token_ids for i in range(len(jobs))] == [base[i].output_token_ids for i in range(len(jobs))]


def test_rollback_is_a_counter(checkpoint):
    """After a verify step with partial acceptance, the slot's pending count is the number of
    accepted drafts, and its committed state with the pending drafts folded in (their k, v
    recomputed from the window and the kept raw conv inputs, as the decode kernels do) equals the
    state of a sequence that only ever saw the accepted tokens."""
    path = checkpoint("qwen3_5")
    prompt = prompts(1, seed=3)[0] + [1, 2, 3]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), [prompt], params)
    drafter = ScriptedDrafter({"0": base[0]}, seed=5)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=4, adaptive_draft_length=False), edit_drafts=drafter)
    request = core.add_request(prompt, params)
    while True:  # step until a verify accepted some but not all drafts; inspect before the next folds it
        seen = len(drafter.forced)
        core.step()
        if len(drafter.forced) > seen and 0 < drafter.forced[-1] < 4:
            break
    pending = int(core.states.pending_counts[request.slot])
    assert pending == drafter.forced[-1]
    fed = request.num_computed_tokens
    # Truth: a fresh engine prefills exactly the accepted tokens.
    fresh = EngineCore(EngineConfig(model=path, num_draft_tokens=0))
    fresh.add_request(request.token_ids(0, fed), SamplingParams(max_tokens=1, temperature=0))
    plan = fresh.schedule()
    truth_slot = plan.prefill_rows[0].slot
    fresh.commit(plan, fresh.run(plan))
    c = core.model_config
    for layer, ours, reference in zip(c.gdn_layer_ids, core.states.layers, fresh.states.layers):
        slot, heads = request.slot, ours.recurrent.shape[1]
        sequence = torch.cat([ours.conv[slot], ours.pending_conv[slot, :pending]]).float()   # [W-1+p, C]
        weight = core.model.layers[layer].mixer.conv_weight.float()                          # [C, W]
        conv = F.silu(F.conv1d(sequence.T[None], weight[:, None], groups=weight.shape[0])[0].T)  # [p, C]
        k = conv[:, c.linear_key_dim:2 * c.linear_key_dim].unflatten(-1, (c.linear_num_key_heads, -1))
        v = conv[:, 2 * c.linear_key_dim:].unflatten(-1, (heads, -1))
        folded, _ = recurrent_steps(ours.recurrent[slot:slot + 1].float(), None, expand_heads(l2norm(k), heads)[None],
                                    v[None], ours.pending_g[slot:slot + 1, :pending, :, 0],
                                    ours.pending_beta[slot:slot + 1, :pending, :, 0])
        expected = reference.recurrent[truth_slot].float()
        assert torch.allclose(folded[0], expected, rtol=1e-4, atol=1e-5), f"layer {layer}"
        window = sequence[-ours.conv.shape[1]:]
        assert torch.allclose(window, reference.conv[truth_slot].float(), rtol=1e-4, atol=1e-5), \
            f"conv window, layer {layer}"


REAL_SHAPES = {
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                 linear_num_key_heads=16, linear_num_value_heads=16, intermediate_size=3584),
    "9b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
               linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=12288),
}


@pytest.mark.parametrize("shape", sorted(REAL_SHAPES))
def test_memory_does_not_grow_with_k(shape):
    """Bytes of recurrent state per sequence with k = 4 are <= 1.05x those with k = 0 (which keeps
    no pending buffers at all); the pool reports the k = 0 figure itself."""
    config = ModelConfig.from_dict({"model_type": "qwen3_5_text", "vocab_size": 248320, "head_dim": 256,
                                    "linear_key_head_dim": 128, "linear_value_head_dim": 128, **REAL_SHAPES[shape]})
    without = StatePool(config, 2, 0, torch.bfloat16, "meta")
    with_k4 = StatePool(config, 2, 4, torch.bfloat16, "meta", keep_mtp_hidden=True)
    assert without.bytes_per_slot == without.bytes_per_slot_without_speculation
    assert with_k4.bytes_per_slot_without_speculation == without.bytes_per_slot
    assert with_k4.bytes_per_slot / without.bytes_per_slot <= 1.05


class FrequentTokenDrafter:
    """A draft editor: drafts, at every output index, the token plain sampling emits most often
    there: drafts that the target often accepts (probability p(d)) and often rejects."""

    def __init__(self, favourites: list[int]) -> None:
        self.favourites = favourites

    def __call__(self, rows, drafts):
        for i, row in enumerate(rows):
            generated = len(row.request.output_token_ids)
            for depth in range(row.num_draft_tokens):
                drafts[i, depth] = self.favourites[min(generated + depth, len(self.favourites) - 1)]


@pytest.mark.slow
def test_sampling_with_speculation_keeps_the_distribution(checkpoint):
    """Outputs with speculation (rejection sampling) follow the same distribution as without:
    two-sample chi-square on the second and third generated tokens (temperature 1, top-k 3)."""
    path = checkpoint("qwen3_5")
    prompt = [7, 8, 9, 10]
    runs = 1500

    def sample_all(core: EngineCore, seed_base: int) -> list[list[int]]:
        requests = [core.add_request(prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=3,
                                                            seed=seed_base + i, ignore_eos=True)) for i in range(runs)]
        while core.has_work:
            core.step()
        return [r.output_token_ids for r in requests]

    plain = sample_all(EngineCore(EngineConfig(model=path, max_num_seqs=64, max_num_batched_tokens=512,
                                               num_draft_tokens=0)), 0)
    favourites = [max(set(col), key=col.count) for col in zip(*plain)]
    core = EngineCore(EngineConfig(model=path, max_num_seqs=64, max_num_batched_tokens=512, num_draft_tokens=2,
                                   adaptive_draft_length=False), edit_drafts=FrequentTokenDrafter(favourites))
    spec = sample_all(core, 10**6)
    stats = core.stats()["spec"]
    assert 0.1 < stats["acceptance_by_position"][0] < 0.9  # both branches of the test ran
    for index in (1, 2):
        a = [tokens[index] for tokens in plain]
        b = [tokens[index] for tokens in spec]
        categories = sorted(set(a) | set(b))
        statistic, dof = 0.0, len(categories) - 1
        for c in categories:
            ca, cb = a.count(c), b.count(c)
            statistic += (ca - cb) ** 2 / (ca + cb)
        # chi-square critical value at p = 0.001 (Wilson-Hilferty; z = 3.09), e.g. 26.1 at 8 dof
        critical = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
        assert statistic < critical, f"token {index}: chi2 {statistic:.1f} over {dof} dof"


@pytest.mark.parametrize("k", [1, 2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_seeded_sampling_with_speculation_equals_plain_sampling(checkpoint, k):
    """Rejection sampling coupled with plain sampling (spec/accept.py) emits exactly the tokens
    plain sampling emits with the same seeds, whatever the drafts: forced to the frequent
    tokens (every acceptance count happens) and from the real MTP layer with the adaptive K."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    batch = prompts(6, seed=30 + k)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, ignore_eos=True)
              for i in range(len(batch))]

    def run(core: EngineCore) -> list[list[int]]:
        requests = [core.add_request(p, q) for p, q in zip(batch, params)]
        while core.has_work:
            core.step()
        return [r.output_token_ids for r in requests]

    plain = run(EngineCore(EngineConfig(model=path, num_draft_tokens=0)))
    favourites = [max(set(col), key=col.count) for col in zip(*plain)]
    forced = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False),
                        edit_drafts=FrequentTokenDrafter(favourites))
    assert run(forced) == plain
    assert 0 < forced.stats()["spec"]["acceptance_by_position"][0] < 1
    assert run(EngineCore(EngineConfig(model=path, num_draft_tokens=k))) == plain


def test_decode_rows_draft_in_a_step_that_prefills(checkpoint):
    """A step that prefills runs its decode rows through the decode stages, drafting as in any
    step (runner.py): a request arriving mid-decode shares a step with the others' drafts, and
    every output equals plain decoding."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    batch = prompts(3, seed=41)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for k in (0, 2):
        core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False))
        running = [core.add_request(batch[0], params), core.add_request(batch[1], params)]
        for _ in range(3):
            core.step()
        running.append(core.add_request(batch[2], params))
        prefilled = []
        while core.has_work:
            step = core.dispatch()
            if step.plan.prefill_rows:
                prefilled.append(step.plan)
            core.commit(step.plan, step.wait())
        assert [bool(plan.decode_rows) for plan in prefilled] == [True]
        assert all(r.num_draft_tokens == k for r in prefilled[0].decode_rows)
        outputs[k] = [r.output_token_ids for r in running]
        assert_all_free(core)
    assert outputs[2] == outputs[0]


def test_draft_policy_can_change_between_steps(checkpoint):
    """Benchmarks compare settings on one engine: a policy of fewer drafts than the pools are
    sized for takes over between steps (greedy output unchanged); one of more is refused."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    batch = prompts(3, seed=40)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=4))
    costs = core.scheduler.draft_policy.costs
    for k in (1, 2):
        core.scheduler.draft_policy = DraftPolicy(k, costs, adaptive=False)
        assert generate(core, batch) == base
    with pytest.raises(ValueError, match="sized for 4"):
        Scheduler(core.scheduler.config, core.slots, core.blocks, core.cache, DraftPolicy(5, costs))


def test_seeded_sampling_with_speculation_is_reproducible(checkpoint):
    path = checkpoint("qwen3_next", mtp_copy_of_last_layer=True)
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    outputs = []
    for _ in range(2):
        core = EngineCore(EngineConfig(model=path, num_draft_tokens=3))
        outputs.append(generate(core, [[1, 2, 3], [4, 5, 6, 7, 8]], params))
    assert outputs[0] == outputs[1]


def test_reduced_draft_vocabulary_is_lossless(checkpoint, tmp_path):
    """With draft_vocab_size set, drafts come only from the listed ids (the MTP head reads
    those lm_head rows only); greedy output is unchanged."""
    import json
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("qwen3_5", mtp_copy_of_last_layer=True), path)
    vocab = list(range(0, 512, 3))
    (path / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab}))
    batch = prompts(3, seed=21)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch)
    proposed = []

    def recording(rows, drafts):
        proposed.extend(drafts[i, :r.num_draft_tokens].tolist() for i, r in enumerate(rows))

    core = EngineCore(EngineConfig(model=path, num_draft_tokens=3, adaptive_draft_length=False,
                                   draft_vocab_size=len(vocab)), edit_drafts=recording)
    assert generate(core, batch) == base
    assert proposed and all(t in set(vocab) for row in proposed for t in row)
    with pytest.raises(ValueError, match="lists 171 tokens"):
        EngineCore(EngineConfig(model=path, num_draft_tokens=2, draft_vocab_size=200))


def test_final_outputs_carry_per_request_acceptance(checkpoint):
    """Each request's own counters reach its final output (sync and streamed); none without
    speculation. The engine-wide counters are the sum of the requests'."""
    from deltaspec.engine import LLM

    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    spec = LLM(path, num_draft_tokens=2, adaptive_draft_length=False)
    outputs = spec.generate(prompts(3, seed=4), params)
    counters = [o.spec_stats for o in outputs]
    assert all(c is not None and c["num_verify_steps"] > 0 for c in counters)
    assert all(1.0 <= c["mean_accepted_length"] <= 3.0 for c in counters)
    total = spec.core.stats()["spec"]
    assert sum(c["num_verify_steps"] for c in counters) == total["num_verify_steps"]
    assert [sum(c["accepted_by_position"][d] for c in counters) for d in range(2)] == total["accepted_by_position"]
    assert all(o.spec_stats is None for o in LLM(path, num_draft_tokens=0).generate(prompts(2, seed=4), params))


def host_drafts_match(host: HostDrafts, make_drafts, num_rows: int, num_drafts: int, device: str) -> None:
    """Each step's drafts, copied by `make_drafts` from a fresh random source, are what the
    host reads for a random subset of rows, in its order."""
    generator = torch.Generator().manual_seed(num_rows)
    for _ in range(3):
        values = torch.randint(0, 1 << 40, (num_rows, num_drafts), generator=generator)
        make_drafts(values.to(device))
        chosen = torch.randperm(num_rows, generator=generator)[:num_rows // 2 + 1].tolist()
        assert host.reader(chosen, num_drafts)() == [values[i].tolist() for i in chosen]


def test_host_drafts_reads_the_chosen_rows():
    host = HostDrafts(8, 3, torch.device("cpu"))
    for num_rows, num_drafts in ((8, 3), (5, 2), (1, 1)):
        host_drafts_match(host, host.copy, num_rows, num_drafts, "cpu")


@pytest.mark.gpu
def test_host_drafts_are_read_before_a_captured_graph_ends():
    """HostDrafts inside a CUDA graph, as SpecGraphs captures a step: the host reads each replay's
    drafts once the draft stage has run, while the long "verify" after it is still running (the
    external event is a node mid-graph, not the graph's end), and the copy is not stale."""
    device = torch.device("cuda")
    num_rows, num_drafts = 16, 3
    host = HostDrafts(num_rows, num_drafts, device)
    source = torch.zeros(num_rows, num_drafts, dtype=torch.int64, device=device)
    weights = torch.randn(2048, 2048, device=device)
    product = torch.empty_like(weights)

    def step() -> None:
        drafts = source + 1  # the draft stage
        host.copy(drafts)
        for _ in range(40):  # the verify: over ten milliseconds
            torch.mm(weights, weights, out=product)
        host.join()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay(values: torch.Tensor) -> None:
        source.copy_(values - 1)
        graph.replay()

    host_drafts_match(host, replay, num_rows, num_drafts, "cuda")
    replay(torch.ones(num_rows, num_drafts, dtype=torch.int64, device=device))
    host.reader([0], num_drafts)()
    assert not torch.cuda.current_stream().query()  # read while the verify runs
    torch.cuda.synchronize()
