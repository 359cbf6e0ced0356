"""The engine options every command shares (`serve`, `generate`, `bench serve`): their argparse
flags, the EngineConfig fields they set, and the same options as flags again for a server that
`bench serve` starts in another process. Each flag is its field's name with dashes, so nothing
a user passes is dropped on the way to the engine. Knows nothing about what a command does.
"""

from __future__ import annotations

import argparse

from ..engine.engine_config import ALL_REDUCES


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="MTP drafts per step at most (default: 3 when the checkpoint has MTP weights, each "
                             "step's count chosen by the adaptive policy; 0: no speculation)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens a step computes at most, decode rows and prefill chunks together (default: "
                             "8192); long prompts are prefilled in chunks that fit")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="shard the model over this many devices (one process each; cuda:0..N-1)")
    parser.add_argument("--enable-expert-parallel", action="store_true", default=None,
                        help="MoE: place whole experts on ranks (experts / tp each) instead of splitting each")
    parser.add_argument("--all-reduce", choices=ALL_REDUCES, default=None,
                        help="tensor parallelism's all-reduces of decode steps: nccl (default): always NCCL; auto: "
                             "through symmetric memory over NVLink where it works, else NCCL, fused with the "
                             "residual add + RMSNorm after it; one_shot or two_shot: that symmetric-memory kernel, "
                             "the norm apart")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                        help="dummy: random weights of the config's shapes (benchmarks)")
    parser.add_argument("--generation-config", choices=("auto", "none"), default=None,
                        help="auto (default): sampling fields a request leaves unset take the checkpoint's "
                             "generation_config.json values; none: the built-in neutral ones")
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="fp8: quantize an unquantized checkpoint to block FP8 (128x128 weight blocks, as the "
                             "official FP8 checkpoints) while loading; FP8 checkpoints need no option")


# The fields add_engine_options sets; a flag left out (None) keeps EngineConfig's default.
_FIELDS = ("device", "dtype", "num_draft_tokens", "max_num_batched_tokens", "tensor_parallel_size",
           "enable_expert_parallel", "all_reduce", "load_format", "generation_config", "quantization")


def engine_options(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments of the flags given."""
    return {name: getattr(args, name) for name in _FIELDS if getattr(args, name) is not None}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The same options as command-line flags (for `deltaspec serve` in another process)."""
    flags = []
    for name, value in engine_options(args).items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags
