"""The links the store moves bytes over, and what each carried: bytes, and the seconds it was busy.

Busy time is the union of the intervals in which at least one move was in flight on the link, so
bytes / busy seconds is the bandwidth the link achieved while it was in use (many moves overlap).
The four links of the memory tiers and the nvme tier are `Link`s; a storage tier registered beside them
(storage_tier.py) brings its two as `TierLink`s, which the meter counts the same way (LinkMeter.add).
"""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

from .. import telemetry

__all__ = ["Link", "TierLink", "LinkMeter"]


class Link(enum.Enum):
    NVME_TO_CPU = "nvme->cpu"
    CPU_TO_NVME = "cpu->nvme"
    CPU_TO_DEVICE = "cpu->device"
    DEVICE_TO_CPU = "device->cpu"

    @property
    def lane(self) -> telemetry.Lane:
        return {Link.NVME_TO_CPU: telemetry.Lane.NVME_READ,
                Link.CPU_TO_NVME: telemetry.Lane.NVME_WRITE}.get(self, telemetry.Lane.COPY)


@dataclass(frozen=True)
class TierLink:
    """A link of a registered storage tier ("file2->cpu"): named and drawn like a Link."""

    value: str
    lane: telemetry.Lane


class LinkMeter:
    def __init__(self):
        self._lock = threading.Lock()
        self.bytes: dict = {}
        self.busy_s: dict = {}
        self._in_flight: dict = {}
        self._since: dict = {}
        for link in Link:
            self.add(link)

    def add(self, link: Link | TierLink) -> None:
        """Count `link` from now on (a storage tier's, when the store builds the tier)."""
        with self._lock:
            if link not in self.bytes:
                self.bytes[link], self.busy_s[link], self._in_flight[link], self._since[link] = 0, 0.0, 0, 0.0

    def begin(self, link: Link | TierLink) -> float:
        """A move starts on `link`; returns its start time for end()."""
        now = time.perf_counter()
        with self._lock:
            if self._in_flight[link] == 0:
                self._since[link] = now
            self._in_flight[link] += 1
        return now

    def end(self, link: Link | TierLink, started: float, nbytes: int, what: object = None, ok: bool = True) -> None:
        """The move begun at `started` is over (`ok`: it moved `nbytes`)."""
        now = time.perf_counter()
        with self._lock:
            self._in_flight[link] -= 1
            if self._in_flight[link] == 0:
                self.busy_s[link] += now - self._since[link]
            if ok:
                self.bytes[link] += nbytes
        telemetry.record(str(what) if what is not None else link.value, link.lane, started, now,
                         {"bytes": nbytes} if ok else {"failed": True})

    def snapshot(self) -> dict:
        """{link value: (bytes, busy seconds)}; busy seconds include the running interval."""
        now = time.perf_counter()
        with self._lock:
            return {link.value: (self.bytes[link], self.busy_s[link] + (now - self._since[link]
                                                                       if self._in_flight[link] else 0.0))
                    for link in self.bytes}
