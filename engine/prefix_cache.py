"""Prompt-prefix reuse for hybrid models: which token prefixes have a restorable checkpoint.

A hybrid model cannot resume from KV blocks alone: a sequence that starts at position q needs
the recurrent state at q too. A `Checkpoint` at q holds everything a new sequence needs:
  - one pool slot with the committed recurrent state and conv window at q (nothing pending),
    the target's post-norm hidden state at q-1 (`last_hidden`, when `has_hidden`: the logits of
    a fully cached prompt's first token come from it) and, with speculation, the hidden states
    of positions [mtp_position, q) the MTP catch-up still needs (`mtp_hidden`);
  - the KV blocks covering [0, q), one reference each (full blocks are shared read-only; a
    partial last block is the checkpoint's own).
Checkpoints come from (docs/design.md, "Prefix cache"):
  - every `checkpoint_interval`-th block boundary a prefill chunk passes and the exact end of
    every prompt, written by the chunked GDN kernel during the forward (`CheckpointWrite`);
  - the end of every finished request (prompt + output): its slot and blocks change owner,
    nothing is copied.
Keys: token blocks hashed in a chain (hash of the parent hash and the block's tokens); a
checkpoint inside a block is found through its last full block's hash and its tail tokens.
A hit compares the tokens themselves, so a hash collision cannot restore the wrong state.
A salt (vLLM's cache_salt, a request's) puts a prefix in a namespace of its own: it seeds the
chain and a hit compares it too, so requests of one salt share their prefixes with each other
only, and unsalted requests with unsalted ones (a tenant cannot learn, by timing its prefills,
which prompts another tenant sent).
Restores copy (copy-on-restore): the restoring sequence shares the full blocks below the first
position it will write and gets its own copies of the rest and of the slot.

Memory: checkpoints live in slots and KV blocks that running requests do not use; `make_room`
evicts least-recently-used checkpoints nobody pins, to the host tier when one is configured
(pinned CPU memory, restored from there later) or for good. A checkpoint is pinned while a
step restores it and while a session handle (`save`) holds it; a session checkpoint may move
to the host tier but is never dropped.

Pure Python, like the scheduler that drives it: device copies are described as `CacheOps`
that the runner executes around the step's forward.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .allocators import BlockAllocator, SlotAllocator

_ROOT_HASH = 0x9E3779B97F4A7C15  # any constant: ints and tuples of ints hash deterministically
_MAX_REQUEST_IDS = 16  # finished requests remembered per checkpoint for `save`


def _tokens(token_ids: Sequence[int]) -> array:
    """Token ids as the cache keeps them: an int64 array, which holds no Python objects, so the
    garbage collector never walks its elements. It walks a new tuple (or list) of ints element by
    element: the prefixes of a busy server's finished requests (~1K tokens each, hundreds a
    second) piled up between young-generation collections into collections of up to 43 ms in
    the engine process (H100, shipped model, 64 streams), every stream stalled meanwhile."""
    return array("q", token_ids)


@dataclass(eq=False)
class Checkpoint:
    id: int
    token_ids: array            # the prefix [0, position) (`_tokens`)
    mtp_position: int           # the MTP layer's KV is exact below this (position or position - 1)
    has_hidden: bool            # the slot's last_hidden holds the hidden state at position - 1
    slot: int | None            # its pool slot while on the GPU
    blocks: list[int]           # its KV blocks covering [0, position) while on the GPU
    num_blocks: int             # blocks covering [0, position) wherever it lives
    on_host: bool = False
    pins: int = 0               # steps and waiting requests restoring it + session handles
    sessions: int = 0           # session handles on it (it may move to the host, never be dropped)
    request_ids: list[str] = field(default_factory=list)  # finished requests it is the end of
    salt: str = ""              # its namespace (the module docstring): "" for unsalted requests

    @property
    def position(self) -> int:
        return len(self.token_ids)

    def holds(self, key: array, salt: str) -> bool:
        """Whether it is the checkpoint of exactly these tokens in the salt's namespace."""
        return self.salt == salt and self.token_ids == key


