"""Official block-FP8 checkpoints: tiny checkpoints of every family in the published layout
(tests/fixtures.py, `fp8=True`) load as stored (fp8 weights + block scales, the kept modules in
bf16), run on the CPU reference within what FP8 activation quantization explains, speculate
losslessly with their MTP layer; quantization methods deltaspec does not run fail at once. The
activation quantizer fused into the ops before the projections changes no logit (both tables)."""

import json
import shutil
from functools import lru_cache

import pytest
import torch

from deltaspec.engine import LLM, ConfigError, EngineConfig, ModelConfig, SamplingParams, WeightLoadError
from deltaspec.engine.core import EngineCore
from deltaspec.engine.quantization import Fp8Config
from deltaspec.kernels.fp8 import FP8, dequantize_reference

from fixtures import GPU_SHAPE, TRITON_TABLE_SHAPE, dequantize_checkpoint
from harness import assert_graphs_decode_as_eager, generate, prompts


@pytest.fixture
def fp8_pair(family, checkpoint, tmp_path_factory):
    """(FP8 checkpoint, the same weights dequantized to float32 as a plain checkpoint)."""
    path = checkpoint(family, fp8=True)
    return path, _dequantized(path, tmp_path_factory.mktemp("dequantized"))


@lru_cache(maxsize=None)
def _dequantized(path, directory):
    return dequantize_checkpoint(path, directory)


def test_fp8_checkpoint_loads_its_weights_as_stored(fp8_pair):
    """Every FP8 projection holds the checkpoint's fp8 values and block scales (repeated over
    rows): dequantized, it is exactly the dequantized checkpoint's weight; everything else is
    equal as loaded. No dequantized copy is kept."""
    fp8_path, plain_path = fp8_pair
    quantized = dict(LLM(fp8_path).model.named_parameters())
    plain = dict(LLM(plain_path).model.named_parameters())
    num_fp8 = 0
    for name, value in plain.items():
        stored = quantized[name]
        if name.endswith("mixer.in_proj.weight") and stored.shape != value.shape:
            # FP8 GDN layers hold b|a (kept in bf16) in a second projection in_proj_ba.
            ba = quantized[name.replace("in_proj", "in_proj_ba")]
            assert torch.equal(ba, value[stored.shape[0]:]), name
            value = value[:stored.shape[0]]
        if stored.dtype == FP8:
            num_fp8 += 1
            scale = quantized[name.removesuffix(".weight") + ".weight_scale" if name.endswith(".weight")
                              else name + "_scale"]
            assert torch.equal(dequantize_reference(stored, scale, 128), value), name
        else:
            assert torch.equal(stored, value), name
    assert num_fp8 > 0 and not any(p.dtype == FP8 for p in plain.values())
    assert set(quantized) - set(plain) == {n for n in quantized if n.endswith(("_scale", "in_proj_ba.weight"))}


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def perturbed_inputs_ops(ops, relative: float, seed: int):
    """`ops` with every projection input (dense and expert GEMMs) multiplied by an independent
    1 + u, |u| <= relative: a noise model of rounding each activation once."""
    from dataclasses import replace
    generator = torch.Generator().manual_seed(seed)

    def noisy(x):
        return x * (1 + relative * (2 * torch.rand(x.shape, generator=generator) - 1))

    return replace(ops, linear=lambda x, w, **fused: ops.linear(noisy(x), w, **fused),
                   moe_experts=lambda x, *args: ops.moe_experts(noisy(x), *args))


