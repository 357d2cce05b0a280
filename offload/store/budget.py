"""Tier budgets: "60GiB"-style sizes or "auto", and the device tier's allocator.

"auto" resolves to a stated fraction of what is free now, split evenly among the ranks of this node that
share the resource (`ranks_sharing`, ranks_on_this_node(), for host memory and the swap drive; a GPU is its
rank's own):
    device: 90% of torch.cuda.mem_get_info() free bytes; on a machine without CUDA 25% of the available
            host memory (the device tier is then a region of host memory)
    cpu:    50% of the available host memory
    nvme:   90% of the free bytes of the swap directory's filesystem (shutil.disk_usage)
"Available host memory" is psutil's, capped by the cgroup's memory.max less its use (a container's limit).
An "auto" device budget is taken before the activations and the communicators exist: after the first step
the runtime fits it to what that step left free at its peak (fit_auto_device_budget, DeviceTier.set_limit).
This is the one rule: the runtime's store, its placement, and `offload finetune`'s check before loading a
model all take their nvme room from nvme_budget_bytes(). A size larger than the machine has is refused
(check_fits_machine): it could never be honoured, and would fail later inside an allocator.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .arena import ArenaBusyError, ArenaFullError, PinnedArena
from .sizes import format_bytes, parse_size

__all__ = ["AUTO_FRACTION", "resolve_budget", "nvme_budget_bytes", "host_memory", "check_fits_machine",
           "ranks_on_this_node", "fit_auto_device_budget", "DeviceTier"]

AUTO_FRACTION = {"device_cuda": 0.90, "device_host": 0.25, "cpu": 0.50, "nvme": 0.90}


def _cgroup_limit() -> tuple[int, int] | None:
    """(memory.max, memory.current) of this process's cgroup (v2, else v1), None when unlimited/unknown."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        return int(limit), usage
    return None


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory this process may use: the machine's, capped by its cgroup's."""
    import psutil

    vm = psutil.virtual_memory()
    total, available = vm.total, vm.available
    cg = _cgroup_limit()
    if cg is not None:
        total, available = min(total, cg[0]), min(available, max(0, cg[0] - cg[1]))
    return total, available


# How launchers tell a process how many ranks share its node: torchrun, Open MPI, MPICH/Intel MPI, Slurm's srun
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def ranks_on_this_node(world_size: int) -> int:
    """The ranks sharing this node's host memory and drive, from the launcher's environment, at most the world
    size (a lone `python train.py` inside an 8-task Slurm allocation is one rank, not eight); the world size
    (all ranks on one node) when no launcher says."""
    world_size = max(1, world_size)
    for name in _LOCAL_SIZE_VARS:
        value = os.environ.get(name, "").split("(")[0]  # Slurm may write "4(x2)": 4 tasks on each of 2 nodes
        if value.strip().isdigit() and int(value) > 0:
            return min(int(value), world_size)
    return world_size


def _existing(path: str) -> str:
    probe = path
    while probe and not os.path.exists(probe):  # the directory may not exist yet
        probe = os.path.dirname(probe)
    return probe or "."


def nvme_budget_bytes(value: int | str | None, nvme_path: str | None, ranks_sharing: int = 1) -> int:
    """This rank's nvme budget: `value` if given, else the "auto" rule (module docstring)."""
    if value is not None and value != "auto":
        return parse_size(value, "nvme_budget", counts=True)
    if not nvme_path:
        return 0
    free = shutil.disk_usage(_existing(nvme_path)).free
    return int(free * AUTO_FRACTION["nvme"] / max(1, ranks_sharing))


def resolve_budget(value: int | str, tier: str, *, nvme_path: str | None = None,
                   device: torch.device | None = None, ranks_sharing: int = 1) -> int:
    """Bytes of a tier budget; `value` is a size or "auto" (see the module docstring)."""
    what = f"{tier}_budget"
    if tier == "nvme":
        return nvme_budget_bytes(value, nvme_path, ranks_sharing)
    if value != "auto":
        return parse_size(value, what, counts=True)
    if tier == "device" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)  # the store's GPU (None: the current one); not shared
        return int(free * AUTO_FRACTION["device_cuda"])
    if tier in ("device", "cpu"):
        share = AUTO_FRACTION["cpu" if tier == "cpu" else "device_host"]
        return int(host_memory()[1] * share / max(1, ranks_sharing))
    raise ValueError(f"unknown tier {tier!r}")


