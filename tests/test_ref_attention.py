"""The paged-attention and KV-write torch references (kernels/attention.py) against a naive
float64 softmax attention over contiguous per-row K/V written here.

Contracts checked: write_kv puts token t at block_table[pos // bs] * bs + pos % bs and touches
nothing else; paged attention over ragged rows (decode q_len 1, verify q_len 4, prefill chunks
over cached prefixes of 0, 1, non-multiple-of-block and many-block lengths) with shuffled,
non-contiguous block ids (block 0 is the null block, never a real row's), block sizes 4 and 16,
GQA ratios 1 and 4, equals per-row causal softmax attention; head h reads kv head h // (Hq/Hkv);
with an output gate, that times sigmoid(gate).
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS

paged_attention_reference = REFERENCE_OPS.paged_attention
write_kv_reference = REFERENCE_OPS.write_kv

RTOL = 1e-4

# (q_len, cached prefix length): decode/verify rows first, prefill chunks after, as the runner
# orders them. Prefixes: 0, 1, not a multiple of any block size, and long (many blocks).
ROWS = [(1, 36), (4, 17), (1, 0), (4, 150), (9, 0), (6, 1), (12, 13), (3, 150)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL, what: str = "") -> None:
    actual, expected = actual.double(), expected.double()
    scale = float(expected.abs().max())
    error = (actual - expected).abs()
    worst = float((error - rtol * (expected.abs() + scale)).max())
    assert worst <= 0, f"{what}: max abs error {float(error.max()):.3e} (scale {scale:.3e})"


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """One row in float64: q [L, Hq, D] at positions prefix..prefix+L-1; keys/values
    [prefix+L, Hkv, D] contiguous. Query i attends to keys 0..prefix+i."""
    q_len, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    out = torch.empty(q_len, num_heads, head_dim, dtype=torch.float64)
    for i in range(q_len):
        visible = prefix + i + 1
        for h in range(num_heads):
            k = keys[:visible, h // group].double()
            v = values[:visible, h // group].double()
            scores = (k @ q[i, h].double()) * scale
            weights = torch.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ v
    return out


class PagedCase:
    """Ragged rows with their true contiguous K/V, a shuffled block allocation and a KV cache
    whose unused positions hold `stale` (finite garbage by default)."""

    def __init__(self, gen: torch.Generator, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 stale: float | None = None) -> None:
        self.block_size, self.head_dim = block_size, head_dim
        contexts = [q_len + prefix for q_len, prefix in ROWS]
        blocks_per_row = [math.ceil(c / block_size) for c in contexts]
        num_blocks = 1 + sum(blocks_per_row) + 5              # block 0 (null) + rows + spare
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.block_tables = torch.zeros(len(ROWS), max(blocks_per_row) + 2, dtype=torch.int32)  # padding -> block 0
        for r, n in enumerate(blocks_per_row):
            self.block_tables[r, :n] = torch.tensor(ids[:n])
            ids = ids[n:]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if stale is None:
            self.k_cache, self.v_cache = 3 * torch.randn(shape, generator=gen), 3 * torch.randn(shape, generator=gen)
        else:
            self.k_cache, self.v_cache = torch.full(shape, stale), torch.full(shape, stale)
        self.keys = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in contexts]
        self.values = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in contexts]
        self.q = torch.randn(sum(q for q, _ in ROWS), num_heads, head_dim, generator=gen)
        self.cu_seqlens = torch.tensor([0] + [q for q, _ in ROWS]).cumsum(0).to(torch.int32)
        self.context_lens = torch.tensor(contexts, dtype=torch.int32)

    def location(self, row: int, pos: int) -> tuple[int, int]:
        return int(self.block_tables[row, pos // self.block_size]), pos % self.block_size

    def write_prefixes(self) -> None:
        """The cached prefix of each row, put in place token by token (not via write_kv)."""
        for r, (_, prefix) in enumerate(ROWS):
            for pos in range(prefix):
                block, offset = self.location(r, pos)
                self.k_cache[block, offset] = self.keys[r][pos]
                self.v_cache[block, offset] = self.values[r][pos]

    def new_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's k, v [T, Hkv, D] and slot_mapping [T] (flat block * bs + offset)."""
        ks, vs, mapping = [], [], []
        for r, (q_len, prefix) in enumerate(ROWS):
            for pos in range(prefix, prefix + q_len):
                block, offset = self.location(r, pos)
                ks.append(self.keys[r][pos])
                vs.append(self.values[r][pos])
                mapping.append(block * self.block_size + offset)
        return torch.stack(ks), torch.stack(vs), torch.tensor(mapping, dtype=torch.int64)

    def expected(self) -> torch.Tensor:
        scale = self.head_dim ** -0.5
        outs, start = [], 0
        for r, (q_len, prefix) in enumerate(ROWS):
            outs.append(naive_attention(self.q[start:start + q_len], self.keys[r], self.values[r], prefix, scale))
            start += q_len
        return torch.cat(outs)

    def attend(self) -> torch.Tensor:
        return paged_attention_reference(self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens,
                                         self.context_lens, self.head_dim ** -0.5)


