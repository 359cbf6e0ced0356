"""Video preprocessing (engine/vision/video.py) against transformers' Qwen3VLVideoProcessor, the
processor Qwen3.5 checkpoints name. torchvision cannot be imported here, so HF's class cannot run
whole: its own functions (smart_resize, sample_frames, patchify, _calculate_timestamps, the PyAV
reader) run on fresh random inputs, the resize is the op HF's torchvision backend calls (and
Pillow's bicubic within 2 levels), the normalisation HF's fused one written out. Decoding reads
videos encoded here with PyAV (lossless codecs, so the sampled frames are known exactly); bad
bytes, settings and config files are one-line ValueErrors."""

import importlib.util
import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata, read_video_pyav

from deltaspec.engine.vision import video as video_module
from deltaspec.engine.vision.image import ImageInput
from deltaspec.engine.vision.preprocess import ImageProcessor
from deltaspec.engine.vision.video import (DEFAULT_VIDEO_FPS, QWEN3_5_VIDEO_TOKEN_ID, VideoProcessor,
                                           VideoProcessorConfig, resize_frames, smart_resize, timestamps)


def hf_module(relative: str, name: str):
    """A transformers module loaded from its file: video_processing_qwen3_vl's lazy import stands
    in a dummy without torchvision, but its functions need none."""
    spec = importlib.util.spec_from_file_location(name, Path(transformers.__file__).parent / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


HF = hf_module("models/qwen3_vl/video_processing_qwen3_vl.py", "transformers.models.qwen3_vl._test_video_reference")
HF_VIDEO = HF.Qwen3VLVideoProcessor


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown with a failure
    return np.random.default_rng(seed)


def hf_sample(config: VideoProcessorConfig, total: int, video_fps: float | None) -> list[int]:
    """HF's Qwen3VLVideoProcessor.sample_frames, unbound, on a stand-in holding the settings."""
    processor = SimpleNamespace(fps=config.fps, min_frames=config.min_frames, max_frames=config.max_frames)
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
    return HF_VIDEO.sample_frames(processor, metadata, num_frames=config.num_frames, fps=config.fps).tolist()


def hf_timestamps(indices, video_fps: float, temporal_patch_size: int) -> list[float]:
    return Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, temporal_patch_size)


