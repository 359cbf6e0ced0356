"""Runs one StepPlan on the device: builds the step's metadata once, runs the model, samples.

A step's decode rows run through the fixed-shape decode stages (decode_step.py): without
speculation one forward in which they commit their token at once, with it the Speculator's
draft, verify, accept and roll back (speculation.py); either replays a CUDA graph per batch
bucket (and K) when one fits (cuda_graphs.py). A step with plainly sampled rows runs the
stages' sampled variant, which draws those rows itself (in the graph); penalized and
constrained rows are decided again after the stages (`_Redecision`, Speculator.resample).
Prefill chunks run in their own forward (a graph replay where one fits, with speculation the
MTP's forward over them too: prefill_graphs.py), queued after the decode rows; cached rows (a
fully cached prompt) take their logits from the restored checkpoint's hidden state.

Around the forwards it executes the prefix cache's device work (checkpoint_io.py): offloads
first, restores once the decode rows are queued, and after the forwards the checkpoints' tail
blocks and the hidden states of the checkpoints the forward wrote.

One host sync per step (the emitted tokens, with each row's flag for non-finite logits). A
decode-only step can also be `launch`ed: its tokens go to the host by an asynchronous copy and
the returned `InFlight` waits for them only when asked, so the engine can launch the next step
first (its rows fed from the device, ScheduledRow.fed_from). Constrained rows of a launched step
are decided later, by `InFlight.decide`, once the tokens their grammar masks follow are
committed. Returns StepOutputs (step.py) and reads nothing of the scheduler beyond the plan it
is handed. Knows nothing about queues or stop conditions.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, NamedTuple, Sequence

import torch

from .batch import ForwardBatch, Row, device_tensor, row_index
from .checkpoint_io import CheckpointIO
from .cuda_graphs import DecodeGraphs, SpecGraphs
from .decode_step import DecodeRows, DecodeStep
from .models import HybridLM
from .penalties import PenalizedRows
from .prefill_graphs import PrefillGraphs
from .prefix_cache import CacheOps
from .sampler import Sampler
from .speculation import Speculator
from .state_pool import KVPool, StatePool
from .step import ScheduledRow, StepOutput, StepPlan, flagged


class _Redecision(NamedTuple):
    """Rows of a plain step whose tokens are decided after its graph (Runner._prepare_plain):
    penalized and constrained ones (SamplingParams.redecided)."""

    index: slice | torch.Tensor         # [R] the rows' places in the step (batch.row_index)
    rows: list[ScheduledRow]
    logits: torch.Tensor                # [R, V] adjusted by the penalties
    positions: torch.Tensor             # [R] where the drawn tokens go
    slots: torch.Tensor                 # [R]
    penalized: PenalizedRows | None     # the penalized ones among them


class InFlight:
    """A launched decode-only step. `decide()` decides its constrained rows' tokens and hands
    its outputs to the host: it must run after the step before it is committed (the grammar
    masks follow the committed tokens) and before the next step is launched (that one is fed
    from these tokens). `result()` waits for the outputs and returns the StepOutput (deciding
    first if nobody did)."""

    def __init__(self, plan: StepPlan, decide: Callable[[Future | None], Callable[[], StepOutput]],
                 prefetch: Callable[[], Future] | None = None) -> None:
        """decide(masks): queues the rest of the step on the device; returns what reads its
        outputs. prefetch: starts computing its constrained rows' masks (None: none)."""
        self.plan, self._decide, self._prefetch = plan, decide, prefetch
        self._masks: Future | None = None
        self._read: Callable[[], StepOutput] | None = None
        self._output: StepOutput | None = None

    def prefetch(self) -> None:
        """Start computing the constrained rows' masks in a worker thread (the engine calls it
        once the step before is committed, then goes on planning the next step)."""
        if self._prefetch is not None and self._masks is None and self._read is None:
            self._masks = self._prefetch()

    def decide(self) -> None:
        if self._read is None:
            self._read = self._decide(self._masks)

    def result(self) -> StepOutput:
        if self._output is None:
            self.decide()
            self._output = self._read()
        return self._output

    def checked(self, check: Callable[[], None]) -> "InFlight":
        """This step with `check` called once its outputs are read, before they are returned,
        and when reading them fails: it raises instead when they cannot be trusted, or explains
        the failure (tensor parallelism's dead worker)."""
        decide = self._decide

        def decide_then_check(masks: Future | None) -> Callable[[], StepOutput]:
            read = decide(masks)

            def read_then_check() -> StepOutput:
                try:
                    output = read()
                except BaseException:
                    check()
                    raise
                check()
                return output
            return read_then_check
        return InFlight(self.plan, decide_then_check, self._prefetch)


