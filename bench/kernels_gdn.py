"""The GDN kernels on the GPU, in one run: chunked prefill (deltaspec's Triton `gdn_chunked`
against fla-core 0.6.0's `chunk_gated_delta_rule` and the memory roofline), then decode and verify
(`gdn_decode` against fla's `fused_recurrent_gated_delta_rule` and the state-bytes roofline:
kernels_gdn_decode.measure, stored under "decode_verify").

Shapes (issue 3): K = V = 128, bf16 activations, fp32 state pool, every row with an initial
state, varlen batches 1 x 16384, 16 x 1024 and 64 x 256 tokens, at HK = HV = 16 and HK = 16 /
HV = 32. Our op includes the gating (softplus, sigmoid), the q/k l2norm and the slot-indexed
state read/write. fla is timed two ways:
  fla_kernel: chunk_gated_delta_rule alone (use_qk_l2norm_in_kernel=True, cu_seqlens, its chunk
              indices precomputed, initial_state already gathered, output_final_state=True);
              the gating and the pool gather/scatter are EXCLUDED (the strict baseline);
  fla_dropin: the same call plus what a drop-in replacement of our op needs around it: the
              gating in torch (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), the
              gather state[slots] and the scatter of the final states back into the pool.
Prefill timing: median over trials of back-to-back calls (CPU launch overhead hidden when the GPU is
the bottleneck), rotating input sets larger than L2 together. Roofline: the bytes the op must
move (q, k, v, a, b read, o written, the rows' states read and written) over the device-to-device
copy bandwidth measured in the same run (read + write bytes). Device time: each side's kernel
times summed (torch.profiler), beside the wall-clock ratio, since fla's call also spends host
time between its launches.

Run on the GPU machine (fla-core importable from /tmp/fla, never installed in the test env):
    DELTASPEC_COMMIT=<sha> python bench/kernels_gdn.py --out DIR
Writes DIR/kernels_gdn-<gpu>.json and .png (prefill: stacked kernel times per shape) and prints
the tables;
`--plot JSON` redraws the PNG of an existing results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
import torch.nn.functional as F
import triton

from common import commit_id, copy_bandwidth, device_tag, eager_time_us  # noqa: E402
from kernels_gdn_decode import measure as measure_decode  # noqa: E402
from deltaspec.kernels.gdn_chunked import _output, _solve, _state, _wy, gdn_chunked, gdn_chunked_reference, split_output

SHAPES = [(1, 16384), (16, 1024), (64, 256)]          # (rows, tokens per row)
HEADS = [(16, 16), (16, 32)]                           # (HK, HV)
KEY_DIM = VALUE_DIM = 128
NUM_SETS = 4


def time_ms(fns: list, calls: int = 20) -> float:
    """Mean ms per call of `calls` back-to-back calls cycling through fns (rotating inputs)."""
    return eager_time_us(lambda i: fns[i % len(fns)](), calls) / 1e3


class Inputs:
    def __init__(self, gen: torch.Generator, rows: int, length: int, hk: int, hv: int) -> None:
        total = rows * length
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        self.q = torch.randn(total, hk, KEY_DIM, generator=gen, device="cuda").to(torch.bfloat16)
        self.k = torch.randn(total, hk, KEY_DIM, generator=gen, device="cuda").to(torch.bfloat16)
        self.v = torch.randn(total, hv, VALUE_DIM, generator=gen, device="cuda").to(**bf16)
        self.a = torch.randn(total, hv, generator=gen, device="cuda").to(**bf16)
        self.b = torch.randn(total, hv, generator=gen, device="cuda").to(**bf16)
        self.A_log = torch.rand(hv, generator=gen, device="cuda") * 3.0 - 4.0
        self.dt_bias = 0.5 * torch.randn(hv, generator=gen, device="cuda")
        self.cu_seqlens = torch.arange(0, total + 1, length, device="cuda", dtype=torch.int32)
        # Slot 0 is scratch; rows use a permutation of slots 1..rows.
        self.slot_ids = (torch.randperm(rows, generator=gen, device="cuda") + 1).to(torch.int32)
        self.has_initial = torch.ones(rows, dtype=torch.bool, device="cuda")
        self.state = 0.1 * torch.randn(rows + 1, hv, KEY_DIM, VALUE_DIM, generator=gen, device="cuda")

    def args(self) -> tuple:
        return (self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias, self.cu_seqlens, self.slot_ids,
                self.has_initial)

    def ours(self, split: bool | None = None):
        return gdn_chunked(*self.args(), self.state, split=split)

    def bytes_moved(self) -> int:
        tensors = (self.q, self.k, self.v, self.a, self.b, self.v)            # the last v: o, same size
        states = 2 * self.slot_ids.numel() * self.state[0].numel() * self.state.element_size()
        return sum(t.numel() * t.element_size() for t in tensors) + states


class Fla:
    """fla's chunk_gated_delta_rule on the same inputs (module from /tmp/fla)."""

    def __init__(self, x: Inputs) -> None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.utils.index import prepare_chunk_indices
        self.fn, self.x = chunk_gated_delta_rule, x
        self.cu = x.cu_seqlens.long()
        self.cu_cpu = self.cu.cpu()
        self.chunk_indices = prepare_chunk_indices(self.cu, 64)
        self.g, self.beta = self.gating()
        self.h0 = x.state[x.slot_ids.long()]

    def gating(self):
        x = self.x
        g = -x.A_log.exp() * F.softplus(x.a.float() + x.dt_bias)
        return g[None], x.b.sigmoid()[None]

    def call(self, g, beta, h0):
        x = self.x
        return self.fn(x.q[None], x.k[None], x.v[None], g, beta, scale=KEY_DIM ** -0.5, initial_state=h0,
                       output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=self.cu,
                       cu_seqlens_cpu=self.cu_cpu, chunk_indices=self.chunk_indices)

    def kernel(self):
        return self.call(self.g, self.beta, self.h0)

    def dropin(self):
        slots = self.x.slot_ids.long()
        g, beta = self.gating()
        o, final = self.call(g, beta, self.x.state[slots])
        self.x.state[slots] = final
        return o[0]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def kernel_breakdown(fn) -> dict[str, float]:
    """Device time per kernel name (us per call) over 5 calls, by torch.profiler."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for event in prof.key_averages():
            if event.device_type.name == "CUDA" or getattr(event, "device_time_total", 0) > 0:
                us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
                if us:
                    totals[event.key[:60]] = round(us / 5, 1)
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    except Exception as error:  # the breakdown is diagnostic only
        return {"error": repr(error)}


def check(x: Inputs) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """Ours against the fp32 reference on the same bf16 inputs (fresh copies of the pool).
    Returns (errors, reference output, reference final states of the rows)."""
    state_ours, state_ref = x.state.clone(), x.state.clone()
    out = gdn_chunked(*x.args(), state_ours)
    fp32 = [t.float() if t.is_floating_point() else t for t in x.args()]
    expected = gdn_chunked_reference(*fp32, state_ref)
    slots = x.slot_ids.long()
    errors = {"ours_out": relative_error(out, expected), "ours_state": relative_error(state_ours[slots], state_ref[slots])}
    return errors, expected, state_ref[slots]


def plot(record: dict, path: pathlib.Path) -> None:
    """Per shape, each side's kernel device times stacked (ours left, fla right) and the wall
    time per call as a marker: where the time goes, and what the host adds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["results"] if "fla_kernel" in r.get("breakdown_us", {})]
    figure, axis = plt.subplots(figsize=(14, 4.8))
    colors: dict[str, str] = {}
    palette = iter(plt.get_cmap("tab20").colors)
    for i, r in enumerate(rows):
        for offset, side, wall in ((-0.2, "ours", r["ours_ms"]), (0.2, "fla_kernel", r["fla_kernel_ms"])):
            bottom = 0.0
            for name, us in sorted(r["breakdown_us"][side].items(), key=lambda kv: -kv[1]):
                label = name.split("(")[0].split("<")[0].strip().lstrip("_")[:40]   # "_x": hidden by matplotlib
                color = colors.setdefault(label, next(palette, "grey"))
                axis.bar(i + offset, us / 1e3, 0.38, bottom=bottom, color=color,
                         label=label if label not in axis.get_legend_handles_labels()[1] else None)
                bottom += us / 1e3
            axis.plot(i + offset, wall, marker="_", markersize=22, color="black")
    axis.set_xticks(range(len(rows)),
                    [f"HV={r['hv']} {r['rows']}x{r['length']}\n({r.get('path', 'fused')}) ours | fla" for r in rows])
    axis.set(ylabel="ms per call", title=f"GDN chunked prefill, {record['device']} ({record.get('commit', '')}): "
                                          "kernel device time stacked, wall time per call as a black bar")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    parser.add_argument("--plot", type=pathlib.Path, help="only draw the PNG of an existing results JSON")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    sys.path.insert(0, "/tmp/fla")
    import fla

    device = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    results: list[dict] = []
    record = dict(
        benchmark="kernels_gdn (GDN chunked varlen prefill; decode and verify under decode_verify)", device=device,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit_id(),
        command=" ".join(["python"] + sys.argv), torch=torch.__version__,
        triton=triton.__version__, fla=getattr(fla, "__version__", "0.6.0"),
        copy_bandwidth_bytes_per_s=bandwidth,
        timing=f"median of 9 trials x 20 back-to-back calls, rotating {NUM_SETS} input sets; ms per call",
        baselines={"fla_kernel": "chunk_gated_delta_rule alone: gating and pool gather/scatter excluded",
                   "fla_dropin": "torch gating + state[slots] gather + chunk_gated_delta_rule + scatter back"},
        results=results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernels_gdn-{device_tag(device)}.json"
    save = lambda: path.write_text(json.dumps(record, indent=1))   # after every shape: a cut-off run keeps its rows
    for hk, hv in HEADS:
        for rows, length in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(rows * 1000 + hv)
            sets = [Inputs(gen, rows, length, hk, hv) for _ in range(NUM_SETS)]
            errors, expected, expected_final = check(sets[0])     # before any call moves the pools
            row = dict(rows=rows, length=length, hk=hk, hv=hv, errors=errors)
            flas = []
            try:  # a failing peer must not lose our numbers
                flas = [Fla(x) for x in sets]
                fla_out, fla_final = flas[0].kernel()
                errors["fla_out"] = relative_error(fla_out[0], expected)
                errors["fla_state"] = relative_error(fla_final, expected_final)
                row["fla_kernel_ms"] = time_ms([f.kernel for f in flas])
                row["fla_dropin_ms"] = time_ms([f.dropin for f in flas])
            except Exception as error:
                row["fla_error"] = repr(error)
            ours = time_ms([x.ours for x in sets])
            # The path gdn_chunked picks (split_output) and, same inputs, the one it does not.
            split = split_output(rows, hv, VALUE_DIM, torch.device("cuda"))
            other = time_ms([lambda x=x: x.ours(split=not split) for x in sets])
            roofline = sets[0].bytes_moved() / bandwidth * 1e3
            row.update(ours_ms=ours, path="split" if split else "fused",
                       ours_other_path_ms=other, roofline_ms=roofline, bytes=sets[0].bytes_moved(),
                       ours_fraction_of_roofline=roofline / ours,
                       configs={"solve": str(_solve.best_config), "wy": str(_wy.best_config), "state": str(_state.best_config),
                                "output": str(getattr(_output, "best_config", None)),
                                "state_tuning_ms": {str(c): t for c, t in getattr(_state, "configs_timings", {}).items()}},
                       breakdown_us={"ours": kernel_breakdown(sets[0].ours)})
            if "fla_kernel_ms" in row:
                row["ours_over_fla_kernel"] = ours / row["fla_kernel_ms"]
                row["ours_over_fla_dropin"] = ours / row["fla_dropin_ms"]
                row["breakdown_us"]["fla_kernel"] = kernel_breakdown(flas[0].kernel)
                # Device time alone (sums of the kernels' times): fla's call also spends host time
                # between its launches, which the wall-clock ratio above includes.
                row["ours_device_us"], row["fla_device_us"] = (sum(row["breakdown_us"][side].values())
                                                               for side in ("ours", "fla_kernel"))
                row["ours_over_fla_device_time"] = row["ours_device_us"] / row["fla_device_us"]
            results.append(row)
            save()
            print(f"HK={hk} HV={hv} {rows}x{length}: ours {ours:.3f} ms ({row['path']}; other path "
                  f"{other:.3f} ms), roofline {roofline:.3f} ms; "
                  f"fla {row.get('fla_kernel_ms', float('nan')):.3f} ms (drop-in {row.get('fla_dropin_ms', float('nan')):.3f}), "
                  f"ratio {row.get('ours_over_fla_kernel', float('nan')):.2f}; errors {row.get('errors')} "
                  f"{row.get('fla_error', '')}", flush=True)
            print(f"   configs {row['configs']}\n   breakdown {json.dumps(row.get('breakdown_us'))}", flush=True)
            del sets, flas
            torch.cuda.empty_cache()

    # Checkpoints for the prefix cache: every 256 tokens of each row of 16 x 1024 (incl. the row end).
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = Inputs(gen, 16, 1024, 16, 16)
    checkpoint_lengths = torch.tensor([256, 512, 768, 1024] * 16, dtype=torch.int32, device="cuda")
    checkpoint_cu = torch.arange(0, 65, 4, dtype=torch.int32, device="cuda")
    checkpoints = torch.empty((64,) + tuple(x.state.shape[1:]), device="cuda")
    ours_checkpointed = time_ms([lambda: gdn_chunked(*x.args(), x.state, checkpoint_cu, checkpoint_lengths,
                                                     checkpoints)])
    print(f"HK=16 HV=16 16x1024 with 64 checkpoints: ours {ours_checkpointed:.3f} ms (includes the host check)")

    record["ours_16x1024_with_64_checkpoints_ms"] = ours_checkpointed
    save()
    print(f"\n{'HK':>3} {'HV':>3} {'shape':>9} {'ours ms':>8} {'path':>6} {'other':>8} {'fla ms':>8} {'ratio':>6} "
          f"{'device':>6} {'drop-in':>8} {'roof ms':>8}")
    nan = float("nan")
    for r in results:
        print(f"{r['hk']:>3} {r['hv']:>3} {r['rows']:>3}x{r['length']:<5} {r['ours_ms']:>8.3f} {r['path']:>6} "
              f"{r['ours_other_path_ms']:>8.3f} "
              f"{r.get('fla_kernel_ms', nan):>8.3f} {r.get('ours_over_fla_kernel', nan):>6.2f} "
              f"{r.get('ours_over_fla_device_time', nan):>6.2f} "
              f"{r.get('fla_dropin_ms', nan):>8.3f} {r['roofline_ms']:>8.3f}")
    plot(record, path.with_suffix(".png"))

    # Decode and verify in the same run (kernels_gdn_decode.py: CUDA-graph replays beside fla's
    # fused_recurrent_gated_delta_rule and the state-bytes roofline; its --sweep adds the tiles).
    def save_decode(part: dict) -> None:
        record["decode_verify"] = part
        save()

    measure_decode(sweep=False, save=save_decode, copy_bytes_per_s=bandwidth)
    print(f"wrote {path} and its .png")


if __name__ == "__main__":
    main()
