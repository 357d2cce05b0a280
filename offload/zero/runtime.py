"""`offload.init(config)`: the ZeRO-3 runtime as a context manager, and its life.

    with offload.init(cfg) as rt:
        model = build_model()              # parameters registered as meta; materialized unit by unit
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        for batch in loader:
            loss = model(batch); loss.backward()
            rt.clip_grad_norm_(1.0)
            opt.step(); opt.zero_grad()
    # leaving the block waits for queued work, frees every shard, removes swap files, restores nn.Module,
    # and makes the model raise a clear error when used.

The pieces, bottom up: collectives/ (comm.py, the watchdog); shards.py names every shard and state_machines.py
holds the units' and the training's states, below state_store.py (the store and the swap directory), lanes.py
and the schedule; units/ (unit.py is one unit's gathers, frees and reduces), update/ (the
optimizers; step.py owns the step's state and hands each step's updates to the optimizer pipeline); here:
wrap.py shards a model into units, torch_patches.py keeps plain PyTorch calls working on a wrapped model,
placement.py decides tiers and chunking, schedule.py traces the step and drives the prefetch, lanes.py runs the
gathers, reduces and the pipeline in the background (docs/zero-runtime.md has the whole table).

Gradient accumulation: by default every backward reduce-scatters its gradient and adds this rank's shard to
the stored gradient shard (memory: one shard per unit). Inside `with rt.no_sync():` backward passes
accumulate the unsharded fp32 gradient locally (memory: the full gradient of every unit) and the first
backward outside it reduces the sum once - the DDP/FSDP pattern. `opt.step()` also reduces anything
no_sync left behind. Both give the same result as plain PyTorch.

The set of units that receive gradients must be the same on every rank (as with DDP's default), because
each reduce is a collective; so must the order in which units run (each gather is one too).
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import importlib
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import compute_dtype as compute_dtypes
from ..config import Config, parse_duration
from ..optim.schema import by_name as schema_by_name
from ..device import Streams, bind_thread, compute_device
from ..store import Tier, check_fits_machine, ranks_on_this_node, resolve_budget
from ..store import host_pool
from ..store.links import Link
from ..telemetry import Lane, Meter, Queue
from .collectives import comm, divergence, user_calls, warm
from . import placement
from .activations import ActivationOffloader
from .active import ACTIVE as _ACTIVE, current  # noqa: F401 - (current: offload.zero.runtime's name too)
from .update.backward_updates import BackwardUpdates
from .context import Counters, UnitContext
from .device_budget_fit import DeviceBudgetFit, fit_device_budget
from .host_memory import peak_rss_bytes, rss_bytes, tune_malloc, untune_malloc
from .lanes import LaneContext, Lanes, WorkLane
from .units.hooks import check_call
from .units.materialize import ConstructionCapture
from .update.optimizer_pipeline import OptimizerPipeline
from .schedule import Schedule
from .shards import StateKind
from .state_machines import UnitState
from .torch_patches import ForeignCodeGuards, placed_apply, route_compiled_zero_grad
from .ddp_guard import DDPGuard
from .state_store import UnitStateStore, prepare_swap_dir
from .update.loss_scale import LossScale
from .update.step import UpdatePath
from .step_stats import StepStats
from .units.unit import ShardedUnit
from .collectives.agree import Agreement
from .collectives.watchdog import Watchdog
from .wrap import place_model, refuse_unmanaged, shard_model

log = logging.getLogger("offload")



def init(config: Config | None = None, **fields) -> "Runtime":
    """A Runtime for `config` (or Config(**fields)); use it as a context manager."""
    if config is None:
        config = Config(**fields)
    elif fields:
        raise TypeError("offload.init: give a Config or keyword fields, not both")
    return Runtime(config)


class Runtime:
    def __init__(self, config: Config):
        # "auto" becomes the dtype this device multiplies fast; open() agrees it across ranks
        self._auto_compute_dtype = config.compute_dtype == "auto"
        name, self.compute_dtype_reason = compute_dtypes.resolve(config.compute_dtype, compute_device())
        self.config = config = dataclasses.replace(config, compute_dtype=name)
        self.sized_schema = schema_by_name(config.optimizer_states)  # what the placement sizes optimizer states for
        self.units: list[ShardedUnit] = []
        self.models: list[nn.Module] = []
        self.compute_dtype = config.torch_compute_dtype
        self.params_tier = config.params
        self.optimizer_tier = config.optimizer
        self.grads_tier = config.grads
        self.placement: placement.Placement | None = None
        self.machine = None  # plan.step_time.Machine: the figures "auto" tiers are compared with
        self.is_open = False
        self.closed = False
        self._hooks: list = []
        self._capture: ConstructionCapture | None = None
        self._pending = False
        self._ordinal_base = 0
        self.states: UnitStateStore | None = None
        self.ctx: UnitContext | None = None
        self.schedule: Schedule | None = None
        self.pipeline: OptimizerPipeline | None = None
        self.meter = Meter()
        self._rss_at_open = 0
        self._malloc_mode: str | None = None  # tune_malloc's, undone at close (the host pool's hold)
        self.step_stats: StepStats | None = None
        self.last_checkpoint_seconds: float | None = None
        self.watchdog: Watchdog | None = None
        self.agreement: Agreement | None = None  # the collective entry points' meeting (collectives/agree.py)
        self._generate_sync = None  # generate() in step over the ranks (integrations/generate_sync.py)
        self.activations: ActivationOffloader | None = None  # Config.activations != "none"
        self.updates: UpdatePath | None = None  # the step's state and hand-off (update/step.py), built in open()
        self.device_fit: DeviceBudgetFit | None = None  # an "auto" device budget, fitted after the first step
        self._fit_device_budget = False
        self._lane_groups: tuple = ()
        self._own_default_group = False  # started here for Config.collectives_at_world_size_1: ended at close
        self.communicators_device_bytes: dict[str, int] = {}  # what each communicator took of the device (warm.py)

    # ---- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> "Runtime":
        try:
            self.open()
        except BaseException:
            self.close(failed=True)  # what open() started (process group, watchdog, store) goes with it
            raise
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        self.close(failed=exc_type is not None)
        return False

    def open(self) -> None:
        if self.closed or self.is_open:
            raise RuntimeError("offload.init: a Runtime can be entered once")
        cfg = self.config
        self.device = compute_device()
        bind_thread(self.device)  # before the process group: NCCL binds its communicator to the current device
        self.group = self._setup_group()
        self._malloc_mode = tune_malloc(self.device)  # first: a bad OFFLOAD_MALLOC_TUNE raises before anything is built
        # each lane issues its collectives on a group of its own (created in the same order on every rank), and
        # every group's communicator takes its memory now, before the budgets are measured (collectives/warm.py)
        timeout = parse_duration(cfg.collective_timeout, "collective_timeout")
        order = comm.ProgramOrder()  # one issue order for the lanes' collectives and the training thread's (comm.py)
        self.group.order, self.group.inline = order, True
        gather_group = comm.sub_group(self.group, "gather", order, timeout)
        reduce_group = comm.sub_group(self.group, "reduce", order, timeout)
        self._lane_groups = (gather_group, reduce_group)  # (destroyed at close, also where open fails after here)
        self.communicators_device_bytes = warm.warm_up([self.group, gather_group, reduce_group], self.device)
        self._rss_at_open = rss_bytes()  # the interpreter's, torch's and the user's own: rt.stats()["memory"]
        local = ranks_on_this_node(self.group.world_size)  # ranks sharing this host's memory and drive
        self.budgets = {"device": self._budget("device_budget", local), "cpu": self._budget("cpu_budget", local),
                        "nvme": None}
        self._local_ranks = local
        # "auto": fitted after the first step to what it left free (the activations, the communicators)
        self._fit_device_budget = cfg.bytes_of("device_budget") is None
        check_fits_machine(self.budgets["device"], self.budgets["cpu"], self.device, local)
        self.machine = placement.machine_for(self.device, local, cfg.machine)  # what "auto" tiers compare
        if cfg.nvme_path:  # dead runs' swap removed first: the auto budget counts the space they held
            self.budgets["nvme"] = prepare_swap_dir(cfg.nvme_path, cfg.nvme_budget, local)
        if self.group.distributed:  # every rank plans with the same numbers: placement decides how many gathers a
            # step issues (gather ahead, what stays gathered, the "auto" tiers), and ranks that decide apart hang.
            # Agreed before any rank builds its store: a rank's pinned arena would shrink the memory the ranks
            # after it read for their "auto" budgets, and each store holds only the agreed budget
            # (and an "auto" compute dtype: 0 where a rank found bf16 slow, so every rank then computes in fp32)
            agreed = comm.all_reduce_host_(self.group, torch.tensor(
                [float(self.budgets[t] if self.budgets[t] is not None else -1) for t in ("device", "cpu", "nvme")]
                + [float(cfg.compute_dtype != "fp32")], dtype=torch.float64), "min",
                what="the budgets and compute dtype every rank plans with")
            self.budgets.update(device=int(agreed[0]), cpu=int(agreed[1]),
                                nvme=int(agreed[2]) if agreed[2] >= 0 else None)
            if self._auto_compute_dtype and agreed[3] == 0 and cfg.compute_dtype != "fp32":
                self.config = cfg = dataclasses.replace(cfg, compute_dtype="fp32")
                self.compute_dtype = torch.float32
                self.compute_dtype_reason = "fp32: another rank's CPU multiplies bf16 slowly"
        self.states = UnitStateStore(self.device, self.budgets, cfg.nvme_path, self.group.rank, cfg.swap_checksums,
                                     cfg.compute_through_device_tier)
        # the store rounded the budgets to pages (the same on every rank): plan against what it enforces
        self.budgets = {t: self.states.capacity(t) for t in ("device", "cpu")} | {"nvme": self.budgets["nvme"]}
        streams = Streams(self.device, high_priority=(Lane.GATHER, Lane.REDUCE))
        lanes = Lanes.create(self.meter, threaded=cfg.pipeline, streams=streams)
        shared = LaneContext(self.states, lanes, self.meter, self.compute_dtype)
        self.pipeline = OptimizerPipeline(shared, read_ahead=placement.PIPELINE_CHUNKS - 1 if cfg.pipeline else 0)
        counters = Counters()
        self.step_stats = StepStats(self.meter, self.states, counters, self.device, log_every=cfg.log_every)
        self.updates = UpdatePath(cfg, self.group, self.units, self.meter, self.states, self.pipeline, self.step_stats,
                                  self.sized_schema, self.compute_dtype, after_step=self._after_step,
                                  quiesce=self.quiesce, every_rank_calls=self.every_rank_calls)
        self.schedule = Schedule(shared, {}, self._reserve_bytes, prefetch=cfg.pipeline, gather_ahead=False,
                                 on_new_backward=self.updates.on_new_backward, pipeline=self.pipeline,
                                 # updates queued in the backward read their own states: read the next ones
                                 # under the forward then
                                 updates_in_backward=self.backward_updates.expects_updates_in_backward,
                                 plan_for_updates_in_backward=cfg.update_in_backward or cfg.speculative_updates,
                                 before_gather=self.backward_updates.before_gather,
                                 activation_room=lambda: self.activations.cpu_demand if self.activations else 0,
                                 on_pass_end=lambda where: divergence.check_pass(self.group, self.units, where))
        self.ctx = UnitContext(self.device, self.compute_dtype, self.group, gather_group, reduce_group, self.states,
                               lanes, self.meter, counters, schedule=self.schedule, streams=streams,
                               reduce_dtype=cfg.torch_reduce_dtype, on_reduce=self.backward_updates.on_reduce)
        self.updates.attach(self.schedule, self.ctx)
        if cfg.activations != "none":
            lane = WorkLane(Lane.ACTIVATIONS, Queue.ACTIVATION, self.meter, threaded=cfg.pipeline, pause_each=False,
                            streams=streams)
            homes = {"cpu": (Tier.CPU,), "nvme": (Tier.NVME,),
                     "auto": (Tier.CPU, Tier.NVME) if cfg.nvme_path else (Tier.CPU,)}[cfg.activations]
            self.activations = ActivationOffloader(
                self.states.store, self.device, homes, cfg.bytes_of("activations_min_size"), lane,
                self.meter, reserve=self._lanes_host_bytes, is_param=self._holds_parameter_bytes,
                setting=cfg.activations)
        # a module was built: the next forward may need to materialize it
        self._capture = ConstructionCapture(
            on_module=self._note_module, on_load=lambda m: self.materialize_pending(),
            on_apply=lambda m, fn, recurse: placed_apply(m, fn, recurse, self.device, self.compute_dtype)).__enter__()
        self._auto_wrap_hook = nn.modules.module.register_module_forward_pre_hook(self._auto_wrap)
        self._hooks.append(self._auto_wrap_hook)
        self._hooks.append(ForeignCodeGuards())  # torch's clip and optimizers over wrapped parameters (torch_patches)
        self._hooks.append(DDPGuard())  # DistributedDataParallel over a wrapped model, refused (ddp_guard.py)
        if "transformers" in sys.modules:  # from_pretrained in the block streams into the store (not imported else)
            importlib.import_module("offload.integrations.hf_loading")
        if self.group.distributed:  # the program's own torch.distributed calls take their place in the order
            self._hooks.append(user_calls.UserCollectivesInOrder(self.group))
        self.is_open = True
        self._sync_generate()
        _ACTIVE.append(self)

    def close(self, failed: bool = False) -> None:
        if self.closed:
            return
        if self._capture is not None:
            self._capture.stop()
        if self.updates is not None:
            self.updates.close()  # its training-loop calls raise from now on
        # The units' hooks stay: after free() they raise a clear error if the model is used again.
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        error = None
        if self.activations is not None:
            try:
                self.activations.close()  # its copies finish before the store goes
            except BaseException as e:  # noqa: BLE001 - reported after everything is freed
                error = e
        if self.ctx is not None:
            for lane in self.ctx.lanes.all():
                try:
                    lane.drain()  # queued updates finish before their buffers go
                except BaseException as e:  # noqa: BLE001 - reported after everything is freed
                    error = error or e
            self.schedule.forget()
            for lane in self.ctx.lanes.all():
                lane.close()
        for unit in self.units:
            unit.free()
        if self.states is not None:
            self.states.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if dist.is_initialized():
            for g in self._lane_groups:  # the default group stays; ours go (NCCL: two communicators per
                if g.pg is not None:       # runtime otherwise)
                    try:
                        dist.destroy_process_group(g.pg)
                    except Exception as e:  # noqa: BLE001 - closing anyway; reported after everything is freed
                        error = error or e
            if self._own_default_group:
                dist.destroy_process_group()
                self._own_default_group = False
        if self._malloc_mode is not None:
            untune_malloc(self._malloc_mode)  # after the units and the store let their buffers go
            self._malloc_mode = None
        self.closed = True
        self.is_open = False
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if error is not None and not failed:
            raise error

    def _setup_group(self) -> comm.Group:
        """The data-parallel group (the default one), its collectives watched (watchdog.py)."""
        timeout = parse_duration(self.config.collective_timeout, "collective_timeout")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if not (dist.is_available() and dist.is_initialized()) and world > 1:  # launched by torchrun: join
            # NCCL on a GPU, bound to this process's device up front (no guess from the rank, no lazy init);
            # every collective tensor lives on that device (comm.py), so no gloo side-backend is needed
            gpu = self.device.type == "cuda"
            if gpu:  # NCCL's flight recorder, dumped when its watchdog times out, unless the user chose otherwise
                os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
                os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=timeout),
                                    **({"device_id": self.device} if gpu else {}))
            # it lives as long as the process, for the next offload.init block too: torch cannot reliably start
            # the default group again after destroying it (a rank may still connect to the old one's addresses:
            # pytorch/pytorch#119196, seen here as gloo's "Connection refused")
            atexit.register(_destroy_default_group)
        at_one = self.config.collectives_at_world_size_1
        if at_one and world == 1 and dist.is_available() and not dist.is_initialized():
            # the test mode's one-rank group: in memory (no port, no launcher), ended at close
            gpu = self.device.type == "cuda"
            dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=timeout),
                                    **({"device_id": self.device} if gpu else {}))
            self._own_default_group = True
        if not (dist.is_available() and dist.is_initialized()):
            if at_one:
                raise RuntimeError("offload.Config.collectives_at_world_size_1: this torch build has no "
                                   "torch.distributed to issue them through; set it False")
            return comm.Group(0, 1, device=self.device)
        backend = str(dist.get_backend()).lower()
        if self.device.type == "cuda" and "nccl" not in backend:
            raise RuntimeError(f"offload: the default process group uses {backend!r}, but this run computes on "
                               f"{self.device}: collectives of device tensors need NCCL. Initialize it with "
                               "torch.distributed.init_process_group('nccl', device_id=...) or let offload.init "
                               "start it (under torchrun)")
        if self.device.type == "cpu" and "gloo" not in backend:
            raise RuntimeError(f"offload: the default process group uses {backend!r}, but this run computes on "
                               "the CPU: initialize it with torch.distributed.init_process_group('gloo')")
        # a group the user created keeps its own timeout; the lanes' groups take collective_timeout
        # on NCCL the heartbeat names a stuck collective before NCCL's own watchdog aborts at the timeout
        self.watchdog = Watchdog(dist.get_rank(), dist.get_world_size(), timeout,
                                 overdue_s=0.9 * timeout if "nccl" in backend else None)
        self.agreement = Agreement(dist.get_rank(), dist.get_world_size(),
                                   parse_duration(self.config.agreement_timeout, "agreement_timeout"),
                                   self.watchdog._store, self.watchdog)
        return comm.Group(dist.get_rank(), dist.get_world_size(), watchdog=self.watchdog, device=self.device,
                          collectives_at_world_size_1=at_one)

    def _budget(self, field: str, ranks_sharing: int) -> int:
        """A budget in bytes: the setting, else the store's "auto" rule for this rank (store/budget.py: the ranks
        of a host split its memory; each GPU is its rank's own)."""
        tier = field.removesuffix("_budget")
        value = self.config.bytes_of(field)
        return resolve_budget("auto" if value is None else value, tier, ranks_sharing=ranks_sharing,
                              device=self.device if self.device.type == "cuda" else None)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def sync_grads(self) -> bool:
        return self.ctx.sync_grads

    def _check_open(self, what: str) -> None:
        if not self.is_open:
            raise RuntimeError(f"offload: {what} needs an open offload.init block (this runtime has "
                               f"{'exited' if self.closed else 'not been entered'})")

    def every_rank_calls(self, what: str) -> None:
        """At a collective entry point (state dicts, exports, checkpoints): return once every rank called it,
        or raise NotOnEveryRank within Config.agreement_timeout naming the ranks that did not (agree.py)."""
        if self.agreement is not None:
            self.agreement.meet(what)

    def quiesce(self) -> None:
        """Wait until no background work is queued and every write-behind has landed (before reading or
        replacing shards wholesale, and so rt.stats() counts every byte of the steps so far)."""
        for lane in self.ctx.lanes.all():
            lane.drain()
        if self.activations is not None:
            self.activations.drain()
        self.pipeline.drop_states_read_ahead()  # whoever quiesces may read or replace those states whole
        self.schedule.release_prefetched()  # (and the params: reads ahead issued as the updates ended)
        self.states.wait_moves()

    # ---- wrapping ---------------------------------------------------------------------------
    def _note_module(self) -> None:
        self._pending = True
        if self._generate_sync is None:  # (transformers imported inside the block: its model is being built)
            self._sync_generate()

    def _sync_generate(self) -> None:
        """With several ranks, generate() of a model of this runtime runs every rank in step (synced_gpus:
        integrations/generate_sync.py), once transformers is loaded."""
        if self._generate_sync is None and self.is_open and self.group.distributed and "transformers" in sys.modules:
            self._generate_sync = importlib.import_module("offload.integrations.generate_sync").SyncedGenerate()
            self._hooks.append(self._generate_sync)

    def stop_capturing(self) -> None:
        """From now on modules are built as plain torch ones, and this runtime is not offload's current one
        (from_pretrained, offload.AdamW over plain parameters behave as without offload); the models it wrapped
        keep working, and close() ends it as before. For a runtime one object owns (OffloadTrainer), so that it
        does not take over the rest of the process."""
        self._check_open("rt.stop_capturing")
        self.materialize_pending()
        if self._capture is not None:
            self._capture.stop()
            self._capture = None
        self._auto_wrap_hook.remove()  # it only wraps what the capture saw built
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    # See [Note: what is patched, and for how long] in docs/zero-runtime.md
    def _auto_wrap(self, module, args):
        """Every module's forward pre-hook: traced by torch.compile while nothing is pending (a flag read)."""
        if type(module).__name__ == "OptimizedModule" and "zero_grad" not in module.__dict__:
            route_compiled_zero_grad(module)  # (called before the compiled frame: eager)
        if not self._pending:
            return None
        return self._wrap_pending_before(module)

    @torch.compiler.disable(reason="offload: wrapping a model built in the block runs eagerly")
    def _wrap_pending_before(self, module) -> None:
        wrapped_before = {id(m) for m in self.models}
        self.materialize_pending()
        unit = getattr(module, "_offload_unit_obj", None)
        if unit is not None and unit.state is UnitState.SHARDED:
            unit.unshard()  # its own pre-hook was registered too late for this call
        held = next((p._offload_unit for p in module._parameters.values() if hasattr(p, "_offload_unit")), None)
        if unit is None and held is not None:
            check_call(held, module, self.schedule)  # likewise its inside-unit check (a submodule called first)
        if (self.activations is not None and id(module) not in wrapped_before
                and any(module is m for m in self.models)):
            self.activations.enter(module)  # likewise (only a model wrapped now); its forward hook runs at the end
        return None

    def materialize_pending(self) -> list[nn.Module]:
        """Wrap every model built inside the block that is not wrapped yet."""
        self._pending = False
        if self._capture is None:
            return []
        self._capture.forget_dead()  # (a module built in every forward, a loss: the scan stays as long as what lives)
        metas = [p for r in self._capture.modules for m in [r()] if m is not None
                 for p in m._parameters.values() if p is not None and p.device.type == "meta"
                 and not hasattr(p, "_offload_unit")]
        roots = self._capture.roots_holding(metas) if metas else []
        for root in roots:
            self.wrap(root)
        return roots

    def wrap(self, model: nn.Module, weights=None) -> nn.Module:
        """Shard `model` into units (in place) and return it. Models built inside the block are materialized
        unit by unit; an existing model keeps its values (rank 0's, broadcast). `weights(name, meta_param)`,
        when given, returns each parameter's value as its unit is sharded (streamed loading, e.g.
        offload.integrations.hf_model_dir.SafetensorsWeights)."""
        self._check_open("rt.wrap")
        if getattr(model, "_offload_runtime", None) is self:
            refuse_unmanaged(model)  # e.g. PEFT's adapters added to a sharded model
            if weights is not None:
                raise RuntimeError("rt.wrap(model, weights=...): the model is already sharded; pass weights on "
                                   "the first wrap, before its first forward or offload.AdamW(model.parameters())")
            return model
        placed = place_model(self, model)
        self._take_placement(placed.placement)
        wrapped = shard_model(self, model, placed, self._adopt_unit, weights)
        self._ordinal_base += wrapped.parameters
        self._hooks.extend(wrapped.hooks)
        model._offload_runtime = self
        self.models.append(model)
        self.attach_activation_offload(model)
        self._sync_generate()
        return model

    def _take_placement(self, place: placement.Placement) -> None:
        """A wrap's placement (wrap.py): the tiers, staging and gathers ahead the runtime works with from now."""
        self.placement = place
        self.states.set_staging_slot(place.staging_slot)  # before the new shards' first staging buffers
        self.params_tier, self.optimizer_tier = place.tiers.params.value, place.tiers.optimizer.value
        self.grads_tier = place.tiers.grads.value
        self.schedule.gather_ahead = place.gather_ahead

    def _adopt_unit(self, unit: ShardedUnit) -> None:
        """A unit a wrap built joins the run (before it is first gathered)."""
        self.units.append(unit)
        self.schedule.units[unit.uid] = unit

    def attach_activation_offload(self, model: nn.Module) -> None:
        """Config.activations: the saved-tensor hooks are open while `model`'s forward runs (wrap calls this)."""
        if self.activations is None:
            return
        enter = torch.compiler.disable(lambda module, _: self.activations.enter(module),
                                       reason="offload: the saved-tensor hooks open eagerly")
        leave = torch.compiler.disable(lambda *_: self.activations.exit(), reason="offload: and close eagerly")
        self._hooks.append(model.register_forward_pre_hook(enter, prepend=True))
        self._hooks.append(model.register_forward_hook(leave, always_call=True))

    def _lanes_host_bytes(self) -> int:
        """cpu-tier bytes the lanes must always find free (their working set and read-ahead): what offloaded
        activations, freed only in the backward, may never take."""
        plan = self.schedule.plan
        if plan is not None:  # what the plan left the lanes (the rest: residents and the activations' share)
            return plan.lanes_bytes
        working, params_ahead, states_ahead = self._reserve_bytes()
        params_paged = any(u.shards.tiers.params is Tier.NVME for u in self.units)  # else read ahead to the device
        return working.total + (params_ahead if params_paged else 0) + states_ahead

    def _holds_parameter_bytes(self, t: torch.Tensor) -> bool:
        """`t` is (a view of) a unit's gathered parameters: it comes back by the unit's own gather."""
        storage = t.untyped_storage()._cdata
        return any(u.flat.untyped_storage()._cdata == storage for u in self.units)

    def _reserve_bytes(self) -> tuple[placement.WorkingSet, int, int]:
        """(cpu bytes the lanes may hold at once to make progress, bytes of param reads worth holding ahead,
        bytes of optimizer states worth reading ahead of the chunk being stepped)."""
        if not self.units:
            return placement.WorkingSet(0, 0, 0), 0, 0
        working = placement.host_working_set(
            [[c.numel for c in u.shards.chunks] for u in self.units], self.compute_dtype.itemsize,
            any(u.shards.tiers.params is Tier.NVME for u in self.units),
            any(u.shards.tiers.optimizer is Tier.NVME for u in self.units),
            any(u.shards.tiers.grads is Tier.NVME for u in self.units), len(self.sized_schema.states))
        largest = max(sum(self.states.staged_nbytes(u.shards.spec(StateKind.PARAM, c)) for c in u.shards.chunks)
                      for u in self.units)
        # read ahead: the next unit's param chunks and the one after; the optimizer's next chunks
        return working, 2 * largest, (placement.PIPELINE_CHUNKS - 1) * working.step

    # ---- the step: update/step.py's UpdatePath owns it; these are its public face ------------
    def _step(self, what: str) -> UpdatePath:
        self._check_open(what)
        return self.updates

    @property
    def grad_scale(self) -> float:
        return self.updates.grad_scale

    @property
    def loss_scale(self) -> LossScale:
        return self.updates.loss_scale

    @property
    def backward_updates(self) -> BackwardUpdates:
        return self.updates.backward_updates

    def no_sync(self):
        """Backward passes in here accumulate gradients locally; the next backward outside reduces once."""
        return self._step("rt.no_sync").no_sync()

    def accumulating(self):
        """Backward passes in here are not their step's last (UpdatePath.accumulating)."""
        return self._step("rt.accumulating").accumulating()

    def flush_grads(self) -> None:
        self.updates.flush_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every shard on every rank; the optimizer's next step scales gradients
        by min(1, max_norm / (norm + 1e-6)) inside its fused update (as torch.nn.utils.clip_grad_norm_)."""
        return self._step("rt.clip_grad_norm_").clip_grad_norm_(max_norm, norm_type)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every unit's gradient (set_to_none=False: keep zero gradients, as torch)."""
        self.updates.zero_grad(set_to_none)

    def zero_grad_params(self, params, set_to_none: bool = True) -> None:
        """Clear the gradients of `params` only (UpdatePath.zero_grad_params)."""
        self.updates.zero_grad_params(params, set_to_none)

    def live_optimizers(self) -> list:
        """The offload optimizers over this runtime still alive, in creation order."""
        return self.updates.live_optimizers()

    def forget_failed_updates(self) -> None:
        """Before rt.load_checkpoint replaces every state (UpdatePath.forget_failed_updates)."""
        self.updates.forget_failed_updates()

    def _after_step(self) -> None:
        """After each optimizer step: an "auto" device budget is fitted to what the first step left free."""
        if self._fit_device_budget and self.device_fit is None:
            later = max(0, self.gathered_bound() - self.ctx.counters.peak_gathered_bytes)  # (gathers ahead)
            self.device_fit = fit_device_budget(self.device, self.states.store, self.group, self._local_ranks, later)
            self.budgets["device"] = self.device_fit.budget_after

    # ---- checkpoints (checkpoint.py) ---------------------------------------------------------
    def save_checkpoint(self, root, extra: dict | None = None, lr_scheduler=None, keep_last: int | None = None,
                        tag: str | None = None, add_files=None):
        """Save a resumable checkpoint under `root` (ROOT/step-N, then ROOT/latest): this rank's fp32 master
        and Adam moments, every optimizer's step counts and hyper-parameters, `lr_scheduler`'s state (one or a
        list), RNG states and the JSON `extra` (e.g. the data cursor). Atomic; `keep_last` prunes older ones;
        `add_files(dir)` puts auxiliary files (config.json, a tokenizer) in it. Collective: every rank calls it,
        between steps."""
        self._check_open("rt.save_checkpoint")
        self.every_rank_calls("rt.save_checkpoint()")
        self.backward_updates.check_quiet("rt.save_checkpoint")
        from .checkpoint import save_checkpoint

        with self.meter.waiting(Queue.CHECKPOINT):
            return save_checkpoint(self, root, extra, _as_list(lr_scheduler), keep_last, tag, add_files)

    def load_checkpoint(self, root, lr_scheduler=None) -> dict:
        """Load the checkpoint `root/latest` names (or the checkpoint directory `root`) into this run, once the
        model, the optimizer(s) and `lr_scheduler` exist; returns the saved `extra`. Verifies checksums and
        shapes before writing anything; loads from another world size or placement. Collective."""
        self._check_open("rt.load_checkpoint")
        self.every_rank_calls("rt.load_checkpoint()")
        self.materialize_pending()
        from .checkpoint import load_checkpoint

        with self.meter.waiting(Queue.CHECKPOINT):
            return load_checkpoint(self, root, _as_list(lr_scheduler))

    # ---- inspection -------------------------------------------------------------------------
    def iter_full_params(self, model: nn.Module | None = None, trainable_only: bool = False):
        """(qualified name, fp32 host tensor) for every parameter of `model` (default: every wrapped model),
        unit by unit: saving a large model holds one unit at a time. trainable_only: the units that train (LoRA's
        adapters, without gathering the frozen base). Collective: call on every rank."""
        return self._full_params(model, trainable_only, "rt.iter_full_params()")

    def _full_params(self, model: nn.Module | None, trainable_only: bool, what: str):
        self._check_open(what)
        self.every_rank_calls(what)  # before anything collective (materializing may broadcast)
        self.materialize_pending()  # a model built in the block and not used yet: its parameters are meta so far
        self.backward_updates.check_quiet("rt.full_state_dict")  # values of a step that may yet clip are not the model's
        self.quiesce()  # every queued update is in the values read below
        from .units.state_dict import gather_full

        models = [model] if model is not None else self.models
        for m in models:
            names = {}
            for mod_name, mod in m.named_modules(remove_duplicate=False):
                for attr in mod._parameters:
                    names.setdefault((id(mod), attr), []).append(f"{mod_name}.{attr}" if mod_name else attr)
            inside = {id(x) for x in m.modules()}
            for unit in self.units:
                if id(unit.module) not in inside or (trainable_only and not unit.layout.trainable):
                    continue
                full = gather_full(self, unit)
                for slot in unit.layout.slots:
                    value = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
                    for mod, attr in slot.refs:
                        for fqn in names.get((id(mod), attr), []):
                            yield fqn, value
                del full

    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Every parameter (fp32 master values, gathered from all ranks) and persistent buffer, by qualified name,
        on the host (what plain model.load_state_dict takes). Collective: call on every rank."""
        from .units.state_dict import persistent_buffers

        self._check_open("rt.full_state_dict")
        out = dict(self._full_params(model, False, "rt.full_state_dict()"))
        for m in [model] if model is not None else self.models:
            for name, buf in persistent_buffers(m):
                out[name] = buf.detach().to("cpu").clone()
        return out

    # See [Note: the gathered bound] in docs/zero-runtime.md
    def gathered_bound(self) -> int:
        """Stated bound on gathered bytes: root + persistent units + the largest other unit, twice when the
        next unit is gathered while one runs (placement.gather_ahead)."""
        width = self.compute_dtype.itemsize
        sizes = [placement.UnitSize(u.index, u.name, "", u.layout,
                                    u.name == "" or u.module in self.models or u.persistent) for u in self.units]
        return placement.gathered_bound(sizes, width, self.schedule.gather_ahead and self.config.pipeline)

    @property
    def gathered_bytes(self) -> int:
        return self.ctx.counters.gathered_bytes

    @property
    def peak_gathered_bytes(self) -> int:
        return self.ctx.counters.peak_gathered_bytes

    def stats(self) -> dict:
        """Cumulative counters since the block opened, and the last step's split (rt.stats()["last_step"])."""
        s = self.states.stats()
        c = self.ctx.counters
        return {
            "nvme_read_bytes": s["moved"][Link.NVME_TO_CPU.value],
            "nvme_written_bytes": s["moved"][Link.CPU_TO_NVME.value],
            "host_to_device_bytes": s["moved"][Link.CPU_TO_DEVICE.value],
            "device_to_host_bytes": s["moved"][Link.DEVICE_TO_CPU.value],
            "allgather_bytes": c.allgather_bytes,
            "reduce_scatter_bytes": c.reduce_scatter_bytes,
            "gather_copy_bytes": c.gather_copy_bytes,
            "peak_resident_bytes": {t: s[t]["peak_bytes"] for t in ("device", "cpu", "nvme")},
            "budgets": {t: s[t]["capacity"] for t in ("device", "cpu", "nvme")},
            "peak_gathered_bytes": c.peak_gathered_bytes,
            "gathered_bound_bytes": self.gathered_bound(),
            "peak_rss_bytes": peak_rss_bytes(),
            "params_tier": self.params_tier,
            "optimizer_tier": self.optimizer_tier,
            "grads_tier": self.grads_tier,
            "resident_bytes": sum(self._resident_sizes()),
            "plans_made": self.schedule.plans_made,
            "gathers_backed_off": self.schedule.gathers_backed_off,
            "steps": self.step_stats.steps,
            "last_step": self.step_stats.last,
            "memory": self._memory(s),
            "activations": self.activations.report() if self.activations is not None else None,
            "speculation": self.backward_updates.speculation.report(),
            "loss_scale": self.loss_scale.report(),
            "communicators_device_bytes": sum(self.communicators_device_bytes.values()),  # (collectives/warm.py)
            "communicators_device_bytes_by_group": dict(self.communicators_device_bytes),
            "compute_dtype": {"dtype": self.config.compute_dtype, "auto": self._auto_compute_dtype,
                              "why": self.compute_dtype_reason},
        }

    def _memory(self, store_stats: dict) -> dict:
        """Where this process's host memory is: the resident set now and at open, what each budget holds now and
        at its peak, what it holds them for (`held`: per tier, shards homed there and working copies of shards
        homed below, by state class, the copies a move is using, and `other`: staging no shard holds), the
        gathered units, and outside_budgets_bytes = RSS growth since open not explained by the host budgets even
        at their peak (the cpu tier; on a machine without a GPU the device tier too, a region of host memory):
        full gradients and their casts, reduce buffers, activations, allocator caches (with the host pool, its
        `cached_bytes`: freed blocks kept for reuse); `pinned`: the cpu tier's arena, how much of it is locked
        and on which NUMA node its pages are (TieredStore.pinned); and `device_budget_fit`: an "auto" device
        budget fitted after the first step (device_budget_fit.py), None before it or with a budget given."""
        host_tiers = ("cpu",) if self.device.type == "cuda" else ("cpu", "device")
        rss = rss_bytes()
        explained = sum(store_stats[t]["peak_bytes"] for t in host_tiers)
        return {
            "rss_bytes": rss,
            "rss_at_open_bytes": self._rss_at_open,
            "budgets_in_use_bytes": {t: store_stats[t]["bytes_in_use"] for t in ("device", "cpu", "nvme")},
            "budgets_peak_bytes": {t: store_stats[t]["peak_bytes"] for t in ("device", "cpu", "nvme")},
            "held": self.states.store.held(),
            "host_budget_tiers": host_tiers,
            "gathered_bytes": self.gathered_bytes,
            "outside_budgets_bytes": max(0, rss - self._rss_at_open - explained),
            "malloc_mode": self._malloc_mode,
            "host_pool": host_pool.stats() if self._malloc_mode == "pool" else None,
            "pinned": self.states.store.pinned(),
            "device_budget_fit": dataclasses.asdict(self.device_fit) if self.device_fit is not None else None,
        }

    def _resident_sizes(self):
        keys = self.states.resident_keys()
        for u in self.units:
            for kind in u.shards.kinds():
                for c in u.shards.chunks:
                    spec = u.shards.spec(kind, c)
                    if spec.key in keys:
                        yield spec.nbytes


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
