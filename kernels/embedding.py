"""Token embeddings gathered by id: out[t] = weight[input_ids[t]], one program a token.

torch's indexing does the same in one kernel, but a torch kernel cannot take part in a chain of
programmatic dependent launches (launch.py): it starts only once the kernel before it has
finished, and its successor only once it has. In a 0.8B decode step at batch 1 torch's index
kernel held 4.8 µs of the critical path and this gather 1.5 µs; the graph replays 14 µs faster
(bench/results/pdl_embedding-h200.json). Knows nothing about models.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent_prologue, pdl
from .norms import row_warps


def embedding_reference(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """input_ids [T] -> weight's rows [T, H] (indexing, not F.embedding: for a decode step's few
    ids that is CUDA's index kernel, not index_select's one thread loop over them)."""
    return weight[input_ids]


@triton.jit
def _embedding_kernel(input_ids, weight, out, stride_ids, H: tl.constexpr, BH: tl.constexpr,
                      DEPENDENT_LAUNCH: tl.constexpr):
    """One token's row. The id is widened before it scales: V * H may pass 2^31."""
    dependent_prologue(DEPENDENT_LAUNCH)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BH)
    mask = offs < H
    token = tl.load(input_ids + row * stride_ids).to(tl.int64)
    tl.store(out + row * H + offs, tl.load(weight + token * H + offs, mask=mask), mask=mask)


def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton embedding_reference, one launch: a contiguous [T, H] in weight's dtype. input_ids:
    any 1-D int32 / int64 view; ids must lie in [0, V) (not checked: that would need the host to
    read them)."""
    assert input_ids.dim() == 1 and input_ids.dtype in (torch.int32, torch.int64), "input_ids: [T] int32 or int64"
    assert weight.dim() == 2 and weight.is_contiguous(), "weight: contiguous [V, H]"
    assert input_ids.device == weight.device, "input_ids and weight on one device"
    num_tokens, width = input_ids.shape[0], weight.shape[1]
    out = torch.empty((num_tokens, width), dtype=weight.dtype, device=weight.device)
    if num_tokens:
        block = triton.next_power_of_2(width)
        _embedding_kernel[(num_tokens,)](input_ids, weight, out, input_ids.stride(0), H=width, BH=block,
                                         num_warps=row_warps(block), **pdl(weight.device))
    return out
