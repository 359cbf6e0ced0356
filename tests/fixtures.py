"""Tiny, deterministic HF-format checkpoints and tokenizers for tests.

`make_tokenizer` trains a byte-level BPE (ChatML specials) on a built-in corpus that mixes
English, Python and multi-byte UTF-8. `make_checkpoint` builds a random Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next model through HF transformers, re-randomises every parameter from a seeded generator
(so norms are not all ones, A_log is not HF's init, logits are O(1)), saves it with
`save_pretrained`, and then rewrites the safetensors into the layout a test asks for: per-expert
or fused MoE experts, with or without the `model.language_model.` prefix, plus `mtp.*` weights in
their own shard, optionally in the official block-FP8 layout (`fp8=True`) or in one of the
published weight-only integer layouts (`wna16=...`, below); `dequantize_checkpoint` writes the
same weights dequantized, as an unquantized checkpoint.

Knows nothing about deltaspec: it only writes files the way HF and real Qwen checkpoints do.
Must not import pytest (benchmarks and scripts use it too).

Weight-only integer (WNA16) layouts
-----------------------------------
Every format stores a projection W [N out, K in] as unsigned codes q in [0, 2^b) (b = 4 or 8), a
scale s and an integer zero z per (row, group of K columns), and means W[n, k] = (q[n, k] -
z[n, g(k)]) * s[n, g(k)], where g(k) = k // group_size, or g_idx[k] with act-order (groups formed
over a permutation of the columns; the columns themselves stay in checkpoint order). "Packed"
means 32 // b codes per int32 word, code j of a word in bits [b*j, b*(j+1)), lowest first. What
differs is which dimension is packed, the dtypes, how zeros are stored and the config:

gptq (GPTQModel / AutoGPTQ, checkpoint_format "gptq", i.e. v1), gptq_v2 (checkpoint_format
"gptq_v2"): `qweight` int32 [K*b/32, N] packed along K; `qzeros` int32 [G, N*b/32] packed along N;
`scales` float16 [G, N]; `g_idx` int32 [K] (always written; k // group_size unless desc_act). v1
stores every zero minus one: GPTQModel writes v1 by subtracting 0x11111111 (b=4; 0x01010101 for
b=8) from the packed v2 words, so a symmetric 4-bit checkpoint has every qzeros word 0x77777777
(a zero of 0 would borrow from the next code; RTN never makes one here). config: quant_method
"gptq", bits, group_size (-1: per channel), sym, desc_act, checkpoint_format, pack_dtype "int32",
lm_head false, meta; `dynamic` holds GPTQModel's negative rules `-:<regex>` (re.match on the full
module name): "-:.*mtp.*" for a kept MTP layer and `-:` + re.escape(name) for every other
projection kept for its shape or by wna16_kept. GPTQModel lists nothing else: the router, the
shared-expert gate and in_proj_a/b/ba are never quantized (its module tree marks them so), and only
their plain `.weight` tensors say so. Symmetric zeros are 2^(b-1); scales 2*amax/(2^b-1) per group
(GPTQ's Quantizer); asymmetric ranges hold 0, z = round(-min/s).

awq (AutoAWQ GEMM): `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8], both packed along N with
AWQ's interleave (code j of a word holds column 8*w + [0, 2, 4, 6, 1, 3, 5, 7][j]); `scales`
float16 [G, N]; 4 bits only; every other tensor float16 too (AutoAWQ saves the model in fp16).
config: quant_method "awq", version "gemm", bits, group_size, zero_point, modules_to_not_convert
(the full name of every kept projection but the embeddings; loaders match them as substrings).
Asymmetric (zero_point true): AutoAWQ's min/max range, z = clamp(-round(min/s), 0, 15). Symmetric
(zero_point false, as GPTQModel's and auto-round's AWQ exports write it): s = amax/7, q in [-8, 7]
stored +8, qzeros all 8 (0x88888888): the zeros are stored either way.

compressed-tensors (llm-compressor W4A16/W8A16, format "pack-quantized"): `weight_packed` int32
[N, ceil(K*b/32)] packed along K, each signed value v in [-2^(b-1), 2^(b-1)) stored as v + 2^(b-1)
(so the packed code is q, with z = 2^(b-1) when symmetric); `weight_scale` bfloat16 [N, G] (the
model's dtype); `weight_shape` int64 [2] = [N, K]; asymmetric only: `weight_zero_point` int32
[ceil(N*b/32), G], the signed zero points packed along N with the same offset; actorder "group"
only: `weight_g_idx` int32 [K]. Symmetric s = amax / ((2^b-1)/2) (7.5 for int4, so +amax clamps to
7); asymmetric s = range/(2^b-1), zero point round(-2^(b-1) - min/s); a value is rounded after its
signed zero point is added, round(w/s + zp). config: quant_method "compressed-tensors", format,
quantization_status "compressed", config_groups.group_0 (targets ["Linear"], weights: num_bits,
type "int", symmetric, strategy "group" or "channel", group_size, actorder, observer, zp_dtype,
...), ignore (the full name of every kept Linear, the routers and lm_head included, as
compressed-tensors lists every unquantized module of a targeted type), version.

auto-round (intel/auto-round's default "auto_round" export): symmetric (bits 4 or 8) is
packing_format "auto_round:auto_gptq": gptq v1 tensors without g_idx; asymmetric 4-bit is
"auto_round:auto_awq": awq tensors, every other tensor float16. auto-round's own RTN: symmetric
"full range" s = signed max / 2^(b-1), whose sign makes the larger side map to -2^(b-1) (so scales
may be negative); asymmetric like GPTQ's. It keeps projections whose N or K is not a multiple of 32
and mtp.fc (quantizing MTP layers otherwise, when wna16_quantize_mtp). config: quant_method
"auto-round", packing_format, bits, group_size, sym, data_type "int", iters 0 (RTN),
autoround_version, block_name_to_quantize ("model.layers", a list with "mtp.layers" when MTP is
quantized), extra_config: {"bits": 16, "data_type": "fp"} for each kept Linear (not the HF router,
not lm_head, which is outside the blocks) and ".*mtp.*" for a kept MTP layer.

Kept in every format (plain `.weight`, bf16 or fp16 as above): embeddings, lm_head, the router
(`mlp.gate`), `shared_expert_gate`, in_proj_a / in_proj_b / in_proj_ba, `mtp.*` unless
wna16_quantize_mtp, wna16_kept, and any projection the layout cannot pack (K not a multiple of the
group, or N / K not a multiple of 32 // b where that dimension is packed; 32 for auto-round); conv1d,
norms, A_log, dt_bias are not projections. Experts are quantized per expert; Qwen3-Next's
in_proj_qkvz is one module. RTN rounds each scale to its stored dtype first, so the stored codes,
scales and zeros agree exactly.

Followed: GPTQModel's qlinear pack_block, quantizer.py and convert_gptq_v2_to_v1_format; AutoAWQ's
WQLinear_GEMM.from_linear and pseudo_quantize_tensor; compressed-tensors' pack_quantized compressor
and calculate_qparams; auto-round's export_to_autoround, qlinear_torch(_zp).py, data_type/int.py,
layer_config/resolver.py and utils/missing_tensors.py (MTP).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Multi-byte characters (é, CJK, emoji) stay rare so BPE keeps them as 2-4 byte tokens: that is
# what makes incremental detokenization hold back partial characters.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A hybrid model interleaves linear attention "
    "with full attention layers, three to one. The engine schedules requests, runs the model "
    "and commits the accepted tokens. Speculative decoding drafts tokens and verifies them.\n",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n"
    "        self.items = {}\n\n    def get(self, key):\n        return self.items.get(key)\n",
    "Le café est très bon. Élève, été, naïve, déjà vu. 中文字符测试。你好，世界！"
    " Emoji: 🙂 🚀 🎉 👍. Ünïcödé ñ ß ø.\n",
    "Hello, world! How are you today? I am fine, thank you. What is 2 + 2? It is 4.\n",
)


# Qwen3.5's vision tokens (a vision-language checkpoint's tokenizer has them; `make_vision_checkpoint`).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def make_tokenizer(directory: Path, vocab_size: int = 384, extra_special: tuple[str, ...] = (),
                   chat_template: str | None = None) -> Path:
    """Train the test tokenizer into `directory` (tokenizer.json + tokenizer_config.json);
    extra_special: special tokens after the ChatML ones; chat_template: in place of ChatML's."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS) + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template or CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


