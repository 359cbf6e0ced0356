"""The whole engine on the GPU with the Triton table (marked `gpu`, skipped without CUDA):
bf16 logits against the CPU float32 reference, the isolation harness up to N = 256 with CUDA
graphs (replays counted), lossless speculation through the captured speculative graphs (on a
bf16-state and an FP8-KV pool too), sampled rows drawn inside the graphs' sampled variants, and the
graphs' release."""

import pytest
import torch

from deltaspec.engine import LLM, EngineConfig, SamplingParams
from deltaspec.engine.core import EngineCore

from harness import (SAMPLED_MIX, ScriptedDrafter, assert_all_free, check_isolation, generate, make_jobs, prompts,
                     redecided, run_counted, run_staggered)
from fixtures import GPU_SHAPE

pytestmark = pytest.mark.gpu

TOKENS = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture
def gpu_checkpoint(checkpoint):
    return lambda family, **options: checkpoint(family, **GPU_SHAPE, **options)


def test_bf16_gpu_model_matches_cpu_reference(family, gpu_checkpoint):
    path = gpu_checkpoint(family)
    reference = LLM(path).score(TOKENS)
    gpu = LLM(path, device="cuda", dtype="bfloat16")
    assert gpu.core.ops.name == "triton"
    logits = gpu.score(TOKENS)
    # Random tiny models amplify rounding: HF itself in bf16 is ~5% RMS off its fp32 logits.
    error = (logits - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
    assert error < 0.15, f"rms relative error {error:.3f}"  # MoE routing flips add to bf16 rounding
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("n", [16, 64])
def test_isolation_on_gpu(family, gpu_checkpoint, n):
    """float32 so that the comparison tests isolation, not bf16 rounding of different batch shapes."""
    check_isolation(gpu_checkpoint(family), n, seed=n, device="cuda", dtype="float32", max_num_seqs=n,
                    max_num_batched_tokens=1024, num_draft_tokens=0)


def test_isolation_on_gpu_256(gpu_checkpoint):
    check_isolation(gpu_checkpoint("qwen3_next"), 256, seed=256, device="cuda", dtype="float32", max_num_seqs=256,
                    max_num_batched_tokens=2048, num_draft_tokens=0)


def count_replays(graphs, sampled: bool | None = None) -> list[int]:
    """Counts the replays of every captured graph of a DecodeGraphs or SpecGraphs (so a test
    sees that graphs ran, not only that they were captured); sampled: of that variant only."""
    replays = []
    for key, entry in graphs.graphs.items():
        if sampled is not None and key[-1] != sampled:  # keys (bucket, [K,] sampled)
            continue
        for graph in (entry.graph, getattr(entry, "verify", None)):
            if graph is not None:
                replay = graph.replay
                graph.replay = lambda replay=replay: replays.append(1) or replay()
    return replays


@pytest.mark.parametrize("num_draft_tokens", [0, 3])
def test_cuda_graphs_replay_and_match_eager(gpu_checkpoint, num_draft_tokens):
    """Plain decoding, and speculation (plain and speculative graphs), on graphs and eagerly.
    A speculative engine runs the jobs with its policy pinned to no drafts, then to 3 (the
    adaptive policy's choice follows measured step costs: either graph kind might go unused)."""
    path = gpu_checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    jobs = [j for j in make_jobs(24, seed=5) if j.abort_after is None]
    options = dict(model=path, device="cuda", dtype="float32", max_num_seqs=32, num_draft_tokens=num_draft_tokens)
    graphs = EngineCore(EngineConfig(**options))
    replays = [count_replays(graphs.runner.graphs)]
    if num_draft_tokens:
        replays.append(count_replays(graphs.runner.spec_graphs))
    eager = EngineCore(EngineConfig(**options, enable_cuda_graphs=False))
    for drafts in ([0, num_draft_tokens] if num_draft_tokens else [None]):
        for core in (graphs, eager):
            if drafts is not None:
                core.scheduler.draft_policy = core.scheduler.draft_policy.pin(drafts)
        with_graphs = run_staggered(graphs, jobs)
        without = run_staggered(eager, jobs)
        assert [with_graphs[i].output_token_ids for i in range(len(jobs))] == \
            [without[i].output_token_ids for i in range(len(jobs))], f"drafts {drafts}"
    assert all(len(r) > 10 for r in replays), f"replays of each graph kind: {[len(r) for r in replays]}"


def count_graph_steps(core: EngineCore) -> list[int]:
    """Counts speculative-graph replays of a speculative engine."""
    assert core.runner.spec_graphs is not None
    return count_replays(core.runner.spec_graphs)


@pytest.mark.parametrize("k", [1, 3])
def test_speculation_is_lossless_on_gpu(family, gpu_checkpoint, k):
    path = gpu_checkpoint(family, mtp_copy_of_last_layer=True)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 50, 200)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = LLM(path, device="cuda", dtype="float32", num_draft_tokens=0)
    base = [o.token_ids for o in plain.generate(prompts, params)]
    spec = LLM(path, device="cuda", dtype="float32", num_draft_tokens=k, adaptive_draft_length=False)
    replays = count_graph_steps(spec.core)
    assert [o.token_ids for o in spec.generate(prompts, params)] == base
    assert len(replays) > 10


