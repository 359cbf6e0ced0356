"""Decode attention over an FP8 (e4m3) KV pool against a bf16 one (EngineConfig.kv_cache_dtype):
the same keys and values, 8 query / 2 KV heads, D 256 (the Qwen3.5 shapes), block 16, shuffled
blocks, rows of one token over long contexts, the kernel's own tile choice; each timed with
triton's do_bench after warm-up, both pools in the same run. The KV bytes per row halve; what the
step gains is the attention's share of it.

    python bench/tools/kv_fp8_attention.py --out $OUT   -> kv_fp8_attention-<gpu>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import device_tag, write_result  # noqa: E402
from deltaspec.kernels.attention import FP8_KV, paged_attention  # noqa: E402

HQ, HKV, D, BLOCK = 8, 2, 256, 16
CASES = [(1, 65536), (16, 8192), (64, 4096), (64, 16384)]   # (rows, context)


def measure(rows: int, context: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(rows * context)
    blocks = rows * context // BLOCK
    shape = (blocks + 1, BLOCK, HKV, D)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = (torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32) + 1).view(rows, -1)
    q = torch.randn(rows, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    entry = {"rows": rows, "context": context}
    for name, (k_cache, v_cache) in {"bf16": (k, v), "fp8": (k.to(FP8_KV), v.to(FP8_KV))}.items():
        run = lambda: paged_attention(q, k_cache, v_cache, tables, cu, lens, D ** -0.5)  # noqa: E731
        us = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
        kv_bytes = 2 * rows * context * HKV * D * k_cache.element_size()
        entry[name] = {"us": us, "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / us / 1e3}
    entry["fp8_speedup"] = entry["bf16"]["us"] / entry["fp8"]["us"]
    diff = (paged_attention(q, k.to(FP8_KV), v.to(FP8_KV), tables, cu, lens, D ** -0.5).float()
            - paged_attention(q, k, v, tables, cu, lens, D ** -0.5).float())
    entry["max_abs_diff_vs_bf16_pool"] = float(diff.abs().max())
    print(f"B={rows:3d} C={context:6d}: bf16 {entry['bf16']['us']:8.1f} us ({entry['bf16']['gb_per_s']:5.0f} GB/s), "
          f"fp8 {entry['fp8']['us']:8.1f} us ({entry['fp8']['gb_per_s']:5.0f} GB/s): {entry['fp8_speedup']:.2f}x")
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    write_result(args.out, "kv_fp8_attention", gpu, {"heads": [HQ, HKV, D], "block": BLOCK,
                                                      "cases": [measure(rows, context) for rows, context in CASES]})
    print("device", device_tag(gpu))


if __name__ == "__main__":
    main()
