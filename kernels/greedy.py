"""Greedy tokens and non-finite flags of logit rows, in one read of the logits and one launch.

logits [N, V] hold G = N / W groups of W consecutive rows (a decode row's W positions: 1 in a
plain step, K + 1 in a verify). `greedy_argmax` returns

    tokens[n]     argmax of row n, as torch.argmax: the first maximum, NaN above everything;
                  with token_ids [V], token_ids of it (a reduced draft vocabulary's columns
                  are token ids: HybridLM.draft_tokens)
    nonfinite[g]  1 where a row of group g holds a NaN or an infinity (a numerical fault of the
                  model: the engine fails that request alone), else 0

`greedy_argmax_reference` is its torch oracle (also the CPU path). The Triton kernel splits
each row over programs (a batch-1 row alone would leave all but one SM idle): each reduces its
slice to one int64 key (each lane keeps its first maximum as a float and a column; the lanes'
are then keyed: the float's order-preserving 32 bits above 31 bits of (2^31 - 1 - column), so
the largest key is the first maximum) and whether the slice is finite; the last
program of a group to arrive (arrivals.py) combines the group's keys and flags. The flag thus
costs no launch and no read of its own. Knows nothing about sampling or requests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters, last_to_arrive, reset_arrivals
from .device import INTERPRETED, num_sms
from .launch import dependent_prologue, pdl
from .sampling import order_key
from .tiles import TileConfig

_COLUMN_BITS = 31
_COLUMN_MASK = (1 << _COLUMN_BITS) - 1


def greedy_argmax_reference(logits: torch.Tensor, width: int, tokens: torch.Tensor | None = None,
                            nonfinite: torch.Tensor | None = None,
                            token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (any float dtype), N a multiple of width -> (tokens [N] int64, nonfinite
    [N / width] int64), written into `tokens` / `nonfinite` when given (contiguous int64);
    token_ids [V] (int64, optional): the id of each column, which tokens then hold."""
    argmax = logits.argmax(dim=-1)
    if token_ids is not None:
        argmax = token_ids[argmax]
    flags = (~torch.isfinite(logits)).reshape(-1, width * logits.shape[1]).any(dim=-1).long()
    if tokens is not None:
        argmax = tokens.copy_(argmax)
    if nonfinite is not None:
        flags = nonfinite.copy_(flags)
    return argmax, flags


@triton.jit
def _argmax_key(x, columns):
    """float32 values and their columns -> int64 keys whose maximum is the first maximum under
    torch.argmax's order (NaN largest; -0.0 equal to +0.0). Every key is > 0."""
    x = tl.where(x == 0.0, 0.0, x)
    ordered = tl.where(x != x, 4294967295, order_key(x))  # [0, 2^32), NaN (of either sign) the top
    return (ordered << 31) | (2147483647 - columns).to(tl.int64)


