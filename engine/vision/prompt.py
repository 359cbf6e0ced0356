"""Where a prompt's images and videos sit, and the multimodal RoPE positions that follow from it.

A prompt names each image with the model's image token (`<|image_pad|>`, as Qwen3.5's chat
template writes it once per image); the model replaces one such token per merged patch group
with the vision encoder's output, so each image's token is repeated `num_tokens` times
(`expand_image_tokens`). A video is named by one video token (`<|video_pad|>`, between vision
start and end tokens), which becomes, for each of its temporal patches, the patch's time as
text and the patch's tokens between vision start and end tokens (`expand_video_tokens`, vLLM's
Qwen3-VL rule), so a video's patches sit in the prompt as images do, separated by their times.
Each image's or patch's tokens form one run; `PromptImages` records the runs.

Multimodal RoPE (M-RoPE, Qwen2-VL onwards) rotates every token by three positions (temporal,
height, width). A text token's three are equal: its index plus the shift the images before it
leave (`delta`). An image of grid (t, h, w) merged to (t, h/m, w/m) gives its token (i, j, k)
the positions (p + i, p + j, p + k), p the position of the image's first token; the text after
it continues from p + max(h, w)/m, so the positions fall behind the token indices by
num_tokens - max(h, w)/m each image. A video patch is an image of grid (1, h, w) (HF splits a
video's grid per patch). Generated tokens are text: index + delta, one shift for the whole
request. Knows nothing of pixels or the encoder beyond each item's grid.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from .image import ImageInput, VideoInput


def expand_image_tokens(token_ids: Sequence[int], images: Sequence[ImageInput], image_token_id: int,
                        num_tokens: Callable[[ImageInput], int]) -> list[int]:
    """The prompt with image i's token repeated num_tokens(images[i]) times. The prompt holds
    one image token per image (as a chat template writes them), or already every token of each
    image in order (returned as it is); any other count is a ValueError naming both."""
    count = sum(1 for t in token_ids if t == image_token_id)
    wanted = [num_tokens(image) for image in images]
    if count == sum(wanted):
        return list(token_ids)
    if count != len(images):
        raise ValueError(f"the prompt holds {count} image tokens ({image_token_id}) for {len(images)} images: one per "
                         f"image (the chat template's placeholder), or {sum(wanted)} (each image's tokens)")
    expanded, next_image = [], 0
    for token in token_ids:
        if token == image_token_id:
            expanded += [token] * wanted[next_image]
            next_image += 1
        else:
            expanded.append(token)
    return expanded


def expand_video_tokens(token_ids: Sequence[int], videos: Sequence[VideoInput], video_token_id: int,
                        vision_start_id: int, vision_end_id: int, num_tokens: Callable[[ImageInput], int],
                        text_ids: Callable[[str], list[int]]) -> list[int]:
    """The prompt with video i's placeholder replaced by, for each of its temporal patches p,
    `<{t_p:.1f} seconds><|vision_start|><|video_pad|> * num_tokens(p)<|vision_end|>` (text_ids
    tokenizes the time: it sits between special tokens, so alone it tokenizes as in context).
    The placeholder is the chat template's `<|vision_start|><|video_pad|><|vision_end|>` whole, as
    vLLM and HF's Qwen3VLProcessor before transformers 5 replace it (the form Qwen3-VL and Qwen3.5
    were trained on: no vision start before a patch's time), else a bare video token. The prompt
    holds one placeholder per video, or already each video in the replaced form (returned as it
    is); anything else is a ValueError naming both."""
    def patch_tokens(patch: ImageInput, seconds: float) -> list[int]:
        return [*text_ids(f"<{seconds:.1f} seconds>"), vision_start_id, *[video_token_id] * num_tokens(patch),
                vision_end_id]

    token_ids = list(token_ids)
    at = [i for i, t in enumerate(token_ids) if t == video_token_id]
    wanted = [sum(num_tokens(patch) for patch in video.patches) for video in videos]
    if len(at) == sum(wanted) and _expanded(token_ids, at, [(patch_tokens(p, t), num_tokens(p)) for video in videos
                                                             for p, t in zip(video.patches, video.timestamps)]):
        return token_ids
    if len(at) != len(videos):
        raise ValueError(f"the prompt holds {len(at)} video tokens ({video_token_id}) for {len(videos)} videos: one "
                         f"per video (the chat template's placeholder), or each video's times and tokens "
                         f"({sum(wanted)} video tokens)")
    expanded, start = [], 0
    for i, video in zip(at, videos):
        wrapped = (0 < i < len(token_ids) - 1 and token_ids[i - 1] == vision_start_id
                   and token_ids[i + 1] == vision_end_id)
        expanded += token_ids[start:i - wrapped]
        for patch, seconds in zip(video.patches, video.timestamps):
            expanded += patch_tokens(patch, seconds)
        start = i + 1 + wrapped
    return expanded + token_ids[start:]


def _expanded(token_ids: list[int], at: list[int], patches: list[tuple[list[int], int]]) -> bool:
    """Whether the prompt already holds each patch's tokens (`expand_video_tokens`' form: its
    time, vision start, its `count` video tokens, vision end) where its video tokens are
    (`at`: the video tokens' indices), in order."""
    first = 0
    for tokens, count in patches:
        start = at[first] - (len(tokens) - count - 1)  # the time and vision start come first
        if start < 0 or token_ids[start:start + len(tokens)] != tokens:
            return False
        first += count
    return True


# Prefix-cache key ids of image tokens are negative (token ids never are) and derived from the
# image's digest and the token's index within the image: equal for equal images at equal places,
# apart for any other image. (2^62: the keys stay int64 however many tokens an image has.)
_KEY_SPAN = 1 << 62


@dataclass(frozen=True, eq=False)
class PromptImages:
    """A prompt's images and video patches (`ImageInput.video`) in prompt order: item i's tokens
    are [starts[i], starts[i] + counts[i]) of the prompt, its patch grid grids[i] (t, h, w),
    merged merge x merge into a token. positions [3, prompt length] int64: the prompt's
    multimodal RoPE positions; delta: a token past the prompt turns by its index + delta on every
    axis."""

    images: tuple[ImageInput, ...]
    starts: tuple[int, ...]
    grids: tuple[tuple[int, int, int], ...]
    merge: int
    positions: np.ndarray
    delta: int

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(t * h * w // self.merge ** 2 for t, h, w in self.grids)

    @classmethod
    def place(cls, token_ids: Sequence[int], items: Sequence[ImageInput], grids: Sequence[tuple[int, int, int]],
              merge: int, image_token_id: int, video_token_id: int | None = None) -> "PromptImages":
        """Where each item sits in an expanded prompt (`expand_image_tokens`,
        `expand_video_tokens`): the images, in order, on the runs of image tokens, the video
        patches, in order, on the runs of video tokens, counts[i] tokens each, which must be one
        run. ValueError otherwise."""
        ids = np.asarray(token_ids, dtype=np.int64)
        placed = []  # (start, item, grid)
        for video, token, name in ((False, image_token_id, "image"), (True, video_token_id, "video")):
            kind = [(item, tuple(grid)) for item, grid in zip(items, grids) if item.video == video]
            at = np.flatnonzero(ids == token) if token is not None else np.empty(0, dtype=np.int64)
            counts = [t * h * w // merge ** 2 for _, (t, h, w) in kind]
            if len(at) != sum(counts):
                raise ValueError(f"the prompt holds {len(at)} {name} tokens ({token}); its {len(kind)} "
                                 f"{'video patches' if video else 'images'} take {sum(counts)}")
            first = 0
            for i, ((item, grid), count) in enumerate(zip(kind, counts)):
                run = at[first:first + count]
                if run[-1] - run[0] != count - 1:
                    raise ValueError(f"{name} {'patch ' if video else ''}{i}'s {count} tokens are not one run in "
                                     f"the prompt")
                placed.append((int(run[0]), item, grid))
                first += count
        placed.sort(key=lambda p: p[0])
        starts = [start for start, _, _ in placed]
        grids = [grid for _, _, grid in placed]
        positions, delta = _mrope_positions(len(ids), starts, grids, merge)
        return cls(tuple(item for _, item, _ in placed), tuple(starts), tuple(grids), merge, positions, delta)

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] int64: the positions of tokens start..end-1 (past the prompt: index + delta)."""
        prompt = self.positions.shape[1]
        inside = self.positions[:, min(start, prompt):min(end, prompt)]
        past = np.arange(max(start, prompt), max(end, prompt), dtype=np.int64) + self.delta
        return np.concatenate([inside, np.broadcast_to(past, (3, len(past)))], axis=1)

    def rope(self, start: int, end: int) -> tuple[np.ndarray | None, int]:
        """How tokens start..end-1 turn, as batch.Row takes it: (None, d) when their positions
        are their indices + d on every axis (a text run: no image token among them), else
        (positions [3, n], 0)."""
        positions = self.rope_positions(start, end)
        if self.spans(start, end):
            return positions, 0
        return None, int(positions[0, 0]) - start

    def without_pixels(self) -> "PromptImages":
        """This placement with its images' pixels left out (digests and sizes kept): what a
        tensor-parallel worker needs, which receives the encoder's outputs from rank 0."""
        return replace(self, images=tuple(ImageInput(b"", i.height, i.width, i.digest, i.frames, i.video)
                                          for i in self.images))

    def spans(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The image tokens among tokens start..end-1: (image, first, last) per image touched,
        tokens first..last-1 of image `image` (its own numbering), in prompt order."""
        touched = []
        for i, (first, count) in enumerate(zip(self.starts, self.counts)):
            lo, hi = max(start, first), min(end, first + count)
            if lo < hi:
                touched.append((i, lo - first, hi - first))
        return touched

    def key_ids(self, token_ids: Sequence[int]) -> list[int]:
        """token_ids (the request's first tokens) with each image token replaced by its image's
        key id for it: the prefix cache's key, so two prompts match only over equal images."""
        keys = np.asarray(token_ids, dtype=np.int64).copy()
        for image, first, count in zip(self.images, self.starts, self.counts):
            stop = min(first + count, len(keys))
            if first < stop:
                base = int.from_bytes(image.digest[:8], "little") % _KEY_SPAN
                keys[first:stop] = -1 - (base + np.arange(stop - first, dtype=np.int64)) % _KEY_SPAN
        return keys.tolist()


def rope(images: PromptImages | None, start: int, end: int) -> tuple[np.ndarray | None, int]:
    """How tokens start..end-1 of a prompt with these images (None: a text prompt, whose
    positions are its indices) turn under RoPE, as batch.Row takes it (PromptImages.rope)."""
    return (None, 0) if images is None else images.rope(start, end)


def _mrope_positions(length: int, starts: Sequence[int], grids: Sequence[tuple[int, int, int]],
                     merge: int) -> tuple[np.ndarray, int]:
    """HF Qwen3.5's get_rope_index for one prompt: text runs count on from the position after
    the previous run; an image's merged grid (t, h, w) takes (p + i, p + j, p + k) and moves
    the next position to p + max(h, w) (its temporal index is i, one per frame: 0 for an
    image). Returns (positions [3, length], delta = max position + 1 - length)."""
    positions = np.empty((3, length), dtype=np.int64)
    index = position = 0
    for start, (t, h, w) in zip(starts, grids):
        positions[:, index:start] = position + np.arange(start - index)
        position += start - index
        h, w = h // merge, w // merge
        frame, row, col = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        positions[:, start:start + t * h * w] = position + np.stack([frame.ravel(), row.ravel(), col.ravel()])
        position += max(h, w)
        index = start + t * h * w
    positions[:, index:] = position + np.arange(length - index)
    return positions, int(positions.max(initial=-1)) + 1 - length
