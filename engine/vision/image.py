"""An image, or one temporal patch of a video, as the engine takes it: RGB pixels already
resized to the vision encoder's grid.

The front ends (server, LLM) decode and resize an image (preprocess.py) or a video's sampled
frames (video.py) and hand the engine `ImageInput`s: the resized pixels, not the normalised float
patches, so a request carries 3 bytes a pixel over the engine process's socket instead of 24 (two
float32 frames), and the digest that names the item in the prefix cache and the encoder cache is
computed once. A video is a sequence of temporal patches, each temporal_patch_size frames, which
the encoder reads as it reads an image (its attention never crosses a patch); `data_url_bytes`
reads media sent inline. Knows nothing of the model.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

import msgspec
import numpy as np


class ImageInput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """RGB pixels [frames, height, width, 3] uint8 in row-major bytes; height and width multiples
    of the encoder's patch_size * merge_size (the processors' resize makes them so). frames: 1 for
    an image (the encoder repeats it over its temporal patch); a video's temporal patch (video
    True) holds temporal_patch_size frames. digest: sha256 of the kind, the shape and the pixels,
    the item's identity for caching (`of` computes it)."""

    pixels: bytes
    height: int
    width: int
    digest: bytes
    frames: int = 1
    video: bool = False

    @classmethod
    def of(cls, array: np.ndarray, video: bool = False) -> "ImageInput":
        """From an RGB uint8 array: [height, width, 3] (one frame) or [frames, height, width, 3]."""
        if array.dtype != np.uint8 or array.ndim not in (3, 4) or array.shape[-1] != 3 or 0 in array.shape:
            raise ValueError(f"an image must be RGB uint8 [height, width, 3] or [frames, height, width, 3], got "
                             f"{array.dtype} {list(array.shape)}")
        frames, height, width = (1, *array.shape[:2]) if array.ndim == 3 else array.shape[:3]
        pixels = np.ascontiguousarray(array).tobytes()
        kind = "video" if video else "image"
        digest = hashlib.sha256(f"{kind}:{frames}x{height}x{width}:".encode() + pixels).digest()
        return cls(pixels, int(height), int(width), digest, int(frames), video)

    def array(self) -> np.ndarray:
        """The pixels as a read-only uint8 array [frames, height, width, 3]."""
        size = self.frames * self.height * self.width * 3
        if len(self.pixels) != size:
            raise ValueError(f"{self.frames} frame(s) of {self.width}x{self.height} need {size} bytes of RGB pixels, "
                             f"got {len(self.pixels)}")
        return np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.frames, self.height, self.width, 3)


def data_url_bytes(url: str, media: str = "image") -> bytes:
    """The bytes a data: URL holds, as vLLM reads one: data:<media>/<subtype>;base64,<data>, media
    "image" or "video". ValueError (the reason) for any other form."""
    header, comma, data = url.removeprefix("data:").partition(",")
    if not comma:
        raise ValueError("a data: URL needs a comma before its data")
    media_type, *parameters = [p.strip() for p in header.split(";")]
    if not parameters or parameters[-1].lower() != "base64":
        raise ValueError("only base64 data: URLs are read (data:image/png;base64,...)")
    if not media_type.lower().startswith(f"{media}/"):
        article = "an" if media[0] in "aeiou" else "a"
        raise ValueError(f"a data: URL of media type {media_type or 'text/plain'!r} is not {article} {media}")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as error:
        raise ValueError(f"the data is not valid base64: {error}") from None



class VideoInput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A video as the engine takes it: its sampled frames, resized, in temporal patches
    (`ImageInput`s with video True and temporal_patch_size frames each, the last frame repeated
    to fill the last patch), and each patch's time in seconds (the mean of its first and last
    frames' times), which the prompt writes before the patch's tokens as `<{t:.1f} seconds>`."""

    patches: tuple[ImageInput, ...]
    timestamps: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.patches or len(self.patches) != len(self.timestamps):
            raise ValueError(f"a video needs one timestamp per temporal patch and at least one patch, got "
                             f"{len(self.patches)} patches and {len(self.timestamps)} timestamps")
        if not all(isinstance(p, ImageInput) and p.video for p in self.patches):
            raise ValueError("a video's patches must be ImageInputs with video=True")
