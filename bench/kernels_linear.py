"""Skinny GEMM (kernels/linear.py) against F.linear (cuBLAS) on the dense projections of
Qwen3.5-0.8B, -9B and -35B-A3B at decode/verify batch sizes, and both against the copy-bandwidth
roofline, on one GPU. bf16, random weights.

    source bench/tools/device_setup.sh && python3 bench/kernels_linear.py --sweep --out $OUT

(from the repo root; without --out it writes to bench/results). Writes
kernels_linear-<gpu>.json and prints a table.

Projections (y[M, N] = x[M, K] @ W[N, K]^T), from the configs of bench/engine_throughput.py
SHAPES, per layer: GDN in_proj N = conv_dim + HV*128 + 2*HV with conv_dim = 2*HK*128 + HV*128,
K = hidden; GDN out_proj N = hidden, K = HV*128; attention q+gate|k|v N = 2*H*256 + 2*HKV*256,
K = hidden; o_proj N = hidden, K = H*256; MLP gate|up N = 2*I, K = hidden; down N = hidden, K = I.
(The MTP fc, N = hidden, K = 2*hidden, has out_proj's shape at 0.8B.)

Per projection and M in ROWS:
  cublas: F.linear;  ours: kernels.linear.linear (the kernel where its rule picks it, else
  F.linear, so ours == cublas there);  kernel: the kernel with its tile heuristic whatever
  the rule says (the data for the rule).
Each is timed as a CUDA graph of R calls over R copies of W (R x W >= 256 MiB, so no call
finds its weight in the 50-60 MB L2), time per call = median replay / R; and eagerly
(common.eager_time_us: events around R back-to-back calls, so where the host launches slower
than the GPU runs, this is the launch cost: the case of steps that are not graphed). Bytes = W + x + y;
roofline fraction = bytes / time / copy bandwidth measured in the same run. Error = max |y -
y_fp32| / max |y_fp32| against F.linear in fp32 on the same bf16 inputs, for ours and cuBLAS.
"step" sums a decode step's projections (layer counts in LAYERS) for cuBLAS and ours.

--sweep (a second pass, after the main numbers are written, narrow N first) times a grid of
configs per row (BLOCK_N x BLOCK_K x num_stages x split-K for 1/2, 1 and 2 programs per SM)
and records each config's time and the best: the data kernel_config and use_kernel are tuned
from. The whole run (main table and sweep) took 2.3 minutes on an H100.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import traceback

import torch
import torch.nn.functional as F
import triton

from common import commit_id, copy_bandwidth, device_tag, eager_time_us, graph_time_us  # noqa: E402
from deltaspec.kernels.arrivals import arrival_counters
from deltaspec.kernels.linear import block_m, kernel_config, launch_linear, linear, linear_config, split_k_for
from deltaspec.kernels.tiles import TileConfig

ROWS = (1, 4, 8, 16, 32, 64)
L2_DEFEAT_BYTES = 256 << 20
MAX_COPIES = 64
# As bench/engine_throughput.py SHAPES (head dims: GDN 128, attention 256).
MODELS = {
    "0.8b": dict(hidden=1024, key_heads=16, value_heads=16, heads=8, kv_heads=2, intermediate=3584, layers=24),
    "9b": dict(hidden=4096, key_heads=16, value_heads=32, heads=16, kv_heads=4, intermediate=12288, layers=32),
    # Qwen3.5-35B-A3B's dense projections (its MLP here: the shared expert; the routed experts are
    # kernels/moe.py's)
    "35b-a3b": dict(hidden=2048, key_heads=16, value_heads=32, heads=16, kv_heads=2, intermediate=512, layers=40),
}


def projections(hidden: int, key_heads: int, value_heads: int, heads: int, kv_heads: int, intermediate: int,
                layers: int) -> list[tuple[str, int, int, int]]:
    """-> (name, N, K, calls per decode step); 3 GDN layers to 1 attention layer."""
    conv_dim = 2 * key_heads * 128 + value_heads * 128
    gdn, attention = layers * 3 // 4, layers // 4
    return [
        ("gdn.in_proj", conv_dim + value_heads * 128 + 2 * value_heads, hidden, gdn),
        ("gdn.out_proj", hidden, value_heads * 128, gdn),
        ("attn.qkv_proj", 2 * heads * 256 + 2 * kv_heads * 256, hidden, attention),
        ("attn.o_proj", hidden, heads * 256, attention),
        ("mlp.gate_up", 2 * intermediate, hidden, layers),
        ("mlp.down", hidden, intermediate, layers),
    ]


def config_name(c: TileConfig) -> str:
    return f"{c.block_n}x{c.block_k}/s{c.num_splits}/w{c.num_warps}p{c.num_stages}"


def sweep_configs(num_rows: int, n: int, k: int, sms: int) -> list[TileConfig]:
    """Tiles whose pipeline stages fit in 160 KB of shared memory, each at the split-K that
    gives about 1/2, 1 and 2 programs per SM (4 per SM and 8 warps never won on the H100)."""
    tiles = [(bn, bk, w, s) for bn in (16, 32, 64, 128) for bk in (128, 256) for w, s in ((4, 3), (4, 4))
             if s * (bn + block_m(num_rows)) * bk * 2 <= 160 << 10]
    configs = []
    for bn, bk, w, s in tiles:
        for programs in (sms // 2, sms, 2 * sms):
            split = split_k_for(triton.cdiv(k, bk), triton.cdiv(programs, triton.cdiv(n, bn)))
            config = TileConfig(block_n=bn, block_k=bk, num_splits=split, num_warps=w, num_stages=s)
            if config not in configs:
                configs.append(config)
    return configs


class Setup:
    """R copies of a random W [N, K] (R x W >= L2_DEFEAT_BYTES) and one x [M, K], bf16."""

    def __init__(self, num_rows: int, n: int, k: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(n * 7 + k + num_rows)
        self.weight_bytes = n * k * 2
        self.copies = max(2, min(MAX_COPIES, -(-L2_DEFEAT_BYTES // self.weight_bytes)))
        self.weights = [(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
                        for _ in range(self.copies)]
        self.x = torch.randn(num_rows, k, generator=gen, device="cuda").bfloat16()
        self.y = torch.empty(num_rows, n, dtype=torch.bfloat16, device="cuda")
        self.bytes = self.weight_bytes + 2 * num_rows * (n + k)

    def time_cublas(self) -> float:
        return graph_time_us(lambda r: F.linear(self.x, self.weights[r]), self.copies)

    def time_ours(self) -> float:
        return graph_time_us(lambda r: linear(self.x, self.weights[r]), self.copies)

    def eager_cublas(self) -> float:
        return eager_time_us(lambda r: F.linear(self.x, self.weights[r]), self.copies)

    def eager_ours(self) -> float:
        return eager_time_us(lambda r: linear(self.x, self.weights[r]), self.copies)

    def time_config(self, config: TileConfig) -> float:
        return graph_time_us(lambda r: launch_linear(self.y, self.x, self.weights[r], config), self.copies)

    def errors(self) -> tuple[float, float]:
        """Relative max error of ours and of cuBLAS against F.linear in fp32."""
        expected = F.linear(self.x.float(), self.weights[0].float())
        scale = expected.abs().max()
        return tuple(float((y.float() - expected).abs().max() / scale)
                     for y in (linear(self.x, self.weights[0]), F.linear(self.x, self.weights[0])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", "--out-dir", dest="out_dir", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configs per row")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--projections", default="", help="comma-separated names (gdn.out_proj, ...); default all")
    args = parser.parse_args()
    models = args.models.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    wanted = set(filter(None, args.projections.split(",")))
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    device = torch.device("cuda", 0)
    result = dict(
        benchmark="kernels_linear", device=props.name, num_sms=sms,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit_id(),
        command=" ".join([sys.executable] + sys.argv), torch=torch.__version__, triton=triton.__version__,
        dtype="bf16", models={m: MODELS[m] for m in models},
        timing=f"CUDA graph of R calls over R copies of W (R x W >= {L2_DEFEAT_BYTES >> 20} MiB), "
               "median of 20 replays / R",
        rows=[],
    )
    result["copy_bandwidth_GBps"] = bandwidth = copy_bandwidth() / 1e9
    print(f"{props.name}: {sms} SMs, copy bandwidth {bandwidth:.0f} GB/s (read + write)", flush=True)
    arrival_counters(device, 4096)  # sized before any capture
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"kernels_linear-{device_tag(props.name)}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    for model in models:
        for name, n, k, calls in projections(**MODELS[model]):
            if wanted and name not in wanted:
                continue
            for num_rows in rows:
                row = dict(model=model, projection=name, N=n, K=k, M=num_rows, calls_per_step=calls)
                try:
                    setup = Setup(num_rows, n, k)
                    chosen = linear_config(num_rows, n, k, device)
                    tiles = kernel_config(num_rows, n, k, sms)
                    row.update(copies=setup.copies, bytes=setup.bytes,
                               ours_config=config_name(chosen) if chosen else "cublas",
                               kernel_config=config_name(tiles))
                    row["ours_error"], row["cublas_error"] = setup.errors()
                    for label, timer in (("cublas", setup.time_cublas), ("ours", setup.time_ours),
                                         ("kernel", lambda: setup.time_config(tiles))):
                        row[f"{label}_us"] = timer()
                        row[f"{label}_roofline"] = setup.bytes / row[f"{label}_us"] / 1e3 / bandwidth
                    row["speedup"] = row["cublas_us"] / row["ours_us"]
                    row["cublas_eager_us"], row["ours_eager_us"] = setup.eager_cublas(), setup.eager_ours()
                    del setup
                except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                    row["error"] = repr(error)
                    traceback.print_exc()
                torch.cuda.empty_cache()
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()
    result["step"] = step_totals(result["rows"])
    save()
    if args.sweep:  # second pass, so that a time limit cuts the sweep, not the main numbers; narrow N first
        for row in sorted(result["rows"], key=lambda r: r["N"]):
            if "error" in row:
                continue
            sweep: dict[str, float | str] = {}
            try:
                setup = Setup(row["M"], row["N"], row["K"])
                for config in sweep_configs(row["M"], row["N"], row["K"], sms):
                    try:
                        sweep[config_name(config)] = setup.time_config(config)
                    except Exception as error:  # noqa: BLE001 - e.g. out of shared memory
                        sweep[config_name(config)] = repr(error)[:200]
                del setup
            except Exception as error:  # noqa: BLE001
                row["sweep_error"] = repr(error)
                traceback.print_exc()
            torch.cuda.empty_cache()
            timed = {c: t for c, t in sweep.items() if isinstance(t, float)}
            row["sweep_us"] = sweep
            if timed:
                best = min(timed, key=timed.get)
                row["sweep_best"], row["sweep_best_us"] = best, timed[best]
                row["sweep_best_roofline"] = row["bytes"] / timed[best] / 1e3 / bandwidth
            print(json.dumps({key: row.get(key) for key in ("model", "projection", "M", "kernel_config", "kernel_us",
                                                            "sweep_best", "sweep_best_us")}), flush=True)
            save()
    print_table(result)
    print("wrote", path)


def step_totals(rows: list[dict]) -> list[dict]:
    """Per model and M: the decode step's projections summed, cuBLAS against ours (µs)."""
    totals = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for num_rows in dict.fromkeys(r["M"] for r in rows):
            mine = [r for r in rows if r["model"] == model and r["M"] == num_rows]
            if mine and all("ours_us" in r for r in mine):
                totals.append(dict(model=model, M=num_rows,
                                   cublas_us=sum(r["calls_per_step"] * r["cublas_us"] for r in mine),
                                   ours_us=sum(r["calls_per_step"] * r["ours_us"] for r in mine)))
    return totals