MOE_DEFAULTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    shared_expert_intermediate_size=40)
FAMILY_DEFAULTS: dict[str, dict] = {"qwen3_5": {}, "qwen3_5_moe": MOE_DEFAULTS, "qwen3_next": MOE_DEFAULTS}

COMMON_DEFAULTS = dict(
    vocab_size=512,
    hidden_size=72,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=96,
)

# What a checkpoint needs on the GPU on top of COMMON_DEFAULTS: the GDN kernels' value tiles are at
# least 64 wide there (kernels/gdn_chunked.py), so its heads are too.
GPU_SHAPE = dict(linear_key_head_dim=64, linear_value_head_dim=64)
# A model small enough for the Triton table under the interpreter: one GDN and one attention layer.
TRITON_TABLE_SHAPE = dict(num_hidden_layers=2, full_attention_interval=2, linear_num_key_heads=1,
                          linear_num_value_heads=2)

# The key real checkpoints use to announce their MTP layers.
MTP_CONFIG_KEY = {"qwen3_5": "mtp_num_hidden_layers", "qwen3_5_moe": "mtp_num_hidden_layers",
                  "qwen3_next": "num_nextn_predict_layers"}

MTP_SHARD = "model-mtp.safetensors"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _model_classes(family: str) -> tuple[type, type]:
    import transformers  # slow to import; tokenizer-only users never pay for it

    classes = {
        "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    }
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(classes)}")
    config_name, model_name = classes[family]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def _random_parameter(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A random value for the parameter `name` whose scale matches its role in the forward pass."""
    normal = torch.randn(shape, generator=generator)
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm multiplies by plain w
        return 1.0 + 0.1 * normal
    if name.endswith("norm.weight"):  # layer / q / k / final RMSNorms multiply by (1 + w)
        return 0.1 * normal
    if name.endswith("A_log"):
        # Decay rate exp(A_log) in [0.1, 2): per-token decay exp(g) ~ 0.4..0.95, so the state
        # carries several tokens (as a trained model's does). HF's init, [1, 16), makes most
        # heads forget each token: the state is then close to one outer product k (beta v)^T,
        # whose output (q.k) beta v nearly vanishes for some tokens, and the gated RMSNorm
        # blows that head's float32 rounding up to ~1e-4 of the logits.
        return torch.log(0.1 + 1.9 * torch.rand(shape, generator=generator))
    if name.endswith("dt_bias"):
        return 0.5 * normal
    if name.endswith("embed_tokens.weight"):
        return normal
    # Linear [out, in], fused experts [E, out, in], depthwise conv [C, 1, K]: the last dim is
    # the fan-in, so std 1/sqrt(fan_in) keeps activations (and logits) O(1).
    return normal / math.sqrt(shape[-1])


@torch.no_grad()
def _randomise(module: torch.nn.Module, generator: torch.Generator) -> None:
    for name, parameter in module.named_parameters():
        parameter.copy_(_random_parameter(name, parameter.shape, generator))


def _split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory fused experts -> the per-expert names HF saves and real Qwen checkpoints use."""
    result = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            base = name.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                result[f"{base}{expert}.gate_proj.weight"] = gate[expert].clone()
                result[f"{base}{expert}.up_proj.weight"] = up[expert].clone()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = name.removesuffix("down_proj")
            for expert in range(tensor.shape[0]):
                result[f"{base}{expert}.down_proj.weight"] = tensor[expert].clone()
        else:
            result[name] = tensor
    return result


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _fuse_experts(tensors: dict[str, tuple[str, torch.Tensor]]) -> dict[str, tuple[str, torch.Tensor]]:
    """Per-expert tensors -> `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I].

    Values are (shard file, tensor); a fused tensor goes to the shard of its expert-0 gate.
    """
    result = {}
    groups: dict[str, dict[tuple[str, int], tuple[str, torch.Tensor]]] = {}
    for name, value in tensors.items():
        match = _PER_EXPERT.match(name)
        if match:
            groups.setdefault(match[1], {})[(match[3], int(match[2]))] = value
        else:
            result[name] = value
    for base, parts in groups.items():
        num_experts = 1 + max(expert for _, expert in parts)
        shard = parts[("gate", 0)][0]

        def stack(projection: str) -> torch.Tensor:
            return torch.stack([parts[(projection, expert)][1] for expert in range(num_experts)])

        result[f"{base}.gate_up_proj"] = (shard, torch.cat([stack("gate"), stack("up")], dim=1))
        result[f"{base}.down_proj"] = (shard, stack("down"))
    return result


def _mtp_tensors(layers: torch.nn.ModuleList, hidden_size: int, copy_last_layer: bool,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`mtp.*` weights: fc + three norms + one full-attention decoder layer (fused experts)."""
    last_full = max(i for i, layer in enumerate(layers) if hasattr(layer, "self_attn"))
    layer = copy.deepcopy(layers[last_full])
    if not copy_last_layer:
        _randomise(layer, generator)
    tensors = {f"mtp.layers.0.{name}": tensor for name, tensor in layer.state_dict().items()}
    tensors["mtp.fc.weight"] = _random_parameter("fc.weight", (hidden_size, 2 * hidden_size), generator)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = _random_parameter("norm.weight", (hidden_size,), generator)
    return tensors


# What the official FP8 checkpoints keep unquantized (their modules_to_not_convert names them):
# embeddings, lm_head, the router, the shared-expert gate, the GDN b/a projections, mtp.fc.
# Norms, conv1d, A_log and dt_bias are not 2-D weights and are never quantized.
FP8_KEPT_MODULES = re.compile(r"(^|\.)(embed_tokens|lm_head|mlp\.gate|shared_expert_gate|in_proj_a|in_proj_b|in_proj_ba|"
                              r"mtp\.fc)$")
FP8_MAX = 448.0


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32)
    with weight ~= fp8.float() * scale_inv over bn x bk blocks (each block's amax maps to 448)."""
    rows, columns = weight.shape
    bn, bk = block
    nb, kb = -(-rows // bn), -(-columns // bk)
    padded = weight.float().new_zeros(nb * bn, kb * bk)
    padded[:rows, :columns] = weight.float()
    blocks = padded.view(nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.view(nb * bn, kb * bk)[:rows, :columns].contiguous(), scale


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, columns = weight.shape
    bn, bk = block
    expanded = scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :columns]
    return weight.float() * expanded


def _to_fp8(tensors: dict[str, tuple[str, torch.Tensor]], block: tuple[int, int] | None,
            extra_kept: tuple[str, ...], scale_name: str = "weight_scale_inv"
            ) -> tuple[dict[str, tuple[str, torch.Tensor]], list[str]]:
    """Quantize every 2-D projection weight outside the kept modules; returns the new tensors and
    modules_to_not_convert (every kept projection, as the published configs list them). block
    None: one scale per output row ([N, 1] in bf16, llm-compressor's FP8_DYNAMIC)."""
    result, kept = {}, []
    for name, (file, tensor) in tensors.items():
        module = name.removesuffix(".weight")
        is_projection = name.endswith(".weight") and tensor.dim() == 2
        if is_projection and (FP8_KEPT_MODULES.search(module) or module in extra_kept):
            kept.append(module)
        if is_projection and module not in kept:
            weight, scale_inv = quantize_block_fp8(tensor, block or (1, tensor.shape[1]))
            result[name] = (file, weight)
            result[f"{module}.{scale_name}"] = (file, scale_inv if block else scale_inv.to(torch.bfloat16))
        else:
            result[name] = (file, tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor)
    return result, sorted(kept)


WNA16_FORMATS = ("gptq", "gptq_v2", "awq", "compressed-tensors", "auto-round")

# The tiny shape of a WNA16 checkpoint (make_checkpoint applies it when wna16 is given, under the
# caller's config_overrides): every projection input is a multiple of 64 (groups of 32 and 64 fit),
# every output a multiple of 32. COMMON_DEFAULTS' hidden size 72 and experts of 24 fit no group of
# 32: only o_proj, out_proj and the dense down_proj would be packed.
WNA16_SHAPE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64)


def wna16_shape(family: str) -> dict:
    """The config overrides make_checkpoint applies to a WNA16 `family` checkpoint (WNA16_SHAPE's
    keys the family has): a plain checkpoint with them holds the same random weights."""
    return {key: value for key, value in WNA16_SHAPE.items() if key in {**COMMON_DEFAULTS, **FAMILY_DEFAULTS[family]}}


# The 2-D weights every published WNA16 recipe keeps unquantized (norms, conv1d, A_log and dt_bias
# are not 2-D projections and never are).
WNA16_KEPT_MODULES = re.compile(r"(^|\.)(embed_tokens|lm_head|mlp\.gate|shared_expert_gate|"
                                r"in_proj_a|in_proj_b|in_proj_ba)$")
_ROUTER = re.compile(r"(^|\.)mlp\.gate$")
# AWQ's interleave: code j of each int32 word holds column 8 * word + AWQ_ORDER[j] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# GPTQ v1 stores zeros minus one: the packed v2 words minus one in every code.
_ONES = {bits: sum(1 << (bits * j) for j in range(32 // bits)) for bits in (4, 8)}


@dataclass(frozen=True)
class Wna16Spec:
    """One published weight-only integer layout (the module docstring describes each)."""

    format: str
    bits: int = 4
    group_size: int = 32            # -1: one group per row (per channel)
    symmetric: bool = True
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.format not in WNA16_FORMATS:
            raise ValueError(f"wna16 must be one of {WNA16_FORMATS}, got {self.format!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"wna16_bits must be 4 or 8, got {self.bits}")
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError(f"wna16_group_size must be positive or -1, got {self.group_size}")
        if self.layout == "awq" and self.bits != 4:
            raise ValueError(f"{self.format} packs AWQ's GEMM layout, which is 4-bit only"
                             + (" (auto-round exports asymmetric ints as auto_round:auto_awq)"
                                if self.format == "auto-round" else ""))
        if self.act_order and (self.format not in ("gptq", "gptq_v2", "compressed-tensors") or self.group_size == -1):
            raise ValueError("wna16_act_order needs groups and is published by GPTQ (desc_act) and "
                             "compressed-tensors (actorder 'group') only")

    @property
    def layout(self) -> str:
        """How the tensors are packed: "gptq", "awq" or "compressed-tensors"."""
        if self.format == "auto-round":
            return "gptq" if self.symmetric else "awq"
        return {"gptq": "gptq", "gptq_v2": "gptq", "awq": "awq"}.get(self.format, "compressed-tensors")

    @property
    def zeros_minus_one(self) -> bool:
        """GPTQ v1's convention (also auto-round's auto_gptq packing)."""
        return self.layout == "gptq" and self.format != "gptq_v2"

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.layout == "compressed-tensors" else torch.float16

    @property
    def dtype(self) -> torch.dtype:
        """Every unquantized tensor's dtype: the tools save the model as loaded (bf16), AWQ's in fp16."""
        return torch.float16 if self.layout == "awq" else torch.bfloat16

    def group(self, columns: int) -> int:
        return columns if self.group_size == -1 else self.group_size

    def packs(self, rows: int, columns: int) -> bool:
        """Whether an [rows, columns] projection fits the layout; the tools keep those that do not."""
        per_word = 32 // self.bits
        if columns % self.group(columns):
            return False
        if self.format == "auto-round":
            return rows % 32 == 0 and columns % 32 == 0
        if self.layout == "gptq":
            return rows % per_word == 0 and columns % per_word == 0
        if self.layout == "awq":
            return rows % per_word == 0
        return True     # compressed-tensors pads its last word


class Wna16Codes(NamedTuple):
    """One projection's round-to-nearest: W ~= (codes - zero[:, g_idx]) * scale[:, g_idx]."""

    codes: torch.Tensor     # [N, K] int64 in [0, 2^bits)
    scale: torch.Tensor     # [N, G] float32, exactly representable in the stored scale dtype
    zero: torch.Tensor      # [N, G] int64 in [0, 2^bits)
    g_idx: torch.Tensor     # [K] int64, the group of each column


def _wna16_qparams(groups: torch.Tensor, spec: Wna16Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero ([N, G], float32) of each group of `groups` [N, G, group] as the tool's RTN
    computes them; the scale is rounded to its stored dtype before the zero is derived from it."""
    maxq, half = 2 ** spec.bits - 1, 2 ** (spec.bits - 1)
    low, high = groups.amin(-1), groups.amax(-1)
    low0, high0 = low.clamp(max=0), high.clamp(min=0)       # ranges holding 0
    amax = torch.maximum(-low0, high0)

    def stored(scale: torch.Tensor) -> torch.Tensor:
        return scale.to(spec.scale_dtype).float()

    if spec.format in ("gptq", "gptq_v2"):                  # GPTQ's Quantizer.find_params
        if spec.symmetric:
            scale = stored(2 * torch.where(amax == 0, 1.0, amax) / maxq)
            return scale, torch.full_like(scale, half)
        empty = (low0 == 0) & (high0 == 0)
        low0, high0 = torch.where(empty, -1.0, low0), torch.where(empty, 1.0, high0)
        scale = stored((high0 - low0) / maxq)
        return scale, torch.round(-low0 / scale)
    if spec.format == "awq":                                # AutoAWQ's pseudo_quantize_tensor
        if spec.symmetric:
            scale = stored(groups.abs().amax(-1).clamp(min=1e-5) / (half - 1))
            return scale, torch.full_like(scale, half)
        scale = stored((high - low).clamp(min=1e-5) / maxq)
        return scale, (-torch.round(low / scale)).clamp(0, maxq)
    if spec.format == "compressed-tensors":                 # calculate_qparams, signed range
        eps = torch.finfo(spec.scale_dtype).eps
        if spec.symmetric:
            scale = stored(amax / (maxq / 2))
            scale = torch.where(scale == 0, eps, scale)
            return scale, torch.full_like(scale, half)
        scale = stored((high0 - low0) / maxq)
        scale = torch.where(scale == 0, eps, scale)
        return scale, torch.round((-half - low0 / scale).clamp(-half, half - 1)) + half
    if spec.symmetric:                                      # auto-round's int_sym ("full range")
        # (2 * (wmax_abs < wmin_abs) - 1) * max: the larger side's sign flipped onto the scale, so
        # that side lands on -2^(b-1), the code the symmetric grid has one more of.
        scale = stored(torch.where(high0 < -low0, amax, -amax) / half)
        scale = torch.where(scale < 0, scale.clamp(max=-1e-5), scale.clamp(min=1e-5))
        return scale, torch.full_like(scale, half)
    scale = stored((high0 - low0) / maxq).clamp(min=1e-5)    # auto-round's int_asym
    return scale, torch.round(-low0 / scale)


def round_to_nearest(weight: torch.Tensor, spec: Wna16Spec, order: torch.Tensor | None = None) -> Wna16Codes:
    """RTN of weight [N, K] in `spec`'s groups. With act_order, `order` (a permutation of the
    columns) stands in for the activation order: groups are consecutive in it, g_idx maps columns
    back."""
    weight = weight.float()
    rows, columns = weight.shape
    group = spec.group(columns)
    order = order if spec.act_order else torch.arange(columns)
    g_idx = torch.empty(columns, dtype=torch.long)
    g_idx[order] = torch.arange(columns) // group
    scale, zero = _wna16_qparams(weight[:, order].view(rows, columns // group, group), spec)
    if spec.layout == "compressed-tensors":     # it adds the signed zero point before rounding
        half = 2 ** (spec.bits - 1)
        codes = torch.round(weight / scale[:, g_idx] + (zero[:, g_idx] - half)) + half
    else:
        codes = torch.round(weight / scale[:, g_idx]) + zero[:, g_idx]
    return Wna16Codes(codes.clamp(0, 2 ** spec.bits - 1).long(), scale, zero.long(), g_idx)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 -> int32 with the same low 32 bits (two's complement wrap)."""
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., C] codes -> int32 [..., ceil(C * bits / 32)]: packed along the last dim, lowest bits
    first, the last word zero-padded."""
    per_word = 32 // bits
    codes = torch.nn.functional.pad(codes.long(), (0, -codes.shape[-1] % per_word))
    return _as_int32((codes.unflatten(-1, (-1, per_word)) << (torch.arange(per_word) * bits)).sum(-1))


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """pack_int32's inverse along the last dim: int64 codes [..., count]."""
    shifts = torch.arange(32 // bits) * bits
    return ((words.long().unsqueeze(-1) >> shifts) & (2 ** bits - 1)).flatten(-2)[..., :count]


def _awq_columns(columns: int) -> torch.Tensor:
    """The column each packed position of an AWQ row holds."""
    return (torch.arange(columns // 8).unsqueeze(1) * 8 + torch.tensor(AWQ_ORDER)).flatten()


def _wna16_tensors(module: str, codes: Wna16Codes, spec: Wna16Spec) -> dict[str, torch.Tensor]:
    """The tensors the format stores for one quantized projection (shapes: module docstring)."""
    rows, columns = codes.codes.shape
    if spec.layout == "gptq":
        qzeros = pack_int32(codes.zero.T, spec.bits)                       # [G, N / per word]
        if spec.zeros_minus_one:
            qzeros = _as_int32(qzeros.long() - _ONES[spec.bits])
        tensors = {"qweight": pack_int32(codes.codes, spec.bits).T,         # [K / per word, N]
                   "qzeros": qzeros, "scales": codes.scale.T.to(torch.float16)}
        if spec.format != "auto-round":
            tensors["g_idx"] = codes.g_idx.to(torch.int32)
    elif spec.layout == "awq":
        position_codes = codes.codes.T[:, _awq_columns(rows)]              # [K, N] in packed order
        position_zeros = codes.zero.T[:, _awq_columns(rows)]
        tensors = {"qweight": pack_int32(position_codes, spec.bits), "qzeros": pack_int32(position_zeros, spec.bits),
                   "scales": codes.scale.T.to(torch.float16)}
    else:
        tensors = {"weight_packed": pack_int32(codes.codes, spec.bits),    # the signed values + 2^(b-1)
                   "weight_scale": codes.scale.to(spec.scale_dtype), "weight_shape": torch.tensor([rows, columns])}
        if not spec.symmetric:
            tensors["weight_zero_point"] = pack_int32(codes.zero.T, spec.bits).T   # [N / per word, G]
        if spec.act_order:
            tensors["weight_g_idx"] = codes.g_idx.to(torch.int32)
    return {f"{module}.{name}": tensor.contiguous() for name, tensor in tensors.items()}


def _wna16_kept_reason(module: str, shape: torch.Size, spec: Wna16Spec, extra_kept: set[str],
                       quantize_mtp: bool) -> str | None:
    """Why the 2-D weight of `module` stays unquantized, or None."""
    if WNA16_KEPT_MODULES.search(module):
        return "recipe"
    if module in extra_kept:
        return "user"
    if module.startswith("mtp.") and not quantize_mtp:
        return "mtp"
    if spec.format == "auto-round" and module == "mtp.fc":
        return "recipe"             # auto-round's BLOCK_NAME_TO_IGNORE for tensors outside the HF model
    if not spec.packs(*shape):
        return "shape"
    return None


# Projections reading one input (a module's name up to this leaf): one act-order permutation.
_INPUT_SIBLINGS = re.compile(r"(\.)(?:q_proj|k_proj|v_proj|gate_proj|up_proj|in_proj_\w+)$")


def _to_wna16(tensors: dict[str, tuple[str, torch.Tensor]], spec: Wna16Spec, extra_kept: tuple[str, ...],
              quantize_mtp: bool, generator: torch.Generator
              ) -> tuple[dict[str, tuple[str, torch.Tensor]], dict[str, str]]:
    """Quantize every 2-D projection outside the kept ones (each tool's tensors in the shard of its
    weight); returns the new tensors and the kept projections (canonical name -> why)."""
    extra_kept = {re.sub(r"^model\.language_model\.", "model.", module) for module in extra_kept}
    result, kept, orders = {}, {}, {}
    for name, (file, tensor) in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and tensor.dim() == 2):
            result[name] = (file, tensor.to(spec.dtype) if tensor.is_floating_point() else tensor)
            continue
        reason = _wna16_kept_reason(module, tensor.shape, spec, extra_kept, quantize_mtp)
        if reason is not None:
            kept[module] = reason
            result[name] = (file, tensor.to(spec.dtype))
            continue
        # Act-order: GPTQ orders columns by its Hessian, which projections of one input share.
        key = (_INPUT_SIBLINGS.sub(r"\1", module), tensor.shape[1])
        if spec.act_order and key not in orders:
            orders[key] = torch.randperm(tensor.shape[1], generator=generator)
        codes = round_to_nearest(tensor, spec, orders.get(key))
        result.update({n: (file, t) for n, t in _wna16_tensors(module, codes, spec).items()})
    return result, kept


def _wna16_quantization_config(spec: Wna16Spec, kept: dict[str, str], with_mtp: bool, quantize_mtp: bool,
                               checkpoint_name) -> dict:
    """config.json's quantization_config as the format's tool writes it; `kept` maps the kept
    projections (canonical names) to why, checkpoint_name gives their names in the checkpoint."""
    listed = [checkpoint_name(m) for m in kept if not m.endswith("embed_tokens")]   # Linear-like, lm_head included
    mtp_kept = with_mtp and not quantize_mtp
    if spec.layout == "gptq" and spec.format != "auto-round":
        dynamic = {"-:.*mtp.*": {}} if mtp_kept else {}
        dynamic.update({f"-:{re.escape(checkpoint_name(m))}": {} for m, reason in kept.items()
                        if reason in ("shape", "user") and not (mtp_kept and m.startswith("mtp."))})
        config = {"bits": spec.bits, "checkpoint_format": spec.format, "desc_act": spec.act_order,
                  "dynamic": dynamic, "group_size": spec.group_size, "lm_head": False,
                  "meta": {"damp_auto_increment": 0.01, "damp_percent": 0.05, "mse": 0.0,
                           "quantizer": ["gptqmodel:5.0.0"], "static_groups": False, "true_sequential": True,
                           "uri": "https://github.com/modelcloud/gptqmodel"},
                  "pack_dtype": "int32", "quant_method": "gptq", "sym": spec.symmetric}
        return {key: value for key, value in config.items() if value != {}}      # GPTQModel drops an empty dynamic
    if spec.format == "awq":
        return {"bits": spec.bits, "group_size": spec.group_size, "modules_to_not_convert": listed,
                "quant_method": "awq", "version": "gemm", "zero_point": not spec.symmetric}
    if spec.format == "compressed-tensors":
        weights = {"actorder": "group" if spec.act_order else None, "block_structure": None, "dynamic": False,
                   "group_size": None if spec.group_size == -1 else spec.group_size, "num_bits": spec.bits,
                   "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None,
                   "strategy": "channel" if spec.group_size == -1 else "group", "symmetric": spec.symmetric,
                   "type": "int", "zp_dtype": None if spec.symmetric else "torch.int8"}
        scheme = {"format": "pack-quantized", "input_activations": None, "output_activations": None,
                  "targets": ["Linear"], "weights": weights}
        return {"config_groups": {"group_0": scheme}, "format": "pack-quantized", "global_compression_ratio": None,
                "ignore": listed, "kv_cache_scheme": None, "quant_method": "compressed-tensors",
                "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
                "version": "0.13.0"}
    extra_config = {".*mtp.*": {"bits": 16, "data_type": "fp"}} if mtp_kept else {}
    extra_config.update({checkpoint_name(m): {"bits": 16, "data_type": "fp"} for m in kept
                         if not m.endswith(("embed_tokens", "lm_head"))
                         and not (_ROUTER.search(m) and not m.startswith("mtp."))})   # HF's router is no Linear
    blocks = checkpoint_name("model.layers")
    return {"autoround_version": "0.13.0", "bits": spec.bits,
            "block_name_to_quantize": [blocks, "mtp.layers"] if with_mtp and quantize_mtp else blocks,
            "data_type": "int", "extra_config": extra_config, "group_size": spec.group_size, "iters": 0,
            "packing_format": f"auto_round:auto_{spec.layout}", "quant_method": "auto-round", "sym": spec.symmetric}


def _wna16_spec_of(quantization: dict) -> tuple[str, int, bool]:
    """(layout, bits, zeros stored minus one) of a WNA16 quantization_config."""
    method = quantization["quant_method"]
    if method == "gptq":
        return "gptq", quantization["bits"], quantization.get("checkpoint_format", "gptq") == "gptq"
    if method == "awq":
        return "awq", quantization["bits"], False
    if method == "compressed-tensors":
        (scheme,) = quantization["config_groups"].values()
        if quantization["format"] != "pack-quantized":
            raise ValueError(f"not a pack-quantized checkpoint: {quantization['format']!r}")
        return "compressed-tensors", scheme["weights"]["num_bits"], False
    if method == "auto-round":
        packing = quantization.get("packing_format", "auto_round:auto_gptq")
        if packing not in ("auto_round:auto_gptq", "auto_round:auto_awq"):
            raise ValueError(f"unknown auto-round packing_format {packing!r}")
        return packing.removeprefix("auto_round:auto_"), quantization["bits"], packing.endswith("gptq")
    raise ValueError(f"unknown quant_method {method!r}")


def _dequantize_wna16(module: str, tensors: dict[str, tuple[str, torch.Tensor]], layout: str, bits: int,
                      zeros_minus_one: bool) -> torch.Tensor:
    """W [N, K] float32 = (q - z) * s of one packed projection, read from its tensors alone."""
    def get(name: str) -> torch.Tensor | None:
        value = tensors.get(f"{module}.{name}")
        return None if value is None else value[1]

    if layout == "compressed-tensors":
        rows, columns = get("weight_shape").tolist()
        scale = get("weight_scale").float()                                  # [N, G]
        offset = 2 ** (bits - 1)                                              # codes are signed values + offset
        codes = unpack_int32(get("weight_packed"), bits, columns) - offset
        packed_zero = get("weight_zero_point")
        zero = (torch.zeros_like(scale, dtype=torch.long) if packed_zero is None
                else unpack_int32(packed_zero.T, bits, rows).T - offset)
        g_idx = get("weight_g_idx")
        g_idx = torch.arange(columns) // (columns // scale.shape[1]) if g_idx is None else g_idx.long()
        return (codes - zero[:, g_idx]).float() * scale[:, g_idx]
    scale = get("scales").float()                                             # [G, N]
    num_groups, rows = scale.shape
    if layout == "awq":
        qweight = get("qweight")                                              # [K, N / 8]
        columns = qweight.shape[0]
        codes, zero = torch.empty(columns, rows, dtype=torch.long), torch.empty(num_groups, rows, dtype=torch.long)
        codes[:, _awq_columns(rows)] = unpack_int32(qweight, bits, rows)
        zero[:, _awq_columns(rows)] = unpack_int32(get("qzeros"), bits, rows)
        g_idx = torch.arange(columns) // (columns // num_groups)
    else:
        qweight, g_idx = get("qweight"), get("g_idx")                         # [K * b / 32, N], [K]
        columns = qweight.shape[0] * 32 // bits if g_idx is None else g_idx.numel()
        codes = unpack_int32(qweight.T, bits, columns).T                     # [K, N]
        qzeros = get("qzeros").long() + (_ONES[bits] if zeros_minus_one else 0)
        zero = unpack_int32(qzeros, bits, rows)                               # [G, N]
        g_idx = torch.arange(columns) // (columns // num_groups) if g_idx is None else g_idx.long()
    return ((codes - zero[g_idx]).float() * scale[g_idx]).T


def dequantize_checkpoint(source: Path, destination: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The quantized checkpoint at `source` (block FP8 or any WNA16 format, as its config.json's
    quantization_config says) with every weight dequantized (FP8: w.float() * scale_inv; WNA16:
    (q - z) * s over its groups) and every tensor in `dtype`, without quantization_config: the
    same model, unquantized. Written from the formats' specifications, apart from the engine."""
    source, destination = Path(source), Path(destination)
    shutil.copytree(source, destination, dirs_exist_ok=True)
    config_path = destination / "config.json"
    config = json.loads(config_path.read_text())
    quantization = config.pop("quantization_config")
    tensors = _read_checkpoint(source)
    result = {}
    if quantization["quant_method"] == "fp8" or quantization.get("format") == "float-quantized":
        scale_name = "weight_scale_inv" if quantization["quant_method"] == "fp8" else "weight_scale"
        for name, (file, tensor) in tensors.items():
            if name.endswith(f".{scale_name}"):
                continue
            scale = tensors.get(name.removesuffix(".weight") + f".{scale_name}")
            if scale is None:
                value = tensor.float()
            else:   # blocks of the config's size, or one scale a row ([N, 1]: blocks of 1 x K)
                weights = next(iter(quantization.get("config_groups", {"": {"weights": {}}}).values()))["weights"]
                block = (1, tensor.shape[1]) if weights.get("strategy") == "channel" else \
                    tuple(quantization.get("weight_block_size") or weights["block_structure"])
                value = dequantize_block_fp8(tensor, scale[1].float(), block)
            result[name] = (file, value.to(dtype))
    else:
        layout, bits, zeros_minus_one = _wna16_spec_of(quantization)
        packed = {name.rpartition(".")[0] for name in tensors if name.endswith((".qweight", ".weight_packed"))}
        for name, (file, tensor) in tensors.items():
            module, _, suffix = name.rpartition(".")
            if module in packed:
                if suffix in ("qweight", "weight_packed"):
                    weight = _dequantize_wna16(module, tensors, layout, bits, zeros_minus_one)
                    result[f"{module}.weight"] = (file, weight.to(dtype))
                continue        # scales, zeros, g_idx, weight_shape: consumed
            result[name] = (file, tensor.to(dtype) if tensor.is_floating_point() else tensor)
    _write_checkpoint(destination, result)
    config_path.write_text(json.dumps(config, indent=2))
    return destination


def _read_checkpoint(directory: Path) -> dict[str, tuple[str, torch.Tensor]]:
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = [SINGLE_FILE]
    tensors = {}
    for file in files:
        with safe_open(directory / file, framework="pt") as f:
            for name in f.keys():
                tensors[name] = (file, f.get_tensor(name))
    return tensors


def _write_checkpoint(directory: Path, tensors: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Rewrite every shard; a single file stays unindexed, more than one gets an index."""
    for path in directory.glob("model*.safetensors*"):
        path.unlink()
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, (file, tensor) in tensors.items():
        shards.setdefault(file, {})[name] = tensor.contiguous()
    for file, shard in shards.items():
        save_file(shard, str(directory / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for _, t in tensors.values())},
            "weight_map": {name: tensors[name][0] for name in sorted(tensors)},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))


def make_checkpoint(
    directory: Path,
    family: str,
    *,
    seed: int = 0,
    with_mtp: bool = True,
    mtp_copy_of_last_layer: bool = False,
    tie_word_embeddings: bool = False,
    moe_layout: str = "per_expert",
    language_model_prefix: bool = False,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype = torch.float32,
    fp8: bool = False,
    fp8_block_size: tuple[int, int] | None = (128, 128),
    fp8_not_converted: tuple[str, ...] = (),
    fp8_format: str = "fp8",
    wna16: str | None = None,
    wna16_bits: int = 4,
    wna16_group_size: int = 32,
    wna16_symmetric: bool = True,
    wna16_act_order: bool = False,
    wna16_kept: tuple[str, ...] = (),
    wna16_quantize_mtp: bool = False,
    **config_overrides,
) -> Path:
    """Write a tiny random `family` checkpoint (+ tokenizer) into `directory` and return it.

    moe_layout: "per_expert" (`mlp.experts.N.{gate,up,down}_proj.weight`, as HF saves) or
    "fused" (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
    language_model_prefix: store `model.*` as `model.language_model.*` (multimodal Qwen3.5).
    fp8: the official block-FP8 layout (float8_e4m3fn projections with `weight_scale_inv`
    [ceil(out/bn), ceil(in/bk)], experts per expert, the kept modules and every other tensor in
    bf16, `quantization_config` in config.json); fp8_not_converted adds modules kept in bf16.
    fp8_format "compressed-tensors": llm-compressor's layout instead (`weight_scale`, format
    float-quantized; fp8_block_size None: FP8_DYNAMIC, one bf16 scale [N, 1] per output row).
    wna16: a weight-only integer layout, "gptq", "gptq_v2", "awq", "compressed-tensors" or
    "auto-round" (module docstring), of wna16_bits (4 or 8) in groups of wna16_group_size columns
    (-1: per channel), symmetric or not, with act-order groups (GPTQ, compressed-tensors); the
    projections are RTN-quantized, experts per expert, in WNA16_SHAPE unless config_overrides say
    otherwise, every other tensor in the tool's dtype (bf16; AWQ packing: fp16), `quantization_config`
    in config.json; wna16_kept adds modules kept unquantized (by their names without the
    language-model prefix), wna16_quantize_mtp quantizes mtp.* too.
    config_overrides go to the HF config (e.g. num_hidden_layers=8, layer_types=[...]).
    """
    if moe_layout not in ("per_expert", "fused"):
        raise ValueError(f"moe_layout must be 'per_expert' or 'fused', got {moe_layout!r}")
    if (fp8 or wna16) and moe_layout != "per_expert":
        raise ValueError("quantized checkpoints store experts per expert")
    if fp8 and wna16:
        raise ValueError("a checkpoint is block-FP8 or WNA16, not both")
    spec = Wna16Spec(wna16, wna16_bits, wna16_group_size, wna16_symmetric, wna16_act_order) if wna16 else None
    directory = Path(directory)
    config_class, model_class = _model_classes(family)
    make_tokenizer(directory)
    eos_token_id = Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(EOS_TOKEN)

    defaults = {**COMMON_DEFAULTS, **FAMILY_DEFAULTS[family], **(wna16_shape(family) if spec is not None else {})}
    settings = {**defaults, "eos_token_id": eos_token_id, "tie_word_embeddings": tie_word_embeddings,
                **config_overrides}
    if "num_hidden_layers" in config_overrides and "layer_types" not in config_overrides:
        del settings["layer_types"]  # let HF derive the 3:1 pattern for the new depth
    config = config_class(**settings)
    model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    _randomise(model, generator)
    model.to(dtype)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)

    tensors = _read_checkpoint(directory)
    if with_mtp:
        mtp = _split_experts(_mtp_tensors(model.model.layers, config.hidden_size, mtp_copy_of_last_layer, generator))
        tensors.update({name: (MTP_SHARD, tensor.to(dtype)) for name, tensor in mtp.items()})
    if moe_layout == "fused":
        tensors = _fuse_experts(tensors)
    if fp8:
        tensors, not_converted = _to_fp8(tensors, fp8_block_size, fp8_not_converted,
                                         "weight_scale_inv" if fp8_format == "fp8" else "weight_scale")
    if spec is not None:
        tensors, wna16_not_quantized = _to_wna16(tensors, spec, wna16_kept, wna16_quantize_mtp, generator)
    prefix = (lambda m: re.sub(r"^model\.", "model.language_model.", m)) if language_model_prefix else str
    tensors = {prefix(name): value for name, value in tensors.items()}
    _write_checkpoint(directory, tensors)

    config_path = directory / "config.json"
    saved = json.loads(config_path.read_text())
    if with_mtp:
        saved[MTP_CONFIG_KEY[family]] = 1
    if fp8 and fp8_format == "fp8":
        saved["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": list(fp8_block_size),
                                        "modules_to_not_convert": [prefix(m) for m in not_converted]}
    elif fp8:
        saved["quantization_config"] = _compressed_tensors_fp8_config(fp8_block_size,
                                                                      [prefix(m) for m in not_converted])
    if spec is not None:
        saved["quantization_config"] = _wna16_quantization_config(spec, wna16_not_quantized, with_mtp,
                                                                  wna16_quantize_mtp, prefix)
        saved["dtype"] = str(spec.dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(saved, indent=2))
    return directory


def _compressed_tensors_fp8_config(block: tuple[int, int] | None, kept: list[str]) -> dict:
    """llm-compressor's FP8_DYNAMIC (block None: a scale per output row, activations per token)
    or FP8_BLOCK quantization_config; `ignore` lists the kept projections, the router also by
    pattern, as its recipes do."""
    float8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "actorder": None,
              "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    weights = {**float8, "dynamic": False, "strategy": "channel"} if block is None else \
        {**float8, "dynamic": False, "strategy": "block", "block_structure": list(block)}
    activations = {**float8, "dynamic": True, "observer": None, "strategy": "token"} if block is None else \
        {**float8, "dynamic": True, "observer": None, "strategy": "group", "group_size": block[1]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": [*kept, "re:.*mlp.gate$"], "kv_cache_scheme": None, "global_compression_ratio": None}


# A chat template that places images as Qwen3.5's does (one <|vision_start|><|image_pad|>
# <|vision_end|> per image part, in order), ChatML otherwise.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] in ('video', 'video_url') or 'video' in part or 'video_url' in part %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A tiny Qwen3.5 vision tower: the real patch (16), temporal patch (2) and merge (2) sizes, so
# the real processor's arithmetic applies; an 8 x 8 learned position grid.
VISION_DEFAULTS = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, in_channels=3, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64)
# Small images for the CPU: 32 x 32 to 128 x 128 pixels (1 to 16 tokens).
VISION_PREPROCESSOR = {"size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}, "patch_size": 16,
                       "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor"}
# Small videos: 2 to 8 frames (1 to 4 temporal patches) of 32 x 32 to 64 x 64 pixels (1 to 4
# tokens a patch); size bounds a video's pixels over all its frames, as in HF.
VIDEO_PREPROCESSOR = {"size": {"shortest_edge": 2 * 32 * 32, "longest_edge": 8 * 64 * 64}, "patch_size": 16,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                      "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 2, "max_frames": 8,
                      "video_processor_type": "Qwen3VLVideoProcessor"}


def make_vision_checkpoint(directory: Path, *, family: str = "qwen3_5", seed: int = 0, with_mtp: bool = True,
                           dtype: torch.dtype = torch.float32, mrope_section: tuple[int, int, int] = (2, 1, 1),
                           **config_overrides) -> Path:
    """A tiny random Qwen3.5 (family "qwen3_5") or Qwen3.5-MoE ("qwen3_5_moe") vision-language
    checkpoint (`Qwen3_5[Moe]ForConditionalGeneration`: the language model under
    `model.language_model.*`, experts per expert, the vision tower under `model.visual.*`), saved
    by HF, with `mtp.*` weights beside it, a tokenizer holding the vision tokens, a chat template
    that places images and videos, and preprocessor_config.json and video_preprocessor_config.json
    for small images and videos. mrope_section: the text
    model's multimodal RoPE sections (frequencies per axis); config_overrides go to the text
    config."""
    import transformers

    if family not in ("qwen3_5", "qwen3_5_moe"):
        raise ValueError(f"vision-language checkpoints are qwen3_5 or qwen3_5_moe, not {family!r}")
    prefix = "Qwen3_5Moe" if family == "qwen3_5_moe" else "Qwen3_5"

    directory = Path(directory)
    make_tokenizer(directory, extra_special=VISION_TOKENS, chat_template=VISION_CHAT_TEMPLATE)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in VISION_TOKENS}
    text = {**COMMON_DEFAULTS, **FAMILY_DEFAULTS[family], "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": list(mrope_section), "mrope_interleaved": True},
            **config_overrides}
    vision = {**VISION_DEFAULTS, "out_hidden_size": text["hidden_size"]}
    config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=vision,
                                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                                        vision_start_token_id=ids["<|vision_start|>"],
                                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(_random_vision_parameter(name, parameter.shape, generator)
                            if ".visual." in f".{name}" else _random_parameter(name, parameter.shape, generator))
    model.to(dtype)
    model.save_pretrained(directory, safe_serialization=True)
    if with_mtp:
        tensors = _read_checkpoint(directory)
        mtp = _split_experts(_mtp_tensors(model.model.language_model.layers, text["hidden_size"], False, generator))
        tensors.update({name: (MTP_SHARD, tensor.to(dtype)) for name, tensor in mtp.items()})
        _write_checkpoint(directory, tensors)
        config_path = directory / "config.json"
        saved = json.loads(config_path.read_text())
        saved["text_config"]["mtp_num_hidden_layers"] = 1
        config_path.write_text(json.dumps(saved, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps(VISION_PREPROCESSOR, indent=2))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR, indent=2))
    return directory


# A chat turn as the vision checkpoints' template writes it, and its media placeholders.
USER_TURN = "<|im_start|>user\n"
ASSISTANT_TURN = "<|im_end|>\n<|im_start|>assistant\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


def vision_checkpoints(tmp_path_factory, seed: int):
    """make(family) -> a tiny vision-language checkpoint of that family (make_vision_checkpoint
    with this seed), made once per family."""
    made = {}

    def make(family: str) -> Path:
        if family not in made:
            made[family] = make_vision_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=seed)
        return made[family]
    return make


def hf_vision_model(path: Path):
    """HF's Qwen3_5[Moe]ForConditionalGeneration of a vision checkpoint, in float32: the oracle."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    model_class = {"qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
                   "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration}[config.model_type]
    return model_class.from_pretrained(path, dtype=torch.float32).eval()


def _random_vision_parameter(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """LayerNorms near (1, 0), biases small, the rest at 1/sqrt(fan-in): O(1) activations."""
    normal = torch.randn(shape, generator=generator)
    if "norm" in name:
        return (1.0 + 0.1 * normal) if name.endswith("weight") else 0.1 * normal
    if name.endswith("bias"):
        return 0.1 * normal
    if name.endswith("pos_embed.weight"):
        return 0.5 * normal
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return normal / math.sqrt(fan_in)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random checkpoint (+ tokenizer).")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--family", choices=("qwen3_5", "qwen3_5_moe", "qwen3_next"), default="qwen3_5")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_checkpoint(args.directory, args.family, seed=args.seed))


def assert_idle(stats: dict) -> None:
    """Nothing runs or waits, and every slot and KV block is free or owned by the prefix cache
    (which pins nothing): no leak."""
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_slots"] + stats["num_cached_slots"] == stats["num_slots"]
    assert stats["num_free_kv_blocks"] + stats["num_cached_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["prefix_cache"]["pinned"] == 0