def test_fp8_logits_are_within_activation_quantization_error(fp8_pair):
    """The FP8 model differs from the dequantized one only by quantizing each projection's
    input to e4m3 per 128-column group: round to nearest changes an element by at most half
    e4m3's relative step 2^-3, i.e. 2^-4 of it (below the subnormals, where the error is
    smaller than 2^-10 of the group's scale). The bound: twice the logits' error of the
    dequantized model when every projection input gets independent relative noise of up to
    2^-4 (the same size of error, without the rounding's structure), averaged over 3 draws.
    (Tiny random models amplify these errors: MoE routing flips, the gated RMSNorm of
    near-zero GDN outputs; the bound is relative to that, measured on the same model.)"""
    fp8_path, plain_path = fp8_pair
    tokens = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = LLM(plain_path)
    expected = plain.score(tokens)
    fp8_error = relative_rms(LLM(fp8_path).score(tokens), expected)
    noise_errors = []
    base_ops = plain.model.ops
    for seed in range(3):
        _set_ops(plain.model, perturbed_inputs_ops(base_ops, 2 ** -4, seed))
        noise_errors.append(relative_rms(plain.score(tokens), expected))
    bound = 2 * sum(noise_errors) / len(noise_errors)
    assert 0 < fp8_error <= bound, f"FP8 logits' relative RMS error {fp8_error:.3f} > {bound:.3f}"


def _set_ops(model, ops) -> None:
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def test_fp8_greedy_speculation_equals_plain_decoding(family, checkpoint, k=2):
    path = checkpoint(family, fp8=True, mtp_copy_of_last_layer=True)
    batch = prompts(3, seed=20 + k)
    base = generate(EngineCore(EngineConfig(model=path, num_draft_tokens=0)), batch)
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False))
    assert generate(core, batch) == base
    assert core.stats()["spec"]["num_verify_steps"] > 0


def test_modules_to_not_convert_is_honoured(checkpoint):
    path = checkpoint("qwen3_5", fp8=True, fp8_not_converted=("model.layers.3.self_attn.o_proj",),
                      language_model_prefix=True)
    layers = LLM(path).model.layers
    assert layers[3].mixer.o_proj.weight_scale is None and layers[3].mixer.o_proj.weight.dtype == torch.float32
    assert layers[3].mixer.qkv_proj.weight.dtype == FP8 and layers[2].mixer.out_proj.weight.dtype == FP8
    assert layers[2].mixer.in_proj_ba.weight.dtype == torch.float32   # GDN b|a: always unquantized


@pytest.mark.parametrize("method", ["bitsandbytes", "gguf", "hqq", "mxfp4"])
def test_unsupported_quantization_fails_in_one_line_before_loading(checkpoint, tmp_path, method):
    """No weights are copied: the error must come before any tensor file is looked at."""
    source = checkpoint("qwen3_5")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as error:
        LLM(tmp_path)
    message = str(error.value)
    assert "\n" not in message and repr(method) in message and "fp8" in message