def test_spec_graphs_are_lossless_for_every_acceptance_count(family, gpu_checkpoint):
    """Through the captured draft/verify graph halves (the draft editor edits the draft half's
    output in place): every acceptance count 0..k occurs, output equals plain greedy decoding and equals
    the eager speculative engine's, and every slot and block is free afterwards."""
    path, k = gpu_checkpoint(family), 3
    batch = prompts(6, seed=7)
    options = dict(device="cuda", dtype="float32")
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0, **options)), batch)
    truth = {str(i): tokens for i, tokens in enumerate(base)}
    outputs = []
    for graphs in (True, False):
        drafter = ScriptedDrafter(truth, seed=3)
        core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False,
                                       enable_cuda_graphs=graphs, **options), edit_drafts=drafter)
        replays = count_graph_steps(core) if graphs else None
        outputs.append(generate(core, batch))
        assert set(drafter.forced) == set(range(k + 1))
        assert replays is None or len(replays) > 10
        assert_all_free(core)
    assert outputs[0] == base and outputs[1] == base


@pytest.mark.parametrize("pool", [dict(mamba_ssm_cache_dtype="bfloat16"), dict(kv_cache_dtype="fp8")],
                         ids=["bf16-state", "fp8-kv"])
def test_lower_precision_pools_are_lossless_through_the_graphs(gpu_checkpoint, pool):
    """A bf16 recurrent state or an e4m3 KV pool, in bf16, CUDA graphs on: every acceptance count
    0..k, output equal to plain greedy decoding on the same pool (the Triton verify and fold round
    the state after each token, as one token a step does; keys and values are rounded once, as
    they are stored)."""
    path, k = gpu_checkpoint("qwen3_5"), 3
    batch = prompts(6, seed=11)
    options = dict(device="cuda", dtype="bfloat16", **pool)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0, **options)), batch)
    drafter = ScriptedDrafter({str(i): tokens for i, tokens in enumerate(base)}, seed=5)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False, **options),
                      edit_drafts=drafter)
    assert core.states.state_dtype == (torch.bfloat16 if "mamba_ssm_cache_dtype" in pool else torch.float32)
    assert core.kv.dtype == (torch.float8_e4m3fn if "kv_cache_dtype" in pool else torch.bfloat16)
    replays = count_graph_steps(core)
    assert generate(core, batch) == base
    assert set(drafter.forced) == set(range(k + 1)) and len(replays) > 10
    assert_all_free(core)


def test_isolation_with_speculation_on_gpu(gpu_checkpoint):
    """The isolation harness (staggered arrivals, aborts, greedy and seeded rows) with MTP
    speculation through the graphs, N = 64."""
    check_isolation(gpu_checkpoint("qwen3_next", mtp_copy_of_last_layer=True), 64, seed=64, device="cuda",
                    dtype="float32", max_num_seqs=32, max_num_batched_tokens=1024, num_draft_tokens=3)


def graph_sets(core: EngineCore) -> list:
    """The engine's decode graphs: plain, and speculative when it speculates."""
    runner = core.runner
    return [graphs for graphs in (runner.graphs, runner.spec_graphs) if graphs is not None]


