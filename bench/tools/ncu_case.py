"""One GDN kernel case for Nsight Compute: warms up (compiles, autotunes), then runs the case once
between torch.cuda.profiler.start() and stop(), so `ncu --profile-from-start off` profiles only
that call. ncu works on the Firecracker H100 (give it --clock-control none: leave clocks alone).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis python bench/tools/ncu_case.py CASE

CASE: verify_B / decode_B (GDN decode kernel, HV = 16, B rows: verify 3 pending + 4 new tokens,
decode 1 token, each at its decode_config tile), chunk_ROWS_LENGTH_HV (gdn_chunked, HK = 16, bf16) or
flachunk_ROWS_LENGTH_HV (fla's chunk_gated_delta_rule on the same inputs; fla-core from /tmp/fla).
Shapes and inputs are those of kernels_gdn_decode.py and kernels_gdn.py.
"""

from __future__ import annotations

import pathlib
import sys

import torch

# The cases are bench/'s own benchmarks (kernels_gdn_decode, kernels_gdn and their `common`).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def main() -> None:
    case = sys.argv[1]
    kind, *sizes = case.split("_")
    if kind in ("verify", "decode"):
        from kernels_gdn_decode import KEY_DIM, VALUE_DIM, Setup

        from deltaspec.kernels.gdn_decode import decode_config
        batch, num_value_heads = int(sizes[0]), 16
        if kind == "verify":
            setup, commit = Setup(batch, num_value_heads, tokens_per_row=4, pending=3), False
        else:
            setup, commit = Setup(batch, num_value_heads, tokens_per_row=1, pending=0, max_pending=0), True
        config = decode_config(batch, num_value_heads, KEY_DIM, VALUE_DIM, commit, torch.device("cuda"))
        run = lambda r: setup.launch(r % setup.repeats, commit, config)  # noqa: E731
    elif kind in ("chunk", "flachunk"):
        from kernels_gdn import Fla, Inputs
        rows, length, hv = (int(x) for x in sizes)
        sys.path.insert(0, "/tmp/fla")
        x = Inputs(torch.Generator(device="cuda").manual_seed(0), rows, length, 16, hv)
        run = (lambda r: x.ours()) if kind == "chunk" else (lambda r, fla=Fla(x): fla.kernel())  # noqa: E731
    else:
        raise SystemExit(f"unknown case {case!r}: verify_B, decode_B, chunk_ROWS_LENGTH_HV or flachunk_ROWS_LENGTH_HV")
    for r in range(3):
        run(r)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run(3)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
