"""The update path: the sharded optimizers (optimizer.py) over the families' state schemas (offload/optim/),
a step's hand-off to the optimizer lane (step.py), the pipeline that steps each chunk where its states live
(optimizer_pipeline.py), a unit's optimizer states (optim_states.py), the updates queued from the backward
(backward_updates.py, Config.update_in_backward) and the global gradient norm (grad_norm.py)."""
