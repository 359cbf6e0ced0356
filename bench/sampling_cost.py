"""What sampling as users configure it costs a decode step, through the engine.

A batch of B decode rows (64 by default) on a random-weight checkpoint of the Qwen3.5-0.8B shape
(bf16, with its MTP layer), every row sampled (T = 0.7, top_p = 0.95), in five mixes run side by
side in one engine:

    plain             nothing else
    penalties         presence 1.5 + frequency 0.5 + repetition 1.1 penalties and a logit_bias
    schema            a json_schema (an array of objects: integer, enum, short string, boolean,
                      required fields), too long to complete in the run: every step is masked
    penalties+schema  both on every row (the issue's bar: <= 1.15x a plain step)
    plain_greedy      temperature 0, for reference

each without speculation and with k fixed drafts (a random MTP accepts almost nothing: the
step's cost is what is compared, drafting and verification included; the grammar masks each
verify position). The tokenizer is tests/fixtures.py's byte-level BPE (384 ids: the grammar's
vocabulary; the model's other ids are never allowed). Each mix: prompts prefilled and a warm-up
of decode steps off the clock, then the wall time of each decode step with every row running
(dispatch -> wait -> commit, the overlapped pipeline as served), median. Beside it, where the
engine's thread spends a step (`phases`, medians in ms): `dispatch` (planning the next step),
`decide` (a launched step's constrained rows drawn, `mask_wait` of it waiting for their grammar
masks), `launch` (the step launched ahead, its rows' sampling work included), `result` (waiting
for the step's outputs: device time the host could not hide) and `commit`; inside those, `draw`
(every `Sampler.draw`: redecided rows' masks applied and tokens drawn, mask_wait included),
`sample` (the sampling kernels' launches inside it) and `hand_over` (queuing the outputs' copy).
`allocator` counts what the CUDA caching allocator did over a mix's timed steps (retries and
whole-device frees synchronize the host with the device; new device blocks cost a cudaMalloc).
Writes
bench/results/sampling_cost-<device>.json (device, date, commit, command, every number and each
mix's ratio to plain).

With `--trace N`, N more decode steps of penalties+schema at each k run under torch.profiler
(host and device, Python frames included) after the timed mixes: a Chrome trace per k
(sampling_trace-k<K>.json beside the results, for Perfetto: the engine's thread is the one
that launches the kernels) and, in the results, the host's operators, Python functions and CUDA
runtime calls by self time per step, every thread's together (`trace`: kernel launches,
synchronizing calls, allocations; the mask worker's idle waits show too), to see what the
engine's thread does in `decide`.

    python bench/sampling_cost.py [--batch 64] [--draft-tokens 3] [--steps 48] [--trace 8]
    python bench/sampling_cost.py --device cpu --shape tiny --batch 4 --steps 3   # smoke (numbers mean nothing)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import make_tokenizer  # noqa: E402

import common  # noqa: E402
from common import commit_id, device_tag  # noqa: E402
from deltaspec.engine import EngineConfig, ModelConfig, SamplingParams, Structured  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.runner import InFlight, Runner  # noqa: E402
from deltaspec.engine.sampler import Sampler  # noqa: E402
from deltaspec.engine.tokenizer import Tokenizer  # noqa: E402

COMMON = dict(model_type="qwen3_5_text", vocab_size=248320, head_dim=256, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=65536, rms_norm_eps=1e-6,
              mtp_num_hidden_layers=1)
SHAPES = {
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                 linear_num_key_heads=16, linear_num_value_heads=16, intermediate_size=3584, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
                 linear_value_head_dim=64, intermediate_size=128, tie_word_embeddings=True),
}
SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {"type": "object",
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "kind": {"enum": ["alpha", "beta", "gamma"]},
                             "note": {"type": "string", "maxLength": 6},
                             "ok": {"type": "boolean"}},
              "required": ["id", "kind", "ok"], "additionalProperties": False},
}
PROMPT_LEN, WARM_UP_STEPS = 64, 8
MIXES = ("plain", "penalties", "schema", "penalties+schema", "plain_greedy")


def params(mix: str, seed: int, max_tokens: int, vocab_size: int) -> SamplingParams:
    penalized = "penalties" in mix
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, seed=seed,
        temperature=0.0 if mix == "plain_greedy" else 0.7, top_p=1.0 if mix == "plain_greedy" else 0.95,
        presence_penalty=1.5 if penalized else 0.0, frequency_penalty=0.5 if penalized else 0.0,
        repetition_penalty=1.1 if penalized else 1.0,
        logit_bias={(seed * 7 + j) % vocab_size: (-1.0) ** j * 2.0 for j in range(8)} if penalized else (),
        structured=Structured("json_schema", SCHEMA) if "schema" in mix else None)


class Phases:
    """Wall time of the engine thread's phases of a step (the module docstring), by wrapping
    the methods that run them; `take` returns and clears each phase's seconds."""

    NAMES = ("dispatch", "decide", "mask_wait", "launch", "result", "commit", "draw", "sample", "hand_over")

    def __init__(self, core: EngineCore) -> None:
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self._undo = []
        runner = core.runner
        self._wrap(core, "dispatch", "dispatch")
        self._wrap(core, "commit", "commit")
        self._wrap(runner, "launch", "launch")
        self._wrap(InFlight, "decide", "decide")
        self._wrap(InFlight, "result", "result")
        self._wrap(Future, "result", "mask_wait")
        self._wrap(Sampler, "draw", "draw")
        self._wrap(Runner, "_hand_over", "hand_over")
        sampler = runner.sampler
        self._undo.append((sampler, "ops", sampler.ops))
        sampler.ops = dataclasses.replace(sampler.ops, sample=self._timed(sampler.ops.sample, "sample"))

    def _timed(self, function, phase: str):
        seconds = self.seconds

        @functools.wraps(function)
        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - begin
        return timed

    def _wrap(self, owner, name: str, phase: str) -> None:
        self._undo.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else None))
        setattr(owner, name, self._timed(getattr(owner, name), phase))

    def undo(self) -> None:
        for owner, name, value in reversed(self._undo):
            if value is None:
                delattr(owner, name)  # the instance attribute goes: the class's method shows again
            else:
                setattr(owner, name, value)

    def take(self) -> dict[str, float]:
        taken = dict(self.seconds)  # decide includes mask_wait
        self.seconds.update(dict.fromkeys(self.NAMES, 0.0))
        return taken


