"""Pure-Python bookkeeping of the two pooled resources: recurrent-state slots and KV blocks.

Never touches a tensor. Checks and actions come in pairs (`can_allocate` / `allocate`).
Slot 0 and block 0 are scratch reserved for padding rows: they are never handed out, so a
padding row can never alias a real sequence. KV blocks are refcounted: a full block of a cached
prefix is shared, read-only, by the prefix cache and every request that restored it.
"""

from __future__ import annotations

from typing import Sequence


class PoolExhausted(RuntimeError):
    """allocate() without a successful can_allocate()."""


class _FreeList:
    def __init__(self, capacity: int, what: str) -> None:
        if capacity < 2:
            raise ValueError(f"a {what} pool needs at least 2 entries (entry 0 is scratch), got {capacity}")
        self.capacity = capacity
        self._what = what
        # LIFO keeps recently used entries warm; entry 0 is never in the list.
        self._free = list(range(capacity - 1, 0, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise PoolExhausted(f"asked for {n} {self._what}s, {len(self._free)} free")
        taken = [self._free.pop() for _ in range(n)]
        self._used.update(taken)
        return taken

    def free(self, entries: Sequence[int]) -> None:
        for e in entries:
            if e not in self._used:
                raise ValueError(f"{self._what} {e} is not allocated")
            self._used.remove(e)
            self._free.append(e)


class SlotAllocator(_FreeList):
    """Recurrent-state slots; a running sequence keeps its slot for its whole life."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, "slot")


class BlockAllocator(_FreeList):
    """Fixed-size KV blocks; a sequence's blocks are listed in its block table. Each holder of
    a block owns one reference; `free` drops one and the block returns to the free list when
    none are left."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, "KV block")
        self.block_size = block_size
        self._refs: dict[int, int] = {}

    def allocate(self, n: int) -> list[int]:
        taken = super().allocate(n)
        self._refs.update((b, 1) for b in taken)
        return taken

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each (allocated) block."""
        for b in blocks:
            if b not in self._refs:
                raise ValueError(f"KV block {b} is not allocated")
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b not in self._refs:
                raise ValueError(f"KV block {b} is not allocated")
        released = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                released.append(b)
        super().free(released)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