def fit_auto_device_budget(budget: int, tier_in_use: int, tier_peak: int, free_at_peak: int,
                           fraction: float = AUTO_FRACTION["device_cuda"]) -> int:
    """An "auto" device budget fitted to a step that ran: the tier may hold what it holds now plus `fraction` of
    what the device had free at the step's peak (activations, autograd's buffers and communicators were all in
    use then), never more than `budget`, and never less than the tier's own peak in that step (its working set:
    a limit under it could leave a needed allocation waiting on nothing). The bytes the tier holds now are in
    both terms' complement: a transient block in use now is not free, so in_use + free does not depend on it."""
    room = tier_in_use + int(max(0, free_at_peak) * fraction)
    return min(budget, max(tier_peak, room))


def check_fits_machine(device_budget: int, cpu_budget: int, device: torch.device, ranks_sharing: int = 1,
                       names: tuple[str, str] = ("offload.Config.device_budget", "offload.Config.cpu_budget")) -> None:
    """Refuse budgets this machine cannot hold (ValueError naming the setting): a cpu budget above the host
    memory this process may use (its cgroup's limit included), shared with the other ranks of the node; a
    device budget above the GPU's memory; on a machine without a GPU, where the device tier is host memory
    too, the two together above it. `names`: the settings as the caller's user knows them (flags)."""
    dev_name, cpu_name = names
    total, _ = host_memory()
    per_rank = total // max(1, ranks_sharing)
    ranks = f" ({ranks_sharing} ranks on this node share it)" if ranks_sharing > 1 else ""
    if cpu_budget > per_rank:
        raise ValueError(f"{cpu_name}: {format_bytes(cpu_budget)} is more host memory than this machine has for "
                         f"a rank: {format_bytes(per_rank)}{ranks}; give at most that (or 'auto')")
    if device.type == "cuda":
        _, gpu_total = torch.cuda.mem_get_info(device)
        if device_budget > gpu_total:
            raise ValueError(f"{dev_name}: {format_bytes(device_budget)} is more than {device}'s "
                             f"{format_bytes(gpu_total)} of memory; give at most that (or 'auto')")
    elif device_budget + cpu_budget > per_rank:
        raise ValueError(f"{dev_name} + {cpu_name}: {format_bytes(device_budget)} + {format_bytes(cpu_budget)} is "
                         f"more than this machine's {format_bytes(per_rank)} of host memory for a rank{ranks}; "
                         "without a GPU the device tier is a region of host memory too, so the two share it: "
                         "lower them (or give 'auto')")


@dataclass(eq=False)
class _CudaBlock:
    tier: "DeviceTier"
    nbytes: int
    reserved: int
    tensor: torch.Tensor
    freed: bool = False

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.tensor[: numel * dtype.itemsize].view(dtype)

    def free(self) -> None:
        self.tier._free(self)


