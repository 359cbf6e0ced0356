"""Tensor and expert parallelism on the CPU (gloo, worker processes): the same greedy tokens as one
device, lossless speculation, the prefix cache; each rank reads only its slices of the
checkpoint; a dead worker ends the engine with an error naming it, and nothing is left running.
The GPU variants (NCCL, CUDA graphs) need two CUDA devices."""

import gc
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from deltaspec.engine import LLM, EngineConfig, ModelConfig, SamplingParams, WeightLoadError
from deltaspec.engine.executor import ParallelRunner, TensorParallelError, WorkerDiedError
from deltaspec.engine.runner import InFlight, Runner
from deltaspec.engine.step import StepOutput, StepPlan
from deltaspec.engine.structured import Structured
from deltaspec.engine.sharding import NotThisRank, Sharding, check_divisible
from deltaspec.engine.tensor_parallel import TensorParallel
from deltaspec.engine.weights import checkpoint_files, load_model, random_model, read_tensors
from deltaspec.kernels import REFERENCE_OPS
from fixtures import GPU_SHAPE
from harness import check_isolation

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Small pools: every rank allocates its own.
POOLS = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, num_checkpoint_slots=8,
             max_model_len=256, checkpoint_interval=64)
# The shared dense engine also moves checkpoints to a host tier (2 checkpoint slots on the device).
DENSE = {**POOLS, "num_checkpoint_slots": 2, "host_cache_bytes": 1 << 24}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (length + 5 * i,), generator=g).tolist() for i in range(n)]


def reference(path, prompt_list, **options) -> list[list[int]]:
    with LLM(path, num_draft_tokens=0, **POOLS, **options) as llm:
        return [o.token_ids for o in llm.generate(prompt_list, GREEDY)]


def no_workers_left(llm: LLM) -> bool:
    return not any(p.is_alive() for p in llm.core.workers.processes)


@pytest.fixture(scope="module")
def dense(checkpoint):
    """A TP=2 engine speculating with the MTP layer (module-wide: each start spawns a process)."""
    llm = LLM(checkpoint("qwen3_5"), tensor_parallel_size=2, num_draft_tokens=2, **DENSE)
    yield llm
    llm.close()


def test_logits_greedy_sampled_constrained_and_cached_equal_one_device(dense, checkpoint):
    path = checkpoint("qwen3_5")
    first = prompts(3, 20, seed=1)
    # The second round repeats a prompt (restored from the prefix cache whole) and extends one
    # past a checkpoint at 64 tokens (restored, then the rest prefilled).
    second = [first[0], first[2] + prompts(1, 50, seed=2)[0]]
    # Then a seeded sampled request (rejection sampling decides alike on every rank) beside a
    # constrained one (rank 0's grammar masks, broadcast).
    third = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0, structured=Structured("regex", "[a-f ]{4,30}"))]
    # Last, a session: a finished request's state saved, then continued.
    with LLM(path, num_draft_tokens=0, **DENSE) as one:
        expected = [o.token_ids for o in one.generate(first + second, GREEDY)]
        expected += [o.token_ids for o in one.generate(first[:2], third)]
        expected += continue_session(one, first[1])
        logits = one.score_batch(first)
    # Logits too (float32; the all-reduce sums partial products in another order).
    for got_logits, want in zip(dense.score_batch(first), logits):
        torch.testing.assert_close(got_logits, want, rtol=1e-4, atol=1e-4)
    got = [o.token_ids for o in dense.generate(first, GREEDY)]
    got += [o.token_ids for o in dense.generate(second, GREEDY)]
    got += [o.token_ids for o in dense.generate(first[:2], third)]
    assert re.fullmatch("[a-f ]+", dense.tokenizer.decode(got[-1]))
    got += continue_session(dense, first[1])
    assert got == expected
    stats = dense.core.stats()
    assert stats["prefix_cache"]["reused_tokens"] > 0 and stats["prefix_cache"]["offloads"] > 0
    assert stats["spec"]["num_verify_steps"] > 0


