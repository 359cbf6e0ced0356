"""Weight-only integer checkpoints (GPTQ, AWQ, compressed-tensors, auto-round): tiny checkpoints
of every family in each tool's published layout (tests/fixtures.py, `wna16=`) load into one
packed layout whose dequantized weights are exactly the fixture's own dequantization (written
apart from the engine), give the dequantized checkpoint's logits (activations are not quantized,
so only summation order differs), and speculate losslessly with their MTP layer; what cannot be
run fails before any tensor is read, in one line."""

import json
import shutil
from functools import lru_cache

import pytest
import torch

from deltaspec.engine import LLM, ConfigError, EngineConfig, ModelConfig, WeightLoadError
from deltaspec.engine.core import EngineCore
from deltaspec.engine.quantization import Wna16Config, quantization_from_dict
from deltaspec.kernels.wna16 import dequantize_reference

from fixtures import GPU_SHAPE, dequantize_checkpoint
from harness import assert_graphs_decode_as_eager, generate, prompts

FORMATS = ["gptq", "gptq_v2", "awq", "compressed-tensors", "auto-round"]


@lru_cache(maxsize=None)
def _dequantized(path, directory):
    return dequantize_checkpoint(path, directory)


def _pair(checkpoint, tmp_path_factory, family: str, **options):
    path = checkpoint(family, **options)
    return path, _dequantized(path, tmp_path_factory.mktemp("dequantized"))


def _dequantized_weight(module, prefix: str = "weight") -> torch.Tensor:
    """A loaded projection's (or expert stack's) weight as float32 in the checkpoint's column order."""
    packed = getattr(module, prefix)
    scale = getattr(module, f"{prefix}_scale")
    zero = getattr(module, f"{prefix}_zero_point")
    group = module.weight_group
    if packed.dim() == 3:
        return torch.stack([dequantize_reference(p, s, None if zero is None else z, group, module.bits)
                            for p, s, z in zip(packed, scale, zero if zero is not None else scale)])
    weight = dequantize_reference(packed, scale, zero, group, module.bits)
    if module.perm is not None:   # stored in act order: back to the checkpoint's columns
        restored = torch.empty_like(weight)
        restored[:, module.perm.long()] = weight
        return restored
    return weight


