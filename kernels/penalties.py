"""Repetition, frequency and presence penalties of whole logit rows, from per-slot statistics, in one pass.

For row p (W consecutive positions of it) with statistics row s = stats[p], token v with output
count c = counts[s, v] and prompt flag q = prompt_mask[s, v] (vLLM's definitions):

    x <- x / r if x > 0 else x * r     where (q or c > 0), r = repetition[p]
    x <- x - f * c - a * [c > 0]       f = frequency[p], a = presence[p]

In a verify row position j also counts the drafts before it as generated: c = counts[s, v] +
#{i < j : drafts[p, i] = v}, so every verified position is penalized as plain decoding would
penalize it once those drafts were accepted.

`penalize_rows` (Triton) reads each logit, count and flag once and writes the logit in place,
adding the drafts' counts in registers (a compare per earlier draft); `penalize_rows_reference`
is its torch oracle (out of place, also the CPU path): a dense pass with the slots' counts,
then a sparse fix of the at most W(W-1)/2 (position, earlier draft) entries. Torch's broadcast
version is a dozen full passes over [P, V] (gathers of the statistics rows, a temporary per
operator). Knows nothing about requests.

`record_tokens` (Triton) folds a step's emitted tokens into the same statistics rows: output
counts, output lengths and the last R tokens, one program per row, one launch where torch takes
a dozen operators (on the engine's thread once per step: it sets the pace of host-bound steps);
`record_tokens_reference` is its oracle.
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
                            repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                            drafts: torch.Tensor | None = None) -> torch.Tensor:
    """logits [P, W, V] float32; counts [S, V] int32 and prompt_mask [S, V] bool, row stats[p]
    of them for row p; repetition, frequency, presence [P] float32; drafts [P, W - 1] int64 (W >
    1: position j counts drafts[p, :j] too). Returns the penalized [P, W, V]."""
    column = lambda values: values[:, None, None]  # noqa: E731
    out = penalize(logits, counts[stats][:, None], prompt_mask[stats][:, None], column(repetition),
                   column(frequency), column(presence))
    width = logits.shape[1]
    if drafts is None or width == 1:
        return out
    # Entries (row, position j, earlier draft i < j) whose count the drafts raise.
    later, earlier = torch.tril_indices(width, width - 1, -1, device=logits.device)  # j > i
    tokens = drafts[:, earlier]                                                      # [P, E]
    row = torch.arange(logits.shape[0], device=logits.device)[:, None].expand_as(tokens)
    position = later[None].expand_as(tokens)
    # count at position j of token t: the slot's count + the drafts before j equal to t
    extra = ((drafts[:, None, :] == tokens[:, :, None])
             & (torch.arange(width - 1, device=logits.device) < later[:, None])).sum(-1)
    slot_stats = stats[:, None].expand_as(tokens)
    out[row, position, tokens] = penalize(logits[row, position, tokens], counts[slot_stats, tokens] + extra,
                                          prompt_mask[slot_stats, tokens], repetition[:, None], frequency[:, None],
                                          presence[:, None])  # duplicates write equal values
    return out


@triton.jit
def _penalize_rows_kernel(logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts, W, V,
                          BLOCK: tl.constexpr, HAS_DRAFTS: tl.constexpr):
    """Program (row p * W + position, column tile): the module docstring's formulas, in place."""
    flat_row = tl.program_id(0).to(tl.int64)
    row = flat_row // W
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < V
    stat = tl.load(stats + row)
    x = tl.load(logits + flat_row * V + columns, mask=inside, other=0.0)
    count = tl.load(counts + stat * V + columns, mask=inside, other=0)
    if HAS_DRAFTS:
        for i in range(0, flat_row - row * W):  # the drafts before this position
            count += (columns == tl.load(drafts + row * (W - 1) + i)).to(tl.int32)
    seen = tl.load(prompt_mask + stat * V + columns, mask=inside, other=0) != 0
    generated = count > 0
    r = tl.load(repetition + row)
    scale = tl.where(seen | generated, r, 1.0)
    # IEEE division, as torch's x / scale (the interpreter and the reference agree bit for bit).
    x = tl.where(x > 0, tl.math.div_rn(x, scale), x * scale)
    x = x - tl.load(frequency + row) * count.to(tl.float32) - tl.load(presence + row) * generated.to(tl.float32)
    tl.store(logits + flat_row * V + columns, x, mask=inside)


def _check_penalize_rows_args(logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts) -> None:
    assert logits.dim() == 3 and logits.dtype == torch.float32 and logits.is_contiguous(), \
        "logits: contiguous float32 [P, W, V]"
    num_rows, width, vocab = logits.shape
    assert counts.dtype == torch.int32 and counts.dim() == 2 and counts.shape[1] == vocab and counts.is_contiguous(), \
        "counts: contiguous int32 [S, V]"
    assert prompt_mask.dtype == torch.bool and prompt_mask.shape == counts.shape and prompt_mask.is_contiguous(), \
        "prompt_mask: contiguous bool [S, V]"
    assert stats.dtype == torch.int64 and stats.shape == (num_rows,), "stats: int64 [P]"
    for name, values in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        assert values.dtype == torch.float32 and values.shape == (num_rows,), f"{name}: float32 [P]"
    assert drafts is None or (drafts.dtype == torch.int64 and drafts.shape == (num_rows, width - 1) and
                              drafts.is_contiguous()), "drafts: contiguous int64 [P, W - 1]"
    assert all(t.device == logits.device for t in (counts, prompt_mask, stats, repetition, frequency, presence)) and \
        (drafts is None or drafts.device == logits.device)


