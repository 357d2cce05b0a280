"""Placement: where each class of state lives, how shards are cut into chunks, and whether it all fits.
Decided when a model is wrapped, before any byte is moved; anything that cannot fit is refused here with
the numbers and the setting to change.

"auto" tiers: of the (params, optimizer) tier pairs that fit the budgets (with room to stage the largest unit),
the one whose data movement the plan's step model (offload/plan/step_time.py, `offload plan`) predicts
fastest, with the figures `offload bench --json` measured (Config.machine) or the device's nominal ones;
ties go to the faster tier for params, then for the optimizer. (Taking the fastest tier for params first is
not always best: a host that holds the optimizer states but not those and the params together is better
used for the states, which move 28 bytes per parameter a step from nvme against the params' 6.)
Gradients live with the optimizer states (the CPU optimizer reads them), except that nvme-homed optimizer
states leave their gradients in the device tier when a device budget the user gave holds them beside the
gathered units (grads_tier): a gradient on nvme costs a write in every backward and a read in every step.
Otherwise the schedule keeps nvme-homed gradients resident in the cpu budget if it can
(planner.residency_plan).
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass

import torch

from ..optim.adamw import ADAMW
from ..optim.schema import Schema
from ..store.sizes import format_bytes
# the chunking and the lanes' host working set: pure arithmetic `offload plan` shares (re-exported here)
from ..plan.host_staging import (CHUNK_ALIGN, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, WorkingSet,  # noqa: F401
                                 chunk_numel_for, equal_chunk, fit_chunk, host_working_set, staging_slot)
from ..plan.memory import Placement as TierPair, unit_working_set_bytes
from ..plan.sizing import DEVICES
from ..bench.figures import bench_figures
from ..plan.step_time import Machine, movement_step_s
from ..store import Tier
from ..store.swap_file import page_bytes
from .units.layout import FlatLayout
from .shards import StateTiers, chunk_bounds
from .state_store import check_nvme_path

PIPELINE_CHUNKS = 2  # chunks of optimizer state the pipeline holds at once (one stepped, one read ahead)


log = logging.getLogger("offload")


@dataclass(frozen=True)
class Placement:
    tiers: StateTiers
    chunk_numel: int  # target elements per chunk (a unit's shard is cut into equal chunks at most this long)
    gather_ahead: bool  # the device budget holds one more gathered unit: gather the next unit while one runs
    staging_slot: int = 0  # bytes every short-lived cpu working copy takes (staging_slot())
    # "auto" tiers: every pair that fit, with the step its data movement alone is predicted to take (seconds)
    considered: tuple[tuple[str, str, float], ...] = ()

    def chunk_of(self, shard_numel: int) -> int:
        return equal_chunk(shard_numel, self.chunk_numel)


AUTO_DEVICE_ACTIVATION_SHARE = 0.5  # of an "auto" device budget that "auto" tiers leave to activations and workspace


def master_fp32(width: int) -> int:
    """fp32 elements of master copy per element: one, unless the parameter (compute dtype of `width` bytes) is it."""
    return 1 if width != 4 else 0


def optimizer_fp32_states(width: int, schema: Schema = ADAMW) -> float:
    """Bytes homed with the optimizer per trained element, in fp32 elements: the family's states (AdamW: exp_avg
    and exp_avg_sq, 2; AdamW8bit: about 0.5), the gradient, and the fp32 master (master_fp32)."""
    return schema.bytes_per_element / 4 + 1 + master_fp32(width)


@dataclass
class UnitSize:
    index: int
    name: str
    module_type: str
    layout: FlatLayout
    always_gathered: bool  # the root, or small enough to persist


# See [Note: the gathered bound] in docs/zero-runtime.md
def gathered_bound(sizes: list[UnitSize], width: int, ahead: bool) -> int:
    """Bytes gathered at once at most: always-gathered units + the largest other unit, twice when the next
    unit is gathered while one runs."""
    fixed = sum(s.layout.padded_numel * width for s in sizes if s.always_gathered)
    largest = max((s.layout.padded_numel * width for s in sizes if not s.always_gathered), default=0)
    return fixed + largest * (2 if ahead else 1)


def device_working_set(sizes: list[UnitSize], width: int, ahead: bool, chunk_numel: int) -> int:
    """Bytes the units need on the device at once at most: always-gathered units + the largest other unit's working
    set (its gathered params, the next unit's when gathered ahead, its full gradients in flight:
    offload.plan.memory.unit_working_set_bytes, the estimate `offload plan` makes). chunk_numel: the chunk length
    (a shard longer than it has its norm taken from a copy)."""
    fixed = sum(s.layout.padded_numel * width for s in sizes if s.always_gathered)
    largest = max((s for s in sizes if not s.always_gathered), key=lambda s: s.layout.padded_numel, default=None)
    if largest is None:
        return fixed
    layout = largest.layout
    return fixed + unit_working_set_bytes(layout.padded_numel, width, layout.world_size, ahead,
                                          spans_chunks=layout.shard_numel > chunk_numel)


def check_unit_working_set(sizes: list[UnitSize], new: list[UnitSize], width: int, device_budget: int,
                           chunk_numel: int) -> None:
    """Refuse at wrap, in one line naming the setting and the figure needed, a device budget that cannot hold the
    largest unit's working set (device_working_set without gathering ahead), instead of running over it."""
    need = device_working_set(sizes, width, False, chunk_numel)
    if need <= device_budget or not new:
        return
    big = max((s for s in sizes if not s.always_gathered), key=lambda s: s.layout.padded_numel, default=None)
    what = f"unit {big.index} ({big.name or '<root>'}, {big.module_type})" if big else "the always-gathered units"
    raise MemoryError(
        f"offload.Config.device_budget (offload plan --gpu-mem): {what} needs {format_bytes(need)} ({need} bytes) on "
        f"the device at once (its gathered parameters, its full-size gradients in flight and the units always "
        f"gathered), more than device_budget {format_bytes(device_budget)}; give device_budget >= "
        f"{format_bytes(need)}, or cut smaller units (offload.Config.unit_classes / unit_min_bytes)")


