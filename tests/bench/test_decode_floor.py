"""bench/decode_floor.py's parts: the read kernel (bench/stream_read.py) against its torch
reference (CPU: the interpreter; GPU: with PDL where it has it); the decode step's launch list
(bench/decode_reads.py) against the 0.8B shape's parameter and state bytes counted here by
hand; the launches of each granularity covering one arena, read whole by their chain (GPU: also
from a CUDA graph replay)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from decode_floor import GRANULARITIES, ReadChain, launch_spans  # noqa: E402
from decode_reads import decode_reads, shape_config  # noqa: E402
from stream_read import ReadConfig, stream_read, stream_read_reference  # noqa: E402

from deltaspec.engine.models import HybridLM  # noqa: E402
from deltaspec.kernels import REFERENCE_OPS  # noqa: E402
from deltaspec.kernels.device import supports_dependent_launch  # noqa: E402

# The GDN's decode conv is fused into its in_proj (linear's ConvDecode) and its gated norm into its
# out_proj (linear's GatedNorm), whose reads count theirs.
GDN_LAYER = ["rms_norm", "linear", "gdn_decode", "linear", "rms_norm", "linear", "silu_and_mul", "linear"]
# The q/k norm, RoPE and KV write are fused into the qkv projection (linear's QKNormRopeKV).
ATTENTION_LAYER = ["rms_norm", "linear", "paged_attention", "linear", "rms_norm", "linear", "silu_and_mul", "linear"]


def random_words(num_words: int, seed: int) -> torch.Tensor:
    """int32 words over the whole range, so the sums wrap."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (num_words,), generator=generator, dtype=torch.int64).to(torch.int32)


def wrapped_sum(words: torch.Tensor) -> int:
    return int(words.long().sum().cpu()) % 2**32


# (words, programs, block): one word; a ragged last tile; more programs than tiles (the extra
# programs store 0); several tiles per program.
@pytest.mark.parametrize("num_words,num_programs,block", [(1, 1, 16), (1000, 3, 64), (320, 8, 64), (4099, 2, 1024)])
def test_stream_read_matches_reference(num_words, num_programs, block, kernel_device):
    words = random_words(num_words, seed=num_words).to(kernel_device)
    partials = torch.full((num_programs,), 12345, dtype=torch.int32, device=kernel_device)
    stream_read(words, partials, ReadConfig(block=block), supports_dependent_launch(words.device))
    assert torch.equal(partials, stream_read_reference(words, num_programs, block))
    assert wrapped_sum(partials) == wrapped_sum(words)


def test_stream_read_rejects_bad_arguments():
    with pytest.raises(ValueError, match="int32"):
        stream_read(torch.zeros(64, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), ReadConfig(), False)
    with pytest.raises(ValueError, match="contiguous"):
        stream_read(torch.zeros(64, dtype=torch.int32)[::2], torch.zeros(1, dtype=torch.int32), ReadConfig(), False)
    with pytest.raises(ValueError, match="power of two"):
        ReadConfig(block=1000)


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_reads_of_the_0_8b_shape(batch):
    config = shape_config("0.8b")
    reads = decode_reads(config, batch, context=512)
    with torch.device("meta"):
        model = HybridLM(config, REFERENCE_OPS, torch.bfloat16, with_mtp=False)
    parameters = dict(model.named_parameters())

    # Every weight once (the tied embedding as the lm_head), plus each row's embedding gather.
    assert config.tie_word_embeddings
    weights = sum(p.numel() * p.element_size() for p in parameters.values())  # A_log, dt_bias: fp32
    assert sum(r.weight_bytes for r in reads) == weights + batch * config.hidden_size * 2
    assert 1.50e9 < weights < 1.51e9
    assert set(parameters) <= {name for r in reads for name in r.tensors}

    # State per row: each GDN layer's fp32 recurrent state and bf16 conv window (+ the int32
    # pending count, read by its conv and its recurrent kernel); each attention layer's K and V
    # of the context and the new token.
    recurrent = 16 * 128 * 128 * 4           # HV x K x V fp32
    conv = 3 * (2 * 16 * 128 + 16 * 128) * 2  # (width - 1) x (q | k | v channels) bf16
    kv = 2 * (512 + 1) * 2 * 256 * 2          # K and V x tokens x KV heads x head dim bf16
    state = 18 * (recurrent + conv + 2 * 4) + 6 * kv
    assert sum(r.state_bytes for r in reads) == batch * state

    # Activations: the logits' bf16 and fp32 copies read after the GEMM, then ~1.6 MB a row over 197 launches.
    logits = batch * config.vocab_size * (2 + 4)
    assert logits < sum(r.activation_bytes for r in reads) < logits + batch * 2 * 2**20

    # The step's launches in order: the embedding, 18 GDN layers of 8 and 6 attention layers of
    # 8, the final norm, the head.
    assert len(reads) == 1 + 18 * 8 + 6 * 8 + 1 + 2
    assert [r.layer for r in reads] == sorted(r.layer for r in reads)
    assert {r.layer for r in reads} == set(range(25))
    for layer in range(24):
        expected = ATTENTION_LAYER if layer % 4 == 3 else GDN_LAYER
        assert [r.op for r in reads if r.layer == layer and r.op != "embedding"] == expected
    assert reads[0].op == "embedding"
    assert [r.op for r in reads if r.layer == 24] == ["rms_norm", "lm_head", "argmax"]


def test_launch_spans_cover_one_arena_and_chains_read_it_whole(kernel_device):
    reads = decode_reads(shape_config("tiny"))
    spans = {granularity: launch_spans(reads, granularity) for granularity in GRANULARITIES}
    assert [len(spans[g]) for g in GRANULARITIES] == [1, 4 + 1, len(reads)]
    total = spans["step"][0].num_words
    assert total * 4 >= sum(r.num_bytes for r in reads)
    for granularity, chain in spans.items():
        assert chain[0].start == 0 and sum(span.num_words for span in chain) == total
        assert all(a.start + a.num_words == b.start for a, b in zip(chain, chain[1:]))
        assert all(span.start % 64 == 0 and span.num_words > 0 for span in chain)
    words = random_words(total, seed=7).to(kernel_device)
    for granularity in GRANULARITIES:
        chain = ReadChain(words, spans[granularity], ReadConfig(block=256, programs_per_sm=2), dependent=False)
        chain()
        assert len(chain) == len(spans[granularity])
        assert wrapped_sum(chain.partials) == wrapped_sum(words)


@pytest.mark.gpu
def test_a_dependent_launch_chain_replayed_from_a_cuda_graph_reads_the_arena_whole():
    """As decode_floor times it: the tiny shape's per-kernel chain, PDL where the GPU has it."""
    spans = launch_spans(decode_reads(shape_config("tiny")), "kernel")
    words = random_words(spans[-1].start + spans[-1].num_words, seed=3).cuda()
    chain = ReadChain(words, spans, ReadConfig(), dependent=supports_dependent_launch(words.device))
    chain()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    chain.partials.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert wrapped_sum(chain.partials) == wrapped_sum(words)
