"""Does a run fit, where should each state live, and what would change the answer: the plan behind
`offload plan` (pure functions of a model, a workload and a machine).

Usable capacity: 90% of each device's memory (the CUDA context, the allocator's slack), 80% of the host's
RAM (the OS, the framework, the page cache), and the NVMe drives' free space when given (else unbounded).
The placement chosen is the fastest predicted (step_time.py) among those that fit.
"""
from __future__ import annotations

import dataclasses

from .memory import PLACEMENTS, Workload, tier_bytes
from .model_spec import ModelSpec
from .step_time import Machine, predict

DEVICE_USABLE, HOST_USABLE = 0.90, 0.80

# Peak dense bf16 FLOP/s, PCIe per direction, achievable collective bus bandwidth, memory: per device.
DEVICES = {
    "h100": dict(device_flops=989e12, pcie_Bps=50e9, interconnect_Bps=360e9, memory=80 << 30),
    "h200": dict(device_flops=989e12, pcie_Bps=50e9, interconnect_Bps=360e9, memory=141 << 30),
    "a100": dict(device_flops=312e12, pcie_Bps=25e9, interconnect_Bps=240e9, memory=80 << 30),
    "l40s": dict(device_flops=362e12, pcie_Bps=25e9, interconnect_Bps=20e9, memory=48 << 30),
    # the CPU as the compute device (this project's test machines): no PCIe hop; give --tflops and --gpu-mem
    "cpu": dict(device_flops=0.5e12, pcie_Bps=float("inf"), interconnect_Bps=10e9, memory=16 << 30),
}


@dataclasses.dataclass(frozen=True)
class Capacity:
    device_per_rank: float
    cpu_per_node: float
    nvme_per_node: float | None  # None: not given (unbounded)


def capacity(device_bytes: int, cpu_bytes: int, nvme_bytes: int | None) -> Capacity:
    return Capacity(DEVICE_USABLE * device_bytes, HOST_USABLE * cpu_bytes, nvme_bytes)


def shortfall(tiers: dict, cap: Capacity, gpus_per_node: int) -> dict[str, float]:
    """{tier: bytes missing} (empty: it fits). Device per rank; cpu and nvme per node."""
    need = {"device": sum(tiers["device"].values()), "cpu": gpus_per_node * sum(tiers["cpu"].values()),
            "nvme": gpus_per_node * sum(tiers["nvme"].values())}
    have = {"device": cap.device_per_rank, "cpu": cap.cpu_per_node,
            "nvme": cap.nvme_per_node if cap.nvme_per_node is not None else float("inf")}
    return {t: need[t] - have[t] for t in need if need[t] > have[t]}


def tiers_for(m: ModelSpec, w: Workload, mc: Machine, cap: Capacity, place) -> dict:
    """tier_bytes under this machine's host memory a rank (the runtime cuts its chunks by its cpu budget)."""
    return tier_bytes(m, w, mc.ranks, place, cpu_budget=cap.cpu_per_node / mc.gpus_per_node)


def as_the_runtime_runs(m: ModelSpec, w: Workload, mc: Machine, cap: Capacity, place) -> Workload:
    """The workload as the runtime runs it on this machine: two things it gives up rather than refuse a run. It
    gathers the next unit ahead only where the device budget holds that too (offload.zero.placement: gather_ahead),
    and with no nvme room for speculative updates' spare slots it turns them off for the run, with a warning
    (offload.zero.update.speculation)."""
    short = shortfall(tiers_for(m, w, mc, cap, place), cap, mc.gpus_per_node)
    if "device" in short and w.gather_ahead:
        w = dataclasses.replace(w, gather_ahead=False)
    if "nvme" in short and w.speculative_updates and place.optimizer == "nvme":
        w = dataclasses.replace(w, speculative_updates=False)
    return w


