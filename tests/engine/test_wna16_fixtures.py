"""The weight-only integer checkpoints of tests/fixtures.py (`make_checkpoint(..., wna16=...)`) are
what each tool publishes: the tensors' names, dtypes and shapes; codes that, unpacked by the code
below (written from the formats' descriptions, apart from fixtures.py's own unpacking), are the
round-to-nearest of the original random weights in their stored groups, scales and zeros; the
config's listing of what stays unquantized; and `dequantize_checkpoint` gives a plain checkpoint
that HF transformers loads, whose weights are (q - z) * s, within one quantization step of the
original ones."""

import json
import re

import pytest
import torch
from safetensors import safe_open

from fixtures import dequantize_checkpoint, make_checkpoint, wna16_shape

# (family, make_checkpoint options): every format, 4 and 8 bits, symmetric and not, groups of 32
# and 64 and per channel, act-order, MTP quantized or kept, on each family where it is cheap.
CASES = [
    ("qwen3_5", dict(wna16="gptq")),
    ("qwen3_5", dict(wna16="gptq", wna16_symmetric=False, wna16_act_order=True)),
    ("qwen3_5", dict(wna16="gptq", wna16_bits=8, wna16_group_size=-1, wna16_quantize_mtp=True)),
    ("qwen3_5", dict(wna16="gptq_v2", wna16_symmetric=False, wna16_bits=8, wna16_group_size=64)),
    ("qwen3_5", dict(wna16="awq", wna16_symmetric=False)),
    ("qwen3_5", dict(wna16="awq", wna16_group_size=-1)),
    ("qwen3_5", dict(wna16="compressed-tensors")),
    ("qwen3_5", dict(wna16="compressed-tensors", wna16_symmetric=False, wna16_bits=8, wna16_group_size=-1)),
    ("qwen3_5", dict(wna16="compressed-tensors", wna16_symmetric=False, wna16_act_order=True, wna16_quantize_mtp=True)),
    ("qwen3_5", dict(wna16="auto-round")),
    ("qwen3_5", dict(wna16="auto-round", wna16_bits=8, wna16_group_size=64, wna16_quantize_mtp=True)),
    ("qwen3_5", dict(wna16="auto-round", wna16_symmetric=False)),
    ("qwen3_5_moe", dict(wna16="gptq", wna16_symmetric=False, wna16_quantize_mtp=True)),
    ("qwen3_5_moe", dict(wna16="compressed-tensors", wna16_act_order=True)),
    ("qwen3_5_moe", dict(wna16="auto-round", wna16_quantize_mtp=True)),
    ("qwen3_next", dict(wna16="gptq_v2", wna16_act_order=True)),
    ("qwen3_next", dict(wna16="awq", wna16_symmetric=False, wna16_quantize_mtp=True)),
    ("qwen3_next", dict(wna16="compressed-tensors", wna16_symmetric=False)),
]
IDS = ["-".join([family, *(str(v) for v in options.values())]) for family, options in CASES]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
RECIPE_KEPT = re.compile(r"(^|\.)(embed_tokens|lm_head|mlp\.gate|shared_expert_gate|in_proj_a|in_proj_b|in_proj_ba)$")


