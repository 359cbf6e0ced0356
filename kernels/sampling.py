"""Token selection on device: temperature, top-k, top-p, min-p, seeded, without a host sync.

Randomness is counter-based, a row's draw a function of its own seed and position only; a token
is drawn by the exponential race (Gumbel-max) over the kept tokens (noise.py).

`sample` (Triton) draws the same token as `sample_reference` (ties aside: race values, or a
token's mass above against top_p, that agree to float32 rounding) without sorting the
vocabulary. The kept set of the filters is a prefix of the vocabulary sorted by scaled logit s,
so it is {s >= threshold}; the kernels find that threshold exactly:

  1. stats    (rows x splits): max / log-sum-exp of s and of the raw logits, raw argmax.
  2. hist     (rows x splits): counts of d = max(s) - s in bins (1/16 logit wide). Counts bound
              the probability mass above every bin edge (each element of bin j has
              exp(-d) in [exp(-edge_{j+1}), exp(-edge_j)]); that locates the top-k boundary
              exactly and the top-p boundary to a window of bins.
  3. plan     (rows): picks the window. Bins before it are certainly kept (the prefix), bins
              after it certainly dropped. A window wider than `capacity` elements is re-binned
              once more, finer (2 and 3 again over the window only, with the prefix mass summed
              exactly); if it is still too wide the row takes the last resort of step 5.
  4. compact  (rows x splits): writes the window's elements to a per-row scratch list, sums the
              prefix mass exactly and runs the race over the prefix (one winner per split).
  5. select   (rows): bit-by-bit search of the order-preserving integer key of s over the
              window (in registers) for the k-th largest element, then for the largest key
              whose mass above reaches top_p * Z_k; race over the kept window elements; the
              winner of prefix and window is the token. The last resort runs the same search
              streaming the row from memory (exact, slower: ~64 passes).

A typical LLM row (or a top-k row) keeps a few hundred tokens: three passes over the logits plus
small work. Rows with no top-k/top-p filter skip 2, 3 and 5's search: the race runs over the
whole row in step 4. Temperature-0 rows are the argmax of step 1.

About ten times faster than the sort-based reference, with the same tokens, yet far from
one read of the logits: block-level reductions every 2048 elements, IEEE division x / t and
exp / hash / log per element, the 64 serial bisection steps of step 5 and 7 launches (measured
at B = 64, V = 248,320: bench/results/kernels_moe_sampling-h200.json).

Knows nothing about requests (every parameter arrives as a per-row tensor) nor about drafts
(speculation verifies sampled drafts against this very draw: spec/accept.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .noise import race_block, row_hash_tl, uniform_noise


def filter_probs_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> filtered, renormalised probabilities [B, V] float32 (temperature > 0).
    top_k <= 0 or >= V, top_p == 1 and min_p == 0 switch the respective filter off."""
    scaled = logits.float() / temperature.float().clamp_min(1e-6)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[1]).long()[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the top token always stays).
    mass_before = probs.cumsum(-1) - probs
    keep = (mass_before < top_p.float()[:, None]) | (rank == 0)
    keep &= probs >= min_p.float()[:, None] * probs[:, :1]
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                     offsets: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V]; per-row params [B]; temperature 0 = greedy.
    Returns (tokens [B] int64: out when given, log-probabilities of those tokens under the raw
    logits [B])."""
    greedy = logits.argmax(dim=-1)
    probs = filter_probs_reference(logits, temperature, top_k, top_p, min_p)
    race = probs.log() - (-uniform_noise(seeds, offsets, logits.shape[1]).log()).log()
    tokens = torch.where(temperature > 0, race.argmax(dim=-1), greedy)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return (tokens if out is None else out.copy_(tokens)), logprobs


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

# Per-row plan (int32 [B, 8] and float32 [B, 4]) that the kernels of one `sample` call hand on.
_STATUS, _LO, _HI, _NUM_PREFIX, _NUM_WINDOW = (tl.constexpr(i) for i in range(5))  # int slots
# float slots: the binning of the row's last histogram round, bin = floor((d - d_lo) * scale)
# for d_lo <= d < d_hi
_D_LO, _SCALE, _D_HI = (tl.constexpr(i) for i in range(3))
GREEDY = tl.constexpr(0)      # temperature 0: argmax of the raw logits
NO_FILTER = tl.constexpr(1)   # no top-k / top-p: the race runs over the whole row (min-p aside)
REFINE = tl.constexpr(2)      # a histogram round is pending
WINDOW = tl.constexpr(3)      # threshold search over the compacted window, in registers
LAST_RESORT = tl.constexpr(4)  # window too wide after two rounds: search streams the row

_BINS_PER_UNIT = tl.constexpr(16.0)  # first round: bins 1/16 logit wide over d in [0, 16), then an open tail
_BOUND_SLACK = tl.constexpr(1e-4)    # relative widening of the per-bin mass bounds (float32 rounding of d, exp)


@triton.jit
def order_key(s):
    """float32 -> int64 in [0, 2^32) with the same order (ties aside: -0.0 < +0.0)."""
    bits = s.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648


@triton.jit
def _online_logsumexp(running_max, running_sum, x):
    """(max, sum of exp(x - max)) updated with the block x; safe when everything is -inf."""
    new_max = tl.maximum(running_max, tl.max(x, 0))
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    return new_max, running_sum * tl.exp(running_max - safe) + tl.sum(tl.exp(x - safe), 0)


@triton.jit
def _bin_of(d, d_lo, scale, NUM_BINS: tl.constexpr):
    """Histogram bin of d >= d_lo; bins 0..NUM_BINS-2 are real (the last one takes the rest)."""
    b = tl.floor((d - d_lo) * scale)
    return tl.minimum(tl.maximum(b, 0.0), NUM_BINS - 2).to(tl.int32)


@triton.jit
def _classify(d, valid, d_lo, scale, d_hi, lo, hi, NUM_BINS: tl.constexpr):
    """-> (prefix, window) masks: prefix = d < d_lo or a bin before lo (certainly kept);
    window = bins lo..hi; the rest (bins after hi, d >= d_hi) is certainly dropped."""
    in_round = valid & (d >= d_lo) & (d < d_hi)
    b = _bin_of(d, d_lo, scale, NUM_BINS)
    prefix = valid & ((d < d_lo) | (in_round & (b < lo)))
    return prefix, in_round & (b >= lo) & (b <= hi)


@triton.jit
def _row_stats(stats, argmax, row, num_splits, S_PAD: tl.constexpr):
    """Merge the per-split partials of `_sample_stats_kernel`.
    -> (max s, sum exp(s - max s), raw log-sum-exp, min finite s, raw argmax)."""
    split = tl.arange(0, S_PAD)
    ok = split < num_splits
    base = stats + (row * num_splits + split) * 5
    top_s = tl.load(base + 0, mask=ok, other=float("-inf"))
    top = tl.max(top_s, 0)
    total = tl.sum(tl.load(base + 1, mask=ok, other=0.0) * tl.exp(top_s - tl.where(top == float("-inf"), 0.0, top)), 0)
    raw_top_s = tl.load(base + 2, mask=ok, other=float("-inf"))
    raw_top = tl.max(raw_top_s, 0)
    raw_safe = tl.where(raw_top == float("-inf"), 0.0, raw_top)
    raw_total = tl.sum(tl.load(base + 3, mask=ok, other=0.0) * tl.exp(raw_top_s - raw_safe), 0)
    s_min = tl.min(tl.load(base + 4, mask=ok, other=float("inf")), 0)
    best_split = tl.min(tl.where(raw_top_s == raw_top, split, S_PAD), 0)  # first split on ties
    greedy = tl.load(argmax + row * num_splits + best_split)
    return top, total, raw_safe + tl.log(raw_total), s_min, greedy


# The per-row parameters (temperature, top_k, top_p, min_p, seeds, offsets) are rows of one gather
# from the sampling table (engine/sampling_table.py: [3, N] floats, [2, N] ints, at offsets 4N or 8N
# bytes), 16-byte aligned or not as N is: the kernels do not specialize on their alignment, so a
# new count of redecided rows compiles nothing while serving. A program loads one value of each.
@triton.jit(do_not_specialize_on_alignment=["temperature", "top_k", "top_p"])
def _sample_stats_kernel(logits, stride_row, temperature, top_k, top_p, stats, argmax, plan_i, plan_f, V,
                         num_splits, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split) over logits[row, split*CHUNK : (split+1)*CHUNK]:
    stats[row, split] = (max s, sum exp(s - max s), max x, sum exp(x - max x), min finite s),
    argmax[row, split] = first index of max x; s = x / max(temperature, 1e-6) as the reference.
    Split 0 also initialises the row's plan."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.maximum(tl.load(temperature + row), 1e-6)
    row_ptr = logits + row.to(tl.int64) * stride_row
    top = float("-inf")
    total = 0.0
    raw_top = float("-inf")
    raw_total = 0.0
    s_min = float("inf")
    best = 0
    for start in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        s = x / t
        top, total = _online_logsumexp(top, total, s)
        block_top = tl.max(x, 0)
        best = tl.where(block_top > raw_top, start + tl.argmax(x, 0), best)
        raw_top, raw_total = _online_logsumexp(raw_top, raw_total, x)
        s_min = tl.minimum(s_min, tl.min(tl.where(s == float("-inf"), float("inf"), s), 0))
    base = stats + (row * num_splits + split) * 5
    tl.store(base + 0, top)
    tl.store(base + 1, total)
    tl.store(base + 2, raw_top)
    tl.store(base + 3, raw_total)
    tl.store(base + 4, s_min)
    tl.store(argmax + row * num_splits + split, best)
    if split == 0:
        k = tl.load(top_k + row)
        filtered = ((k > 0) & (k < V)) | (tl.load(top_p + row) < 1.0)
        status = tl.where(tl.load(temperature + row) > 0, tl.where(filtered, REFINE, NO_FILTER), GREEDY)
        tl.store(plan_i + row * 8 + _STATUS, status)
        tl.store(plan_f + row * 4 + _D_LO, 0.0)
        tl.store(plan_f + row * 4 + _SCALE, _BINS_PER_UNIT)
        tl.store(plan_f + row * 4 + _D_HI, float("inf"))


@triton.jit(do_not_specialize_on_alignment=["temperature"])
def _sample_hist_kernel(logits, stride_row, temperature, stats, argmax, plan_i, plan_f, hist, prefix_count,
                        prefix_mass, V, num_splits, S_PAD: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):
    """Rows being refined: hist[row, split, bin] counts of d = max s - s in the row's current
    binning (the last bin is a dump for elements outside it); prefix_count / prefix_mass: the
    elements with d < d_lo and the exact sum of their exp(-d)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(plan_i + row * 8 + _STATUS) != REFINE:
        return
    top, _, _, _, _ = _row_stats(stats, argmax, row, num_splits, S_PAD)
    t = tl.maximum(tl.load(temperature + row), 1e-6)
    d_lo = tl.load(plan_f + row * 4 + _D_LO)
    scale = tl.load(plan_f + row * 4 + _SCALE)
    d_hi = tl.load(plan_f + row * 4 + _D_HI)
    row_ptr = logits + row.to(tl.int64) * stride_row
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    num_prefix = 0
    mass = 0.0
    for start in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < V
        s = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32) / t
        d = top - s
        in_round = valid & (d >= d_lo) & (d < d_hi)
        prefix = valid & (d < d_lo)
        counts += tl.histogram(tl.where(in_round, _bin_of(d, d_lo, scale, NUM_BINS), NUM_BINS - 1), NUM_BINS)
        num_prefix += tl.sum(prefix.to(tl.int32), 0)
        mass += tl.sum(tl.where(prefix, tl.exp(s - top), 0.0), 0)
    tl.store(hist + (row * num_splits + split) * NUM_BINS + tl.arange(0, NUM_BINS), counts)
    tl.store(prefix_count + row * num_splits + split, num_prefix)
    tl.store(prefix_mass + row * num_splits + split, mass)


