"""Kernel kinds, one module each; KINDS is the one table fuse, select and codegen iterate.

Adding a kind: a module here (anchors, roles, parameters, signatures, CPU call, GPU
kernels; see base.py) plus its templates, and a line below.
"""

from __future__ import annotations

from hipc.compiler.kernels import attention, deltanet, embedding, glu, linear, moe, rmsnorm
from hipc.compiler.kernels.base import KernelKind

KINDS: tuple[KernelKind, ...] = (
    linear.KIND, attention.KIND, embedding.KIND, rmsnorm.KIND, glu.KIND, moe.KIND, deltanet.KIND
)  # fmt: skip
BY_NAME = {k.name: k for k in KINDS}
BY_ANCHOR = {op: k for k in KINDS for op in k.anchors}