CONFIGS = [(4, 4, 4, 32), (4, 8, 2, 32), (16, 4, 4, 32), (16, 8, 2, 32), (16, 4, 1, 256)]
CONFIG_IDS = ["bs4-mha", "bs4-gqa4", "bs16-mha", "bs16-gqa4", "bs16-gqa4-d256"]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", CONFIGS, ids=CONFIG_IDS)
def test_write_kv_places_tokens_by_slot_mapping_only(block_size, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size * 100 + num_heads + head_dim)
    case = PagedCase(gen, block_size, num_heads, num_kv_heads, head_dim)
    k, v, mapping = case.new_tokens()
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    for t, flat in enumerate(mapping.tolist()):
        expected_k[flat // block_size, flat % block_size] = k[t]
        expected_v[flat // block_size, flat % block_size] = v[t]
    write_kv_reference(k, v, case.k_cache, case.v_cache, mapping)
    assert torch.equal(case.k_cache, expected_k) and torch.equal(case.v_cache, expected_v)


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", CONFIGS, ids=CONFIG_IDS)
def test_paged_attention_matches_naive_softmax(block_size, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size * 10 + num_heads + head_dim)
    case = PagedCase(gen, block_size, num_heads, num_kv_heads, head_dim)
    case.write_prefixes()
    k, v, mapping = case.new_tokens()
    write_kv_reference(k, v, case.k_cache, case.v_cache, mapping)
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    out = case.attend()
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    expected = case.expected()
    start = 0
    for r, (q_len, prefix) in enumerate(ROWS):
        assert_close(out[start:start + q_len], expected[start:start + q_len], what=f"row {r} (q_len {q_len}, prefix {prefix})")
        start += q_len
    assert torch.equal(case.k_cache, k_before) and torch.equal(case.v_cache, v_before), "attention wrote the cache"


def test_paged_attention_row_is_independent_of_batch():
    """A row's output alone equals its output inside the ragged batch (bit-exact is not
    required across shapes; the float64 truth is the arbiter)."""
    gen = torch.Generator().manual_seed(5)
    case = PagedCase(gen, 4, 8, 2, 32)
    case.write_prefixes()
    k, v, mapping = case.new_tokens()
    write_kv_reference(k, v, case.k_cache, case.v_cache, mapping)
    batch_out = case.attend()
    start = 0
    for r, (q_len, _) in enumerate(ROWS):
        alone = paged_attention_reference(case.q[start:start + q_len], case.k_cache, case.v_cache,
                                          case.block_tables[r:r + 1], torch.tensor([0, q_len], dtype=torch.int32),
                                          case.context_lens[r:r + 1], case.head_dim ** -0.5)
        assert_close(alone, batch_out[start:start + q_len], rtol=1e-5, what=f"row {r} alone vs batched")
        start += q_len


def test_paged_attention_never_reads_positions_past_context():
    """KV positions a row does not own (the null block 0 that pads block tables, the tail of its
    last block, other blocks) may hold anything, including NaN written by pad rows of a CUDA
    graph; they must not reach a real row's output (masked probability 0 times NaN is NaN)."""
    gen = torch.Generator().manual_seed(6)
    case = PagedCase(gen, 16, 8, 2, 32, stale=float("nan"))
    case.write_prefixes()
    k, v, mapping = case.new_tokens()
    write_kv_reference(k, v, case.k_cache, case.v_cache, mapping)
    assert_close(case.attend(), case.expected(), what="outputs with NaN in unowned KV positions")


def test_paged_attention_output_gate():
    """With a gate (a strided [T, Hq, D] view, as the model slices it from [q | gate] per head),
    the output is attention * sigmoid(gate), computed before the one rounding."""
    gen = torch.Generator().manual_seed(7)
    case = PagedCase(gen, 16, 8, 2, 32)
    case.write_prefixes()
    k, v, mapping = case.new_tokens()
    write_kv_reference(k, v, case.k_cache, case.v_cache, mapping)
    gate = (3 * torch.randn(case.q.shape[0], case.q.shape[1], 2 * case.head_dim, generator=gen))[..., case.head_dim:]
    out = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens,
                                    case.context_lens, case.head_dim ** -0.5, gate)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, case.expected() * torch.sigmoid(gate.double()), what="gated output")
