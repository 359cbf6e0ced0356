"""SwiGLU activation of the dense and expert MLPs: silu(gate) * up on a fused [.., 2I] input.

Math in float32, rounded once to the input dtype (as the norms and the fused MoE kernels do).
`silu_and_mul` is the Triton kernel (one launch, where torch takes two per MLP),
`silu_and_mul_reference` its torch oracle. Knows nothing about weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import dependent_prologue, pdl


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate columns first) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


@triton.jit
def _silu_and_mul_kernel(gate_up, out, stride_gate_up, I: tl.constexpr, BLOCK: tl.constexpr,
                         DEPENDENT_LAUNCH: tl.constexpr):
    """Program (token, column tile): out[t, n] = silu(g) * u with g = gate_up[t, n], u = gate_up[t, I + n]."""
    dependent_prologue(DEPENDENT_LAUNCH)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = gate_up + token * stride_gate_up
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + token * I + cols, (g * tl.sigmoid(g) * u).to(out.dtype.element_ty), mask=mask)


def _check_silu_and_mul_args(gate_up: torch.Tensor) -> None:
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up: [T, 2I]"
    assert gate_up.stride(1) == 1, "gate_up: unit column stride"
    assert gate_up.dtype in (torch.float32, torch.bfloat16, torch.float16), f"gate_up: dtype {gate_up.dtype}"


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton silu_and_mul_reference. gate_up [T, 2I] with unit column stride (any row stride);
    returns a contiguous [T, I]. Grid (T, cdiv(I, BLOCK)): shapes only, CUDA-graph safe."""
    _check_silu_and_mul_args(gate_up)
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    # 1024 columns of 4 warps: 8 contiguous elements (16 bytes of bf16) per thread and load.
    block = min(1024, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        gate_up, out, gate_up.stride(0), I=intermediate, BLOCK=block, num_warps=4, **pdl(gate_up.device))
    return out
