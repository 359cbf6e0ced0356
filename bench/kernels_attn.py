"""Paged attention (kernels/attention.py) on the GPU, beside torch SDPA (flash backend) and the
machine's measured ceilings, all in one run.

Prefill: one sequence of T tokens, no prefix, 8 query / 2 KV heads, D 256, causal; FLOPs
4 * Hq * D * T(T+1)/2; against SDPA (flash, enable_gqa or repeated KV) on contiguous K/V.
Decode: B rows of one token over contexts of C keys (8/2 heads, D 256, block 16, shuffled
blocks); bytes = the KV the rows own, B * C * Hkv * D * 2 (K and V) * 2 bytes; against the
copy bandwidth (read + write of a 1 GiB device-to-device copy). Decode calls are timed as CUDA
graph replays of R launches over R disjoint block sets (R * KV >= 512 MB, so L2 cannot serve
them); beside them, a copy moving the same bytes timed the same way (the bandwidth a copy
reaches at that size). Verify rows (q_len 4) are timed the same way, for information.

Writes bench/results/kernels_attn-<gpu>.json (and a copy under --out). --sweep also times a
small table of alternative tile configs and split counts per shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import commit_id, copy_bandwidth, device_tag, graph_time_us  # noqa: E402
from deltaspec.kernels.attention import attention_config, launch_paged_attention
from deltaspec.kernels.device import num_sms
from deltaspec.kernels.tiles import TileConfig

HQ, HKV, D = 8, 2, 256
ROOT = pathlib.Path(__file__).resolve().parents[1]


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def shuffled_pool(num_blocks: int, block_size: int, gen: torch.Generator):
    shape = (num_blocks, block_size, HKV, D)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.randperm(num_blocks - 1, device="cuda", generator=gen).to(torch.int32) + 1   # block 0: null
    return k_cache, v_cache, ids


def gather_rows(cache: torch.Tensor, block_tables: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, context, D] contiguous copy of each row's keys (or values)."""
    block_size = cache.shape[1]
    pos = torch.arange(context, device="cuda")
    flat = block_tables.long()[:, pos // block_size] * block_size + pos % block_size
    return cache.view(-1, HKV, D)[flat].transpose(1, 2).contiguous()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


PREFILL_SWEEP = [TileConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s) for bm, bn, w, s in
                 [(128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3),
                  (128, 64, 16, 2), (128, 32, 16, 3)]]


