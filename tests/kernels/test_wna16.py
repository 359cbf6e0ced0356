"""Weight-only integer linear layers and experts (kernels/wna16.py): the torch references against
an oracle written here from the layout alone (unpacking, dequantizing, float64 products), then the
Triton kernels against the references on fresh random inputs — the packed GEMM on its skinny
tiles (split-K, the zero point by MMA) and its wide tiles (the zero point per value), the
dequantize-then-cuBLAS path, and the MoE experts on both of moe.py's paths with another rank's
pairs — over 4 and 8 bits, groups of 32, 128 and per-channel (K), symmetric and with zero
points, an act-order perm, and K not a multiple of the group or of the K step. fp32 / fp16 on the
CPU (the interpreter's bf16 tl.dot is wrong), bf16 at real shapes on the GPU, and under CUDA
graphs. Buffers the launchers allocate start as garbage (`poisoned_empty`), outputs given to a
launcher start as NaN."""

import pytest
import torch

from deltaspec.kernels.moe import route_reference
from deltaspec.kernels.tiles import TileConfig
from deltaspec.kernels.wna16 import (dequantize, dequantize_reference, launch_wna16_gemm, pack_reference,
                                     quantize_reference, unpack_reference, wna16_config, wna16_linear,
                                     wna16_linear_reference, wna16_moe_experts, wna16_moe_experts_grouped,
                                     wna16_moe_experts_per_token, wna16_moe_experts_reference)
from kernel_helpers import assert_close

# ----------------------------------------------------------------------------------------------
# The oracle: the layout's definition, nothing of kernels/wna16.py
# ----------------------------------------------------------------------------------------------