@triton.jit(do_not_specialize_on_alignment=["top_k", "top_p"])
def _sample_plan_kernel(stats, argmax, top_k, top_p, plan_i, plan_f, hist, prefix_count, prefix_mass,
                        window_offsets, V, num_splits, capacity, LAST_ROUND: tl.constexpr,
                        S_PAD: tl.constexpr, NUM_BINS: tl.constexpr):
    """Rows being refined: choose the window from this round's counts.

    With C_j / M_j the count / mass (sum of exp(-d)) up to and including bin j, M_j lies in
    [Mlo_j, Mhi_j] from the bin edges. b_k = the bin holding the k-th element (exact from counts);
    Z_k (mass of the top k) is bounded likewise (Z, exact, without top-k). Elements of bin j are
    certainly kept by top-p if Mhi_j < p * Zk_lo (their mass before is smaller), certainly dropped
    past the first bin b2 with Mlo_b2 >= p * Zk_hi. Window = [lo, hi] = [min(b1, b_k), b_k] with
    top-k, [b1, b2] without. If it holds <= capacity elements: WINDOW (with each split's offset
    into the scratch list); else re-bin the window finely (REFINE), or LAST_RESORT after the last
    round."""
    row = tl.program_id(0)
    if tl.load(plan_i + row * 8 + _STATUS) != REFINE:
        return
    top, total, _, s_min, _ = _row_stats(stats, argmax, row, num_splits, S_PAD)
    k = tl.load(top_k + row).to(tl.float32)
    p = tl.load(top_p + row)
    k_on = (k > 0) & (k < V)
    p_on = p < 1.0
    split = tl.arange(0, S_PAD)
    ok = split < num_splits
    j = tl.arange(0, NUM_BINS)
    real = j < NUM_BINS - 1
    part = tl.load(hist + (row * num_splits + split[:, None]) * NUM_BINS + j[None, :],
                   mask=ok[:, None] & real[None, :], other=0)                    # [S_PAD, NUM_BINS]
    counts = tl.sum(part, 0)
    num_prefix = tl.sum(tl.load(prefix_count + row * num_splits + split, mask=ok, other=0), 0)
    mass_prefix = tl.sum(tl.load(prefix_mass + row * num_splits + split, mask=ok, other=0.0), 0)
    d_lo = tl.load(plan_f + row * 4 + _D_LO)
    scale = tl.load(plan_f + row * 4 + _SCALE)
    d_hi = tl.load(plan_f + row * 4 + _D_HI)

    jf = j.to(tl.float32)
    upper = tl.exp(-(d_lo + jf / scale)) * (1.0 + _BOUND_SLACK)
    lower = tl.where(j == NUM_BINS - 2, tl.exp(-d_hi), tl.exp(-(d_lo + (jf + 1.0) / scale))) * (1.0 - _BOUND_SLACK)
    cf = counts.to(tl.float32)
    cum_count = num_prefix.to(tl.float32) + tl.cumsum(cf, 0)
    mass_hi = mass_prefix + tl.cumsum(cf * tl.where(real, upper, 0.0), 0)
    mass_lo = mass_prefix + tl.cumsum(cf * tl.where(real, lower, 0.0), 0)

    # top-k: the bin of the k-th element, r elements of it inside the top k
    b_k = tl.where(k_on, tl.minimum(tl.sum((real & (cum_count < k)).to(tl.int32), 0), NUM_BINS - 2), NUM_BINS - 2)
    before = j < b_k
    r = k - num_prefix.to(tl.float32) - tl.sum(tl.where(before, cf, 0.0), 0)
    zk_lo = mass_prefix + tl.sum(tl.where(before, cf * lower, 0.0), 0) + r * tl.sum(tl.where(j == b_k, lower, 0.0), 0)
    zk_hi = mass_prefix + tl.sum(tl.where(before, cf * upper, 0.0), 0) + r * tl.sum(tl.where(j == b_k, upper, 0.0), 0)
    zk_lo = tl.where(k_on, zk_lo, total * (1.0 - _BOUND_SLACK))
    zk_hi = tl.where(k_on, zk_hi, total * (1.0 + _BOUND_SLACK))
    # top-p: bins before b1 certainly kept, bins after b2 certainly dropped
    b1 = tl.sum((real & (mass_hi < p * zk_lo)).to(tl.int32), 0)
    b2 = tl.minimum(tl.sum((real & (mass_lo < p * zk_hi)).to(tl.int32), 0), NUM_BINS - 2)
    lo = tl.where(p_on, tl.where(k_on, tl.minimum(b1, b_k), b1), b_k)
    hi = tl.where(k_on, b_k, b2)

    in_window = real & (j >= lo) & (j <= hi)
    num_window = tl.sum(tl.where(in_window, counts, 0), 0)
    if num_window <= capacity:
        tl.store(plan_i + row * 8 + _STATUS, WINDOW)
        per_split = tl.sum(tl.where(in_window[None, :], part, 0), 1)  # [S_PAD]
        tl.store(window_offsets + row * num_splits + split, tl.cumsum(per_split, 0) - per_split, mask=ok)
    elif LAST_ROUND:
        tl.store(plan_i + row * 8 + _STATUS, LAST_RESORT)
    else:
        # re-bin [edge lo, edge hi+1) into NUM_BINS-1 bins; an open last bin ends past max d
        new_lo = d_lo + lo.to(tl.float32) / scale
        new_hi = tl.where((hi == NUM_BINS - 2) & (d_hi == float("inf")), (top - s_min) * 1.0001 + 1e-6,
                          d_lo + (hi + 1).to(tl.float32) / scale)
        tl.store(plan_f + row * 4 + _D_LO, new_lo)
        tl.store(plan_f + row * 4 + _SCALE, (NUM_BINS - 1) / (new_hi - new_lo))
        tl.store(plan_f + row * 4 + _D_HI, new_hi)
    tl.store(plan_i + row * 8 + _LO, lo)
    tl.store(plan_i + row * 8 + _HI, hi)
    tl.store(plan_i + row * 8 + _NUM_PREFIX, num_prefix + tl.sum(tl.where(j < lo, counts, 0), 0))
    tl.store(plan_i + row * 8 + _NUM_WINDOW, num_window)


