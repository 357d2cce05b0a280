"""Bytes of every class of training state, per rank and per tier: pure arithmetic.

Mixed-precision AdamW keeps, per parameter: the compute-dtype parameter (2 bytes in bf16), its gradient,
and the optimizer's fp32 master, first and second moments (K = 12 bytes). The ZeRO paper's figures take a
bf16 gradient (2 + 2 + 12 = 16 bytes per parameter); this runtime reduces gradients into fp32 shards
(4 bytes), so its own layout is 2 + 4 + 12 = 18 bytes per parameter. ZeRO-3 divides all of it by the
number of data-parallel ranks.

Activations follow Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
Models": 34 * s * b * h bytes per layer in 16-bit with a fused (flash / SDPA) attention, which keeps no
s x s score matrix; with activation checkpointing only each layer's input (2 * s * b * h bytes) is kept,
plus one layer's full activations while it is recomputed. The logits add s * b * vocab * 6 bytes (bf16,
and the fp32 copy the loss takes).

With activations offloaded (Config.activations "cpu" or "nvme") the layers' saved tensors wait in that tier
instead, except the ones around the layer being worked on (ACTIVATION_WINDOW layers: the one the backward is in
and those read ahead): with checkpointing that is every layer's input but those, without it every layer's
activations but those. The logits stay (the loss needs them first).
"""
from __future__ import annotations

import dataclasses

from .host_staging import staging_bytes
from .model_spec import ModelSpec

