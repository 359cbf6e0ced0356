"""A rank's view of the tensor-parallel group: who it is, and the two collectives the model needs.

Every rank holds a shard of each layer (engine/sharding.py) and runs the same step on the same
(replicated) tokens. Row-parallel outputs are partial sums, `all_reduce`d in place; the
vocabulary-parallel logits are `gather_logits`ed so every rank holds the full [N, V] logits and
samples the same tokens with the same seeds: no rank ever waits for another's sampled tokens.
Both are torch.distributed collectives (NCCL on CUDA, capturable in CUDA graphs; gloo on the
CPU), except all-reduces of messages up to the decode steps' largest, which go through
symmetric memory on GPUs where it works (symmetric_all_reduce.py: `use_symmetric_memory`).
A block output the model norms next goes through `all_reduce_rms_norm`: one fused kernel where
the message fits the symmetric buffer (all_reduce "auto"), else the all-reduce, then the norm.
Knows nothing about models, processes or steps.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Callable

import torch
import torch.distributed as dist

from ..kernels.quantize import Activation
from . import symmetric_all_reduce
from .symmetric_all_reduce import SymmetricAllReduce

logger = logging.getLogger("deltaspec")

# A collective waits at most this long for a peer: a rank that never comes is an error, not a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("DELTASPEC_COLLECTIVE_TIMEOUT_S", "120")))


class TensorParallel:
    def __init__(self, rank: int, size: int, device: torch.device, store: dist.Store | None = None) -> None:
        self.rank, self.size, self.device, self.store = rank, size, device, store
        # The all-reduce of small messages through symmetric memory (None: every one through NCCL / gloo).
        self.symmetric: SymmetricAllReduce | None = None
        # Whether all_reduce_rms_norm fuses the messages that fit the symmetric buffer into one kernel.
        self.fuse_norm = False

    @classmethod
    def join(cls, rank: int, size: int, device: torch.device, store: dist.Store) -> "TensorParallel":
        """Join the group as `rank` (the default process group of this process), meeting the
        other ranks at `store` (rank 0's TCPStore)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # NVLink multicast off, NCCL's and symmetric memory's (before any is created): the
            # lent GPU hosts forbid it, and nothing here uses it.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            # Rank 0's monitor owns failures: it aborts the group when a worker dies (executor.py),
            # and torch asks for its watchdog's own error handling off with that abort (else the
            # watchdog may tear the process down first: the server would die instead of raising).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                                **({"device_id": device} if device.type == "cuda" else {}))
        group = cls(rank, size, device, store)
        if device.type == "cuda":
            group.connect()
        return group

    def connect(self) -> None:
        """Run the model's collectives once at small, medium and large sizes. NCCL connects its
        peers lazily, per algorithm and protocol (LL for small messages, LL128, Simple for
        large), on a collective's first call, and allocates those connections' buffers then:
        now, before the pools are sized from the free memory, and before any CUDA graph is
        captured (a capture must not be the first call of anything)."""
        for numel in (1 << 4, 1 << 14, 1 << 22):  # 32 B, 32 KiB and 8 MiB of bf16
            x = torch.ones(numel, dtype=torch.bfloat16, device=self.device)
            self.all_reduce(x)
            _all_gather(x.new_empty(self.size * numel), x)
        torch.cuda.synchronize(self.device)

    def use_symmetric_memory(self, choice: str, dtype: torch.dtype, max_tokens: int, hidden_size: int) -> None:
        """All-reduce messages of `dtype` up to [max_tokens, hidden_size] through symmetric memory
        (collective: every rank, in the same order, before any CUDA graph is captured). choice
        (EngineConfig.all_reduce): "nccl" keeps NCCL; "auto" is one_shot, with the all-reduces a
        norm follows fused with it (`all_reduce_rms_norm`); "one_shot" / "two_shot": torch's
        kernel, the norm apart. On the CPU nothing changes. Where it cannot be used on some rank
        (no peer access, a dtype its kernels do not sum, torch without it, a failed rendezvous, a
        check all-reduce that fails or whose sum differs from NCCL's) every rank logs why and
        keeps NCCL: start-up never fails for it. Every rank decides alike: the ranks agree (a
        minimum over ranks) before each collective step."""
        if choice == "nccl" or self.device.type != "cuda":
            return
        algorithm = "one_shot" if choice == "auto" else choice
        fuse_norm = choice == "auto"
        # Rank r runs on cuda:(i + r) (executor.rank_device).
        peers = [self.device.index + p - self.rank for p in range(self.size) if p != self.rank]
        reason = symmetric_all_reduce.unavailable(algorithm, dtype, self.size, self.device, peers)
        symmetric = None
        if self.min_over_ranks(int(reason is None)):
            try:
                group_name = symmetric_all_reduce.register_group(self.store, self.rank, self.size)
                symmetric = SymmetricAllReduce.create(algorithm, dtype, max_tokens * hidden_size, self.device,
                                                      group_name)
            except Exception as error:  # noqa: BLE001 - any failure keeps NCCL, named in the log
                reason = f"setting it up failed ({type(error).__name__}: {error})"
            if not self.min_over_ranks(int(symmetric is not None)):
                symmetric = None
            else:
                try:  # a kernel that fails (the fused one's compile) fails alike on every rank
                    same = self._sums_like_nccl(symmetric, hidden_size if fuse_norm else 0)
                except Exception as error:  # noqa: BLE001 - keeps NCCL, named in the log
                    same, reason = False, f"its check all-reduce failed ({type(error).__name__}: {error})"
                if not self.min_over_ranks(int(same)):
                    symmetric, reason = None, reason or "its check all-reduce differed from NCCL's on some rank"
        if symmetric is None:
            # Once from rank 0 (the server's log), and from any other rank that found the reason.
            if reason is not None or self.rank == 0:
                logger.warning("all-reduce: NCCL only, not %s through symmetric memory: %s", algorithm,
                               reason or "another rank cannot use it (its log says why)")
            return
        self.symmetric, self.fuse_norm = symmetric, fuse_norm
        logger.info("all-reduce: %s through symmetric memory up to %d KiB of %s%s, NCCL above", algorithm,
                    symmetric.capacity * symmetric.buffer.element_size() >> 10, str(dtype).removeprefix("torch."),
                    " (fused with the residual add + RMSNorm after it)" if fuse_norm else "")

    def _sums_like_nccl(self, symmetric: SymmetricAllReduce, hidden_size: int) -> bool:
        """The symmetric all-reduce of random integers (exact sums in any order) equals NCCL's,
        at the buffer's full size and a small one; with hidden_size, the fused kernel's new
        residual too (sum + residual) at its full and one-row sizes."""
        device = symmetric.buffer.device
        generator = torch.Generator(device=device).manual_seed(1234 + self.rank)

        def integers(*shape: int) -> torch.Tensor:
            return torch.randint(-8, 9, shape, generator=generator, device=device).to(symmetric.dtype)

        def nccl_sum(x: torch.Tensor) -> torch.Tensor:
            expected = x.clone()
            dist.all_reduce(expected)
            return expected

        for numel in sorted({symmetric.capacity, min(symmetric.capacity, 1024)}):
            x = integers(numel)
            if not torch.equal(symmetric(x.clone()), nccl_sum(x)):
                return False
        if hidden_size:
            weight = torch.zeros(hidden_size, dtype=symmetric.dtype, device=device)
            for rows in sorted({1, symmetric.capacity // hidden_size}):
                x, residual = integers(rows, hidden_size), integers(rows, hidden_size)
                _, new_residual = symmetric.all_reduce_rms_norm(x, weight, 1e-6, residual)
                if not torch.equal(new_residual, nccl_sum(x) + residual):
                    return False
        return True

    @property
    def all_reduce_kind(self) -> str:
        """The path small all-reduces take: "one_shot" or "two_shot" (symmetric memory; with
        "+rms_norm" where those a norm follows are fused with it), else the process group's
        backend ("nccl", "gloo")."""
        if self.symmetric is None:
            return dist.get_backend()
        return self.symmetric.algorithm + ("+rms_norm" if self.fuse_norm else "")

    def abort(self) -> None:
        """A peer died: end this rank's collectives in flight (their results are garbage; the
        engine is ending). NCCL: abort the communicators. Symmetric memory: its kernels spin for
        the dead peer with no timeout, so stand in for the peers until the device is idle. Both
        at once: a collective of either kind may wait on the stream behind one of the other."""
        stand_in = None
        if self.symmetric is not None:
            stand_in = threading.Thread(target=self._stand_in_for_peers, name="deltaspec-symm-stand-in", daemon=True)
            stand_in.start()
        try:
            abort_nccl()
        finally:
            if stand_in is not None:
                stand_in.join()

    def _stand_in_for_peers(self) -> None:
        try:
            if self.symmetric.stand_in_for_peers():
                return
            logger.error("the symmetric-memory all-reduce still waits for a dead peer after %.0f s; this process's "
                         "GPU work ends when it exits", symmetric_all_reduce.STAND_IN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - best effort, in a thread of its own: say why
            logger.exception("could not stand in for the dead peer at the symmetric-memory barriers")

    def leave(self) -> None:
        """Leave the group (idempotent: a group the monitor aborted is already gone), after this
        rank's CUDA graphs are destroyed (core._release): NCCL's abort and destroy both wait
        for good while a graph that captured the group's collectives exists (4 H200s, 76de151:
        every rank hung in either; with the graphs gone both took under 0.6 s). NCCL: abort
        this rank's communicators, which does not wait for a peer that is gone. gloo: destroy,
        which is local there. Symmetric memory: nothing (its buffer stays mapped until the
        process exits)."""
        if not abort_nccl() and dist.is_initialized():
            dist.destroy_process_group()

    def split(self, total: int) -> tuple[int, int]:
        """This rank's (start, size) of `total` items split evenly (total % size == 0)."""
        share = total // self.size
        return self.rank * share, share

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x. Through symmetric memory when it fits
        there (the decode and speculative steps' messages), else NCCL (prefill chunks) or gloo."""
        if self.symmetric is not None and self.symmetric.fits(x):
            return self.symmetric(x)
        dist.all_reduce(x)
        return x

    def all_reduce_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                            rms_norm: Callable, quantize_group: int = 0) -> tuple[Activation, torch.Tensor]:
        """rms_norm(x summed over the ranks, weight, eps, residual) -> (normed, new residual): a
        row-parallel block's output and the residual add + RMSNorm after it. One kernel through
        symmetric memory where the message fits there and the setting fuses ("auto": decode and
        speculative steps); else `all_reduce` (x summed in place) then rms_norm (Ops.rms_norm),
        as two steps. Every rank takes the same path: the same step has the same shapes.
        quantize_group goes to rms_norm; the one kernel does not quantize (its normed comes plain
        and the FP8 projections after it quantize it themselves)."""
        if self.fuse_norm and self.symmetric.fits_rows(x):
            return self.symmetric.all_reduce_rms_norm(x, weight, eps, residual)
        return rms_norm(self.all_reduce(x), weight, eps, residual, quantize_group=quantize_group)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (the grammar masks only rank 0 can compute)."""
        dist.broadcast(x, src=0)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (pool sizes: every rank's pools must match)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_logits(self, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Vocabulary shards [N, V / tp] of every rank -> the full logits [N, V], into `out`
        when given. One all-gather into [tp, N, V / tp], then one copy into vocabulary order."""
        parts = local.new_empty((self.size * local.shape[0], local.shape[1]))
        _all_gather(parts, local.contiguous())
        full = parts.view(self.size, *local.shape).permute(1, 0, 2).reshape(local.shape[0], self.size * local.shape[1])
        if out is None:
            return full
        return out.copy_(full)

    def embed(self, ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding: each rank looks up the ids in its shard [V / tp, H]
        (zeros for ids outside it) and the sum over ranks is every id's row."""
        start = self.rank * shard.shape[0]
        local = ids - start
        inside = (local >= 0) & (local < shard.shape[0])
        x = shard[torch.where(inside, local, 0)]  # indexing, not F.embedding: models/hybrid.py
        return self.all_reduce(x * inside[:, None].to(x.dtype))


def abort_nccl() -> bool:
    """Abort this process's NCCL communicators, if it has an NCCL group (which the abort also
    unregisters); returns whether it had one. Local: no peer takes part, so none can hang it."""
    if not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return False
    dist.distributed_c10d._abort_process_group()
    return True


# torch >= 2.10 names the flat all-gather all_gather_single (the old name warns).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
