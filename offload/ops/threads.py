"""Kernel thread count and SIMD path: the settings behind every C++ kernel.

Defaults: all usable cores, the best SIMD path the CPU has. The environment sets them at load time
(OFFLOAD_NUM_THREADS=4, OFFLOAD_ISA=avx2); these functions change them at run time.
"""
from __future__ import annotations

from .. import _ext

__all__ = ["num_threads", "set_num_threads", "active_isa", "compute_isa", "set_isa"]


def num_threads() -> int:
    """Threads (the caller included) the kernels use; 1 on the plain-torch fallback."""
    mod = _ext.get()
    return mod.num_threads() if mod is not None else 1


def set_num_threads(n: int) -> None:
    """n >= 1 threads for the kernels; 0 restores the default (usable cores). Results do not depend on n."""
    _ext.require().set_num_threads(int(n))


def active_isa() -> str:
    """'avx512', 'avx2' or 'scalar' (the path kernels take now); 'torch' on the plain-torch fallback."""
    mod = _ext.get()
    return mod.active_isa() if mod is not None else "torch"


def compute_isa() -> str:
    """The path compute-bound kernels (the 8-bit AdamW) take: the widest one unless set_isa forced one."""
    mod = _ext.get()
    return mod.compute_isa() if mod is not None else "torch"


def set_isa(name: str) -> None:
    """Force 'avx512', 'avx2' or 'scalar' (or 'auto' = the best this CPU has); a path the CPU lacks raises."""
    _ext.require().set_isa(name)
