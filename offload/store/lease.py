"""A lease: one piece of work's claim on a shard's bytes in a tier, handed out at once.

    lease = store.lease(key, "cpu", LeaseMode.UPDATE)   # the read (if any) is queued; nothing waits here
    ...                                                  # other work while the bytes come in
    t = lease.wait()                                     # wait only where the bytes are needed
    t.mul_(0.5)
    done = lease.release()                               # Future: the write-behind (UPDATE / OVERWRITE)

Issue and wait are separate calls, as FSDP2's unshard(async_op) / wait_for_unshard. The tensor is valid
from wait() until release(); after release() the holder must not touch it (the write-behind reads it, and
its buffer goes back to the tier's budget once the write is over). Moves of one shard run in the order
they were asked for, so a lease taken after a release of the same shard sees the released bytes. Leases of
one shard held at once share its working copy, which is freed after the last of them is released; so they are
of one tier (a lease in another tier while one is held is refused). A release that cannot have the buffer its
write-back needs raises and leaves the lease held: release it again.
"""
from __future__ import annotations

import concurrent.futures as cf
import enum

import torch

from ..device import retire
from .residency import Tier

__all__ = ["Lease", "LeaseMode", "resolved"]


def resolved(value=None) -> cf.Future:
    """A future that is already done with `value` (work with nothing to wait for)."""
    f: cf.Future = cf.Future()
    f.set_result(value)
    return f


class LeaseMode(enum.Enum):
    READ = "read"
    """The holder only reads: the bytes are brought in; release drops the working copy, writing nothing."""

    UPDATE = "update"
    """The holder reads and changes the bytes: brought in, and written home on release (write-behind)."""

    OVERWRITE = "overwrite"
    """The holder writes every byte without reading one: nothing is read in (no I/O for bytes about to be
    replaced); the buffer's contents are undefined until the holder writes them; written home on release."""


class Lease:
    def __init__(self, store, key, tier: Tier, mode: LeaseMode, ready: cf.Future):
        self.store = store
        self.key = key
        self.tier = tier
        self.mode = mode
        self._ready = ready  # Future[Tensor]: the working copy (or home copy) is valid once it resolves
        self._released: cf.Future | None = None

    def __repr__(self) -> str:
        state = "released" if self._released is not None else ("ready" if self._ready.done() else "pending")
        return f"Lease({self.key}, {self.tier.value}, {self.mode.value}, {state})"

    @property
    def released(self) -> bool:
        return self._released is not None

    def ready(self) -> bool:
        """The bytes are there (wait() will not block)."""
        return self._ready.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The shard's bytes in the leased tier (1-D); raises the move's error if it failed."""
        if self._released is not None:
            raise RuntimeError(f"lease of {self.key} used after release")
        return self._ready.result(timeout)  # the caller needs the bytes now

    def upgrade(self) -> None:
        """A READ lease whose holder now changes the bytes (it was taken ahead, before the work that writes
        them was known): from here on it is an UPDATE lease, written home on release."""
        if self._released is not None or self.mode is not LeaseMode.READ:
            raise RuntimeError(f"upgrade of {self!r}: only a held READ lease becomes an UPDATE one")
        self.mode = LeaseMode.UPDATE

    def release(self) -> cf.Future:
        """Give the bytes back: written home first for UPDATE / OVERWRITE (write-behind), then the working
        copy's buffer returns to its tier. Returns the move's future. Idempotent."""
        if self._released is None:
            if (self.tier is Tier.DEVICE and self._ready.done() and not self._ready.cancelled()
                    and self._ready.exception() is None):
                retire(self._ready.result())  # read or written on the holder's stream: reused only after it
            writeback = self.mode is not LeaseMode.READ
            self._released = self.store.release_lease(self.key, writeback=writeback)
        return self._released
