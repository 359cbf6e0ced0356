"""An image as the engine takes it: RGB pixels already resized to the vision encoder's grid.

The front ends (server, LLM) decode and resize an image (preprocess.py) and hand the engine an
`ImageInput`: the resized pixels, not the normalised float patches, so a request carries 3 bytes a
pixel over the engine process's socket instead of 24 (two float32 frames), and the digest that
names the image in the prefix cache and the encoder cache is computed once; `data_url_bytes`
reads an image sent inline. Knows nothing of the model.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

import msgspec
import numpy as np


class ImageInput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """RGB pixels [height, width, 3] uint8 in row-major bytes; height and width multiples of the
    encoder's patch_size * merge_size (preprocess.resize makes them so). digest: sha256 of the
    shape and the pixels, the image's identity for caching (`of` computes it)."""

    pixels: bytes
    height: int
    width: int
    digest: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> "ImageInput":
        """From an RGB uint8 array [height, width, 3]."""
        if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
            raise ValueError(f"an image must be RGB uint8 [height, width, 3], got {array.dtype} {list(array.shape)}")
        height, width = int(array.shape[0]), int(array.shape[1])
        pixels = np.ascontiguousarray(array).tobytes()
        digest = hashlib.sha256(f"{height}x{width}:".encode() + pixels).digest()
        return cls(pixels, height, width, digest)

    def array(self) -> np.ndarray:
        """The pixels as a read-only uint8 array [height, width, 3]."""
        if len(self.pixels) != self.height * self.width * 3:
            raise ValueError(f"an image of {self.height}x{self.width} needs {self.height * self.width * 3} bytes of "
                             f"RGB pixels, got {len(self.pixels)}")
        return np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.height, self.width, 3)


def data_url_bytes(url: str) -> bytes:
    """The image a data: URL holds, as vLLM reads one: data:<image media type>;base64,<data>.
    ValueError (the reason) for any other form."""
    header, comma, data = url.removeprefix("data:").partition(",")
    if not comma:
        raise ValueError("a data: URL needs a comma before its data")
    media_type, *parameters = [p.strip() for p in header.split(";")]
    if not parameters or parameters[-1].lower() != "base64":
        raise ValueError("only base64 data: URLs are read (data:image/png;base64,...)")
    if not media_type.lower().startswith("image/"):
        raise ValueError(f"a data: URL of media type {media_type or 'text/plain'!r} is not an image")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as error:
        raise ValueError(f"the data is not valid base64: {error}") from None

