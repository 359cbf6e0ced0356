"""Block-FP8 linear: the torch reference against exact error bounds of e4m3 rounding, the
Triton GEMM against the reference on the same quantized inputs, and the group quantizer.

Under the interpreter (CPU), Triton's float32 -> float8e4nv conversion rounds some values just
below a power of two down to the binade below (e.g. 124.3 -> 64 instead of 128), so the
quantizer (and fp8_linear end to end) is compared exactly only on a GPU; on the CPU the GEMM
kernel, whose fp8 tl.dot the interpreter does run, gets the reference's quantized inputs."""

import pytest
import torch

from deltaspec.kernels.fp8 import (FP8, dequantize_reference, fp8_gemm, fp8_linear, fp8_linear_reference,
                                   quantize_groups, quantize_groups_reference)

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


@pytest.mark.parametrize("shape", [(1, 128, 40), (17, 300, 70), (5, 64, 128)])
@pytest.mark.parametrize("group", [32, 128])
def test_fp8_gemm_matches_reference(kernel_device, shape, group):
    num_rows, num_columns, num_features = shape
    x, weight, weight_scale = random_case(*shape, group, seed=num_rows + group)
    x_fp8, x_scale = quantize_groups_reference(x, group)
    expected = dequantize_reference(x_fp8, x_scale, group) @ dequantize_reference(weight, weight_scale, group).T
    to = lambda t: t.to(kernel_device)
    actual = fp8_gemm(to(x_fp8), to(x_scale), to(weight), to(weight_scale), group, torch.float32).cpu()
    # On sm_90 the fp8 dot accumulates in reduced precision (test_fp8_linear_matches_reference_on_gpu).
    tolerance = 2.0 ** -11 if kernel_device == "cuda" else 1e-5
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048, 512), (77, 1000, 300), (512, 4096, 1024)])
def test_fp8_linear_matches_reference_on_gpu(shape, dtype):
    num_rows, num_columns, num_features = shape
    x, weight, weight_scale = random_case(*shape, 128, seed=num_rows)
    x = x.to(dtype)
    x_fp8, x_scale = quantize_groups(x.cuda(), 128)
    ref_fp8, ref_scale = quantize_groups_reference(x, 128)
    assert torch.equal(x_fp8.cpu().float(), ref_fp8.float()) and torch.equal(x_scale.cpu(), ref_scale)
    actual = fp8_linear(x.cuda(), weight.cuda(), weight_scale.cuda(), 128).cpu().float()
    expected = fp8_linear_reference(x, weight, weight_scale, 128).float()
    # sm_90 accumulates an fp8 tl.dot in the tensor cores' reduced precision (Triton's default
    # max_num_imprecise_acc there; about 13 mantissa bits), promoted to float32 once per 128-wide
    # group as DeepGEMM does: errors up to ~2^-11 of the output's scale, far above float32's.
    tolerance = 2.0 ** -11 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
