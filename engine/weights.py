"""Load an HF-format checkpoint (sharded safetensors) into a `HybridLM`.

Handles both projection layouts (Qwen3-Next fused, grouped per key head `in_proj_qkvz` /
`in_proj_ba`; Qwen3.5 split `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`), the
`model.language_model.` prefix of multimodal checkpoints (vision weights are skipped), MoE
experts per expert or fused, tied embeddings, and optional `mtp.*` weights. Checkpoint names
are first normalised to one canonical scheme; the model's `checkpoint_map` then says where each
tensor goes. Block-FP8 checkpoints (engine/quantization.py) load as they are stored: float8
weights, and their `weight_scale_inv` block scales repeated over each block's rows (so fused
and regrouped projections split them row by row, as they split the weights); an unquantized
checkpoint loaded with online FP8 goes through engine/online_quantization.py first and then
takes the same path. Any problem ends in one `WeightLoadError` listing every missing, unexpected
or mis-shaped tensor. Knows nothing about the forward pass.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..kernels import Ops
from ..kernels.fp8 import FP8
from . import online_quantization
from .model_config import ModelConfig
from .models import HybridLM
from .quantization import Fp8Config, Wna16Config, canonical_module, with_checkpoint_modules
from .wna16_tensors import canonical_stream
from .sharding import NotThisRank, Sharding, shard_config
from .tensor_parallel import TensorParallel

_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
_PROGRESS_BAR_BYTES = 256 << 20


class WeightLoadError(ValueError):
    """A checkpoint that does not match the model it claims to be."""


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise WeightLoadError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    return files


def _canonical_name(name: str) -> str | None:
    """Strip layout prefixes; None for tensors deltaspec never uses (vision tower)."""
    return None if name.startswith(_VISION_PREFIXES) else canonical_module(name)


_FUSED_LEAVES = ("weight", "weight_scale_inv", "weight_scale", "weight_zero_point", "g_idx")
_FUSED_PROJECTIONS = tuple(f"{projection}.{leaf}" for projection in ("in_proj_qkvz", "in_proj_ba")
                           for leaf in _FUSED_LEAVES)
_SCALE_SUFFIX = ".weight_scale_inv"


def _split_fused_projections(name: str, tensor: torch.Tensor, c: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next stores q|k|v|z and b|a grouped per key head: [HK, (K, K, rV, rV), H] and
    [HK, (r, r), H] with r = HV/HK. Yield the flat (Qwen3.5) layout instead. A tensor of one
    row per weight row (a block scale already repeated over rows, maybe past the last row; packed
    integers, their group scales and zero points) is regrouped the same way; an act-order g_idx
    (one entry per input column) belongs to both halves."""
    stem, _, suffix = name.partition(".in_proj_")
    projection, leaf = suffix.split(".", 1)
    halves = ("qkv", "z") if projection == "qkvz" else ("b", "a")
    if leaf == "g_idx":
        for half in halves:
            yield f"{stem}.in_proj_{half}.{leaf}", tensor
        return
    hk, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    plain_weight = leaf == "weight" and tensor.is_floating_point()   # bf16 or FP8: [N, H]
    columns = c.hidden_size if plain_weight else tensor.shape[-1]
    num_rows = hk * (2 * dk + 2 * r * dv) if projection == "qkvz" else hk * 2 * r
    if not plain_weight and tensor.dim() == 2 and tensor.shape[0] >= num_rows:
        tensor = tensor[:num_rows]
    if tuple(tensor.shape) != (num_rows, columns):
        raise _ShapeMismatch(name, (num_rows, columns), tuple(tensor.shape))
    flat = lambda t: t.reshape(-1, columns)
    if projection == "qkvz":
        q, k, v, z = tensor.view(hk, -1, columns).split((dk, dk, r * dv, r * dv), dim=1)
        yield f"{stem}.in_proj_qkv.{leaf}", torch.cat([flat(q), flat(k), flat(v)])
        yield f"{stem}.in_proj_z.{leaf}", flat(z)
    else:
        b, a = tensor.view(hk, 2 * r, columns).split((r, r), dim=1)
        yield f"{stem}.in_proj_b.{leaf}", flat(b)
        yield f"{stem}.in_proj_a.{leaf}", flat(a)


