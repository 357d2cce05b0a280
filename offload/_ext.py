"""Loads the C++ extension `offload._C`: prebuilt (setup.py with OFFLOAD_BUILD_EXT=1) or compiled by
ninja on first use and cached. Without a compiler the callers fall back to plain torch, warned once.

Environment (the table is offload/env.py's): OFFLOAD_BUILD_DIR, OFFLOAD_BUILD_VERBOSE and OFFLOAD_DISABLE_EXT
at the first use; OFFLOAD_NUM_THREADS and OFFLOAD_ISA applied when it loads. With OFFLOAD_ISA unset the faster
of AVX-512 and AVX2 for the AdamW kernel is timed once at load (a few ms): some CPUs (AMD Zen 4) run AVX-512 at
half the AVX2 rate here; every path gives bitwise the same results, so the choice changes only the speed.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import sys
import threading
import time
import warnings
from pathlib import Path

from . import env

_lock = threading.Lock()
_module = None
_error: str | None = None
_loaded = False
_warned = False


def build_dir() -> Path:
    if env.BUILD_DIR.get():
        return Path(env.BUILD_DIR.get())
    import torch

    tag = torch.__version__.replace("+", "_")
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "offload" / "ext" / tag


_BUILD_LOCK = "offload_build.flock"  # ours, beside torch's own `lock` file


@contextlib.contextmanager
def _build_lock(path: Path):
    """One builder at a time, held by a live process only: an flock, which the kernel drops when its holder
    dies however it dies (Ctrl-C, a timeout, the OOM killer). torch's own build lock (`path/lock`) is a file
    whose existence is the lock, so a killed build leaves it and every later load would wait on it. Under our
    flock no builder of ours is alive, so a `lock` file found there was left by a dead one and is removed at
    once. A process that starts a first build meanwhile waits here, then finds the build current (ninja
    compiles nothing)."""
    fd = os.open(path / _BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"offload: another process is building the extension in {path}; waiting for it",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel releases it if that builder dies
        except OSError:  # a filesystem without flock (NFS without lockd): unguarded, as torch alone would be
            pass
        stale = path / "lock"
        if stale.exists():
            warnings.warn(f"offload: removing {stale}, left by an extension build that was killed; building again",
                          RuntimeWarning, stacklevel=4)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # drops the flock


# CPU-seconds of a full build of csrc/ with g++ -O3 (measured: 118-132 s of user time on a 2-vCPU AMD EPYC)
_BUILD_CPU_SECONDS = 130


def _estimate(n_sources: int) -> str:
    """An honest first-build estimate: the compile's CPU time over the cores not already busy (ninja runs one
    compiler per core), so a loaded machine is told it will take longer."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    seconds = _BUILD_CPU_SECONDS / max(1.0, min(cores, n_sources) - busy)
    low, high = max(1, round(seconds / 60)), max(2, round(2 * seconds / 60))
    return f"about {low}-{high} min on {cores} cores at load {busy:.1f}"


class _Progress:
    """Says each object file as ninja finishes it (torch's quiet build prints nothing for minutes): a thread
    polls the build directory for .o files written since the build began."""

    def __init__(self, path: Path, n_sources: int):
        self.path, self.n = path, n_sources
        self.t0, self.mono = time.time(), time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="offload-build-progress", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self._report()  # the last objects, finished within the final poll

    def _run(self) -> None:
        self.seen: set[str] = set()
        while not self.done.wait(1.0):
            self._report()

    def _report(self) -> None:
        for f in sorted(self.path.glob("*.o")):
            try:
                fresh = f.stat().st_mtime >= self.t0 - 1
            except FileNotFoundError:
                continue
            if fresh and f.name not in self.seen:
                self.seen.add(f.name)
                print(f"offload: [{len(self.seen)}/{self.n}] compiled {f.stem} "
                      f"({time.monotonic() - self.mono:.0f} s)", file=sys.stderr, flush=True)


