"""Image preprocessing for Qwen3.5's vision encoder, bit-exact with Hugging Face's PIL processor.

`ImageProcessor.resize` decodes an image (encoded bytes or a PIL image), converts it to RGB,
and resizes it with Pillow's bicubic filter to the grid `smart_resize` picks: both sides
multiples of patch_size * merge_size, the area within [min_pixels, max_pixels]. The result is
an `ImageInput` (uint8 RGB), what a request carries to the engine. `patchify` turns that into
the encoder's input: float32 [patches, 3 * temporal_patch_size * patch_size**2], equal bit for
bit to the `pixel_values` of transformers' `Qwen2VLImageProcessorPil` (rescale by 1/255 in
float64, cast to float32, normalise in float32, one frame repeated temporal_patch_size times,
patches ordered in merge_size x merge_size blocks). `num_tokens` and `grid_thw` say how many
`<|image_pad|>` tokens the image takes and the grid the encoder's rotary positions follow.

Knows the preprocessor's settings (from a checkpoint's config.json and preprocessor_config.json)
and nothing else: not the encoder's weights, the prompt's layout, nor the engine's scheduling.
EXIF orientation is not applied: HF's processor does not apply it to the images it is given.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .image import ImageInput

# Pillow's own refusal threshold (2 * Image.MAX_IMAGE_PIXELS by default), fixed here so that a
# process changing Pillow's global cannot lift it. Checked on the header's size, before
# decoding: a bomb costs nothing. An image just under it still takes a few GB to decode and
# convert (RGBA: 4 bytes a pixel, a copy per step of the alpha compositing).
MAX_DECODED_PIXELS = 178_956_970

# HF's smart_resize refuses images longer than this many times their width (or vice versa).
MAX_ASPECT_RATIO = 200

# Qwen3.5's `<|image_pad|>`, for config.json files that do not name it.
QWEN3_5_IMAGE_TOKEN_ID = 248056

# preprocessor_config.json keys whose only supported value is HF's default for Qwen (None: the
# key is present but unset, which HF also reads as its default). resample 3 is PIL's BICUBIC.
FIXED_SETTINGS: dict[str, object] = {
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "rescale_factor": 1 / 255, "resample": int(Image.Resampling.BICUBIC),
}


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The preprocessor's settings; the defaults are Qwen3.5's."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        problems = []
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.min_pixels > self.max_pixels:
            problems.append(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
        problems += normalisation_problems(self.image_mean, self.image_std)
        if problems:
            raise ValueError("invalid image processor config: " + "; ".join(problems))

    @property
    def factor(self) -> int:
        """What the resized height and width are multiples of: one merged token's side in pixels."""
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """HF's Qwen2-VL target size (height, width): each side rounded to a multiple of factor, then
    scaled (aspect ratio kept) into [min_pixels, max_pixels] when the rounded area falls out of
    it. The float expressions keep HF's operation order so the floors and ceilings agree."""
    if height <= 0 or width <= 0:
        raise ValueError(f"an image needs a positive size, got {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.1f} of {width}x{height} "
                         f"exceeds {MAX_ASPECT_RATIO}")
    # round() is Python's, half to even, as in HF.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageProcessor:
    """Qwen3.5's image preprocessing with `config`; `image_token_id` is the `<|image_pad|>` token
    the model replaces with the image's features (num_tokens of them per image)."""

    config: ImageProcessorConfig = field(default_factory=ImageProcessorConfig)
    image_token_id: int = QWEN3_5_IMAGE_TOKEN_ID
    # [3, 256] float32: the normalised value of each channel's 256 levels. HF's rescale and
    # normalise are elementwise, so looking the pixels up gives its result bit for bit without
    # the float64 temporary HF's rescale makes (8 bytes a subpixel).
    _levels: torch.Tensor = field(init=False, repr=False, compare=False)  # [3, 256] float32

    def __post_init__(self) -> None:
        if not isinstance(self.config, ImageProcessorConfig):
            raise TypeError(f"config must be an ImageProcessorConfig, got {type(self.config).__name__}")
        if not is_int(self.image_token_id) or self.image_token_id < 0:
            raise ValueError(f"image_token_id must be a non-negative integer, got {self.image_token_id!r}")
        # HF: rescale = (uint8 as float64 * (1/255)) cast to float32; normalise = (x - mean) / std
        # with mean and std as float32 arrays, in float32.
        rescaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
        mean = np.array(self.config.image_mean, dtype=np.float32)[:, None]
        std = np.array(self.config.image_std, dtype=np.float32)[:, None]
        object.__setattr__(self, "_levels", torch.from_numpy((rescaled[None, :] - mean) / std))

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ImageProcessor | None:
        """The checkpoint's preprocessor, None for a text-only checkpoint (config.json without
        vision_config). preprocessor_config.json, when present, sets the pixel bounds (`size`'s
        shortest_edge / longest_edge, or the older min_pixels / max_pixels, which win as in HF),
        means, stds and patch sizes; what it lacks comes from vision_config, then Qwen3.5's
        defaults. Raises ValueError naming the file and the field for a malformed file."""
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
        image_token_id = raw.get("image_token_id", QWEN3_5_IMAGE_TOKEN_ID)
        if not is_int(image_token_id) or image_token_id < 0:
            raise ValueError(f"{config_file}: image_token_id must be a non-negative integer, got {image_token_id!r}")
        defaults = ImageProcessorConfig()
        preprocessor_file = path / "preprocessor_config.json"
        pre = read_json_object(preprocessor_file) if preprocessor_file.is_file() else {}
        sizes, size = checked_sizes(vision, config_file, pre, preprocessor_file, FIXED_SETTINGS, "images", defaults)
        min_pixels = int_field(size, "shortest_edge", defaults.min_pixels, preprocessor_file, "size.")
        max_pixels = int_field(size, "longest_edge", defaults.max_pixels, preprocessor_file, "size.")
        try:
            config = ImageProcessorConfig(
                **sizes,
                min_pixels=int_field(pre, "min_pixels", min_pixels, preprocessor_file),
                max_pixels=int_field(pre, "max_pixels", max_pixels, preprocessor_file),
                image_mean=channels_field(pre, "image_mean", defaults.image_mean, preprocessor_file),
                image_std=channels_field(pre, "image_std", defaults.image_std, preprocessor_file),
            )
        except ValueError as e:
            raise ValueError(f"{preprocessor_file}: {e}") from None
        return cls(config, image_token_id)

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> ImageProcessor:
        """This processor with other pixel bounds (vLLM's mm_processor_kwargs min/max_pixels)."""
        config = replace(self.config,
                         min_pixels=self.config.min_pixels if min_pixels is None else min_pixels,
                         max_pixels=self.config.max_pixels if max_pixels is None else max_pixels)
        return ImageProcessor(config, self.image_token_id)

    def resize(self, image: bytes | Image.Image) -> ImageInput:
        """An encoded image (PNG, JPEG, WebP, GIF's first frame, BMP... whatever Pillow reads) or
        a PIL image, as RGB resized to the encoder's grid. Raises ValueError for bytes Pillow
        cannot read, an image over MAX_DECODED_PIXELS, or an aspect ratio over 200."""
        if isinstance(image, (bytes, bytearray, memoryview)):
            try:
                decoded = Image.open(io.BytesIO(image))
            except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
                # The warning only arrives here raised, where warnings are made errors.
                raise ValueError(f"image too large to decode: {one_line(e)}") from None
            except Exception as e:  # Pillow's readers raise many types (OSError, SyntaxError...).
                raise ValueError(f"not an image Pillow can read: {one_line(e)}") from None
        elif isinstance(image, Image.Image):
            decoded = image
        else:
            raise TypeError(f"an image must be bytes or a PIL.Image.Image, got {type(image).__name__}")
        # The header's size: a bomb or an extreme aspect ratio fails before anything is decoded.
        width, height = decoded.size
        if width * height > MAX_DECODED_PIXELS:
            raise ValueError(f"image of {width}x{height} has more than {MAX_DECODED_PIXELS} pixels")
        c = self.config
        new_height, new_width = smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels)
        try:
            decoded.load()  # decoding happens here, lazily: a truncated or corrupt file fails now
        except Exception as e:
            raise ValueError(f"not an image Pillow can read: {one_line(e)}") from None
        try:
            rgb = to_rgb(decoded)
        except ValueError as e:  # a mode Pillow cannot convert (La, ...), as in HF
            raise ValueError(f"cannot convert a {decoded.mode} image to RGB: {one_line(e)}") from None
        # HF resizes the RGB uint8 pixels as a PIL image (reducing_gap None), back to uint8.
        resized = rgb.resize((new_width, new_height), resample=Image.Resampling.BICUBIC)
        return ImageInput.of(np.asarray(resized))

    def grid_thw(self, image: ImageInput) -> tuple[int, int, int]:
        """(temporal, height, width) in patches: temporal 1, the frame repeated
        temporal_patch_size times fills one temporal patch."""
        c = self.config
        if image.height <= 0 or image.width <= 0 or image.height % c.factor or image.width % c.factor:
            raise ValueError(f"an image of {image.width}x{image.height} is not on the encoder's grid: "
                             f"height and width must be positive multiples of {c.factor} (resize makes them so)")
        return 1, image.height // c.patch_size, image.width // c.patch_size

    def num_tokens(self, image: ImageInput) -> int:
        """The image's `<|image_pad|>` tokens in the prompt: one per merge_size x merge_size patches."""
        t, h, w = self.grid_thw(image)
        return t * h * w // self.config.merge_size ** 2

    def patchify(self, image: ImageInput, device: torch.device | str = "cpu") -> torch.Tensor:
        """The encoder's input for the image, HF's `pixel_values`: float32
        [t*h*w, 3 * temporal_patch_size * patch_size**2] on `device` (`patchify` below)."""
        if image.video or image.frames != 1:
            raise ValueError("a video's temporal patch is the video processor's to patchify (video.py)")
        self.grid_thw(image)
        c = self.config
        return patchify(image, self._levels, c.patch_size, c.merge_size, c.temporal_patch_size, device)


