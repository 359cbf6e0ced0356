"""Engine throughput on the GPU: decode tokens/s at several batch sizes, time to first token,
CPU time per step, against the memory roofline and HF transformers `generate` on the same
random weights, in one run. Writes bench/results/engine-<gpu>.json.

Shapes (random weights, bf16): Qwen3.5-0.8B-like and Qwen3.5-9B-like (see SHAPES).
Roofline of a decode step = bytes that must move (every weight the step reads once: all of
them but an embedding table that is not also the head, of which it gathers the batch's rows;
each sequence's recurrent and conv state read + written, its KV read, the new KV written) /
measured copy bandwidth.

    python bench/engine_throughput.py [--shapes 0.8b,9b] [--batches 1,16,64,256]
    python bench/engine_throughput.py --quantization fp8 [--shapes 9b,35b-a3b] [--out DIR]
    python bench/engine_throughput.py --quantization w4a16 [--shapes 9b,35b-a3b] [--out DIR]

--quantization fp8 (writes engine_fp8-<gpu>.json): each dense shape's bf16 model and its FP8
twin, quantized from the same weights through the online path (engine/online_quantization.py),
side by side: decode tokens/s per batch and prefill tokens/s (the bare forward of an 8K-token
prompt), their ratios (the issue's bars: FP8 >= 1.6x bf16 decode at batch 1, >= 1.3x prefill),
and the peak memory of the online load; no HF generate. The 35b-a3b shape (Qwen3.5-35B-A3B,
random FP8 weights drawn in place, with its MTP layer) runs plain and speculative (3 drafts)
decoding at batches 1 and 16, and prints its memory against one H100's 80 GB.

--quantization w4a16 / w8a16 (writes engine_w4a16-<gpu>.json): the same, with each dense shape's
bf16 model beside a weight-only integer twin (random packed weights, 128-column groups, symmetric,
as llm-compressor's W4A16 / W8A16; the kernels' speed does not depend on the values), and the
35b-a3b shape with packed experts and projections.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
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
from deltaspec.engine.quantization import Fp8Config, Wna16Config, with_online_quantization  # noqa: E402
from deltaspec.engine.weights import model_from_tensors  # noqa: E402
from deltaspec.kernels import select_ops  # noqa: E402
import common  # noqa: E402

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
# Only with --quantization fp8: random FP8 weights drawn in place (a bf16 copy would not fit an H100).
MOE_SHAPE = dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                 num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=0,
                 num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, tie_word_embeddings=False, mtp_num_hidden_layers=1)
H100_BYTES = 80 * 10**9
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


def build_fp8(hf, config: ModelConfig):
    """The FP8 twin of `hf`'s weights through the online path, and the load's peak memory beyond
    what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fp8_config = with_online_quantization(config, "fp8")
    model = model_from_tensors(fp8_config, hf.state_dict().items(), select_ops("cuda"), torch.bfloat16, "cuda",
                               with_mtp=False, quantize_online=True)
    torch.cuda.synchronize()
    return model, fp8_config, {"weight_bytes": weight_bytes(model),
                               "load_peak_bytes": torch.cuda.max_memory_allocated() - before}


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def engine(model, tokenizer, batches: list[int], num_draft_tokens: int = 0, state_dtype: str = "auto") -> EngineCore:
    return EngineCore(EngineConfig(model=".", device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                                   mamba_ssm_cache_dtype=state_dtype,
                                   max_num_batched_tokens=max(TTFT_PROMPT, max(batches)),
                                   max_model_len=TTFT_PROMPT + 64, gpu_memory_utilization=0.5,
                                   enable_prefix_cache=False,  # TTFT repeats one prompt: measure cold
                                   num_draft_tokens=num_draft_tokens,
                                   warm_up=False),  # its own warm-up compiles what it times
                      model=model, tokenizer=tokenizer)


