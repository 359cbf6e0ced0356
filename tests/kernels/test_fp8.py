"""Block-FP8 linear and experts: the torch references against exact error bounds of e4m3
rounding, then the Triton kernels against them on fresh random inputs — the group quantizer
bit-equal (CPU interpreter and GPU), the GEMM on both of its paths (one pass; split-K with the
last-arriver sum) on the reference's quantized inputs, fp8_linear end to end (and given an input
that comes quantized: no quantizer, the same bits), and the grouped
FP8 experts (fp32 / fp16 on the CPU, bf16 at Qwen-like shapes on the GPU, and under a CUDA
graph whose routing changes between replays). Buffers the launchers allocate start as garbage
(`poisoned_empty`)."""

import pytest
import torch

from deltaspec.kernels.fp8 import (FP8, block_scales, dequantize_reference, fp8_gemm, fp8_linear, fp8_linear_reference,
                                   fp8_moe_experts, fp8_moe_experts_reference, launch_fp8_gemm, quantize_blocks,
                                   quantize_groups, quantize_groups_reference)
from deltaspec.kernels.quantize import quantize_activation, quantize_activation_reference
from fixtures import quantize_block_fp8
from deltaspec.kernels.conv1d import ConvDecode, causal_conv1d_decode_reference
from deltaspec.kernels.moe import route_reference
from deltaspec.kernels.tiles import TileConfig
from kernel_helpers import assert_close, assert_slots_untouched, clone, conv_pool, cu_seqlens_of

# Round to nearest in e4m3 (3 mantissa bits): relative error <= 2^-4 for normal values; below
# 2^-6 (in units of the group scale) the spacing is 2^-9, so the absolute error <= 2^-10.
RELATIVE_ROUNDING = 2.0 ** -4
SUBNORMAL_ROUNDING = 2.0 ** -10


