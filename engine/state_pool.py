"""Device tensors of the packed recurrent-state pool and the paged KV pool.

StatePool, per GDN layer (see kernels/gdn.py and kernels/conv1d.py for the layouts):
the committed recurrent state and conv window of every slot, and what cannot be recomputed of
the drafts accepted but not yet folded in (their raw conv inputs and g, beta; the decode kernels
recompute their k and v each step); `pending_counts` [num_slots] is shared by all layers.
KVPool, per full-attention layer (and per MTP layer): k/v caches in fixed-size blocks.

Holds tensors only; which slot or block belongs to whom is the allocators' business.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..kernels.gdn import pending_replicas
from .batch import device_tensor
from .model_config import ModelConfig


class GDNLayerState(NamedTuple):
    recurrent: torch.Tensor     # [S, HV, K, V]
    conv: torch.Tensor          # [S, W-1, conv_dim]
    pending_conv: torch.Tensor  # [S, P, conv_dim]  raw conv inputs (activation dtype)
    pending_g: torch.Tensor     # [S, P, HV, R]     log decay (fp32), R equal replicas (kernels/gdn.py)
    pending_beta: torch.Tensor  # [S, P, HV, R]     (fp32)
    pending_counts: torch.Tensor  # [S] int32, the same tensor for every layer


class KVLayer(NamedTuple):
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


class StatePool:
    def __init__(self, config: ModelConfig, num_slots: int, max_pending: int, dtype: torch.dtype,
                 device: torch.device | str, state_dtype: torch.dtype = torch.float32,
                 keep_mtp_hidden: bool = False, keep_last_hidden: bool = False) -> None:
        """max_pending: drafts a slot may hold unfolded, P = k (0 without speculation): a verify
        step commits its first fed token at once. keep_mtp_hidden: also keep, per slot, the
        target's hidden states at the k + 1 positions fed last step (the MTP layer's inputs for
        the next step's catch-up), [num_slots, max_pending + 1, hidden].
        keep_last_hidden: also keep [num_slots, hidden], the hidden state before a checkpoint's
        position (the prefix cache computes a fully cached prompt's first logits from it)."""
        if max_pending < 0:
            raise ValueError("max_pending must be >= 0")
        self.num_slots, self.max_pending, self.state_dtype = num_slots, max_pending, state_dtype
        c = config
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        s, p = num_slots, max_pending
        replicas = pending_replicas(dv)

        self.pending_counts = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # Each kind of per-slot tensor is one allocation over the GDN layers, [L, S, ...], and a
        # layer's tensor is its contiguous view [l]: copying a slot (a prefix-cache restore) takes
        # a view per kind, not one per layer and kind.
        n = len(config.gdn_layer_ids)
        recurrent = torch.zeros(n, s, hv, dk, dv, dtype=state_dtype, device=device)
        conv = torch.zeros(n, s, c.linear_conv_kernel_dim - 1, c.conv_dim, dtype=dtype, device=device)
        pending_conv = torch.zeros(n, s, p, c.conv_dim, dtype=dtype, device=device)
        pending_g = torch.zeros(n, s, p, hv, replicas, dtype=torch.float32, device=device)
        pending_beta = torch.zeros(n, s, p, hv, replicas, dtype=torch.float32, device=device)
        self.layers = [GDNLayerState(recurrent[i], conv[i], pending_conv[i], pending_g[i], pending_beta[i],
                                     self.pending_counts) for i in range(n)]
        self.mtp_hidden = (torch.zeros(s, p + 1, c.hidden_size, dtype=dtype, device=device) if keep_mtp_hidden
                           else None)
        self.last_hidden = (torch.zeros(s, c.hidden_size, dtype=dtype, device=device) if keep_last_hidden
                            else None)
        # What a checkpoint of a slot holds (every per-slot tensor but the pending counts), each
        # with the slot as dim 1; and those of them that only speculation needs.
        hidden = [t.unsqueeze(0) for t in (self.mtp_hidden, self.last_hidden) if t is not None]
        self._slot_tensors = [recurrent, conv, pending_conv, pending_g, pending_beta, *hidden]
        self._speculative = [pending_conv, pending_g, pending_beta] + \
            ([self.mtp_hidden.unsqueeze(0)] if self.mtp_hidden is not None else [])

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """slot dst := slot src for each (src, dst) (distinct dst, none of them a src), with
        nothing pending (checkpoints never hold pending tokens)."""
        if not pairs:
            return
        # One launch for every tensor and pair, from views: a gather would stage copies of the
        # source slots (tens of MB each at real sizes, n of them for n choices of one prompt).
        torch._foreach_copy_([t[:, dst] for _, dst in pairs for t in self._slot_tensors],
                             [t[:, src] for src, _ in pairs for t in self._slot_tensors])
        self.pending_counts.index_fill_(0, device_tensor([dst for _, dst in pairs], torch.int64,
                                                         self.pending_counts.device), 0)

    def save_slot(self, slot: int) -> list[torch.Tensor]:
        """Host copies of a slot's tensors (pinned when the pool is on CUDA)."""
        return [_to_host(t[:, slot]) for t in self._slot_tensors]

    def load_slot(self, slot: int, saved: list[torch.Tensor]) -> None:
        for t, host in zip(self._slot_tensors, saved, strict=True):
            t[:, slot].copy_(host, non_blocking=True)
        self.pending_counts[slot] = 0

    def hidden_to_mtp(self, slots: Sequence[int]) -> None:
        """mtp_hidden[slot, 0] := last_hidden[slot] for each slot: a fully cached prompt's MTP
        re-runs the position before its checkpoint with the token sampled from it, so its
        catch-up input is that position's hidden state."""
        if slots:
            index = device_tensor(slots, torch.int64, self.pending_counts.device)
            self.mtp_hidden[index, 0] = self.last_hidden[index]

    @property
    def bytes_per_slot(self) -> int:
        """Committed state + conv window + pending buffers (+ kept hidden states) of one slot."""
        return _slot_bytes(self._slot_tensors) + self.pending_counts.element_size()

    @property
    def bytes_per_slot_without_speculation(self) -> int:
        """bytes_per_slot of this pool with k = 0: less the pending buffers and the MTP inputs."""
        return self.bytes_per_slot - _slot_bytes(self._speculative)


def _slot_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of one slot of tensors whose slot is dim 1."""
    return sum(t[:, 0].numel() * t.element_size() for t in tensors)


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        # One allocation [layer, k/v, block, ...]; each layer's caches are contiguous views of it,
        # so copying blocks is one gather and one scatter however many layers and blocks.
        self._caches = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                                   device=device)
        self.layers = [KVLayer(self._caches[i, 0], self._caches[i, 1]) for i in range(num_layers)]
        self.block_bytes = self.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """block dst := block src in every layer, for each (src, dst) (distinct dst, none of
        them a src). The block ids reach the device by a queued copy (`device_tensor`): a
        pageable one would wait for the step in flight before the prefill step that restores a
        checkpoint could launch."""
        if not pairs:
            return
        index = device_tensor([block for pair in pairs for block in pair], torch.int64,
                              self._caches.device).view(-1, 2)
        self._caches[:, :, index[:, 1]] = self._caches[:, :, index[:, 0]]

    def save_blocks(self, blocks: Sequence[int]) -> torch.Tensor:
        """A host copy of the blocks, [layer, k/v, block, ...]."""
        return _to_host(self._caches[:, :, device_tensor(blocks, torch.int64, self._caches.device)])

    def load_blocks(self, blocks: Sequence[int], saved: torch.Tensor) -> None:
        index = device_tensor(blocks, torch.int64, self._caches.device)
        self._caches[:, :, index] = saved.to(self._caches.device, non_blocking=True)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """K and V of one block in every layer: what sizing a pool before allocating it needs."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of t; pinned when t is on CUDA, so copies back can be asynchronous."""
    if t.device.type != "cuda":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host
