"""Weight loading: every layout a real checkpoint uses loads to the same model, and every
corruption ends in one clear error naming the problem."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from safetensors import safe_open
from safetensors.torch import save_file

from deltaspec.engine import LLM, ConfigError, ModelConfig, WeightLoadError
from deltaspec.kernels import REFERENCE_OPS
from deltaspec.engine.weights import load_model

TOKENS = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(0)).tolist()


def logits_of(path):
    return LLM(path).score(TOKENS)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_fused_and_per_expert_layouts_agree(family, checkpoint):
    per_expert = logits_of(checkpoint(family))
    fused = logits_of(checkpoint(family, moe_layout="fused"))
    assert torch.equal(per_expert, fused)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_language_model_prefix_and_shards_agree(family, checkpoint):
    plain = logits_of(checkpoint(family))
    assert torch.equal(plain, logits_of(checkpoint(family, language_model_prefix=True)))
    sharded = checkpoint(family, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert torch.equal(plain, logits_of(sharded))


def test_tied_embeddings(checkpoint):
    llm = LLM(checkpoint("qwen3_5", tie_word_embeddings=True))
    assert llm.model.lm_head is None
    assert llm.model.lm_head_weight is llm.model.embed_tokens


def test_vision_weights_are_ignored(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_5", language_model_prefix=True), tmp_path)
    save_file({"model.visual.patch_embed.proj.weight": torch.randn(4, 3)}, str(path / "vision.safetensors"))
    add_to_index(path, "model.visual.patch_embed.proj.weight", "vision.safetensors")
    assert torch.equal(logits_of(path), logits_of(checkpoint("qwen3_5")))


def test_bfloat16_load_is_close_to_float32(checkpoint):
    path = checkpoint("qwen3_next")
    full = LLM(path).score(TOKENS)
    half = LLM(path, dtype="bfloat16").score(TOKENS)
    assert half.dtype == torch.float32
    # These random tiny models amplify rounding (HF itself in bf16 is ~10% RMS off its fp32
    # logits here), so the bound is HF's own bf16 error on the same checkpoint.
    with torch.no_grad():
        hf_full, hf_half = (AutoModelForCausalLM.from_pretrained(path, dtype=dtype)(torch.tensor([TOKENS])).logits[0].float()
                            for dtype in (torch.float32, torch.bfloat16))
    assert relative_rms(half, full) <= max(0.05, 1.5 * relative_rms(hf_half, hf_full))


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


# Corruptions -----------------------------------------------------------------------------------

def copy_checkpoint(source, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def add_to_index(path, name, file):
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][name] = file
    index_path.write_text(json.dumps(index))


def rewrite_shard(path, edit):
    """Apply edit(dict) to the shard holding the model weights (not the MTP shard)."""
    shard = path / "model.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != "model.safetensors" or n in tensors}
    index["weight_map"].update({n: "model.safetensors" for n in tensors})
    index_path.write_text(json.dumps(index))


def load(path):
    return load_model(path, REFERENCE_OPS, torch.float32, "cpu")


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_5"), tmp_path)
    rewrite_shard(path, lambda t: t.pop("model.layers.1.linear_attn.in_proj_z.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensors \(1\): model.layers.1.linear_attn.in_proj_z.weight"):
        load(path)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_next"), tmp_path)
    rewrite_shard(path, lambda t: t.update({"model.layers.3.self_attn.o_proj.weight": torch.randn(72, 100)}))
    with pytest.raises(WeightLoadError, match=r"model.layers.3.self_attn.o_proj.weight: expected \[72, 128\], got \[72, 100\]"):
        load(path)


def test_wrong_fused_projection_shape_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_next"), tmp_path)
    rewrite_shard(path, lambda t: t.update({"model.layers.0.linear_attn.in_proj_ba.weight": torch.randn(6, 72)}))
    with pytest.raises(WeightLoadError, match=r"in_proj_ba.weight: expected \[8, 72\], got \[6, 72\]"):
        load(path)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_5"), tmp_path)
    rewrite_shard(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.randn(3)}))
    with pytest.raises(WeightLoadError, match=r"unexpected tensors \(1\): model.layers.0.mlp.extra.weight"):
        load(path)


def test_several_problems_in_one_error(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_5_moe"), tmp_path)

    def edit(t):
        t.pop("model.layers.2.mlp.experts.5.up_proj.weight")
        t["model.norm.weight"] = torch.randn(71)

    rewrite_shard(path, edit)
    with pytest.raises(WeightLoadError) as error:
        load(path)
    message = str(error.value)
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in message and "model.norm.weight" in message
    assert "experts.gate_up_proj" not in message  # the unused alternative layout is not reported


def test_truncated_safetensors_file(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_5"), tmp_path)
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        load(path)


def test_missing_shard_named_by_index(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_5"), tmp_path)
    (path / "model-mtp.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="model-mtp.safetensors"):
        load(path)


def test_unknown_model_type(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("qwen3_5"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'.*qwen3_5.*qwen3_next"):
        LLM(path)


def test_no_weights_at_all(tmp_path, checkpoint):
    path = copy_checkpoint(checkpoint("qwen3_5"), tmp_path)
    for file in path.glob("model*"):
        file.unlink()
    with pytest.raises(WeightLoadError, match="no \\*.safetensors files"):
        load(path)


# Config ---------------------------------------------------------------------------------------

BASE = dict(vocab_size=100, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, intermediate_size=128)


def test_nested_text_config_and_interval():
    raw = {"model_type": "qwen3_5", "tie_word_embeddings": True, "vision_config": {"depth": 2},
           "text_config": {**BASE, "full_attention_interval": 4, "mtp_num_hidden_layers": 1,
                           "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                               "mrope_section": [11, 11, 10], "mrope_interleaved": True}}}
    c = ModelConfig.from_dict(raw)
    assert c.family == "qwen3_5" and c.tie_word_embeddings and c.num_mtp_layers == 1
    assert c.attention_layer_ids == (3, 7) and c.rotary_dim == 8 and c.rope_theta == 1e7
    assert c.num_experts == 0


def test_qwen3_next_fields():
    raw = {"model_type": "qwen3_next", **BASE, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "norm_topk_prob": False,
           "decoder_sparse_step": 2, "mlp_only_layers": [5], "num_nextn_predict_layers": 1,
           "rope_theta": 5e6, "partial_rotary_factor": 0.5}
    c = ModelConfig.from_dict(raw)
    assert c.num_mtp_layers == 1 and not c.norm_topk_prob and c.rope_theta == 5e6 and c.rotary_dim == 16
    assert [c.is_moe_layer(i) for i in range(8)] == [False, True, False, True, False, False, False, True]


def test_config_is_frozen_and_validated():
    c = ModelConfig.from_dict({"model_type": "qwen3_5_text", **BASE})
    with pytest.raises(Exception):
        c.hidden_size = 3
    with pytest.raises(ConfigError, match="linear_num_value_heads must be a multiple"):
        ModelConfig.from_dict({"model_type": "qwen3_5_text", **BASE, "linear_num_value_heads": 3})
    with pytest.raises(ConfigError, match="lacks required field 'hidden_size'"):
        ModelConfig.from_dict({"model_type": "qwen3_5_text", **{k: v for k, v in BASE.items() if k != "hidden_size"}})


@pytest.mark.parametrize("key,value", [("hidden_act", "gelu"), ("output_gate_type", "sigmoid"),
                                       ("attn_output_gate", False), ("attention_bias", True),
                                       ("mamba_ssm_dtype", "float8_e4m3fn")])
def test_config_values_the_engine_does_not_implement_are_refused(key, value):
    """A value that would change the model's math is one clear error, never served as the
    published configs' choice; those choices themselves load (one at a time, then all)."""
    with pytest.raises(ConfigError, match=f"{key} = {value!r} is not supported"):
        ModelConfig.from_dict({"model_type": "qwen3_5_text", **BASE, key: value})
    published = dict(hidden_act="silu", output_gate_type="swish", attn_output_gate=True, attention_bias=False,
                     mamba_ssm_dtype="float32")
    ModelConfig.from_dict({"model_type": "qwen3_5_text", **BASE, key: published[key]})
    ModelConfig.from_dict({"model_type": "qwen3_next", "text_config": {**BASE, **published}})
