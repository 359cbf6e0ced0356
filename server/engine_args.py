"""The engine options every command shares (`serve`, `generate`, `bench serve`): their argparse
flags, the EngineConfig fields they set, and the same options as flags again for a server that
`bench serve` starts in another process. Each flag is its field's name with dashes, so nothing
a user passes is dropped on the way to the engine; vLLM's names for the same settings
(`--enforce-eager`, `--speculative-config`, `--disable-custom-all-reduce`) are taken too, and its
flags whose meaning already holds here, so a vLLM command line runs as it is; a vLLM value this
engine cannot honour (`--kv-cache-dtype fp8_e5m2`, a `--speculative-config` method other than MTP)
is a one-line error. Knows nothing about what a command does.
"""

from __future__ import annotations

import argparse
import json

from ..engine.engine_config import ALL_REDUCES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, SSM_CACHE_DTYPES
from ..engine.quantization import CHECKPOINT_OPTIONS
from ..engine.vllm_options import (draft_tokens, media_io_video_options, merge_video_options, mm_processor_options,
                                   translate)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="auto (default: a GPU when there is one, else the CPU), cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None,
                        help="auto (default: on a GPU the checkpoint's bfloat16 / float16, bfloat16 for a float32 "
                             "checkpoint; float32 on the CPU), float32, bfloat16 or float16")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="MTP drafts per step at most (default: 3 when the checkpoint has MTP weights, each "
                             "step's count chosen by the adaptive policy; 0: no speculation)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens a step computes at most, decode rows and prefill chunks together (default: "
                             "8192); long prompts are prefilled in chunks that fit")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="shard the model over this many devices (one process each; cuda:0..N-1)")
    parser.add_argument("--enable-expert-parallel", action="store_true", default=None,
                        help="MoE: place whole experts on ranks (experts / tp each) instead of splitting each")
    parser.add_argument("--all-reduce", choices=ALL_REDUCES, default=None,
                        help="tensor parallelism's all-reduces of decode steps: nccl (default): always NCCL; auto: "
                             "through symmetric memory over NVLink where it works, else NCCL, fused with the "
                             "residual add + RMSNorm after it; one_shot or two_shot: that symmetric-memory kernel, "
                             "the norm apart")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                        help="dummy: random weights of the config's shapes (benchmarks)")
    parser.add_argument("--generation-config", choices=("auto", "none"), default=None,
                        help="auto (default): sampling fields a request leaves unset take the checkpoint's "
                             "generation_config.json values; none: the built-in neutral ones")
    parser.add_argument("--quantization", "-q", choices=("fp8", *CHECKPOINT_OPTIONS), default=None,
                        help="fp8: quantize an unquantized checkpoint to block FP8 (128x128 weight blocks, as the "
                             "official FP8 checkpoints) while loading; a weight-only method (gptq, awq, "
                             "compressed-tensors, auto-round, vLLM's *_marlin names) is checked against the "
                             "checkpoint's own. Quantized checkpoints need no option")
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=None,
                        help="fcfs (default): requests in arrival order; priority: by each request's priority "
                             "(lower first), a request taking the place of running ones it outranks (vLLM's)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of the GPU's memory this engine may use, its weights and activations included "
                             "(vLLM's meaning: two engines at 0.45 share a GPU; default 0.9)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="run every step eagerly, no CUDA graphs (vLLM's flag)")
    parser.add_argument("--revision", default=None,
                        help="a Hugging Face Hub model's branch, tag or commit (default: main)")
    parser.add_argument("--download-dir", default=None,
                        help="the Hub cache to download a Hub model into and look it up in (default: HF_HOME's)")
    parser.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                        help="vLLM's form of --num-draft-tokens: '{\"method\": \"mtp\", \"num_speculative_tokens\": "
                             "N}' (method mtp or qwen3_next_mtp: the checkpoint's MTP layer drafts)")
    parser.add_argument("--mamba-ssm-cache-dtype", choices=SSM_CACHE_DTYPES, default=None,
                        help="the GDN recurrent state's dtype (vLLM's flag): auto (default) is float32, as the "
                             "checkpoints ask; bfloat16 halves its memory and the bytes a decode step moves for it, "
                             "for a rounding of the state after each token")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="the KV cache's dtype (vLLM's flag): auto (default) is the model's; fp8 / fp8_e4m3 keeps "
                             "keys and values in e4m3 with a scale of 1 (half of bf16's bytes: twice the context)")
    parser.add_argument("--image-min-pixels", type=int, default=None,
                        help="an image's pixels at least after resizing (default: preprocessor_config.json's)")
    parser.add_argument("--image-max-pixels", type=int, default=None,
                        help="an image's pixels at most after resizing, so its tokens at most (pixels / 1024 for "
                             "Qwen3.5; default: preprocessor_config.json's)")
    parser.add_argument("--mm-processor-kwargs", type=_mm_processor_kwargs, default=None, metavar="JSON",
                        help="the image and video processors' settings (vLLM's flag): an image's pixel bounds after "
                             "resizing, so its tokens: '{\"max_pixels\": 1003520}' (min_pixels, max_pixels, or size's "
                             "shortest_edge and longest_edge, which bound a video's pixels too); a video's frames: "
                             "fps, num_frames, do_sample_frames, min_frames, max_frames; a request's "
                             "mm_processor_kwargs overrides it for its images and videos")
    parser.add_argument("--media-io-kwargs", type=_media_io_kwargs, default=None, metavar="JSON",
                        help="vLLM's video loader settings: '{\"video\": {\"num_frames\": -1}}' (Qwen3.5's model "
                             "card: every frame to the processor, which samples by fps; what always happens here), "
                             "num_frames N: N frames spread evenly, fps F: F frames a second")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV-cache block (default: 16); must divide the checkpoint interval")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="vLLM's form of --all-reduce nccl (the default): NCCL for every all-reduce")
    # vLLM flags whose meaning holds here anyway, so vLLM command lines run unchanged.
    parser.add_argument("--distributed-executor-backend", choices=("mp",), default=None,
                        help="accepted for vLLM command lines: tensor-parallel ranks are processes on this host")
    parser.add_argument("--language-model-only", action="store_true", default=None,
                        help="load a vision-language checkpoint's language model alone, without its vision encoder: "
                             "requests with images are refused (vLLM's flag)")
    accept_vllm_flags(parser, {
        "--enable-chunked-prefill": "prompts are always prefilled in chunks of at most --max-num-batched-tokens"})