def test_prompt_logprobs_equal_one_device(dense, checkpoint):
    """The workers score the prompt tokens too (the gathered logits are a collective): the
    tokens each chunk scores reach them, and rank 0 reads the same scores as one device's."""
    prompt = prompts(1, 70, seed=4)[0]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    with LLM(checkpoint("qwen3_5"), num_draft_tokens=0, **DENSE) as one:
        expected = one.generate([prompt], params)[0].prompt_logprobs
    got = dense.generate([prompt], params)[0].prompt_logprobs
    assert len(got) == len(expected) == len(prompt) and got[0] is expected[0] is None
    for ours, theirs in zip(got[1:], expected[1:]):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]


def continue_session(llm: LLM, prompt: list[int]) -> list[list[int]]:
    handle = llm.save_checkpoint(llm.generate([prompt], GREEDY)[0].request_id)
    continued = llm.generate([[7, 8, 9]], GREEDY, resume_from=handle)[0].token_ids
    llm.release_checkpoint(handle)
    return [continued]


def test_killed_worker_ends_the_engine_naming_its_rank(dense):
    """After the other test of the shared engine: it kills its worker. One tensor-parallel
    engine runs per process, so the next tests start theirs after this one's close."""
    core = dense.core
    core.add_request(prompts(1, 10, seed=5)[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    core.step()
    worker = core.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        while True:
            core.step()
    assert time.monotonic() - started < 30
    dense.close()
    assert no_workers_left(dense)


def test_graphs_are_destroyed_before_the_group_is_left(checkpoint, monkeypatch):
    """NCCL cannot leave a group while CUDA graphs that captured its collectives exist (every
    rank hung in the abort on 4 H200s): close destroys rank 0's graphs, then leaves."""
    order = []
    release, leave = Runner.release_graphs, TensorParallel.leave
    monkeypatch.setattr(Runner, "release_graphs", lambda self: (order.append("graphs"), release(self))[1])
    monkeypatch.setattr(TensorParallel, "leave", lambda self: (order.append("leave"), leave(self))[1])
    llm = LLM(checkpoint("qwen3_5"), tensor_parallel_size=2, num_draft_tokens=0, **POOLS)
    assert [len(o.token_ids) for o in llm.generate(prompts(2, 6, seed=3), GREEDY)] == [8, 8]
    llm.close()
    assert order == ["graphs", "leave"]
    assert no_workers_left(llm)
    llm.close()
    assert order == ["graphs", "leave"]


def test_outputs_read_after_a_worker_died_are_not_returned():
    """On GPUs a collective whose peer died hangs until the process group is aborted and then
    leaves garbage in its buffers: a step's outputs read after a worker died raise instead."""
    class Workers:
        def __init__(self):
            self.dead, self.sent = False, []

        def send(self, method, *args):
            self.sent.append(method)

        def check(self, grace=0.0):
            if self.dead:
                raise WorkerDiedError("tensor-parallel worker rank 1 died")

    class Runner:
        fail = False

        def launch(self, plan):
            def read():
                if self.fail:  # a CUDA error after the group was aborted
                    raise RuntimeError("CUDA error")
                return StepOutput([[7]])
            return InFlight(plan, lambda masks: read)

        def run(self, plan):
            return StepOutput([[8]])

    workers = Workers()
    runner = ParallelRunner(Runner(), workers)
    plan = StepPlan((), ())
    assert runner.launch(plan).result().emitted == [[7]] and runner.run(plan).emitted == [[8]]
    launched = runner.launch(plan)
    launched.decide()
    workers.dead = True  # between the launch and the read
    with pytest.raises(WorkerDiedError, match="rank 1"):
        launched.result()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        runner.run(plan)
    runner.runner.fail, workers.dead = True, False
    with pytest.raises(RuntimeError, match="CUDA error"):  # no worker died: the error as it is
        runner.launch(plan).result()
    workers.dead = True
    with pytest.raises(WorkerDiedError, match="rank 1"):  # one did: that explains it
        runner.launch(plan).result()
    assert workers.sent == ["launch", "run", "launch", "run", "launch", "launch"]


@pytest.mark.slow
def test_isolation_harness_with_speculation(checkpoint):
    """Staggered greedy and seeded sampled requests with aborts, each equal to its output alone
    (sampled speculation decides on every rank alike), after the killed engine's group is gone.
    Then a failure on rank 0 alone."""
    core = check_isolation(checkpoint("qwen3_5"), n=4, seed=7, tensor_parallel_size=2, num_draft_tokens=2,
                           max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=128, num_checkpoint_slots=8)
    assert core.scheduler.spec_stats.num_verify_steps > 0
    # A step that fails on rank 0 alone leaves the ranks out of step: the engine stops.
    def fail(plan):
        raise RuntimeError("injected")

    core.runner.runner.run = core.runner.runner.launch = fail
    core.add_request([1, 2, 3], GREEDY)
    with pytest.raises(TensorParallelError, match="rank 0 failed .*injected.*out of step"):
        core.step()
    assert not any(p.is_alive() for p in core.workers.processes)
    with pytest.raises(TensorParallelError, match="workers were stopped"):
        core.step()
    core.close()


def test_reduced_draft_vocabulary_under_tp_equals_one_device(checkpoint, tmp_path):
    """draft_vocab_size at tp 2 through the engine (each rank's share of the ids, the gathered
    argmax in the speculative steps): the same greedy tokens and the same draft statistics as
    one device. The drafts themselves: test_draft_vocabulary_split_over_ranks_drafts_as_one_device."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("qwen3_5"), path)
    batch = prompts(3, 12, seed=8)
    expected = reference(path, batch)
    vocab = sorted({t for row in expected for t in row} | set(range(0, 200, 3)))  # more ids in rank 0's half
    (path / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab}))
    options = dict(num_draft_tokens=3, adaptive_draft_length=False, draft_vocab_size=len(vocab), **POOLS)
    runs = []
    for tp in (1, 2):
        with LLM(path, tensor_parallel_size=tp, **options) as llm:
            runs.append(([o.token_ids for o in llm.generate(batch, GREEDY)], llm.core.stats()["spec"]))
    (one, one_spec), (two, two_spec) = runs
    assert two == one == expected
    assert one_spec["num_verify_steps"] > 0 and two_spec == one_spec


def test_draft_vocabulary_split_over_ranks_drafts_as_one_device():
    """Each rank keeps the draft ids of its vocabulary shard (padded to the most any rank
    holds; here 3 : 1) and the gathered scores, padding at -inf, give one device's drafts.
    The all-gather is played by the test: every rank's scores, in rank order."""
    config = ModelConfig.from_dict(SMALL_122B)
    full = random_model(config, REFERENCE_OPS, torch.float32, "cpu", seed=5)
    generator = torch.Generator().manual_seed(9)
    ids = torch.cat([torch.randperm(256, generator=generator)[:60], 256 + torch.randperm(256, generator=generator)[:20]])
    ids = ids[torch.randperm(len(ids), generator=generator)]
    full.use_draft_vocab(ids)
    hidden = torch.randn(7, config.hidden_size, generator=generator)

    class Gathered(TensorParallel):
        def gather_logits(self, local, out=None):
            return torch.cat([torch.nn.functional.linear(hidden, m.draft_head) for m in ranks], dim=1)

    ranks = []
    for rank in range(2):
        model = random_model(config, REFERENCE_OPS, torch.float32, "cpu", Gathered(rank, 2, torch.device("cpu")))
        model.lm_head.data.copy_(full.lm_head[rank * 256:(rank + 1) * 256])
        model.use_draft_vocab(ids)
        ranks.append(model)
    assert [m.draft_head.shape[0] for m in ranks] == [60, 60]  # rank 1's 20 rows padded
    expected = full.draft_tokens(hidden)
    assert bool(torch.isin(expected, ids).all())
    for model in ranks:
        assert torch.equal(model.draft_tokens(hidden), expected)


@pytest.mark.parametrize("family, expert_parallel", [("qwen3_5_moe", False), ("qwen3_next", True)])
def test_moe_greedy_equals_one_device(checkpoint, family, expert_parallel):
    path = checkpoint(family)
    batch = prompts(3, 12, seed=3)
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, num_draft_tokens=0, **POOLS)
    got = [o.token_ids for o in llm.generate(batch, GREEDY)]
    processes = llm.core.workers.processes
    del llm  # no close: collecting the engine stops its workers
    gc.collect()
    assert not any(p.is_alive() for p in processes)
    assert got == reference(path, batch)


@pytest.mark.slow
def test_four_ranks_with_replicated_kv_heads(checkpoint):
    """tp=4 with 2 KV heads: each KV head on two ranks."""
    path = checkpoint("qwen3_5", linear_num_key_heads=4, linear_num_value_heads=8)
    batch = prompts(2, 10, seed=4)
    with LLM(path, tensor_parallel_size=4, num_draft_tokens=0, **POOLS) as llm:
        got = [o.token_ids for o in llm.generate(batch, GREEDY)]
    assert got == reference(path, batch)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_four_ranks_moe_greedy_and_speculation_equal_one_device(checkpoint, expert_parallel):
    """tp=4 (2 KV heads: each on two ranks), experts split or two whole experts per rank, with
    MTP speculation: the greedy tokens of one device without speculation."""
    path = checkpoint("qwen3_5_moe", linear_num_key_heads=4, linear_num_value_heads=8)
    batch = prompts(3, 12, seed=8)
    with LLM(path, tensor_parallel_size=4, enable_expert_parallel=expert_parallel, num_draft_tokens=2,
             **POOLS) as llm:
        got = [o.token_ids for o in llm.generate(batch, GREEDY)]
        assert llm.core.stats()["spec"]["num_verify_steps"] > 0
    assert no_workers_left(llm)
    assert got == reference(path, batch)


# Configuration and weight loading: no processes ------------------------------------------------

def test_sizes_tp_does_not_divide_are_named(checkpoint):
    config = ModelConfig.from_file(checkpoint("qwen3_5_moe"))
    with pytest.raises(ValueError, match="num_attention_heads=4.*linear_num_key_heads=2.*"
                                         "shared_expert_intermediate_size=40"):
        check_divisible(config, 3, expert_parallel=False)
    with pytest.raises(ValueError, match="num_experts=8"):
        check_divisible(config, 16, expert_parallel=True)
    check_divisible(config, 2, expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel needs tensor_parallel_size > 1"):
        EngineConfig(model="x", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        LLM(checkpoint("qwen3_5"), tensor_parallel_size=3)


def test_ranks_past_the_visible_devices_are_refused_before_any_process_starts(checkpoint):
    """Rank r runs on cuda:(i + r): cuda:7 with tp=2 needs nine visible devices."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 on cuda:7 needs cuda:7\.\.cuda:8; \d+ CUDA devices"):
        LLM(checkpoint("qwen3_5"), device="cuda:7", tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


def rank_tensors(path, rank: int, size: int = 2, expert_parallel: bool = False) -> dict[str, torch.Tensor]:
    sharding = Sharding(ModelConfig.from_file(path), rank, size, expert_parallel)
    return dict(read_tensors(checkpoint_files(path), sharding))


def full_tensors(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.mark.parametrize("family, layout", [("qwen3_5", "per_expert"), ("qwen3_5_moe", "fused")])
def test_rank_slices_concatenate_to_the_tensor(checkpoint, family, layout):
    path = checkpoint(family, **({"moe_layout": layout} if layout == "fused" else {}))
    c = ModelConfig.from_file(path)
    full, ranks = full_tensors(path), [rank_tensors(path, r) for r in range(2)]
    key, value = c.linear_key_dim, c.linear_value_dim
    for name, tensor in full.items():
        parts = [r[name] for r in ranks]
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            # Each rank: its half of q, of k and of v.
            blocks = tensor.split([key, key, value])
            for rank, part in enumerate(parts):
                assert torch.equal(part, torch.cat([b.chunk(2)[rank] for b in blocks]))
        elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")) and tensor.dim() == 2:
            assert torch.equal(torch.cat(parts, dim=1), tensor)
        elif name.endswith("experts.gate_up_proj"):  # [E, gate | up, H]
            gate, up = tensor.chunk(2, dim=1)
            for rank, part in enumerate(parts):
                assert torch.equal(part, torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], dim=1))
        elif name.endswith("experts.down_proj"):
            assert torch.equal(torch.cat(parts, dim=2), tensor)
        elif name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight", "mlp.gate.weight",
                            "shared_expert_gate.weight", "mtp.fc.weight")):
            assert all(torch.equal(p, tensor) for p in parts)
        else:  # heads, widths and the vocabulary by rows
            assert parts[0].shape[0] * 2 == tensor.shape[0], name
            assert torch.equal(torch.cat(parts), tensor), name


def test_expert_parallel_ranks_read_their_experts_only(checkpoint):
    path = checkpoint("qwen3_5_moe")
    ranks = [rank_tensors(path, r, expert_parallel=True) for r in range(2)]
    experts = [{int(n.split(".experts.")[1].split(".")[0]) for n in r if ".experts." in n} for r in ranks]
    assert experts == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    with pytest.raises(NotThisRank):
        sharding = Sharding(ModelConfig.from_file(path), 0, 2, expert_parallel=True)
        sharding.pieces("model.layers.0.mlp.experts.5.up_proj.weight", (24, 72))


def test_fp8_scales_are_sliced_by_block_and_a_cut_block_is_refused(checkpoint):
    path = checkpoint("qwen3_5", fp8=True, fp8_block_size=(16, 16))
    full, ranks = full_tensors(path), [rank_tensors(path, r) for r in range(2)]
    name = "model.layers.0.mlp.gate_proj"
    for leaf in ("weight", "weight_scale_inv"):  # 96 rows: 48 = 3 blocks of 16 per rank
        assert torch.equal(torch.cat([r[f"{name}.{leaf}"] for r in ranks]).float(), full[f"{name}.{leaf}"].float())
    down = "model.layers.0.mlp.down_proj.weight_scale_inv"
    assert torch.equal(torch.cat([r[down] for r in ranks], dim=1), full[down])
    # With 128-blocks rank 1's half of q (rows 16..32) starts inside a block.
    coarse = checkpoint("qwen3_5", fp8=True)
    with pytest.raises(WeightLoadError, match="cuts an FP8 128x128 scale block"):
        load_model(coarse, REFERENCE_OPS, torch.float32, "cpu", tp=TensorParallel(1, 2, torch.device("cpu")))


def test_fp8_fused_activation_quantizer_changes_no_token_under_tp(checkpoint, monkeypatch):
    """tp=2: decode batches' norms quantize their outputs on every rank (the gloo path: rms_norm
    after the all-reduce), and greedy output equals that of ranks whose projections quantize
    their own inputs (DELTASPEC_FUSE_FP8_QUANT=0, inherited by the workers)."""
    path = checkpoint("qwen3_5", fp8=True, fp8_block_size=(16, 16))
    batch = prompts(2, 10, seed=6)
    outputs = []
    for fuse in ("1", "0"):
        monkeypatch.setenv("DELTASPEC_FUSE_FP8_QUANT", fuse)
        with LLM(path, tensor_parallel_size=2, num_draft_tokens=0, **POOLS) as llm:
            outputs.append([o.token_ids for o in llm.generate(batch, GREEDY)])
    assert outputs[0] == outputs[1]


# A scaled-down Qwen3.5-122B-A10B (its head and expert ratios; 2 KV heads, fewer than 4 ranks).
SMALL_122B = dict(model_type="qwen3_5_moe_text", vocab_size=512, hidden_size=48, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, linear_num_key_heads=4,
                  linear_num_value_heads=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  intermediate_size=0, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=16, mtp_num_hidden_layers=1, tie_word_embeddings=False)
# Parameters every rank holds whole: norms, the router, the shared expert's gate, the MTP fc.
REPLICATED = re.compile(r"(norm|norm_weight|norm_embedding|norm_hidden|router\.weight|shared_gate\.weight|fc\.weight)$")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_dummy_weights_draw_only_this_ranks_shard(expert_parallel):
    """load_format "dummy" at tp=4: each rank builds and draws its shard alone (no rank ever
    holds a whole sharded tensor): every parameter is the whole model's with one dimension
    divided by 4, or replicated; the experts of the four ranks add up to the model's."""
    config = ModelConfig.from_dict(SMALL_122B)
    full = {n: p.shape for n, p in random_model(config, REFERENCE_OPS, torch.float32, "cpu").named_parameters()}
    expert_numel = 0
    for rank in range(4):
        tp = TensorParallel(rank, 4, torch.device("cpu"))
        model = random_model(config, REFERENCE_OPS, torch.float32, "cpu", tp, expert_parallel, seed=3)
        for name, p in model.named_parameters():
            whole = full[name]
            assert torch.isfinite(p).all() and p.std() > 0, name
            if REPLICATED.search(name):
                assert p.shape == whole, name
            elif name.endswith("qkv_proj.weight"):  # 8 query heads (with gates) / 4, one of the 2 KV heads
                assert p.shape == (2 * 2 * 16 + 2 * 16, 48), name
            else:
                split = [d for d, (a, b) in enumerate(zip(p.shape, whole)) if a != b]
                assert len(split) == 1 and whole[split[0]] == 4 * p.shape[split[0]], (name, p.shape, whole)
                if name.endswith(("w_gate_up", "w_down")):
                    assert split == ([0] if expert_parallel else [1 if name.endswith("w_gate_up") else 2]), name
                    expert_numel += p.numel()
    assert expert_numel == sum(torch.Size(s).numel() for n, s in full.items() if n.endswith(("w_gate_up", "w_down")))


# GPU: NCCL and CUDA graphs ---------------------------------------------------------------------

def gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA devices")


@pytest.mark.gpu
@gpus(2)
@pytest.mark.parametrize("all_reduce", ["nccl", "auto"])
def test_gpu_killed_worker_ends_the_engine_naming_its_rank(checkpoint, all_reduce):
    """A collective whose peer is gone hangs (inside a graph replay too) until the monitor aborts
    the process group (NCCL) and stands in for the dead peer at the symmetric-memory barriers
    (auto); the engine then raises WorkerDiedError naming the rank, reads no outputs of the
    broken step, closes within seconds without leaving a process, and its process exits.
    The scenario runs in a process of its own (killed_worker.py): what a dead peer leaves on
    rank 0's device ends only with that process."""
    path = checkpoint("qwen3_5", **GPU_SHAPE)
    script = pathlib.Path(__file__).with_name("killed_worker.py")
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(path), all_reduce], capture_output=True, text=True,
                          timeout=240)
    lines = done.stdout.strip().splitlines()
    assert lines, f"no result (exit {done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert result["all_reduce_kind"] == ("one_shot+rms_norm" if all_reduce == "auto" else "nccl")
    assert re.match(r"WorkerDiedError: .*rank 1", result["error"]), result["error"]
    assert result["error_after_s"] < 30
    # What was handed out is the model's output: no tokens of a step whose collectives broke.
    got, expected = result["tokens"], result["expected"]
    assert 0 < len(got) < 400 and got == expected[:len(got)]
    assert result["close_s"] < 15 and result["workers_left"] == 0
    # The process ends by itself: 0, or 1 where the group's abort never returned (Workers ends
    # the process at exit rather than let the C++ teardown abort it).
    assert done.returncode in (0, 1), (done.returncode, done.stderr[-4000:])
    assert time.monotonic() - started < 240


