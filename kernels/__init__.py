"""deltaspec.kernels: heavy ops (Triton on the GPU) beside their torch references.

Imports nothing of the rest of the project. Models call ops only through `Ops` (backend.py).

Each op `foo` has a torch oracle `foo_reference` and a Triton launcher `foo` with the same
signature. A launcher first checks its arguments in `_check_foo_args` (asserts: a failed one is
the caller's bug; checks of tensor values, such as gdn_chunked's checkpoint lengths, raise
ValueError), then picks its tile from shapes and device facts alone (a TileConfig, tiles.py;
device.py), so that CUDA graphs replay the choice. Where tests and benchmark sweeps need to pick
the tile themselves, `launch_foo` takes it explicitly.
"""

from .backend import BACKEND_NAMES, REFERENCE_OPS, Ops, select_ops, triton_ops

__all__ = ["BACKEND_NAMES", "REFERENCE_OPS", "Ops", "select_ops", "triton_ops"]
