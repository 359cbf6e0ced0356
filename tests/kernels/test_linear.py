"""The skinny split-K GEMM (kernels/linear.py) against its reference, F.linear.

Inputs are fresh seeded random draws; outputs are poisoned with NaN before the kernel writes
them. Cases cover M = 1, 3, 16, 33 (x is padded to >= 16 rows for the MMA, so M = 33 pads to
64), N not a multiple of the tile, K not a multiple of BLOCK_K * split_k (short and empty last
splits), split-K = 1 and > 1 (the in-launch reduction by the last arriver), and x as a
row-strided view with an unaligned start. After each launch the arrival
counters are back at zero, and a second launch gives bit-identical output (the partials are
summed in a fixed order, whichever program arrives last).

CPU: the interpreter, fp32 and fp16 (it computes bf16 dots wrongly), small shapes.
GPU (`gpu` marker): bf16 on the Qwen3.5-0.8B and -9B projection shapes through `linear` (the
kernel or its cuBLAS fallback), explicit configs, and replay in a CUDA graph.

The fused prologues (SwiGLU before the down projection, the GDN gated norm before out_proj)
against an oracle written here: the activation in float64, rounded once to the input dtype
(what the unfused kernels store), then the GEMM in float64; their entry points against the
unfused composition (identical where they fall back to it). The residual add + RMSNorm
epilogue, after each prologue, split-K or not: (normed, new residual) against the same float64
oracle of y rounded to the dtype, then the add (rounded) and the (1 + w) norm; the arrival
counters (the epilogue's included) back at zero.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels.arrivals import arrival_counters
from deltaspec.kernels.norms import AddRMSNorm
from deltaspec.kernels.linear import EPILOGUE_MAX_ROWS, KERNEL_MAX_ROWS, MAX_ROWS, gated_rms_norm_linear, \
    gated_rms_norm_linear_reference, launch_gated_rms_norm_linear, launch_linear, launch_silu_and_mul_linear, linear, \
    linear_config, linear_reference, silu_and_mul_linear, silu_and_mul_linear_reference
from deltaspec.kernels.tiles import TileConfig
from kernel_helpers import assert_close


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def inputs(num_rows: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int,
           row_stride: int | None = None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (a view into a wider buffer when row_stride is given) and W [N, K], scaled so
    that y is O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    stride = row_stride or k
    buffer = torch.randn(num_rows * stride + offset, generator=gen, device=device).to(dtype)
    x = buffer[offset:].as_strided((num_rows, k), (stride, 1))
    weight = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(dtype)
    return x, weight


def check(x: torch.Tensor, weight: torch.Tensor, config: TileConfig) -> None:
    """Poisoned output vs reference; counters at zero; a second launch bit-identical."""
    y = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    launch_linear(y, x, weight, config)
    expected = linear_reference(x.float(), weight.float())
    assert_close(y, expected, TOLERANCE[x.dtype], f"{config}")
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0, "arrival counters not reset"
    again = torch.full_like(y, float("nan"))
    launch_linear(again, x, weight, config)
    assert torch.equal(y, again), "second launch differs"


# (M, N, K, config): BLOCK_N 16 and BLOCK_K 32 or 16 keep the interpreter's grids small.
CASES = [
    (1, 40, 100, TileConfig(block_n=16, block_k=32, num_splits=2, num_warps=1, num_stages=1)),   # K % 64 != 0
    (3, 33, 64, TileConfig(block_n=16, block_k=32, num_splits=1, num_warps=1, num_stages=1)),
    (16, 50, 96, TileConfig(block_n=16, block_k=32, num_splits=3, num_warps=1, num_stages=1)),
    (33, 20, 70, TileConfig(block_n=16, block_k=32, num_splits=4, num_warps=1, num_stages=1)),   # 4th split empty
    (3, 24, 72, TileConfig(block_n=16, block_k=16, num_splits=5, num_warps=1, num_stages=1)),    # 16 | K, 80 !| K
    (1, 17, 48, TileConfig(block_n=16, block_k=16, num_splits=1, num_warps=1, num_stages=1)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}-s{c[3].num_splits}")
def test_linear_kernel(case, dtype, kernel_device):
    num_rows, n, k, config = case
    x, weight = inputs(num_rows, n, k, dtype, kernel_device, seed=num_rows * 100 + n)
    check(x, weight, config)


def test_linear_strided_x(kernel_device):
    """x as a row-strided view (unit stride along K) starting off a 16-byte boundary."""
    x, weight = inputs(5, 36, 80, torch.float32, kernel_device, seed=3, row_stride=93, offset=3)
    assert not x.is_contiguous() and x.stride() == (93, 1)
    check(x, weight, TileConfig(block_n=16, block_k=32, num_splits=2, num_warps=1, num_stages=1))


def test_linear_entry_point(kernel_device):
    """`linear` takes the kernel up to KERNEL_MAX_ROWS rows and F.linear above (and for no rows)."""
    for num_rows in (1, 7, KERNEL_MAX_ROWS):
        x, weight = inputs(num_rows, 24, 64, torch.float32, kernel_device, seed=num_rows)
        assert linear_config(num_rows, 24, 64, x.device) is not None
        assert_close(linear(x, weight), linear_reference(x, weight), TOLERANCE[torch.float32], f"M={num_rows}")
    for num_rows in (0, KERNEL_MAX_ROWS + 1):
        x, weight = inputs(num_rows, 24, 64, torch.float32, kernel_device, seed=num_rows)
        assert linear_config(num_rows, 24, 64, x.device) is None
        assert torch.equal(linear(x, weight), linear_reference(x, weight))


def test_linear_rejects_bad_arguments(kernel_device):
    config = TileConfig(block_n=16, block_k=32, num_splits=1, num_warps=1, num_stages=1)
    x, weight = inputs(2, 16, 32, torch.float32, kernel_device, seed=0)
    y = torch.empty(2, 16, device=kernel_device)
    with pytest.raises(AssertionError, match="dtype|float"):
        launch_linear(y, x, weight.half(), config)
    with pytest.raises(AssertionError, match="unit stride"):
        launch_linear(y, x.t().contiguous().t(), weight, config)
    with pytest.raises(AssertionError, match="chain"):
        launch_linear(y, x, weight[:, :16], config)
    with pytest.raises(AssertionError, match="rows"):
        launch_linear(torch.empty(MAX_ROWS + 1, 16, device=kernel_device),
                      torch.zeros(MAX_ROWS + 1, 32, device=kernel_device), weight, config)


# ---- fused prologues ----------------------------------------------------------------------------

def swiglu_oracle(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64, rounded to gate_up's dtype, @ weight^T in float64."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    a = (gate / (1 + torch.exp(-gate)) * up).to(gate_up.dtype)
    return a.double() @ weight.double().T


def gated_norm_oracle(x, gate, norm_weight, eps, weight) -> torch.Tensor:
    """Per head: x / sqrt(mean(x^2) + eps) * w * silu(gate) in float64, rounded to x's dtype,
    flattened, @ weight^T in float64."""
    h, z = x.double(), gate.double()
    a = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double() * (z / (1 + torch.exp(-z)))
    return a.to(x.dtype).flatten(1).double() @ weight.double().T


def swiglu_inputs(num_rows: int, n: int, inner: int, dtype: torch.dtype, device: str, seed: int):
    """gate_up [M, 2I] as a row-strided view (a wider buffer), W [N, I]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    buffer = torch.randn(num_rows, 2 * inner + 5, generator=gen, device=device).mul(2).to(dtype)
    weight = (torch.randn(n, inner, generator=gen, device=device) * inner ** -0.5).to(dtype)
    return buffer[:, 3:3 + 2 * inner], weight


