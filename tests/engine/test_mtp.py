"""The MTP module against an independent, straightforward torch implementation of docs/design.md's
formula, written here from the raw checkpoint tensors:

    u      = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])
    out    = mtp.norm(decoder_layer(u))      (full attention at position t, causal)
    logits = lm_head(out)

with h_t the target's post-final-norm hidden state (taken from HF transformers)."""

import json
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from deltaspec.engine import LLM
from deltaspec.engine.batch import ForwardBatch, Row
from deltaspec.engine.state_pool import KVPool


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name).double() for name in f.keys()})
    return tensors


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def reference_mtp_logits(path: Path, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """Logits for x_{t+2} at t = 0..T-2, in float64, from tokens x_0..x_{T-1} and h_0..h_{T-1}."""
    c = json.loads((path / "config.json").read_text())
    w = load_tensors(path)
    eps, heads, kv_heads, d = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    rotary = int(d * c["rope_parameters"]["partial_rotary_factor"])
    theta = c["rope_parameters"]["rope_theta"]
    p = "mtp.layers.0."
    embed = w["model.embed_tokens.weight"]
    lm_head = w.get("lm_head.weight", embed)

    x = torch.cat([rms(embed[tokens[1:]], w["mtp.pre_fc_norm_embedding.weight"], eps),
                   rms(hidden[:-1].double(), w["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
    u = x @ w["mtp.fc.weight"].T
    n = u.shape[0]

    # Gated attention, causal over positions 0..n-1.
    h = rms(u, w[p + "input_layernorm.weight"], eps)
    q_gate = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:].reshape(n, heads * d)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    q, k = rms(q, w[p + "self_attn.q_norm.weight"], eps), rms(k, w[p + "self_attn.k_norm.weight"], eps)
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]

    def rope(t):
        r, rest = t[..., :rotary], t[..., rotary:]
        half = rotary // 2
        rotated = torch.cat([-r[..., half:], r[..., :half]], -1)
        return torch.cat([r * cos + rotated * sin, rest], -1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attention = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    u = u + (attention * torch.sigmoid(gate)) @ w[p + "self_attn.o_proj.weight"].T

    # MLP: dense SwiGLU, or routed experts + gated shared expert.
    h = rms(u, w[p + "post_attention_layernorm.weight"], eps)

    def swiglu(x, prefix):
        return (F.silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) \
            @ w[prefix + "down_proj.weight"].T

    if p + "mlp.gate.weight" not in w:
        mlp = swiglu(h, p + "mlp.")
    else:
        probs = (h @ w[p + "mlp.gate.weight"].T).softmax(-1)
        mlp = torch.zeros_like(h)
        for t in range(n):
            top = probs[t].topk(c["num_experts_per_tok"])
            weights = top.values / top.values.sum() if c.get("norm_topk_prob", True) else top.values
            for weight, expert in zip(weights, top.indices.tolist()):
                mlp[t] += weight * swiglu(h[t:t + 1], f"{p}mlp.experts.{expert}.")[0]
        mlp += torch.sigmoid(h @ w[p + "mlp.shared_expert_gate.weight"].T) * swiglu(h, p + "mlp.shared_expert.")
    u = u + mlp
    return rms(u, w["mtp.norm.weight"], eps) @ lm_head.T


@lru_cache(maxsize=None)
def _models(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), LLM(path)


def test_mtp_logits_match_independent_implementation(family, checkpoint):
    path = checkpoint(family)
    hf, llm = _models(path)
    assert llm.model.mtp is not None
    sequences = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (41, 9)]
    kv = KVPool(llm.model.num_kv_layers, 16, 16, llm.config.num_key_value_heads, llm.config.head_dim,
                torch.float32, "cpu")
    # MTP rows: input x_{t+1} at position t, for t = 0..T-2; ragged batch of two sequences.
    rows = [Row(tokens[1:], 0, slot, table, num_logits=len(tokens) - 1)
            for tokens, slot, table in zip(sequences, (1, 2), ([3, 5, 7], [9]))]
    batch = ForwardBatch.build([], rows, 16, "cpu")
    with torch.no_grad():
        hidden = [hf.model(torch.tensor([tokens])).last_hidden_state[0] for tokens in sequences]
        draft = llm.model.draft_hidden(batch.input_ids, torch.cat([h[:-1] for h in hidden]), batch, kv)
        logits = llm.model.compute_logits(draft).split([len(t) - 1 for t in sequences])
    for tokens, h, actual in zip(sequences, hidden, logits):
        expected = reference_mtp_logits(path, tokens, h).float()
        error = (actual - expected).abs().max() / expected.abs().max()
        assert error < 1e-4, f"relative error {error:.2e}"


def test_checkpoint_without_mtp_serves_without_speculation(checkpoint):
    llm = LLM(checkpoint("qwen3_5", with_mtp=False))
    assert llm.model.mtp is None
    assert len(llm.generate([[1, 2, 3]], None)[0].token_ids) > 0
