"""Prompt log-probabilities at scale: what scoring every prompt token costs a prefill, and how
close the scores are to HF transformers' on the same weights.

The 0.8B shape (random weights, bf16, engine_throughput.py's build), one engine: a batch of
prompts prefilled with max_tokens=1, without prompt log-probabilities and with them (top 0 and
top 5: lm-eval-harness asks for 1), alternated, each timed as the median of several runs after
a warm-up and a garbage collection (prefix cache off, so every run prefills); the top-k of the
scores by the kernel (kernels/logprobs.top_logits) and by torch's topk side by side. Then one prompt's scores against the log
softmax of HF's logits (the same bf16 weights): the largest difference, and how often the
top-1 token agrees.

    python bench/prompt_logprobs.py [--prompts 16] [--prompt-len 1024] [--out bench/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_throughput  # noqa: E402
from common import write_result  # noqa: E402
from fixtures import make_tokenizer  # noqa: E402
from deltaspec.engine import EngineConfig, SamplingParams  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.tokenizer import Tokenizer  # noqa: E402
from deltaspec.kernels.logprobs import top_logits, top_logits_reference  # noqa: E402

# name: (prompt_logprobs, the top-k op: "kernel" (kernels/logprobs.top_logits) or "torch" (its
# reference, torch's topk: the side-by-side baseline)).
VARIANTS = {"none": (None, "kernel"), "top0": (0, "kernel"), "top1": (1, "kernel"), "top1_torch": (1, "torch"),
            "top5": (5, "kernel"), "top5_torch": (5, "torch")}


def run(core: EngineCore, prompts: list[list[int]], top_n: int | None, top_op: str = "kernel") -> tuple[float, list]:
    sampler = core.runner.sampler
    sampler.ops = replace(sampler.ops, top_logits=top_logits if top_op == "kernel" else top_logits_reference)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=top_n)
    # The runs before left ~10^5 objects each (scores, their lists): collected now, so that a full
    # collection does not land inside whichever run crosses the threshold.
    gc.collect()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    requests = [core.add_request(prompt, params) for prompt in prompts]
    while core.has_work:
        core.step()
    return time.perf_counter() - begin, [r.output() for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    hf, model, config = engine_throughput.build("0.8b")
    tokenizer = Tokenizer.from_dir(make_tokenizer(Path(tempfile.mkdtemp())))
    core = EngineCore(EngineConfig(model=".", device="cuda", dtype="bfloat16", max_num_seqs=args.prompts,
                                   max_num_batched_tokens=8192, max_model_len=args.prompt_len + 64,
                                   gpu_memory_utilization=0.5, enable_prefix_cache=False, num_draft_tokens=0),
                      model=model, tokenizer=tokenizer)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_len), generator=generator).tolist()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for name, variant in VARIANTS.items():
        run(core, prompts, *variant)  # warm-up: compiles what the variant launches
    for _ in range(args.repeats):
        for name, variant in VARIANTS.items():
            times[name].append(run(core, prompts, *variant)[0])
    tokens = args.prompts * args.prompt_len
    results = {name: {"seconds": statistics.median(t), "prompt_tokens_per_s": tokens / statistics.median(t)}
               for name, t in times.items()}
    for name in VARIANTS:
        results[name]["cost_vs_none"] = results[name]["seconds"] / results["none"]["seconds"]

    # Parity with HF on one prompt (bf16 both: differences of bf16 rounding, not of the math).
    prompt = prompts[0]
    ours = run(core, [prompt], 5)[1][0].prompt_logprobs
    with torch.inference_mode():
        reference = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0].float(), dim=-1)
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    got = [entry.logprob for entry in ours[1:]]
    differences = [abs(a - b) for a, b in zip(got, expected)]
    top1 = reference.argmax(-1)[:-1].tolist()
    parity = {"positions": len(differences), "max_abs_difference": max(differences),
              "mean_abs_difference": statistics.mean(differences),
              "top1_agreement": sum(entry.top[0][0] == t for entry, t in zip(ours[1:], top1)) / len(top1)}

    results = {"shape": "0.8b", "prompts": args.prompts, "prompt_len": args.prompt_len, "timings": results,
               "hf_parity": parity}
    print(json.dumps(results, indent=1))
    write_result(Path(args.out), "prompt_logprobs", torch.cuda.get_device_name(), results)

if __name__ == "__main__":
    main()
