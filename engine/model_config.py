"""Model configuration: one frozen, validated description of a hybrid GDN/attention model.

Read from an HF `config.json` of the families deltaspec serves. Knows nothing about weights,
devices or the engine; derived sizes are properties so they can never disagree with the fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..kernels.rope import Yarn

if TYPE_CHECKING:
    from .quantization import Fp8Config, Wna16Config
    from .vision.encoder import VisionConfig

# model_type -> family. The family decides the weight-name scheme and the MLP kind.
SUPPORTED_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}

# Qwen3.5's vision token ids, for config.json files that do not name them.
_QWEN3_5_VISION_TOKENS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                          "vision_end_token_id": 248054}

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class ConfigError(ValueError):
    """A config.json that deltaspec cannot serve."""


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "qwen3_5" | "qwen3_5_moe" | "qwen3_next"
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # Gated attention.
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    # YaRN-scaled RoPE (rope_type "yarn"), None for default RoPE.
    yarn: Yarn | None
    # Gated DeltaNet.
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP: dense SwiGLU width, or MoE fields (num_experts == 0 means dense everywhere).
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Multi-token prediction layers stored under `mtp.*` (0: none in the config).
    num_mtp_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # A block-FP8 or weight-only integer checkpoint (its quantization_config), None for
    # unquantized weights.
    quantization: "Fp8Config | Wna16Config | None" = None
    # Expert parallelism (engine/sharding.py): this rank's experts start at first_local_expert
    # (num_local_experts of them; 0: every expert). The router still scores all num_experts.
    first_local_expert: int = 0
    num_local_experts: int = 0
    # Multimodal RoPE's frequencies per axis (temporal, height, width; interleaved as Qwen3.5's),
    # () for a model whose positions are one per token (kernels/rope.py).
    mrope_section: tuple[int, ...] = ()
    # The vision encoder (config.json's vision_config) and the tokens its outputs replace (an
    # image's, a video's), with the tokens around a video's temporal patches; None for a
    # text-only checkpoint (engine/vision/).
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 0):
                problems.append(f"{f.name}={value!r} must be a non-negative int")
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "linear_num_key_heads",
                    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_conv_kernel_dim")
        problems += [f"{name} must be > 0" for name in positive if getattr(self, name) <= 0]
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for "
                            f"{self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            problems.append(f"unknown layer types {sorted(unknown)}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % max(self.linear_num_key_heads, 1):
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            problems.append(f"partial_rotary_factor={self.partial_rotary_factor} must give an even "
                            f"rotary dim in (0, head_dim]")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append("num_experts_per_tok must be in 1..num_experts")
        if any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers)) and self.intermediate_size <= 0:
            problems.append("intermediate_size must be > 0 when some layer has a dense MLP")
        if self.num_experts and self.moe_intermediate_size <= 0:
            problems.append("moe_intermediate_size must be > 0 for a MoE model")
        if self.mrope_section and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0):
            problems.append(f"mrope_section {list(self.mrope_section)} must be 3 non-negative section sizes")
        vision_tokens = (self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)
        if self.vision is not None and (None in vision_tokens or not self.mrope_section):
            problems.append("a vision encoder needs image, video, vision start and end token ids and multimodal "
                            "RoPE (mrope_section)")
        if problems:
            raise ConfigError(f"invalid {self.model_type} config: " + "; ".join(problems))

    # Derived sizes ---------------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q | k | v."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Qwen3-Next/Qwen3.5-MoE rule: MoE unless listed dense or off the sparse step."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def local_experts(self) -> range:
        """The expert ids whose weights this model holds (all but under expert parallelism)."""
        return range(self.first_local_expert, self.first_local_expert + (self.num_local_experts or self.num_experts))

    @property
    def mtp_is_moe(self) -> bool:
        # The MTP decoder layer uses the model's MoE block when the model has experts.
        return self.num_experts > 0

    # Construction ----------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {model_type!r}; deltaspec serves "
                              f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
        family = SUPPORTED_MODEL_TYPES[model_type]
        # Before anything else: an unsupported quantization method is one line, not a
        # complaint about its tensors later. (Imported here: quantization.py uses ConfigError.)
        from .quantization import quantization_from_dict
        quantization = quantization_from_dict(raw.get("quantization_config")
                                              or (raw.get("text_config") or {}).get("quantization_config"))
        # Multimodal Qwen3.5 checkpoints nest the language model under text_config; vision
        # settings are ignored. Top-level fields (tie_word_embeddings) still apply.
        text = dict(raw.get("text_config") or raw)
        for key in ("tie_word_embeddings",):
            if key not in text and key in raw:
                text[key] = raw[key]
        try:
            config = cls._from_text_config(model_type, family, text, quantization)
            if raw.get("vision_config") is None:
                return config
            from .vision.encoder import VisionConfig
            return replace(config, vision=VisionConfig.from_dict(raw["vision_config"]),
                           **{name: int(raw.get(name, default)) for name, default in _QWEN3_5_VISION_TOKENS.items()})
        except KeyError as e:
            raise ConfigError(f"{model_type} config lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{model_type} config has a malformed field: {e}") from None

    @classmethod
    def _from_text_config(cls, model_type: str, family: str, c: dict,
                          quantization: "Fp8Config | Wna16Config | None") -> "ModelConfig":
        _check_fixed_choices(c)
        num_layers = int(c["num_hidden_layers"])
        layer_types = c.get("layer_types")
        if layer_types is None:
            interval = int(c.get("full_attention_interval", 4))
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                           for i in range(num_layers)]
        # Newer configs keep RoPE settings in rope_parameters (or rope_scaling); older ones flat.
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope", "yarn"):
            raise ConfigError(f"unsupported rope_type {rope_type!r} (deltaspec serves default and yarn RoPE)")
        rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
        hidden = int(c["hidden_size"])
        num_heads = int(c["num_attention_heads"])
        eos = c.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(x) for x in (eos if isinstance(eos, list) else [eos]))
        num_experts = int(c.get("num_experts", 0) or 0) if family != "qwen3_5" else 0
        # Qwen3.5's text configs rotate by three positions (HF's default sections when absent);
        # Qwen3-Next's by one.
        mrope_section = tuple(int(n) for n in rope.get("mrope_section", (11, 11, 10))) if family != "qwen3_next" else ()
        return cls(
            family=family,
            model_type=model_type,
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            num_attention_heads=num_heads,
            num_key_value_heads=int(c.get("num_key_value_heads", num_heads)),
            head_dim=int(c.get("head_dim") or hidden // num_heads),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            max_position_embeddings=int(c.get("max_position_embeddings", 32768)),
            yarn=_yarn(rope, int(c.get("max_position_embeddings", 32768))) if rope_type == "yarn" else None,
            linear_num_key_heads=int(c["linear_num_key_heads"]),
            linear_num_value_heads=int(c["linear_num_value_heads"]),
            linear_key_head_dim=int(c["linear_key_head_dim"]),
            linear_value_head_dim=int(c["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(c.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(c.get("intermediate_size", 0) or 0),
            num_experts=num_experts,
            num_experts_per_tok=int(c.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
            moe_intermediate_size=int(c.get("moe_intermediate_size", 0) or 0) if num_experts else 0,
            shared_expert_intermediate_size=(
                int(c.get("shared_expert_intermediate_size", 0) or 0) if num_experts else 0),
            # Qwen3.5-MoE always renormalises the top-k weights; Qwen3-Next has a flag.
            norm_topk_prob=bool(c.get("norm_topk_prob", True)) if family == "qwen3_next" else True,
            decoder_sparse_step=int(c.get("decoder_sparse_step", 1) or 1) if family == "qwen3_next" else 1,
            mlp_only_layers=tuple(c.get("mlp_only_layers") or ()) if family == "qwen3_next" else (),
            num_mtp_layers=int(c.get("mtp_num_hidden_layers", c.get("num_nextn_predict_layers", 0)) or 0),
            eos_token_ids=eos_ids,
            bos_token_id=c.get("bos_token_id"),
            quantization=quantization,
            mrope_section=mrope_section,
        )


# Fields whose other values would change the model's math, each with the values the engine
# implements (the published Qwen3.5 / Qwen3-Next configs' own; absent means the family's
# default). The recurrent state is always kept in float32, as those configs ask
# (`mamba_ssm_dtype`); a lower precision asked for is not taken, so it is not an error.
FIXED_CHOICES = {
    "hidden_act": ("silu", "swish"),          # the MLP's SwiGLU
    "output_gate_type": ("swish", "silu"),    # the GDN's gated RMSNorm: norm(x) * silu(z)
    "attn_output_gate": (True,),              # the gated attention's sigmoid(gate) on its output
    "attention_bias": (False,),
    "mamba_ssm_dtype": ("float32", "bfloat16", "float16", "auto"),
}


def _check_fixed_choices(c: dict) -> None:
    for key, allowed in FIXED_CHOICES.items():
        if key in c and c[key] is not None and c[key] not in allowed:
            raise ConfigError(f"{key} = {c[key]!r} is not supported (deltaspec implements "
                              f"{' / '.join(repr(a) for a in allowed)})")


def _yarn(rope: dict, max_position_embeddings: int) -> Yarn:
    """YaRN's parameters as HF's `_compute_yarn_parameters` reads them: factor defaults to
    max_position_embeddings / original_max_position_embeddings, and attention_factor (the
    cos/sin scale) to 0.1 ln(factor) + 1, or the ratio of two such terms with mscale and
    mscale_all_dim."""
    if "original_max_position_embeddings" not in rope:
        raise ConfigError("yarn rope_parameters lack original_max_position_embeddings")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    try:
        return Yarn(factor=factor, original_max_position_embeddings=original,
                    beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                    attention_factor=float(attention_factor), truncate=bool(rope.get("truncate", True)))
    except ValueError as e:
        raise ConfigError(str(e)) from None
