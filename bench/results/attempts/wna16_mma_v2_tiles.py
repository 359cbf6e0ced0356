"""Skinny packed GEMM tiles at 1, 8 and 32 rows: MMAv2 (1-2 warps, small tiles, many programs) against the 4-warp
wgmma tiles (kernels/wna16.py at 6955de0^ with the scale prefetch). Run from the repo root on the GPU:
    python bench/results/attempts/wna16_mma_v2_tiles.py OUT.json
"""
import json, sys, time
import torch, triton
sys.path.insert(0, "bench")
from common import copy_bandwidth, graph_time_us
from kernels_wna16 import num_copies, packed_weights
from deltaspec.kernels.linear import split_k_for
from deltaspec.kernels.tiles import TileConfig
from deltaspec.kernels.wna16 import launch_wna16_gemm, wna16_config, wna16_linear_reference

SHAPES = {"in_proj": (12352, 4096), "gate_up": (24576, 4096), "down": (4096, 12288), "out_proj": (4096, 4096)}
CANDIDATES = [(w, bn, st, per_sm) for w, bns in ((1, (16, 32, 64)), (2, (32, 64, 128))) for bn in bns
              for st in (3, 4) for per_sm in (4, 8, 16)] + [(4, 128, 4, 2), (4, 64, 4, 4)]
bw = copy_bandwidth()
sms = torch.cuda.get_device_properties(0).multi_processor_count
report = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "cases": []}
t0 = time.time()
for m in (1, 8, 32):
    for name, (n, k) in SHAPES.items():
        copies = num_copies(n * k // 2)
        packed = packed_weights(n, k, copies)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = wna16_linear_reference(x, *packed[0], None, None, 128, 4).float()
        nbytes = n * k // 2 + n * k // 128 * 4
        chosen = wna16_config(m, n, k, 128, x.device)
        rows = []
        for warps, block_n, stages, per_sm in CANDIDATES:
            block_m = max(16, triton.next_power_of_2(m))
            tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
            splits = split_k_for(k // 128, max(1, triton.cdiv(per_sm * sms, tiles)))
            config = TileConfig(block_m=block_m, block_n=block_n, block_k=128, num_splits=splits, num_warps=warps,
                                num_stages=stages)
            try:
                launch_wna16_gemm(y, x, *packed[0], None, None, 128, 4, config)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                us = graph_time_us(lambda r: launch_wna16_gemm(y, x, *packed[r % copies], None, None, 128, 4, config),
                                   copies)
            except Exception as exc:
                rows.append({"config": repr(config), "error": str(exc)[:120]})
                continue
            rows.append({"config": repr(config), "us": round(us, 2), "share": round(nbytes / (us * 1e-6) / bw, 3),
                         "err": round(err, 5)})
        timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        print(m, name, "chosen", repr(chosen), "| best:", [(r["config"], r["us"], r["share"]) for r in timed[:3]],
              "| 4-warp:", [(r["us"], r["share"]) for r in rows if "num_warps=4" in r["config"]], flush=True)
        report["cases"].append({"m": m, "shape": name, "n": n, "k": k, "chosen": repr(chosen), "configs": rows})
json.dump(report, open(sys.argv[1], "w"), indent=1)
print(f"{time.time() - t0:.0f} s")