def accept_vllm_flags(parser: argparse.ArgumentParser, flags: dict[str, str]) -> None:
    """vLLM switches whose meaning already holds here, each with why (its help): taken so that a
    vLLM command line runs as it is, changing nothing."""
    for flag, why in flags.items():
        parser.add_argument(flag, action="store_true", help=f"accepted for vLLM command lines: {why}")


def _mm_processor_kwargs(text: str) -> tuple[dict[str, int], dict]:
    """vLLM's --mm-processor-kwargs (JSON) as (the image pixel bounds, the video options) it sets."""
    try:
        return mm_processor_options(json.loads(text))
    except ValueError as error:  # (json's errors are ValueErrors too)
        raise argparse.ArgumentTypeError(str(error).removeprefix("mm_processor_kwargs: ")) from None


def _media_io_kwargs(text: str) -> dict:
    """vLLM's --media-io-kwargs (JSON) as the video options it sets."""
    try:
        return media_io_video_options(json.loads(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("media_io_kwargs: ")) from None


def _speculative_config(text: str) -> int:
    """vLLM's --speculative-config (JSON) as the MTP drafts per step it asks for."""
    try:
        config = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    try:
        return draft_tokens(config)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("speculative_config: ")) from None


# The fields add_engine_options sets; a flag left out (None) keeps EngineConfig's default.
_FIELDS = ("device", "dtype", "num_draft_tokens", "max_num_batched_tokens", "tensor_parallel_size",
           "enable_expert_parallel", "all_reduce", "load_format", "generation_config", "quantization",
           "gpu_memory_utilization", "scheduling_policy", "revision", "download_dir", "block_size",
           "mamba_ssm_cache_dtype", "kv_cache_dtype", "language_model_only", "image_min_pixels",
           "image_max_pixels")


def engine_options(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments of the flags given (vLLM's names translated)."""
    options = {name: getattr(args, name) for name in _FIELDS if getattr(args, name) is not None}
    if args.speculative_config is not None:
        translate(options, "--speculative-config", "num_draft_tokens", args.speculative_config, _setting)
    pixels, video = args.mm_processor_kwargs or ({}, {})
    for name, value in pixels.items():
        translate(options, "--mm-processor-kwargs", f"image_{name}", value, _setting)
    video = merge_video_options(args.media_io_kwargs or {}, video)
    if video:
        translate(options, "--mm-processor-kwargs", "video_options", video, _setting)
    if args.disable_custom_all_reduce:
        translate(options, "--disable-custom-all-reduce", "all_reduce", "nccl", _setting)
    if args.enforce_eager:
        options["enable_cuda_graphs"] = False
    return options


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The same options as command-line flags (for `deltaspec serve` in another process)."""
    flags = []
    for name, value in engine_options(args).items():
        if name == "enable_cuda_graphs":
            flags.append("--enforce-eager")
            continue
        flags += [_flag(name)] if value is True else [_flag(name), str(value)]
    return flags


def _flag(name: str) -> str:
    """An EngineConfig field's flag."""
    return "--" + name.replace("_", "-")


def _setting(name: str, value) -> str:
    """A field's setting as its flag writes it (vllm_options.translate's messages)."""
    return f"{_flag(name)} {value}"
