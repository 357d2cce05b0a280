"""TieredStore: named flat shards paged among the device, pinned host RAM (cpu) and NVMe, within budgets.

    from offload.store import TieredStore, StoreConfig
    with TieredStore(StoreConfig(device_budget="8GiB", cpu_budget="32GiB", nvme_budget="1TiB",
                                 nvme_path="/nvme/run1")) as store:
        store.register("layer0.master", numel, torch.float32, home="nvme", tier_class="optim", init=t)
        x = store.fetch("layer0.master", "cpu").result()   # Future[Tensor]: the working copy
        x.mul_(0.5)
        store.writeback("layer0.master")                   # Future[None]: working copy -> home copy
        store.release("layer0.master")                     # Future[None]: drop the working copy
        lease = store.lease("layer0.master", "cpu", LeaseMode.UPDATE)  # the same as one claim (lease.py)
        store.stats()                                      # bytes in use / peak per tier, bytes moved
        store.held()                                       # what the cpu and device tiers hold, by class

Shard names are strings or small frozen records (any hashable; str() of it appears in messages).

Every shard has a home tier that always holds a copy (the *home copy*: a swap-file slot, a cpu buffer
in the pinned arena, or a device buffer; or a slot of another storage tier named in StoreConfig.tiers, which
the state machine treats as it does nvme). Every home is a HomeTier (home_tier.py) and a shard's home is
(tier, slot): a MemoryTier (cpu_tier.py, device_tier.py) whose slot is a block read as a view, or a
StorageTier (storage_tier.py, nvme_tier.py) read into and written from a cpu buffer; docs/tiers.md.
fetch(name, tier) makes a *working copy* in a faster tier and returns it; writeback copies the working copy
to the home copy; release frees the working copy (release(name, writeback=True) does both). fetch to the
home tier returns the home copy itself. A shard has at most one working copy: fetching it to another tier
moves the working copy there.

Guarantees
- Moves of one shard run in the order they were asked for; moves of different shards run in
  parallel on `io_workers` threads (and the aio engine's queue underneath). fetch/writeback/release
  return at once with a future: they may submit the move's first I/O from the calling thread (when
  nothing of that shard is queued before it) and a release without writeback may free the buffer
  right there, but they never copy or wait for I/O in the caller; they only wait for budget space.
- A buffer is freed only by the move that last used it, after that move's I/O or copy is over, and the
  arena hands a range out again only after it was freed: no buffer is reused while a move into or out
  of it is in flight. A tensor returned by fetch is valid until that shard's next release or fetch to
  another tier; do not touch it while a writeback of that shard is in flight.
- Budgets: cpu buffers come from the cpu tier's PinnedArena whose capacity is the cpu budget; device buffers
  from the device tier's budget (memory_tier.py); swap slots are counted against their storage tier's budget at
  register time.
  A request that can never fit raises (naming the size and the budget); one that does not fit *now*
  blocks in the calling thread until a release frees space (`timeout`, else StoreConfig.alloc_timeout),
  or with timeout=0 raises ArenaBusyError at once (a prefetch backs off instead of stalling).
- A working copy whose writeback failed is never dropped unsaved: every later release of it (with
  writeback or not, a READ lease's included) writes it home first, and keeps it when that fails again.
- fetch(name, tier, read=False) makes a working copy without reading it (its bytes are undefined until
  the caller writes them all): no I/O for bytes about to be overwritten.
- Short-lived cpu buffers (working copies, staging) take one slot of `staging_slot` bytes each when it is
  set (set_staging_slot: the largest of them); home copies and working copies fetched with resident=True
  (held for many steps) take their own size (arena.py: so the room a caller plans for its short-lived
  buffers, free_staging_bytes(), is always usable, never split into pieces).
- Residency (residency.py) is written only by _transition, which asserts the move is allowed.
- close() (or leaving `with`, also by an exception) cancels moves not yet started, waits for the
  ones running, joins the worker threads and the aio engine, frees the arena and removes the swap
  files and the swap directory if the store created it.

Call fetch/writeback/release of one shard from one thread at a time (different shards: any threads).
Without a GPU, the device tier is a budgeted region of host memory and its tensors are CPU tensors.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import xxhash

from ..device import resolve as resolve_device
from ..device import thread_initializer
from ..ops.copy import copy_ as _host_copy
from .. import inject
from ..telemetry import Queue
from .arena import ArenaBusyError, PinnedArena
from .budget import resolve_budget
from .cpu_tier import CpuMemoryTier
from .device_tier import DeviceMemoryTier
from .home_tier import HomeTier
from .lease import Lease, LeaseMode, resolved
from .links import Link, LinkMeter
from .moves import TO_WORKER, Moves, drop_unused
from . import nvme_tier  # noqa: F401  (registers the "nvme" storage tier)
from .residency import TRANSITIONS, Residency, Tier
from .storage_tier import StorageTier, build_storage_tier, run_every
from .swap_file import SLOT_ALIGN

__all__ = ["TieredStore", "StoreConfig", "StoreError", "ShardInfo"]

R = Residency
_DONE = resolved()  # what a release with nothing to do returns (a finished future: safe to share)


def _digest(t: torch.Tensor) -> int:
    """XXH3-64 of a host uint8 tensor's bytes (xxhash releases the GIL; about 29 GB/s on one core here, five
    times zlib's CRC-32)."""
    return xxhash.xxh3_64_intdigest(memoryview(t.numpy()))


