"""Predicted time of one optimizer step, split by resource, from the model, the workload, the placement
and the machine's figures: pure arithmetic.

Each resource's busy seconds per step (per rank; the disks and the CPU Adam are shared by a node's ranks):
  compute       a forward is 2 N + 4 L h s FLOPs per token (N: the active parameters, a MoE layer's routed
                experts counted num_experts_per_tok times), a backward twice that, and activation
                checkpointing adds one more forward; at the device's peak x its achieved fraction (mfu)
  pcie          each rank's shard of the parameters host -> device twice per micro-batch (forward and
                backward) when params are off the device; gradient shards device -> host every micro-batch
                and updated parameter shards host -> device once a step when the optimizer is off the device
  nvme read     parameter shards twice per micro-batch (params on nvme); master + moments + gradient once
                a step (optimizer on nvme)
  nvme write    the same states written back once a step, gradient shards every micro-batch
  cpu adam      the fused CPU AdamW over the node's shards (optimizer off the device)
  activations   with Config.activations, the offloaded bytes (memory.offloaded_activation_bytes) leave over
                pcie in each forward and come back in each backward; to nvme they are also written in the
                forward and read in the backward
  collectives   all-gathers (forward and backward) and reduce-scatters over the ranks' interconnect
nvme-homed states that fit in the host memory a rank has left (`resident_bytes`) are kept there and move no
nvme bytes, as the runtime's residency plan keeps them (offload/prefetch/schedule.residency_plan): most traffic
saved per byte first, which is the parameters (read twice per micro-batch, written once a step), then the
gradients (written every micro-batch, read once), then master and moments (read and written once a step).

The step is not their sum, and not quite their maximum. The pipeline overlaps within a phase, but global-norm
clipping needs every gradient before any update, and each unit's next gather waits for its update:
    forward  = max(its compute, its pcie, its nvme reads + activation writes, its all-gathers)
    backward = max(its compute, its pcie, its nvme reads + writes, its collectives)
    update   = max(optimizer nvme reads + writes, cpu adam, parameter upload)
    step     = grad_accum x backward + (grad_accum - 1) x forward + first forward
    first forward = the forward and the update on the same links: max(its compute, pcie + the update's,
                    nvme reads + the update's nvme traffic, all-gathers, cpu adam)
(the update runs under the next step's first forward, unit by unit). With Config.update_in_backward (opt-in:
clipped by the previous step's coefficient) each unit's update runs as soon as its gradient is final, so it
spreads over the last backward and the next first forward; so do the default's speculative updates at steps
that do not clip (Workload.unclipped; exact):
    last     = the last forward + backward + the update, each resource's seconds summed: max(compute,
               pcie, nvme, collectives, cpu adam)
    step     = (grad_accum - 1) x (forward + backward) + last
"""
from __future__ import annotations

import dataclasses

from .memory import Placement, StateBytes, RUNTIME, Workload, offloaded_activation_bytes, state_bytes
from .model_spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Machine:
    gpus_per_node: int = 8
    nodes: int = 1
    device_flops: float = 989e12  # peak dense bf16 FLOP/s per device
    mfu: float = 0.4  # fraction of the peak a step achieves
    pcie_Bps: float = 50e9  # per device, each direction
    interconnect_Bps: float = 360e9  # per device: achievable all-gather / reduce-scatter bus bandwidth
    nvme_read_Bps: float = 25e9  # per node, all drives together
    nvme_write_Bps: float = 12e9
    adam_params_per_s: float = 2.0e9  # per node, the fused CPU AdamW
    host_cores: int = 96  # per node (a compute-bound optimizer kernel scales with them)

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclasses.dataclass(frozen=True)
class Movement:
    """Busy seconds of one rank's data movement per step for a placement (compute and collectives aside)."""

    pcie_fwd: float  # per micro-batch
    pcie_bwd: float  # per micro-batch
    pcie_upd: float  # once a step
    nvme_fwd: float  # reads, per micro-batch
    nvme_bwd_read: float  # per micro-batch
    nvme_bwd_write: float  # per micro-batch
    nvme_upd_read: float  # once a step
    nvme_upd_write: float  # once a step
    adam: float  # once a step
    act_pcie: float = 0.0  # offloaded activations, each way, per micro-batch (out in the forward, back in the backward)
    act_nvme_write: float = 0.0  # per micro-batch, in the forward
    act_nvme_read: float = 0.0  # per micro-batch, in the backward

    @property
    def update(self) -> float:
        return max(self.nvme_upd_read + self.nvme_upd_write, self.adam, self.pcie_upd)


