"""Prefix reuse on the GPU: time to first token (TTFT) of a long prompt cold, fully cached, and
cached except its last 100 tokens; and the TTFT of every turn of a multi-turn chat with the
prefix cache on and off, MTP speculation on. Writes bench/results/prefix-<gpu>.json.

    python bench/prefix_cache.py [--shape 0.8b] [--prompt-tokens 16384] [--turns 6] [--device cuda]

The model is a random Qwen3.5-0.8B-like checkpoint with a random MTP layer (bf16), built in
memory (bench/spec_step.py). TTFT is measured around the engine's own steps, from submission
to the first token on the host (the device synchronised first), median of several prompts.
The cold reference runs the same engine with the same prompt lengths and a cache that has
never seen the prompt; the chat reference is an engine with `enable_prefix_cache=False`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import make_tokenizer  # noqa: E402

from common import commit_id, device_tag  # noqa: E402
from deltaspec.engine import EngineConfig, SamplingParams  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.tokenizer import Tokenizer  # noqa: E402
from spec_step import random_model  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ttft(core: EngineCore, prompt: list[int], params: SamplingParams = FIRST_TOKEN) -> tuple[float, object]:
    """Seconds from submission to the first token; the request then runs to completion."""
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    begin = time.perf_counter()
    request = core.add_request(prompt, params)
    while not request.output_token_ids:
        core.step()
    seconds = time.perf_counter() - begin
    while core.has_work:
        core.step()
    return seconds, request


def single_prompt(core: EngineCore, rng: random.Random, length: int, vocab: int, repeats: int) -> dict:
    """Cold, fully cached, and cached except the last 100 tokens, `repeats` prompts each."""
    fresh = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    ttft(core, fresh(length))  # compile and autotune outside the timing
    cold, full, partial, restored = [], [], [], []
    for _ in tqdm(range(repeats), desc="single prompt", leave=False):
        prompt = fresh(length)
        cold.append(ttft(core, prompt)[0])
        full.append(ttft(core, prompt)[0])
        before = core.stats()["prefix_cache"]["reused_tokens"]
        partial.append(ttft(core, prompt[:-100] + fresh(100))[0])
        restored.append(core.stats()["prefix_cache"]["reused_tokens"] - before)
    cold_ms, full_ms, partial_ms = (statistics.median(x) * 1e3 for x in (cold, full, partial))
    return {"prompt_tokens": length, "repeats": repeats, "cold_ms": cold_ms, "fully_cached_ms": full_ms,
            "cached_except_last_100_ms": partial_ms, "cached_except_last_100_restored_tokens": restored,
            "fully_cached_over_cold": full_ms / cold_ms, "target_fully_cached_over_cold": 0.05,
            "cached_except_last_100_over_cold": partial_ms / cold_ms}


def chat(core: EngineCore, seed: int, turns: int, system_tokens: int, user_tokens: int, answer_tokens: int,
         vocab: int) -> list[dict]:
    """Turn t's prompt = turn t-1's prompt + its answer + a new user message."""
    rng = random.Random(seed)
    conversation = [rng.randrange(vocab) for _ in range(system_tokens + user_tokens)]
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    result = []
    for turn in range(turns):
        before = core.stats()["prefix_cache"]["reused_tokens"]
        seconds, request = ttft(core, conversation, params)
        result.append({"turn": turn + 1, "prompt_tokens": len(conversation), "ttft_ms": seconds * 1e3,
                       "reused_tokens": core.stats()["prefix_cache"]["reused_tokens"] - before})
        conversation = conversation + request.output_token_ids + [rng.randrange(vocab) for _ in range(user_tokens)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--user-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--checkpoint-interval", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = random_model(args.shape, args.device, dtype)
    vocab = model.config.vocab_size
    tokenizer = Tokenizer.from_dir(make_tokenizer(Path(tempfile.mkdtemp())))
    chat_tokens = args.system_tokens + args.turns * (2 * args.user_tokens + args.answer_tokens)

    def engine(enable_prefix_cache: bool) -> EngineCore:
        config = EngineConfig(model=".", device=args.device, dtype=str(dtype).removeprefix("torch."),
                              max_num_seqs=4, max_num_batched_tokens=max(args.prompt_tokens, 2048),
                              max_model_len=max(args.prompt_tokens, chat_tokens) + 128,
                              num_draft_tokens=args.num_draft_tokens, enable_prefix_cache=enable_prefix_cache,
                              checkpoint_interval=args.checkpoint_interval, gpu_memory_utilization=0.5)
        return EngineCore(config, model=model, tokenizer=tokenizer)

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"benchmark": "prefix_cache", "device": name,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "shape": args.shape,
              "dtype": str(dtype), "num_draft_tokens": args.num_draft_tokens,
              "checkpoint_interval": args.checkpoint_interval}
    on = engine(True)
    report["single_prompt"] = single_prompt(on, random.Random(0), args.prompt_tokens, vocab, args.repeats)
    chat_args = (1, args.turns, args.system_tokens, args.user_tokens, args.answer_tokens, vocab)
    chat(on, 2, *chat_args[1:])  # warm-up on another conversation: compiles decode, verify, restores
    with_cache = chat(on, *chat_args)
    report["cache_stats"] = on.stats()["prefix_cache"]
    del on
    off = engine(False)
    chat(off, 2, *chat_args[1:])  # warm-up on another conversation
    without = chat(off, *chat_args)
    report["chat"] = [{**w, "ttft_without_cache_ms": o["ttft_ms"], "speedup": o["ttft_ms"] / w["ttft_ms"]}
                      for w, o in zip(with_cache, without)]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefix-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    s = report["single_prompt"]
    print(f"{args.prompt_tokens}-token prompt TTFT: cold {s['cold_ms']:.1f} ms, fully cached {s['fully_cached_ms']:.1f} "
          f"ms ({100 * s['fully_cached_over_cold']:.1f}%), all but the last 100 {s['cached_except_last_100_ms']:.1f} ms")
    for t in report["chat"]:
        print(f"turn {t['turn']}: {t['prompt_tokens']} tokens, TTFT {t['ttft_ms']:.1f} ms with the cache "
              f"({t['reused_tokens']} reused), {t['ttft_without_cache_ms']:.1f} ms without")
    print("wrote", path)


if __name__ == "__main__":
    main()