ADAM_K = 12  # fp32 master + two fp32 moments, bytes per parameter


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each state class."""

    params: int = 2
    grads: int = 4  # this runtime: fp32 gradient shards (the ZeRO paper: 2)
    master: int = 4
    moments: float = 8  # the optimizer family's own states: AdamW 8, AdamW8bit about 2.03, Lion 4
    update_bytes: float = 28.0  # host memory traffic of the family's step per parameter (Schema)
    update_core_rate: float | None = None  # parameters one core steps per second where compute bounds it
    state_tensors: int = 2  # tensors the family stores per chunk (its schema's states: AdamW 2, AdamW8bit 4)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.moments


PAPER = StateBytes(grads=2)  # the ZeRO paper's mixed-precision Adam: 16 bytes per parameter
RUNTIME = StateBytes()  # this runtime: 18


def zero_stage_bytes(params: int, ranks: int, stage: int, sb: StateBytes = PAPER) -> float:
    """Model-state bytes per rank under ZeRO stage 0 (DDP) to 3 (the ZeRO paper's Figure 1)."""
    p, g, k = sb.params * params, sb.grads * params, (sb.master + sb.moments) * params
    if stage == 0:
        return p + g + k
    if stage == 1:
        return p + g + k / ranks
    if stage == 2:
        return p + (g + k) / ranks
    if stage == 3:
        return (p + g + k) / ranks
    raise ValueError(f"ZeRO stage {stage}: expected 0, 1, 2 or 3")


@dataclasses.dataclass(frozen=True)
class Workload:
    micro_batch: int = 1  # sequences per rank per forward
    seq_len: int = 4096
    grad_accum: int = 1
    checkpointing: bool = True
    update_in_backward: bool = False  # Config.update_in_backward: the update runs under the last backward
    speculative_updates: bool = True  # Config.speculative_updates: a spare nvme slot per paged optimizer state
    gather_ahead: bool = True  # the next unit gathered while one runs (the runtime's, where the device budget holds it)
    chunk_size: int | None = None  # Config.chunk_size: fp32 bytes per chunk of a paged shard (None: cpu budget / 64)
    unclipped: bool = False  # steps whose norm stays under the clip: speculative updates run under the backward
    activations: str = "none"  # Config.activations: where saved activations wait (none: on the device)
    optimizer_states: str = "adamw"  # Config.optimizer_states: the optimizer family (its schema's bytes)


def state_bytes(w: Workload) -> StateBytes:
    """This runtime's bytes per parameter of each class with the workload's optimizer family (its schema)."""
    from ..optim.schema import by_name

    schema = by_name(w.optimizer_states, "--optimizer-states")
    return StateBytes(moments=schema.bytes_per_element, update_bytes=schema.update_bytes,
                      update_core_rate=schema.update_core_rate, state_tensors=len(schema.states))


ACTIVATION_WINDOW = 3  # layers' saved tensors on the device while offloaded: the current one and two read ahead
#                       (offload.zero.activations: READ_AHEAD + 1, and OUT_WINDOW + 1 in the forward; tests/test_plan.py)


def offloaded_activation_bytes(m: ModelSpec, w: Workload) -> int:
    """Bytes per micro-batch and rank that Config.activations moves off the device (0 for "none")."""
    if w.activations == "none":
        return 0
    sbh = w.seq_len * w.micro_batch * m.hidden
    per_layer = 2 * sbh if w.checkpointing else 34 * sbh
    return per_layer * max(0, m.layers - ACTIVATION_WINDOW)


def activation_bytes(m: ModelSpec, w: Workload) -> int:
    """Peak activation bytes on the device, one rank, one micro-batch (module docstring)."""
    sbh = w.seq_len * w.micro_batch * m.hidden
    full_layer = 34 * sbh
    kept = (2 * sbh * m.layers + full_layer) if w.checkpointing else full_layer * m.layers
    return kept - offloaded_activation_bytes(m, w) + 6 * w.seq_len * w.micro_batch * m.vocab


REDUCES_IN_FLIGHT = 2  # full gradients the reduce lane holds at once (offload.zero.context: max_reduces_in_flight)


def unit_working_set_bytes(unit_numel: int, compute_bytes: int = 2, ranks: int = 1, ahead: bool = True,
                           spans_chunks: bool = True) -> int:
    """Bytes one gathered unit needs on the compute device at once, the estimate `offload plan` and the runtime's
    refusal at wrap (offload.zero.placement) share: its gathered parameters (and the next unit's, gathered ahead),
    two full-size gradients in the compute dtype (the one autograd is making and the one the reduce lane still
    holds), the fp32 copy of this rank's piece of a parameter spanning gradient chunks that the reduce takes its
    norm from (offload.zero.units.piece_norms; `spans_chunks`: the unit's shard is cut into more than one chunk),
    and with more than one rank the fp32 copies of the full gradients the reduce lane sums over ranks
    (Config.reduce_dtype's default)."""
    params = unit_numel * compute_bytes * (2 if ahead else 1)
    grads = 2 * unit_numel * compute_bytes
    norm_copy = unit_numel * 4 // ranks if spans_chunks else 0
    return params + grads + norm_copy + (REDUCES_IN_FLIGHT * unit_numel * 4 if ranks > 1 else 0)


def gathered_bytes(m: ModelSpec, compute_bytes: int = 2, ranks: int = 1, ahead: bool = True) -> int:
    """Gathered parameters on the device at once, with their gradients (unit_working_set_bytes of the largest unit,
    the next one gathered ahead unless `ahead` is False: the runtime gathers ahead only where the budget holds it)."""
    return unit_working_set_bytes(m.largest_unit_params, compute_bytes, ranks, ahead=ahead)


@dataclasses.dataclass(frozen=True)
class Placement:
    params: str  # tier of the compute-dtype parameter shards: device, cpu or nvme
    optimizer: str  # tier of master + moments
    grads: str | None = None  # tier of the fp32 gradient shards (None: with the optimizer states)

    @property
    def grads_tier(self) -> str:
        return self.grads or self.optimizer

    def __str__(self) -> str:
        extra = f", grads={self.grads}" if self.grads and self.grads != self.optimizer else ""
        return f"params={self.params}, optimizer={self.optimizer}{extra}"


# With the optimizer states on nvme, the runtime keeps the gradient shards on the device when the device
# budget holds them (Config.grads="auto"): those placements are candidates too.
PLACEMENTS = [Placement("device", "device"), Placement("device", "cpu"), Placement("cpu", "cpu"),
              Placement("device", "nvme", "device"), Placement("cpu", "nvme", "device"),
              Placement("nvme", "nvme", "device"),
              Placement("device", "nvme"), Placement("cpu", "nvme"), Placement("nvme", "nvme")]


def per_rank_state_bytes(m: ModelSpec, ranks: int, sb: StateBytes = RUNTIME) -> dict[str, float]:
    """ZeRO-3: every state class divided over the ranks."""
    n = m.params / ranks
    return {"params": sb.params * n, "grads": sb.grads * n, "master": sb.master * n, "moments": sb.moments * n}


def tier_bytes(m: ModelSpec, w: Workload, ranks: int, place: Placement, sb: StateBytes | None = None,
               cpu_budget: float | None = None) -> dict:
    """{tier: {class: bytes per rank}} for a placement: states where it puts them, activations and the
    gathered working set on the device, the lanes' host working copies of nvme-homed states (host_staging.py).
    sb: default the workload's optimizer family's (state_bytes); cpu_budget: host bytes a rank has (the runtime's
    chunk size follows it; None: a large host, 64 MiB chunks)."""
    sb = sb or state_bytes(w)
    states = per_rank_state_bytes(m, ranks, sb)
    out = {"device": {}, "cpu": {}, "nvme": {}}
    out[place.params]["params"] = states["params"]
    out[place.grads_tier]["grads"] = states["grads"]
    for cls in ("master", "moments"):
        out[place.optimizer][cls] = states[cls]
    out["device"]["activations"] = activation_bytes(m, w)
    if w.activations != "none":  # one micro-batch's at a time (each backward takes its own back)
        out[w.activations]["activations"] = offloaded_activation_bytes(m, w)
    if place.optimizer == "nvme" and w.speculative_updates:  # what a speculative update writes beside the old
        out["nvme"]["spares"] = states["master"] + states["moments"]
    out["device"]["gathered"] = gathered_bytes(m, sb.params, ranks, w.gather_ahead)
    if "nvme" in (place.params, place.optimizer):
        # staging: the chunks the lanes hold at once, the floor the runtime refuses a cpu budget below (its
        # read-ahead only fills what the budget has left beside it)
        out["cpu"]["staging"] = staging_bytes(m.unit_params, ranks, sb.params, place.params == "nvme",
                                              place.optimizer == "nvme", place.grads_tier == "nvme", sb.state_tensors,
                                              cpu_budget, w.chunk_size)
    return out
