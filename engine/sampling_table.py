"""Each slot's sampling parameters on the device, written once when its request starts.

The sampling kernel takes per-row columns: temperature, top_k, top_p, min_p and the seed.
`SamplingTable` keeps them per slot: `start` writes a slot's row when its request's first
token is sampled after admission (also after a restore or a preemption: the same moment
penalties.py builds its statistics), and a step gathers its rows' columns by slot on the device
(`columns`), so a decode step's sampled rows cost one gather each for the float and the integer
columns, not a host list and a host-to-device copy per column per step (rows decided after the
step's graph, `step_columns`, reuse their last gather while their slots stay). A slot's row is
written again only by the next request that starts in it. Knows nothing about steps or requests beyond
a row's slot, parameters and seed.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .batch import device_tensor
from .step import ScheduledRow


class SamplingColumns(NamedTuple):
    """Per-row parameters of the sampling kernel, each contiguous [N]."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor        # int64
    top_p: torch.Tensor        # float32
    min_p: torch.Tensor        # float32
    seeds: torch.Tensor        # int64


class SamplingTable:
    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device = device
        # A column per slot: one gather gives a step's rows every column contiguously.
        self._floats = torch.zeros(3, num_slots, dtype=torch.float32, device=device)  # temperature, top_p, min_p
        self._ints = torch.zeros(2, num_slots, dtype=torch.int64, device=device)      # top_k, seed
        # The last `step_columns` result and its (slots, width): a steady batch's redecided rows
        # keep their slots step after step; any `start` may rewrite a slot's row.
        self._last: tuple[tuple[tuple[int, ...], int] | None, SamplingColumns | None] = (None, None)

    def start(self, rows: Sequence[ScheduledRow]) -> None:
        """Write the slots of rows about to sample their request's first token (after admission,
        a restore or a preemption)."""
        if not rows:
            return
        slots = device_tensor([r.slot for r in rows], torch.int64, self.device)
        params = [r.request.params for r in rows]
        self._floats[:, slots] = device_tensor([(p.temperature, p.top_p, p.min_p) for p in params], torch.float32,
                                               self.device).view(len(rows), 3).T
        self._ints[:, slots] = device_tensor([(p.top_k, r.request.seed) for p, r in zip(params, rows)], torch.int64,
                                             self.device).view(len(rows), 2).T
        self._last = (None, None)

    def step_columns(self, rows: Sequence[ScheduledRow], slots: torch.Tensor | None = None,
                     width: int = 1) -> SamplingColumns:
        """`columns` of the rows' slots (slots: those on the device, else copied in), reused
        without a gather while the rows' slots and width stay those of the last call and no
        slot has started since (the tensors are only ever read). Not inside a graph capture:
        a replay would not redo the gather."""
        key = (tuple(r.slot for r in rows), width)
        if key != self._last[0]:
            if slots is None:
                slots = device_tensor(key[0], torch.int64, self.device)
            self._last = key, self.columns(slots, width)
        return self._last[1]

    def columns(self, slots: torch.Tensor, width: int = 1) -> SamplingColumns:
        """The columns of the rows in `slots` [N] (int64, on the device), each row's repeated for
        its W = width consecutive positions: [N * W] each."""
        if width > 1:
            slots = slots[:, None].expand(-1, width).reshape(-1)
        # Advanced indexing, not index_select: for up to 16 indices CUDA's index_select runs
        # one thread loop over them, a dependent load after another (7.4 against 1.7 us at 16
        # rows on an H100: bench/results/step_gathers-h100.json); indexing reads them in parallel.
        temperature, top_p, min_p = self._floats[:, slots]
        top_k, seeds = self._ints[:, slots]
        return SamplingColumns(temperature, top_k, top_p, min_p, seeds)
