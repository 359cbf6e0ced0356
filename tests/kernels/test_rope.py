"""q/k norm + partial RoPE and the KV write after it (kernels/rope.py): the torch reference
against a naive float64 loop written here, then the Triton kernel and the one-row projection
that runs it in its epilogue (kernels/linear.py) against the reference.

Reference. Contracts checked: a (1 + w) RMSNorm per token and head, then only the first
rotary_dim channels rotate, pairs (i, i + rotary_dim/2), at each token's own position (out of
order, far apart); channels past rotary_dim are only normalised; GQA heads.

Triton, with the reference as the oracle: q read from [q | gate] per head and k, v from the same
qkv row, as the model's projection lays them out; q_out poisoned; the tokens' keys and values
land in their slots of a pool of stale entries and nothing else changes; YaRN only moves the
rotary channels; the one-row form (a program a quarter of a head, the last arriver finishing
it) twice over the same arrival counters. CPU: the interpreter, fp32 / fp16, small widths; GPU:
bf16 at the 0.8B's widths.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaspec.kernels.linear import launch_gemv, linear, linear_reference
from deltaspec.kernels.rope import (QKNormRopeKV, Yarn, qk_norm_rope_kv, qk_norm_rope_kv_reference,
                                   qk_norm_rope_reference, rope_cos_sin)
from deltaspec.kernels.tiles import TileConfig
from kernel_helpers import TOLERANCE, assert_close, assert_close_elementwise, naive_rms, rope_kv_case, run_rope_kv



# ----------------------------------------------------------------------------------------------
# Torch reference vs a float64 loop
# ----------------------------------------------------------------------------------------------

def naive_norm_rope(x: torch.Tensor, weight: torch.Tensor, positions: list[int], rotary_dim: int,
                    theta: float, eps: float) -> torch.Tensor:
    """x [T, H, D] -> per token and head: (1 + w) RMSNorm, then rotate pairs (i, i + R/2) of
    the first R channels by position * theta^(-2i/R); channels >= R pass through."""
    tokens, heads, dim = x.shape
    half = rotary_dim // 2
    w = weight.tolist()
    out = torch.empty(tokens, heads, dim, dtype=torch.float64)
    for t in range(tokens):
        for h in range(heads):
            row = x[t, h].double().tolist()
            r = naive_rms(row, eps)
            y = [row[i] * r * (1.0 + w[i]) for i in range(dim)]
            z = list(y)
            for i in range(half):
                angle = positions[t] * theta ** (-2.0 * i / rotary_dim)
                c, s = math.cos(angle), math.sin(angle)
                z[i] = y[i] * c - y[i + half] * s
                z[i + half] = y[i + half] * c + y[i] * s
            out[t, h] = torch.tensor(z)
    return out


def test_qk_norm_partial_rope():
    """head_dim 64, rotary_dim 16 (0.25), GQA heads; positions out of order and far apart."""
    gen = torch.Generator().manual_seed(5)
    heads_q, heads_k, dim, rotary_dim, theta, eps = 4, 2, 64, 16, 10_000.0, 1e-6
    positions = [0, 1, 517, 3, 64, 1999, 2, 200]
    q = torch.randn(len(positions), heads_q, dim, generator=gen)
    k = torch.randn(len(positions), heads_k, dim, generator=gen)
    q_weight, k_weight = 0.1 * torch.randn(dim, generator=gen), 0.1 * torch.randn(dim, generator=gen)
    q_out, k_out = qk_norm_rope_reference(q, k, q_weight, k_weight, torch.tensor(positions), rotary_dim, theta, eps)
    # fp32 angles at position ~2000 carry ~1e-4 rad of rounding (as HF's), hence 5e-4.
    assert_close_elementwise(q_out, naive_norm_rope(q, q_weight, positions, rotary_dim, theta, eps), 5e-4, "q")
    assert_close_elementwise(k_out, naive_norm_rope(k, k_weight, positions, rotary_dim, theta, eps), 5e-4, "k")
    # Channels past rotary_dim are only normalised: tight tolerance there.
    assert_close_elementwise(q_out[..., rotary_dim:], naive_norm_rope(q, q_weight, positions, rotary_dim, theta, eps)[..., rotary_dim:],
                 1e-5, "q pass-through channels")


# ----------------------------------------------------------------------------------------------
# Triton: qk_norm_rope_kv and the one-row projection that runs it, vs the torch reference
# ----------------------------------------------------------------------------------------------

def assert_rope_kv_close(actual: QKNormRopeKV, expected: QKNormRopeKV, slots: torch.Tensor, what: str,
                         values_exact: bool = True) -> None:
    """q_out and the tokens' keys within tolerance, their values exact (copies of the same qkv;
    within tolerance where each side computed its own projection), every other pool entry
    bit-identical (a kernel writes the tokens' slots and nothing else)."""
    tolerance = TOLERANCE[expected.q_out.dtype]
    assert_close(actual.q_out, expected.q_out, tolerance, f"{what}: q")
    flat = lambda pool: pool.view(-1, *pool.shape[2:])                                    # noqa: E731
    assert_close(flat(actual.k_cache)[slots], flat(expected.k_cache)[slots], tolerance, f"{what}: k")
    if values_exact:
        assert torch.equal(flat(actual.v_cache)[slots], flat(expected.v_cache)[slots]), f"{what}: v"
    else:
        assert_close(flat(actual.v_cache)[slots], flat(expected.v_cache)[slots], tolerance, f"{what}: v")
    others = torch.ones(flat(expected.k_cache).shape[0], dtype=torch.bool, device=slots.device)
    others[slots] = False
    for pool in ("k_cache", "v_cache"):
        assert torch.equal(flat(getattr(actual, pool))[others], flat(getattr(expected, pool))[others]), \
            f"{what}: {pool} written outside the tokens' slots"


@pytest.mark.parametrize("rotary_dim,dtype,slot_dtype",
                         [(8, torch.float32, torch.int64), (32, torch.float16, torch.int32)])
def test_qk_norm_rope_kv(kernel_device, rotary_dim, dtype, slot_dtype):
    """GQA heads, qkv a row-strided view, q_out poisoned, a pool of stale entries."""
    qkv, spec = rope_kv_case(kernel_device, dtype, 6, 4, 2, 32, 5000, seed=92, rotary_dim=rotary_dim,
                             qkv_stride=(2 * 4 + 2 * 2) * 32 + 24)
    spec = spec._replace(slot_mapping=spec.slot_mapping.to(slot_dtype))
    expected = run_rope_kv(qk_norm_rope_kv_reference, qkv, spec)
    actual = run_rope_kv(qk_norm_rope_kv, qkv, spec)
    assert_rope_kv_close(actual, expected, spec.slot_mapping.long(), "qk_norm_rope_kv")


def test_qk_norm_rope_kv_yarn(kernel_device):
    """YaRN: blended frequencies and the cos/sin attention factor, on the rotary channels only."""
    yarn = Yarn(factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=1, attention_factor=1.2)
    qkv, spec = rope_kv_case(kernel_device, torch.float32, 6, 4, 2, 32, 5000, seed=95, rotary_dim=16, yarn=yarn)
    expected = run_rope_kv(qk_norm_rope_kv_reference, qkv, spec)
    assert_rope_kv_close(run_rope_kv(qk_norm_rope_kv, qkv, spec), expected, spec.slot_mapping, "yarn")
    plain = run_rope_kv(qk_norm_rope_kv_reference, qkv, spec._replace(yarn=None))
    assert not torch.allclose(expected.q_out[..., :16], plain.q_out[..., :16])
    assert torch.equal(expected.q_out[..., 16:], plain.q_out[..., 16:])


@pytest.mark.parametrize("norm", [False, True])
def test_one_row_projection_runs_rope_kv(kernel_device, norm):
    """The one-row form with rope_kv in its epilogue (4 programs a head: each query and key head
    finished by the last of its programs to arrive) against the projection, then the reference.
    Twice over the same arrival counters, at other positions and slots: the last arrivers
    leave them at zero."""
    hq, hkv, d, hidden = 4, 2, 32, 64
    gen = torch.Generator().manual_seed(96 + norm)
    width = (2 * hq + 2 * hkv) * d
    weight = (torch.randn(width, hidden, generator=gen) / hidden ** 0.5).to(kernel_device)
    config = TileConfig(block_n=8, block_k=hidden, num_warps=1)
    for seed in (97, 98):
        _, spec = rope_kv_case(kernel_device, torch.float32, 1, hq, hkv, d, 5000, seed=seed, rotary_dim=8)
        x = torch.randn(1, hidden, generator=gen).to(kernel_device)
        norm_eps = 1e-6 if norm else None
        expected = run_rope_kv(lambda _, outputs: linear_reference(x, weight, norm_eps=norm_eps, rope_kv=outputs),
                               None, spec)
        y = torch.full((1, width), float("nan"), device=kernel_device)
        actual = run_rope_kv(lambda _, outputs: launch_gemv(y, x, weight, config, norm_eps=norm_eps, rope_kv=outputs),
                             None, spec)
        assert_close(y, linear_reference(x, weight, norm_eps=norm_eps), TOLERANCE[torch.float32], "y")
        assert_rope_kv_close(actual, expected, spec.slot_mapping, f"one-row form, seed {seed}", values_exact=False)


@pytest.mark.gpu
def test_qk_norm_rope_kv_gpu_model_shapes():
    """bf16 at the 0.8B's attention widths (8 q / 2 kv heads of 256, rotary 64) at positions up
    to 256K: the kernel for 300 tokens, and `linear` at one row, whose one-row form runs it."""
    qkv, spec = rope_kv_case("cuda", torch.bfloat16, 300, 8, 2, 256, 262_144, seed=94, rotary_dim=64,
                             theta=10_000_000.0, block_size=16)
    assert_rope_kv_close(run_rope_kv(qk_norm_rope_kv, qkv, spec), run_rope_kv(qk_norm_rope_kv_reference, qkv, spec),
                         spec.slot_mapping, "300 tokens")
    gen = torch.Generator().manual_seed(99)
    weight = (torch.randn(qkv.shape[1], 1024, generator=gen) / 32).to(torch.bfloat16).cuda()
    x = torch.randn(1, 1024, generator=gen).to(torch.bfloat16).cuda()
    _, spec = rope_kv_case("cuda", torch.bfloat16, 1, 8, 2, 256, 262_144, seed=95, rotary_dim=64,
                           theta=10_000_000.0, block_size=16)
    for _ in range(2):                                  # the arrival counters are zero again after a launch
        expected = run_rope_kv(lambda _, outputs: linear_reference(x, weight, norm_eps=1e-6, rope_kv=outputs), None,
                               spec)
        actual = run_rope_kv(lambda _, outputs: linear(x, weight, norm_eps=1e-6, rope_kv=outputs), None, spec)
        assert_rope_kv_close(actual, expected, spec.slot_mapping, "linear, one row", values_exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_qk_norm_rope_kv_into_an_fp8_pool(kernel_device, dtype):
    """An FP8 (e4m3) KV pool: the kernel stores each key and value as the reference does (the
    model-dtype value clamped to 448 and rounded to e4m3: bit-equal codes where both sides round
    the same model-dtype value), q_out stays in the model dtype, nothing else in the pool moves.
    Values are 600x the usual so that some saturate."""
    qkv, spec = rope_kv_case(kernel_device, dtype, 6, 4, 2, 32, 5000, seed=97, rotary_dim=16)
    qkv = qkv.clone()
    qkv[:, -2 * 2 * 32:] *= 600                                                        # k (normalised) and v
    spec = spec._replace(k_cache=spec.k_cache.to(torch.float8_e4m3fn), v_cache=spec.v_cache.to(torch.float8_e4m3fn))
    expected = run_rope_kv(qk_norm_rope_kv_reference, qkv, spec)
    actual = run_rope_kv(qk_norm_rope_kv, qkv, spec)
    flat = lambda pool: pool.view(-1, *pool.shape[2:])                                    # noqa: E731
    slots = spec.slot_mapping
    assert actual.q_out.dtype == dtype
    assert_close(actual.q_out, expected.q_out, TOLERANCE[dtype], "q")
    v_codes = flat(actual.v_cache)[slots].view(torch.uint8)
    assert torch.equal(v_codes, flat(expected.v_cache)[slots].view(torch.uint8)), "v: e4m3 codes"
    assert (flat(actual.v_cache)[slots].float().abs().max() == 448.0), "large values saturate at 448"
    # Keys: one e4m3 step where the model-dtype key itself differs in its last bit.
    assert_close(flat(actual.k_cache)[slots].float(), flat(expected.k_cache)[slots].float(), 2 ** -3, "k")
    others = torch.ones(flat(spec.k_cache).shape[0], dtype=torch.bool, device=slots.device)
    others[slots] = False
    for pool in ("k_cache", "v_cache"):
        assert torch.equal(flat(getattr(actual, pool))[others].view(torch.uint8),
                           flat(getattr(spec, pool))[others].view(torch.uint8)), pool


# ----------------------------------------------------------------------------------------------
# Multimodal RoPE: positions [3, T] (image tokens), frequencies by interleaved axis sections
# ----------------------------------------------------------------------------------------------

def hf_interleaved_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                           section: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Qwen3.5's Qwen3_5TextRotaryEmbedding.forward + recomposition_frequencies, restated:
    the temporal axis' angles, overwritten at index 1::3 (< 3 section[1]) by the height axis',
    at 2::3 (< 3 section[2]) by the width axis'."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = positions[..., None].float() * inv_freq                                     # [3, T, R/2]
    mixed = freqs[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        mixed[..., offset:section[axis] * 3:3] = freqs[axis][..., offset:section[axis] * 3:3]
    return mixed.cos(), mixed.sin()


@pytest.mark.parametrize("rotary_dim,section", [(64, (11, 11, 10)), (16, (11, 11, 10)), (32, (4, 6, 6))])
def test_mrope_cos_sin_matches_hf(rotary_dim, section):
    """rope_cos_sin over [3, T] positions (each axis different) equals HF's interleaved
    recomposition; equal axes give plain RoPE of that position."""
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(0, 4000, (3, 9), generator=gen)
    cos, sin = rope_cos_sin(positions, rotary_dim, 10_000.0, mrope_section=section)
    hf_cos, hf_sin = hf_interleaved_cos_sin(positions, rotary_dim, 10_000.0, section)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    same = positions[:1].expand(3, -1)
    assert torch.equal(rope_cos_sin(same, rotary_dim, 10_000.0, mrope_section=section)[0],
                       rope_cos_sin(positions[0], rotary_dim, 10_000.0)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_qk_norm_rope_kv_mrope(kernel_device, dtype):
    """The kernel turning each frequency by its axis' position ([3, T] positions) against the
    reference; the axes differ, so a kernel reading one axis for all fails."""
    qkv, spec = rope_kv_case(kernel_device, dtype, 7, 4, 2, 64, 3000, seed=101, rotary_dim=32)
    gen = torch.Generator().manual_seed(102)
    positions = torch.randint(0, 3000, (3, 7), generator=gen).to(kernel_device)
    spec = spec._replace(positions=positions, mrope_section=(5, 6, 5))
    expected = run_rope_kv(qk_norm_rope_kv_reference, qkv, spec)
    assert_rope_kv_close(run_rope_kv(qk_norm_rope_kv, qkv, spec), expected, spec.slot_mapping, "mrope")
    first_axis = run_rope_kv(qk_norm_rope_kv_reference, qkv, spec._replace(positions=positions[0].contiguous()))
    assert not torch.allclose(first_axis.q_out, expected.q_out)
    # The projection's one-row form runs [3, T] positions' rope after it, not in its epilogue.
    _, one = rope_kv_case(kernel_device, torch.float32, 1, 4, 2, 32, 3000, seed=103, rotary_dim=16)
    one = one._replace(positions=torch.tensor([[5], [9], [2]], device=kernel_device), mrope_section=(3, 3, 2))
    weight = (torch.randn((2 * 4 + 2 * 2) * 32, 64, generator=gen) / 8).to(kernel_device)
    x = torch.randn(1, 64, generator=gen).to(kernel_device)
    expected = run_rope_kv(lambda _, outputs: linear_reference(x, weight, rope_kv=outputs), None, one)
    actual = run_rope_kv(lambda _, outputs: linear(x, weight, rope_kv=outputs), None, one)
    assert_rope_kv_close(actual, expected, one.slot_mapping, "one row, [3, 1] positions", values_exact=False)
