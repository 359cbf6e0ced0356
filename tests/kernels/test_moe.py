"""Triton MoE routing / experts (kernels/moe.py), sampling and rejection sampling
(kernels/sampling.py) against their torch references.

The references are checked against float64 formulas and statistics in test_ref_norms_moe.py and
test_ref_sampling.py; here they are the oracle. Inputs are fresh seeded random draws (no zeros);
every buffer a launcher allocates starts as garbage (`torch.empty` is poisoned: NaN for floats,
a large negative number for integers), so an unwritten output or workspace entry that is read
shows up.

CPU: the interpreter on tiny shapes (fp32 / fp16), with the tiling shrunk so that every path
runs: both MoE paths, and every sampling path (greedy, no filter, window found in the first or
second histogram round, last resort). Sampling must draw the same token as the reference (the
noise is bit-identical), from its own (seed, offset) only. Rejection sampling is checked token
for token against its reference, and its reference for exactness of distribution: 200k rows,
chi-square at p = 0.001 for the first emitted token, the token after one acceptance and the
bonus token, with sampled and with greedy (one-hot) drafts.
GPU (`gpu` marker): bf16 MoE at Qwen-like shapes, sampling at a 248,320 vocabulary (peaked and
flat rows), and the 200k-row distribution test on the Triton rejection kernel.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from deltaspec.kernels.moe import (moe_experts, moe_experts_grouped, moe_experts_per_token, moe_experts_reference,
                                   route, route_reference)
from deltaspec.kernels.noise import row_hash_tl, uniform_noise, uniform_tl
from deltaspec.kernels.rejection import rejection_sample, rejection_sample_reference
from deltaspec.kernels.sampling import GREEDY, LAST_RESORT, NO_FILTER, WINDOW, launch_sample, sample, sample_reference
from deltaspec.kernels.tiles import TileConfig

# Upper 0.1% points of the chi-square distribution by degrees of freedom (no scipy needed).
CHI2_CRITICAL_P001 = {5: 20.515}
INT_POISON = -(2 ** 30) + 7


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Max error relative to the largest reference magnitude; NaN never passes."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual.double() - expected.double()).abs().max()
    scale = expected.double().abs().max()
    assert bool(error <= rtol * scale), f"{what}: max abs error {float(error):.3e} (scale {float(scale):.3e})"


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns garbage-filled tensors while a kernel launcher runs."""
    empty = torch.empty

    def garbage_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        if x.dtype == torch.bool:
            return x
        return x.fill_(float("nan") if x.is_floating_point() else INT_POISON)

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "empty", garbage_empty)
            return fn(*args, **kwargs)

    return run


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------