@pytest.mark.parametrize("k, forced", [(0, False), (3, False), (3, True)])
def test_sampled_graphs_match_eager_and_redecision(gpu_checkpoint, k, forced):
    """Plainly sampled rows drawn inside the sampled graph variants (with k = 3, accepted by
    rejection sampling there; forced: a draft editor forces every acceptance count 0..k,
    through split draft/verify graphs) give the tokens of the same engine without graphs and
    of plain sampling, and the tokens and log-probabilities of the eager redecision (the rows
    made penalized by a zero bias: greedy variants, then the rows decided again). Each decode
    step of the sampled run is one replay (two halves when split), some of the sampled
    variant, with no eager draw and no redecision."""
    path = gpu_checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    batch = prompts(len(SAMPLED_MIX), seed=60 + k)
    options = dict(model=path, device="cuda", dtype="float32", max_num_seqs=8, adaptive_draft_length=False)
    plain = run_counted(EngineCore(EngineConfig(**options, num_draft_tokens=0, enable_cuda_graphs=False)), batch,
                        SAMPLED_MIX)[0]
    truth = {str(i): tokens for i, (tokens, _) in enumerate(plain)}

    def engine(**extra) -> EngineCore:
        drafter = ScriptedDrafter(truth, seed=k) if forced else None
        return EngineCore(EngineConfig(**options, num_draft_tokens=k, **extra), edit_drafts=drafter)

    core = engine()
    replays = [count_replays(graphs) for graphs in graph_sets(core)]
    sampled_replays = [count_replays(graphs, sampled=True) for graphs in graph_sets(core)]
    per_step = []
    launch = core.runner._launch_decode

    def launch_counted(rows):
        before = sum(map(len, replays))
        launched = launch(rows)
        per_step.append(sum(map(len, replays)) - before)
        return launched

    core.runner._launch_decode = launch_counted
    in_graphs, counts = run_counted(core, batch, SAMPLED_MIX)
    assert counts == {"draws": 0, "redecisions": 0}
    # Forced acceptance ends the mix in a few steps of up to k + 1 tokens each (6 on an H100,
    # 7cf1f05): several steps, each one replay or two halves.
    assert len(per_step) >= 4 and set(per_step) <= {1, 2 if forced else 1}
    assert sum(map(len, sampled_replays)) > 0
    eager, eager_counts = run_counted(engine(enable_cuda_graphs=False), batch, SAMPLED_MIX)
    assert eager_counts["draws"] > 0
    old, old_counts = run_counted(engine(), batch, [redecided(p) for p in SAMPLED_MIX])
    assert old_counts["redecisions"] > 0
    tokens = lambda outputs: [t for t, _ in outputs]  # noqa: E731
    assert tokens(in_graphs) == tokens(eager) == tokens(plain)
    assert in_graphs == old


@pytest.mark.parametrize("k", [0, 3])
def test_release_destroys_both_graph_variants(gpu_checkpoint, k):
    """Runner.release_graphs destroys every captured graph, greedy and sampled variants alike
    (and both halves of split graphs); the engine then decodes eagerly, sampled rows included,
    as it did on the graphs."""
    path = gpu_checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    batch = prompts(len(SAMPLED_MIX), seed=70 + k)
    core = EngineCore(EngineConfig(model=path, device="cuda", dtype="float32", max_num_seqs=4, num_draft_tokens=k,
                                   adaptive_draft_length=False))
    before = run_counted(core, batch, SAMPLED_MIX)[0]
    sets = graph_sets(core)
    assert len(sets) == (2 if k else 1)
    captured, reset = [], []
    for graphs in sets:
        assert {key[-1] for key in graphs.graphs} == {False, True}
        for entry in graphs.graphs.values():
            for graph in (entry.graph, getattr(entry, "verify", None)):
                if graph is not None:
                    captured.append(graph)
                    destroy = graph.reset
                    graph.reset = lambda graph=graph, destroy=destroy: reset.append(graph) or destroy()
    core.runner.release_graphs()
    assert len(reset) == len(captured) and {id(g) for g in reset} == {id(g) for g in captured}
    assert all(not graphs.graphs for graphs in sets)
    assert core.runner.graphs is None and core.runner.spec_graphs is None
    after, counts = run_counted(core, batch, SAMPLED_MIX)
    assert counts["draws"] > 0
    assert [t for t, _ in after] == [t for t, _ in before]
    assert_all_free(core)