@dataclass(frozen=True)
class CheckpointHandle:
    """A saved session: a finished request's tokens (prompt + output) and its checkpoint, which
    covers all of them but the few never fed (the last sampled token, speculative tokens left
    pending); a resume feeds those again. `release()` frees it (the engine's
    `release_checkpoint(handle)` does the same)."""

    handle_id: int
    token_ids: tuple[int, ...]
    _release: Callable[["CheckpointHandle"], None] = field(repr=False, compare=False, default=lambda handle: None)

    def release(self) -> None:
        self._release(self)


@dataclass(frozen=True)
class CheckpointWrite:
    """A checkpoint a prefill row writes during the forward: the state after `position`
    tokens (absolute) into `slot`. Its mtp_position is `position`, or position - 1 when the
    position ends the sequence's known tokens (the MTP has no next token there yet)."""

    position: int
    slot: int
    ends_tokens: bool


@dataclass(frozen=True)
class Restore:
    """Copy a checkpoint into a sequence's fresh slot (pending count 0)."""

    dst_slot: int
    src_slot: int | None                     # on the GPU: copy slot -> slot
    host_id: int | None                      # on the host: copy host -> slot and blocks
    block_copies: tuple[tuple[int, int], ...]  # (src, dst) KV blocks copied on the GPU
    host_blocks: tuple[int, ...]             # from the host: the destination of every block
    hidden_to_mtp: bool                      # mtp_hidden[dst, 0] := last_hidden (full hit)


@dataclass(frozen=True)
class Offload:
    """Copy a GPU checkpoint to the host tier before its slot and blocks are reused."""

    checkpoint_id: int
    slot: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class CacheOps:
    """Device work of one step, in this order: offloads and host drops (before anything of the
    step), restores (before the forward that reads them), tail copies after it (the partial last
    block of a prompt-end checkpoint). checkpoint_io.py executes them."""

    offloads: tuple[Offload, ...] = ()
    host_drops: tuple[int, ...] = ()
    restores: tuple[Restore, ...] = ()
    tail_copies: tuple[tuple[int, int], ...] = ()


@dataclass
class CacheStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    offloads: int = 0
    host_restores: int = 0


