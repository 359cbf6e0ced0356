"""What a speculative step costs: verify (k+1 tokens per row through the deferred-commit path)
and one MTP draft step (full and reduced draft vocabulary), each relative to a plain decode step,
at several batch sizes; and the speedup those costs imply for given mean accepted lengths.
Writes bench/results/spec-<gpu>.json.

    python bench/spec_step.py [--shape 0.8b] [--batches 1,8,64] [--device cuda]

The model is a random Qwen3.5-0.8B-like checkpoint (bf16) with a random MTP layer, built in
memory. Each step is the model's own forward on metadata built once as device tensors, so it is
the device cost of the step, not the engine's host work:
    decode        : 1 token per row, commit (a state pool without pending buffers, as the engine
                    has without speculation)
    verify(k)     : k + 1 tokens per row, k pending drafts folded first, the first new token
                    committed, the k drafts left pending (commit=False)
Both keep their logits in the model dtype, as the engine's graphs do (no float32 copy).
    draft step    : one MTP layer step per row + the lm_head + argmax (what the runner runs per
                    draft depth), scoring the full vocabulary, and scoring N token ids only
                    (`use_draft_vocab`; ids 0..N-1: on a random model which N ids does not change
                    the cost, an N x H head; a real model takes its N most frequent)
Every step reads and writes the KV and state pools in place, so each call is a full step.

On CUDA each step is captured in a CUDA graph and timed as a replay (common.graph_time_us): at
this size an eager step is bound by the host launching its kernels (eager decode measured 11-24 ms
against ~1.8 ms graphed on an H200), so eager ratios compare launch counts, not work. The eager
time (events around back-to-back calls) is kept beside it under "eager_ms" (the engine replays
graphs for decode-only steps, plain and speculative: cuda_graphs.py). On the CPU (a smoke test)
every step is timed eagerly with the wall clock.

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
from typing import Callable

import torch

import common  # noqa: E402
from common import commit_id, device_tag, eager_time_us, graph_time_us  # noqa: E402
from deltaspec.engine import ModelConfig  # noqa: E402
from deltaspec.engine.batch import ForwardBatch, Row  # noqa: E402
from deltaspec.engine.models import HybridLM  # noqa: E402
from deltaspec.engine.quantization import with_online_quantization  # noqa: E402
from deltaspec.engine.state_pool import KVPool, StatePool  # noqa: E402

SHAPES = {
    "0.8b": dict(vocab_size=248320, hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=3584,
                 tie_word_embeddings=True, mtp_num_hidden_layers=1),
    "9b": dict(vocab_size=248320, hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
               head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, intermediate_size=12288, tie_word_embeddings=False, mtp_num_hidden_layers=1),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
                 linear_value_head_dim=64, intermediate_size=128, tie_word_embeddings=True, mtp_num_hidden_layers=1),
}
CONTEXT, BLOCK = 512, 16
GRAPH_CALLS = 4    # steps per captured graph (one replay's time / GRAPH_CALLS is one step)
EAGER_CALLS = 10   # back-to-back eager steps per timed round (CUDA)
CPU_ROUNDS = 30


def random_model(shape: str, device: str, dtype: torch.dtype, quantization: str | None = None) -> HybridLM:
    """A random checkpoint of a SHAPES shape; quantization "fp8": its block-FP8 twin (the online
    path's format, weights drawn in place)."""
    config = ModelConfig.from_dict({"model_type": "qwen3_5_text", **SHAPES[shape]})
    if quantization is not None:
        config = with_online_quantization(config, quantization)
    return common.random_model(config, device, dtype)


def time_step(step: Callable[[], object], device: str) -> dict[str, float]:
    """Milliseconds per call of step(): {"graph", "eager"} on CUDA, {"eager"} (median wall time
    after warm-up) on the CPU. step must read only tensors that stay put (graph inputs)."""
    if torch.device(device).type == "cuda":
        def launch(_: int) -> None:
            step()

        # Eager first: its warm-up calls compile and autotune before anything is timed.
        eager = eager_time_us(launch, EAGER_CALLS) / 1e3
        return {"graph": graph_time_us(launch, GRAPH_CALLS) / 1e3, "eager": eager}
    for _ in range(3):
        step()
    times = []
    for _ in range(CPU_ROUNDS):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return {"eager": statistics.median(times) * 1e3}


def measure(model: HybridLM, batch: int, max_draft: int, draft_vocab_size: int, device: str,
            dtype: torch.dtype) -> dict:
    config = model.config
    blocks_per_row = (CONTEXT + max_draft + 1) // BLOCK + 1
    # As the engine sizes them: no pending buffers without speculation, k of them (and the MTP
    # inputs) with k drafts.
    plain = StatePool(config, batch + 1, 0, dtype, device)
    speculative = StatePool(config, batch + 1, max_draft, dtype, device, keep_mtp_hidden=True)
    kv = KVPool(model.num_kv_layers, batch * blocks_per_row + 1, BLOCK, config.num_key_value_heads, config.head_dim,
                dtype, device)
    tables = [list(range(1 + r * blocks_per_row, 1 + (r + 1) * blocks_per_row)) for r in range(batch)]
    generator = torch.Generator().manual_seed(batch)

    def rows(num_tokens: int) -> list[Row]:
        tokens = torch.randint(0, config.vocab_size, (batch, num_tokens), generator=generator).tolist()
        return [Row(tokens[r], CONTEXT, r + 1, tables[r], num_logits=num_tokens) for r in range(batch)]

    prefill = ForwardBatch.build([], [Row(torch.randint(0, config.vocab_size, (CONTEXT,), generator=generator)
                                          .tolist(), 0, r + 1, tables[r]) for r in range(batch)], BLOCK, device)
    times: dict[str, dict] = {}
    with torch.inference_mode():
        for states in (plain, speculative):
            model(prefill, states, kv)  # a real context in every slot and KV block table

        # Each batch below is built once: its device tensors are the graph's static inputs.
        decode = ForwardBatch.build(rows(1), [], BLOCK, device, commit=True)
        # Logits in the model dtype, as the engine's plain and speculative graphs keep them (cuda_graphs.py).
        times["decode"] = time_step(lambda: model.logits(model(decode, plain, kv)), device)

        hidden = torch.randn(batch, config.hidden_size, dtype=dtype, device=device)
        draft = ForwardBatch.build([], rows(1), BLOCK, device)

        def draft_step() -> torch.Tensor:
            return model.draft_tokens(model.draft_hidden(draft.input_ids, hidden, draft, kv))

        times["draft_step"] = time_step(draft_step, device)
        model.use_draft_vocab(torch.arange(draft_vocab_size))
        times["draft_step_reduced_vocab"] = time_step(draft_step, device)
        model.use_draft_vocab(None)

        for k in range(1, max_draft + 1):
            verify = ForwardBatch.build(rows(k + 1), [], BLOCK, device, commit=False)
            # k pending drafts per slot, as after a fully accepted step: the fold runs every time
            # (the pending counts are a graph input; the forward never changes them).
            speculative.pending_counts[1:batch + 1] = k
            times[f"verify_{k}"] = time_step(lambda: model.logits(model(verify, speculative, kv)), device)
            speculative.pending_counts.zero_()

    timing = "graph" if "graph" in times["decode"] else "eager"

    def pick(kind: str) -> dict:
        return {"decode_ms": times["decode"][kind], "draft_step_ms": times["draft_step"][kind],
                "draft_step_reduced_vocab_ms": times["draft_step_reduced_vocab"][kind],
                "verify_ms": {k: times[f"verify_{k}"][kind] for k in range(1, max_draft + 1)}}

    result = {"batch": batch, "context": CONTEXT, "timing": timing, **pick(timing)}
    if timing == "graph":
        result["eager_ms"] = pick("eager")
    decode_ms, verify_ms = result["decode_ms"], result["verify_ms"]
    result["verify_over_decode"] = {k: v / decode_ms for k, v in verify_ms.items()}
    result["draft_over_decode"] = result["draft_step_ms"] / decode_ms
    result["draft_reduced_vocab_over_decode"] = result["draft_step_reduced_vocab_ms"] / decode_ms

    def implied_speedup(draft_ms: float) -> dict:
        return {k: {length: length * decode_ms / (verify_ms[k] + k * draft_ms)
                    for length in (1.5, 2.5, 3.5) if length <= k + 1}
                for k in verify_ms}

    result["implied_speedup"] = implied_speedup(result["draft_step_ms"])
    result["implied_speedup_reduced_draft_vocab"] = implied_speedup(result["draft_step_reduced_vocab_ms"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--max-draft", type=int, default=4)
    parser.add_argument("--draft-vocab-size", type=int, default=32768,
                        help="the reduced draft vocabulary (capped at half the shape's vocabulary)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = random_model(args.shape, args.device, dtype)
    draft_vocab_size = min(args.draft_vocab_size, model.config.vocab_size // 2)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"benchmark": "spec_step", "device": name, "shape": args.shape, "dtype": str(dtype),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
              "timing": ("CUDA graph replay of each step (eager beside it)" if args.device == "cuda"
                         else "eager, wall clock (CPU smoke test)"),
              "draft_vocab_size": draft_vocab_size,
              "draft_vocab_ids": f"0..{draft_vocab_size - 1} (any {draft_vocab_size} ids cost the same on a random model)",
              "state_bytes_per_sequence": {
                  "k=0": StatePool(model.config, 2, 0, dtype, "meta").bytes_per_slot,
                  f"k={args.max_draft}": StatePool(model.config, 2, args.max_draft, dtype, "meta",
                                                   keep_mtp_hidden=True).bytes_per_slot},
              "results": [measure(model, int(b), args.max_draft, draft_vocab_size, args.device, dtype)
                          for b in args.batches.split(",")]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"spec-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    for r in report["results"]:
        eager = f" (eager {r['eager_ms']['decode_ms']:.3f})" if "eager_ms" in r else ""
        print(f"B={r['batch']:>3} [{r['timing']}] decode {r['decode_ms']:.3f} ms{eager}  "
              f"draft/decode {r['draft_over_decode']:.2f} (vocab {draft_vocab_size}: "
              f"{r['draft_reduced_vocab_over_decode']:.2f})  "
              + "  ".join(f"verify k={k}: {v:.2f}x" for k, v in r["verify_over_decode"].items()))
    print("wrote", path)


if __name__ == "__main__":
    main()
