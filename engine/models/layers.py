"""Building blocks of the hybrid family: GDN mixer, gated attention, dense and MoE MLPs, and
the decoder layer that wraps them. Every heavy op goes through the `Ops` table, dense
projections too (`ops.linear`: a skinny-GEMM kernel for decode batches, cuBLAS otherwise).

Projections are `Linear`s stored fused for one GEMM each (GDN q|k|v|z|b|a, attention
q+gate|k|v, MLP gate|up); `checkpoint_map` says which checkpoint tensor fills which region, so
the loader needs no knowledge of the modules. Each module is built with its checkpoint name
(`src`), which decides, for a quantized checkpoint, whether a projection is stored in FP8 with
block scales or as packed integers with group scales (engine/quantization.py). Knows nothing
about checkpoint files or scheduling.

The residual-stream form (`DecoderLayer.forward_stream`, where the Ops table's linear fuses the
block ops: kernels/linear.py): each block's RMSNorm weights are folded into the projections
after them at load time (`fold_norms`; the norms keep a zero weight, so the other form computes
the same), the stream is one tensor the blocks update in place, a projection after a norm reads
it as a `Stream` (normalising its rows in its own kernel), the block's last projection adds its
output into it, and the MLP's gate_up applies SwiGLU itself. One device, bf16 projections and
dense MLPs only; otherwise `forward`, where the norm kernels fuse the residual add. Quantized
projections fuse no block op: their norm weights cannot fold into quantized values.

FP8 activations: at decode, verify and draft batches (<= SKINNY_MAX_ROWS rows, the Triton FP8
GEMM's) the op before an FP8 projection quantizes its own output (`quantize_group`: the norms,
the GDN's gated norm, silu_and_mul) and hands on a QuantizedActivation, whose fp8 values and
scales the GEMM reads instead of launching its quantizer; bf16 consumers of the same output (the
GDN's b|a, the MoE router) read its values. Prefill batches keep the GEMM's own quantizer (cuBLAS
reads column-major scales). DELTASPEC_FUSE_FP8_QUANT=0, read as a model is built, turns the
fusion off (A/B timing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import triton
from torch import nn

from ...kernels import Ops
from ...kernels.conv1d import ConvDecode
from ...kernels.fp8 import FP8, SKINNY_MAX_ROWS, block_scales
from ...kernels.wna16 import pack_reference, unpack_reference
from ...kernels.norms import GatedNorm
from ...kernels.rope import QKNormRopeKV
from ...kernels.quantize import Activation, activation_values
from ..batch import ForwardBatch, PrefillCheckpoints
from ..model_config import ConfigError, ModelConfig
from ..quantization import Fp8Config, Wna16Config
from ..state_pool import GDNLayerState, KVLayer

# checkpoint name -> (parameter name, index into that parameter)
CheckpointMap = dict[str, tuple[str, tuple]]


class ReduceNorm(Protocol):
    """ops.rms_norm of x summed over the tensor-parallel ranks (HybridLM.reduce_norm): (normed,
    new residual). normed is a QuantizedActivation when quantize_group > 0, except from the
    symmetric-memory all-reduce kernel, which does not quantize (TensorParallel)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 quantize_group: int = 0) -> tuple[Activation, torch.Tensor]: ...

ALL = (slice(None),)


@dataclass(frozen=True)
class Stream:
    """The residual stream [T, H] as a projection's input: the projection RMS-normalises its rows
    (Linear.forward: ops.linear's norm_eps) with the norm's weight folded into its own."""
    values: torch.Tensor
    eps: float


def _num_tokens(x: Activation | Stream) -> int:
    return (x.values if isinstance(x, Stream) else activation_values(x)).shape[0]


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


def _is_fp8(c: ModelConfig, modules) -> bool:
    return isinstance(c.quantization, Fp8Config) and c.quantization.quantizes_all(modules)


def _is_wna16(c: ModelConfig, modules) -> bool:
    return isinstance(c.quantization, Wna16Config) and c.quantization.quantizes_all(modules)


