"""Every OFFLOAD_* environment variable offload reads, in one table: its type, its default, who reads it and
what it changes. The code reads them only through this table (tests/test_env.py checks it), and
docs/environment.md shows the same table (written by `python -m offload.env`; the test keeps the two equal).

    from offload import env
    if env.DEBUG.on(): ...                 # a flag: set and neither "" nor "0"
    mode = env.MALLOC_TUNE.get()           # the value as set, else the default ("" where it has none)

A variable is read where its owner needs it (each call reads the environment again), and the owner checks the
value and names the variable in its error: the table says what is read, the owner says what a value means.

Where an argument or a config field can carry a setting, it should: a variable here is for what must reach a
process before any code of the user's runs (the extension's build and load), what a launcher passes to the
processes it starts (torchrun workers), or a diagnostic switched on without editing code.

Imports nothing of offload's and not torch: setup.py and offload/_build_spec.py read it before torch exists.
"""
from __future__ import annotations

import dataclasses
import os

__all__ = ["Variable", "VARIABLES", "markdown_table"]


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # flag | whole number | choice | size | path | list
    default: str  # what an unset variable means, as the docs say it ("" where get() returns "")
    read_by: str  # the module that reads it, and when
    changes: str  # what it changes
    audience: str  # user | build | tests
    fallback: str = ""  # what get() returns when unset (the default, where it is a value the owner parses)

    def get(self) -> str:
        """The value as set (surrounding blanks removed), else `fallback`."""
        value = os.environ.get(self.name)
        return value.strip() if value is not None and value.strip() else self.fallback

    def on(self) -> bool:
        """A flag: set to anything but "" and "0"."""
        assert self.kind == "flag", self.name
        return self.get() not in ("", "0")


def _var(*args, **kwargs) -> Variable:
    return Variable(*args, **kwargs)


# ---- the user's: speed and memory knobs of a run, and diagnostics ----------------------------------------------
NUM_THREADS = _var(
    "OFFLOAD_NUM_THREADS", "whole number", "the usable cores", "offload/_ext.py, when the extension loads",
    "threads of the C++ kernels (the fused optimizers, the copies); 0 is the default. At run time: "
    "offload.ops.threads.set_num_threads. Results do not depend on it", "user")
ISA = _var(
    "OFFLOAD_ISA", "choice: avx512, avx2, scalar, auto", "the faster of AVX-512 and AVX2 for the AdamW kernel, "
    "timed once at load", "offload/_ext.py, when the extension loads",
    "the kernels' SIMD path (auto: the widest the CPU has). Every path gives bitwise the same results; only "
    "the speed changes. At run time: offload.ops.threads.set_isa", "user")
NUMA_NODE = _var(
    "OFFLOAD_NUMA_NODE", "choice: auto, off, a node number", "auto: the GPU's node, on a machine with several "
    "nodes", "offload/store/numa.py, when the cpu tier's arena is mapped",
    "the NUMA node the pinned cpu-tier arena's pages are preferred on (off: wherever the kernel puts them)", "user",
    fallback="auto")
MALLOC_TUNE = _var(
    "OFFLOAD_MALLOC_TUNE", "choice: auto, pool, frugal, fast, off", "auto: frugal with a GPU, pool without",
    "offload/zero/host_memory.py, when a Runtime opens",
    "how host transients are allocated for the process: torch's CPU allocator replaced by the host pool "
    "(pool), or glibc's mmap threshold fixed (frugal: 128 KiB, fast: 32 MiB), or glibc left alone (off)",
    "user", fallback="auto")
HOST_POOL_HEADROOM = _var(
    "OFFLOAD_HOST_POOL_HEADROOM", "size", "128MiB", "offload/store/host_pool.py, when the host pool is installed",
    "bytes of freed blocks the host pool keeps mapped beyond its peak in use: more reuses more, less keeps "
    "resident memory nearer the step's peak", "user")
DEBUG = _var(
    "OFFLOAD_DEBUG", "flag", "off", "offload/cli.py and offload/finetune/cli.py, when a command fails",
    "the CLI raises an error with its traceback instead of printing one line and exiting 2", "user")

# ---- the build of the C++ extension --------------------------------------------------------------------------
BUILD_EXT = _var(
    "OFFLOAD_BUILD_EXT", "flag", "off: compiled by ninja on first use", "setup.py",
    "pip install compiles the extension ahead of time (same sources and flags as the first-use build)", "build")
BUILD_DIR = _var(
    "OFFLOAD_BUILD_DIR", "path", "~/.cache/offload/ext/TORCH_VERSION ($XDG_CACHE_HOME for ~/.cache)",
    "offload/_ext.py, at the first use",
    "where the first-use build is compiled and cached", "build")
BUILD_VERBOSE = _var(
    "OFFLOAD_BUILD_VERBOSE", "flag", "off: one progress line", "offload/_ext.py, at a build",
    "the build prints the compiler's commands and output", "build")
CSRC = _var(
    "OFFLOAD_CSRC", "path", "the checkout's csrc/", "offload/_build_spec.py, at a build",
    "where the C++ sources are (an installed package without them, a shared prebuilt cache)", "build")
NO_URING = _var(
    "OFFLOAD_NO_URING", "flag", "off: io_uring where liburing is installed", "offload/_build_spec.py, at a build",
    "the NVMe engine is built without io_uring (its thread-pool engine instead)", "build")
DISABLE_EXT = _var(
    "OFFLOAD_DISABLE_EXT", "flag", "off", "offload/_ext.py, at the first use",
    "the extension is never loaded: every kernel runs on the plain-torch fallback (correct, slower); the "
    "tests of the fallback set it", "build")

# ---- tests: they cross into processes a test starts (torchrun workers, a CLI run); in-process, use the API -----
INJECT_DELAY = _var(
    "OFFLOAD_INJECT_DELAY", "list: QUEUE=SECONDS,...", "none", "offload/inject.py, when it is imported",
    "each named queue's worker sleeps this long per item (a slow queue shows a missing wait). For processes a "
    "test launches; in-process: offload.inject.delay", "tests")
INJECT_OOM = _var(
    "OFFLOAD_INJECT_OOM", "list: SITE,...", "none", "offload/inject.py, when it is imported",
    "the allocation at each named site raises torch.OutOfMemoryError. For processes a test launches; "
    "in-process: offload.inject.out_of_memory_at", "tests")
GPU_FIGURES = _var(
    "OFFLOAD_GPU_FIGURES", "path", "none: figures only printed", "tests/cuda_common.py",
    "the GPU tests append their measured figures to this JSON-lines file (benchmarks/gpu_check.sh sets it)",
    "tests")

VARIABLES: tuple[Variable, ...] = tuple(v for v in globals().values() if isinstance(v, Variable))


def markdown_table() -> str:
    """The table docs/environment.md shows."""
    rows = ["| Variable | Type | Default | Read by | What it changes |", "|---|---|---|---|---|"]
    for audience in ("user", "build", "tests"):
        for v in (v for v in VARIABLES if v.audience == audience):
            rows.append(f"| `{v.name}` ({v.audience}) | {v.kind} | {v.default} | {v.read_by} | {v.changes} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
