"""A decode step's per-row gathers on CUDA, three ways: index_select, advanced indexing and
F.embedding, at 1 to 64 rows (device time in a CUDA graph, triton.testing.do_bench_cudagraph). For
up to 16 indices CUDA's index_select (F.embedding's too) runs a kernel whose threads loop over
the indices one after another; the engine gathers by indexing (engine/sampling_table.py).

    python bench/tools/gather_micro.py [--out DIR]  -> DIR/gather_micro-<gpu>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import write_result  # noqa: E402
from deltaspec.server.acceptance_benchmark import device_name  # noqa: E402

ROWS = (1, 8, 16, 17, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    device = "cuda"
    # The sampling table's shapes in a served engine (3 float and 2 int64 columns of 4160 slots);
    # embeddings of the shipped model's width and the 9B's.
    floats = torch.rand(3, 4160, device=device)
    ints = torch.randint(0, 9, (2, 4160), device=device)
    tables = {"384": torch.randn(32768, 384, device=device, dtype=torch.bfloat16),
              "4096": torch.randn(248320, 4096, device=device, dtype=torch.bfloat16)}
    results = {}
    for rows in ROWS:
        slots = torch.randint(0, floats.shape[1], (rows,), device=device)
        ids = torch.randint(0, 32768, (rows,), device=device)
        cases = {"index_select floats": lambda: floats.index_select(1, slots), "indexing floats": lambda: floats[:, slots],
                 "index_select ints": lambda: ints.index_select(1, slots), "indexing ints": lambda: ints[:, slots]}
        for width, table in tables.items():
            cases[f"F.embedding {width}"] = lambda table=table: F.embedding(ids, table)
            cases[f"indexing {width}"] = lambda table=table: table[ids]
        results[rows] = {name: do_bench_cudagraph(case) * 1e3 for name, case in cases.items()}
        print(rows, {name: round(us, 2) for name, us in results[rows].items()})
    write_result(args.out, "gather_micro", device_name("cuda"), {"us_by_rows": results})


if __name__ == "__main__":
    main()
