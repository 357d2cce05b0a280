"""The cost table: what moving a byte and running a use cost on this machine, from measurement.

Bandwidths come from the store's links as the runtime measured them (bytes / busy seconds) once a step
has run; before that, from a bench profile or the defaults below (deliberately modest, so the first
plan prefetches early rather than late).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_NVME_READ = 1.0e9  # bytes/s
DEFAULT_NVME_WRITE = 1.0e9
DEFAULT_COPY = 8.0e9  # host <-> device


@dataclass(frozen=True)
class CostTable:
    nvme_read_Bps: float = DEFAULT_NVME_READ
    nvme_write_Bps: float = DEFAULT_NVME_WRITE
    h2d_Bps: float = DEFAULT_COPY
    d2h_Bps: float = DEFAULT_COPY

    def read_s(self, nbytes: int) -> float:
        return nbytes / self.nvme_read_Bps

    def measured(self, link_bytes: dict, link_busy_s: dict, min_bytes: int = 1 << 20) -> "CostTable":
        """A copy with each link's bandwidth replaced by bytes / busy seconds where enough was moved."""
        def rate(link: str, old: float) -> float:
            b, s = link_bytes.get(link, 0), link_busy_s.get(link, 0.0)
            return b / s if b >= min_bytes and s > 0 else old

        return replace(self, nvme_read_Bps=rate("nvme->cpu", self.nvme_read_Bps),
                       nvme_write_Bps=rate("cpu->nvme", self.nvme_write_Bps),
                       h2d_Bps=rate("cpu->device", self.h2d_Bps), d2h_Bps=rate("device->cpu", self.d2h_Bps))
