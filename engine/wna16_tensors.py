"""Weight-only integer checkpoints' tensors in kernels/wna16.py's one layout.

Each tool stores a quantized projection `m` (N outputs, K inputs, P = 32 / bits values a word,
KG groups) its own way; this module rewrites one tensor at a time into the canonical names the
model's `checkpoint_map` knows:

    m.weight             [N, K / P] int32, column k's value in bits (k % P) * bits of word k / P
    m.weight_scale       [N, KG] float32
    m.weight_zero_point  [N, KG] uint8 (asymmetric only: symmetric zeros are 2^(bits-1))
    m.g_idx              [K] int32 (act-order only: the group of each column)

GPTQ (GPTQModel, AutoGPTQ, auto-round's auto_gptq export): `qweight` [K / P, N] packs K the
canonical way, so it is the transpose; `scales` [KG, N]; `qzeros` [KG, N / P] packs N, and the
original format ("gptq", not "gptq_v2") stores each zero minus one (read back as vLLM does:
the stored nibble plus one); `g_idx` [K]. AWQ (AutoAWQ GEMM): `qweight` [K, N / P] and `qzeros`
[KG, N / P] pack N in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (4 bits); `scales` [KG, N].
compressed-tensors pack-quantized: `weight_packed` [N, K / P] is canonical, each value offset by
2^(bits-1) to be unsigned; `weight_scale` [N, KG]; `weight_zero_point` packed along N
([ceil(N / P), KG] int32) or, from older versions, signed int8 [N, KG] (both offset as the
values are); `weight_shape` is checked by the model's shapes instead; `weight_g_idx` [K].

A symmetric checkpoint's zero points (GPTQ writes them anyway) are not read: vLLM ignores them
too. A trivial g_idx (column k in group k / G) is dropped unless the config is act-order, where
the model's projection takes it and decides (layers.Linear._order_groups).

`canonical_stream` is the loader's stage (engine/weights.py load_model): under tensor
parallelism these tensors are read whole (their stored layouts are not the model's) and cut
here, after the rewrite, by the rows and columns of the logical weight [N, K] that the rank's
sharding gives (engine/sharding.py): packed words by K / P, scales and zero points by groups. A
cut inside a word or a group, or through an act-order projection's columns, is a ValueError.
Knows nothing about the model beyond canonical names.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..kernels.wna16 import pack_reference
from .quantization import Wna16Config, canonical_module
from .sharding import Sharding

# AWQ's nibble i of a word holds column 8 * word + AWQ_ORDER[i]; so column 8 * word + r sits in
# nibble AWQ_REVERSE_ORDER[r].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

_LEAVES = {
    "gptq": ("qweight", "scales", "qzeros", "g_idx"),
    "awq": ("qweight", "scales", "qzeros"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}


def is_wna16_tensor(name: str, q: Wna16Config) -> bool:
    """Whether `name` is one of the layout's quantized-projection tensors."""
    return name.rpartition(".")[2] in _LEAVES[q.layout]


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C / P] int32 packed along the last dim -> [R, C] int32 values in [0, 2^bits); order:
    the nibble holding each of a word's columns (AWQ's), None for consecutive."""
    pack = 32 // bits
    shifts = torch.arange(pack, dtype=torch.int32, device=packed.device) * bits
    if order is not None:
        shifts = shifts[list(order)]
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _trivial_g_idx(g_idx: torch.Tensor, q: Wna16Config) -> bool:
    columns = g_idx.numel()
    group = q.columns_per_group(columns)
    return torch.equal(g_idx.long(), torch.arange(columns, device=g_idx.device) // group)


def canonical_tensors(name: str, tensor: torch.Tensor, q: Wna16Config) -> Iterator[tuple[str, torch.Tensor]]:
    """One checkpoint tensor of a quantized projection (`is_wna16_tensor`) -> its canonical
    (name, tensor) pairs: none for tensors not read (a symmetric checkpoint's zeros, a trivial
    g_idx, compressed-tensors' weight_shape)."""
    module, _, leaf = name.rpartition(".")
    if leaf in ("g_idx", "weight_g_idx"):
        if q.act_order or not _trivial_g_idx(tensor, q):
            yield f"{module}.g_idx", tensor.to(torch.int32)
        return
    if leaf == "weight_shape":
        return
    if leaf in ("scales", "weight_scale"):
        yield f"{module}.weight_scale", (tensor.t() if q.layout != "compressed-tensors" else tensor).float()
        return
    if leaf in ("qzeros", "weight_zero_point"):
        if not q.symmetric:
            yield f"{module}.weight_zero_point", _zero_points(tensor, q)
        return
    if q.layout == "gptq":       # qweight [K / P, N]: K packed as canonical
        yield f"{module}.weight", tensor.t().contiguous()
    elif q.layout == "awq":      # qweight [K, N / P]: N packed, interleaved
        values = unpack_columns(tensor, q.bits, AWQ_REVERSE_ORDER if q.bits == 4 else None)
        yield f"{module}.weight", pack_reference(values.t(), q.bits)
    else:
        yield f"{module}.weight", tensor


def _zero_points(tensor: torch.Tensor, q: Wna16Config) -> torch.Tensor:
    """A layout's stored zero points -> [N, KG] uint8 on the values' own scale."""
    if q.layout == "gptq":       # [KG, N / P], N packed consecutively; v1 stores zero - 1
        zeros = unpack_columns(tensor, q.bits).t() + int(q.zeros_minus_one)
    elif q.layout == "awq":      # [KG, N / P], N packed in AWQ's order
        zeros = unpack_columns(tensor, q.bits, AWQ_REVERSE_ORDER if q.bits == 4 else None).t()
    elif tensor.dtype == torch.int32:   # compressed-tensors [ceil(N / P), KG], N packed, offset
        zeros = unpack_columns(tensor.t(), q.bits).t()
    else:                               # older compressed-tensors: signed [N, KG]
        zeros = tensor.to(torch.int32) + (1 << (q.bits - 1))
    return zeros.to(torch.uint8).contiguous()


def canonical_stream(tensors: Iterable[tuple[str, torch.Tensor]], q: Wna16Config,
                     sharding: Sharding | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs -> the same, each quantized projection's tensors in the
    canonical layout and, with a sharding, cut to the rank's slices; other tensors as they come
    (read_tensors already cut those)."""
    for name, tensor in tensors:
        if not is_wna16_tensor(name, q):
            yield name, tensor
            continue
        for canonical, piece in canonical_tensors(name, tensor, q):
            yield canonical, piece if sharding is None else _rank_slices(canonical, piece, q, sharding)


def _rank_slices(name: str, tensor: torch.Tensor, q: Wna16Config, sharding: Sharding) -> torch.Tensor:
    """A canonical tensor's part on the sharding's rank: the logical weight's pieces, rows as
    rows, columns in words (the packed weight), groups (scales, zero points) or columns (g_idx)."""
    module, _, leaf = name.rpartition(".")
    if leaf == "g_idx":
        in_features, per_entry = tensor.numel(), 1
    else:
        per_entry = q.pack if leaf == "weight" else q.group_size
        in_features = tensor.shape[1] * per_entry if per_entry > 0 else 0   # per channel: unknown, whole
    pieces = sharding.pieces(f"{canonical_module(module)}.weight", (tensor.shape[0], in_features))
    if pieces is None:
        return tensor
    parts = []
    for dim, start, stop in pieces:
        if dim == 0:
            parts.append(tensor if leaf == "g_idx" else tensor[start:stop])
        elif leaf == "g_idx":
            raise ValueError(f"{name}: tensor_parallel_size={sharding.size} splits the columns of an act-order "
                             f"projection, whose groups are spread over all of them; load it on one GPU")
        elif per_entry < 0:      # per-channel scales: one a row, for every column piece
            parts.append(tensor)
        elif start % per_entry or (stop % per_entry and stop != in_features):
            unit = "word" if leaf == "weight" else "quantization group"
            raise ValueError(f"{name}: tensor_parallel_size={sharding.size} cuts a {unit} of {per_entry} columns "
                             f"(columns [{start}, {stop}) are this rank's); use a size whose shards are whole groups")
        else:
            parts.append(tensor[:, start // per_entry:-(-stop // per_entry)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0][0])
