"""Tiny, deterministic HF-format checkpoints and tokenizers for tests.

`make_tokenizer` trains a byte-level BPE (ChatML specials) on a built-in corpus that mixes
English, Python and multi-byte UTF-8. `make_checkpoint` builds a random Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next model through HF transformers, re-randomises every parameter from a seeded generator
(so norms are not all ones, A_log is not HF's init, logits are O(1)), saves it with
`save_pretrained`, and then rewrites the safetensors into the layout a test asks for: per-expert
or fused MoE experts, with or without the `model.language_model.` prefix, plus `mtp.*` weights in
their own shard, optionally in the official block-FP8 layout (`fp8=True`);
`dequantize_checkpoint` writes the same weights dequantized, as an unquantized checkpoint.

Knows nothing about deltaspec: it only writes files the way HF and real Qwen checkpoints do.
Must not import pytest (benchmarks and scripts use it too).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

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


def _to_fp8(tensors: dict[str, tuple[str, torch.Tensor]], block: tuple[int, int],
            extra_kept: tuple[str, ...]) -> tuple[dict[str, tuple[str, torch.Tensor]], list[str]]:
    """Quantize every 2-D projection weight outside the kept modules; returns the new tensors and
    modules_to_not_convert (every kept projection, as the published configs list them)."""
    result, kept = {}, []
    for name, (file, tensor) in tensors.items():
        module = name.removesuffix(".weight")
        is_projection = name.endswith(".weight") and tensor.dim() == 2
        if is_projection and (FP8_KEPT_MODULES.search(module) or module in extra_kept):
            kept.append(module)
        if is_projection and module not in kept:
            weight, scale_inv = quantize_block_fp8(tensor, block)
            result[name] = (file, weight)
            result[f"{module}.weight_scale_inv"] = (file, scale_inv)
        else:
            result[name] = (file, tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor)
    return result, sorted(kept)


def dequantize_checkpoint(source: Path, destination: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The FP8 checkpoint at `source` with every weight dequantized (w.float() * scale_inv) and
    every tensor in `dtype`, without quantization_config: the same model, unquantized."""
    source, destination = Path(source), Path(destination)
    shutil.copytree(source, destination, dirs_exist_ok=True)
    config_path = destination / "config.json"
    config = json.loads(config_path.read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    tensors = _read_checkpoint(source)
    result = {}
    for name, (file, tensor) in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale_inv")
        value = dequantize_block_fp8(tensor, scale[1], block) if scale is not None else tensor.float()
        result[name] = (file, value.to(dtype))
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
    fp8_block_size: tuple[int, int] = (128, 128),
    fp8_not_converted: tuple[str, ...] = (),
    **config_overrides,
) -> Path:
    """Write a tiny random `family` checkpoint (+ tokenizer) into `directory` and return it.

    moe_layout: "per_expert" (`mlp.experts.N.{gate,up,down}_proj.weight`, as HF saves) or
    "fused" (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
    language_model_prefix: store `model.*` as `model.language_model.*` (multimodal Qwen3.5).
    fp8: the official block-FP8 layout (float8_e4m3fn projections with `weight_scale_inv`
    [ceil(out/bn), ceil(in/bk)], experts per expert, the kept modules and every other tensor in
    bf16, `quantization_config` in config.json); fp8_not_converted adds modules kept in bf16.
    config_overrides go to the HF config (e.g. num_hidden_layers=8, layer_types=[...]).
    """
    if moe_layout not in ("per_expert", "fused"):
        raise ValueError(f"moe_layout must be 'per_expert' or 'fused', got {moe_layout!r}")
    if fp8 and moe_layout != "per_expert":
        raise ValueError("FP8 checkpoints store experts per expert")
    directory = Path(directory)
    config_class, model_class = _model_classes(family)
    make_tokenizer(directory)
    eos_token_id = Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(EOS_TOKEN)

    settings = {**COMMON_DEFAULTS, **FAMILY_DEFAULTS[family], "eos_token_id": eos_token_id,
                "tie_word_embeddings": tie_word_embeddings, **config_overrides}
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
        tensors, not_converted = _to_fp8(tensors, fp8_block_size, fp8_not_converted)
    if language_model_prefix:
        tensors = {re.sub(r"^model\.", "model.language_model.", name): value for name, value in tensors.items()}
    _write_checkpoint(directory, tensors)

    config_path = directory / "config.json"
    saved = json.loads(config_path.read_text())
    if with_mtp:
        saved[MTP_CONFIG_KEY[family]] = 1
    if fp8:
        prefix = (lambda m: re.sub(r"^model\.", "model.language_model.", m)) if language_model_prefix else str
        saved["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": list(fp8_block_size),
                                        "modules_to_not_convert": [prefix(m) for m in not_converted]}
    config_path.write_text(json.dumps(saved, indent=2))
    return directory


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