def _block_count(size: int, block: int) -> int:
    return -(-size // block)


class _ShapeMismatch(Exception):
    def __init__(self, name: str, expected: tuple, got: tuple) -> None:
        self.line = f"{name}: expected {list(expected)}, got {list(got)}"


def _normalise(name: str, tensor: torch.Tensor, c: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    q = c.quantization
    if isinstance(q, Fp8Config) and q.scale_name != _SCALE_SUFFIX[1:] and name.endswith(f".{q.scale_name}"):
        name = name.removesuffix(f".{q.scale_name}") + _SCALE_SUFFIX   # compressed-tensors' name, the same scales
    if name.endswith(_SCALE_SUFFIX) and q is not None and tensor.dim() == 2:
        # [ceil(N / bn), KB] -> [ceil(N / bn) * bn, KB]: one scale per weight row; the copy
        # trims the rows past N (kernels/fp8.py says why scales are kept per row).
        tensor = tensor.float().repeat_interleave(q.weight_block_size[0], dim=0)
    if name.endswith(_FUSED_PROJECTIONS) and (q is not None or not name.endswith(_SCALE_SUFFIX)):
        yield from _split_fused_projections(name, tensor, c)
    elif name.endswith("conv1d.weight") and tensor.dim() == 3:
        yield name, tensor.squeeze(1)   # [C, 1, W] depthwise conv -> [C, W]
    else:
        yield name, tensor


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise WeightLoadError(f"cannot read {file}: {e}") from None


def _checkpoint_names(files: list[Path]) -> dict[str, Path]:
    names = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                names[name] = file
    return names


def load_model(path: str | Path, ops: Ops, dtype: torch.dtype, device: torch.device | str,
               config: ModelConfig | None = None, quantize_online: bool = False, tp: TensorParallel | None = None,
               expert_parallel: bool = False) -> HybridLM:
    """Build the model for the checkpoint at `path` and fill every parameter from it. Under
    tensor parallelism (tp) this rank's shard, reading only its slices of each tensor.
    quantize_online: the checkpoint is unquantized and `config` says block FP8
    (quantization.with_online_quantization): its projections (this rank's slices) are quantized
    as they are read."""
    path = Path(path)
    config = config or ModelConfig.from_file(path)
    files = checkpoint_files(path)
    names = _checkpoint_names(files)
    config = with_checkpoint_modules(config, names)
    sharding = Sharding(config, tp.rank, tp.size, expert_parallel) if tp is not None else None
    shard = shard_config(config, tp.size, tp.rank, expert_parallel) if tp is not None else config
    total_bytes = sum(f.stat().st_size for f in files)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights",
              disable=total_bytes < _PROGRESS_BAR_BYTES or (tp is not None and tp.rank > 0)) as bar:
        tensors = read_tensors(files, sharding, bar)
        if isinstance(config.quantization, Wna16Config):   # each format's tensors in the packed layout
            tensors = _canonical_packed(tensors, config.quantization, sharding)
        return model_from_tensors(shard, tensors, ops, dtype, device,
                                  with_mtp=any((_canonical_name(n) or "").startswith("mtp.") for n in names),
                                  quantize_online=quantize_online, tp=tp)


def _canonical_packed(tensors: Iterable[tuple[str, torch.Tensor]], q: Wna16Config,
                      sharding: Sharding | None) -> Iterator[tuple[str, torch.Tensor]]:
    """wna16_tensors.canonical_stream, a cut it refuses as a WeightLoadError."""
    try:
        yield from canonical_stream(tensors, q, sharding)
    except WeightLoadError:
        raise
    except ValueError as e:
        raise WeightLoadError(str(e)) from None


def random_model(config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel | None = None, expert_parallel: bool = False, seed: int = 0) -> HybridLM:
    """A model of the config's shapes (with its MTP layer) and random weights at the scales a
    trained model has (A_log in [0, 2.7], vectors ~0.1, matrices ~1/sqrt(fan-in)): benchmarks of
    real sizes without their checkpoints (EngineConfig.load_format "dummy"). A config with
    block-FP8 quantization gets random e4m3 values and block scales of the same magnitude, drawn
    in place (no bf16 copy: a 35B-A3B-shape model fits one H100); weight-only integers random
    packed values with group scales that give the bf16 weights' magnitude."""
    shard = shard_config(config, tp.size, tp.rank, expert_parallel) if tp is not None else config
    with torch.device(device):
        model = HybridLM(shard, ops, dtype, with_mtp=True, tp=tp)
    generator = torch.Generator(device=device).manual_seed(seed + (tp.rank if tp is not None else 0))
    q = config.quantization
    for name, p in model.named_parameters():
        if p.dtype == FP8:                     # block FP8: e4m3 values ~N(0, 64) ...
            for chunk in p.data.view(-1, p.shape[-1]).split(4096):
                chunk.copy_(torch.randn(chunk.shape, device=device, generator=generator).mul_(64).clamp_(-448, 448))
        elif p.dtype in (torch.int32, torch.uint8):   # packed integers (any bits) and zero points (mid-range)
            if p.dtype == torch.uint8:
                p.data.fill_(1 << (q.bits - 1))
            else:
                p.data.random_(-2 ** 31, 2 ** 31, generator=generator)
        elif name.endswith("_scale") and isinstance(q, Wna16Config):
            # uniform values in [0, 2^bits) about the zero: std 2^bits / sqrt(12) a step
            fan_in = p.shape[-1] * q.group_size
            p.data.fill_(fan_in ** -0.5 / (2 ** q.bits / 12 ** 0.5))
        elif name.endswith("_scale"):          # ... times 1 / (64 sqrt(fan-in)): the bf16 weights' scale
            p.data.fill_((p.shape[-1] * 128) ** -0.5 / 64)
        elif name.endswith("A_log"):
            p.data.uniform_(0.0, 2.7, generator=generator)
        elif p.dim() == 1:
            p.data.normal_(0.0, 0.1, generator=generator)
        else:
            p.data.normal_(0.0, p.shape[-1] ** -0.5, generator=generator)
    model.finish_loading()
    return model.eval()


def model_from_tensors(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], ops: Ops,
                       dtype: torch.dtype, device: torch.device | str, with_mtp: bool,
                       quantize_online: bool = False, tp: TensorParallel | None = None) -> HybridLM:
    """Build the model and fill it from (checkpoint name, tensor) pairs, e.g. an HF state_dict
    (quantize_online: as load_model). config: the model or (under tensor parallelism) this
    rank's shard of it, and the tensors this rank's slices; a weight-only integer checkpoint's in
    the canonical packed layout (wna16_tensors.canonical_stream)."""
    with torch.device(device):
        model = HybridLM(config, ops, dtype, with_mtp=with_mtp, tp=tp)
    if quantize_online:
        tensors = online_quantization.quantize_online(tensors, config.quantization, device)
    _fill(model, tensors, config)
    try:
        model.finish_loading()
    except ValueError as e:  # an act-order checkpoint whose column orders cannot be followed
        raise WeightLoadError(str(e)) from None
    return model.eval()


