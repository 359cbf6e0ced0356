"""rms_norm, gated_rms_norm and mtp_input (kernels/norms.py): the torch references against naive
float64 per-row formulas written here, then the Triton kernels against the references.

References. Contracts checked: rms_norm multiplies by (1 + w) and fuses the residual add
(returning the sum as the new residual), in bf16 within one rounding of the float64 value;
gated_rms_norm is norm(x) * w * silu(z) with plain w; mtp_input is, bit for bit, the MTP's
composed ops (the gathered embedding rows and hidden each through rms_norm, then cat).

Triton kernels, with the references as the oracle: x and the gate are strided row views, with
and without the residual, widths that are not a power of two. CPU: the interpreter, fp32.
With `quantize_group` both kernels also return their output's FP8 group quantization: the
values are the unquantized call's, bit for bit, and the fp8 codes and scales are
quantize_groups_reference of those values (decode batches of 1 to 64 rows; partial last groups,
rows narrower than a group, a group spanning heads: the gated norm's unfused fallback), fp32 and fp16.
mtp_input: int32 and int64 ids (strided) hitting the first and last vocabulary rows, a strided
hidden, widths that are not a power of two, fp32 and fp16, into a NaN-poisoned output.
GPU (`gpu` marker): bf16 at model widths (hidden 2048 / 5120, GDN output heads 32 x 128; the
MTP input at the 0.8B's hidden 1024 and vocabulary 248320, and a table past 2^31 values); the
q/k norm's at attention widths: test_rope.py.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.norms import gated_rms_norm, gated_rms_norm_reference, mtp_input, mtp_input_reference, \
    rms_norm, rms_norm_reference
from kernel_helpers import TOLERANCE, assert_close, assert_close_elementwise, assert_quantized, naive_rms, \
    silu


ops = REFERENCE_OPS


# ----------------------------------------------------------------------------------------------
# Torch references vs float64 formulas
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_one_plus_w_with_residual(with_residual):
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, eps = 7, 48, 1e-6
    x = torch.randn(tokens, hidden, generator=gen) * 3
    residual = torch.randn(tokens, hidden, generator=gen) if with_residual else None
    weight = 0.1 * torch.randn(hidden, generator=gen)
    normed, new_residual = ops.rms_norm(x, weight, eps, residual)
    summed = x + residual if with_residual else x
    assert torch.equal(new_residual, summed), "new residual is x + residual, in x's dtype"
    w = weight.tolist()
    for t in range(tokens):
        row = summed[t].double().tolist()
        r = naive_rms(row, eps)
        expected = torch.tensor([row[i] * r * (1.0 + w[i]) for i in range(hidden)], dtype=torch.float64)
        assert_close_elementwise(normed[t], expected, 1e-5, f"token {t}")


def test_rms_norm_without_weight_is_unit_weight():
    """weight None (the norm whose weight a projection holds): x / rms(x), as a zero weight."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 40, generator=gen) * 3
    normed, _ = ops.rms_norm(x, None, 1e-6)
    for t in range(5):
        row = x[t].double().tolist()
        r = naive_rms(row, 1e-6)
        assert_close_elementwise(normed[t], torch.tensor([v * r for v in row], dtype=torch.float64), 1e-5, f"token {t}")


def test_rms_norm_bf16_rounds_once():
    """bf16 in, bf16 out: within one bf16 rounding of the float64 value."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    residual = torch.randn(5, 64, generator=gen).bfloat16()
    weight = (0.1 * torch.randn(64, generator=gen)).bfloat16()
    normed, new_residual = ops.rms_norm(x, weight, 1e-6, residual)
    assert normed.dtype == torch.bfloat16 and new_residual.dtype == torch.bfloat16
    h = new_residual.double()
    expected = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.double())
    assert_close_elementwise(normed, expected, 2 ** -8, "bf16")


def test_gated_rms_norm_plain_w_times_silu_gate():
    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim, eps = 6, 3, 16, 1e-6
    x = torch.randn(tokens, heads, dim, generator=gen)
    gate = torch.randn(tokens, heads, dim, generator=gen) * 2
    weight = 1.0 + 0.1 * torch.randn(dim, generator=gen)
    out = ops.gated_rms_norm(x, gate, weight, eps)
    assert out.shape == x.shape and out.dtype == x.dtype
    w = weight.tolist()
    for t in range(tokens):
        for h in range(heads):  # one value head per row
            row, z = x[t, h].double().tolist(), gate[t, h].double().tolist()
            r = naive_rms(row, eps)
            expected = torch.tensor([row[i] * r * w[i] * silu(z[i]) for i in range(dim)])
            assert_close_elementwise(out[t, h], expected, 1e-5, f"token {t} head {h}")


def test_mtp_input_is_the_composed_norms():
    """What MTP.forward computed before the fused op: gather, each half's rms_norm, cat."""
    ids, table, hidden, w_e, w_h = mtp_input_case("cpu", torch.bfloat16, 48, tokens=6, vocab=30, seed=5)
    x = ops.mtp_input(ids, table, hidden, w_e, w_h, 1e-6)
    embedded, _ = ops.rms_norm(table[ids], w_e, 1e-6)
    normed, _ = ops.rms_norm(hidden, w_h, 1e-6)
    assert x.dtype == torch.bfloat16 and torch.equal(x, torch.cat([embedded, normed], dim=-1))


