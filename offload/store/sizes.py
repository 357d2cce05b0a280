"""Byte sizes as strings: "60GiB", "512MiB", "1.5GB", "4096B".

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers of 1000;
"K"/"M"/"G"/"T" alone are binary (what `ulimit`/`dd` users expect); "B" is bytes. "auto" is not a size: budgets
handle it (see budget.py).

One rule for every size a user gives (CLI flags, --config JSON, offload.Config, environment variables): a number
without a unit ("512", or 512 in JSON or Python) is refused, naming the setting and the unit to add ("--cpu-budget
512: add a unit, e.g. 512GiB, or 512B for bytes"), never read as bytes. 0 needs none. Internal APIs whose ints are
byte counts computed by code (the store's StoreConfig, the arena, the aio engine) pass `counts=True`; code that
hands a computed byte count to a user-facing setting wraps it in `Bytes`.
"""
from __future__ import annotations

import re

__all__ = ["parse_size", "format_bytes", "Bytes", "SLOT_ALIGN", "page_bytes"]

SLOT_ALIGN = 4096  # a swap slot's and a store buffer's granule (here, not in swap_file.py: `offload plan` counts in it)


def page_bytes(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages: what a swap slot, and the store's buffer, of that many bytes takes."""
    return -(-int(nbytes) // SLOT_ALIGN) * SLOT_ALIGN

# The one size parser of the package: config.py and the aio engine use it too, so "512M" means the
# same number of bytes in every setting.

_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KIB": 1 << 10, "KB": 10**3,
    "M": 1 << 20, "MIB": 1 << 20, "MB": 10**6,
    "G": 1 << 30, "GIB": 1 << 30, "GB": 10**9,
    "T": 1 << 40, "TIB": 1 << 40, "TB": 10**12,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


class Bytes(int):
    """An int that is a byte count by construction (a value code computed, e.g. DeepSpeed's persistence threshold
    turned into bytes): parse_size takes it without a unit."""


def parse_size(value: int | str, what: str = "size", *, counts: bool = False) -> int:
    """Bytes in `value`; `what` names the setting in the error message. A number without a unit is refused (the
    module's rule) unless `counts` (an internal API taking byte counts computed by code)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size like '60GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{what} must be a finite size like '60GiB', got {value!r}")
        if value < 0:
            raise ValueError(f"{what} must be >= 0 bytes, got {value}")
        if value and not counts and not isinstance(value, Bytes):
            raise ValueError(_no_unit(what, value))
        return int(value)
    m = _RE.match(str(value))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"{what} must be a size like '60GiB', '512MiB' or '1.5GB', got {value!r}"
        )
    if not m.group(2) and float(m.group(1)) and not counts:
        raise ValueError(_no_unit(what, m.group(1)))
    return int(float(m.group(1)) * _UNITS[unit])


def _no_unit(what: str, number) -> str:
    return f"{what} {number}: add a unit, e.g. {number}GiB, or {number}B for bytes (a number alone is not a size)"


def format_bytes(n: int | float) -> str:
    """1536 -> '1.50 KiB' (binary units, for messages)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
