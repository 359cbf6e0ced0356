"""Image preprocessing (engine/vision/preprocess.py) against transformers' Qwen2VLImageProcessorPil,
the processor Qwen3.5 checkpoints name, set up with Qwen3.5's parameters: for fresh random images
of many sizes, PIL modes and encoded formats, `patchify(resize(image))` is HF's pixel_values bit
for bit and `grid_thw` / `num_tokens` its image_grid_thw; the checkpoint's config files are read
as HF reads them; bad bytes, bombs and extreme aspect ratios are one-line ValueErrors."""

import io
import json
import os
import struct
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from deltaspec.engine.vision import preprocess
from deltaspec.engine.vision.image import ImageInput
from deltaspec.engine.vision.preprocess import (QWEN3_5_IMAGE_TOKEN_ID, ImageProcessor, ImageProcessorConfig,
                                                smart_resize)

QWEN3_5 = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown with a failure
    return np.random.default_rng(seed)


def hf_processor(config: ImageProcessorConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size, image_mean=list(config.image_mean), image_std=list(config.image_std),
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels})


def assert_matches_hf(processor: ImageProcessor, ours: bytes | Image.Image, theirs: Image.Image) -> ImageInput:
    image = processor.resize(ours)
    reference = hf_processor(processor.config)(theirs, return_tensors="pt")
    grid = tuple(reference["image_grid_thw"][0].tolist())
    assert processor.grid_thw(image) == grid
    assert processor.num_tokens(image) == grid[0] * grid[1] * grid[2] // processor.config.merge_size ** 2
    patches = processor.patchify(image)
    assert patches.dtype == torch.float32 and patches.shape == reference["pixel_values"].shape
    assert torch.equal(patches, reference["pixel_values"])
    return image


def noise(rng, height: int, width: int, channels: int = 3) -> np.ndarray:
    return rng.integers(0, 256, (height, width, channels), dtype=np.uint8)


def random_image(rng, mode: str, height: int, width: int) -> Image.Image:
    """A random image in `mode` (integer and float modes span past 0..255 to exercise clipping)."""
    if mode == "1":
        return Image.fromarray(rng.random((height, width)) > 0.5)
    if mode == "I":
        return Image.fromarray(rng.integers(-1000, 70_000, (height, width), dtype=np.int32))
    if mode == "F":
        return Image.fromarray(rng.uniform(-10, 300, (height, width)).astype(np.float32))
    bands = {"I;16": 2, "I;16B": 2}.get(mode) or Image.getmodebands(mode)  # bytes a pixel
    image = Image.frombytes(mode, (width, height), noise(rng, height, width, bands).tobytes())
    if mode in ("P", "PA"):
        image.putpalette(noise(rng, 256, 1).tobytes())
    return image


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height RGB pixels and holds none of them."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


# Sizes and pixel bounds ---------------------------------------------------------------------------

@pytest.mark.parametrize("height, width, bounds", [
    (1, 1, {}),  # far below min_pixels: scaled up
    (5, 3, {}),
    (37, 251, {}),  # odd sides
    (251, 37, {}),
    (256, 512, {}),  # already on the grid and in bounds: the resize is an identity
    (300, 200, {}),
    (1, 200, {}),  # the most extreme aspect ratio allowed
    (2, 250, {}),
    (250, 2, {}),
    (80, 48, {"min_pixels": 1024}),  # 2.5 and 1.5 patches: round half to even, 64 x 64
    (700, 500, {"max_pixels": 100_000}),  # above max_pixels: scaled down
    (333, 1000, {"min_pixels": 1024, "max_pixels": 60_000}),
    (97, 3000, {"min_pixels": 1024, "max_pixels": 50_000}),
])
def test_patches_equal_hf_pixel_values(rng, height, width, bounds):
    processor = ImageProcessor().with_pixels(**bounds)
    image = Image.fromarray(noise(rng, height, width))
    resized = assert_matches_hf(processor, image, image)
    assert (resized.height, resized.width) == smart_resize(height, width, 32, processor.config.min_pixels,
                                                           processor.config.max_pixels)


def test_other_patch_sizes_equal_hf(rng):
    """Qwen2-VL's 14-pixel patches and CLIP means: nothing is specific to Qwen3.5's numbers."""
    config = ImageProcessorConfig(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136,
                                  max_pixels=200_000, image_mean=(0.48145466, 0.4578275, 0.40821073),
                                  image_std=(0.26862954, 0.26130258, 0.27577711))
    image = Image.fromarray(noise(rng, 123, 457))
    resized = assert_matches_hf(ImageProcessor(config), image, image)
    assert resized.height % 28 == 0 and resized.width % 28 == 0


