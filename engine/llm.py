"""The embedded Python API: `LLM(model_path).generate(prompts, params)` and `LLM.score`.

Runs a list of prompts as one static batch: one mixed prefill step for all prompts, then
decode steps for the unfinished ones, each sequence in its own state slot and KV blocks.
Pools are sized for the call and released when it ends. Knows nothing about HTTP.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

import torch

from ..kernels import select_ops
from .allocators import BlockAllocator, SlotAllocator
from .batch import ForwardBatch, Row
from .config import ModelConfig
from .sampling_params import SamplingParams
from .sequence import Sequence
from .state_pool import KVPool, StatePool
from .tokenizer import Tokenizer
from .weights import load_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"


class LLM:
    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "float32",
                 kernel_backend: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 64,
                 block_size: int = 16) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        if max_num_seqs < 1 or block_size < 1:
            raise ValueError("max_num_seqs and block_size must be >= 1")
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.config = ModelConfig.from_file(model_path)
        self.tokenizer = Tokenizer.from_dir(model_path)
        self.ops = select_ops(self.device, kernel_backend)
        self.model = load_model(model_path, self.ops, self.dtype, self.device, self.config)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.max_num_seqs, self.block_size = max_num_seqs, block_size
        self._next_request = 0

    # Public API ------------------------------------------------------------------------------

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are strings or token-id lists (one prompt or a list); params one for all or
        one per prompt. Every prompt is validated before any work starts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        sequences = [self._new_sequence(p, sp) for p, sp in zip(prompts, params)]
        for start in range(0, len(sequences), self.max_num_seqs):
            self._run_static_batch(sequences[start:start + self.max_num_seqs])
        return [RequestOutput(s.request_id, s.prompt_token_ids, s.output_token_ids, s.text, s.finish_reason)
                for s in sequences]

    def score(self, token_ids: Seq[int]) -> torch.Tensor:
        """Logits at every position of one sequence: [T, vocab] float32 on the CPU."""
        return self.score_batch([token_ids])[0]

    @torch.inference_mode()
    def score_batch(self, sequences: Seq[Seq[int]]) -> list[torch.Tensor]:
        """`score` for several sequences of any lengths, run together as one varlen batch."""
        sequences = [self._validate_tokens(list(ids)) for ids in sequences]
        slots, blocks, states, kv = self._pools([len(ids) for ids in sequences])
        rows = [Row(ids, 0, slot, table, num_logits=len(ids)) for ids, slot, table in zip(sequences, slots, blocks)]
        batch = ForwardBatch.build([], rows, self.block_size, self.device)
        logits = self.model.compute_logits(self.model(batch, states, kv)[batch.logits_indices]).cpu()
        return list(logits.split([len(ids) for ids in sequences]))

    # Internals -------------------------------------------------------------------------------

    def _validate_tokens(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:8]}")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, the context limit is {self.max_model_len}")
        return token_ids

    def _new_sequence(self, prompt: str | Seq[int], params: SamplingParams) -> Sequence:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        token_ids = self._validate_tokens(token_ids)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens: no room to generate within the "
                             f"context limit {self.max_model_len}")
        request_id = str(self._next_request)
        self._next_request += 1
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return Sequence.create(request_id, token_ids, params, seed, self.max_model_len, self.tokenizer)

    def _pools(self, max_lengths: list[int]):
        """Slots and KV blocks for sequences of the given maximum lengths (slot 0 and block 0
        stay scratch)."""
        slot_allocator = SlotAllocator(len(max_lengths) + 1)
        block_counts = [-(-n // self.block_size) for n in max_lengths]
        block_allocator = BlockAllocator(sum(block_counts) + 1, self.block_size)
        slots = slot_allocator.allocate(len(max_lengths))
        blocks = [block_allocator.allocate(n) for n in block_counts]
        states = StatePool(self.config, slot_allocator.capacity, max_pending=1, dtype=self.dtype,
                           device=self.device)
        kv = KVPool(self.model.num_kv_layers, block_allocator.capacity, self.block_size,
                    self.config.num_key_value_heads, self.config.head_dim, self.dtype, self.device)
        return slots, blocks, states, kv

    @torch.inference_mode()
    def _run_static_batch(self, sequences: list[Sequence]) -> None:
        max_lengths = [min(len(s.prompt_token_ids) + s.params.max_tokens, self.max_model_len) for s in sequences]
        slots, blocks, states, kv = self._pools(max_lengths)
        rows = [Row(s.prompt_token_ids, 0, slot, table) for s, slot, table in zip(sequences, slots, blocks)]
        batch = ForwardBatch.build([], rows, self.block_size, self.device)
        running = list(zip(sequences, slots, blocks))
        while True:
            hidden = self.model(batch, states, kv)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            tokens = self._sample(logits, [s for s, _, _ in running]).tolist()
            for (seq, _, _), token in zip(running, tokens):
                seq.append(token)
            running = [r for r in running if not r[0].finished]
            if not running:
                return
            rows = [Row([s.last_token_id], s.num_tokens - 1, slot, table) for s, slot, table in running]
            batch = ForwardBatch.build(rows, [], self.block_size, self.device)

    def _sample(self, logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=logits.device)

        params = [s.params for s in sequences]
        return self.ops.sample(
            logits,
            column([p.temperature for p in params], torch.float32),
            column([p.top_k for p in params], torch.int64),
            column([p.top_p for p in params], torch.float32),
            column([p.min_p for p in params], torch.float32),
            column([s.seed for s in sequences], torch.int64),
            column([s.num_tokens for s in sequences], torch.int64),
        )[0]
