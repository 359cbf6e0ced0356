"""One all-reduce's latency at decode message sizes, tp ranks of one host: NCCL against the
symmetric-memory one_shot and two_shot paths the engine takes (engine/symmetric_all_reduce.py:
a copy into the symmetric buffer, then torch's kernel), each captured `--repeats` times back to
back in a CUDA graph (a 32-layer decode step makes 64) and replayed: rank 0's microseconds per
all-reduce (median replay / repeats; the time a rank waits for a slower peer included).

Sizes are messages of [tokens, hidden] in the model dtype: 8 KiB is batch 1 of the 9B shape
(hidden 4096, bf16), 512 KiB batch 64, 2 MiB batch 64 verifying 3 drafts. NVLink multicast is
off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

    python bench/all_reduce_latency.py [--tp 2] [--sizes-kib 8,64,512,2048] [--dtype bfloat16] [--out DIR]

Writes DIR (default bench/results)/all_reduce_latency-<gpu>-tp<N>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_id, device_tag, graph_time_us  # noqa: E402
from deltaspec.engine import symmetric_all_reduce  # noqa: E402
from deltaspec.engine.symmetric_all_reduce import SymmetricAllReduce  # noqa: E402
from deltaspec.engine.tensor_parallel import TensorParallel  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def rank_main(rank: int, args: argparse.Namespace, port: int, results) -> None:
    """Every rank runs the same captures and replays in the same order (their collectives pair
    up); rank 0 sends its times."""
    device, dtype = torch.device(f"cuda:{rank}"), DTYPES[args.dtype]
    store = dist.TCPStore("127.0.0.1", port, args.tp, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    tp = TensorParallel.join(rank, args.tp, device, store)
    sizes = [int(kib) * 1024 // dtype.itemsize for kib in args.sizes_kib.split(",")]
    group_name = symmetric_all_reduce.register_group(store, rank, args.tp)
    paths = {"nccl": lambda x: dist.all_reduce(x)}
    for algorithm in symmetric_all_reduce.ALGORITHMS:
        if symmetric_all_reduce.unavailable(algorithm, dtype, args.tp, device, []) is None:
            paths[algorithm] = SymmetricAllReduce.create(algorithm, dtype, max(sizes), device, group_name)
    rows = {}
    for numel in sizes:
        x = torch.zeros(numel, dtype=dtype, device=device)  # sums stay 0 over any number of replays
        rows[f"{numel * dtype.itemsize >> 10}KiB"] = {
            name: graph_time_us(lambda _, reduce=reduce: reduce(x), args.repeats) for name, reduce in paths.items()}
    if rank == 0:
        results.put(rows)
    tp.leave()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sizes-kib", default="8,64,512,2048")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=64, help="all-reduces per captured graph")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    if torch.cuda.device_count() < args.tp:
        sys.exit(f"--tp {args.tp} needs {args.tp} CUDA devices, {torch.cuda.device_count()} visible")
    with socket.socket() as probe:  # a free port for the ranks' store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=rank_main, args=(rank, args, port, results), daemon=True)
                 for rank in range(args.tp)]
    for process in processes:
        process.start()
    rows = results.get(timeout=600)
    for process in processes:
        process.join(60)
    report = {"device": device_tag(torch.cuda.get_device_name()), "tp": args.tp, "dtype": args.dtype,
              "repeats": args.repeats, "date": datetime.date.today().isoformat(), "commit": commit_id(),
              "command": " ".join(["python", *sys.argv]), "us_per_all_reduce": rows}
    out = Path(args.out) / f"all_reduce_latency-{report['device']}-tp{args.tp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for size, row in rows.items():
        print(f"{size:>8}: " + "  ".join(f"{name} {us:.2f} us" for name, us in row.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