# Modes and formats ---------------------------------------------------------------------------------

MODES = ["1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "I;16",
         "I;16B", "I", "F"]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_converts_as_hf(rng, mode):
    image = random_image(rng, mode, 41, 67)
    assert image.mode == mode
    assert_matches_hf(ImageProcessor(), image, image)


@pytest.mark.parametrize("mode, transparency", [
    ("P", "index"),  # one palette entry transparent
    ("P", "bytes"),  # an alpha per palette entry (PNG's tRNS)
    ("L", "index"),
    ("RGB", "colour"),
])
def test_transparency_key_composites_onto_white_as_hf(rng, mode, transparency):
    image = random_image(rng, mode, 50, 40)
    first = image.getpixel((0, 0))
    key = rng.integers(0, 256, 256, dtype=np.uint8).tobytes() if transparency == "bytes" else first
    opaque = image.copy()
    image.info["transparency"] = key
    resized = assert_matches_hf(ImageProcessor(), image, image)
    # White where the key was: not the image without the key.
    assert resized != ImageProcessor().resize(opaque)


def test_la_is_refused_as_hf_refuses_it(rng):
    """Pillow has no La -> RGBA conversion: HF fails; so does resize, with a ValueError."""
    image = random_image(rng, "La", 20, 20)
    with pytest.raises(ValueError):
        hf_processor(ImageProcessorConfig())(image)
    with pytest.raises(ValueError, match="cannot convert a La image to RGB"):
        ImageProcessor().resize(image)


@pytest.mark.parametrize("fmt, mode, options", [
    ("PNG", "RGB", {}),
    ("PNG", "RGBA", {}),
    ("PNG", "L", {}),
    ("PNG", "I;16", {}),
    ("PNG", "P", {"transparency": 7}),
    ("JPEG", "RGB", {"quality": 90}),
    ("JPEG", "L", {}),
    ("JPEG", "CMYK", {}),
    ("WEBP", "RGBA", {"lossless": True}),
    ("WEBP", "RGB", {}),
    ("GIF", "P", {"transparency": 3}),
    ("BMP", "RGB", {}),
    ("TIFF", "RGBA", {}),
])
def test_encoded_bytes_equal_hf_on_the_decoded_image(rng, fmt, mode, options):
    data = encode(random_image(rng, mode, 45, 73), fmt, **options)
    assert_matches_hf(ImageProcessor(), data, Image.open(io.BytesIO(data)))