def _is_quantized(c: ModelConfig, modules) -> bool:
    return c.quantization is not None and c.quantization.quantizes_all(modules)


def _fused_group(group_size: int) -> int:
    """The group the op before FP8 projections of group_size (0: bf16 ones) quantizes its output
    with at skinny batches: theirs, or 0 under DELTASPEC_FUSE_FP8_QUANT=0."""
    return group_size if os.environ.get("DELTASPEC_FUSE_FP8_QUANT", "1") != "0" else 0


def _at_skinny(group_size: int, num_rows: int) -> int:
    """quantize_group for an op of num_rows output rows: the fused group at decode, verify and
    draft batches, where the Triton FP8 GEMM reads the row-major scales the op writes; 0 above."""
    return group_size if num_rows <= SKINNY_MAX_ROWS else 0


def _scale_map(module: str, param: str, index: tuple, fp8: bool, wna16: bool, zero_point: bool) -> CheckpointMap:
    """A quantized checkpoint projection's scales (and zero points) -> `param`_scale
    (`param`_zero_point) at index: FP8's weight_scale_inv, the canonical weight-only leaves
    (engine/wna16_tensors.py)."""
    if fp8:
        return {f"{module}.weight_scale_inv": (f"{param}_scale", index)}
    if not wna16:
        return {}
    return {f"{module}.weight_scale": (f"{param}_scale", index),
            **({f"{module}.weight_zero_point": (f"{param}_zero_point", index)} if zero_point else {})}


