"""Helpers shared by several kernel test files (tests/kernels/test_*.py), one definition each.

Checks: `assert_close` (a Triton kernel against its torch reference: max error relative to the
largest reference magnitude, NaN never passes), `assert_close_elementwise` (a torch reference
against float64 math written in the tests: per element, relative with an absolute floor at the
tensor's scale), bit-identity of the pool slots a batch does not own, and a fused quantizer's
output against quantize_groups_reference of its own values (`assert_quantized`). Float64 oracles of the
GDN recurrence and the causal conv (test_gdn_chunked.py, test_conv1d.py, test_gdn_decode.py) and
of RMSNorm and SiLU (test_norms.py, test_rope.py, test_activation.py); the recurrent pools and
ragged batches of the conv and GDN decode tests; q/k inputs for RoPE; constants of the sampling,
noise tests. Shared fixtures are in conftest.py beside this module.

These share no code with kernels/ beyond the launchers and references they call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deltaspec.kernels.conv1d import causal_conv1d_decode, causal_conv1d_decode_reference
from deltaspec.kernels.quantize import quantize_groups_reference
from deltaspec.kernels.rope import QKNormRopeKV


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------

RTOL = 1e-4  # fp32 kernels vs float64 oracles

# Kernels vs references, by dtype (conv1d, GDN decode, norms, RoPE)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Max error relative to the largest reference magnitude; NaN never passes."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not actual.numel():
        return
    error = (actual.double() - expected.double()).abs().max()
    scale = expected.double().abs().max()
    assert bool(error <= rtol * scale), f"{what}: max abs error {float(error):.3e} (scale {float(scale):.3e})"


def assert_close_elementwise(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL, what: str = "") -> None:
    """Elementwise |a - e| <= rtol * (|e| + max|e|): relative, with an absolute floor at the
    tensor's scale so entries near zero do not demand impossible precision."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    error = (actual - expected).abs()
    bound = rtol * (expected.abs() + scale)
    worst = float((error - bound).max()) if error.numel() else 0.0
    assert worst <= 0, f"{what}: max abs error {float(error.max()):.3e} (scale {scale:.3e}, rtol {rtol:.0e})"


def assert_quantized(activation, group_size: int, what: str = "") -> None:
    """A QuantizedActivation (kernels/quantize.py) from a kernel that fused the quantizer: its fp8
    codes (bit for bit, the sign of zero included) and scales are quantize_groups_reference of
    the values it returns beside them."""
    expected_fp8, expected_scale = quantize_groups_reference(activation.values.cpu(), group_size)
    assert activation.group_size == group_size, what
    assert activation.fp8.is_contiguous() and activation.scale.is_contiguous(), f"{what}: layout the GEMM reads"
    assert torch.equal(activation.fp8.cpu().view(torch.uint8), expected_fp8.view(torch.uint8)), f"{what}: fp8 codes"
    assert torch.equal(activation.scale.cpu(), expected_scale), f"{what}: scales"


def bits(x: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-identical comparison (NaN-safe)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(view)


def assert_slots_untouched(pool: dict[str, torch.Tensor], before: dict[str, torch.Tensor], owned: set[int]) -> None:
    """Every slot outside `owned` is bit-identical in every pool tensor."""
    for name, tensor in pool.items():
        for slot in range(tensor.shape[0]):
            if slot not in owned:
                assert torch.equal(bits(tensor[slot]), bits(before[name][slot])), f"{name}[{slot}] changed"


# ----------------------------------------------------------------------------------------------
# Float64 oracles (independent of kernels/: no shared code)
# ----------------------------------------------------------------------------------------------

def naive_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: float, beta: float) -> torch.Tensor:
    """One token on one value head's state [K, V] in float64; k not yet normalised."""
    k = k / torch.sqrt((k * k).sum() + 1e-6)
    s = math.exp(g) * state
    return s + torch.outer(k, beta * (v - s.T @ k))


