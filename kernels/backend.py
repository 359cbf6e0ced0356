"""The one interface through which models reach heavy ops, chosen once at start-up.

`Ops` is a frozen table of functions. `REFERENCE_OPS` holds the torch references: the CPU
backend and the oracle of every kernel test. `triton_ops()` is the GPU table with the same
signatures; `select_ops` is the only place that decides which table a model gets. Knows nothing
about what the ops compute, only which implementation fills each entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Callable

import torch

from .activation import silu_and_mul_reference
from .attention import paged_attention_reference
from .conv1d import causal_conv1d_decode_reference, causal_conv1d_prefill_reference
from .decode_metadata import decode_metadata_reference
from .embedding import embedding_reference
from .fp8 import fp8_linear_reference, fp8_moe_experts_reference
from .gdn_chunked import gdn_chunked_reference
from .gdn_decode import gdn_decode_reference
from .greedy import greedy_argmax_reference
from .linear import linear_reference
from .logprobs import top_logits_reference, token_logprobs_reference
from .moe import moe_experts_reference, route_reference
from .norms import gated_rms_norm_reference, mtp_input_reference, rms_norm_reference
from .rope import qk_norm_rope_kv_reference
from .sampling import sample_reference
from .penalties import penalize_rows_reference, record_tokens_reference
from .token_bitmask import apply_token_bitmask_reference
from .wna16 import wna16_linear_reference, wna16_moe_experts_reference


@dataclass(frozen=True)
class Ops:
    """fused_block_rows: up to how many rows `linear` fuses a block's ops into the projection's
    kernel (the input RMSNorm, SwiGLU, the residual add: linear.py), so that models fold their
    norms and run such batches in the residual-stream form (engine/models/layers.py); 0: never
    (the references only compose them)."""
    name: str
    linear: Callable
    embedding: Callable
    fp8_linear: Callable
    rms_norm: Callable
    gated_rms_norm: Callable
    mtp_input: Callable
    qk_norm_rope_kv: Callable
    silu_and_mul: Callable
    causal_conv1d_prefill: Callable
    causal_conv1d_decode: Callable
    gdn_chunked: Callable
    gdn_decode: Callable
    paged_attention: Callable
    moe_route: Callable
    moe_experts: Callable
    fp8_moe_experts: Callable
    wna16_linear: Callable
    wna16_moe_experts: Callable
    sample: Callable
    greedy_argmax: Callable
    token_logprobs: Callable
    top_logits: Callable
    apply_token_bitmask: Callable
    penalize_rows: Callable
    record_tokens: Callable
    decode_metadata: Callable
    fused_block_rows: int = 0


REFERENCE_OPS = Ops(
    name="torch",
    linear=linear_reference,
    embedding=embedding_reference,
    fp8_linear=fp8_linear_reference,
    rms_norm=rms_norm_reference,
    gated_rms_norm=gated_rms_norm_reference,
    mtp_input=mtp_input_reference,
    qk_norm_rope_kv=qk_norm_rope_kv_reference,
    silu_and_mul=silu_and_mul_reference,
    causal_conv1d_prefill=causal_conv1d_prefill_reference,
    causal_conv1d_decode=causal_conv1d_decode_reference,
    gdn_chunked=gdn_chunked_reference,
    gdn_decode=gdn_decode_reference,
    paged_attention=paged_attention_reference,
    moe_route=route_reference,
    moe_experts=moe_experts_reference,
    fp8_moe_experts=fp8_moe_experts_reference,
    wna16_linear=wna16_linear_reference,
    wna16_moe_experts=wna16_moe_experts_reference,
    sample=sample_reference,
    greedy_argmax=greedy_argmax_reference,
    token_logprobs=token_logprobs_reference,
    top_logits=top_logits_reference,
    apply_token_bitmask=apply_token_bitmask_reference,
    penalize_rows=penalize_rows_reference,
    record_tokens=record_tokens_reference,
    decode_metadata=decode_metadata_reference,
)


@cache
def triton_ops() -> Ops:
    """The GPU table: Triton kernels where they exist; the remaining entries are the (batched,
    device-agnostic) torch references, listed here so the mix is visible in one place."""
    from . import activation, attention, conv1d, decode_metadata, embedding, fp8, gdn_chunked, gdn_decode, greedy, linear, \
        logprobs, moe, norms, penalties, rope, sampling, token_bitmask, wna16

    return replace(
        REFERENCE_OPS,
        name="triton",
        linear=linear.linear,
        embedding=embedding.embedding,
        fp8_linear=fp8.fp8_linear,
        rms_norm=norms.rms_norm,
        gated_rms_norm=norms.gated_rms_norm,
        mtp_input=norms.mtp_input,
        qk_norm_rope_kv=rope.qk_norm_rope_kv,
        silu_and_mul=activation.silu_and_mul,
        causal_conv1d_prefill=conv1d.causal_conv1d_prefill,
        causal_conv1d_decode=conv1d.causal_conv1d_decode,
        gdn_chunked=gdn_chunked.gdn_chunked,
        gdn_decode=gdn_decode.gdn_decode,
        paged_attention=attention.paged_attention,
        moe_route=moe.route,
        moe_experts=moe.moe_experts,
        fp8_moe_experts=fp8.fp8_moe_experts,
        wna16_linear=wna16.wna16_linear,
        wna16_moe_experts=wna16.wna16_moe_experts,
        sample=sampling.sample,
        greedy_argmax=greedy.greedy_argmax,
        token_logprobs=logprobs.token_logprobs,
        top_logits=logprobs.top_logits,
        apply_token_bitmask=token_bitmask.apply_token_bitmask,
        penalize_rows=penalties.penalize_rows,
        record_tokens=penalties.record_tokens,
        decode_metadata=decode_metadata.decode_metadata,
        fused_block_rows=linear.FUSED_MAX_ROWS,
    )


BACKEND_NAMES = ("torch", "triton")


def select_ops(device: torch.device | str, backend: str = "auto") -> Ops:
    """'auto' picks Triton on CUDA and the torch references elsewhere; a name forces one (for
    example the references on CUDA, to debug a kernel)."""
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {backend!r}; available: auto, {', '.join(BACKEND_NAMES)}")
    return REFERENCE_OPS if backend == "torch" else triton_ops()