def _loaded_weights(llm) -> dict[str, torch.Tensor]:
    """Every parameter of the model, packed projections and experts dequantized."""
    from deltaspec.engine.models.layers import Linear, MoEMLP
    weights = {}
    for name, module in llm.model.named_modules():
        if isinstance(module, Linear) and module.is_wna16:
            weights[f"{name}.weight"] = _dequantized_weight(module)
        elif isinstance(module, MoEMLP) and module.bits:
            weights[f"{name}.w_gate_up"] = _dequantized_weight(module, "w_gate_up")
            weights[f"{name}.w_down"] = _dequantized_weight(module, "w_down")
    for name, value in llm.model.named_parameters():
        if value.dtype not in (torch.int32, torch.uint8) and not name.endswith(("_scale", ".g_idx")):
            weights.setdefault(name, value)
    return weights


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_loads_the_weights_it_stores(checkpoint, tmp_path_factory, fmt):
    """Qwen3.5: the packed weights, dequantized, are exactly the fixture's dequantized checkpoint;
    the kept modules (b|a, the MTP layer) load as stored; logits equal the dequantized model's."""
    path, plain_path = _pair(checkpoint, tmp_path_factory, "qwen3_5", wna16=fmt)
    quantized_llm, plain_llm = LLM(path), LLM(plain_path)
    quantized, plain = _loaded_weights(quantized_llm), dict(plain_llm.model.named_parameters())
    in_proj = quantized_llm.model.layers[0].mixer
    assert in_proj.in_proj.is_wna16 and not in_proj.in_proj_ba.is_wna16
    for name, value in quantized.items():
        if name.endswith("in_proj_ba.weight"):
            continue   # compared with its rows of the plain model's in_proj below
        if name.endswith("mixer.in_proj.weight") and value.shape != plain[name].shape:
            ba = quantized[name.replace("in_proj", "in_proj_ba")]
            assert torch.equal(ba, plain[name][value.shape[0]:]), name
            assert torch.equal(value, plain[name][:value.shape[0]]), name
        else:
            assert torch.equal(value, plain[name]), name
    tokens = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.testing.assert_close(quantized_llm.score(tokens), plain_llm.score(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_moe_families_load_their_packed_experts(checkpoint, tmp_path_factory, family, fmt):
    """Experts per expert, the shared expert, and Qwen3-Next's fused in_proj_qkvz (split by key
    head into the flat layout, its packed rows, scales and zero points alike)."""
    path, plain_path = _pair(checkpoint, tmp_path_factory, family, wna16=fmt, wna16_symmetric=False)
    quantized_llm, plain_llm = LLM(path), LLM(plain_path)
    assert any(m.bits for m in quantized_llm.model.modules() if hasattr(m, "w_gate_up"))
    tokens = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(quantized_llm.score(tokens), plain_llm.score(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options", [
    dict(wna16="gptq", wna16_symmetric=False),
    dict(wna16="gptq_v2", wna16_symmetric=False, wna16_bits=8),
    dict(wna16="awq", wna16_symmetric=False),
    dict(wna16="compressed-tensors", wna16_symmetric=False, wna16_group_size=-1),
    dict(wna16="gptq", wna16_act_order=True, wna16_quantize_mtp=True),
], ids=["gptq-asym", "gptq_v2-8bit", "awq", "ct-channel", "gptq-act-order"])
def test_zero_points_bits_groups_and_act_order(checkpoint, tmp_path_factory, options):
    """Asymmetric zeros (GPTQ's zero-minus-one convention and v2's), 8 bits, per-channel groups,
    and act-order, whose columns the loader reorders (and the kernel gathers x by): logits equal
    the dequantized checkpoint's."""
    path, plain_path = _pair(checkpoint, tmp_path_factory, "qwen3_5", **options)
    quantized_llm = LLM(path)
    if options.get("wna16_act_order"):
        projection = quantized_llm.model.layers[0].mixer.in_proj
        assert projection.perm is not None and projection.g_idx is None
    tokens = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(quantized_llm.score(tokens), LLM(plain_path).score(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantize_mtp", [False, True])
def test_wna16_greedy_speculation_equals_plain_decoding(checkpoint, quantize_mtp, k=2):
    path = checkpoint("qwen3_5", wna16="gptq", mtp_copy_of_last_layer=True, wna16_quantize_mtp=quantize_mtp)
    batch = prompts(3, seed=30 + k)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False))
    assert generate(core, batch) == base
    assert core.stats()["spec"]["num_verify_steps"] > 0
    assert core.model.mtp.layers[0].mlp.gate_up.is_wna16 == quantize_mtp


def _with_quantization_config(source, directory, quantization_config):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    return directory


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                       "group_size": 128}, "input_activations": None}}}