def step_weight_bytes(model, batch: int) -> int:
    """The weight bytes a decode step of `batch` rows reads: every parameter once, except an
    embedding table that is not also the head (the 9B's: 2.03 GB, 11% of its weights), and the
    batch's rows of the embedding, gathered (a tied table is also read whole, as the head)."""
    table = model.embed_tokens
    untied = 0 if model.lm_head is None else table.nbytes
    return sum(p.numel() * p.element_size() for p in model.parameters()) - untied + batch * table[0].nbytes


def decode_step_bytes(model, config: ModelConfig, batch: int, context: int, state_bytes: int = 4) -> int:
    """state_bytes: a recurrent-state element's (fp32 by default; 2 on a bf16 pool)."""
    weights = step_weight_bytes(model, batch)
    c = config
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * state_bytes
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


def measure_engine(core: EngineCore, model, config: ModelConfig, batches: list[int], bandwidth: float) -> dict:
    entry = {"parameters": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes(model),
             "decode": []}
    for batch in tqdm(batches, desc="decode", leave=False):
        measured = measure_decode(core, batch)
        context = PROMPT_LEN + DECODE_STEPS // 2
        roofline_step = decode_step_bytes(model, config, batch, context, core.states.state_dtype.itemsize) / bandwidth
        measured.update(roofline_step_ms=roofline_step * 1e3,
                        roofline_tokens_per_s=batch / roofline_step,
                        share_of_roofline=roofline_step * 1e3 / measured["step_ms"])
        entry["decode"].append(measured)
    entry["ttft"] = measure_ttft(core, model, config)
    entry["prefill_tokens_per_s"] = TTFT_PROMPT / (entry["ttft"]["bare_forward_ms"] * 1e-3)
    return entry


def measure_fp8_pair(shape: str, batches: list[int], bandwidth: float, tokenizer) -> dict:
    """bf16 and FP8 (online-quantized from the same weights) engines of one dense shape."""
    hf, model, config = build(shape)
    bf16 = measure_engine(engine(model, tokenizer, batches), model, config, batches, bandwidth)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    model, fp8_config, load = build_fp8(hf, config)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    fp8 = {**measure_engine(engine(model, tokenizer, batches), model, fp8_config, batches, bandwidth), **load}
    ratios = {"decode_speedup": {b["batch"]: f["tokens_per_s"] / b["tokens_per_s"]
                                 for b, f in zip(bf16["decode"], fp8["decode"])},
              "prefill_speedup": fp8["prefill_tokens_per_s"] / bf16["prefill_tokens_per_s"]}
    return {"bf16": bf16, "fp8": fp8, **ratios}


def wna16_config(config: ModelConfig, scheme: str) -> ModelConfig:
    """config with llm-compressor's W4A16 or W8A16 scheme (128-column groups, symmetric)."""
    bits = {"w4a16": 4, "w8a16": 8}[scheme]
    return replace(config, quantization=Wna16Config("compressed-tensors", bits, 128, True, method="compressed-tensors"))


def measure_wna16_pair(shape: str, batches: list[int], bandwidth: float, tokenizer, scheme: str) -> dict:
    """bf16 and weight-only integer engines of one dense shape (the packed twin's weights random)."""
    hf, model, config = build(shape)
    del hf
    bf16 = measure_engine(engine(model, tokenizer, batches), model, config, batches, bandwidth)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    packed_config = wna16_config(config, scheme)
    model = common.random_model(packed_config, "cuda", torch.bfloat16)
    model.mtp = None   # as the bf16 model, built without its MTP layer
    packed = measure_engine(engine(model, tokenizer, batches), model, packed_config, batches, bandwidth)
    ratios = {"decode_speedup": {b["batch"]: f["tokens_per_s"] / b["tokens_per_s"]
                                 for b, f in zip(bf16["decode"], packed["decode"])},
              "prefill_speedup": packed["prefill_tokens_per_s"] / bf16["prefill_tokens_per_s"]}
    return {"bf16": bf16, scheme: packed, **ratios}


