"""The runtime's view of the tiered store (offload/store): unit shards by ShardSpec, handed out as leases.

    states.register(spec, init=t)                  # home copy in spec.home (zeros without init)
    lease = states.lease(spec, Use.HOST, LeaseMode.UPDATE)   # at once; lease.wait() where the bytes are needed
    done = lease.release()                         # write-behind future
    states.keep_resident(specs)                    # held in the cpu tier across steps (no I/O while held)

Where a consumer wants a shard:
  Use.COMPUTE  the gather's source: the compute device (on a CPU-only machine, host memory: a working copy
               in the cpu tier for nvme homes, the home copy otherwise)
  Use.HOST     the CPU optimizer and the gradient accumulation: host memory (a cpu working copy for nvme
               homes; the home copy for cpu homes; for device homes on a GPU, a host copy made when waited)

This class also owns the runtime's swap directory: it creates the run directory (0700) under nvme_path, holds
its lock for the run's life (offload/dir_lock.py) and removes it when closed. prepare_swap_dir() is what every
run does first with nvme_path: check it, remove what dead runs left there (a kill -9 cannot clean up after
itself), and take this rank's nvme budget by the store's one rule.
"""
from __future__ import annotations

import concurrent.futures as cf
import enum
import os
import shutil
from pathlib import Path

import torch

from ..store.sizes import format_bytes
from ..device import retire
from ..dir_lock import DirLock, make_locked_dir, remove_stale
from ..store import LeaseMode, StoreConfig, Tier, TieredStore, nvme_budget_bytes
from ..store.lease import Lease, resolved
from .shards import ShardKey, ShardSpec

ALLOC_TIMEOUT_S = 120.0  # a buffer that cannot be had in this long is a planning error: raise, never hang
RUN_DIR_PREFIX = "offload-"  # a run directory is nvme_path/offload-<pid>-rank<r>-<random>
SWAP_LOCK = "offload swap"  # what a run directory's lock says it is for (only such directories are ever removed)


class Use(enum.Enum):
    COMPUTE = "compute"
    HOST = "host"


