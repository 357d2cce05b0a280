"""The open runtimes (offload.init blocks), innermost last: which one `current()` is. At the bottom of zero/, so
that what asks (the optimizers, the loss scaler, the integrations) does not import the runtime."""
from __future__ import annotations

ACTIVE: list = []  # Runtime.open appends itself; close and stop_capturing remove it


def current():
    """The innermost open runtime (None outside any offload.init block)."""
    return ACTIVE[-1] if ACTIVE else None
