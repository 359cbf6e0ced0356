"""Building blocks of the hybrid family: GDN mixer, gated attention, dense and MoE MLPs, and
the decoder layer that wraps them. Every heavy op goes through the `Ops` table, dense
projections too (`ops.linear`: a skinny-GEMM kernel for decode batches, cuBLAS otherwise).

Parameters are stored fused for one GEMM each (GDN q|k|v|z|b|a, attention q+gate|k|v, MLP
gate|up); `checkpoint_map` says which checkpoint tensor fills which region, so the loader
needs no knowledge of the modules. Knows nothing about checkpoint files or scheduling.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import Ops
from ..batch import ForwardBatch, PrefillCheckpoints
from ..model_config import ModelConfig
from ..state_pool import GDNLayerState, KVLayer

# checkpoint name -> (parameter name, index into that parameter)
CheckpointMap = dict[str, tuple[str, tuple]]

ALL = (slice(None),)


def checkpoint_conv_windows(x: torch.Tensor, written: PrefillCheckpoints, conv_state: torch.Tensor) -> torch.Tensor:
    """The conv window at each checkpoint: the W-1 raw inputs before it [N, W-1, C]. x: the
    prefill group's raw conv inputs [T, C]. A checkpoint closer than W-1 tokens to its row's
    start is at the row's end (checkpoints sit on chunk-size multiples or the row's end), so its
    window is the row's final one, which the conv prefill has just written to the row's slot."""
    width = conv_state.shape[1]
    index = written.last_token[:, None] - (width - 1) + torch.arange(width, device=x.device)
    inside = (index[:, 0] >= written.row_start)[:, None, None]
    return torch.where(inside, x[index.clamp(min=0)], conv_state[written.row_slot])


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _rows(start: int, size: int) -> tuple:
    return (slice(start, start + size),)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        hv = c.linear_num_value_heads
        # in_proj rows: q | k | v (the conv channels) | z | b | a
        self.splits = (c.conv_dim, c.linear_value_dim, hv, hv)
        self.in_proj = _param(sum(self.splits), c.hidden_size, dtype=dtype)
        self.conv_weight = _param(c.conv_dim, c.linear_conv_kernel_dim, dtype=dtype)
        # Gating parameters stay float32: g = -exp(A_log) * softplus(a + dt_bias) is computed there.
        self.A_log = _param(hv, dtype=torch.float32)
        self.dt_bias = _param(hv, dtype=torch.float32)
        self.norm_weight = _param(c.linear_value_head_dim, dtype=dtype)
        self.out_proj = _param(c.hidden_size, c.linear_value_dim, dtype=dtype)

    def checkpoint_map(self, src: str, dst: str) -> CheckpointMap:
        c = self.c
        return {
            f"{src}.in_proj_qkv.weight": (f"{dst}.in_proj", _rows(0, c.conv_dim)),
            f"{src}.in_proj_z.weight": (f"{dst}.in_proj", _rows(c.conv_dim, c.linear_value_dim)),
            f"{src}.in_proj_b.weight": (f"{dst}.in_proj", _rows(c.conv_dim + c.linear_value_dim,
                                                                 c.linear_num_value_heads)),
            f"{src}.in_proj_a.weight": (f"{dst}.in_proj", _rows(c.conv_dim + c.linear_value_dim
                                                                 + c.linear_num_value_heads,
                                                                 c.linear_num_value_heads)),
            f"{src}.conv1d.weight": (f"{dst}.conv_weight", ALL),
            f"{src}.A_log": (f"{dst}.A_log", ALL),
            f"{src}.dt_bias": (f"{dst}.dt_bias", ALL),
            f"{src}.norm.weight": (f"{dst}.norm_weight", ALL),
            f"{src}.out_proj.weight": (f"{dst}.out_proj", ALL),
        }

    def _split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., conv_dim] -> views q, k [..., HK, K] and v [..., HV, V]."""
        c = self.c
        q, k, v = conv_out.split((c.linear_key_dim, c.linear_key_dim, c.linear_value_dim), dim=-1)
        return (q.unflatten(-1, (c.linear_num_key_heads, c.linear_key_head_dim)),
                k.unflatten(-1, (c.linear_num_key_heads, c.linear_key_head_dim)),
                v.unflatten(-1, (c.linear_num_value_heads, c.linear_value_head_dim)))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: GDNLayerState, ops: Ops) -> torch.Tensor:
        c, num_tokens = self.c, x.shape[0]
        mixed, z, b, a = ops.linear(x, self.in_proj).split(self.splits, dim=-1)
        # No copies: the conv kernels read mixed (the q|k|v columns of the projection, a strided
        # view) where it lies, and every kernel writes its row group's rows of the step buffers.
        conv_out = x.new_empty(num_tokens, c.conv_dim)
        core = x.new_empty(num_tokens, c.linear_num_value_heads, c.linear_value_head_dim)
        dec, pre = batch.decode, batch.prefill
        if dec.num_rows:
            span = slice(dec.token_start, dec.token_end)
            # pending_conv_out [rows, P, conv_dim]: the conv outputs of each row's pending drafts
            _, pending_conv_out = ops.causal_conv1d_decode(
                mixed[span], self.conv_weight, dec.cu_seqlens, dec.slot_ids, state.conv, state.pending_conv,
                state.pending_counts, batch.commit, out=conv_out[span])
        if pre.num_rows:
            span = slice(pre.token_start, pre.token_end)
            ops.causal_conv1d_prefill(mixed[span], self.conv_weight, pre.cu_seqlens, pre.slot_ids,
                                      pre.has_initial_state, state.conv, out=conv_out[span])
        q, k, v = self._split_heads(conv_out)
        if dec.num_rows:
            span = slice(dec.token_start, dec.token_end)
            _, pending_k, pending_v = self._split_heads(pending_conv_out)
            ops.gdn_decode(q[span], k[span], v[span], a[span], b[span], self.A_log, self.dt_bias, dec.cu_seqlens,
                           dec.slot_ids, state.recurrent, pending_k, pending_v, state.pending_g, state.pending_beta,
                           state.pending_counts, batch.commit, out=core[span])
        if pre.num_rows:
            span = slice(pre.token_start, pre.token_end)
            written = batch.checkpoints
            checkpoints = {}
            if written is not None:  # lengths checked when the batch was built: no host sync here
                saved = state.recurrent.new_empty((written.slots.numel(), *state.recurrent.shape[1:]))
                checkpoints = dict(checkpoint_cu=written.cu, checkpoint_lengths=written.lengths,
                                   checkpoint_states=saved, lengths_checked=True)
            ops.gdn_chunked(q[span], k[span], v[span], a[span], b[span], self.A_log, self.dt_bias, pre.cu_seqlens,
                            pre.slot_ids, pre.has_initial_state, state.recurrent, **checkpoints, out=core[span])
            if written is not None:
                state.recurrent[written.slots] = saved
                state.conv[written.slots] = checkpoint_conv_windows(mixed[span], written, state.conv)
        gate = z.reshape(num_tokens, c.linear_num_value_heads, c.linear_value_head_dim)
        core = ops.gated_rms_norm(core, gate, self.norm_weight, c.rms_norm_eps)
        return ops.linear(core.reshape(num_tokens, -1), self.out_proj)