def paged_bytes(shard_params: float, place: Placement, resident_bytes: float,
                sb: StateBytes = RUNTIME) -> dict[str, float]:
    """{params, grads, optimizer}: bytes of each nvme-homed state class one rank pages through nvme each step,
    once `resident_bytes` of host memory hold what fits of them (module docstring: most traffic per byte first).
    Classes homed elsewhere page nothing."""
    sizes = {"params": sb.params * shard_params if place.params == "nvme" else 0.0,
             "grads": sb.grads * shard_params if place.grads_tier == "nvme" else 0.0,
             "optimizer": (sb.master + sb.moments) * shard_params if place.optimizer == "nvme" else 0.0}
    left = max(0.0, resident_bytes)
    out = {}
    for cls, nbytes in sizes.items():  # in that order
        kept = min(left, nbytes)
        out[cls], left = nbytes - kept, left - kept
    return out


def update_rate(mc: Machine, sb: StateBytes) -> float:
    """Parameters per second the node's CPU steps with the family of `sb`: the fused fp32 AdamW's rate (memory
    bound) scaled by the bytes each step moves, or the cores' rate where compute bounds the family's kernel."""
    rate = mc.adam_params_per_s * RUNTIME.update_bytes / sb.update_bytes
    return min(rate, mc.host_cores * sb.update_core_rate) if sb.update_core_rate else rate


def movement(shard_params: float, place: Placement, mc: Machine, sb: StateBytes = RUNTIME,
             resident_bytes: float = 0.0) -> Movement:
    """The transfers a placement costs one rank holding `shard_params` parameters (module docstring); the
    node's ranks share its drives and its CPU; `resident_bytes`: host memory the rank keeps nvme-homed states
    resident in."""
    p_bytes, g_bytes = sb.params * shard_params, sb.grads * shard_params
    paged = paged_bytes(shard_params, place, resident_bytes, sb)
    on_dev_params, on_dev_opt = place.params == "device", place.optimizer == "device"
    on_dev_grads = place.grads_tier == "device"
    node = mc.gpus_per_node
    nv_fwd = node * paged["params"] / mc.nvme_read_Bps
    # the updated params up (params on the device, optimizer off it); gradients kept on the device down to
    # the CPU optimizer once a step instead of every micro-batch
    upd_up = p_bytes / mc.pcie_Bps if (on_dev_params and not on_dev_opt) else 0.0
    upd_down = g_bytes / mc.pcie_Bps if (on_dev_grads and not on_dev_opt) else 0.0
    return Movement(
        pcie_fwd=0.0 if on_dev_params else p_bytes / mc.pcie_Bps,
        pcie_bwd=(0.0 if on_dev_params else p_bytes / mc.pcie_Bps) + (0.0 if on_dev_grads else g_bytes / mc.pcie_Bps),
        pcie_upd=upd_up + upd_down,
        nvme_fwd=nv_fwd,
        nvme_bwd_read=nv_fwd,
        nvme_bwd_write=node * paged["grads"] / mc.nvme_write_Bps,
        # master + moments in and out and the gradient in (what pages of them); the updated params out
        nvme_upd_read=node * (paged["optimizer"] + paged["grads"]) / mc.nvme_read_Bps,
        nvme_upd_write=node * (paged["optimizer"] + paged["params"]) / mc.nvme_write_Bps,
        adam=0.0 if on_dev_opt else node * shard_params / update_rate(mc, sb),
    )


