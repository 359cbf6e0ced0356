"""llm-compressor's FP8 checkpoints (compressed-tensors, format float-quantized): FP8_DYNAMIC
(a scale per output row, activations per token) and FP8_BLOCK (128 x 128 blocks) run as block
FP8. Tiny checkpoints in that layout (tests/fixtures.py, `fp8_format="compressed-tensors"`) load
their fp8 values and scales as stored, give logits within what activation quantization explains,
and speculate losslessly; schemes that cannot run fail before loading, in one line."""

from functools import lru_cache

import pytest
import torch

from deltaspec.engine import LLM, ConfigError, EngineConfig
from deltaspec.engine.core import EngineCore
from deltaspec.engine.quantization import Fp8Config, describe, quantization_from_dict
from deltaspec.kernels.fp8 import FP8, dequantize_reference

from fixtures import GPU_SHAPE, dequantize_checkpoint
from harness import assert_graphs_decode_as_eager, generate, prompts
from test_fp8_checkpoints import _set_ops, perturbed_inputs_ops, relative_rms

SCHEMES = {"dynamic": None, "block": (128, 128)}


@lru_cache(maxsize=None)
def _dequantized(path, directory):
    return dequantize_checkpoint(path, directory)


@pytest.fixture(params=list(SCHEMES))
def compressed_pair(request, checkpoint, tmp_path_factory):
    """(compressed-tensors FP8 Qwen3.5-MoE checkpoint, the same weights dequantized, plain)."""
    path = checkpoint("qwen3_5_moe", fp8=True, fp8_format="compressed-tensors", fp8_block_size=SCHEMES[request.param],
                      mtp_copy_of_last_layer=True)
    return path, _dequantized(path, tmp_path_factory.mktemp("dequantized"))


def test_compressed_fp8_loads_as_stored_and_stays_within_activation_rounding(compressed_pair):
    """Every FP8 projection and expert dequantizes to exactly the dequantized checkpoint's weight
    (a per-row scale broadcast over the row's groups); the logits' error is within twice that of
    relative input noise of 2^-4 (test_fp8_checkpoints' bound: half e4m3's step)."""
    path, plain_path = compressed_pair
    quantized_llm, plain_llm = LLM(path), LLM(plain_path)
    quantized, plain = dict(quantized_llm.model.named_parameters()), dict(plain_llm.model.named_parameters())
    num_fp8 = 0
    for name, value in plain.items():
        stored = quantized[name]
        if name.endswith("mixer.in_proj.weight") and stored.shape != value.shape:
            value = value[:stored.shape[0]]   # b|a kept in bf16: a second projection in_proj_ba
        if stored.dtype == FP8:
            num_fp8 += 1
            scale = quantized[name.removesuffix(".weight") + ".weight_scale" if name.endswith(".weight")
                              else name + "_scale"]
            assert torch.equal(dequantize_reference(stored, scale, 128), value), name
    assert num_fp8 > 0
    tokens = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = plain_llm.score(tokens)
    error = relative_rms(quantized_llm.score(tokens), expected)
    base_ops, noise = plain_llm.model.ops, []
    for seed in range(3):
        _set_ops(plain_llm.model, perturbed_inputs_ops(base_ops, 2 ** -4, seed))
        noise.append(relative_rms(plain_llm.score(tokens), expected))
    assert 0 < error <= 2 * sum(noise) / len(noise)


def test_compressed_fp8_greedy_speculation_equals_plain_decoding(compressed_pair, k=2):
    path, _ = compressed_pair
    batch = prompts(3, seed=40 + k)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False))
    assert generate(core, batch) == base
    assert core.stats()["spec"]["num_verify_steps"] > 0


FLOAT8 = {"num_bits": 8, "type": "float", "symmetric": True}


def _config(weights: dict, activations: dict | None, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", **extra,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


def test_schemes_parse_to_block_fp8():
    dynamic = _config({**FLOAT8, "strategy": "channel"}, {**FLOAT8, "strategy": "token", "dynamic": True},
                      ignore=["model.language_model.layers.0.mlp.shared_expert_gate", "re:.*mlp.gate$", "lm_head"])
    parsed = quantization_from_dict(dynamic)
    assert parsed == Fp8Config(weight_block_size=(1, 128), scale_name="weight_scale",
                               modules_to_not_convert=("model.layers.0.mlp.shared_expert_gate", "lm_head"),
                               ignore_patterns=(".*mlp.gate$",))
    assert not parsed.quantizes("model.layers.3.mlp.gate") and parsed.quantizes("model.layers.3.mlp.gate_proj")
    assert describe(parsed) == "FP8, a scale a row"
    block = _config({**FLOAT8, "strategy": "block", "block_structure": [128, 128]},
                    {**FLOAT8, "strategy": "group", "group_size": 128, "dynamic": True})
    assert quantization_from_dict(block) == Fp8Config(weight_block_size=(128, 128), scale_name="weight_scale")
    assert describe(quantization_from_dict(block)) == "FP8, 128 x 128 weight blocks"


@pytest.mark.parametrize("config, named", [
    (_config({**FLOAT8, "strategy": "channel"}, {**FLOAT8, "strategy": "token", "dynamic": False}), "static"),
    (_config({**FLOAT8, "strategy": "tensor"}, {**FLOAT8, "strategy": "tensor", "dynamic": True}), "'tensor'"),
    (_config({**FLOAT8, "strategy": "channel"}, None), "8-bit float weights with 8-bit float activations"),
    (_config({"num_bits": 8, "type": "int", "strategy": "channel"}, {"num_bits": 8, "type": "int",
                                                                     "strategy": "token", "dynamic": True},
             format="int-quantized"), "W8A8 int8"),
    (_config({**FLOAT8, "strategy": "channel"}, {**FLOAT8, "strategy": "token", "dynamic": True},
             kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
])
def test_what_cannot_run_is_named(config, named):
    with pytest.raises(ConfigError) as error:
        quantization_from_dict(config)
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_fp8_on_gpu_under_cuda_graphs(checkpoint, scheme):
    """The Triton FP8 GEMMs with per-row scales (and cuBLAS's blocks for FP8_BLOCK at prefill)
    under the graphs (harness.assert_graphs_decode_as_eager)."""
    assert_graphs_decode_as_eager(checkpoint("qwen3_5", fp8=True, fp8_format="compressed-tensors",
                                             fp8_block_size=SCHEMES[scheme], mtp_copy_of_last_layer=True, **GPU_SHAPE))

def test_per_row_scales_are_sliced_with_their_rows(checkpoint):
    """tp=2 reads: a column-parallel projection's [N, 1] scales split with its rows, a
    row-parallel one's stay whole on every rank (one scale a row covers both halves)."""
    from test_tensor_parallel import full_tensors, rank_tensors
    path = checkpoint("qwen3_5", fp8=True, fp8_format="compressed-tensors", fp8_block_size=None)
    full, ranks = full_tensors(path), [rank_tensors(path, r) for r in range(2)]
    gate = "model.layers.0.mlp.gate_proj.weight_scale"
    assert torch.equal(torch.cat([r[gate] for r in ranks]), full[gate])
    down = "model.layers.0.mlp.down_proj.weight_scale"
    assert all(torch.equal(r[down], full[down]) for r in ranks) and full[down].shape[1] == 1

