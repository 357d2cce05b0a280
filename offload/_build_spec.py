"""Sources and flags of the one C++ extension, shared by the JIT loader (_ext.py) and setup.py.

Pure function of the checkout and the machine: no torch import, so setup.py can call it early.
"""
from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path

from . import env

CSRC = Path(__file__).resolve().parent.parent / "csrc"


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    sources: list[str]
    include_dirs: list[str]
    cflags: list[str]
    ldflags: list[str]
    features: dict[str, bool]


def _dirs(env_vars: tuple[str, ...], defaults: list[str]) -> list[str]:
    """Where the compiler or the linker looks: the directories the environment adds, then the defaults."""
    return [d for v in env_vars for d in os.environ.get(v, "").split(os.pathsep) if d] + defaults


def include_dirs() -> list[str]:
    return _dirs(("CPATH", "CPLUS_INCLUDE_PATH"), ["/usr/local/include", "/usr/include"])


def library_dirs() -> list[str]:
    multiarch = f"{platform.machine()}-linux-gnu"
    return _dirs(("LIBRARY_PATH",), ["/usr/local/lib", f"/usr/lib/{multiarch}", f"/lib/{multiarch}", "/usr/lib64",
                                     "/lib64", "/usr/lib", "/lib"])


def liburing_found(include: list[str], lib: list[str]) -> bool:
    """Its header and its library both: a header alone (liburing built from source into /usr/local, its library
    where the linker does not look) made the whole extension fail to link, and every kernel fall back to torch."""
    header = any(Path(d, "liburing.h").is_file() for d in include)
    library = any(Path(d, name).exists() for d in lib for name in ("liburing.so", "liburing.a"))
    return header and library


def build_spec(csrc: Path | None = None) -> BuildSpec:
    csrc = Path(env.CSRC.get() or csrc or CSRC)
    if not (csrc / "module.cpp").exists():
        raise FileNotFoundError(
            f"offload: C++ sources not found at {csrc} (expected module.cpp); "
            "install from a source checkout (pip install -e .) or set OFFLOAD_CSRC"
        )
    sources = sorted(str(p) for p in csrc.rglob("*.cpp"))
    # ninja names objects by basename, so every .cpp under csrc/ needs a unique file name.
    names = [Path(s).name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"offload: csrc/ has several files named {dup}; give each .cpp a unique name")
    # No -march: the binary runs on any x86-64 and picks AVX-512 / AVX2 / scalar at run time
    # (function-level target attributes). No -ffast-math: results must match torch bit for bit.
    # -ffp-contract=off: GCC fuses a*b+c into an FMA even in -std=c++17 mode (vector intrinsics
    # included), which changes roundings; kernels write their FMAs explicitly instead.
    cflags = ["-O3", "-std=c++17", "-ffp-contract=off", "-Wall", "-Wno-unused-function", "-fno-math-errno",
              "-pthread"]
    ldflags = ["-pthread"]
    features = {"x86_64": platform.machine() in ("x86_64", "AMD64"), "liburing": False}
    if not env.NO_URING.on() and liburing_found(include_dirs(), library_dirs()):
        features["liburing"] = True
        cflags.append("-DOFFLOAD_HAVE_LIBURING=1")
        ldflags.append("-luring")
    return BuildSpec(sources, [str(csrc)], cflags, ldflags, features)