def oracle_values(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., K / P] int32 -> [..., K] int64: column k is bits [(k % P) * bits, +bits) of word k // P."""
    words = qweight.to(torch.int64) & 0xFFFFFFFF                      # the word's 32 bits, unsigned
    per_word = 32 // bits
    k = torch.arange(qweight.shape[-1] * per_word)
    return (words[..., k // per_word] >> ((k % per_word) * bits)) & (2 ** bits - 1)


def oracle_weight(qweight, scales, zeros, group_size, bits) -> torch.Tensor:
    """W [..., N, K] float64 = (q - zero) * scale, group k // G."""
    values = oracle_values(qweight, bits).double()
    group = torch.arange(values.shape[-1]) // group_size
    zero = 2.0 ** (bits - 1) if zeros is None else zeros.double()[..., group]
    return (values - zero) * scales.double()[..., group]


def oracle_linear(x, qweight, scales, zeros, perm, group_size, bits) -> torch.Tensor:
    x = x.double() if perm is None else x.double()[:, perm.long()]
    return x @ oracle_weight(qweight, scales, zeros, group_size, bits).T


# ----------------------------------------------------------------------------------------------
# Random cases
# ----------------------------------------------------------------------------------------------

def packed_weight(gen, num_rows, num_columns, group_size, bits, with_zeros, *batch):
    """Random values, scales (fp32) and zero points (uint8 or None) of the layout, packed."""
    num_groups = -(-num_columns // group_size)
    values = torch.randint(0, 2 ** bits, (*batch, num_rows, num_columns), generator=gen)
    scales = (torch.rand(*batch, num_rows, num_groups, generator=gen) + 0.5) / (2 ** bits * num_columns ** 0.5)
    zeros = torch.randint(0, 2 ** bits, (*batch, num_rows, num_groups), generator=gen).to(torch.uint8) \
        if with_zeros else None
    return pack_reference(values, bits), scales, zeros


def linear_case(num_rows, num_features, num_columns, group_size, bits, with_zeros, with_perm, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_rows, num_columns, generator=gen) * 2).to(dtype)
    qweight, scales, zeros = packed_weight(gen, num_features, num_columns, group_size, bits, with_zeros)
    perm = torch.randperm(num_columns, generator=gen).to(torch.int32) if with_perm else None
    return x, qweight, scales, zeros, perm


def on(device, tensors):
    return [None if t is None else t.to(device) for t in tensors]


# fp32 kernels differ from the float32 reference by summation order; fp16 by the output's rounding
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (bits, G, K, zeros, perm, dtype): groups of 32 (K = 296: a partial last group and K step),
# 128 (K = 288: a partial last group), per-channel (K = 296 = G: a ragged last K step)
CASES = [(4, 32, 296, False, False, torch.float32), (4, 128, 288, True, True, torch.float16),
         (4, 296, 296, True, False, torch.float32), (8, 32, 296, True, False, torch.float16),
         (8, 128, 288, False, True, torch.float32), (8, 296, 296, False, False, torch.float16),
         (4, 128, 288, False, False, torch.float32), (4, 32, 296, True, True, torch.float16)]


def case_id(case):
    bits, group, columns, with_zeros, with_perm, dtype = case
    return f"w{bits}-g{'K' if group == columns else group}-{'zeros' if with_zeros else 'sym'}" \
           f"{'-perm' if with_perm else ''}-{str(dtype)[6:]}"


# ----------------------------------------------------------------------------------------------
# References against the oracle
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_pack_and_unpack_follow_the_layout(bits):
    gen = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2 ** bits, (5, 64), generator=gen)
    values[0, :32 // bits] = 2 ** bits - 1                        # a word with its top bit set: negative
    qweight = pack_reference(values, bits)
    assert qweight.dtype == torch.int32 and qweight.shape == (5, 64 * bits // 32) and qweight[0, 0] < 0
    assert torch.equal(oracle_values(qweight, bits), values)
    assert torch.equal(unpack_reference(qweight, bits).long(), values)


@pytest.mark.parametrize("case", CASES[:6], ids=case_id)
def test_dequantize_and_linear_references_match_the_oracle(case):
    bits, group, columns, with_zeros, with_perm, dtype = case
    x, qweight, scales, zeros, perm = linear_case(7, 24, columns, group, bits, with_zeros, with_perm,
                                                  torch.float32, seed=group)
    expected = oracle_weight(qweight, scales, zeros, group, bits)
    actual = dequantize_reference(qweight, scales, zeros, group, bits)
    assert actual.dtype == torch.float32
    assert_close(actual, expected, 1e-7, "W")
    assert_close(wna16_linear_reference(x, qweight, scales, zeros, perm, group, bits),
                 oracle_linear(x, qweight, scales, zeros, perm, group, bits), 1e-6, "y")


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zeros"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_reference_rounds_to_nearest(bits, symmetric):
    """Every weight within half a step (its group's scale) of its dequantized value; zero points
    (where given) and values in range; a group of zeros stays zero."""
    gen = torch.Generator().manual_seed(bits + symmetric)
    weight = torch.randn(3, 2, 96, generator=gen) * torch.rand(3, 2, 1, generator=gen)
    weight[0, 0, :32] = 0.0
    qweight, scales, zeros = quantize_reference(weight, 32, bits, symmetric)
    assert qweight.shape == (3, 2, 96 * bits // 32) and scales.shape == (3, 2, 3) and scales.dtype == torch.float32
    assert (zeros is None) == symmetric and (symmetric or zeros.dtype == torch.uint8)
    dequantized = oracle_weight(qweight, scales, zeros, 32, bits)
    step = scales.double().repeat_interleave(32, -1)
    assert ((dequantized - weight.double()).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (dequantized[0, 0, :32] == 0).all()


# ----------------------------------------------------------------------------------------------
# The linear kernels
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_wna16_linear_matches_reference(kernel_device, poisoned_empty, case):
    """Decode, verify and draft rows (1, 3, 17: the skinny tiles, split-K) through wna16_linear,
    N = 40 (a ragged last tile of W's rows)."""
    bits, group, columns, with_zeros, with_perm, dtype = case
    for num_rows in (1, 3, 17):
        args = linear_case(num_rows, 40, columns, group, bits, with_zeros, with_perm, dtype, seed=num_rows + bits)
        actual = poisoned_empty(wna16_linear, *on(kernel_device, args), group, bits)
        assert actual.dtype == dtype
        assert_close(actual.cpu(), wna16_linear_reference(*args, group, bits), TOLERANCE[dtype], f"{num_rows} rows")


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], CASES[7]], ids=case_id)
def test_prefill_tiles_match_reference(kernel_device, poisoned_empty, case):
    """80 rows through wna16_linear (two m tiles of the interpreter's or the GPU's prefill
    tiles), and through wide tiles that subtract the zero point per value (as the GPU's
    prefill tiles do), split in 2 along K as well."""
    bits, group, columns, with_zeros, with_perm, dtype = case
    args = linear_case(80, 48, columns, group, bits, with_zeros, with_perm, dtype, seed=80 + bits)
    expected = wna16_linear_reference(*args, group, bits)
    assert_close(poisoned_empty(wna16_linear, *on(kernel_device, args), group, bits).cpu(), expected,
                 TOLERANCE[dtype], "wna16_linear")
    for splits in (1, 2):
        y = torch.full((80, 48), float("nan"), dtype=dtype, device=kernel_device)
        config = TileConfig(block_m=64, block_n=32, block_k=32, num_splits=splits, num_warps=4, num_stages=1)
        poisoned_empty(launch_wna16_gemm, y, *on(kernel_device, args), group, bits, config)
        assert_close(y.cpu(), expected, TOLERANCE[dtype], f"wide tiles, {splits} splits")


def test_split_k_counters_are_back_at_zero(kernel_device):
    """A second launch of a split-K shape finds the arrival counters at zero (the same result)."""
    args = on(kernel_device, linear_case(2, 40, 256, 32, 4, True, False, torch.float32, seed=3))
    first = wna16_linear(*args, 32, 4)
    assert torch.equal(wna16_linear(*args, 32, 4), first)


@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5]], ids=case_id)
def test_dequantize_then_cublas_path(kernel_device, poisoned_empty, monkeypatch, case):
    """The Triton dequantizer against the reference (to float32 and to x's dtype), and
    wna16_linear through it (DEQUANT_MIN_ROWS lowered to 17 rows), perm and all."""
    import deltaspec.kernels.wna16 as wna16
    bits, group, columns, with_zeros, with_perm, dtype = case
    args = linear_case(17, 40, columns, group, bits, with_zeros, with_perm, dtype, seed=17)
    x, qweight, scales, zeros, perm = on(kernel_device, args)
    expected = dequantize_reference(*args[1:4], group, bits)
    for out_dtype in (torch.float32, dtype):
        weight = poisoned_empty(dequantize, qweight, scales, zeros, group, bits, out_dtype)
        assert weight.dtype == out_dtype
        assert_close(weight.cpu(), expected.to(out_dtype), 1e-7, str(out_dtype))
    monkeypatch.setattr(wna16, "DEQUANT_MIN_ROWS", 17)
    monkeypatch.setattr(wna16, "launch_wna16_gemm", None)                # a call would raise
    actual = poisoned_empty(wna16_linear, x, qweight, scales, zeros, perm, group, bits)
    assert_close(actual.cpu(), wna16_linear_reference(*args, group, bits), TOLERANCE[dtype], "y")


