"""Mixture-of-experts MLP: softmax top-k routing and the routed SwiGLU experts.

Routing as Qwen3-Next / Qwen3.5-MoE define it: probabilities = softmax(router logits) in
float32, keep the top k, optionally renormalise them to sum to 1, cast to the activation dtype.
The shared expert and its sigmoid gate are dense GEMMs done by the model. Knows nothing about
layers or checkpoints.

Triton: `route` is one program per token (softmax, then k rounds of argmax). `moe_experts`
computes out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = experts[t, j], along
one of two paths, chosen from the batch shape alone (no host sync, CUDA-graph safe):

- per token (decode): one program per (token, slot) and tile of the intermediate computes the
  gate/up GEMV with SiLU*up fused; one program per (token, tile of H) runs the k down GEMVs and
  sums them in slot order. Two launches; each pair reads its expert's weights once, so a batch
  moves (pairs x expert bytes): the least possible while pairs ~ distinct experts.
- grouped (prefill, large batches): pairs are counted per expert (atomic ranks), scattered into
  expert order and padded per expert to BLOCK_M-row blocks (as vLLM's moe_align_block_size; the
  padding is implicit: a block knows its expert and row range from the counts alone). One GEMM
  program per (row block, N tile) reads its expert's weight tile once for up to BLOCK_M pairs:
  gate_up with SiLU*up fused, then down with the routing weight applied, written per pair; a
  last kernel sums each token's k rows in slot order (deterministic, no float atomics).

A pair whose expert id is outside [0, E) belongs to another rank (expert parallelism, where a
rank holds E of the model's experts): it contributes nothing and costs nothing — the per-token
kernels skip it, the grouped path neither counts nor sorts it, and the slot sum leaves it out.

The per-token path runs while pairs = tokens * k <= E / 4 (12 tokens of a Qwen3-Next layer):
up to 8 tokens the two paths are within noise of each other, from 16 tokens on the grouped path
wins (measured at 512 experts, top-10, H 2048, I 512, bf16:
bench/results/kernels_moe_sampling-h200.json).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_reference
from .device import INTERPRETED
from .launch import dependent_prologue, dot_precision, pdl
from .tiles import TileConfig


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def by_expert_reference(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
                        mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's k experts e of weight * mlp(e, its row of x): x [T, H]; weights,
    experts [T, k] -> [T, H]; pairs of experts outside [0, num_experts) (another rank's) are left
    out. Tokens are grouped by expert so each expert's mlp runs once, over all of its tokens (the
    references of the bf16 and the FP8 experts share this)."""
    out = torch.zeros_like(x)
    flat_experts = experts.reshape(-1)
    mine = torch.nonzero((flat_experts >= 0) & (flat_experts < num_experts)).flatten()
    order = mine[torch.argsort(flat_experts[mine], stable=True)]
    counts = torch.bincount(flat_experts[mine], minlength=num_experts).tolist()
    token_of = order // experts.shape[1]
    weight_of = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start:start + count]
        out.index_add_(0, tokens, mlp(expert, x[tokens]) * weight_of[start:start + count, None])
        start += count
    return out


