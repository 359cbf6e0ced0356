"""What the engine adds to a decode step at batch 1 with speculation off, on the GPU.

Issue #6 asks that supporting speculation costs the single-request path nothing. The tree before
speculation landed ran the torch references on the GPU (no Triton table yet), so it is no
baseline; instead this compares, in one run on the same random Qwen3.5-0.8B-like model (bf16):

    engine : EngineCore with num_draft_tokens=0, one greedy request, wall time per step
             (schedule + run + commit: token latency as a user sees it), steady state; with
             async scheduling (the default) and without it (every step waits for the one before);
    bare   : the model's own decode forward captured in a CUDA graph, replayed with the next
             token fed back on the device, plus the host read of each token: no scheduler,
             no requests, no pools beyond one slot, no speculation code on the path at all.

engine / bare - 1 bounds what everything in the engine (speculation support included) adds.
Also records the same engine's step with speculation on (k=3, graphs) for scale.

    python bench/decode_overhead.py [--steps 200] [--profile]

--profile first prints the device kernels of 20 steps of each side (torch.profiler): what the
engine's step runs beyond the bare forward.

Writes bench/results/decode_overhead-<gpu>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import make_tokenizer  # noqa: E402

from common import commit_id, device_tag  # noqa: E402
from spec_step import BLOCK, random_model  # noqa: E402
from deltaspec.engine import EngineConfig, SamplingParams  # noqa: E402
from deltaspec.engine.batch import ForwardBatch, Row  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.state_pool import KVPool, StatePool  # noqa: E402
from deltaspec.engine.tokenizer import Tokenizer  # noqa: E402

PROMPT_LEN = 128


def engine(model, tokenizer, steps: int, num_draft_tokens: int, async_scheduling: bool = True) -> EngineCore:
    return EngineCore(EngineConfig(model=".", device="cuda", dtype="bfloat16", max_num_seqs=1,
                                   max_model_len=PROMPT_LEN + steps + 64, gpu_memory_utilization=0.3,
                                   num_draft_tokens=num_draft_tokens, adaptive_draft_length=False,
                                   enable_prefix_cache=False, async_scheduling=async_scheduling, warm_up=False),
                      model=model, tokenizer=tokenizer)


def engine_step_ms(model, tokenizer, steps: int, num_draft_tokens: int, async_scheduling: bool = True) -> dict:
    core = engine(model, tokenizer, steps, num_draft_tokens, async_scheduling)
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    request = core.add_request(prompt.tolist(), SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    times, tokens = [], []
    while core.has_work:
        begin = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - begin)
        tokens.append(len(request.output_token_ids))
    steady = times[8:-1]  # past the prefill and warm-up; the last step also finishes the request
    per_step = statistics.median(steady)
    emitted = (tokens[-2] - tokens[7]) / len(steady)
    del core
    return {"step_ms": per_step * 1e3, "tokens_per_step": emitted, "tokens_per_s": emitted / per_step,
            "steps": len(steady)}


def kernels_of(step, label: str, repeats: int = 20) -> None:
    """Prints the device kernels of `repeats` calls of step(), by device time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    print(f"== {label}: {repeats} calls")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))


def engine_kernels(model, tokenizer) -> None:
    core = engine(model, tokenizer, 64, 0)
    core.add_request([1] * PROMPT_LEN, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for _ in range(20):
        core.step()
    kernels_of(core.step, "engine step")
    del core


def bare_step_ms(model, steps: int, profile: bool = False) -> float:
    config = model.config
    blocks = (PROMPT_LEN + steps + 1) // BLOCK + 2
    states = StatePool(config, 2, 0, torch.bfloat16, "cuda")
    kv = KVPool(model.num_kv_layers, blocks + 1, BLOCK, config.num_key_value_heads, config.head_dim, torch.bfloat16,
                "cuda")
    table = list(range(1, blocks + 1))
    with torch.inference_mode():
        prompt = torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
        model(ForwardBatch.build([], [Row(prompt.tolist(), 0, 1, table)], BLOCK, "cuda"), states, kv)
        # One decode row at a fixed position: each replay is a full step (state read and written).
        batch = ForwardBatch.build([Row([1], PROMPT_LEN, 1, table)], [], BLOCK, "cuda")

        def step() -> None:
            token = model.compute_logits(model(batch, states, kv)).argmax(dim=-1)
            batch.input_ids.copy_(token)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            graph.replay()
            batch.input_ids.item()  # the host reads each token, as any generation loop must
            times.append(time.perf_counter() - begin)
        if profile:
            kernels_of(lambda: (graph.replay(), batch.input_ids.item()), "bare step")
    return statistics.median(times[8:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--profile", action="store_true", help="print the kernels of each side's steps first")
    args = parser.parse_args()
    model = random_model("0.8b", "cuda", torch.bfloat16)
    tokenizer = Tokenizer.from_dir(make_tokenizer(Path(tempfile.mkdtemp())))
    if args.profile:
        bare_step_ms(model, 40, profile=True)
        engine_kernels(model, tokenizer)
    rounds = []
    for _ in range(3):  # interleaved, so drift of the machine hits both sides alike
        rounds.append({"bare_ms": bare_step_ms(model, args.steps),
                       "engine": engine_step_ms(model, tokenizer, args.steps, 0),
                       "engine_sync": engine_step_ms(model, tokenizer, args.steps, 0, async_scheduling=False)})
    bare = statistics.median(r["bare_ms"] for r in rounds)
    engine = statistics.median(r["engine"]["step_ms"] for r in rounds)
    engine_sync = statistics.median(r["engine_sync"]["step_ms"] for r in rounds)
    speculative = engine_step_ms(model, tokenizer, args.steps, 3)
    name = torch.cuda.get_device_name()
    report = {"benchmark": "decode_overhead", "device": name, "shape": "0.8b", "dtype": "bfloat16",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "batch": 1,
              "rounds": rounds, "bare_step_ms": bare, "engine_step_ms": engine,
              "engine_over_bare": engine / bare,
              "engine_without_async_scheduling_step_ms": engine_sync,
              "engine_without_async_scheduling_over_bare": engine_sync / bare,
              "engine_with_speculation_k3_random_mtp": speculative}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_overhead-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"bare graph step {bare:.3f} ms, engine step (speculation off) {engine:.3f} ms: "
          f"{100 * (engine / bare - 1):+.1f}% ({engine_sync:.3f} ms without async scheduling); engine k=3 step {speculative['step_ms']:.3f} ms "
          f"({speculative['tokens_per_step']:.2f} tokens/step)")
    print("wrote", path)


if __name__ == "__main__":
    main()
