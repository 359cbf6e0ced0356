"""The host's share of sampling as users configure it: what a decode step's penalized, constrained
and sampled rows cost the engine's thread, measured on the CPU.

`bench/sampling_cost.py` times whole steps on a GPU, where steps with penalized and constrained
rows are host-bound: the engine's thread, not the device, sets their pace. This benchmark
isolates that thread's sampling work (what the runner does for rows whose tokens are decided
after the forward: `Runner._prepare_plain` / `_decide_plain` without speculation,
`Speculator.prepare` / `decide` with it; the grammar masks' worker thread is not counted; plainly
sampled rows are drawn inside the step and cost none of it) and
counts, per decode step of the five mixes of sampling_cost.py (same params, same schema, batch
64 by default, through `EngineCore` on the CPU with the tiny shape):

    host_ms       the engine thread's CPU time in that work (median over the timed steps; CPU
                  time, so other processes on a shared machine disturb it little), less the time
                  inside Ops-table calls (device work: torch references here)
    mask_wait_ms  wall time it waits for the grammar masks' worker
    ops           torch operator calls it makes (each a kernel launch on a GPU; a call of the
                  Ops table, i.e. a Triton kernel there, counts one)
    copies_in     host-to-device tensors it makes (`device_tensor`: a pinned buffer and an
                  asynchronous copy each on a GPU)
    advance_ms    the engine thread's CPU time advancing the grammars by the committed tokens
                  (`Matcher.advance`, in the commit)
    mask_ms       wall time of computing a step's grammar masks (`Grammars.bitmask`, in the
                  worker; median over the calls of the timed steps): on a GPU with speculation it
                  runs while the device verifies the step, so it delays the next launch only
                  when it outlasts the verify
    mask_lead_ms  wall time from the masks' start (`InFlight.prefetch` returns) to the engine
                  thread asking for them in `decide`: the engine-thread work the worker's mask
                  computation overlaps (on a 2-core machine shared with other work the two
                  threads also share the cores, so mask_wait_ms need not fall as it grows)

The CPU runs every operator at once and the tiny vocabulary keeps them cheap, so `host_ms` is
dominated by Python and dispatch, as on a GPU host; the counts do not depend on the machine.

    python bench/sampling_host.py [--batch 64] [--steps 24] [--label after]
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
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import make_tokenizer  # noqa: E402

import common  # noqa: E402
from common import commit_id  # noqa: E402
from sampling_cost import COMMON, MIXES, PROMPT_LEN, SHAPES, WARM_UP_STEPS, params  # noqa: E402
from deltaspec.engine import EngineConfig, ModelConfig  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.runner import InFlight, Runner  # noqa: E402
from deltaspec.engine.speculation import Speculator  # noqa: E402
from deltaspec.engine.structured import Grammars, Matcher  # noqa: E402
from deltaspec.engine.tokenizer import Tokenizer  # noqa: E402

# The runner's sampling work for redecided rows, on the engine's thread.
# The Ops-table kernels the sampling work calls (each one launch on a GPU).
KERNELS = ("sample", "penalize_rows", "record_tokens", "apply_token_bitmask")
TIMED = ((Runner, "_prepare_plain"), (Runner, "_decide_plain"), (Speculator, "prepare"), (Speculator, "decide"))


class Counter(TorchDispatchMode):
    """Counts operator calls on this thread; an Ops-table call counts once (`kernel`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.copies_in = 0
        self.kernel_seconds = 0.0  # inside Ops-table calls: device work (CPU references here)
        self._inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside_kernel:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def kernel(self, function):
        @functools.wraps(function)
        def counted(*args, **kwargs):
            if not self._inside_kernel:
                self.ops += 1
            self._inside_kernel += 1
            begin = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self._inside_kernel -= 1
                if not self._inside_kernel:
                    self.kernel_seconds += time.thread_time() - begin
        return counted


class Probe:
    """Wraps the TIMED methods and every module's `device_tensor` for one engine: per step, the
    wall time inside them (outermost calls only) and what they dispatch."""

    def __init__(self, core: EngineCore) -> None:
        self.counter = Counter()
        self.seconds = 0.0
        # Durations of each call (seconds): mask waits inside the timed methods, grammar
        # advances (CPU time), mask computations (the worker's: not attributed to a step).
        self.waits: list[float] = []
        self.advances: list[float] = []
        self.mask_calls: list[float] = []
        self.leads: list[float] = []
        self._prefetched: float | None = None  # when the last InFlight.prefetch returned
        self._depth = 0
        self._undo = []
        sampler = core.runner.sampler
        kernels = dataclasses.replace(sampler.ops, **{name: self.counter.kernel(getattr(sampler.ops, name))
                                                      for name in KERNELS})
        self._patch(sampler, "ops", kernels)
        self._patch(sampler.penalties, "ops", kernels)
        for owner, name in TIMED:
            if hasattr(owner, name):
                self._patch(owner, name, self._timed(getattr(owner, name)))
        self._patch(Future, "result", self._clocked(self._lead(Future.result), time.perf_counter, self.waits,
                                                    in_timed=True))
        self._patch(InFlight, "prefetch", self._marks_prefetch(InFlight.prefetch))
        self._patch(Matcher, "advance", self._clocked(Matcher.advance, time.thread_time, self.advances))
        self._patch(Grammars, "bitmask", self._clocked(Grammars.bitmask, time.perf_counter, self.mask_calls))
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("deltaspec.engine") and hasattr(module, "device_tensor"):
                self._patch(module, "device_tensor", self._copy_in(module.device_tensor))

    def _patch(self, owner, name, value) -> None:
        self._undo.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)

    def _timed(self, function):
        probe = self

        @functools.wraps(function)
        def timed(*args, **kwargs):
            if probe._depth:
                return function(*args, **kwargs)
            probe._depth += 1
            begin = time.thread_time()
            try:
                with probe.counter:
                    return function(*args, **kwargs)
            finally:
                probe.seconds += time.thread_time() - begin
                probe._depth -= 1
        return timed

    def _clocked(self, function, clock, durations: list[float], in_timed: bool = False):
        """function, appending each call's duration by `clock` to durations (in_timed: only
        calls made inside a TIMED method)."""
        @functools.wraps(function)
        def clocked(*args, **kwargs):
            begin = clock()
            try:
                return function(*args, **kwargs)
            finally:
                if self._depth or not in_timed:
                    durations.append(clock() - begin)
        return clocked

    def _marks_prefetch(self, function):
        @functools.wraps(function)
        def prefetch(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            finally:
                self._prefetched = time.perf_counter()
        return prefetch

    def _lead(self, function):
        """function (Future.result), appending the time since the last prefetch to leads when
        a TIMED method asks for masks prefetched before it."""
        @functools.wraps(function)
        def result(*args, **kwargs):
            if self._depth and self._prefetched is not None:
                self.leads.append(time.perf_counter() - self._prefetched)
                self._prefetched = None
            return function(*args, **kwargs)
        return result

    def _copy_in(self, function):
        @functools.wraps(function)
        def counted(*args, **kwargs):
            if self._depth:
                self.counter.copies_in += 1
            return function(*args, **kwargs)
        return counted

    def take(self) -> tuple[float, float, int, int, float, float]:
        """(host CPU seconds outside the kernels, seconds waiting for grammar masks, operator
        calls, host-to-device tensors, CPU seconds advancing grammars, seconds from the masks'
        start to that wait) since the last take."""
        counter = self.counter
        taken = (self.seconds - counter.kernel_seconds, sum(self.waits), counter.ops, counter.copies_in,
                 sum(self.advances), sum(self.leads))
        self.seconds = counter.kernel_seconds = 0.0
        self.waits.clear()
        self.advances.clear()
        self.leads.clear()
        counter.ops = counter.copies_in = 0
        return taken


def measure(core: EngineCore, mix: str, batch: int, steps: int) -> dict:
    vocab = core.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch)
    max_tokens = 1 + WARM_UP_STEPS + steps + 4
    requests = [core.add_request(torch.randint(0, vocab, (PROMPT_LEN,), generator=generator).tolist(),
                                 params(mix, i, max_tokens, vocab)) for i in range(batch)]
    while any(not r.output_token_ids for r in requests):
        core.step()
    probe = Probe(core)
    samples = []
    try:
        while core.has_work:
            probe.take()
            step = core.dispatch()
            core.commit(step.plan, step.wait())
            if len(step.plan.decode_rows) == batch and not step.plan.prefill_rows:
                samples.append(probe.take())
    finally:
        probe.undo()
    timed = samples[WARM_UP_STEPS:WARM_UP_STEPS + steps]
    column = lambda i: statistics.median(sample[i] for sample in timed)  # noqa: E731
    mask_calls = probe.mask_calls[WARM_UP_STEPS:WARM_UP_STEPS + steps]
    return {"host_ms": column(0) * 1e3, "mask_wait_ms": column(1) * 1e3, "ops": column(2), "copies_in": column(3),
            "advance_ms": column(4) * 1e3, "mask_ms": statistics.median(mask_calls) * 1e3 if mask_calls else 0.0,
            "mask_lead_ms": column(5) * 1e3,
            "steps_measured": len(timed)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampling_host-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread times steadier
    model_config = ModelConfig.from_dict({**COMMON, **SHAPES["tiny"]})
    model = common.random_model(model_config, "cpu", torch.float32)
    directory = make_tokenizer(Path(tempfile.mkdtemp()))
    tokenizer = Tokenizer.from_dir(directory)
    runs = {}
    for num_drafts in (0, args.draft_tokens):
        config = EngineConfig(model=directory, device="cpu", dtype="float32", max_num_seqs=args.batch,
                              max_num_batched_tokens=max(2048, args.batch * PROMPT_LEN), max_model_len=1024,
                              num_draft_tokens=num_drafts, adaptive_draft_length=False, enable_prefix_cache=False,
                              warm_up=False)
        core = EngineCore(config, model, tokenizer)
        measure(core, "penalties+schema", args.batch, 2)
        run = {mix: measure(core, mix, args.batch, args.steps) for mix in MIXES}
        runs[f"k={num_drafts}"] = run
        print(f"k={num_drafts}: " + "; ".join(f"{m} {r['host_ms']:.2f} ms (+{r['mask_wait_ms']:.2f} waiting), "
                                               f"{r['ops']:.0f} ops, {r['copies_in']:.0f} copies in, "
                                               f"grammar advance {r['advance_ms']:.2f} ms, masks {r['mask_ms']:.2f} ms "
                                               f"started {r['mask_lead_ms']:.2f} ms ahead"
                                               for m, r in run.items()), flush=True)
        del core
    out = Path(args.out)
    recorded = json.loads(out.read_text()) if out.exists() else {"benchmark": "sampling_host", "runs": {}}
    recorded["runs"][args.label] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "batch": args.batch, "results": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(recorded, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
