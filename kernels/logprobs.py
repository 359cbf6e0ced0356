"""Log-probabilities and ranks of chosen tokens, in one read of the logits; the top-k logits of rows.

For logits [N, V] (any float dtype) and chosen token ids [N], `token_logprobs` returns

    logprob[n]    logits[n, chosen[n]] - logsumexp(logits[n])   (log_softmax's, float32)
    rank[n]       1 + the number of columns whose logit is above the chosen one's
    lse[n]        logsumexp(logits[n]), float32: top-k logits minus it are log-probabilities

torch takes a float32 copy, a logsumexp pass and a compare pass over [N, V] (vLLM a
log_softmax copy besides), and a prompt scored at every position (SamplingParams.prompt_logprobs)
is thousands of rows of a 248K vocabulary. The kernel reads each row once, in its own dtype, a
program a row: a running maximum and sum of exp (online softmax, in base 2) and a running count
of larger logits (what scoring a prompt costs: bench/RESULTS.md, "Prompt log-probabilities").
`token_logprobs_reference` is its torch oracle (also the CPU path).

`top_logits` returns the k largest logits of each row and their ids, largest first (k <= 20:
the requests' top_logprobs). torch's topk over a 248K-wide row is a generic radix select; here a
program takes one BLOCK_K-column block of a row and pulls its k largest by k max-and-mask
passes in registers, writing k candidates a block ([N, blocks * k], one read of the logits
spread over N x blocks programs), and a sort of those few picks the k largest. A block's
k largest include every one of the row's k largest that lies in it, so nothing is lost.
`top_logits_reference` (torch's topk on float32) is its oracle and the CPU path. Equal logits
may come in another order than torch's.

Knows nothing about requests or prompts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # columns a loop step: 16 KB of float32 a program in flight
BLOCK_K = 2048  # columns a top_logits program takes: 121 programs a 248K row
MAX_K = 20
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


def top_logits_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (values [N, k] float32, ids [N, k] int64), largest first."""
    values, ids = logits.float().topk(k, dim=-1)
    return values, ids


@triton.jit
def _block_top_kernel(logits, values_out, ids_out, V, stride_row, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    columns = block * BLOCK + offs
    free = columns < V  # real columns not taken yet
    x = tl.load(logits + row * stride_row + columns, mask=free, other=float("-inf")).to(tl.float32)
    out = (row * tl.num_programs(1) + block) * K
    for j in range(K):  # k a runtime bound: one compile serves every k
        top = tl.max(tl.where(free, x, float("-inf")), 0)
        # The first free column holding it (a tie's others come in the next passes; -inf
        # columns are real candidates too).
        at = tl.min(tl.where(free & (x == top), offs, BLOCK), 0)
        tl.store(values_out + out + j, top)
        # Only the last block can run out of columns (BLOCK_K >= MAX_K): its remaining
        # candidates are -inf fillers naming a real column, ordered after every real one.
        tl.store(ids_out + out + j, tl.minimum(block * BLOCK + at, V - 1).to(tl.int64))
        free = free & (offs != at)


def top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton top_logits_reference: one launch over (rows, blocks), then torch's topk of the
    [N, blocks * k] candidates. logits: [N, V] with unit column stride; 1 <= k <= MAX_K."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [N, V] with contiguous rows"
    rows, vocab = logits.shape
    assert 1 <= k <= min(MAX_K, vocab), f"k must be in 1..{min(MAX_K, vocab)}"
    blocks = triton.cdiv(vocab, BLOCK_K)
    values = torch.empty(rows, blocks * k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, blocks * k, dtype=torch.int64, device=logits.device)
    if rows:
        _block_top_kernel[(rows, blocks)](logits, values, ids, vocab, logits.stride(0), K=k, BLOCK=BLOCK_K,
                                          num_warps=4)
    # A stable sort keeps candidates of equal value in block order: the last block's fillers
    # (-inf) never displace a real -inf column.
    best, where = values.sort(dim=-1, descending=True, stable=True)
    return best[:, :k], ids.gather(1, where[:, :k])
