"""A grammar's token mask applied to logits: packed bits in, float32 logits with refused tokens at -inf out.

The mask is llguidance's packed layout: bitmask [N, ceil(V / 32)] int32, token v of row n allowed
iff bit (v % 32) of word bitmask[n, v // 32] is set (two's complement: word -1 allows all 32).
Packed, a row of a 248K vocabulary is 31 KB to copy to the device instead of 248 KB of bools.
`apply_token_bitmask` (Triton) reads each logit and its word once and writes the float32 row (the
sampler's working copy, so the raw logits stay intact for log-probabilities; or in place, where
the working copy exists already: the penalties made it);
`apply_token_bitmask_reference` is its torch oracle. Knows nothing about grammars or requests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] (any float dtype), bitmask [N, ceil(V / 32)] int32 -> float32 [N, V]: a new
    tensor, or out (contiguous float32 [N, V], which may be logits itself: masked in place)."""
    vocab = logits.shape[1]
    columns = torch.arange(vocab, device=logits.device)
    words = bitmask.index_select(1, columns // 32)                                   # [N, V]
    allowed = (words >> (columns % 32).to(torch.int32)) & 1
    masked = logits.float().masked_fill(allowed == 0, float("-inf"))
    return masked if out is None else out.copy_(masked)


@triton.jit
def _apply_token_bitmask_kernel(logits, bitmask, out, stride_logits, stride_bitmask, V, BLOCK: tl.constexpr):
    """Program (row, column tile): out[n, v] = logits[n, v] if bit v of the row's mask else -inf."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < V
    x = tl.load(logits + row * stride_logits + columns, mask=inside, other=0.0).to(tl.float32)
    word = tl.load(bitmask + row * stride_bitmask + columns // 32, mask=inside, other=0)
    allowed = ((word >> (columns % 32)) & 1) != 0
    tl.store(out + row * V + columns, tl.where(allowed, x, float("-inf")), mask=inside)


def _check_apply_token_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [N, V] with unit column stride"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16), f"logits: dtype {logits.dtype}"
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.stride(1) == 1, \
        "bitmask: [N, ceil(V / 32)] int32 with unit column stride"
    assert bitmask.shape == (logits.shape[0], -(-logits.shape[1] // 32)), \
        f"bitmask: shape {tuple(bitmask.shape)} for logits {tuple(logits.shape)}"
    assert bitmask.device == logits.device, "bitmask: on the logits' device"


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton apply_token_bitmask_reference: a new contiguous float32 [N, V], or out (each
    element is read before it is written, by the same program: out may be logits). Grid (N,
    cdiv(V, BLOCK)): shapes only, CUDA-graph safe."""
    _check_apply_token_bitmask_args(logits, bitmask)
    num_rows, vocab = logits.shape
    if out is None:
        out = torch.empty(num_rows, vocab, dtype=torch.float32, device=logits.device)
    assert out.shape == logits.shape and out.dtype == torch.float32 and out.is_contiguous() and \
        out.device == logits.device, "out: contiguous float32 [N, V] on the logits' device"
    if num_rows == 0 or vocab == 0:
        return out
    block = min(2048, triton.next_power_of_2(vocab))
    _apply_token_bitmask_kernel[(num_rows, triton.cdiv(vocab, block))](
        logits, bitmask, out, logits.stride(0), bitmask.stride(0), vocab, BLOCK=block, num_warps=4)
    return out
