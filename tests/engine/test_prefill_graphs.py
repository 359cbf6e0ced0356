"""Prefill forwards replayed from CUDA graphs (engine/prefill_graphs.py): the buckets, and on the
GPU the engine's output with them equal to the engine's without them (replays counted), plain
and speculative, with prefix-cache checkpoints and restores; with speculation the MTP's KV
cache and acceptance equal too (the MTP's prefill graphs: lossless output alone would not show
a wrong MTP KV cache, only lower acceptance). The padded forward itself is checked against the
unpadded one on the CPU in test_batch.py."""

import pytest
import torch

from deltaspec.engine import LLM, SamplingParams, prefill_graphs
from deltaspec.engine.prefill_graphs import row_buckets, token_buckets

from fixtures import GPU_SHAPE


def test_buckets():
    assert token_buckets(8192) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert token_buckets(3000) == [64, 128, 256, 512, 1024, 2048, 3000]
    assert token_buckets(64) == [64]
    assert row_buckets(1) == [2]
    assert row_buckets(64) == [2, 4, 8, 16, 32, 64, 128]
    assert row_buckets(63) == [2, 4, 8, 16, 32, 64]


def counted_replays(graphs) -> list:
    """A list that gets an entry at every replay of one of the captured graphs (asserted some)."""
    assert graphs is not None and graphs.graphs, graphs and graphs.describe()
    replays = []
    for entry in graphs.graphs:
        replay = entry.graph.replay
        entry.graph.replay = lambda replay=replay: replays.append(1) or replay()
    return replays


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("num_draft_tokens", [0, 3])
def test_prefill_graphs_change_no_token(checkpoint, monkeypatch, family, num_draft_tokens):
    # Every bucket captured, whether or not its replay pays: that is a timing on a GPU shared with
    # other test processes (qwen3_next's 64-token bucket once read 7.00 ms eager, 6.74 replayed).
    monkeypatch.setattr(prefill_graphs, "HOST_BOUND_SHARE", float("inf"))
    path = checkpoint(family, **GPU_SHAPE)
    generator = torch.Generator().manual_seed(num_draft_tokens)
    shared = torch.randint(0, 512, (700,), generator=generator).tolist()
    # Lengths across token buckets; the last two share a 700-token prefix (a checkpoint is
    # written at 512 and at the prompt's end, then restored).
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (1, 5, 63, 64, 65, 200, 1500)]
    prompts += [shared + [1, 2, 3], shared + [4, 5]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", num_draft_tokens=num_draft_tokens, max_num_seqs=8,
                   max_num_batched_tokens=2048, checkpoint_interval=512)
    eager = LLM(path, enable_prefill_graphs=False, **options)
    assert eager.core.runner.prefill_graphs is None
    want = [o.token_ids for o in eager.generate(prompts, params)]
    short = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 17, 30)]
    want_short = [o.token_ids for o in eager.generate(short, params)]
    del eager
    graphed = LLM(path, **options)
    graphs = graphed.core.runner.prefill_graphs
    replays = counted_replays(graphs)
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    # A step of a few short prompts fits the smallest bucket.
    replays.clear()
    assert [o.token_ids for o in graphed.generate(short, params)] == want_short
    assert replays, f"no prefill step replayed a graph: {graphs.describe()}"


@pytest.mark.gpu
def test_mtp_prefill_graphs_write_the_kv_eager_writes(checkpoint, monkeypatch):
    """The MTP's prefill forward replayed from a graph writes the MTP KV cache the eager forward
    writes (so the drafts, which attend over it, are the same). A random tiny MTP accepts
    nothing, so the KV cache itself is compared: fixed draft counts (no timing-dependent policy)
    keep both engines' schedules, blocks and slots the same."""
    monkeypatch.setattr(prefill_graphs, "HOST_BOUND_SHARE", float("inf"))
    path = checkpoint("qwen3_5", **GPU_SHAPE)
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 512, (600,), generator=generator).tolist()
    # Across token buckets, several rows per step, and a restored checkpoint (the shared prefix).
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (2, 9, 40, 64, 130, 300, 1100)]
    prompts += [shared + [7, 8], shared + [9]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", num_draft_tokens=3, adaptive_draft_length=False, max_num_seqs=8,
                   max_num_batched_tokens=2048, checkpoint_interval=512)

    def run(llm: LLM) -> tuple[list, torch.Tensor]:
        core = llm.core
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        mtp_layer = core.kv.layers[len(core.model_config.attention_layer_ids)]
        # Block 0 is the scratch block that padding rows write.
        return tokens, torch.stack([mtp_layer.k_cache[1:], mtp_layer.v_cache[1:]]).cpu()

    eager = LLM(path, enable_prefill_graphs=False, **options)
    want_tokens, want_kv = run(eager)
    del eager
    graphed = LLM(path, **options)
    graphs = graphed.core.runner.mtp_prefill_graphs
    replays = counted_replays(graphs)
    tokens, kv = run(graphed)
    assert replays, f"no MTP prefill replayed a graph: {graphs.describe()}"
    assert tokens == want_tokens
    assert want_kv.abs().amax() > 0
    torch.testing.assert_close(kv, want_kv, rtol=1e-4, atol=1e-4)
