"""GDN deferred-commit decode/verify kernel (kernels/gdn_decode.py) against fla's
fused_recurrent_gated_delta_rule and the copy-bandwidth roofline, on one GPU.

Shapes: K = V = 128, HK = 16 with HV = 16 and HV = 32, bf16 activations, fp32 state pool.
  decode: 1 token per row, commit=True, no pending buffers (P = 0: plain decode, speculation off)
  verify: 4 new tokens per row (k = 3 drafts), 3 pending per slot (k, v read from the conv's step
          buffer [B, P, conv_dim], g / beta from the pool), commit=False
  fla:    its plain varlen call, 1 token per row, in-kernel gating / l2norm / sigmoid, reading
          initial_state [B, HV, K, V] and writing a fresh final state (fla 0.6.0 has no slot
          indices, so it moves the same state bytes as our in-place kernel, minus the gather).
Every op is timed as a CUDA graph of R launches over R disjoint slot sets (R x state >= 256 MiB,
so no launch finds its state in L2); time per launch = median replay / R. Roofline: state bytes
read + written (2 x B x HV x K x V x 4) over the copy bandwidth measured in the same run.

Usage: python bench/kernels_gdn_decode.py [--out-dir bench/results] [--sweep]
(bench/kernels_gdn.py runs `measure` too, after the prefill shapes, into kernels_gdn-<gpu>.json.)
(Results before the compact pending layout, with its tile sweep: this file as committed in 54c80a9.)
fla-core is imported from /tmp/fla (install there; never in the test environment).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import traceback

import torch

from common import commit_id, copy_bandwidth, device_tag, graph_time_us  # noqa: E402
from deltaspec.kernels.gdn import pending_replicas
from deltaspec.kernels.gdn_decode import decode_config, launch_gdn_decode
from deltaspec.kernels.tiles import TileConfig

KEY_DIM = VALUE_DIM = 128
NUM_KEY_HEADS = 16
BATCHES = (1, 8, 64, 256)
MAX_PENDING = 3  # P = k
L2_DEFEAT_BYTES = 256 << 20
SWEEP = [TileConfig(block_n=bv, num_warps=w)  # 16 columns: one pending replica
         for bv, w in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4))]


class Setup:
    """R replicas of a batch of B rows (disjoint slots of one pool) with model-like strided inputs."""

    def __init__(self, batch: int, num_value_heads: int, tokens_per_row: int, pending: int,
                 max_pending: int = MAX_PENDING) -> None:
        gen = torch.Generator(device="cuda").manual_seed(batch * 100 + num_value_heads)
        hk, hv, kd, vd = NUM_KEY_HEADS, num_value_heads, KEY_DIM, VALUE_DIM
        self.batch, self.hv = batch, hv
        self.state_bytes = batch * hv * kd * vd * 4
        self.repeats = max(1, min(128, -(-L2_DEFEAT_BYTES // self.state_bytes)))
        num_slots = 1 + self.repeats * batch
        self.state = torch.randn(num_slots, hv, kd, vd, generator=gen, device="cuda") * 0.1
        replicas = pending_replicas(vd)
        self.pending_g = -torch.rand(num_slots, max_pending, hv, 1, generator=gen, device="cuda").repeat(1, 1, 1, replicas)
        self.pending_beta = torch.rand(num_slots, max_pending, hv, 1, generator=gen, device="cuda").repeat(1, 1, 1, replicas)
        self.pending_counts = torch.full((num_slots,), pending, dtype=torch.int32, device="cuda")
        num_tokens = batch * tokens_per_row
        conv_dim = 2 * hk * kd + hv * vd
        # The conv decode kernel's step buffer: conv outputs of each row's pending tokens.
        pending_out = torch.randn(batch, max_pending, conv_dim, generator=gen, device="cuda").bfloat16()
        self.pending_k = pending_out[..., hk * kd:2 * hk * kd].unflatten(-1, (hk, kd))
        self.pending_v = pending_out[..., 2 * hk * kd:].unflatten(-1, (hv, vd))
        conv_out = torch.randn(num_tokens, conv_dim, generator=gen, device="cuda").bfloat16()
        q, k, v = conv_out.split((hk * kd, hk * kd, hv * vd), dim=-1)
        self.q, self.k = q.view(num_tokens, hk, kd), k.view(num_tokens, hk, kd)
        self.v = v.view(num_tokens, hv, vd)
        projection = torch.randn(num_tokens, hv * vd + 2 * hv, generator=gen, device="cuda").bfloat16()
        self.b, self.a = projection[:, hv * vd:hv * vd + hv], projection[:, hv * vd + hv:]
        self.A_log = torch.rand(hv, generator=gen, device="cuda") * 2 - 3
        self.dt_bias = torch.randn(hv, generator=gen, device="cuda") * 0.5
        self.cu_seqlens = torch.arange(0, num_tokens + 1, tokens_per_row, dtype=torch.int32, device="cuda")
        self.slot_sets = [torch.arange(1 + r * batch, 1 + (r + 1) * batch, dtype=torch.int32, device="cuda")
                          for r in range(self.repeats)]
        self.out = torch.empty(num_tokens, hv, vd, dtype=torch.bfloat16, device="cuda")

    def launch(self, r: int, commit: bool, config: TileConfig) -> None:
        launch_gdn_decode(self.out, self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias, self.cu_seqlens,
                          self.slot_sets[r], self.state, self.pending_k, self.pending_v, self.pending_g,
                          self.pending_beta, self.pending_counts, commit, config)


def time_ours(setup: Setup, commit: bool, config: TileConfig) -> float:
    return graph_time_us(lambda r: setup.launch(r, commit, config), setup.repeats)


def time_fla(setup: Setup, fla_fn) -> tuple[float, float]:
    """fla's varlen call on the same tokens; -> (µs per call, max |o_fla - o_ours| at replica 0)."""
    hv = setup.hv
    q, k, v = (t.contiguous().unsqueeze(0) for t in (setup.q, setup.k, setup.v))
    a, b = setup.a.contiguous().unsqueeze(0), setup.b.contiguous().unsqueeze(0)
    cu = setup.cu_seqlens.long()
    initial = [setup.state[s.long()].contiguous() for s in setup.slot_sets]
    outputs = {}

    def launch(r: int) -> None:
        o, _ = fla_fn(q, k, v, g=a, beta=b, scale=KEY_DIM ** -0.5, initial_state=initial[r], output_final_state=True,
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=setup.A_log,
                      dt_bias=setup.dt_bias, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu)
        outputs[r] = o

    launch(0)
    torch.cuda.synchronize()
    reference = outputs[0][0].float()
    saved = setup.state[setup.slot_sets[0].long()].clone()
    setup.launch(0, True, decode_config(setup.batch, hv, KEY_DIM, VALUE_DIM, True, torch.device("cuda")))
    setup.state[setup.slot_sets[0].long()] = saved
    difference = float((reference - setup.out.float()).abs().max())
    return graph_time_us(launch, setup.repeats), difference


