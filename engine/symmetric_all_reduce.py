"""All-reduce of small messages through symmetric memory: NVLink peer loads instead of NCCL.

Each rank allocates one buffer with torch's symmetric memory (`torch.distributed.
_symmetric_memory`), mapped into every peer's address space. An all-reduce of x copies x into
this rank's buffer, then torch's kernel, reading the peers' buffers directly, sums into x:

- one_shot (`symm_mem::one_shot_all_reduce_out`): meets every peer at a barrier, then sums all
  tp buffers. Each rank reads the whole message from every peer: the least latency (one barrier
  before the sum), the most traffic; what small decode messages want.
- two_shot (`symm_mem::two_shot_all_reduce_out`): each rank sums its 1/tp of the message from
  every peer into its own buffer (reduce-scatter), a barrier, then gathers every rank's sums:
  2 (tp - 1) / tp of the message moved per rank, two rounds (the same traffic at tp = 2).

- all_reduce_rms_norm (kernels/all_reduce_norm.py): copy + one_shot + residual add + RMSNorm in
  one Triton kernel, for the all-reduces a norm follows (every mixer's and MLP's output): one
  launch instead of three, the buffers and signal pads addressed through the handle.

The copy is a kernel of its own, not `one_shot_all_reduce_copy_out`'s fused copy: that kernel
signals its peers from a block's first threads right after their own copies, with no
__syncthreads before (torch's own comments on sync_remote_blocks ask for one), so a peer may
read elements the block's other warps have not stored yet. A kernel boundary orders them all.

Reusing the buffer at once is safe: both kernels also end at a barrier, so a rank leaves an
all-reduce only when every peer has finished reading its buffer, and the next all-reduce (the
next layer's, or the next replay of a CUDA graph) may overwrite it. The barriers are flags in
the peers' signal pads, set by one rank and cleared by the other, so they pair up across any
number of replays with no host work (capturable). The bfloat16 sum is in bfloat16, in rank
order: at tp = 2 it is NCCL's sum bit for bit (one correctly rounded addition). The fused
kernel sums in float32 in rank order and rounds once: the same at tp = 2, and the same bits on
every rank at any tp.

The barriers spin with no timeout: a peer that died leaves this rank's kernel spinning, which
aborting NCCL does not end. `stand_in_for_peers` ends it by writing the dead peers' flags.
NVLink multicast is never used (no multimem ops; TensorParallel sets
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before any symmetric memory exists). Knows nothing about
models or steps: TensorParallel picks this path by message size and dtype.
"""

from __future__ import annotations

import threading
import time
import uuid

import torch
import torch.distributed as dist

from ..kernels.all_reduce_norm import all_reduce_rms_norm

ALGORITHMS = ("one_shot", "two_shot")
DTYPES = (torch.bfloat16, torch.float32)  # what torch's kernels sum
_OPS = {"one_shot": "one_shot_all_reduce_out", "two_shot": "two_shot_all_reduce_out"}  # (input, op, group, out)
STAND_IN_TIMEOUT_S = 8.0  # below executor.ABORT_TIMEOUT_S, which the engine's close waits for
_GROUP_NAME_KEY = "deltaspec/symmetric_memory_group"
# Every buffer lives as long as the process: freeing one synchronizes the device (torch's
# allocator), which would hang on a kernel still spinning for a dead peer and is illegal while
# a CUDA graph captures (a collected engine's buffer could be freed then). One small buffer per
# tensor-parallel engine a process starts.
_KEEP_ALIVE: list[torch.Tensor] = []


def register_group(store: dist.Store, rank: int, size: int) -> str:
    """Name the default process group's ranks, meeting at `store`, for symmetric memory
    (collective: every rank). Not by the group's own name: that ("0") repeats for every engine
    a process starts, and torch versions that keep a store per name (set_group_info) keep the
    first for the life of the process and refuse a second. So a name of this group only, drawn
    by rank 0 and read by the others from the store, given this group's store (those versions)
    and registered as an alias of the process group (versions that resolve the name to it)."""
    from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

    if rank == 0:
        store.set(_GROUP_NAME_KEY, f"deltaspec-{uuid.uuid4().hex}")
    name = store.get(_GROUP_NAME_KEY).decode()
    if hasattr(_SymmetricMemory, "set_group_info"):
        _SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore(name + "/", store))
    _register_process_group(name, dist.group.WORLD)
    return name


def unavailable(algorithm: str, dtype: torch.dtype, size: int, device: torch.device,
                peer_devices: list[int]) -> str | None:
    """Why this rank cannot all-reduce through symmetric memory, found without any collective
    (None: it can)."""
    if device.type != "cuda":
        return "not on CUDA"
    if dtype not in DTYPES:
        return f"its kernels sum bfloat16 and float32, not {dtype}"
    if algorithm == "two_shot" and size not in (2, 4, 8):
        return f"two_shot runs on 2, 4 or 8 ranks, not {size}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as error:
        return f"torch {torch.__version__} has no symmetric memory ({error})"
    if not hasattr(torch.ops.symm_mem, _OPS[algorithm]):
        return f"torch {torch.__version__} has no symm_mem::{_OPS[algorithm]}"
    blocked = [p for p in peer_devices if not torch.cuda.can_device_access_peer(device, p)]
    if blocked:
        return f"cuda:{device.index} cannot access the memory of cuda:{', cuda:'.join(map(str, blocked))}"
    return None


