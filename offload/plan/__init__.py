"""`offload plan`: model sizes (model_spec.py), bytes per state class and tier (memory.py), the predicted step
(step_time.py), fit, placement and advice (sizing.py). Pure arithmetic; no torch."""
