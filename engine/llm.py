"""The synchronous Python API: `LLM(model_path).generate(prompts, params)` and `LLM.score`.

A thin wrapper that drives the same EngineCore as AsyncLLM until every submitted request is
done, so a list of prompts is continuously batched like concurrent requests. Knows nothing
about HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence as Seq

import torch

from .core import EngineCore
from .engine_config import EngineConfig
from .errors import NonFiniteLogitsError
from .prefix_cache import CheckpointHandle
from .request import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "float32", **engine_options) -> None:
        """engine_options: any other EngineConfig field (max_model_len, max_num_seqs, ...)."""
        self.core = EngineCore(EngineConfig(model=model_path, device=device, dtype=dtype, **engine_options))

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done when the LLM is collected or the
        interpreter exits); nothing to do on one device."""
        self.core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def config(self):
        return self.core.model_config

    @property
    def model(self):
        return self.core.model

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 resume_from: CheckpointHandle | None = None, n: int = 1) -> list[RequestOutput]:
        """Prompts are strings or token-id lists (one prompt or a list); params one for all or
        one per prompt. A bad prompt raises ValueError; the ones submitted before it are withdrawn.
        resume_from: a session saved by `save_checkpoint`; every prompt continues it (so several
        prompts fork one conversation). n: choices per prompt, its prompt prefilled once
        (SamplingParams.for_choices: choice i samples with seed + i); the outputs are choices
        0..n-1 of the first prompt, then of the next. A request whose logits turn non-finite
        fails alone: the others run to the end, then NonFiniteLogitsError names it (and holds
        every output)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        requests = []
        try:
            for prompt, p in zip(prompts, params):
                parent = None
                for choice in p.for_choices(n):
                    requests.append(self.core.add_request(prompt, choice, resume_from=resume_from, fork_of=parent))
                    parent = parent or requests[-1].request_id
        except ValueError:
            for request in requests:
                self.core.abort(request.request_id)
            while self.core.has_work:
                self.core.step()
            raise
        while self.core.has_work:
            self.core.step()
        outputs = [request.output() for request in requests]
        failed = [output.request_id for output in outputs if output.finish_reason == "error"]
        if failed:
            raise NonFiniteLogitsError(failed, outputs)
        return outputs

    def save_checkpoint(self, request_id: str) -> CheckpointHandle:
        """A handle on a finished request's state (its RequestOutput.request_id) that
        `generate(..., resume_from=handle)` continues without prefilling it again; it holds
        memory until `release_checkpoint`."""
        return self.core.save_checkpoint(request_id)

    def release_checkpoint(self, handle: CheckpointHandle) -> None:
        self.core.release_checkpoint(handle)

    @torch.inference_mode()
    def score(self, token_ids: Seq[int]) -> torch.Tensor:
        """Logits at every position of one sequence: [T, vocab] float32 on the CPU."""
        return self.score_batch([token_ids])[0]

    def score_batch(self, sequences: Seq[Seq[int]]) -> list[torch.Tensor]:
        """`score` for several sequences, run together as one varlen prefill in scratch pools of
        their own (the engine's pools and running requests are not touched)."""
        vocab_size = self.core.model_config.vocab_size
        sequences = [list(ids) for ids in sequences]
        for ids in sequences:
            if not ids or any(not 0 <= t < vocab_size for t in ids):
                raise ValueError("score needs non-empty token ids inside the vocabulary")
        return self.core.runner.score(sequences)