@pytest.mark.gpu
@pytest.mark.parametrize("family, expert_parallel, tp", [
    pytest.param("qwen3_5", False, 2, marks=gpus(2)), pytest.param("qwen3_5_moe", False, 2, marks=gpus(2)),
    pytest.param("qwen3_5_moe", True, 2, marks=gpus(2)),
    pytest.param("qwen3_5", False, 4, marks=gpus(4)), pytest.param("qwen3_5_moe", True, 4, marks=gpus(4))])
def test_gpu_greedy_and_speculation_equal_one_gpu(checkpoint, family, expert_parallel, tp):
    """float32 (token equality across a different reduction order needs it on random tiny
    models); CUDA graphs with the collectives captured in them, on every rank in the same
    order; 4 GDN key heads so that tp=4 divides them (2 KV heads: replicated at tp=4); GDN heads
    of 64 (fixtures.GPU_SHAPE)."""
    path = checkpoint(family, linear_num_key_heads=4, linear_num_value_heads=8, **GPU_SHAPE)
    batch = prompts(8, 24, seed=6)
    options = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512)
    with LLM(path, num_draft_tokens=0, **options) as llm:
        expected = [o.token_ids for o in llm.generate(batch, GREEDY)]
    for k in (0, 3):
        llm = LLM(path, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel, num_draft_tokens=k,
                  **options)
        try:
            assert llm.core.runner.runner.graphs is not None
            assert [o.token_ids for o in llm.generate(batch, GREEDY)] == expected
        finally:
            closing = time.monotonic()
            llm.close()
        # NCCL's abort waited for good (120 s, torch's limit) while graphs that captured its
        # collectives existed (4 H200s, 76de151).
        assert time.monotonic() - closing < 10
        assert no_workers_left(llm)