class GatedAttention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # qkv_proj rows: [q_h | gate_h] per head (as q_proj stores them) | k | v
        self.splits = (2 * hq * d, hkv * d, hkv * d)
        self.qkv_proj = _param(sum(self.splits), c.hidden_size, dtype=dtype)
        self.q_norm = _param(d, dtype=dtype)
        self.k_norm = _param(d, dtype=dtype)
        self.o_proj = _param(c.hidden_size, hq * d, dtype=dtype)

    def checkpoint_map(self, src: str, dst: str) -> CheckpointMap:
        q, kv, _ = self.splits
        return {
            f"{src}.q_proj.weight": (f"{dst}.qkv_proj", _rows(0, q)),
            f"{src}.k_proj.weight": (f"{dst}.qkv_proj", _rows(q, kv)),
            f"{src}.v_proj.weight": (f"{dst}.qkv_proj", _rows(q + kv, kv)),
            f"{src}.q_norm.weight": (f"{dst}.q_norm", ALL),
            f"{src}.k_norm.weight": (f"{dst}.k_norm", ALL),
            f"{src}.o_proj.weight": (f"{dst}.o_proj", ALL),
        }

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVLayer, ops: Ops) -> torch.Tensor:
        c, num_tokens = self.c, x.shape[0]
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_gate, k, v = ops.linear(x, self.qkv_proj).split(self.splits, dim=-1)
        q_gate = q_gate.view(num_tokens, hq, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:]
        q, k = ops.qk_norm_rope(q, k.view(num_tokens, hkv, d), self.q_norm, self.k_norm, batch.positions,
                                c.rotary_dim, c.rope_theta, c.rms_norm_eps)
        ops.write_kv(k, v.view(num_tokens, hkv, d), kv.k_cache, kv.v_cache, batch.slot_mapping)
        # attention * sigmoid(gate), the gate applied by the kernel that stores the output
        out = ops.paged_attention(q, kv.k_cache, kv.v_cache, batch.block_tables, batch.cu_seqlens, batch.context_lens,
                                  d ** -0.5, gate)
        return ops.linear(out.reshape(num_tokens, hq * d), self.o_proj)


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = _param(2 * intermediate_size, hidden_size, dtype=dtype)
        self.down = _param(hidden_size, intermediate_size, dtype=dtype)

    def checkpoint_map(self, src: str, dst: str) -> CheckpointMap:
        i = self.intermediate_size
        return {
            f"{src}.gate_proj.weight": (f"{dst}.gate_up", _rows(0, i)),
            f"{src}.up_proj.weight": (f"{dst}.gate_up", _rows(i, i)),
            f"{src}.down_proj.weight": (f"{dst}.down", ALL),
        }

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.gate_up)), self.down)


