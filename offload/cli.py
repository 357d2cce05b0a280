"""The `offload` command. Subcommands register here; each lives in its own module."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__, env


def _cmd_env(args: argparse.Namespace) -> int:
    """Versions, the CPU's SIMD paths, and whether/where the extension is built."""
    import platform

    import torch

    from . import _ext
    from ._build_spec import build_spec

    mod = _ext.get()
    info = {
        "offload": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "extension_built": mod is not None,
        "extension_path": getattr(mod, "__file__", None),
        "extension_error": _ext.error(),
        "build_dir": str(_ext.build_dir()),
    }
    try:
        info["build_features"] = build_spec().features
    except FileNotFoundError as exc:
        info["build_features"] = str(exc)
    if mod is not None:
        info["cpu_isa_best"] = mod.best_isa()
        info["cpu_isa_active"] = mod.active_isa()
        info["cpu_isa_choice"] = _ext.ISA_CHOICE["reason"]
        info["kernel_threads"] = mod.num_threads()
        if hasattr(mod, "aio_backends"):
            info["aio_backends"] = mod.aio_backends()
    from .compute_dtype import fast_compute_dtype
    from .device import compute_device

    info["compute_dtype_auto"] = "{} ({})".format(*fast_compute_dtype(compute_device()))  # Config.compute_dtype="auto"
    info.update(_host_memory_info())
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _host_memory_info() -> dict:
    """What the budgets are sized against: host memory (capped by the cgroup's limit), how much may be
    page-locked (the cpu arena is mlock'ed when it fits under RLIMIT_MEMLOCK, else registered with CUDA or left
    pageable), the NUMA nodes pinned pages could land on, each GPU's node, and the node the first rank's arena
    will prefer (None: the kernel's default placement). A running job says what it pinned and where in
    rt.stats()["memory"]["pinned"]."""
    import resource

    import torch

    from .device import compute_device
    from .store import format_bytes, host_memory, numa

    total, available = host_memory()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    info = {
        "host_memory": f"{format_bytes(total)} total, {format_bytes(available)} available (cgroup limit included)",
        "memlock_limit": "unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft),
        "numa_nodes": len(numa.online_nodes()),
        # (`offload finetune` sets expandable_segments:True when this is unset: device.prefer_expandable_segments)
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF")),
    }
    if torch.cuda.is_available():
        info["gpu_numa_nodes"] = {f"cuda:{i}": numa.gpu_node(torch.device("cuda", i))
                                  for i in range(torch.cuda.device_count())}
    try:
        info["arena_numa_node"] = numa.arena_node(compute_device())  # this process's (LOCAL_RANK's GPU)
    except ValueError as exc:  # OFFLOAD_NUMA_NODE set wrong: env is where a user looks
        info["arena_numa_node"] = str(exc)
    return info


# The subcommands: each one's help line and where its parser is built. `offload --help`, `--version` and a
# mistyped command import none of them (their modules import torch: 3 s of CPU before a word was printed); a
# command imports its own module only.
SUBCOMMANDS = {
    "bench": ("measure this machine (writes JSON that offload plan reads)", "offload.bench.cli", "add_bench_parser"),
    "finetune": ("fine-tune a Hugging Face causal LM with states paged to disk", "offload.finetune.cli",
                 "add_finetune_parser"),
    "export": ("a checkpoint's weights as a Hugging Face directory (safetensors)", "offload.checkpoint.export",
               "add_export_parser"),
    "plan": ("size a run before launching it: fit, placement, step time", "offload.plan.cli", "add_plan_parser"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `only` (a subcommand's name, or "" for none), that subcommand's parser in full and
    the others as their help line alone, so that nothing else is imported."""
    import importlib

    parser = argparse.ArgumentParser(prog="offload", description=__doc__)
    parser.add_argument("--version", action="version", version=f"offload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="versions, CPU ISA, extension build status")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.set_defaults(func=_cmd_env)
    for name, (help_line, module, add) in SUBCOMMANDS.items():  # a new subcommand: one row in SUBCOMMANDS
        if only is None or only == name:
            getattr(importlib.import_module(module), add)(sub, help_line)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def _command_in(argv: list[str]) -> str:
    """The subcommand `argv` names ("" for none): the first word that is not an option (the top level's options
    take no values)."""
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(only=_command_in(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if argv is None and args.command == "finetune":  # run as the program (not called by a test): its CUDA work
        from .device import prefer_expandable_segments  # is all ours, and none has started yet

        prefer_expandable_segments()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - a user sees one line; OFFLOAD_DEBUG=1 shows the traceback
        if env.DEBUG.on():  # OFFLOAD_DEBUG=1: the error raises with its traceback
            raise
        from .errors import InputError

        text = " ".join(str(exc).split()) or "(no message)"
        if isinstance(exc, InputError):  # input the command refused: exit 2, like argparse's own errors
            print(f"offload {args.command}: error: {text}", file=sys.stderr)
            return 2
        print(f"offload {args.command}: error: {type(exc).__name__}: {text} (OFFLOAD_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
