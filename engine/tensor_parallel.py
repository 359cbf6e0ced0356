"""A rank's view of the tensor-parallel group: who it is, and the two collectives the model needs.

Every rank holds a shard of each layer (engine/sharding.py) and runs the same step on the same
(replicated) tokens. Row-parallel outputs are partial sums, `all_reduce`d in place; the
vocabulary-parallel logits are `gather_logits`ed so every rank holds the full [N, V] logits and
samples the same tokens with the same seeds: no rank ever waits for another's sampled tokens.
Both are plain torch.distributed collectives (NCCL on CUDA, capturable in CUDA graphs; gloo on
the CPU). Knows nothing about models, processes or steps.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# A collective waits at most this long for a peer: a rank that never comes is an error, not a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("DELTASPEC_COLLECTIVE_TIMEOUT_S", "120")))


class TensorParallel:
    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device

    @classmethod
    def join(cls, rank: int, size: int, device: torch.device, store: dist.Store) -> "TensorParallel":
        """Join the group as `rank` (the default process group of this process), meeting the
        other ranks at `store` (rank 0's TCPStore)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see bench/tp_scaling.py)
            # Rank 0's monitor owns failures: it aborts the group when a worker dies (executor.py),
            # and torch asks for its watchdog's own error handling off with that abort (else the
            # watchdog may tear the process down first: the server would die instead of raising).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                                **({"device_id": device} if device.type == "cuda" else {}))
        group = cls(rank, size, device)
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

    def leave(self) -> None:
        """Leave the group (idempotent: a group the monitor aborted is already gone). NCCL:
        abort this rank's communicators. destroy_process_group would finalize them, and a
        finalize waits until every peer has finalized too: a peer that is gone, or that rank 0
        stops only after it has left, hangs it for good (4 H200s, f2c4306: both the killed-worker
        test and a plain shutdown). An abort is local. gloo: destroy, which is local there."""
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()

    def split(self, total: int) -> tuple[int, int]:
        """This rank's (start, size) of `total` items split evenly (total % size == 0)."""
        share = total // self.size
        return self.rank * share, share

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        dist.all_reduce(x)
        return x

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
        x = torch.nn.functional.embedding(torch.where(inside, local, 0), shard)
        return self.all_reduce(x * inside[:, None].to(x.dtype))


# torch >= 2.10 names the flat all-gather all_gather_single (the old name warns).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
