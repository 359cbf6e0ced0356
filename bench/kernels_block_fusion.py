"""A decode step's projections and the block ops around them, separate against fused into the
skinny GEMM's epilogue (kernels/linear.py: norm_eps, glu, residual), on one GPU. bf16, random
weights, the layers of Qwen3.5-0.8B or -9B (bench/kernels_linear.py's projections).

    source bench/tools/device_setup.sh && python3 bench/kernels_block_fusion.py --out $OUT

Per layer (3 GDN layers to 1 attention layer), the mixer itself left out:
  separate  rms_norm(x, w, residual) -> in_proj (GDN) or qkv (attention) -> out_proj / o_proj of a
            fixed mixer output -> rms_norm(x, w, residual) -> gate_up -> silu_and_mul -> down
            (the engine's path before: the residual add inside the next norm)
  fused     in_proj(stream, norm) -> out_proj(residual = stream) -> gate_up(stream, norm, glu)
            -> down(residual = stream)
Each form is one CUDA graph over every layer of the model (their weights are distinct, so no
projection finds its weight in L2), timed per step (median replay); launches counted in a replay
(profile_step.kernel_table).

Then per projection (--projections), each a CUDA graph over R copies of its weight (as
kernels_linear.py): cuBLAS, the kernel plain at the config the fused call takes, and the kernel
with each fusion that projection gets in a block (in_proj / qkv: norm; gate_up: norm, glu, both;
out_proj / o_proj / down: residual), so that a fusion's cost is its time over the plain kernel's.
--fused-max-rows N times the fused form up to N rows (kernels/linear.py FUSED_MAX_ROWS, at most
KERNEL_MAX_ROWS): the data for that limit. Writes kernels_block_fusion-<gpu>.json.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

import torch.nn.functional as F

from common import graph_time_us, write_result  # noqa: E402
from kernels_linear import MODELS, Setup, config_name, projections  # noqa: E402
from profile_step import kernel_table  # noqa: E402
from deltaspec.kernels.activation import silu_and_mul
from deltaspec.kernels import linear as linear_module
from deltaspec.kernels.linear import launch_linear, linear, linear_config
from deltaspec.kernels.norms import rms_norm

EPS = 1e-6


class Layer:
    """One layer's projections (bf16, scaled so the stream stays O(1)) and norm weights."""

    def __init__(self, shapes: dict[str, tuple[int, int]], attention: bool, gen: torch.Generator) -> None:
        def weight(name: str) -> torch.Tensor:
            n, k = shapes[name]
            return (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()

        self.w_in = weight("attn.qkv_proj" if attention else "gdn.in_proj")
        self.w_out = weight("attn.o_proj" if attention else "gdn.out_proj")
        self.w_gate_up, self.w_down = weight("mlp.gate_up"), weight("mlp.down")
        hidden = self.w_down.shape[0]
        self.norm_in = (0.1 * torch.randn(hidden, generator=gen, device="cuda")).bfloat16()
        self.norm_post = (0.1 * torch.randn(hidden, generator=gen, device="cuda")).bfloat16()


def build(model: str, num_rows: int) -> tuple[list[Layer], torch.Tensor, torch.Tensor]:
    dims = MODELS[model]
    shapes = {name: (n, k) for name, n, k, _ in projections(**dims)}
    gen = torch.Generator(device="cuda").manual_seed(num_rows)
    layers = [Layer(shapes, attention=i % 4 == 3, gen=gen) for i in range(dims["layers"])]
    mixer_width = max(shapes["gdn.out_proj"][1], shapes["attn.o_proj"][1])
    mixed = torch.randn(num_rows, mixer_width, generator=gen, device="cuda").bfloat16()
    x = torch.randn(num_rows, dims["hidden"], generator=gen, device="cuda").bfloat16()
    return layers, mixed, x


def separate_step(layers: list[Layer], mixed: torch.Tensor, x: torch.Tensor) -> None:
    out, residual = x, None
    for layer in layers:
        normed, residual = rms_norm(out, layer.norm_in, EPS, residual)
        linear(normed, layer.w_in)
        out = linear(mixed[:, :layer.w_out.shape[1]], layer.w_out)
        normed, residual = rms_norm(out, layer.norm_post, EPS, residual)
        out = linear(silu_and_mul(linear(normed, layer.w_gate_up)), layer.w_down)


def fused_step(layers: list[Layer], mixed: torch.Tensor, stream: torch.Tensor) -> None:
    for layer in layers:
        linear(stream, layer.w_in, norm_eps=EPS)
        linear(mixed[:, :layer.w_out.shape[1]], layer.w_out, residual=stream)
        linear(linear(stream, layer.w_gate_up, norm_eps=EPS, glu=True), layer.w_down, residual=stream)


VARIANTS = {"gdn.in_proj": {"norm": dict(norm_eps=EPS)}, "attn.qkv_proj": {"norm": dict(norm_eps=EPS)},
            "mlp.gate_up": {"norm": dict(norm_eps=EPS), "glu": dict(glu=True),
                            "norm+glu": dict(norm_eps=EPS, glu=True)},
            "gdn.out_proj": {"residual": dict(residual=True)}, "attn.o_proj": {"residual": dict(residual=True)},
            "mlp.down": {"residual": dict(residual=True)}}


def projection_rows(model: str, num_rows: int) -> list[dict]:
    """cuBLAS, the plain kernel and each fusion at the fused call's config, per projection."""
    rows = []
    for name, n, k, _ in projections(**MODELS[model]):
        setup = Setup(num_rows, n, k)
        config = linear_config(num_rows, n, k, setup.x.device, True)
        row = dict(model=model, projection=name, N=n, K=k, rows=num_rows, config=config_name(config),
                   cublas_us=graph_time_us(lambda r: F.linear(setup.x, setup.weights[r]), setup.copies),
                   kernel_us=setup.time_config(config))
        for variant, options in VARIANTS[name].items():
            width = n // 2 if options.get("glu") else n
            y = torch.zeros(num_rows, width, dtype=torch.bfloat16, device="cuda")
            kwargs = dict(options, residual=y if options.get("residual") else None)
            row[f"{variant}_us"] = graph_time_us(
                lambda r: launch_linear(y, setup.x, setup.weights[r], config, **kwargs), setup.copies)
        rows.append(row)
        print(" ".join(f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in row.items() if key not in ("model", "N", "K")), flush=True)
        del setup
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--models", default="0.8b,9b")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--projections", action="store_true", help="also time each projection's variants")
    parser.add_argument("--fused-max-rows", type=int, default=linear_module.FUSED_MAX_ROWS)
    args = parser.parse_args()
    linear_module.FUSED_MAX_ROWS = min(args.fused_max_rows, linear_module.KERNEL_MAX_ROWS)
    rows, projection_table = [], []
    for model in args.models.split(","):
        for num_rows in map(int, args.rows.split(",")):
            layers, mixed, x = build(model, num_rows)
            stream = x.clone()
            forms = {"separate": lambda: separate_step(layers, mixed, x),
                     "fused": lambda: fused_step(layers, mixed, stream)}
            row = dict(model=model, rows=num_rows)
            for name, step in forms.items():
                row[f"{name}_launches"] = kernel_table(step, 1)[1]
                row[f"{name}_us"] = graph_time_us(lambda _: step(), 1)
            row["fused_over_separate"] = row["fused_us"] / row["separate_us"]
            rows.append(row)
            print(f"{model} M={num_rows}: separate {row['separate_us']:.1f} us ({row['separate_launches']} launches), "
                  f"fused {row['fused_us']:.1f} us ({row['fused_launches']}): {row['fused_over_separate']:.3f}x",
                  flush=True)
            del layers
            if args.projections:
                projection_table += projection_rows(model, num_rows)
    write_result(pathlib.Path(args.out), "kernels_block_fusion", torch.cuda.get_device_name(),
                 {"rows": rows, "projections": projection_table})


if __name__ == "__main__":
    main()