@triton.jit(do_not_specialize_on_alignment=["temperature", "min_p", "seeds", "offsets"])
def _sample_compact_kernel(logits, stride_row, temperature, min_p, seeds, offsets, stats, argmax, plan_i, plan_f,
                           window_offsets, window_value, window_token, race_value, race_token, prefix_mass, V,
                           num_splits, capacity, S_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                           NUM_BINS: tl.constexpr):
    """Sampled rows, program (row, split): race over the prefix (min-p applies; the other filters
    keep it all) -> race_value / race_token[row, split]; exact prefix mass -> prefix_mass; WINDOW
    rows also append their window elements (s, token) to the row's scratch list, in token order."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    status = tl.load(plan_i + row * 8 + _STATUS)
    if status == GREEDY:
        return
    top, _, _, _, _ = _row_stats(stats, argmax, row, num_splits, S_PAD)
    t = tl.maximum(tl.load(temperature + row), 1e-6)
    floor_p = tl.load(min_p + row)
    row_hash = row_hash_tl(tl.load(seeds + row), tl.load(offsets + row))
    if status == NO_FILTER:
        d_lo = 3.0e38  # everything finite is prefix
        scale = 1.0
        d_hi = float("inf")
        lo = 0
        hi = 0
    else:
        d_lo = tl.load(plan_f + row * 4 + _D_LO)
        scale = tl.load(plan_f + row * 4 + _SCALE)
        d_hi = tl.load(plan_f + row * 4 + _D_HI)
        lo = tl.load(plan_i + row * 8 + _LO)
        hi = tl.load(plan_i + row * 8 + _HI)
    compact = status == WINDOW
    position = 0
    if compact:
        position = tl.load(window_offsets + row * num_splits + split)
    row_ptr = logits + row.to(tl.int64) * stride_row
    best = float("-inf")
    best_token = 0
    mass = 0.0
    for start in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < V
        s = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32) / t
        prefix, window = _classify(top - s, valid, d_lo, scale, d_hi, lo, hi, NUM_BINS)
        if tl.sum(prefix.to(tl.int32), 0) > 0:  # most blocks of a peaked row hold no prefix
            e = tl.exp(s - top)
            mass += tl.sum(tl.where(prefix, e, 0.0), 0)
            value, token = race_block(s, offs, prefix & (e >= floor_p), top, row_hash)
            best_token = tl.where(value > best, token, best_token)
            best = tl.maximum(best, value)
        if compact:
            n = window.to(tl.int32)
            slot = row.to(tl.int64) * capacity + position + tl.cumsum(n, 0) - 1
            tl.store(window_value + slot, s, mask=window)
            tl.store(window_token + slot, offs, mask=window)
            position += tl.sum(n, 0)
    tl.store(race_value + row * num_splits + split, best)
    tl.store(race_token + row * num_splits + split, best_token)
    tl.store(prefix_mass + row * num_splits + split, mass)


@triton.jit
def _reduce_keys(threshold, lower, key, e, valid, MODE: tl.constexpr):
    """MODE 0: #(key >= threshold); 1: sum of e over key >= threshold; 2: sum of e over
    key > threshold and key >= lower. Float32 either way (counts stay exact below 2^24)."""
    if MODE == 0:
        return tl.sum((valid & (key >= threshold)).to(tl.float32), 0)
    elif MODE == 1:
        return tl.sum(tl.where(valid & (key >= threshold), e, 0.0), 0)
    else:
        return tl.sum(tl.where(valid & (key > threshold) & (key >= lower), e, 0.0), 0)


@triton.jit
def _window_reduce(threshold, lower, key, e, valid, row_ptr, V, t, top, d_lo, scale, d_hi, lo, hi,
                   MODE: tl.constexpr, FROM_ROW: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):
    """`_reduce_keys` over the window: from registers (key, e, valid), or, FROM_ROW, streaming
    the row and classifying each element as `_sample_compact_kernel` does."""
    if FROM_ROW:
        acc = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            s = tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) / t
            _, window = _classify(top - s, ok, d_lo, scale, d_hi, lo, hi, NUM_BINS)
            acc += _reduce_keys(threshold, lower, order_key(s), tl.exp(s - top), window, MODE)
        return acc
    else:
        return _reduce_keys(threshold, lower, key, e, valid, MODE)


@triton.jit
def _window_select(key, e, s, token, valid, row_ptr, V, t, top, total, d_lo, scale, d_hi, lo, hi, num_prefix,
                   mass_prefix, k, k_on, p, p_on, floor_p, row_hash, FROM_ROW: tl.constexpr, BLOCK: tl.constexpr,
                   NUM_BINS: tl.constexpr):
    """Exact thresholds over the window (prefix known by count and mass), then the race over the
    kept window elements. -> (best value, its token).

    key_k = the largest key with num_prefix + #(key >= key_k) >= k: the k-th largest s.
    Z_k = mass_prefix + mass(key >= key_k). key_p = the largest key with
    mass_prefix + mass(key > key_p, within top k) >= p * Z_k: an element is kept iff the mass
    strictly above it is < p * Z_k, i.e. iff key > key_p (capped below the row's maximum, which
    always stays). Both built bit by bit from the top (32 steps)."""
    key_k = tl.zeros([], dtype=tl.int64)
    z_k = total
    if k_on:
        for step in range(32):
            candidate = key_k | (tl.full([], 1, tl.int64) << (31 - step))
            count = num_prefix + _window_reduce(candidate, key_k, key, e, valid, row_ptr, V, t, top, d_lo, scale,
                                                d_hi, lo, hi, 0, FROM_ROW, BLOCK, NUM_BINS)
            key_k = tl.where(count >= k, candidate, key_k)
        z_k = mass_prefix + _window_reduce(key_k, key_k, key, e, valid, row_ptr, V, t, top, d_lo, scale, d_hi,
                                           lo, hi, 1, FROM_ROW, BLOCK, NUM_BINS)
    key_p = tl.full([], -1, tl.int64)
    if p_on:
        key_p = tl.zeros([], dtype=tl.int64)
        target = p * z_k
        for step in range(32):
            candidate = key_p | (tl.full([], 1, tl.int64) << (31 - step))
            mass = mass_prefix + _window_reduce(candidate, key_k, key, e, valid, row_ptr, V, t, top, d_lo, scale,
                                                d_hi, lo, hi, 2, FROM_ROW, BLOCK, NUM_BINS)
            key_p = tl.where(mass >= target, candidate, key_p)
        key_p = tl.minimum(key_p, order_key(top) - 1)
    if FROM_ROW:
        best = float("-inf")
        best_token = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            s_block = tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) / t
            _, window = _classify(top - s_block, ok, d_lo, scale, d_hi, lo, hi, NUM_BINS)
            key_block = order_key(s_block)
            kept = window & (key_block >= key_k) & (key_block > key_p) & (tl.exp(s_block - top) >= floor_p)
            value, winner = race_block(s_block, offs, kept, top, row_hash)
            best_token = tl.where(value > best, winner, best_token)
            best = tl.maximum(best, value)
        return best, best_token
    else:
        kept = valid & (key >= key_k) & (key > key_p) & (e >= floor_p)
        return race_block(s, token, kept, top, row_hash)


@triton.jit(do_not_specialize_on_alignment=["temperature", "top_k", "top_p", "min_p", "seeds", "offsets"])
def _sample_select_kernel(logits, stride_row, temperature, top_k, top_p, min_p, seeds, offsets, stats, argmax,
                          plan_i, plan_f, window_value, window_token, race_value, race_token, prefix_mass,
                          tokens, logprobs, V, num_splits, capacity, S_PAD: tl.constexpr, CAPACITY: tl.constexpr,
                          BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):
    """One row: the token (greedy, or the race winner of prefix and window) and its log-prob
    under the raw logits."""
    row = tl.program_id(0)
    top, total, log_z, _, token = _row_stats(stats, argmax, row, num_splits, S_PAD)
    status = tl.load(plan_i + row * 8 + _STATUS)
    row_ptr = logits + row.to(tl.int64) * stride_row
    if status != GREEDY:
        split = tl.arange(0, S_PAD)
        ok = split < num_splits
        values = tl.load(race_value + row * num_splits + split, mask=ok, other=float("-inf"))
        best = tl.max(values, 0)
        token = tl.min(tl.where(values == best, tl.load(race_token + row * num_splits + split, mask=ok, other=0),
                                2147483647), 0)
        if status != NO_FILTER:
            t = tl.maximum(tl.load(temperature + row), 1e-6)
            k = tl.load(top_k + row).to(tl.float32)
            p = tl.load(top_p + row)
            k_on = (k > 0) & (k < V)
            p_on = p < 1.0
            floor_p = tl.load(min_p + row)
            row_hash = row_hash_tl(tl.load(seeds + row), tl.load(offsets + row))
            num_prefix = tl.load(plan_i + row * 8 + _NUM_PREFIX).to(tl.float32)
            mass_prefix = tl.sum(tl.load(prefix_mass + row * num_splits + split, mask=ok, other=0.0), 0)
            d_lo = tl.load(plan_f + row * 4 + _D_LO)
            scale = tl.load(plan_f + row * 4 + _SCALE)
            d_hi = tl.load(plan_f + row * 4 + _D_HI)
            lo = tl.load(plan_i + row * 8 + _LO)
            hi = tl.load(plan_i + row * 8 + _HI)
            # the window in registers (LAST_RESORT rows leave it empty and stream the row)
            slot = tl.arange(0, CAPACITY)
            valid = slot < tl.where(status == WINDOW, tl.load(plan_i + row * 8 + _NUM_WINDOW), 0)
            s = tl.load(window_value + row.to(tl.int64) * capacity + slot, mask=valid, other=float("-inf"))
            window_tokens = tl.load(window_token + row.to(tl.int64) * capacity + slot, mask=valid, other=0)
            key = order_key(s)
            e = tl.exp(s - top)
            if status == WINDOW:
                value, winner = _window_select(key, e, s, window_tokens, valid, row_ptr, V, t, top, total, d_lo,
                                               scale, d_hi, lo, hi, num_prefix, mass_prefix, k, k_on, p, p_on,
                                               floor_p, row_hash, False, BLOCK, NUM_BINS)
            else:
                value, winner = _window_select(key, e, s, window_tokens, valid, row_ptr, V, t, top, total, d_lo,
                                               scale, d_hi, lo, hi, num_prefix, mass_prefix, k, k_on, p, p_on,
                                               floor_p, row_hash, True, BLOCK, NUM_BINS)
            token = tl.where((value > best) | ((value == best) & (winner < token)), winner, token)
    tl.store(tokens + row, token.to(tl.int64))
    tl.store(logprobs + row, tl.load(row_ptr + token).to(tl.float32) - log_z)


_SAMPLE_CHUNK = 16384    # elements of a row per program in the streaming passes
_SAMPLE_BLOCK = 2048     # elements per loop step inside a program
_SAMPLE_BINS = 256       # histogram bins per round (the last one collects what is outside)
_SAMPLE_CAPACITY = 4096  # window elements a row may keep in registers for the exact search


def _check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, offsets, chunk, block, num_bins,
                       capacity) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits [B, V], unit stride along V"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16), f"logits: dtype {logits.dtype}"
    batch = logits.shape[0]
    for name, x, dtypes in (("temperature", temperature, (torch.float32,)),
                            ("top_k", top_k, (torch.int64, torch.int32)), ("top_p", top_p, (torch.float32,)),
                            ("min_p", min_p, (torch.float32,)), ("seeds", seeds, (torch.int64,)),
                            ("offsets", offsets, (torch.int64,))):
        assert x.shape == (batch,) and x.is_contiguous(), f"{name}: expected contiguous [{batch}], got {tuple(x.shape)}"
        assert x.dtype in dtypes, f"{name}: dtype {x.dtype} not in {dtypes}"
        assert x.device == logits.device, f"{name} on {x.device}, logits on {logits.device}"
    assert chunk % block == 0 and num_bins & (num_bins - 1) == 0 and capacity & (capacity - 1) == 0, \
        "tiling: chunk a multiple of block, num_bins and capacity powers of two"


def launch_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *, chunk: int = _SAMPLE_CHUNK,
                  block: int = _SAMPLE_BLOCK, num_bins: int = _SAMPLE_BINS,
                  capacity: int = _SAMPLE_CAPACITY, statuses: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` with its tiling exposed (tests shrink it to reach every path on small rows);
    `statuses` ([B] int32), when given, receives each row's path (GREEDY .. LAST_RESORT)."""
    _check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, offsets, chunk, block, num_bins, capacity)
    batch, vocab = logits.shape
    assert out is None or (out.shape == (batch,) and out.dtype == torch.int64 and out.is_contiguous()
                           and out.device == logits.device), "out: contiguous int64 [B] on the logits' device"
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device) if out is None else out
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return tokens, logprobs
    num_splits = triton.cdiv(vocab, chunk)
    s_pad = triton.next_power_of_2(num_splits)
    new = lambda *shape, dtype=torch.int32: torch.empty(shape, dtype=dtype, device=logits.device)
    stats, argmax = new(batch, num_splits, 5, dtype=torch.float32), new(batch, num_splits)
    plan_i, plan_f = new(batch, 8), new(batch, 4, dtype=torch.float32)
    hist = new(batch, num_splits, num_bins)
    prefix_count, prefix_mass = new(batch, num_splits), new(batch, num_splits, dtype=torch.float32)
    window_offsets = new(batch, num_splits)
    window_value, window_token = new(batch, capacity, dtype=torch.float32), new(batch, capacity)
    race_value, race_token = new(batch, num_splits, dtype=torch.float32), new(batch, num_splits)
    grid = (batch, num_splits)
    params = dict(CHUNK=chunk, BLOCK=block, num_warps=8)
    _sample_stats_kernel[grid](logits, logits.stride(0), temperature, top_k, top_p, stats, argmax, plan_i, plan_f,
                               vocab, num_splits, **params)
    for last_round in (False, True):
        _sample_hist_kernel[grid](logits, logits.stride(0), temperature, stats, argmax, plan_i, plan_f, hist,
                                  prefix_count, prefix_mass, vocab, num_splits, S_PAD=s_pad, NUM_BINS=num_bins,
                                  **params)
        _sample_plan_kernel[(batch,)](stats, argmax, top_k, top_p, plan_i, plan_f, hist, prefix_count, prefix_mass,
                                      window_offsets, vocab, num_splits, capacity, LAST_ROUND=last_round, S_PAD=s_pad,
                                      NUM_BINS=num_bins, num_warps=4)
    _sample_compact_kernel[grid](logits, logits.stride(0), temperature, min_p, seeds, offsets, stats, argmax, plan_i,
                                 plan_f, window_offsets, window_value, window_token, race_value, race_token,
                                 prefix_mass, vocab, num_splits, capacity, S_PAD=s_pad, NUM_BINS=num_bins, **params)
    _sample_select_kernel[(batch,)](logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets, stats,
                                    argmax, plan_i, plan_f, window_value, window_token, race_value, race_token,
                                    prefix_mass, tokens, logprobs, vocab, num_splits, capacity, S_PAD=s_pad,
                                    CAPACITY=capacity, BLOCK=block, NUM_BINS=num_bins, num_warps=8)
    if statuses is not None:
        statuses.copy_(plan_i[:, _STATUS.value])
    return tokens, logprobs


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
           out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `sample_reference`: same arguments, same tokens (ties aside), same log-probs; the
    tokens written into out when given (a step's token buffer: no copy after the draw)."""
    return launch_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, out=out)
