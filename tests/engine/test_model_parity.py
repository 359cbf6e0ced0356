"""Parity with HF transformers (the oracle) on random tiny checkpoints of every family, float32
on the CPU reference backend: single sequences of many lengths, ragged batches, a sequence fed
in pieces (prefill, decode steps, a later chunk), mixed decode+prefill batches, and greedy
generation. The residual-stream form (norms folded into the projections, the stream updated in
place: engine/models/layers.py, what the GPU runs) against HF too, through the references with
`fused_block_rows` set. One test runs the model through the Triton table instead (the interpreter
on CPU), so the way the layers wire the kernels (output views, strided inputs, fused epilogues)
is checked end to end without a GPU."""

from dataclasses import replace
from functools import lru_cache

import pytest
import torch
from transformers import AutoModelForCausalLM

from deltaspec.engine import LLM, SamplingParams
from deltaspec.engine.allocators import BlockAllocator, SlotAllocator
from deltaspec.engine.batch import ForwardBatch, Row
from deltaspec.engine.state_pool import KVPool, StatePool
from fixtures import GPU_SHAPE, TRITON_TABLE_SHAPE

TOLERANCE = 1e-4  # max abs error relative to the logits' scale


@pytest.fixture
def models(family, checkpoint):
    return _models(checkpoint(family))


@lru_cache(maxsize=None)
def _models(path):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, LLM(path, block_size=16)


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    error = (actual - expected).abs().max().item() / expected.abs().max().item()
    assert error <= TOLERANCE, f"relative error {error:.2e}"


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("length", [1, 2, 37, 63, 64, 65, 129, 300])
def test_score_matches_hf(models, length):
    hf, llm = models
    tokens = random_tokens(length, seed=length)
    assert_close(llm.score(tokens), hf_logits(hf, tokens))


def test_ragged_batch_matches_hf(models):
    hf, llm = models
    sequences = [random_tokens(n, seed=n) for n in (70, 1, 5, 128, 33)]
    for tokens, logits in zip(sequences, llm.score_batch(sequences)):
        assert_close(logits, hf_logits(hf, tokens))


