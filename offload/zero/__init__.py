"""ZeRO-3 runtime: units (flat per-block parameter groups), sharding across ranks, the hooks that gather
and free them around compute, and the sharded optimizer. Entry point: `offload.init(config)`."""
from .optimizer import ShardedAdamW, owned_by_runtime, wants_sharded
from .runtime import Runtime, current, init
from .state import UnitState

__all__ = ["Runtime", "init", "current", "ShardedAdamW", "owned_by_runtime", "wants_sharded", "UnitState"]