# ----------------------------------------------------------------------------------------------
# Triton kernels vs the torch references
# ----------------------------------------------------------------------------------------------

def mtp_input_case(device: str, dtype: torch.dtype, hidden: int, tokens: int, vocab: int, seed: int,
                   ids_dtype: torch.dtype = torch.int64):
    """(ids, embedding table, hidden, w_e, w_h): ids a strided [T] view (a column of [T, 2])
    whose first and last entries are the vocabulary's first and last rows; hidden a row-strided
    view."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens, 2), generator=gen)
    ids[0, 0], ids[-1, 0] = 0, vocab - 1
    table = (2 * torch.randn(vocab, hidden, generator=gen)).to(dtype)
    wide = (3 * torch.randn(tokens, hidden + 5, generator=gen)).to(dtype)
    w_e, w_h = ((0.1 * torch.randn(hidden, generator=gen)).to(dtype) for _ in range(2))
    return (ids.to(ids_dtype).to(device)[:, 0], table.to(device), wide.to(device)[:, 5:], w_e.to(device),
            w_h.to(device))


def norm_cases(device: str, dtype: torch.dtype, hidden: int, tokens: int = 5, seed: int = 90):
    gen = torch.Generator().manual_seed(seed)
    wide = (3 * torch.randn(tokens, hidden + 7, generator=gen)).to(dtype).to(device)
    x = wide[:, 7:]  # a strided row view
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    weight = (0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "unit"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [48, 100])
def test_rms_norm(kernel_device, hidden, with_residual, with_weight):
    x, residual, weight = norm_cases(kernel_device, torch.float32, hidden)
    weight = weight if with_weight else None
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual if with_residual else None)
    actual, actual_residual = rms_norm(x, weight, 1e-6, residual if with_residual else None)
    assert_close(actual, expected, TOLERANCE[torch.float32], "normed")
    assert torch.equal(actual_residual, expected_residual), "new residual is x + residual, in x's dtype"


@pytest.mark.parametrize("leading", [(6,), (5, 3)], ids=["2d", "3d"])
def test_gated_rms_norm(kernel_device, leading):
    """gate is a strided view (z of the GDN projection)."""
    gen = torch.Generator().manual_seed(91)
    dim = 24
    x = torch.randn(*leading, dim, generator=gen).to(kernel_device)
    wide = torch.randn(leading[0], dim * (leading[1] if len(leading) > 1 else 1) + 9, generator=gen).to(kernel_device)
    gate = wide[:, 9:].view(*leading, dim)
    weight = torch.randn(dim, generator=gen).to(kernel_device)
    assert_close(gated_rms_norm(x, gate, weight, 1e-6), gated_rms_norm_reference(x, gate, weight, 1e-6),
                 TOLERANCE[torch.float32], "gated norm")


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 96)])
def test_mtp_input(kernel_device, poisoned_empty, tokens, hidden, dtype, ids_dtype):
    ids, table, x, w_e, w_h = mtp_input_case(kernel_device, dtype, hidden, tokens, vocab=37, seed=tokens * hidden,
                                             ids_dtype=ids_dtype)
    actual = poisoned_empty(mtp_input, ids, table, x, w_e, w_h, 1e-6)
    assert actual.dtype == dtype
    assert_close(actual, mtp_input_reference(ids, table, x, w_e, w_h, 1e-6), TOLERANCE[dtype], "mtp_input")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("tokens,hidden,group", [(1, 72, 16), (3, 48, 128), (7, 300, 128), (64, 96, 32)])
def test_rms_norm_quantizes_its_output(kernel_device, poisoned_empty, dtype, with_residual, tokens, hidden, group):
    """48 < 128: the row is narrower than one group; 72, 300: a partial last group; the first
    row's first group all zeros (the scale's floor); the last row's first value a tiny negative
    one, which rounds to -0."""
    x, residual, weight = norm_cases(kernel_device, dtype, hidden, tokens, seed=tokens * hidden)
    x[0, :group] = 0.0
    residual[0, :group] = 0.0
    x[-1, 0], residual[-1, 0] = -1e-7, 0.0
    residual = residual if with_residual else None
    plain, plain_residual = rms_norm(x, weight, 1e-6, residual)
    quantized, new_residual = poisoned_empty(rms_norm, x, weight, 1e-6, residual, quantize_group=group)
    assert torch.equal(quantized.values, plain) and torch.equal(new_residual, plain_residual)
    assert_quantized(quantized, group, f"rms_norm T={tokens} H={hidden}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,heads,dim,group", [(1, 4, 16, 16), (5, 3, 64, 32), (64, 2, 32, 32), (3, 3, 16, 32),
                                                    (2, 3, 24, 8)],
                         ids=["head-one-group", "head-two-groups", "64-rows", "group-spans-heads", "dim-not-pow2"])
def test_gated_rms_norm_quantizes_its_output(kernel_device, poisoned_empty, dtype, tokens, heads, dim, group):
    """Quantized as [T, heads * D] rows (what out_proj reads): in the kernel where a head is whole
    groups, by the standalone quantizer after it otherwise (the last two cases)."""
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    x = torch.randn(tokens, heads, dim, generator=gen).to(dtype).to(kernel_device)
    wide = (2 * torch.randn(tokens, heads * dim + 5, generator=gen)).to(dtype).to(kernel_device)
    gate = wide[:, 5:].view(tokens, heads, dim)
    weight = torch.randn(dim, generator=gen).to(dtype).to(kernel_device)
    plain = gated_rms_norm(x, gate, weight, 1e-6)
    quantized = poisoned_empty(gated_rms_norm, x, gate, weight, 1e-6, quantize_group=group)
    assert torch.equal(quantized.values, plain.view(tokens, heads * dim))
    assert_quantized(quantized, group, f"gated_rms_norm T={tokens} {heads}x{dim}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_norms_quantize_their_output_gpu_bf16(tokens):
    """bf16 at model widths with the published group of 128: hidden 4096 / 5120 (with the
    residual), GDN output heads 32 x 128."""
    for hidden in (4096, 5120):
        x, residual, weight = norm_cases("cuda", torch.bfloat16, hidden, tokens=tokens, seed=tokens)
        quantized, _ = rms_norm(x, weight, 1e-6, residual, quantize_group=128)
        assert torch.equal(quantized.values, rms_norm(x, weight, 1e-6, residual)[0])
        assert_quantized(quantized, 128, f"rms_norm {hidden}")
    gen = torch.Generator().manual_seed(tokens)
    core = torch.randn(tokens, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    z = torch.randn(tokens, 32 * 128 + 64, generator=gen).to(torch.bfloat16).cuda()[:, 64:].view(tokens, 32, 128)
    weight = torch.randn(128, generator=gen).to(torch.bfloat16).cuda()
    quantized = gated_rms_norm(core, z, weight, 1e-6, quantize_group=128)
    # Within one bf16 ulp, not bit-equal: the quantizing variant's reshape can give the compiled
    # kernel another register layout, hence another order of the row's sum of squares (1 float32
    # ulp in rstd, which moves a value across a bf16 rounding boundary now and then; H100, 64 rows).
    torch.testing.assert_close(quantized.values, gated_rms_norm(core, z, weight, 1e-6).view(tokens, -1),
                               rtol=2**-7, atol=0)
    assert_quantized(quantized, 128, "gated_rms_norm")


@pytest.mark.gpu
def test_norms_gpu_bf16():
    """Model widths in bf16: hidden 2048 / 5120, GDN output heads 32 x 128."""
    for hidden in (2048, 5120):
        x, residual, weight = norm_cases("cuda", torch.bfloat16, hidden, tokens=300)
        for res in (None, residual):
            expected, expected_residual = rms_norm_reference(x, weight, 1e-6, res)
            actual, actual_residual = rms_norm(x, weight, 1e-6, res)
            assert_close(actual, expected, TOLERANCE[torch.bfloat16], f"rms_norm {hidden}")
            assert torch.equal(actual_residual, expected_residual)
    gen = torch.Generator().manual_seed(93)
    core = torch.randn(300, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    z = torch.randn(300, 32 * 128 + 64, generator=gen).to(torch.bfloat16).cuda()[:, 64:].view(300, 32, 128)
    weight = torch.randn(128, generator=gen).to(torch.bfloat16).cuda()
    assert_close(gated_rms_norm(core, z, weight, 1e-6), gated_rms_norm_reference(core, z, weight, 1e-6),
                 TOLERANCE[torch.bfloat16], "gated_rms_norm")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_mtp_input_gpu_bf16(tokens):
    """The 0.8B's shape (hidden 1024, vocabulary 248320), and a 27B-wide table whose last row
    starts past 2^31 values (the gather's offsets are int64); ids hit the first and last rows."""
    gen = torch.Generator("cuda").manual_seed(tokens)
    for hidden, vocab in ((1024, 248320), (5120, 2 ** 31 // 5120 + 2)):
        randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").bfloat16()  # noqa: E731
        ids = torch.randint(0, vocab, (tokens,), generator=gen, device="cuda")
        ids[0], ids[-1] = 0, vocab - 1
        args = (ids, randn(vocab, hidden), 3 * randn(tokens, hidden), 0.1 * randn(hidden), 0.1 * randn(hidden), 1e-6)
        assert_close(mtp_input(*args), mtp_input_reference(*args), TOLERANCE[torch.bfloat16], f"mtp_input {hidden}")
