"""Engine settings: one frozen, validated object built once at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any
from pathlib import Path

import torch

from ..kernels.gdn_chunked import CHUNK_SIZE
from .quantization import CHECKPOINT_OPTIONS, ONLINE_METHODS
from .vllm_options import VIDEO_KEYS

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
ALL_REDUCES = ("auto", "nccl", "one_shot", "two_shot")  # tensor_parallel.TensorParallel.use_symmetric_memory
SCHEDULING_POLICIES = ("fcfs", "priority")  # scheduler.py
SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")  # the recurrent state's (the GDN kernels take these two)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")         # vLLM's names for an e4m3 KV pool
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)


@dataclass(frozen=True)
class EngineConfig:
    model: str | Path
    # "auto" (vLLM's default): a GPU when there is one (DELTASPEC_DEVICE overrides), else the CPU;
    # on a GPU the checkpoint's bfloat16 / float16, a float32 checkpoint in bfloat16; float32 on
    # the CPU. `concrete` says which.
    device: str = "auto"
    dtype: str = "auto"
    kernel_backend: str = "auto"
    max_model_len: int | None = None        # default: the model's max_position_embeddings
    max_num_seqs: int = 64                  # running requests at most
    # "fcfs": requests in arrival order; "priority": by SamplingParams.priority (lower first), then
    # arrival, a waiting request taking the place of running ones it outranks (vLLM's policies).
    scheduling_policy: str = "fcfs"
    # Tokens a step computes at most; long prompts are chunked to fit. A step that prefills runs
    # eagerly, at a host cost nearly independent of its tokens: admitting more prompts per such
    # step means fewer of them (vLLM and SGLang: 8192; bench/results/step_trace_batched_tokens).
    max_num_batched_tokens: int = 8192
    block_size: int = 16                    # tokens per KV block
    gpu_memory_utilization: float = 0.9     # share of the GPU's memory for the engine, weights included (vLLM's)
    cpu_memory_bytes: int = 1 << 30         # pool budget on the CPU
    num_kv_blocks: int | None = None        # override the KV pool size (tests, preemption)
    enable_cuda_graphs: bool = True         # decode steps replay captured graphs (CUDA + Triton only)
    enable_prefill_graphs: bool = True      # so do prefill forwards where that pays (needs enable_cuda_graphs)
    async_scheduling: bool = True           # plain decoding launches step n+1 before step n's tokens arrive
    num_draft_tokens: int | None = None     # MTP drafts a step at most (0: off; None: 3 with MTP weights)
    adaptive_draft_length: bool = True      # each step's drafts from measured step costs and acceptance
    draft_vocab_size: int = 0               # >0: drafts from the N most frequent tokens (draft_vocab.json)
    enable_prefix_cache: bool = True        # restore cached prompt prefixes (recurrent checkpoints + KV)
    checkpoint_interval: int = 512          # tokens between the prefix checkpoints a prefill leaves
    num_checkpoint_slots: int | None = None  # state slots for checkpoints (default: 10% of the pool budget)
    # The GDN recurrent state's dtype (vLLM's --mamba-ssm-cache-dtype). "auto": float32, what the
    # Qwen3.5 / Qwen3-Next configs ask (`mamba_ssm_dtype`). "bfloat16" (SGLang's --mamba-ssm-dtype
    # bfloat16) halves the state's memory and what a decode step moves for it (most of a step's
    # bytes at large batches), the math staying float32, for a rounding of the state each step.
    mamba_ssm_cache_dtype: str = "auto"
    # The KV pool's dtype (vLLM's --kv-cache-dtype). "auto": the model's. "fp8" / "fp8_e4m3": e4m3
    # with a scale of 1, as vLLM's without calibrated scales (keys and values past 448 saturate):
    # half a bf16 pool's bytes a token, so twice the context fits, and attention reads half.
    kv_cache_dtype: str = "auto"
    # The seed requests that set none draw theirs from (vLLM's `seed`): the same requests in the
    # same order then sample the same tokens run after run. None: from the OS's entropy.
    seed: int | None = None
    host_cache_bytes: int = 0               # host tier: pinned CPU memory evicted checkpoints move to
    warm_up: bool = True                    # CUDA: compile and autotune the eager steps' kernels at start-up
    generation_config: str = "auto"         # unset sampling fields from generation_config.json ("none": off)
    # "fp8": quantize an unquantized checkpoint to block FP8 at load; a weight-only method's name
    # (gptq, awq, compressed-tensors, auto-round; vLLM's *_marlin too): checked against the checkpoint
    quantization: str | None = None
    tensor_parallel_size: int = 1           # ranks the model is sharded over (one process and device each)
    enable_expert_parallel: bool = False    # MoE: whole experts per rank (experts / tp each) instead of split
    load_format: str = "auto"               # "dummy": random weights of the config's shapes (benchmarks)
    # vLLM's --language-model-only: a vision-language checkpoint's vision encoder is not loaded
    # (its memory goes to the pools) and prompts with images are refused.
    language_model_only: bool = False
    # Bounds on an image's pixels after resizing, so on its tokens (vLLM's mm_processor_kwargs
    # min_pixels / max_pixels); None: the checkpoint's preprocessor_config.json.
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    # The video processor's options (vLLM's mm_processor_kwargs keys for videos: fps, num_frames,
    # do_sample_frames, min_frames, max_frames, size; VideoProcessor.with_options checks their
    # values when the engine starts); None: the checkpoint's video_preprocessor_config.json.
    video_options: dict[str, Any] | None = None
    # `model` a Hugging Face Hub repo id (model_source.py): the branch, tag or commit to load, and
    # the cache directory in place of HF_HOME's.
    revision: str | None = None
    download_dir: str | None = None
    # Small all-reduces (decode steps): "nccl" always NCCL (the default until the symmetric path
    # has run on GPUs); "auto" through symmetric memory where it works on CUDA, else NCCL, each
    # block output's all-reduce fused with the residual add + RMSNorm after it (one kernel);
    # "one_shot" / "two_shot": that symmetric-memory kernel of torch's, the norm apart.
    all_reduce: str = "nccl"

    def __post_init__(self) -> None:
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append("max_model_len must be >= 2")
        if self.max_num_seqs < 1:
            problems.append("max_num_seqs must be >= 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            problems.append(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                            f"got {self.scheduling_policy!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            problems.append("max_num_batched_tokens must be >= max_num_seqs")
        if self.block_size < 1:
            problems.append("block_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append("gpu_memory_utilization must be in (0, 1]")
        if self.num_draft_tokens is not None and not 0 <= self.num_draft_tokens <= 8:
            problems.append("num_draft_tokens must be in 0..8")
        if self.draft_vocab_size < 0:
            problems.append("draft_vocab_size must be >= 0 (0: the full vocabulary)")
        if self.checkpoint_interval < 1 or self.checkpoint_interval % self.block_size \
                or self.checkpoint_interval % CHUNK_SIZE:
            problems.append(f"checkpoint_interval must be a positive multiple of block_size and of the GDN chunk "
                            f"size {CHUNK_SIZE}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.mamba_ssm_cache_dtype not in SSM_CACHE_DTYPES:
            problems.append(f"mamba_ssm_cache_dtype must be one of {', '.join(SSM_CACHE_DTYPES)}, "
                            f"got {self.mamba_ssm_cache_dtype!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            problems.append(f"seed must be an int or None, got {self.seed!r}")
        if self.num_checkpoint_slots is not None and self.num_checkpoint_slots < 0:
            problems.append("num_checkpoint_slots must be >= 0")
        if self.host_cache_bytes < 0:
            problems.append("host_cache_bytes must be >= 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            problems.append("num_kv_blocks must be >= 2 (block 0 is scratch)")
        if self.generation_config not in ("auto", "none"):
            problems.append(f"generation_config must be 'auto' or 'none', got {self.generation_config!r}")
        if self.quantization not in (None, *ONLINE_METHODS, *CHECKPOINT_OPTIONS):
            problems.append(f"quantization must be 'fp8' (online block FP8), the checkpoint's weight-only method "
                            f"({', '.join(CHECKPOINT_OPTIONS)}) or None, got {self.quantization!r}")
        if self.video_options is not None and (not isinstance(self.video_options, dict)
                                               or self.video_options.keys() - {*VIDEO_KEYS, "size"}):
            problems.append(f"video_options must be a dict of {', '.join(VIDEO_KEYS)} and size, "
                            f"got {self.video_options!r}")
        for name in ("image_min_pixels", "image_max_pixels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                problems.append(f"{name} must be a positive int or None, got {value!r}")
        if self.tensor_parallel_size < 1:
            problems.append("tensor_parallel_size must be >= 1")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            problems.append("enable_expert_parallel needs tensor_parallel_size > 1")
        if self.load_format not in LOAD_FORMATS:
            problems.append(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.all_reduce not in ALL_REDUCES:
            problems.append(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {self.all_reduce!r}")
        elif self.all_reduce != "nccl" and self.tensor_parallel_size == 1:
            problems.append(f"all_reduce={self.all_reduce!r} needs tensor_parallel_size > 1")
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    def concrete(self, checkpoint_dtype: str | None) -> EngineConfig:
        """This config with device and dtype "auto" made what they mean on this machine for a
        checkpoint stored in checkpoint_dtype (its config.json's; None: unknown)."""
        device = concrete_device(self.device)
        dtype = self.dtype
        if dtype == "auto":
            if torch.device(device).type == "cpu":
                dtype = "float32"
            else:
                dtype = checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"
        return replace(self, device=device, dtype=dtype)


def concrete_device(device: str) -> str:
    """"auto": DELTASPEC_DEVICE when set, else cuda when a GPU is visible, else cpu; any other
    device as it is."""
    if device != "auto":
        return device
    return os.environ.get("DELTASPEC_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