def naive_gdn(q, k, v, a, b, A_log, dt_bias, initial):
    """Token-by-token gated delta rule in float64, one value head at a time.

    q, k [L, HK, K]; v [L, HV, V]; a, b [L, HV]; initial [HV, K, V]. -> (o [L, HV, V], S [HV, K, V]).
    """
    q, k, v, initial = q.double(), k.double(), v.double(), initial.double()
    length, num_key_heads, key_dim = q.shape
    num_value_heads = v.shape[1]
    group = num_value_heads // num_key_heads
    a, b, A_log, dt_bias = a.tolist(), b.tolist(), A_log.tolist(), dt_bias.tolist()
    state = initial.clone()
    out = torch.empty(length, num_value_heads, v.shape[2], dtype=torch.float64)
    for t in range(length):
        for h in range(num_value_heads):
            qt = q[t, h // group]
            qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) * key_dim ** -0.5
            g = -math.exp(A_log[h]) * math.log1p(math.exp(a[t][h] + dt_bias[h]))
            beta = 1.0 / (1.0 + math.exp(-b[t][h]))
            state[h] = naive_step(state[h], k[t, h // group], v[t, h], g, beta)
            out[t, h] = state[h].T @ qt
    return out, state


def naive_conv(sequence: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) in float64 by F.conv1d. sequence [W-1+L, C] (window ++ row),
    weight [C, W] -> [L, C]: output t sees sequence[t .. t+W-1], tap W-1 on the newest."""
    channels, width = weight.shape
    if sequence.shape[0] == width - 1:  # L = 0
        return torch.zeros(0, channels, dtype=torch.float64)
    out = F.conv1d(sequence.double().T[None], weight.double()[:, None, :], groups=channels)[0].T
    return F.silu(out)


def random_gating_params(gen: torch.Generator, num_value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log spans slow (exp(A_log) ~ 0.02: long memory) to fast decay (~2.7)."""
    A_log = torch.rand(num_value_heads, generator=gen) * 5.0 - 4.0
    dt_bias = 0.5 * torch.randn(num_value_heads, generator=gen)
    return A_log, dt_bias


def silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


def naive_rms(row: list[float], eps: float) -> float:
    """1 / sqrt(mean(x^2) + eps) of one row."""
    return 1.0 / math.sqrt(sum(x * x for x in row) / len(row) + eps)


# ----------------------------------------------------------------------------------------------
# Recurrent pools and batches (conv1d and GDN decode)
# ----------------------------------------------------------------------------------------------

PAD_SLOT = 0  # scratch slot: pad rows (CUDA-graph padding) point at it, several rows may share it


def cu_seqlens_of(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(device)


def clone(pool: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in pool.items()}


# Rows: (new tokens, slot, pending count of the slot) with P = k = 4: 1..k+1 new tokens over 0..k
# pending; pad rows (slot 0) last, as CUDA graphs pad.
RAGGED = [(1, 5, 0), (5, 2, 4), (2, 7, 3), (1, 3, 1), (3, 8, 0), (5, 4, 0), (1, PAD_SLOT, None),
          (1, PAD_SLOT, None)]


def conv_pool(gen: torch.Generator, num_slots: int, max_pending: int, channels: int, width: int, device: str):
    pool = dict(conv=torch.randn(num_slots, width - 1, channels, generator=gen).to(device),
                pending_conv=torch.randn(num_slots, max_pending, channels, generator=gen).to(device),
                pending_counts=torch.randint(0, max_pending + 1, (num_slots,), generator=gen,
                                             dtype=torch.int32).to(device))
    pool["pending_counts"][PAD_SLOT] = max_pending
    return pool


def run_conv_decode(kernel: bool, x, weight, lengths, slots, pool, commit):
    device = x.device
    fn = causal_conv1d_decode if kernel else causal_conv1d_decode_reference
    return fn(x, weight, cu_seqlens_of(lengths, device), torch.tensor(slots, dtype=torch.int32, device=device),
              pool["conv"], pool["pending_conv"], pool["pending_counts"], commit)


# ----------------------------------------------------------------------------------------------
# Inputs of q/k norm + RoPE (test_rope.py, and the GPU test of test_norms.py)
# ----------------------------------------------------------------------------------------------

def rope_kv_case(device: str, dtype: torch.dtype, tokens: int, hq: int, hkv: int, head_dim: int, max_position: int,
                 seed: int, rotary_dim: int, theta: float = 10_000.0, yarn=None, block_size: int = 4,
                 qkv_stride: int = 0) -> tuple[torch.Tensor, QKNormRopeKV]:
    """A qkv projection's output [T, Hq * 2D + 2 * Hkv * D] ([q | gate] per head, k, v; rows
    qkv_stride columns apart when given, as a wider buffer's view) and its QKNormRopeKV: random
    norm weights and positions, distinct random slots of a pool of random (stale) entries with
    room for every token twice, q_out filled with NaN (whatever is not written fails)."""
    gen = torch.Generator().manual_seed(seed)
    width = (2 * hq + 2 * hkv) * head_dim
    qkv = torch.randn(tokens, max(qkv_stride, width), generator=gen)[:, :width].to(dtype).to(device)
    q_weight, k_weight = ((0.1 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2))
    positions = torch.randint(0, max_position, (tokens,), generator=gen).to(device)
    num_blocks = 2 * tokens // block_size + 1
    k_cache, v_cache = (torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype).to(device)
                        for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(device)
    q_out = torch.full((tokens, hq, head_dim), float("nan"), dtype=dtype, device=device)
    return qkv, QKNormRopeKV(q_out, q_weight, k_weight, positions, rotary_dim, theta, 1e-6, yarn, k_cache, v_cache,
                             slots)


def run_rope_kv(function, qkv: torch.Tensor, spec: QKNormRopeKV) -> QKNormRopeKV:
    """function(qkv, spec) on copies of spec's outputs (q_out, the pools); returns those copies."""
    outputs = spec._replace(q_out=spec.q_out.clone(), k_cache=spec.k_cache.clone(), v_cache=spec.v_cache.clone())
    function(qkv, outputs)
    return outputs


# ----------------------------------------------------------------------------------------------
# Sampling and noise
# ----------------------------------------------------------------------------------------------

# Upper 0.1% points of the chi-square distribution, by degrees of freedom (no scipy needed).
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
                      8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123,
                      15: 37.697}

# Found by search: with 24 random bits b, (b + 0.5) / 2^24 is computed in float32, where b + 0.5
# needs 25 bits: b = 2^24 - 1 rounds to 2^24 and u becomes exactly 1.0 (~V / 2^24 of draws hit a
# u = 1 token: ~0.9% at V = 151936). Then -log(-log u) = +inf and that token wins the race even
# when filtered out (log 0 + inf = nan, which argmax also picks).
U_ONE_SEED, U_ONE_OFFSET, U_ONE_TOKEN, U_ONE_VOCAB = 1234, 152, 5330, 151936


def on(device: str, args):
    return [None if a is None else a.to(device) for a in args]