def test_config_fills_the_gpu_at_decode_shapes(monkeypatch):
    """The GPU's rule (also under the interpreter): decode shapes of the 9B's projections split
    K so that the grid fills a 132-SM GPU; prefill shapes do not split; K steps never straddle
    a group."""
    import deltaspec.kernels.wna16 as wna16
    monkeypatch.setattr(wna16, "INTERPRETED", False)
    monkeypatch.setattr(wna16, "num_sms", lambda device: 132)
    for num_rows in (1, 16, 64):
        for num_features, num_columns in ((4096, 4096), (4096, 12288), (24576, 4096)):
            config = wna16_config(num_rows, num_features, num_columns, 128, torch.device("cpu"))
            grid = -(-num_features // config.block_n) * config.num_splits
            assert grid >= 132 and config.block_k <= 128, (num_rows, num_features, config)
    assert wna16_config(512, 4096, 4096, 128, torch.device("cpu")).num_splits == 1
    assert wna16_config(1, 4096, 4096, 32, torch.device("cpu")).block_k == 32
    assert wna16_config(1, 4096, 4096, 4096, torch.device("cpu")).block_k == 128


# ----------------------------------------------------------------------------------------------
# MoE experts
# ----------------------------------------------------------------------------------------------

def moe_case(tokens, hidden, inter, num_experts, top_k, group, bits, with_zeros, dtype, seed):
    """x, routing (expert 1 never chosen), and packed experts (gate rows first)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * 2).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen) * 2
    logits[:, 1] = -30.0
    weights, experts = route_reference(logits.to(dtype), top_k, True)
    gate_up = packed_weight(gen, 2 * inter, hidden, min(group, hidden), bits, with_zeros, num_experts)
    down = packed_weight(gen, hidden, inter, min(group, inter), bits, with_zeros, num_experts)
    return (x, weights, experts, *gate_up, *down)


def test_moe_reference_is_the_dequantized_mlp():
    """Per token and slot, the oracle's experts in float64, summed with the routing weights;
    another rank's pair (expert id E) left out."""
    x, weights, experts, w_gu, s_gu, z_gu, w_dn, s_dn, z_dn = moe_case(5, 64, 32, 4, 2, 32, 4, True, torch.float32, 3)
    experts[2, 1] = 4
    out = wna16_moe_experts_reference(x, weights, experts, w_gu, s_gu, z_gu, w_dn, s_dn, z_dn, 32, 4)
    for t in range(5):
        expected = torch.zeros(64, dtype=torch.float64)
        for j in range(2):
            e = int(experts[t, j])
            if e >= 4:
                continue
            gate_up = x[t].double() @ oracle_weight(w_gu[e], s_gu[e], z_gu[e], 32, 4).T
            act = torch.nn.functional.silu(gate_up[:32]) * gate_up[32:]
            expected += float(weights[t, j]) * (act @ oracle_weight(w_dn[e], s_dn[e], z_dn[e], 32, 4).T)
        assert_close(out[t], expected, 1e-5, f"token {t}")


MOE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (bits, G, zeros, dtype) at H = 96, I = 64: groups of 32; G = 64: gate/up groups of 64, down per-channel
MOE_CASES = [(4, 32, False, torch.float32), (4, 64, True, torch.float16), (8, 32, True, torch.float32),
             (8, 64, False, torch.float16)]


@pytest.mark.parametrize("case", MOE_CASES,
                         ids=lambda c: f"w{c[0]}-g{c[1]}-{'zeros' if c[2] else 'sym'}-{str(c[3])[6:]}")
def test_wna16_moe_experts_match_reference(kernel_device, poisoned_empty, case):
    """Both paths, whatever moe.py's rule picks, with another rank's pairs (expert id E, about a
    third): 2 tokens per token (top-2 of 6 experts), 21 grouped (some experts over one 16-row
    block); then wna16_moe_experts itself."""
    bits, group, with_zeros, dtype = case
    for tokens, path in ((2, wna16_moe_experts_per_token), (21, wna16_moe_experts_grouped), (2, wna16_moe_experts)):
        x, weights, experts, *packed = moe_case(tokens, 96, 64, 6, 2, group, bits, with_zeros, dtype,
                                                seed=tokens + bits)
        outside = torch.rand(experts.shape, generator=torch.Generator().manual_seed(tokens)) < 0.35
        experts = torch.where(outside, 6, experts)
        expected = wna16_moe_experts_reference(x, weights, experts, *packed, group, bits)
        out = poisoned_empty(path, *on(kernel_device, (x, weights, experts, *packed)), group, bits)
        assert out.dtype == dtype
        assert_close(out.cpu(), expected, MOE_TOLERANCE[dtype], f"{path.__name__}, {tokens} tokens")


# ----------------------------------------------------------------------------------------------
# GPU: bf16 at real shapes, CUDA graphs
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 8, 16, 64, 65, 300, 1024, 2048])
@pytest.mark.parametrize("shape", [(4096, 4096, 128, 4, False, False), (12352, 4096, 128, 4, True, False),
                                   (4096, 12288, 128, 4, True, True), (1024, 2048, 32, 4, False, False),
                                   (4096, 4096, 4096, 8, False, False), (2048, 4096, 128, 8, True, True)],
                         ids=lambda s: f"{s[0]}x{s[1]}-g{s[2]}-w{s[3]}{'-zeros' if s[4] else ''}"
                                       f"{'-perm' if s[5] else ''}")