class MoEMLP(nn.Module):
    """Routed experts + shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.router = _param(e, h, dtype=dtype)
        self.w_gate_up = _param(e, 2 * i, h, dtype=dtype)
        self.w_down = _param(e, h, i, dtype=dtype)
        self.shared = DenseMLP(h, c.shared_expert_intermediate_size, dtype)
        self.shared_gate = _param(1, h, dtype=dtype)

    def checkpoint_map(self, src: str, dst: str) -> CheckpointMap:
        i = self.c.moe_intermediate_size
        mapping = {
            f"{src}.gate.weight": (f"{dst}.router", ALL),
            f"{src}.shared_expert_gate.weight": (f"{dst}.shared_gate", ALL),
            # Experts come either fused over all experts or one tensor per expert.
            f"{src}.experts.gate_up_proj": (f"{dst}.w_gate_up", ALL),
            f"{src}.experts.down_proj": (f"{dst}.w_down", ALL),
            **self.shared.checkpoint_map(f"{src}.shared_expert", f"{dst}.shared"),
        }
        for e in range(self.c.num_experts):
            mapping[f"{src}.experts.{e}.gate_proj.weight"] = (f"{dst}.w_gate_up", (e, slice(0, i)))
            mapping[f"{src}.experts.{e}.up_proj.weight"] = (f"{dst}.w_gate_up", (e, slice(i, 2 * i)))
            mapping[f"{src}.experts.{e}.down_proj.weight"] = (f"{dst}.w_down", (e,))
        return mapping

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        weights, experts = ops.moe_route(ops.linear(x, self.router), self.c.num_experts_per_tok,
                                         self.c.norm_topk_prob)
        routed = ops.moe_experts(x, weights, experts, self.w_gate_up, self.w_down)
        return routed + torch.sigmoid(ops.linear(x, self.shared_gate)) * self.shared(x, ops)


class DecoderLayer(nn.Module):
    """Pre-norm block: residual += mixer(norm(x)); residual += mlp(norm(residual)).

    The residual add is fused into the next RMSNorm, so a layer returns (mlp_out, residual) and
    the stream is materialised only inside the fused norm."""

    def __init__(self, c: ModelConfig, is_gdn: bool, is_moe: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = c.rms_norm_eps
        self.input_norm = _param(c.hidden_size, dtype=dtype)
        self.post_attention_norm = _param(c.hidden_size, dtype=dtype)
        self.mixer = GatedDeltaNet(c, dtype) if is_gdn else GatedAttention(c, dtype)
        self.mlp = MoEMLP(c, dtype) if is_moe else DenseMLP(c.hidden_size, c.intermediate_size, dtype)

    def checkpoint_map(self, src: str, dst: str) -> CheckpointMap:
        mixer_src = f"{src}.linear_attn" if isinstance(self.mixer, GatedDeltaNet) else f"{src}.self_attn"
        return {
            f"{src}.input_layernorm.weight": (f"{dst}.input_norm", ALL),
            f"{src}.post_attention_layernorm.weight": (f"{dst}.post_attention_norm", ALL),
            **self.mixer.checkpoint_map(mixer_src, f"{dst}.mixer"),
            **self.mlp.checkpoint_map(f"{src}.mlp", f"{dst}.mlp"),
        }

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                mixer_state: GDNLayerState | KVLayer, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = ops.rms_norm(x, self.input_norm, self.eps, residual)
        x = self.mixer(x, batch, mixer_state, ops)
        x, residual = ops.rms_norm(x, self.post_attention_norm, self.eps, residual)
        return self.mlp(x, ops), residual
