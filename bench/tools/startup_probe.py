"""Does a large model start and serve with speculation at the engine's defaults on one GPU?

The 35B-A3B shape in block FP8 (random weights, drawn in place) with its MTP layer, through
EngineCore with EngineConfig's defaults (step budget, memory share, warm-up, prefix cache) and
64 sequences: start-up time and what it captured (the logged graph buckets), memory after it,
then prompts of mixed lengths (5 to 9000 tokens: chunked, graph-replayed and eager prefills,
the MTP's too) generating 16 sampled tokens each. Prints; a diagnostic, not a benchmark.

    python bench/tools/startup_probe.py
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]

import common  # noqa: E402
from engine_throughput import moe_fp8_config  # noqa: E402
from fixtures import make_tokenizer  # noqa: E402
from deltaspec.engine import EngineConfig, SamplingParams  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = moe_fp8_config()
    model = common.random_model(config, "cuda", torch.bfloat16)
    tokenizer = Tokenizer.from_dir(make_tokenizer(Path(tempfile.mkdtemp())))
    print(f"weights allocated {torch.cuda.memory_allocated() / 1e9:.1f} GB", flush=True)
    started = time.perf_counter()
    core = EngineCore(EngineConfig(model=".", device="cuda", dtype="bfloat16", max_num_seqs=64, num_draft_tokens=3),
                      model=model, tokenizer=tokenizer)
    print(f"start-up {time.perf_counter() - started:.0f} s; allocated {torch.cuda.memory_allocated() / 1e9:.1f} GB, "
          f"reserved {torch.cuda.memory_reserved() / 1e9:.1f} GB, free {torch.cuda.mem_get_info()[0] / 1e9:.1f} GB",
          flush=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist()
               for n in (5, 70, 300, 900, 2000, 5000, 9000, 40)]
    params = SamplingParams(max_tokens=16, temperature=0.7, ignore_eos=True)
    requests = [core.add_request(p, params) for p in prompts]
    while core.has_work:
        core.step()
    print("generated", [len(r.output_token_ids) for r in requests],
          f"peak allocated {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
