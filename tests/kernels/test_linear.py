"""The skinny split-K GEMM (kernels/linear.py) against its reference, F.linear.

Inputs are fresh seeded random draws; outputs are poisoned with NaN before the kernel writes
them. Cases cover M = 1, 3, 16, 33 (x is padded to >= 16 rows for the MMA, so M = 33 pads to
64), N not a multiple of the tile, K not a multiple of BLOCK_K * split_k (short and empty last
splits), split-K = 1 and > 1 (the in-launch reduction by the last arriver), and x as a
row-strided view with an unaligned start. After each launch the arrival
counters are back at zero, and a second launch gives bit-identical output (the partials are
summed in a fixed order, whichever program arrives last). The fused block ops (the input's
RMSNorm, SwiGLU over [gate; up], the residual add into the stream) alone and together, on the
same cases, against the separate ops of the reference; and their cuBLAS fallback through
`linear` against the same. The GDN's decode conv run by the projection (ConvDecode) over ragged
verify and decode rows, against the conv reference applied to the reference GEMM's output. The
one-row form (launch_gemv: W in registers, no split-K) on its own cases, with the same fusions
and the conv, and the GDN's gated norm it runs on its input (GatedNorm), against the reference.

CPU: the interpreter, fp32 and fp16 (it computes bf16 dots wrongly), small shapes.
GPU (`gpu` marker): bf16 on the Qwen3.5-0.8B and -9B projection shapes through `linear` (the
kernel or its cuBLAS fallback), explicit configs, and replay in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import triton

from deltaspec.kernels.arrivals import arrival_counters
import deltaspec.kernels.linear as linear_module
from deltaspec.kernels.conv1d import ConvDecode, causal_conv1d_decode, causal_conv1d_decode_reference
from deltaspec.kernels.linear import (CONV_EPILOGUE_MAX_ROWS, CUBLAS_ROWS, FUSED_WIDE_MAX_BYTES, GEMV_PROGRAM_BYTES,
                                     GEMV_ROW_BYTES, GEMV_WARPS, KERNEL_MAX_ROWS, MAX_ROWS, block_m, gemv_config,
                                     kernel_config, launch_gemv, launch_linear, linear, linear_config, linear_reference,
                                     padded_linear, use_kernel)
from deltaspec.kernels.norms import GatedNorm, gated_rms_norm, gated_rms_norm_reference
from deltaspec.kernels.tiles import TileConfig
from kernel_helpers import (PAD_SLOT, RAGGED, assert_close, assert_slots_untouched, clone, conv_pool,
                            cu_seqlens_of)


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


def check(x: torch.Tensor, weight: torch.Tensor, config: TileConfig, launch=launch_linear) -> None:
    """Poisoned output vs reference; counters at zero; a second launch bit-identical."""
    y = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    launch(y, x, weight, config)
    expected = linear_reference(x.float(), weight.float())
    assert_close(y, expected, TOLERANCE[x.dtype], f"{config}")
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0, "arrival counters not reset"
    again = torch.full_like(y, float("nan"))
    launch(again, x, weight, config)
    assert torch.equal(y, again), "second launch differs"


FUSIONS = {"norm": dict(norm_eps=1e-6), "glu": dict(glu=True), "residual": dict(residual=True),
           "all": dict(norm_eps=1e-6, glu=True, residual=True)}


def fused_reference(x: torch.Tensor, weight: torch.Tensor, stream: torch.Tensor | None, options: dict) -> torch.Tensor:
    """The separate ops in float32: x / rms(x) (its weight is W's), the GEMM, silu(gate) * up,
    stream + result."""
    x = x.float()
    if options.get("norm_eps") is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + options["norm_eps"])
    y = x @ weight.float().t()
    if options.get("glu"):
        gate, up = y.chunk(2, dim=-1)
        y = gate * torch.sigmoid(gate) * up
    return y if stream is None else stream.float() + y


def check_fused(x: torch.Tensor, weight: torch.Tensor, config: TileConfig, options: dict, seed: int,
                launch=launch_linear) -> None:
    """The fused launch into a poisoned y, or into the residual stream itself, against
    fused_reference; x scaled far from unit rms, so a missing norm cannot pass."""
    x = x * 7.0
    num_rows, width = x.shape[0], weight.shape[0] // (2 if options.get("glu") else 1)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    stream = torch.randn(num_rows, width, generator=gen, device=x.device).to(x.dtype) \
        if options.get("residual") else None
    expected = fused_reference(x, weight, stream, options)
    kwargs = dict(options, residual=stream)
    y = stream if stream is not None else torch.full((num_rows, width), float("nan"), dtype=x.dtype, device=x.device)
    launch(y, x, weight, config, **kwargs)
    assert_close(y, expected, TOLERANCE[x.dtype], f"{config} {options}")
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0, "arrival counters not reset"


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


@pytest.mark.parametrize("fusion", FUSIONS, ids=str)
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}-s{c[3].num_splits}")
def test_linear_kernel_fused(case, fusion, kernel_device):
    num_rows, n, k, config = case
    options = FUSIONS[fusion]
    x, weight = inputs(num_rows, 2 * n if options.get("glu") else n, k, torch.float32, kernel_device,
                       seed=num_rows * 100 + n)
    check_fused(x, weight, config, options, seed=n)


# (N, K, block_n, block_k) of the one-row form: N not a multiple of the tile, K not a power of
# two (the masked tail of the padded row), one and several rows of W a program, block_k past K.
GEMV_CASES = [(40, 100, 8, 128), (17, 48, 1, 64), (33, 64, 4, 64), (24, 72, 16, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: f"N{c[0]}-K{c[1]}-bn{c[2]}-bk{c[3]}")
def test_gemv_kernel(case, dtype, kernel_device):
    """The one-row form against the reference, x a row of a strided buffer off a 16-byte boundary."""
    n, k, block_n, block_k = case
    x, weight = inputs(1, n, k, dtype, kernel_device, seed=n + k, row_stride=k + 5, offset=3)
    check(x, weight, TileConfig(block_n=block_n, block_k=block_k, num_warps=1), launch_gemv)


@pytest.mark.parametrize("fusion", FUSIONS, ids=str)
@pytest.mark.parametrize("case", GEMV_CASES[:3], ids=lambda c: f"N{c[0]}-K{c[1]}-bn{c[2]}-bk{c[3]}")
def test_gemv_kernel_fused(case, fusion, kernel_device):
    n, k, block_n, block_k = case
    options = FUSIONS[fusion]
    block_n = max(block_n, 2) if options.get("glu") else block_n
    x, weight = inputs(1, 2 * n if options.get("glu") else n, k, torch.float32, kernel_device, seed=n)
    check_fused(x, weight, TileConfig(block_n=block_n, block_k=block_k, num_warps=1), options, seed=k, launch=launch_gemv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [3, 4], ids=["3-heads-padded", "4-heads"])
@pytest.mark.parametrize("entry", ["launch", "linear-1", "linear-3"])
def test_linear_gated_norm(entry, heads, dtype, kernel_device, monkeypatch):
    """gated_norm=GatedNorm: x [M, H * 16] gated-RMS-normalised by heads (gate a row-strided view,
    as z of the GDN's in_proj output) before the projection, with the residual add the GDN's
    out_proj runs with; three heads leave a padded fourth in the one-row form's K. `linear` runs
    it in the one-row form for 1 row and by the gated norm's kernel before the projection above,
    against gated_rms_norm_reference and the reference GEMM. x far from unit rms per head, so a
    missing norm cannot pass."""
    head, n = 16, 24
    num_rows = 3 if entry == "linear-3" else 1
    k = heads * head
    x, weight = inputs(num_rows, n, k, dtype, kernel_device, seed=heads * 10 + num_rows)
    gen = torch.Generator(device=kernel_device).manual_seed(heads)
    x = x * torch.arange(1, k + 1, device=kernel_device).to(dtype) / 8
    wide = torch.randn(num_rows, 2 * k + 5, generator=gen, device=kernel_device).to(dtype)
    gate = wide[:, k:2 * k]
    norm_weight = (1 + 0.5 * torch.randn(head, generator=gen, device=kernel_device)).to(dtype)
    stream = torch.randn(num_rows, n, generator=gen, device=kernel_device).to(dtype)
    normed = gated_rms_norm_reference(x.view(num_rows, heads, head), gate.reshape(num_rows, heads, head), norm_weight,
                                      1e-6).reshape(num_rows, k)
    expected = stream.float() + linear_reference(normed.float(), weight.float())
    norms = []
    monkeypatch.setattr(linear_module, "gated_rms_norm", lambda *a: norms.append(1) or gated_rms_norm(*a))
    gated = GatedNorm(gate, norm_weight, 1e-6)
    if entry == "launch":
        y = stream.clone()
        launch_gemv(y, x, weight, TileConfig(block_n=4, block_k=64, num_warps=1), residual=y, gated_norm=gated)
    else:
        y = linear(x, weight, residual=stream.clone(), gated_norm=gated)
    assert len(norms) == (entry == "linear-3")
    assert_close(y, expected, TOLERANCE[dtype], entry)
    reference = linear_reference(x, weight, residual=stream.clone(), gated_norm=gated)
    assert_close(reference, expected, TOLERANCE[dtype], "reference")


def test_linear_wide_row(kernel_device, monkeypatch):
    """A row of W past GEMV_PROGRAM_BYTES (fp16, K = 9000: 32 KB padded, as the 9B's down
    projection) with the residual add the down projection runs: `linear` takes the one-row form,
    one row a program, never the MMA form, against the reference."""
    monkeypatch.setattr(linear_module, "launch_linear", lambda *a, **k: pytest.fail("the MMA form ran"))
    x, weight = inputs(1, 6, 9000, torch.float16, kernel_device, seed=6)
    stream = torch.randn(1, 6, generator=torch.Generator(device=kernel_device).manual_seed(7),
                         device=kernel_device).to(torch.float16)
    expected = stream.float() + linear_reference(x.float(), weight.float())
    y = linear(x, weight, residual=stream)
    assert y is stream
    assert_close(y, expected, TOLERANCE[torch.float16], "wide row")


def test_linear_gated_norm_odd_heads(kernel_device, monkeypatch):
    """Heads of a width that is not a power of two: `linear` runs the gated norm's kernel before
    the projection even for one row (the one-row form reshapes x into power-of-two heads)."""
    x, weight = inputs(1, 20, 24, torch.float32, kernel_device, seed=4)
    gen = torch.Generator(device=kernel_device).manual_seed(4)
    gated = GatedNorm(torch.randn(1, 24, generator=gen, device=kernel_device),
                      torch.randn(12, generator=gen, device=kernel_device), 1e-6)
    norms = []
    monkeypatch.setattr(linear_module, "gated_rms_norm", lambda *a: norms.append(1) or gated_rms_norm(*a))
    y = linear(x * 3.0, weight, gated_norm=gated)
    assert norms == [1]
    assert_close(y, linear_reference(x * 3.0, weight, gated_norm=gated), TOLERANCE[torch.float32], "odd heads")


def test_gemv_config():
    """gemv_config on an H100 (132 SMs, bf16): a program's padded share of W within
    GEMV_PROGRAM_BYTES, a power of two of rows (two at least with glu), N tiles for every SM
    where the rows allow; a wider least share (the 9B's down projection, 32 KB a row) alone up
    to GEMV_ROW_BYTES with warps in proportion; None past that."""
    device = torch.device("cpu")
    for n, k in GPU_SHAPES + [(1024, 20000)]:
        for glu in (False, True):
            config = gemv_config(2 * n if glu else n, k, device, glu)
            share = triton.next_power_of_2(k) * 2 * (2 if glu else 1)
            if share > GEMV_ROW_BYTES:
                assert config is None, (n, k, glu)
                continue
            if share > GEMV_PROGRAM_BYTES:
                assert config.block_n == (2 if glu else 1) and config.block_k == triton.next_power_of_2(k), (n, k)
                assert config.num_warps == GEMV_WARPS * share // GEMV_PROGRAM_BYTES
                continue
            assert config.block_k == triton.next_power_of_2(k) and config.block_n & (config.block_n - 1) == 0
            assert config.block_n * config.block_k * 2 <= GEMV_PROGRAM_BYTES
            assert config.block_n >= (2 if glu else 1)
    with pytest.raises(AssertionError, match="power of two"):
        x, weight = inputs(1, 16, 48, torch.float32, "cpu", seed=0)
        launch_gemv(torch.empty(1, 16), x, weight, TileConfig(block_n=4, block_k=32))
    with pytest.raises(AssertionError, match="1 row"):
        x, weight = inputs(2, 16, 32, torch.float32, "cpu", seed=0)
        launch_gemv(torch.empty(2, 16), x, weight, TileConfig(block_n=4, block_k=32))


def test_linear_fused_entry_point(kernel_device):
    """`linear` with the fusions: the kernel's epilogue up to its rows, cuBLAS and the separate
    ops above (rms_norm without a weight, silu_and_mul, the add), both against the reference;
    with a residual, the stream itself is the result."""
    options = FUSIONS["all"]
    for num_rows in (2, KERNEL_MAX_ROWS + 3):
        x, weight = inputs(num_rows, 48, 64, torch.float32, kernel_device, seed=num_rows)
        x = x * 5.0
        stream = torch.randn(num_rows, 24, device=kernel_device)
        expected = fused_reference(x, weight, stream, options)
        y = linear(x, weight, norm_eps=options["norm_eps"], glu=True, residual=stream)
        assert y is stream
        assert_close(y, expected, TOLERANCE[torch.float32], f"M={num_rows}")
        reference = linear_reference(x, weight, norm_eps=options["norm_eps"], glu=True,
                                     residual=torch.zeros(num_rows, 24, device=kernel_device))
        assert_close(reference, fused_reference(x, weight, None, options), TOLERANCE[torch.float32], "reference")


ONE_ROW = [(4, 7, 3)]  # (new tokens, slot, pending count), as RAGGED
ONE_TOKEN = [(1, 7, 3)]  # a decode row: `linear` runs the one-row form


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("entry", ["launch", "linear", "reference"])
@pytest.mark.parametrize("rows", [RAGGED, ONE_ROW, ONE_TOKEN], ids=["ragged", "one-row", "one-token"])
def test_linear_conv_epilogue(kernel_device, monkeypatch, rows, entry, splits, commit):
    """conv=ConvDecode: the projection's first C = 40 of N = 56 columns (a 16-column tile straddles
    C) go through the decode conv of ragged rows (pending drafts, verify rows of up to 5 tokens,
    pad rows on scratch slot 0) or of one row: y, the new tokens' conv outputs, the pending
    tokens' and every real slot's window and pending columns against
    causal_conv1d_decode_reference run on the reference GEMM's output; slots outside the batch
    untouched. `linear` runs the conv in the epilogue up to CONV_EPILOGUE_MAX_ROWS rows and by the
    conv kernel above; for one token, in the one-row form's epilogue (splits 1: launch_gemv
    with 16-row tiles, 3: with 2-row tiles)."""
    channels, n, k, max_pending = 40, 56, 48, 4
    lengths, slots = [length for length, _, _ in rows], [slot for _, slot, _ in rows]
    conv_launches = []
    monkeypatch.setattr(linear_module, "causal_conv1d_decode",
                        lambda *args: conv_launches.append(1) or causal_conv1d_decode(*args))
    num_tokens = sum(lengths)
    gen = torch.Generator().manual_seed(11 + splits)
    x, weight = inputs(num_tokens, n, k, torch.float32, kernel_device, seed=5 + splits)
    conv_weight = (0.5 * torch.randn(channels, 4, generator=gen)).to(kernel_device)
    pool = conv_pool(gen, 10, max_pending, channels, 4, kernel_device)
    for _, slot, count in rows:
        if count is not None:
            pool["pending_counts"][slot] = count
    cu, slot_ids = cu_seqlens_of(lengths, kernel_device), torch.tensor(slots, dtype=torch.int32, device=kernel_device)
    expected_pool, actual_pool = clone(pool), clone(pool)
    y_expected = x @ weight.t()
    out_expected, pending_expected = causal_conv1d_decode_reference(
        y_expected[:, :channels], conv_weight, cu, slot_ids, expected_pool["conv"], expected_pool["pending_conv"],
        expected_pool["pending_counts"], commit)
    nan = float("nan")
    conv = ConvDecode(conv_weight, cu, slot_ids, actual_pool["conv"], actual_pool["pending_conv"],
                      actual_pool["pending_counts"], commit,
                      torch.full((num_tokens, channels), nan, device=kernel_device),
                      torch.full((len(slots), max_pending, channels), nan, device=kernel_device))
    if entry == "launch" and num_tokens == 1:
        y = torch.full((num_tokens, n), nan, device=kernel_device)
        launch_gemv(y, x, weight, TileConfig(block_n=16 if splits == 1 else 2, block_k=64, num_warps=1), conv=conv)
    elif entry == "launch":
        y = torch.full((num_tokens, n), nan, device=kernel_device)
        launch_linear(y, x, weight, TileConfig(block_n=16, block_k=16, num_splits=splits, num_warps=1, num_stages=1),
                      conv=conv)
    else:
        y = (linear if entry == "linear" else linear_reference)(x, weight, conv=conv)
    assert len(conv_launches) == (entry == "linear" and len(rows) > CONV_EPILOGUE_MAX_ROWS)
    assert_close(y, y_expected, TOLERANCE[torch.float32], "y")
    start = 0
    for row, (length, slot) in enumerate(zip(lengths, slots)):
        if slot != PAD_SLOT:  # pad rows share scratch slot 0: their outputs are garbage
            span = slice(start, start + length)
            assert_close(conv.out[span], out_expected[span], TOLERANCE[torch.float32], f"conv out of slot {slot}")
            count = int(pool["pending_counts"][slot])
            assert_close(conv.pending_out[row, :count], pending_expected[row, :count], TOLERANCE[torch.float32],
                         f"pending conv out of slot {slot}")
            for name in ("conv", "pending_conv"):
                assert_close(actual_pool[name][slot], expected_pool[name][slot], TOLERANCE[torch.float32], name)
        start += length
    assert_slots_untouched(actual_pool, pool, owned=set(slots))
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0, "arrival counters not reset"


def test_linear_strided_x(kernel_device):
    """x as a row-strided view (unit stride along K) starting off a 16-byte boundary."""
    x, weight = inputs(5, 36, 80, torch.float32, kernel_device, seed=3, row_stride=93, offset=3)
    assert not x.is_contiguous() and x.stride() == (93, 1)
    check(x, weight, TileConfig(block_n=16, block_k=32, num_splits=2, num_warps=1, num_stages=1))


def test_linear_entry_point(kernel_device, monkeypatch):
    """`linear` takes the one-row form for 1 row, the kernel up to KERNEL_MAX_ROWS rows and
    F.linear above (and for no rows)."""
    forms = []
    monkeypatch.setattr(linear_module, "launch_gemv", lambda *a, **kw: forms.append("gemv") or launch_gemv(*a, **kw))
    monkeypatch.setattr(linear_module, "launch_linear",
                        lambda *a, **kw: forms.append("mma") or launch_linear(*a, **kw))
    for num_rows in (1, 7, KERNEL_MAX_ROWS):
        x, weight = inputs(num_rows, 24, 64, torch.float32, kernel_device, seed=num_rows)
        assert linear_config(num_rows, 24, 64, x.device) is not None
        assert_close(linear(x, weight), linear_reference(x, weight), TOLERANCE[torch.float32], f"M={num_rows}")
    for num_rows in (0, KERNEL_MAX_ROWS + 1):
        x, weight = inputs(num_rows, 24, 64, torch.float32, kernel_device, seed=num_rows)
        assert linear_config(num_rows, 24, 64, x.device) is None
        assert torch.equal(linear(x, weight), linear_reference(x, weight))
    assert forms == ["gemv", "mma", "mma"]


@pytest.mark.parametrize("num_rows", [1, 3, KERNEL_MAX_ROWS + 1])
def test_linear_widened_out(kernel_device, num_rows):
    """out=: a float32 buffer (a model head's logits) holds the product rounded to x's dtype, then
    widened, bit for bit the float() of the same launch's fp16 result: the one-row form writes it
    itself, the other paths copy. A fused op with out is refused."""
    x, weight = inputs(num_rows, 40, 100, torch.float16, kernel_device, seed=num_rows + 11)
    out = torch.full((num_rows, 40), float("nan"), dtype=torch.float32, device=kernel_device)
    assert linear(x, weight, out=out) is out
    assert torch.equal(out, linear(x, weight).float())
    assert_close(out, linear_reference(x.float(), weight.float()), TOLERANCE[torch.float16], f"M={num_rows}")
    assert torch.equal(linear_reference(x, weight, out=torch.empty_like(out)), linear_reference(x, weight).float())
    if num_rows <= KERNEL_MAX_ROWS:  # the MMA form widens its stores too
        config = TileConfig(block_n=16, block_k=32, num_splits=2, num_warps=1, num_stages=1)
        narrow, wide = torch.empty(num_rows, 40, dtype=x.dtype, device=kernel_device), torch.full_like(out, float("nan"))
        launch_linear(narrow, x, weight, config)
        launch_linear(wide, x, weight, config)
        assert torch.equal(wide, narrow.float())
    with pytest.raises(AssertionError, match="out takes no fused ops"):
        linear(x, weight, residual=torch.zeros(num_rows, 40, dtype=x.dtype, device=kernel_device), out=out)


@pytest.mark.parametrize("element_size", [2, 4])
def test_kernel_configs_fit_shared_memory(element_size):
    """Every tile kernel_config picks for up to KERNEL_MAX_ROWS rows, on the Qwen3.5 projection
    shapes and the wide ones fused projections bring (lm_head-like N too), pipelines its W and x
    tiles within an H100's 227 KB of shared memory, fp32 inputs included."""
    for num_rows in range(1, KERNEL_MAX_ROWS + 1):
        for n, k in [*GPU_SHAPES, (248320, 1024), (2 * 17408, 5120)]:
            config = kernel_config(num_rows, n, k, 132, element_size)
            stages = config.num_stages * (config.block_n + block_m(num_rows)) * config.block_k * element_size
            assert stages <= 227 * 1024, f"M={num_rows} N={n} K={k}: {config} needs {stages} bytes"


def test_large_wide_weights_go_to_cublas():
    """A fused wide projection (N >= 32 per SM) takes the kernel up to FUSED_WIDE_MAX_BYTES of W
    (the 0.8B's gate_up), cuBLAS past it (the 9B's gate_up and in_proj); a fused narrow one takes
    the kernel whatever its size (the 9B's down)."""
    assert use_kernel(4, 7168, 132, fused=True, weight_bytes=7168 * 1024 * 2)
    assert not use_kernel(4, 24576, 132, fused=True, weight_bytes=24576 * 4096 * 2)
    assert not use_kernel(4, 12352, 132, fused=True, weight_bytes=12352 * 4096 * 2)
    assert use_kernel(4, 4096, 132, fused=True, weight_bytes=4096 * 12288 * 2)
    assert 7168 * 1024 * 2 <= FUSED_WIDE_MAX_BYTES < 10240 * 4096 * 2


def test_long_rows_take_wide_k_steps():
    """Rows of W of LONG_K or more at up to 8 rows: K steps of 256 and at most one program per SM
    (2 splits of the 9B's 64 N tiles on 132 SMs); shorter rows keep steps of 128 and round the
    programs per SM up (the 0.8B's down: 16 tiles, 9 splits)."""
    config = kernel_config(4, 4096, 4096, 132)
    assert (config.block_n, config.block_k, config.num_splits) == (64, 256, 2)
    assert kernel_config(4, 4096, 12288, 132).block_k == 256
    assert kernel_config(16, 4096, 12288, 132).block_k == 128
    short = kernel_config(4, 1024, 3584, 132)
    assert (short.block_k, short.num_splits) == (128, 7)


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


@pytest.mark.parametrize("multiple", [7, 128])
def test_padded_linear(multiple):
    """Rows staged into a buffer of a multiple of `multiple` rows: the leading rows of the padded
    product, contiguous, equal to F.linear over x's rows alone (x a strided view too)."""
    for num_rows in (1, 6, 7, 8, 127, 128, 129, 300):
        x, weight = inputs(num_rows, 48, 40, torch.float32, "cpu", seed=num_rows, row_stride=44, offset=3)
        y = padded_linear(x, weight, multiple)
        assert y.shape == (num_rows, 48) and y.is_contiguous()
        assert_close(y, linear_reference(x, weight), TOLERANCE[torch.float32], f"M={num_rows}")


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
@pytest.mark.parametrize("shape", GPU_SHAPES[:5], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_linear_gpu_fused_shapes(shape):
    """The fused block ops through `linear` at the 0.8B projections' shapes, bf16, every row
    count the kernel fuses at and one above (cuBLAS and the separate kernels)."""
    n, k = shape
    for fusion, options in FUSIONS.items():
        for num_rows in (1, 4, 16, 32, 33):
            x, weight = inputs(num_rows, 2 * n if options.get("glu") else n, k, torch.bfloat16, "cuda", seed=num_rows)
            x = x * 7.0
            stream = torch.randn(num_rows, n, device="cuda").bfloat16() if options.get("residual") else None
            expected = fused_reference(x, weight, stream, options)
            y = linear(x, weight, norm_eps=options.get("norm_eps"), glu=bool(options.get("glu")), residual=stream)
            assert_close(y, expected, TOLERANCE[torch.bfloat16], f"{fusion} M={num_rows}")
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 4])
def test_linear_gpu_cuda_graph(num_rows):
    """Captured once, replayed on new x: the same as eager (scratch from the graph's pool,
    counters reset inside the launch; for 1 row, the one-row form)."""
    x, weight = inputs(num_rows, 1024, 3584, torch.bfloat16, "cuda", seed=1)
    if num_rows > 1:
        assert linear_config(num_rows, 1024, 3584, x.device).num_splits > 1
    linear(x, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear(x, weight)
    for seed in range(3):
        x.copy_(inputs(num_rows, 1024, 3584, torch.bfloat16, "cuda", seed=seed + 10)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, linear(x, weight))
        assert_close(y, linear_reference(x.float(), weight.float()), TOLERANCE[torch.bfloat16], f"seed {seed}")
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.gpu
def test_linear_gpu_cublas_rows_padded():
    """Past the kernel's rows `linear` takes cuBLAS over rows padded to CUBLAS_ROWS (eager: the
    result is the leading rows), and the exact rows under graph capture: both equal the
    reference, and the replay equals eager within bf16's tolerance (other rows, other kernels)."""
    n, k = 4096, 4096
    for num_rows in (65, CUBLAS_ROWS + 1, 200, 1000):
        assert linear_config(num_rows, n, k, torch.device("cuda")) is None
        x, weight = inputs(num_rows, n, k, torch.bfloat16, "cuda", seed=num_rows, row_stride=k + 8)
        y = linear(x, weight)
        assert y.shape == (num_rows, n) and y.is_contiguous()
        assert_close(y, linear_reference(x.float(), weight.float()), TOLERANCE[torch.bfloat16], f"M={num_rows}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = linear(x, weight)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(captured, y, TOLERANCE[torch.bfloat16], f"M={num_rows}, captured")

