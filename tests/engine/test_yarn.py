"""YaRN RoPE (`rope_type: yarn`): logits equal HF transformers' past the original context, on
tiny checkpoints whose original context is 64 tokens, and the config reads YaRN's parameters
(and its attention factor) as HF does."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from deltaspec.engine import LLM, ConfigError, ModelConfig

from fixtures import make_checkpoint

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
        "original_max_position_embeddings": 64}
TOLERANCE = 1e-4   # max abs error relative to the logits' scale, as test_model_parity


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("rope", [YARN, {**YARN, "beta_fast": 8, "beta_slow": 2, "attention_factor": 1.3}])
def test_yarn_logits_match_hf_past_the_original_context(family, checkpoint, rope, tmp_path):
    path = make_checkpoint(tmp_path, family, with_mtp=False, rope_parameters=dict(rope), max_position_embeddings=256)
    tokens = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    llm = LLM(path, block_size=16)
    assert llm.config.yarn is not None
    actual = llm.score(tokens)
    error = (actual - expected).abs().max().item() / expected.abs().max().item()
    assert error <= TOLERANCE, f"relative error {error:.2e}"
    # Not vacuous: plain RoPE gives other logits past position 64.
    assert not torch.allclose(actual[64:], LLM(checkpoint(family, with_mtp=False), block_size=16).score(tokens)[64:])


def config_with(rope: dict) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32,
                                  "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "head_dim": 16, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                                  "linear_key_head_dim": 8, "linear_value_head_dim": 8, "intermediate_size": 64,
                                  "max_position_embeddings": 1024, "rope_scaling": rope})


def test_yarn_parameters_as_hf_reads_them():
    yarn = config_with({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}).yarn
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1) and (yarn.beta_fast, yarn.beta_slow) == (32, 1)
    implied = config_with({"rope_type": "yarn", "original_max_position_embeddings": 256, "mscale": 1.0,
                           "mscale_all_dim": 0.5}).yarn
    assert implied.factor == 4.0
    assert implied.attention_factor == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    assert config_with({"rope_type": "default"}).yarn is None
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        config_with({"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="unsupported rope_type 'dynamic'"):
        config_with({"rope_type": "dynamic", "factor": 2.0})
