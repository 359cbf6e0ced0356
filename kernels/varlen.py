"""Varlen batch helpers shared by the torch references: rows described by cu_seqlens offsets.
Knows nothing about any particular op."""

from __future__ import annotations

import torch


def row_layout(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """-> (lengths [B], row of each token [T], index of each token within its row [T], max_len)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                  output_size=num_tokens)
    index_in_row = torch.arange(num_tokens, device=cu_seqlens.device) - cu_seqlens[:-1].long()[row]
    max_len = int(lengths.max()) if lengths.numel() else 0
    return lengths, row, index_in_row, max_len


def pad_rows(x: torch.Tensor, row: torch.Tensor, index_in_row: torch.Tensor, num_rows: int,
              max_len: int) -> torch.Tensor:
    """[T, ...] -> [B, max_len, ...] zero-padded."""
    out = x.new_zeros((num_rows, max_len) + tuple(x.shape[1:]))
    out[row, index_in_row] = x
    return out


def into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """The references' `out=` contract, as the Triton launchers keep it: the result is written
    into the caller's view `out` (same shape and dtype; e.g. a row slice of a step buffer) and
    `out` is returned; without one the result itself is."""
    if out is None:
        return result
    assert out.shape == result.shape and out.dtype == result.dtype, \
        f"out: {out.dtype} {tuple(out.shape)}, expected {result.dtype} {tuple(result.shape)}"
    return out.copy_(result)