def assert_same_top_k(experts: torch.Tensor, expected: torch.Tensor, router_logits: torch.Tensor) -> None:
    """Same experts in the same order, up to the order among experts of equal probability
    (frequent with bf16 logits; torch.topk does not promise an order for ties)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, experts), probs.gather(1, expected))
    assert bool((experts.sort(1).values.diff(dim=1) > 0).all()), "an expert chosen twice"


def moe_case(gen: torch.Generator, tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
             dtype: torch.dtype, device: str):
    x = torch.randn(tokens, hidden, generator=gen)
    router_logits = torch.randn(tokens, num_experts, generator=gen) * 2
    router_logits[:, 1] = -30.0  # expert 1 gets no token: the grouped path must skip it
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    to = dict(device=device, dtype=dtype)
    return x.to(**to), router_logits.to(**to), w_gate_up.to(**to), w_down.to(**to)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_reference(kernel_device, poisoned_empty, dtype, renormalize):
    gen = torch.Generator().manual_seed(1 + renormalize)
    logits = (torch.randn(9, 40, generator=gen) * 2).to(kernel_device, dtype)  # 40 experts: not a power of 2
    for top_k in (1, 3):
        weights, experts = poisoned_empty(route, logits, top_k, renormalize)
        expected_weights, expected_experts = route_reference(logits, top_k, renormalize)
        assert weights.dtype == dtype and experts.dtype == torch.int64
        assert_same_top_k(experts, expected_experts, logits)
        assert_close(weights, expected_weights, 1e-6 if dtype == torch.float32 else 1e-3, f"top_k {top_k}")


PATHS = {
    "per_token": lambda *a: moe_experts_per_token(*a, gate_up_config=TileConfig(block_n=8, block_k=32),
                                                  down_config=TileConfig(block_n=16, block_k=32)),
    "grouped": lambda *a: moe_experts_grouped(*a, config=TileConfig(block_m=16, block_n=16, block_k=16,
                                                                    num_stages=1)),
    "dispatch": moe_experts,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tokens", [1, 13])
def test_moe_experts_match_reference(kernel_device, poisoned_empty, path, tokens):
    """H = 48, I = 24 (no tile divides them), 6 experts, one of them unused, top-2."""
    gen = torch.Generator().manual_seed(10 + tokens)
    x, router_logits, w_gate_up, w_down = moe_case(gen, tokens, 48, 24, 6, 2, torch.float32, kernel_device)
    weights, experts = route_reference(router_logits, 2, True)
    out = poisoned_empty(PATHS[path], x, weights, experts, w_gate_up, w_down)
    assert out.dtype == x.dtype
    assert_close(out, moe_experts_reference(x, weights, experts, w_gate_up, w_down), 1e-5, path)


def test_moe_grouped_crosses_blocks_and_matches_alone(kernel_device, poisoned_empty):
    """40 tokens, slot 0 of every token on expert 3 (three 16-row blocks, the last partial),
    fp16: matches the reference, and each token alone gives its row of the batch."""
    gen = torch.Generator().manual_seed(20)
    x, router_logits, w_gate_up, w_down = moe_case(gen, 40, 32, 16, 5, 2, torch.float16, kernel_device)
    router_logits[:, 3] = 20.0
    weights, experts = route_reference(router_logits, 2, False)
    config = TileConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
    out = poisoned_empty(moe_experts_grouped, x, weights, experts, w_gate_up, w_down, config)
    assert_close(out, moe_experts_reference(x, weights, experts, w_gate_up, w_down), 3e-3, "fp16 grouped")
    for t in (0, 17, 39):
        alone = moe_experts_grouped(x[t:t + 1], weights[t:t + 1], experts[t:t + 1], w_gate_up, w_down, config)
        assert_close(alone, out[t:t + 1], 1e-3, f"token {t} alone")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
def test_moe_bf16_qwen_like_shapes(tokens):
    """bf16, 64 experts, top-8, H 512, I 128: route and both paths against the reference."""
    gen = torch.Generator().manual_seed(30 + tokens)
    x, router_logits, w_gate_up, w_down = moe_case(gen, tokens, 512, 128, 64, 8, torch.bfloat16, "cuda")
    weights, experts = route(router_logits, 8, True)
    expected_weights, expected_experts = route_reference(router_logits, 8, True)
    assert_same_top_k(experts, expected_experts, router_logits)
    assert_close(weights, expected_weights, 1e-2, "routing weights")
    expected = moe_experts_reference(x, weights, experts, w_gate_up, w_down)
    for path in (moe_experts_per_token, moe_experts_grouped, moe_experts):
        assert_close(path(x, weights, experts, w_gate_up, w_down), expected, 2e-2, path.__name__)


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------

@triton.jit
def _noise_kernel(seeds, offsets, out, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    v = tl.arange(0, BLOCK)
    u = uniform_tl(row_hash_tl(tl.load(seeds + row), tl.load(offsets + row)), v)
    tl.store(out + row * V + v, u, mask=v < V)


def test_kernel_noise_is_bit_identical(kernel_device):
    gen = torch.Generator().manual_seed(40)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (6,), generator=gen)
    seeds[0], seeds[1] = 0, -1
    offsets = torch.randint(0, 2 ** 40, (6,), generator=gen)
    out = torch.empty(6, 100, device=kernel_device)
    _noise_kernel[(6,)](seeds.to(kernel_device), offsets.to(kernel_device), out, 100, BLOCK=128)
    assert torch.equal(out.cpu(), uniform_noise(seeds, offsets, 100))


def sampling_rows(gen: torch.Generator, batch: int, vocab: int, flat: bool = False):
    """Mixed rows: greedy, plain temperature, min-p, top-k, top-p, both, ranks just above and
    below the vocabulary; peaked logits (a few strong tokens) unless flat."""
    logits = torch.randn(batch, vocab, generator=gen) * (0.4 if flat else 2.0)
    if not flat:
        logits[:, :5] += 6.0 * torch.rand(batch, 5, generator=gen)
        logits = logits[:, torch.randperm(vocab, generator=gen)]
    pattern = [  # temperature, top_k, top_p, min_p
        (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.1), (1.2, 10, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0), (0.7, 20, 0.8, 0.0), (1.5, vocab + 3, 0.95, 0.02), (0.9, 1, 0.5, 0.0),
        (1.0, vocab - 1, 0.999, 0.0), (2.0, 0, 0.6, 0.0),
    ]
    rows = [pattern[i % len(pattern)] for i in range(batch)]
    columns = list(zip(*rows))
    temperature = torch.tensor(columns[0], dtype=torch.float32)
    top_k = torch.tensor(columns[1], dtype=torch.int64)
    top_p = torch.tensor(columns[2], dtype=torch.float32)
    min_p = torch.tensor(columns[3], dtype=torch.float32)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (batch,), generator=gen)
    offsets = torch.randint(0, 10 ** 6, (batch,), generator=gen)
    return [logits, temperature, top_k, top_p, min_p, seeds, offsets]


def on(device: str, args):
    return [None if a is None else a.to(device) for a in args]


# chunk, block, bins, capacity: the launcher's own; 2 splits and a window found by the first
# histogram round; a tiny capacity that sends the wide windows to the second round or the last resort
TILINGS = [dict(), dict(chunk=128, block=64, num_bins=64, capacity=256),
           dict(chunk=64, block=64, num_bins=16, capacity=8)]


@pytest.mark.parametrize("tiling", range(len(TILINGS)))
def test_sample_matches_reference(kernel_device, poisoned_empty, tiling):
    gen = torch.Generator().manual_seed(50 + tiling)
    args = sampling_rows(gen, 10, 200)
    expected_tokens, expected_logprobs = sample_reference(*args)
    statuses = torch.zeros(10, dtype=torch.int32, device=kernel_device)
    tokens, logprobs = poisoned_empty(launch_sample, *on(kernel_device, args), **TILINGS[tiling], statuses=statuses)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens.cpu(), expected_tokens)
    assert_close(logprobs.cpu(), expected_logprobs, 1e-5, "logprobs")
    seen = set(statuses.tolist())
    assert {GREEDY.value, NO_FILTER.value} <= seen
    assert (WINDOW.value in seen) and (tiling < 2 or LAST_RESORT.value in seen), seen


def test_sample_flat_rows_refine_and_low_precision_logits(kernel_device):
    """Flat logits (wide top-p windows, re-binned) in fp16 and bf16: the reference's tokens."""
    gen = torch.Generator().manual_seed(60)
    args = sampling_rows(gen, 10, 300, flat=True)
    for dtype in (torch.float16, torch.bfloat16):
        args[0] = args[0].to(dtype)
        expected_tokens, expected_logprobs = sample_reference(*args)
        tokens, logprobs = launch_sample(*on(kernel_device, args), chunk=256, block=128, num_bins=32, capacity=64)
        assert torch.equal(tokens.cpu(), expected_tokens), dtype
        assert_close(logprobs.cpu(), expected_logprobs, 1e-5, f"{dtype} logprobs")


