"""ZeRO-3 runtime: units (flat per-block parameter groups), sharding across ranks, the hooks that gather
and free them around compute, the sharded optimizer and the pipelines that overlap it all.
Entry point: `offload.init(config)`; the map of the files is in runtime.py's docstring."""
from .optimizer import ShardedAdamW, wants_sharded
from .runtime import Runtime, current, init
from .state import TrainingState, UnitState

__all__ = ["Runtime", "init", "current", "ShardedAdamW", "wants_sharded", "UnitState", "TrainingState"]
