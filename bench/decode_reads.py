"""What a plain decode step reads, launch by launch: the model's own forward traced on the CPU.

`decode_reads(config, batch, context)` builds the HybridLM of `config` with uninitialised
weights (shapes are all that matter; untouched pages cost no memory) and runs one decode step
of `batch` rows, each with `context` tokens already in its KV cache and a state in its slot,
through an Ops table that records every call before running the torch reference. Each Ops call
is one launch of the GPU step, in the step's order; what it reads is classified by identity:

    weight      a parameter of the model, read whole, or for a gather (ROW_GATHERS: the token
                embedding) the rows its ids pick
    state       a pool tensor (StatePool, KVPool), read as the op reads it (POOL_READS): the rows
                of the batch's slots, or the keys and values of the rows' context
    activation  anything else it is handed (the step's activations and metadata); `out` and
                `pending_out` are written
An op handed a NamedTuple of fused work (linear's ConvDecode and GatedNorm: the GDN conv in the
in_proj's epilogue, the gated norm in the out_proj's one-row form) reads what its fields hold, as
the fused op would; above one row the GPU runs some of that work as launches of its own.

The forward's torch ops outside the Ops table are added by hand, as bench/profile_step.py's step
runs them: after the final norm the logits (the lm_head GEMM, in the model's dtype) and the
argmax. Ops whose GPU kernel is two launches (split-KV
attention and its combine) count as one, so the list has a few launches fewer than the GPU
step; as a floor it errs low. bf16 / fp16 / fp32 models only (FP8 activations are not counted).
Knows nothing about timing.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from spec_step import BLOCK, CONTEXT, SHAPES
from deltaspec.engine import ModelConfig
from deltaspec.engine.batch import ForwardBatch, Row
from deltaspec.engine.models import HybridLM
from deltaspec.engine.state_pool import KVPool, StatePool
from deltaspec.kernels import REFERENCE_OPS, Ops

# How an op of the decode step reads the pool tensors it is handed (by op, or by "op.argument"
# for those of one argument): the rows of the batch's slots (state pools, slot first), the keys or
# values of each row's context (KV caches), or nothing (the KV write of the q/k norm, run by the
# qkv projection or after it, only stores the new tokens' keys and values).
POOL_READS = {"causal_conv1d_decode": "slots", "gdn_decode": "slots", "paged_attention": "context",
              "qk_norm_rope_kv": "none", "linear": "slots", "linear.rope_kv": "none"}
WRITTEN = {"out", "pending_out"}
# Ops that read only some rows of the weight they are handed: op -> the argument holding the ids.
ROW_GATHERS = {"embedding": "input_ids"}


def _flat_arguments(arguments: dict) -> dict:
    """An op's bound arguments with the fields of a NamedTuple argument (its fused work) spliced
    in as `argument.field`."""
    flat = {}
    for name, value in arguments.items():
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            flat.update({f"{name}.{field}": item for field, item in _flat_arguments(value._asdict()).items()})
        else:
            flat[name] = value
    return flat


@dataclass(frozen=True)
class Read:
    """One launch of a decode step and the bytes it reads. layer: the launch's stage, decoder
    layer 0..L-1 (the embedding gather counts with layer 0, whose input it is) or L for the
    final norm and the head. tensors: the weights and state it reads, by name."""

    op: str
    layer: int
    weight_bytes: int
    state_bytes: int
    activation_bytes: int
    tensors: tuple[str, ...]

    @property
    def num_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes + self.activation_bytes


def _pool_read(op: str, argument: str) -> str:
    """POOL_READS's entry for a pool tensor handed to op as `argument` (a flattened name)."""
    how = POOL_READS.get(f"{op}.{argument.split('.')[0]}", POOL_READS.get(op))
    if how is None:
        raise ValueError(f"{op} is handed a pool tensor ({argument}); how it reads it is not in POOL_READS")
    return how


