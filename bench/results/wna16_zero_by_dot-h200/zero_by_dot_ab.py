"""The zero point by a ones-MMA (ZERO_BY_DOT) against subtracted from the unpacked values, 3 and 4 stages, at 1 and 8
rows on the 9B projections, with the tiles wna16_config chose at 64e0817 (whose _wna16_gemm_kernel took ZERO_BY_DOT;
run there, from the repo root: python bench/results/wna16_zero_by_dot-h200/zero_by_dot_ab.py OUT.json). H200 -> zero_by_dot_ab-h200.json."""
import json, sys
import torch, triton
sys.path.insert(0, "bench")
from common import copy_bandwidth, graph_time_us
from kernels_wna16 import num_copies, packed_weights
from deltaspec.kernels import wna16 as W
from deltaspec.kernels.arrivals import arrival_counters
from deltaspec.kernels.launch import dot_precision, pdl

def launch(y, x, qweight, scales, config, zbd):
    m, k = x.shape
    n = qweight.shape[0]
    steps = triton.cdiv(k, config.block_k)
    per = triton.cdiv(steps, config.num_splits)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), triton.cdiv(steps, per))
    partials = torch.empty((grid[1], m, n), dtype=torch.float32, device=x.device) if grid[1] > 1 else y
    arrivals = arrival_counters(x.device, grid[0]) if grid[1] > 1 else y
    W._wna16_gemm_kernel[grid](x, qweight, scales, qweight, qweight, y, partials, arrivals, W.pair_mask(4), m, n, k,
        128, scales.shape[1], per, x.stride(0), y.stride(0), BITS=4, **W._unpack_constants(x.dtype, 4),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=grid[1], GROUP_M=8,
        HAS_ZEROS=False, HAS_PERM=False, ZERO_BY_DOT=zbd, EVEN_K=True, PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl(x.device))

SHAPES = {"in_proj": (12352, 4096), "gate_up": (24576, 4096), "down": (4096, 12288), "out_proj": (4096, 4096)}
bw = copy_bandwidth()
out = {"device": torch.cuda.get_device_name(), "rows": []}
for m in (1, 8):
    for name, (n, k) in SHAPES.items():
        copies = num_copies(n * k // 2)
        packed = packed_weights(n, k, copies)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = W.wna16_linear_reference(x, *packed[0], None, None, 128, 4).float()
        base = W.wna16_config(m, n, k, 128, x.device)
        row = {"m": m, "shape": name, "config": repr(base)}
        for zbd in (True, False):
            for stages in (3, 4):
                config = W.TileConfig(block_m=base.block_m, block_n=base.block_n, block_k=base.block_k,
                                      num_splits=base.num_splits, num_warps=4, num_stages=stages)
                launch(y, x, *packed[0], config, zbd)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                us = graph_time_us(lambda r: launch(y, x, *packed[r % copies], config, zbd), copies)
                row[f"zbd{int(zbd)}_s{stages}"] = (round(us, 2), round(err, 5))
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