class Linear(nn.Module):
    """y = x W^T for the checkpoint projections `parts` (module name -> rows), stacked in order.

    W is `weight` [N, K] in the model dtype; or, when the checkpoint stores these projections in
    FP8, float8_e4m3fn with `weight_scale` [N, ceil(K / G)] float32 (each checkpoint block scale
    repeated over its rows: see kernels/fp8.py); or, in a weight-only integer checkpoint,
    `weight` [N, K / P] int32 of packed `bits`-bit values with `weight_scale` [N, KG] float32 and
    `weight_zero_point` [N, KG] uint8 (None: symmetric) per group of `weight_group` columns
    (kernels/wna16.py's layout; engine/wna16_tensors.py converts each format to it). No
    dequantized copy is kept."""

    def __init__(self, c: ModelConfig, parts: dict[str, int], in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.parts = parts
        num_rows = sum(parts.values())
        self.block_scale = None    # FP8 with whole-block scales: [ceil(N / bn), KB] (finish_loading)
        self.weight_scale = self.weight_zero_point = self.g_idx = None
        self.group_size = self.block_rows = 0    # FP8: the activation group the op before may quantize in
        self.bits = 0                             # weight-only integers: bits a value (0: not such a projection)
        self.perm = None           # act-order: x's columns in the order the groups were formed (finish_loading)
        if _is_fp8(c, parts):
            self.group_size = c.quantization.group_size
            self.block_rows = c.quantization.weight_block_size[0]
            self.weight = _param(num_rows, in_features, dtype=FP8)
            self.weight_scale = _param(num_rows, triton.cdiv(in_features, self.group_size), dtype=torch.float32)
        elif _is_wna16(c, parts):
            q = c.quantization
            self.bits, self.weight_group = q.bits, q.columns_per_group(in_features)
            num_groups = triton.cdiv(in_features, self.weight_group)
            self.weight = _param(num_rows, in_features // q.pack, dtype=torch.int32)
            self.weight_scale = _param(num_rows, num_groups, dtype=torch.float32)
            if not q.symmetric:
                self.weight_zero_point = _param(num_rows, num_groups, dtype=torch.uint8)
            if q.act_order:  # each part's g_idx; fused parts must agree (finish_loading)
                self.g_idx = _param(len(parts), in_features, dtype=torch.int32)
        else:
            self.weight = _param(num_rows, in_features, dtype=dtype)

    def finish_loading(self) -> None:
        """After the weights are in: an FP8 checkpoint's block scales, where the per-row scales
        are whole blocks (kernels/fp8.py block_scales), for the GPU table's cuBLAS prefill path;
        an act-order checkpoint's permutation (`_order_groups`)."""
        if self.is_fp8 and self.block_rows == 128:   # cuBLAS's blocks are 128 x 128
            self.block_scale = block_scales(self.weight_scale.data, self.block_rows)
        if self.g_idx is not None:
            self._order_groups()

    def _order_groups(self) -> None:
        """Act-order (GPTQ desc_act, compressed-tensors actorder "group"): column k of W belongs
        to group g_idx[k]. Sorting the columns by group (perm, stable) makes each group's
        columns contiguous, so W[:, perm] is an ordinary grouped weight and y = x[:, perm] @
        W[:, perm]^T; the kernel gathers x through perm. A trivial g_idx leaves W as it is."""
        g_idx = self.g_idx.data
        if not torch.equal(g_idx, g_idx[:1].expand_as(g_idx)):
            raise ValueError(f"the act-order g_idx of {', '.join(self.parts)} differ: deltaspec runs these "
                             f"projections as one GEMM over one order of x's columns")
        g_idx, in_features = g_idx[0].long(), g_idx.shape[1]
        groups = torch.arange(in_features, device=g_idx.device) // self.weight_group
        self.g_idx = None
        if torch.equal(g_idx, groups):
            return
        perm = torch.sort(g_idx, stable=True).indices
        if not torch.equal(g_idx[perm], groups):
            raise ValueError(f"the act-order g_idx of {', '.join(self.parts)} has groups of other than "
                             f"{self.weight_group} columns")
        values = unpack_reference(self.weight.data, self.bits)
        self.weight.data.copy_(pack_reference(values[:, perm], self.bits))
        self.perm = perm.to(torch.int32)

    def checkpoint_map(self, dst: str) -> CheckpointMap:
        mapping, start = {}, 0
        for part, (module, num_rows) in enumerate(self.parts.items()):
            rows = _rows(start, num_rows)
            mapping[f"{module}.weight"] = (f"{dst}.weight", rows)
            mapping.update(_scale_map(module, f"{dst}.weight", rows, self.is_fp8, self.is_wna16,
                                      self.weight_zero_point is not None))
            if self.g_idx is not None:
                mapping[f"{module}.g_idx"] = (f"{dst}.g_idx", (part,))
            start += num_rows
        return mapping

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8

    @property
    def is_wna16(self) -> bool:
        return self.bits > 0

    @property
    def is_quantized(self) -> bool:
        return self.is_fp8 or self.is_wna16

    def fold_norm(self, norm_weight: torch.Tensor) -> None:
        """W <- W diag(1 + w): the zero-centred RMSNorm weight of the norm before this projection
        (layers' forward_stream), in float32, rounded once. bf16 / fp32 weights only."""
        assert not self.is_quantized, "fold_norm: quantized weights keep their scales"
        self.weight.data.copy_(self.weight.data.float() * (1.0 + norm_weight.float()))

    def forward(self, x: Activation | Stream, ops: Ops, *, glu: bool = False,
                residual: torch.Tensor | None = None, conv: ConvDecode | None = None,
                gated_norm: GatedNorm | None = None, rope_kv: QKNormRopeKV | None = None) -> torch.Tensor:
        """x plain, quantized by the op before (read as values by a bf16 projection), or the
        residual stream to normalise; glu: silu(gate) * up of a [gate; up] projection; residual:
        the output added into it (in place; returned); conv: the GDN's decode conv of the output's
        first columns; gated_norm: the GDN's gated norm of x by heads (kernels/linear.py); rope_kv:
        the gated attention's q/k norm, RoPE and KV write of the output (kernels/rope.py). A
        quantized projection takes rope_kv and conv (run after it, or for FP8 in its launch:
        ops.fp8_linear), none of the others."""
        values, norm_eps = (x.values, x.eps) if isinstance(x, Stream) else (activation_values(x), None)
        if self.is_quantized:
            assert norm_eps is None and not glu and residual is None and gated_norm is None, \
                "quantized projections fuse no block op but the decode conv"
            if self.is_fp8:
                y = ops.fp8_linear(x, self.weight, self.weight_scale, self.group_size, self.block_scale, conv=conv)
            else:
                y = ops.wna16_linear(values, self.weight, self.weight_scale, self.weight_zero_point, self.perm,
                                     self.weight_group, self.bits)
                if conv is not None:
                    ops.causal_conv1d_decode(y[:, :conv.weight.shape[0]], *conv)
            if rope_kv is not None:
                ops.qk_norm_rope_kv(y, rope_kv)
            return y
        return ops.linear(values, self.weight, norm_eps=norm_eps, glu=glu, residual=residual, conv=conv,
                          gated_norm=gated_norm, rope_kv=rope_kv)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: ModelConfig, src: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.c, self.src = c, src
        hv = c.linear_num_value_heads
        # in_proj rows: q | k | v (the conv channels) | z | b | a. Quantized checkpoints keep b
        # and a in bf16: then they are a second, small projection in_proj_ba.
        self.splits = (c.conv_dim, c.linear_value_dim, hv, hv)
        qkvz = {f"{src}.in_proj_qkv": c.conv_dim, f"{src}.in_proj_z": c.linear_value_dim}
        ba = {f"{src}.in_proj_b": hv, f"{src}.in_proj_a": hv}
        if _is_quantized(c, qkvz) == _is_quantized(c, ba):
            self.in_proj, self.in_proj_ba = Linear(c, {**qkvz, **ba}, c.hidden_size, dtype), None
        else:
            self.in_proj, self.in_proj_ba = Linear(c, qkvz, c.hidden_size, dtype), Linear(c, ba, c.hidden_size, dtype)
        self.conv_weight = _param(c.conv_dim, c.linear_conv_kernel_dim, dtype=dtype)
        # Gating parameters stay float32: g = -exp(A_log) * softplus(a + dt_bias) is computed there.
        self.A_log = _param(hv, dtype=torch.float32)
        self.dt_bias = _param(hv, dtype=torch.float32)
        self.norm_weight = _param(c.linear_value_head_dim, dtype=dtype)
        self.out_proj = Linear(c, {f"{src}.out_proj": c.hidden_size}, c.linear_value_dim, dtype)
        self.input_group_size = self.in_proj.group_size     # of the FP8 projection of x (0: none)
        self.out_quantize_group = _fused_group(self.out_proj.group_size)

    def checkpoint_map(self, dst: str) -> CheckpointMap:
        src = self.src
        return {
            **self.in_proj.checkpoint_map(f"{dst}.in_proj"),
            **(self.in_proj_ba.checkpoint_map(f"{dst}.in_proj_ba") if self.in_proj_ba is not None else {}),
            **self.out_proj.checkpoint_map(f"{dst}.out_proj"),
            f"{src}.conv1d.weight": (f"{dst}.conv_weight", ALL),
            f"{src}.A_log": (f"{dst}.A_log", ALL),
            f"{src}.dt_bias": (f"{dst}.dt_bias", ALL),
            f"{src}.norm.weight": (f"{dst}.norm_weight", ALL),
        }

    def _split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., conv_dim] -> views q, k [..., HK, K] and v [..., HV, V]."""
        c = self.c
        q, k, v = conv_out.split((c.linear_key_dim, c.linear_key_dim, c.linear_value_dim), dim=-1)
        return (q.unflatten(-1, (c.linear_num_key_heads, c.linear_key_head_dim)),
                k.unflatten(-1, (c.linear_num_key_heads, c.linear_key_head_dim)),
                v.unflatten(-1, (c.linear_num_value_heads, c.linear_value_head_dim)))

    @property
    def input_projection(self) -> Linear | None:
        """The one projection of the block's normed input, where there is one (FP8 checkpoints
        split b|a off)."""
        return self.in_proj if self.in_proj_ba is None else None

    def forward(self, x: Activation | Stream, batch: ForwardBatch, state: GDNLayerState, ops: Ops,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: the stream out_proj adds its output into (forward_stream)."""
        c, num_tokens = self.c, _num_tokens(x)
        dec, pre = batch.decode, batch.prefill
        # No copies: the conv kernels read mixed (the q|k|v columns of the projection, a strided
        # view) where it lies, and every kernel writes its row group's rows of the step buffers
        # (in the model dtype, the conv weight's, as the projection's output).
        conv_out, conv = self.conv_weight.new_empty(num_tokens, c.conv_dim), None
        # A decode-only batch: the projection runs the conv (in its own launch where it fuses it).
        if dec.num_rows and not pre.num_rows:
            # pending_conv_out [rows, P, conv_dim]: the conv outputs of each row's pending drafts
            pending_conv_out = self.conv_weight.new_empty(dec.num_rows, state.pending_conv.shape[1], c.conv_dim)
            conv = ConvDecode(self.conv_weight, dec.cu_seqlens, dec.slot_ids, state.conv, state.pending_conv,
                              state.pending_counts, batch.commit, conv_out, pending_conv_out)
        if self.in_proj_ba is None:
            mixed, z, b, a = self.in_proj(x, ops, conv=conv).split(self.splits, dim=-1)
        else:
            mixed, z = self.in_proj(x, ops, conv=conv).split(self.splits[:2], dim=-1)
            b, a = self.in_proj_ba(x, ops).split(self.splits[2:], dim=-1)
        core = mixed.new_empty(num_tokens, c.linear_num_value_heads, c.linear_value_head_dim)
        if dec.num_rows and conv is None:
            span = slice(dec.token_start, dec.token_end)
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
        if not self.out_proj.is_quantized:  # the projection runs the gated norm (in the one-row form, itself)
            return self.out_proj(core.reshape(num_tokens, -1), ops, residual=residual,
                                 gated_norm=GatedNorm(z, self.norm_weight, c.rms_norm_eps))
        gate = z.reshape(num_tokens, c.linear_num_value_heads, c.linear_value_head_dim)
        quantize_group = _at_skinny(self.out_quantize_group, num_tokens)
        core = ops.gated_rms_norm(core, gate, self.norm_weight, c.rms_norm_eps, quantize_group=quantize_group)
        return self.out_proj(core if quantize_group else core.reshape(num_tokens, -1), ops, residual=residual)


