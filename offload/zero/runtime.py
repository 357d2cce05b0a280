"""`offload.init(config)`: the ZeRO-3 runtime as a context manager.

    with offload.init(cfg) as rt:
        model = build_model()              # parameters registered as meta; materialized unit by unit
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        for batch in loader:
            loss = model(batch); loss.backward()
            rt.clip_grad_norm_(1.0)
            opt.step(); opt.zero_grad()
    # leaving the block frees every shard, removes swap files, restores nn.Module, and makes the model
    # raise a clear error when used.

Gradient accumulation: by default every backward reduce-scatters its gradient and adds this rank's shard to
the stored gradient shard (memory: one shard per unit). Inside `with rt.no_sync():` backward passes
accumulate the unsharded fp32 gradient locally (memory: the full gradient of every unit) and the first
backward outside it reduces the sum once - the DDP/FSDP pattern. `opt.step()` also reduces anything
no_sync left behind. Both give the same result as plain PyTorch.

The set of units that receive gradients must be the same on every rank (as with DDP's default), because
each reduce is a collective.
"""
from __future__ import annotations

import contextlib
import math
import os
import resource
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import Config, format_size, parse_size
from . import comm, hooks
from .layout import FlatLayout
from .materialize import ConstructionCapture, is_meta_model, materialize_unit
from .state import UnitState
from .state_dict import wrapped_load_state_dict, wrapped_state_dict
from .storage import ShardStorage, check_nvme_path
from .unit import ShardedUnit
from .units import discover_units

_ACTIVE: list["Runtime"] = []


def current() -> "Runtime | None":
    """The innermost open runtime (None outside any offload.init block)."""
    return _ACTIVE[-1] if _ACTIVE else None


def _apply_to_buffers_only(module: nn.Module, fn, recurse: bool = True):
    """Module._apply for a wrapped model: the runtime places and casts parameters (Config.compute_dtype,
    the compute device), so .to()/.cuda()/.float() reach only the buffers; parameters stay placeholders."""
    if recurse:
        for child in module.children():
            child._apply(fn)
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = fn(buf)
    return module