def read_tensors(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def read_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def unpack(words: torch.Tensor, bits: int, dim: int, count: int) -> torch.Tensor:
    """The codes of an int32 tensor packed along `dim`: word i's field j (bits [bits*j, bits*j +
    bits)) is element i * (32 // bits) + j; the first `count` elements."""
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    fields = [(unsigned >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)]
    return torch.stack(fields, dim=dim + 1).flatten(dim, dim + 1).narrow(dim, 0, count)


class Layout:
    """What the config says about the stored codes: bits, group, zeros minus one, packing."""

    def __init__(self, config: dict):
        self.method = config["quant_method"]
        if self.method == "compressed-tensors":
            weights = config["config_groups"]["group_0"]["weights"]
            self.bits, self.group_size = weights["num_bits"], weights["group_size"]
            self.symmetric = weights["symmetric"]
            self.packing = "compressed-tensors"
        else:
            self.bits, self.group_size = config["bits"], config["group_size"]
            self.symmetric = not config["zero_point"] if self.method == "awq" else config["sym"]
            self.packing = {"gptq": "gptq", "awq": "awq"}.get(self.method) or \
                config["packing_format"].removeprefix("auto_round:auto_")
        self.zeros_minus_one = (self.method == "gptq" and config["checkpoint_format"] == "gptq") or \
            config.get("packing_format") == "auto_round:auto_gptq"

    def group(self, columns: int) -> int:
        return columns if self.group_size in (-1, None) else self.group_size


def decode(tensors: dict, module: str, layout: Layout, shape: torch.Size):
    """(codes, zeros, scales) of a packed projection, each [N, K] (zeros, scales per element), the
    codes and zeros unsigned: W = (codes - zeros) * scales."""
    rows, columns = shape
    group = layout.group(columns)
    groups = torch.arange(columns) // group
    if layout.packing == "compressed-tensors":
        codes = unpack(tensors[f"{module}.weight_packed"], layout.bits, 1, columns)      # signed + 2^(b-1)
        zero_name = f"{module}.weight_zero_point"
        zeros = (unpack(tensors[zero_name], layout.bits, 0, rows) if zero_name in tensors
                 else torch.full((rows, columns // group), 1 << (layout.bits - 1)))
        groups = tensors.get(f"{module}.weight_g_idx", groups).long()
        scales = tensors[f"{module}.weight_scale"].float()
        return codes, zeros[:, groups], scales[:, groups]
    scales = tensors[f"{module}.scales"].float()                                            # [G, N]
    if layout.packing == "gptq":
        codes = unpack(tensors[f"{module}.qweight"], layout.bits, 0, columns).T            # packed along K
        zeros = unpack(tensors[f"{module}.qzeros"], layout.bits, 1, rows)                  # packed along N
        zeros = zeros + 1 if layout.zeros_minus_one else zeros
        groups = tensors.get(f"{module}.g_idx", groups).long()
    else:                                                                                    # AWQ: along N, interleaved
        column_of = [8 * (i // 8) + AWQ_ORDER[i % 8] for i in range(rows)]
        codes = torch.empty(columns, rows, dtype=torch.long)
        zeros = torch.empty(columns // group, rows, dtype=torch.long)
        codes[:, column_of] = unpack(tensors[f"{module}.qweight"], layout.bits, 1, rows)
        zeros[:, column_of] = unpack(tensors[f"{module}.qzeros"], layout.bits, 1, rows)
        codes = codes.T
    return codes, zeros[groups].T, scales[groups].T


@pytest.fixture(scope="module")
def made(checkpoint, tmp_path_factory):
    """made(family, options) -> (checkpoint, its dequantized copy, the original weights)."""
    cache = {}

    def build(family: str, options: dict):
        key = (family, tuple(sorted(options.items())))
        if key not in cache:
            path = checkpoint(family, **options)
            shape = {k: v for k, v in options.items() if not k.startswith("wna16") and k != "language_model_prefix"}
            original = read_tensors(checkpoint(family, **{**wna16_shape(family), **shape}))
            cache[key] = (path, dequantize_checkpoint(path, tmp_path_factory.mktemp("dequantized")), original)
        return cache[key]
    return build


def projections(tensors: dict) -> set[str]:
    """The modules stored as plain 2-D weights."""
    return {name.removesuffix(".weight") for name, t in tensors.items() if name.endswith(".weight") and t.dim() == 2}


def packed_modules(tensors: dict) -> list[str]:
    return sorted(name.rpartition(".")[0] for name in tensors if name.endswith((".qweight", ".weight_packed")))


@pytest.mark.parametrize("family, options", CASES, ids=IDS)
def test_tensors_have_the_published_names_dtypes_and_shapes(made, family, options):
    """Each packed projection has exactly its format's tensors (module docstring of fixtures.py);
    act-order g_idx is a permutation of whole groups; every other tensor is in the tool's dtype."""
    path, _, original = made(family, options)
    tensors, config = read_tensors(path), read_config(path)
    layout = Layout(config["quantization_config"])
    bits, act_order = options.get("wna16_bits", 4), options.get("wna16_act_order", False)
    fmt, symmetric = options["wna16"], options.get("wna16_symmetric", True)
    per_word = 32 // bits
    modules = packed_modules(tensors)
    assert any(".experts.0." in m for m in modules) == (family != "qwen3_5")
    assert any(m.startswith("mtp.") for m in modules) == options.get("wna16_quantize_mtp", False)
    assert any("in_proj_qkv" in m for m in modules)      # Qwen3-Next's fused in_proj_qkvz is one module
    for module in modules:
        rows, columns = original[f"{module}.weight"].shape
        num_groups = columns // layout.group(columns)
        stored = {name.removeprefix(f"{module}."): (t.dtype, tuple(t.shape)) for name, t in tensors.items()
                  if name.startswith(f"{module}.")}
        if layout.packing == "gptq":
            expected = {"qweight": (torch.int32, (columns // per_word, rows)),
                        "qzeros": (torch.int32, (num_groups, rows // per_word)),
                        "scales": (torch.float16, (num_groups, rows))}
            if fmt != "auto-round":             # GPTQModel always writes g_idx, auto-round never
                expected["g_idx"] = (torch.int32, (columns,))
        elif layout.packing == "awq":
            expected = {"qweight": (torch.int32, (columns, rows // 8)),
                        "qzeros": (torch.int32, (num_groups, rows // 8)),
                        "scales": (torch.float16, (num_groups, rows))}
        else:
            expected = {"weight_packed": (torch.int32, (rows, -(-columns // per_word))),
                        "weight_scale": (torch.bfloat16, (rows, num_groups)), "weight_shape": (torch.int64, (2,))}
            if not symmetric:
                expected["weight_zero_point"] = (torch.int32, (-(-rows // per_word), num_groups))
            if act_order:
                expected["weight_g_idx"] = (torch.int32, (columns,))
            assert tensors[f"{module}.weight_shape"].tolist() == [rows, columns]
        assert stored == expected, module
        g_idx = tensors.get(f"{module}.g_idx", tensors.get(f"{module}.weight_g_idx"))
        if g_idx is not None:
            plain = torch.arange(columns) // layout.group(columns)
            assert (not torch.equal(g_idx.long(), plain)) == act_order
            assert torch.equal(g_idx.long().bincount(), torch.bincount(plain)), module   # whole groups
    unquantized_dtype = torch.float16 if layout.packing == "awq" else torch.bfloat16
    for name, tensor in tensors.items():
        if name.rpartition(".")[0] not in modules:
            assert tensor.dtype == unquantized_dtype, name


SYMMETRIC_STORED = [(family, options) for family, options in CASES
                    if options.get("wna16_symmetric", True) and options["wna16"] != "compressed-tensors"]


@pytest.mark.parametrize("family, options", SYMMETRIC_STORED, ids=[IDS[CASES.index(case)] for case in SYMMETRIC_STORED])
def test_symmetric_zeros_are_stored_as_each_tool_stores_them(made, family, options):
    """GPTQ v1 (and auto-round's auto_gptq) store the zero 2^(b-1) minus one in every code (4 bits:
    0x77777777), v2 the zero itself; symmetric AWQ stores its 8s. (compressed-tensors stores none.)"""
    path, _, _ = made(family, options)
    tensors, quantization = read_tensors(path), read_config(path)["quantization_config"]
    bits = options.get("wna16_bits", 4)
    zero = (1 << (bits - 1)) - Layout(quantization).zeros_minus_one
    word = sum(zero << (bits * j) for j in range(32 // bits))
    word = word - 2 ** 32 if word >= 2 ** 31 else word            # as int32
    for module in packed_modules(tensors):
        assert (tensors[f"{module}.qzeros"] == word).all(), module


@pytest.mark.parametrize("family, options", CASES, ids=IDS)
def test_codes_are_the_round_to_nearest_and_dequantize_within_one_step(made, family, options):
    """Unpacked here, every code is clamp(round(w / s) + z) of the original weight w in its group
    (compressed-tensors rounds after adding its signed zero point); the dequantized checkpoint holds
    (q - z) * s exactly, within one step |s| of w, and every other tensor as stored. (The tools
    round s to its stored dtype, which can shrink it by half an ulp: then the range spans up to
    (2^b - 1) * ulp / 2 steps more than the codes, and its ends clip by that much: 0.5% of a step
    for fp16 at 4 bits, a whole step for bf16 at 8.)"""
    path, dequantized_path, original = made(family, options)
    tensors, dequantized = read_tensors(path), read_tensors(dequantized_path)
    layout = Layout(read_config(path)["quantization_config"])
    assert "quantization_config" not in read_config(dequantized_path)
    assert set(dequantized) == set(original)
    modules = packed_modules(tensors)
    for module in modules:
        weight = original[f"{module}.weight"]
        codes, zeros, scales = decode(tensors, module, layout, weight.shape)
        if layout.packing == "compressed-tensors":        # round(w / s + signed zero point), stored + 2^(b-1)
            half = 1 << (layout.bits - 1)
            rtn = (torch.round(weight / scales + (zeros - half)) + half).clamp(0, 2 ** layout.bits - 1)
        else:
            rtn = (torch.round(weight / scales) + zeros).clamp(0, 2 ** layout.bits - 1)
        assert torch.equal(codes, rtn.long()), module
        value = (codes - zeros).float() * scales
        assert torch.equal(dequantized[f"{module}.weight"], value), module
        stored_scale = tensors.get(f"{module}.scales", tensors.get(f"{module}.weight_scale"))
        clip = (2 ** layout.bits - 1) * torch.finfo(stored_scale.dtype).eps / 2
        assert ((value - weight).abs() <= (1 + clip) * scales.abs()).all(), module
    for name, tensor in dequantized.items():
        assert tensor.dtype == torch.float32
        if name.removesuffix(".weight") not in modules:
            assert torch.equal(tensor, tensors[name].float()), name


# One HF load per format and family.
HF_CASES = [CASES[i] for i in (0, 3, 4, 7, 9, 11, 12, 14, 15, 16, 17)]


@pytest.mark.parametrize("family, options", HF_CASES, ids=[IDS[CASES.index(case)] for case in HF_CASES])
def test_dequantized_checkpoint_loads_in_hf(made, family, options):
    """Every HF weight is the dequantized checkpoint's (experts per expert), and the logits are O(1)."""
    from transformers import AutoModelForCausalLM
    _, dequantized_path, _ = made(family, options)
    model, info = AutoModelForCausalLM.from_pretrained(dequantized_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(name.startswith("mtp.") for name in info["unexpected_keys"])
    dequantized = read_tensors(dequantized_path)
    for name, value in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):             # [E, 2I, H]: gates then ups
            base = name.removesuffix("gate_up_proj")
            gates, ups = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                assert torch.equal(gates[e], dequantized[f"{base}{e}.gate_proj.weight"]), name
                assert torch.equal(ups[e], dequantized[f"{base}{e}.up_proj.weight"]), name
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(value.shape[0]):
                assert torch.equal(value[e], dequantized[f"{base}{e}.down_proj.weight"]), name
        elif name in dequantized:
            assert torch.equal(value, dequantized[name]), name
        else:
            assert name == "lm_head.weight" and model.config.tie_word_embeddings, name
    with torch.no_grad():
        logits = model(torch.arange(1, 40).unsqueeze(0)).logits
    assert torch.isfinite(logits).all() and 0.3 < logits.std() < 30


def expected_kept(plain: dict, options: dict, packs) -> set[str]:
    """The 2-D projections of the plain checkpoint the recipes keep: the fixed list, the MTP layer
    unless quantized, the caller's, auto-round's mtp.fc, and whatever the layout cannot pack."""
    kept = set()
    for module in projections(plain):
        canonical = module.replace("model.language_model.", "model.")
        if (RECIPE_KEPT.search(module) or canonical in options.get("wna16_kept", ())
                or (canonical.startswith("mtp.") and not options.get("wna16_quantize_mtp", False))
                or (options["wna16"] == "auto-round" and canonical == "mtp.fc")
                or not packs(*plain[f"{module}.weight"].shape)):
            kept.add(module)
    return kept


def packs_rule(fmt: str, bits: int, group_size: int):
    """Whether an [N, K] projection fits: K in whole groups; the packed dimensions in whole words
    (GPTQ packs K and N, AWQ N, compressed-tensors pads); auto-round wants N and K % 32."""
    def packs(rows: int, columns: int) -> bool:
        per_word = 32 // bits
        whole = columns % (columns if group_size == -1 else group_size) == 0
        return whole and {"gptq": rows % per_word == 0 and columns % per_word == 0,
                          "gptq_v2": rows % per_word == 0 and columns % per_word == 0,
                          "awq": rows % 8 == 0, "compressed-tensors": True,
                          "auto-round": rows % 32 == 0 and columns % 32 == 0}[fmt]
    return packs


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors", "auto-round"])
def test_kept_projections_are_listed_as_each_tool_lists_them(made, fmt):
    """Experts of 24 and a shared expert of 40 (which fit no group of 32; its gate and up fit
    GPTQ's, AWQ's and compressed-tensors' packing, not auto-round's), the multimodal prefix, an MTP
    layer kept and o_proj kept by the caller: exactly the expected projections stay plain, and the
    config lists them in the tool's own way."""
    options = dict(wna16=fmt, wna16_symmetric=fmt != "awq", language_model_prefix=True, moe_intermediate_size=24,
                   shared_expert_intermediate_size=40, wna16_kept=("model.layers.3.self_attn.o_proj",))
    path, dequantized_path, original = made("qwen3_5_moe", options)
    tensors, quantization = read_tensors(path), read_config(path)["quantization_config"]
    plain = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: value
             for name, value in original.items()}
    kept = expected_kept(plain, options, packs_rule(fmt, 4, 32))
    assert projections(tensors) == kept
    assert set(packed_modules(tensors)) == projections(plain) - kept
    assert "model.language_model.layers.3.self_attn.o_proj" in kept
    assert any(".shared_expert.gate_proj" in m for m in packed_modules(tensors)) == (fmt != "auto-round")
    assert set(read_tensors(dequantized_path)) == set(plain)
    linear = {m for m in kept if not m.endswith("embed_tokens")}
    if fmt == "gptq":       # GPTQModel: the MTP rule and its own exclusions; the recipe modules unlisted
        listed = {"-:.*mtp.*"} | {f"-:{re.escape(m)}" for m in linear
                                  if not m.startswith("mtp.") and not RECIPE_KEPT.search(m)}
        assert set(quantization["dynamic"]) == listed
        assert all(re.match(rule[2:], "mtp.layers.0.mlp.experts.0.up_proj") for rule in quantization["dynamic"]
                   if "mtp" in rule)
    elif fmt == "awq":
        assert set(quantization["modules_to_not_convert"]) == linear and quantization["zero_point"]
    elif fmt == "compressed-tensors":
        assert set(quantization["ignore"]) == linear
    else:                   # auto-round: bits 16 for each Linear it saw, HF's router (no Linear) and lm_head not
        assert set(quantization["extra_config"]) == {".*mtp.*"} | {
            m for m in linear if m != "lm_head" and not (m.endswith("mlp.gate") and not m.startswith("mtp."))}
        assert all(entry == {"bits": 16, "data_type": "fp"} for entry in quantization["extra_config"].values())
        assert quantization["block_name_to_quantize"] == "model.language_model.layers"


def test_configs_carry_each_tools_fields(made):
    """The fields loaders read, with their published spelling."""
    def config(family, **options):
        return read_config(made(family, options)[0])["quantization_config"]

    gptq = config("qwen3_5", wna16="gptq")
    assert gptq.pop("meta")["quantizer"][0].startswith("gptqmodel:")
    assert gptq == {"bits": 4, "checkpoint_format": "gptq", "desc_act": False, "dynamic": {"-:.*mtp.*": {}},
                    "group_size": 32, "lm_head": False, "pack_dtype": "int32", "quant_method": "gptq", "sym": True}
    gptq_v2 = config("qwen3_5", wna16="gptq_v2", wna16_symmetric=False, wna16_bits=8, wna16_group_size=64)
    assert [gptq_v2[k] for k in ("checkpoint_format", "sym", "bits", "group_size")] == ["gptq_v2", False, 8, 64]
    assert config("qwen3_5", wna16="gptq", wna16_symmetric=False, wna16_act_order=True)["desc_act"] is True
    assert "dynamic" not in config("qwen3_5", wna16="gptq", wna16_bits=8, wna16_group_size=-1, wna16_quantize_mtp=True)
    awq = config("qwen3_5", wna16="awq", wna16_symmetric=False)
    assert {k: v for k, v in awq.items() if k != "modules_to_not_convert"} == {
        "bits": 4, "group_size": 32, "quant_method": "awq", "version": "gemm", "zero_point": True}
    assert config("qwen3_5", wna16="awq", wna16_group_size=-1)["zero_point"] is False
    ct = config("qwen3_5", wna16="compressed-tensors", wna16_symmetric=False, wna16_act_order=True,
                wna16_quantize_mtp=True)
    assert (ct["quant_method"], ct["format"], ct["quantization_status"]) == ("compressed-tensors", "pack-quantized",
                                                                            "compressed")
    (scheme,) = ct["config_groups"].values()
    assert scheme["targets"] == ["Linear"] and scheme["format"] == "pack-quantized"
    assert scheme["input_activations"] is None and scheme["output_activations"] is None
    assert scheme["weights"] | {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
                                "actorder": "group", "zp_dtype": "torch.int8"} == scheme["weights"]
    channel = config("qwen3_5", wna16="compressed-tensors", wna16_symmetric=False, wna16_bits=8, wna16_group_size=-1)
    assert channel["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert channel["config_groups"]["group_0"]["weights"]["group_size"] is None
    auto_round = config("qwen3_5", wna16="auto-round", wna16_bits=8, wna16_group_size=64, wna16_quantize_mtp=True)
    assert {k: auto_round[k] for k in ("quant_method", "packing_format", "bits", "group_size", "sym", "data_type")} == {
        "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 8, "group_size": 64,
        "sym": True, "data_type": "int"}
    assert auto_round["block_name_to_quantize"] == ["model.layers", "mtp.layers"]
    assert auto_round["extra_config"]["mtp.fc"] == {"bits": 16, "data_type": "fp"}
    assert config("qwen3_5", wna16="auto-round", wna16_symmetric=False)["packing_format"] == "auto_round:auto_awq"


def test_auto_round_symmetric_scales_carry_the_larger_sides_sign(made):
    """auto-round's "full range" symmetric RTN: the side of larger magnitude lands on -2^(b-1), so a
    group whose largest value is positive has a negative scale."""
    path, _, original = made("qwen3_5", dict(wna16="auto-round"))
    tensors = read_tensors(path)
    module = "model.layers.0.linear_attn.in_proj_qkv"
    scales = tensors[f"{module}.scales"].float()                            # [G, N]
    groups = original[f"{module}.weight"].unflatten(1, (-1, 32))            # [N, G, 32]
    positive_side_larger = groups.amax(-1) >= -groups.amin(-1)
    assert torch.equal(scales.T < 0, positive_side_larger)


@pytest.mark.parametrize("options, message", [
    (dict(wna16="awq", wna16_bits=8), "4-bit only"),
    (dict(wna16="auto-round", wna16_symmetric=False, wna16_bits=8), "auto_round:auto_awq"),
    (dict(wna16="awq", wna16_act_order=True), "act_order"),
    (dict(wna16="gptq", wna16_act_order=True, wna16_group_size=-1), "act_order"),
    (dict(wna16="gptq", fp8=True), "not both"),
    (dict(wna16="marlin"), "wna16 must be one of"),
])
def test_unpublished_combinations_are_refused(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        make_checkpoint(tmp_path, "qwen3_5", **options)
