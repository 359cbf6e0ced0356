"""Repetition, frequency and presence penalties of whole logit rows, from per-slot statistics, in one pass.

For row p (W consecutive positions of it) with statistics row s = stats[p], token v with output
count c = counts[s, v] and prompt flag q = prompt_mask[s, v] (vLLM's definitions):

    x <- x / r if x > 0 else x * r     where (q or c > 0), r = repetition[p]
    x <- x - f * c - a * [c > 0]       f = frequency[p], a = presence[p]

`penalize_rows` (Triton) reads each logit, count and flag once and writes the logit in place;
`penalize_rows_reference` is its torch oracle (out of place, also the CPU path). Torch's
broadcast version is a dozen full passes over [P, V] (gathers of the statistics rows, a
temporary per operator). Knows nothing about requests or drafts (engine/penalties.py adds the
drafts' counts afterwards, at the few entries they touch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor,
             frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The penalties of broadcastable tensors: float32 logits, output counts, prompt flags and
    the per-row penalties (the module docstring's formulas)."""
    generated = counts > 0
    scale = torch.where(in_prompt | generated, repetition, 1.0)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    return logits - frequency * counts - presence * generated


def penalize_rows_reference(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, stats: torch.Tensor,
                            repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """logits [P, W, V] float32; counts [S, V] int32 and prompt_mask [S, V] bool, row stats[p]
    of them for row p; repetition, frequency, presence [P] float32. Returns the penalized [P, W, V]."""
    column = lambda values: values[:, None, None]  # noqa: E731
    return penalize(logits, counts[stats][:, None], prompt_mask[stats][:, None], column(repetition),
                    column(frequency), column(presence))


@triton.jit
def _penalize_rows_kernel(logits, counts, prompt_mask, stats, repetition, frequency, presence, W, V,
                          BLOCK: tl.constexpr):
    """Program (row p * W + position, column tile): the module docstring's formulas, in place."""
    flat_row = tl.program_id(0).to(tl.int64)
    row = flat_row // W
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < V
    stat = tl.load(stats + row)
    x = tl.load(logits + flat_row * V + columns, mask=inside, other=0.0)
    count = tl.load(counts + stat * V + columns, mask=inside, other=0)
    seen = tl.load(prompt_mask + stat * V + columns, mask=inside, other=0) != 0
    generated = count > 0
    r = tl.load(repetition + row)
    scale = tl.where(seen | generated, r, 1.0)
    # IEEE division, as torch's x / scale (the interpreter and the reference agree bit for bit).
    x = tl.where(x > 0, tl.math.div_rn(x, scale), x * scale)
    x = x - tl.load(frequency + row) * count.to(tl.float32) - tl.load(presence + row) * generated.to(tl.float32)
    tl.store(logits + flat_row * V + columns, x, mask=inside)


def _check_penalize_rows_args(logits, counts, prompt_mask, stats, repetition, frequency, presence) -> None:
    assert logits.dim() == 3 and logits.dtype == torch.float32 and logits.is_contiguous(), \
        "logits: contiguous float32 [P, W, V]"
    num_rows, vocab = logits.shape[0], logits.shape[2]
    assert counts.dtype == torch.int32 and counts.dim() == 2 and counts.shape[1] == vocab and counts.is_contiguous(), \
        "counts: contiguous int32 [S, V]"
    assert prompt_mask.dtype == torch.bool and prompt_mask.shape == counts.shape and prompt_mask.is_contiguous(), \
        "prompt_mask: contiguous bool [S, V]"
    assert stats.dtype == torch.int64 and stats.shape == (num_rows,), "stats: int64 [P]"
    for name, values in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        assert values.dtype == torch.float32 and values.shape == (num_rows,), f"{name}: float32 [P]"
    assert all(t.device == logits.device for t in (counts, prompt_mask, stats, repetition, frequency, presence))


def penalize_rows(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, stats: torch.Tensor,
                  repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Triton penalize_rows_reference, in place on logits (returned). Grid (P * W,
    cdiv(V, BLOCK)): shapes only, CUDA-graph safe."""
    _check_penalize_rows_args(logits, counts, prompt_mask, stats, repetition, frequency, presence)
    num_rows, width, vocab = logits.shape
    if num_rows * width == 0 or vocab == 0:
        return logits
    block = min(2048, triton.next_power_of_2(vocab))
    _penalize_rows_kernel[(num_rows * width, triton.cdiv(vocab, block))](
        logits, counts, prompt_mask, stats, repetition, frequency, presence, width, vocab, BLOCK=block, num_warps=4)
    return logits