def _zero_grad_wrapped(module: nn.Module, set_to_none: bool = True) -> None:
    """Module.zero_grad for a wrapped model: clears the runtime's gradients of this module's parameters."""
    module._offload_runtime_ref.zero_grad_params(module.parameters(), set_to_none)


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM (per address space, so it does not inherit the parent's peak
    across fork+exec as ru_maxrss can), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _pin_mmap_threshold() -> None:
    """glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB), after
    which multi-MB staging buffers (nvme reads, gathered units) come from the heap and are kept there: RSS
    grows by several units' worth. Pinning M_MMAP_THRESHOLD at 128 KiB (glibc's initial value) disables
    that adjustment, so freed buffers go back to the OS. Process-wide; OFFLOAD_MALLOC_TUNE=0 skips it."""
    if os.environ.get("OFFLOAD_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        pass


def init(config: Config | None = None, **fields) -> "Runtime":
    """A Runtime for `config` (or Config(**fields)); use it as a context manager."""
    if config is None:
        config = Config(**fields)
    elif fields:
        raise TypeError("offload.init: give a Config or keyword fields, not both")
    return Runtime(config)


class Runtime:
    def __init__(self, config: Config):
        self.config = config
        self.units: list[ShardedUnit] = []
        self.models: list[nn.Module] = []
        self.sync_grads = True
        self.traffic = {"allgather": 0, "reduce_scatter": 0}
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.grad_scale = 1.0  # set by clip_grad_norm_, used by every optimizer's step, reset by the next backward
        self.compute_dtype = config.torch_compute_dtype
        self.params_tier = config.params
        self.optimizer_tier = config.optimizer
        self.is_open = False
        self.closed = False
        self._callback_queued = False
        self._hooks: list = []
        self._owns_pg = False
        self._capture: ConstructionCapture | None = None
        self._pending = False
        self._ordinal_base = 0
        self.storage: ShardStorage | None = None

    # ---- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> "Runtime":
        self.open()
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def open(self) -> None:
        if self.closed or self.is_open:
            raise RuntimeError("offload.init: a Runtime can be entered once")
        cfg = self.config
        self.group = self._setup_group()
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.budgets = {"device": self._budget("device_budget"), "cpu": self._budget("cpu_budget"), "nvme": None}
        run_dir = None
        if cfg.nvme_path:
            need = parse_size(cfg.nvme_budget, "nvme_budget") if cfg.nvme_budget is not None else None
            check_nvme_path(cfg.nvme_path, need, "nvme_budget")
            if need is not None:
                self.budgets["nvme"] = need
            # A fresh directory of our own: unpredictable name, created atomically with mode 0700 (never a
            # planted directory or symlink); removed when the block exits (ShardStorage.close).
            run_dir = Path(tempfile.mkdtemp(prefix=f"offload-{os.getpid()}-rank{self.group.rank}-",
                                            dir=cfg.nvme_path))
        try:
            self.storage = ShardStorage(self.device, self.budgets, run_dir, self.group.rank)
        except BaseException:
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        # the store resolved "auto" budgets (and rounded to pages): plan against what it enforces
        self.budgets = {t: self.storage.capacity(t) for t in ("device", "cpu")} | {"nvme": self.budgets["nvme"]}
        _pin_mmap_threshold()
        # a module was built: the next forward may need to materialize it
        self._capture = ConstructionCapture(on_module=self._note_module,
                                            on_load=lambda m: self.materialize_pending()).__enter__()
        self._hooks.append(nn.modules.module.register_module_forward_pre_hook(self._auto_wrap))
        self.is_open = True
        _ACTIVE.append(self)

    def close(self) -> None:
        if self.closed:
            return
        if self._capture is not None:
            self._capture.stop()
        # The units' hooks stay: after free() they raise a clear error if the model is used again.
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for unit in self.units:
            unit.free()
        if self.storage is not None:
            self.storage.close()
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        self.closed = True
        self.is_open = False
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _setup_group(self) -> comm.Group:
        if dist.is_available() and dist.is_initialized():
            return comm.Group(dist.get_rank(), dist.get_world_size())
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:  # launched by torchrun: join its group
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            self._owns_pg = True
            return comm.Group(dist.get_rank(), dist.get_world_size())
        return comm.Group(0, 1)

    def _budget(self, field: str) -> int | None:
        """A set budget in bytes; None for "auto" (the store resolves it), except that ranks sharing a host
        split the host's share between them."""
        value = self.config.bytes_of(field)
        if value is not None:
            return value
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.group.world_size)))
        if local <= 1 or (field == "device_budget" and self.device.type == "cuda"):
            return None
        from ..store import AUTO_FRACTION

        import psutil

        share = AUTO_FRACTION["cpu" if field == "cpu_budget" else "device_host"]
        return int(psutil.virtual_memory().available * share / local)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def _check_open(self, what: str) -> None:
        if not self.is_open:
            raise RuntimeError(f"offload: {what} needs an open offload.init block (this runtime has "
                               f"{'exited' if self.closed else 'not been entered'})")

    # ---- wrapping ---------------------------------------------------------------------------
    def _note_module(self) -> None:
        self._pending = True

    def _auto_wrap(self, module, args):
        if not self._pending:
            return None
        self.materialize_pending()
        unit = getattr(module, "_offload_unit_obj", None)
        if unit is not None and unit.state is UnitState.SHARDED:
            unit.unshard()  # its own pre-hook was registered too late for this call
        return None

    def materialize_pending(self) -> list[nn.Module]:
        """Wrap every model built inside the block that is not wrapped yet."""
        self._pending = False
        if self._capture is None:
            return []
        metas = [p for r in self._capture.modules for m in [r()] if m is not None
                 for p in m._parameters.values() if p is not None and p.device.type == "meta"
                 and not hasattr(p, "_offload_unit")]
        roots = self._capture.roots_holding(metas) if metas else []
        for root in roots:
            self.wrap(root)
        return roots

    def wrap(self, model: nn.Module) -> nn.Module:
        """Shard `model` into units (in place) and return it. Models built inside the block are materialized
        unit by unit; an existing model keeps its values (rank 0's, broadcast)."""
        self._check_open("rt.wrap")
        if getattr(model, "_offload_runtime", None) is self:
            return model
        cfg = self.config
        specs = [s for s in discover_units(model, cfg) if s.params]
        layouts = [FlatLayout(s.params, self.world_size) for s in specs]
        self._plan(specs, layouts)
        meta = is_meta_model(model)
        persist = parse_size(cfg.persist_threshold, "persist_threshold")
        base = len(self.units)
        ordinal = {id(p): i + self._ordinal_base for i, p in enumerate(model.parameters())}
        self._ordinal_base += len(ordinal)
        with self._capture.paused() if self._capture else contextlib.nullcontext():
            for k, (spec, layout) in enumerate(zip(specs, layouts)):
                index = base + k
                if meta:
                    values = materialize_unit(model, spec.params, cfg.seed + index)
                else:
                    values = [p.detach() for p, _, _ in spec.params]
                full = layout.flatten(values, torch.float32)
                del values
                if not meta:  # every rank must start from the same values
                    comm.broadcast_(self.group, full, 0)
                lo, hi = layout.shard_bounds(self.rank)
                shard = full[lo:hi].clone()
                del full
                key = f"u{index}"
                self.storage.create(f"{key}.param", self.params_tier, "params", init=shard.to(self.compute_dtype))
                if self.compute_dtype != torch.float32:
                    self.storage.create(f"{key}.master", self.optimizer_tier, "optim", init=shard)
                del shard
                unit = ShardedUnit(self, index, spec.name, spec.module, layout)
                for slot, (p, _, _) in zip(layout.slots, spec.params):
                    slot.ordinal = ordinal[id(p)]
                for slot, (p, _, _) in zip(layout.slots, spec.params):
                    if p.device.type != "meta":
                        torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"),
                                                                 requires_grad=p.requires_grad))
                    if hasattr(p, "_offload_initial_value"):
                        del p._offload_initial_value
                    p._offload_unit = unit
                    p._offload_slot = slot.index
                    unit.placeholders.append(p)
                    unit.views[slot.index]._offload_placeholder = p  # model.parameters() while gathered
                unit._install(unit.placeholders)
                spec.module._offload_unit_obj = unit
                self.units.append(unit)
                hooks.install(unit)
                if unit.nbytes_full <= persist:
                    unit.unshard()
                    unit.persistent = True
        # Buffers are replicated, not sharded: moved to the compute device, and floating ones cast to the
        # compute dtype (what model.to(torch.bfloat16) would do).
        for name, buf in list(model.named_buffers()):
            dtype = self.compute_dtype if buf.is_floating_point() else buf.dtype
            if buf.device != self.device or buf.dtype != dtype:
                mod_name, _, attr = name.rpartition(".")
                model.get_submodule(mod_name)._buffers[attr] = buf.to(self.device, dtype)
        for m in model.modules():  # model.to()/.cuda()/.float() must not touch the runtime's placeholders
            m._apply = types.MethodType(_apply_to_buffers_only, m)
            # the gradients live in the runtime's shards, not in the placeholders' .grad
            m.zero_grad = types.MethodType(_zero_grad_wrapped, m)
            m._offload_runtime_ref = self
            # state dicts carry real values (gathered / scattered), not the meta placeholders
            m.state_dict = types.MethodType(wrapped_state_dict, m)
            m.load_state_dict = types.MethodType(wrapped_load_state_dict, m)
        model._offload_runtime = self
        self.models.append(model)
        return model

    def _plan(self, specs, layouts) -> None:
        """Resolve "auto" tiers and refuse, before any work, what cannot fit."""
        width = self.compute_dtype.itemsize
        for spec, layout, i in zip(specs, layouts, range(len(self.units), len(self.units) + len(specs))):
            full = layout.padded_numel * width
            if full > self.budgets["device"]:
                raise MemoryError(
                    f"offload: unit {i} ({spec.name or '<root>'}, {type(spec.module).__name__}) needs "
                    f"{format_size(full)} ({full} bytes) gathered on the device, more than device_budget "
                    f"{format_size(self.budgets['device'])}; raise device_budget or cut smaller units "
                    "(Config.unit_classes / unit_min_bytes)"
                )
        shard_elems = sum(l.shard_numel for l in layouts)
        param_bytes = shard_elems * width
        opt_bytes = shard_elems * 4 * (3 + (1 if width != 4 else 0))  # exp_avg, exp_avg_sq, grad (+ master)
        biggest = max((l.padded_numel * width for l in layouts), default=0)
        # host working set while the optimizer steps the largest unit: master (or fp32 param), exp_avg,
        # exp_avg_sq, grad, and the bf16 param shard; nvme-homed ones are staged in the cpu arena
        staging = max((l.shard_numel for l in layouts), default=0) * (16 + (width if width != 4 else 0))
        cpu_free = self.budgets["cpu"] - self.storage.nbytes_in("cpu")
        gathered = self._gathered_estimate(specs, layouts)
        if self.params_tier == "auto":
            if param_bytes + max(2 * biggest, gathered) <= self.budgets["device"] - self.storage.nbytes_in("device"):
                self.params_tier = "device"
            elif param_bytes + staging <= cpu_free:
                self.params_tier = "cpu"
            else:
                self.params_tier = self._nvme_or_fail("params", param_bytes)
        if self.optimizer_tier == "auto":
            cpu_used = param_bytes if self.params_tier == "cpu" else 0
            if opt_bytes + cpu_used + staging <= cpu_free:
                self.optimizer_tier = "cpu"
            else:
                self.optimizer_tier = self._nvme_or_fail("optimizer", opt_bytes)
        if "nvme" in (self.params_tier, self.optimizer_tier) and staging > cpu_free:
            raise MemoryError(
                f"offload.Config.cpu_budget: stepping the largest unit stages {format_size(staging)} ({staging} "
                f"bytes) of nvme-homed state in host memory but only {format_size(cpu_free)} ({cpu_free} bytes) "
                "of cpu_budget is free; raise cpu_budget or cut smaller units"
            )
        nvme_need = (param_bytes if self.params_tier == "nvme" else 0) + \
                    (opt_bytes if self.optimizer_tier == "nvme" else 0)
        if nvme_need:
            if self.budgets["nvme"] is not None and nvme_need > self.budgets["nvme"]:
                raise OSError(
                    f"offload.Config.nvme_budget: the model's nvme-homed states need {format_size(nvme_need)} "
                    f"({nvme_need} bytes) on this rank but nvme_budget is {format_size(self.budgets['nvme'])} "
                    f"({self.budgets['nvme']} bytes)"
                )
            check_nvme_path(self.config.nvme_path, nvme_need, "the model's nvme-homed states")
        if self.params_tier == "device":
            # device-homed shards and the gathered units share the device: both must fit device_budget
            have = self.budgets["device"] - self.storage.nbytes_in("device")
            if param_bytes + gathered > have:
                raise MemoryError(
                    f"offload.Config.device_budget: params='device' keeps {format_size(param_bytes)} "
                    f"({param_bytes} bytes) of parameter shards on the device and gathering units needs up to "
                    f"{format_size(gathered)} ({gathered} bytes) more (root + persistent units + the largest "
                    f"unit), but only {format_size(have)} ({have} bytes) of device_budget is left; raise "
                    "device_budget or set params='cpu' / 'nvme'"
                )
        for tier, need in (("cpu", (param_bytes if self.params_tier == "cpu" else 0)
                            + (opt_bytes if self.optimizer_tier == "cpu" else 0)),):
            have = self.budgets[tier] - self.storage.nbytes_in(tier)
            if need > have:
                raise MemoryError(
                    f"offload.Config.{tier}_budget: this model's {tier}-homed states need {format_size(need)} "
                    f"({need} bytes) per rank but only {format_size(have)} of {tier}_budget is left; raise "
                    f"{tier}_budget or set params=/optimizer= to a lower tier ('cpu', 'nvme')"
                )

    def _gathered_estimate(self, specs, layouts) -> int:
        """gathered_bound() once these units join the existing ones: roots + persistent units + the largest
        other unit."""
        persist = parse_size(self.config.persist_threshold, "persist_threshold")
        width = self.compute_dtype.itemsize
        fixed, largest = 0, 0
        for u in self.units:
            if u.name == "" or u.module in self.models or u.persistent:
                fixed += u.nbytes_full
            else:
                largest = max(largest, u.nbytes_full)
        for spec, layout in zip(specs, layouts):
            full = layout.padded_numel * width
            if spec.name == "" or full <= persist:
                fixed += full
            else:
                largest = max(largest, full)
        return fixed + largest

    def _nvme_or_fail(self, what: str, nbytes: int) -> str:
        if not self.config.nvme_path:
            raise MemoryError(
                f"offload.Config.{what}='auto': {format_size(nbytes)} of {what} states fit neither device_budget "
                "nor cpu_budget and no nvme_path is set; raise a budget or give nvme_path"
            )
        return "nvme"

    # ---- hooks' callbacks -----------------------------------------------------------------
    def _account_gathered(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _on_backward_start(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self.grad_scale = 1.0  # a new backward pass: the last clip coefficient was for the last step
            # runs when the whole backward pass has finished: free what no post-backward freed
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_forward_outside_backward(self) -> None:
        """A forward outside backward while the end-of-backward callback is still marked queued: the last
        backward raised before its callback ran. Clear the mark (else no later backward queues one, and
        gathered units would leak into every step) and free what that backward left gathered."""
        if not self._callback_queued:
            return
        self._callback_queued = False
        for unit in self.units:
            if unit.state is UnitState.UNSHARDED:
                unit.reshard()

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        for unit in self.units:
            if unit.state is UnitState.UNSHARDED:
                unit.reshard()

    # ---- training-loop API ------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in here accumulate gradients locally; the next backward outside reduces once."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    def flush_grads(self) -> None:
        for unit in self.units:
            unit.flush_local_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every shard on every rank; the optimizer's next step scales gradients
        by min(1, max_norm / (norm + 1e-6)) inside its fused update (as torch.nn.utils.clip_grad_norm_)."""
        self._check_open("rt.clip_grad_norm_")
        self.flush_grads()
        # Per-parameter norms first, then the norm of those (as torch.nn.utils.clip_grad_norm_ does), so
        # one rank reproduces torch bit for bit; ranks combine their partial sums of squares.
        norms = []
        for unit in self.units:
            if not unit.has_grad:
                continue
            g = self.storage.acquire(f"{unit.key}.grad")
            for piece in unit.layout.pieces(self.rank):
                if unit.layout.slots[piece.slot].requires_grad:
                    norms.append((unit.layout.slots[piece.slot].ordinal,
                                  torch.linalg.vector_norm(g[piece.lo:piece.hi], norm_type)))
            self.storage.release(f"{unit.key}.grad", g)
            del g
        norms = [n for _, n in sorted(norms, key=lambda x: x[0])]  # model.parameters() order, as torch
        local = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros(())
        if not self.group.distributed:
            total = local
        elif math.isinf(norm_type):
            total = comm.all_reduce_(self.group, local.clone(), "max")
        else:
            total = comm.all_reduce_(self.group, local ** norm_type, "sum") ** (1.0 / norm_type)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # fp32, exactly as torch computes it
        self.grad_scale = float(coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every unit's gradient (set_to_none=False: keep zero gradients, as torch)."""
        for unit in self.units:
            unit.zero_grad(None, set_to_none)
        self.grad_scale = 1.0

    def zero_grad_params(self, params, set_to_none: bool = True) -> None:
        """Clear the gradients of `params` only (placeholders, or a gathered unit's views): what
        `module.zero_grad()` and `opt.zero_grad()` do for the parameters they hold."""
        by_unit: dict[int, tuple] = {}
        for p in params:
            p = getattr(p, "_offload_placeholder", p)
            unit = getattr(p, "_offload_unit", None)
            if unit is None or unit.rt is not self:
                continue
            by_unit.setdefault(id(unit), (unit, set()))[1].add(p._offload_slot)
        for unit, slots in by_unit.values():
            unit.zero_grad(slots, set_to_none)

    def sync_used(self) -> None:
        """OR the per-parameter 'received a gradient' flags over ranks (params with none are not stepped)."""
        if not self.units or not self.group.distributed:
            return
        flags = torch.cat([u.used.to(torch.int32) for u in self.units])
        comm.all_reduce_(self.group, flags, "max")
        offset = 0
        for u in self.units:
            n = u.used.numel()
            u.used.copy_(flags[offset:offset + n].bool())
            offset += n

    # ---- inspection -------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Every parameter (fp32 master values, gathered from all ranks) and buffer, by qualified name, on
        the host. Collective: call on every rank."""
        self._check_open("rt.full_state_dict")
        models = [model] if model is not None else self.models
        out: dict[str, torch.Tensor] = {}
        for m in models:
            names = {}
            for mod_name, mod in m.named_modules(remove_duplicate=False):
                for attr in mod._parameters:
                    names.setdefault((id(mod), attr), []).append(f"{mod_name}.{attr}" if mod_name else attr)
            for unit in self.units:
                if not any(unit.module is x for x in m.modules()):
                    continue
                key = "master" if self.compute_dtype != torch.float32 else "param"
                held = self.storage.acquire(f"{unit.key}.{key}")
                shard = held.float()  # a copy for bf16; fp32: the held tensor itself, gathered below
                full = torch.empty(unit.layout.padded_numel, dtype=torch.float32)
                comm.all_gather_into(self.group, full, shard)
                self.storage.release(f"{unit.key}.{key}", held)
                del held, shard
                for slot in unit.layout.slots:
                    value = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
                    for mod, attr in slot.refs:
                        for fqn in names.get((id(mod), attr), []):
                            out[fqn] = value
            for name, buf in m.named_buffers():
                out[name] = buf.detach().to("cpu").clone()
        return out

    def gathered_bound(self) -> int:
        """Stated bound on gathered bytes: root + persistent units + largest other unit x units in flight (1:
        a unit is freed before the next is gathered, in forward and in backward)."""
        root = [u for u in self.units if u.name == "" or u.module in self.models]
        rest = [u for u in self.units if u not in root]
        persistent = sum(u.nbytes_full for u in rest if u.persistent)
        largest = max((u.nbytes_full for u in rest if not u.persistent), default=0)
        return sum(u.nbytes_full for u in root) + persistent + largest * 1

    def stats(self) -> dict:
        s = self.storage.stats()
        return {
            "nvme_read_bytes": s["nvme_read"],
            "nvme_written_bytes": s["nvme_written"],
            "host_to_device_bytes": s["host_to_device"],
            "device_to_host_bytes": s["device_to_host"],
            "allgather_bytes": self.traffic["allgather"],
            "reduce_scatter_bytes": self.traffic["reduce_scatter"],
            "peak_resident_bytes": s["peak_resident"],
            "peak_gathered_bytes": self.peak_gathered_bytes,
            "gathered_bound_bytes": self.gathered_bound(),
            "peak_rss_bytes": peak_rss_bytes(),
            "params_tier": self.params_tier,
            "optimizer_tier": self.optimizer_tier,
        }
