"""The floor under a speculative step's cost relative to a plain decode step, from a
bench/decode_floor.py report (#32's bar: a k = 3 speculative step of the 0.8B shape costs at most
1.5x a plain decode step at batch 1, the draft chain included).

A speculative step with k drafts reads at least what a plain step reads (its verify forward
runs the same weights over the same states) and, per draft, the MTP layer's weights, that
layer's KV context and the draft lm_head: the whole vocabulary's rows, or the reduced draft
vocabulary's (`--draft-vocab`). Each draft depends on the token before it, so the k draft reads
cannot share a pass. At the read-only rate the report measured (its one-launch row), k draft
reads take k x draft bytes / rate, and the speculative step costs at least

    ratio = (plain step + k x draft floor) / plain step

for a plain step that costs (a) its own floor (the report's bytes at the same rate), (b) #32's
target, 60% of the roofline, and (c) the engine's step as the report measured it. Where (b) is
over the bar, no draft kernel meets the bar together with the decode target. Arithmetic on
the report and the shape's parameter counts (the model built on the meta device): no GPU.

    python bench/tools/spec_floor.py bench/results/decode_floor-h100.json [--drafts 3]
                                     [--draft-vocab 32768]

Writes spec_floor-<gpu>.json beside the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import commit_id  # noqa: E402
from decode_reads import shape_config  # noqa: E402

from deltaspec.engine import ModelConfig  # noqa: E402
from deltaspec.engine.models import HybridLM  # noqa: E402
from deltaspec.kernels import REFERENCE_OPS  # noqa: E402

DECODE_TARGET = 0.60  # #32: the 0.8B shape's batch-1 decode step at >= 60% of the roofline
BAR = 1.5             # #32: a speculative step (k = 3) at most 1.5x a plain decode step


def draft_bytes(config: ModelConfig, context: int, draft_vocab: int | None,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """What one draft step reads at least: the MTP layers' parameters, their KV context
    (keys and values of `context` tokens) and the draft lm_head's rows."""
    with torch.device("meta"):
        model = HybridLM(config, REFERENCE_OPS, dtype, with_mtp=True)
    mtp = sum(p.nbytes for p in model.mtp.parameters())
    kv = len(model.mtp.layers) * context * config.num_key_value_heads * config.head_dim * 2 * dtype.itemsize
    rows = config.vocab_size if draft_vocab is None else draft_vocab
    return {"mtp": mtp, "kv": kv, "lm_head": rows * config.hidden_size * dtype.itemsize}


def read_rate(report: dict) -> float:
    """Bytes/s of the report's read-only stream in one launch."""
    return next(r for r in report["rows"] if r["name"] == "read, 1 launch")["gb_per_s"] * 1e9


def spec_floor(report: dict, drafts: int, draft_vocab: int | None) -> dict:
    rate = read_rate(report)
    parts = draft_bytes(shape_config(report["shape"]), report["context"], draft_vocab)
    draft_us = sum(parts.values()) / rate * 1e6
    plain = {"floor": report["bytes_read_per_step"] / rate * 1e6,
             "target": report["roofline_us"] / DECODE_TARGET,
             "engine": report["engine"]["graph_replay_us"]}
    return {"draft_vocab": draft_vocab or "full", "draft_bytes": parts, "draft_floor_us": draft_us,
            "plain_us": plain,
            "ratio": {name: (us + drafts * draft_us) / us for name, us in plain.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report", type=Path, help="a bench/decode_floor.py JSON")
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=32768, help="the reduced draft vocabulary beside the full")
    args = parser.parse_args()
    report = json.loads(args.report.read_text())
    cases = [spec_floor(report, args.drafts, vocab) for vocab in (None, args.draft_vocab)]
    out = {"benchmark": "spec_floor", "source": str(args.report), "device": report["device"],
           "report_commit": report["commit"], "commit": commit_id(), "shape": report["shape"], "batch": report["batch"],
           "context": report["context"], "drafts": args.drafts, "bar": BAR, "decode_target": DECODE_TARGET,
           "read_rate_gb_per_s": read_rate(report) / 1e9,
           "command": " ".join(["python", *sys.argv]), "cases": cases}
    for case in cases:
        ratios = ", ".join(f"{name} {ratio:.3f}" for name, ratio in case["ratio"].items())
        print(f"draft vocabulary {case['draft_vocab']}: draft floor {case['draft_floor_us']:.1f} us; "
              f"k = {args.drafts} step / plain step at least: {ratios}")
    path = args.report.with_name(args.report.name.replace("decode_floor", "spec_floor"))
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
