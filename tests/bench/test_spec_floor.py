"""bench/tools/spec_floor.py: the MTP layer's bytes of the 0.8B shape against a count by hand,
and the floor's arithmetic on a made-up decode_floor report."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "tools"))

from spec_floor import draft_bytes, spec_floor  # noqa: E402
from decode_reads import shape_config  # noqa: E402


def mtp_params_by_hand(h: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> int:
    attention = h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim + heads * head_dim * h  # q+gate, k, v, o
    norms = 2 * h + 2 * head_dim          # the layer's two norms, q and k norms
    mtp = 2 * h * h + 3 * h               # fc over [embedding | hidden], its two input norms and the final norm
    return attention + norms + 3 * h * inter + mtp


def test_draft_bytes_of_the_0_8b_shape():
    config = shape_config("0.8b")
    parts = draft_bytes(config, context=512, draft_vocab=None)
    h, inter = config.hidden_size, config.intermediate_size
    assert parts["mtp"] == 2 * mtp_params_by_hand(h, inter, config.num_attention_heads, config.num_key_value_heads,
                                                  config.head_dim)
    assert parts["kv"] == 512 * config.num_key_value_heads * config.head_dim * 2 * 2
    assert parts["lm_head"] == config.vocab_size * h * 2
    assert draft_bytes(config, 512, draft_vocab=1000)["lm_head"] == 1000 * h * 2


def test_ratios_follow_from_the_report():
    report = {"shape": "0.8b", "context": 512, "bytes_read_per_step": 10**9, "roofline_us": 600.0,
              "rows": [{"name": "read, 1 launch", "gb_per_s": 2000.0}], "engine": {"graph_replay_us": 1200.0}}
    case = spec_floor(report, drafts=3, draft_vocab=None)
    draft_us = sum(case["draft_bytes"].values()) / 2000e9 * 1e6
    assert case["draft_floor_us"] == pytest.approx(draft_us)
    assert case["plain_us"] == pytest.approx({"floor": 500.0, "target": 1000.0, "engine": 1200.0})
    for name, plain in case["plain_us"].items():
        assert case["ratio"][name] == pytest.approx(1 + 3 * draft_us / plain)