@pytest.mark.parametrize("quantization_config, named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "gguf"}, "'gguf'"),
    ({**GPTQ, "bits": 3}, "3 bits"),
    ({**GPTQ, "group_size": 100}, "group_size 100"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({**GPTQ, "lm_head": True}, "quantized lm_head"),
    ({**GPTQ, "dynamic": {r"+:.*down_proj.*": {"bits": 8}}}, "own bits or groups"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}, "version 'gemv'"),
    ({**W4A16, "config_groups": {"group_0": {**W4A16["config_groups"]["group_0"], "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}, "quantizes activations"),
    ({**W4A16, "format": "float-quantized", "config_groups": {"group_0": {
        **W4A16["config_groups"]["group_0"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     "are not supported"),
    ({**W4A16, "format": "marlin-24"}, "marlin-24"),
    ({"quant_method": "auto-round", "bits": 4, "group_size": 128, "packing_format": "auto_round:llm_compressor"},
     "packing_format"),
])
def test_what_cannot_run_fails_in_one_line_before_loading(checkpoint, tmp_path, quantization_config, named):
    """No tensor file is in the directory: the error must come from the config alone."""
    directory = _with_quantization_config(checkpoint("qwen3_5"), tmp_path, quantization_config)
    with pytest.raises(ConfigError) as error:
        LLM(directory)
    message = str(error.value)
    assert "\n" not in message and named in message, message


def test_formats_parse_to_one_config():
    assert quantization_from_dict(GPTQ) == Wna16Config("gptq", 4, 128, True, method="gptq", zeros_minus_one=True)
    assert quantization_from_dict({**GPTQ, "checkpoint_format": "gptq_v2", "desc_act": True, "sym": False}) == \
        Wna16Config("gptq", 4, 128, False, method="gptq", act_order=True)
    assert quantization_from_dict({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
                                   "version": "GEMM", "modules_to_not_convert": ["model.language_model.visual"]}) \
        == Wna16Config("awq", 4, 64, False, method="awq", modules_to_not_convert=("model.visual",))
    channel = {**W4A16, "config_groups": {"group_0": {**W4A16["config_groups"]["group_0"], "weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}}
    assert quantization_from_dict(channel) == Wna16Config("compressed-tensors", 8, -1, True,
                                                          method="compressed-tensors")
    assert quantization_from_dict({"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True,
                                   "packing_format": "auto_round:auto_gptq"}).layout == "gptq"


def test_quantized_modules_come_from_the_tensor_names(checkpoint):
    """Which projections are packed is read from the checkpoint: here the kept MTP layer and
    b|a (which GPTQModel does not list) stay unquantized, the rest is packed."""
    llm = LLM(checkpoint("qwen3_5", wna16="gptq", language_model_prefix=True))
    quantized = llm.model.config.quantization.quantized
    assert "model.layers.0.linear_attn.in_proj_qkv" in quantized and "model.layers.3.self_attn.o_proj" in quantized
    assert not any(m.startswith("mtp.") or m.endswith(("in_proj_a", "in_proj_b")) for m in quantized)
    assert llm.model.layers[3].mixer.o_proj.is_wna16 and not llm.model.mtp.fc.is_wna16


def test_the_start_up_log_names_the_weight_format(checkpoint, caplog):
    with caplog.at_level("INFO", logger="deltaspec"):
        llm = LLM(checkpoint("qwen3_5", wna16="gptq"))
    packed = len(llm.model.config.quantization.quantized)
    assert f"gptq 4-bit weights, groups of 32, symmetric, {packed} projections packed" in caplog.text and packed > 10


def test_packed_weights_without_quantization_config_say_so(checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("qwen3_5", wna16="gptq"), path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"packed integer weights .* no quantization_config"):
        LLM(path)


def test_the_quantization_option_names_the_checkpoints_method(checkpoint):
    """vLLM's --quantization gptq_marlin on a GPTQ checkpoint loads it; another method's name, or
    fp8 (online quantization of an unquantized checkpoint), is refused in one line."""
    path = checkpoint("qwen3_5", wna16="gptq")
    assert LLM(path, quantization="gptq_marlin").model.layers[0].mixer.in_proj.is_wna16
    with pytest.raises(ConfigError, match="names a awq checkpoint, but this checkpoint is gptq"):
        LLM(path, quantization="awq")
    with pytest.raises(ConfigError, match="already gptq"):
        LLM(path, quantization="fp8")


def _canonical(path, rank: int | None = None) -> dict[str, torch.Tensor]:
    """A packed checkpoint's tensors after the loader's stage, whole or rank `rank` of 2's."""
    from deltaspec.engine.sharding import Sharding
    from deltaspec.engine.weights import checkpoint_files, read_tensors
    from deltaspec.engine.wna16_tensors import canonical_stream
    config = ModelConfig.from_file(path)
    sharding = None if rank is None else Sharding(config, rank, 2)
    return dict(canonical_stream(read_tensors(checkpoint_files(path), sharding), config.quantization, sharding))


@pytest.mark.parametrize("family, options", [
    ("qwen3_5", dict(wna16="gptq", wna16_symmetric=False)),
    ("qwen3_5", dict(wna16="awq", wna16_symmetric=False)),
    ("qwen3_next", dict(wna16="compressed-tensors", wna16_symmetric=False)),
    ("qwen3_5_moe", dict(wna16="gptq", wna16_group_size=-1)),
], ids=["gptq", "awq", "ct-next", "gptq-channel-moe"])
def test_rank_slices_of_packed_tensors_concatenate(checkpoint, family, options):
    """tp=2: each rank's packed weights, scales and zero points are its rows (column-parallel
    projections: q|k|v by blocks) or its words and groups (row-parallel: o_proj, out_proj,
    down), cut from the canonical tensors; per-channel scales stay whole."""
    path = checkpoint(family, **options)
    whole, ranks = _canonical(path), [_canonical(path, r) for r in range(2)]
    checked = 0
    for name, tensor in whole.items():
        if tensor.dtype not in (torch.int32, torch.uint8) and not name.endswith(".weight_scale"):
            continue
        parts = [r[name] for r in ranks]
        row_parallel = name.rpartition(".")[0].endswith(("o_proj", "out_proj", "down_proj"))
        if row_parallel and parts[0].shape[1] == tensor.shape[1]:   # one scale a row
            assert all(torch.equal(part, tensor) for part in parts), name
        elif row_parallel:
            assert torch.equal(torch.cat(parts, dim=1), tensor), name
        elif parts[0].shape[0] * 2 == tensor.shape[0] and "in_proj_qkv." not in name:
            assert torch.equal(torch.cat(parts), tensor), name
        checked += 1
    assert checked > 10


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_packed_checkpoint_under_tensor_parallelism_equals_one_device(checkpoint, family):
    """tp=2 over gloo: greedy tokens of a GPTQ checkpoint with zero points equal one device's
    (weight-only quantization: the ranks' partial products only sum in another order)."""
    from test_tensor_parallel import GREEDY, POOLS
    path = checkpoint(family, wna16="gptq", wna16_symmetric=False)
    batch = prompts(2, seed=9)
    with LLM(path, num_draft_tokens=0, **POOLS) as one:
        expected = [o.token_ids for o in one.generate(batch, GREEDY)]
    with LLM(path, tensor_parallel_size=2, num_draft_tokens=0, **POOLS) as llm:
        assert [o.token_ids for o in llm.generate(batch, GREEDY)] == expected


def test_act_order_columns_are_not_split(checkpoint):
    """An act-order projection's groups are spread over all its columns: a row-parallel cut of
    them is refused by name (column-parallel ones are cut by rows and load)."""
    from deltaspec.engine.tensor_parallel import TensorParallel
    from deltaspec.engine.weights import load_model
    from deltaspec.kernels import REFERENCE_OPS
    path = checkpoint("qwen3_5", wna16="gptq", wna16_act_order=True)
    with pytest.raises(WeightLoadError, match="splits the columns of an act-order projection"):
        load_model(path, REFERENCE_OPS, torch.float32, "cpu", tp=TensorParallel(1, 2, torch.device("cpu")))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_wna16_runs_under_cuda_graphs_and_speculates_losslessly(checkpoint, family):
    """The Triton WNA16 kernels are graph-safe (harness.assert_graphs_decode_as_eager), and the
    torch table on the same GPU gives the same tokens."""
    path = checkpoint(family, wna16="gptq", wna16_group_size=64, mtp_copy_of_last_layer=True, **GPU_SHAPE)
    batch, expected, params = assert_graphs_decode_as_eager(path)
    reference = LLM(path, device="cuda", dtype="float32", num_draft_tokens=0, kernel_backend="torch",
                    enable_cuda_graphs=False)
    assert [o.token_ids for o in reference.generate(batch, params)] == expected