def phases(mv: Movement, grad_accum: int, update_in_backward: bool = False, c_fwd: float = 0.0,
           c_bwd: float = 0.0, ag: float = 0.0, rs: float = 0.0) -> tuple[float, float, float]:
    """(forward, backward, step) seconds from a placement's movement, the compute of one forward and one
    backward and the collectives (all-gather, reduce-scatter) of one micro-batch (module docstring)."""
    pcie_fwd, pcie_bwd = mv.pcie_fwd + mv.act_pcie, mv.pcie_bwd + mv.act_pcie
    nvme_fwd, nvme_bwd = mv.nvme_fwd + mv.act_nvme_write, mv.nvme_bwd_read + mv.nvme_bwd_write + mv.act_nvme_read
    fwd = max(c_fwd, pcie_fwd, nvme_fwd, ag)
    bwd = max(c_bwd, pcie_bwd, nvme_bwd, ag + rs)
    nvme_upd = mv.nvme_upd_read + mv.nvme_upd_write
    if update_in_backward:
        last = max(c_fwd + c_bwd, pcie_fwd + pcie_bwd + mv.pcie_upd, nvme_fwd + nvme_bwd + nvme_upd, 2 * ag + rs,
                   mv.adam)
        return fwd, bwd, (grad_accum - 1) * (fwd + bwd) + last
    first = max(c_fwd, pcie_fwd + mv.pcie_upd, nvme_fwd + nvme_upd, ag, mv.adam)
    return fwd, bwd, grad_accum * bwd + (grad_accum - 1) * fwd + first


def movement_step_s(shard_params: float, place: Placement, mc: Machine, grad_accum: int = 1,
                    update_in_backward: bool = False) -> float:
    """The step a placement's data movement alone would take (compute and collectives free): what the
    runtime's "auto" tiers compare (offload.zero.placement), in the update mode the run uses."""
    return phases(movement(shard_params, place, mc), grad_accum, update_in_backward)[2]


def predict(m: ModelSpec, w: Workload, place: Placement, mc: Machine, sb: StateBytes | None = None,
            resident_bytes: float = 0.0) -> dict:
    """{"resources": busy seconds per resource per step, "phases": seconds, "step_s", "bottleneck",
    "tokens_per_s"} (module docstring); `resident_bytes`: host memory per rank that keeps nvme-homed states;
    sb: default the workload's optimizer family's (memory.state_bytes)."""
    sb = sb or state_bytes(w)
    r = mc.ranks
    shard = m.params / r  # parameters per rank
    tokens = w.micro_batch * w.seq_len  # per rank per micro-batch
    fwd_flops = (2 * m.active_params + 4 * m.layers * m.hidden * w.seq_len) * tokens  # per micro-batch
    passes = 4 if w.checkpointing else 3  # forward, backward (2x), and the recomputed forward
    rate = mc.device_flops * mc.mfu
    compute = passes * fwd_flops / rate
    c_fwd, c_bwd = fwd_flops / rate, (passes - 1) * fwd_flops / rate
    mv = movement(shard, place, mc, sb, resident_bytes)
    moved = offloaded_activation_bytes(m, w)  # activations, per micro-batch and rank
    if moved:
        mv = dataclasses.replace(mv, act_pcie=moved / mc.pcie_Bps,
                                 act_nvme_write=mc.gpus_per_node * moved / mc.nvme_write_Bps
                                 if w.activations == "nvme" else 0.0,
                                 act_nvme_read=mc.gpus_per_node * moved / mc.nvme_read_Bps
                                 if w.activations == "nvme" else 0.0)

    coll = (r - 1) / r if r > 1 else 0.0
    ag = coll * sb.params * m.params / mc.interconnect_Bps  # one all-gather of every unit
    rs = coll * 4 * m.params / mc.interconnect_Bps  # fp32 gradient reduce-scatter

    a = w.grad_accum
    in_backward = w.update_in_backward or (w.unclipped and w.speculative_updates)  # (the same phases, exact)
    fwd, bwd, step = phases(mv, a, in_backward, c_fwd, c_bwd, ag, rs)
    resources = {
        "compute": a * compute,
        "pcie": a * (mv.pcie_fwd + mv.pcie_bwd + 2 * mv.act_pcie) + mv.pcie_upd,
        "nvme read": a * (mv.nvme_fwd + mv.nvme_bwd_read + mv.act_nvme_read) + mv.nvme_upd_read,
        "nvme write": a * (mv.nvme_bwd_write + mv.act_nvme_write) + mv.nvme_upd_write,
        "cpu adam": mv.adam,
        "collectives": a * (2 * ag + rs),
    }
    return {"resources": resources, "phases": {"forward": fwd, "backward": bwd, "update": mv.update}, "step_s": step,
            "bottleneck": max(resources, key=resources.get),
            "tokens_per_s": a * tokens * r / step if step > 0 else float("inf")}
