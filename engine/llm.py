"""The synchronous Python API: `LLM(model).generate(prompts, sampling_params)`, `LLM.chat`,
`LLM.beam_search` and `LLM.score`, in vLLM's shape (its keyword arguments, prompt dicts,
`outputs`, `SamplingParams.n`), so a vLLM offline script runs as it is.

A thin wrapper that drives the same EngineCore as AsyncLLM until every submitted request is
done, so a list of prompts is continuously batched like concurrent requests. Knows nothing
about HTTP.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Sequence as Seq

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from .beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from .core import EngineCore
from .engine_config import EngineConfig
from .errors import NonFiniteLogitsError
from .prefix_cache import CheckpointHandle
from .request import RequestOutput
from .sampling_params import SamplingParams
from . import vllm_options
from .vision.fetch import fetch_limits, fetch_url, read_file_url
from .vision.image import ImageInput, VideoInput, data_url_bytes
from .vision.video import VideoProcessor


class LLM:
    def __init__(self, model: str | Path, device: str = "auto", dtype: str = "auto",
                 allowed_local_media_path: str | Path | None = None, **engine_options) -> None:
        """model: a checkpoint directory or a Hugging Face Hub repo id ("Qwen/Qwen3.5-0.8B",
        downloaded or found in the Hub cache; `revision` and `download_dir` pick the commit and
        the cache). device, dtype: "auto" is a GPU in the checkpoint's dtype when there is one, else
        the CPU in float32 (EngineConfig). engine_options: any other EngineConfig field
        (max_model_len, max_num_seqs, seed, ...), or vLLM's name for one (enforce_eager,
        enable_prefix_caching, speculative_config, ...: vllm_options.py), so vLLM's
        `LLM(model=..., ...)` runs as it is. allowed_local_media_path (vLLM's): the directory
        `chat`'s file: URLs may name media under (None: file: URLs are refused)."""
        self._local_media = None
        if allowed_local_media_path is not None:
            root = Path(allowed_local_media_path).expanduser().resolve()
            if not root.is_dir():
                raise ValueError(f"allowed_local_media_path {str(allowed_local_media_path)!r} is not a directory")
            self._local_media = str(root)
        self.core = EngineCore(EngineConfig(model=model, device=device, dtype=dtype,
                                            **vllm_options.engine_options(model, engine_options)))

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done when the LLM is collected or the
        interpreter exits); nothing to do on one device."""
        self.core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's name for the `tokenizer` property)."""
        return self.tokenizer

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def config(self):
        return self.core.model_config

    @property
    def model(self):
        return self.core.model

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 resume_from: CheckpointHandle | None = None, n: int = 1, use_tqdm: bool = True,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Prompts are strings, token-id lists or vLLM's prompt dicts ({"prompt": text} or
        {"prompt_token_ids": ids}, with {"multi_modal_data": {"image": images, "video": videos}}
        for a model that reads them: each named in the prompt by its image or video token, as a
        chat template writes it; and {"cache_salt": salt}: its prefixes shared in the prefix
        cache only with prompts of the same salt, SamplingParams.cache_salt), one or a list;
        params one for all or one per prompt. A bad prompt raises ValueError; the ones submitted
        before it are withdrawn.
        resume_from: a session saved by `save_checkpoint`; every prompt continues it (so several
        prompts fork one conversation). Choices, each prompt prefilled once and choice i sampling
        with seed + i (SamplingParams.for_choices; an unset seed from the engine's `seed`):
        SamplingParams.n (vLLM's) gives one output per prompt holding them in `outputs`; the n
        argument gives them as outputs of their own, choices 0..n-1 of the first prompt, then of the
        next. A request whose logits turn non-finite fails alone: the others run to the end, then
        NonFiniteLogitsError names it (and holds every output). use_tqdm: a progress bar of
        finished requests on stderr. priority (vLLM's): one per prompt, its SamplingParams.priority
        (the engine's scheduling_policy "priority" serves lower first)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts, prompts, images, videos, salts = zip(*map(_prompt, prompts)) if prompts else ((), (), (), (), ())
        images = [self._resize(given) for given in images]
        videos = [self._decode(given) for given in videos]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
            params = [dataclasses.replace(p, priority=rank) for p, rank in zip(params, priority)]
        params = [p if salt is None else dataclasses.replace(p, cache_salt=salt) for p, salt in zip(params, salts)]
        if n != 1 and any(p.n != 1 for p in params):
            raise ValueError("choices asked for twice: give SamplingParams.n or generate's n, not both")
        counts = [p.n if n == 1 else n for p in params]  # each prompt's choices
        requests = []
        try:
            for prompt, prompt_images, prompt_videos, p, count in zip(prompts, images, videos, params, counts):
                parent = None
                base_seed = self.core.draw_seed() if count > 1 and p.seed is None else None
                for choice in p.for_choices(count, base_seed):
                    requests.append(self.core.add_request(prompt, choice, resume_from=resume_from, fork_of=parent,
                                                          images=prompt_images, videos=prompt_videos))
                    parent = parent or requests[-1].request_id
        except ValueError:
            for request in requests:
                self.core.abort(request.request_id)
            while self.core.has_work:
                self.core.step()
            raise
        self._run(requests, use_tqdm)
        outputs = [request.output() for request in requests]
        failed = [output.request_id for output in outputs if output.finish_reason == "error"]
        if failed:
            raise NonFiniteLogitsError(failed, outputs)
        results, start = [], 0
        for text, p, count in zip(texts, params, counts):
            choices = outputs[start:start + count]
            start += count
            completions = [o.completion(i, self.tokenizer.decode_token) for i, o in enumerate(choices)]
            if p.n > 1:  # vLLM's shape: one output per prompt, its choices in `outputs`
                results.append(dataclasses.replace(choices[0], prompt=text, outputs=completions))
            else:
                results += [dataclasses.replace(o, prompt=text, outputs=[c]) for o, c in zip(choices, completions)]
        return results

    def chat(self, messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, n: int = 1,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """vLLM's LLM.chat: a conversation (a list of message dicts) or a list of them, each
        rendered by the chat template (Tokenizer.apply_chat_template: the messages as HF
        templates take them, tools and chat_template_kwargs such as {"enable_thinking": False}
        as template variables), then generated as `generate` does. The outputs' text is the
        model's raw text (reasoning and tool calls unparsed). Image parts, for a model that
        reads images: {"type": "image_url", "image_url": {"url": a data: or http(s) URL}}, {"type":
        "image_pil", "image_pil": a PIL image} or {"type": "image", "image": a PIL image or
        encoded bytes}; video parts: {"type": "video_url", "video_url": {"url": ...}} or
        {"type": "video", "video": what multi_modal_data's "video" takes}. http(s) URLs are
        fetched (vision/fetch.py: the server's time and size limits), file: URLs read under
        allowed_local_media_path; other URLs are refused."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            rendered, media = _chat_media(conversation, self._local_media)
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, tools=tools,
                                                      **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "multi_modal_data": media} if media else text)
        return self.generate(prompts, sampling_params, n=n, use_tqdm=use_tqdm)

    def _resize(self, images: list) -> list[ImageInput]:
        """A prompt's images (PIL images, RGB uint8 arrays [height, width, 3] as vLLM takes them,
        encoded bytes or ImageInputs) as the engine takes them."""
        if images and self.core.image_processor is None:
            raise ValueError(self.core.images_refused)
        return [image if isinstance(image, ImageInput) else self.core.image_processor.resize(_pil(image))
                for image in images]

    def _decode(self, videos: list) -> list[VideoInput]:
        """A prompt's videos as the engine takes them: encoded bytes (a video file), frames
        (an RGB uint8 array [frames, height, width, 3] or a list of PIL images, sampled here as
        from a decoded file at the fps its metadata says), (frames, metadata) with vLLM's
        metadata dict ({"fps": .., "frames_indices": [..]}: frames already sampled at those
        indices), or VideoInputs."""
        if videos and self.core.video_processor is None:
            raise ValueError(self.core.images_refused)
        return [_video(video, self.core.video_processor) for video in videos]

    def beam_search(self, prompts: Seq[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py) from each prompt: text, token ids or a prompt
        dict without multi_modal_data (its cache_salt applies to every step). Each step is a
        `generate` of every live beam; the prefix cache (on by default) makes a step a one-token
        prefill a beam. use_tqdm: a progress bar of the steps."""
        parsed = [_prompt(prompt) for prompt in prompts]
        if any(images or videos for _, _, images, videos, _ in parsed):
            raise ValueError("beam_search takes text or token-id prompts: multi_modal_data is not supported")
        token_ids = [self.tokenizer.encode(given) if isinstance(given, str) else list(given)
                     for _, given, _, _, _ in parsed]
        salts = [salt for *_, salt in parsed]

        def step(beams: list[tuple[int, list[int]]], step_params: SamplingParams) -> list[RequestOutput]:
            return self.generate([tokens for _, tokens in beams],
                                 [dataclasses.replace(step_params, cache_salt=salts[index]) for index, _ in beams],
                                 use_tqdm=False)

        with tqdm(total=params.max_tokens, desc="beam search", unit="step", disable=not use_tqdm) as bar:
            return beam_search(step, token_ids, params, frozenset(self.tokenizer.eos_token_ids),
                               self.core.max_model_len, lambda tokens: self.tokenizer.decode(tokens, False),
                               lambda: bar.update(1))

    def _run(self, requests: list, use_tqdm: bool) -> None:
        """Step until the engine is idle; the bar counts finished requests and generated tokens/s."""
        with tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm) as bar:
            start, shown, pending = time.monotonic(), 0.0, list(requests)
            while self.core.has_work:
                self.core.step()
                now = time.monotonic()
                if now - shown > 0.5 or not self.core.has_work:
                    finished = [r for r in pending if r.finished]
                    pending = [r for r in pending if not r.finished]
                    bar.update(len(finished))
                    tokens = sum(len(r.output_token_ids) for r in requests)
                    bar.set_postfix_str(f"{tokens / max(now - start, 1e-9):.0f} tok/s", refresh=False)
                    shown = now

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


Prompt = str | Seq[int] | dict[str, Any]

# The content part types LLM.chat reads an image or a video from (vLLM's offline chat takes these).
_IMAGE_PARTS = ("image_url", "image_pil", "image")
_VIDEO_PARTS = ("video_url", "video")


def _chat_media(conversation: Seq[dict[str, Any]],
                local_media: str | None) -> tuple[list[dict[str, Any]], dict[str, list]]:
    """The messages as the chat template takes them, each image part made {"type": "image"}
    and each video part {"type": "video"} (where Qwen3.5's template writes the placeholders),
    and multi_modal_data of the images and videos in order ({} when there are none).
    local_media: the directory file: URLs may read under (None: none)."""
    messages, media = [], {}
    for index, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in _IMAGE_PARTS + _VIDEO_PARTS
                                                    for p in content):
            messages.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _IMAGE_PARTS + _VIDEO_PARTS:
                parts.append(part)
                continue
            modality = "video" if kind in _VIDEO_PARTS else "image"
            media.setdefault(modality, []).append(_part_media(part, kind, modality, f"messages[{index}]",
                                                              local_media))
            parts.append({"type": modality})
        messages.append({**message, "content": parts})
    return messages, media


def _part_media(part: dict[str, Any], kind: str, modality: str, where: str, local_media: str | None):
    """An image or video part's media as given (a PIL image, frames, encoded bytes: a data:
    URL's decoded, an http(s) URL's fetched, a file: URL's read under local_media)."""
    value = part.get(kind)
    if not kind.endswith("_url"):
        if value is None:
            raise ValueError(f"{where}: a {kind!r} part needs its {modality} under {kind!r}")
        return value
    url = value.get("url") if isinstance(value, dict) else value
    scheme = url.partition(":")[0].lower() if isinstance(url, str) else None
    if scheme not in ("data", "http", "https", "file") or (scheme == "file" and local_media is None):
        raise ValueError(f"{where}: LLM.chat reads {kind} parts as data: or http(s) URLs, and file: URLs under "
                         f"LLM(allowed_local_media_path=...); got {str(url)[:64]!r}: pass the {modality} itself "
                         f"({{'type': '{modality}', '{modality}': ...}})")
    try:
        if scheme == "data":
            return data_url_bytes(url, modality)
        if scheme == "file":
            return read_file_url(url, local_media, fetch_limits(modality)[2], "allowed_local_media_path")
        return fetch_url(url, modality)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _pil(image: Any) -> Any:
    """An image given as an array, as a PIL image; anything else as it is (the processor checks)."""
    if not isinstance(image, np.ndarray):
        return image
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"an image array must be RGB uint8 [height, width, 3], got {image.dtype} {list(image.shape)}")
    return Image.fromarray(image)


def _video(video: Any, processor: VideoProcessor) -> VideoInput:
    """One of multi_modal_data's videos (LLM._decode's forms) as the engine takes it."""
    if isinstance(video, VideoInput):
        return video
    if isinstance(video, (bytes, bytearray, memoryview)):
        return processor.decode(bytes(video))
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict):
        frames, metadata = video
        unknown = sorted(metadata.keys() - {"fps", "frames_indices", "total_num_frames", "duration",
                                            "video_backend", "width", "height", "do_sample_frames"})
        if unknown:
            raise ValueError(f"video metadata takes fps, frames_indices and do_sample_frames; got unknown keys "
                             f"{unknown}")
        # vLLM's loaders say do_sample_frames when they hand over every frame: sample them here.
        indices = None if metadata.get("do_sample_frames") else metadata.get("frames_indices")
        return processor.from_frames(frames, fps=metadata.get("fps"), indices=indices)
    return processor.from_frames(video)