@pytest.mark.gpu
@gpus(2)
def test_gpu_symmetric_all_reduce_greedy_equals_nccl_and_one_gpu(checkpoint):
    """Decode and speculative steps' all-reduces through symmetric memory (auto: fused with the
    residual add + RMSNorm after them; one_shot and two_shot: torch's kernels, then the norm),
    captured in the CUDA graphs and replayed every step: the same greedy tokens as NCCL's
    all-reduce and as one GPU (float32; at tp = 2 every sum is one addition)."""
    path = checkpoint("qwen3_5", linear_num_key_heads=4, linear_num_value_heads=8, **GPU_SHAPE)
    batch = prompts(8, 24, seed=7)
    options = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512)
    with LLM(path, num_draft_tokens=0, **options) as llm:
        expected = [o.token_ids for o in llm.generate(batch, GREEDY)]
    # Without and with speculation; one_shot and two_shot with it (its graphs hold every kind of step).
    kinds = {"nccl": "nccl", "auto": "one_shot+rms_norm", "one_shot": "one_shot", "two_shot": "two_shot"}
    for k, all_reduce in [(0, "nccl"), (0, "auto"), (3, "nccl"), (3, "auto"), (3, "one_shot"), (3, "two_shot")]:
        with LLM(path, tensor_parallel_size=2, num_draft_tokens=k, all_reduce=all_reduce, **options) as llm:
            assert llm.core.runner.runner.graphs is not None
            assert llm.core.tp.all_reduce_kind == kinds[all_reduce]
            assert [o.token_ids for o in llm.generate(batch, GREEDY)] == expected, (k, all_reduce)
        assert no_workers_left(llm)