def hf_pixel_values(config: VideoProcessorConfig, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """HF's pixel_values_videos and grid of resized uint8 frames [N, h, w, 3]: its fused rescale and
    normalise (TorchvisionBackend.rescale_and_normalize with tvF.normalize), then its patchify."""
    videos = torch.from_numpy(frames).permute(0, 3, 1, 2)[None]  # [1, N, 3, h, w]
    mean = torch.tensor(list(config.image_mean)) * (1.0 / (1 / 255))
    std = torch.tensor(list(config.image_std)) * (1.0 / (1 / 255))
    normalised = videos.to(torch.float32).sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    patches, grid_t, grid_h, grid_w = HF_VIDEO.patchify(None, normalised, config.patch_size, config.merge_size,
                                                        config.temporal_patch_size)
    return patches[0], (grid_t, grid_h, grid_w)


def hf_resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """torchvision's resize_image for a uint8 CPU video with BICUBIC, as HF calls it (antialias True):
    the whole video in one interpolate on uint8, the same size returned as it is."""
    if frames.shape[1:3] == (height, width):
        return frames
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    return F.interpolate(video, size=[height, width], mode="bicubic", align_corners=False,
                         antialias=True).permute(0, 2, 3, 1).numpy()


def random_config(rng) -> VideoProcessorConfig:
    by_fps = rng.random() < 0.6
    max_frames = int(rng.integers(4, 900))
    return VideoProcessorConfig(
        patch_size=int(rng.choice([8, 14, 16])), temporal_patch_size=int(rng.choice([1, 2, 3])),
        merge_size=int(rng.choice([1, 2])), min_pixels=int(rng.integers(1, 50_000)),
        max_pixels=int(rng.integers(50_000, 30_000_000)),
        fps=float(rng.uniform(0.1, 8)) if by_fps else None,
        num_frames=None if by_fps else int(rng.integers(1, max_frames + 1)),
        min_frames=int(rng.integers(1, 5)), max_frames=max_frames,
        image_mean=tuple(float(v) for v in rng.uniform(0.2, 0.8, 3)),
        image_std=tuple(float(v) for v in rng.uniform(0.1, 0.5, 3)))


def random_size(rng) -> tuple[int, int]:
    height = int(rng.integers(1, 4000))
    ratio = float(np.exp(rng.uniform(-np.log(150), np.log(150))))
    return height, max(1, min(20_000, int(height * ratio)))


def encode(frames: np.ndarray, fps, container: str = "matroska", codec: str = "ffv1", pix_fmt: str = "bgr0",
           rotation: int = 0) -> bytes:
    """frames [N, H, W, 3] uint8 as a video file; ffv1 with bgr0 (and png) are lossless.
    rotation: the display matrix's counterclockwise turn, as a phone writes a portrait video's."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        if rotation:
            stream.set_display_rotation(rotation)
        for frame in frames:
            output.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        output.mux(stream.encode())
    return buffer.getvalue()


def noise(rng, shape) -> np.ndarray:
    return rng.integers(0, 256, shape, dtype=np.uint8)


# --- HF's functions -------------------------------------------------------------------------------

def test_smart_resize_matches_hf(rng):
    for _ in range(3000):
        height, width = random_size(rng)
        num_frames = int(rng.integers(1, 1000))
        temporal, factor = int(rng.choice([1, 2, 3])), int(rng.choice([16, 28, 32]))
        min_pixels = int(rng.integers(1, 100_000))
        max_pixels = int(rng.integers(min_pixels, 40_000_000))
        args = (num_frames, height, width, temporal, factor, min_pixels, max_pixels)
        try:
            expected = HF.smart_resize(*args)
        except ValueError:  # too few frames, or an aspect ratio over 200
            with pytest.raises(ValueError):
                smart_resize(*args)
            continue
        assert smart_resize(*args) == expected, args


def test_frame_indices_match_hf(rng):
    for _ in range(2000):
        config = random_config(rng)
        total = int(rng.integers(1, 20_000))
        video_fps = None if rng.random() < 0.1 else float(rng.choice([rng.uniform(1, 120), 23.976, 25, 29.97, 30, 60]))
        indices = VideoProcessor(config).frame_indices(total, video_fps)
        assert indices == hf_sample(config, total, video_fps), (config, total, video_fps)
    everything = VideoProcessor(VideoProcessorConfig(do_sample_frames=False))
    assert everything.frame_indices(7, 30.0) == list(range(7))


def test_timestamps_match_hf(rng):
    for _ in range(2000):
        indices = sorted(rng.integers(0, 10_000, int(rng.integers(1, 60))).tolist())
        video_fps, temporal = float(rng.uniform(0.5, 120)), int(rng.choice([1, 2, 3, 4]))
        assert timestamps(indices, video_fps, temporal) == tuple(hf_timestamps(indices, video_fps, temporal))


def test_resize_is_torchvisions_op_and_near_pillow(rng):
    for _ in range(12):
        num_frames = int(rng.integers(1, 4))
        height, width = int(rng.integers(4, 200)), int(rng.integers(4, 200))
        new_height, new_width = int(rng.integers(1, 8)) * 32, int(rng.integers(1, 8)) * 32
        frames = noise(rng, (num_frames, height, width, 3))
        resized = resize_frames(frames, new_height, new_width)
        assert resized.shape == (num_frames, new_height, new_width, 3) and resized.dtype == np.uint8
        # HF resizes the whole video in one call; the op is per frame.
        assert np.array_equal(resized, hf_resize(frames, new_height, new_width))
        # Pillow's bicubic (the same a = -0.5 kernel, antialiased) in torch's pass order, width then
        # height, each pass rounded and clipped to uint8: within 2 levels of 255. (One Pillow call
        # may take height first; on noise that is upscaled the clipped overshoots then differ by
        # more, since the passes clip at different points.)
        for frame, ours in zip(frames, resized):
            image = Image.fromarray(frame).resize((new_width, height), Image.Resampling.BICUBIC)
            pillow = np.asarray(image.resize((new_width, new_height), Image.Resampling.BICUBIC))
            assert np.abs(ours.astype(int) - pillow).max() <= 2
    same = noise(rng, (2, 64, 96, 3))
    assert resize_frames(same, 64, 96) is same


def test_patchify_matches_hf(rng):
    for _ in range(6):
        config = random_config(rng)
        processor = VideoProcessor(config)
        t, factor = config.temporal_patch_size, config.factor
        frames = noise(rng, (t * int(rng.integers(1, 4)), factor * int(rng.integers(1, 4)),
                             factor * int(rng.integers(1, 4)), 3))
        patches = [ImageInput.of(frames[i:i + t], video=True) for i in range(0, len(frames), t)]
        ours = torch.cat([processor.patchify(p) for p in patches])
        expected, (grid_t, grid_h, grid_w) = hf_pixel_values(config, frames)
        assert ours.dtype == torch.float32 and torch.equal(ours, expected)
        assert {processor.grid_thw(p) for p in patches} == {(1, grid_h, grid_w)} and grid_t == len(patches)
        assert sum(processor.num_tokens(p) for p in patches) == grid_t * grid_h * grid_w // config.merge_size ** 2


def test_video_levels_are_not_the_image_levels():
    """HF normalises videos as (x - 127.5) / 127.5 and images as (x / 255 - 0.5) / 0.5: equal to a
    few ulps, not bit for bit, so a video patch must not go through the image's table."""
    levels = (np.arange(32 * 32) % 256).astype(np.uint8).reshape(32, 32)  # every level, on the 32-pixel grid
    image = ImageInput.of(np.stack([levels] * 3, axis=-1))
    patch = ImageInput.of(np.stack([image.array()[0]] * 2), video=True)
    as_image = ImageProcessor().patchify(image)
    as_video = VideoProcessor().patchify(patch)
    assert not torch.equal(as_image, as_video)
    assert torch.allclose(as_image, as_video, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="video"):
        ImageProcessor().patchify(patch)
    with pytest.raises(ValueError, match="temporal patch"):
        VideoProcessor().patchify(image)


@pytest.mark.parametrize("source_fps", [None, 1.0, 10.0, 29.97])
def test_from_frames_is_hfs_pipeline(rng, source_fps):
    """sample_frames, frames[indices], smart_resize with the sampled count, the resize, the fused
    normalisation and patchify, and the timestamps: all HF's, composed as its processor does."""
    for _ in range(3):
        config = random_config(rng)
        processor = VideoProcessor(config)
        total = int(rng.integers(config.temporal_patch_size, 60))
        height, width = int(rng.integers(8, 120)), int(rng.integers(8, 120))
        frames = noise(rng, (total, height, width, 3))
        video = processor.from_frames(frames, fps=source_fps)

        indices = hf_sample(config, total, source_fps)
        sampled = frames[indices]
        if len(sampled) < config.temporal_patch_size:
            continue  # HF refuses such a video; test_short_videos_repeat_their_last_frame
        new_height, new_width = HF.smart_resize(len(sampled), height, width, config.temporal_patch_size,
                                                config.factor, config.min_pixels, config.max_pixels)
        expected, (grid_t, grid_h, grid_w) = hf_pixel_values(config, hf_resize(sampled, new_height, new_width))
        assert torch.equal(torch.cat([processor.patchify(p) for p in video.patches]), expected)
        assert len(video.patches) == grid_t
        assert {processor.grid_thw(p) for p in video.patches} == {(1, grid_h, grid_w)}
        assert list(video.timestamps) == hf_timestamps(indices, source_fps or DEFAULT_VIDEO_FPS,
                                                       config.temporal_patch_size)


def test_from_frames_inputs(rng):
    processor = VideoProcessor()
    frames = noise(rng, (6, 40, 70, 3))
    # Frames already sampled: taken as they are, their indices give the times.
    given = processor.from_frames(frames, fps=2.0, indices=[0, 4, 8, 12, 16, 20])
    assert given.timestamps == (1.0, 5.0, 9.0)  # seconds 0, 2 | 4, 6 | 8, 10
    assert processor.from_frames(torch.from_numpy(frames), fps=np.float64(2), indices=np.arange(0, 24, 4)) == given
    assert np.array_equal(np.concatenate([p.array() for p in given.patches]),
                          resize_frames(frames, *smart_resize(6, 40, 70, 2, 32, 4096, 25_165_824)))
    # A list of PIL images is read as images are: RGBA composited onto white.
    rgba = noise(rng, (6, 40, 70, 4))
    as_pil = processor.from_frames([Image.fromarray(f, "RGBA") for f in rgba], fps=2.0, indices=range(6))
    alpha = rgba[..., 3:].astype(np.float64) / 255
    white = np.round(rgba[..., :3] * alpha + 255 * (1 - alpha))
    as_array = processor.from_frames(np.clip(white, 0, 255).astype(np.uint8), fps=2.0, indices=range(6))
    difference = np.abs(np.concatenate([p.array() for p in as_pil.patches]).astype(int)
                        - np.concatenate([p.array() for p in as_array.patches]))
    assert difference.max() <= 1
    # Without fps, HF's 24: 6 frames at 24 fps are 0.25 s, 4 frames at least (min_frames).
    assert processor.from_frames(frames).timestamps == tuple(hf_timestamps([0, 2, 3, 5], 24.0, 2))
    for bad, match in [(frames.astype(np.float32), "uint8"), (frames[..., :2], "RGB"), (frames[0], "frames"),
                       (frames[:0], "at least one"), ([], "at least one"), ([frames[0], frames[0, :20]], "one size"),
                       ([frames[0].astype(np.int16)], "video frame")]:
        with pytest.raises(ValueError, match=match):
            processor.from_frames(bad, fps=2.0)
    with pytest.raises(ValueError, match="one non-negative integer per frame"):
        processor.from_frames(frames, fps=2.0, indices=[0, 1])
    with pytest.raises(ValueError, match="fps"):
        processor.from_frames(frames, fps=0)
    with pytest.raises(TypeError):
        processor.from_frames("frames")


def test_short_videos_repeat_their_last_frame(rng):
    """One frame (an image sent as a video, a clip of a single frame): HF's smart_resize refuses
    fewer frames than a temporal patch; here the frame fills the patch."""
    processor = VideoProcessor()
    frame = noise(rng, (1, 50, 90, 3))
    video = processor.from_frames(frame, fps=30.0)
    assert len(video.patches) == 1 and video.timestamps == (0.0,)
    pixels = video.patches[0].array()
    height, width = smart_resize(2, 50, 90, 2, 32, 4096, 25_165_824)
    assert np.array_equal(pixels[0], pixels[1]) and np.array_equal(pixels[:1], resize_frames(frame, height, width))
    # Three frames: two patches, the last frame (and its time) repeated.
    video = processor.from_frames(noise(rng, (3, 50, 90, 3)), fps=1.0, indices=[0, 5, 9])
    assert video.timestamps == (2.5, 9.0)
    assert np.array_equal(video.patches[1].array()[0], video.patches[1].array()[1])


# --- decoding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("rotation", [-90, 90, 180])
def test_decode_shows_frames_upright(rng, rotation):
    """A video whose display matrix turns it (a phone's portrait video: stored landscape, shown
    turned) decodes as shown: each frame turned counterclockwise by the rotation, so a band at
    the stored top is at the right after -90 degrees; the same as from_frames of the turned frames."""
    frames = noise(rng, (4, 32, 64, 3))
    frames[:, :8] = 255
    processor = VideoProcessor(VideoProcessorConfig(fps=2.0, min_frames=2))
    video = processor.decode(encode(frames, 2, "mov", "png", "rgb24", rotation=rotation))
    shown = np.rot90(frames, k=rotation // 90, axes=(1, 2))
    assert video == processor.from_frames(np.ascontiguousarray(shown), fps=2.0)
    if rotation == -90:
        assert (video.patches[0].array()[0][:, -8:] == 255).all()

@pytest.mark.parametrize("container, codec, pix_fmt", [("matroska", "ffv1", "bgr0"), ("avi", "ffv1", "bgr0"),
                                                       ("mov", "png", "rgb24")])
def test_decode_takes_the_sampled_frames(rng, container, codec, pix_fmt):
    """Lossless videos (Matroska declares no frame count: the packets are counted)."""
    for fps in (1, 5, 12, 30):
        total = int(rng.integers(1, 40))
        frames = noise(rng, (total, int(rng.integers(16, 80)), int(rng.integers(16, 80)), 3))
        config = VideoProcessorConfig(fps=float(rng.uniform(0.5, 6)), min_frames=int(rng.integers(1, 6)))
        processor = VideoProcessor(config)
        video = processor.decode(encode(frames, fps, container, codec, pix_fmt))
        assert video == processor.from_frames(frames, fps=float(fps))
        indices = hf_sample(config, total, float(fps))
        assert list(video.timestamps) == hf_timestamps(indices, float(fps), 2)


def test_decode_matches_hfs_pyav_reader(rng, tmp_path):
    """A lossy mp4 (mpeg4, yuv420p): HF's read_video_pyav decodes all frames up to the last sampled
    one and converts the sampled ones to rgb24; the frames here are its frames, resized."""
    processor = VideoProcessor(VideoProcessorConfig(fps=3.0))
    frames = noise(rng, (37, 48, 64, 3))
    data = encode(frames, 10, "mp4", "mpeg4", "yuv420p")
    (tmp_path / "clip.mp4").write_bytes(data)
    sampler = lambda metadata, **kwargs: np.array(hf_sample(processor.config, metadata.total_num_frames, metadata.fps))
    decoded, metadata = read_video_pyav(str(tmp_path / "clip.mp4"), sample_indices_fn=sampler)
    assert processor.decode(data) == processor.from_frames(decoded, fps=metadata.fps,
                                                           indices=metadata.frames_indices.tolist())


def test_decode_resamples_a_stream_shorter_than_declared(rng, monkeypatch):
    frames = noise(rng, (20, 32, 48, 3))
    data = encode(frames, 8, "avi")
    processor = VideoProcessor()
    honest = processor.decode(data)
    probe = video_module._probe
    monkeypatch.setattr(video_module, "_probe", lambda av, data: (probe(av, data)[0] + 13, probe(av, data)[1]))
    assert processor.decode(data) == honest == processor.from_frames(frames, fps=8.0)


def test_decode_refuses(rng, monkeypatch):
    processor = VideoProcessor()
    frames = noise(rng, (6, 32, 32, 3))
    mp4 = encode(frames, 5, "mp4", "mpeg4", "yuv420p")
    png = io.BytesIO()
    Image.fromarray(frames[0]).save(png, "PNG")
    audio = io.BytesIO()
    with av.open(audio, mode="w", format="matroska") as output:
        stream = output.add_stream("pcm_s16le", rate=8000, layout="mono")
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        samples.sample_rate = 8000
        output.mux(stream.encode(samples))
        output.mux(stream.encode())
    empty_video = io.BytesIO()
    with av.open(empty_video, mode="w", format="avi") as output:  # a header, a stream, no frame
        stream = output.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        output.start_encoding()
    cases = [(b"", "PyAV"), (os.urandom(4000), "PyAV"), (b"just some text\n" * 100, "PyAV"),
             (mp4[:len(mp4) // 3], "PyAV"), (png.getvalue(), "PyAV"), (audio.getvalue(), "no video stream"),
             (empty_video.getvalue(), "no frames"),
             (b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/hostname\n#EXT-X-ENDLIST\n", "PyAV")]
    for data, match in cases:
        with pytest.raises(ValueError, match=match) as error:
            processor.decode(data)
        assert "\n" not in str(error.value)
    with pytest.raises(TypeError):
        processor.decode("video.mp4")
    with pytest.raises(ValueError, match="taken whole exceeds max_frames"):
        VideoProcessor(VideoProcessorConfig(do_sample_frames=False, max_frames=5)).decode(mp4)
    monkeypatch.setattr(video_module, "MAX_VIDEO_FRAMES", 5)
    with pytest.raises(ValueError, match="longer than 5 frames"):
        processor.decode(encode(frames, 5))  # Matroska: counted
    with pytest.raises(ValueError, match="longer than 5 frames"):
        processor.decode(mp4)  # declared
    monkeypatch.setattr(video_module, "MAX_DECODED_PIXELS", 1000)
    with pytest.raises(ValueError, match="more than 1000 pixels"):
        processor.decode(encode(frames[:3], 5))


# --- settings -------------------------------------------------------------------------------------

def test_with_options():
    processor = VideoProcessor()
    assert processor.with_options(fps=1).config == replace_config(fps=1.0)
    assert processor.with_options(num_frames=16).config == replace_config(fps=None, num_frames=16)
    assert processor.with_options(num_frames=16).with_options(fps=4).config == replace_config(fps=4.0)
    assert processor.with_options(size={"shortest_edge": 100, "longest_edge": 10_000}, max_pixels=20_000,
                                  min_frames=2, max_frames=10, do_sample_frames=False).config == replace_config(
        min_pixels=100, max_pixels=20_000, min_frames=2, max_frames=10, do_sample_frames=False)
    assert processor.with_options(fps=None, size={"longest_edge": 9000}).config == replace_config(max_pixels=9000)
    refusals = [
        (dict(frames=3), "frames"), (dict(fps=1, num_frames=8), "fps and num_frames"), (dict(fps=0), "fps"),
        (dict(fps="2"), "fps"), (dict(fps=float("nan")), "fps"), (dict(fps=True), "fps"),
        (dict(num_frames=0), "num_frames"),
        (dict(num_frames=2.0), "num_frames"), (dict(num_frames=1000), "num_frames"),
        (dict(min_frames=-1), "min_frames"), (dict(max_frames=2), "min_frames 4 exceeds max_frames 2"),
        (dict(do_sample_frames=1), "do_sample_frames"), (dict(size=[1, 2]), "size"),
        (dict(size={"height": 10}), "size"), (dict(size={"shortest_edge": 0}), "min_pixels"),
        (dict(min_pixels=10**9), "min_pixels"), (dict(max_pixels=True), "max_pixels"),
    ]
    for options, match in refusals:
        with pytest.raises(ValueError, match=match):
            processor.with_options(**options)


def replace_config(**changes) -> VideoProcessorConfig:
    return VideoProcessorConfig(**{**VideoProcessorConfig().__dict__, **changes})


@pytest.mark.parametrize("settings, match", [
    (dict(patch_size=0), "patch_size"), (dict(min_pixels=10, max_pixels=5), "min_pixels"),
    (dict(min_frames=9, max_frames=8), "min_frames"), (dict(fps=None), "exactly one"),
    (dict(num_frames=4), "exactly one"), (dict(fps=-1.0), "fps"), (dict(do_sample_frames=None), "do_sample_frames"),
    (dict(image_std=(0.5, 0.0, 0.5)), "image_std"), (dict(image_mean=(0.5,)), "image_mean"),
])
def test_config_refuses(settings, match):
    with pytest.raises(ValueError, match=match):
        VideoProcessorConfig(**settings)


def write_checkpoint(path: Path, vision: dict | None = None, **files) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"video_token_id": 151656}
    if vision is not None:
        config["vision_config"] = vision
    (path / "config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (path / f"{name}.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return path


QWEN3_5_VIDEO_FILE = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                      "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                      "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "do_resize": True, "resample": 3}
VISION = {"patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2}


def test_from_model_dir(tmp_path):
    assert VideoProcessor.from_model_dir(write_checkpoint(tmp_path / "text")) is None
    plain = VideoProcessor.from_model_dir(write_checkpoint(tmp_path / "none", VISION))
    assert plain == VideoProcessor(VideoProcessorConfig(), 151656)
    assert VideoProcessor.from_model_dir(write_checkpoint(tmp_path / "file", VISION,
                                                          video_preprocessor_config=QWEN3_5_VIDEO_FILE)) == plain
    custom = {**QWEN3_5_VIDEO_FILE, "size": {"shortest_edge": 1000, "longest_edge": 90_000}, "num_frames": 8,
              "fps": None, "min_frames": 2, "image_mean": 0.25}
    nested = VideoProcessor.from_model_dir(write_checkpoint(
        tmp_path / "nested", VISION, processor_config={"video_processor": custom, "image_processor": {}},
        video_preprocessor_config=QWEN3_5_VIDEO_FILE))  # the nested object wins, as in HF
    assert nested.config == replace_config(min_pixels=1000, max_pixels=90_000, fps=None, num_frames=8, min_frames=2,
                                           image_mean=(0.25, 0.25, 0.25))
    no_token = tmp_path / "no_token"
    write_checkpoint(no_token, VISION)
    (no_token / "config.json").write_text(json.dumps({"vision_config": VISION}))
    assert VideoProcessor.from_model_dir(no_token).video_token_id == QWEN3_5_VIDEO_TOKEN_ID


@pytest.mark.parametrize("file, match", [
    ({"do_resize": False}, "do_resize"), ({"resample": 2}, "resample"), ({"do_normalize": False}, "do_normalize"),
    ({"rescale_factor": 0.5}, "rescale_factor"), ({"cap_pixels_per_frame": True}, "cap_pixels_per_frame"),
    ({"patch_size": 14}, "disagrees"), ({"merge_size": 3}, "disagrees"), ({"size": 100}, "size"),
    ({"size": {"shortest_edge": -1}}, "size.shortest_edge"), ({"fps": 2, "num_frames": 8}, "mutually exclusive"),
    ({"fps": "fast"}, "fps"), ({"num_frames": 0}, "num_frames"), ({"num_frames": 1000}, "num_frames"),
    ({"do_sample_frames": "yes"}, "do_sample_frames"), ({"min_frames": 9, "max_frames": 8}, "min_frames"),
    ({"image_std": [1, 2]}, "image_std"), ("[1, 2]", "JSON object"), ("{not json", "not readable JSON"),
])
def test_from_model_dir_refuses(tmp_path, file, match):
    with pytest.raises(ValueError, match=match) as error:
        VideoProcessor.from_model_dir(write_checkpoint(tmp_path, VISION, video_preprocessor_config=file))
    assert "video_preprocessor_config.json" in str(error.value)


def test_from_model_dir_refuses_bad_layouts(tmp_path):
    with pytest.raises(ValueError, match="video_processor must be an object"):
        VideoProcessor.from_model_dir(write_checkpoint(tmp_path / "a", VISION, processor_config={"video_processor": 3}))
    with pytest.raises(ValueError, match="vision_config"):
        VideoProcessor.from_model_dir(write_checkpoint(tmp_path / "b", {"patch_size": 0}))
    with pytest.raises(ValueError, match="no config.json"):
        VideoProcessor.from_model_dir(tmp_path / "c")