def machine_for(device: torch.device, ranks_per_node: int, bench_json: str | None) -> Machine:
    """The figures "auto" tiers are compared with: the compute device's nominal ones (a CPU has no PCIe hop;
    a GPU's from offload.plan.sizing.DEVICES by name, an H100's when unknown), overridden by what
    `offload bench --json` measured on this machine (Config.machine)."""
    key = "cpu"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        key = next((k for k in DEVICES if k != "cpu" and k in name), "h100")
    dev = DEVICES[key]
    figures = dict(device_flops=dev["device_flops"], pcie_Bps=dev["pcie_Bps"],
                   interconnect_Bps=dev["interconnect_Bps"])
    if bench_json:
        figures.update(bench_figures(bench_json, "offload.Config.machine"))
    return Machine(gpus_per_node=max(1, ranks_per_node), **figures)


def plan(sizes: list[UnitSize], new: list[UnitSize], params: str, optimizer: str, budgets: dict,
         in_use: dict, compute_dtype: torch.dtype, chunk_setting: int | None, nvme_path: str | None,
         grads: str = "auto", device_budget_given: bool = False, machine: Machine | None = None,
         update_in_backward: bool = False, schema: Schema = ADAMW) -> Placement:
    """The placement for `new` units joining `sizes` (every unit, new ones included). `params` /
    `optimizer` / `grads`: the configured tiers ("auto" allowed); budgets / in_use: bytes per tier;
    device_budget_given: the device budget is the user's figure (not "auto"); machine: the figures "auto"
    tiers are compared with (machine_for; default: a CPU's); update_in_backward: the step they predict is
    Config.update_in_backward's; schema: the optimizer family the states are sized for
    (Config.optimizer_states)."""
    width = compute_dtype.itemsize
    chunk_numel = fit_chunk(chunk_numel_for(budgets["cpu"], chunk_setting), [s.layout.shard_numel for s in sizes])
    check_unit_working_set(sizes, new, width, budgets["device"], chunk_numel)
    chunks = {s.index: [hi - lo for lo, hi in chunk_bounds(s.layout.shard_numel,
                                                          equal_chunk(s.layout.shard_numel, chunk_numel))]
              for s in sizes}
    # bytes the new units' shards hold in their home tier, as the store holds them (every chunk page-rounded); a
    # frozen unit (a LoRA base) has the parameter and its fp32 master (its values as loaded, for the export) and
    # never a gradient or a moment
    new_chunks = [n for s in new for n in chunks[s.index]]
    trained_chunks = [n for s in new if s.layout.trainable for n in chunks[s.index]]
    param_bytes = sum(page_bytes(n * width) for n in new_chunks)
    grad_bytes = sum(page_bytes(n * 4) for n in trained_chunks)
    master_bytes = master_fp32(width) * sum(page_bytes(n * 4) for n in new_chunks)
    opt_bytes = master_bytes + int((optimizer_fp32_states(width, schema) - master_fp32(width)) * grad_bytes)

    def staging(p: str, o: str) -> int:
        return host_working_set(list(chunks.values()), width, p == "nvme", o == "nvme",
                                None if grads == "auto" else grads == "nvme", len(schema.states)).total

    def cpu_homed(p: str, o: str) -> int:
        return (param_bytes if p == "cpu" else 0) + (opt_bytes if o == "cpu" else 0)

    def device_homed(p: str, o: str) -> int:
        return (param_bytes if p == "device" else 0) + (opt_bytes if o == "device" else 0)

    cpu_free = budgets["cpu"] - in_use["cpu"]
    device_free = budgets["device"] - in_use["device"]
    gathered = device_working_set(sizes, width, False, chunk_numel)  # (with the gradients in flight)
    biggest_full = max((s.layout.padded_numel * width for s in new), default=0)

    def fits(p: str, o: str) -> bool:
        if cpu_homed(p, o) + staging(p, o) > cpu_free:
            return False
        # the device-homed shards, and two units gathered at once (or the persistent ones); under an "auto" device
        # budget (the activations' need unknown, and a shard's home never moves) in half of it at most, as the
        # gradients under "auto" go to the device only within a budget the user gave
        room = device_free if device_budget_given else device_free - budgets["device"] * AUTO_DEVICE_ACTIVATION_SHARE
        if device_homed(p, o) and device_homed(p, o) + max(2 * biggest_full, gathered) > room:
            return False
        nvme = (param_bytes if p == "nvme" else 0) + (opt_bytes if o == "nvme" else 0)
        return not nvme or (nvme_path is not None and (budgets["nvme"] is None or nvme <= budgets["nvme"])
                            and _nvme_free(nvme_path) >= nvme)

    considered = ()
    if "auto" in (params, optimizer):
        mc = machine or machine_for(torch.device("cpu"), 1, None)
        shard_numel = sum(s.layout.shard_numel for s in new)
        options = [(p, o) for p in (("device", "cpu", "nvme") if params == "auto" else (params,))
                   for o in (("cpu", "nvme") if optimizer == "auto" else (optimizer,)) if fits(p, o)]
        considered = tuple((p, o, movement_step_s(shard_numel, TierPair(p, o), mc, 1, update_in_backward))
                           for p, o in options)
        if considered:  # the fastest predicted; ties to the earlier (faster) tiers
            params, optimizer, _ = min(considered, key=lambda c: c[2])
            log.info("offload: auto placement params=%s optimizer=%s (predicted data movement per step: %s)",
                     params, optimizer, ", ".join(f"{p}/{o} {t * 1e3:.1f} ms" for p, o, t in considered))
        else:  # nothing fits: the tiers that need the least memory, so the checks below say what is short
            if params == "auto":
                params = _nvme_or_fail("params", param_bytes, nvme_path)
            if optimizer == "auto":
                optimizer = _nvme_or_fail("optimizer", opt_bytes, nvme_path)
    cpu_need, working = cpu_homed(params, optimizer), staging(params, optimizer)
    if cpu_need + working > cpu_free:
        raise MemoryError(
            f"offload.Config.cpu_budget: with params={params!r} and optimizer={optimizer!r} this rank needs "
            f"{format_bytes(cpu_need + working)} ({cpu_need + working} bytes) of host memory: "
            f"{format_bytes(cpu_need)} of cpu-homed states and {format_bytes(working)} that the background work "
            "holds at once for nvme-homed ones (the largest unit's param chunks being gathered, one chunk of every "
            f"state being stepped, one gradient chunk being reduced), but only {format_bytes(cpu_free)} "
            f"({cpu_free} bytes) of cpu_budget is free; raise cpu_budget"
            + "".join(f", set {name}='nvme'" for name, tier in (("params", params), ("optimizer", optimizer))
                      if tier != "nvme")
            + ", or lower offload.Config.chunk_size"
        )
    nvme_need = (param_bytes if params == "nvme" else 0) + (opt_bytes if optimizer == "nvme" else 0)
    if nvme_need:
        if budgets["nvme"] is not None and nvme_need > budgets["nvme"]:
            raise OSError(
                f"offload.Config.nvme_budget: the model's nvme-homed states need {format_bytes(nvme_need)} "
                f"({nvme_need} bytes) on this rank but nvme_budget is {format_bytes(budgets['nvme'])} "
                f"({budgets['nvme']} bytes) (when 'auto': 90% of nvme_path's free space, split among this node's "
                "ranks); free space on the drive, point nvme_path at a larger one, or give nvme_budget (up to the "
                "free space)"
            )
        check_nvme_path(nvme_path, nvme_need, "the model's nvme-homed states")
    on_device = device_homed(params, optimizer)
    if on_device and on_device + gathered > device_free:
        # device-homed shards and the gathered units share the device: both must fit device_budget
        what = " and ".join(f"{name}='device' keeps {format_bytes(n)} ({n} bytes) of {kind}"
                            for name, tier, n, kind in (("params", params, param_bytes, "parameter shards"),
                                                        ("optimizer", optimizer, opt_bytes,
                                                         "fp32 master, gradient and optimizer states"))
                            if tier == "device")
        raise MemoryError(
            f"offload.Config.device_budget: {what} on the device and gathering units needs up to "
            f"{format_bytes(gathered)} ({gathered} bytes) more (root + persistent units + the largest unit's working "
            f"set), but only {format_bytes(device_free)} ({device_free} bytes) of device_budget is left; raise device_budget or set "
            + " / ".join(f"{name}='cpu' / 'nvme'" for name, tier in (("params", params), ("optimizer", optimizer))
                         if tier == "device")
        )
    device_left = device_free - on_device
    gathered_ahead = device_working_set(sizes, width, True, chunk_numel)
    grads = grads_tier(grads, optimizer, grad_bytes, device_left - gathered_ahead, cpu_free - cpu_need - working,
                       device_budget_given)
    if grads == "device" and optimizer != "device":
        device_left -= grad_bytes
    ahead = gathered_ahead <= device_left
    tiers = StateTiers(Tier(params), Tier(optimizer), Tier(grads))
    return Placement(tiers, chunk_numel, ahead, staging_slot(list(chunks.values())), considered)


