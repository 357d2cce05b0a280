"""The links the store moves bytes over, and what each carried: bytes, and the seconds it was busy.

Busy time is the union of the intervals in which at least one move was in flight on the link, so
bytes / busy seconds is the bandwidth the link achieved while it was in use (many moves overlap).
"""
from __future__ import annotations

import enum
import threading
import time

from .. import telemetry

__all__ = ["Link", "LinkMeter"]


class Link(enum.Enum):
    NVME_TO_CPU = "nvme->cpu"
    CPU_TO_NVME = "cpu->nvme"
    CPU_TO_DEVICE = "cpu->device"
    DEVICE_TO_CPU = "device->cpu"

    @property
    def lane(self) -> telemetry.Lane:
        return {Link.NVME_TO_CPU: telemetry.Lane.NVME_READ,
                Link.CPU_TO_NVME: telemetry.Lane.NVME_WRITE}.get(self, telemetry.Lane.COPY)


class LinkMeter:
    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = {link: 0 for link in Link}
        self.busy_s = {link: 0.0 for link in Link}
        self._in_flight = {link: 0 for link in Link}
        self._since = {link: 0.0 for link in Link}

    def begin(self, link: Link) -> float:
        """A move starts on `link`; returns its start time for end()."""
        now = time.perf_counter()
        with self._lock:
            if self._in_flight[link] == 0:
                self._since[link] = now
            self._in_flight[link] += 1
        return now

    def end(self, link: Link, started: float, nbytes: int, what: object = None, ok: bool = True) -> None:
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
                    for link in Link}