def random_case(num_rows, num_columns, num_features, group, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, num_columns, generator=generator) * torch.rand(num_rows, 1, generator=generator) * 4
    weight = (torch.randn(num_features, num_columns, generator=generator) * 100).clamp(-448, 448).to(FP8)
    num_groups = -(-num_columns // group)
    weight_scale = torch.rand(num_features, num_groups, generator=generator) * 1e-2 + 1e-3
    return x, weight, weight_scale


@pytest.mark.parametrize("shape", [(1, 128), (7, 300), (33, 64)])
@pytest.mark.parametrize("group", [32, 128])
def test_quantize_groups_reference_error_bound(shape, group):
    x = random_case(*shape, 1, group, seed=shape[0])[0]
    x[0, : min(group, shape[1])] = 0.0           # an all-zero group must not divide by zero
    x_fp8, x_scale = quantize_groups_reference(x, group)
    assert x_fp8.dtype == FP8 and x_scale.shape == (shape[0], -(-shape[1] // group))
    error = (dequantize_reference(x_fp8, x_scale, group) - x).abs()
    per_column_scale = x_scale.repeat_interleave(group, 1)[:, :shape[1]]
    assert (error <= RELATIVE_ROUNDING * x.abs() + SUBNORMAL_ROUNDING * per_column_scale).all()
    assert (x_fp8.float().abs().amax(-1)[1:] == 448).all()   # each nonzero row's largest group fills the range


@pytest.mark.parametrize("shape", [(1, 200, 70), (9, 128, 256), (40, 96, 33)])
def test_fp8_linear_reference_error_bound(shape):
    """|y - x W^T| <= sum_k (2^-4 |x_k| + 2^-10 s_k) |W_k|: each product's input rounded once."""
    num_rows, num_columns, num_features = shape
    x, weight, weight_scale = random_case(*shape, 128, seed=num_columns)
    w = dequantize_reference(weight, weight_scale, 128).double()
    expected = x.double() @ w.T
    _, x_scale = quantize_groups_reference(x, 128)
    per_column_scale = x_scale.repeat_interleave(128, 1)[:, :num_columns].double()
    bound = (RELATIVE_ROUNDING * x.abs().double() + SUBNORMAL_ROUNDING * per_column_scale) @ w.abs().T
    actual = fp8_linear_reference(x, weight, weight_scale, 128).double()
    assert ((actual - expected).abs() <= bound * (1 + 1e-5) + 1e-6).all()


def test_quantize_blocks_matches_the_checkpoint_generator():
    """The online-FP8 block quantizer against tests/fixtures.py's (the official layout), bit for
    bit, on a batch of experts with partial blocks in both dimensions, in bf16 as checkpoints are."""
    weight = (torch.randn(3, 200, 300, generator=torch.Generator().manual_seed(9)) * 0.05).to(torch.bfloat16)
    values, scale_inv = quantize_blocks(weight, (128, 128))
    assert values.shape == weight.shape and scale_inv.shape == (3, 2, 3)
    for e in range(3):
        expected_values, expected_scale = quantize_block_fp8(weight[e], (128, 128))
        assert torch.equal(values[e].view(torch.uint8), expected_values.view(torch.uint8))
        assert torch.equal(scale_inv[e], expected_scale)


# On sm_90 an fp8 tl.dot accumulates in the tensor cores' reduced precision (Triton's default
# max_num_imprecise_acc there; about 13 mantissa bits), promoted to float32 once per 128-wide
# group as DeepGEMM does: errors up to ~2^-11 of the output's scale, far above float32's.
def gemm_tolerance(device: str) -> float:
    return 2.0 ** -11 if device == "cuda" else 1e-5


@pytest.mark.parametrize("shape", [(1, 2048 // 8, 40), (7, 300, 33), (40, 96, 70)])
@pytest.mark.parametrize("group", [32, 128])
def test_quantize_groups_is_bit_equal_to_reference(kernel_device, poisoned_empty, shape, group):
    x = random_case(*shape, group, seed=shape[0] + group)[0]
    x[0, :16] = 0.0                                    # a zero run; a whole zero group for 16-wide rows
    x[-1, -1] = 124.3 * x[-1].abs().max() / 448       # rounds up into the next binade (128 after scaling)
    x[-1, 0] = -1e-7 * x[-1].abs().max()               # rounds to -0
    x_fp8, x_scale = poisoned_empty(quantize_groups, x.to(kernel_device), group)
    ref_fp8, ref_scale = quantize_groups_reference(x, group)
    assert torch.equal(x_fp8.cpu().view(torch.uint8), ref_fp8.view(torch.uint8)) and torch.equal(x_scale.cpu(), ref_scale)


def test_quantize_groups_column_major_scales(kernel_device):
    """The layout cuBLAS's block-scaled GEMM reads: the same scales, strides (1, M)."""
    x = random_case(37, 300, 1, 128, seed=4)[0]
    _, x_scale = quantize_groups(x.to(kernel_device), 128, scale_column_major=True)
    assert x_scale.shape == (37, 3) and x_scale.stride() == (1, 37)
    assert torch.equal(x_scale.cpu(), quantize_groups_reference(x, 128)[1])


GEMM_CONFIGS = {   # the interpreter's small tiles: one pass, and split-K over 2 or 3 runs of groups
    "one_pass": TileConfig(block_m=16, block_n=32, num_splits=1, num_stages=1),
    "split_2": TileConfig(block_m=16, block_n=32, num_splits=2, num_stages=1),
    "split_3": TileConfig(block_m=16, block_n=16, num_splits=3, num_stages=1),
}


@pytest.mark.parametrize("config", GEMM_CONFIGS)
@pytest.mark.parametrize("shape", [(1, 300, 40), (17, 300, 70), (5, 128, 128)])
def test_fp8_gemm_matches_reference(kernel_device, poisoned_empty, config, shape, group=32):
    """x quantized by the reference (the GEMM alone); 300 columns: a partial last group."""
    num_rows, num_columns, num_features = shape
    x, weight, weight_scale = random_case(*shape, group, seed=num_rows + num_features)
    x_fp8, x_scale = quantize_groups_reference(x, group)
    expected = dequantize_reference(x_fp8, x_scale, group) @ dequantize_reference(weight, weight_scale, group).T
    to = lambda t: t.to(kernel_device)
    y = torch.full((num_rows, num_features), float("nan"), device=kernel_device)
    poisoned_empty(launch_fp8_gemm, y, to(x_fp8), to(x_scale), to(weight), to(weight_scale), group,
                   GEMM_CONFIGS[config])
    tolerance = gemm_tolerance(kernel_device)
    torch.testing.assert_close(y.cpu(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    # a second launch finds the arrival counters back at zero
    again = fp8_gemm(to(x_fp8), to(x_scale), to(weight), to(weight_scale), group, torch.float32)
    torch.testing.assert_close(again.cpu(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_gemm_config_splits_decode_shapes_only(monkeypatch):
    """Decode-shaped GEMMs of a 9B projection split K so the grid fills a 132-SM GPU; prefill
    shapes do not split. (The GPU's rule, also under the interpreter.)"""
    import deltaspec.kernels.fp8 as fp8
    monkeypatch.setattr(fp8, "INTERPRETED", False)
    for rows in (1, 16, 64):
        config = fp8.gemm_config(rows, 4096, 12288 // 128, 132)
        grid = -(-rows // config.block_m) * -(-4096 // config.block_n) * config.num_splits
        assert config.num_splits > 1 and grid >= 132, (rows, config)
    assert fp8.gemm_config(2048, 4096, 32, 132).num_splits == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_linear_matches_reference(kernel_device, dtype):
    """The whole op (quantizer + GEMM) at a decode and a prefill shape."""
    for shape in ((3, 256, 48), (70, 200, 40)):
        x, weight, weight_scale = random_case(*shape, 32, seed=shape[0])
        x = x.to(dtype)
        actual = fp8_linear(x.to(kernel_device), weight.to(kernel_device), weight_scale.to(kernel_device), 32)
        expected = fp8_linear_reference(x, weight, weight_scale, 32)
        assert actual.dtype == dtype
        tolerance = max(gemm_tolerance(kernel_device), 1e-3 if dtype == torch.float16 else 0)
        assert_close(actual.cpu(), expected, tolerance, str(shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 256, 48), (1, 300, 37), (1, 20, 9)], ids=["even", "partial-group", "k-below-group"])
def test_fp8_one_row_form_matches_reference(kernel_device, poisoned_empty, monkeypatch, dtype, shape):
    """One row through the one-row form (fp8_linear takes it; the GEMM would raise): x plain,
    quantized in the kernel, and x quantized by the op before, bit for bit the same; a partial
    last group, N not a multiple of the tile, K below one group."""
    import deltaspec.kernels.fp8 as fp8
    x, weight, weight_scale = random_case(*shape, 32, seed=shape[2])
    x = x.to(dtype)
    expected = fp8_linear_reference(x, weight, weight_scale, 32)
    device_case = [t.to(kernel_device) for t in (x, weight, weight_scale)]
    config = fp8.fp8_gemv_config(shape[2], shape[1], 32, torch.device(kernel_device))
    assert config is not None
    with monkeypatch.context() as patch:
        patch.setattr(fp8, "fp8_gemm", None)            # a call would raise
        actual = poisoned_empty(fp8_linear, *device_case, 32)
        quantized = fp8_linear(quantize_activation(device_case[0], 32), *device_case[1:], 32)
    tolerance = max(gemm_tolerance(kernel_device), 1e-3 if dtype == torch.float16 else 0)
    assert actual.dtype == dtype and torch.equal(actual, quantized)
    assert_close(actual.cpu(), expected, tolerance, str(shape))
    small = TileConfig(block_n=4, block_k=max(32, 1 << (shape[1] - 1).bit_length()), num_warps=1)
    y = torch.full((1, shape[2]), float("nan"), dtype=dtype, device=kernel_device)
    fp8.launch_fp8_gemv(y, *device_case, 32, small)  # 4 rows a program: a ragged last tile
    # Against the reference, not bit for bit against `actual`: on a GPU another tile may sum a
    # row's products in another order.
    assert_close(y.cpu(), expected, tolerance, f"{shape}, 4 rows a program")


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
@pytest.mark.parametrize("rows", [[(1, 7, 3)], [(1, 7, 3), (1, 2, 0)]], ids=["one-row", "two-rows"])
def test_fp8_linear_conv(kernel_device, monkeypatch, rows, commit):
    """conv=ConvDecode through fp8_linear: the GDN's decode conv of the projection's first C = 40
    of N = 56 columns (a 4-row tile of the one-row form straddles C), for a decode row with 3
    pending drafts in the one-row form's own launch (the conv kernel would raise), for two rows
    by the conv kernel after the GEMM. y, the conv outputs, the pending tokens' outputs and the
    slots' windows against causal_conv1d_decode_reference on fp8_linear_reference's output (which
    runs the same conv: fp8_linear_reference(conv=...)); other slots untouched."""
    import deltaspec.kernels.fp8 as fp8
    channels, n, k, max_pending = 40, 56, 64, 4
    lengths, slots = [length for length, _, _ in rows], [slot for _, slot, _ in rows]
    x, weight, weight_scale = random_case(len(rows), k, n, 32, seed=len(rows) + commit)
    gen = torch.Generator().manual_seed(17)
    conv_weight = 0.5 * torch.randn(channels, 4, generator=gen)
    pool = conv_pool(gen, 10, max_pending, channels, 4, "cpu")
    for _, slot, count in rows:
        pool["pending_counts"][slot] = count
    cu, slot_ids = cu_seqlens_of(lengths), torch.tensor(slots, dtype=torch.int32)

    def decode_conv(pool, device):
        nan = float("nan")
        return ConvDecode(conv_weight.to(device), cu.to(device), slot_ids.to(device), pool["conv"], pool["pending_conv"],
                          pool["pending_counts"], commit, torch.full((len(rows), channels), nan, device=device),
                          torch.full((len(rows), max_pending, channels), nan, device=device))

    expected_pool = clone(pool)
    expected_conv = decode_conv(expected_pool, "cpu")
    y_expected = fp8_linear_reference(x, weight, weight_scale, 32, conv=expected_conv)
    out_expected, pending_expected = causal_conv1d_decode_reference(
        y_expected[:, :channels], conv_weight, cu, slot_ids, *(clone(pool)[name] for name in
                                                              ("conv", "pending_conv", "pending_counts")), commit)
    assert_close(expected_conv.out, out_expected, 1e-6, "the reference's conv")
    actual_pool = {name: tensor.to(kernel_device) for name, tensor in pool.items()}
    conv = decode_conv(actual_pool, kernel_device)
    with monkeypatch.context() as patch:
        if len(rows) == 1:
            patch.setattr(fp8, "causal_conv1d_decode", None)     # a call would raise: the conv runs in the launch
        y = fp8_linear(quantize_activation(x.to(kernel_device), 32), weight.to(kernel_device),
                       weight_scale.to(kernel_device), 32, conv=conv)
    tolerance = gemm_tolerance(kernel_device)
    assert_close(y.cpu(), y_expected, tolerance, "y")
    assert_close(conv.out.cpu(), out_expected, tolerance, "conv out")
    for row, slot in enumerate(slots):
        count = int(pool["pending_counts"][slot])
        assert_close(conv.pending_out[row, :count].cpu(), pending_expected[row, :count], tolerance, f"pending of {slot}")
        for name in ("conv", "pending_conv"):
            assert_close(actual_pool[name][slot].cpu(), expected_pool[name][slot], tolerance, f"{name} of {slot}")
    assert_slots_untouched({name: t.cpu() for name, t in actual_pool.items()}, pool, owned=set(slots))


def test_a_quantized_activation_skips_the_quantizer(kernel_device, monkeypatch):
    """fp8_linear and fp8_moe_experts given x with its quantization (a QuantizedActivation, as
    a norm that fused the quantizer returns) launch no quantizer of their own and return bit for
    bit what they return for x; the references too. A projection of another group size refuses it."""
    import deltaspec.kernels.fp8 as fp8
    x, weight, weight_scale = (t.to(kernel_device) for t in random_case(5, 200, 48, 32, seed=8))
    moe_case = [t.to(kernel_device) for t in fp8_moe_case(3, 80, 48, 6, 2, 32, torch.float32, seed=9)]
    plain = fp8_linear(x, weight, weight_scale, 32), fp8_moe_experts(*moe_case, 32)
    quantized = quantize_activation(x, 32), quantize_activation(moe_case[0], 32)
    with monkeypatch.context() as patch:
        patch.setattr(fp8, "quantize_groups", None)      # a call would raise
        assert torch.equal(fp8_linear(quantized[0], weight, weight_scale, 32), plain[0])
        assert torch.equal(fp8_moe_experts(quantized[1], *moe_case[1:], 32), plain[1])
    cpu = [t.cpu() for t in (x, weight, weight_scale)]
    assert torch.equal(fp8_linear_reference(quantize_activation_reference(cpu[0], 32), *cpu[1:], 32),
                       fp8_linear_reference(*cpu, 32))
    with pytest.raises(AssertionError, match="groups of 32"):
        fp8_linear(quantized[0], weight, torch.ones(48, 4, device=kernel_device), 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048, 512), (1, 4096, 12352), (1, 12288, 4096), (16, 4096, 4096),
                                   (77, 1000, 300), (512, 4096, 1024)])
def test_fp8_linear_matches_reference_on_gpu(shape, dtype):
    num_rows, num_columns, num_features = shape
    x, weight, weight_scale = random_case(*shape, 128, seed=num_rows)
    x = x.to(dtype)
    x_fp8, x_scale = quantize_groups(x.cuda(), 128)
    ref_fp8, ref_scale = quantize_groups_reference(x, 128)
    assert torch.equal(x_fp8.cpu().float(), ref_fp8.float()) and torch.equal(x_scale.cpu(), ref_scale)
    actual = fp8_linear(x.cuda(), weight.cuda(), weight_scale.cuda(), 128).cpu().float()
    expected = fp8_linear_reference(x, weight, weight_scale, 128).float()
    tolerance = 2.0 ** -11 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_block_scales_only_for_whole_blocks():
    """Per-row scales that repeat one row per 4-row block (the last block partial) give the block
    scales back; a projection whose parts are not block-aligned gives None."""
    blocks = torch.rand(3, 5) + 0.5
    per_row = blocks.repeat_interleave(4, dim=0)[:10]
    assert torch.equal(block_scales(per_row, 4), blocks)
    shifted = torch.cat([per_row[:1], per_row[:-1]])       # a 1-row part before the blocks
    assert block_scales(shifted, 4) is None


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [65, 300, 2048])
def test_fp8_linear_cublas_prefill_path_matches_reference(num_rows):
    """bf16 batches past 64 rows with whole-block scales take cuBLAS's block-scaled GEMM (sm_90)."""
    gen = torch.Generator().manual_seed(num_rows)
    x = (torch.randn(num_rows, 1024, generator=gen) * 3).to(torch.bfloat16)
    weight = (torch.randn(640, 1024, generator=gen) * 100).clamp(-448, 448).to(FP8)   # 5 row blocks
    blocks = torch.rand(5, 8, generator=gen) * 1e-2 + 1e-3
    per_row = blocks.repeat_interleave(128, dim=0)
    actual = fp8_linear(x.cuda(), weight.cuda(), per_row.cuda(), 128, blocks.cuda()).cpu().float()
    expected = fp8_linear_reference(x, weight, per_row, 128).float()
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


# ----------------------------------------------------------------------------------------------
# Grouped FP8 experts
# ----------------------------------------------------------------------------------------------

def fp8_moe_case(tokens, hidden, inter, num_experts, top_k, group, dtype, seed):
    """x, routing (expert 1 never chosen), and FP8 experts with per-row block scales."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * 2).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen) * 2
    logits[:, 1] = -30.0
    weights, experts = route_reference(logits.to(dtype), top_k, True)

    def fp8_weight(rows, columns):
        values = (torch.randn(num_experts, rows, columns, generator=gen) * 64).clamp(-448, 448).to(FP8)
        scale = (torch.rand(num_experts, rows, -(-columns // group), generator=gen) + 0.5) / (64 * columns ** 0.5)
        return values, scale

    return (x, weights, experts, *fp8_weight(2 * inter, hidden), *fp8_weight(hidden, inter))


def test_fp8_moe_experts_reference_is_the_dequantized_mlp():
    """Independent check of the reference: per token and slot, the dequantized expert MLP on
    quantized inputs, summed with the routing weights (float64)."""
    x, weights, experts, w_gu, s_gu, w_dn, s_dn = fp8_moe_case(5, 64, 32, 4, 2, 32, torch.float32, seed=3)
    out = fp8_moe_experts_reference(x, weights, experts, w_gu, s_gu, w_dn, s_dn, 32)
    for t in range(5):
        expected = torch.zeros(64, dtype=torch.float64)
        for j in range(2):
            e = int(experts[t, j])
            xq, xs = quantize_groups_reference(x[t:t + 1], 32)
            gate_up = dequantize_reference(xq, xs, 32).double() @ dequantize_reference(w_gu[e], s_gu[e], 32).double().T
            gate, up = gate_up[0, :32], gate_up[0, 32:]
            act = (gate * torch.sigmoid(gate) * up).float()[None]
            aq, as_ = quantize_groups_reference(act, 32)
            down = dequantize_reference(aq, as_, 32).double() @ dequantize_reference(w_dn[e], s_dn[e], 32).double().T
            expected += float(weights[t, j]) * down[0]
        assert_close(out[t], expected, 5e-3, f"token {t}")


# An activation whose fp32 sum lands on the other side of an e4m3 rounding boundary than the
# reference's moves by one e4m3 step (2^-4 relative); that is rare and small against the output.
MOE_TOLERANCE = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 21])
def test_fp8_moe_experts_match_reference(kernel_device, poisoned_empty, dtype, tokens):
    """H = 80, I = 48 with groups of 32 (partial groups on both GEMMs), 6 experts (one unused),
    top-2; 21 tokens put some experts over one 16-row block."""
    case = fp8_moe_case(tokens, 80, 48, 6, 2, 32, dtype, seed=tokens)
    out = poisoned_empty(fp8_moe_experts, *[t.to(kernel_device) for t in case], 32)
    expected = fp8_moe_experts_reference(*case, 32)
    assert out.dtype == dtype
    assert_close(out.cpu(), expected, MOE_TOLERANCE[dtype], f"{tokens} tokens")


def test_fp8_moe_experts_skip_other_ranks_pairs(kernel_device, poisoned_empty):
    """Expert parallelism: pairs of experts outside [0, E) contribute nothing (moe.py); the
    reference against itself on this rank's pairs alone, the kernel against the reference."""
    x, weights, experts, *w = fp8_moe_case(21, 80, 48, 6, 2, 32, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    outside = torch.rand(experts.shape, generator=gen) < 0.5
    ranked = torch.where(outside, 6, experts)
    expected = fp8_moe_experts_reference(x, weights, ranked, *w, 32)
    # The same pairs, this rank's only: weight 0 on an expert of its own contributes 0 too.
    assert_close(expected, fp8_moe_experts_reference(x, torch.where(outside, 0.0, weights), experts, *w, 32), 1e-6,
                 "reference")
    out = poisoned_empty(fp8_moe_experts, *[t.to(kernel_device) for t in (x, weights, ranked, *w)], 32)
    assert_close(out.cpu(), expected, MOE_TOLERANCE[torch.float32], "kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 700])
def test_fp8_moe_experts_qwen_like_shapes(tokens):
    """bf16, 64 experts, top-8, H 1024, I 320 (a partial last group of 128), group 128."""
    case = fp8_moe_case(tokens, 1024, 320, 64, 8, 128, torch.bfloat16, seed=tokens)
    out = fp8_moe_experts(*[t.cuda() for t in case], 128)
    assert_close(out.cpu(), fp8_moe_experts_reference(*case, 128), MOE_TOLERANCE[torch.bfloat16], f"{tokens}")


@pytest.mark.gpu
def test_fp8_moe_experts_replay_in_a_cuda_graph():
    """Captured once, replayed with new inputs and new routing: each replay equals the eager
    call (no host sync, launch sizes from shapes only)."""
    case = [t.cuda() for t in fp8_moe_case(16, 512, 256, 32, 4, 128, torch.bfloat16, seed=5)]
    static = [t.clone() for t in case]
    fp8_moe_experts(*static, 128)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_moe_experts(*static, 128)
    for seed in (6, 7):
        fresh = fp8_moe_case(16, 512, 256, 32, 4, 128, torch.bfloat16, seed=seed)
        for target, source in zip(static[:3], fresh[:3]):
            target.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_moe_experts(*static, 128)), f"seed {seed}"
