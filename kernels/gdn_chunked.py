"""Chunked varlen GDN prefill: many sequences of different lengths in one call, each starting
from its slot's committed state (or zero) and writing its final state back to the slot.
Recurrence and pool layout: gdn.py. Knows nothing about models or the scheduler.
"""

from __future__ import annotations

import torch

from .gdn import expand_heads, gdn_gating_reference, l2norm
from .varlen import pad_rows, row_layout

CHUNK_SIZE = 64


def _chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel form of `_recurrent_steps` (WY representation). Shapes as there, with the
    padded length a multiple of chunk_size. Within a chunk (positions i, j; G = cumsum g):
        A[i, j]  = beta_i (k_i . k_j) exp(G_i - G_j)            for j < i
        (I + A) U = beta * V,  (I + A) W = beta * exp(G) * K     (unit lower-triangular solves)
        V'  = U - W S_0,   O = exp(G) * (Q S_0) + (QK^T * exp(G_i - G_j), j <= i) V'
        S_1 = exp(G_last) S_0 + (K * exp(G_last - G))^T V'
    """
    batch, length, heads, _ = k.shape
    n = length // chunk_size
    shape = lambda x: x.reshape(batch, n, chunk_size, heads, -1).transpose(2, 3)  # [B, n, H, C, *]
    q, k, v = shape(q), shape(k), shape(v)
    g = g.reshape(batch, n, chunk_size, heads).transpose(2, 3)       # [B, n, H, C]
    beta = beta.reshape(batch, n, chunk_size, heads).transpose(2, 3)
    cum = g.cumsum(-1)
    diff = cum[..., :, None] - cum[..., None, :]
    ones = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device)
    decay = torch.where(ones.tril(), diff, torch.full_like(diff, float("-inf"))).exp()   # j <= i
    strictly_lower = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay * ones.tril(-1)
    system = strictly_lower + torch.eye(chunk_size, device=k.device)
    u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, beta[..., None] * cum.exp()[..., None] * k, upper=False,
                                      unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    outputs = torch.empty_like(u)
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ state
        outputs[:, c] = (q[:, c] * cum[:, c, :, :, None].exp()) @ state + intra[:, c] @ v_new
        last = cum[:, c, :, -1:]
        state = state * last.exp()[..., None] + (k[:, c] * (last - cum[:, c]).exp()[..., None]).transpose(-1, -2) @ v_new
    return state, outputs.transpose(2, 3).reshape(batch, length, heads, -1)


def gdn_chunked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                          slot_ids: torch.Tensor, has_initial_state: torch.Tensor,
                          state: torch.Tensor) -> torch.Tensor:
    """Varlen prefill. q, k: [T, HK, K]; v: [T, HV, V]; a, b: [T, HV]. Reads the slot's state when
    has_initial_state (else zeros) and writes the final state back to state[slot].
    Returns o [T, HV, V] in v's dtype."""
    num_rows, num_value_heads = slot_ids.numel(), v.shape[1]
    slots = slot_ids.long()
    lengths, row, index_in_row, max_len = row_layout(cu_seqlens, v.shape[0])
    padded_len = -(-max_len // CHUNK_SIZE) * CHUNK_SIZE
    g, beta = gdn_gating_reference(a, b, A_log, dt_bias)
    qn = expand_heads(l2norm(q), num_value_heads) * q.shape[-1] ** -0.5
    kn = expand_heads(l2norm(k), num_value_heads)
    pad = lambda x: pad_rows(x, row, index_in_row, num_rows, padded_len)
    # Select, never multiply: a fresh row must not read whatever its slot's last owner left.
    initial = torch.where(has_initial_state.view(-1, 1, 1, 1), state[slots].float(), 0.0)
    final, out = _chunked(initial, pad(qn), pad(kn), pad(v.float()), pad(g), pad(beta), CHUNK_SIZE)
    state[slots] = final.to(state.dtype)
    return out[row, index_in_row].to(v.dtype)