def _alignment(num_bytes: int) -> int:
    """The vector width torch's kernels use for a size or offset: the largest of 16, 8, 4, 2, 1
    dividing it (16 for 0)."""
    return min(16, num_bytes & -num_bytes) if num_bytes else 16


class SymmetricAllReduce:
    """One rank's symmetric buffer of `capacity` elements of `dtype` and the all-reduce through it."""

    def __init__(self, algorithm: str, buffer: torch.Tensor, handle, group_name: str) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        self.algorithm, self.buffer, self.handle, self.group_name = algorithm, buffer, handle, group_name
        self.dtype, self.capacity = buffer.dtype, buffer.numel()
        self.rank, self.size = handle.rank, handle.world_size
        self._op = getattr(torch.ops.symm_mem, _OPS[algorithm])
        # For the fused kernel: every rank's buffer and signal pad as this process maps them (the
        # handle's pointers are the allocations' starts; the buffer sits at the same offset in
        # each), and the pads' slots per rank (int32 flags [slot, rank]).
        offset = buffer.data_ptr() - handle.buffer_ptrs[self.rank]
        self.peer_buffers = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64,
                                         device=buffer.device)
        self.peer_signal_pads = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=buffer.device)
        self.num_slots = handle.signal_pad_size // 4 // self.size

    @classmethod
    def create(cls, algorithm: str, dtype: torch.dtype, capacity: int, device: torch.device,
               group_name: str) -> "SymmetricAllReduce":
        """Allocate and rendezvous this rank's buffer (collective: every rank of the group, in
        the same order). Raises what torch raises when the memory cannot be shared."""
        from torch._C._distributed_c10d import _SymmetricMemory
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(capacity, dtype=dtype, device=device)
        _KEEP_ALIVE.append(buffer)
        # torch's own rendezvous, not the Python wrapper: some versions' wrapper registers the
        # name as a process group's, which this group's name (register_group) is not.
        handle = _SymmetricMemory.rendezvous(buffer, group_name)
        return cls(algorithm, buffer, handle, group_name)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x can take this path: its dtype, at most `capacity` elements, contiguous, and
        aligned as the kernels need (x's offset at least as aligned as its size, which the
        buffer's start is; a size of a multiple of 4 bytes). Every rank decides alike: the
        same step computes the same shapes."""
        num_bytes = x.numel() * x.element_size()
        return (x.dtype == self.dtype and 0 < x.numel() <= self.capacity and x.is_contiguous()
                and _alignment(num_bytes) >= 4
                and _alignment(x.storage_offset() * x.element_size()) >= _alignment(num_bytes))

    def fits_rows(self, x: torch.Tensor) -> bool:
        """Whether x [T, H] can take the fused all-reduce + RMSNorm: its dtype, at most `capacity`
        elements, unit stride along H, rows of whole 16-byte words (the kernel's vectors; the
        buffer starts 16-byte aligned). Every rank decides alike."""
        return (x.dim() == 2 and x.dtype == self.dtype and 0 < x.numel() <= self.capacity and x.stride(1) == 1
                and x.shape[1] * x.element_size() % 16 == 0)

    def all_reduce_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum of x over the ranks + residual), the new residual) in one kernel
        (kernels/all_reduce_norm.py; x must fit_rows). x itself is left as it was."""
        return all_reduce_rms_norm(x, weight, eps, residual, self.peer_buffers, self.peer_signal_pads, self.rank,
                                   self.capacity, self.num_slots)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x must fit); returns x."""
        flat = x.view(-1)
        staged = self.buffer[:flat.numel()]
        staged.copy_(flat)
        self._op(staged, "sum", self.group_name, flat)  # peers read `staged`, never x
        return x

    def stand_in_for_peers(self, timeout_s: float = STAND_IN_TIMEOUT_S) -> bool:
        """Release this rank's kernels waiting for peers that will never come (a peer died; the
        engine is ending): until the device is idle, keep writing what every peer would write at
        a barrier: its flag in this rank's signal pad set (slot [block, peer]) and this rank's
        flag in its pad cleared (slot [block, rank]: consumed). The kernels then run to their
        end on whatever the buffers hold. Returns whether the device became idle in time."""
        flags = [self.num_slots * self.size]
        own = self.handle.get_signal_pad(self.rank, flags, dtype=torch.int32).view(-1, self.size)
        peers = [p for p in range(self.size) if p != self.rank]
        theirs = [self.handle.get_signal_pad(p, flags, dtype=torch.int32).view(-1, self.size)[:, self.rank]
                  for p in peers]
        idle = threading.Event()

        def wait_for_device() -> None:
            torch.cuda.synchronize(self.device)  # every stream's work issued so far
            idle.set()

        threading.Thread(target=wait_for_device, name="deltaspec-symm-drain", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.Stream(self.device)):
            while not idle.wait(0.002) and time.monotonic() < deadline:
                for peer, pad in zip(peers, theirs):
                    own[:, peer].fill_(1)
                    pad.fill_(0)
        return idle.is_set()

    @property
    def device(self) -> torch.device:
        return self.buffer.device
