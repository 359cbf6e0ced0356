"""Helpers shared by several engine test files (tests/engine/test_*.py), one definition each.

The isolation harness (test_engine.py, test_speculation.py, test_prefix_cache.py,
test_async_scheduling.py, test_gpu_engine.py): random jobs with staggered arrivals and aborts,
each request's output in a batch checked against its output alone, and the check that an idle
engine holds no slots, blocks or requests. The speculation helpers (test_speculation.py,
test_gpu_engine.py): prompts, generate, and ScriptedDrafter, a draft editor that forces every
acceptance count. LaunchCounter (test_async_scheduling.py, test_structured.py) counts the steps
launched ahead of the one before them. Sampled steps (test_sampled_steps.py, test_gpu_engine.py):
a mix of greedy and sampled rows, the same rows sent through the eager redecision, and a run
that counts the step's own draws and the redecisions after it. Quantized checkpoints on the GPU
(test_fp8_checkpoints.py, test_wna16_checkpoints.py, test_compressed_fp8.py):
assert_graphs_decode_as_eager."""

import dataclasses
import random
from dataclasses import dataclass

import torch

from deltaspec.engine import EngineConfig, SamplingParams
from deltaspec.engine.core import EngineCore
from fixtures import assert_idle


# The isolation harness -------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    prompt: list[int]
    params: SamplingParams
    arrival_step: int            # submitted before this engine step
    abort_after: int | None      # abort once this many tokens were produced (None: never)


def make_jobs(n: int, seed: int, max_prompt: int = 400, vocab: int = 512) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        length = rng.choice([1, 2, rng.randint(3, 40), rng.randint(41, max_prompt)])
        if rng.random() < 0.5:
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.8, top_p=0.95, top_k=40,
                                    seed=rng.randint(0, 2**31), ignore_eos=True)
        abort_after = rng.randint(0, 3) if n > 2 and rng.random() < 0.15 else None
        jobs.append(Job([rng.randrange(vocab) for _ in range(length)], params, rng.randint(0, 2 * n), abort_after))
    return jobs


def run_alone(core: EngineCore, job: Job) -> list[int]:
    request = core.add_request(job.prompt, job.params)
    while core.has_work:
        core.step()
    return request.output_token_ids


def run_staggered(core: EngineCore, jobs: list[Job]) -> dict[int, object]:
    """Submit job i before step arrival_step[i]; abort jobs after their abort_after-th token."""
    requests, step = {}, 0
    while len(requests) < len(jobs) or core.has_work:
        for i, job in enumerate(jobs):
            if i not in requests and job.arrival_step <= step:
                requests[i] = core.add_request(job.prompt, job.params)
        for i, request in requests.items():
            abort_after = jobs[i].abort_after
            if abort_after is not None and len(request.output_token_ids) >= abort_after and not request.finished:
                core.abort(request.request_id)
        core.step()
        step += 1
    return requests


class LaunchCounter:
    """Counts the steps the runner launched with fed rows (continuations: launched before the
    step they follow was read), those of them that admit requests too (prefill chunks or
    cached rows beside the fed rows), and the fed rows whose token is the first token a prefill
    row of the step before drew."""

    def __init__(self, core: EngineCore) -> None:
        self.fed_steps = self.admitting_fed_steps = self.fed_first_tokens = 0
        launch = core.runner.launch
        before = []

        def counting(plan):
            fed = [row.fed_from for row in plan.decode_rows if row.fed_from is not None]
            self.fed_steps += bool(fed)
            self.admitting_fed_steps += bool(fed) and plan.admits
            if fed and before:
                self.fed_first_tokens += sum(source >= len(before[-1].decode_rows) for source in fed)
            before[:] = [plan]
            return launch(plan)

        core.runner.launch = counting


def assert_all_free(core: EngineCore) -> None:
    assert_idle(core.stats())
    assert not core.requests


def check_isolation(path, n: int, seed: int, **engine_options) -> EngineCore:
    jobs = make_jobs(n, seed)
    core = EngineCore(EngineConfig(model=path, **engine_options))
    alone = [run_alone(core, job) for job in jobs]
    requests = run_staggered(core, jobs)
    for i, job in enumerate(jobs):
        request = requests[i]
        if request.finish_reason == "abort":
            assert request.output_token_ids == alone[i][:len(request.output_token_ids)]
        else:
            assert request.output_token_ids == alone[i], f"request {i} (prompt {len(job.prompt)}) differs"
            assert request.finish_reason == "length"
    assert_all_free(core)
    return core


# Speculation -----------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.choice([1, 7, 64, 150]))] for _ in range(n)]


def generate(core: EngineCore, batch: list[list[int]], params=GREEDY) -> list[list[int]]:
    requests = [core.add_request(p, params) for p in batch]
    while core.has_work:
        core.step()
    return [r.output_token_ids for r in requests]


