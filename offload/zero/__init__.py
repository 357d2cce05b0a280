"""ZeRO-3 runtime: units (flat per-block parameter groups, units/), sharding across ranks, the hooks that
gather and free them around compute, the sharded optimizers and their path (update/), the collectives
(collectives/), and the schedule and lanes that overlap it all (here).
Entry point: `offload.init(config)`; the map of the files is in runtime.py's docstring."""
from .update.optimizer import ShardedAdamW, wants_sharded
from .runtime import Runtime, current, init
from .state_machines import TrainingState, UnitState

__all__ = ["Runtime", "init", "current", "ShardedAdamW", "wants_sharded", "UnitState", "TrainingState"]
