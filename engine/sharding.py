"""How a model is split over tensor-parallel ranks: this rank's model config and which slices of
each checkpoint tensor it reads.

By heads, as vLLM and SGLang split Qwen3-Next / Qwen3.5:
  GDN        in_proj_qkv and conv1d column-parallel per q / k / v block (each rank takes its key
             heads' q and k and its value heads' v, not a contiguous slice of the packed rows),
             in_proj_z, in_proj_b, in_proj_a, A_log, dt_bias per value head; the Qwen3-Next fused
             in_proj_qkvz / in_proj_ba are grouped per key head, so a rank's share is contiguous;
             out_proj row-parallel (its input columns). The recurrent state is [HV/tp, K, V].
  attention  q (with its gate) per query head, k / v per KV head (replicated when there are
             fewer KV heads than ranks: rank r uses KV head r * kv // tp), o_proj row-parallel.
  MLPs       gate / up column-parallel, down row-parallel; MoE experts split by their
             intermediate dimension, or under expert parallelism experts / tp whole experts per
             rank; the shared expert split like a dense MLP; the router replicated.
  vocabulary embed_tokens and lm_head by rows (the logits are gathered before sampling).
  replicated norms, q_norm / k_norm, the GDN output norm, the MTP fc, routers and gates.
One all-reduce after each mixer and each MLP (HybridLM's hooks). A rank's model config has its
head counts and widths divided, so the model code is the single-device code. Block-FP8 scales
are sliced with their 128-blocks: a split that cuts a block is refused. Knows nothing about
processes or files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .model_config import ModelConfig
from .quantization import Fp8Config

# (dim, start, stop): one slice of a checkpoint tensor; a rank's part is its pieces concatenated
# along dim.
Piece = tuple[int, int, int]


def check_divisible(c: ModelConfig, tp: int, expert_parallel: bool) -> None:
    """ValueError naming every size tp does not divide."""
    problems = []

    def need(name: str, value: int) -> None:
        if value % tp:
            problems.append(f"{name}={value}")

    need("num_attention_heads", c.num_attention_heads)
    if c.num_key_value_heads % tp and tp % c.num_key_value_heads:
        problems.append(f"num_key_value_heads={c.num_key_value_heads} (neither divides the other)")
    if c.gdn_layer_ids:
        need("linear_num_key_heads", c.linear_num_key_heads)
    if any(not c.is_moe_layer(i) for i in range(c.num_hidden_layers)) or not c.num_experts:
        need("intermediate_size", c.intermediate_size)
    if c.num_experts:
        need("num_experts" if expert_parallel else "moe_intermediate_size",
             c.num_experts if expert_parallel else c.moe_intermediate_size)
        need("shared_expert_intermediate_size", c.shared_expert_intermediate_size)
    need("vocab_size", c.vocab_size)
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's head counts and widths; it does not "
                         f"divide {', '.join(problems)}")


def shard_config(c: ModelConfig, tp: int, rank: int, expert_parallel: bool = False) -> ModelConfig:
    """Rank `rank`'s part of the model: heads and widths divided by tp (KV heads at least one),
    the vocabulary whole (HybridLM splits its rows), under expert parallelism its experts."""
    check_divisible(c, tp, expert_parallel)
    if tp == 1:
        return c
    experts = {}
    if c.num_experts and expert_parallel:
        share = c.num_experts // tp
        experts = dict(first_local_expert=rank * share, num_local_experts=share)
    return dataclasses.replace(
        c, num_attention_heads=c.num_attention_heads // tp,
        num_key_value_heads=max(1, c.num_key_value_heads // tp),
        linear_num_key_heads=c.linear_num_key_heads // tp if c.gdn_layer_ids else c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads // tp if c.gdn_layer_ids else c.linear_num_value_heads,
        intermediate_size=c.intermediate_size // tp if c.intermediate_size % tp == 0 else c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size if expert_parallel else c.moe_intermediate_size // tp,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size // tp, **experts)


class NotThisRank(Exception):
    """The tensor belongs to another rank only (an expert placed elsewhere)."""


@dataclass(frozen=True)
class Sharding:
    """Which slices of each checkpoint tensor rank `rank` of `size` reads. config: the whole model."""

    config: ModelConfig
    rank: int
    size: int
    expert_parallel: bool = False

    def pieces(self, name: str, shape: tuple[int, ...]) -> list[Piece] | None:
        """The slices of the canonical checkpoint tensor `name` (of `shape`) this rank reads:
        None when every rank reads it whole; raises NotThisRank when no part is this rank's.
        An FP8 block scale's pieces are its weight's, in blocks."""
        module, is_scale = name, False
        q = self.config.quantization
        scale = f".{q.scale_name}" if isinstance(q, Fp8Config) else ".weight_scale_inv"
        for leaf in (scale, ".weight"):
            if name.endswith(leaf):
                module, is_scale = name[:-len(leaf)], leaf == scale
        pieces = self._weight_pieces(module)
        if pieces is None or not is_scale:
            return pieces
        return self._block_pieces(name, pieces, shape)

    def _weight_pieces(self, module: str) -> list[Piece] | None:
        c, r, n = self.config, self.rank, self.size
        kind = module.rsplit(".", 1)[-1]

        def share(dim: int, total: int, offset: int = 0) -> Piece:
            return dim, offset + r * total // n, offset + (r + 1) * total // n

        if ".linear_attn." in module:
            rows = {"in_proj_z": c.linear_value_dim, "in_proj_b": c.linear_num_value_heads,
                    "in_proj_a": c.linear_num_value_heads, "A_log": c.linear_num_value_heads,
                    "dt_bias": c.linear_num_value_heads, "in_proj_ba": 2 * c.linear_num_value_heads,
                    "in_proj_qkvz": c.linear_num_key_heads * 2 * c.linear_key_head_dim + 2 * c.linear_value_dim}
            if kind in ("in_proj_qkv", "conv1d"):
                key = c.linear_key_dim
                return [share(0, key), share(0, key, key), share(0, c.linear_value_dim, 2 * key)]
            if kind in rows:
                return [share(0, rows[kind])]
            if kind == "out_proj":
                return [share(1, c.linear_value_dim)]
            return None
        if ".self_attn." in module:
            d, kv = c.head_dim, c.num_key_value_heads
            if kind == "q_proj":
                return [share(0, 2 * c.num_attention_heads * d)]
            if kind in ("k_proj", "v_proj"):
                if kv >= n:
                    return [share(0, kv * d)]
                head = r * kv // n  # fewer KV heads than ranks: replicated, n / kv ranks per head
                return [(0, head * d, (head + 1) * d)]
            if kind == "o_proj":
                return [share(1, c.num_attention_heads * d)]
            return None
        if ".mlp." in module or module.endswith(".mlp"):
            return self._mlp_pieces(module, kind, share)
        if module in ("model.embed_tokens", "lm_head"):
            return [share(0, c.vocab_size)]
        return None

    def _mlp_pieces(self, module: str, kind: str, share) -> list[Piece] | None:
        c = self.config
        if ".experts." in module or module.endswith(".experts"):
            parts = module.split(".experts.")[-1].split(".") if ".experts." in module else [kind]
            if self.expert_parallel:
                first, count = self.rank * c.num_experts // self.size, c.num_experts // self.size
                if parts[0].isdigit():  # per expert: this rank's experts whole, the others not at all
                    if not first <= int(parts[0]) < first + count:
                        raise NotThisRank(module)
                    return None
                return [(0, first, first + count)]  # fused [E, ...]: this rank's experts
            width = c.moe_intermediate_size
            if kind == "gate_up_proj":  # fused [E, 2I, H]: gate rows then up rows
                return [share(1, width), share(1, width, width)]
            if kind == "down_proj" and not parts[0].isdigit():  # fused [E, H, I]
                return [share(2, width)]
        elif ".shared_expert." in module:
            width = c.shared_expert_intermediate_size
        else:
            width = c.intermediate_size
        if kind in ("gate_proj", "up_proj"):
            return [share(0, width)]
        if kind == "down_proj":
            return [share(1, width)]
        return None

    def _block_pieces(self, name: str, pieces: list[Piece], shape: tuple[int, ...]) -> list[Piece]:
        """Weight pieces -> the pieces of its block scale [ceil(N / bn), ceil(K / bk)]; each
        piece must start on a block and end on one (or at the weight's end)."""
        block = self.config.quantization.weight_block_size
        out = []
        for dim, start, stop in pieces:
            if dim == 1 and block[0] == 1 and shape[1] == 1:   # FP8_DYNAMIC's one scale a row: every column piece's
                out.append((dim, 0, 1))
                continue
            b = block[dim]
            end = -(-stop // b)
            if start % b or (stop % b and end != shape[dim]):
                raise ValueError(f"tensor_parallel_size={self.size} cuts an FP8 {block[0]}x{block[1]} scale block of "
                                 f"{name} (rows or columns [{start}, {stop}) of this rank); use a tensor_parallel_size "
                                 f"whose shards are whole blocks")
            out.append((dim, start // b, end))
        return out
