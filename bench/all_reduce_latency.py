"""One all-reduce's latency at decode message sizes, tp ranks of one host: NCCL against the
symmetric-memory one_shot and two_shot paths the engine takes (engine/symmetric_all_reduce.py:
a copy into the symmetric buffer, then torch's kernel), each captured `--repeats` times back to
back in a CUDA graph (a 32-layer decode step makes 64) and replayed: rank 0's microseconds per
all-reduce (median replay / repeats; the time a rank waits for a slower peer included).

Then what the model runs at each block output, an all-reduce and the residual add + RMSNorm
after it (rows of `--hidden`): nccl+rms_norm (all_reduce="nccl"), one_shot+rms_norm
("one_shot": copy, torch's kernel, the norm kernel) and fused (the default "auto": one kernel,
kernels/all_reduce_norm.py), timed the same way.

Sizes are messages of [tokens, hidden] in the model dtype: 8 KiB is batch 1 of the 9B shape
(hidden 4096, bf16), 512 KiB batch 64, 2 MiB batch 64 verifying 3 drafts. NVLink multicast is
off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

    python bench/all_reduce_latency.py [--tp 2] [--sizes-kib 8,64,512,2048] [--hidden 4096] [--dtype bfloat16]
                                       [--out DIR]

Writes DIR (default bench/results)/all_reduce_latency-<gpu>-tp<N>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_id, device_tag, free_port, graph_time_us  # noqa: E402
from deltaspec.engine import symmetric_all_reduce  # noqa: E402
from deltaspec.engine.symmetric_all_reduce import SymmetricAllReduce  # noqa: E402
from deltaspec.engine.tensor_parallel import TensorParallel  # noqa: E402
from deltaspec.kernels.norms import rms_norm  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def nccl_sum_in_place(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def rank_main(rank: int, args: argparse.Namespace, port: int, results) -> None:
    """Every rank runs the same captures and replays in the same order (their collectives pair
    up); rank 0 sends its times."""
    device, dtype = torch.device(f"cuda:{rank}"), DTYPES[args.dtype]
    store = dist.TCPStore("127.0.0.1", port, args.tp, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    tp = TensorParallel.join(rank, args.tp, device, store)
    sizes = [int(kib) * 1024 // dtype.itemsize for kib in args.sizes_kib.split(",")]
    group_name = symmetric_all_reduce.register_group(store, rank, args.tp)
    paths = {"nccl": nccl_sum_in_place}
    for algorithm in symmetric_all_reduce.ALGORITHMS:
        if symmetric_all_reduce.unavailable(algorithm, dtype, args.tp, device, []) is None:
            paths[algorithm] = SymmetricAllReduce.create(algorithm, dtype, max(sizes), device, group_name)
    rows = {}
    for numel in sizes:
        x = torch.zeros(numel, dtype=dtype, device=device)  # sums stay 0 over any number of replays
        rows[f"{numel * dtype.itemsize >> 10}KiB"] = {
            name: graph_time_us(lambda _, reduce=reduce: reduce(x), args.repeats) for name, reduce in paths.items()}
    rows_with_norm = {}
    one_shot = paths.get("one_shot")
    for numel in sizes:
        x = torch.zeros(numel // args.hidden, args.hidden, dtype=dtype, device=device)
        residual, weight = torch.randn_like(x), torch.randn(args.hidden, dtype=dtype, device=device)
        then_norm = {"nccl+rms_norm": nccl_sum_in_place}
        if one_shot is not None:
            then_norm["one_shot+rms_norm"] = one_shot
        timings = {name: graph_time_us(lambda _, reduce=reduce: rms_norm(reduce(x), weight, 1e-6, residual),
                                       args.repeats) for name, reduce in then_norm.items()}
        if one_shot is not None:
            timings["fused"] = graph_time_us(lambda _: one_shot.all_reduce_rms_norm(x, weight, 1e-6, residual),
                                             args.repeats)
        rows_with_norm[f"{numel * dtype.itemsize >> 10}KiB"] = timings
    if rank == 0:
        results.put((rows, rows_with_norm))
    tp.leave()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sizes-kib", default="8,64,512,2048")
    parser.add_argument("--hidden", type=int, default=4096, help="row width of the all-reduce + RMSNorm messages")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=64, help="all-reduces per captured graph")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    itemsize = DTYPES[args.dtype].itemsize
    partial_rows = [kib for kib in args.sizes_kib.split(",") if int(kib) * 1024 // itemsize % args.hidden]
    if partial_rows:
        sys.exit(f"--sizes-kib {','.join(partial_rows)}: not whole rows of --hidden {args.hidden} {args.dtype}")
    if torch.cuda.device_count() < args.tp:
        sys.exit(f"--tp {args.tp} needs {args.tp} CUDA devices, {torch.cuda.device_count()} visible")
    port = free_port()  # the ranks' store
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=rank_main, args=(rank, args, port, results), daemon=True)
                 for rank in range(args.tp)]
    for process in processes:
        process.start()
    rows, rows_with_norm = results.get(timeout=600)
    for process in processes:
        process.join(60)
    report = {"device": device_tag(torch.cuda.get_device_name()), "tp": args.tp, "dtype": args.dtype,
              "repeats": args.repeats, "date": datetime.date.today().isoformat(), "commit": commit_id(),
              "command": " ".join(["python", *sys.argv]), "us_per_all_reduce": rows, "hidden": args.hidden,
              "us_per_all_reduce_rms_norm": rows_with_norm}
    out = Path(args.out) / f"all_reduce_latency-{report['device']}-tp{args.tp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for title, table in (("all-reduce", rows), (f"all-reduce + RMSNorm, rows of {args.hidden}", rows_with_norm)):
        print(title)
        for size, row in table.items():
            print(f"{size:>8}: " + "  ".join(f"{name} {us:.2f} us" for name, us in row.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