def moe_experts_reference(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                          w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; weights, experts: [T, k]; w_gate_up: [E, 2I, H]; w_down: [E, H, I] -> [T, H]."""
    return by_expert_reference(x, weights, experts, w_gate_up.shape[0],
                               lambda e, rows: silu_and_mul_reference(rows @ w_gate_up[e].T) @ w_down[e].T)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _route_kernel(logits, stride_row, weights, experts, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """One token: probs = softmax(logits) in float32; slot j = the j-th largest (first index on
    ties, as argmax); weights optionally renormalised over the k kept."""
    dependent_prologue(DEPENDENT_LAUNCH)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits + row * stride_row + e, mask=e < E, other=float("-inf")).to(tl.float32)
    probs = tl.exp(x - tl.max(x, 0))
    probs = probs / tl.sum(probs, 0)
    remaining = tl.where(e < E, probs, -1.0)
    slot = tl.arange(0, K_PAD)
    chosen_weight = tl.zeros([K_PAD], dtype=tl.float32)
    chosen_expert = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, 0)
        index = tl.min(tl.where(remaining == best, e, BLOCK_E), 0)
        chosen_weight = tl.where(slot == j, best, chosen_weight)
        chosen_expert = tl.where(slot == j, index, chosen_expert)
        remaining = tl.where(e == index, -1.0, remaining)
    if RENORMALIZE:
        chosen_weight = chosen_weight / tl.sum(chosen_weight, 0)
    ok = slot < TOP_K
    tl.store(weights + row * TOP_K + slot, chosen_weight.to(weights.dtype.element_ty), mask=ok)
    tl.store(experts + row * TOP_K + slot, chosen_expert.to(tl.int64), mask=ok)


def _check_route_args(router_logits: torch.Tensor, top_k: int) -> None:
    assert router_logits.dim() == 2 and router_logits.stride(1) == 1, "router_logits [T, E], unit stride along E"
    assert router_logits.dtype in (torch.float32, torch.bfloat16, torch.float16), \
        f"router_logits: dtype {router_logits.dtype}"
    num_experts = router_logits.shape[1]
    assert 1 <= top_k <= num_experts, f"top_k {top_k} with {num_experts} experts"


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `route_reference`: [T, E] -> (weights [T, k] in the logits' dtype, experts [T, k] int64)."""
    _check_route_args(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens > 0:
        _route_kernel[(num_tokens,)](router_logits, router_logits.stride(0), weights, experts, num_experts,
                                     TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                     BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
                                     num_warps=4, **pdl(router_logits.device))
    return weights, experts


@triton.jit
def _gate_up_per_pair_kernel(x, experts, w_gate_up, act, H, I, E, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (pair, tile of I), pair = token * TOP_K + slot: act[pair, n] = silu(g_n) * u_n with
    g = W_gate[e] x[token], u = W_up[e] x[token] (rows n and I + n of w_gate_up[e]), fp32 sums;
    nothing for another rank's pair (its act row is never read)."""
    dependent_prologue(DEPENDENT_LAUNCH)
    pair = tl.program_id(0).to(tl.int64)
    e = tl.load(experts + pair).to(tl.int64)
    if (e < 0) | (e >= E):
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    token = pair // TOP_K
    w = w_gate_up + e * (2 * I * H)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xk = tl.load(x + token * H + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        tile_ok = n_ok[:, None] & k_ok[None, :]
        gate += tl.sum(tl.load(w + n[:, None] * H + k[None, :], mask=tile_ok, other=0.0).to(tl.float32) * xk, 1)
        up += tl.sum(tl.load(w + (n + I)[:, None] * H + k[None, :], mask=tile_ok, other=0.0).to(tl.float32) * xk, 1)
    tl.store(act + pair * I + n, (gate * tl.sigmoid(gate) * up).to(act.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_per_token_kernel(act, weights, experts, w_down, out, H, I, E, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """Program (token, tile of H): out[token, n] = sum over slots j (in order) of
    w[token, j] * (W_down[e_j] act[token * TOP_K + j])_n, fp32 sums, over this rank's pairs."""
    dependent_prologue(DEPENDENT_LAUNCH)
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in range(TOP_K):
        pair = token * TOP_K + slot
        e = tl.load(experts + pair).to(tl.int64)
        if (e >= 0) & (e < E):
            w = w_down + e * (H * I)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < I
                a = tl.load(act + pair * I + k, mask=k_ok, other=0.0).to(tl.float32)
                tile = tl.load(w + n[:, None] * I + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.sum(tile.to(tl.float32) * a[None, :], 1)
            total += tl.load(weights + pair).to(tl.float32) * acc
    tl.store(out + token * H + n, total.to(out.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["N"])
def _count_pairs_kernel(experts, counts, ranks, N, E, BLOCK: tl.constexpr):
    """ranks[pair] = the pair's position among its expert's pairs (arrival order of the atomics:
    any order works, each GEMM row only depends on its own pair); counts[e] += pairs of e.
    Another rank's pairs are not counted (nor ranked)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(experts + offs, mask=offs < N, other=-1).to(tl.int32)
    ok = (offs < N) & (e >= 0) & (e < E)
    tl.store(ranks + offs, tl.atomic_add(counts + e, 1, mask=ok), mask=ok)


@triton.jit
def _expert_layout(counts, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """counts [E] -> per expert lane (e, count, first sorted position, first row block, row blocks)."""
    e = tl.arange(0, E_PAD)
    count = tl.load(counts + e, mask=e < E, other=0)
    blocks = (count + BLOCK_M - 1) // BLOCK_M
    return e, count, tl.cumsum(count, 0) - count, tl.cumsum(blocks, 0) - blocks, blocks


@triton.jit(do_not_specialize=["N"])
def _scatter_pairs_kernel(experts, counts, ranks, sorted_pairs, N, E, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """sorted_pairs[start[e] + rank] = pair: this rank's pairs grouped by expert, experts in order."""
    lanes, _, start, _, _ = _expert_layout(counts, E, E_PAD, 1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(experts + offs, mask=offs < N, other=-1).to(tl.int32)
    ok = (offs < N) & (e >= 0) & (e < E)
    first = tl.sum(tl.where(e[:, None] == lanes[None, :], start[None, :], 0), 1)
    tl.store(sorted_pairs + first + tl.load(ranks + offs, mask=ok, other=0), offs, mask=ok)


@triton.jit
def block_rows(counts, sorted_pairs, m_block, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block m_block of the expert-sorted, per-expert BLOCK_M-padded pair list ->
    (expert (E past the last block), sorted positions [BLOCK_M], valid rows, pair ids)."""
    lanes, count, start, block_start, blocks = _expert_layout(counts, E, E_PAD, BLOCK_M)
    expert = tl.sum(((block_start + blocks <= m_block) & (lanes < E)).to(tl.int32), 0)  # experts wholly before
    mine = lanes == expert
    rows = (m_block - tl.sum(tl.where(mine, block_start, 0), 0)) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < tl.sum(tl.where(mine, count, 0), 0)
    position = tl.sum(tl.where(mine, start, 0), 0) + rows
    return expert, position, valid, tl.load(sorted_pairs + position, mask=valid, other=0)


@triton.jit
def store_weighted_pairs(out_pairs, acc, weights, pair, valid, n, n_ok, H):
    """The down GEMMs' epilogue: out_pairs[pair, n] = routing weight[pair] * acc[row, n] (fp32
    acc [BLOCK_M, BLOCK_N]) for the block's valid rows and the tile's columns n < H."""
    acc *= tl.load(weights + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_pairs + pair[:, None].to(tl.int64) * H + n[None, :], acc.to(out_pairs.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_m_blocks"])
def _gate_up_grouped_kernel(x, counts, sorted_pairs, w_gate_up, act, H, I, E, num_m_blocks, TOP_K: tl.constexpr,
                            E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PRECISION: tl.constexpr):
    """Program (row block, tile of I), row blocks fastest so an expert's blocks share its weight
    tile in L2: act[position, n] = silu(x W_gate^T) * (x W_up^T) over the block's pairs."""
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    expert, position, valid, pair = block_rows(counts, sorted_pairs, m_block, E, E_PAD, BLOCK_M)
    if expert >= E:
        return
    token = (pair // TOP_K).to(tl.int64)
    n = (pid // num_m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    w = w_gate_up + expert.to(tl.int64) * (2 * I * H)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        a = tl.load(x + token[:, None] * H + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_ok = k_ok[:, None] & n_ok[None, :]
        gate = tl.dot(a, tl.load(w + n[None, :] * H + k[:, None], mask=b_ok, other=0.0), gate,
                      input_precision=PRECISION)
        up = tl.dot(a, tl.load(w + (n + I)[None, :] * H + k[:, None], mask=b_ok, other=0.0), up,
                    input_precision=PRECISION)
    tl.store(act + position[:, None].to(tl.int64) * I + n[None, :],
             (gate * tl.sigmoid(gate) * up).to(act.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_m_blocks"])
def _down_grouped_kernel(act, counts, sorted_pairs, weights, w_down, out_pairs, H, I, E, num_m_blocks,
                         E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Program (row block, tile of H): out_pairs[pair, n] = w[pair] * (act W_down^T)[row, n]."""
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    expert, position, valid, pair = block_rows(counts, sorted_pairs, m_block, E, E_PAD, BLOCK_M)
    if expert >= E:
        return
    n = (pid // num_m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w = w_down + expert.to(tl.int64) * (H * I)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(act + position[:, None].to(tl.int64) * I + k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w + n[None, :] * I + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    store_weighted_pairs(out_pairs, acc, weights, pair, valid, n, n_ok, H)


@triton.jit
def _sum_slots_kernel(out_pairs, experts, out, H, E, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[token, n] = sum over slots in order of out_pairs[token * TOP_K + slot, n] (fp32), over
    this rank's pairs (another rank's out_pairs row is never written)."""
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in range(TOP_K):
        pair = token * TOP_K + slot
        e = tl.load(experts + pair) + tl.zeros([BLOCK_N], dtype=tl.int64)  # a block: masks are blocks
        mine = n_ok & (e >= 0) & (e < E)
        total += tl.load(out_pairs + pair * H + n, mask=mine, other=0.0).to(tl.float32)
    tl.store(out + token * H + n, total.to(out.dtype.element_ty), mask=n_ok)


# Tiles of the per-token path: gate/up programs cover block_n rows of I, down programs block_n
# rows of H; both loop over the reduction in block_k steps. The fastest of the sweep at 1-8
# tokens (small tiles: many programs, many loads in flight; measured:
# bench/results/kernels_moe_sampling-h200.json).
PER_TOKEN_GATE_UP = TileConfig(block_n=8, block_k=256, num_warps=4)
PER_TOKEN_DOWN = TileConfig(block_n=4, block_k=256, num_warps=4)


def grouped_config(num_pairs: int, num_experts: int) -> TileConfig:
    """Tiles of the grouped path (block_m: pairs per row block, the per-expert padding unit; the
    gate/up and down GEMMs share them) by the mean pairs per expert: up to 8 (decode-like),
    16-row blocks with long K steps; 64 and more (prefill), 128x128 tiles; in between (not
    measured) block_m follows the mean. Each the fastest of its sweep (measured:
    bench/results/kernels_moe_sampling-h200.json)."""
    if INTERPRETED:
        return TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    mean = triton.cdiv(num_pairs, num_experts)
    if mean <= 8:
        return TileConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if mean >= 64:
        return TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return TileConfig(block_m=triton.next_power_of_2(mean), block_n=64, block_k=64, num_warps=4, num_stages=3)


def use_per_token_path(num_pairs: int, num_experts: int) -> bool:
    """Few pairs per expert: each pair's weights are read once either way, and the per-token
    path saves the counting, scatter and sum launches (measured:
    bench/results/kernels_moe_sampling-h200.json)."""
    return 4 * num_pairs <= num_experts


class SortedPairs(NamedTuple):
    """The (token, slot) pairs grouped by expert, as every grouped kernel reads them (`block_rows`)."""
    counts: torch.Tensor        # [E] int32: pairs per expert
    sorted_pairs: torch.Tensor  # [pairs] int32: pair ids, experts in order
    num_m_blocks: int           # row blocks launched: an upper bound from shapes alone (blocks past the
                                # last expert's return at once)
    e_pad: int                  # E rounded up to a power of two (the lanes of _expert_layout)


def sort_pairs(experts: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """Count and scatter the pairs of `experts` [T, k] by expert (those of experts in [0,
    num_experts)) on the device (no host sync: the
    launch sizes depend on shapes only, so CUDA graphs replay them). Shared by the bf16 and the
    FP8 grouped experts."""
    num_pairs, device = experts.numel(), experts.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(num_pairs, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    _count_pairs_kernel[(triton.cdiv(num_pairs, 1024),)](experts, counts, ranks, num_pairs, num_experts, BLOCK=1024)
    _scatter_pairs_kernel[(triton.cdiv(num_pairs, 32),)](experts, counts, ranks, sorted_pairs, num_pairs,
                                                          num_experts, E_PAD=e_pad, BLOCK=32)
    # sum over experts of ceil(count / block_m) <= (pairs + (block_m - 1) * nonempty experts) / block_m
    num_m_blocks = (num_pairs + (block_m - 1) * min(num_experts, num_pairs)) // block_m
    return SortedPairs(counts, sorted_pairs, num_m_blocks, e_pad)


def sum_slots(out_pairs: torch.Tensor, experts: torch.Tensor, num_experts: int, out: torch.Tensor) -> None:
    """out [T, H] = each token's k rows of out_pairs [T * k, H] summed in slot order, the rows of
    pairs whose expert (experts [T, k]) is outside [0, num_experts) left out."""
    num_tokens, hidden = out.shape
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, block))](out_pairs, experts, out, hidden, num_experts,
                                                                 TOP_K=experts.shape[1], BLOCK_N=block, num_warps=4)


def _check_moe_experts_args(x, weights, experts, w_gate_up, w_down) -> None:
    num_tokens, hidden = x.shape
    num_experts, two_inter, hidden_2 = w_gate_up.shape
    assert hidden_2 == hidden and two_inter % 2 == 0, f"w_gate_up {tuple(w_gate_up.shape)} vs x {tuple(x.shape)}"
    assert w_down.shape == (num_experts, hidden, two_inter // 2), f"w_down {tuple(w_down.shape)}"
    assert experts.dim() == 2 and experts.shape[0] == num_tokens and weights.shape == experts.shape, \
        "weights, experts: [T, k]"
    assert experts.dtype in (torch.int64, torch.int32), f"experts: dtype {experts.dtype}"
    assert x.dtype == w_gate_up.dtype == w_down.dtype, \
        f"x {x.dtype}, w_gate_up {w_gate_up.dtype}, w_down {w_down.dtype}: one dtype"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"x: dtype {x.dtype}"
    for name, t in (("x", x), ("weights", weights), ("experts", experts), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        assert t.is_contiguous(), f"{name} must be contiguous"
        assert t.device == x.device, f"{name} on {t.device}, x on {x.device}"


def moe_experts_per_token(x, weights, experts, w_gate_up, w_down, gate_up_config: TileConfig = PER_TOKEN_GATE_UP,
                          down_config: TileConfig = PER_TOKEN_DOWN):
    """The per-token path (any batch; meant for decode), with the tiles of its two kernels."""
    _check_moe_experts_args(x, weights, experts, w_gate_up, w_down)
    num_tokens, hidden = x.shape
    top_k, inter = experts.shape[1], w_down.shape[2]
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    _gate_up_per_pair_kernel[(num_tokens * top_k, triton.cdiv(inter, gate_up_config.block_n))](
        x, experts, w_gate_up, act, hidden, inter, w_gate_up.shape[0], TOP_K=top_k, BLOCK_N=gate_up_config.block_n,
        BLOCK_K=gate_up_config.block_k, **gate_up_config.launch_options(), **pdl(x.device))
    _down_per_token_kernel[(num_tokens, triton.cdiv(hidden, down_config.block_n))](
        act, weights, experts, w_down, out, hidden, inter, w_down.shape[0], TOP_K=top_k, BLOCK_N=down_config.block_n,
        BLOCK_K=min(down_config.block_k, triton.next_power_of_2(inter)), **down_config.launch_options(),
        **pdl(x.device))
    return out


def moe_experts_grouped(x, weights, experts, w_gate_up, w_down, config: TileConfig | None = None):
    """The grouped path (any batch; meant for prefill and large batches)."""
    _check_moe_experts_args(x, weights, experts, w_gate_up, w_down)
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = w_gate_up.shape[0], experts.shape[1], w_down.shape[2]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    config = config or grouped_config(num_pairs, num_experts)
    pairs = sort_pairs(experts, num_experts, config.block_m)
    tiles = dict(E_PAD=pairs.e_pad, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 PRECISION=dot_precision(x.dtype), **config.launch_options())
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # rows in expert order
    _gate_up_grouped_kernel[(pairs.num_m_blocks * triton.cdiv(inter, config.block_n),)](
        x, pairs.counts, pairs.sorted_pairs, w_gate_up, act, hidden, inter, num_experts, pairs.num_m_blocks,
        TOP_K=top_k, **tiles)
    out_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # rows by pair
    _down_grouped_kernel[(pairs.num_m_blocks * triton.cdiv(hidden, config.block_n),)](
        act, pairs.counts, pairs.sorted_pairs, weights, w_down, out_pairs, hidden, inter, num_experts,
        pairs.num_m_blocks, **tiles)
    sum_slots(out_pairs, experts, num_experts, out)
    return out


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """Triton `moe_experts_reference` (same arguments and result): the per-token path for
    decode-sized batches, the grouped path otherwise (the choice depends on shapes only)."""
    if use_per_token_path(experts.numel(), w_gate_up.shape[0]):
        return moe_experts_per_token(x, weights, experts, w_gate_up, w_down)
    return moe_experts_grouped(x, weights, experts, w_gate_up, w_down)
