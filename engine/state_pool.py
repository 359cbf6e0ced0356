"""Device tensors of the packed recurrent-state pool and the paged KV pool.

StatePool, per GDN layer (see kernels/gdn.py and kernels/conv1d.py for the layouts):
the committed recurrent state and conv window of every slot, and the pending inputs of
tokens accepted but not yet folded in; `pending_counts` [num_slots] is shared by all layers.
KVPool, per full-attention layer (and per MTP layer): k/v caches in fixed-size blocks.

Holds tensors only; which slot or block belongs to whom is the allocators' business.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import ModelConfig


class GDNLayerState(NamedTuple):
    recurrent: torch.Tensor     # [S, HV, K, V]
    conv: torch.Tensor          # [S, W-1, conv_dim]
    pending_conv: torch.Tensor  # [S, P, conv_dim]
    pending_k: torch.Tensor     # [S, P, HK, K]  l2-normalised keys
    pending_v: torch.Tensor     # [S, P, HV, V]
    pending_g: torch.Tensor     # [S, P, HV]     log decay
    pending_beta: torch.Tensor  # [S, P, HV]
    pending_counts: torch.Tensor  # [S] int32, the same tensor for every layer


class KVLayer(NamedTuple):
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


class StatePool:
    def __init__(self, config: ModelConfig, num_slots: int, max_pending: int, dtype: torch.dtype,
                 device: torch.device | str, state_dtype: torch.dtype = torch.float32,
                 keep_mtp_hidden: bool = False) -> None:
        """max_pending: tokens one step may feed per row (k + 1 with k drafts). keep_mtp_hidden:
        also keep, per slot, the target's hidden states at the positions fed last step (the MTP
        layer's inputs for the next step's catch-up), [num_slots, max_pending, hidden]."""
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1 (one step's new tokens)")
        self.num_slots, self.max_pending = num_slots, max_pending
        c = config
        hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                          c.linear_value_head_dim)
        s, p = num_slots, max_pending

        self.pending_counts = torch.zeros(num_slots, dtype=torch.int32, device=device)

        def layer() -> GDNLayerState:
            return GDNLayerState(
                recurrent=torch.zeros(s, hv, dk, dv, dtype=state_dtype, device=device),
                conv=torch.zeros(s, c.linear_conv_kernel_dim - 1, c.conv_dim, dtype=dtype, device=device),
                pending_conv=torch.zeros(s, p, c.conv_dim, dtype=dtype, device=device),
                pending_k=torch.zeros(s, p, hk, dk, dtype=dtype, device=device),
                pending_v=torch.zeros(s, p, hv, dv, dtype=dtype, device=device),
                pending_g=torch.zeros(s, p, hv, dtype=torch.float32, device=device),
                pending_beta=torch.zeros(s, p, hv, dtype=torch.float32, device=device),
                pending_counts=self.pending_counts,
            )

        self.layers = [layer() for _ in config.gdn_layer_ids]
        self.mtp_hidden = (torch.zeros(s, p, c.hidden_size, dtype=dtype, device=device) if keep_mtp_hidden
                           else None)

    @property
    def bytes_per_slot(self) -> int:
        """Committed state + conv window + pending buffers of one slot, all layers."""
        per_layer = sum(t[0].numel() * t.element_size() for layer in self.layers for t in layer[:-1])
        mtp = 0 if self.mtp_hidden is None else self.mtp_hidden[0].numel() * self.mtp_hidden.element_size()
        return per_layer + mtp + self.pending_counts.element_size()


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = [KVLayer(torch.zeros(shape, dtype=dtype, device=device),
                               torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """K and V of one block in every layer: what sizing a pool before allocating it needs."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