@triton.jit(do_not_specialize=["num_rows", "width", "num_splits", "blocks_per_split"])
def _greedy_argmax_kernel(logits, tokens, nonfinite, token_ids, partials, arrivals, stride_logits, num_rows, V,
                          width, num_splits, blocks_per_split, BLOCK: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                          HAS_TOKEN_IDS: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (row n, split s): the largest key and the non-finite flag of columns
    [s * blocks_per_split * BLOCK, +blocks_per_split * BLOCK) of row n into partials [2, N,
    splits]; the last program of group n // width to arrive writes the group's tokens (the
    argmax columns, or their token_ids with HAS_TOKEN_IDS) and flag."""
    dependent_prologue(DEPENDENT_LAUNCH)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    first = split * blocks_per_split * BLOCK + tl.arange(0, BLOCK)
    # Each lane keeps the first maximum of its columns (they come in increasing order) as a
    # float32 value and a column: a few 32-bit operations an element. (Building the int64 key of
    # every element, as the combine below does once a lane, made the kernel compute-bound: 64
    # rows of 248,320 bf16 logits took as long as fp32 ones.) A lane starts at its first column
    # with value -inf, so a row of -inf keeps its first column; NaN is taken over any number and
    # kept (NaN < inf is false, so `finite` clears at NaN as at +-inf).
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_column = first
    finite = tl.full([BLOCK], 1, tl.int1)
    for b in range(blocks_per_split):
        columns = first + b * BLOCK
        inside = columns < V
        x = tl.load(logits + row * stride_logits + columns, mask=inside, other=0.0).to(tl.float32)
        finite = finite & (tl.abs(x) < float("inf"))
        take = inside & ((x > best) | ((x != x) & (best == best)))
        best = tl.where(take, x, best)
        best_column = tl.where(take, columns, best_column)
    lane_keys = tl.where(best_column < V, _argmax_key(best, best_column), 0)  # a lane wholly past V: no column
    bad = (~finite).to(tl.int32)
    tl.store(partials + row * num_splits + split, tl.max(lane_keys, 0))
    tl.store(partials + (num_rows + row) * num_splits + split, tl.max(bad, 0).to(tl.int64))
    group = row // width
    counter = arrivals + group
    if last_to_arrive(counter, width * num_splits):
        splits = tl.arange(0, BLOCK_SPLITS)
        present = splits < num_splits
        flag = tl.zeros([BLOCK_SPLITS], dtype=tl.int64)
        for w in range(width):
            member = group * width + w
            # .cg: from L2, where the other SMs' stores are, never a stale L1 line
            keys = tl.load(partials + member * num_splits + splits, mask=present, other=0, cache_modifier=".cg")
            flag = tl.maximum(flag, tl.load(partials + (num_rows + member) * num_splits + splits, mask=present,
                                            other=0, cache_modifier=".cg"))
            column = 2147483647 - (tl.max(keys, 0) & 2147483647)
            if HAS_TOKEN_IDS:
                column = tl.load(token_ids + column)
            tl.store(tokens + member, column)
        tl.store(nonfinite + group, tl.max(flag, 0))
        reset_arrivals(counter)


# Programs per SM the rows are split into, the bytes of logits a program's loop step loads, and
# its warps. The loop's loads are not pipelined: each program has one step's loads in flight, so
# the SM's share of the bytes in flight (Little's law) takes several programs. The sweep of
# bench/kernels_greedy.py (H100: bench/results/kernels_greedy-h100.json): 64 rows of 248,320
# bf16 logits in 19.2 µs at 2 KB, 8 warps, 8 programs an SM (22-33 µs at 4-16 KB steps, torch.argmax
# 32.3 µs); one row in 3.7 µs, about one memory round trip.
PROGRAMS_PER_SM = 8
STEP_BYTES = 2 << 10
WARPS = 8


def greedy_config(num_rows: int, vocab: int, sms: int, element_size: int) -> TileConfig:
    """Tiles of `_greedy_argmax_kernel`: block_n columns a loop step (STEP_BYTES of logits of
    element_size bytes), each row split over num_splits programs, about PROGRAMS_PER_SM programs
    per SM in all (a batch-1 row over the whole GPU)."""
    block = _block(element_size)
    num_blocks = triton.cdiv(vocab, block)
    wanted = min(num_blocks, max(1, triton.cdiv(PROGRAMS_PER_SM * sms, num_rows)))
    num_splits = triton.cdiv(num_blocks, triton.cdiv(num_blocks, wanted))  # no empty split
    return TileConfig(block_n=block, num_splits=num_splits, num_warps=WARPS)


def _block(element_size: int) -> int:
    return 64 if INTERPRETED else STEP_BYTES // element_size


def _max_splits(vocab: int, sms: int, element_size: int) -> int:
    """The most splits greedy_config gives any batch of this vocabulary: the combine's vector
    is that wide whatever the batch, so batch sizes compile no variants of their own."""
    return triton.next_power_of_2(min(triton.cdiv(vocab, _block(element_size)), PROGRAMS_PER_SM * sms))


def _check_greedy_argmax_args(logits: torch.Tensor, width: int, tokens: torch.Tensor | None,
                              nonfinite: torch.Tensor | None, token_ids: torch.Tensor | None) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [N, V] with unit column stride"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16), f"logits: dtype {logits.dtype}"
    num_rows, vocab = logits.shape
    assert 0 < vocab <= _COLUMN_MASK, f"vocabulary {vocab}: 1 .. 2^31 - 1 columns"
    assert width >= 1 and num_rows % width == 0, f"{num_rows} rows: not groups of {width}"
    for name, out, size in (("tokens", tokens, num_rows), ("nonfinite", nonfinite, num_rows // width)):
        assert out is None or (out.dtype == torch.int64 and out.shape == (size,) and out.is_contiguous()
                               and out.device == logits.device), f"{name}: contiguous int64 [{size}]"
    assert token_ids is None or (token_ids.dtype == torch.int64 and token_ids.shape == (vocab,)
                                 and token_ids.is_contiguous() and token_ids.device == logits.device), \
        f"token_ids: contiguous int64 [{vocab}] on the logits' device"


def greedy_argmax(logits: torch.Tensor, width: int, tokens: torch.Tensor | None = None,
                  nonfinite: torch.Tensor | None = None,
                  token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton greedy_argmax_reference. Grid (N, splits), splits from shapes and the SM count
    only; scratch is torch.empty and the shared arrival counters: CUDA-graph safe."""
    _check_greedy_argmax_args(logits, width, tokens, nonfinite, token_ids)
    num_rows, vocab = logits.shape
    device = logits.device
    tokens = torch.empty(num_rows, dtype=torch.int64, device=device) if tokens is None else tokens
    nonfinite = torch.empty(num_rows // width, dtype=torch.int64, device=device) if nonfinite is None else nonfinite
    if num_rows == 0:
        return tokens, nonfinite
    sms, element_size = num_sms(device), logits.element_size()
    config = greedy_config(num_rows, vocab, sms, element_size)
    num_splits = config.num_splits
    partials = torch.empty(2, num_rows, num_splits, dtype=torch.int64, device=device)
    arrivals = arrival_counters(device, num_rows // width)
    _greedy_argmax_kernel[(num_rows, num_splits)](
        logits, tokens, nonfinite, tokens if token_ids is None else token_ids, partials, arrivals, logits.stride(0),
        num_rows, vocab, width, num_splits, triton.cdiv(triton.cdiv(vocab, config.block_n), num_splits),
        BLOCK=config.block_n, BLOCK_SPLITS=_max_splits(vocab, sms, element_size), HAS_TOKEN_IDS=token_ids is not None,
        **config.launch_options(), **pdl(device))
    return tokens, nonfinite