def test_sample_draw_depends_only_on_own_seed_and_offset(kernel_device):
    """Each row alone, and the rows scattered among strangers in a bigger batch, draw the same
    tokens as the batch did; the same call twice gives the same tokens."""
    gen = torch.Generator().manual_seed(70)
    rows = sampling_rows(gen, 6, 150)
    tokens, _ = sample(*on(kernel_device, rows))
    assert torch.equal(sample(*on(kernel_device, rows))[0], tokens)
    for r in (1, 4):
        alone, _ = sample(*on(kernel_device, [x[r:r + 1] for x in rows]))
        assert alone.item() == tokens[r].item(), f"row {r} alone"
    strangers = sampling_rows(gen, 5, 150)
    places = torch.randperm(11, generator=gen)
    big = [torch.empty((11,) + x.shape[1:], dtype=x.dtype) for x in rows]
    for merged, mine, theirs in zip(big, rows, strangers):
        merged[places[:6]] = mine
        merged[places[6:]] = theirs
    big_tokens, _ = sample(*on(kernel_device, big))
    assert torch.equal(big_tokens[places[:6].to(kernel_device)], tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("flat", [False, True])
def test_sample_full_vocabulary(flat):
    """B = 20 rows over a 248,320 vocabulary, fp32 and bf16 logits."""
    gen = torch.Generator().manual_seed(80 + flat)
    args = sampling_rows(gen, 20, 248_320, flat=flat)
    for dtype in (torch.float32, torch.bfloat16):
        args[0] = args[0].to(dtype)
        expected_tokens, expected_logprobs = sample_reference(*on("cuda", args))
        statuses = torch.zeros(20, dtype=torch.int32, device="cuda")
        tokens, logprobs = launch_sample(*on("cuda", args), statuses=statuses)
        assert torch.equal(tokens, expected_tokens), (dtype, statuses.tolist())
        assert_close(logprobs, expected_logprobs, 1e-5, f"{dtype} logprobs")


# ----------------------------------------------------------------------------------------------
# Rejection sampling
# ----------------------------------------------------------------------------------------------

def rejection_case(gen: torch.Generator, batch: int, max_draft: int, vocab: int, device: str):
    p = torch.softmax(torch.randn(batch, max_draft + 1, vocab, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(batch, max_draft, vocab, generator=gen) * 2, -1)
    draft = torch.randint(0, vocab, (batch, max_draft), generator=gen)
    num_draft = torch.randint(0, max_draft + 1, (batch,), generator=gen)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (batch,), generator=gen)
    offsets = torch.randint(0, 10 ** 6, (batch,), generator=gen)
    return [x.to(device) for x in (p, q, draft, num_draft, seeds, offsets)]


@pytest.mark.parametrize("max_draft,vocab", [(0, 30), (1, 9), (3, 50), (4, 300)])
def test_rejection_kernel_matches_reference(kernel_device, poisoned_empty, max_draft, vocab):
    gen = torch.Generator().manual_seed(90 + max_draft)
    p, q, draft, num_draft, seeds, offsets = rejection_case(gen, 7, max_draft, vocab, kernel_device)
    for draft_probs in (q, None):
        expected = rejection_sample_reference(p, draft_probs, draft, num_draft, seeds, offsets)
        tokens, accepted = poisoned_empty(rejection_sample, p, draft_probs, draft, num_draft, seeds, offsets)
        assert torch.equal(accepted, expected[1]) and torch.equal(tokens, expected[0])
        assert bool((accepted <= num_draft).all())


def test_rejection_greedy_target_is_argmax_matching(kernel_device):
    """One-hot p (a greedy target): accept the longest prefix equal to the argmax, then emit
    the argmax at the first mismatch (or the bonus argmax)."""
    gen = torch.Generator().manual_seed(100)
    batch, max_draft, vocab = 16, 3, 12
    best = torch.randint(0, vocab, (batch, max_draft + 1), generator=gen)
    p = torch.nn.functional.one_hot(best, vocab).float()
    draft = torch.where(torch.rand(batch, max_draft, generator=gen) < 0.7, best[:, :max_draft],
                        torch.randint(0, vocab, (batch, max_draft), generator=gen))
    num_draft = torch.randint(0, max_draft + 1, (batch,), generator=gen)
    seeds, offsets = torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
    tokens, accepted = rejection_sample(*on(kernel_device, [p, None, draft, num_draft, seeds, offsets]))
    tokens, accepted = tokens.cpu(), accepted.cpu()
    for b in range(batch):
        n = 0
        while n < num_draft[b] and draft[b, n] == best[b, n]:
            n += 1
        assert accepted[b].item() == n
        assert tokens[b, :n + 1].tolist() == draft[b, :n].tolist() + [best[b, n].item()]
        assert (tokens[b, n + 1:] == -1).all()


P_FIXED = torch.tensor([[0.30, 0.05, 0.20, 0.15, 0.25, 0.05],
                        [0.10, 0.40, 0.05, 0.05, 0.10, 0.30],
                        [0.05, 0.15, 0.35, 0.25, 0.10, 0.10]])
Q_FIXED = torch.tensor([[0.10, 0.30, 0.10, 0.30, 0.10, 0.10],
                        [0.25, 0.15, 0.25, 0.05, 0.25, 0.05]])


def chi_square(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=expected.numel()).double()
    n = counts.sum()
    return float(((counts - n * expected.double()) ** 2 / (n * expected.double())).sum())


def check_rejection_distribution(fn, device: str, greedy_drafts: bool) -> None:
    """200k rows, 2 drafts each, fixed p (3 positions) and q; drafts drawn from q, or for greedy
    drafts fixed tokens (0, 1) with draft_probs None (one-hot q). Emitted token 0 ~ p_0; given one
    acceptance token 1 ~ p_1; given both, the bonus token 2 ~ p_2."""
    rows, max_draft = 200_000, 2
    gen = torch.Generator().manual_seed(110 + greedy_drafts)
    if greedy_drafts:
        draft = torch.tensor([0, 1]).expand(rows, max_draft).clone()
    else:
        draft = torch.stack([torch.multinomial(Q_FIXED[i], rows, replacement=True, generator=gen)
                             for i in range(max_draft)], 1)
    args = [P_FIXED.expand(rows, -1, -1).contiguous(),
            None if greedy_drafts else Q_FIXED.expand(rows, -1, -1).contiguous(), draft,
            torch.full((rows,), max_draft), torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=gen),
            torch.randint(0, 2 ** 40, (rows,), generator=gen)]
    tokens, accepted = fn(*on(device, args))
    tokens, accepted = tokens.cpu(), accepted.cpu()
    for position in range(max_draft + 1):
        reached = accepted >= position
        stat = chi_square(tokens[reached, position], P_FIXED[position])
        assert stat < CHI2_CRITICAL_P001[5], f"position {position}: chi-square {stat:.1f}, {int(reached.sum())} rows"
        assert int(reached.sum()) > 10_000


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_rejection_reference_emits_target_distribution(greedy_drafts):
    check_rejection_distribution(rejection_sample_reference, "cpu", greedy_drafts)


@pytest.mark.gpu
@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_rejection_kernel_emits_target_distribution(greedy_drafts):
    check_rejection_distribution(rejection_sample, "cuda", greedy_drafts)
