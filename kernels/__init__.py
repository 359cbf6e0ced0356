"""deltaspec.kernels: heavy ops (Triton on the GPU) beside their torch references.

Imports nothing of the rest of the project. Models call ops only through `Ops` (backend.py).
"""

from .backend import BACKEND_NAMES, REFERENCE_OPS, Ops, select_ops, triton_ops

__all__ = ["BACKEND_NAMES", "REFERENCE_OPS", "Ops", "select_ops", "triton_ops"]