def _prompt(prompt: Prompt) -> tuple[str | None, str | Seq[int], list, list, str | None]:
    """(its text or None, what EngineCore.add_request takes, its images and its videos as given,
    its cache salt or None) of a prompt: text, token ids, or vLLM's prompt dicts, {"prompt":
    text} or {"prompt_token_ids": ids}, with {"multi_modal_data": {"image": an image or a list of
    them, "video": a video or a list of them}} and {"cache_salt": a string} beside it. Any other
    key or modality is refused by name."""
    if not isinstance(prompt, dict):
        return (prompt if isinstance(prompt, str) else None), prompt, [], [], None
    unknown = sorted(prompt.keys() - {"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"})
    if unknown or len(prompt.keys() & {"prompt", "prompt_token_ids"}) != 1:
        raise ValueError(f"a prompt dict holds one of 'prompt' (text) and 'prompt_token_ids', and optionally "
                         f"'multi_modal_data' and 'cache_salt'; got keys {sorted(prompt)}")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or data.keys() - {"image", "video"}:
        raise ValueError(f"multi_modal_data takes images and videos ({{'image': ..., 'video': ...}}); got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    # One video is an array of frames, a list of PIL images (its frames, as vLLM reads such a
    # list), a (frames, metadata) pair or bytes; any other list holds videos.
    videos = data.get("video", [])
    if not isinstance(videos, list) or (videos and all(isinstance(v, Image.Image) for v in videos)):
        videos = [videos]
    salt = prompt.get("cache_salt")
    if "prompt" in prompt:
        return prompt["prompt"], prompt["prompt"], images, videos, salt
    return None, prompt["prompt_token_ids"], images, videos, salt
