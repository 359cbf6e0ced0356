"""The vision encoder against transformers' Qwen3_5VisionModel (random weights, packed images of
different grids, loaded through the checkpoint loader), images isolated from each other in a
batch, and the loader's errors and FP8 dequantization."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from deltaspec.engine import ConfigError, WeightLoadError
from deltaspec.engine.vision.encoder import VisionConfig, load_vision_encoder
from fixtures import dequantize_block_fp8, quantize_block_fp8

TINY = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
            temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=36)
# Against the 6 x 6 position table: rows and columns both down- and up-sampled, non-square
# grids, and an image of two frames (attention within each frame).
GRIDS = [(1, 4, 6), (1, 8, 4), (2, 4, 4)]


def hf_model(seed: int, attn: str = "eager", **overrides) -> Qwen3_5VisionModel:
    """HF's encoder with every parameter random: weights ~ 1/sqrt(fan_in) (activations stay O(1)),
    norm scales around 1, biases and the position table non-zero."""
    config = Qwen3_5VisionConfig(**{**TINY, **overrides})
    config._attn_implementation = attn
    model = Qwen3_5VisionModel(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            elif name == "pos_embed.weight":
                p.copy_(noise)
            elif p.dim() >= 2:
                p.copy_(noise / p[0].numel() ** 0.5)
            else:
                p.copy_(0.2 * noise)
    return model


def tensors_of(model: Qwen3_5VisionModel, prefix: str = "model.visual.") -> dict[str, torch.Tensor]:
    tensors = {prefix + name: t.contiguous() for name, t in model.state_dict().items()}
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(4, 8)  # not the encoder's: skipped
    return tensors


def save(tensors: dict[str, torch.Tensor], directory):
    directory.mkdir(exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    return directory


def config_of(model: Qwen3_5VisionModel) -> VisionConfig:
    return VisionConfig.from_dict(model.config.to_dict())


def patches(grids, config: VisionConfig, seed: int) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, config.patch_dim, generator=torch.Generator().manual_seed(seed))


def hf_output(model, x, grids) -> torch.Tensor:
    with torch.no_grad():
        return model(x, grid_thw=torch.tensor(grids)).pooler_output


@pytest.mark.parametrize("attn, overrides", [
    ("eager", {}),
    # The real patch geometry, erf GELU, another rope base, a 4 x 4 table and 4 heads.
    ("sdpa", dict(patch_size=16, hidden_act="gelu", rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
                  num_position_embeddings=16, num_heads=4)),
])
def test_matches_hf(tmp_path, attn, overrides):
    model = hf_model(1, attn, **overrides)
    config = config_of(model)
    assert config.hidden_act == overrides.get("hidden_act", "gelu_pytorch_tanh")
    encoder = load_vision_encoder(save(tensors_of(model), tmp_path / "ckpt"), config, torch.float32, "cpu")
    x = patches(GRIDS, config, seed=2)
    with torch.no_grad():
        out = encoder(x, GRIDS)
    expected = hf_output(model, x, GRIDS)
    assert out.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_matches_hf(tmp_path):
    model = hf_model(3, "sdpa")   # eager's bf16 matmuls and float32 softmax round differently
    config = config_of(model)
    encoder = load_vision_encoder(save(tensors_of(model), tmp_path / "ckpt"), config, torch.bfloat16, "cpu")
    model.to(torch.bfloat16)
    # Module.to casts HF's float32 rope frequencies to bfloat16 too (from_pretrained keeps them
    # float32); restore them, since the encoder keeps them float32.
    model.rotary_pos_emb.inv_freq = encoder.inv_freq.clone()
    x = patches(GRIDS, config, seed=4)
    with torch.no_grad():
        out = encoder(x, GRIDS)
    expected = hf_output(model, x, GRIDS)
    assert out.dtype == torch.bfloat16
    # The same ops in the same dtypes (float32 rope and table resampling, SDPA): bit-identical on
    # the CPU.
    assert torch.equal(out, expected)


def test_a_videos_patches_encode_as_its_grid(tmp_path):
    """A video of grid (3, h, w) in HF equals its 3 temporal patches as items of grid (1, h, w)
    (how the engine encodes a video), beside an image of the same size and one of another: the
    patches sharing an attention call change nothing."""
    model = hf_model(7, "sdpa")
    config = config_of(model)
    encoder = load_vision_encoder(save(tensors_of(model), tmp_path / "ckpt"), config, torch.float32, "cpu")
    hf_grids = [(1, 4, 6), (3, 4, 6), (1, 8, 4)]
    x = patches(hf_grids, config, seed=8)
    with torch.no_grad():
        out = encoder(x, [(1, 4, 6)] * 4 + [(1, 8, 4)])
    torch.testing.assert_close(out, hf_output(model, x, hf_grids), rtol=1e-5, atol=1e-5)


def test_images_are_isolated(tmp_path):
    model = hf_model(5)
    config = config_of(model)
    encoder = load_vision_encoder(save(tensors_of(model), tmp_path / "ckpt"), config, torch.float32, "cpu")
    x = patches(GRIDS, config, seed=6)
    first, second = 24, 24 + 32          # patch rows of GRIDS[0], GRIDS[1]
    with torch.no_grad():
        batch = encoder(x, GRIDS)
        alone = encoder(x[first:second], GRIDS[1:2])
        other = x.clone()
        other[:first] += 1               # change the images around the middle one
        other[second:] *= -1
        changed = encoder(other, GRIDS)
    torch.testing.assert_close(batch[first // 4:second // 4], alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(changed[first // 4:second // 4], alone, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(changed[:first // 4], batch[:first // 4])


def test_visual_prefix_and_shards(tmp_path):
    model = hf_model(7)
    config = config_of(model)
    x = patches(GRIDS, config, seed=8)
    plain = load_vision_encoder(save(tensors_of(model), tmp_path / "plain"), config, torch.float32, "cpu")
    tensors = tensors_of(model, prefix="visual.")
    directory = tmp_path / "sharded"
    directory.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard in shards.items():
        save_file({n: tensors[n] for n in shard}, directory / file)
    index = {"weight_map": {n: file for file, shard in shards.items() for n in shard}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_vision_encoder(directory, config, torch.float32, "cpu")
    with torch.no_grad():
        assert torch.equal(plain(x, GRIDS), sharded(x, GRIDS))


def test_load_errors_name_every_tensor(tmp_path):
    model = hf_model(9)
    tensors = tensors_of(model)
    del tensors["model.visual.blocks.1.attn.proj.bias"]
    tensors["model.visual.merger.linear_fc2.weight"] = torch.zeros(48, 64)
    tensors["model.visual.patch_embed.proj.weight"] = tensors["model.visual.patch_embed.proj.weight"].flatten(1)
    tensors["model.visual.deepstack_merger_list.0.norm.weight"] = torch.zeros(32)
    tensors["visual.pos_embed.weight"] = tensors["model.visual.pos_embed.weight"].clone()
    with pytest.raises(WeightLoadError) as error:
        load_vision_encoder(save(tensors, tmp_path / "bad"), config_of(model), torch.float32, "cpu")
    message = str(error.value)
    assert "missing tensors (1): blocks.1.attn.proj.bias" in message
    assert "merger.linear_fc2.weight: expected [48, 128], got [48, 64]" in message
    assert "patch_embed.proj.weight: expected [32, 3, 2, 4, 4], got [32, 96]" in message
    assert "unexpected tensors (1): model.visual.deepstack_merger_list.0.norm.weight" in message
    assert "given twice (1): model.visual.pos_embed.weight, visual.pos_embed.weight" in message


def test_a_packed_integer_tower_is_named(tmp_path):
    """A vision tower a GPTQ / AWQ / compressed-tensors tool quantized (its weights as qweight or
    weight_packed) is not loaded: the error says so first and names the way around it."""
    model = hf_model(9)
    tensors = tensors_of(model)
    weight = tensors.pop("model.visual.blocks.0.mlp.linear_fc1.weight")
    tensors["model.visual.blocks.0.mlp.linear_fc1.weight_packed"] = torch.zeros(weight.shape[0], weight.shape[1] // 8,
                                                                                 dtype=torch.int32)
    with pytest.raises(WeightLoadError) as error:
        load_vision_encoder(save(tensors, tmp_path / "packed"), config_of(model), torch.float32, "cpu")
    first_problem = str(error.value).splitlines()[1]
    assert "stored as packed integers" in first_problem and "--language-model-only" in first_problem


@pytest.mark.parametrize("block", [(16, 16), (128, 128)])
def test_fp8_weights_load_dequantized(tmp_path, block):
    model = hf_model(10)
    config = config_of(model)
    tensors = tensors_of(model)
    quantized = {}
    for name in ("blocks.0.mlp.linear_fc1.weight", "blocks.1.attn.qkv.weight", "merger.linear_fc1.weight"):
        weight, scale = quantize_block_fp8(tensors[f"model.visual.{name}"], block)
        tensors[f"model.visual.{name}"] = weight
        tensors[f"model.visual.{name.removesuffix('.weight')}.weight_scale_inv"] = scale
        quantized[name] = dequantize_block_fp8(weight, scale, block).to(torch.bfloat16)
    encoder = load_vision_encoder(save(tensors, tmp_path / "fp8"), config, torch.bfloat16, "cpu", fp8_block=block)
    params = dict(encoder.named_parameters())
    names = encoder.checkpoint_names()
    for name, expected in quantized.items():
        loaded = params[names[name].parameter]
        assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, expected)
    # The FP8 values differ from the originals: the loader did dequantize, not read the originals.
    assert not torch.equal(params[names["merger.linear_fc1.weight"].parameter],
                           model.merger.linear_fc1.weight.to(torch.bfloat16))

    del tensors["model.visual.blocks.1.attn.qkv.weight_scale_inv"]
    tensors["model.visual.merger.linear_fc1.weight_scale_inv"] = torch.ones(3, 3)
    tensors["model.visual.merger.linear_fc2.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(WeightLoadError) as error:
        load_vision_encoder(save(tensors, tmp_path / "bad"), config, torch.bfloat16, "cpu", fp8_block=block)
    message = str(error.value)
    assert "blocks.1.attn.qkv.weight: float8_e4m3fn without a .weight_scale_inv" in message
    assert "merger.linear_fc1.weight_scale_inv: expected" in message
    assert "merger.linear_fc2.weight_scale_inv (the weight is torch.float32" in message


def test_config_from_dict():
    hf = Qwen3_5VisionConfig()
    defaults = VisionConfig.from_dict({})
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings",
                 "hidden_act"):
        assert getattr(defaults, name) == getattr(hf, name), name
    assert defaults.rope_theta == hf.rope_parameters["rope_theta"]
    # A published Qwen3.5 vision_config.
    real = {"deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
            "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5",
            "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 5120, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2}
    c = VisionConfig.from_dict(real)
    assert (c.out_hidden_size, c.head_dim, c.patch_dim, c.grid_side) == (5120, 72, 1536, 48)
    assert VisionConfig.from_dict({"rope_parameters": {"rope_type": "axial", "rope_theta": 50.0}}).rope_theta == 50.0
    # HF reads an old checkpoint's "default" rope as axial, and a top-level rope_theta.
    old = {"rope_parameters": {"rope_type": "default"}, "rope_theta": 70.0}
    assert VisionConfig.from_dict(old).rope_theta == 70.0 == Qwen3_5VisionConfig(**old).rope_parameters["rope_theta"]
    for bad, match in (({"hidden_act": "silu"}, "hidden_act 'silu'"),
                       ({"rope_parameters": {"rope_type": "yarn"}}, "rope_type 'yarn'"),
                       ({"num_position_embeddings": 2300}, "2300 is not a perfect square"),
                       ({"patch_size": [16, 16]}, "patch_size must be a positive int"),
                       ({"hidden_size": 1000}, "not a multiple of num_heads"),
                       ({"deepstack_visual_indexes": [8, 16]}, "deepstack")):
        with pytest.raises(ConfigError, match=match):
            VisionConfig.from_dict(bad)


def test_forward_checks_grids(tmp_path):
    model = hf_model(11)
    config = config_of(model)
    encoder = load_vision_encoder(save(tensors_of(model), tmp_path / "ckpt"), config, torch.float32, "cpu")
    x = patches(GRIDS, config, seed=12)
    with pytest.raises(ValueError, match="hold 88 patches, patches has 87"):
        encoder(x[1:], GRIDS)
    with pytest.raises(ValueError, match="multiples of 2"):
        encoder(x[:12], [(1, 3, 4)])
