"""The hybrid language model: Qwen3.5, Qwen3.5-MoE and Qwen3-Next share one module tree.

The families differ only in config (MoE or dense MLP per layer) and in checkpoint layout,
which the weight loader normalises before `checkpoint_map` is consulted. The forward pass takes
one flattened varlen batch and reads/writes state only through the pools. Knows nothing about
files, tokenizers or scheduling.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import Ops
from ..batch import ForwardBatch
from ..model_config import ModelConfig
from ..state_pool import KVPool, StatePool
from ..tensor_parallel import TensorParallel
from .layers import ALL, CheckpointMap, DecoderLayer, Linear, _param
from .mtp import MTP


class HybridLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, with_mtp: bool,
                 tp: TensorParallel | None = None) -> None:
        """config: this rank's shard of the model (engine/sharding.py: heads and widths divided
        by the tensor-parallel size; the vocabulary is whole) or the whole model; tp: the
        tensor-parallel group (None: one device). Under tensor parallelism the embedding and
        lm_head hold this rank's rows of the vocabulary, and the mixers' and MLPs' outputs
        (row-parallel partial sums) are summed over the ranks by the norm after each:
        `reduce_norm`, the all-reduce and the residual add + RMSNorm (one kernel where the
        message fits the symmetric buffer: TensorParallel.all_reduce_rms_norm)."""
        super().__init__()
        self.config, self.ops, self.tp = config, ops, tp
        c = config
        vocab_rows = c.vocab_size // (tp.size if tp is not None else 1)
        self.embed_tokens = _param(vocab_rows, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(c, f"model.layers.{i}", is_gdn=t == "linear_attention", is_moe=c.is_moe_layer(i), dtype=dtype)
            for i, t in enumerate(c.layer_types))
        self.norm = _param(c.hidden_size, dtype=dtype)
        self.lm_head = None if c.tie_word_embeddings else _param(vocab_rows, c.hidden_size, dtype=dtype)
        self.mtp = MTP(c, dtype) if with_mtp else None
        # The norm after a block's output (layers.ReduceNorm): on one device ops.rms_norm itself.
        self.reduce_norm = ops.rms_norm if tp is None else partial(tp.all_reduce_rms_norm, rms_norm=ops.rms_norm)
        # Reduced draft vocabulary (optional): the MTP head scores only these token ids.
        self.draft_token_ids: torch.Tensor | None = None
        self.draft_head: torch.Tensor | None = None
        self.draft_bias: torch.Tensor | None = None  # under tensor parallelism: -inf on padded rows
        self.streamed = False  # norms folded for the residual-stream form (finish_loading, stream_form)

    @property
    def num_kv_layers(self) -> int:
        """Attention layers of the target, then the MTP layers: all share one KV pool."""
        return len(self.config.attention_layer_ids) + (len(self.mtp.layers) if self.mtp else 0)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def finish_loading(self) -> None:
        """Once every parameter is filled: derived per-projection data (FP8 block scales), and,
        where the ops fuse block ops and every layer (the MTP's too) allows it on one device,
        the norms folded into the projections for the residual-stream form (layers.py)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.finish_loading()
        layers = [*self.layers, *(self.mtp.layers if self.mtp is not None else [])]
        if self.ops.fused_block_rows and self.tp is None and all(layer.foldable for layer in layers):
            for layer in layers:
                layer.fold_norms()
            self.streamed = True

    def stream_form(self, num_tokens: int) -> bool:
        """Whether a forward of num_tokens rows runs the residual-stream form: after the fold, up
        to the rows the ops fuse block ops at (decode, verify and draft batches). Wider batches
        run `DecoderLayer.forward`, whose norm kernels fuse the residual add (and whose zero norm
        weights after the fold leave the folded projections' products as they were)."""
        return self.streamed and num_tokens <= self.ops.fused_block_rows

    def checkpoint_map(self) -> CheckpointMap:
        mapping = {
            "model.embed_tokens.weight": ("embed_tokens", ALL),
            "model.norm.weight": ("norm", ALL),
        }
        if self.lm_head is not None:
            mapping["lm_head.weight"] = ("lm_head", ALL)
        for i, layer in enumerate(self.layers):
            mapping.update(layer.checkpoint_map(f"layers.{i}"))
        if self.mtp is not None:
            mapping.update(self.mtp.checkpoint_map("mtp"))
        return mapping

    def forward(self, batch: ForwardBatch, states: StatePool, kv: KVPool) -> torch.Tensor:
        """Returns the final (post-norm) hidden state of every token: [T, H]."""
        x, residual = self.embed(batch.input_ids), None
        if batch.embeds is not None:  # image tokens take the vision encoder's outputs
            x[batch.embeds[0]] = batch.embeds[1]
        stream_form = self.stream_form(x.shape[0])
        gdn_states, kv_layers = iter(states.layers), iter(kv.layers)
        for layer, kind in zip(self.layers, self.config.layer_types):
            mixer_state = next(gdn_states) if kind == "linear_attention" else next(kv_layers)
            if stream_form:  # x: the stream (a fresh tensor from the embedding gather)
                layer.forward_stream(x, batch, mixer_state, self.ops)
            else:
                x, residual = layer(x, residual, batch, mixer_state, self.ops, self.reduce_norm)
        x, _ = self.reduce_norm(x, self.norm, self.config.rms_norm_eps, residual)
        return x

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> embeddings [T, H] (vocabulary-parallel under tensor parallelism)."""
        if self.tp is not None:
            return self.tp.embed(ids, self.embed_tokens)
        return self.ops.embedding(ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V] (the model-dtype logits widened). One row on one
        device, the head's one-row form (`head`) widens its own stores; elsewhere a widening copy
        does (none for a float32 model)."""
        if hidden.dtype != torch.float32 and hidden.shape[0] == 1 and self.tp is None:
            return self.logits(hidden, hidden.new_empty((1, self.config.vocab_size), dtype=torch.float32))
        return self.logits(hidden).float()

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in the model's dtype (greedy argmax needs no float32
        copy), into `out` when given (a CUDA graph's static buffer). Under tensor parallelism
        every rank computes its vocabulary rows and gathers everyone's: all ranks hold the
        same full logits and sample the same tokens."""
        if self.tp is not None:
            return self.tp.gather_logits(F.linear(hidden, self.lm_head_weight), out)
        return self.head(hidden, self.lm_head_weight, out=out)

    def head(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] @ weight [V, H]^T (+ bias), into `out` when given (hidden's dtype; float32
        at one row: the one-row form widens its own stores). One row goes through ops.linear, whose
        one-row form streams a head faster than cuBLAS (the 0.8B's 167 against 183 µs, the 9B's
        645 against 713 µs: H100, bench/results/gemv_lm_head-h100.json), more rows through cuBLAS
        as they come."""
        if hidden.shape[0] == 1 and bias is None:
            return self.ops.linear(hidden, weight, out=out)
        if out is None:
            return F.linear(hidden, weight, bias)
        assert bias is None, "head: out is for the model's own head, which has no bias"
        return torch.mm(hidden, weight.t(), out=out)

    def use_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Let drafts come from `token_ids` only (None: the full vocabulary). The rows of the
        lm_head for those ids are copied once, so a draft step reads N x H weights, not V x H;
        exactness is unaffected because the target verifies every draft.

        Under tensor parallelism each rank holds the rows of the ids in its vocabulary shard,
        padded to the most any rank holds (equal shards for the all-gather) and scored -inf on
        padding (the draft GEMM's bias); `draft_token_ids` maps each gathered column to its id.
        Ties between equal scores may resolve to another id than on one device (a draft, which
        the target verifies either way)."""
        self.draft_token_ids = self.draft_head = self.draft_bias = None
        if token_ids is None:
            return
        ids = token_ids.to(self.embed_tokens.device, torch.int64)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {self.config.vocab_size})")
        if self.tp is None:
            self.draft_token_ids = ids
            self.draft_head = self.lm_head_weight.detach()[ids].contiguous()
            return
        start, shard = self.tp.split(self.config.vocab_size)  # this rank's vocabulary rows
        by_rank = [ids[ids // shard == rank] for rank in range(self.tp.size)]
        rows = max(len(r) for r in by_rank)
        mine = by_rank[self.tp.rank]
        self.draft_head = self.lm_head_weight.new_zeros(rows, self.lm_head_weight.shape[1])
        self.draft_head[:len(mine)] = self.lm_head_weight.detach()[mine - start]
        self.draft_bias = self.lm_head_weight.new_full((rows,), float("-inf"))
        self.draft_bias[:len(mine)] = 0
        self.draft_token_ids = torch.cat([F.pad(rank_ids, (0, rows - len(rank_ids))) for rank_ids in by_rank])

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP output [N, H] -> greedy draft token ids [N], from the draft vocabulary if set: the
        argmax of the model-dtype scores (ops.greedy_argmax, which maps a reduced vocabulary's
        columns to their ids in the same launch; no float32 copy: the widening is exact)."""
        if self.draft_head is None:
            return self.ops.greedy_argmax(self.logits(hidden), 1)[0]
        scores = self.head(hidden, self.draft_head, self.draft_bias)
        if self.tp is not None:
            scores = self.tp.gather_logits(scores)
        return self.ops.greedy_argmax(scores, 1, token_ids=self.draft_token_ids)[0]

    def draft_hidden(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                     kv: KVPool, mtp_layer: int = 0) -> torch.Tensor:
        """One MTP step (see mtp.py); its KV lives after the target's attention layers."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP weights")
        kv_layer = kv.layers[len(self.config.attention_layer_ids) + mtp_layer]
        return self.mtp(input_ids, hidden, self.embed, batch, kv_layer, self.ops, self.reduce_norm, mtp_layer,
                        stream_form=self.stream_form(input_ids.shape[0]),
                        embed_weight=self.embed_tokens if self.tp is None and batch.embeds is None else None)
