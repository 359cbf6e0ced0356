"""GDN decode/verify with deferred commit (DESIGN.md, "Deferred commit"): one call per layer for
the whole batch; each row loads its slot's committed state once, folds the pending tokens of
the previous step, stores the result, then runs its new tokens (1 for decode, up to k+1 for
verify) producing outputs, and records their inputs as pending. Recurrence and pool layout:
gdn.py. Knows nothing about models or the scheduler.
"""

from __future__ import annotations

import torch

from .gdn import expand_heads, gdn_gating_reference, l2norm, recurrent_steps
from .varlen import pad_rows, row_layout


def gdn_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                         slot_ids: torch.Tensor, state: torch.Tensor, pending_k: torch.Tensor,
                         pending_v: torch.Tensor, pending_g: torch.Tensor, pending_beta: torch.Tensor,
                         pending_counts: torch.Tensor, commit: bool) -> torch.Tensor:
    """Decode/verify with deferred commit; shapes as gdn_chunked_reference, 1..P tokens per row.

    Per row: load the committed state, fold the slot's pending tokens, store it; run the new
    tokens producing outputs; record their inputs as pending (or fold them too when commit)."""
    num_rows, num_value_heads = slot_ids.numel(), v.shape[1]
    max_pending = pending_k.shape[1]
    slots = slot_ids.long()
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, v.shape[0])
    # Columns past a slot's pending count are stale: select them away (g = beta = 0, k = v = 0
    # is an exact no-op step), never multiply them in.
    valid = (torch.arange(max_pending, device=v.device).view(1, -1)
             < pending_counts[slots].long().view(-1, 1))[..., None]             # [B, P, 1]

    def pending(buffer: torch.Tensor) -> torch.Tensor:
        values = buffer[slots].float()
        return torch.where(valid.view(*valid.shape, *[1] * (values.dim() - 3)), values, 0.0)

    folded, _ = recurrent_steps(state[slots].float(), None, expand_heads(pending(pending_k), num_value_heads),
                                pending(pending_v), pending(pending_g), pending(pending_beta))
    g, beta = gdn_gating_reference(a, b, A_log, dt_bias)
    kn = l2norm(k)
    qn = expand_heads(l2norm(q), num_value_heads) * q.shape[-1] ** -0.5
    pad = lambda x: pad_rows(x, row, index_in_row, num_rows, max_len)
    final, out = recurrent_steps(folded, pad(qn), pad(expand_heads(kn, num_value_heads)), pad(v.float()),
                                  pad(g), pad(beta))
    if commit:
        state[slots] = final.to(state.dtype)
    else:
        state[slots] = folded.to(state.dtype)
        tok_slots = slots[row]
        pending_k[tok_slots, index_in_row] = kn.to(pending_k.dtype)
        pending_v[tok_slots, index_in_row] = v.to(pending_v.dtype)
        pending_g[tok_slots, index_in_row] = g.to(pending_g.dtype)
        pending_beta[tok_slots, index_in_row] = beta.to(pending_beta.dtype)
    return out[row, index_in_row].to(v.dtype)