def grads_tier(setting: str, optimizer: str, grad_bytes: int, device_room: int, cpu_room: int,
               device_budget_given: bool) -> str:
    """Home tier of the gradient shards. `device_room` / `cpu_room`: bytes of those budgets left once the
    params, optimizer states, gathered units (one ahead) and the lanes' working set have theirs."""
    if setting == "auto":
        if optimizer == "nvme" and device_budget_given and grad_bytes <= device_room:
            return "device"  # no nvme round trip; with an "auto" budget the activations' need is unknown
        return optimizer
    if setting == optimizer:
        return setting
    if setting == "device" and grad_bytes > device_room:
        raise MemoryError(
            f"offload.Config.grads='device': the gradient shards need {format_bytes(grad_bytes)} ({grad_bytes} bytes) "
            f"of device_budget but only {format_bytes(max(device_room, 0))} is left beside the gathered units; "
            "raise device_budget or set grads='auto'")
    if setting == "cpu" and grad_bytes > cpu_room:
        raise MemoryError(
            f"offload.Config.grads='cpu': the gradient shards need {format_bytes(grad_bytes)} ({grad_bytes} bytes) "
            f"of cpu_budget but only {format_bytes(max(cpu_room, 0))} is left; raise cpu_budget or set grads='auto'")
    return setting


def _nvme_free(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0  # unusable: the checks below say why


def _nvme_or_fail(what: str, nbytes: int, nvme_path: str | None) -> str:
    if not nvme_path:
        raise MemoryError(
            f"offload.Config.{what}='auto': {format_bytes(nbytes)} of {what} states fit neither device_budget "
            "nor cpu_budget and no nvme_path is set; raise a budget or give nvme_path"
        )
    return "nvme"
