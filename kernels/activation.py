"""SwiGLU activation of the dense and expert MLPs: silu(gate) * up on a fused [.., 2I] input.

Math in float32, rounded once to the input dtype (as the norms and the fused MoE kernels do).
`silu_and_mul` is the Triton kernel (one launch, where torch takes two per MLP),
`silu_and_mul_reference` its torch oracle. With `quantize_group` > 0 (the down projection is FP8)
both also return the output's per-token-group FP8 quantization as a QuantizedActivation
(quantize.py), the kernel quantizing its rounded output while it holds it. Knows nothing about
weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import dependent_prologue, pdl
from .quantize import Activation, QuantizedActivation, check_group_size, quantize_activation_reference, \
    quantized_outputs, store_groups


def silu_and_mul_reference(gate_up: torch.Tensor, quantize_group: int = 0) -> Activation:
    """gate_up: [T, 2I] (gate columns first) -> [T, I] (a QuantizedActivation with quantize_group)."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = (F.silu(gate.float()) * up.float()).to(gate_up.dtype)
    return quantize_activation_reference(out, quantize_group) if quantize_group else out


@triton.jit
def _silu_and_mul_kernel(gate_up, out, out_fp8, out_scale, stride_gate_up, I: tl.constexpr, BLOCK: tl.constexpr,
                         GROUP: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (token, column tile): out[t, n] = silu(g) * u with g = gate_up[t, n], u = gate_up[t, I + n].
    GROUP > 0: out (as rounded) also quantized per group of GROUP columns into out_fp8 [T, I] and
    out_scale [T, ceil(I / GROUP)]; the tile (BLOCK, a multiple of GROUP) is whole groups, and
    its columns past I are 0 (silu(0) * 0), as the reference pads the last group."""
    dependent_prologue(DEPENDENT_LAUNCH)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = gate_up + token * stride_gate_up
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g) * u).to(out.dtype.element_ty)
    tl.store(out + token * I + cols, act, mask=mask)
    if GROUP > 0:
        store_groups(act.to(tl.float32), out_fp8 + token * I, out_scale + token * tl.cdiv(I, GROUP),
                     tl.program_id(1) * (BLOCK // GROUP), I, N=BLOCK, GROUP=GROUP)


def _check_silu_and_mul_args(gate_up: torch.Tensor, quantize_group: int) -> None:
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up: [T, 2I]"
    assert gate_up.stride(1) == 1, "gate_up: unit column stride"
    assert gate_up.dtype in (torch.float32, torch.bfloat16, torch.float16), f"gate_up: dtype {gate_up.dtype}"
    check_group_size(quantize_group)


def silu_and_mul(gate_up: torch.Tensor, quantize_group: int = 0) -> Activation:
    """Triton silu_and_mul_reference. gate_up [T, 2I] with unit column stride (any row stride);
    returns a contiguous [T, I] (with quantize_group, and its quantization from the same kernel).
    Grid (T, cdiv(I, BLOCK)): shapes only, CUDA-graph safe."""
    _check_silu_and_mul_args(gate_up, quantize_group)
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    out_fp8, out_scale = quantized_outputs(num_tokens, intermediate, quantize_group, gate_up.device) \
        if quantize_group else (out, out)
    if num_tokens and intermediate:
        # 1024 columns of 4 warps: 8 contiguous elements (16 bytes of bf16) per thread and load;
        # a tile is whole quantization groups.
        block = max(min(1024, triton.next_power_of_2(intermediate)), quantize_group)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
            gate_up, out, out_fp8, out_scale, gate_up.stride(0), I=intermediate, BLOCK=block, GROUP=quantize_group,
            num_warps=4, **pdl(gate_up.device))
    return QuantizedActivation(out, out_fp8, out_scale, quantize_group) if quantize_group else out
