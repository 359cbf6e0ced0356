"""Host time per engine step: `EngineCore.dispatch()` (the scheduling) and `EngineCore.commit()`
in steady-state decode, on the CPU, without the model. Writes bench/results/host_overhead-cpu.json.

    python bench/host_overhead.py [--batches 16,64,256] [--drafts 0,3] [--label after] [--profile 64]
                                  [--no-async-scheduling]

This is the CPU half of an engine step that `engine_throughput.py` times on the GPU
(`cpu_schedule_commit_ms`, issue #5: at most 15% of the GPU step at batch 64). The setting is
the same: `batch` greedy requests with 128-token random prompts, ignore_eos, a model with
Qwen3.5's vocabulary (248320) and the test tokenizer (tests/fixtures.make_tokenizer), prefix
cache off. The runner is replaced by a fake that returns a `StepOutput` at once, so only the
engine's own host work is timed:
  - each request emits the tokens of the test corpus (fixtures.CORPUS: English, code and
    multi-byte characters), from its own offset: text a tokenizer knows, as a real model's
    output is, so each token costs a real detokenizer step;
  - with drafts (k > 0, MTP speculation with adaptive draft length), each drafted position is
    accepted with probability ACCEPTANCE, in order (what a greedy verify does), and the accepted
    drafts are left pending as the speculative runner reports them.
The fake draws acceptance from one seeded generator, so every version of the engine sees the
same steps.

Each time is the median over the timed steps of the wall clock (`*_ms`) and of this process's
CPU time (`*_cpu_ms`); the CPU time is what other processes on a shared machine disturb least.
A run is recorded under --label ("before", "after", ...) in the JSON, beside the other labels,
with its commit; `speedup` compares the first two labels when both are present.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import CORPUS, make_checkpoint  # noqa: E402

from common import commit_id  # noqa: E402
from deltaspec.engine import EngineConfig, SamplingParams  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.runner import InFlight  # noqa: E402
from deltaspec.engine.step import ScheduledRow, StepOutput, StepPlan  # noqa: E402

VOCAB_SIZE = 248320
PROMPT_LEN = 128
WARMUP_STEPS = 8
ADMISSION_STEPS = 16  # at most, until all prompts are prefilled (256 x 128 tokens at 8192 per step)
ACCEPTANCE = 0.7  # per drafted position, as the adaptive policy's initial estimate


class FakeRunner:
    """Stands in for the engine's Runner: the StepOutput it would return for a plan, with
    corpus tokens and seeded acceptance instead of a forward (a launched step is done at once)."""

    def __init__(self, text_ids: list[int], speculative: bool, seed: int) -> None:
        self.text_ids, self.speculative = text_ids, speculative
        self.random = random.Random(seed)

    def launch(self, plan: StepPlan) -> InFlight:
        output = self.run(plan)
        return InFlight(plan, lambda masks: lambda: output)

    def run(self, plan: StepPlan) -> StepOutput:
        emitted, num_pending = [], []
        for row in plan.decode_rows:
            accepted = 0
            while accepted < row.num_draft_tokens and self.random.random() < ACCEPTANCE:
                accepted += 1
            emitted.append(self._tokens(row, accepted + 1))
            num_pending.append(accepted)
        for row in plan.prefill_rows + plan.cached_rows:
            emitted.append(self._tokens(row, 1) if row.sample else [])
            num_pending.append(0)
        return StepOutput(emitted, num_pending=num_pending if self.speculative else None)

    def _tokens(self, row: ScheduledRow, n: int) -> list[int]:
        """The request's next n output tokens: the corpus from an offset of its own."""
        start = 37 * row.request.arrival + len(row.request.output_token_ids)
        return [self.text_ids[(start + i) % len(self.text_ids)] for i in range(n)]


def build_core(checkpoint: Path, num_draft_tokens: int, max_num_seqs: int, async_scheduling: bool) -> EngineCore:
    config = EngineConfig(model=checkpoint, device="cpu", max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(8192, max_num_seqs), max_model_len=8192,
                          num_draft_tokens=num_draft_tokens, enable_prefix_cache=False,
                          async_scheduling=async_scheduling)
    return EngineCore(config)