def evaluate(m: ModelSpec, w: Workload, mc: Machine, cap: Capacity) -> list[dict]:
    """Every placement: its bytes per tier, what it lacks, and its predicted step. The host memory a rank has
    left beside its cpu-homed states and staging keeps nvme-homed states resident, as the runtime does."""
    out = []
    for place in PLACEMENTS:
        wp = resolve_activations(m, w, mc, cap, place)
        tiers = tiers_for(m, wp, mc, cap, place)
        room = cap.cpu_per_node / mc.gpus_per_node - sum(tiers["cpu"].values())
        out.append({"placement": place, "tiers": tiers, "short": shortfall(tiers, cap, mc.gpus_per_node),
                    "activations": wp.activations, "gather_ahead": wp.gather_ahead,
                    "speculative_updates": wp.speculative_updates,
                    "prediction": predict(m, wp, place, mc, resident_bytes=max(0.0, room))})
    return out


def resolve_activations(m: ModelSpec, w: Workload, mc: Machine, cap: Capacity, place) -> Workload:
    """Config.activations="auto" as the runtime takes it, for one placement: the cpu tier when the activations fit
    there beside the states, else the swap file (when that fits; else the cpu tier, whose shortfall is reported);
    then the runtime's fallbacks (as_the_runtime_runs)."""
    if w.activations != "auto":
        return as_the_runtime_runs(m, w, mc, cap, place)
    for where in ("cpu", "nvme"):
        wp = as_the_runtime_runs(m, dataclasses.replace(w, activations=where), mc, cap, place)
        if not shortfall(tiers_for(m, wp, mc, cap, place), cap, mc.gpus_per_node):
            return wp
    return as_the_runtime_runs(m, dataclasses.replace(w, activations="cpu"), mc, cap, place)


SEQ_STEP, SEQ_MAX = 1024, 1 << 20  # the longest sequence is searched in these steps, up to this many tokens


def longest_sequence(m: ModelSpec, w: Workload, mc: Machine, cap: Capacity, placement) -> int:
    """The longest sequence (a multiple of SEQ_STEP, at most SEQ_MAX tokens) at which `placement` fits with w's other
    settings; 0 when not even SEQ_STEP does. The activations grow with the sequence and the states do not, so
    fitting is monotone in it: a bisection."""
    def fits(steps: int) -> bool:
        wider = resolve_activations(m, dataclasses.replace(w, seq_len=steps * SEQ_STEP), mc, cap, placement)
        return not shortfall(tiers_for(m, wider, mc, cap, placement), cap, mc.gpus_per_node)

    lo, hi = 0, SEQ_MAX // SEQ_STEP
    if fits(hi):
        return SEQ_MAX
    while hi - lo > 1:  # fits(lo) (or lo == 0), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * SEQ_STEP


def longest_sequences(m: ModelSpec, w: Workload, mc: Machine, cap: Capacity, placement) -> dict[str, int]:
    """{Config.activations: the longest sequence that fits `placement`} with the activations on the device and
    offloaded to each tier."""
    return {where: longest_sequence(m, dataclasses.replace(w, activations=where), mc, cap, placement)
            for where in ("none", "cpu", "nvme", "auto")}


def choose(options: list[dict]) -> dict | None:
    fitting = [o for o in options if not o["short"]]
    return min(fitting, key=lambda o: o["prediction"]["step_s"]) if fitting else None