def print_table(result: dict) -> None:
    nan = float("nan")
    print(f"{'model':5} {'projection':13} {'N':>6} {'K':>6} {'M':>3} | {'cublas':>7} {'ours':>7} {'kernel':>7} us | "
          f"{'cublas':>6} {'ours':>5} {'kernel':>6} of roofline | eager us: {'cublas':>6} {'ours':>6} | "
          f"{'error':>7} | ours config / sweep best")
    for r in result["rows"]:
        best = f" / {r['sweep_best']} {r['sweep_best_us']:.2f}us" if "sweep_best" in r else ""
        print(f"{r['model']:5} {r['projection']:13} {r['N']:6} {r['K']:6} {r['M']:3} | {r.get('cublas_us', nan):7.2f} "
              f"{r.get('ours_us', nan):7.2f} {r.get('kernel_us', nan):7.2f}    | {r.get('cublas_roofline', nan):6.2f} "
              f"{r.get('ours_roofline', nan):5.2f} {r.get('kernel_roofline', nan):6.2f}              | "
              f"          {r.get('cublas_eager_us', nan):6.2f} {r.get('ours_eager_us', nan):6.2f} | "
              f"{r.get('ours_error', nan):7.1e} | {r.get('ours_config', r.get('error', '?'))}{best}")
    for t in result.get("step", []):
        print(f"decode step projections, {t['model']} M={t['M']}: cuBLAS {t['cublas_us']:.0f} us, "
              f"ours {t['ours_us']:.0f} us")


if __name__ == "__main__":
    main()
