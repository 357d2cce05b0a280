"""What `offload finetune` checks and claims before the model loads, so that no run is lost to a late check:
the output and checkpoint directories (writable, and this run's alone while it lives), budgets the machine
can hold, and room on the swap drive by the store's own rule; plus the spelling of the runtime's settings as
this command's flags in every message.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..config import Config
from ..dir_lock import DirectoryInUse, DirLock, LockUnavailable, make_locked_dir, remove_stale
from ..errors import InputError
from .config import FinetuneConfig

log = logging.getLogger("offload")

RUNTIME_FIELDS = ("params", "optimizer", "nvme_path", "nvme_budget", "cpu_budget", "device_budget",
                   "compute_dtype", "update_in_backward", "activations")
SWAP_DIR_PREFIX = "offload-finetune-"  # the default swap directory: TMPDIR/offload-finetune-<random>


def as_flags(message: str) -> str:
    """A runtime error's message with its offload.Config settings spelled as this command's flags (the user
    typed --cpu-budget, not offload.Config.cpu_budget)."""
    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')}" if name in RUNTIME_FIELDS else f"{name} (in --config)"

    message = re.sub(r"offload\.Config\.(\w+)", lambda m: flag(m.group(1)), message)
    message = re.sub(r"\b(params|optimizer)='(\w+)'", lambda m: f"--{m.group(1)} {m.group(2)}", message)
    return re.sub(r"\b(?<!-)(cpu_budget|device_budget|nvme_budget|nvme_path)\b", lambda m: flag(m.group(1)),
                  message)


def check_budgets(cfg: Config, world: int) -> None:
    """Budgets this machine cannot hold, refused before anything is loaded (the runtime's own check)."""
    from ..device import compute_device
    from ..store import check_fits_machine, ranks_on_this_node, resolve_budget

    local = ranks_on_this_node(world)
    device = compute_device()
    sizes = {t: resolve_budget(getattr(cfg, f"{t}_budget"), t, ranks_sharing=local,
                               device=device if device.type == "cuda" else None) for t in ("device", "cpu")}
    try:
        check_fits_machine(sizes["device"], sizes["cpu"], device, local, names=("--device-budget", "--cpu-budget"))
    except ValueError as exc:
        raise InputError(str(exc)) from None


def swap_bytes_per_rank(cfg: Config, n_params: int, n_tensors: int, world: int,
                        trained_params: int | None = None) -> int:
    """An upper bound of the swap space one rank's nvme-homed states take, as the store lays them out: this
    rank's share of every parameter at the bytes its states keep (placement.py: the compute-dtype parameter and
    the fp32 master unless the parameter is it; of the `trained_params` (default all; a LoRA run's adapters) also
    the optimizer family's states and the fp32 gradient), plus each unit's padding and page rounding (at most
    one alignment quantum a unit and one page a chunk, chunks being at least half a MiB; every unit holds at
    least one tensor)."""
    from ..store.swap_file import SLOT_ALIGN
    from ..zero.units.layout import ALIGN
    from ..optim.schema import by_name

    compute = cfg.torch_compute_dtype.itemsize
    every, trained = [], []  # bytes per element of each nvme-homed state: of every parameter, of trained ones
    if cfg.params == "nvme":
        every.append(compute)
    if cfg.optimizer == "nvme":
        every += [4] if compute != 4 else []
        trained += [s.bytes_per_element for s in by_name(cfg.optimizer_states).states] + [4]
    numel = math.ceil(n_params / world)
    trained_numel = numel if trained_params is None else math.ceil(trained_params / world)
    chunks = math.ceil(numel * 4 / (512 << 10)) + n_tensors
    return math.ceil(sum(k * (numel + n_tensors * ALIGN) + chunks * SLOT_ALIGN for k in every)
                     + sum(k * (trained_numel + n_tensors * ALIGN) + chunks * SLOT_ALIGN for k in trained))


def check_swap_room(cfg: Config, n_params: int, n_tensors: int, world: int, budget_setting: str,
                    trained_params: int | None = None) -> None:
    """Before the first byte is written: room for this rank's swap by the runtime's own rule (the same
    budget the store will enforce: nvme_budget, else 90% of the free space split among this node's ranks).
    `budget_setting`: where an explicit nvme budget came from, as the user wrote it (the flag or --config)."""
    if "nvme" not in (cfg.params, cfg.optimizer):
        return
    from ..store import format_bytes, ranks_on_this_node
    from ..zero.state_store import prepare_swap_dir

    local = ranks_on_this_node(world)
    try:
        budget = prepare_swap_dir(cfg.nvme_path, cfg.nvme_budget, local)
    except OSError as exc:
        raise InputError(as_flags(str(exc))) from None
    need = swap_bytes_per_rank(cfg, n_params, n_tensors, world, trained_params)
    if need <= budget:
        return
    states = f"this run swaps up to {format_bytes(need)} a rank (params on {cfg.params}, optimizer states on {cfg.optimizer})"
    if cfg.nvme_budget not in (None, "auto"):
        raise InputError(f"{budget_setting}: {states} but the budget is {format_bytes(budget)}; raise it (the drive "
                         f"has {format_bytes(shutil.disk_usage(cfg.nvme_path).free)} free), or keep a state in memory "
                         "(--params cpu / --optimizer cpu)")
    free = shutil.disk_usage(cfg.nvme_path).free
    raise InputError(f"--nvme-path {cfg.nvme_path}: {states} but the nvme budget is {format_bytes(budget)} (90% of "
                     f"the {format_bytes(free)} free" + (f", split among {local} ranks" if local > 1 else "") +
                     "); free space there, give --nvme-path on a larger drive, or keep a state in memory "
                     "(--params cpu / --optimizer cpu)")


def _claim(directory: str | os.PathLike, flag: str, held: contextlib.ExitStack) -> None:
    """This run's own `directory` for its whole life: a second run naming it is refused with this one's pid."""
    try:
        held.enter_context(DirLock.acquire(directory, f"offload finetune {flag}"))
    except DirectoryInUse as busy:
        who = busy.owner.describe() if busy.owner else "pid unknown"
        raise InputError(f"{flag} {directory}: in use by another live run ({who}); wait for it to end or give "
                         f"another {flag}") from None
    except LockUnavailable as exc:
        log.warning("offload finetune: %s; a second run given %s %s would not be refused", exc, flag, directory)


def claim_outputs(cfg: FinetuneConfig, held: contextlib.ExitStack) -> None:
    """The output and checkpoint directories: writable (found now, not after training, when the trained
    weights would be lost) and this run's alone (rank 0 writes them; two runs would prune each other's
    checkpoints and overwrite each other's model)."""
    check_writable_dir(cfg.output, "--output")
    if cfg.checkpoint_dir is not None:
        check_writable_dir(cfg.checkpoint_dir, "--checkpoint-dir")
    if int(os.environ.get("RANK", "0")) != 0:
        return
    _claim(cfg.output, "--output", held)
    if cfg.checkpoint_dir is not None and Path(cfg.checkpoint_dir).resolve() != Path(cfg.output).resolve():
        _claim(cfg.checkpoint_dir, "--checkpoint-dir", held)


def own_swap_dir(held: contextlib.ExitStack) -> str:
    """A temporary swap directory of this process's (used unless --nvme-path / --config gives one), locked
    so that the next run finds and removes it if this process dies without cleaning up (kill -9); the
    directories of such dead runs are removed here first."""
    from ..zero.state_store import SWAP_LOCK

    remove_stale(tempfile.gettempdir(), SWAP_DIR_PREFIX, SWAP_LOCK)
    path, lock = make_locked_dir(tempfile.gettempdir(), SWAP_DIR_PREFIX, SWAP_LOCK)
    if lock is not None:
        held.callback(lock.release)
    held.callback(shutil.rmtree, path, True)  # first out: the files go, then the lock (a cleaner skips it meanwhile)
    return str(path)


def check_writable_dir(path: str | os.PathLike, flag: str) -> None:
    """`path` is a directory this process can create files in, or can be made one (its nearest existing
    ancestor is): a probe file is written and removed there, so a read-only mount or a file in the way is
    found before training (permission bits alone say nothing for root)."""
    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise InputError(f"{flag} {path}: is a file, not a directory; give a directory (it is created if missing)")
    probe_dir = p
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise InputError(f"{flag} {path}: {probe_dir} is a file, so the directory cannot be created there")
    try:
        fd, probe = tempfile.mkstemp(prefix=".offload-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot write in {probe_dir} ({exc.strerror}); give a writable "
                         "directory") from None
