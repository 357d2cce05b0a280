"""Units and their bytes: how a model is cut into units (discover.py), each unit's flat layout over the ranks
(layout.py) and its shards in the store (shards.py), a unit's state machine and its gathers, reduces and
frees (unit.py, state.py), the hooks that drive it around compute (hooks.py), materializing and sharding a
model (materialize.py, wrap.py) and what plain PyTorch calls do on a wrapped model (torch_patches.py,
state_dict.py). Nothing here knows the optimizer or the schedule's plan."""
