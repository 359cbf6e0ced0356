"""The multi-token-prediction (MTP) module: the model's own one-layer drafter.

For the token at position t with target hidden state h_t (after the target's final norm) and
the next token x_{t+1}:
    u   = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])
    out = norm(decoder_layer(u))          (a full-attention layer at position t, own KV cache)
and lm_head(out) scores x_{t+2}. A later draft step feeds `out` back as h. Embeddings and
lm_head are the target's. Knows nothing about acceptance or scheduling.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...kernels import Ops
from ..batch import ForwardBatch
from ..model_config import ModelConfig
from ..state_pool import KVLayer
from .layers import ALL, CheckpointMap, DecoderLayer, Linear, ReduceNorm, _param


class MTP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = c.rms_norm_eps
        self.fc = Linear(c, {"mtp.fc": c.hidden_size}, 2 * c.hidden_size, dtype)
        self.pre_fc_norm_embedding = _param(c.hidden_size, dtype=dtype)
        self.pre_fc_norm_hidden = _param(c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, f"mtp.layers.{j}", is_gdn=False, is_moe=c.mtp_is_moe, dtype=dtype)
                                    for j in range(max(c.num_mtp_layers, 1)))
        self.norm = _param(c.hidden_size, dtype=dtype)

    def checkpoint_map(self, dst: str) -> CheckpointMap:
        mapping = {f"mtp.{name}.weight": (f"{dst}.{name}", ALL)
                   for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        mapping.update(self.fc.checkpoint_map(f"{dst}.fc"))
        for j, layer in enumerate(self.layers):
            mapping.update(layer.checkpoint_map(f"{dst}.layers.{j}"))
        return mapping

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                batch: ForwardBatch, kv: KVLayer, ops: Ops, reduce_norm: ReduceNorm, layer: int = 0,
                stream_form: bool = False, embed_weight: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (x_{t+1}), hidden [T, H] (h_t) -> post-norm MTP hidden [T, H].
        embed: the target's token embedding; embed_weight: its table [V, H] where embed is that
        table's plain row gather (one device) and batch.embeds replace none of its rows, else
        None;
        reduce_norm: the target's (layers.DecoderLayer); stream_form: the layer in the
        residual-stream form (HybridLM.stream_form).
        batch carries positions t and the MTP layer's KV metadata."""
        if embed_weight is not None:  # the gather, both norms and the cat in one launch
            x = ops.mtp_input(input_ids, embed_weight, hidden, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden,
                              self.eps)
        else:
            embedded = embed(input_ids)
            if batch.embeds is not None:  # an image token's input is its vision encoder output
                embedded[batch.embeds[0]] = batch.embeds[1]
            embedded, _ = ops.rms_norm(embedded, self.pre_fc_norm_embedding, self.eps)
            normed, _ = ops.rms_norm(hidden, self.pre_fc_norm_hidden, self.eps)
            x = torch.cat([embedded, normed], dim=-1)
        x, residual = self.fc(x, ops), None
        if stream_form:  # x: the stream (the fc's fresh output)
            self.layers[layer].forward_stream(x, batch, kv, ops)
        else:
            x, residual = self.layers[layer](x, None, batch, kv, ops, reduce_norm)
        out, _ = reduce_norm(x, self.norm, self.eps, residual)
        return out