def config_for(chosen: dict, cap: Capacity, gpus_per_node: int) -> dict:
    """The offload.Config fields that make the runtime take the chosen placement on this machine. The plan counts
    on HOST_USABLE of the host memory, where the runtime's "auto" cpu budget is half of what is available at start
    (store/budget.py): a placement with states or activations in host memory names its cpu budget (its cpu bytes
    a rank, 5% and a GiB over, within what the plan counts on); gradients on the device are named too (the
    runtime's "auto" puts them there only under a given device budget); so are the activations' tier."""
    place = chosen["placement"]
    fields = {"params": place.params, "optimizer": place.optimizer}
    if place.grads and place.grads != place.optimizer:
        fields["grads"] = place.grads
    cpu = sum(chosen["tiers"]["cpu"].values())
    if set(chosen["tiers"]["cpu"]) - {"staging"}:  # (staging alone: "auto" holds it, and keeps more resident)
        room = cap.cpu_per_node / gpus_per_node
        fields["cpu_budget"] = f"{max(1, int(min(room, 1.05 * cpu + (1 << 30)) // (1 << 30)))}GiB"
    if chosen["activations"] != "none":
        fields["activations"] = chosen["activations"]
    if not chosen.get("speculative_updates", True) and place.optimizer == "nvme":  # (the runtime's warning, silenced)
        fields["speculative_updates"] = False
    return fields


def advice(m: ModelSpec, w: Workload, mc: Machine, cap: Capacity, chosen: dict | None) -> list[str]:
    """The smallest changes worth making, each with its predicted effect."""
    tips = []
    if chosen is None:
        best = min(evaluate(m, w, mc, cap), key=lambda o: sum(o["short"].values()))
        short = ", ".join(f"{t} by {v / 2**30:.1f} GiB" for t, v in best["short"].items())
        tips.append(f"nothing fits; closest is {best['placement']}, short on {short}")
        if "device" in best["short"]:
            if not w.checkpointing:
                tips.append("turn on activation checkpointing (--grad-checkpointing)")
            if w.activations == "none":
                tips.append("offload the activations (--activations cpu, or nvme)")
            if w.micro_batch > 1:
                tips.append(f"a smaller micro-batch (--micro-batch {w.micro_batch // 2}) with more accumulation")
        if "nvme" in best["short"]:
            tips.append("more nodes (ZeRO-3 divides every state by the ranks), or a larger NVMe drive (--nvme-size)")
        elif "cpu" in best["short"]:  # (with NVMe unbounded a larger drive changes nothing)
            tips.append("more nodes (ZeRO-3 divides every state by the ranks), or more host RAM (--cpu-mem)")
        return tips
    base = chosen["prediction"]
    bottleneck = base["bottleneck"]

    def rerun(label: str, **changes) -> None:
        mc2 = dataclasses.replace(mc, **{k: v for k, v in changes.items() if hasattr(mc, k)})
        w2 = dataclasses.replace(w, **{k: v for k, v in changes.items() if hasattr(w, k)})
        options = evaluate(m, w2, mc2, cap)
        pick = next(o for o in options if o["placement"] == chosen["placement"])
        if not pick["short"]:
            p = pick["prediction"]
            tips.append(f"{label}: {p['tokens_per_s']:.0f} tokens/s (from {base['tokens_per_s']:.0f}), "
                        f"step {p['step_s']:.2f} s")

    if bottleneck in ("nvme read", "nvme write"):
        rerun("a second NVMe drive (twice the bandwidth)", nvme_read_Bps=2 * mc.nvme_read_Bps,
              nvme_write_Bps=2 * mc.nvme_write_Bps)
        rerun(f"twice the gradient accumulation (--grad-accum {2 * w.grad_accum})", grad_accum=2 * w.grad_accum)
    elif bottleneck == "cpu adam":
        rerun(f"twice the gradient accumulation (--grad-accum {2 * w.grad_accum})", grad_accum=2 * w.grad_accum)
    elif bottleneck == "pcie":
        rerun(f"twice the micro-batch (--micro-batch {2 * w.micro_batch})", micro_batch=2 * w.micro_batch)
    elif bottleneck == "compute":
        tips.append("compute-bound: the offload costs nothing here")
    if w.checkpointing:
        options = evaluate(m, dataclasses.replace(w, checkpointing=False), mc, cap)
        pick = next(o for o in options if o["placement"] == chosen["placement"])
        if not pick["short"]:
            tips.append(f"activation checkpointing off still fits: {pick['prediction']['tokens_per_s']:.0f} tokens/s")
    return tips