class Runner:
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, sampler: Sampler, checkpoint_io: CheckpointIO,
                 block_size: int, device: torch.device, decode: DecodeStep, graphs: DecodeGraphs | None = None,
                 speculator: Speculator | None = None, spec_graphs: SpecGraphs | None = None,
                 prefill_graphs: PrefillGraphs | None = None, mtp_prefill_graphs: PrefillGraphs | None = None) -> None:
        """decode: the fixed-shape decode stages; graphs: their captured plain graphs (None:
        eager). speculator: the speculative stages (None: no speculation) and spec_graphs their
        captured graphs. prefill_graphs, mtp_prefill_graphs: the target's and the MTP's
        captured prefill forwards (None: eager)."""
        self.model, self.states, self.kv, self.sampler = model, states, kv, sampler
        self.block_size, self.device, self.graphs = block_size, device, graphs
        self.decode, self.speculator, self.spec_graphs = decode, speculator, spec_graphs
        self.prefill_graphs, self.mtp_prefill_graphs = prefill_graphs, mtp_prefill_graphs
        self.checkpoint_io = checkpoint_io
        # Pinned copies of DecodeStep.outputs, used in turn: at most two steps are in flight
        # (the one being waited for and the one launched after it).
        self._host_outputs = [torch.empty_like(decode.outputs, device="cpu", pin_memory=True)
                              for _ in range(2)] if device.type == "cuda" else []
        self._launches = 0

    def release_graphs(self) -> None:
        """Destroy every captured graph and wait for the device (the engine is closing; steps
        run eagerly after this). An NCCL group cannot be left while a graph that captured its
        collectives exists: the communicators' abort and destroy wait for the graphs'
        release, on every rank alike (4 H200s, 76de151: every rank hung in the abort;
        with the graphs destroyed first, the ranks left in under 0.6 s)."""
        for graphs in (self.graphs, self.spec_graphs, self.prefill_graphs, self.mtp_prefill_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.spec_graphs = self.prefill_graphs = self.mtp_prefill_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def apply_cache_ops(self, ops: CacheOps) -> None:
        """The prefix cache's device work outside a step (clearing it: host drops)."""
        self.checkpoint_io.before_forward(ops)

    def can_launch(self, plan: StepPlan) -> bool:
        """Whether `launch` takes the plan: decode rows only."""
        return bool(plan.decode_rows) and not plan.prefill_rows and not plan.cached_rows

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InFlight:
        """Launch a decode-only step (`can_launch`) without waiting for its outputs: a plain step
        when no row drafts, else a speculative one. Its rows may be fed (ScheduledRow.fed_from)
        from the step launched before it. Constrained rows are left to the InFlight: their
        penalties are applied now; once the step before is committed the engine has their masks
        computed in a worker (`InFlight.prefetch`, while this step's forward runs), and
        `InFlight.decide` draws them. No other row waits for them. A step whose rows ask for
        log-probabilities is read at `decide` (they need the logits before the next step
        overwrites them), as is every step off the GPU (nothing runs asynchronously there)."""
        self.checkpoint_io.before_forward(plan.cache_ops)
        launched = self._launch_decode(plan, plan.decode_rows)
        self.checkpoint_io.after_forward(plan.cache_ops)
        return launched

    def _launch_decode(self, plan: StepPlan, rows: tuple[ScheduledRow, ...]) -> InFlight:
        """`launch` without the prefix cache's device work."""
        # Constrained by its parameters, not its matcher: a tensor-parallel worker's rows carry none.
        constrained = [i for i, r in enumerate(rows) if r.request.params.structured is not None]
        if any(r.num_draft_tokens for r in rows):
            drafted = self.speculator.launch(rows, self.spec_graphs, deferred=constrained)
            logits, width = drafted.logits, drafted.drafts.shape[1] + 1
            later = self.speculator.prepare(rows, drafted, constrained)
            decide = lambda masks: self.speculator.decide(later, masks)  # noqa: E731
            prefetch = (lambda: self.sampler.prefetch_masks(later.rows, width, later.read_drafts)) if later else None
        else:
            device_rows, logits, tokens = self._launch_plain(rows)
            now = [i for i, r in enumerate(rows) if r.request.params.redecided and r.request.params.structured is None]
            self._decide_plain(tokens, self._prepare_plain(rows, device_rows, logits, now))
            later = self._prepare_plain(rows, device_rows, logits, constrained)
            width = 1
            decide = lambda masks: self._decide_plain(tokens, later, masks)  # noqa: E731
            prefetch = (lambda: self.sampler.prefetch_masks(later.rows)) if later else None

        @torch.inference_mode()
        def decide_and_hand_over(masks: Future | None) -> Callable[[], StepOutput]:
            if constrained:
                decide(masks)
            return self._hand_over(rows, logits, width)

        return InFlight(plan, decide_and_hand_over, prefetch)

    def _hand_over(self, rows: tuple[ScheduledRow, ...], logits: torch.Tensor, width: int) -> Callable[[], StepOutput]:
        """Start the copy of a launched step's outputs (tokens, accepted counts, non-finite flags)
        to the host; returns what waits for them. Rows asking for log-probabilities, and steps
        off the GPU, are read at once."""
        speculative = width > 1
        if self.device.type != "cuda" or any(r.request.params.logprobs is not None for r in rows):
            emitted, logit_rows, num_pending, nonfinite = self.speculator.read(len(rows), width) if speculative else \
                ([[t] for t in self.decode.emitted[0, :len(rows)].tolist()], [[i] for i in range(len(rows))], None,
                 self.decode.nonfinite[:len(rows)].tolist())
            output = StepOutput(emitted, logprobs=self.sampler.logprobs(logits, rows, logit_rows, emitted),
                                num_pending=num_pending, nonfinite=flagged(nonfinite))
            return lambda: output
        host = self._host_outputs[self._launches % 2]
        self._launches += 1
        # The whole buffer (a few KB, contiguous both sides): one copy, no gather kernel.
        host.copy_(self.decode.outputs, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        num_rows, catch_up = len(rows), self.decode.emitted.shape[0]

        def read() -> StepOutput:
            done.synchronize()
            emitted = host[:width, :num_rows].tolist()
            nonfinite = flagged(host[catch_up + 1, :num_rows].tolist())
            if not speculative:
                return StepOutput([[t] for t in emitted[0]], nonfinite=nonfinite)
            accepted = host[catch_up, :num_rows].tolist()
            return StepOutput([[emitted[d][r] for d in range(a + 1)] for r, a in enumerate(accepted)],
                              num_pending=accepted, nonfinite=nonfinite)

        return read

    def _launch_plain(self, rows: tuple[ScheduledRow, ...]) -> tuple[DecodeRows, torch.Tensor, torch.Tensor]:
        """Queue a plain decode step, a sampled one when a row is plainly sampled. Returns its
        rows on the device, the raw logits [B, V] and the step's tokens [B]: greedy and plainly
        sampled rows' (a view of DecodeStep.emitted[0], where the next step's fed rows read
        them and where `_decide_plain` writes the redecided rows' tokens)."""
        decode_rows = [r.decode_row() for r in rows]
        sampled = any(r.request.params.drawn_in_step for r in rows)
        if self.graphs is not None and self.graphs.fits(decode_rows):
            return self.graphs.run(decode_rows, sampled)
        device_rows = self.decode.row_tensors(decode_rows, self.device)
        return device_rows, *self.decode.plain(device_rows, sampled)

    def _prepare_plain(self, rows: tuple[ScheduledRow, ...], device_rows: DecodeRows, logits: torch.Tensor,
                       chosen: list[int]) -> _Redecision | None:
        """The chosen rows (penalized or constrained) to decide again after the graph:
        their logits adjusted by the penalties, and the positions of their seeded draws (on the
        device, where only a fed row's is known). Gathered from the graph's buffers now, or,
        when every row is chosen, views of them: `_decide_plain` reads those before the next
        step is loaded into the buffers (it runs before the next launch: InFlight)."""
        if not chosen:
            return None
        index = row_index(chosen, len(rows), self.device)
        chosen_rows = [rows[i] for i in chosen]
        penalized = self.sampler.penalties.select(chosen_rows)
        adjusted = self.sampler.penalties.adjust(logits[index], penalized)
        chosen_device_rows = DecodeRows(device_rows.packed[index])
        return _Redecision(index, chosen_rows, adjusted, chosen_device_rows.positions + 1, chosen_device_rows.slots,
                           penalized)

    def _decide_plain(self, tokens: torch.Tensor, redecision: _Redecision | None, masks: Future | None = None) -> None:
        """Draw the prepared rows' tokens (masks: their prefetched grammar masks; else they are
        computed now) into the step's tokens."""
        if redecision is None:
            return
        index = redecision.index
        # Every row redecided: drawn straight into the step's tokens (a view), else copied there.
        into = tokens[index] if isinstance(index, slice) else None
        drawn = self.sampler.draw(redecision.logits, redecision.rows, redecision.positions, masks=masks,
                                  slots=redecision.slots, owned=redecision.penalized is not None, out=into)
        if into is None:
            tokens[index] = drawn
        self.sampler.penalties.record(redecision.penalized, drawn[:, None])

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """A step, waited for. Its decode rows are queued first through the decode stages, as a
        launched step's (a CUDA graph when one fits; they draft as in any decode step), its
        prefill chunks follow in their own eager forward, cached rows last. Decode rows and
        prefill chunks are different sequences, so two forwards compute what one mixed forward
        would; the decode rows skip the eager path's kernel launches, which for a small model cost
        far more host time than the graph's second pass over the weights costs the GPU. All of
        it is queued before anything is read back, so the host waits for the device once (each
        part's reader copies its outputs to the host after that). The prefix cache's restores
        are queued after the decode rows, before the prefill chunks that continue from them."""
        if self.can_launch(plan):
            return self.launch(plan).result()
        self.checkpoint_io.release(plan.cache_ops)
        decoded = self._launch_decode(plan, plan.decode_rows) if plan.decode_rows else None
        # The restores only write the new rows' slots and blocks: queued after the decode rows,
        # the device runs those while the host works the restores out.
        self.checkpoint_io.restore(plan.cache_ops)
        prefilled = self._prefill(plan.prefill_rows) if plan.prefill_rows else None
        self.checkpoint_io.after_forward(plan.cache_ops)
        cached = self._run_cached(plan.cached_rows) if plan.cached_rows else None
        output = decoded.result() if decoded is not None else StepOutput([])
        for read in (prefilled, cached):
            if read is not None:
                output = output.then(read())
        return output

    def _prefill(self, rows: tuple[ScheduledRow, ...]) -> Callable[[], StepOutput]:
        """One forward over prefill chunks (a graph replay where one fits, else eager); the rows
        that end their prompt sample their first token. With speculation the MTP runs over the
        chunks too (Speculator.prefill_mtp). Queues it all; returns what reads the outputs."""
        forward_rows = [r.forward_row() for r in rows]
        replayed = self.prefill_graphs.run(forward_rows) if self.prefill_graphs is not None else None
        if replayed is not None:
            batch, hidden = replayed
        else:
            batch = ForwardBatch.build([], forward_rows, self.block_size, self.device, commit=self.speculator is None)
            hidden = self.model(batch, self.states, self.kv)
        self.checkpoint_io.keep_hidden(batch, hidden)
        if self.speculator is not None:
            self.speculator.prefill_mtp(hidden, batch, rows, self.mtp_prefill_graphs)
        sampling = [r for r in rows if r.sample]
        if not sampling:
            return lambda: StepOutput([[] for _ in rows])
        # Sampling rows' logits are in row order: logits row j belongs to the j-th sampling row.
        read_first = self._first_tokens(self.model.compute_logits(hidden[batch.logits_indices]), sampling)
        picked = iter(range(len(sampling)))
        index = [next(picked) if r.sample else None for r in rows]

        def read() -> StepOutput:
            first = read_first()

            def spread(values: list | None, empty) -> list | None:
                return None if values is None else [values[i] if i is not None else empty for i in index]

            return StepOutput(spread(first.emitted, []), spread(first.logprobs, None),
                              nonfinite=spread(first.nonfinite, False))

        return read

    def _run_cached(self, rows: tuple[ScheduledRow, ...]) -> Callable[[], StepOutput]:
        """Fully cached prompts: the first token's logits from the hidden state the checkpoint
        kept for its last position (restored into the row's slot before the forward). Queues
        the draw; returns what reads it."""
        slots = device_tensor([r.slot for r in rows], torch.int64, self.device)
        return self._first_tokens(self.model.compute_logits(self.states.last_hidden[slots]), rows)

    def _first_tokens(self, logits: torch.Tensor, rows: Sequence[ScheduledRow]) -> Callable[[], StepOutput]:
        """The first token of rows whose prompt is now computed, from logits [N, V] (row i's in
        row i): their slots' sampling parameters and penalty statistics written (`Sampler.start`)
        and the draw and non-finite flags queued now; the returned reader copies them to the
        host (one copy) and adds the log-probabilities."""
        self.sampler.start(rows)
        tokens = self.sampler.sample(logits, rows)
        _, nonfinite = self.model.ops.greedy_argmax(logits, 1)  # the flags (its argmax unused)
        drawn = torch.stack([tokens, nonfinite])

        def read() -> StepOutput:
            host_tokens, host_nonfinite = drawn.tolist()  # one copy to the host
            emitted = [[t] for t in host_tokens]
            logprobs = self.sampler.logprobs(logits, rows, [[i] for i in range(len(rows))], emitted)
            return StepOutput(emitted, logprobs=logprobs, num_pending=[0] * len(rows),
                              nonfinite=flagged(host_nonfinite))

        return read

    @torch.inference_mode()
    def score(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Float32 logits [T, V] on the CPU at every position of each sequence, run as one
        varlen prefill in scratch pools of their own (the engine's pools are not touched)."""
        config, dtype = self.model.config, self.model.norm.dtype
        block_counts = [-(-len(ids) // self.block_size) for ids in sequences]
        states = StatePool(config, len(sequences) + 1, 0, dtype, self.device)
        kv = KVPool(self.model.num_kv_layers, sum(block_counts) + 1, self.block_size, config.num_key_value_heads,
                    config.head_dim, dtype, self.device)
        rows, next_block = [], 1
        for slot, (ids, count) in enumerate(zip(sequences, block_counts), start=1):
            rows.append(Row(ids, 0, slot, list(range(next_block, next_block + count)), num_logits=len(ids)))
            next_block += count
        batch = ForwardBatch.build([], rows, self.block_size, self.device)
        logits = self.model.compute_logits(self.model(batch, states, kv)[batch.logits_indices]).cpu()
        return list(logits.split([len(ids) for ids in sequences]))