def _first_error(exc: BaseException) -> str:
    """The compiler's first error line out of torch's build exception (which holds ninja's whole output)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "error:" in line.lower():
            return line[:300]
    return (lines[0] if lines else type(exc).__name__)[:300]


def _load():
    if env.DISABLE_EXT.on():
        raise RuntimeError("disabled by OFFLOAD_DISABLE_EXT=1")
    try:  # ahead-of-time build
        return importlib.import_module("offload._C")
    except ImportError:
        pass
    from torch.utils import cpp_extension

    from ._build_spec import build_spec

    spec = build_spec()
    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    verbose = env.BUILD_VERBOSE.on()
    key = _build_key(spec)
    with _build_lock(path):
        # A first build takes minutes with nothing on screen: say what it does, or a new user sees a hang.
        building = _needs_build(spec, path, key)
        if building:
            print(f"offload: building the C++ extension (first use only; {len(spec.sources)} sources, "
                  f"{_estimate(len(spec.sources))}); cached in {path}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            with _Progress(path, len(spec.sources)) if building and not verbose else contextlib.nullcontext():
                mod = cpp_extension.load(
                    name="offload_C",
                    sources=spec.sources,
                    extra_include_paths=spec.include_dirs,
                    extra_cflags=spec.cflags,
                    extra_ldflags=spec.ldflags,
                    build_directory=str(path),
                    verbose=verbose,
                )
        except BaseException as exc:
            if building:
                print(f"offload: building the C++ extension failed after {time.monotonic() - t0:.0f} s: "
                      f"{_first_error(exc)}; every kernel runs on the plain-torch fallback (correct, slower); "
                      "OFFLOAD_BUILD_VERBOSE=1 shows the compiler's output", file=sys.stderr, flush=True)
            raise
        if building:
            print(f"offload: built the C++ extension in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        try:
            (path / _KEY_FILE).write_text(key)
        except OSError:  # a read-only shared cache still loads; only the next prediction is poorer
            pass
    return mod


_KEY_FILE = "offload_build.key"


def _build_key(spec) -> str:
    import torch

    return repr((torch.__version__, spec.sources, spec.include_dirs, spec.cflags, spec.ldflags))


def _needs_build(spec, path: Path, key: str) -> bool:
    """Whether ninja will compile: torch runs it on every load, a no-op when the cache is current. Predicts
    ninja's own tests (an output missing, an input newer than it) plus a changed flag set or torch version,
    recorded in _KEY_FILE by the last load (a cache that has no such file is judged by the first two only)."""
    lib = path / "offload_C.so"
    try:
        built = lib.stat().st_mtime
    except FileNotFoundError:
        return True
    if any(not (path / (Path(s).stem + ".o")).exists() for s in spec.sources):
        return True
    try:
        if (path / _KEY_FILE).read_text() != key:
            return True
    except FileNotFoundError:
        pass
    # sources and the headers next to them (ninja tracks the headers through its depfiles)
    inputs = [*spec.sources, *(f for d in spec.include_dirs for f in Path(d).rglob("*") if f.is_file())]
    return any(Path(f).stat().st_mtime > built for f in inputs)


def _apply_env_settings(mod):
    # A bad value is the user's setting, not a missing compiler: raise, naming the variable.
    threads = env.NUM_THREADS.get()
    if threads:
        if not threads.isdigit():
            raise _SettingError(f"OFFLOAD_NUM_THREADS must be a whole number >= 0, got {threads!r}")
        try:
            mod.set_num_threads(int(threads))
        except (ValueError, TypeError) as exc:
            raise _SettingError(f"OFFLOAD_NUM_THREADS={threads}: {exc}") from None
    isa = env.ISA.get()
    if isa:
        try:
            mod.set_isa(isa)
        except ValueError as exc:
            raise _SettingError(f"OFFLOAD_ISA: {exc}") from None
    elif mod.best_isa() == "avx512":
        _pick_faster_isa(mod)
    return mod


ISA_CHOICE = {"reason": "OFFLOAD_ISA or the widest path"}  # why the load-time path is what it is (offload env)


def _pick_faster_isa(mod) -> None:
    """AVX-512 or AVX2, whichever runs the AdamW kernel (the hottest host loop) faster on this CPU."""
    import torch

    n = 1 << 20
    own = torch.Generator().manual_seed(0)  # not torch's global one: a seeded run draws the same with or without this
    master, m, v = torch.randn(n, generator=own), torch.zeros(n), torch.zeros(n)
    grad, out = torch.randn(n, generator=own).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    rate = {}
    for isa in ("avx512", "avx2"):
        mod.set_isa(isa)
        best = float("inf")
        for step in range(1, 4):
            t0 = time.perf_counter()
            mod.adamw_step_(master, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            step=step, grad_scale=1.0, out=out)
            best = min(best, time.perf_counter() - t0)
        rate[isa] = n / best
    pick = "avx2" if rate["avx2"] > 1.15 * rate["avx512"] else "avx512"  # a clear win only: noise keeps avx512
    mod.set_isa(pick)
    mod.prefer_widest_for_compute(True)  # the 8-bit AdamW is compute-bound: AVX-512 is faster for it regardless
    ISA_CHOICE["reason"] = (f"{pick}: AdamW timed at load, avx512 {rate['avx512'] / 1e9:.2f} vs avx2 "
                            f"{rate['avx2'] / 1e9:.2f} G params/s; compute-bound kernels (AdamW8bit): "
                            f"{mod.compute_isa()}")


class _SettingError(ValueError):
    pass


def get():
    """The extension module, or None when it cannot be built (the reason is in `error()`)."""
    global _module, _error, _loaded
    if _loaded:
        return _module
    with _lock:
        if not _loaded:
            try:
                _module = _apply_env_settings(_load())
            except _SettingError:
                raise
            except Exception as exc:  # no compiler, missing headers, disabled: fall back, never crash
                _error = f"{type(exc).__name__}: {exc}".strip()
                _module = None
            _loaded = True
    return _module


def error() -> str | None:
    get()
    return _error


def require():
    """The extension, or a RuntimeError saying why it is missing and how to fix it."""
    mod = get()
    if mod is None:
        raise RuntimeError(
            "offload: the C++ extension offload._C is not available "
            f"({_error}). Install a C++ compiler (g++) and ninja, then retry; "
            "`offload env` shows the build directory and the last error."
        )
    return mod


def warn_fallback(what: str) -> None:
    """Warn once per process that `what` runs on the slow plain-torch path."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"offload: C++ extension unavailable ({_error}); {what} uses the plain-torch fallback "
            "(correct, slower). Install g++ and ninja to build it.",
            RuntimeWarning,
            stacklevel=3,
        )
