"""`TileConfig`, the one type of a kernel's tile shape and launch options: what a launcher's
`*_config` function picks from shapes, what its `launch_*` function takes explicitly (tests,
benchmark sweeps), and, through `autotune_configs`, what an autotuned kernel chooses among.
Knows nothing about any kernel: each launcher says which fields its kernel reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import triton


@dataclass(frozen=True, kw_only=True)
class TileConfig:
    """A program's tile and the launch options of its kernel. A field the kernel does not read
    keeps its default; num_warps and num_stages default to Triton's own defaults.

    block_m     rows of a program's output tile (tokens, packed token x head rows, expert pairs)
    block_n     columns of a program's output tile (output features, value columns)
    block_k     step of a program's loop over the reduced dimension
    num_splits  programs that share one output tile, each reducing a slice of the reduced
                dimension (linear: split-K; attention: the key range)
    num_warps   warps per program
    num_stages  software-pipelining depth of the loop's loads (None: Triton's default)
    """
    block_m: int = 1
    block_n: int = 1
    block_k: int = 1
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int | None = None

    def launch_options(self) -> dict:
        """The launch keywords: num_warps, and num_stages when set."""
        if self.num_stages is None:
            return {"num_warps": self.num_warps}
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def autotune_configs(tiles: Iterable[TileConfig], **constexprs: str) -> list[triton.Config]:
    """triton.autotune's configs for `tiles`: `constexprs` maps each tile constexpr of the kernel
    to the TileConfig field it takes (e.g. BV="block_n")."""
    return [triton.Config({name: getattr(tile, field) for name, field in constexprs.items()},
                          **tile.launch_options())
            for tile in tiles]
