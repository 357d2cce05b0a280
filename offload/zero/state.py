"""The state of one unit's parameters, and the only legal moves between states.

`ShardedUnit._transition` is the single writer of `unit.state`; it checks the move against `ALLOWED`.
"""
from __future__ import annotations

import enum


class UnitState(enum.Enum):
    SHARDED = "sharded"
    """Only this rank's shard exists, in its home tier (device / cpu / nvme). The full flat buffer has no
    storage (0 bytes); the modules hold meta placeholders in place of their parameters."""

    UNSHARDED = "unsharded"
    """The full flat parameter (all ranks' shards gathered, compute dtype) lives on the compute device; the
    modules hold views of it. The home-tier shard is unchanged (the flat buffer is a copy)."""

    FREED = "freed"
    """The runtime has exited: shards and the flat buffer are gone; any use of the module raises."""


ALLOWED = {
    (UnitState.SHARDED, UnitState.UNSHARDED),
    (UnitState.UNSHARDED, UnitState.SHARDED),
    (UnitState.SHARDED, UnitState.FREED),
    (UnitState.UNSHARDED, UnitState.FREED),
}
