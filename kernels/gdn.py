"""Gated DeltaNet recurrence: gating, chunked varlen prefill and deferred-commit decode/verify.

Per value head, with state S [K, V], for each token t (q, k l2-normalised, q scaled by K^-1/2):
    g_t    = -exp(A_log) * softplus(a_t + dt_bias)        (log decay, <= 0)
    beta_t = sigmoid(b_t)
    S      = exp(g_t) * S
    S      = S + k_t (beta_t (v_t - S^T k_t))^T           (delta rule)
    o_t    = S^T q_t
Value heads may outnumber key heads: value head h reads key head h // (HV / HK).

Pool layout (per GDN layer): state [num_slots, HV, K, V] (fp32 by default), and the pending
inputs of tokens accepted but not folded in: pending_k [num_slots, P, HK, K] (normalised),
pending_v [num_slots, P, HV, V], pending_g / pending_beta [num_slots, P, HV] (fp32), with
pending_counts [num_slots] shared by every layer. See DESIGN.md, "Deferred commit".

Knows nothing about models or the scheduler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv1d import _pad_rows, _row_layout

CHUNK_SIZE = 64


def gdn_gating_reference(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, HV] -> (g, beta) float32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """[..., HK, K] -> [..., HV, K]: value head h uses key head h // (HV/HK)."""
    return x.repeat_interleave(num_value_heads // x.shape[-2], dim=-2)


def _recurrent_steps(state: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence over a padded batch. state [B, HV, K, V] fp32; k [B, L, HV, K];
    v [B, L, HV, V]; g, beta [B, L, HV]; q [B, L, HV, K] or None (fold only).
    A padded token must carry g = 0 and beta = 0: it then leaves the state unchanged."""
    outputs = []
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        if q is not None:
            outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return state, (torch.stack(outputs, dim=1) if q is not None else None)


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
    lengths, row, index_in_row, max_len = _row_layout(cu_seqlens, v.shape[0])
    padded_len = -(-max_len // CHUNK_SIZE) * CHUNK_SIZE
    g, beta = gdn_gating_reference(a, b, A_log, dt_bias)
    qn = _expand_heads(l2norm(q), num_value_heads) * q.shape[-1] ** -0.5
    kn = _expand_heads(l2norm(k), num_value_heads)
    pad = lambda x: _pad_rows(x, row, index_in_row, num_rows, padded_len)
    initial = state[slots].float() * has_initial_state.view(-1, 1, 1, 1).float()
    final, out = _chunked(initial, pad(qn), pad(kn), pad(v.float()), pad(g), pad(beta), CHUNK_SIZE)
    state[slots] = final.to(state.dtype)
    return out[row, index_in_row].to(v.dtype)


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
    lengths, row, index_in_row, max_len = _row_layout(cu_seqlens, v.shape[0])
    valid = (torch.arange(max_pending, device=v.device).view(1, -1)
             < pending_counts[slots].long().view(-1, 1)).float()[..., None]     # [B, P, 1]
    folded, _ = _recurrent_steps(state[slots].float(), None, _expand_heads(pending_k[slots].float(), num_value_heads),
                                 pending_v[slots].float(), pending_g[slots].float() * valid,
                                 pending_beta[slots].float() * valid)
    g, beta = gdn_gating_reference(a, b, A_log, dt_bias)
    kn = l2norm(k)
    qn = _expand_heads(l2norm(q), num_value_heads) * q.shape[-1] ** -0.5
    pad = lambda x: _pad_rows(x, row, index_in_row, num_rows, max_len)
    final, out = _recurrent_steps(folded, pad(qn), pad(_expand_heads(kn, num_value_heads)), pad(v.float()),
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