class StoreError(RuntimeError):
    """Misuse of the store (unknown shard, wrong tier, closed store) or a move that could not run."""


class SwapCorruptError(StoreError):
    """A swap slot read back with other bytes than were written (bit rot, a bad drive, another writer)."""


@dataclass
class StoreConfig:
    """Budgets are sizes ("60GiB", "512MiB", bytes) or "auto" (see budget.py for the fractions)."""

    device_budget: int | str = "auto"
    cpu_budget: int | str = "auto"
    nvme_budget: int | str = "auto"
    nvme_path: str | None = None  # swap directory; needed only for shards whose home is "nvme"
    rank: int = 0  # names the swap files: rank{rank}-{tier_class}.swap
    device: str | None = None  # compute device; default "cuda" when available, else "cpu"
    lock_memory: bool | str = "auto"  # page-lock the arena: "auto" where allowed, True required, False never
    numa_node: int | str | None = "auto"  # the arena's pages prefer this node; "auto": numa.arena_node(device)
    io_workers: int = 16  # threads running moves (each waits on its own I/O or copy; enough to keep the aio queue full)
    alloc_timeout: float | None = None  # default wait for budget space (None: until a release frees it)
    aio_block_size: int | str = "1MiB"
    aio_queue_depth: int = 32
    aio_workers: int = 2
    aio_backend: str = "auto"
    checksums: bool = True  # an XXH3-64 of every swap slot, taken at write, verified at read (SwapCorruptError)
    # storage tiers beside nvme, by registered name: {name: its settings} (storage_tier.py, docs/tiers.md)
    tiers: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ShardInfo:
    name: object
    numel: int
    dtype: torch.dtype
    home: Tier
    tier_class: str
    nbytes: int
    residency: Residency
    home_name: str = ""  # the home tier's name: home.value, or a storage tier's ("nvme", or one registered)


@dataclass(eq=False)
class _Shard:
    name: object
    numel: int
    dtype: torch.dtype
    home: Tier  # its level (home_tier.level): a shard homed in a storage tier is Tier.NVME
    tier_class: str
    nbytes: int
    residency: Residency
    home_tier: HomeTier  # where the home copy is (home_tier.py): a memory tier or a storage tier
    slot: object = None  # the home copy's slot there (a memory tier's: its block); None once unregistered
    cpu_block: object = None  # home in a storage tier: staging buffer holding the working copy at CPU
    dev_block: object = None  # working copy on the device (home cpu / nvme)
    target: Tier | None = None  # where the working copy will be once queued moves ran (None: home only)
    last: cf.Future | None = None  # the last move queued for this shard
    digest: int | None = None  # XXH3-64 of the slot's bytes as last written (StoreConfig.checksums)
    torn: str | None = None  # the slot's last write failed (its error): no complete copy there; reads refuse it
    leases: int = 0  # leases handed out and not released: they share the working copy (freed after the last)
    lease_tier: Tier | None = None  # the tier of those leases (one: a working copy is in one tier)
    unsaved: str | None = None  # the last writeback failed (its error): the working copy holds changes the home
    #                             copy lacks, so every later release writes it home first (or fails, keeping it)
    home_ready: tuple | None = None  # (slot, home tier, a resolved future of the home copy's view): _home_ready


def _view(block, s: _Shard) -> torch.Tensor:
    return block.view(s.dtype, s.numel)


def _home_view(s: _Shard) -> torch.Tensor:
    """The home copy of a shard homed in memory: a view of its block."""
    return s.home_tier.view(s.slot, s.dtype, s.numel)


def _home_ready(s: _Shard) -> cf.Future:
    """A resolved future of _home_view(s), made once per home block and shared by every lease of the shard on it
    (per lease, two tensor ops and a future a step: 9% of the training thread's time over 120 small units). Its
    holders read and write through the tensor and never reshape it in place."""
    cached = s.home_ready
    if cached is not None and cached[0] is s.slot and cached[1] is s.home_tier:
        return cached[2]
    ready = resolved(_home_view(s))
    s.home_ready = (s.slot, s.home_tier, ready)
    return ready


