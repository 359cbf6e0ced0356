"""Engine throughput on the GPU: decode tokens/s at several batch sizes, time to first token,
CPU time per step, against the memory roofline and HF transformers `generate` on the same
random weights, in one run. Writes bench/results/engine-<gpu>.json.

Shapes (random weights, bf16): Qwen3.5-0.8B-like and Qwen3.5-9B-like (see SHAPES).
Roofline of a decode step = bytes that must move (all weights once, each sequence's recurrent
and conv state read + written, its KV read, the new KV written) / measured copy bandwidth.

    python bench/engine_throughput.py [--shapes 0.8b,9b] [--batches 1,16,64,256]
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
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import make_tokenizer  # noqa: E402

from common import commit_id, copy_bandwidth, device_tag  # noqa: E402
from deltaspec.engine import EngineConfig, ModelConfig, SamplingParams  # noqa: E402
from deltaspec.engine.batch import ForwardBatch, Row  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.state_pool import KVPool, StatePool  # noqa: E402
from deltaspec.engine.tokenizer import Tokenizer  # noqa: E402
from deltaspec.engine.weights import model_from_tensors  # noqa: E402
from deltaspec.kernels import select_ops  # noqa: E402

COMMON = dict(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, max_position_embeddings=65536, rms_norm_eps=1e-6)
SHAPES = {
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                 linear_num_key_heads=16, linear_num_value_heads=16, intermediate_size=3584,
                 tie_word_embeddings=True),
    "9b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
               linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=12288,
               tie_word_embeddings=False),
}
PROMPT_LEN, DECODE_STEPS, TTFT_PROMPT = 128, 48, 8192


def build(shape: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    settings = {**COMMON, **SHAPES[shape]}
    hf_config = Qwen3_5TextConfig(**settings)
    with torch.device("cuda"):
        hf = Qwen3_5ForCausalLM(hf_config).to(torch.bfloat16).eval()
    config = ModelConfig.from_dict({**hf_config.to_dict(), "model_type": "qwen3_5_text"})
    model = model_from_tensors(config, hf.state_dict().items(), select_ops("cuda"), torch.bfloat16, "cuda",
                               with_mtp=False)
    return hf, model, config


def decode_step_bytes(model, config: ModelConfig, batch: int, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    c = config
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4   # fp32
    conv = (c.linear_conv_kernel_dim - 1) * c.conv_dim * 2                                       # bf16
    state_rw = 2 * len(c.gdn_layer_ids) * (recurrent + conv) * batch
    kv_token = 2 * len(config.attention_layer_ids) * config.num_key_value_heads * config.head_dim * 2
    return weights + state_rw + batch * (context + 1) * kv_token


def measure_decode(core: EngineCore, batch: int) -> dict:
    params = SamplingParams(max_tokens=DECODE_STEPS + 8, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        core.add_request(torch.randint(0, 248320, (PROMPT_LEN,), generator=generator).tolist(), params)
    step_times, host_times = [], []
    while core.has_work:
        begin = time.perf_counter()
        step = core.dispatch()
        dispatched = time.perf_counter()
        output = step.wait()
        waited = time.perf_counter()
        core.commit(step.plan, output)
        committed = time.perf_counter()
        if step.plan.decode_rows and not step.plan.prefill_rows and len(step.plan.decode_rows) == batch:
            # Wall time per step as a user sees it (with async scheduling the host's part hides
            # behind the device's); host time: scheduling and committing.
            step_times.append(committed - begin)
            host_times.append((dispatched - begin) + (committed - waited))
    steady = step_times[3:]
    step = statistics.median(steady)
    return {"batch": batch, "step_ms": step * 1e3, "tokens_per_s": batch / step,
            "cpu_schedule_commit_ms": statistics.median(host_times[3:]) * 1e3,
            "cpu_share_of_step": statistics.median(host_times[3:]) / step, "steps_measured": len(steady)}


def measure_ttft(core: EngineCore, model, config: ModelConfig) -> dict:
    prompt = torch.randint(0, 248320, (TTFT_PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttfts = []
    for _ in range(4):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        request = core.add_request(prompt, params)
        while not request.output_token_ids:
            core.step()
        ttfts.append(time.perf_counter() - begin)
    # The bare forward: one prefill row through the model + last-token logits, no engine.
    states = StatePool(config, 2, 0, torch.bfloat16, "cuda")
    kv = KVPool(model.num_kv_layers, TTFT_PROMPT // 16 + 2, 16, config.num_key_value_heads, config.head_dim,
                torch.bfloat16, "cuda")
    batch = ForwardBatch.build([], [Row(prompt, 0, 1, list(range(1, TTFT_PROMPT // 16 + 1)))], 16, "cuda")
    forwards = []
    with torch.inference_mode():
        for _ in range(4):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            model.compute_logits(model(batch, states, kv)[batch.logits_indices]).argmax(-1).item()
            forwards.append(time.perf_counter() - begin)
    ttft, forward = statistics.median(ttfts[1:]), statistics.median(forwards[1:])
    return {"prompt_tokens": TTFT_PROMPT, "ttft_ms": ttft * 1e3, "bare_forward_ms": forward * 1e3,
            "ratio": ttft / forward}


def measure_hf(hf, batch: int) -> dict:
    prompt = torch.randint(0, 248320, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1)).cuda()
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        hf.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        hf.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - begin
        begin = time.perf_counter()
        hf.generate(prompt, max_new_tokens=DECODE_STEPS + 1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        total = time.perf_counter() - begin
    step = (total - prefill) / DECODE_STEPS
    return {"batch": batch, "step_ms": step * 1e3, "tokens_per_s": batch / step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.8b,9b")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth()
    tokenizer = Tokenizer.from_dir(make_tokenizer(Path(tempfile.mkdtemp())))
    gpu = torch.cuda.get_device_name()
    result = {"benchmark": "engine_throughput", "device": gpu,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(),
              "command": " ".join(["python"] + sys.argv), "copy_bandwidth_bytes_per_s": bandwidth,
              "torch": torch.__version__, "shapes": {}}
    for shape in tqdm(args.shapes.split(","), desc="shapes"):
        hf, model, config = build(shape)
        core = EngineCore(EngineConfig(model=".", device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                                       max_num_batched_tokens=max(TTFT_PROMPT, max(batches)),
                                       max_model_len=TTFT_PROMPT + 64, gpu_memory_utilization=0.5,
                                       enable_prefix_cache=False,  # TTFT repeats one prompt: measure cold
                                       warm_up=False),  # its own warm-up compiles what it times
                          model=model, tokenizer=tokenizer)
        entry = {"parameters": sum(p.numel() for p in model.parameters()), "decode": [], "hf_generate": []}
        for batch in tqdm(batches, desc=f"{shape} decode", leave=False):
            measured = measure_decode(core, batch)
            context = PROMPT_LEN + DECODE_STEPS // 2
            roofline_step = decode_step_bytes(model, config, batch, context) / bandwidth
            measured.update(roofline_step_ms=roofline_step * 1e3,
                            roofline_tokens_per_s=batch / roofline_step,
                            share_of_roofline=roofline_step * 1e3 / measured["step_ms"])
            entry["decode"].append(measured)
        entry["ttft"] = measure_ttft(core, model, config)
        for batch in (1, 16):
            entry["hf_generate"].append(measure_hf(hf, batch))
        for ours in entry["decode"]:
            peer = next((h for h in entry["hf_generate"] if h["batch"] == ours["batch"]), None)
            if peer:
                ours["speedup_vs_hf"] = ours["tokens_per_s"] / peer["tokens_per_s"]
        result["shapes"][shape] = entry
        del hf, model, core
        torch.cuda.empty_cache()
        print(json.dumps(entry, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-{device_tag(gpu)}.json"
    path.write_text(json.dumps(result, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