def gated_inputs(num_rows: int, n: int, heads: int, dim: int, dtype: torch.dtype, device: str, seed: int):
    """x [M, H, D] contiguous; gate [M, H, D] a view into a wider projection output (as z is);
    norm weight [D] around 1; W [N, H * D]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(num_rows, heads, dim, generator=gen, device=device) * 3).to(dtype)
    projection = torch.randn(num_rows, heads * dim + 7, generator=gen, device=device).to(dtype)
    gate = projection[:, 7:].unflatten(1, (heads, dim))
    norm_weight = (1 + 0.3 * torch.randn(dim, generator=gen, device=device)).to(dtype)
    weight = (torch.randn(n, heads * dim, generator=gen, device=device) * (heads * dim) ** -0.5).to(dtype)
    return x, gate, norm_weight, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [
    (1, 40, 100, TileConfig(block_n=16, block_k=32, num_splits=2, num_warps=1, num_stages=1)),   # I % 32 != 0
    (5, 33, 64, TileConfig(block_n=16, block_k=32, num_splits=1, num_warps=1, num_stages=1)),
    (16, 20, 96, TileConfig(block_n=16, block_k=16, num_splits=4, num_warps=1, num_stages=1)),
], ids=lambda c: f"M{c[0]}-N{c[1]}-I{c[2]}-s{c[3].num_splits}")
def test_silu_and_mul_linear_kernel(case, dtype, kernel_device):
    num_rows, n, inner, config = case
    gate_up, weight = swiglu_inputs(num_rows, n, inner, dtype, kernel_device, seed=num_rows + inner)
    y = torch.full((num_rows, n), float("nan"), dtype=dtype, device=kernel_device)
    launch_silu_and_mul_linear(y, gate_up, weight, config)
    assert_close(y, swiglu_oracle(gate_up, weight), TOLERANCE[dtype], f"{config}")
    assert int(arrival_counters(y.device, 1).abs().sum()) == 0, "arrival counters not reset"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [
    (1, 40, 4, 16, 1), (3, 24, 3, 32, 2), (16, 17, 6, 16, 4),   # (M, N, heads, D, splits)
], ids=lambda c: f"M{c[0]}-N{c[1]}-H{c[2]}-D{c[3]}-s{c[4]}")
def test_gated_rms_norm_linear_kernel(case, dtype, kernel_device):
    num_rows, n, heads, dim, splits = case
    x, gate, norm_weight, weight = gated_inputs(num_rows, n, heads, dim, dtype, kernel_device, seed=num_rows * heads)
    config = TileConfig(block_n=16, block_k=dim, num_splits=splits, num_warps=1, num_stages=1)
    y = torch.full((num_rows, n), float("nan"), dtype=dtype, device=kernel_device)
    launch_gated_rms_norm_linear(y, x, gate, norm_weight, 1e-6, weight, config)
    assert_close(y, gated_norm_oracle(x, gate, norm_weight, 1e-6, weight), TOLERANCE[dtype], f"{config}")
    assert int(arrival_counters(y.device, 1).abs().sum()) == 0, "arrival counters not reset"


def test_fused_entry_points(kernel_device):
    """The fused entry points against their references where they fuse (a decode batch), and
    bit-identical to the unfused composition where they fall back to it (a prefill batch)."""
    for num_rows in (2, KERNEL_MAX_ROWS + 3):
        fuses = num_rows <= KERNEL_MAX_ROWS
        gate_up, weight = swiglu_inputs(num_rows, 24, 64, torch.float32, kernel_device, seed=num_rows)
        y = silu_and_mul_linear(gate_up, weight)
        assert_close(y, silu_and_mul_linear_reference(gate_up, weight), TOLERANCE[torch.float32], f"M={num_rows}")
        unfused = silu_and_mul_linear(gate_up, weight, fused=False)
        assert fuses or torch.equal(y, unfused)
        x, gate, norm_weight, weight = gated_inputs(num_rows, 24, 2, 32, torch.float32, kernel_device, seed=num_rows)
        y = gated_rms_norm_linear(x, gate, norm_weight, 1e-6, weight)
        expected = gated_rms_norm_linear_reference(x, gate, norm_weight, 1e-6, weight)
        assert_close(y, expected, TOLERANCE[torch.float32], f"M={num_rows}")
        assert fuses or torch.equal(y, gated_rms_norm_linear(x, gate, norm_weight, 1e-6, weight, fused=False))


def test_fused_prologues_reject_bad_arguments(kernel_device):
    config = TileConfig(block_n=16, block_k=32, num_splits=1, num_warps=1, num_stages=1)
    gate_up, weight = swiglu_inputs(2, 16, 32, torch.float32, kernel_device, seed=0)
    with pytest.raises(AssertionError, match="chain"):
        launch_silu_and_mul_linear(torch.empty(2, 16, device=kernel_device), gate_up[:, :48], weight, config)
    x, gate, norm_weight, weight = gated_inputs(2, 16, 2, 16, torch.float32, kernel_device, seed=0)
    y = torch.empty(2, 16, device=kernel_device)
    with pytest.raises(AssertionError, match="head dim"):
        launch_gated_rms_norm_linear(y, x, gate, norm_weight, 1e-6, weight, config)
    with pytest.raises(AssertionError, match="adjacent heads"):
        launch_gated_rms_norm_linear(y, x.transpose(0, 1).contiguous().transpose(0, 1), gate, norm_weight, 1e-6,
                                     weight, TileConfig(block_n=16, block_k=16, num_warps=1, num_stages=1))


def add_norm_oracle(y: torch.Tensor, then: AddRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """y (float64 GEMM output) rounded to the residual's dtype, + residual rounded, then
    s / sqrt(mean(s^2) + eps) * (1 + w) in float64."""
    dtype = then.residual.dtype
    s = (y.to(dtype).double() + then.residual.double()).to(dtype)
    h = s.double()
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + then.eps) * (1 + then.weight.double()), s


def add_norm(num_rows: int, n: int, dtype: torch.dtype, device: str, seed: int) -> AddRMSNorm:
    """A residual [M, N] as a row-strided view, a norm weight near 0 ((1 + w) scaling)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    residual = torch.randn(num_rows, n + 3, generator=gen, device=device).to(dtype)[:, 1:n + 1]
    return AddRMSNorm(residual, (0.2 * torch.randn(n, generator=gen, device=device)).to(dtype), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("prologue", ["plain", "silu_and_mul", "gated_rms_norm"])
def test_add_rms_norm_epilogue(prologue, splits, dtype, kernel_device):
    for num_rows, n in ((1, 40), (EPILOGUE_MAX_ROWS, 33)):
        seed = num_rows * 7 + splits
        then = add_norm(num_rows, n, dtype, kernel_device, seed)
        y = torch.full((num_rows, n), float("nan"), dtype=dtype, device=kernel_device)
        config = TileConfig(block_n=16, block_k=16, num_splits=splits, num_warps=1, num_stages=1)
        if prologue == "plain":
            x, weight = inputs(num_rows, n, 96, dtype, kernel_device, seed)
            normed, residual = launch_linear(y, x, weight, config, then)
            expected = x.double() @ weight.double().T
        elif prologue == "silu_and_mul":
            gate_up, weight = swiglu_inputs(num_rows, n, 80, dtype, kernel_device, seed)
            normed, residual = launch_silu_and_mul_linear(y, gate_up, weight, config, then)
            expected = swiglu_oracle(gate_up, weight)
        else:
            x, gate, norm_weight, weight = gated_inputs(num_rows, n, 5, 16, dtype, kernel_device, seed)
            normed, residual = launch_gated_rms_norm_linear(y, x, gate, norm_weight, 1e-6, weight, config, then)
            expected = gated_norm_oracle(x, gate, norm_weight, 1e-6, weight)
        expected_normed, expected_residual = add_norm_oracle(expected, then)
        assert_close(residual, expected_residual, TOLERANCE[dtype], f"{prologue} M={num_rows}: residual")
        assert_close(normed, expected_normed, TOLERANCE[dtype], f"{prologue} M={num_rows}: normed")
        assert int(arrival_counters(y.device, 1).abs().sum()) == 0, "arrival counters not reset"


def test_epilogue_entry_points(kernel_device):
    """`then` through the entry points: in the epilogue up to EPILOGUE_MAX_ROWS rows, apart above
    (then identical to rms_norm after the unfused projection), and equal to the references."""
    from deltaspec.kernels.norms import rms_norm
    for num_rows in (2, EPILOGUE_MAX_ROWS + 1):
        x, weight = inputs(num_rows, 24, 64, torch.float32, kernel_device, seed=num_rows)
        then = add_norm(num_rows, 24, torch.float32, kernel_device, seed=num_rows)
        normed, residual = linear(x, weight, then)
        expected_normed, expected_residual = linear_reference(x, weight, then)
        assert_close(normed, expected_normed, TOLERANCE[torch.float32], f"M={num_rows}")
        assert_close(residual, expected_residual, TOLERANCE[torch.float32], f"M={num_rows}")
        apart = rms_norm(linear(x, weight), then.weight, then.eps, then.residual)
        if num_rows > EPILOGUE_MAX_ROWS:
            assert torch.equal(normed, apart[0]) and torch.equal(residual, apart[1])
        gate_up, weight = swiglu_inputs(num_rows, 24, 64, torch.float32, kernel_device, seed=num_rows)
        for actual, expected in zip(silu_and_mul_linear(gate_up, weight, then),
                                    silu_and_mul_linear_reference(gate_up, weight, then)):
            assert_close(actual, expected, TOLERANCE[torch.float32], f"M={num_rows}")


# ---- GPU --------------------------------------------------------------------------------------

# (N, K) of the Qwen3.5-0.8B and -9B projections (bench/kernels_linear.py derives them).
GPU_SHAPES = [(1024, 2048), (1024, 3584), (8224, 1024), (7168, 1024), (5120, 1024),
              (4096, 4096), (4096, 12288), (12352, 4096), (10240, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_linear_gpu_shapes(shape):
    n, k = shape
    for num_rows in (1, 3, 4, 8, 16, 33, 64):
        x, weight = inputs(num_rows, n, k, torch.bfloat16, "cuda", seed=num_rows + n)
        y = linear(x, weight)
        assert_close(y, linear_reference(x.float(), weight.float()), TOLERANCE[torch.bfloat16], f"M={num_rows}")
        assert torch.equal(y, linear(x, weight)), f"M={num_rows}: not deterministic"
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    TileConfig(block_n=64, block_k=128, num_splits=1, num_warps=4, num_stages=3),
    TileConfig(block_n=32, block_k=64, num_splits=7, num_warps=4, num_stages=4),
    TileConfig(block_n=128, block_k=256, num_splits=28, num_warps=8, num_stages=2),   # half the splits empty
    TileConfig(block_n=16, block_k=256, num_splits=5, num_warps=2, num_stages=1),
], ids=lambda c: f"{c.block_n}x{c.block_k}-s{c.num_splits}")
def test_linear_gpu_configs(config):
    for num_rows, n, k in ((1, 1024, 3584), (4, 1000, 3500), (64, 1024, 2048)):
        x, weight = inputs(num_rows, n, k, torch.bfloat16, "cuda", seed=num_rows)
        check(x, weight, config)
    x, weight = inputs(3, 1024, 2048, torch.bfloat16, "cuda", seed=9, row_stride=2048 + 24, offset=8)
    check(x, weight, config)


@pytest.mark.gpu
def test_linear_gpu_cuda_graph():
    """Captured once, replayed on new x: the same as eager (scratch from the graph's pool,
    counters reset inside the launch)."""
    x, weight = inputs(4, 1024, 3584, torch.bfloat16, "cuda", seed=1)
    assert linear_config(4, 1024, 3584, x.device).num_splits > 1
    linear(x, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear(x, weight)
    for seed in range(3):
        x.copy_(inputs(4, 1024, 3584, torch.bfloat16, "cuda", seed=seed + 10)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, linear(x, weight))
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 3584), (4096, 12288)], ids=lambda s: f"N{s[0]}-I{s[1]}")
def test_silu_and_mul_linear_gpu_shapes(shape):
    """The 0.8B and 9B down projections, bf16, through the entry point (kernel up to 16 rows)."""
    n, inner = shape
    for num_rows in (1, 4, 16, 64):
        gate_up, weight = swiglu_inputs(num_rows, n, inner, torch.bfloat16, "cuda", seed=num_rows)
        y = silu_and_mul_linear(gate_up, weight)
        assert_close(y, swiglu_oracle(gate_up, weight), TOLERANCE[torch.bfloat16], f"M={num_rows}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 16, 128), (4096, 32, 128)], ids=lambda s: f"N{s[0]}-H{s[1]}-D{s[2]}")
def test_gated_rms_norm_linear_gpu_shapes(shape):
    """The 0.8B and 9B GDN out_proj, bf16, through the entry point (kernel up to 16 rows)."""
    n, heads, dim = shape
    for num_rows in (1, 4, 16, 64):
        x, gate, norm_weight, weight = gated_inputs(num_rows, n, heads, dim, torch.bfloat16, "cuda", seed=num_rows)
        y = gated_rms_norm_linear(x, gate, norm_weight, 1e-6, weight)
        assert_close(y, gated_norm_oracle(x, gate, norm_weight, 1e-6, weight), TOLERANCE[torch.bfloat16],
                     f"M={num_rows}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 3584), (4096, 12288)], ids=lambda s: f"N{s[0]}-I{s[1]}")
def test_add_rms_norm_epilogue_gpu_shapes(shape):
    """The 0.8B and 9B down projections with the next layer's input norm, bf16: in the epilogue
    up to EPILOGUE_MAX_ROWS rows, apart above."""
    n, inner = shape
    for num_rows in (1, 2, EPILOGUE_MAX_ROWS, 8):
        gate_up, weight = swiglu_inputs(num_rows, n, inner, torch.bfloat16, "cuda", seed=num_rows)
        then = add_norm(num_rows, n, torch.bfloat16, "cuda", seed=num_rows)
        normed, residual = silu_and_mul_linear(gate_up, weight, then)
        expected_normed, expected_residual = add_norm_oracle(swiglu_oracle(gate_up, weight), then)
        assert_close(residual, expected_residual, TOLERANCE[torch.bfloat16], f"M={num_rows}: residual")
        assert_close(normed, expected_normed, TOLERANCE[torch.bfloat16], f"M={num_rows}: normed")
    assert int(arrival_counters(weight.device, 1).abs().sum()) == 0


@pytest.mark.gpu
def test_add_rms_norm_epilogue_gpu_cuda_graph():
    """The gated-norm out_proj with the post-mixer norm, captured once and replayed on new
    inputs: the same as eager (counters reset inside the launch, outputs from the graph's pool)."""
    x, gate, norm_weight, weight = gated_inputs(1, 1024, 16, 128, torch.bfloat16, "cuda", seed=1)
    then = add_norm(1, 1024, torch.bfloat16, "cuda", seed=1)
    gated_rms_norm_linear(x, gate, norm_weight, 1e-6, weight, then)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, residual = gated_rms_norm_linear(x, gate, norm_weight, 1e-6, weight, then)
    for seed in range(3):
        fresh = gated_inputs(1, 1024, 16, 128, torch.bfloat16, "cuda", seed=seed + 10)
        x.copy_(fresh[0])
        gate.copy_(fresh[1])
        then.residual.copy_(add_norm(1, 1024, torch.bfloat16, "cuda", seed=seed + 10).residual)
        graph.replay()
        torch.cuda.synchronize()
        eager = gated_rms_norm_linear(x, gate, norm_weight, 1e-6, weight, then)
        assert torch.equal(normed, eager[0]) and torch.equal(residual, eager[1])
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0
