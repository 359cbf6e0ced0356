"""Video preprocessing for Qwen3.5's vision encoder, as Hugging Face's `Qwen3VLVideoProcessor` does it.

`VideoProcessor.decode` reads an encoded video (mp4, mkv, webm, avi, ...) with PyAV and
`from_frames` takes decoded frames (vLLM's `multi_modal_data={"video": array}`). Both pick the
frames HF's `sample_frames` picks (fps frames a second of the video, between min_frames and
max_frames, or num_frames of them, spread evenly), resize them all to the one grid the video
`smart_resize` picks from the frame count and the frame size (the bounds are on the video's pixels,
all frames together), with the op HF's torchvision backend runs (torch's bicubic with antialias,
on uint8), and group them into temporal patches of temporal_patch_size frames, the last frame
repeated to fill the last patch. The result is a `VideoInput`: one `ImageInput` (uint8 RGB,
video=True) per temporal patch, and each patch's time in seconds (HF's `_calculate_timestamps`),
which the prompt writes before the patch's tokens. `patchify` turns a patch into the encoder's
input, HF's `pixel_values_videos` for it bit for bit: the video path normalises with the rescale
fused into the mean and std, `(x - 255 mean) / (255 std)` in float32, which is not bit for bit the
image path's `(x / 255 - mean) / std`. Each temporal patch is its own grid of t = 1 (Qwen3.5 splits
a video's grid per patch, so `grid_thw` is (1, h, w) and the patches' timestamps sit between them).

Decoding keeps only the sampled frames, each resized as it comes: a long video is never held
whole (ten minutes of 1080p is about 100 GB of frames). The frame count is the container's, else
a count of the stream's packets; a stream that ends early is sampled again from the frames it had.

Knows the video preprocessor's settings (a checkpoint's config.json and
video_preprocessor_config.json) and nothing else: not the encoder, the prompt's layout, nor the
engine. Where HF fails, this does not: a video of fewer than temporal_patch_size sampled frames
(HF's smart_resize refuses it) has its last frame repeated first. Pixels follow HF on the same
machine: torch's uint8 resize may round differently on another CPU (as HF's does). PyAV's
rgb24 conversion is HF's PyAV reader's; vLLM's OpenCV reader converts colours its own way. A
frame is turned as its display matrix says (`upright`: a phone's portrait video stands up), as
vLLM's OpenCV reader and FFmpeg's player show it; HF's PyAV reader leaves it as stored.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .image import ImageInput, VideoInput
from .prompt import expand_video_tokens
from .preprocess import (FIXED_SETTINGS, MAX_ASPECT_RATIO, MAX_DECODED_PIXELS, channels_field, checked_sizes,
                         int_field, is_int, is_real, normalisation_problems, one_line, read_json_object, to_rgb,
                         patchify)

# Qwen3.5's `<|video_pad|>`, `<|vision_start|>` and `<|vision_end|>`, for config.json files that
# do not name them.
QWEN3_5_VIDEO_TOKEN_ID = 248057
QWEN3_5_VISION_START_TOKEN_ID = 248053
QWEN3_5_VISION_END_TOKEN_ID = 248054

# The frame rate HF assumes for frames given without one (its warning's "Defaulting to fps=24"),
# for sampling by fps and for the timestamps.
DEFAULT_VIDEO_FPS = 24.0

# The most frames a video may have, declared or counted: bounds the packets counted and the
# frames decoded (two hours at 30 fps). Decoding runs through every frame up to the last sampled
# one, so a video's cost is its length, whatever is sampled.
MAX_VIDEO_FRAMES = 216_000

# The container formats decoded (FFmpeg's demuxer names): real video files only. Any other
# demuxer (playlists, image sequences, text rendered as video...) is refused before it reads a
# header, so nothing a file names is ever opened.
VIDEO_FORMATS = ("mov", "mp4", "m4v", "3gp", "matroska", "webm", "avi", "flv", "mpegts", "mpeg", "ogg", "asf",
                 "nut", "gif", "h264", "hevc", "ivf")

# video_preprocessor_config.json keys that must keep HF's default (None: unset, HF's default).
# cap_pixels_per_frame (HF's opt-in per-frame pixel cap) is not implemented: HF's default, off.
_VIDEO_FIXED_SETTINGS: dict[str, object] = {**FIXED_SETTINGS, "cap_pixels_per_frame": False}

# mm_processor_kwargs keys `with_options` takes (vLLM's, for Qwen3-VL's video processor).
OPTION_KEYS = ("fps", "num_frames", "do_sample_frames", "min_frames", "max_frames", "min_pixels", "max_pixels", "size")


@dataclass(frozen=True)
class VideoProcessorConfig:
    """The video preprocessor's settings; the defaults are Qwen3.5's (video_preprocessor_config.json).
    min_pixels and max_pixels (HF's size.shortest_edge / longest_edge) bound the resized video's
    pixels over all its frames. Frames are sampled at fps a second of video (clamped to
    [min_frames, max_frames]) or, with fps None, num_frames of them: exactly one of the two is set,
    as HF refuses both. do_sample_frames False takes every frame given."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 4096
    max_pixels: int = 25_165_824
    fps: float | None = 2.0
    num_frames: int | None = None
    do_sample_frames: bool = True
    min_frames: int = 4
    max_frames: int = 768
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        problems = []
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "min_frames",
                     "max_frames"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems:
            if self.min_pixels > self.max_pixels:
                problems.append(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
            if self.min_frames > self.max_frames:
                problems.append(f"min_frames {self.min_frames} exceeds max_frames {self.max_frames}")
        if self.fps is not None and (not is_real(self.fps) or self.fps <= 0):
            problems.append(f"fps must be a positive number, got {self.fps!r}")
        if self.num_frames is not None:
            if not is_int(self.num_frames) or self.num_frames <= 0:
                problems.append(f"num_frames must be a positive integer, got {self.num_frames!r}")
            elif is_int(self.max_frames) and self.num_frames > self.max_frames:
                problems.append(f"num_frames {self.num_frames} exceeds max_frames {self.max_frames}")
        if (self.fps is None) == (self.num_frames is None):
            problems.append(f"give exactly one of fps and num_frames, got fps {self.fps!r} and num_frames "
                            f"{self.num_frames!r}")
        if not isinstance(self.do_sample_frames, bool):
            problems.append(f"do_sample_frames must be a bool, got {self.do_sample_frames!r}")
        problems += normalisation_problems(self.image_mean, self.image_std)
        if problems:
            raise ValueError("invalid video processor config: " + "; ".join(problems))

    @property
    def factor(self) -> int:
        """What the resized height and width are multiples of: one merged token's side in pixels."""
        return self.patch_size * self.merge_size


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """HF's Qwen3-VL video target size (height, width): as the image smart_resize, but the bounds
    are on t * h * w, the frame count rounded to a multiple of temporal_factor times the rounded
    frame, and a frame smaller than factor is first scaled up (truncated) to it. num_frames must be
    >= temporal_factor (HF's rule; VideoProcessor pads short videos before). HF's float
    expressions, in its order."""
    if num_frames < temporal_factor:
        raise ValueError(f"a video of {num_frames} frames is shorter than a temporal patch of {temporal_factor}")
    if height <= 0 or width <= 0:
        raise ValueError(f"a video needs a positive frame size, got {width}x{height}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"video aspect ratio {max(height, width) / min(height, width):.1f} of {width}x{height} "
                         f"exceeds {MAX_ASPECT_RATIO}")
    # round() is Python's, half to even, as in HF.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB uint8 frames [N, H, W, 3] resized to [N, height, width, 3]: HF's torchvision resize of a
    uint8 CPU video with BICUBIC, which is torch's bicubic (a = -0.5, Pillow's) with antialias run
    natively on uint8 (no float round trip), on channels-first frames; the same size is returned
    as it is, as torchvision does. Each frame is resized on its own (the op is per frame)."""
    if frames.shape[1:3] == (height, width):
        return frames
    # torch wants writable memory (a read-only array, np.frombuffer's, is copied).
    frames = np.array(frames, copy=None if frames.flags.writeable else True)
    channels_first = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # [N, 3, H, W]
    resized = F.interpolate(channels_first, size=(height, width), mode="bicubic", align_corners=False,
                            antialias=True)
    return resized.permute(0, 2, 3, 1).numpy()  # [N, height, width, 3]


def timestamps(indices: Sequence[int], video_fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """HF's `_calculate_timestamps`: each temporal patch's time in seconds, the mean of its first and
    last frames' times (index / video_fps), the last index repeated to fill the last patch."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    seconds = [index / video_fps for index in indices]
    return tuple((seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
                 for i in range(0, len(seconds), temporal_patch_size))


@dataclass(frozen=True)
class VideoProcessor:
    """Qwen3.5's video preprocessing with `config`; `video_token_id` is the `<|video_pad|>` token the
    model replaces with a temporal patch's features (num_tokens of them per patch), between the
    vision start and end tokens (`expand`)."""

    config: VideoProcessorConfig = field(default_factory=VideoProcessorConfig)
    video_token_id: int = QWEN3_5_VIDEO_TOKEN_ID
    vision_start_token_id: int = QWEN3_5_VISION_START_TOKEN_ID
    vision_end_token_id: int = QWEN3_5_VISION_END_TOKEN_ID
    # [3, 256] float32: each channel's 256 levels normalised as HF normalises videos (patchify's
    # lookup table). HF fuses the rescale into the mean and std: mean and std as float32 tensors
    # times 1 / rescale_factor (in float32: 127.5 for 0.5), then (float32(x) - mean) / std.
    _levels: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, VideoProcessorConfig):
            raise TypeError(f"config must be a VideoProcessorConfig, got {type(self.config).__name__}")
        for name in ("video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        rescale_factor = FIXED_SETTINGS["rescale_factor"]
        mean = torch.tensor(self.config.image_mean, dtype=torch.float32) * (1.0 / rescale_factor)
        std = torch.tensor(self.config.image_std, dtype=torch.float32) * (1.0 / rescale_factor)
        levels = torch.arange(256, dtype=torch.float32)[None, :]
        object.__setattr__(self, "_levels", (levels - mean[:, None]) / std[:, None])

    @classmethod
    def from_model_dir(cls, path: str | Path) -> VideoProcessor | None:
        """The checkpoint's video preprocessor, None for a text-only checkpoint (config.json
        without vision_config). Its settings come, as HF looks for them, from processor_config.json's
        "video_processor" object, else video_preprocessor_config.json, else Qwen3.5's defaults
        (HF would fall back to preprocessor_config.json, the images' settings; Qwen3.5 ships the
        video file). Sizes must agree with vision_config; video_token_id is config.json's. Raises
        ValueError naming the file and the field for a malformed file."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"no config.json at {path}")
        raw = read_json_object(config_file)
        vision = raw.get("vision_config")
        if vision is None:
            return None
        if not isinstance(vision, dict):
            raise ValueError(f"{config_file}: vision_config must be an object, got {vision!r}")
        tokens = {name: raw.get(name, default) for name, default in (
            ("video_token_id", QWEN3_5_VIDEO_TOKEN_ID), ("vision_start_token_id", QWEN3_5_VISION_START_TOKEN_ID),
            ("vision_end_token_id", QWEN3_5_VISION_END_TOKEN_ID))}
        for name, value in tokens.items():
            if not is_int(value) or value < 0:
                raise ValueError(f"{config_file}: {name} must be a non-negative integer, got {value!r}")
        defaults = VideoProcessorConfig()
        source, pre = _video_settings(path)
        sizes, size = checked_sizes(vision, config_file, pre, source, _VIDEO_FIXED_SETTINGS, "videos", defaults)
        # HF's Qwen3-VL video processor reads size alone (top-level min_pixels / max_pixels are
        # not among its settings); null means HF's default, as for every key.
        num_frames = pre.get("num_frames")
        if num_frames is not None and pre.get("fps") is not None:
            raise ValueError(f"{source}: fps and num_frames are mutually exclusive (HF refuses both): give one")
        do_sample_frames = pre.get("do_sample_frames", defaults.do_sample_frames)
        if do_sample_frames is None:
            do_sample_frames = defaults.do_sample_frames
        if not isinstance(do_sample_frames, bool):
            raise ValueError(f"{source}: do_sample_frames must be true or false, got {do_sample_frames!r}")
        fps = pre.get("fps")
        if fps is not None and (not is_real(fps) or fps <= 0):
            raise ValueError(f"{source}: fps must be a positive number, got {fps!r}")
        try:
            config = VideoProcessorConfig(
                **sizes,
                min_pixels=int_field(size, "shortest_edge", defaults.min_pixels, source, "size."),
                max_pixels=int_field(size, "longest_edge", defaults.max_pixels, source, "size."),
                fps=None if num_frames is not None else float(fps if fps is not None else defaults.fps),
                num_frames=None if num_frames is None else int_field(pre, "num_frames", 1, source),
                do_sample_frames=do_sample_frames,
                min_frames=int_field(pre, "min_frames", defaults.min_frames, source),
                max_frames=int_field(pre, "max_frames", defaults.max_frames, source),
                image_mean=channels_field(pre, "image_mean", defaults.image_mean, source),
                image_std=channels_field(pre, "image_std", defaults.image_std, source),
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        return cls(config, **tokens)

    def with_options(self, **options: Any) -> VideoProcessor:
        """This processor with vLLM's mm_processor_kwargs for videos (OPTION_KEYS): fps or num_frames
        (one replaces the other; both at once is a ValueError, as in HF), do_sample_frames,
        min_frames, max_frames, and the pixel bounds over the video's frames: size's shortest_edge /
        longest_edge, or min_pixels / max_pixels, which win. A value None is not given. Raises
        ValueError naming the key for an unknown key or a bad value."""
        unknown = sorted(options.keys() - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"unsupported video options {unknown}: videos take {', '.join(OPTION_KEYS)}")
        options = {key: value for key, value in options.items() if value is not None}
        if "fps" in options and "num_frames" in options:
            raise ValueError("video options fps and num_frames are mutually exclusive: give one")
        changes: dict[str, Any] = {}
        if "fps" in options:
            if not is_real(options["fps"]) or options["fps"] <= 0:
                raise ValueError(f"video option fps must be a positive number, got {options['fps']!r}")
            changes.update(fps=float(options["fps"]), num_frames=None)
        if "do_sample_frames" in options:
            if not isinstance(options["do_sample_frames"], bool):
                raise ValueError(f"video option do_sample_frames must be a bool, got {options['do_sample_frames']!r}")
            changes["do_sample_frames"] = options["do_sample_frames"]
        size = options.get("size", {})
        if not isinstance(size, dict) or size.keys() - {"shortest_edge", "longest_edge"}:
            raise ValueError(f"video option size takes shortest_edge and longest_edge (pixels), got {size!r}")
        pixels = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
        pixels.update({key: options[key] for key in ("min_pixels", "max_pixels") if key in options})
        counts = {key: options[key] for key in ("num_frames", "min_frames", "max_frames") if key in options}
        for key, value in {**counts, **pixels}.items():
            if value is not None and (not is_int(value) or value <= 0):
                raise ValueError(f"video option {key} must be a positive integer, got {value!r}")
        if "num_frames" in counts:
            changes["fps"] = None
        changes.update(counts)
        changes.update({key: value for key, value in pixels.items() if value is not None})
        try:
            config = replace(self.config, **changes)
        except ValueError as e:
            raise ValueError(f"video options {sorted(options)}: {e}") from None
        return replace(self, config=config)

    def expand(self, token_ids: Sequence[int], videos: Sequence[VideoInput],
               text_ids: Callable[[str], list[int]]) -> list[int]:
        """The prompt with each video's placeholder expanded to its patches' times and tokens
        (prompt.expand_video_tokens with this checkpoint's token ids); text_ids tokenizes."""
        return expand_video_tokens(token_ids, videos, self.video_token_id, self.vision_start_token_id,
                                   self.vision_end_token_id, self.num_tokens, text_ids)

    def frame_indices(self, total_frames: int, video_fps: float | None) -> list[int]:
        """The frames to take of a video of total_frames (HF's Qwen3VLVideoProcessor.sample_frames):
        by fps, int(total / video_fps * fps) clamped to [min_frames, max_frames] and to total (a
        video_fps None is taken as DEFAULT_VIDEO_FPS, as HF does); else num_frames; spread over
        [0, total - 1] and rounded half to even (numpy's). With num_frames over total, frames repeat.
        Every frame when do_sample_frames is False."""
        c = self.config
        if total_frames <= 0:
            raise ValueError(f"a video needs at least one frame, got {total_frames}")
        if not c.do_sample_frames:
            return list(range(total_frames))
        if c.num_frames is not None:
            num_frames = c.num_frames
        else:
            video_fps = DEFAULT_VIDEO_FPS if video_fps is None else video_fps
            num_frames = int(total_frames / video_fps * c.fps)
            num_frames = min(max(num_frames, c.min_frames), c.max_frames, total_frames)
        return np.linspace(0, total_frames - 1, num_frames).round().astype(int).tolist()

    def decode(self, data: bytes) -> VideoInput:
        """An encoded video's sampled frames (PyAV: the first video stream, frames as rgb24),
        resized and grouped into temporal patches with their times. Raises ValueError (one line)
        for bytes PyAV cannot read, a container format not in VIDEO_FORMATS, no video stream or
        no frame, a frame over MAX_DECODED_PIXELS, frames changing size, or a video longer than
        MAX_VIDEO_FRAMES (or than max_frames when every frame is taken)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"a video must be bytes, got {type(data).__name__}")
        import av  # the engine imports without PyAV; only decoding needs it

        try:
            total_frames, video_fps = _probe(av, data)
            indices = self.frame_indices(total_frames, video_fps)
            self._check_frame_count(indices)
            frames = _SampledFrames(av, data, indices)
            taken = self._resized(frames, len(indices))
            if len(taken) < len(indices):
                # The stream ended before its declared (or counted) last frame: sample again from
                # the frames it had, HF's sampling over the true count (one more pass, whose
                # count is exact).
                total_frames = frames.decoded
                indices = self.frame_indices(total_frames, video_fps)
                again = _SampledFrames(av, data, indices)
                taken = self._resized(again, len(indices))
                if len(taken) < len(indices):
                    raise ValueError(f"the video's frame count changed between two decodings ({total_frames}, "
                                     f"then {again.decoded})")
        except av.FFmpegError as e:
            raise ValueError(f"not a video PyAV can read: {one_line(e)}") from None
        return self._patches(np.stack(taken), indices, video_fps)

    def from_frames(self, frames: np.ndarray | torch.Tensor | Sequence[np.ndarray | Image.Image],
                    fps: float | None = None, indices: Sequence[int] | None = None) -> VideoInput:
        """A decoded video: RGB uint8 frames [N, H, W, 3] (vLLM's video array or tensor) or a sequence of
        frames ([H, W, 3] uint8 arrays or PIL images, converted to RGB as images are). fps: the
        video's frame rate (DEFAULT_VIDEO_FPS, HF's assumption, when None). indices: the frames'
        indices in the source video when they are already sampled from it (vLLM's metadata
        frames_indices): taken as they are, for the timestamps. Without indices the frames are the
        whole video, sampled as `frame_indices` says."""
        if isinstance(frames, torch.Tensor):
            frames = frames.numpy(force=True)
        if isinstance(frames, np.ndarray):
            if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
                raise ValueError(f"a video's frames must be RGB uint8 [frames, height, width, 3], got "
                                 f"{frames.dtype} {list(frames.shape)}")
            video = frames
        elif isinstance(frames, (list, tuple)):
            video = [_frame_array(frame) for frame in frames]
        else:
            raise TypeError(f"a video's frames must be a uint8 array or a sequence of frames, got "
                            f"{type(frames).__name__}")
        if len(video) == 0 or 0 in video[0].shape:
            raise ValueError("a video needs at least one non-empty frame")
        if fps is not None and (not is_real(fps) or fps <= 0):
            raise ValueError(f"a video's fps must be a positive number, got {fps!r}")
        if indices is None:
            indices = self.frame_indices(len(video), fps)
            self._check_frame_count(indices)
            selected = [video[i] for i in indices]
        else:
            indices = list(indices)
            if len(indices) != len(video) or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                                     and i >= 0 for i in indices):
                raise ValueError(f"indices must be one non-negative integer per frame ({len(video)}), got "
                                 f"{len(indices)} values")
            indices = [int(i) for i in indices]  # numpy's integers too (vLLM's frames_indices may be an array)
            selected = list(video)
        resized = self._resized(selected, len(selected))
        return self._patches(np.stack(resized), indices, fps)

    def grid_thw(self, item: ImageInput) -> tuple[int, int, int]:
        """(temporal, height, width) in patches of one temporal patch: temporal 1 (Qwen3.5 encodes a
        video as one grid per temporal patch)."""
        c = self.config
        if not item.video or item.frames != c.temporal_patch_size:
            raise ValueError(f"not a video's temporal patch of {c.temporal_patch_size} frames "
                             f"(video {item.video}, {item.frames} frame(s))")
        if item.height <= 0 or item.width <= 0 or item.height % c.factor or item.width % c.factor:
            raise ValueError(f"a video patch of {item.width}x{item.height} is not on the encoder's grid: height "
                             f"and width must be positive multiples of {c.factor} (the processor makes them so)")
        return 1, item.height // c.patch_size, item.width // c.patch_size

    def num_tokens(self, item: ImageInput) -> int:
        """A temporal patch's `<|video_pad|>` tokens: one per merge_size x merge_size patches."""
        t, h, w = self.grid_thw(item)
        return t * h * w // self.config.merge_size ** 2

    def patchify(self, item: ImageInput, device: torch.device | str = "cpu") -> torch.Tensor:
        """The encoder's input for a temporal patch, HF's `pixel_values_videos` rows for it: float32
        [h*w, 3 * temporal_patch_size * patch_size**2] on `device` (preprocess.patchify, with the
        video normalisation's levels)."""
        self.grid_thw(item)
        c = self.config
        return patchify(item, self._levels, c.patch_size, c.merge_size, c.temporal_patch_size, device)

    def _check_frame_count(self, indices: list[int]) -> None:
        # Only without sampling can the count pass max_frames (num_frames is bounded by it).
        if len(indices) > self.config.max_frames:
            raise ValueError(f"a video of {len(indices)} frames taken whole exceeds max_frames "
                             f"{self.config.max_frames}: sample it (do_sample_frames)")

    def _resized(self, frames: Iterable[np.ndarray], num_frames: int) -> list[np.ndarray]:
        """The frames resized to the grid smart_resize picks for num_frames frames of the first
        one's size, one at a time (only the resized frames are kept). A video shorter than a
        temporal patch counts as one (its last frame is repeated: HF refuses such a video)."""
        c = self.config
        resized: list[np.ndarray] = []
        size = target = None
        for frame in frames:
            if size is None:
                size = frame.shape[:2]
                target = smart_resize(max(num_frames, c.temporal_patch_size), *size, c.temporal_patch_size, c.factor,
                                      c.min_pixels, c.max_pixels)
            elif frame.shape[:2] != size:
                raise ValueError(f"a video's frames must share one size: {size[1]}x{size[0]}, then "
                                 f"{frame.shape[1]}x{frame.shape[0]}")
            resized.append(resize_frames(frame[None], *target)[0])
        return resized

    def _patches(self, frames: np.ndarray, indices: list[int], video_fps: float | None) -> VideoInput:
        """[N, h, w, 3] resized frames as temporal patches, the last frame (and its index) repeated
        to fill the last one, as HF's patchify and _calculate_timestamps do."""
        t = self.config.temporal_patch_size
        if pad := -len(frames) % t:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        patches = tuple(ImageInput.of(frames[i:i + t], video=True) for i in range(0, len(frames), t))
        video_fps = DEFAULT_VIDEO_FPS if video_fps is None else video_fps
        return VideoInput(patches, timestamps(indices, video_fps, t))


class _SampledFrames:
    """The sampled frames of one sequential decoding, as rgb24 arrays, in index order (a frame
    sampled twice comes twice); `decoded` counts the frames decoded once the iteration ends."""

    def __init__(self, av: Any, data: bytes, indices: list[int]) -> None:
        self.av, self.data, self.wanted, self.decoded = av, data, Counter(indices), 0

    def __iter__(self) -> Iterator[np.ndarray]:
        last = max(self.wanted)
        with _open(self.av, self.data) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # frame threads: frames still come in order
            for index, frame in enumerate(container.decode(stream)):
                self.decoded = index + 1
                if index > last:
                    break
                if index not in self.wanted:
                    continue  # decoded (later frames need it), never converted
                if frame.width * frame.height > MAX_DECODED_PIXELS:
                    raise ValueError(f"video frame of {frame.width}x{frame.height} has more than "
                                     f"{MAX_DECODED_PIXELS} pixels")
                rgb = upright(frame.to_ndarray(format="rgb24"), frame.rotation)  # HF's PyAV reader's conversion
                for _ in range(self.wanted[index]):
                    yield rgb


def upright(frame: np.ndarray, rotation: int) -> np.ndarray:
    """A decoded frame [H, W, 3] as it is shown: turned counterclockwise by its display matrix's
    rotation (PyAV's VideoFrame.rotation, degrees), as FFmpeg's player and vLLM's OpenCV reader
    show a phone's portrait video; HF's PyAV reader leaves it sideways. A rotation that is not a
    multiple of 90 degrees is not applied (no container writes one)."""
    return np.ascontiguousarray(np.rot90(frame, k=rotation // 90)) if rotation % 90 == 0 and rotation % 360 else frame


def _open(av: Any, data: bytes) -> Any:
    """The container, refusing any demuxer outside VIDEO_FORMATS before its header is read and
    letting no demuxer open another resource (protocol_whitelist names none)."""
    options = {"format_whitelist": ",".join(VIDEO_FORMATS), "protocol_whitelist": "none"}
    try:
        container = av.open(io.BytesIO(bytes(data)), mode="r", container_options=options, metadata_errors="ignore")
    except av.FFmpegError as e:
        raise ValueError(f"not a video PyAV can read (formats read: {', '.join(VIDEO_FORMATS)}): "
                         f"{one_line(e)}") from None
    if not container.streams.video:
        name = container.format.name
        container.close()
        raise ValueError(f"no video stream in the {name} file")
    return container


def _probe(av: Any, data: bytes) -> tuple[int, float | None]:
    """(frames, frame rate) of the first video stream: the container's count, else its packets
    counted (no decoding); the average frame rate, None when the container gives none."""
    with _open(av, data) as container:
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > MAX_DECODED_PIXELS:
            raise ValueError(f"video frame of {width}x{height} has more than {MAX_DECODED_PIXELS} pixels")
        rate = stream.average_rate
        video_fps = float(rate) if rate else None
        total = stream.frames
        if total <= 0:
            # Matroska and WebM declare no count: one packet is one frame (the flush packet is empty).
            for packet in container.demux(stream):
                if packet.size:
                    total += 1
                    if total > MAX_VIDEO_FRAMES:
                        break
    if total > MAX_VIDEO_FRAMES:
        raise ValueError(f"a video of {total} frames is longer than {MAX_VIDEO_FRAMES} frames")
    if total <= 0:
        raise ValueError("the video has no frames")
    return total, video_fps


def _video_settings(path: Path) -> tuple[Path, dict]:
    """(the file, its video processor settings), in HF's order: processor_config.json's nested
    "video_processor", then video_preprocessor_config.json; no file: ({} from a file that is not)."""
    processor_file = path / "processor_config.json"
    if processor_file.is_file():
        nested = read_json_object(processor_file).get("video_processor")
        if nested is not None:
            if not isinstance(nested, dict):
                raise ValueError(f"{processor_file}: video_processor must be an object, got {nested!r}")
            return processor_file, nested
    video_file = path / "video_preprocessor_config.json"
    if video_file.is_file():
        return video_file, read_json_object(video_file)
    return video_file, {}


def _frame_array(frame: np.ndarray | Image.Image) -> np.ndarray:
    if isinstance(frame, Image.Image):
        if frame.width * frame.height > MAX_DECODED_PIXELS:
            raise ValueError(f"video frame of {frame.width}x{frame.height} has more than {MAX_DECODED_PIXELS} pixels")
        return np.asarray(to_rgb(frame))
    if isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[-1] == 3:
        return frame
    raise ValueError(f"a video frame must be a PIL image or RGB uint8 [height, width, 3], got "
                     f"{type(frame).__name__} {getattr(frame, 'dtype', '')} {list(getattr(frame, 'shape', []))}")