class _Recorder:
    """An Ops table whose every entry records its call as a Read, then runs the reference."""

    def __init__(self) -> None:
        self.reads: list[Read] = []
        self.layer = 0
        self.names: dict[int, str] = {}   # id(tensor) -> name, of weights and pool tensors
        self.pools: set[int] = set()
        self.ops = dataclasses.replace(REFERENCE_OPS, name="recording", **{
            f.name: self._recording(f.name, getattr(REFERENCE_OPS, f.name))
            for f in dataclasses.fields(Ops) if callable(getattr(REFERENCE_OPS, f.name))})

    def watch(self, model: HybridLM, states: StatePool, kv: KVPool) -> None:
        self.names = {id(p): name for name, p in model.named_parameters()}
        for pool, layers in (("states", states.layers), ("kv", kv.layers)):
            for i, layer in enumerate(layers):
                self.names.update({id(t): f"{pool}.layers.{i}.{field}" for field, t in zip(layer._fields, layer)})
        self.names[id(states.pending_counts)] = "states.pending_counts"   # one tensor shared by every layer
        self.pools = {id(t) for layer in (*states.layers, *kv.layers) for t in layer}
        # The layer a launch belongs to: set as each decoder layer starts; after one ends, the next stage.
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "layer", i))
            layer.register_forward_hook(lambda *_, i=i: setattr(self, "layer", i + 1))

    def _recording(self, op: str, fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            self.reads.append(self._read(op, signature.bind(*args, **kwargs).arguments))
            return fn(*args, **kwargs)

        return call

    def _read(self, op: str, arguments: dict) -> Read:
        weight = state = activation = 0
        tensors = []
        arguments = _flat_arguments(arguments)
        for name, value in arguments.items():
            if name.rsplit(".", 1)[-1] in WRITTEN or not isinstance(value, torch.Tensor):
                continue
            if id(value) in self.pools:
                num_bytes = self._pool_bytes(_pool_read(op, name), value, arguments)
                state += num_bytes
                if num_bytes:  # not the empty pending buffers of a pool without speculation
                    tensors.append(self.names[id(value)])
            elif id(value) in self.names:
                ids = ROW_GATHERS.get(op)
                weight += value.nbytes if ids is None else arguments[ids].numel() * value[0].nbytes
                tensors.append(self.names[id(value)])
            else:
                activation += value.nbytes
        return Read(op, self.layer, weight, state, activation, tuple(tensors))

    @staticmethod
    def _pool_bytes(how: str, pool: torch.Tensor, arguments: dict) -> int:
        if how == "slots":
            slot_ids = next(value for name, value in arguments.items() if name.rsplit(".", 1)[-1] == "slot_ids")
            return slot_ids.numel() * pool[0].nbytes
        if how == "context":
            return int(arguments["context_lens"].sum()) * pool[0, 0].nbytes
        return 0


def decode_reads(config: ModelConfig, batch: int = 1, context: int = CONTEXT,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[Read, ...]:
    """The launches of a plain decode step (one token per row, committed) of `batch` rows at
    `context` tokens each, in order, with what each reads (see the module docstring)."""
    if config.quantization is not None:
        raise ValueError("decode_reads counts unquantized models only")
    recorder = _Recorder()
    model = HybridLM(config, recorder.ops, dtype, with_mtp=False)
    blocks_per_row = (context + 1) // BLOCK + 1
    states = StatePool(config, batch + 1, 0, dtype, "cpu")   # slot 0 is the engine's scratch
    kv = KVPool(model.num_kv_layers, batch * blocks_per_row + 1, BLOCK, config.num_key_value_heads, config.head_dim,
                dtype, "cpu")
    recorder.watch(model, states, kv)
    rows = [Row([0], context, r + 1, list(range(1 + r * blocks_per_row, 1 + (r + 1) * blocks_per_row)))
            for r in range(batch)]
    step = ForwardBatch.build(rows, [], BLOCK, "cpu", commit=True)
    hidden_row = config.hidden_size * dtype.itemsize
    with torch.inference_mode():
        model(step, states, kv)
    head = config.num_hidden_layers
    lm_head = "embed_tokens" if model.lm_head is None else "lm_head"
    logits = batch * config.vocab_size
    # greedy_argmax(model.logits(hidden)): the GEMM, then the argmax over the model-dtype logits.
    tail = (Read("lm_head", head, model.lm_head_weight.nbytes, 0, batch * hidden_row, (lm_head,)),
            Read("argmax", head, 0, 0, logits * dtype.itemsize, ()))
    return (*recorder.reads, *tail)


def shape_config(shape: str) -> ModelConfig:
    """The ModelConfig of a bench shape (spec_step.SHAPES, what profile_step times)."""
    return ModelConfig.from_dict({"model_type": "qwen3_5_text", **SHAPES[shape]})
