"""What MTP speculation is worth end to end at the sizes users run, through the engine.

Random-weight checkpoints of the Qwen3.5-0.8B, Qwen3.5-9B and Qwen3.5-35B-A3B shapes (bf16, with
their MTP layer) run real requests through EngineCore: every stage is real — the MTP drafts are
computed, verify runs, the state is rolled back, steps overlap the host — except that each
verify row's accepted count is drawn from a per-position acceptance profile (spec/profile.py),
since a random model accepts nothing. Profiles:

    shipped   0.92 / 0.75 / 0.64                             the shipped model's greedy profile
    published 0.76 / 0.62 / 0.51 / 0.42 / 0.36 / 0.31 / 0.27 / 0.24   vLLM's k=8 on gsm8k

For each shape, batch (1, 4, 16, 64, 256), temperature (0, 0.7) and profile, side by side in
one run: plain decoding (an engine with num_draft_tokens=0), fixed k = 1..4 and the adaptive
default (up to 3 drafts, each step's K from the measured step costs). tokens/s counts generated
tokens over the wall time of the decode steps (prefill excluded: every request's prompt is
prefilled before the clock starts); every request generates --tokens (128) or more, small
batches more (at least 2048 in all, at most 256 each), so that every run spans many steps: with
48 tokens a request, a speculative run at batch 256 was ~20 steps, its tail (the last rows
finishing at different steps) a large share, and the same cell read 0.91x and 1.07x in two runs
(H100, d402836). The dense shapes also run
with the reduced draft vocabulary (the 32768 most frequent ids; on a random model which ids does
not change the cost).

Also recorded per shape and batch: the measured step costs (the policy's table: plain step,
speculative step at each K) and the bound they give, mean accepted length / (cost(K) / cost(0))
in plain steps, for the shipped profile at K = 3.

    python bench/spec_e2e.py [--shapes 0.8b,9b,35b-a3b] [--batches 1,4,16,64,256] [--tokens 128]
                             [--fixed 1,2,3,4] [--profiles shipped,published]

(--fixed 3 --profiles shipped --temperatures 0: plain, k = 3 and adaptive only, for an A/B of two
trees in one device call; the speculative engine is built for max(fixed, 3) drafts.)

Writes bench/results/spec_e2e-<gpu>.json and .png (speedup over plain decoding by batch, one
line per shape and setting).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures import make_tokenizer  # noqa: E402

import common  # noqa: E402
from common import commit_id, device_tag  # noqa: E402
from deltaspec.engine import EngineConfig, ModelConfig, SamplingParams  # noqa: E402
from deltaspec.engine.core import EngineCore  # noqa: E402
from deltaspec.engine.models import HybridLM  # noqa: E402
from deltaspec.engine.tokenizer import Tokenizer  # noqa: E402
from deltaspec.spec import AcceptanceProfile, DraftPolicy, write_draft_vocab  # noqa: E402

COMMON = dict(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, max_position_embeddings=65536, rms_norm_eps=1e-6, mtp_num_hidden_layers=1)
SHAPES = {
    "0.8b": dict(model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, intermediate_size=3584,
                 tie_word_embeddings=True),
    "9b": dict(model_type="qwen3_5_text", hidden_size=4096, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=12288,
               tie_word_embeddings=False),
    "35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=0,
                    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, tie_word_embeddings=False),
    # Qwen/Qwen3.5-122B-A10B (~233 GiB in bf16 with its MTP layer: four H100s or two H200s;
    # bench/tp_scaling.py runs it sharded). Its config.json's text_config, as published configs
    # restate it: hidden 3072, 48 layers (full attention every 4th), 32 query / 2 KV heads of 256
    # (partial RoPE 0.25, theta 1e7), 256 experts, 8 active, expert and shared-expert widths 1024,
    # vocabulary 248320, untied lm_head (slime's scripts/models/qwen3.5-122B-A10B.sh, e.g.
    # Osmosis-AI/slime-rl); GDN 16 key / 64 value heads of 128, conv width 4 (a public NPU test
    # script's run_qwen3_5_moe_122B config, the same numbers as the 397B's GDN). The MoE MTP layer
    # comes with mtp_num_hidden_layers=1 (COMMON). 48 x 256 x 3 x 3072 x 1024 expert weights plus
    # the rest: 122.1B parameters, 124.6B with the MTP layer.
    "122b-a10b": dict(model_type="qwen3_5_moe_text", hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=64, intermediate_size=0,
                      num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
                      shared_expert_intermediate_size=1024, rope_theta=10000000, partial_rotary_factor=0.25,
                      tie_word_embeddings=False),
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (~152 GiB in bf16 with its MTP layer: two
    # H200s, or its FP8 form on two H100s): hidden 2048, 48 layers (full attention every 4th),
    # 16 query / 2 KV heads of 256 (partial RoPE 0.25, theta 1e7), GDN 16 key / 32 value heads of
    # 128, 512 experts, 10 active, expert and shared-expert widths 512, vocabulary 151936.
    "80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                    num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16,
                    linear_num_value_heads=32, intermediate_size=5120, num_experts=512, num_experts_per_tok=10,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1,
                    norm_topk_prob=True, rope_theta=10000000, partial_rotary_factor=0.25,
                    tie_word_embeddings=False),
    # A smoke test of the script on the CPU (its numbers mean nothing).
    "tiny": dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                 linear_key_head_dim=64, linear_value_head_dim=64, intermediate_size=128, tie_word_embeddings=True),
}
PROFILES = {"shipped": (0.92, 0.75, 0.64), "published": (0.76, 0.62, 0.51, 0.42, 0.36, 0.31, 0.27, 0.24)}
FIXED = (1, 2, 3, 4)
ADAPTIVE_MAX = 3
DRAFT_VOCAB = 32768
PROMPT_LEN = 128


def random_model(shape: str, device: str) -> HybridLM:
    config = ModelConfig.from_dict({**COMMON, **SHAPES[shape]})
    return common.random_model(config, device, torch.bfloat16 if device == "cuda" else torch.float32)


def engine(model: HybridLM, tokenizer: Tokenizer, directory: Path, max_batch: int, num_draft_tokens: int,
           profile: AcceptanceProfile | None, draft_vocab: bool = False) -> EngineCore:
    cuda = model.embed_tokens.device.type == "cuda"
    config = EngineConfig(model=directory, device="cuda" if cuda else "cpu",
                          dtype="bfloat16" if cuda else "float32", max_num_seqs=max_batch,
                          max_num_batched_tokens=max(2048, max_batch * (PROMPT_LEN // 4)), max_model_len=1024,
                          num_draft_tokens=num_draft_tokens, enable_prefix_cache=False,
                          draft_vocab_size=DRAFT_VOCAB if draft_vocab else 0, gpu_memory_utilization=0.5,
                          warm_up=False)  # decode steps are timed, never the eager prefills
    return EngineCore(config, model, tokenizer, forced_acceptance=profile)


def run(core: EngineCore, batch: int, tokens: int, temperature: float, seed: int) -> float:
    """Decode tokens/s of `batch` requests generating `tokens` each, all prefilled first."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(batch):
        params = SamplingParams(max_tokens=tokens + 1, temperature=temperature, top_p=0.95,
                                seed=seed * 1000 + i if temperature else None, ignore_eos=True)
        vocab = core.model_config.vocab_size
        requests.append(core.add_request(torch.randint(0, vocab, (PROMPT_LEN,), generator=generator).tolist(), params))
    while any(not r.output_token_ids for r in requests):  # prefill (and the first token) off the clock
        core.step()
    synchronize()
    begin, before = time.perf_counter(), sum(len(r.output_token_ids) for r in requests)
    while core.has_work:
        core.step()
    synchronize()
    return (sum(len(r.output_token_ids) for r in requests) - before) / (time.perf_counter() - begin)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(core: EngineCore, batches: list[int], tokens: int, temperatures: list[float], bar: tqdm,
            draft_counts: dict | None = None) -> dict:
    """tokens/s by (temperature, batch), after an untimed run per batch and temperature.
    draft_counts: filled with the steps the adaptive policy ran at each K in each timed run."""
    results = {}
    for batch in batches:
        for temperature in temperatures:  # greedy and sampled steps compile different kernels
            run(core, batch, 8, temperature, seed=0)
        for temperature in temperatures:
            before = Counter(core.scheduler.draft_policy.chosen) if draft_counts is not None else None
            results[f"T={temperature}", batch] = run(core, batch, max(tokens, min(256, 2048 // batch)), temperature,
                                                     seed=1)
            if draft_counts is not None:
                after = Counter(core.scheduler.draft_policy.chosen)
                draft_counts[f"T={temperature}, batch {batch}"] = {f"K={k}": n for k, n in sorted((after - before).items())}
            bar.update()
    return results


def set_policy(core: EngineCore, max_draft_tokens: int, adaptive: bool) -> None:
    """Another setting on the same engine (its graphs cover K up to its num_draft_tokens)."""
    costs = core.scheduler.draft_policy.costs
    core.scheduler.draft_policy = DraftPolicy(max_draft_tokens, costs, adaptive=adaptive)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.8b,9b,35b-a3b")
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--fixed", default=",".join(map(str, FIXED)),
                        help="the fixed draft counts to run beside plain and adaptive (an A/B of two trees: 3)")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="acceptance profiles to run (shipped, published)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    fixed = [int(k) for k in args.fixed.split(",")]
    profiles = {name: PROFILES[name] for name in args.profiles.split(",")}
    temperatures = [float(t) for t in args.temperatures.split(",")]
    directory = Path(tempfile.mkdtemp())
    make_tokenizer(directory)
    write_draft_vocab(directory, range(DRAFT_VOCAB), 0, 0)
    tokenizer = Tokenizer.from_dir(directory)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"benchmark": "spec_e2e", "device": device_name, "commit": commit_id(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "profiles": profiles, "tokens_per_request": args.tokens,
              "prompt_tokens": PROMPT_LEN, "shapes": {}}
    for shape in args.shapes.split(","):
        if args.device == "cuda":
            torch.cuda.empty_cache()
        try:
            model = random_model(shape, args.device)
        except torch.cuda.OutOfMemoryError:
            report["shapes"][shape] = {"skipped": "the weights do not fit this GPU"}
            continue
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        variants = [("full", False)] + ([("draft_vocab_32k", True)] if shape in ("0.8b", "9b") else [])
        per_shape = {"weights_gib": weights / 2**30, "variants": {}}
        total = len(batches) * len(temperatures) * (1 + len(variants) * len(profiles) * (len(fixed) + 1))
        with tqdm(total=total, desc=shape) as bar:
            plain = engine(model, tokenizer, directory, max(batches), 0, None)
            plain_tps = measure(plain, batches, args.tokens, temperatures, bar)
            del plain
            gc.collect()
            for variant, draft_vocab in variants:
                per_variant = {}
                profile = AcceptanceProfile(next(iter(profiles.values())))
                core = engine(model, tokenizer, directory, max(batches), max(*fixed, ADAPTIVE_MAX), profile,
                              draft_vocab)
                for profile_name, by_position in profiles.items():
                    profile.set(by_position)
                    settings = {}
                    for k in fixed:
                        set_policy(core, k, adaptive=False)
                        settings[f"k={k}"] = measure(core, batches, args.tokens, temperatures, bar)
                    set_policy(core, ADAPTIVE_MAX, adaptive=True)
                    draft_counts: dict = {}
                    settings["adaptive"] = measure(core, batches, args.tokens, temperatures, bar, draft_counts)
                    costs = core.scheduler.draft_policy.costs
                    per_variant[profile_name] = {
                        "tokens_per_s": {name: {f"{t}, batch {b}": v for (t, b), v in values.items()}
                                         for name, values in {"plain": plain_tps, **settings}.items()},
                        "speedup": {name: {f"{t}, batch {b}": v / plain_tps[t, b] for (t, b), v in values.items()}
                                    for name, values in settings.items()},
                        "step_costs": costs.as_dict(),
                        # The adaptive policy's steps at each K in each timed run (probes included).
                        "adaptive_draft_counts": draft_counts,
                        # mean accepted length / (cost(K) / cost(0)) in plain steps, at K = 3
                        "bound_k3": {b: (1 + sum(by_position[:3])) / (costs(b, 3) / costs(b, 0)) for b in batches},
                    }
                del core
                gc.collect()
                per_shape["variants"][variant] = per_variant
        report["shapes"][shape] = per_shape
        del model
        gc.collect()
        # After every shape: a run cut off by a time limit keeps what it measured.
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"spec_e2e-{device_tag(device_name)}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
        plot(report, batches, stem.with_suffix(".png"))
    for shape, per_shape in report["shapes"].items():
        for variant, per_variant in per_shape.get("variants", {}).items():
            for profile_name, result in per_variant.items():
                for name, speedups in result["speedup"].items():
                    print(f"{shape:8s} {variant:16s} {profile_name:9s} {name:9s} "
                          + " ".join(f"{key}: {value:.2f}x" for key, value in speedups.items()))


def plot(report: dict, batches: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(shape, variant, profile) for shape, s in report["shapes"].items()
              for variant, v in s.get("variants", {}).items() for profile in v]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for axis, (shape, variant, profile) in zip(axes[0], panels):
        result = report["shapes"][shape]["variants"][variant][profile]
        for name, speedups in result["speedup"].items():
            for temperature in sorted({key.split(",")[0] for key in speedups}):
                axis.plot(batches, [speedups[f"{temperature}, batch {b}"] for b in batches], marker="o",
                          linestyle="-" if temperature == "T=0.0" else "--",
                          linewidth=2.5 if name == "adaptive" else 1, label=f"{name} {temperature}")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_title(f"{shape} {variant} · {profile}", fontsize=9)
        axis.set_xlabel("batch")
    axes[0][0].set_ylabel("tokens/s over plain decoding")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