class ManualStepper:
    """Drives the model step by step with explicit rows, as the engine's runner will."""

    def __init__(self, llm: LLM, num_sequences: int, max_len: int) -> None:
        self.llm = llm
        self.slots = SlotAllocator(num_sequences + 3)
        self.blocks = BlockAllocator(num_sequences * (-(-max_len // 16)) + 4, 16)
        self.states = StatePool(llm.config, self.slots.capacity, 0, llm.core.dtype, llm.core.device)
        self.kv = KVPool(llm.model.num_kv_layers, self.blocks.capacity, 16, llm.config.num_key_value_heads,
                         llm.config.head_dim, llm.core.dtype, llm.core.device)
        # Skip a few slots/blocks so the sequences do not sit at 1, 2, ...
        self.slots.allocate(2)
        self.blocks.allocate(3)
        self.tables = {}

    def new_sequence(self, key, max_len: int) -> None:
        self.tables[key] = (self.slots.allocate(1)[0], self.blocks.allocate(-(-max_len // 16)))

    @torch.inference_mode()
    def step(self, decode: list[tuple], prefill: list[tuple]) -> list[torch.Tensor]:
        """decode/prefill: (key, token_ids, start_position). Returns logits of every token, per row."""
        def rows(items):
            return [Row(ids, start, *self.tables[key], num_logits=len(ids)) for key, ids, start in items]

        batch = ForwardBatch.build(rows(decode), rows(prefill), 16, self.llm.core.device)
        hidden = self.llm.model(batch, self.states, self.kv)
        logits = self.llm.model.compute_logits(hidden[batch.logits_indices])
        return list(logits.split([len(ids) for _, ids, _ in [*decode, *prefill]]))


def test_sequence_fed_in_pieces_matches_one_pass(models):
    """Prefill 37 tokens, then 1 token at a time, then a 50-token chunk (prefill with initial
    state): the state carried through the pools gives the logits of one full pass."""
    hf, llm = models
    tokens = random_tokens(37 + 12 + 50, seed=7)
    expected = hf_logits(hf, tokens)
    stepper = ManualStepper(llm, 1, len(tokens))
    stepper.new_sequence("a", len(tokens))
    pieces = [stepper.step([], [("a", tokens[:37], 0)])[0]]
    for position in range(37, 49):
        pieces.append(stepper.step([("a", tokens[position:position + 1], position)], [])[0])
    pieces.append(stepper.step([], [("a", tokens[49:], 49)])[0])
    assert_close(torch.cat(pieces), expected)


def test_mixed_decode_and_prefill_batch(models):
    """Sequences decode one token while others prefill (from scratch and after a prefix) in the
    same step; each matches its own full pass."""
    hf, llm = models
    a, b, c = random_tokens(40, 1), random_tokens(90, 2), random_tokens(70, 3)
    stepper = ManualStepper(llm, 3, 100)
    for key in "abc":
        stepper.new_sequence(key, 100)
    out = {"a": [], "b": [], "c": []}
    first = stepper.step([], [("a", a[:30], 0), ("c", c[:20], 0)])
    out["a"].append(first[0]), out["c"].append(first[1])
    for i in range(30, 40):
        # a decodes; b prefills in chunks of 9; c continues its prefill with a ragged chunk.
        prefill = [("b", b[(i - 30) * 9:(i - 29) * 9], (i - 30) * 9)]
        if i == 31:
            prefill.append(("c", c[20:70], 20))
        logits = stepper.step([("a", a[i:i + 1], i)], prefill)
        out["a"].append(logits[0]), out["b"].append(logits[1])
        if i == 31:
            out["c"].append(logits[2])
    assert_close(torch.cat(out["a"]), hf_logits(hf, a))
    assert_close(torch.cat(out["b"]), hf_logits(hf, b))
    assert_close(torch.cat(out["c"]), hf_logits(hf, c))


def test_greedy_generate_matches_hf(models):
    hf, llm = models
    prompts = [random_tokens(n, seed=100 + n) for n in (5, 23)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    hf.generation_config.eos_token_id = None
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            reference = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        assert output.token_ids == reference[0, len(prompt):].tolist()
        assert output.finish_reason == "length"


def test_residual_stream_form_matches_hf(family, checkpoint):
    """A fresh load refolded for ops that fuse block ops up to 8 rows: dense families run the
    stream form there (an MoE MLP keeps the norm kernels) and the other form, with the norms
    folded, above; both match HF on a whole sequence, one fed in pieces (8-token chunks and
    decode steps) and a mixed decode + prefill step."""
    path = checkpoint(family)
    hf, _ = _models(path)
    llm = LLM(path, block_size=16)
    model = llm.model
    assert not model.streamed
    model.ops = replace(model.ops, fused_block_rows=8)
    model.finish_loading()
    assert model.streamed == (family == "qwen3_5")
    assert all(not bool(layer.input_norm.any()) for layer in model.layers) == model.streamed
    assert model.stream_form(8) == model.streamed and not model.stream_form(9)
    tokens = random_tokens(70, seed=5)
    assert_close(llm.score(tokens), hf_logits(hf, tokens))
    stepper = ManualStepper(llm, 2, 80)
    stepper.new_sequence("a", 80)
    stepper.new_sequence("b", 80)
    pieces = [stepper.step([], [("a", tokens[:32], 0)])[0]]
    pieces += [stepper.step([], [("a", tokens[start:start + 8], start)])[0] for start in (32, 40)]
    for position in range(48, 52):
        logits = stepper.step([("a", tokens[position:position + 1], position)],
                              [("b", tokens[:6], 0)] if position == 49 else [])
        pieces.append(logits[0])
    assert_close(torch.cat(pieces), hf_logits(hf, tokens[:52]))


# One GDN layer of two value heads (one key head) and one attention layer: under the interpreter a
# prefill costs ~2 s per (chunk, value head) of each GDN layer.


@pytest.mark.slow
def test_triton_table_matches_hf(checkpoint, kernel_device):
    """Dense Qwen3.5 through the Triton table: a prefill; a decode row beside a prefill row in one
    step (the GDN kernels read the row groups' strided conv inputs and write their rows of one
    buffer each); then two decode rows together, then one."""
    gpu_shape = GPU_SHAPE if kernel_device == "cuda" else {}
    path = checkpoint("qwen3_5", **TRITON_TABLE_SHAPE, **gpu_shape)
    hf, _ = _models(path)
    llm = LLM(path, device=kernel_device, block_size=16, kernel_backend="triton", enable_cuda_graphs=False)
    assert llm.core.ops.name == "triton" and llm.model.streamed
    a, b = random_tokens(12, seed=11), random_tokens(13, seed=12)
    stepper = ManualStepper(llm, 2, 16)
    stepper.new_sequence("a", 16)
    stepper.new_sequence("b", 16)
    pieces_a = [stepper.step([], [("a", a[:9], 0)])[0]]
    logits = stepper.step([("a", a[9:10], 9)], [("b", b[:12], 0)])
    pieces_a.append(logits[0])
    pieces_b = [logits[1]]
    logits = stepper.step([("a", a[10:11], 10), ("b", b[12:13], 12)], [])
    pieces_a.append(logits[0])
    pieces_b.append(logits[1])
    pieces_a.append(stepper.step([("a", a[11:12], 11)], [])[0])
    assert_close(torch.cat(pieces_a).cpu(), hf_logits(hf, a))
    assert_close(torch.cat(pieces_b).cpu(), hf_logits(hf, b))
