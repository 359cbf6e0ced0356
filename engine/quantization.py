"""Quantized checkpoints: the `quantization_config` of a config.json and which modules it covers.

deltaspec runs two kinds of quantized checkpoint:

- Block FP8 (`Fp8Config`), the official checkpoints of Qwen3.5 and Qwen3-Next: weights in
  float8_e4m3fn, each with `<name>.weight_scale_inv` of shape [ceil(out / bn), ceil(in / bk)]
  (the real weight is `w.float() * scale_inv` over bn x bk blocks), activations quantized at run
  time per token in groups of bk ("dynamic"); and llm-compressor's compressed-tensors FP8
  (FP8_BLOCK, and FP8_DYNAMIC's one scale per output row as a block of one row).
- Weight-only integers (`Wna16Config`: 4 or 8 bits, activations in the model dtype) as GPTQ
  (GPTQModel, AutoGPTQ), AWQ (AutoAWQ's GEMM layout), compressed-tensors' pack-quantized
  (llm-compressor's W4A16 / W8A16) and auto-round write them: integer values packed into int32
  with a scale, and a zero point unless symmetric, per group of input columns. Which projections
  are stored quantized is read from the checkpoint's tensor names (`with_checkpoint_modules`),
  since not every tool lists the ones it kept; engine/wna16_tensors.py turns each format's
  tensors into kernels/wna16.py's one layout.

Any other method or scheme fails at once, before a tensor is read, in one line naming it.
`with_online_quantization` gives an unquantized checkpoint the FP8 config for online FP8
(engine/online_quantization.py quantizes its tensors). Knows nothing about tensors or kernels:
only the config and the rule saying which projection is stored quantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable

from .model_config import ConfigError, ModelConfig

SUPPORTED_METHODS = ("fp8", "gptq", "awq", "compressed-tensors", "auto-round")
ONLINE_METHODS = ("fp8",)          # EngineConfig.quantization: quantize an unquantized checkpoint at load
# EngineConfig.quantization (vLLM's --quantization) naming the checkpoint's own weight-only method
# (vLLM's Marlin kernels' names included): checked against the checkpoint, nothing else changes.
CHECKPOINT_OPTIONS = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                      "compressed-tensors": "compressed-tensors", "auto-round": "auto-round"}

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
    """Block FP8 (e4m3 weights with block scales, dynamic per-token-group e4m3 activations).

    The official checkpoints store `<m>.weight_scale_inv` [ceil(N / bn), ceil(K / bk)];
    llm-compressor's compressed-tensors FP8 (scale_name "weight_scale") the same blocks
    (FP8_BLOCK) or one scale per output row (FP8_DYNAMIC: bn = 1, its [N, 1] scale broadcast over
    the row's column groups). ignore_patterns: compressed-tensors' "re:" entries of `ignore`,
    matched against canonical module names."""

    weight_block_size: tuple[int, int] = (128, 128)   # (rows bn, columns bk) of one weight scale
    modules_to_not_convert: tuple[str, ...] = ()      # canonical module names, kept unquantized
    scale_name: str = "weight_scale_inv"              # the checkpoint leaf of the weight scales
    ignore_patterns: tuple[str, ...] = ()

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
        return not any(_contains_run(parts, tuple(entry.split("."))) for entry in skipped) \
            and not any(re.match(pattern, module) for pattern in self.ignore_patterns)

    def quantizes_all(self, modules: Iterable[str]) -> bool:
        """For a fused parameter: its checkpoint modules must share one format."""
        modules = tuple(modules)
        formats = {self.quantizes(m) for m in modules}
        if len(formats) > 1:
            raise ConfigError(f"modules_to_not_convert splits the fused projection {', '.join(modules)}: "
                              f"deltaspec fuses them into one GEMM, so they must all be FP8 or none")
        return formats.pop()

    @classmethod
    def from_dict(cls, raw: dict) -> "Fp8Config":
        """An fp8 `quantization_config`. Only block FP8 with e4m3 weights and dynamic activations
        is served; anything else is one ConfigError line."""
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


# Tensor layouts of weight-only integer checkpoints (engine/wna16_tensors.py reads each):
# "gptq": qweight [K / P, N] packed along K, qzeros [KG, N / P] packed along N, scales [KG, N],
# g_idx [K]; "awq": qweight and qzeros packed along N in AWQ's interleaved order, scales [KG, N];
# "compressed-tensors": weight_packed [N, K / P], weight_scale [N, KG], weight_zero_point
# [ceil(N / P), KG] packed along N, weight_g_idx [K].
WNA16_LAYOUTS = ("gptq", "awq", "compressed-tensors")
# The checkpoint leaf that marks a module as stored quantized, per layout.
WNA16_MARKERS = {"gptq": ".qweight", "awq": ".qweight", "compressed-tensors": ".weight_packed"}


@dataclass(frozen=True)
class Wna16Config:
    """Weight-only integers: `bits`-bit weights with a scale (and a zero point unless symmetric)
    per `group_size` input columns (-1: one group per row), activations in the model dtype.

    layout: how the tensors are stored (WNA16_LAYOUTS); zeros_minus_one: GPTQ's original format
    stores each zero point minus one (checkpoint_format "gptq"; "gptq_v2" does not); act_order:
    groups are formed in a permuted column order (`g_idx`), which the loader turns into a
    permutation of x. quantized: the canonical projections the checkpoint stores quantized, from
    its tensor names (`with_checkpoint_modules`); None until they are read (or for random
    weights), when every projection but ALWAYS_BF16 and modules_to_not_convert is."""

    layout: str
    bits: int
    group_size: int
    symmetric: bool
    method: str = ""              # the config's quant_method (auto-round writes either layout)
    zeros_minus_one: bool = False
    act_order: bool = False
    modules_to_not_convert: tuple[str, ...] = ()
    quantized: frozenset[str] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.layout not in WNA16_LAYOUTS:
            problems.append(f"layout {self.layout!r} (one of {', '.join(WNA16_LAYOUTS)})")
        if self.bits not in (4, 8):
            problems.append(f"{self.bits} bits (4 or 8)")
        if self.group_size != -1 and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            problems.append(f"group_size {self.group_size} (-1, or a power of two >= 16)")
        if problems:
            raise ConfigError("unsupported weight-only quantization: " + "; ".join(problems))

    @property
    def pack(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits

    def columns_per_group(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def quantizes(self, module: str) -> bool:
        if self.quantized is not None:
            return module in self.quantized
        parts = tuple(module.split("."))
        return not any(_contains_run(parts, tuple(entry.split(".")))
                       for entry in ALWAYS_BF16 + self.modules_to_not_convert)

    def quantizes_all(self, modules: Iterable[str]) -> bool:
        modules = tuple(modules)
        formats = {self.quantizes(m) for m in modules}
        if len(formats) > 1:
            stored = [m for m in modules if self.quantizes(m)]
            raise ConfigError(f"the checkpoint quantizes {', '.join(stored)} but not the rest of the fused projection "
                              f"{', '.join(modules)}: deltaspec runs them as one GEMM, so they must share one format")
        return formats.pop()


def _int_field(raw: dict, *names: str, default=None):
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    return default


def _gptq(raw: dict, layout_name: str, zeros_minus_one: bool) -> Wna16Config:
    """GPTQModel / AutoGPTQ (and auto-round's auto_gptq export): bits, group_size, sym, desc_act;
    `dynamic` may exclude modules ("-:regex", which the tensor names show anyway) or give some
    other settings, which one kernel configuration per model cannot honour."""
    bits, group, sym = int(_int_field(raw, "bits", default=4)), int(_int_field(raw, "group_size", default=128)), \
        bool(raw.get("sym", True))
    for pattern, override in (raw.get("dynamic") or {}).items():
        differs = {k: v for k, v in (override or {}).items()
                   if k in ("bits", "group_size", "sym", "desc_act") and v != raw.get(k)}
        if not str(pattern).startswith("-:") and differs:
            raise ConfigError(f"{layout_name} quantization_config: dynamic entry {pattern!r} sets {differs}: modules "
                              f"with their own bits or groups are not supported (one setting per checkpoint)")
    if raw.get("lm_head"):
        raise ConfigError(f"{layout_name} quantization_config: a quantized lm_head (lm_head: true) is not supported")
    return Wna16Config("gptq", bits, group, sym, method=layout_name, zeros_minus_one=zeros_minus_one,
                       act_order=bool(raw.get("desc_act", False)))


def _awq(raw: dict, method: str = "awq") -> Wna16Config:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"awq quantization_config: version {version!r} is not supported (AutoAWQ's 'gemm' layout is)")
    return Wna16Config("awq", int(_int_field(raw, "bits", "w_bit", default=4)),
                       int(_int_field(raw, "group_size", "q_group_size", default=128)),
                       symmetric=not raw.get("zero_point", True), method=method,
                       modules_to_not_convert=tuple(canonical_module(m)
                                                    for m in raw.get("modules_to_not_convert") or ()))


def _compressed_tensors(raw: dict) -> "Wna16Config | Fp8Config":
    """llm-compressor's weight-only integer schemes (W4A16, W8A16; format pack-quantized) or its
    FP8 ones with dynamic activations (FP8_DYNAMIC, FP8_BLOCK; format float-quantized): every
    config group must share one setting."""
    name = "compressed-tensors quantization_config"
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if raw.get(field):
            raise ConfigError(f"{name}: {field} is not supported")
    groups = list((raw.get("config_groups") or {}).values())
    if groups and all((g.get("weights") or {}).get("type") == "float" for g in groups):
        return _compressed_tensors_fp8(raw, groups)
    schemes, formats = set(), {raw.get("format")}
    for group_name, group in (raw.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if group.get("input_activations") or group.get("output_activations"):
            raise ConfigError(f"{name}: {group_name} quantizes activations of integer weights (W8A8 int8, "
                              f"W4A8); deltaspec runs weight-only integer schemes (W4A16, W8A16) and FP8 ones")
        if weights.get("type", "int") != "int" or weights.get("strategy") not in ("group", "channel") \
                or weights.get("num_bits") not in (4, 8) or weights.get("dynamic"):
            raise ConfigError(f"{name}: {group_name}'s weights {weights!r} are not supported (4 or 8 bit int, "
                              f"by group or channel)")
        formats.add(group.get("format"))
        group_size = -1 if weights["strategy"] == "channel" else int(weights["group_size"])
        schemes.add((int(weights["num_bits"]), group_size, bool(weights.get("symmetric", True)),
                     weights.get("actorder") == "group"))
    formats.discard(None)
    if formats != {"pack-quantized"}:
        raise ConfigError(f"{name}: format {sorted(formats) or 'unnamed'} is not supported (pack-quantized is)")
    if len(schemes) != 1:
        raise ConfigError(f"{name}: {len(schemes)} different weight schemes {sorted(schemes)}; one is supported")
    bits, group, sym, act_order = schemes.pop()
    return Wna16Config("compressed-tensors", bits, group, sym, method="compressed-tensors", act_order=act_order)


def _compressed_tensors_fp8(raw: dict, groups: list[dict]) -> Fp8Config:
    """FP8_DYNAMIC (e4m3 weights with a scale per output row, activations quantized per token at
    run time) and FP8_BLOCK (bn x bk weight blocks, activations per token group of bk): both run
    as block FP8, the per-row scale a block of one row; activations are quantized in groups of
    128 columns here (per token in vLLM: a finer grid, so no larger an error)."""
    name = "compressed-tensors FP8 quantization_config"
    if raw.get("format") not in ("float-quantized", None) or len({repr(g.get("weights")) for g in groups}) != 1 \
            or len({repr(g.get("input_activations")) for g in groups}) != 1:
        raise ConfigError(f"{name}: format {raw.get('format')!r} with {len(groups)} schemes is not supported "
                          f"(float-quantized, one scheme)")
    weights, activations = groups[0]["weights"], groups[0].get("input_activations") or {}
    if weights.get("num_bits") != 8 or activations.get("type") != "float" or activations.get("num_bits") != 8:
        raise ConfigError(f"{name}: weights {weights!r} with activations {activations or None!r} are not supported "
                          f"(8-bit float weights with 8-bit float activations)")
    if not activations.get("dynamic"):
        raise ConfigError(f"{name}: static activation scales (input_scale) are not supported; dynamic ones are")
    if weights.get("strategy") == "channel" and activations.get("strategy") == "token":
        block = (1, 128)
    elif weights.get("strategy") == "block" and activations.get("strategy") == "group" \
            and list(weights.get("block_structure") or ())[1:] == [activations.get("group_size")]:
        block = tuple(weights["block_structure"])
    else:
        raise ConfigError(f"{name}: weight strategy {weights.get('strategy')!r} with activation strategy "
                          f"{activations.get('strategy')!r} is not supported (channel with token, or block with "
                          f"group)")
    plain = tuple(canonical_module(m) for m in raw.get("ignore") or () if not m.startswith("re:"))
    patterns = tuple(m[3:] for m in raw.get("ignore") or () if m.startswith("re:"))
    return Fp8Config(weight_block_size=block, modules_to_not_convert=plain, scale_name="weight_scale",
                     ignore_patterns=patterns)


def _auto_round(raw: dict) -> Wna16Config:
    packing = str(raw.get("packing_format", "auto_round:auto_gptq"))
    if str(raw.get("data_type", "int")) != "int":
        raise ConfigError(f"auto-round quantization_config: data_type {raw.get('data_type')!r} is not supported (int)")
    for module, override in (raw.get("extra_config") or {}).items():
        bits = (override or {}).get("bits", raw.get("bits"))
        if bits not in (16, raw.get("bits")):
            raise ConfigError(f"auto-round quantization_config: {module} has {bits} bits; modules with their own bits "
                              f"are not supported (one setting per checkpoint, 16: kept unquantized)")
    if packing in ("auto_round:auto_gptq", "auto_gptq", "auto_round:gptq"):
        return _gptq(raw, "auto-round", zeros_minus_one=True)
    if packing in ("auto_round:auto_awq", "auto_awq"):
        return _awq({**raw, "zero_point": not raw.get("sym", True)}, method="auto-round")
    raise ConfigError(f"auto-round quantization_config: packing_format {packing!r} is not supported "
                      f"(auto_round:auto_gptq, auto_round:auto_awq)")


def quantization_from_dict(raw) -> "Fp8Config | Wna16Config | None":
    """The `quantization_config` of a config.json (None when absent): block FP8 or one of the
    weight-only integer formats; anything else is one ConfigError line naming it."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"quantization_config must be an object, got {raw!r}")
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method == "fp8":
        return Fp8Config.from_dict(raw)
    if method == "gptq":
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq-v2", "gptq_v2"):
            raise ConfigError(f"gptq quantization_config: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return _gptq(raw, "gptq", zeros_minus_one=fmt == "gptq")
    if method == "awq":
        return _awq(raw)
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method in ("auto-round", "intel/auto-round"):
        return _auto_round(raw)
    raise ConfigError(f"quantization method {method or 'unnamed'!r} is not supported; deltaspec runs unquantized "
                      f"(bf16/fp16/fp32) checkpoints, official block FP8 (quant_method 'fp8') and weight-only "
                      f"integer ones (gptq, awq, compressed-tensors pack-quantized, auto-round)")


def describe(quantization: "Fp8Config | Wna16Config | None") -> str:
    """The checkpoint's weight format in a few words, for the start-up log."""
    if quantization is None:
        return "unquantized"
    if isinstance(quantization, Fp8Config):
        bn, bk = quantization.weight_block_size
        return "FP8, a scale a row" if bn == 1 else f"FP8, {bn} x {bk} weight blocks"
    q = quantization
    groups = "a group a row" if q.group_size == -1 else f"groups of {q.group_size}"
    packed = "" if q.quantized is None else f", {len(q.quantized)} projections packed"
    return (f"{q.method or q.layout} {q.bits}-bit weights, {groups}, {'symmetric' if q.symmetric else 'zero points'}"
            f"{', act-order' if q.act_order else ''}{packed}")


# Fused checkpoint projections (Qwen3-Next) -> the canonical modules they hold.
_FUSED_MODULES = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}


def with_checkpoint_modules(config: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """A weight-only integer config with the projections the checkpoint stores quantized (those
    with its layout's marker tensor, in canonical names); other configs as they are. A quantized
    lm_head or embedding is refused here, before any tensor is read."""
    q = config.quantization
    if not isinstance(q, Wna16Config):
        return config
    marker, quantized = WNA16_MARKERS[q.layout], set()
    for name in names:
        module = canonical_module(name)
        if not module.endswith(marker) or not module.startswith(("model.", "mtp.", "lm_head")):
            continue
        module = module[:-len(marker)]
        if module.endswith(("lm_head", "embed_tokens")):
            raise ConfigError(f"{name}: a quantized {module.rsplit('.', 1)[-1]} is not supported")
        stem, _, leaf = module.rpartition(".")
        quantized.update(f"{stem}.{part}" for part in _FUSED_MODULES.get(leaf, (leaf,)))
    return replace(config, quantization=replace(q, quantized=frozenset(quantized)))


def with_quantization_option(config: ModelConfig, option: str) -> ModelConfig:
    """The model config under EngineConfig.quantization: online FP8 (with_online_quantization),
    or the checkpoint's own weight-only method named (CHECKPOINT_OPTIONS), checked."""
    if option not in CHECKPOINT_OPTIONS:
        return with_online_quantization(config, option)
    q, method = config.quantization, CHECKPOINT_OPTIONS[option]
    if not isinstance(q, Wna16Config) or q.method != method:
        stored = "unquantized" if q is None else ("block-FP8" if isinstance(q, Fp8Config) else q.method)
        raise ConfigError(f"--quantization {option} names a {method} checkpoint, but this checkpoint is {stored} "
                          f"(its config.json's quantization_config); drop the option")
    return config


def with_online_quantization(config: ModelConfig, method: str) -> ModelConfig:
    """The model config an unquantized checkpoint loads under with `--quantization method`: block
    FP8 in the official checkpoints' format (128 x 128 weight blocks, the same modules kept in
    bf16: ALWAYS_BF16), so both load and run alike. A checkpoint already quantized is refused."""
    if method not in ONLINE_METHODS:
        raise ConfigError(f"online quantization {method!r} is not supported; deltaspec quantizes to "
                          f"{', '.join(ONLINE_METHODS)} at load time")
    if config.quantization is not None:
        kind = "block-FP8" if isinstance(config.quantization, Fp8Config) else config.quantization.layout
        raise ConfigError(f"--quantization {method} quantizes an unquantized checkpoint at load time, but this "
                          f"checkpoint is already {kind} (its config.json's quantization_config): drop the option")
    return replace(config, quantization=Fp8Config())