class PrefixCache:
    def __init__(self, slots: SlotAllocator, blocks: BlockAllocator, checkpoint_interval: int, enabled: bool = True,
                 mtp: bool = False, host_capacity_bytes: int = 0,
                 checkpoint_bytes: Callable[[int], int] = lambda num_blocks: 0) -> None:
        """enabled: restore prefixes, write prompt checkpoints and keep finished requests (for
        the next turn and `save`); off, a finished request's slot and blocks are freed at once.
        mtp: the engine speculates with the MTP layer, whose KV may be one position behind a
        checkpoint. checkpoint_bytes(num_blocks): bytes a checkpoint with that many KV blocks
        takes on the host (its slot's tensors + the blocks)."""
        self.slots, self.blocks, self.mtp = slots, blocks, mtp
        self.block_size = blocks.block_size
        if checkpoint_interval % self.block_size:
            raise ValueError(f"checkpoint_interval {checkpoint_interval} is not a multiple of the block size "
                             f"{self.block_size}")
        self.interval, self.enabled = checkpoint_interval, enabled
        self.host_capacity_bytes, self._checkpoint_bytes = host_capacity_bytes, checkpoint_bytes
        self.host_bytes = 0
        self.stats = CacheStats()
        self._entries: dict[int, Checkpoint] = {}          # by id, least recently used first (`_touch`)
        self._aligned: dict[int, Checkpoint] = {}          # chain hash of its full blocks -> checkpoint
        self._tails: dict[int, list[Checkpoint]] = {}      # chain hash of the last full block -> unaligned ones
        # Finished requests: (their checkpoint, all their tokens), for `save`.
        self._by_request: dict[str, tuple[Checkpoint, array]] = {}
        self._sessions: dict[int, Checkpoint] = {}         # handle id -> checkpoint
        self._pending: list[Checkpoint] = []               # reserved, written by a step not yet committed
        self._reserved: list[Checkpoint] = []              # reserved since the last `take_writes`
        self._num_held_slots = 0
        self._block_holds: dict[int, int] = {}             # GPU block -> checkpoints holding it
        self._ids = itertools.count(1)
        self._ops = _OpsBuilder()

    # Lookup ---------------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], salt: str = "") -> Checkpoint | None:
        """The checkpoint of the longest prefix of token_ids that can be restored, within the
        salt's namespace: a prefix shorter than token_ids, or all of it when the checkpoint
        kept the hidden state its next token's logits need."""
        if not self.enabled:
            return None
        key = _tokens(token_ids)
        hashes = self._chain(key, salt)
        for j in range(len(hashes) - 1, -1, -1):
            tails = sorted(self._tails.get(hashes[j], ()), key=lambda c: -c.position)
            candidates = [c for c in tails if c.position <= len(token_ids)]
            aligned = self._aligned.get(hashes[j]) if j else None
            if aligned is not None:
                candidates.append(aligned)
            for c in candidates:
                usable = c.position < len(token_ids) or c.has_hidden
                if usable and c.holds(key[:c.position], salt):
                    self._touch(c)
                    return c
        return None

    def get(self, checkpoint_id: int) -> Checkpoint | None:
        return self._entries.get(checkpoint_id)

    # Writes and adoption ---------------------------------------------------------------------

    def wants_checkpoint(self, position: int, num_known: int) -> bool:
        """Whether a prefill pass through `position` should leave a checkpoint there: every
        interval-th boundary and the end of the known tokens."""
        return self.enabled and position > 0 and (position % self.interval == 0 or position == num_known)

    def reserve_write(self, token_ids: Sequence[int], block_table: Sequence[int], ends_tokens: bool,
                      salt: str = "") -> CheckpointWrite | None:
        """A slot (and, for a position inside a block, a tail block copied after the forward)
        for a checkpoint of token_ids written by this step's forward; None when it is cached
        already or no room can be made. ends_tokens: token_ids are all the sequence's known
        tokens, so the MTP's KV stops one position short (its next token is not known yet)."""
        key = _tokens(token_ids)
        if self._find(key, salt) is not None:
            return None
        position = len(key)
        tail = position % self.block_size != 0
        if not self.make_room(1, int(tail)):
            return None
        slot = self.slots.allocate(1)[0]
        full = position // self.block_size
        blocks = list(block_table[:full])
        self.blocks.share(blocks)
        if tail:  # the sequence goes on writing its last block: the checkpoint gets a copy
            blocks += self.blocks.allocate(1)
            self._ops.tail_copies.append((block_table[full], blocks[-1]))
        mtp_position = position - int(self.mtp and ends_tokens)
        checkpoint = Checkpoint(next(self._ids), key, mtp_position, True, slot, blocks, len(blocks), salt=salt)
        self._hold(checkpoint)
        self._pending.append(checkpoint)
        self._reserved.append(checkpoint)
        return CheckpointWrite(position, slot, ends_tokens)

    def take_writes(self) -> tuple[Checkpoint, ...]:
        """The writes reserved since the last call: the step being planned writes them (its
        StepPlan keeps them, and its commit registers or discards them; with async scheduling
        the next step is planned, and reserves its own, before this one is committed)."""
        writes, self._reserved = tuple(self._reserved), []
        return writes

    @property
    def pending_writes(self) -> tuple[Checkpoint, ...]:
        """Every write reserved and not yet registered or discarded."""
        return tuple(self._pending)

    def register_writes(self, writes: Sequence[Checkpoint]) -> None:
        """The step that wrote these reserved checkpoints ran: make them findable."""
        for checkpoint in writes:
            self._pending.remove(checkpoint)
            if self._find(checkpoint.token_ids, checkpoint.salt) is not None:
                self._drop(checkpoint)  # two rows of one step wrote the same prefix
            else:
                self._insert(checkpoint)

    def discard_writes(self, writes: Sequence[Checkpoint]) -> None:
        """The step that was to write these reserved checkpoints failed: free what they hold."""
        for checkpoint in writes:
            self._pending.remove(checkpoint)
            self._drop(checkpoint)

    def adopt(self, request_id: str, token_ids: Sequence[int], all_token_ids: Sequence[int], mtp_position: int,
              slot: int, blocks: Sequence[int], salt: str = "") -> bool:
        """Take over a finished request's slot and the KV blocks covering token_ids, its
        committed tokens (one reference each), as their checkpoint in the salt's namespace;
        False (nothing taken) when that prefix is cached already. all_token_ids: every token of
        the request, for `save`."""
        if not self.enabled:
            return False  # a cache that is off holds nothing: idle, every slot is free
        key = _tokens(token_ids)
        existing = self._find(key, salt)
        checkpoint = existing or Checkpoint(next(self._ids), key, mtp_position, False, slot, list(blocks),
                                            len(blocks), salt=salt)
        if existing is None:
            self._hold(checkpoint)
            self._insert(checkpoint)
        checkpoint.request_ids.append(request_id)
        self._by_request[request_id] = (checkpoint, _tokens(all_token_ids))
        if len(checkpoint.request_ids) > _MAX_REQUEST_IDS:
            self._by_request.pop(checkpoint.request_ids.pop(0), None)
        return existing is None

    # Restore --------------------------------------------------------------------------------

    def restore_plan(self, checkpoint: Checkpoint, full_hit: bool) -> tuple[int, int, int]:
        """(shared, copied, mtp_position) for restoring `checkpoint`: the sequence shares its
        first `shared` blocks and needs `copied` fresh blocks for the rest of [0, position).
        On a full hit the MTP re-runs position - 1 with the sampled token, so it is behind."""
        mtp_position = checkpoint.mtp_position
        if full_hit and self.mtp:
            mtp_position = min(mtp_position, checkpoint.position - 1)
        if checkpoint.on_host:
            return 0, checkpoint.num_blocks, mtp_position
        first_write = min(checkpoint.position, mtp_position)
        shared = first_write // self.block_size
        return shared, checkpoint.num_blocks - shared, mtp_position

    def restore(self, checkpoint: Checkpoint, dst_slot: int, full_hit: bool) -> tuple[list[int], int]:
        """Plan the copy of `checkpoint` into dst_slot; returns the sequence's block table for
        [0, position) and its mtp_position. The caller made room for the fresh blocks and pins
        the checkpoint until the step ran."""
        shared, copied, mtp_position = self.restore_plan(checkpoint, full_hit)
        fresh = self.blocks.allocate(copied)
        hidden_to_mtp = mtp_position < checkpoint.mtp_position
        if checkpoint.on_host:
            self._ops.restores.append(Restore(dst_slot, None, checkpoint.id, (), tuple(fresh), hidden_to_mtp))
            self.stats.host_restores += 1
            table = fresh
        else:
            self.blocks.share(checkpoint.blocks[:shared])
            self._ops.restores.append(Restore(dst_slot, checkpoint.slot, None,
                                              tuple(zip(checkpoint.blocks[shared:], fresh)), (), hidden_to_mtp))
            table = checkpoint.blocks[:shared] + fresh
        self._touch(checkpoint)
        return table, mtp_position

    def count_admission(self, num_tokens: int, reused: int) -> None:
        """A request started with `reused` of its `num_tokens` tokens restored (the hit rate)."""
        self.stats.prompt_tokens += num_tokens
        self.stats.reused_tokens += reused

    def pin(self, checkpoint: Checkpoint) -> None:
        checkpoint.pins += 1

    def unpin(self, checkpoint: Checkpoint) -> None:
        if checkpoint.pins <= 0:
            raise ValueError(f"checkpoint {checkpoint.id} is not pinned")
        checkpoint.pins -= 1

    def take_ops(self) -> CacheOps:
        if self._ops.empty:
            return _NO_OPS  # most steps: nothing to copy
        ops, self._ops = self._ops.build(), _OpsBuilder()
        return ops

    # Sessions -------------------------------------------------------------------------------

    def save(self, request_id: str) -> CheckpointHandle:
        """Pin the checkpoint of a finished request as a session a later request resumes."""
        checkpoint, all_token_ids = self._by_request.get(request_id, (None, ()))
        if checkpoint is None or checkpoint.id not in self._entries:
            raise ValueError(f"no checkpoint is kept for request {request_id!r} (unknown, evicted, the prefix "
                             f"cache is off, or it finished before any token was committed)")
        checkpoint.sessions += 1
        self.pin(checkpoint)
        handle = CheckpointHandle(next(self._ids), tuple(all_token_ids), self.release)
        self._sessions[handle.handle_id] = checkpoint
        return handle

    def session(self, handle: CheckpointHandle) -> Checkpoint:
        """The checkpoint of a saved session (ValueError once it is released)."""
        checkpoint = self._sessions.get(handle.handle_id) if isinstance(handle, CheckpointHandle) else None
        if checkpoint is None:
            raise ValueError("resume_from is not a saved session (or it was released)")
        return checkpoint

    def release(self, handle: CheckpointHandle) -> None:
        checkpoint = self.session(handle)
        del self._sessions[handle.handle_id]
        checkpoint.sessions -= 1
        self.unpin(checkpoint)

    # Memory ---------------------------------------------------------------------------------

    def make_room(self, num_slots: int, num_blocks: int) -> bool:
        """Evict least-recently-used checkpoints until the allocators can hand out num_slots
        slots and num_blocks blocks; False when the unpinned ones do not free enough."""
        kept: set[int] = set()  # sessions the host tier turned out to have no room for
        while not (self.slots.can_allocate(num_slots) and self.blocks.can_allocate(num_blocks)):
            victim = self._victim(kept)
            if victim is None:
                return False
            if not self._evict(victim):
                kept.add(victim.id)
        return True

    def clear(self, reset_stats: bool = False) -> None:
        """Drop every checkpoint nobody pins (GPU and host); reset_stats: and zero the counters."""
        for checkpoint in [c for c in self._entries.values() if c.pins == 0]:
            self._remove(checkpoint)
        if reset_stats:
            self.stats = CacheStats()

    @property
    def num_gpu_checkpoints(self) -> int:
        """Registered checkpoints on the GPU: each holds a slot, as each pending write does."""
        return self._num_held_slots - len(self._pending)

    @property
    def num_host_checkpoints(self) -> int:
        return len(self._entries) - self.num_gpu_checkpoints

    @property
    def num_held_slots(self) -> int:
        """Slots the checkpoints on the GPU hold (pending writes included)."""
        return self._num_held_slots

    @property
    def num_held_blocks(self) -> int:
        """Distinct KV blocks they hold: counted as they come and go, not gathered (a scrape of
        the metrics asks, and thousands of checkpoints hold hundreds of thousands of blocks)."""
        return len(self._block_holds)

    def stats_dict(self) -> dict:
        s = self.stats
        return {"enabled": self.enabled, "gpu_checkpoints": self.num_gpu_checkpoints,
                "host_checkpoints": self.num_host_checkpoints, "host_bytes": self.host_bytes,
                "pinned": sum(c.pins > 0 for c in self._entries.values()),
                "prompt_tokens": s.prompt_tokens, "reused_tokens": s.reused_tokens,
                "hit_rate": s.reused_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "evictions": s.evictions, "offloads": s.offloads, "host_restores": s.host_restores}

    # Internals ------------------------------------------------------------------------------

    def _chain(self, token_ids: Sequence[int], salt: str) -> list[int]:
        """hashes[j]: chain hash of the first j full blocks (hashes[0] the root, the salt's)."""
        hashes = [hash((_ROOT_HASH, salt)) if salt else _ROOT_HASH]
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            hashes.append(hash((hashes[-1], tuple(token_ids[start:start + self.block_size]))))
        return hashes

    def _find(self, key: array, salt: str) -> Checkpoint | None:
        hashes = self._chain(key, salt)
        full = len(key) // self.block_size
        if len(key) % self.block_size == 0:
            found = self._aligned.get(hashes[full])
            return found if found is not None and found.holds(key, salt) else None
        return next((c for c in self._tails.get(hashes[full], ()) if c.holds(key, salt)), None)

    def _touch(self, checkpoint: Checkpoint) -> None:
        """Make it the most recently used: the last of `_entries`."""
        self._entries[checkpoint.id] = self._entries.pop(checkpoint.id)

    def _insert(self, checkpoint: Checkpoint) -> None:
        self._entries[checkpoint.id] = checkpoint
        hashes = self._chain(checkpoint.token_ids, checkpoint.salt)
        full = checkpoint.position // self.block_size
        if checkpoint.position % self.block_size == 0:
            self._aligned[hashes[full]] = checkpoint
        else:
            self._tails.setdefault(hashes[full], []).append(checkpoint)

    def _victim(self, kept: set[int]) -> Checkpoint | None:
        """The least recently used GPU checkpoint that may leave the GPU: unpinned, or a
        session (pinned by its handles alone) when the host tier could take it."""
        return next((c for c in self._entries.values() if not c.on_host and c.id not in kept
                     and (c.pins == 0 or (c.pins == c.sessions and self._host_fits(c)))), None)

    def _host_fits(self, checkpoint: Checkpoint) -> bool:
        return self._checkpoint_bytes(checkpoint.num_blocks) <= self.host_capacity_bytes

    def _evict(self, checkpoint: Checkpoint) -> bool:
        """Move a checkpoint to the host tier, or drop it; False when it is a session the host
        tier has no room for (it stays)."""
        size = self._checkpoint_bytes(checkpoint.num_blocks)
        if self._host_fits(checkpoint):
            while self.host_bytes + size > self.host_capacity_bytes:
                oldest = next((c for c in self._entries.values() if c.on_host and c.pins == 0), None)
                if oldest is None:
                    break
                self._remove(oldest)
            if self.host_bytes + size <= self.host_capacity_bytes:
                self._ops.offloads.append(Offload(checkpoint.id, checkpoint.slot, tuple(checkpoint.blocks)))
                self._release_gpu(checkpoint)
                checkpoint.on_host = True
                self.host_bytes += size
                self.stats.offloads += 1
                self.stats.evictions += 1
                return True
        if checkpoint.pins:
            return False
        self._remove(checkpoint)
        self.stats.evictions += 1
        return True

    def _hold(self, checkpoint: Checkpoint) -> None:
        """Count the slot and blocks of a checkpoint on the GPU (`num_held_slots`, `num_held_blocks`)."""
        self._num_held_slots += 1
        for block in checkpoint.blocks:
            self._block_holds[block] = self._block_holds.get(block, 0) + 1

    def _release_gpu(self, checkpoint: Checkpoint) -> None:
        self.slots.free([checkpoint.slot])
        self.blocks.free(checkpoint.blocks)
        self._num_held_slots -= 1
        for block in checkpoint.blocks:
            if self._block_holds[block] == 1:
                del self._block_holds[block]
            else:
                self._block_holds[block] -= 1
        checkpoint.slot, checkpoint.blocks = None, []

    def _remove(self, checkpoint: Checkpoint) -> None:
        """Forget a registered checkpoint and free what it holds."""
        del self._entries[checkpoint.id]
        hashes = self._chain(checkpoint.token_ids, checkpoint.salt)
        full = checkpoint.position // self.block_size
        if checkpoint.position % self.block_size == 0:
            del self._aligned[hashes[full]]
        else:
            self._tails[hashes[full]].remove(checkpoint)
            if not self._tails[hashes[full]]:
                del self._tails[hashes[full]]
        for request_id in checkpoint.request_ids:
            self._by_request.pop(request_id, None)
        self._drop(checkpoint)

    def _drop(self, checkpoint: Checkpoint) -> None:
        if checkpoint.on_host:
            self.host_bytes -= self._checkpoint_bytes(checkpoint.num_blocks)
            self._ops.host_drops.append(checkpoint.id)
        else:
            self._release_gpu(checkpoint)


@dataclass
class _OpsBuilder:
    offloads: list[Offload] = field(default_factory=list)
    host_drops: list[int] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    tail_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.offloads or self.host_drops or self.restores or self.tail_copies)

    def build(self) -> CacheOps:
        return CacheOps(tuple(self.offloads), tuple(self.host_drops), tuple(self.restores), tuple(self.tail_copies))


_NO_OPS = CacheOps()