def test_images_under_tp_equal_one_device(tmp_path):
    """A vision-language checkpoint at tp 2 (rank 0 encodes, the worker receives the features):
    prompts with images and a video (cut over prefill chunks, with MTP drafts) give one device's
    tokens; a repeated prompt restores its image prefix."""
    import numpy as np
    from PIL import Image
    from fixtures import make_vision_checkpoint
    path = make_vision_checkpoint(tmp_path / "vision", seed=11)
    rng = np.random.default_rng(12)
    image = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    batch = [{"prompt": turn.format(f"see {pad} and {pad}"), "multi_modal_data": {"image": [image(96, 64), image(48, 80)]}},
             {"prompt": turn.format(f"one {pad}"), "multi_modal_data": {"image": [image(64, 64)]}},
             {"prompt": turn.format("a clip <|vision_start|><|video_pad|><|vision_end|>"),
              "multi_modal_data": {"video": (rng.integers(0, 256, (6, 48, 64, 3), dtype=np.uint8), {"fps": 2.0})}},
             turn.format("text only")]
    options = dict(num_draft_tokens=2, **POOLS)
    with LLM(path, **options) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(batch, GREEDY, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, **options) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
        again = llm.generate(batch[1], GREEDY, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == expected[1] and again.num_cached_tokens > 0


@pytest.mark.gpu
@gpus(2)
def test_gpu_images_under_tp_equal_one_gpu(tmp_path):
    """Image prompts at tp 2 on GPUs (rank 0's features broadcast over NCCL, each rank's decode
    graphs reading its slots' RoPE shifts), plain and speculative: one GPU's tokens (float32)."""
    import numpy as np
    from PIL import Image
    from fixtures import make_vision_checkpoint
    path = make_vision_checkpoint(tmp_path / "vision", seed=13, linear_num_key_heads=4, linear_num_value_heads=8,
                                  **GPU_SHAPE)
    rng = np.random.default_rng(14)
    image = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    batch = [{"prompt": turn.format(f"picture {i}: {pad}"), "multi_modal_data": {"image": [image(32 + 32 * i, 64)]}}
             for i in range(3)] + [turn.format("text only")]
    options = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512)
    with LLM(path, num_draft_tokens=0, **options) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(batch, GREEDY, use_tqdm=False)]
    for k in (0, 2):
        with LLM(path, tensor_parallel_size=2, num_draft_tokens=k, **options) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected, k
        assert no_workers_left(llm)