def measure(core: EngineCore, mix: str, batch: int, steps: int) -> dict:
    """Median wall time of a decode step with all `batch` rows of `mix` running, and of each of
    the engine thread's phases of it."""
    vocab = core.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch)
    max_tokens = 1 + WARM_UP_STEPS + steps + 4
    requests = [core.add_request(torch.randint(0, vocab, (PROMPT_LEN,), generator=generator).tolist(),
                                 params(mix, i, max_tokens, vocab)) for i in range(batch)]
    while any(not r.output_token_ids for r in requests):  # prefills off the clock
        core.step()
    step_times, phase_times = [], []
    phases = Phases(core)
    allocator_before = _allocator_counts(core.device)
    try:
        while core.has_work:
            phases.take()
            begin = time.perf_counter()
            step = core.dispatch()
            core.commit(step.plan, step.wait())
            if len(step.plan.decode_rows) == batch and not step.plan.prefill_rows:
                step_times.append(time.perf_counter() - begin)
                phase_times.append(phases.take())
    finally:
        phases.undo()
    allocator = {name: count - allocator_before[name] for name, count in _allocator_counts(core.device).items()}
    assert all(r.finish_reason == "length" for r in requests), [r.finish_reason for r in requests]
    timed = step_times[WARM_UP_STEPS:WARM_UP_STEPS + steps]
    timed_phases = phase_times[WARM_UP_STEPS:WARM_UP_STEPS + steps]
    return {"step_ms": statistics.median(timed) * 1e3, "steps_measured": len(timed),
            "tokens_per_step": sum(len(r.output_token_ids) for r in requests) / batch / max(len(step_times), 1),
            "phases": {name: statistics.median(p[name] for p in timed_phases) * 1e3 for name in Phases.NAMES},
            "allocator": allocator}


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def _allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's counters that mean a host stall or a cudaMalloc (none off the GPU)."""
    if device.type != "cuda":
        return dict.fromkeys(ALLOCATOR_COUNTS, 0)
    stats = torch.cuda.memory_stats(device)
    return {name: stats.get(name, 0) for name in ALLOCATOR_COUNTS}


