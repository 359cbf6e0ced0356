"""Paged attention and the KV write (kernels/attention.py): the torch references against naive
float64 softmax attention over contiguous per-row K/V written here, then the Triton kernels
against the references.

References. Contracts checked: write_kv puts token t at block_table[pos // bs] * bs + pos % bs
and touches nothing else; paged attention over ragged rows (decode q_len 1, verify q_len 4,
prefill chunks over cached prefixes of 0, 1, non-multiple-of-block and many-block lengths) with
shuffled, non-contiguous block ids (block 0 is the null block, never a real row's), block sizes
4 and 16, GQA ratios 1 and 4, equals per-row causal softmax attention; head h reads kv head
h // (Hq/Hkv); with an output gate, that times sigmoid(gate).

Triton paged_attention, with the reference as the oracle (the Triton KV write runs with the
q/k norm: test_rope.py; here it feeds the graph test). Inputs are fresh seeded
random draws (no zeros), outputs are poisoned with NaN before the kernel runs, and pool positions
a batch does not own hold finite garbage (or NaN) and must stay bit-identical. Rows mix decode
(q_len 1), verify (q_len <= 8) and prefill chunks over cached prefixes of length 0, 1, not a
multiple of the block size, and many blocks, in one batch. Block ids are shuffled; block 0 is
the null block that pads block tables.

CPU: the interpreter, fp32/fp16, head_dim 32/64, block sizes 4/16, every tile kind (decode tile,
prefill tile, split key range) through explicit configs plus the launcher's own choice, with and
without the output gate (attention * sigmoid(gate), fused into whichever kernel stores the output).
GPU (`gpu` marker): bf16, head_dim 128/256, GQA 1/4/8, block sizes 16/64, the launcher's choice
and the prefill/split configs, long contexts, the gate, and capture in a CUDA graph.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS, attention
from deltaspec.kernels.attention import launch_paged_attention, paged_attention, write_kv_reference
from deltaspec.kernels.rope import QKNormRopeKV, qk_norm_rope_kv, qk_norm_rope_kv_reference
from deltaspec.kernels.tiles import TileConfig
from kernel_helpers import assert_close_elementwise


# Through the backend table, so the tests follow the references wherever they live.
paged_attention_reference = REFERENCE_OPS.paged_attention

# (q_len, cached prefix length): decode/verify rows first, prefill chunks after, as the runner
# orders them. Prefixes: 0, 1, not a multiple of any block size, and long (many blocks).
ROWS = [(1, 36), (4, 17), (1, 0), (4, 150), (9, 0), (6, 1), (12, 13), (3, 150)]


# ----------------------------------------------------------------------------------------------
# Torch references vs naive float64 attention
# ----------------------------------------------------------------------------------------------

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
        assert_close_elementwise(out[start:start + q_len], expected[start:start + q_len], what=f"row {r} (q_len {q_len}, prefix {prefix})")
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
        assert_close_elementwise(alone, batch_out[start:start + q_len], rtol=1e-5, what=f"row {r} alone vs batched")
        start += q_len


def test_paged_attention_reference_never_reads_positions_past_context():
    """KV positions a row does not own (the null block 0 that pads block tables, the tail of its
    last block, other blocks) may hold anything, including NaN written by pad rows of a CUDA
    graph; they must not reach a real row's output (masked probability 0 times NaN is NaN)."""
    gen = torch.Generator().manual_seed(6)
    case = PagedCase(gen, 16, 8, 2, 32, stale=float("nan"))
    case.write_prefixes()
    k, v, mapping = case.new_tokens()
    write_kv_reference(k, v, case.k_cache, case.v_cache, mapping)
    assert_close_elementwise(case.attend(), case.expected(), what="outputs with NaN in unowned KV positions")


def test_paged_attention_reference_output_gate():
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
    assert_close_elementwise(out, case.expected() * torch.sigmoid(gate.double()), what="gated output")


# ----------------------------------------------------------------------------------------------
# Triton kernels vs the torch references
# ----------------------------------------------------------------------------------------------

