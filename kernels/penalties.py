"""Repetition, frequency and presence penalties of whole logit rows, from per-slot statistics, in one pass.

For row p (W consecutive positions of it) with statistics row s = stats[p], token v with output
count c = counts[s, v] and prompt flag q = prompt_mask[s, v] (vLLM's definitions):

    x <- x / r if x > 0 else x * r     where (q or c > 0), r = repetition[p]
    x <- x - f * c - a * [c > 0]       f = frequency[p], a = presence[p]

In a verify row position j also counts the drafts before it as generated: c = counts[s, v] +
#{i < j : drafts[p, i] = v}, so every verified position is penalized as plain decoding would
penalize it once those drafts were accepted.

Each row's logit_bias is added first (vLLM's order: bias, then penalties).

`penalize_rows` (Triton) reads each logit (any float dtype), count and flag once and writes the
float32 result, in place or to a separate output (so the penalized rows need no widened copy
first), adding the bias entries that fall in its tile and the drafts' counts in registers (a
compare per earlier draft); a step's penalized rows may be a subset of its rows (`rows`), each
written in its place. `penalize_rows_reference` is its torch oracle (also the CPU path): a
scatter of the bias, a dense pass with the slots' counts, then a sparse fix of the at most
W(W-1)/2 (position, earlier draft) entries. Torch's broadcast
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
                            drafts: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                            bias_tokens: torch.Tensor | None = None, bias_values: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, W, V] (any float dtype) of N rows, P of them penalized: rows [P] int64 (None:
    all, P = N), the p-th with statistics row stats[p] of counts [S, V] int32 and prompt_mask
    [S, V] bool; repetition, frequency, presence [P] float32; drafts [P, W - 1] int64 (W > 1:
    position j counts drafts[p, :j] too); bias_tokens [P, B] int64 and bias_values [P, B] float32:
    each row's logit_bias, added before the penalties (padding (0, 0.0) adds nothing). Writes the
    penalized rows, float32, into out (contiguous float32 [N, W, V], which may be logits itself;
    its other rows are left as they are) and returns it; without out, returns a new float32
    [N, W, V] (the other rows widened)."""
    x = logits.float() if rows is None else logits[rows].float()                      # [P, W, V]
    if bias_tokens is not None:
        shape = (*x.shape[:2], bias_tokens.shape[1])
        x = x.scatter_add(2, bias_tokens[:, None].expand(shape), bias_values[:, None].expand(shape))
    x = _penalized(x, counts, prompt_mask, stats, repetition, frequency, presence, drafts)   # a new tensor
    if out is None and rows is None:
        return x
    target = logits.to(torch.float32, copy=True) if out is None else out
    if rows is None:
        return target.copy_(x)
    target[rows] = x
    return target


def _penalized(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, stats: torch.Tensor,
               repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
               drafts: torch.Tensor | None) -> torch.Tensor:
    """The penalties of float32 logits [P, W, V], row p's from statistics row stats[p] (drafts:
    penalize_rows_reference's); a new tensor."""
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


# W (1 + drafts) and B (the widest logit_bias so far) change with what requests ask for: not
# specialized (Triton would compile again for 1 and multiples of 16), so a warmed-up server does not.
# Nor is the alignment of the per-row vectors: the coefficients are rows of one [3, P] gather, at
# offsets 4P and 8P bytes, 16-byte aligned or not as P is (a compile while serving, found by the
# GPU no-compile test); each program loads one scalar of each.
@triton.jit(do_not_specialize=["W", "B"],
            do_not_specialize_on_alignment=["rows", "stats", "repetition", "frequency", "presence", "drafts",
                                            "bias_tokens", "bias_values"])