class TieredStore:
    """See the module docstring."""

    def __init__(self, config: StoreConfig | None = None, **overrides):
        cfg = config or StoreConfig()
        if overrides:
            cfg = StoreConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        # an index always: "cuda" alone would mean each worker thread's current device (0 unless bound)
        self.device = resolve_device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # Re-entrant: a future's done-callbacks (which take the lock) can fire inside _chain, which holds it.
        self._lock = threading.RLock()
        self._closed = False
        self._shards: dict[str, _Shard] = {}
        self._moves = Moves(self._lock, StoreError)  # the moves in flight and their workers (moves.py)
        self._links = LinkMeter()
        self._storage: dict[str, StorageTier] = {}  # the storage tiers by name (nvme when nvme_path is set)
        self._cpu: CpuMemoryTier | None = None  # the memory tiers (memory_tier.py)
        self._dev: DeviceMemoryTier | None = None
        try:
            page = SLOT_ALIGN
            cpu_cap = resolve_budget(cfg.cpu_budget, "cpu") // page * page
            dev_cap = resolve_budget(cfg.device_budget, "device",
                                     device=self.device if self.device.type == "cuda" else None) // page * page
            self._nvme_budget = resolve_budget(cfg.nvme_budget, "nvme", nvme_path=cfg.nvme_path)  # checked always
            wanted = ({Tier.NVME.value: {}} if cfg.nvme_path is not None else {}) | dict(cfg.tiers)
            for tier_name, settings in wanted.items():
                tier = self._storage[tier_name] = build_storage_tier(tier_name, cfg, settings)
                self._links.add(tier.read_link)
                self._links.add(tier.write_link)
            self._cpu = CpuMemoryTier(cpu_cap, self.device, cfg.lock_memory, cfg.numa_node)
            self._dev = DeviceMemoryTier(dev_cap, self.device)
            self._moves.start(cfg.io_workers, thread_initializer(self.device))
        except BaseException:
            self._teardown()
            raise
        # a store dropped without close(): its files, pins and threads still go, without waiting (a finalizer
        # may run on one of the store's own threads, which cannot join itself); close() waits and detaches it
        self._finalizer = weakref.finalize(self, _release, self._parts(), False)

    # ------------------------------------------------------------------ public API

    def register(
        self,
        name: str,
        numel: int,
        dtype: torch.dtype = torch.float32,
        home: str | Tier = "cpu",
        tier_class: str = "params",
        init: torch.Tensor | None = None,
        timeout: float | None = None,
        zero: bool = True,
    ) -> cf.Future:
        """Adds shard `name` of `numel` elements, its home copy in tier `home` ("device", "cpu", "nvme" or a
        storage tier named in StoreConfig.tiers; nvme shards go to the swap file of `tier_class`). Contents:
        `init` (cast like .to() if its dtype differs) or zeros (zero=False: undefined, for a caller whose
        OVERWRITE lease comes next). The future resolves once the home copy holds them."""
        self._check_open()
        home, storage = self._home_of(home)
        if name is None or name == "" or getattr(type(name), "__hash__", None) is None:
            raise ValueError(f"name must be a non-empty string or a hashable record, got {name!r}")
        if name in self._shards:
            raise ValueError(f"shard {name!r} is already registered")
        numel = int(numel)
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if init is not None and init.numel() != numel:
            raise ValueError(f"init has {init.numel()} elements but numel is {numel}")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        timeout = self.config.alloc_timeout if timeout is None else timeout
        s = _Shard(name, numel, dtype, home, tier_class, nbytes, R.NVME if home is Tier.NVME else R(home.value),
                   storage)
        if isinstance(storage, StorageTier):
            if init is None and zero and not storage.fresh_slot_reads_zero(tier_class):  # (it may hold another
                init = torch.zeros(numel, dtype=dtype)  # shard's bytes): write the zeros promised
            # The initial bytes go out through a staging buffer, taken first so that a refusal leaves
            # no slot behind: the shard starts as a working copy at CPU and its first move writes
            # it home and drops it.
            stg = self._alloc(s, ["cpu"], timeout)["cpu"] if init is not None else None
            try:
                if stg is not None:
                    _host_copy(_view(stg, s), init.detach().cpu() if init.device.type != "cpu" else init.detach())
                with self._lock:
                    s.slot = storage.reserve(name, nbytes, tier_class)
            except BaseException:
                if stg is not None:
                    stg.free()
                raise
            if stg is None:
                with self._lock:
                    self._shards[name] = s
                return resolved()
            s.residency, s.cpu_block, s.target = R.CPU, stg, Tier.CPU
            with self._lock:
                self._shards[name] = s
            return self.release(name, writeback=True)
        blk = storage.reserve(name, nbytes, tier_class, timeout=timeout)  # a memory tier: waits for room
        try:
            t = _view(blk, s)
            if init is None:
                if zero:
                    t.zero_()
            elif t.device.type == "cpu" and init.device.type == "cpu":
                _host_copy(t, init.detach())
            else:
                t.copy_(init.detach().reshape(-1))
                if t.device.type == "cuda":
                    torch.cuda.current_stream(t.device).synchronize()  # over before the block is used
        except BaseException:
            storage.free(blk)
            raise
        s.slot = blk
        with self._lock:
            self._shards[name] = s
        return resolved()

    def limit_device(self, nbytes: int) -> int:
        """The device tier holds at most `nbytes` from now on (an "auto" budget fitted after the first step:
        zero/device_budget_fit.py); what it holds stays. The limit set."""
        return self._dev.set_limit(nbytes)

    @property
    def staging_slot(self) -> int:
        """Bytes every short-lived cpu buffer takes (0: its own size, first fit)."""
        return self._cpu.staging_slot

    def set_staging_slot(self, nbytes: int) -> None:
        """Every short-lived cpu buffer from now on takes `nbytes` (rounded up to a page): the largest such
        buffer the caller will ask for. A larger one takes its own size."""
        self._cpu.set_staging_slot(nbytes)

    def free_staging_bytes(self) -> int:
        """Bytes of the cpu tier short-lived buffers can take at once now (whole staging slots; every free
        byte when slots are off)."""
        return self._cpu.free_staging_bytes()

    def staged_nbytes(self, nbytes: int) -> int:
        """Bytes of the cpu budget a short-lived buffer of `nbytes` takes."""
        return self._cpu.staged_nbytes(nbytes)

    def fetch(self, name, tier: str | Tier = "device", timeout: float | None = None,
              read: bool = True, resident: bool = False) -> cf.Future:
        """Future[Tensor]: the shard's bytes in `tier` (1-D, its dtype). A tier faster than home gets a
        working copy (buffers taken from that tier's budget, waiting for space in this thread; timeout=0:
        ArenaBusyError at once when there is none now); the home tier returns the home copy.
        read=False: a working copy made without reading anything into it (the caller overwrites it all).
        resident=True: the working copy will be held for long (placed as a home copy is, not in a slot)."""
        s = self._get(name)
        tier = self._home_of(tier, check=False)[0]
        if tier is Tier.NVME or tier.rank > s.home.rank:
            raise ValueError(f"fetch({name!r}, {str(getattr(tier, 'value', tier))!r}): can only fetch to the home "
                             f"tier ({self._home_name(s)}) or a faster one")
        timeout = self.config.alloc_timeout if timeout is None else timeout
        plan = s.target
        need = []
        if tier is not s.home and plan is not tier:
            if tier is Tier.CPU:
                need = ["cpu"]
            else:
                staged = plan is None and s.home is Tier.NVME and read  # nvme -> cpu -> device
                need = ["dev", "cpu"] if staged else ["dev"]
        new = self._alloc(s, need, timeout, resident=resident)
        # Only a move that reads a device working copy (down to cpu) waits for the caller's queued work on it; a
        # fetch up to the device fills a block of its own and is not ordered behind compute queued earlier.
        after = self._dev.stream_point() if plan is Tier.DEVICE and tier is not Tier.DEVICE else None
        with self._lock:
            s.target = None if tier is s.home else tier  # the home copy: no working copy once this fetch ran
            fut, kick = self._chain(s, lambda: self._do_fetch(s, tier, new, after, read), new)
        kick()  # outside the lock: may run the move's first step (its I/O submission) right here
        return fut

    def lease(self, name, tier: str | Tier, mode: LeaseMode, block: bool = True,
              resident: bool = False) -> Lease | None:
        """A claim on the shard's bytes in `tier` for one piece of work (see lease.py), returned at once.
        block=False: None when the tier has no room now (a prefetch backs off; nothing was queued).
        resident: held for many steps (see fetch)."""
        s = self._get(name)
        tier = Tier(tier)
        with self._lock:
            if s.leases > 0 and s.lease_tier is not tier:
                raise StoreError(
                    f"shard {name!r}: a {tier.value} lease while a {s.lease_tier.value} lease of it is held: leases "
                    f"held at once share one working copy, so they are of one tier; release the "
                    f"{s.lease_tier.value} lease first")
            # counted before its fetch is queued: a release of another lease asked meanwhile keeps the working copy
            s.leases += 1  # this fetch may return (release, unless_leased)
            s.lease_tier = tier
            if tier is s.home and self._at_rest_home(s):  # the home copy as it is: no move to queue
                return Lease(self, name, tier, mode, _home_ready(s))
        try:
            ready = self.fetch(name, tier, timeout=None if block else 0, read=mode is not LeaseMode.OVERWRITE,
                               resident=resident)
        except BaseException as e:
            with self._lock:
                s.leases -= 1
            if isinstance(e, ArenaBusyError) and not block:
                return None
            raise
        return Lease(self, name, Tier(tier), mode, ready)

    def release_lease(self, name, writeback: bool) -> cf.Future:
        """A lease's release (Lease.release): as release(), but while another lease of the shard is held (they
        share its working copy) the copy stays, written home first if `writeback`."""
        s = self._get(name)
        with self._lock:
            s.leases = max(0, s.leases - 1)
            shared = s.leases > 0
            if self._at_rest_home(s) and s.unsaved is None:  # nothing to write home, no working copy to free
                return _DONE
        try:
            if shared:
                return self.writeback(name) if writeback else resolved()
            return self.release(name, writeback=writeback, unless_leased=True)
        except BaseException:  # no room for the write-back's buffer (nothing was queued): the lease is still held,
            with self._lock:  # and releasing it again retries
                s.leases += 1
            raise

    def writeback(self, name, timeout: float | None = None) -> cf.Future:
        """Future[None]: copy the working copy to the home copy (no-op without a working copy)."""
        s = self._get(name)
        new = self._alloc(s, self._writeback_needs(s), self.config.alloc_timeout if timeout is None else timeout)
        after = self._dev.stream_point()
        with self._lock:
            fut, kick = self._chain(s, lambda: self._do_writeback(s, new, after), new)
        kick()  # outside the lock: may run the move's first step (its I/O submission) right here
        return fut

    def release(self, name, writeback: bool = False, timeout: float | None = None,
                unless_leased: bool = False) -> cf.Future:
        """Future[None]: free the working copy (after writing it home when `writeback`); its buffer
        returns to its tier's budget once every move of it has finished. unless_leased: a lease's release; the copy
        stays if another lease is counted when this is asked (taken since the caller's count fell to 0: its fetch
        may return this very copy). Decided here, not when the move runs: a lease taken after this request fetches
        a copy of its own, and keeping this one for it would hold the budget its fetch waits for."""
        s = self._get(name)
        need = self._writeback_needs(s) if writeback or s.unsaved is not None else []
        new = self._alloc(s, need, self.config.alloc_timeout if timeout is None else timeout)
        after = self._dev.stream_point()
        with self._lock:
            keep = unless_leased and s.leases > 0
            if not keep:
                s.target = None  # the plan: home only (a fetch asked from here on brings its own copy)
            fut, kick = self._chain(s, lambda: self._do_release(s, writeback, new, after, keep), new)
        kick()  # outside the lock: may run the move's first step (its I/O submission) right here
        return fut

    def unregister(self, name) -> cf.Future:
        """Future[None]: shard `name` removed once every move asked for before has finished: its home buffer or
        swap slot and any working copy go back to their budgets (a freed slot is reused by the next shard of its
        length). The caller holds no lease of it. For short-lived shards (offloaded activations)."""
        s = self._get(name)
        with self._lock:
            s.target = None
            fut, kick = self._chain(s, lambda: self._do_unregister(s), {})
        kick()  # outside the lock: may run the move right here
        return fut

    def exchange_slots(self, name, spare) -> None:
        """Swap the swap-file slots (and their checksums) of two nvme-homed shards of one size and class, so
        that `name`'s next write lands beside its last one, which `spare` then holds: a write that may have to be
        taken back (exchange again, once it has landed, and `name` reads its old bytes). Metadata only, no I/O.
        No move of either may be in flight: `spare` is at rest (no working copy), `name` at rest or holding a
        working copy already read (a waited lease: its release writes into the new slot)."""
        a, b = self._get(name), self._get(spare)
        if a is b or a.home is not Tier.NVME or b.home_tier is not a.home_tier:
            raise ValueError(f"exchange_slots({name!r}, {spare!r}): two distinct shards homed in one storage tier")
        if (a.nbytes, a.tier_class) != (b.nbytes, b.tier_class):
            raise ValueError(f"exchange_slots({name!r}, {spare!r}): {a.nbytes} B of {a.tier_class!r} against "
                             f"{b.nbytes} B of {b.tier_class!r}: the slots must be alike")
        with self._lock:
            busy = [s.name for s in (a, b) if s.last is not None and not s.last.done()]
            if busy or a.residency not in (R.NVME, R.CPU) or b.residency is not R.NVME:
                raise StoreError(f"exchange_slots({name!r}, {spare!r}): a move is in flight or {spare!r} has a "
                                 f"working copy ({a.residency.name}, {b.residency.name}, busy: {busy})")
            a.slot, b.slot = b.slot, a.slot
            a.digest, b.digest = b.digest, a.digest
            a.torn, b.torn = b.torn, a.torn

    def swap_location(self, name) -> tuple[int, int] | None:
        """(file descriptor, offset) of an nvme-homed shard's swap slot (page-aligned, readable to the page after
        its bytes); None for another home. The slot holds the shard's value only while no working copy
        differs from it: the caller keeps the store quiet (no lease that writes, no write-behind pending)."""
        s = self._get(name)
        return s.home_tier.location(s.slot) if isinstance(s.home_tier, StorageTier) else None

    def residency(self, name) -> Residency:
        return self._get(name).residency

    def info(self, name) -> ShardInfo:
        s = self._get(name)
        return ShardInfo(s.name, s.numel, s.dtype, s.home, s.tier_class, s.nbytes, s.residency, self._home_name(s))

    def names(self) -> list:
        return list(self._shards)

    def wait_all(self, timeout: float | None = None) -> None:
        """Waits for every move asked for so far; raises the first failure among them."""
        with self._lock:
            futs = list(self._moves.inflight)
        done, pending = cf.wait(futs, timeout)  # the caller asked to drain the queues
        if pending:
            raise TimeoutError(f"{len(pending)} moves still in flight after {timeout}s")
        for f in done:
            if not f.cancelled() and f.exception() is not None:
                raise f.exception()

    def stats(self) -> dict:
        """Bytes in use / peak / capacity per tier and bytes moved per direction (cheap: no walk over shards)."""
        links = self._links.snapshot()
        with self._lock:
            inflight = len(self._moves.inflight)
            homes = {name: tier.stats() for name, tier in self._homes().items()}  # HomeTier.stats()
            homes.setdefault("nvme", {"capacity": self._nvme_budget, "bytes_in_use": 0, "peak_bytes": 0})  # no path
        return {
            **homes,
            "moved": {link: nbytes for link, (nbytes, _) in links.items()},
            "busy_s": {link: busy for link, (_, busy) in links.items()},
            "shards": len(self._shards),
            "in_flight": inflight,
        }

    def pinned(self) -> dict:
        """The cpu tier's arena: its bytes, how they are locked ("cuda": registered, "mlock", "none"; then
        locked_bytes 0), the NUMA node they prefer and why not where one was asked for, and {node: pages} of a
        sample of 64 of its pages that have been touched (numa.nodes_of: what the kernel says, not the policy)."""
        return self._cpu.pinned()

    def held(self) -> dict:
        """{tier: {"homes": {tier_class: bytes}, "copies": {tier_class: bytes}, "moving": bytes, "other": bytes}}
        of the cpu and device tiers: the blocks of shards whose home is there, the working copies there of shards
        homed below it (resident, or staged for a move), of those copies the bytes a move is using now, and the
        rest of the tier's bytes in use (staging slots and buffers no shard holds). Bytes as the tiers count them
        (a block's span). Walks every shard under the store's lock: for reports, not for hot paths."""
        with self._lock:
            out = self._held()
        for tier, pool in (("cpu", self._cpu), ("device", self._dev)):
            attached = sum(out[tier]["homes"].values()) + sum(out[tier]["copies"].values())
            out[tier]["other"] = max(0, pool.bytes_in_use - attached)
        return out

    def _held(self) -> dict:
        out = {t: {"homes": {}, "copies": {}, "moving": 0} for t in ("cpu", "device")}

        def add(tier: str, kind: str, cls: str, blk, moving: bool = False) -> None:
            if blk is not None:
                taken = getattr(blk, "span", 0) or blk.reserved
                out[tier][kind][cls] = out[tier][kind].get(cls, 0) + taken
                out[tier]["moving"] += taken if moving else 0

        for sh in self._shards.values():
            moving = sh.residency not in (R.NVME, R.CPU, R.DEVICE)  # reading, writing, or between cpu and device
            if sh.home is not Tier.NVME:
                add(sh.home.value, "homes", sh.tier_class, sh.slot)
            else:
                add("cpu", "copies", sh.tier_class, sh.cpu_block, moving)
            if sh.home is not Tier.DEVICE:
                add("device", "copies", sh.tier_class, sh.dev_block, moving)
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def swap_paths(self) -> list[str]:
        return [p for tier in self._storage.values() for p in tier.paths()]

    @property
    def _arena(self) -> PinnedArena:  # the cpu tier's arena (tests reach it)
        return self._cpu.arena

    @property
    def _engine(self):  # the nvme tier's engine and swap files (tests reach them to inject faults)
        return self._storage[Tier.NVME.value].engine

    @property
    def _swap(self) -> dict:
        return self._storage[Tier.NVME.value].files if Tier.NVME.value in self._storage else {}

    def close(self, cancel: bool = False) -> None:
        """Waits for running moves (cancelling queued ones when `cancel`), joins the workers, frees the
        arena and the device tier, closes the engine and removes the swap files and created directory.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._moves.cancelling = cancel
            futs = list(self._moves.inflight)
        if cancel:
            for f in futs:
                f.cancel()  # only moves that have not started; running ones finish below
        cf.wait(futs)  # buffers are freed below: every move touching them must be over
        self._teardown()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc_type is not None)

    # ------------------------------------------------------------------ internals: bookkeeping

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def _get(self, name) -> _Shard:
        self._check_open()
        s = self._shards.get(name)
        if s is None:
            raise KeyError(f"no shard named {name!r} is registered")
        return s

    def _home_of(self, home, check: bool = True) -> tuple[Tier, HomeTier | None]:
        """(level, tier) of a home name: "device", "cpu", or a storage tier of this store (`check`: one that is
        built; else any name below cpu is Tier.NVME, its tier None when not built)."""
        name = home.value if isinstance(home, Tier) else str(home)
        tier = self._homes().get(name)
        if tier is not None:
            return tier.level, tier
        if check:
            if name == Tier.NVME.value:
                raise StoreError("shards with home 'nvme' need StoreConfig.nvme_path (the swap directory)")
            raise ValueError(f"home {name!r}: not a tier of this store (device, cpu"
                             f"{''.join(', ' + n for n in self._storage)}); storage tiers are named in "
                             "StoreConfig.tiers (docs/tiers.md)")
        if name != Tier.NVME.value:
            raise ValueError(f"{name!r} is not a tier of this store (device, cpu"
                             f"{''.join(', ' + n for n in self._storage)})")
        return Tier.NVME, None

    def _homes(self) -> dict[str, HomeTier]:
        return {Tier.DEVICE.value: self._dev, Tier.CPU.value: self._cpu, **self._storage}

    @staticmethod
    def _home_name(s: _Shard) -> str:
        return s.home_tier.name

    def _writeback_needs(self, s: _Shard) -> list[str]:
        # A device working copy of an nvme shard goes home through a cpu staging buffer.
        return ["cpu"] if (s.home is Tier.NVME and s.target is Tier.DEVICE) else []

    def _alloc(self, s: _Shard, kinds: list[str], timeout: float | None, resident: bool = False) -> dict:
        """Working blocks for shard s from the "cpu" / "dev" memory tiers, waiting for space (resident: held for
        long, its own size; otherwise a short-lived cpu block takes a staging slot). memory_tier.py: a request
        larger than what home blocks leave free raises at once."""
        new: dict = {}
        try:
            for k in kinds:
                tier = self._cpu if k == "cpu" else self._dev
                new[k] = tier.take(s.name, s.nbytes, timeout, short_lived=not resident)
        except BaseException:
            for b in new.values():
                b.free()
            raise
        return new

    def _chain(self, s: _Shard, make: Callable, new: dict):
        """Queues a move as the shard's next (moves.py); returns (future, kick), kick() called once the caller
        has released self._lock. A failed move with nothing queued behind leaves the plan where the bytes are."""
        return self._moves.chain(s, make, new, settle=lambda: setattr(s, "target", self._working_tier(s)))

    def _at_rest_home(self, s: _Shard) -> bool:
        """A memory-homed shard with no working copy and no move queued or running (called with self._lock
        held): a lease of its home tier is its home copy as it is, and that lease's release moves nothing. The
        per-unit fast path: a fetch or release here queued a move that did nothing (see _do_fetch, _do_release),
        a future and a chain step each, several times a unit a step."""
        return ((s.home is Tier.CPU and s.residency is R.CPU or s.home is Tier.DEVICE)
                and (s.last is None or s.last.done()) and not self._moves.cancelling)

    def _working_tier(self, s: _Shard) -> Tier | None:
        if s.home is not Tier.DEVICE and s.dev_block is not None:
            return Tier.DEVICE
        if s.home is Tier.NVME and s.cpu_block is not None:
            return Tier.CPU
        return None

    def _transition(self, s: _Shard, frm: Residency, to: Residency) -> None:
        with self._lock:
            if s.residency is not frm or (frm, to) not in TRANSITIONS:
                raise AssertionError(f"store bug: shard {s.name!r} move {frm.name}->{to.name} while {s.residency.name}")
            s.residency = to

    # ------------------------------------------------------------------ internals: data movement

    def _copy(self, s: _Shard, link: Link, dst: torch.Tensor, src: torch.Tensor, after=None) -> None:
        """dst <- src between host and device buffers (one of s's moves, over `link`: without a GPU both are
        host tensors); returns when the bytes have landed."""
        started = self._links.begin(link)
        ok = False
        try:
            self._dev.copy(dst, src, after)
            inject.pause(Queue.COPY)
            ok = True
        finally:
            self._links.end(link, started, s.nbytes, s.name, ok)

    def _copy_down(self, s: _Shard, dst_block, after=None) -> None:
        """The device working copy -> dst_block (a cpu buffer): DEVICE -> TO_CPU, back to DEVICE on failure;
        the caller makes the next transition."""
        self._transition(s, R.DEVICE, R.TO_CPU)
        try:
            self._copy(s, Link.DEVICE_TO_CPU, _view(dst_block, s), _view(s.dev_block, s), after)
        except BaseException:
            self._transition(s, R.TO_CPU, R.DEVICE)
            raise

    def _device_down(self, s: _Shard, dst_block, read: bool, after=None):
        """The device working copy comes down into dst_block, a cpu block (read=False: dropped, the caller
        overwrites dst_block whole): DEVICE -> CPU, the device block freed. The caller keeps dst_block."""
        if read:
            yield TO_WORKER  # copies run in a worker, never in the caller
            self._copy_down(s, dst_block, after)
            self._transition(s, R.TO_CPU, R.CPU)
        else:
            self._transition(s, R.DEVICE, R.CPU)
        dev, s.dev_block = s.dev_block, None
        dev.free()

    # Moves are generators (see _chain): `yield handle` submits an I/O and is resumed once it is over;
    # `yield TO_WORKER` hands the rest to a worker thread. Each undoes its residency on failure.

    def _read(self, s: _Shard, blk):
        if blk.reserved == 0:
            return
        storage = s.home_tier
        if s.torn is not None:
            raise StoreError(f"shard {s.name!r}: its last write to {storage.where(s.slot)} failed ({s.torn}): "
                             "the slot holds no complete copy, so it is not read. Free space or check the drive, and "
                             "resume from a checkpoint")
        started = self._links.begin(storage.read_link)
        ok = False
        try:
            h = storage.read(s.slot, blk.padded())
            yield h  # resumed once the read is over: the buffer is valid only then
            h.wait()  # already over; raises the read's error here, where the caller undoes its state
            if s.digest is not None and _digest(blk.padded()) != s.digest:
                raise SwapCorruptError(
                    f"shard {s.name!r}: {blk.reserved} bytes read back from {storage.where(s.slot)} differ "
                    f"from what was written (XXH3-64 {_digest(blk.padded()):016x}, written {s.digest:016x}): the "
                    "drive or the file is corrupt; nothing was used. Check the drive (dmesg, smartctl) and resume "
                    "from a checkpoint")
            inject.pause(Queue.NVME_READ)  # in the worker: a slow disk, not a slow caller
            ok = True
        finally:
            self._links.end(storage.read_link, started, s.nbytes, s.name, ok)

    def _write(self, s: _Shard, blk):
        if blk.reserved == 0:
            return
        storage = s.home_tier
        started = self._links.begin(storage.write_link)
        ok = False
        try:
            digest = _digest(blk.padded()) if self.config.checksums else None  # the bytes as they go out
            try:
                h = storage.write(s.slot, blk.padded())
                yield h  # resumed once the write is over: the buffer may be reused or freed only then
                h.wait()  # already over; raises the write's error here
            except BaseException as e:  # the slot may hold part of it: not the last good bytes, nor these
                s.torn = f"{type(e).__name__}: {e}"
                raise
            s.digest, s.torn = digest, None  # the slot holds these bytes now (only now: a failure keeps them out)
            inject.pause(Queue.NVME_WRITE)  # in the worker: a slow disk, not a slow caller
            ok = True
        finally:
            self._links.end(storage.write_link, started, s.nbytes, s.name, ok)

    def _nvme_to_cpu(self, s: _Shard, new: dict):
        blk = new.get("cpu")
        if blk is None:
            raise StoreError(f"shard {s.name!r}: moved while this fetch was being queued; fetch again")
        self._transition(s, R.NVME, R.READING)
        try:
            yield from self._read(s, blk)
        except BaseException:
            self._transition(s, R.READING, R.NVME)
            raise
        s.cpu_block, new["cpu"] = blk, None
        self._transition(s, R.READING, R.CPU)

    def _do_fetch(self, s: _Shard, tier: Tier, new: dict, after=None, read: bool = True):
        try:
            st = s.residency
            if tier is s.home:
                if st is R.DEVICE and s.home is Tier.CPU:
                    # A device copy kept by a release for this lease (unless_leased), which wants the home copy: it
                    # goes, coming home first, or the holder's writes home would be overwritten by its write-back.
                    yield from self._device_down(s, s.slot, read, after)
                    s.unsaved = None  # saved now, or about to be overwritten whole
                return _home_view(s) if s.home is not Tier.NVME else None
            if tier is Tier.CPU:  # home nvme
                if st is R.CPU:
                    return _view(s.cpu_block, s)
                blk = new.get("cpu")
                if blk is None:
                    raise StoreError(f"shard {s.name!r}: moved while this fetch was being queued; fetch again")
                if st is R.NVME:
                    if read:
                        yield from self._nvme_to_cpu(s, new)
                    else:  # the caller overwrites it all: nothing to read
                        s.cpu_block, new["cpu"] = blk, None
                        self._transition(s, R.NVME, R.CPU)
                    return _view(s.cpu_block, s)
                yield from self._device_down(s, blk, read, after)  # st is DEVICE
                s.cpu_block, new["cpu"] = blk, None
                return _view(s.cpu_block, s)
            # tier is DEVICE
            if st is R.DEVICE:
                return _view(s.dev_block, s)
            dev = new.get("dev")
            if dev is None:
                raise StoreError(f"shard {s.name!r}: moved while this fetch was being queued; fetch again")
            if not read:  # the caller overwrites it all: no read, no copy
                self._transition(s, st, R.DEVICE)  # from NVME, or CPU (a cpu working copy is dropped)
                s.dev_block, new["dev"] = dev, None
                if s.home is Tier.NVME and s.cpu_block is not None:
                    stg, s.cpu_block = s.cpu_block, None
                    stg.free()
                return _view(s.dev_block, s)
            if st is R.NVME:
                yield from self._nvme_to_cpu(s, new)
            src = s.cpu_block if s.home is Tier.NVME else s.slot
            yield TO_WORKER  # copies run in a worker, never in the caller
            self._transition(s, R.CPU, R.TO_DEVICE)
            try:
                self._copy(s, Link.CPU_TO_DEVICE, _view(dev, s), _view(src, s))
            except BaseException:
                self._transition(s, R.TO_DEVICE, R.CPU)
                raise
            s.dev_block, new["dev"] = dev, None
            self._transition(s, R.TO_DEVICE, R.DEVICE)
            if s.home is Tier.NVME:  # the staging buffer has done its job
                stg, s.cpu_block = s.cpu_block, None
                stg.free()
            return _view(s.dev_block, s)
        finally:
            drop_unused(new)

    def _writeback_now(self, s: _Shard, new: dict, after=None):
        try:
            yield from self._writeback_steps(s, new, after)
        except BaseException as e:
            s.unsaved = f"{type(e).__name__}: {e}"
            raise
        s.unsaved = None

    def _writeback_steps(self, s: _Shard, new: dict, after=None):
        st = s.residency
        if s.home is Tier.DEVICE or st is R.NVME or (st is R.CPU and s.home is Tier.CPU):
            return  # no working copy apart from the home copy
        if st is R.CPU:  # home nvme, working copy in the staging buffer
            self._transition(s, R.CPU, R.WRITING)
            try:
                yield from self._write(s, s.cpu_block)
            finally:
                self._transition(s, R.WRITING, R.CPU)
            return
        # st is DEVICE
        yield TO_WORKER  # copies run in a worker, never in the caller
        if s.home is Tier.CPU:
            self._copy_down(s, s.slot, after)
            self._transition(s, R.TO_CPU, R.DEVICE)
            return
        stg = new.get("cpu")
        if stg is None:
            raise StoreError(f"shard {s.name!r}: moved while this writeback was being queued; write back again")
        self._copy_down(s, stg, after)
        self._transition(s, R.TO_CPU, R.WRITING)
        try:
            yield from self._write(s, stg)
        finally:
            self._transition(s, R.WRITING, R.DEVICE)

    def _do_writeback(self, s: _Shard, new: dict, after=None):
        try:
            yield from self._writeback_now(s, new, after)
        finally:
            drop_unused(new)

    def _do_release(self, s: _Shard, writeback: bool, new: dict, after=None, keep: bool = False):
        try:
            if writeback or s.unsaved is not None:  # a copy an earlier writeback failed to save is saved now
                yield from self._writeback_now(s, new, after)  # a failure keeps the working copy: nothing is lost
            if keep:  # a lease counted when this was asked holds (or will be handed) the copy
                return
            st = s.residency
            if st is R.CPU and s.home is Tier.NVME:
                self._transition(s, R.CPU, R.NVME)
                blk, s.cpu_block = s.cpu_block, None
                blk.free()
            elif st is R.DEVICE and s.home is not Tier.DEVICE:
                self._transition(s, R.DEVICE, R.CPU if s.home is Tier.CPU else R.NVME)
                blk, s.dev_block = s.dev_block, None
                blk.free()
        finally:
            drop_unused(new)

    def _do_unregister(self, s: _Shard):
        yield from ()  # a move (see _chain) with nothing to wait for
        for working in ("dev_block", "cpu_block"):
            blk = getattr(s, working)
            if blk is not None:
                setattr(s, working, None)
                blk.free()
        with self._lock:
            if s.slot is not None:
                s.home_tier.free(s.slot)
                s.slot = None
            if self._shards.get(s.name) is s:
                del self._shards[s.name]

    def _parts(self) -> tuple:
        """What _release frees, in its order (held by the finalizer: never the store itself)."""
        return (self._moves.pool, self._storage, self._cpu, self._dev)

    def _teardown(self) -> None:
        """Frees everything the store holds, waiting for its threads; each step runs even if an earlier one
        failed."""
        self._closed = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        _release(self._parts(), True)


def _release(parts: tuple, wait: bool) -> None:
    """Free a store's parts (TieredStore._parts): join (when `wait`) its move threads, close its storage tiers
    (the nvme tier: its swap files, engine and directory), the pinned arena and the device tier. Every step runs;
    the first failure is raised at the end."""
    pool, storage, cpu, dev = parts
    steps = [
        lambda: pool and pool.shutdown(wait=wait),
        *[(lambda t=t: t.close()) for t in list(storage.values())],
        lambda: cpu and cpu.close(),
        lambda: dev and dev.close(),
    ]
    try:
        run_every(steps)
    finally:
        storage.clear()