def measure(core: EngineCore, batch: int, steps: int, seed: int,
            profiler: cProfile.Profile | None = None) -> dict:
    """Median host ms of dispatch() (scheduling: `schedule`, or `continuation` with async
    scheduling) and commit() over `steps` decode steps of `batch` requests."""
    speculative = bool(core.num_draft_tokens)
    core.runner = FakeRunner(core.tokenizer.encode("".join(CORPUS)), speculative, seed)
    generator = random.Random(seed)
    # Room for the steps while prompts are admitted and every timed step to emit k + 1 tokens:
    # nobody finishes while being timed.
    params = SamplingParams(max_tokens=(ADMISSION_STEPS + WARMUP_STEPS + steps) * (core.num_draft_tokens + 1),
                            temperature=0.0, ignore_eos=True)
    requests = [core.add_request([generator.randrange(VOCAB_SIZE) for _ in range(PROMPT_LEN)], params)
                for _ in range(batch)]
    times: dict[str, list[float]] = {"schedule": [], "commit": [], "schedule_cpu": [], "commit_cpu": []}
    num_tokens = []
    while len(num_tokens) < WARMUP_STEPS + steps:
        begin, begin_cpu = time.perf_counter(), time.process_time()
        step = core.dispatch()
        scheduled, scheduled_cpu = time.perf_counter(), time.process_time()
        plan, result = step.plan, step.wait()
        ran, ran_cpu = time.perf_counter(), time.process_time()
        core.commit(plan, result)
        committed, committed_cpu = time.perf_counter(), time.process_time()
        if any(request.finished for request in requests):
            raise RuntimeError("a request finished before the timed steps did: raise its max_tokens")
        if len(plan.decode_rows) == batch and not plan.prefill_rows:
            times["schedule"].append(scheduled - begin)
            times["commit"].append(committed - ran)
            times["schedule_cpu"].append(scheduled_cpu - begin_cpu)
            times["commit_cpu"].append(committed_cpu - ran_cpu)
            num_tokens.append(sum(len(tokens) for tokens in result.output.emitted))
            if profiler is not None and len(num_tokens) == WARMUP_STEPS:
                profiler.enable()
    if profiler is not None:
        profiler.disable()
    for request in requests:
        core.abort(request.request_id)
    while core.has_work:
        core.step()
    result = {"batch": batch, "num_draft_tokens": core.num_draft_tokens}
    for name, measured in times.items():
        result[f"{name}_ms"] = statistics.median(measured[WARMUP_STEPS:]) * 1e3
    result["host_ms"] = result["schedule_ms"] + result["commit_ms"]
    result["host_cpu_ms"] = result["schedule_cpu_ms"] + result["commit_cpu_ms"]
    return {**result, "tokens_per_step": statistics.mean(num_tokens[WARMUP_STEPS:]), "steps_measured": steps}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--drafts", default="0,3", help="num_draft_tokens settings (0: no speculation)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per setting")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per setting; the one with the least median CPU time is kept")
    parser.add_argument("--label", default="after")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="every step from `schedule` (default: steady decoding from `continuation`)")
    parser.add_argument("--profile", type=int, default=0, metavar="BATCH",
                        help="print a cProfile of the timed steps at this batch size instead of recording")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_overhead-cpu.json"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    checkpoint = make_checkpoint(Path(tempfile.mkdtemp()), "qwen3_5", with_mtp=True, vocab_size=VOCAB_SIZE)
    results = []
    for num_draft_tokens in [int(k) for k in args.drafts.split(",")]:
        core = build_core(checkpoint, num_draft_tokens, max(batches), not args.no_async_scheduling)
        if args.profile:
            profiler = cProfile.Profile()
            measure(core, args.profile, args.steps, seed=args.profile, profiler=profiler)
            print(f"--- k={num_draft_tokens}, batch {args.profile}: {args.steps} steps (schedule + commit)")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            continue
        for batch in batches:
            # The same seed in every repeat: each repeat times the same steps.
            runs = [measure(core, batch, args.steps, seed=batch) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["host_cpu_ms"])
            results.append(best)
            print(json.dumps(best))
    if args.profile:
        return

    out = Path(args.out)
    recorded = json.loads(out.read_text()) if out.exists() else {"benchmark": "host_overhead", "runs": {}}
    recorded["runs"][args.label] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
        "cpu": cpu_name(), "python": platform.python_version(),
        "results": results}
    labels = list(recorded["runs"])
    if len(labels) >= 2:
        base, new = (recorded["runs"][label]["results"] for label in labels[:2])
        recorded["speedup"] = {
            f"batch {b['batch']}, k={b['num_draft_tokens']}": {
                key: b[key] / n[key] for key in ("schedule_cpu_ms", "commit_cpu_ms", "host_cpu_ms", "host_ms")}
            for b in base for n in new if (b["batch"], b["num_draft_tokens"]) == (n["batch"], n["num_draft_tokens"])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(recorded, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
