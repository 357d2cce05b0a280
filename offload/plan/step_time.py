"""Predicted time of one optimizer step, split by resource, from the model, the workload, the placement
and the machine's figures: pure arithmetic.

Each resource's busy seconds per step (per rank; the disks and the CPU Adam are shared by a node's ranks):
  compute       a forward is 2 N + 4 L h s FLOPs per token, a backward twice that, and activation
                checkpointing adds one more forward; at the device's peak x its achieved fraction (mfu)
  pcie          each rank's shard of the parameters host -> device twice per micro-batch (forward and
                backward) when params are off the device; gradient shards device -> host every micro-batch
                and updated parameter shards host -> device once a step when the optimizer is off the device
  nvme read     parameter shards twice per micro-batch (params on nvme); master + moments + gradient once
                a step (optimizer on nvme)
  nvme write    the same states written back once a step, gradient shards every micro-batch
  cpu adam      the fused CPU AdamW over the node's shards (optimizer off the device)
  collectives   all-gathers (forward and backward) and reduce-scatters over the ranks' interconnect

The step is not their sum, and not quite their maximum. The pipeline overlaps within a phase, but global-norm
clipping needs every gradient before any update, and each unit's next gather waits for its update:
    forward  = max(its compute, its pcie, its nvme reads, its all-gathers)
    backward = max(its compute, its pcie, its nvme reads + writes, its collectives)
    update   = max(optimizer nvme reads + writes, cpu adam, parameter upload)
    step     = grad_accum x backward + (grad_accum - 1) x forward + max(forward, update)
(the update runs under the next step's first forward, unit by unit).
"""
from __future__ import annotations

import dataclasses

from .memory import Placement, StateBytes, RUNTIME, Workload
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

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes


def predict(m: ModelSpec, w: Workload, place: Placement, mc: Machine, sb: StateBytes = RUNTIME) -> dict:
    """{"resources": busy seconds per resource per step, "phases": seconds, "step_s", "bottleneck",
    "tokens_per_s"} (module docstring)."""
    r, local = mc.ranks, mc.gpus_per_node
    shard = m.params / r  # parameters per rank
    tokens = w.micro_batch * w.seq_len  # per rank per micro-batch
    fwd_flops = (2 * m.params + 4 * m.layers * m.hidden * w.seq_len) * tokens  # per micro-batch
    passes = 4 if w.checkpointing else 3  # forward, backward (2x), and the recomputed forward
    rate = mc.device_flops * mc.mfu
    compute = passes * fwd_flops / rate
    c_fwd, c_bwd = fwd_flops / rate, (passes - 1) * fwd_flops / rate

    p_bytes, g_bytes, opt_bytes = sb.params * shard, sb.grads * shard, (sb.master + sb.moments) * shard
    on_dev_params, on_dev_opt = place.params == "device", place.optimizer == "device"
    pcie_fwd = 0.0 if on_dev_params else p_bytes / mc.pcie_Bps
    pcie_bwd = (0.0 if on_dev_params else p_bytes / mc.pcie_Bps) + (0.0 if on_dev_opt else g_bytes / mc.pcie_Bps)
    pcie_upd = p_bytes / mc.pcie_Bps if (on_dev_params and not on_dev_opt) else 0.0

    node = local  # a node's ranks share its drives and its CPU
    nv_fwd = node * p_bytes / mc.nvme_read_Bps if place.params == "nvme" else 0.0
    nv_bwd_r = nv_fwd
    nv_bwd_w = node * g_bytes / mc.nvme_write_Bps if place.optimizer == "nvme" else 0.0
    nv_upd = 0.0
    if place.optimizer == "nvme":  # master + moments in and out, the gradient in
        nv_upd += node * (opt_bytes + g_bytes) / mc.nvme_read_Bps + node * opt_bytes / mc.nvme_write_Bps
    if place.params == "nvme":  # the updated compute-dtype parameters out
        nv_upd += node * p_bytes / mc.nvme_write_Bps
    adam = 0.0 if on_dev_opt else node * shard / mc.adam_params_per_s

    coll = (r - 1) / r if r > 1 else 0.0
    ag = coll * sb.params * m.params / mc.interconnect_Bps  # one all-gather of every unit
    rs = coll * 4 * m.params / mc.interconnect_Bps  # fp32 gradient reduce-scatter

    fwd = max(c_fwd, pcie_fwd, nv_fwd, ag)
    bwd = max(c_bwd, pcie_bwd, nv_bwd_r + nv_bwd_w, ag + rs)
    upd = max(nv_upd, adam, pcie_upd)
    a = w.grad_accum
    step = a * bwd + (a - 1) * fwd + max(fwd, upd)
    resources = {
        "compute": a * compute,
        "pcie": a * (pcie_fwd + pcie_bwd) + pcie_upd,
        "nvme read": a * (nv_fwd + nv_bwd_r) + (node * (opt_bytes + g_bytes) / mc.nvme_read_Bps
                                                if place.optimizer == "nvme" else 0.0),
        "nvme write": a * nv_bwd_w + (node * opt_bytes / mc.nvme_write_Bps if place.optimizer == "nvme" else 0.0)
        + (node * p_bytes / mc.nvme_write_Bps if place.params == "nvme" else 0.0),
        "cpu adam": adam,
        "collectives": a * (2 * ag + rs),
    }
    return {"resources": resources, "phases": {"forward": fwd, "backward": bwd, "update": upd}, "step_s": step,
            "bottleneck": max(resources, key=resources.get),
            "tokens_per_s": a * tokens * r / step if step > 0 else float("inf")}