def test_gif_first_frame(rng):
    frames = [Image.fromarray(noise(rng, 30, 30)).convert("P") for _ in range(3)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    processor = ImageProcessor()
    assert processor.resize(data) == processor.resize(encode(frames[0], "GIF"))
    assert processor.resize(data) != processor.resize(encode(frames[1], "GIF"))


# Identity -------------------------------------------------------------------------------------------

def test_digest_names_the_pixels(rng):
    processor = ImageProcessor()
    pixels = noise(rng, 64, 96)
    image = Image.fromarray(pixels)
    from_pil = processor.resize(image)
    from_png = processor.resize(encode(image, "PNG"))
    assert from_pil == from_png and from_pil.digest == from_png.digest
    other = pixels.copy()
    other[17, 33, 1] ^= 1
    assert processor.resize(Image.fromarray(other)).digest != from_pil.digest
    # Same bytes, another shape: another image.
    assert ImageInput.of(pixels.reshape(96, 64, 3)).digest != ImageInput.of(pixels).digest


# Grid -----------------------------------------------------------------------------------------------

def test_grid_and_tokens(rng):
    processor = ImageProcessor()
    image = ImageInput.of(noise(rng, 64, 96))
    assert processor.grid_thw(image) == (1, 4, 6)
    assert processor.num_tokens(image) == 6
    assert processor.patchify(image).shape == (24, 3 * 2 * 16 * 16)
    for height, width in [(64, 80), (48, 64)]:
        off_grid = ImageInput.of(noise(rng, height, width))
        for method in (processor.grid_thw, processor.num_tokens, processor.patchify):
            with pytest.raises(ValueError, match="multiples of 32"):
                method(off_grid)


# Bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [b"", b"not an image", b"\x89PNG\r\n\x1a\n garbage"])
def test_unreadable_bytes(data):
    with pytest.raises(ValueError, match="^not an image Pillow can read: [^\n]*$"):
        ImageProcessor().resize(data)


def test_truncated_file(rng):
    data = encode(Image.fromarray(noise(rng, 200, 200)), "PNG")
    with pytest.raises(ValueError, match="^not an image Pillow can read: [^\n]*$"):
        ImageProcessor().resize(data[: len(data) // 2])


def test_not_an_image_type():
    with pytest.raises(TypeError):
        ImageProcessor().resize("picture.png")


def test_aspect_ratio_over_200():
    for size in [(201, 1), (1, 201), (2010, 10)]:
        image = Image.new("RGB", size)
        with pytest.raises(ValueError, match="aspect ratio 201.0"):
            ImageProcessor().resize(image)
        with pytest.raises(ValueError):
            hf_processor(ImageProcessorConfig())(image)
    # From the header, before decoding: this file has no pixels to decode.
    with pytest.raises(ValueError, match="aspect ratio 201.0"):
        ImageProcessor().resize(png_header(20_100, 100))


def test_decompression_bomb_is_refused_before_decoding(monkeypatch):
    bomb = png_header(100_000, 100_000)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="too large"):
        ImageProcessor().resize(bomb)
    # Pillow's own guard switched off: the engine's still holds, on the header's size.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(ValueError, match=f"more than {preprocess.MAX_DECODED_PIXELS} pixels"):
        ImageProcessor().resize(bomb)
    assert time.perf_counter() - start < 1


def test_pixel_limit_applies_to_bytes_and_pil_images(rng, monkeypatch):
    monkeypatch.setattr(preprocess, "MAX_DECODED_PIXELS", 100 * 100)
    image = Image.fromarray(noise(rng, 101, 100))
    for source in (image, encode(image, "PNG")):
        with pytest.raises(ValueError, match="101 has more than 10000 pixels"):
            ImageProcessor().resize(source)
    ImageProcessor().resize(Image.fromarray(noise(rng, 100, 100)))


# Configuration --------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes", [
    {"patch_size": 0}, {"merge_size": -2}, {"temporal_patch_size": 1.0}, {"min_pixels": True},
    {"min_pixels": 2000, "max_pixels": 1000}, {"image_mean": (0.5, 0.5)}, {"image_std": (0.5, 0.0, 0.5)},
    {"image_std": [0.5, 0.5, 0.5]}, {"image_mean": (0.5, float("nan"), 0.5)},
])
def test_config_validation(changes):
    with pytest.raises(ValueError, match="invalid image processor config"):
        ImageProcessorConfig(**changes)


def test_factor_and_with_pixels():
    processor = ImageProcessor()
    assert processor.config.factor == 32
    narrower = processor.with_pixels(max_pixels=100_000)
    assert narrower.config.max_pixels == 100_000 and narrower.config.min_pixels == 65_536
    assert narrower.image_token_id == processor.image_token_id
    assert processor.config.max_pixels == 16_777_216  # unchanged
    assert processor.with_pixels(min_pixels=1000).config.min_pixels == 1000
    with pytest.raises(ValueError, match="exceeds max_pixels"):
        processor.with_pixels(min_pixels=200_000, max_pixels=100_000)


