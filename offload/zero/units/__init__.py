"""Units: how a model is cut into units (discover.py), each unit's flat layout over the ranks (layout.py), a
unit's gathers, reduces and frees (unit.py), the norms of its gradient's pieces (piece_norms.py), the hooks that
drive it around compute (hooks.py), materializing a model (materialize.py) and a wrapped model's state dict
(state_dict.py). Below them: a unit's shards' records (../shards.py), its state machine (../state_machines.py),
the store's view (../state_store.py) and the lanes. Nothing here knows the optimizer, the placement or the
schedule's plan: sharding a whole model (../wrap.py) and plain PyTorch calls on it (../torch_patches.py) stand
above, beside the runtime."""
