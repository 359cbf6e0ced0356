"""Causal depthwise conv1d (kernel W, SiLU) over the GDN q|k|v channels, by slot.

State layout (per GDN layer), time-major so a token's channels are contiguous:
  conv_state   [num_slots, W-1, C]   the last W-1 *committed* inputs of each slot
  pending_conv [num_slots, P, C]     inputs of tokens accepted but not yet folded in
  pending_counts [num_slots]         how many pending columns are valid (shared by all layers)

Rollback uses the same deferred-commit idea as the recurrent state: a decode/verify step first
folds the slot's pending inputs into its window (window := last W-1 of committed ++ pending),
then convolves the step's new tokens against that window, and records the new inputs as
pending. After acceptance the engine only sets the pending count, so rejected columns are never
read again. With `commit=True` (plain decode) the new inputs are folded at once.

Knows nothing about models or the scheduler: rows are described by cu_seqlens and slot ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import pad_rows, row_layout


def _depthwise(window: torch.Tensor, weight: torch.Tensor, num_out: int) -> torch.Tensor:
    """window [B, W-1+L, C], weight [C, W] -> silu(conv) [B, num_out, C] in float32.

    out[t] = sum_j weight[:, j] * window[t + j]: tap W-1 multiplies the newest input.
    """
    taps = weight.shape[1]
    w = weight.float()
    acc = sum(window[:, j:j + num_out].float() * w[:, j] for j in range(taps))
    return F.silu(acc)


def causal_conv1d_prefill_reference(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                                    slot_ids: torch.Tensor, has_initial_state: torch.Tensor,
                                    conv_state: torch.Tensor) -> torch.Tensor:
    """Varlen prefill. x: [T, C], weight: [C, W]. Reads the slot's window when has_initial_state
    (else zeros), writes the last W-1 inputs back to conv_state[slot]. Returns [T, C]."""
    num_rows = slot_ids.numel()
    width = weight.shape[1]
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, x.shape[0])
    # Select, never multiply: a fresh row must not read whatever its slot's last owner left.
    initial = torch.where(has_initial_state.view(-1, 1, 1), conv_state[slot_ids.long()], 0)
    window = torch.cat([initial.to(x.dtype), pad_rows(x, row, index_in_row, num_rows, max_len)], dim=1)
    out = _depthwise(window, weight, max_len)[row, index_in_row]
    # Final window of row b: inputs at window positions [len_b, len_b + W-1).
    tail = lengths.view(-1, 1) + torch.arange(width - 1, device=x.device).view(1, -1)
    conv_state[slot_ids.long()] = torch.gather(
        window, 1, tail.unsqueeze(-1).expand(-1, -1, window.shape[-1])).to(conv_state.dtype)
    return out.to(x.dtype)


def causal_conv1d_decode_reference(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                                   slot_ids: torch.Tensor, conv_state: torch.Tensor,
                                   pending_conv: torch.Tensor, pending_counts: torch.Tensor,
                                   commit: bool) -> torch.Tensor:
    """Decode/verify with deferred commit. x: [T, C] new tokens (1..P per row). Returns [T, C]."""
    num_rows = slot_ids.numel()
    width = weight.shape[1]
    max_pending = pending_conv.shape[1]
    slots = slot_ids.long()
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, x.shape[0])
    counts = pending_counts[slots].long()
    # Per row, the sequence committed(W-1) ++ pending(p) ++ new(n) built by gathering from the
    # concatenation committed ++ pending(P) ++ new(max_len): position m >= W-1+p reads new[m-W+1-p].
    source = torch.cat([conv_state[slots].to(x.dtype), pending_conv[slots].to(x.dtype),
                        pad_rows(x, row, index_in_row, num_rows, max_len)], dim=1)
    m = torch.arange(width - 1 + max_pending + max_len, device=x.device).view(1, -1)
    boundary = (width - 1) + counts.view(-1, 1)
    index = torch.where(m < boundary, m, m - counts.view(-1, 1) + max_pending).clamp(max=source.shape[1] - 1)
    sequence = torch.gather(source, 1, index.unsqueeze(-1).expand(-1, -1, source.shape[-1]))
    # New token i of a row sits at sequence position W-1+p+i; its window starts at p+i.
    shifted = torch.gather(sequence, 1, (counts.view(-1, 1) + torch.arange(max_len + width - 1, device=x.device)
                                         .view(1, -1)).unsqueeze(-1).expand(-1, -1, sequence.shape[-1]))
    out = _depthwise(shifted, weight, max_len)[row, index_in_row]
    # Fold: the committed window becomes the last W-1 columns of committed ++ pending (++ new).
    folded = counts + (lengths if commit else 0)
    tail = folded.view(-1, 1) + torch.arange(width - 1, device=x.device).view(1, -1)
    conv_state[slots] = torch.gather(sequence, 1, tail.unsqueeze(-1).expand(-1, -1, sequence.shape[-1])).to(conv_state.dtype)
    if not commit:
        pending_conv[slots[row], index_in_row] = x.to(pending_conv.dtype)
    return out.to(x.dtype)
