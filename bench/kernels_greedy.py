"""greedy_argmax (kernels/greedy.py) against the bytes it reads, by its tile: the logits a loop
step loads (STEP_BYTES), the warps of a program (WARPS) and the programs an SM (PROGRAMS_PER_SM),
each variant at the rows a step feeds it (1 and 64 plain decode rows, 4 verify positions of one
row) over the 248,320-column vocabulary and a 32K draft vocabulary, bf16 and fp32, beside
torch.argmax on the same logits.

Timing: a CUDA graph of R calls over R copies of the logits (R x bytes >= 256 MiB, so no call
reads another's from L2), median of 20 replays / R. `GB/s` is the logits' bytes over that time;
`of_copy` its share of the device-to-device copy bandwidth (bytes read + written). Writes
bench/results/kernels_greedy-<device>.json.

    python bench/kernels_greedy.py
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, graph_time_us, write_result  # noqa: E402

from deltaspec.kernels import greedy  # noqa: E402

# (rows, width): plain decode rows, and one row's k + 1 = 4 verify positions (one group).
ROWS = ((1, 1), (4, 4), (64, 1))
VOCABS = (248_320, 32_768)
DTYPES = (torch.bfloat16, torch.float32)
STEP_BYTES = (2 << 10, 4 << 10, 8 << 10, 16 << 10)
WARPS = (4, 8)
PROGRAMS_PER_SM = (4, 8)


def time_us(launch, nbytes: int) -> float:
    repeats = max(1, -(-(256 << 20) // nbytes))
    return graph_time_us(launch, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth()
    shipped = (greedy.STEP_BYTES, greedy.WARPS, greedy.PROGRAMS_PER_SM)
    rows_out = []
    for (num_rows, width), vocab, dtype in itertools.product(ROWS, VOCABS, DTYPES):
        nbytes = num_rows * vocab * torch.finfo(dtype).bits // 8
        repeats = max(1, -(-(256 << 20) // nbytes))
        copies = [torch.randn(num_rows, vocab, device=device).to(dtype) for _ in range(repeats)]
        tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
        flags = torch.empty(num_rows // width, dtype=torch.int64, device=device)
        expected = copies[0].argmax(dim=-1)
        entry = {"rows": num_rows, "width": width, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
                 "bytes": nbytes, "variants": {}}
        torch_us = graph_time_us(lambda r: torch.argmax(copies[r], dim=-1), repeats)
        entry["torch_argmax_us"] = torch_us
        for step_bytes, warps, per_sm in itertools.product(STEP_BYTES, WARPS, PROGRAMS_PER_SM):
            greedy.STEP_BYTES, greedy.WARPS, greedy.PROGRAMS_PER_SM = step_bytes, warps, per_sm
            greedy.greedy_argmax(copies[0], width, tokens, flags)
            assert torch.equal(tokens, expected), (num_rows, vocab, dtype, step_bytes, warps, per_sm)
            us = graph_time_us(lambda r: greedy.greedy_argmax(copies[r], width, tokens, flags), repeats)
            entry["variants"][f"{step_bytes >> 10}KB/w{warps}/p{per_sm}"] = {
                "us": us, "GB/s": nbytes / us * 1e-3, "of_copy": nbytes / (us * 1e-6) / copy}
        greedy.STEP_BYTES, greedy.WARPS, greedy.PROGRAMS_PER_SM = shipped
        best = min(entry["variants"].items(), key=lambda kv: kv[1]["us"])
        entry["best"] = best[0]
        entry["shipped"] = f"{shipped[0] >> 10}KB/w{shipped[1]}/p{shipped[2]}"
        print(f"{num_rows:3d} x {vocab:7d} {entry['dtype']:8s} torch {torch_us:7.1f} us | shipped "
              f"{entry['variants'][entry['shipped']]['us']:6.1f} us | best {best[0]} {best[1]['us']:6.1f} us "
              f"({best[1]['of_copy']:.0%} of copy)", flush=True)
        rows_out.append(entry)
        del copies
    write_result(args.out, "kernels_greedy", torch.cuda.get_device_name(), {
        "copy_bandwidth_GBps": copy * 1e-9, "triton": triton.__version__,
        "timing": "CUDA graph of R calls over R copies of the logits (R x bytes >= 256 MiB), median of 20 replays / R",
        "rows": rows_out})


if __name__ == "__main__":
    main()