def penalize_rows(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, stats: torch.Tensor,
                  repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                  drafts: torch.Tensor | None = None) -> torch.Tensor:
    """Triton penalize_rows_reference, in place on logits (returned). Grid (P * W,
    cdiv(V, BLOCK)): shapes only, CUDA-graph safe."""
    _check_penalize_rows_args(logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts)
    num_rows, width, vocab = logits.shape
    if num_rows * width == 0 or vocab == 0:
        return logits
    block = min(2048, triton.next_power_of_2(vocab))
    has_drafts = drafts is not None and width > 1
    _penalize_rows_kernel[(num_rows * width, triton.cdiv(vocab, block))](
        logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts if has_drafts else stats, width,
        vocab, BLOCK=block, HAS_DRAFTS=has_drafts, num_warps=4)
    return logits


def record_tokens_reference(counts: torch.Tensor, num_output: torch.Tensor, recent: torch.Tensor, stats: torch.Tensor,
                            tokens: torch.Tensor, num_emitted: torch.Tensor | None = None) -> None:
    """In place: row p's first num_emitted[p] tokens of tokens [P, W] (all W when None) added to
    statistics row s = stats[p]: counts[s] [S, V] int32 (+1 per token), num_output[s] [S] int64
    (+ their number) and recent[s] [S, R] int64 (the last R of recent[s] then those tokens).
    Statistics rows are distinct."""
    width, num_recent = tokens.shape[1], recent.shape[1]
    if num_emitted is None:
        count, valid = torch.full_like(stats, width), torch.ones_like(tokens, dtype=torch.int32)
    else:
        count = num_emitted.long()
        valid = (torch.arange(width, device=tokens.device) < count[:, None]).int()
    # Integer atomics: exact in any order. Row s's token t is flat entry s * V + t.
    counts.view(-1).scatter_add_(0, (stats[:, None] * counts.shape[1] + tokens).reshape(-1), valid.reshape(-1))
    num_output.index_add_(0, stats, count)
    joined = torch.cat([recent[stats], tokens], dim=1)                                   # [P, R + W]
    recent[stats] = joined.gather(1, count[:, None] + torch.arange(num_recent, device=tokens.device))


@triton.jit
def _record_tokens_kernel(counts, num_output, recent, stats, tokens, num_emitted, stride_row, stride_column, V, W,
                          R: tl.constexpr, R_PAD: tl.constexpr, HAS_NUM_EMITTED: tl.constexpr):
    """Program p: record_tokens_reference's update of statistics row stats[p]."""
    p = tl.program_id(0).to(tl.int64)
    stat = tl.load(stats + p)
    if HAS_NUM_EMITTED:
        count = tl.load(num_emitted + p).to(tl.int64)
    else:
        count = tl.full((), W, tl.int64)
    row_tokens = tokens + p * stride_row
    for j in range(0, W):  # a token may repeat within the row: one atomic each
        token = tl.load(row_tokens + j * stride_column)
        tl.atomic_add(counts + stat * V + token, 1, mask=j < count)
    tl.store(num_output + stat, tl.load(num_output + stat) + count)
    # recent[i] <- joined[count + i], joined = (recent row, the W tokens): read all, then write.
    i = tl.arange(0, R_PAD)
    source = count + i
    inside = i < R
    kept = source < R
    old = tl.load(recent + stat * R + source, mask=inside & kept, other=0)
    new = tl.load(row_tokens + (source - R) * stride_column, mask=inside & ~kept, other=0)
    tl.store(recent + stat * R + i, tl.where(kept, old, new), mask=inside)


def _check_record_tokens_args(counts, num_output, recent, stats, tokens, num_emitted) -> None:
    assert counts.dtype == torch.int32 and counts.dim() == 2 and counts.is_contiguous(), \
        "counts: contiguous int32 [S, V]"
    num_stats = counts.shape[0]
    assert num_output.dtype == torch.int64 and num_output.shape == (num_stats,) and num_output.is_contiguous(), \
        "num_output: contiguous int64 [S]"
    assert recent.dtype == torch.int64 and recent.dim() == 2 and recent.shape[0] == num_stats and \
        recent.is_contiguous(), "recent: contiguous int64 [S, R]"
    assert stats.dtype == torch.int64 and stats.dim() == 1 and stats.is_contiguous(), "stats: contiguous int64 [P]"
    assert tokens.dtype == torch.int64 and tokens.dim() == 2 and tokens.shape[0] == stats.shape[0], \
        "tokens: int64 [P, W]"
    assert num_emitted is None or (num_emitted.dtype in (torch.int32, torch.int64) and
                                   num_emitted.shape == stats.shape and num_emitted.is_contiguous()), \
        "num_emitted: contiguous int32 or int64 [P]"
    assert all(t.device == counts.device for t in (num_output, recent, stats, tokens)) and \
        (num_emitted is None or num_emitted.device == counts.device)


def record_tokens(counts: torch.Tensor, num_output: torch.Tensor, recent: torch.Tensor, stats: torch.Tensor,
                  tokens: torch.Tensor, num_emitted: torch.Tensor | None = None) -> None:
    """Triton record_tokens_reference (in place). Grid (P,): shapes only, CUDA-graph safe."""
    _check_record_tokens_args(counts, num_output, recent, stats, tokens, num_emitted)
    num_rows, width = tokens.shape
    if num_rows == 0:
        return
    num_recent = recent.shape[1]
    _record_tokens_kernel[(num_rows,)](
        counts, num_output, recent, stats, tokens, num_emitted if num_emitted is not None else stats,
        tokens.stride(0), tokens.stride(1), counts.shape[1], width, R=num_recent,
        R_PAD=triton.next_power_of_2(max(num_recent, 1)), HAS_NUM_EMITTED=num_emitted is not None, num_warps=1)