def measure(sweep: bool, save=lambda result: None, copy_bytes_per_s: float | None = None) -> dict:
    """Decode and verify at every (HV, B) of the issue beside fla, then (sweep) every tile config;
    calls save(result) after each row, so a run cut off by a time limit keeps what it measured.
    copy_bytes_per_s: the copy bandwidth when the caller measured it already (else measured here)."""
    props = torch.cuda.get_device_properties(0)
    result = dict(
        benchmark="kernels_gdn_decode", device=props.name, num_sms=props.multi_processor_count,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit_id(),
        command=" ".join([sys.executable] + sys.argv), torch=torch.__version__,
        shapes=dict(key_dim=KEY_DIM, value_dim=VALUE_DIM, num_key_heads=NUM_KEY_HEADS, activations="bf16",
                    state="fp32", verify="4 new tokens/row (k = 3), 3 pending (P = k), commit=False"),
        timing="CUDA graph of R launches over disjoint slot sets (>= 256 MiB of state), median of 20 replays / R",
        rows=[],
    )
    import triton
    result["triton"] = triton.__version__
    result["copy_bandwidth_GBps"] = (copy_bytes_per_s or copy_bandwidth()) / 1e9
    print(f"{props.name}: copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s (read + write)", flush=True)
    sys.path.insert(0, "/tmp/fla")
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn
    except Exception as error:  # noqa: BLE001 - reported, not fatal
        fla_fn = None
        result["fla_error"] = repr(error)
        print("fla unavailable:", error)
    for hv in (16, 32):
        for batch in BATCHES:
            row = dict(num_value_heads=hv, batch=batch)
            try:
                auto = decode_config(batch, hv, KEY_DIM, VALUE_DIM, True, torch.device("cuda"))
                auto_verify = decode_config(batch, hv, KEY_DIM, VALUE_DIM, False, torch.device("cuda"))
                row["config"] = f"{auto.block_n}x{auto.num_warps}"
                row["verify_config"] = f"{auto_verify.block_n}x{auto_verify.num_warps}"
                decode = Setup(batch, hv, tokens_per_row=1, pending=0, max_pending=0)
                row["repeats"] = decode.repeats
                row["state_MiB"] = decode.state_bytes / 2**20
                row["decode_us"] = time_ours(decode, True, auto)
                moved = 2 * decode.state_bytes
                row["decode_GBps"] = moved / row["decode_us"] / 1e3
                row["decode_roofline_fraction"] = row["decode_GBps"] / result["copy_bandwidth_GBps"]
                if fla_fn is not None:
                    try:
                        row["fla_us"], row["fla_max_abs_diff"] = time_fla(decode, fla_fn)
                        row["fla_GBps"] = moved / row["fla_us"] / 1e3
                    except Exception as error:  # noqa: BLE001
                        row["fla_error"] = repr(error)
                        traceback.print_exc()
                del decode
                verify = Setup(batch, hv, tokens_per_row=4, pending=3)
                row["verify_us"] = time_ours(verify, False, auto_verify)
                row["verify_over_decode"] = row["verify_us"] / row["decode_us"]
                del verify
            except Exception as error:  # noqa: BLE001
                row["error"] = repr(error)
                traceback.print_exc()
            torch.cuda.empty_cache()
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            save(result)
    if sweep:  # second pass, so that a time limit cuts the sweep, not the main numbers
        for row in result["rows"]:
            try:
                for name, tokens, pending, commit in (("decode", 1, 0, True), ("verify", 4, 3, False)):
                    setup = Setup(row["batch"], row["num_value_heads"], tokens_per_row=tokens, pending=pending,
                                  max_pending=pending)
                    row[f"{name}_sweep_us"] = {f"{c.block_n}x{c.num_warps}": time_ours(setup, commit, c)
                                               for c in SWEEP}
                    del setup
                    torch.cuda.empty_cache()
            except Exception as error:  # noqa: BLE001
                row["sweep_error"] = repr(error)
                traceback.print_exc()
            print(json.dumps({k: row[k] for k in row if "sweep" in k or k in ("batch", "num_value_heads")}), flush=True)
            save(result)
    print_table(result)
    return result


def print_table(result: dict) -> None:
    print("HV  B   decode_us  fla_us  verify_us  verify/decode  roofline", flush=True)
    for row in result["rows"]:
        print(f"{row['num_value_heads']:<3} {row['batch']:<4} {row.get('decode_us', float('nan')):9.2f} "
              f"{row.get('fla_us', float('nan')):7.2f} {row.get('verify_us', float('nan')):9.2f} "
              f"{row.get('verify_over_decode', float('nan')):13.2f} {row.get('decode_roofline_fraction', float('nan')):8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--sweep", action="store_true", help="also time every tile config")
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"kernels_gdn_decode-{device_tag(torch.cuda.get_device_name())}.json"
    measure(args.sweep, lambda result: path.write_text(json.dumps(result, indent=1)))
    print("wrote", path)


if __name__ == "__main__":
    main()