def _penalize_rows_kernel(logits, stride_row, stride_position, out, rows, counts, prompt_mask, stats, repetition,
                          frequency, presence, drafts, bias_tokens, bias_values, W, V, B, BLOCK: tl.constexpr,
                          HAS_DRAFTS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program (penalized row p * W + position j, column tile): the module docstring's formulas
    after the row's logit bias, from logits row rows[p] (p without rows) to the same row of out."""
    flat = tl.program_id(0).to(tl.int64)
    p = flat // W
    j = flat - p * W
    if HAS_ROWS:
        n = tl.load(rows + p)
    else:
        n = p
    start = tl.program_id(1) * BLOCK
    columns = start + tl.arange(0, BLOCK)
    inside = columns < V
    stat = tl.load(stats + p)
    x = tl.load(logits + n * stride_row + j * stride_position + columns, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        for i in range(0, B):  # a scalar test per entry: only its tile adds it
            token = tl.load(bias_tokens + p * B + i)
            if (token >= start) & (token < start + BLOCK):
                x += tl.where(columns == token, tl.load(bias_values + p * B + i), 0.0)
    count = tl.load(counts + stat * V + columns, mask=inside, other=0)
    if HAS_DRAFTS:
        for i in range(0, j):  # the drafts before this position
            count += (columns == tl.load(drafts + p * (W - 1) + i)).to(tl.int32)
    seen = tl.load(prompt_mask + stat * V + columns, mask=inside, other=0) != 0
    generated = count > 0
    r = tl.load(repetition + p)
    scale = tl.where(seen | generated, r, 1.0)
    # IEEE division, as torch's x / scale (the interpreter and the reference agree bit for bit).
    x = tl.where(x > 0, tl.math.div_rn(x, scale), x * scale)
    x = x - tl.load(frequency + p) * count.to(tl.float32) - tl.load(presence + p) * generated.to(tl.float32)
    tl.store(out + (n * W + j) * V + columns, x, mask=inside)


def _check_penalize_rows_args(logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts, rows,
                              bias_tokens, bias_values, out) -> None:
    assert logits.dim() == 3 and logits.stride(2) == 1 and logits.dtype in (torch.float32, torch.bfloat16,
                                                                              torch.float16), \
        "logits: float [N, W, V] with unit column stride"
    num_rows, width, vocab = logits.shape
    target = logits if out is None else out
    assert target.shape == logits.shape and target.dtype == torch.float32 and target.is_contiguous(), \
        "out (logits when None): contiguous float32 [N, W, V]"
    assert counts.dtype == torch.int32 and counts.dim() == 2 and counts.shape[1] == vocab and counts.is_contiguous(), \
        "counts: contiguous int32 [S, V]"
    assert prompt_mask.dtype == torch.bool and prompt_mask.shape == counts.shape and prompt_mask.is_contiguous(), \
        "prompt_mask: contiguous bool [S, V]"
    penalized = num_rows if rows is None else rows.shape[0]
    assert rows is None or (rows.dtype == torch.int64 and rows.dim() == 1 and rows.is_contiguous()), \
        "rows: contiguous int64 [P]"
    assert stats.dtype == torch.int64 and stats.shape == (penalized,) and stats.is_contiguous(), "stats: int64 [P]"
    for name, values in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        assert values.dtype == torch.float32 and values.shape == (penalized,) and values.is_contiguous(), \
            f"{name}: contiguous float32 [P]"
    assert drafts is None or (drafts.dtype == torch.int64 and drafts.shape == (penalized, width - 1) and
                              drafts.is_contiguous()), "drafts: contiguous int64 [P, W - 1]"
    assert (bias_tokens is None) == (bias_values is None), "bias_tokens and bias_values: both or neither"
    assert bias_tokens is None or (
        bias_tokens.dtype == torch.int64 and bias_values.dtype == torch.float32 and bias_tokens.dim() == 2
        and bias_tokens.shape == bias_values.shape and bias_tokens.shape[0] == penalized
        and bias_tokens.is_contiguous() and bias_values.is_contiguous()), \
        "bias_tokens, bias_values: contiguous int64 and float32 [P, B]"
    assert all(t is None or t.device == logits.device for t in (counts, prompt_mask, stats, repetition, frequency,
                                                               presence, drafts, rows, bias_tokens, bias_values,
                                                               out))


def penalize_rows(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, stats: torch.Tensor,
                  repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                  drafts: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                  bias_tokens: torch.Tensor | None = None, bias_values: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton penalize_rows_reference, into out (returned), else in place on logits (float32
    then). Each element is read before it is written, by the same program, so out may be
    logits. Grid (P * W, cdiv(V, BLOCK)): shapes only, CUDA-graph safe."""
    _check_penalize_rows_args(logits, counts, prompt_mask, stats, repetition, frequency, presence, drafts, rows,
                              bias_tokens, bias_values, out)
    out = logits if out is None else out
    width, vocab = logits.shape[1], logits.shape[2]
    penalized = stats.shape[0]
    if penalized * width == 0 or vocab == 0:
        return out
    block = min(2048, triton.next_power_of_2(vocab))
    has_drafts, has_rows, has_bias = drafts is not None and width > 1, rows is not None, bias_tokens is not None
    _penalize_rows_kernel[(penalized * width, triton.cdiv(vocab, block))](
        logits, logits.stride(0), logits.stride(1), out, rows if has_rows else stats, counts, prompt_mask, stats,
        repetition, frequency, presence, drafts if has_drafts else stats, bias_tokens if has_bias else stats,
        bias_values if has_bias else repetition, width, vocab, bias_tokens.shape[1] if has_bias else 0, BLOCK=block,
        HAS_DRAFTS=has_drafts, HAS_ROWS=has_rows, HAS_BIAS=has_bias, num_warps=4)
    return out


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