class ResidentLease:
    """A lease on a shard held resident: the bytes are already in the cpu tier (pinned); nothing moves. Writes
    by UPDATE / OVERWRITE holders land in the resident copy (written home when it stops being resident).
    A GPU consumer gets a device copy made when waited, on its current stream (an async DMA from the pinned
    copy). The lanes that take such leases (gather, reduce) sync their copies before their futures resolve,
    and a host writer of the shard (the optimizer) waits for those futures: no DMA reads bytes being written."""

    def __init__(self, key: ShardKey, tensor: torch.Tensor, mode: LeaseMode, to_device: torch.device | None):
        self.key, self.mode = key, mode
        self._tensor = tensor
        self._device = to_device  # a compute consumer (GPU, or the device tier on a CPU): copied when waited
        self._copy: torch.Tensor | None = None
        self._released: cf.Future | None = None

    def ready(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self._released is not None:
            raise RuntimeError(f"lease of {self.key} used after release")
        if self._device is None:
            return self._tensor
        if self._copy is None:  # pinned -> device on this stream (a copy on the CPU too: .to would alias it)
            self._copy = torch.empty(self._tensor.shape, dtype=self._tensor.dtype, device=self._device)
            self._copy.copy_(self._tensor, non_blocking=True)
        return self._copy

    def release(self) -> cf.Future:
        if self._released is None:
            if self._copy is not None and self.mode is not LeaseMode.READ:
                self._tensor.copy_(self._copy)  # blocking: the host copy is the truth once released
            retire(self._copy)  # read on the holder's stream
            self._copy = None
            self._released = resolved()
        return self._released


class HostCopyLease:
    """A device-homed shard (GPU) lent to the CPU: a host copy made when waited, copied back on release
    when written. The CPU optimizer over optimizer='device' states takes this path: blocking pageable copies,
    correct but not overlapped (docs/zero-runtime.md; a device-side update is the update-path issue's)."""

    def __init__(self, inner: Lease):
        self.key, self.mode = inner.key, inner.mode
        self._inner = inner
        self._host: torch.Tensor | None = None

    def ready(self) -> bool:
        return self._inner.ready()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self._host is None:
            dev = self._inner.wait(timeout)
            self._host = dev.to("cpu") if self.mode is not LeaseMode.OVERWRITE else torch.empty(
                dev.shape, dtype=dev.dtype)
        return self._host

    def release(self) -> cf.Future:
        if self._host is not None and self.mode is not LeaseMode.READ:
            # no reader of the old bytes is left: a gather's lane syncs its copies of them before its future
            # resolves, and an update waits for the unit's gathers (unit.py); the copy from pageable memory is
            # over when it returns
            self._inner.wait().copy_(self._host)
        self._host = None
        return self._inner.release()


class UnitStateStore:
    def __init__(self, device: torch.device, budgets: dict, nvme_path: str | None, rank: int = 0,
                 checksums: bool = True, compute_through_device_tier: bool = False):
        self.device = torch.device(device)
        self.run_dir: Path | None = None
        self._run_lock: DirLock | None = None
        if nvme_path:
            # A fresh directory of our own: unpredictable name, mode 0700 (never a planted directory or symlink),
            # locked before it shows under its name and while this process lives; removed by close()
            self.run_dir, self._run_lock = make_locked_dir(nvme_path, f"{RUN_DIR_PREFIX}{os.getpid()}-rank{rank}-",
                                                           SWAP_LOCK)
        cfg = StoreConfig(
            device_budget=budgets["device"] if budgets["device"] is not None else "auto",
            cpu_budget=budgets["cpu"] if budgets["cpu"] is not None else "auto",
            nvme_budget=budgets["nvme"] if budgets.get("nvme") is not None else "auto",
            nvme_path=str(self.run_dir) if self.run_dir is not None else None,
            rank=rank,
            device=str(self.device),
            # page-locking only pays for DMA to a GPU; without one it would just pin RSS
            lock_memory="auto" if self.device.type == "cuda" else False,
            alloc_timeout=ALLOC_TIMEOUT_S,
            checksums=checksums,
        )
        try:
            self.store = TieredStore(cfg)
        except BaseException:
            self._remove_run_dir()
            raise
        self._registered: set[ShardKey] = set()
        self._resident: dict[ShardKey, Lease] = {}
        # Compute leases take working copies in the device tier: on a GPU always. On a CPU run the compute device
        # reads host memory, so they lend the home (cpu) copy, unless Config.compute_through_device_tier (tests):
        # then they page through the device tier (host memory there) as on a GPU, and CPU CI runs the GPU's moves.
        self.compute_in_device_tier = self.device.type != "cpu" or compute_through_device_tier

    # ---- budgets ----------------------------------------------------------------------------
    def capacity(self, tier: str) -> int:
        return self.store.stats()[tier]["capacity"]

    def nbytes_in(self, tier: str) -> int:
        return self.store.stats()[tier]["bytes_in_use"]

    def set_staging_slot(self, nbytes: int) -> None:
        """Every short-lived cpu working copy takes `nbytes` (the largest chunk): see store/arena.py."""
        self.store.set_staging_slot(max(nbytes, self.store.staging_slot))

    def swap_location(self, spec: ShardSpec) -> tuple[int, int] | None:
        """Where an nvme-homed shard's slot is (fd, offset), unless it is held resident (the slot is stale)."""
        return None if spec.key in self._resident else self.store.swap_location(spec.key)

    def free_staging_bytes(self) -> int:
        return self.store.free_staging_bytes()

    def staged_nbytes(self, spec: ShardSpec) -> int:
        """Bytes of the cpu budget a short-lived working copy of `spec` takes (its staging slot)."""
        return self.store.staged_nbytes(spec.nbytes)

    # ---- shards -----------------------------------------------------------------------------
    def has(self, spec: ShardSpec) -> bool:
        return spec.key in self._registered

    def register(self, spec: ShardSpec, init: torch.Tensor | None = None) -> cf.Future:
        """The home copy of `spec`: `init`'s values (cast like .to()) or zeros. Future: the home copy holds them."""
        if init is not None:
            init = init.detach().reshape(-1).contiguous()
        try:
            fut = self.store.register(spec.key, spec.numel, spec.dtype, home=spec.home, tier_class=spec.tier_class,
                                      init=init)
        except MemoryError as exc:
            raise MemoryError(f"offload: shard {spec.key} ({format_bytes(spec.nbytes)}) does not fit its "
                              f"{spec.home.value} tier: {exc}") from exc
        self._registered.add(spec.key)
        return fut

    # See [Note: a speculative update commits or is taken back] in docs/zero-runtime.md
    def exchange(self, spec: ShardSpec, spare: ShardSpec) -> None:
        """Swap the nvme slots of `spec` and its registered `spare` (TieredStore.exchange_slots): `spec`'s next
        write lands beside its last one, which the spare keeps until exchanged back."""
        self.store.exchange_slots(spec.key, spare.key)

    def tier_for(self, spec: ShardSpec, use: Use) -> Tier:
        if use is Use.COMPUTE and self.compute_in_device_tier:
            return Tier.DEVICE
        return Tier.CPU if spec.home is Tier.NVME else spec.home  # memory homes lend their home copy

    def lease(self, spec: ShardSpec, use: Use, mode: LeaseMode, block: bool = True):
        """A lease on spec's bytes where `use` needs them (see the module docstring). block=False: None when
        the tier has no room now (a prefetch backs off)."""
        held = self._resident.get(spec.key)
        if held is not None:
            copied = use is Use.COMPUTE and self.compute_in_device_tier
            return ResidentLease(spec.key, held.wait(), mode, self.device if copied else None)
        tier = self.tier_for(spec, use)
        if use is Use.HOST and tier is Tier.DEVICE and self.device.type != "cpu":
            inner = self.store.lease(spec.key, Tier.DEVICE, mode, block)
            return None if inner is None else HostCopyLease(inner)
        return self.store.lease(spec.key, tier, mode, block)

    # ---- residency across steps ---------------------------------------------------------------
    def resident_keys(self) -> frozenset:
        return frozenset(self._resident)

    def is_resident(self, spec: ShardSpec) -> bool:
        return spec.key in self._resident

    def keep_resident(self, specs: list[ShardSpec]) -> None:
        """Hold these nvme-homed shards in the cpu tier from now on (their bytes read in once)."""
        for spec in specs:
            if spec.key not in self._resident and spec.home is Tier.NVME:
                lease = self.store.lease(spec.key, Tier.CPU, LeaseMode.UPDATE, block=False, resident=True)
                if lease is None:
                    break  # no room now: the rest stay paged (the plan is retried at the next re-plan)
                self._resident[spec.key] = lease
        for lease in self._resident.values():
            lease.wait()  # the resident copies are read before anyone borrows them

    def evict(self, keys) -> list[cf.Future]:
        """Stop holding these shards: each is written home (write-behind) and its buffer freed."""
        return [self._resident.pop(k).release() for k in list(keys) if k in self._resident]

    def flush(self) -> None:
        """Write every resident copy home (they stay resident): the swap files hold the current values."""
        futs = [self.store.writeback(k) for k in self._resident]
        for f in futs:
            f.result()  # the caller (a checkpoint, close) needs the bytes home

    def wait_moves(self) -> None:
        """Wait for every move asked of the store so far (write-behinds included); raises the first failure."""
        self.store.wait_all()

    # ---- lifetime / stats -------------------------------------------------------------------
    def stats(self) -> dict:
        return self.store.stats()

    def close(self) -> None:
        """Close the store (joins its threads, frees the arena, removes swap files) and the run directory.
        Resident copies are dropped: the run's states die with it (checkpoints keep what must survive)."""
        self._resident.clear()
        try:
            self.store.close()
        finally:
            self._registered.clear()
            self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        if self.run_dir is not None and self.run_dir.exists():
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._run_lock is not None:
            self._run_lock.release()  # after the files: a cleaner never sees an unlocked half-removed directory

    @property
    def closed(self) -> bool:
        return self.store.closed


# See [Note: swap directories are locked] in docs/zero-runtime.md
def prepare_swap_dir(path: str | os.PathLike, budget: str | int | None, ranks_sharing: int) -> int:
    """What a run does first with its nvme_path: check it (check_nvme_path), remove the swap directories that
    dead runs left under it, then this rank's nvme budget by the store's rule (store.nvme_budget_bytes: the
    setting, else 90% of the free space split among the `ranks_sharing` ranks of this node). An explicit
    budget is this rank's: the node's ranks together must find it free."""
    check_nvme_path(path, None, "")
    remove_stale(path, RUN_DIR_PREFIX, SWAP_LOCK)
    if budget is not None and budget != "auto":
        need = nvme_budget_bytes(budget, str(path))
        check_nvme_path(path, need * ranks_sharing,
                        "nvme_budget" + (f" x the {ranks_sharing} ranks of this node" if ranks_sharing > 1 else ""))
        return need
    return nvme_budget_bytes("auto", str(path), ranks_sharing)


def check_nvme_path(path: str | os.PathLike, need_bytes: int | None, what: str) -> None:
    """Fail early (with the numbers) when `path` is missing, read-only, or has less than `need_bytes` free."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"offload.Config.nvme_path: {p} does not exist; create it (mkdir -p {p}) "
                                "on the NVMe drive you want to swap to")
    if not p.is_dir():
        raise NotADirectoryError(f"offload.Config.nvme_path: {p} is not a directory")
    probe = p / f".offload-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        probe.unlink()
    except OSError as exc:
        raise PermissionError(
            f"offload.Config.nvme_path: {p} is not writable ({exc.strerror}, errno {exc.errno}); "
            "give a directory this process can write to"
        ) from exc
    if need_bytes is not None:
        free = shutil.disk_usage(p).free
        if free < need_bytes:
            raise OSError(
                f"offload.Config.nvme_path: {p} has {format_bytes(free)} ({free} bytes) free but {what} needs "
                f"{format_bytes(need_bytes)} ({need_bytes} bytes); free space or choose a larger drive"
            )
