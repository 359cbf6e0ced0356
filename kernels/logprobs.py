"""Log-probabilities and ranks of chosen tokens, in one read of the logits.

For logits [N, V] (any float dtype) and chosen token ids [N], `token_logprobs` returns

    logprob[n]    logits[n, chosen[n]] - logsumexp(logits[n])   (log_softmax's, float32)
    rank[n]       1 + the number of columns whose logit is above the chosen one's
    lse[n]        logsumexp(logits[n]), float32: top-k logits minus it are log-probabilities

torch takes a float32 copy, a logsumexp pass and a compare pass over [N, V] (vLLM a
log_softmax copy besides), and a prompt scored at every position (SamplingParams.prompt_logprobs)
is thousands of rows of a 248K vocabulary. The kernel reads each row once, in its own dtype, a
program a row: a running maximum and sum of exp (online softmax, in base 2) and a running count
of larger logits. (Scoring every position of a 0.8B-shape prefill with it costs 1.95x the plain
prefill: bench/results/prompt_logprobs-h200.json.) `token_logprobs_reference` is its torch
oracle (also the CPU path). Knows nothing about requests or prompts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # columns a loop step: 16 KB of float32 a program in flight
LOG2E = 1.4426950408889634


def token_logprobs_reference(logits: torch.Tensor, chosen: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V], chosen [N] int64 -> (logprob [N] float32, rank [N] int64, lse [N] float32)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    chosen_logits = logits.gather(1, chosen[:, None])
    rank = (logits > chosen_logits).sum(dim=-1) + 1
    return chosen_logits[:, 0] - lse, rank, lse


@triton.jit
def _token_logprobs_kernel(logits, chosen, logprob_out, rank_out, lse_out, V, stride_row,
                           BLOCK: tl.constexpr, LOG2E_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride_row
    target = tl.load(base + tl.load(chosen + row)).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    # Per lane: a running maximum (base-2 units), the sum of 2^(x - maximum), the count above target.
    maximum = tl.full((BLOCK,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    above = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, V, BLOCK):
        columns = start + offs
        x = tl.load(base + columns, mask=columns < V, other=float("-inf")).to(tl.float32)
        above += (x > target).to(tl.int32)
        x2 = x * LOG2E_
        new_maximum = tl.maximum(maximum, x2)
        # A lane that has seen only -inf (masked columns) keeps a zero sum, not NaN.
        safe = tl.where(new_maximum == float("-inf"), 0.0, new_maximum)
        total = total * tl.exp2(maximum - safe) + tl.exp2(x2 - safe)
        maximum = new_maximum
    row_maximum = tl.max(maximum, 0)
    row_total = tl.sum(tl.where(maximum == float("-inf"), 0.0, total * tl.exp2(maximum - row_maximum)), 0)
    lse = (row_maximum + tl.log2(row_total)) / LOG2E_
    tl.store(logprob_out + row, target - lse)
    tl.store(rank_out + row, tl.sum(above, 0).to(tl.int64) + 1)
    tl.store(lse_out + row, lse)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton token_logprobs_reference, one launch. logits: [N, V] with unit column stride;
    chosen: [N] int64 ids in [0, V) (not checked: that would need the host to read them)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [N, V] with contiguous rows"
    assert chosen.shape == (logits.shape[0],) and chosen.dtype == torch.int64, "chosen: [N] int64"
    rows, vocab = logits.shape
    logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    rank = torch.empty(rows, dtype=torch.int64, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _token_logprobs_kernel[(rows,)](logits, chosen.contiguous(), logprob, rank, lse, vocab, logits.stride(0),
                                        BLOCK=BLOCK_V, LOG2E_=LOG2E, num_warps=8)
    return logprob, rank, lse
