"""vLLM's names for this engine's settings, translated in one place: the keyword arguments of
`LLM(...)` (and `AsyncLLM(...)`) and the flags of `vllm serve` (server/engine_args.py) come here,
so a vLLM script or command line runs as it is. A setting whose meaning already holds here is
accepted; one this engine cannot honour is a ValueError of one line, never dropped. Knows
nothing about argparse or HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

# vLLM's speculative methods that name this engine's drafter (the checkpoint's MTP layer).
MTP_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")


def draft_tokens(speculative_config: Any) -> int:
    """vLLM's speculative_config ({"method": "mtp", "num_speculative_tokens": N}) as the MTP
    drafts a step it asks for."""
    if not isinstance(speculative_config, dict):
        raise ValueError("speculative_config must be a JSON object / dict")
    unknown = sorted(speculative_config.keys() - {"method", "num_speculative_tokens"})
    if unknown:
        raise ValueError(f"speculative_config: unsupported keys {unknown}: this engine drafts with the checkpoint's "
                         f"MTP layer; only method and num_speculative_tokens apply")
    method = speculative_config.get("method", "mtp")
    if method not in MTP_METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not supported: the drafter is the checkpoint's "
                         f"MTP layer ({', '.join(MTP_METHODS)})")
    tokens = speculative_config.get("num_speculative_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError("speculative_config: num_speculative_tokens must be an int >= 0")
    return tokens


# mm_processor_kwargs keys that concern videos alone (HF's Qwen3VLVideoProcessor's): checked by
# VideoProcessor.with_options. `size` bounds both images' and videos' pixels, as in HF.
VIDEO_KEYS = ("fps", "num_frames", "do_sample_frames", "min_frames", "max_frames")


def mm_processor_options(mm_processor_kwargs: Any) -> tuple[dict[str, int], dict[str, Any]]:
    """vLLM's mm_processor_kwargs for Qwen's processors as (the image processor's pixel bounds
    {"min_pixels": .., "max_pixels": ..}, the given ones; the video processor's options). Image
    bounds: {"min_pixels", "max_pixels"} or Qwen3-VL's {"size": {"shortest_edge", "longest_edge"}},
    an image's pixels after resizing, so its tokens. Video: VIDEO_KEYS, and size (a video's pixels
    over all its frames). Another key is a ValueError naming it."""
    if not isinstance(mm_processor_kwargs, dict):
        raise ValueError("mm_processor_kwargs must be a JSON object / dict")
    kwargs = dict(mm_processor_kwargs)
    size = kwargs.pop("size", None) or {}
    if not isinstance(size, dict) or size.keys() - {"shortest_edge", "longest_edge"}:
        raise ValueError(f"mm_processor_kwargs: size takes shortest_edge and longest_edge (pixels), got {size!r}")
    unknown = sorted(kwargs.keys() - {"min_pixels", "max_pixels", *VIDEO_KEYS})
    if unknown:
        raise ValueError(f"mm_processor_kwargs: unsupported keys {unknown}: images take min_pixels and max_pixels "
                         f"(or size's shortest_edge and longest_edge), videos {', '.join(VIDEO_KEYS)} and size")
    pixels = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
    pixels.update({name: kwargs[name] for name in ("min_pixels", "max_pixels") if kwargs.get(name) is not None})
    for name, value in pixels.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"mm_processor_kwargs: {name} must be a positive int, got {value!r}")
    video = {name: kwargs[name] for name in VIDEO_KEYS if kwargs.get(name) is not None}
    if size:
        video["size"] = size
    return {name: value for name, value in pixels.items() if value is not None}, video


def merge_video_options(media_io: dict[str, Any], mm_processor: dict[str, Any]) -> dict[str, Any]:
    """The video options media_io_kwargs and mm_processor_kwargs set together; a key both set
    differently is a ValueError naming it."""
    clash = sorted(k for k in media_io.keys() & mm_processor.keys() if media_io[k] != mm_processor[k])
    if clash:
        raise ValueError(f"media_io_kwargs and mm_processor_kwargs set the video's {clash} differently: give one")
    return {**media_io, **mm_processor}


def media_io_video_options(media_io_kwargs: Any) -> dict[str, Any]:
    """vLLM's media_io_kwargs (its media loaders' settings: `--media-io-kwargs '{"video":
    {"num_frames": -1}}'`, as Qwen3.5's model card serves) as the video processor's options.
    vLLM's video loader keeps num_frames frames spread evenly, or with -1 every frame for the
    processor to sample by fps; here the processor samples the decoded stream itself, so -1 is
    what always happens, num_frames N is the processor's num_frames and fps F (-1: unset) its
    fps. Another key or modality is a ValueError naming it."""
    if not isinstance(media_io_kwargs, dict):
        raise ValueError("media_io_kwargs must be a JSON object / dict")
    unknown = sorted(media_io_kwargs.keys() - {"video"})
    video = media_io_kwargs.get("video", {})
    if unknown or not isinstance(video, dict) or video.keys() - {"num_frames", "fps"}:
        raise ValueError(f"media_io_kwargs takes {{'video': {{'num_frames': .., 'fps': ..}}}}; got "
                         f"{media_io_kwargs!r}")
    options = {}
    for name, value in video.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value == -1 or value > 0):
            raise ValueError(f"media_io_kwargs: video {name} must be -1 (unset) or positive, got {value!r}")
        if value != -1:
            options[name] = value
    return options


def engine_options(model: str | Path, options: dict[str, Any]) -> dict[str, Any]:
    """`LLM(model, **options)`'s keyword arguments as EngineConfig fields. vLLM's enforce_eager,
    enable_prefix_caching, speculative_config, mm_processor_kwargs and media_io_kwargs are
    translated; trust_remote_code (no remote code ever runs: the model classes are the engine's)
    and tokenizer naming the model itself are accepted; every other name must be an EngineConfig
    field (kv_cache_dtype, seed, ... are)."""
    options = dict(options)
    if "enforce_eager" in options:
        translate(options, "enforce_eager", "enable_cuda_graphs", not options.pop("enforce_eager"))
    if "enable_prefix_caching" in options:
        translate(options, "enable_prefix_caching", "enable_prefix_cache", bool(options.pop("enable_prefix_caching")))
    if options.get("speculative_config") is not None:
        translate(options, "speculative_config", "num_draft_tokens", draft_tokens(options.pop("speculative_config")))
    options.pop("speculative_config", None)
    pixels, video = mm_processor_options(options.pop("mm_processor_kwargs", None) or {})
    for name, value in pixels.items():
        translate(options, "mm_processor_kwargs", f"image_{name}", value)
    video = merge_video_options(media_io_video_options(options.pop("media_io_kwargs", None) or {}), video)
    if video:
        translate(options, "mm_processor_kwargs", "video_options", video)
    options.pop("trust_remote_code", None)
    tokenizer = options.pop("tokenizer", None)
    if tokenizer is not None and str(tokenizer) != str(model):
        raise ValueError(f"tokenizer {str(tokenizer)!r}: the tokenizer is the model's own ({str(model)!r}); another "
                         f"one is not supported")
    return options


def translate(options: dict[str, Any], vllm_name: str, name: str, value: Any,
              spell: Callable[[str, Any], str] = lambda name, value: f"{name}={value!r}") -> None:
    """options[name] = value, what vLLM's setting vllm_name means, unless the field itself asks
    for another: a ValueError naming both as `spell` writes a setting (a keyword argument; the
    server's flags spell their own)."""
    if options.get(name, value) != value:
        raise ValueError(f"{vllm_name} means {spell(name, value)}, but {spell(name, options[name])} is given: "
                         f"give one")
    options[name] = value
