"""Where an eager prefill step's host time goes, plain engine against speculative one: each
named stage of the runner timed on the host (no sync) and to the device's completion (sync),
for a few prompts of the shipped model. A diagnostic: prints, writes nothing.

    python bench/tools/prefill_split.py [--model models/default] [--tokens 600] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import random
import time
from pathlib import Path

import torch

from deltaspec.engine import AsyncLLM, EngineConfig, SamplingParams
from deltaspec.engine.models.hybrid import HybridLM
from deltaspec.engine.speculation import Speculator
from deltaspec.engine.runner import Runner

ROOT = Path(__file__).resolve().parents[2]


def timed(table, name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        table[name].append((host, time.perf_counter() - start))
        return result
    return wrapper


async def drive(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams) -> None:
    for prompt in prompts:
        async for _ in engine.generate(prompt, params):
            pass
    await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "default")
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=1, help="decode steps (graphs) between the prefills")
    parser.add_argument("--background", type=int, default=0,
                        help="requests decoding (10k tokens) beside each prefill: its step is a mixed one")
    parser.add_argument("--front-end", choices=("core", "async"), default="core",
                        help="drive EngineCore.step on this thread, or AsyncLLM (steps in its worker thread)")
    args = parser.parse_args()
    rng = random.Random(0)
    for drafts in (0, None):
        engine = AsyncLLM(config=EngineConfig(model=args.model, device="cuda", dtype="bfloat16",
                                              num_draft_tokens=drafts, max_num_seqs=16, enable_prefix_cache=False))
        core = engine.core
        table = collections.defaultdict(list)
        patches = [(HybridLM, "forward"), (HybridLM, "logits"), (HybridLM, "draft_hidden"), (Runner, "run"),
                   (Runner, "_run_plain"), (Speculator, "_prefill_mtp"), (Speculator, "_verify_mixed"),
                   (Speculator, "read"), (Speculator, "run"), (Speculator, "draft"), (Speculator, "accept"),
                   (Speculator, "resample")]
        saved = [(cls, name, getattr(cls, name)) for cls, name in patches]
        for cls, name, fn in saved:
            setattr(cls, name, timed(table, f"{cls.__name__}.{name}", fn))
        try:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
            prompts = [[rng.randrange(1000) for _ in range(args.tokens)] for _ in range(args.repeats)]
            if args.front_end == "core":
                background = [core.add_request([rng.randrange(1000) for _ in range(100)],
                                               SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
                              for _ in range(args.background)]
                for _ in range(3):
                    core.step()
                for prompt in prompts:
                    request = core.add_request(prompt, params)
                    while not request.finished:
                        core.step()
                for request in background:
                    core.abort(request.request_id)
                while core.has_work:
                    core.step()
            else:
                asyncio.run(drive(engine, prompts, params))
        finally:
            for cls, name, fn in saved:
                setattr(cls, name, fn)
        print(f"num_draft_tokens={drafts}: ms host / to completion, median of {args.repeats} (first dropped)")
        for name, values in table.items():
            values = sorted(values[1:]) or values
            host, total = zip(*values)
            print(f"  {name:28s} {1e3 * sorted(host)[len(host) // 2]:8.2f} {1e3 * sorted(total)[len(total) // 2]:8.2f}"
                  f"  x{len(values)}")
        del core, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