class ScriptedDrafter:
    """A draft editor (EngineCore(edit_drafts=...)): replaces the MTP's drafts (its KV side effects stay real) with the true
    greedy continuation corrupted at a chosen depth, so acceptance a = 0..k all occur."""

    def __init__(self, truth: dict[str, list[int]], seed: int) -> None:
        self.truth, self.rng = truth, random.Random(seed)
        self.forced: list[int] = []

    def __call__(self, rows, drafts):
        for i, row in enumerate(rows):
            request, k = row.request, row.num_draft_tokens
            if not k:
                continue
            full = request.prompt_token_ids + self.truth[request.request_id]
            newest = request.num_tokens  # drafts predict positions newest .. newest + k - 1
            want = self.rng.randint(0, k)
            scripted = []
            for depth in range(k):
                token = full[newest + depth] if newest + depth < len(full) else 0
                scripted.append(token if depth < want else (token + 1) % 512)
            drafts[i, :k] = torch.tensor(scripted)
            self.forced.append(want)


def check_scripted_speculation(path, prompts: list[list[int]], params: list[SamplingParams], k: int) -> list:
    """Each request's output with k drafts a step, ScriptedDrafter forcing every acceptance
    count, equals its output without speculation (and every slot and block is free after).
    Returns the plain engine's requests."""
    plain = EngineCore(EngineConfig(model=path, num_draft_tokens=0))
    base = [plain.add_request(p, q) for p, q in zip(prompts, params)]
    while plain.has_work:
        plain.step()
    truth = {str(i): r.output_token_ids for i, r in enumerate(base)}
    drafter = ScriptedDrafter(truth, seed=k)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False), edit_drafts=drafter)
    requests = [core.add_request(p, q) for p, q in zip(prompts, params)]
    while core.has_work:
        core.step()
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in base]
    assert set(drafter.forced) == set(range(k + 1))
    assert_all_free(core)
    return base


# Sampled steps ---------------------------------------------------------------------------------

SAMPLED_MIX = [
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
    """SAMPLED_MIX with every sampled row drawn in the step; every one redecided (the path
    before sampled steps: no step draws); half and half (the step draws, then the redecided
    rows are decided again over its result)."""
    sampled = [i for i, p in enumerate(SAMPLED_MIX) if not p.greedy]
    return {"in_step": SAMPLED_MIX,
            "redecided": [redecided(p) if i in sampled else p for i, p in enumerate(SAMPLED_MIX)],
            "both": [redecided(p) if i in sampled[::2] else p for i, p in enumerate(SAMPLED_MIX)]}


def count_calls(owner, name: str, counted) -> list:
    """Counts the calls of owner.name (an instance's method, replaced by a counting wrapper)
    whose positional arguments satisfy `counted`."""
    calls, method = [], getattr(owner, name)

    def counting(*args, **kwargs):
        if counted(*args):
            calls.append(1)
        return method(*args, **kwargs)

    setattr(owner, name, counting)
    return calls


def run_counted(core: EngineCore, batch: list[list[int]], params: list[SamplingParams]) -> tuple[list, dict]:
    """Each request's (tokens, log-probabilities), and how many eager calls of the step's draw
    (DecodeStep.draw; a graph replay makes none) and how many redecisions after a step
    (plain: Runner._decide_plain, speculative: Speculator.decide, of some rows) the run made."""
    runner = core.runner
    draws = count_calls(runner.decode, "draw", lambda *args: True)
    redecisions = [count_calls(runner, "_decide_plain", lambda tokens, redecision, *rest: redecision is not None)]
    if runner.speculator is not None:
        redecisions.append(count_calls(runner.speculator, "decide", lambda resampling, *rest: resampling is not None))
    requests = [core.add_request(p, q) for p, q in zip(batch, params)]
    while core.has_work:
        core.step()
    outputs = [(r.output_token_ids, r.output_logprobs) for r in requests]
    return outputs, {"draws": len(draws), "redecisions": sum(map(len, redecisions))}


# Quantized checkpoints on the GPU ---------------------------------------------------------------

def assert_graphs_decode_as_eager(path, **options) -> tuple[list[list[int]], list[list[int]], SamplingParams]:
    """Greedy decoding of prompts of 3, 50 and 200 tokens through the decode graphs, and greedy
    speculation (2 drafts) through the speculative graphs, equal eager decoding (float32
    activations on CUDA, so that the comparison is not about bf16 rounding of different batch
    shapes): the kernels are graph-safe. Returns (prompts, eager tokens, params) for more checks."""
    from deltaspec.engine import LLM
    batch = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 50, 200)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", **options)
    eager = LLM(path, **options, num_draft_tokens=0, enable_cuda_graphs=False)
    graphs = LLM(path, **options, num_draft_tokens=0)
    spec = LLM(path, **options, num_draft_tokens=2, adaptive_draft_length=False)
    assert graphs.core.runner.graphs is not None and spec.core.runner.spec_graphs is not None
    expected = [o.token_ids for o in eager.generate(batch, params)]
    assert [o.token_ids for o in graphs.generate(batch, params)] == expected
    assert [o.token_ids for o in spec.generate(batch, params)] == expected
    assert spec.core.stats()["spec"]["num_verify_steps"] > 0
    return batch, expected, params
