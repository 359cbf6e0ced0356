"""A read-only streaming kernel: the cheapest thing a launch can do with N bytes of device
memory. bench/decode_floor.py launches it over the bytes a decode step reads to measure what
any kernel sequence of that shape can reach.

`stream_read(words, partials, config)` reads every int32 word of `words` once and stores, per
program p of P, the wrapping int32 sum of the BLOCK-word tiles p, p + P, p + 2P, ... in
partials[p]. The sums exist only so the compiler cannot drop the loads; nothing else is
written. Tiles start at multiples of BLOCK words, so on a 16-byte-aligned `words` whose length
is a multiple of 16 the loads are 16-byte vectors. With `dependent_launch` the kernel starts
with the engine's PDL prologue (kernels/launch.py): it may be scheduled while its predecessor
runs, and waits on-chip for it before loading, as the engine's decode kernels do.
`stream_read_reference` is its torch oracle. Knows nothing about models or what the bytes hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaspec.kernels.launch import dependent_prologue


@dataclass(frozen=True)
class ReadConfig:
    """Tile and grid of a stream_read launch: block words per tile, num_warps per program, at
    most programs_per_sm programs per SM (each loops over its tiles)."""

    block: int = 2048
    num_warps: int = 4
    programs_per_sm: int = 4

    def __post_init__(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {self.block}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.programs_per_sm < 1:
            raise ValueError(f"num_warps must be a power of two <= 16 and programs_per_sm >= 1: {self}")

    def num_programs(self, num_words: int, num_sms: int) -> int:
        """Programs of a launch over num_words words: one per tile, at most programs_per_sm per SM."""
        return max(1, min(triton.cdiv(num_words, self.block), self.programs_per_sm * num_sms))


def stream_read_reference(words: torch.Tensor, num_programs: int, block: int) -> torch.Tensor:
    """words [N] int32 -> partials [num_programs] int32: program p's wrapping sum of the tiles
    p, p + num_programs, ... of `block` words (the last tile zero-padded)."""
    tiles = F.pad(words.long(), (0, -words.numel() % block)).view(-1, block).sum(dim=1)
    owner = torch.arange(tiles.numel(), device=words.device) % num_programs
    sums = torch.zeros(num_programs, dtype=torch.int64, device=words.device).index_add_(0, owner, tiles)
    return ((sums + 2**31) % 2**32 - 2**31).to(torch.int32)


@triton.jit
def _stream_read_kernel(words, partials, num_words, BLOCK: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program p of P: partials[p] = sum of tiles p, p + P, ... (int32, wrapping)."""
    dependent_prologue(DEPENDENT_LAUNCH)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for tile in range(tl.program_id(0), tl.cdiv(num_words, BLOCK), tl.num_programs(0)):
        index = tl.multiple_of(tile * BLOCK, BLOCK) + offsets
        acc += tl.load(words + index, mask=index < num_words, other=0)
    tl.store(partials + tl.program_id(0), tl.sum(acc, axis=0))


def stream_read(words: torch.Tensor, partials: torch.Tensor, config: ReadConfig, dependent_launch: bool) -> None:
    """Read words [N] int32 once; partials [P] int32 (P programs) get the tile sums (see the
    module docstring). dependent_launch: launch with PDL (sm_90+, not the interpreter)."""
    if words.dtype != torch.int32 or partials.dtype != torch.int32 or words.dim() != 1 or partials.dim() != 1:
        raise ValueError(f"words and partials must be 1-D int32, got {words.dtype} {tuple(words.shape)} and "
                         f"{partials.dtype} {tuple(partials.shape)}")
    if not words.is_contiguous() or not partials.is_contiguous() or words.device != partials.device:
        raise ValueError("words and partials must be contiguous and on one device")
    if words.numel() == 0 or partials.numel() == 0 or words.numel() + config.block >= 2**31:
        raise ValueError(f"need 0 < words < 2^31 - block and at least one program, got {words.numel()} words, "
                         f"{partials.numel()} programs")
    _stream_read_kernel[(partials.numel(),)](words, partials, words.numel(), BLOCK=config.block,
                                             DEPENDENT_LAUNCH=dependent_launch, launch_pdl=dependent_launch,
                                             num_warps=config.num_warps)