GPU_ROWS = [(1, 1000), (1, 0), (4, 37), (8, 300), (2, 63), (200, 0), (77, 1), (130, 517), (16, 2048)]

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_case(seed: int, rows, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: str, stale: float | None = None) -> SimpleNamespace:
    """Rows' K/V written into shuffled blocks of a pool whose other positions hold `stale`
    (random garbage when None). q and gate are strided views, as the model slices them from
    [q | gate] per head."""
    gen = torch.Generator().manual_seed(seed)
    contexts = [q_len + prefix for q_len, prefix in rows]
    blocks_per_row = [math.ceil(c / block_size) for c in contexts]
    num_blocks = 1 + sum(blocks_per_row) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(rows), max(blocks_per_row) + 2, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if stale is None:
        k_cache, v_cache = 3 * torch.randn(shape, generator=gen), 3 * torch.randn(shape, generator=gen)
    else:
        k_cache, v_cache = torch.full(shape, stale), torch.full(shape, stale)
    for r, (n, context) in enumerate(zip(blocks_per_row, contexts)):
        block_tables[r, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
        pos = torch.arange(context)
        flat = block_tables[r].long()[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[flat] = torch.randn(context, num_kv_heads, head_dim, generator=gen)
        v_cache.view(-1, num_kv_heads, head_dim)[flat] = torch.randn(context, num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(q_len for q_len, _ in rows)
    q_gate = torch.randn(num_tokens, num_heads, 2 * head_dim, generator=gen)
    to = dict(device=device)
    q_gate = q_gate.to(dtype=dtype, **to)
    return SimpleNamespace(
        q=q_gate[..., :head_dim], gate=q_gate[..., head_dim:], k_cache=k_cache.to(dtype=dtype, **to),
        v_cache=v_cache.to(dtype=dtype, **to), block_tables=block_tables.to(**to),
        cu_seqlens=torch.tensor([0] + [q for q, _ in rows]).cumsum(0).to(torch.int32).to(**to),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device), scale=head_dim ** -0.5)


def reference(case: SimpleNamespace, gate: torch.Tensor | None = None) -> torch.Tensor:
    return paged_attention_reference(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens,
                                     case.context_lens, case.scale, gate)


def launch(case: SimpleNamespace, config: TileConfig, gate: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device=case.q.device)
    launch_paged_attention(out, case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens,
                           case.context_lens, case.scale, config, gate)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Max error relative to the largest reference magnitude; NaN never passes."""
    error = float((actual.float() - expected.float()).abs().max())
    scale = float(expected.float().abs().max())
    assert error <= rtol * scale, f"{what}: max abs error {error:.3e} (scale {scale:.3e}, rtol {rtol})"


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN included."""
    as_int = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def check_attention(case: SimpleNamespace, config: TileConfig | None, what: str, gated: bool = False) -> None:
    """gated: the output gate of the Qwen3.5 attention, applied by the kernel that stores the
    output (the attention kernel, or the split merge)."""
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    gate = case.gate if gated else None
    if config is None:
        out = paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens,
                              case.context_lens, case.scale, gate)
    else:
        out = launch(case, config, gate)
    expected = reference(case, gate)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert_close(out, expected, TOLERANCE[case.q.dtype], what)
    assert bit_equal(case.k_cache, k_before) and bit_equal(case.v_cache, v_before), "attention wrote the pool"


# --------------------------------------------------------------------------- CPU (interpreter) and GPU

# (block_size, Hq, Hkv, D, dtype, config): decode tiles (16 rows), prefill tiles (several tokens
# x heads), split key ranges, GQA 1 / 3 (not a power of two) / 4 / 8; key steps that cover whole
# blocks, lie inside one block (32 / 16) or straddle blocks (6 / 16).
CPU_CASES = [
    (4, 4, 4, 32, torch.float32, TileConfig(block_m=16, block_n=16, num_splits=1, num_warps=4, num_stages=1)),
    (16, 8, 2, 32, torch.float32, TileConfig(block_m=32, block_n=32, num_splits=1, num_warps=4, num_stages=1)),
    pytest.param(16, 8, 2, 64, torch.float16,
                 TileConfig(block_m=16, block_n=32, num_splits=3, num_warps=4, num_stages=1), marks=pytest.mark.slow),
    (4, 6, 2, 32, torch.float32, TileConfig(block_m=16, block_n=16, num_splits=2, num_warps=4, num_stages=1)),
    (16, 8, 1, 32, torch.float16, TileConfig(block_m=64, block_n=16, num_splits=1, num_warps=4, num_stages=1)),
    (32, 8, 2, 32, torch.float32, TileConfig(block_m=16, block_n=16, num_splits=3, num_warps=4, num_stages=1)),
    (6, 4, 2, 32, torch.float16, TileConfig(block_m=32, block_n=16, num_splits=1, num_warps=4, num_stages=1)),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype,config", CPU_CASES,
                         ids=["bs4-mha-decode-tile", "bs16-gqa4-prefill-tile", "bs16-gqa4-d64-fp16-split3",
                              "bs4-gqa3-split2", "bs16-gqa8-fp16-tile64", "bs32-steps-in-block-split3",
                              "bs6-steps-straddle-blocks"])
def test_paged_attention_matches_reference(kernel_device, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                           config):
    case = make_case(block_size + num_heads + head_dim, ROWS, block_size, num_heads, num_kv_heads, head_dim, dtype,
                     kernel_device)
    check_attention(case, config, f"{config}")


@pytest.mark.parametrize("dtype,config", [
    (torch.float32, TileConfig(block_m=16, block_n=16, num_splits=2, num_warps=4, num_stages=1)),
    (torch.float16, TileConfig(block_m=32, block_n=32, num_splits=1, num_warps=4, num_stages=1)),
], ids=["fp32-decode-split2", "fp16-prefill-tile"])
def test_paged_attention_reads_an_fp8_pool(kernel_device, dtype, config):
    """Keys and values in e4m3 (EngineConfig.kv_cache_dtype "fp8"): the kernel widens them to the
    queries' dtype exactly, so it matches the reference over the same FP8 pool, gated, split or
    not (the pool's stale entries past each row's context stay unread)."""
    case = make_case(77, ROWS, 16, 8, 2, 32, dtype, kernel_device)
    case.k_cache, case.v_cache = case.k_cache.to(torch.float8_e4m3fn), case.v_cache.to(torch.float8_e4m3fn)
    check_attention(case, config, f"fp8 pool, {config}", gated=True)


def test_paged_attention_launcher_choice(kernel_device):
    """The launcher's own configs: a ragged mixed batch, and one decode row over a long context
    (which splits the key range: 2 programs leave SMs idle, also the 4 the interpreter assumes)."""
    mixed = make_case(1, ROWS, 16, 8, 2, 32, torch.float32, kernel_device)
    check_attention(mixed, None, "mixed batch")
    decode = make_case(2, [(1, 300)], 16, 8, 2, 32, torch.float32, kernel_device)
    check_attention(decode, None, "long decode")


def test_paged_attention_split_merge_chunks(kernel_device):
    """40 splits merged in chunks of COMBINE_SPLIT_CHUNK (32: a full chunk and a ragged one), over D
    blocks of COMBINE_BLOCK_D; splits past a short row's keys see none (weight 0)."""
    assert attention.COMBINE_SPLIT_CHUNK == 32 and 128 // attention.COMBINE_BLOCK_D >= 2
    case = make_case(7, [(1, 600), (2, 45)], 16, 8, 2, 128, torch.float32, kernel_device)
    check_attention(case, TileConfig(block_m=16, block_n=16, num_splits=40, num_warps=4, num_stages=1), "40 splits",
                    gated=True)


@pytest.mark.parametrize("config,dtype", [
    (TileConfig(block_m=16, block_n=16, num_splits=1, num_warps=4, num_stages=1), torch.float32),
    (TileConfig(block_m=32, block_n=32, num_splits=1, num_warps=4, num_stages=1), torch.float32),
    (TileConfig(block_m=16, block_n=32, num_splits=3, num_warps=4, num_stages=1), torch.float16),
    (None, torch.float32)],
    ids=["decode-tile", "prefill-tile", "fp16-split3", "launcher"])
def test_paged_attention_output_gate(kernel_device, config, dtype):
    """attention * sigmoid(gate) in one launch (two with a split key range: the merge applies it)."""
    case = make_case(21, ROWS, 16, 8, 2, 32, dtype, kernel_device)
    check_attention(case, config, f"gated {config}", gated=True)


@pytest.mark.parametrize("config", [TileConfig(block_m=16, block_n=16, num_splits=1, num_warps=4, num_stages=1),
                                    TileConfig(block_m=32, block_n=16, num_splits=4, num_warps=4, num_stages=1)],
                         ids=["whole-range", "split4"])
def test_paged_attention_never_reads_positions_past_context(kernel_device, config):
    """Unowned pool positions (null block 0, the tail of a row's last block, other blocks) may
    hold NaN, e.g. written by pad rows of a CUDA graph; no real row's output may see them."""
    case = make_case(3, ROWS, 16, 8, 2, 32, torch.float32, kernel_device, stale=float("nan"))
    check_attention(case, config, "NaN in unowned KV positions")


# --------------------------------------------------------------------------- GPU only (bf16)

# (block_size, Hq, Hkv, D, config); None is the launcher's own choice, which for GPU_ROWS is the
# prefill tile with a split key range.
GPU_CASES = [
    (16, 8, 2, 256, None), (64, 8, 2, 256, None), (16, 8, 8, 128, None), (16, 8, 1, 256, None), (64, 16, 2, 128, None),
    (16, 8, 2, 256, TileConfig(block_m=128, block_n=32, num_splits=1, num_warps=8, num_stages=2)),
    (64, 8, 1, 256, TileConfig(block_m=128, block_n=64, num_splits=1, num_warps=8, num_stages=2)),
    (16, 8, 2, 256, TileConfig(block_m=16, block_n=32, num_splits=5, num_warps=4, num_stages=3)),
    (16, 8, 1, 128, TileConfig(block_m=64, block_n=64, num_splits=3, num_warps=4, num_stages=3)),
    (64, 8, 2, 256, TileConfig(block_m=16, block_n=16, num_splits=7, num_warps=2, num_stages=3)),
    (24, 8, 2, 256, TileConfig(block_m=16, block_n=32, num_splits=3, num_warps=4, num_stages=3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,config", GPU_CASES,
                         ids=["bs16-gqa4-d256", "bs64-gqa4-d256", "bs16-mha-d128", "bs16-gqa8-d256", "bs64-gqa8-d128",
                              "bs16-gqa4-d256-prefill-tile", "bs64-gqa8-d256-prefill-tile",
                              "bs16-gqa4-d256-decode-tile-split5", "bs16-gqa8-d128-verify-tile-split3",
                              "bs64-gqa4-d256-steps-in-block-split7", "bs24-gqa4-d256-steps-straddle-blocks"])
def test_paged_attention_bf16_gpu(block_size, num_heads, num_kv_heads, head_dim, config):
    case = make_case(block_size * num_heads + head_dim, GPU_ROWS, block_size, num_heads, num_kv_heads, head_dim,
                     torch.bfloat16, "cuda")
    check_attention(case, config, f"{config}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [[(1, 9000)], [(1, 4000)] * 3 + [(1, 17)], [(5, 3000)] * 2, [(3000, 0)],
                                  [(100, 5000), (1, 7)]],
                         ids=["decode-1x9k", "decode-4-ragged", "verify-2x3k", "prefill-3k", "chunk-over-5k"])
def test_paged_attention_long_contexts_gpu(rows):
    case = make_case(len(rows), rows, 16, 8, 2, 256, torch.bfloat16, "cuda")
    check_attention(case, None, f"rows {rows[:2]}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,config", [
    (GPU_ROWS, None), ([(1, 9000)], None),
    ([(1, 4000)] * 3 + [(1, 17)], TileConfig(block_m=16, block_n=64, num_splits=1, num_warps=4, num_stages=3)),
    (GPU_ROWS, TileConfig(block_m=128, block_n=64, num_splits=1, num_warps=8, num_stages=2))],
    ids=["mixed-launcher", "decode-split", "decode-tile", "prefill-tile"])
def test_paged_attention_output_gate_bf16_gpu(rows, config):
    case = make_case(11, rows, 16, 8, 2, 256, torch.bfloat16, "cuda")
    check_attention(case, config, f"gated {config}", gated=True)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [3, 40, 128])
def test_split_merge_sums_without_shared_memory(splits):
    """The merge's sums over splits are each thread's own: its compiled code stores nothing to
    shared memory, where the copies of one sum that several threads held all wrote one word
    (racecheck's write-after-write hazard; the copies may differ in the last bit)."""
    heads, head_dim = 4, 256
    partial_acc = torch.randn(heads * splits, head_dim, device="cuda")
    partial_stats = torch.randn(heads * splits, 2, device="cuda").abs()
    out = torch.empty(1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    block_d = min(attention.COMBINE_BLOCK_D, head_dim)
    kernel = attention._combine_splits_kernel[(1, heads, head_dim // block_d)](
        partial_acc, partial_stats, out, out, splits, 0, 0, out.stride(0), out.stride(1), NUM_HEADS=heads,
        SPLIT_CHUNK=min(attention.COMBINE_SPLIT_CHUNK, 1 << (splits - 1).bit_length()), HEAD_DIM=head_dim,
        BLOCK_D=block_d, HAS_GATE=False, DEPENDENT_LAUNCH=False, num_warps=attention.COMBINE_WARPS)
    assert "st.shared" not in kernel.asm["ptx"]


@pytest.mark.gpu
def test_paged_attention_and_kv_write_in_cuda_graph():
    """Launch geometry depends on shapes only: a captured decode step (write this token's K/V,
    attend with the output gate, as the model does) replays correctly after lengths, slots,
    queries, gates and K/V change in place. The K/V write is rope.py's qk_norm_rope_kv, whose
    key is normalised and rotated: the reference writes what it wrote (its own test checks that)."""
    rows = [(1, 700), (1, 30), (1, 2000), (1, 0)]
    case = make_case(9, rows, 16, 8, 2, 256, torch.bfloat16, "cuda")
    qkv = torch.randn(len(rows), (2 * 8 + 2 * 2) * 256, device="cuda", dtype=torch.bfloat16)
    slots = torch.zeros(len(rows), dtype=torch.int64, device="cuda")
    weights = torch.zeros(256, device="cuda", dtype=torch.bfloat16)
    spec = QKNormRopeKV(torch.empty(len(rows), 8, 256, device="cuda", dtype=torch.bfloat16), weights, weights,
                        case.context_lens.long() - 1, 64, 10_000.0, 1e-6, None, case.k_cache, case.v_cache, slots)

    def step() -> torch.Tensor:
        qk_norm_rope_kv(qkv, spec)
        return paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens,
                               case.context_lens, case.scale, case.gate)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                                      # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    gen = torch.Generator().manual_seed(10)
    for contexts in ([650, 1, 1999, 1], [17, 31, 64, 1]):
        case.context_lens.copy_(torch.tensor(contexts, dtype=torch.int32))
        position = case.context_lens.long() - 1                     # this step's token: the row's last
        slots.copy_(case.block_tables.long().gather(1, (position // 16)[:, None])[:, 0] * 16 + position % 16)
        case.q.copy_(torch.randn(case.q.shape, generator=gen))
        case.gate.copy_(torch.randn(case.gate.shape, generator=gen))
        spec.positions.copy_(position)
        qkv.copy_(torch.randn(qkv.shape, generator=gen))
        expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
        qk_norm_rope_kv_reference(qkv, spec._replace(q_out=spec.q_out.clone(), k_cache=expected_k, v_cache=expected_v))
        graph.replay()
        assert torch.equal(case.v_cache, expected_v)
        assert_close(case.k_cache, expected_k, TOLERANCE[torch.bfloat16], "keys written in the replay")
        assert_close(out, reference(case, case.gate), TOLERANCE[torch.bfloat16], f"graph replay, contexts {contexts}")


def test_decode_config_pipelines_only_splits_with_many_key_steps():
    """A one-row decode over 4K keys splits into one key step per program (unpipelined). Over 32K
    keys each split walks many steps and keeps a 3-stage pipeline: in 16-key steps inside one
    block on 2 warps (blocks of a multiple of 16 keys; decode and verify rows), else in 32."""
    def tile(num_tokens, context, block_size):
        config = attention.attention_config(num_tokens, 1, 2, 4, context, 132, block_size=block_size)
        return config.block_n, config.num_splits, config.num_warps, config.num_stages
    assert tile(1, 4096, 16) == (32, 128, 4, 1)
    assert tile(1, 32768, 16) == (16, 128, 2, 3)
    assert tile(1, 32768, 64) == (16, 128, 2, 3)
    assert tile(4, 32768, 16) == (16, 128, 2, 3)
    assert tile(1, 32768, 24) == (32, 128, 4, 3)