def test_unsupported_fp8_variants_are_named():
    with pytest.raises(ConfigError, match="activation_scheme 'static'"):
        Fp8Config.from_dict({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match="per-tensor FP8"):
        Fp8Config.from_dict({"quant_method": "fp8", "activation_scheme": "dynamic"})


def test_fp8_scales_without_quantization_config_say_fp8(checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("qwen3_5", fp8=True), path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"FP8 block scales \(\*\.weight_scale_inv\) but its config.json has "
                                              r"no quantization_config"):
        LLM(path)


def test_which_modules_are_fp8():
    config = Fp8Config(modules_to_not_convert=("model.layers.1", "lm_head", "mtp.layers.0.mlp.gate"))
    assert config.quantizes("model.layers.10.self_attn.o_proj")
    assert not config.quantizes("model.layers.1.self_attn.o_proj")
    assert not config.quantizes("model.layers.4.mlp.gate") and config.quantizes("model.layers.4.mlp.gate_proj")
    assert not config.quantizes("model.layers.0.linear_attn.in_proj_ba") and not config.quantizes("mtp.fc")
    with pytest.raises(ConfigError, match="must all be FP8 or none"):
        Fp8Config(modules_to_not_convert=("k_proj",)).quantizes_all(["a.q_proj", "a.k_proj"])
    parsed = ModelConfig.from_dict({**json.loads(json.dumps(_TINY)), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.language_model.layers.0.mlp.gate"]}})
    assert parsed.quantization.modules_to_not_convert == ("model.layers.0.mlp.gate",)


_TINY = {"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1,
         "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "intermediate_size": 64}


# One GDN and one attention layer (test_model_parity's Triton-table shape) in FP8 blocks of 16 x 16:
# the GDN heads' 16 value columns are whole groups, so every fused kernel runs (gated norm included).


def fused_and_unfused(path, monkeypatch, quantizer: str, tokens: list[int], max_tokens: int,
                      **options) -> list[tuple]:
    """(logits of `tokens`, max_tokens greedy speculative tokens after its first 7, the input
    widths of the standalone quantizer's calls) with the fused activation quantizer on, then off."""
    import deltaspec.kernels.fp8 as fp8
    results = []
    for fuse in ("1", "0"):
        monkeypatch.setenv("DELTASPEC_FUSE_FP8_QUANT", fuse)
        llm = LLM(path, num_draft_tokens=2, adaptive_draft_length=False, **options)
        widths = []
        standalone = getattr(fp8, quantizer)
        with monkeypatch.context() as patch:
            patch.setattr(fp8, quantizer, lambda x, *args, **kwargs: widths.append(x.shape[1]) or
                          standalone(x, *args, **kwargs))
            logits = llm.score(tokens)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            generated = llm.generate([tokens[:7]], params)[0].token_ids
        assert llm.core.stats()["spec"]["num_verify_steps"] > 0
        results.append((logits, generated, set(widths)))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_activation_quantizer_changes_no_logit(checkpoint, monkeypatch, kernel_device, backend):
    """At decode-sized batches (a 24-token prefill is one too) the norms, the gated norm and
    silu_and_mul quantize their outputs for the FP8 projections after them (layers.py): logits and
    greedy speculative tokens equal the unfused model's bit for bit, and the projections'
    own quantizer runs only for o_proj (its input, attention's output, comes plain). The torch
    table runs the references' fusion, the Triton table the kernels (interpreted on the CPU)."""
    if kernel_device == "cuda" and backend == "triton":
        pytest.skip("test_fused_activation_quantizer_on_gpu")
    path = checkpoint("qwen3_5", fp8=True, fp8_block_size=(16, 16), mtp_copy_of_last_layer=True, **TRITON_TABLE_SHAPE)
    tokens = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    quantizer = "quantize_groups" if backend == "triton" else "quantize_groups_reference"
    (logits, generated, widths), (expected_logits, expected, all_widths) = fused_and_unfused(
        path, monkeypatch, quantizer, tokens, 3, device=kernel_device, kernel_backend=backend, enable_cuda_graphs=False)
    assert torch.equal(logits, expected_logits) and generated == expected
    o_proj_width = 4 * 32    # num_attention_heads x head_dim
    assert widths == {o_proj_width} and all_widths == {72, 32, 96, o_proj_width}   # hidden, GDN values, MLP


@pytest.mark.gpu
def test_fused_activation_quantizer_on_gpu(checkpoint, monkeypatch):
    """The GPU kernels at the published group (128) with 128-column GDN heads, in bf16 with the
    decode and speculative CUDA graphs: logits and greedy speculative tokens of the fused model
    equal the unfused one's bit for bit. Prefill graphs off: which buckets an engine captures
    depends on its start-up timings (prefill_graphs.py), and a prefill padded to a bucket rounds
    otherwise than the eager one (other tiles), so on a busy GPU two engines' first tokens could
    differ for that alone (2 of 8 runs sharing one H200 with seven others)."""
    path = checkpoint("qwen3_5", fp8=True, mtp_copy_of_last_layer=True, **{**GPU_SHAPE, "linear_value_head_dim": 128})
    tokens = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    (logits, generated, widths), (expected_logits, expected, _) = fused_and_unfused(
        path, monkeypatch, "quantize_groups", tokens, 32, device="cuda", dtype="bfloat16", enable_prefill_graphs=False)
    assert torch.equal(logits, expected_logits) and generated == expected
    assert widths == {4 * 32}


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_fp8_moe_runs_under_cuda_graphs_and_speculates_losslessly(checkpoint, family):
    """The Triton FP8 experts are graph-safe (harness.assert_graphs_decode_as_eager)."""
    assert_graphs_decode_as_eager(checkpoint(family, fp8=True, mtp_copy_of_last_layer=True, **GPU_SHAPE))
