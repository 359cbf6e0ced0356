"""silu_and_mul, the SwiGLU activation (kernels/activation.py): the torch reference against a
naive float64 formula written here, then the Triton kernel against the reference.

Reference: the gate is the first half of the columns: silu(gate) * up.

Triton kernel, with the reference as the oracle: gate_up as F.linear returns it or as a strided
row view, the output allocated NaN (`torch.empty` poisoned), so an unwritten element fails.
CPU: the interpreter, fp32 and fp16, no rows, one row, several, two column tiles; with
`quantize_group` the same values, bit for bit, and their FP8 group quantization, equal to
quantize_groups_reference of them. GPU (`gpu` marker): bf16 at dense and MoE widths.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.activation import silu_and_mul, silu_and_mul_reference
from kernel_helpers import assert_close, assert_close_elementwise, assert_quantized, silu


ops = REFERENCE_OPS


# ----------------------------------------------------------------------------------------------
# Torch reference vs a float64 formula
# ----------------------------------------------------------------------------------------------

def test_silu_and_mul_gate_columns_first():
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(5, 2 * 12, generator=gen) * 2
    out = ops.silu_and_mul(gate_up)
    rows = gate_up.double().tolist()
    expected = torch.tensor([[silu(r[i]) * r[12 + i] for i in range(12)] for r in rows])
    assert_close_elementwise(out, expected, 1e-6)


# ----------------------------------------------------------------------------------------------
# Triton kernel vs the torch reference
# ----------------------------------------------------------------------------------------------

def check_silu_and_mul(num_tokens: int, intermediate: int, dtype: torch.dtype, device: str, rtol: float,
                       monkeypatch) -> None:
    """gate_up as F.linear returns it or as a strided row view (a wider buffer's columns); the
    output is allocated NaN (torch.empty poisoned), so an unwritten element fails."""
    gen = torch.Generator().manual_seed(num_tokens + intermediate)
    wide = (2 * torch.randn(num_tokens, 2 * intermediate + 11, generator=gen)).to(dtype).to(device)
    for gate_up in (wide[:, 3:3 + 2 * intermediate], wide[:, :2 * intermediate].contiguous()):
        expected = silu_and_mul_reference(gate_up)
        with monkeypatch.context() as patch:
            empty = torch.empty
            patch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan")))
            actual = silu_and_mul(gate_up)
        assert actual.dtype == dtype and actual.is_contiguous()
        assert_close(actual, expected, rtol, f"silu_and_mul T={num_tokens} I={intermediate}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,intermediate", [(0, 24), (1, 40), (6, 24), (2, 1100)],
                         ids=["empty", "decode", "tokens", "two-column-tiles"])
def test_silu_and_mul(kernel_device, monkeypatch, num_tokens, intermediate, dtype):
    """fp16 rounds once (fp32 math), as the reference: they may differ by one fp16 ulp."""
    rtol = {torch.float32: 2e-5, torch.float16: 1e-3}[dtype]
    check_silu_and_mul(num_tokens, intermediate, dtype, kernel_device, rtol, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,intermediate,group", [(1, 40, 16), (6, 1100, 128), (64, 24, 32)],
                         ids=["decode", "two-column-tiles", "narrower-than-a-group"])
def test_silu_and_mul_quantizes_its_output(kernel_device, poisoned_empty, num_tokens, intermediate, group, dtype):
    gen = torch.Generator().manual_seed(num_tokens + intermediate)
    gate_up = (2 * torch.randn(num_tokens, 2 * intermediate + 3, generator=gen)).to(dtype).to(kernel_device)[:, 3:]
    quantized = poisoned_empty(silu_and_mul, gate_up, quantize_group=group)
    assert torch.equal(quantized.values, silu_and_mul(gate_up))
    assert_quantized(quantized, group, f"silu_and_mul T={num_tokens} I={intermediate}")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_silu_and_mul_gpu_bf16(monkeypatch, num_tokens):
    """bf16 at the 0.8B dense width (3584), a wide dense one (12288), the Qwen3-Next expert and
    shared-expert width (512) and one that is no multiple of the tile (1000). The reference rounds
    once from fp32 too, so they agree to a bf16 ulp."""
    for intermediate in (3584, 12288, 512, 1000):
        check_silu_and_mul(num_tokens, intermediate, torch.bfloat16, "cuda", 1e-2, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_silu_and_mul_quantizes_its_output_gpu_bf16(num_tokens):
    """bf16 with the published group of 128 at the 9B dense width (12288), the expert width (512)
    and one that is no multiple of the group (1000)."""
    gen = torch.Generator().manual_seed(num_tokens)
    for intermediate in (12288, 512, 1000):
        gate_up = (2 * torch.randn(num_tokens, 2 * intermediate, generator=gen)).to(torch.bfloat16).cuda()
        quantized = silu_and_mul(gate_up, quantize_group=128)
        assert torch.equal(quantized.values, silu_and_mul(gate_up))
        assert_quantized(quantized, 128, f"silu_and_mul I={intermediate}")