VISION = {"patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "depth": 2}


def checkpoint_dir(tmp_path, config: dict, preprocessor: dict | str | None = None):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if preprocessor is not None:
        text = preprocessor if isinstance(preprocessor, str) else json.dumps(preprocessor)
        (tmp_path / "preprocessor_config.json").write_text(text)
    return tmp_path


def assert_reads_as_hf(processor: ImageProcessor, path):
    """The bounds, means, stds and sizes HF's processor takes from the same directory."""
    hf = Qwen2VLImageProcessorPil.from_pretrained(path)
    c = processor.config
    assert (c.min_pixels, c.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
    assert (c.patch_size, c.temporal_patch_size, c.merge_size) == (hf.patch_size, hf.temporal_patch_size,
                                                                    hf.merge_size)
    for ours, theirs in [(c.image_mean, hf.image_mean), (c.image_std, hf.image_std)]:
        assert list(ours) == np.broadcast_to(theirs, 3).tolist()  # HF keeps a scalar as it is


def test_text_only_checkpoint_has_no_processor(tmp_path):
    assert ImageProcessor.from_model_dir(checkpoint_dir(tmp_path, {"model_type": "qwen3_5_text"})) is None


def test_preprocessor_with_size(tmp_path):
    preprocessor = {"size": {"longest_edge": 1_000_000, "shortest_edge": 4096}, **QWEN3_5,
                    "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.25], "do_rescale": True,
                    "rescale_factor": 0.00392156862745098, "resample": 3,
                    "image_processor_type": "Qwen2VLImageProcessorFast"}
    path = checkpoint_dir(tmp_path, {"vision_config": VISION, "image_token_id": 151655}, preprocessor)
    processor = ImageProcessor.from_model_dir(path)
    assert processor.image_token_id == 151655
    assert processor.config == ImageProcessorConfig(min_pixels=4096, max_pixels=1_000_000,
                                                    image_mean=(0.4, 0.5, 0.6), image_std=(0.2, 0.3, 0.25))
    assert_reads_as_hf(processor, path)


def test_preprocessor_with_min_max_pixels(tmp_path):
    """Older checkpoints' keys; where `size` is there too, min/max_pixels win, as in HF."""
    vision = {**VISION, "patch_size": 14}
    preprocessor = {"min_pixels": 3136, "max_pixels": 12_845_056, "patch_size": 14, "merge_size": 2,
                    "size": {"shortest_edge": 100, "longest_edge": 200}, "image_mean": 0.5, "image_std": 0.5}
    processor = ImageProcessor.from_model_dir(checkpoint_dir(tmp_path, {"vision_config": vision}, preprocessor))
    assert processor.image_token_id == QWEN3_5_IMAGE_TOKEN_ID
    assert processor.config == ImageProcessorConfig(patch_size=14, min_pixels=3136, max_pixels=12_845_056)
    assert_reads_as_hf(processor, tmp_path)


def test_no_preprocessor_config_means_defaults(tmp_path):
    vision = {"patch_size": 14, "spatial_merge_size": 2}
    processor = ImageProcessor.from_model_dir(checkpoint_dir(tmp_path, {"vision_config": vision}))
    assert processor.config == ImageProcessorConfig(patch_size=14)
    assert ImageProcessor.from_model_dir(checkpoint_dir(tmp_path, {"vision_config": {}})) == ImageProcessor()


@pytest.mark.parametrize("config, preprocessor, file, field", [
    ("{", None, "config.json", "JSON"),
    ({"vision_config": [1]}, None, "config.json", "vision_config"),
    ({"vision_config": VISION, "image_token_id": "x"}, None, "config.json", "image_token_id"),
    ({"vision_config": {"patch_size": -16}}, None, "config.json", "vision_config.patch_size"),
    ({"vision_config": VISION}, "[1, 2", "preprocessor_config.json", "JSON"),
    ({"vision_config": VISION}, [], "preprocessor_config.json", "JSON object"),
    ({"vision_config": VISION}, {"size": 65536}, "preprocessor_config.json", "size"),
    ({"vision_config": VISION}, {"size": {"shortest_edge": "64"}}, "preprocessor_config.json", "size.shortest_edge"),
    ({"vision_config": VISION}, {"min_pixels": 1.5}, "preprocessor_config.json", "min_pixels"),
    ({"vision_config": VISION}, {"min_pixels": 4096, "max_pixels": 1024}, "preprocessor_config.json", "max_pixels"),
    ({"vision_config": VISION}, {"image_mean": [0.5, 0.5]}, "preprocessor_config.json", "image_mean"),
    ({"vision_config": VISION}, {"image_std": [0.5, 0, 0.5]}, "preprocessor_config.json", "image_std"),
    ({"vision_config": VISION}, {"patch_size": 14}, "preprocessor_config.json", "patch_size"),
    ({"vision_config": VISION}, {"do_normalize": False}, "preprocessor_config.json", "do_normalize"),
    ({"vision_config": VISION}, {"resample": 2}, "preprocessor_config.json", "resample"),
    ({"vision_config": VISION}, {"rescale_factor": 1.0}, "preprocessor_config.json", "rescale_factor"),
])
def test_malformed_files(tmp_path, config, preprocessor, file, field):
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if preprocessor is not None:
        text = preprocessor if isinstance(preprocessor, str) else json.dumps(preprocessor)
        (tmp_path / "preprocessor_config.json").write_text(text)
    with pytest.raises(ValueError) as raised:
        ImageProcessor.from_model_dir(tmp_path)
    message = str(raised.value)
    assert str(tmp_path / file) in message and field in message and "\n" not in message


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ImageProcessor.from_model_dir(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_patchify_on_the_gpu_equals_the_cpus():
    """The engine patchifies on its device (uint8 pixels copied, expanded there): the same float32
    values as on the CPU, bit for bit."""
    processor = ImageProcessor()
    image = ImageInput.of(np.random.default_rng(21).integers(0, 256, (96, 160, 3), dtype=np.uint8))
    assert torch.equal(processor.patchify(image, "cuda").cpu(), processor.patchify(image))
