"""Paged attention over the KV pool: varlen prefill over a cached prefix, decode and verify.

KV pool (per attention layer): k_cache, v_cache [num_blocks, block_size, Hkv, D]. A row's
tokens live at positions [0, context_len) mapped through its block table; the row's q_len
query tokens are its last q_len positions, causal among themselves. Decode (q_len 1),
verify (q_len k+1) and prefill chunks (any q_len, any cached prefix) are the same call.
Softmax in float32. Knows nothing about sequences beyond block tables and lengths.
"""

from __future__ import annotations

import torch

from .varlen import pad_rows, row_layout


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] flat index block * block_size + offset."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping.long()] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping.long()] = v.to(v_cache.dtype)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
                              context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; block_tables: [B, M]; cu_seqlens: [B+1] query offsets; context_lens: [B]
    keys per row (cached prefix + this step's tokens, already written). Returns [T, Hq, D]."""
    num_rows, (num_heads, head_dim) = block_tables.shape[0], q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    lengths, row, index_in_row, max_q = row_layout(cu_seqlens, q.shape[0])
    context = context_lens.long()
    max_k = int(context.max())
    key_pos = torch.arange(max_k, device=q.device)
    blocks = block_tables.long().gather(1, (key_pos // block_size).clamp(max=block_tables.shape[1] - 1)
                                        .expand(num_rows, -1))
    flat = blocks * block_size + key_pos % block_size                          # [B, max_k]
    # Positions past a row's context (block-table padding, the tail of its last block) are never
    # read: they may hold anything, NaN included.
    in_context = (key_pos.view(1, -1) < context.view(-1, 1)).view(num_rows, max_k, 1, 1)
    keys = torch.where(in_context, k_cache.view(-1, num_kv_heads, head_dim)[flat].float(), 0.0)
    values = torch.where(in_context, v_cache.view(-1, num_kv_heads, head_dim)[flat].float(), 0.0)
    groups = num_heads // num_kv_heads
    keys, values = keys.repeat_interleave(groups, dim=2), values.repeat_interleave(groups, dim=2)
    queries = pad_rows(q.float(), row, index_in_row, num_rows, max_q)         # [B, max_q, Hq, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", queries, keys) * scale
    query_pos = context.view(-1, 1) - lengths.view(-1, 1) + torch.arange(max_q, device=q.device).view(1, -1)
    allowed = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)                # [B, max_q, max_k]
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                     # padded queries: all -inf
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)
    return out[row, index_in_row].to(q.dtype)
