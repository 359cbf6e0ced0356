"""The one-row form of the skinny GEMM against the MMA form on a chain of a model's projections:
the 0.8B shape's 96 decode projections at one row (in_proj, out_proj, gate_up, down of 24
layers, each its own weights, each reading the one before's output), graph-replayed with PDL as
a decode step runs them. The MMA form with kernel_config's tiles (split-K), the one-row form
(kernels/linear.py launch_gemv) with gemv_config's tiles and with other program sizes and warps
(what GEMV_PROGRAM_BYTES and GEMV_WARPS were picked from). Then the lm_head of the 0.8B and the
9B shapes (248320 rows of 1024 / 4096) at one row: cuBLAS (F.linear, as the model's head runs)
against the one-row form, one call a replay of 2 (W is far larger than L2).

    python bench/tools/gemv_chain.py [--out bench/results]  -> gemv-<gpu>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import commit_id, device_tag, graph_time_us  # noqa: E402
from deltaspec.kernels.device import num_sms  # noqa: E402
from deltaspec.kernels.linear import gemv_config, kernel_config, launch_gemv, launch_linear  # noqa: E402

# (N, K) of a 0.8B GDN layer's projections in step order: in_proj, out_proj, gate_up, down.
SHAPES = [(8224, 1024), (1024, 2048), (7168, 1024), (1024, 3584)]
LAYERS = 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = num_sms(device)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for n, k in SHAPES]
               for _ in range(LAYERS)]
    outputs = [[torch.empty(1, n, device=device, dtype=torch.bfloat16) for n, _ in SHAPES] for _ in range(LAYERS)]
    x0 = torch.randn(1, SHAPES[0][1], device=device, dtype=torch.bfloat16)
    weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)

    def chain(launch, configs):
        x = x0
        for layer_weights, layer_outputs in zip(weights, outputs):
            for (_, k), w, y, config in zip(SHAPES, layer_weights, layer_outputs, configs):
                launch(y, x[:, :k], w, config)
                x = y
        return x

    mma = [kernel_config(1, n, k, sms) for n, k in SHAPES]
    reference = chain(launch_linear, mma).float().clone()
    variants = [("mma (kernel_config)", launch_linear, mma),
                ("gemv (gemv_config)", launch_gemv, [gemv_config(n, k, device) for n, k in SHAPES])]
    variants += [(f"gemv {b >> 10} KB, {w} warps", launch_gemv,
                  [gemv_config(n, k, device, program_bytes=b, num_warps=w) for n, k in SHAPES])
                 for b in (8 << 10, 16 << 10, 32 << 10, 64 << 10) for w in (4, 8)]
    rows = []
    for name, launch, configs in variants:
        out = chain(launch, configs).float()
        us = graph_time_us(lambda _: chain(launch, configs), 4)
        rows.append({"variant": name, "block_n": [c.block_n for c in configs], "num_warps": configs[0].num_warps,
                     "us": us, "gb_per_s": weight_bytes / us / 1e3,
                     "max_diff_vs_mma": (out - reference).abs().max().item()})
        print(f"{name:26s} block_n {rows[-1]['block_n']}: {us:7.1f} us  {rows[-1]['gb_per_s']:5.0f} GB/s")
    heads = [lm_head_row(device, k) for k in (1024, 4096)]
    name = torch.cuda.get_device_name()
    report = {"benchmark": "gemv_chain", "device": name,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "shapes": SHAPES, "layers": LAYERS,
              "weight_bytes": weight_bytes, "results": rows,
              "lm_head": heads}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gemv-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    print("wrote", path)


def lm_head_row(device: torch.device, hidden: int, vocab: int = 248320) -> dict:
    """One row through a [vocab, hidden] head: cuBLAS and the one-row form's variants."""
    weight = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16) * hidden ** -0.5
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    y = torch.empty(1, vocab, device=device, dtype=torch.bfloat16)
    reference = torch.nn.functional.linear(x, weight).float()
    times = {"cublas": graph_time_us(lambda _: torch.nn.functional.linear(x, weight), 2)}
    diffs = {}
    for program_bytes in (16 << 10, 32 << 10, 64 << 10):
        for warps in (4, 8):
            config = gemv_config(vocab, hidden, device, program_bytes=program_bytes, num_warps=warps)
            name = f"gemv {program_bytes >> 10} KB, {warps} warps"
            launch_gemv(y, x, weight, config)
            diffs[name] = (y.float() - reference).abs().max().item()
            times[name] = graph_time_us(lambda _: launch_gemv(y, x, weight, config), 2)
    weight_bytes = weight.numel() * weight.element_size()
    for name, us in times.items():
        print(f"lm_head {vocab}x{hidden} {name:22s}: {us:7.1f} us  {weight_bytes / us / 1e3:5.0f} GB/s")
    return {"vocab": vocab, "hidden": hidden, "weight_bytes": weight_bytes, "us": times, "max_diff_vs_cublas": diffs}


if __name__ == "__main__":
    main()