def generate_tokens_per_s(core: EngineCore, batch: int, tokens: int) -> float:
    """Output tokens/s of `batch` requests of `tokens` each, prefill and first token off the clock."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    requests = [core.add_request(torch.randint(0, 248320, (PROMPT_LEN,), generator=generator).tolist(), params)
                for _ in range(batch)]
    while any(not r.output_token_ids for r in requests):
        core.step()
    torch.cuda.synchronize()
    begin, before = time.perf_counter(), sum(len(r.output_token_ids) for r in requests)
    while core.has_work:
        core.step()
    torch.cuda.synchronize()
    return (sum(len(r.output_token_ids) for r in requests) - before) / (time.perf_counter() - begin)


def moe_fp8_config() -> ModelConfig:
    """The 35B-A3B shape with its MTP layer in the published block-FP8 format."""
    return ModelConfig.from_dict({**COMMON, **MOE_SHAPE, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})


def measure_moe_fp8(tokenizer, batches: list[int], config: ModelConfig | None = None) -> dict:
    """The 35B-A3B shape in FP8 (or `config`'s quantization) with its MTP layer: memory against
    one H100, then plain and speculative greedy decoding (random weights: the drafts are rarely
    accepted; this shows it runs under the graphs, not what speculation gains)."""
    config = config or moe_fp8_config()
    torch.cuda.reset_peak_memory_stats()
    model = common.random_model(config, "cuda", torch.bfloat16)
    entry = {"weight_bytes": weight_bytes(model), "mtp_weight_bytes": weight_bytes(model.mtp), "decode": {}}
    for drafts in (0, 3):
        core = EngineCore(EngineConfig(model=".", device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                                       max_num_batched_tokens=2048, max_model_len=4096, num_draft_tokens=drafts,
                                       gpu_memory_utilization=0.5, enable_prefix_cache=False, warm_up=False),
                          model=model, tokenizer=tokenizer)
        stats = core.stats()
        entry["decode"][f"drafts={drafts}"] = {b: generate_tokens_per_s(core, b, 32) for b in batches}
        entry[f"pools_drafts={drafts}"] = {"state_bytes_per_sequence": stats["state_bytes_per_sequence"],
                                           "num_slots": core.states.num_slots, "num_kv_blocks": core.kv.num_blocks,
                                           "kv_block_bytes": core.kv.block_bytes}
        del core
        gc.collect()
        torch.cuda.empty_cache()
    entry["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    # On one H100 (90% of its 80 GB usable): the run's peak (weights, the pools above, activations)
    # plus how many more 32K-token sequences (state slot with 3 drafts + KV blocks) fit beside it.
    pools = entry["pools_drafts=3"]
    per_sequence = pools["state_bytes_per_sequence"] + (32768 // 16) * pools["kv_block_bytes"]
    room = int((0.9 * H100_BYTES - entry["peak_allocated_bytes"]) // per_sequence)
    entry.update(h100_bytes=H100_BYTES, bytes_per_32k_sequence=per_sequence, more_32k_sequences_on_h100=room,
                 fits_one_h100=room > 0)
    kind = "FP8" if isinstance(config.quantization, Fp8Config) else f"{config.quantization.bits}-bit weight-only"
    print(f"35B-A3B {kind} + MTP: weights {entry['weight_bytes'] / 1e9:.1f} GB (MTP {entry['mtp_weight_bytes'] / 1e9:.2f}),"
          f" peak allocated {entry['peak_allocated_bytes'] / 1e9:.1f} GB; one H100 (72 of 80 GB) holds that and "
          f"{room} more 32K-token sequences ({per_sequence / 1e9:.2f} GB each)")
    return entry


def compare_state_dtypes(args: argparse.Namespace) -> None:
    """Each shape's engine decoding on each recurrent-state dtype, one model, one run; each dtype's
    share of its own roofline and its tokens/s over the first dtype's."""
    dtypes = args.state_dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth()
    tokenizer = Tokenizer.from_dir(make_tokenizer(Path(tempfile.mkdtemp())))
    gpu = torch.cuda.get_device_name()
    result = {"benchmark": "engine_state_dtype", "device": gpu,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
              "copy_bandwidth_bytes_per_s": bandwidth, "shapes": {}}
    for shape in (args.shapes or "0.8b,9b").split(","):
        _, model, config = build(shape)
        entry = {}
        for dtype in dtypes:
            core = engine(model, tokenizer, batches, state_dtype=dtype)
            measured = measure_engine(core, model, config, batches, bandwidth)
            entry[dtype] = {"decode": measured["decode"],
                            "state_bytes_per_sequence": core.stats()["state_bytes_per_sequence"]}
            del core
            gc.collect()
            torch.cuda.empty_cache()
        base = entry[dtypes[0]]["decode"]
        for dtype in dtypes[1:]:
            entry[dtype]["tokens_per_s_over_" + dtypes[0]] = {
                b["batch"]: d["tokens_per_s"] / b["tokens_per_s"] for b, d in zip(base, entry[dtype]["decode"])}
            print(shape, dtype, "over", dtypes[0], entry[dtype]["tokens_per_s_over_" + dtypes[0]])
        result["shapes"][shape] = entry
        del model
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_state_dtype-{device_tag(gpu)}.json"
    path.write_text(json.dumps(result, indent=2))
    print("wrote", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=None, help="default: 0.8b,9b (with --quantization fp8: 9b,35b-a3b)")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--quantization", choices=("fp8", "w4a16", "w8a16"), default=None,
                        help="fp8: bf16 and online-FP8 engines side by side (engine_fp8-<gpu>.json); w4a16 / "
                             "w8a16: bf16 and weight-only integer engines (engine_w4a16-<gpu>.json)")
    parser.add_argument("--state-dtypes", default=None,
                        help="e.g. float32,bfloat16: each shape's engine on each recurrent-state dtype side by side "
                             "(mamba_ssm_cache_dtype; engine_state_dtype-<gpu>.json)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.state_dtypes:
        return compare_state_dtypes(args)
    shapes = (args.shapes or ("9b,35b-a3b" if args.quantization else "0.8b,9b")).split(",")
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth()
    tokenizer = Tokenizer.from_dir(make_tokenizer(Path(tempfile.mkdtemp())))
    gpu = torch.cuda.get_device_name()
    suffix = f"_{args.quantization}" if args.quantization else ""
    result = {"benchmark": "engine_throughput" + suffix, "device": gpu,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(),
              "command": " ".join(["python"] + sys.argv), "copy_bandwidth_bytes_per_s": bandwidth,
              "torch": torch.__version__, "shapes": {}}
    for shape in tqdm(shapes, desc="shapes"):
        if args.quantization and shape == "35b-a3b":
            config = None if args.quantization == "fp8" else wna16_config(
                ModelConfig.from_dict({**COMMON, **MOE_SHAPE}), args.quantization)
            entry = measure_moe_fp8(tokenizer, [b for b in batches if b <= 16] or [1], config)
        elif args.quantization == "fp8":
            entry = measure_fp8_pair(shape, batches, bandwidth, tokenizer)
            print(f"{shape}: FP8 / bf16 decode {entry['decode_speedup']}, prefill {entry['prefill_speedup']:.2f}x")
        elif args.quantization:
            entry = measure_wna16_pair(shape, batches, bandwidth, tokenizer, args.quantization)
            print(f"{shape}: {args.quantization} / bf16 decode {entry['decode_speedup']}, "
                  f"prefill {entry['prefill_speedup']:.2f}x")
        else:
            hf, model, config = build(shape)
            entry = measure_engine(engine(model, tokenizer, batches), model, config, batches, bandwidth)
            entry["hf_generate"] = [measure_hf(hf, batch) for batch in (1, 16)]
            for ours in entry["decode"]:
                peer = next((h for h in entry["hf_generate"] if h["batch"] == ours["batch"]), None)
                if peer:
                    ours["speedup_vs_hf"] = ours["tokens_per_s"] / peer["tokens_per_s"]
            del hf, model
        result["shapes"][shape] = entry
        torch.cuda.empty_cache()
        print(json.dumps(entry, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine{suffix}-{device_tag(gpu)}.json"
    path.write_text(json.dumps(result, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
