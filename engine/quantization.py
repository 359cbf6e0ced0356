"""Quantized checkpoints: the `quantization_config` of a config.json and which modules it covers.

deltaspec runs one quantized format, the official block-FP8 checkpoints of Qwen3.5 and
Qwen3-Next: weights in float8_e4m3fn, each with `<name>.weight_scale_inv` of shape
[ceil(out / bn), ceil(in / bk)] (the real weight is `w.float() * scale_inv` over bn x bk
blocks), activations quantized at run time per token in groups of bk ("dynamic"). Any other
method fails at once, before a tensor is read. `with_online_quantization` gives an unquantized
checkpoint the same config for online FP8 (engine/online_quantization.py quantizes its tensors).
Knows nothing about tensors or kernels: only the config and the rule saying which projection is
stored in FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from .model_config import ConfigError, ModelConfig

SUPPORTED_METHODS = ("fp8",)
ONLINE_METHODS = ("fp8",)          # EngineConfig.quantization: quantize an unquantized checkpoint at load

# Projections the published FP8 checkpoints keep in bf16 whether or not their config lists them
# (vLLM builds these without a quant config): the MoE router, the shared-expert gate, the GDN
# decay/beta projections (tiny, and exp/softplus amplify their error) and the MTP input fc.
# Embeddings, lm_head, norms, conv1d, A_log and dt_bias are never projections run as FP8.
ALWAYS_BF16 = ("mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b", "in_proj_ba", "mtp.fc",
               "lm_head", "embed_tokens")

# Checkpoint name prefixes -> the canonical scheme (multimodal checkpoints nest the language
# model); the weight loader and modules_to_not_convert both use it.
_PREFIX_REWRITES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                    ("language_model.lm_head", "lm_head"), ("model.mtp.", "mtp."))


def canonical_module(name: str) -> str:
    """A checkpoint tensor or module name in the canonical scheme (`model.layers.N...`, `mtp...`)."""
    for old, new in _PREFIX_REWRITES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _contains_run(module: tuple[str, ...], entry: tuple[str, ...]) -> bool:
    """entry's dotted parts appear as a contiguous run of module's: "lm_head" and "mlp.gate"
    match anywhere, "model.layers.1" matches layer 1 but not layer 10, "mlp.gate" not gate_proj."""
    return any(module[i:i + len(entry)] == entry for i in range(len(module) - len(entry) + 1))


@dataclass(frozen=True)
class Fp8Config:
    """Block FP8 (e4m3 weights with block scales, dynamic per-token-group e4m3 activations)."""

    weight_block_size: tuple[int, int] = (128, 128)   # (rows bn, columns bk) of one weight scale
    modules_to_not_convert: tuple[str, ...] = ()      # canonical module names, kept unquantized

    def __post_init__(self) -> None:
        if len(self.weight_block_size) != 2 or any(not isinstance(b, int) or b <= 0
                                                   for b in self.weight_block_size):
            raise ConfigError(f"fp8 weight_block_size must be two positive ints, got {self.weight_block_size!r}")

    @property
    def group_size(self) -> int:
        """Activation group (columns per activation scale) = the weight block's columns, so one
        K block of a GEMM has one activation scale per row and one weight scale per row block."""
        return self.weight_block_size[1]

    def quantizes(self, module: str) -> bool:
        """Whether the projection `module` (canonical checkpoint name without `.weight`) is FP8."""
        parts = tuple(module.split("."))
        skipped = ALWAYS_BF16 + self.modules_to_not_convert
        return not any(_contains_run(parts, tuple(entry.split("."))) for entry in skipped)

    def quantizes_all(self, modules: Iterable[str]) -> bool:
        """For a fused parameter: its checkpoint modules must share one format."""
        modules = tuple(modules)
        formats = {self.quantizes(m) for m in modules}
        if len(formats) > 1:
            raise ConfigError(f"modules_to_not_convert splits the fused projection {', '.join(modules)}: "
                              f"deltaspec fuses them into one GEMM, so they must all be FP8 or none")
        return formats.pop()

    @classmethod
    def from_dict(cls, raw: dict) -> "Fp8Config | None":
        """The `quantization_config` of a config.json (None when absent). Only block FP8 with
        e4m3 weights and dynamic activations is served; anything else is one ConfigError line."""
        if not raw:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(f"quantization_config must be an object, got {raw!r}")
        method = str(raw.get("quant_method", "")).lower()
        if method not in SUPPORTED_METHODS:
            raise ConfigError(f"quantization method {method or 'unnamed'!r} is not supported; "
                              f"deltaspec runs unquantized (bf16/fp16/fp32) and official block-FP8 "
                              f"(quant_method 'fp8') checkpoints")
        fmt = raw.get("fmt", "e4m3")
        scheme = raw.get("activation_scheme", "dynamic")
        block = raw.get("weight_block_size")
        problems = []
        if fmt != "e4m3":
            problems.append(f"fmt {fmt!r} (only 'e4m3')")
        if scheme != "dynamic":
            problems.append(f"activation_scheme {scheme!r} (only 'dynamic')")
        if block is None:
            problems.append("no weight_block_size (per-tensor FP8 is not served, only block FP8)")
        if problems:
            raise ConfigError("unsupported fp8 quantization_config: " + "; ".join(problems))
        if not isinstance(block, (list, tuple)):
            raise ConfigError(f"fp8 weight_block_size must be two positive ints, got {block!r}")
        return cls(weight_block_size=tuple(block),
                   modules_to_not_convert=tuple(canonical_module(m) for m in raw.get("modules_to_not_convert") or ()))


def with_online_quantization(config: ModelConfig, method: str) -> ModelConfig:
    """The model config an unquantized checkpoint loads under with `--quantization method`: block
    FP8 in the official checkpoints' format (128 x 128 weight blocks, the same modules kept in
    bf16: ALWAYS_BF16), so both load and run alike. A checkpoint already quantized is refused."""
    if method not in ONLINE_METHODS:
        raise ConfigError(f"online quantization {method!r} is not supported; deltaspec quantizes to "
                          f"{', '.join(ONLINE_METHODS)} at load time")
    if config.quantization is not None:
        raise ConfigError(f"--quantization {method} quantizes an unquantized checkpoint at load time, but this "
                          f"checkpoint is already block-FP8 (its config.json's quantization_config): drop the option")
    return replace(config, quantization=Fp8Config())
