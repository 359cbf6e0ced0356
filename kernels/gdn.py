"""Gated DeltaNet math shared by the chunked prefill and the deferred-commit decode/verify.

Per value head, with state S [K, V], for each token t (q, k l2-normalised, q scaled by K^-1/2):
    g_t    = -exp(A_log) * softplus(a_t + dt_bias)        (log decay, <= 0)
    beta_t = sigmoid(b_t)
    S      = exp(g_t) * S
    S      = S + k_t (beta_t (v_t - S^T k_t))^T           (delta rule)
    o_t    = S^T q_t
Value heads may outnumber key heads: value head h reads key head h // (HV / HK).

Pool layout (per GDN layer): state [num_slots, HV, K, V] (fp32 by default), and of the tokens
accepted but not folded in (P = k: the drafts of one verify step; the step's first token is
always committed at once) only what cannot be recomputed: their raw conv inputs (conv1d.py) and
pending_g / pending_beta [num_slots, P, HV, R] (fp32), with pending_counts [num_slots] shared by
every layer. Their k and v are recomputed each step by the conv decode kernel from the window
and the raw inputs, into a step buffer the decode kernel folds from. docs/design.md, "Deferred commit".
Each g / beta is kept R = pending_replicas(V) times, one replica per V / R value columns, all
equal: the decode kernel's programs split a head's columns into tiles of at least V / R, and a
program reads and writes only its own columns' replicas, so no program overwrites an entry
another is still to read, and none waits for another (gdn_decode.py).

gdn_chunked.py and gdn_decode.py hold the two kernels and their references; this module holds
the definition of the recurrence they both implement. Knows nothing about models or the scheduler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


PENDING_REPLICA_COLUMNS = 16  # value columns per pending g / beta replica: the narrowest decode tile


def pending_replicas(value_dim: int) -> int:
    """R, the replicas of each pending g / beta: one per PENDING_REPLICA_COLUMNS value columns."""
    return max(1, value_dim // PENDING_REPLICA_COLUMNS)


def gdn_gating_reference(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, HV] -> (g, beta) float32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def expand_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """[..., HK, K] -> [..., HV, K]: value head h uses key head h // (HV/HK)."""
    return x.repeat_interleave(num_value_heads // x.shape[-2], dim=-2)


def recurrent_steps(state: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor,
                     round_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence over a padded batch. state [B, HV, K, V] fp32; k [B, L, HV, K];
    v [B, L, HV, V]; g, beta [B, L, HV]; q [B, L, HV, K] or None (fold only).
    A padded token must carry g = 0 and beta = 0: it then leaves the state unchanged. L may be 0.
    round_to: the state is rounded to this dtype after each token (its output taken before), as
    a pool of that dtype rounds it when tokens run one step each: a pool below fp32 then gives
    every token the state it would have had one token a step."""
    out = None if q is None else v.new_empty(v.shape)  # [B, L, HV, V]
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        if out is not None:
            out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
        if round_to is not None:
            state = state.to(round_to).float()
    return state, out