def read_tensors(files: list[Path], sharding: Sharding | None = None,
                 bar: tqdm | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the files; with a sharding, only this rank's slices
    (safetensors reads just those bytes) and no tensor that is wholly another rank's (a
    weight-only integer checkpoint's packed tensors whole: wna16_tensors.canonical_stream cuts
    them)."""
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                try:
                    tensor = _read(f, name, sharding)
                except NotThisRank:
                    continue
                except ValueError as e:  # a split that cuts an FP8 scale block
                    raise WeightLoadError(str(e)) from None
                except Exception as e:
                    raise WeightLoadError(f"cannot read tensor {name} from {file}: {e}") from None
                if bar is not None:
                    bar.update(tensor.numel() * tensor.element_size())
                yield name, tensor


def _read(f, name: str, sharding: Sharding | None) -> torch.Tensor:
    canonical = _canonical_name(name)
    if sharding is None or canonical is None:
        return f.get_tensor(name)
    tensor = f.get_slice(name)
    pieces = sharding.pieces(canonical, tuple(tensor.get_shape()))
    if pieces is None:
        return f.get_tensor(name)
    parts = [tensor[(slice(None),) * dim + (slice(start, stop),)] for dim, start, stop in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0][0])


def _fill(model: HybridLM, tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig) -> None:
    mapping = model.checkpoint_map()
    params = dict(model.named_parameters())
    covered: dict[str, int] = defaultdict(int)
    seen: set[str] = set()
    unexpected, mismatched, duplicated, wrong_dtype = [], [], [], []
    for raw_name, tensor in tensors:
        name = _canonical_name(raw_name)
        if name is None or (name == "lm_head.weight" and model.lm_head is None) \
                or (name.startswith("mtp.") and model.mtp is None):
            continue
        try:
            pieces = list(_normalise(name, tensor, config))
        except _ShapeMismatch as e:
            mismatched.append(e.line)
            continue
        for canonical, piece in pieces:
            if canonical not in mapping:
                unexpected.append(f"{raw_name} {list(piece.shape)}")
                continue
            if canonical in seen:
                duplicated.append(canonical)
                continue
            seen.add(canonical)
            param_name, index = mapping[canonical]
            target = params[param_name].data[index]
            if canonical.endswith(_SCALE_SUFFIX):
                piece = _trim_scale_rows(piece, target, config)
                if piece.shape[-1] == 1 < target.shape[-1]:   # one scale a row: over each of its groups
                    piece = piece.expand(*piece.shape[:-1], target.shape[-1])
            elif canonical.endswith(".weight_zero_point") and target.shape[0] < piece.shape[0] < target.shape[0] + 8:
                piece = piece[:target.shape[0]]   # zero points packed along N, past its last row
            if _storage(piece.dtype) != _storage(target.dtype):
                wrong_dtype.append(f"{raw_name}: {piece.dtype}, expected {_storage(target.dtype)}")
                continue
            if target.shape != piece.shape:
                mismatched.append(f"{canonical}: expected {list(target.shape)}, got {list(piece.shape)}")
                continue
            target.copy_(piece)
            covered[param_name] += piece.numel()
    missing = sorted(name for name, (param_name, _) in mapping.items()
                     if covered[param_name] < params[param_name].numel() and name not in seen
                     and not _alternative_layout_complete(name, mapping, seen))
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(missing))
    if mismatched:
        problems.append(f"tensors with the wrong shape ({len(mismatched)}): " + "; ".join(mismatched))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected))
    if duplicated:
        problems.append(f"tensors given twice ({len(duplicated)}): " + ", ".join(duplicated))
    if wrong_dtype:
        problems.append(f"tensors with the wrong dtype ({len(wrong_dtype)}): " + "; ".join(wrong_dtype))
    if config.quantization is None and any(_SCALE_SUFFIX in line for line in unexpected):
        problems.insert(0, "the checkpoint holds FP8 block scales (*.weight_scale_inv) but its config.json has "
                           "no quantization_config: add the one published with the checkpoint")
    if config.quantization is None and any(leaf in line for line in unexpected
                                           for leaf in (".qweight", ".weight_packed")):
        problems.insert(0, "the checkpoint holds packed integer weights (*.qweight / *.weight_packed) but its "
                           "config.json has no quantization_config: add the one published with the checkpoint")
    if problems:
        raise WeightLoadError(f"checkpoint does not match the {config.model_type} config:\n  "
                              + "\n  ".join(problems))


def _storage(dtype: torch.dtype) -> str:
    """What a parameter stores, in the words a dtype error names."""
    if dtype == FP8:
        return "float8_e4m3fn"
    if dtype == torch.int32:
        return "int32 (packed integer weights or g_idx)"
    if dtype == torch.uint8:
        return "uint8 (zero points)"
    return "an unquantized float" if dtype.is_floating_point else str(dtype)


def _trim_scale_rows(piece: torch.Tensor, target: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A block scale repeated over ceil(N / bn) * bn rows -> N rows, when it has that many."""
    block_rows = config.quantization.weight_block_size[0]
    num_rows = target.shape[0]
    if piece.dim() == target.dim() and piece.shape[0] == _block_count(num_rows, block_rows) * block_rows:
        return piece[:num_rows]
    return piece


def _alternative_layout_complete(name: str, mapping: dict, seen: set[str]) -> bool:
    """Fused and per-expert expert tensors are alternatives: when a parameter is partly covered
    by one layout, report only that layout's missing names."""
    param_name = mapping[name][0]
    siblings = [n for n, (p, _) in mapping.items() if p == param_name]
    fused = [n for n in siblings if mapping[n][1] == (slice(None),)]
    per_part = [n for n in siblings if n not in fused]
    if not fused or not per_part:
        return False
    mine, other = (fused, per_part) if name in fused else (per_part, fused)
    return not any(n in seen for n in mine) and any(n in seen for n in other)

