"""Executes the prefix cache's device work (`CacheOps`) on the pools and keeps the host tier.

Before anything of a step runs (`release`): GPU checkpoints leaving for the host are copied
there (their slot and blocks may be reused by this very step) and dropped host copies are freed.
Then (`restore`, which may follow the step's decode rows on the stream: it writes only the new
rows' own slots and blocks) restores copy a checkpoint's slot and KV blocks into the restoring
sequence's own (copy-on-restore: the cached checkpoint is never written by the sequence that uses
it), every restore of the step at once (StatePool.copy_slots, KVPool.copy_blocks). After the
forward: the partial last block of each prompt-end checkpoint is copied from the sequence that
wrote it, and the checkpoints the chunked kernel wrote during the forward keep their last hidden
state.

Knows nothing about which checkpoint is worth keeping: that is prefix_cache.py's business.
"""

from __future__ import annotations

import torch

from .batch import ForwardBatch
from .prefix_cache import CacheOps
from .state_pool import KVPool, StatePool


class CheckpointIO:
    def __init__(self, states: StatePool, kv: KVPool) -> None:
        self.states, self.kv = states, kv
        # Host tier: checkpoint id -> (slot tensors, KV blocks) in pinned CPU memory.
        self.host: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def before_forward(self, ops: CacheOps) -> None:
        self.release(ops)
        self.restore(ops)

    def release(self, ops: CacheOps) -> None:
        """Offloads and host drops: before the step writes any slot or block."""
        for offload in ops.offloads:
            self.host[offload.checkpoint_id] = (self.states.save_slot(offload.slot),
                                                self.kv.save_blocks(offload.blocks))
        for checkpoint_id in ops.host_drops:
            del self.host[checkpoint_id]

    def restore(self, ops: CacheOps) -> None:
        """Restores (after `release`): their sources are checkpoints, their destinations new
        slots and blocks, so no restore reads what another writes."""
        if not ops.restores:
            return
        on_gpu = [r for r in ops.restores if r.src_slot is not None]
        self.states.copy_slots([(r.src_slot, r.dst_slot) for r in on_gpu])
        self.kv.copy_blocks([pair for r in on_gpu for pair in r.block_copies])
        for restore in ops.restores:
            if restore.src_slot is None:
                slot_tensors, blocks = self.host[restore.host_id]
                self.states.load_slot(restore.dst_slot, slot_tensors)
                self.kv.load_blocks(restore.host_blocks, blocks)
        self.states.hidden_to_mtp([r.dst_slot for r in ops.restores if r.hidden_to_mtp])

    def keep_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """Checkpoints the forward wrote keep the hidden state of their last position (a full
        hit's logits; the MTP catch-up of a checkpoint one position behind). Their pending
        counts are never read: a restore zeroes the destination's."""
        written = batch.checkpoints
        if written is None:
            return
        last = hidden[batch.prefill.token_start + written.last_token]
        self.states.last_hidden[written.slots] = last
        if self.states.mtp_hidden is not None:
            self.states.mtp_hidden[written.slots, 0] = last

    def after_forward(self, ops: CacheOps) -> None:
        self.kv.copy_blocks(ops.tail_copies)
