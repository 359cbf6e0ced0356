"""Host time of an eager bf16 GEMM through cuBLAS (F.linear) by whether its row count M was seen
before: cuBLAS chooses its kernel per shape on the host and caches the choice, so a step whose
eager GEMMs bring new M (the MTP's prefill of each prompt, prefills past the captured graphs)
pays the choice every time. Also the same new M through kernels/linear.py's `padded_linear`
(rows staged into a multiple of CUBLAS_ROWS). 300 calls per case, the device synchronised
around each.

    python bench/tools/cublas_shapes.py [--out DIR]     -> DIR/cublas_shapes-<gpu>.json
"""

import argparse
import datetime
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import commit_id, device_tag  # noqa: E402
from deltaspec.kernels.linear import CUBLAS_ROWS, padded_linear  # noqa: E402

SHAPES = [(384, 1024), (1024, 3584), (4096, 12288)]  # (K, N): shipped model, 0.8B, 9B MLP


def host_us(x: torch.Tensor, w: torch.Tensor, rows: list[int], padded: bool) -> dict:
    times = []
    for m in rows:
        torch.cuda.synchronize()
        begin = time.perf_counter()
        if padded:
            padded_linear(x[:m], w, CUBLAS_ROWS)
        else:
            F.linear(x[:m], w)
        times.append(time.perf_counter() - begin)
    torch.cuda.synchronize()
    times.sort()
    return {"median_us": round(times[len(times) // 2] * 1e6, 1), "mean_us": round(sum(times) / len(times) * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"benchmark": "cublas_shapes", "device": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "shapes": {}}
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            F.linear(x[:512], w)
        new = random.Random(1).sample(range(65, 4096), 300)
        cases = {"same M": host_us(x, w, [777] * 300, False), "new M": host_us(x, w, new, False),
                 "new M padded to 128": host_us(x, w, new, True), "the same new M again": host_us(x, w, new, False)}
        report["shapes"][f"K={k} N={n}"] = cases
        print(k, n, cases, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"cublas_shapes-{device_tag(report['device'])}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
