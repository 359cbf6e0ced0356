"""The one interface through which models reach heavy ops, chosen once at start-up.

`Ops` is a frozen table of functions. `REFERENCE_OPS` holds the torch references: the CPU
backend and the oracle of every kernel test. `triton_ops()` is the GPU table with the same
signatures; `unfused_triton_ops()` the same with every fused entry (an op folded into the
launch that consumes it) run as its parts: the launches before fusion, for the A/B of a decode
step's launch count and time. `select_ops` is the only place that decides which table a model
gets. Knows nothing about what the ops compute, only which implementation fills each entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, partial
from typing import Callable

import torch

from .activation import silu_and_mul_reference
from .attention import paged_attention_reference
from .conv1d import causal_conv1d_decode_reference, causal_conv1d_prefill_reference
from .fp8 import fp8_linear_reference, fp8_moe_experts_reference
from .gdn_chunked import gdn_chunked_reference
from .gdn_decode import gdn_decode_reference
from .linear import gated_rms_norm_linear_reference, linear_reference, silu_and_mul_linear_reference
from .moe import moe_experts_reference, route_reference
from .norms import gated_rms_norm_reference, rms_norm_reference
from .rope import qk_norm_rope_write_kv_reference
from .sampling import sample_reference
from .penalties import penalize_rows_reference
from .token_bitmask import apply_token_bitmask_reference


@dataclass(frozen=True)
class Ops:
    name: str
    linear: Callable
    fp8_linear: Callable
    rms_norm: Callable
    gated_rms_norm: Callable
    qk_norm_rope_write_kv: Callable
    silu_and_mul: Callable
    silu_and_mul_linear: Callable
    gated_rms_norm_linear: Callable
    causal_conv1d_prefill: Callable
    causal_conv1d_decode: Callable
    gdn_chunked: Callable
    gdn_decode: Callable
    paged_attention: Callable
    moe_route: Callable
    moe_experts: Callable
    fp8_moe_experts: Callable
    sample: Callable
    apply_token_bitmask: Callable
    penalize_rows: Callable


REFERENCE_OPS = Ops(
    name="torch",
    linear=linear_reference,
    fp8_linear=fp8_linear_reference,
    rms_norm=rms_norm_reference,
    gated_rms_norm=gated_rms_norm_reference,
    qk_norm_rope_write_kv=qk_norm_rope_write_kv_reference,
    silu_and_mul=silu_and_mul_reference,
    silu_and_mul_linear=silu_and_mul_linear_reference,
    gated_rms_norm_linear=gated_rms_norm_linear_reference,
    causal_conv1d_prefill=causal_conv1d_prefill_reference,
    causal_conv1d_decode=causal_conv1d_decode_reference,
    gdn_chunked=gdn_chunked_reference,
    gdn_decode=gdn_decode_reference,
    paged_attention=paged_attention_reference,
    moe_route=route_reference,
    moe_experts=moe_experts_reference,
    fp8_moe_experts=fp8_moe_experts_reference,
    sample=sample_reference,
    apply_token_bitmask=apply_token_bitmask_reference,
    penalize_rows=penalize_rows_reference,
)


@cache
def triton_ops() -> Ops:
    """The GPU table: Triton kernels where they exist; the remaining entries are the (batched,
    device-agnostic) torch references, listed here so the mix is visible in one place."""
    from . import activation, attention, conv1d, fp8, gdn_chunked, gdn_decode, linear, moe, norms, penalties, rope, sampling, \
        token_bitmask

    return replace(
        REFERENCE_OPS,
        name="triton",
        linear=linear.linear,
        fp8_linear=fp8.fp8_linear,
        rms_norm=norms.rms_norm,
        gated_rms_norm=norms.gated_rms_norm,
        qk_norm_rope_write_kv=rope.qk_norm_rope_write_kv,
        silu_and_mul=activation.silu_and_mul,
        silu_and_mul_linear=linear.silu_and_mul_linear,
        gated_rms_norm_linear=linear.gated_rms_norm_linear,
        causal_conv1d_prefill=conv1d.causal_conv1d_prefill,
        causal_conv1d_decode=conv1d.causal_conv1d_decode,
        gdn_chunked=gdn_chunked.gdn_chunked,
        gdn_decode=gdn_decode.gdn_decode,
        paged_attention=attention.paged_attention,
        moe_route=moe.route,
        moe_experts=moe.moe_experts,
        fp8_moe_experts=fp8.fp8_moe_experts,
        sample=sampling.sample,
        apply_token_bitmask=token_bitmask.apply_token_bitmask,
        penalize_rows=penalties.penalize_rows,
    )


@cache
def unfused_triton_ops() -> Ops:
    """The GPU table with each fused entry as its parts (two launches where it has one)."""
    from . import linear, rope

    return replace(triton_ops(), name="triton-unfused",
                   linear=partial(linear.linear, fused=False),
                   silu_and_mul_linear=partial(linear.silu_and_mul_linear, fused=False),
                   gated_rms_norm_linear=partial(linear.gated_rms_norm_linear, fused=False),
                   qk_norm_rope_write_kv=partial(rope.qk_norm_rope_write_kv, fused=False))


BACKEND_NAMES = ("torch", "triton", "triton-unfused")


def select_ops(device: torch.device | str, backend: str = "auto") -> Ops:
    """'auto' picks Triton on CUDA and the torch references elsewhere; a name forces one (for
    example the references on CUDA, to debug a kernel)."""
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {backend!r}; available: auto, {', '.join(BACKEND_NAMES)}")
    if backend == "torch":
        return REFERENCE_OPS
    return triton_ops() if backend == "triton" else unfused_triton_ops()