class DeviceTier:
    """The device tier's memory: a budget of `capacity` bytes handing out blocks with the arena's
    interface (alloc(nbytes, timeout) -> block with .view(dtype, numel), .free(), .reserved).

    With CUDA: tensors from torch's caching allocator on `device`, counted against the budget
    (rounded to 512 bytes, torch's own granularity). Without: a host PinnedArena (not locked), so
    the budget is enforced exactly the same way and the compute device is the CPU."""

    def __init__(self, capacity: int, device: torch.device, alloc_stream=None):
        self.device = device
        self.alloc_stream = alloc_stream  # CUDA: blocks come from this stream's pool (the stream that fills them)
        self.capacity = capacity  # what may be in use at once (set_limit may lower it)
        self._given = capacity
        self._host = None
        if device.type == "cpu":
            self._host = PinnedArena(capacity, lock=False, name="device tier (host memory)")
            self.capacity = self._host.capacity
        self._cv = threading.Condition()
        self._in_use = 0
        self._peak = 0
        self._frees = 0  # blocks freed so far: what a request the GPU refused waits to change
        self._gpu_full_at, self._gpu_full_size = -1, 0  # the GPU refused this size when _frees had this value

    @property
    def bytes_in_use(self) -> int:
        return self._host.bytes_in_use if self._host else self._in_use

    @property
    def peak_bytes(self) -> int:
        return self._host.peak_bytes if self._host else self._peak

    def alloc(self, nbytes: int, timeout: float | None = None):
        """A block of `nbytes`, waiting up to `timeout` seconds for room (None: as long as it takes for the
        budget; 0: not at all, ArenaBusyError at once: a prefetch backs off). The GPU itself may have less free
        than the budget (activations, communicators, other processes): then, like a full budget, the request
        waits for this tier's next free until its deadline (None: raises at once, naming device_budget), and
        later requests that could not wait do not try the allocator again until a block is freed."""
        if self._host is not None:
            return self._host.alloc(nbytes, timeout)
        size = -(-nbytes // 512) * 512
        if size > self._given:
            raise ArenaFullError(
                f"device tier: a request of {format_bytes(nbytes)} ({nbytes} bytes) can never fit in the device "
                f"budget of {format_bytes(self._given)}; raise device_budget"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cv:
                while self._in_use + size > self.capacity:
                    if size > self.capacity:  # over the limit an "auto" budget was fitted to (set_limit, maybe
                        # while this waited): a prefetch backs off, anything else could wait forever
                        raise (ArenaFullError if timeout is None else ArenaBusyError)(
                            f"device tier: a request of {format_bytes(nbytes)} ({nbytes} bytes) is over the device "
                            f"budget of {format_bytes(self.capacity)} that 'auto' was fitted to after the first "
                            "step (what it left free on the device); give device_budget")
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise ArenaBusyError(
                            f"device tier: timed out after {timeout}s waiting for {format_bytes(nbytes)}; "
                            f"{format_bytes(self._in_use)} of {format_bytes(self.capacity)} in use"
                        )
                    self._cv.wait(left)  # woken by _free
                if self._gpu_full_at == self._frees and size >= self._gpu_full_size and timeout == 0:
                    # the GPU refused as much since the last free: each try would flush the allocator's cache
                    raise self._gpu_full(size)
                self._in_use += size
                self._peak = max(self._peak, self._in_use)
                seen = self._frees
            try:
                with torch.cuda.stream(self.alloc_stream) if self.alloc_stream is not None else contextlib.nullcontext():
                    t = torch.empty(size, dtype=torch.uint8, device=self.device)[:nbytes]
                return _CudaBlock(self, nbytes, size, t)
            except torch.OutOfMemoryError:
                with self._cv:
                    self._in_use -= size  # not a free: OOM waiters keep waiting for a real one
                    self._cv.notify_all()  # budget waiters may fit now
                    self._gpu_full_at, self._gpu_full_size = self._frees, size
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is None or left <= 0 or not self._cv.wait_for(lambda: self._frees != seen, left):
                        raise self._gpu_full(size) from None
            except Exception:
                self._release(size)
                raise

    def set_limit(self, nbytes: int) -> int:
        """Hold at most `nbytes` from now on (fit_auto_device_budget's figure; never above the budget given at
        the start): blocks in use stay, requests that would pass it wait for frees or back off. The limit set."""
        if self._host is not None:
            self.capacity = self._host.set_limit(nbytes)
            return self.capacity
        with self._cv:
            self.capacity = min(self._given, -(-max(0, int(nbytes)) // 512) * 512)
            self._cv.notify_all()  # waiters re-check against the new limit
            return self.capacity

    def _gpu_full(self, size: int) -> ArenaBusyError:
        free, _ = torch.cuda.mem_get_info(self.device)
        return ArenaBusyError(
            f"device tier: {self.device} has {format_bytes(free)} free, not the {format_bytes(size)} asked for, "
            f"though the device budget has room ({format_bytes(self._in_use)} of {format_bytes(self.capacity)} in "
            "use): other memory (activations, communicators, other processes) took it; lower device_budget"
        )

    def _release(self, size: int) -> None:
        with self._cv:
            self._in_use -= size
            self._cv.notify_all()  # budget freed: waiters re-check

    def _free(self, blk: _CudaBlock) -> None:
        if blk.freed:
            raise RuntimeError("device tier: block freed twice")
        blk.freed = True
        blk.tensor = torch.empty(0, dtype=torch.uint8)
        with self._cv:
            self._frees += 1  # under the lock with the release: a waiter cannot miss it
            self._in_use -= blk.reserved
            self._cv.notify_all()

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