def test_wna16_linear_matches_reference_on_gpu(shape, num_rows):
    """bf16 x, 9B-like projections: the skinny tiles, the prefill tiles and (from 1024 rows)
    dequantize-then-cuBLAS."""
    num_features, num_columns, group, bits, with_zeros, with_perm = shape
    args = linear_case(num_rows, num_features, num_columns, group, bits, with_zeros, with_perm, torch.bfloat16,
                       seed=num_rows)
    args = on("cuda", args)                        # the reference on the GPU too: float32 math either way
    assert_close(wna16_linear(*args, group, bits), wna16_linear_reference(*args, group, bits),
                 TOLERANCE[torch.bfloat16], f"{num_rows} rows")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_wna16_linear_other_dtypes_on_gpu(dtype):
    for num_rows in (1, 40, 300):
        args = on("cuda", linear_case(num_rows, 1024, 2048, 128, 4, True, True, dtype, seed=num_rows))
        assert_close(wna16_linear(*args, 128, 4), wna16_linear_reference(*args, 128, 4), TOLERANCE[dtype],
                     f"{num_rows} rows")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 8, 64, 700])
@pytest.mark.parametrize("bits", [4, 8])
def test_wna16_moe_experts_qwen_like_shapes(tokens, bits):
    """bf16, 64 experts, top-8, H 1024, I 384 (a partial last group of 128), group 128, zero
    points; a third of the pairs another rank's."""
    x, weights, experts, *packed = moe_case(tokens, 1024, 384, 64, 8, 128, bits, True, torch.bfloat16, seed=tokens)
    experts = torch.where(torch.rand(experts.shape, generator=torch.Generator().manual_seed(1)) < 0.3, 64, experts)
    args = on("cuda", (x, weights, experts, *packed))
    assert_close(wna16_moe_experts(*args, 128, bits), wna16_moe_experts_reference(*args, 128, bits),
                 MOE_TOLERANCE[torch.bfloat16], f"{tokens} tokens")


@pytest.mark.gpu
def test_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs (and, for the experts, new routing): each replay
    equals the eager call (no host sync, launch sizes from shapes only, split-K counters reset)."""
    linear_args = on("cuda", linear_case(4, 4096, 4096, 128, 4, True, True, torch.bfloat16, seed=1))
    moe_args = on("cuda", moe_case(16, 1024, 256, 32, 4, 128, 4, False, torch.bfloat16, seed=2))
    calls = ((lambda: wna16_linear(*linear_args, 128, 4), linear_args, 1),
             (lambda: wna16_moe_experts(*moe_args, 128, 4), moe_args, 3))
    for call, args, num_inputs in calls:
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for seed in (3, 4):
            fresh = on("cuda", linear_case(4, 4096, 4096, 128, 4, True, True, torch.bfloat16, seed=seed)
                       if num_inputs == 1 else moe_case(16, 1024, 256, 32, 4, 128, 4, False, torch.bfloat16, seed=seed))
            for target, source in zip(args[:num_inputs], fresh[:num_inputs]):
                target.copy_(source)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, call()), f"seed {seed}"