def patchify(item: ImageInput, levels: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """An image's or a video patch's encoder input, HF's `pixel_values` / `pixel_values_videos`:
    float32 [h*w, 3 * temporal_patch_size * patch_size**2] on `device` (h, w: the grid in
    patches), rows ordered by merge block (block row, block column, row in block, column in
    block), each row (channel, frame, y, x). One frame (an image) is repeated over the temporal
    patch; a video patch brings temporal_patch_size frames. levels [3, 256] float32: the
    normalised value of each channel's 256 levels (the processor's rescale and normalise, which
    are elementwise). The uint8 pixels go to the device and are expanded there (an eighth of the
    float patches' bytes to copy, no host work beyond the copy); the levels are the same float32
    values on any device, so the patches are too."""
    p, m = patch_size, merge_size
    grid_h, grid_w = item.height // p, item.width // p
    if item.frames not in (1, temporal_patch_size):
        raise ValueError(f"an item of {item.frames} frames fills no temporal patch of {temporal_patch_size}")
    pixels = torch.tensor(item.array()).to(device, non_blocking=True)
    # [F, H, W, 3] uint8 -> float32: each subpixel's level looked up in its channel's row.
    levels = levels.to(device, non_blocking=True)
    values = levels[torch.arange(3, device=levels.device), pixels.long()]
    # [F, H, W, C] -> [F, block row, row in block, y, block column, column in block, x, C]
    blocks = values.view(item.frames, grid_h // m, m, p, grid_w // m, m, p, 3)
    # -> [block row, block column, row in block, column in block, C, F, y, x]
    blocks = blocks.permute(1, 4, 2, 5, 7, 0, 3, 6)
    frames = blocks.expand(*blocks.shape[:5], temporal_patch_size, p, p)
    return frames.reshape(grid_h * grid_w, 3 * temporal_patch_size * p * p)


def checked_sizes(vision: dict, config_file: Path, pre: dict, source: Path, fixed: dict[str, object], media: str,
                  defaults: Any) -> tuple[dict[str, int], dict]:
    """What a preprocessor file (`pre`, read from `source`) and config.json's vision_config
    settle for a processor of `media`: ({patch_size, temporal_patch_size, merge_size}, the
    `size` object). Raises ValueError naming the file and the key for a fixed setting (`fixed`)
    that differs, a size that disagrees with the encoder's (its patch embedding and merger are
    built from vision_config's), or a `size` that is not an object."""
    encoder = {
        "patch_size": int_field(vision, "patch_size", defaults.patch_size, config_file, "vision_config."),
        "temporal_patch_size": int_field(vision, "temporal_patch_size", defaults.temporal_patch_size, config_file,
                                         "vision_config."),
        "merge_size": int_field(vision, "spatial_merge_size", defaults.merge_size, config_file, "vision_config."),
    }
    for key, expected in fixed.items():
        if pre.get(key) is not None and pre[key] != expected:
            raise ValueError(f"{source}: {key} = {pre[key]!r} is not supported "
                             f"(deltaspec preprocesses {media} with {key} = {expected!r})")
    sizes = {}
    for key, value in encoder.items():
        sizes[key] = int_field(pre, key, value, source)
        if sizes[key] != value:
            raise ValueError(f"{source}: {key} = {sizes[key]} disagrees with {config_file}'s vision_config ({value})")
    size = {} if pre.get("size") is None else pre["size"]
    if not isinstance(size, dict):
        raise ValueError(f"{source}: size must be an object, got {size!r}")
    return sizes, size


def normalisation_problems(mean: Any, std: Any) -> list[str]:
    """What is wrong with a processor's per-channel mean and std (3 finite numbers each, std > 0)."""
    problems = []
    for name, value in (("image_mean", mean), ("image_std", std)):
        if not (isinstance(value, tuple) and len(value) == 3 and all(is_real(v) for v in value)):
            problems.append(f"{name} must be a tuple of 3 finite numbers, got {value!r}")
        elif name == "image_std" and min(value) <= 0:
            problems.append(f"image_std must be > 0, got {value!r}")
    return problems


def to_rgb(image: Image.Image) -> Image.Image:
    """HF's convert_to_rgb: an image with an alpha band or a transparency key (P, L, RGB with
    info["transparency"]) is composited onto opaque white; any other mode is Pillow's convert."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_json_object(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {one_line(e)}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def int_field(raw: dict, key: str, default: int, path: Path, prefix: str = "") -> int:
    value = raw.get(key)
    if value is None:
        return default
    if not is_int(value) or value <= 0:
        raise ValueError(f"{path}: {prefix}{key} must be a positive integer, got {value!r}")
    return value


def channels_field(raw: dict, key: str, default: tuple[float, float, float],
                    path: Path) -> tuple[float, float, float]:
    """A per-channel value: 3 numbers, or one for all channels (HF accepts both)."""
    value = raw.get(key)
    if value is None:
        return default
    if is_real(value):
        return (float(value),) * 3
    if isinstance(value, list) and len(value) == 3 and all(is_real(v) for v in value):
        return (float(value[0]), float(value[1]), float(value[2]))
    raise ValueError(f"{path}: {key} must be 3 finite numbers, got {value!r}")