def trace(core: EngineCore, mix: str, batch: int, steps: int, path: Path) -> list[dict]:
    """`steps` decode steps of `mix` with every row running, under torch.profiler (the
    prefills and WARM_UP_STEPS off it); writes the Chrome trace to path and returns the top 25
    host-side entries by self CPU time (microseconds per step, all threads)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = core.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch + 1)
    requests = [core.add_request(torch.randint(0, vocab, (PROMPT_LEN,), generator=generator).tolist(),
                                 params(mix, i, 1 + WARM_UP_STEPS + steps + 4, vocab)) for i in range(batch)]
    while any(len(r.output_token_ids) <= WARM_UP_STEPS for r in requests):
        core.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if core.device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as profiler:
        for _ in range(steps):
            core.step()
    while core.has_work:
        core.step()
    profiler.export_chrome_trace(str(path))
    entries = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    return [{"name": e.key, "calls_per_step": e.count / steps, "self_cpu_us_per_step": e.self_cpu_time_total / steps}
            for e in entries]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default="0.8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=3, help="drafts a speculative step (fixed)")
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per mix")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--trace", type=int, default=0, metavar="STEPS",
                        help="then profile this many penalties+schema steps at each k (0: none)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    model_config = ModelConfig.from_dict({**COMMON, **SHAPES[args.shape]})
    model = common.random_model(model_config, args.device, torch.bfloat16 if cuda else torch.float32)
    directory = make_tokenizer(Path(tempfile.mkdtemp()))
    tokenizer = Tokenizer.from_dir(directory)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"benchmark": "sampling_cost", "device": device_name,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "shape": args.shape,
              "batch": args.batch, "bar": "penalties+schema step_ms <= 1.15x plain", "runs": {}}
    for num_drafts in (0, args.draft_tokens):
        config = EngineConfig(model=directory, device=args.device, dtype="bfloat16" if cuda else "float32",
                              max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch * PROMPT_LEN),
                              max_model_len=1024, num_draft_tokens=num_drafts, adaptive_draft_length=False,
                              enable_prefix_cache=False, gpu_memory_utilization=0.5,
                              warm_up=False)  # decode steps are timed, never the eager prefills
        core = EngineCore(config, model, tokenizer)
        measure(core, "penalties+schema", args.batch, 2)  # compiles the masking and penalty kernels untimed
        run = {mix: measure(core, mix, args.batch, args.steps) for mix in MIXES}
        for mix in MIXES:
            run[mix]["ratio_to_plain"] = run[mix]["step_ms"] / run["plain"]["step_ms"]
        result["runs"][f"k={num_drafts}"] = run
        print(f"k={num_drafts}: " + ", ".join(f"{m} {r['step_ms']:.2f} ms ({r['ratio_to_plain']:.2f}x)"
                                               for m, r in run.items()), flush=True)
        for mix, r in run.items():
            print(f"  {mix} phases (ms): " + ", ".join(f"{n} {v:.2f}" for n, v in r["phases"].items())
                  + f"; allocator {r['allocator']}", flush=True)
        if args.trace:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            run["trace"] = trace(core, "penalties+schema", args.batch, args.trace,
                                 Path(args.out) / f"sampling_trace-k{num_drafts}.json")
            print("  penalties+schema host time per step (us): " + ", ".join(
                f"{e['name']} {e['self_cpu_us_per_step']:.0f}" for e in run["trace"][:12]), flush=True)
        del core
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sampling_cost-{device_tag(device_name) if cuda else 'cpu'}.json"
    path.write_text(json.dumps(result, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
