"""Online FP8: an unquantized checkpoint's tensors turned, as they are read, into what the official
block-FP8 checkpoint of the same weights would hold (`--quantization fp8`).

Each projection weight the config stores in FP8 (Fp8Config.quantizes: every 2-D `*.weight` but
the kept modules, conv1d and norms) becomes float8_e4m3fn plus `<module>.weight_scale_inv` in
128 x 128 blocks (kernels/fp8.py quantize_blocks), computed on the device the model lives on,
one tensor at a time: the model is built in FP8 from the start, so loading peaks at its FP8
size plus one bf16 tensor and its float32 working copy. Experts stored fused over all experts
are split per expert first, as the official checkpoints store them (each expert's gate and up
quantized apart). The loader (engine/weights.py) then takes the stream as it takes an official
FP8 checkpoint. Knows nothing about files or the model's modules beyond checkpoint names.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..kernels.fp8 import FP8, quantize_blocks
from .quantization import Fp8Config, canonical_module

_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def _per_expert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`...experts.gate_up_proj` [E, 2I, H] / `...experts.down_proj` [E, H, I] -> each expert's
    `...experts.N.{gate,up,down}_proj.weight`; any other tensor as it is."""
    if not (name.endswith(_FUSED_EXPERTS) and tensor.dim() == 3):
        yield name, tensor
        return
    stem, _, projection = name.rpartition(".")
    for expert, weight in enumerate(tensor):
        if projection == "gate_up_proj":
            gate, up = weight.chunk(2, dim=0)
            yield f"{stem}.{expert}.gate_proj.weight", gate
            yield f"{stem}.{expert}.up_proj.weight", up
        else:
            yield f"{stem}.{expert}.down_proj.weight", weight


def _is_fp8_projection(name: str, tensor: torch.Tensor, quantization: Fp8Config) -> bool:
    if not (name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()) or "conv1d" in name:
        return False
    return quantization.quantizes(canonical_module(name.removesuffix(".weight")))


def quantize_online(tensors: Iterable[tuple[str, torch.Tensor]], quantization: Fp8Config,
                    device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, unquantized tensor) pairs -> the official block-FP8 checkpoint's pairs."""
    for raw_name, raw_tensor in tensors:
        if raw_tensor.dtype == FP8 or raw_name.endswith(".weight_scale_inv"):
            raise ValueError(f"{raw_name} is already FP8: online quantization takes an unquantized checkpoint")
        for name, tensor in _per_expert(raw_name, raw_tensor):
            if not _is_fp8_projection(name, tensor, quantization):
                yield name, tensor
                continue
            weight, scale_inv = quantize_blocks(tensor.to(device), quantization.weight_block_size)
            yield name, weight
            yield f"{name.removesuffix('.weight')}.weight_scale_inv", scale_inv