class GatedAttention(nn.Module):
    def __init__(self, c: ModelConfig, src: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.c, self.src = c, src
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # qkv_proj rows: [q_h | gate_h] per head (as q_proj stores them) | k | v
        self.splits = (2 * hq * d, hkv * d, hkv * d)
        q, kv, _ = self.splits
        self.qkv_proj = Linear(c, {f"{src}.q_proj": q, f"{src}.k_proj": kv, f"{src}.v_proj": kv}, c.hidden_size, dtype)
        self.q_norm = _param(d, dtype=dtype)
        self.k_norm = _param(d, dtype=dtype)
        self.o_proj = Linear(c, {f"{src}.o_proj": c.hidden_size}, hq * d, dtype)
        self.input_group_size = self.qkv_proj.group_size

    def checkpoint_map(self, dst: str) -> CheckpointMap:
        return {
            **self.qkv_proj.checkpoint_map(f"{dst}.qkv_proj"),
            f"{self.src}.q_norm.weight": (f"{dst}.q_norm", ALL),
            f"{self.src}.k_norm.weight": (f"{dst}.k_norm", ALL),
            **self.o_proj.checkpoint_map(f"{dst}.o_proj"),
        }

    @property
    def input_projection(self) -> Linear:
        return self.qkv_proj

    def forward(self, x: Activation | Stream, batch: ForwardBatch, kv: KVLayer, ops: Ops,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: the stream o_proj adds its output into (forward_stream)."""
        c, num_tokens = self.c, _num_tokens(x)
        hq, d = c.num_attention_heads, c.head_dim
        q = torch.empty(num_tokens, hq, d, dtype=self.q_norm.dtype, device=kv.k_cache.device)  # the model's dtype
        rope_kv = QKNormRopeKV(q, self.q_norm, self.k_norm, batch.positions, c.rotary_dim, c.rope_theta,
                               c.rms_norm_eps, c.yarn, kv.k_cache, kv.v_cache, batch.slot_mapping, c.mrope_section)
        qkv = self.qkv_proj(x, ops, rope_kv=rope_kv)     # q normalised and rotated, k and v in the pool
        gate = qkv[:, :self.splits[0]].view(num_tokens, hq, 2 * d)[..., d:]
        # attention * sigmoid(gate), the gate applied by the kernel that stores the output
        out = ops.paged_attention(q, kv.k_cache, kv.v_cache, batch.block_tables, batch.cu_seqlens, batch.context_lens,
                                  d ** -0.5, gate)
        return self.o_proj(out.reshape(num_tokens, hq * d), ops, residual=residual)


class DenseMLP(nn.Module):
    def __init__(self, c: ModelConfig, src: str, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        i = intermediate_size
        self.gate_up = Linear(c, {f"{src}.gate_proj": i, f"{src}.up_proj": i}, c.hidden_size, dtype)
        self.down = Linear(c, {f"{src}.down_proj": c.hidden_size}, i, dtype)
        self.input_group_size = self.gate_up.group_size
        self.down_quantize_group = _fused_group(self.down.group_size)

    def checkpoint_map(self, dst: str) -> CheckpointMap:
        return {**self.gate_up.checkpoint_map(f"{dst}.gate_up"), **self.down.checkpoint_map(f"{dst}.down")}

    def forward(self, x: Activation | Stream, ops: Ops, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: the stream down adds its output into (forward_stream), where SwiGLU runs
        inside gate_up's op (ops.linear's glu); otherwise silu_and_mul, which quantizes for an
        FP8 down projection."""
        if residual is not None:
            return self.down(self.gate_up(x, ops, glu=True), ops, residual=residual)
        gate_up = self.gate_up(x, ops)
        return self.down(ops.silu_and_mul(gate_up, _at_skinny(self.down_quantize_group, gate_up.shape[0])), ops)


class MoEMLP(nn.Module):
    """Routed experts + shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, c: ModelConfig, src: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.c, self.src = c, src
        i, h = c.moe_intermediate_size, c.hidden_size
        # Under expert parallelism this rank holds experts c.local_experts only; the router
        # scores every expert.
        e = len(c.local_experts)
        self.expert_parallel = e != c.num_experts
        self.router = Linear(c, {f"{src}.gate": c.num_experts}, h, dtype)
        expert_modules = [f"{src}.experts.{n}.{p}_proj" for n in c.local_experts for p in ("gate", "up", "down")]
        self.group_size = self.bits = 0
        self.w_gate_up_scale = self.w_down_scale = self.w_gate_up_zero_point = self.w_down_zero_point = None
        if _is_fp8(c, expert_modules):
            # FP8 experts (stored per expert) with their block scales repeated over rows.
            g = self.group_size = c.quantization.group_size
            self.w_gate_up = _param(e, 2 * i, h, dtype=FP8)
            self.w_down = _param(e, h, i, dtype=FP8)
            self.w_gate_up_scale = _param(e, 2 * i, triton.cdiv(h, g), dtype=torch.float32)
            self.w_down_scale = _param(e, h, triton.cdiv(i, g), dtype=torch.float32)
        elif _is_wna16(c, expert_modules):
            # Packed integer experts (kernels/wna16.py's layout), stored per expert.
            q = c.quantization
            if q.act_order or q.group_size == -1:
                raise ConfigError("MoE experts quantized with act-order (g_idx) or per channel (group_size -1) are "
                                 "not supported: the grouped expert GEMMs take one group size and x in one order")
            self.bits, self.weight_group = q.bits, q.group_size
            groups_h, groups_i = triton.cdiv(h, self.weight_group), triton.cdiv(i, self.weight_group)
            self.w_gate_up = _param(e, 2 * i, h // q.pack, dtype=torch.int32)
            self.w_down = _param(e, h, i // q.pack, dtype=torch.int32)
            self.w_gate_up_scale = _param(e, 2 * i, groups_h, dtype=torch.float32)
            self.w_down_scale = _param(e, h, groups_i, dtype=torch.float32)
            if not q.symmetric:
                self.w_gate_up_zero_point = _param(e, 2 * i, groups_h, dtype=torch.uint8)
                self.w_down_zero_point = _param(e, h, groups_i, dtype=torch.uint8)
        else:
            self.w_gate_up = _param(e, 2 * i, h, dtype=dtype)
            self.w_down = _param(e, h, i, dtype=dtype)
        self.shared = DenseMLP(c, f"{src}.shared_expert", c.shared_expert_intermediate_size, dtype)
        self.shared_gate = Linear(c, {f"{src}.shared_expert_gate": 1}, h, dtype)
        # The FP8 experts and shared expert read x in the one group size of the checkpoint.
        self.input_group_size = self.group_size or self.shared.input_group_size

    def checkpoint_map(self, dst: str) -> CheckpointMap:
        src, i = self.src, self.c.moe_intermediate_size
        mapping = {
            **self.router.checkpoint_map(f"{dst}.router"),
            **self.shared_gate.checkpoint_map(f"{dst}.shared_gate"),
            # Experts come either fused over all experts or one tensor per expert.
            f"{src}.experts.gate_up_proj": (f"{dst}.w_gate_up", ALL),
            f"{src}.experts.down_proj": (f"{dst}.w_down", ALL),
            **self.shared.checkpoint_map(f"{dst}.shared"),
        }
        first = self.c.first_local_expert
        for e in self.c.local_experts:
            rows = {"gate": (e - first, slice(0, i)), "up": (e - first, slice(i, 2 * i)), "down": (e - first,)}
            for projection, index in rows.items():
                target = "w_down" if projection == "down" else "w_gate_up"
                module = f"{src}.experts.{e}.{projection}_proj"
                mapping[f"{module}.weight"] = (f"{dst}.{target}", index)
                mapping.update(_scale_map(module, f"{dst}.{target}", index, self.group_size > 0, self.bits > 0,
                                          self.w_down_zero_point is not None))
        return mapping

    def forward(self, x: Activation, ops: Ops) -> torch.Tensor:
        weights, experts = ops.moe_route(self.router(x, ops), self.c.num_experts_per_tok, self.c.norm_topk_prob)
        if self.expert_parallel:
            weights, experts = self._local_pairs(weights, experts)
        if self.group_size:
            routed = ops.fp8_moe_experts(x, weights, experts, self.w_gate_up, self.w_gate_up_scale, self.w_down,
                                         self.w_down_scale, self.group_size)
        elif self.bits:
            routed = ops.wna16_moe_experts(activation_values(x), weights, experts, self.w_gate_up, self.w_gate_up_scale,
                                           self.w_gate_up_zero_point, self.w_down, self.w_down_scale,
                                           self.w_down_zero_point, self.weight_group, self.bits)
        else:
            routed = ops.moe_experts(activation_values(x), weights, experts, self.w_gate_up, self.w_down)
        return routed + torch.sigmoid(self.shared_gate(x, ops)) * self.shared(x, ops)

    def _local_pairs(self, weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: the routed (token, expert) pairs [T, k] in this rank's expert
        numbering; the pairs of other ranks' experts get the id num_local_experts, outside the
        rank's experts, which the expert ops skip (kernels/moe.py: no compute, no weight read).
        Every rank has every token; the all-reduce after the MLP adds the ranks' contributions."""
        num_local = len(self.c.local_experts)
        local = experts - self.c.first_local_expert
        return weights, torch.where((local >= 0) & (local < num_local), local, num_local)


class DecoderLayer(nn.Module):
    """Pre-norm block: residual += mixer(norm(x)); residual += mlp(norm(residual)).

    The residual add is fused into the next RMSNorm, so a layer returns (mlp_out, residual) and
    the stream is materialised only inside the fused norm. Under tensor parallelism the mixer's
    and the MLP's outputs are partial sums (row-parallel), summed over the ranks by the norm
    after each: `reduce_norm` (HybridLM.reduce_norm), ops.rms_norm itself on one device."""

    def __init__(self, c: ModelConfig, src: str, is_gdn: bool, is_moe: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps, self.src = c.rms_norm_eps, src
        self.input_norm = _param(c.hidden_size, dtype=dtype)
        self.post_attention_norm = _param(c.hidden_size, dtype=dtype)
        self.mixer = GatedDeltaNet(c, f"{src}.linear_attn", dtype) if is_gdn else \
            GatedAttention(c, f"{src}.self_attn", dtype)
        self.mlp = MoEMLP(c, f"{src}.mlp", dtype) if is_moe else \
            DenseMLP(c, f"{src}.mlp", c.intermediate_size, dtype)
        self.mixer_quantize_group = _fused_group(self.mixer.input_group_size)
        self.mlp_quantize_group = _fused_group(self.mlp.input_group_size)

    def checkpoint_map(self, dst: str) -> CheckpointMap:
        return {
            f"{self.src}.input_layernorm.weight": (f"{dst}.input_norm", ALL),
            f"{self.src}.post_attention_layernorm.weight": (f"{dst}.post_attention_norm", ALL),
            **self.mixer.checkpoint_map(f"{dst}.mixer"),
            **self.mlp.checkpoint_map(f"{dst}.mlp"),
        }

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                mixer_state: GDNLayerState | KVLayer, ops: Ops,
                reduce_norm: ReduceNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the layer before's MLP output (a partial sum under tensor parallelism) with the
        residual stream, or, without a residual, the stack's input (embeddings, the MTP's fc
        output: whole on every rank). Returns (this MLP's output, unreduced, and the residual).
        At skinny batches the norms also quantize their output for the FP8 projections after them."""
        num_rows = x.shape[0]
        x, residual = (ops.rms_norm if residual is None else reduce_norm)(
            x, self.input_norm, self.eps, residual, quantize_group=_at_skinny(self.mixer_quantize_group, num_rows))
        x = self.mixer(x, batch, mixer_state, ops)
        x, residual = reduce_norm(x, self.post_attention_norm, self.eps, residual,
                                  quantize_group=_at_skinny(self.mlp_quantize_group, num_rows))
        return self.mlp(x, ops), residual

    @property
    def foldable(self) -> bool:
        """Whether fold_norms and forward_stream apply: bf16 projections, a single one after each
        norm, a dense MLP."""
        return self.mixer.input_projection is not None and isinstance(self.mlp, DenseMLP) \
            and not any(m.is_quantized for m in self.modules() if isinstance(m, Linear))

    def fold_norms(self) -> None:
        """The two norms' weights into the projections after them; the norms keep zero weights
        (x / rms(x) * (1 + 0)), so `forward` computes what it did, `forward_stream` too."""
        assert self.foldable, "fold_norms: a layer with quantized or split input projections or an MoE MLP"
        for norm, projection in ((self.input_norm, self.mixer.input_projection),
                                 (self.post_attention_norm, self.mlp.gate_up)):
            projection.fold_norm(norm.data)
            norm.data.zero_()

    def forward_stream(self, stream: torch.Tensor, batch: ForwardBatch, mixer_state: GDNLayerState | KVLayer,
                       ops: Ops) -> torch.Tensor:
        """The residual-stream form (after fold_norms, on one device): stream [T, H] is updated in
        place, stream += mixer(norm(stream)), then stream += mlp(norm(stream)), each norm inside
        the projection that reads it and each add inside the block's last projection."""
        self.mixer(Stream(stream, self.eps), batch, mixer_state, ops, residual=stream)
        return self.mlp(Stream(stream, self.eps), ops, residual=stream)
