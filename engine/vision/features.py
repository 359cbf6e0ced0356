"""The vision encoder's outputs where a step's tokens take them, with a cache of encoded images
(and video patches, which the encoder reads as it reads images).

A prefill chunk (or the MTP's run over it) that feeds some of a prompt's image tokens takes, at
each such token, its image's encoder output for it in place of the token's embedding
(`ForwardBatch.embeds`). An image is encoded once, when a step first needs any of its tokens,
and kept on the device (keyed by its digest) while later chunks of its prompt, the MTP's run
over them, another choice of the prompt or another request with the same image need it; the
least recently used are dropped past a byte budget. Under tensor parallelism rank 0 encodes and
broadcasts a step's features to the other ranks. Knows nothing of scheduling: a step's windows
say which tokens sit where.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import torch

from ..tensor_parallel import TensorParallel
from .encoder import VisionEncoder
from .image import ImageInput
from .preprocess import ImageProcessor
from .prompt import PromptImages
from .video import VideoProcessor

# Device bytes of encoder outputs kept between steps. The largest image Qwen3.5's processor
# makes (16M pixels: 16384 tokens) is 128 MB of features at a hidden size of 4096 in bf16; an
# image a step needs is kept whatever its size.
CACHE_BYTES = 256 << 20

# Patches the encoder takes in one call at most: the largest image Qwen3.5's processor makes
# (16M pixels over 16 x 16 patches). Its activations (a few GB at the published widths) are what
# the memory the pools leave must hold.
ENCODE_PATCHES = 65536

# A window of a step's batch: tokens start..end-1 of a request whose prompt holds `images`
# sit at batch tokens offset.. (offset + end - start - 1).
Window = tuple[int, PromptImages, int, int]


class ImageFeatures:
    def __init__(self, encoder: VisionEncoder | None, processor: ImageProcessor | None,
                 video_processor: VideoProcessor | None, hidden_size: int, tp: TensorParallel | None = None,
                 cache_bytes: int = CACHE_BYTES) -> None:
        """encoder, processor, video_processor: rank 0's (one device's). Under tensor parallelism
        (tp) rank 0 encodes and broadcasts each step's features; a worker has none (None) and
        receives them, its windows telling it how many (its requests' images carry no pixels)."""
        self.encoder, self.tp, self.cache_bytes = encoder, tp, cache_bytes
        self.processor, self.video_processor = processor, video_processor
        self.hidden_size = hidden_size
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()   # digest -> [tokens, H]

    def embeds(self, windows: Sequence[Window], device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(batch token indices [M], embeddings [M, H] in dtype) of the image tokens in the
        windows, on the device, or None when they hold none. Images not cached are encoded
        together, in one call."""
        pieces = [(offset + images.starts[i] + first - start, images.images[i], first, last)
                  for offset, images, start, end in windows for i, first, last in images.spans(start, end)]
        if not pieces:
            return None
        index = torch.cat([torch.arange(at, at + last - first) for at, _, first, last in pieces]).to(device)
        if self.encoder is None:  # a worker: rank 0's features, broadcast below
            values = torch.empty(len(index), self.hidden_size, dtype=dtype, device=device)
        else:
            needed = {image.digest: image for _, image, _, _ in pieces}
            self._encode([image for digest, image in needed.items() if digest not in self._cache])
            for digest in needed:
                self._cache.move_to_end(digest)
            values = torch.cat([self._cache[image.digest][first:last] for _, image, first, last in pieces])
            self._evict(keep=needed.keys())
        if self.tp is not None:
            self.tp.broadcast(values)
        return index, values

    def _encode(self, images: list[ImageInput]) -> None:
        """Encode images together, in calls of at most ENCODE_PATCHES patches (an image larger
        than that alone): the encoder's activations stay those of one large image however many
        a step brings."""
        calls: list[list[tuple[ImageInput, tuple[int, int, int]]]] = []
        patches_in_call = 0
        for image in images:
            grid = self._processor(image).grid_thw(image)
            if not calls or patches_in_call + math.prod(grid) > ENCODE_PATCHES:
                calls.append([])
                patches_in_call = 0
            calls[-1].append((image, grid))
            patches_in_call += math.prod(grid)
        device = next(self.encoder.parameters()).device
        for call in calls:
            patches = torch.cat([self._processor(image).patchify(image, device) for image, _ in call])
            features = self.encoder(patches, [grid for _, grid in call])
            parts = features.split([self._processor(image).num_tokens(image) for image, _ in call])
            for (image, _), part in zip(call, parts):
                self._cache[image.digest] = part

    def _processor(self, item: ImageInput) -> ImageProcessor | VideoProcessor:
        return self.video_processor if item.video else self.processor

    def _evict(self, keep) -> None:
        total = sum(t.numel() * t.element_size() for t in self._cache.values())
        for digest in list(self._cache):
            if total <= self.cache_bytes:
                break
            if digest not in keep:
                total -= self._cache[digest].numel() * self._cache[digest].element_size()
                del self._cache[digest]
