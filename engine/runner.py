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

One host sync per step (the emitted tokens, with each row's flag for non-finite logits). A step
is `launch`ed: its tokens (decode rows' and the first tokens of rows that end their prompt, side
by side in DecodeStep.outputs) go to the host by one asynchronous copy and the returned
`InFlight` waits for them only when asked, so the engine can launch the next step first (its
rows fed from the device, ScheduledRow.fed_from). Constrained decode rows of a launched step are
decided later, by `InFlight.decide`, once the tokens their grammar masks follow are committed.
Returns StepOutputs (step.py) and reads nothing of the scheduler beyond the plan it is handed.
Knows nothing about queues or stop conditions.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np
import torch

from .batch import ForwardBatch, Row, device_tensor, row_index
from .checkpoint_io import CheckpointIO
from .cuda_graphs import DecodeGraphs, SpecGraphs
from .decode_step import DecodeRows, DecodeStep
from .models import HybridLM
from .penalties import PenalizedRows
from .prefill_graphs import PrefillGraphs
from .prefix_cache import CacheOps
from .request import TokenLogprobs
from .sampler import Sampler, TokenScores
from .speculation import Speculator
from .state_pool import KVPool, StatePool
from .step import ScheduledRow, StepOutput, StepPlan, flagged

if TYPE_CHECKING:
    from .vision.features import ImageFeatures


# Logits elements a piece of a prompt's scored positions computes at once (Runner._score_prompt),
# in the model's dtype: 64 MB of bf16 (~135 positions of a 248K vocabulary), beside the step's
# own activations.
PROMPT_LOGITS_ELEMENTS = 1 << 25


class _Redecision(NamedTuple):
    """Rows of a plain step whose tokens are decided after its graph (Runner._prepare_plain):
    penalized and constrained ones (SamplingParams.redecided)."""

    index: slice | torch.Tensor         # [R] the rows' places in the step (batch.row_index)
    rows: list[ScheduledRow]
    logits: torch.Tensor                # [R, V] adjusted by the penalties
    positions: torch.Tensor             # [R] where the drawn tokens go
    slots: torch.Tensor                 # [R]
    penalized: PenalizedRows | None     # the penalized ones among them


class _Decoded(NamedTuple):
    """A launched step's decode rows (Runner._launch_decode)."""

    rows: tuple[ScheduledRow, ...]
    logits: torch.Tensor                                # [B * width, V]
    width: int                                          # positions a row: K + 1 (1: a plain step)
    decide: Callable[[Future | None], None] | None      # draws the constrained rows (None: none)
    prefetch: Callable[[], Future] | None               # starts computing their grammar masks


class _First(NamedTuple):
    """A launched step's rows drawing their request's first token (Runner._first_tokens)."""

    rows: list[ScheduledRow]
    logits: torch.Tensor  # [N, V]


class InFlight:
    """A launched step. `decide()` decides its constrained decode rows' tokens and hands
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
                 prefill_graphs: PrefillGraphs | None = None, mtp_prefill_graphs: PrefillGraphs | None = None,
                 images: ImageFeatures | None = None) -> None:
        """decode: the fixed-shape decode stages; graphs: their captured plain graphs (None:
        eager). speculator: the speculative stages (None: no speculation) and spec_graphs their
        captured graphs. prefill_graphs, mtp_prefill_graphs: the target's and the MTP's
        captured prefill forwards (None: eager). images: the vision encoder's outputs for
        prompts' image tokens (None: a text-only model)."""
        self.model, self.states, self.kv, self.sampler = model, states, kv, sampler
        self.block_size, self.device, self.graphs = block_size, device, graphs
        self.decode, self.speculator, self.spec_graphs = decode, speculator, spec_graphs
        self.prefill_graphs, self.mtp_prefill_graphs = prefill_graphs, mtp_prefill_graphs
        self.checkpoint_io = checkpoint_io
        self.images = images
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

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InFlight:
        """Queue a step on the device without waiting for its outputs. Its decode rows first,
        through the decode stages (a CUDA graph when one fits): a plain step when no row
        drafts, else a speculative one; a row may be fed (ScheduledRow.fed_from) from the step
        launched before it. Its prefill chunks follow in their own forward (`_prefill`), cached
        rows last; the rows that end their prompt draw their first token (`_first_tokens`),
        kept beside the decode rows' outputs where the next step's fed rows read them. Decode
        rows and prefill chunks are different sequences, so two forwards compute what one mixed
        forward would; the decode rows skip the eager path's kernel launches, which for a small
        model cost far more host time than the graph's second pass over the weights costs the
        GPU. The prefix cache's offloads go first, its restores once the decode rows are queued
        (they only write the new rows' slots and blocks: the device runs the decode rows while
        the host works them out), before the prefill chunks that continue from them.

        Constrained decode rows are left to the InFlight: their penalties are applied now; once
        the step before is committed the engine has their masks computed in a worker
        (`InFlight.prefetch`, while this step's forward runs), and `InFlight.decide` draws them.
        No other row waits for them. A step whose rows ask for log-probabilities is read at
        `decide` (they need the logits before the next step overwrites them), as is every step
        off the GPU (nothing runs asynchronously there)."""
        ops = plan.cache_ops
        # A sequence's decode steps turn its tokens by position + its prompt's image shift: set
        # where it (re)starts, before any decode step of it.
        self.decode.set_rope_deltas([(r.slot, 0 if r.request.images is None else r.request.images.delta)
                                     for r in plan.prefill_rows + plan.cached_rows])
        self.checkpoint_io.release(ops)
        decoded = self._launch_decode(plan.decode_rows) if plan.decode_rows else None
        self.checkpoint_io.restore(ops)
        hidden, prompt_scores = self._prefill(plan.prefill_rows) if plan.prefill_rows else (None, None)
        self.checkpoint_io.after_forward(ops)
        first = None
        if plan.cached_rows:
            # A fully cached prompt's first token comes from the hidden state its checkpoint kept
            # for its last position (restored into the row's slot above).
            kept = self.states.last_hidden[device_tensor([r.slot for r in plan.cached_rows], torch.int64, self.device)]
            hidden = kept if hidden is None else torch.cat([hidden, kept])
        if hidden is not None:
            first = self._first_tokens(hidden, [r for r in plan.prefill_rows + plan.cached_rows if r.sample],
                                       len(plan.decode_rows))

        @torch.inference_mode()
        def decide_and_hand_over(masks: Future | None) -> Callable[[], StepOutput]:
            if decoded is not None and decoded.decide is not None:
                decoded.decide(masks)
            return self._hand_over(plan, decoded, first, prompt_scores)

        return InFlight(plan, decide_and_hand_over, decoded.prefetch if decoded is not None else None)

    def run(self, plan: StepPlan) -> StepOutput:
        """A step, waited for (`launch`, then its outputs)."""
        return self.launch(plan).result()

    def _launch_decode(self, rows: tuple[ScheduledRow, ...]) -> _Decoded:
        """Queue the decode rows' step (`launch`); what decides its constrained rows is returned."""
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
        return _Decoded(rows, logits, width, decide if constrained else None, prefetch)

    def _hand_over(self, plan: StepPlan, decoded: _Decoded | None, first: _First | None,
                   prompt_scores: TokenScores | None) -> Callable[[], StepOutput]:
        """Start the copy of a launched step's outputs (decode rows' tokens, accepted counts and
        non-finite flags, then the first tokens, all in DecodeStep.outputs) to the host; returns
        what waits for them. Steps whose rows ask for log-probabilities (of their tokens or their
        prompt's), and steps off the GPU, are read at once."""
        if self.device.type != "cuda" or prompt_scores is not None \
                or any(r.request.params.logprobs is not None for r in plan.rows):
            output = self._read(plan, decoded, first, self.decode.outputs, prompt_scores=prompt_scores)
            return lambda: output
        host = self._host_outputs[self._launches % 2]
        self._launches += 1
        # The whole buffer (a few KB, contiguous both sides): one copy, no gather kernel.
        host.copy_(self.decode.outputs, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read() -> StepOutput:
            done.synchronize()
            return self._read(plan, decoded, first, host, logprobs=False)

        return read

    def _read(self, plan: StepPlan, decoded: _Decoded | None, first: _First | None, outputs: torch.Tensor,
              logprobs: bool = True, prompt_scores: TokenScores | None = None) -> StepOutput:
        """The step's StepOutput from `outputs` (DecodeStep.outputs or its host copy: W rows of
        emitted tokens, the accepted counts, the non-finite flags; decode rows first, then the
        rows that drew a first token); logprobs: with the log-probabilities rows ask for;
        prompt_scores: its prefill rows' prompt scores (`_score_prompt`)."""
        num_decode, width = len(plan.decode_rows), self.decode.emitted.shape[0]
        rest = plan.prefill_rows + plan.cached_rows
        # The plan rows that drew a first token; output rows num_decode.. hold theirs, in order.
        firsts = [i for i, r in enumerate(rest, num_decode) if r.sample]
        table = outputs[:, :num_decode + len(firsts)].tolist()  # one read
        tokens, accepted, nonfinite = table[0], table[width], table[width + 1]
        speculative = decoded is not None and decoded.width > 1
        if speculative:
            emitted = [[table[d][r] for d in range(accepted[r] + 1)] for r in range(num_decode)]
            num_pending = accepted[:num_decode]
        else:
            emitted, num_pending = [[t] for t in tokens[:num_decode]], None
        flags = nonfinite[:num_decode]
        if rest:
            emitted += [[] for _ in rest]
            flags += [0] * len(rest)
            for out, i in enumerate(firsts, num_decode):
                emitted[i], flags[i] = [tokens[out]], nonfinite[out]
            num_pending = (num_pending or [0] * num_decode) + [0] * len(rest)
        return StepOutput(emitted, self._logprobs(plan, decoded, first, emitted, firsts) if logprobs else None,
                          num_pending, None if prompt_scores is None else self._prompt_logprobs(plan, prompt_scores),
                          flagged(flags))

    def _logprobs(self, plan: StepPlan, decoded: _Decoded | None, first: _First | None,
                  emitted: list[list[int]], firsts: list[int]) -> list | None:
        """Per plan row, the log-probabilities of its emitted tokens where its request asks for
        them (decode rows scored by their verify logits, first tokens, at plan rows `firsts`, by
        theirs); None: none."""
        num_decode = len(plan.decode_rows)
        result: list = [None] * len(emitted)
        if decoded is not None:
            w = decoded.width
            logit_rows = [list(range(r * w, r * w + len(t))) for r, t in enumerate(emitted[:num_decode])]
            result[:num_decode] = self.sampler.logprobs(decoded.logits, decoded.rows, logit_rows,
                                                        emitted[:num_decode]) or [None] * num_decode
        if first is not None:
            scored = self.sampler.logprobs(first.logits, first.rows, [[j] for j in range(len(firsts))],
                                           [emitted[i] for i in firsts])
            for i, entry in zip(firsts, scored or ()):
                result[i] = entry
        return result if any(entry is not None for entry in result) else None

    @staticmethod
    def _prompt_logprobs(plan: StepPlan, scores: TokenScores) -> list[list[TokenLogprobs] | None]:
        """Per plan row, its prompt tokens' scores (`_score_prompt`: the prefill rows' spans in
        order, each entry cut to the top-N its request asks for)."""
        scored = iter(scores.read())
        result: list[list[TokenLogprobs] | None] = [None] * len(plan.rows)
        for i, row in enumerate(plan.prefill_rows, len(plan.decode_rows)):
            first, last = row.prompt_logprob_span
            if first < last:
                result[i] = [next(scored).top_n(row.request.params.prompt_logprobs) for _ in range(first, last)]
        return result

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

    def _prefill(self, rows: tuple[ScheduledRow, ...]) -> tuple[torch.Tensor | None, TokenScores | None]:
        """One forward over prefill chunks (a graph replay where one fits, else eager); with
        speculation the MTP runs over the chunks too (Speculator.prefill_mtp). Queues it all;
        returns the hidden states of the rows that end their prompt [S, H] (in row order),
        whose logits give their first token, or None when none does; and the scores of the
        prompt tokens the rows' spans ask for (`_score_prompt`), or None."""
        forward_rows = [r.forward_row() for r in rows]
        embeds = self._image_embeds(rows, lambda r: (r.start_position, r.start_position + r.num_tokens))
        # Image tokens' embeddings are not a graph's input: such a batch runs eagerly.
        graphed = self.prefill_graphs is not None and embeds is None
        replayed = self.prefill_graphs.run(forward_rows) if graphed else None
        if replayed is not None:
            batch, hidden = replayed
        else:
            batch = ForwardBatch.build([], forward_rows, self.block_size, self.device, commit=self.speculator is None)
            hidden = self.model(replace(batch, embeds=embeds), self.states, self.kv)
        self.checkpoint_io.keep_hidden(batch, hidden)
        if self.speculator is not None:
            # The MTP at position t reads token t + 1: an image token's features where it is one.
            mtp_embeds = self._image_embeds([r for r in rows if r.mtp_end > r.mtp_start],
                                            lambda r: (r.mtp_start + 1, r.mtp_end + 1))
            self.speculator.prefill_mtp(hidden, batch, rows, self.mtp_prefill_graphs, mtp_embeds)
        prompt_scores = self._score_prompt(hidden, rows)
        return (hidden[batch.logits_indices] if any(r.sample for r in rows) else None), prompt_scores

    def _image_embeds(self, rows: Sequence[ScheduledRow],
                      window: Callable[[ScheduledRow], tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """ForwardBatch.embeds of a varlen batch of one row for each of `rows`, in order, row i
        feeding tokens window(rows[i]) = [start, end) of its request; None when they feed no
        image token."""
        if self.images is None:
            return None
        offsets = np.cumsum([0] + [end - start for start, end in map(window, rows)])
        windows = [(int(offset), row.request.images, *window(row)) for offset, row in zip(offsets, rows)
                   if row.request.images is not None]
        return self.images.embeds(windows, self.device, self.model.norm.dtype) if windows else None

    def _score_prompt(self, hidden: torch.Tensor, rows: tuple[ScheduledRow, ...]) -> TokenScores | None:
        """The next prompt token's score at each position of the rows' prompt_logprob_spans, in
        order, from the forward's hidden states [tokens, H] (the rows' tokens first, in row
        order). The logits go through in pieces of at most PROMPT_LOGITS_ELEMENTS, so a chunk
        of thousands of positions never holds its [positions, V] logits at once."""
        index, chosen, top_n = [], [], 0
        offset = 0
        for row in rows:
            first, last = row.prompt_logprob_span
            if first < last:
                index += range(offset + first - row.start_position, offset + last - row.start_position)
                chosen += row.request.token_ids(first + 1, last + 1)
                top_n = max(top_n, row.request.params.prompt_logprobs)
            offset += row.num_tokens
        if not index:
            return None
        index, chosen = device_tensor(index, torch.int64, self.device), device_tensor(chosen, torch.int64, self.device)
        piece = max(1, PROMPT_LOGITS_ELEMENTS // self.model.config.vocab_size)
        return TokenScores.cat([self.sampler.score(self.model.logits(hidden[index[i:i + piece]]), chosen[i:i + piece],
                                                   top_n)
                                for i in range(0, len(index), piece)])

    def _first_tokens(self, hidden: torch.Tensor, rows: Sequence[ScheduledRow], start: int) -> _First:
        """The first token of rows whose prompt is now computed, from their last hidden states
        [N, H] (row i's in row i): their slots' sampling parameters and penalty statistics
        written (`Sampler.start`), the draw queued and kept with the non-finite flags at the
        step's output rows start.. (DecodeStep.record_first), where the next step's fed rows
        and the host read them."""
        logits = self.model.compute_logits(hidden)
        self.sampler.start(rows)
        positions = device_tensor([r.start_position + r.num_tokens for r in rows], torch.int64, self.device)
        self.decode.record_first(start, self.sampler.sample(logits, rows, positions), logits, positions)
        return _First(rows, logits)

    @torch.inference_mode()
    def score(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Float32 logits [T, V] on the CPU at every position of each sequence, run as one
        varlen prefill in scratch pools of their own, of the engine's dtypes (the engine's pools
        are not touched)."""
        config, dtype = self.model.config, self.model.norm.dtype
        block_counts = [-(-len(ids) // self.block_size) for ids in sequences]
        states = StatePool(config, len(sequences) + 1, 0, dtype, self.device, self.states.state_dtype)
        kv = KVPool(self.model.num_kv_layers, sum(block_counts) + 1, self.block_size, config.num_key_value_heads,
                    config.head_dim, self.kv.dtype, self.device)
        rows, next_block = [], 1
        for slot, (ids, count) in enumerate(zip(sequences, block_counts), start=1):
            rows.append(Row(ids, 0, slot, list(range(next_block, next_block + count)), num_logits=len(ids)))
            next_block += count
        batch = ForwardBatch.build([], rows, self.block_size, self.device)
        logits = self.model.compute_logits(self.model(batch, states, kv)[batch.logits_indices]).cpu()
        return list(logits.split([len(ids) for ids in sequences]))