def bench_prefill(num_tokens: int, sweep: bool, gen: torch.Generator) -> dict:
    block_size = 16
    num_blocks = num_tokens // block_size + 1
    k_cache, v_cache, ids = shuffled_pool(num_blocks, block_size, gen)
    block_tables = ids.view(1, -1)
    q = torch.randn(num_tokens, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda")
    context_lens = torch.tensor([num_tokens], dtype=torch.int32, device="cuda")
    scale = D ** -0.5
    flops = 4 * HQ * D * num_tokens * (num_tokens + 1) / 2
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()                             # [1, Hq, T, D]
    ks, vs = gather_rows(k_cache, block_tables, num_tokens), gather_rows(v_cache, block_tables, num_tokens)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            expected = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            run_sdpa, mode = (lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
                              "flash, enable_gqa")
        except RuntimeError:
            kr, vr = ks.repeat_interleave(HQ // HKV, 1), vs.repeat_interleave(HQ // HKV, 1)
            expected = F.scaled_dot_product_attention(qs, kr, vr, is_causal=True)
            run_sdpa, mode = (lambda: F.scaled_dot_product_attention(qs, kr, vr, is_causal=True)), "flash, repeated KV"
        sdpa_ms = triton.testing.do_bench(run_sdpa, warmup=100, rep=400, return_mode="median")
    expected = expected[0].transpose(0, 1)                                        # [T, Hq, D]
    result = {"tokens": num_tokens, "flops": flops, "sdpa": {"mode": mode, "ms": sdpa_ms,
                                                            "tflops": flops / sdpa_ms / 1e9}}
    default = attention_config(num_tokens, 1, HKV, HQ // HKV, block_tables.shape[1] * block_size,
                               num_sms(q.device), block_size=block_size)
    configs = [default] + ([c for c in PREFILL_SWEEP if c != default] if sweep else [])
    rows = []
    for config in configs:
        out = torch.full_like(q, float("nan"))
        run = lambda: launch_paged_attention(out, q, k_cache, v_cache, block_tables, cu_seqlens, context_lens,  # noqa
                                             scale, config)
        try:
            run()
            torch.cuda.synchronize()
        except Exception as error:                      # out of shared memory / registers: skip the config
            rows.append({"config": dataclasses.asdict(config), "error": str(error)[:200]})
            continue
        ms = triton.testing.do_bench(run, warmup=100, rep=400, return_mode="median")
        rows.append({"config": dataclasses.asdict(config), "ms": ms, "tflops": flops / ms / 1e9,
                     "vs_sdpa": sdpa_ms / ms, "rel_error_vs_sdpa": rel_error(out, expected)})
    result["default"] = rows[0]
    result["sweep"] = rows[1:]
    return result


def decode_case(num_rows: int, context: int, q_len: int, gen: torch.Generator, table_tokens: int = 0):
    """table_tokens: width of the block tables in tokens (an engine's are max_model_len wide,
    whatever the context; default: the context)."""
    block_size = 16
    blocks_per_row = context // block_size
    kv_bytes = num_rows * context * HKV * D * 2 * 2
    rotations = max(1, min(32, math.ceil(512e6 / kv_bytes)))
    k_cache, v_cache, ids = shuffled_pool(rotations * num_rows * blocks_per_row + 1, block_size, gen)
    tables = ids.view(rotations, num_rows, blocks_per_row)
    if table_tokens > context:
        tables = F.pad(tables, (0, table_tokens // block_size - blocks_per_row))  # block 0 past the context
    num_tokens = num_rows * q_len
    qs = [torch.randn(num_tokens, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(rotations)]
    cu_seqlens = torch.arange(0, num_tokens + 1, q_len, dtype=torch.int32, device="cuda")
    context_lens = torch.full((num_rows,), context, dtype=torch.int32, device="cuda")
    return dict(k_cache=k_cache, v_cache=v_cache, tables=tables, qs=qs, cu_seqlens=cu_seqlens,
                context_lens=context_lens, kv_bytes=kv_bytes, rotations=rotations)


def time_config(case: dict, config: TileConfig) -> tuple[float, torch.Tensor]:
    outs = [torch.full_like(q, float("nan")) for q in case["qs"]]

    def call(i: int):
        return lambda: launch_paged_attention(outs[i], case["qs"][i], case["k_cache"], case["v_cache"], case["tables"][i],
                                              case["cu_seqlens"], case["context_lens"], D ** -0.5, config)
    calls = [call(i) for i in range(case["rotations"])]
    us = graph_time_us(lambda r: calls[r](), len(calls))
    return us, outs[0]


SWEEP = [(block_n, warps, stages) for block_n, warps, stages in
         [(32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 8, 2)]]
# Small batches are latency-bound: shorter key steps, fewer warps, no pipelining too.
SMALL_BATCH_SWEEP = [(block_n, warps, stages) for block_n in (16, 32, 64) for warps in (2, 4)
                     for stages in (1, 2, 3)]


def same_bytes_copy(num_bytes: int, copy_gbps: float) -> dict:
    """A device copy that moves num_bytes (half read, half written), timed like the kernel (graph
    replays over rotated buffers): what the copy bandwidth comes to at this size, launch and
    ramp-up included; small decodes cannot beat it."""
    rotations = max(1, min(32, math.ceil(512e6 / num_bytes)))
    sources = [torch.empty(num_bytes // 4, dtype=torch.int16, device="cuda").random_() for _ in range(rotations)]
    targets = [torch.empty_like(source) for source in sources]
    us = graph_time_us(lambda r: targets[r].copy_(sources[r]), rotations)
    return {"us": us, "gbps": num_bytes / us / 1e3, "fraction_of_copy": num_bytes / us / 1e3 / copy_gbps}


def bench_decode(num_rows: int, context: int, q_len: int, copy_gbps: float, sweep: bool, gen: torch.Generator,
                 table_tokens: int = 0, sweep_table: list = SWEEP) -> dict:
    case = decode_case(num_rows, context, q_len, gen, table_tokens)
    kv_bytes = case["kv_bytes"]
    num_tokens = num_rows * q_len
    default = attention_config(num_tokens, num_rows, HKV, HQ // HKV, max(context, table_tokens),
                               num_sms(torch.device("cuda")), block_size=case["k_cache"].shape[1])

    # Flash SDPA over contiguous copies of the same K/V (rotation 0), as the independent check and peer.
    ks = gather_rows(case["k_cache"], case["tables"][0], context)
    vs = gather_rows(case["v_cache"], case["tables"][0], context)
    q0 = case["qs"][0].view(num_rows, q_len, HQ, D).transpose(1, 2)                # [B, Hq, q_len, D]
    # Rows' queries are their last q_len positions: bottom-right causal = an explicit mask for q_len > 1.
    mask = None
    if q_len > 1:
        mask = (torch.arange(context, device="cuda")[None, :]
                <= context - q_len + torch.arange(q_len, device="cuda")[:, None])
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        group = HQ // HKV
        expected = F.scaled_dot_product_attention(q0, ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1),
                                                  attn_mask=mask).transpose(1, 2).reshape(num_tokens, HQ, D)
    result = {"rows": num_rows, "context": context, "q_len": q_len, "kv_bytes": kv_bytes,
              "rotations": case["rotations"], "table_tokens": max(context, table_tokens)}
    if q_len == 1:
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa_us = graph_time_us(lambda r: F.scaled_dot_product_attention(q0, ks, vs, enable_gqa=True), 1)
            result["sdpa_contiguous_kv_flash_enable_gqa"] = {"us": sdpa_us, "gbps": kv_bytes / sdpa_us / 1e3,
                                                             "note": "one KV set, may sit in L2 when small"}
        except RuntimeError as error:
            result["sdpa_contiguous_kv_flash_enable_gqa"] = {"error": str(error)[:200]}

    if q_len == 1:
        result["same_bytes_copy"] = same_bytes_copy(kv_bytes, copy_gbps)

    def record(config, label):
        try:
            us, out = time_config(case, config)
        except Exception as error:
            return {"config": label, "error": str(error)[:200]}
        gbps = kv_bytes / us / 1e3
        return {"config": label, "us": us, "gbps": gbps, "fraction_of_copy": gbps / copy_gbps,
                "rel_error_vs_sdpa": rel_error(out, expected)}

    result["default"] = record(default, dataclasses.asdict(default))     # what paged_attention picks for this shape
    if sweep:
        rows = []
        for block_n, warps, stages in sweep_table:
            for splits in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                if splits > 1 and max(context, table_tokens) // splits < block_n:
                    continue
                config = dataclasses.replace(default, block_n=block_n, num_warps=warps, num_stages=stages,
                                             num_splits=splits)
                rows.append(record(config, dataclasses.asdict(config)))
        result["sweep"] = rows
        timed = [r for r in rows if "us" in r]
        result["best"] = min(timed, key=lambda r: r["us"]) if timed else None
    return result


def compiled_resources() -> list:
    """Registers / spills / shared memory of every compiled attention kernel variant (best effort)."""
    from deltaspec.kernels import attention
    found = []
    for fn in (attention._paged_attention_kernel, attention._combine_splits_kernel):
        for device_cache in getattr(fn, "device_caches", {}).values():
            for key, kernel in device_cache[0].items():
                found.append({"kernel": fn.__name__, "key": str(key)[:300], "n_regs": getattr(kernel, "n_regs", None),
                              "n_spills": getattr(kernel, "n_spills", None),
                              "shared": getattr(kernel.metadata, "shared", None)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time alternative configs and split counts")
    parser.add_argument("--out", default=None, help="extra directory for the JSON (the device's $OUT)")
    parser.add_argument("--small-batch", action="store_true",
                        help="only decode at batch 1-8 over short contexts in 8192-token tables (an engine "
                             "step's shape), with a sweep for latency-bound tiles; kernels_attn_small-<gpu>.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    name = torch.cuda.get_device_name()
    gpu = device_tag(name)
    report = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": commit_id(),
              "command": " ".join([sys.executable] + sys.argv), "torch": torch.__version__,
              "triton": triton.__version__, "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}}
    stem = f"kernels_attn_small-{gpu}.json" if args.small_batch else f"kernels_attn-{gpu}.json"
    paths = [ROOT / "bench" / "results" / stem]
    if args.out:
        paths.append(pathlib.Path(args.out) / stem)

    def save():
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1))

    report["copy_gbps"] = copy_gbps = copy_bandwidth() / 1e9
    report["matmul_bf16_tflops"] = matmul_tflops()
    print(f"{name}: copy {copy_gbps:.0f} GB/s, bf16 matmul {report['matmul_bf16_tflops']:.0f} TFLOP/s", flush=True)
    save()
    if args.small_batch:
        report["decode"] = []
        for context in (512, 2048):
            for num_rows in (1, 2, 8):
                report["decode"].append(bench_decode(num_rows, context, 1, copy_gbps, True, gen, table_tokens=8192,
                                                     sweep_table=SMALL_BATCH_SWEEP))
                save()
                best, default = report["decode"][-1]["best"], report["decode"][-1]["default"]
                print(f"B={num_rows} C={context}: default {default.get('us', float('nan')):.2f} us "
                      f"{tuple(default['config'].values())}, best {best['us']:.2f} us {tuple(best['config'].values())}",
                      flush=True)
        report["compiled"] = compiled_resources()
        save()
        return
    report["prefill"] = []
    for num_tokens in (4096, 16384):
        report["prefill"].append(bench_prefill(num_tokens, args.sweep, gen))
        save()
        torch.cuda.empty_cache()
    report["decode"] = []
    for context in (4096, 32768):
        for num_rows in (1, 16, 64):
            report["decode"].append(bench_decode(num_rows, context, 1, copy_gbps, args.sweep, gen))
            save()
            torch.cuda.empty_cache()
    report["verify"] = []
    for context in (4096, 32768):
        for num_rows in (16, 64):
            report["verify"].append(bench_decode(num_rows, context, 4, copy_gbps, False, gen))
            save()
            torch.cuda.empty_cache()
    report["compiled"] = compiled_resources()
    save()

    print("\nprefill (T, SDPA TFLOP/s, ours TFLOP/s, ratio, rel err) | sweep best")
    for p in report["prefill"]:
        d = p["default"]
        best = max((r for r in p["sweep"] if "ms" in r), key=lambda r: r["tflops"], default=None)
        best_text = f"{best['tflops']:.0f} {tuple(best['config'].values())}" if best else "-"
        print(f"  T={p['tokens']:6d} sdpa {p['sdpa']['tflops']:6.1f} ours {d.get('tflops', float('nan')):6.1f} "
              f"x{d.get('vs_sdpa', float('nan')):.2f} err {d.get('rel_error_vs_sdpa', float('nan')):.1e} | {best_text}")
    print("decode/verify (B, C, q_len, us, GB/s, of copy, rel err) | sweep best")
    for r in report["decode"] + report["verify"]:
        d = r["default"]
        best = r.get("best")
        best_text = f"{best['us']:.1f}us {best['fraction_of_copy']:.2f} {tuple(best['config'].values())}" if best else "-"
        print(f"  B={r['rows']:3d} C={r['context']:6d} q={r['q_len']} {d.get('us', float('nan')):8.1f}us "
              f"{d.get('gbps', float('nan')):6.0f} GB/s {d.get('fraction_of_copy', float('nan')):.2f} "
              f"err {d.get('rel_error_vs_sdpa', float('nan')):.1e} {tuple(d['config'].values())} | {best_text}"
              + (f" | copy of these bytes {r['same_bytes_copy']['fraction_of_copy']:.2f}" if "same_bytes_copy" in r else ""))
    spills = [c for c in report["compiled"] if c.get("n_spills")]
    print(f"compiled variants: {len(report['compiled'])}, with spills: {[(c['n_regs'], c['n_spills']) for c in spills]}")


if __name__ == "__main__":
    main()
