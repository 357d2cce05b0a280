"""The runtime's two state machines, and the only legal moves of a unit.

`ShardedUnit._transition` is the single writer of `unit.state` and checks the move against `ALLOWED`;
`Schedule._enter` is the single writer of the training state and checks the move against `TRAINING_MOVES`.
"""
from __future__ import annotations

import enum


class UnitState(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C (Enum's hashes its name in Python)

    SHARDED = "sharded"
    """Only this rank's shard exists, in its home tier (device / cpu / nvme), chunk by chunk. The full flat
    buffer has no storage (0 bytes); the modules hold meta placeholders in place of their parameters."""

    GATHERING = "gathering"
    """The gather is issued: the full flat buffer has its storage (counted as gathered) and the gather lane is
    writing every rank's shard into it; its bytes are not valid until wait_for_unshard(). The modules hold
    placeholders (or, for a persistent unit being refreshed, views of the old bytes, unused until the wait)."""

    UNSHARDED = "unsharded"
    """The full flat parameter (all ranks' shards gathered, compute dtype) lives on the compute device; the
    modules hold views of it. The home-tier shard is unchanged (the flat buffer is a copy)."""

    FREED = "freed"
    """The runtime has exited: shards and the flat buffer are gone; any use of the module raises."""


ALLOWED = {
    (UnitState.SHARDED, UnitState.GATHERING),
    (UnitState.GATHERING, UnitState.UNSHARDED),
    (UnitState.GATHERING, UnitState.SHARDED),  # the gather failed: its buffer is given back
    (UnitState.UNSHARDED, UnitState.GATHERING),  # a persistent unit re-gathers after an update
    (UnitState.UNSHARDED, UnitState.SHARDED),
    (UnitState.SHARDED, UnitState.FREED),
    (UnitState.UNSHARDED, UnitState.FREED),
}


class TrainingState(enum.Enum):
    """Where the training loop is, as the runtime sees it (one per runtime)."""

    IDLE = "idle"
    """No pass running. Gathered: persistent units (and units kept for a backward that did not come). The
    optimizer lane may still be updating units from the last step: each unit's next gather waits for its own."""

    FORWARD = "forward"
    """A forward pass with autograd on: units are gathered as they run (the next one ahead of time)."""

    BACKWARD = "backward"
    """The backward pass: units are gathered again in reverse, freed after, and their gradients reduced on the
    reduce lane. Ends when autograd's final callback runs."""


TRAINING_MOVES = {
    (TrainingState.IDLE, TrainingState.FORWARD),  # a forward with autograd on starts
    (TrainingState.FORWARD, TrainingState.BACKWARD),  # its backward reaches a unit
    (TrainingState.BACKWARD, TrainingState.IDLE),  # autograd's final callback (or the next forward, after a
    # backward that raised before its callback ran)
    (TrainingState.IDLE, TrainingState.BACKWARD),  # a second graph's backward: two forwards, then two backwards
    (TrainingState.IDLE, TrainingState.IDLE),  # a backward whose units were already closed ends
}
