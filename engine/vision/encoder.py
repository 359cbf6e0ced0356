"""The vision encoder of Qwen3.5 vision-language checkpoints (`model.visual.*`): a ViT over the
patches of one or more images, ending in one embedding per merged group of merge x merge
patches, in the language model's hidden size (`out_hidden_size`).

Input is the image processor's `pixel_values`: one row per patch (in_channels x
temporal_patch_size x patch_size^2 values), each image's patches frame after frame and, within a
frame, in spatial-merge-block order (merge x merge blocks row-major, patches row-major inside a
block), with each image's (t, h, w) grid in patches. Images are packed into one batch but never
see each other: attention runs within one frame of one image. Output row g is merged group g of
that same order, so an image of grid (t, h, w) owns t * h * w / merge^2 consecutive rows.

It does not know tokens, where an image sits in the prompt (the M-RoPE positions), or
scheduling and caching of encoder outputs: the caller places the rows in the prompt's embeddings.
Parity reference: transformers' Qwen3_5VisionModel (pooler_output).
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from ..model_config import ConfigError
from ..weights import WeightLoadError, checkpoint_files

# hidden_act -> F.gelu's `approximate`: the checkpoints use the tanh form; "gelu" is HF's erf form.
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
_PREFIXES = ("model.visual.", "visual.")
_SCALE_SUFFIX = ".weight_scale_inv"
_CONV_WEIGHT = "patch_embed.proj.weight"
# A block's checkpoint module names -> ours.
_BLOCK_MODULES = {"norm1": "norm1", "norm2": "norm2", "attn.qkv": "qkv", "attn.proj": "proj",
                  "mlp.linear_fc1": "fc1", "mlp.linear_fc2": "fc2"}


@dataclass(frozen=True)
class VisionConfig:
    """A checkpoint's `vision_config`. The defaults are transformers' Qwen3_5VisionConfig's (what
    a config.json that leaves a key out means); rope_theta is its axial rope's default."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"vision_config {f.name} must be a positive int, got {value!r}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"vision_config hidden_act {self.hidden_act!r} is not supported "
                              f"(only {', '.join(_ACTIVATIONS)})")
        if not self.rope_theta > 0 or not self.layer_norm_eps > 0:
            raise ConfigError(f"vision_config rope_theta and layer_norm_eps must be positive, "
                              f"got {self.rope_theta!r}, {self.layer_norm_eps!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision_config hidden_size {self.hidden_size} is not a multiple of "
                              f"num_heads {self.num_heads}")
        if self.head_dim % 4:
            # The 2D rope gives rows and columns head_dim / 4 frequencies each, rotated over halves.
            raise ConfigError(f"vision_config head_dim {self.head_dim} is not a multiple of 4")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ConfigError(f"vision_config num_position_embeddings {self.num_position_embeddings} "
                              f"is not a perfect square (the learned table is a square grid)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one patch (a row of pixel_values)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        """Side of the square learned position table."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, raw: dict) -> "VisionConfig":
        """From config.json's `vision_config`; keys it lacks take the defaults, keys the encoder
        does not use (model_type, initializer_range, ...) are ignored."""
        raw = dict(raw)
        # HF's attribute_map aliases.
        for alias, name in (("num_attention_heads", "num_heads"), ("num_hidden_layers", "depth")):
            if alias in raw and name not in raw:
                raw[name] = raw[alias]
        if raw.get("deepstack_visual_indexes"):
            raise ConfigError(f"vision_config deepstack_visual_indexes {raw['deepstack_visual_indexes']!r} "
                              f"is not supported (Qwen3.5 has none)")
        rope = raw.get("rope_parameters") or {}
        # HF reads "default" (older checkpoints, or the legacy "type" key) as axial.
        rope_type = rope.get("rope_type", rope.get("type", "axial"))
        if rope_type not in ("axial", "default"):
            raise ConfigError(f"vision_config rope_type {rope_type!r} is not supported (only 'axial')")
        # rope_theta: in rope_parameters, or at the top level in older configs.
        theta = rope.get("rope_theta", raw.get("rope_theta", cls.rope_theta))
        values = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        return cls(**{**values, "rope_theta": float(theta)})


class CheckpointTensor(NamedTuple):
    """Where a checkpoint tensor goes: this module's parameter, and the shape it has in the
    checkpoint (the patch embedding's Conv3d weight differs from its linear parameter's)."""

    parameter: str
    shape: tuple[int, ...]


class _Block(nn.Module):
    """Pre-norm ViT block: x + proj(attention(rope(qkv(norm1 x)))), then x + fc2(act(fc1(norm2 x)))."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.approximate = _ACTIVATIONS[c.hidden_act]
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """x [N, hidden]; cos, signed sin [N, 1, 1, head_dim] float32 (`_rotate`)."""
        n = x.shape[0]
        qkv = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, self.head_dim)
        (q, k), v = _rotate(qkv[:, :2], cos, sin).unbind(1), qkv[:, 2]
        # Consecutive items of one frame size (a video's temporal patches, same-sized images)
        # share an SDPA call, their frames the batch: a frame attends to itself only, and no
        # mask spans more than one frame.
        runs: list[list[int]] = []
        for t, h, w in grids:
            if runs and runs[-1][1:] == [h, w]:
                runs[-1][0] += t
            else:
                runs.append([t, h, w])
        out, start = [], 0
        for t, h, w in runs:
            frame = slice(start, start + t * h * w)
            q_, k_, v_ = (y[frame].view(t, h * w, self.num_heads, self.head_dim).transpose(1, 2)
                          for y in (q, k, v))
            o = F.scaled_dot_product_attention(q_, k_, v_, scale=self.head_dim ** -0.5)
            out.append(o.transpose(1, 2).reshape(t * h * w, -1))
            start += t * h * w
        x = x + self.proj(torch.cat(out))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope over the whole head dim, in float32 (as HF), back in x's dtype; q and k
    together, x [N, 2, heads, head_dim]; cos, signed_sin [N, 1, 1, head_dim]. HF's
    rotate_half(y) * sin is cat(-y2, y1) * sin = roll(y, half) * cat(-sin1, sin2): the sign
    moved onto sin is exact, so the products and their sum round as HF's, in a third of the
    launches (the encoder is launch-bound at small images)."""
    y = x.float()
    return (y * cos + y.roll(x.shape[-1] // 2, dims=-1) * signed_sin).to(x.dtype)


class _Merger(nn.Module):
    """LayerNorm per patch, then each merge x merge group's patches concatenated [hidden * merge^2]
    -> fc1 -> GELU (erf) -> fc2 [out_hidden_size]."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        merged = c.hidden_size * c.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.fc1 = nn.Linear(merged, merged)
        self.fc2 = nn.Linear(merged, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.fc1.in_features)
        return self.fc2(F.gelu(self.fc1(x)))


def _merge_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[h, w, ...] in raster order -> [h * w, ...] in spatial-merge-block order."""
    h, w = grid.shape[:2]
    rest = grid.shape[2:]
    blocks = grid.reshape(h // merge, merge, w // merge, merge, *rest).transpose(1, 2)
    return blocks.reshape(h * w, *rest)


class VisionEncoder(nn.Module):
    """patches [sum t*h*w, patch_dim] + grids [(t, h, w)] -> [sum t*h*w / merge^2, out_hidden_size].

    Weights are in the model dtype; the position-embedding resampling and the rope are
    computed in float32 and cast, as HF does. Parameters start uninitialised: load them with
    `load_vision_encoder` (or fill them through `checkpoint_names`)."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = self.config = config
        with torch.device("meta"):  # no initialisation work: every parameter is loaded
            # Conv3d with kernel == stride over exactly one patch is a linear map over its
            # values in (channel, frame, row, col) order, the row layout of pixel_values.
            self.patch_embed = nn.Linear(c.patch_dim, c.hidden_size)
            self.pos_embed = nn.Parameter(torch.empty(c.num_position_embeddings, c.hidden_size))
            self.blocks = nn.ModuleList(_Block(c) for _ in range(c.depth))
            self.merger = _Merger(c)
        self.to(dtype).to_empty(device=device).requires_grad_(False)
        # Per-axis rope frequencies [head_dim / 4], float32, computed on the CPU as HF does. (A
        # later `.to(bfloat16)` would round them too, as it does HF's: build in the dtype instead.)
        half = c.head_dim // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.dtype

    def checkpoint_names(self) -> dict[str, CheckpointTensor]:
        """Checkpoint tensor name (without the `model.visual.` / `visual.` prefix) -> where it goes."""
        c = self.config
        conv_shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        modules = {"patch_embed.proj": "patch_embed", "merger.norm": "merger.norm",
                   "merger.linear_fc1": "merger.fc1", "merger.linear_fc2": "merger.fc2"}
        for i in range(c.depth):
            modules |= {f"blocks.{i}.{theirs}": f"blocks.{i}.{ours}" for theirs, ours in _BLOCK_MODULES.items()}
        shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        names = {f"{theirs}.{leaf}": CheckpointTensor(f"{ours}.{leaf}", shapes[f"{ours}.{leaf}"])
                 for theirs, ours in modules.items() for leaf in ("weight", "bias")}
        names[_CONV_WEIGHT] = CheckpointTensor("patch_embed.weight", conv_shape)
        names["pos_embed.weight"] = CheckpointTensor("pos_embed", shapes["pos_embed"])
        return names

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        grids = [tuple(int(v) for v in g) for g in grids]
        self._check(patches, grids)
        x = F.linear(patches.to(device=self.pos_embed.device, dtype=self.dtype),
                     self.patch_embed.weight, self.patch_embed.bias)
        x = x + self._position_embeddings(grids).to(x.dtype)
        cos, sin = self._rope(grids)
        for block in self.blocks:
            x = block(x, cos, sin, grids)
        return self.merger(x)

    def _check(self, patches: torch.Tensor, grids: list[tuple[int, ...]]) -> None:
        c, merge = self.config, self.config.spatial_merge_size
        if patches.dim() != 2 or patches.shape[1] != c.patch_dim:
            raise ValueError(f"patches must be [num_patches, {c.patch_dim}], got {list(patches.shape)}")
        for grid in grids:
            if len(grid) != 3 or min(grid) <= 0 or grid[1] % merge or grid[2] % merge:
                raise ValueError(f"grid {grid} is not (t, h, w) with h and w positive multiples of {merge}")
        if sum(t * h * w for t, h, w in grids) != patches.shape[0]:
            raise ValueError(f"grids {grids} hold {sum(t * h * w for t, h, w in grids)} patches, "
                             f"patches has {patches.shape[0]}")

    def _position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned square table resampled to each image's (h, w) like F.interpolate(bilinear,
        align_corners=True), in merge-block order, repeated over frames: [N, hidden] float32."""
        side, merge = self.config.grid_side, self.config.spatial_merge_size
        table = self.pos_embed.float().view(side, side, -1)
        device = table.device
        out = []
        for t, h, w in grids:
            (r0, r1, wr0, wr1), (c0, c1, wc0, wc1) = (_taps(n, side, device) for n in (h, w))
            grid = sum(table[rows[:, None], cols[None, :]] * (wr[:, None] * wc[None, :])[..., None]
                       for rows, wr in ((r0, wr0), (r1, wr1)) for cols, wc in ((c0, wc0), (c1, wc1)))
            out.append(_merge_order(grid, merge).repeat(t, 1))
        return torch.cat(out)

    def _rope(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [N, 1, 1, head_dim] float32 of each patch's (row, col): angles laid
        out [row freqs | col freqs | row freqs | col freqs], each head_dim / 4 wide."""
        merge, device = self.config.spatial_merge_size, self.inv_freq.device
        out = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device, dtype=torch.float32)[:, None] * self.inv_freq
            cols = torch.arange(w, device=device, dtype=torch.float32)[:, None] * self.inv_freq
            angles = torch.cat((rows[:, None].expand(h, w, -1), cols[None].expand(h, w, -1)), dim=-1)
            out.append(_merge_order(angles, merge).repeat(t, 1))
        angles = torch.cat(out)
        sin = angles.sin()
        # [N, 1, 1, head_dim]: broadcast over q/k and heads; sin's first half negated (`_rotate`).
        return (torch.cat((angles, angles), dim=-1).cos()[:, None, None],
                torch.cat((-sin, sin), dim=-1)[:, None, None])


def _taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Bilinear align_corners=True taps of `size` target positions into a `side`-long axis:
    (lower index, upper index, lower weight, upper weight), float32 weights, as HF computes them."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    frac = src - floor
    lower = floor.long()
    # At the last source position the upper tap falls off the table; its weight is 0 there.
    return lower, (lower + 1).clamp(max=side - 1), 1 - frac, frac


def _strip(name: str) -> str | None:
    """A checkpoint name without its vision prefix; None for tensors outside the vision tower."""
    prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
    return None if prefix is None else name[len(prefix):]


def _dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block FP8 [N, K] with scale_inv [ceil(N / bn), ceil(K / bk)] -> float32 [N, K]."""
    rows, columns = weight.shape
    bn, bk = block
    scale = scale_inv.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :columns]
    return weight.float() * scale


def load_vision_encoder(path: Path, config: VisionConfig, dtype: torch.dtype, device: torch.device | str,
                        fp8_block: tuple[int, int] = (128, 128)) -> VisionEncoder:
    """The vision encoder of the checkpoint at `path`, from its `model.visual.*` (or `visual.*`)
    tensors only. An FP8 (float8_e4m3fn) weight with a `weight_scale_inv` block scale over
    fp8_block (rows, columns) blocks is dequantized to `dtype`. Every missing, unexpected, doubled
    or mis-shaped tensor is listed in one WeightLoadError."""
    encoder = VisionEncoder(config, dtype, device)
    targets = encoder.checkpoint_names()
    params = dict(encoder.named_parameters())
    missing, unexpected, mismatched, doubled, wrong_dtype = [], [], [], [], []
    with ExitStack() as stack:
        located: dict[str, list[tuple[str, Any]]] = defaultdict(list)  # stripped name -> [(raw name, open file)]
        for file in checkpoint_files(Path(path)):
            try:
                f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise WeightLoadError(f"cannot read {file}: {e}") from None
            for raw in f.keys():
                if (name := _strip(raw)) is not None:
                    located[name].append((raw, f))
        for name, entries in located.items():
            if len(entries) > 1:
                doubled.append(", ".join(raw for raw, _ in entries))
            weight = name.removesuffix(_SCALE_SUFFIX) + ".weight"
            if name not in targets and not (name.endswith(_SCALE_SUFFIX) and weight in targets):
                unexpected.extend(raw for raw, _ in entries)

        def read(name: str) -> torch.Tensor:
            raw, f = located[name][0]
            try:
                return f.get_tensor(raw)
            except Exception as e:
                raise WeightLoadError(f"cannot read tensor {raw}: {e}") from None

        for name, (parameter, shape) in targets.items():
            if name not in located:
                missing.append(name)
                continue
            tensor = read(name)
            scale_name = name.removesuffix(".weight") + _SCALE_SUFFIX
            if tensor.dtype == torch.float8_e4m3fn:
                if scale_name not in located or tensor.dim() != 2:
                    wrong_dtype.append(f"{name}: float8_e4m3fn without a {_SCALE_SUFFIX} block scale "
                                       f"(only 2-D block-FP8 weights are dequantized)")
                    continue
                scale = read(scale_name)
                blocks = tuple(-(-n // b) for n, b in zip(tensor.shape, fp8_block))
                if tuple(scale.shape) != blocks:
                    mismatched.append(f"{scale_name}: expected {list(blocks)}, got {list(scale.shape)}")
                    continue
                tensor = _dequantize(tensor, scale, fp8_block)
            elif scale_name in located:
                unexpected.append(f"{scale_name} (the weight is {tensor.dtype}, not float8_e4m3fn)")
            if tuple(tensor.shape) != shape:
                mismatched.append(f"{name}: expected {list(shape)}, got {list(tensor.shape)}")
                continue
            params[parameter].data.copy_(tensor.reshape(params[parameter].shape))
    problems = []
    for what, items, sep in (("missing tensors", missing, ", "), ("tensors with the wrong shape", mismatched, "; "),
                             ("unexpected tensors", unexpected, ", "), ("tensors given twice", doubled, "; "),
                             ("tensors with the wrong dtype", wrong_dtype, "; ")):
        if items:
            problems.append(f"{what} ({len(items)}): " + sep.join(items))
    if any(raw.endswith((".qweight", ".weight_packed")) for raw in unexpected):
        problems.insert(0, "the vision tower is stored as packed integers (GPTQ / AWQ / compressed-tensors), which "
                           "deltaspec does not load: serve the language model alone (--language-model-only)")
    if problems:
        raise WeightLoadError(f"checkpoint {path} does not match its vision_config:\n  " + "\n  ".join(problems))
    return encoder.eval()


def random_vision_encoder(config: VisionConfig, dtype: torch.dtype, device: torch.device | str,
                          seed: int = 0) -> VisionEncoder:
    """An encoder of the config's shapes with random weights at a trained model's scales
    (LayerNorm weights ~1, vectors ~0.1, matrices ~1/sqrt(fan-in)): benchmarks of real sizes
    without their checkpoints (EngineConfig.load_format "dummy")."""
    encoder = VisionEncoder(config, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, p in encoder.named_parameters():
        if p.dim() == 1:
            layer_norm_weight = ".norm" in name and name.endswith(".weight")
            p.data.normal_(1.0 if layer_norm_weight else 0.0, 0.1, generator=generator)
        else:
            p.data.normal_(0.0, p.shape[-1] ** -0.5, generator=generator)
    return encoder.eval()

