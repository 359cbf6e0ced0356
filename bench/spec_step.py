"""What a speculative step costs: verify (k+1 tokens per row through the deferred-commit path)
and one MTP draft step, each relative to a plain decode step, at several batch sizes; and the
speedup those costs imply for given mean accepted lengths. Writes bench/results/spec-<gpu>.json.

    python bench/spec_step.py [--shape 0.8b] [--batches 1,8,64] [--device cuda]

The model is a random Qwen3.5-0.8B-like checkpoint (bf16) with a random MTP layer, built in
memory. Each measurement times the model's own forward on prepared metadata (CUDA events,
median of many runs), so it is the device cost of the step, not the engine's host work:
    decode  : 1 token per row, commit
    verify  : k + 1 tokens per row, k pending folded first, outputs only (deferred commit)
    draft   : one MTP layer step per row + the lm_head
Speedup for mean accepted length L at draft length k: L * decode / (verify(k) + k * draft).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common import commit_id, device_tag  # noqa: E402
from deltaspec.engine import ModelConfig  # noqa: E402
from deltaspec.engine.batch import ForwardBatch, Row  # noqa: E402
from deltaspec.engine.models import HybridLM  # noqa: E402
from deltaspec.engine.state_pool import KVPool, StatePool  # noqa: E402
from deltaspec.kernels import select_ops  # noqa: E402

SHAPES = {
    "0.8b": dict(vocab_size=248320, hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=3584,
                 tie_word_embeddings=True, mtp_num_hidden_layers=1),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
                 linear_value_head_dim=64, intermediate_size=128, tie_word_embeddings=True, mtp_num_hidden_layers=1),
}
CONTEXT, BLOCK = 512, 16


def random_model(shape: str, device: str, dtype: torch.dtype) -> HybridLM:
    config = ModelConfig.from_dict({"model_type": "qwen3_5_text", **SHAPES[shape]})
    with torch.device(device):
        model = HybridLM(config, select_ops(device), dtype, with_mtp=True)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.data.uniform_(0.0, 2.7, generator=generator)
        elif p.dim() == 1:
            p.data.normal_(0.0, 0.1, generator=generator)
        else:
            p.data.normal_(0.0, p.shape[-1] ** -0.5, generator=generator)
    return model.eval()


def timed(fn, device: str, repeats: int = 30) -> float:
    """Median seconds of fn() after warm-up (CUDA events on the GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure(model: HybridLM, batch: int, max_draft: int, device: str, dtype: torch.dtype) -> dict:
    config = model.config
    blocks_per_row = (CONTEXT + max_draft + 1) // BLOCK + 1
    states = StatePool(config, batch + 1, max_draft + 1, dtype, device, keep_mtp_hidden=True)
    kv = KVPool(model.num_kv_layers, batch * blocks_per_row + 1, BLOCK, config.num_key_value_heads, config.head_dim,
                dtype, device)
    tables = [list(range(1 + r * blocks_per_row, 1 + (r + 1) * blocks_per_row)) for r in range(batch)]
    generator = torch.Generator().manual_seed(batch)

    def rows(num_tokens: int) -> list[Row]:
        tokens = torch.randint(0, config.vocab_size, (batch, num_tokens), generator=generator).tolist()
        return [Row(tokens[r], CONTEXT, r + 1, tables[r], num_logits=num_tokens) for r in range(batch)]

    prefill = ForwardBatch.build([], [Row(torch.randint(0, config.vocab_size, (CONTEXT,), generator=generator)
                                          .tolist(), 0, r + 1, tables[r]) for r in range(batch)], BLOCK, device)
    with torch.inference_mode():
        model(prefill, states, kv)  # a real context in every slot and KV block table
        decode = ForwardBatch.build(rows(1), [], BLOCK, device, commit=True)
        result = {"batch": batch, "context": CONTEXT}
        result["decode_ms"] = 1e3 * timed(lambda: model.compute_logits(model(decode, states, kv)), device)
        hidden = torch.randn(batch, config.hidden_size, dtype=dtype, device=device)
        draft_batch = ForwardBatch.build([], rows(1), BLOCK, device)
        result["draft_step_ms"] = 1e3 * timed(lambda: model.compute_logits(
            model.draft_hidden(draft_batch.input_ids, hidden, draft_batch, kv)), device)
        result["verify_ms"] = {}
        for k in range(1, max_draft + 1):
            verify = ForwardBatch.build(rows(k + 1), [], BLOCK, device, commit=False)
            # k pending tokens per slot: the fold runs as it would after a fully accepted step.
            states.pending_counts[1:batch + 1] = k
            result["verify_ms"][k] = 1e3 * timed(lambda: model.compute_logits(model(verify, states, kv)), device)
            states.pending_counts.zero_()
    result["verify_over_decode"] = {k: v / result["decode_ms"] for k, v in result["verify_ms"].items()}
    result["draft_over_decode"] = result["draft_step_ms"] / result["decode_ms"]
    result["implied_speedup"] = {
        k: {length: length * result["decode_ms"] / (result["verify_ms"][k] + k * result["draft_step_ms"])
            for length in (1.5, 2.5, 3.5) if length <= k + 1}
        for k in result["verify_ms"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--max-draft", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = random_model(args.shape, args.device, dtype)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"benchmark": "spec_step", "device": name, "shape": args.shape, "dtype": str(dtype),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
              "state_bytes_per_sequence": {
                  "k=0": StatePool(model.config, 2, 1, dtype, "meta").bytes_per_slot,
                  f"k={args.max_draft}": StatePool(model.config, 2, args.max_draft + 1, dtype, "meta",
                                                   keep_mtp_hidden=True).bytes_per_slot},
              "results": [measure(model, int(b), args.max_draft, args.device, dtype) for b in args.batches.split(",")]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"spec-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    for r in report["results"]:
        print(f"B={r['batch']:>3} decode {r['decode_ms']:.3f} ms  draft/decode {r['draft_over_decode']:.2f}  "
              + "  ".join(f"verify k={k}: {v:.2f}x" for k, v in r["verify_over_decode"].items()))
    print("wrote", path)


if __name__ == "__main__":
    main()
