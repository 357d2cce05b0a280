"""Sources and flags of the one C++ extension, shared by the JIT loader (_ext.py) and setup.py.

Pure function of the checkout and the machine: no torch import, so setup.py can call it early.
"""
from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    sources: list[str]
    include_dirs: list[str]
    cflags: list[str]
    ldflags: list[str]
    features: dict[str, bool]


def _have_header(name: str) -> bool:
    return any(Path(d, name).exists() for d in ("/usr/include", "/usr/local/include"))


def build_spec(csrc: Path | None = None) -> BuildSpec:
    csrc = Path(os.environ.get("OFFLOAD_CSRC", csrc or CSRC))
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
    if os.environ.get("OFFLOAD_NO_URING") != "1" and _have_header("liburing.h"):
        features["liburing"] = True
        cflags.append("-DOFFLOAD_HAVE_LIBURING=1")
        ldflags.append("-luring")
    return BuildSpec(sources, [str(csrc)], cflags, ldflags, features)
