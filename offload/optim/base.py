"""What every offload optimizer shares: the dispatch to the runtime's sharded variant, and `SchemaOptimizer`,
a torch.optim.Optimizer that steps any `Schema` (schema.py) on in-memory CPU tensors.

`offload.AdamW8bit(params)` over ordinary CPU tensors is a SchemaOptimizer stepping each parameter as one
chunk; over the parameters of an offload runtime it becomes that runtime's sharded subclass
(offload.zero.update.optimizer registers it when the runtime is imported: the optim package does not import the
runtime), which steps each rank's shard chunk by chunk where the states live.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .schema import Schema

# base class -> [(wants(params) -> bool, subclass)]: registered by offload.zero.update.optimizer
_SHARDED: dict[type, list] = {}
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# group switches no offload optimizer runs: refused wherever a group can get them (the constructor, add_param_group,
# a group's key set after construction, a loaded state dict), checked again at every step()
UNSUPPORTED_SWITCHES = {"amsgrad": "AMSGrad", "capturable": "CUDA-graph capture",
                        "differentiable": "autograd through the step"}


def check_groups(display: str, groups, source: str = "", first: int = 0) -> None:
    """Refuse a param group with amsgrad / capturable / differentiable switched on, naming the group and key."""
    for i, group in enumerate(groups, first):
        for key, what in UNSUPPORTED_SWITCHES.items():
            if group.get(key):
                raise ValueError(f"{display}: param group {i}{source} has {key}={group[key]!r} ({what}), which it "
                                 f"does not run; set {key}=False, or use torch.optim.AdamW")


def add_checked(opt, add: Callable, param_group: dict, display: str) -> None:
    """torch's add_param_group, then the group refused (and taken out again) if it switches one of those on."""
    add(param_group)
    try:
        check_groups(display, opt.param_groups[-1:], " (added)", len(opt.param_groups) - 1)
    except ValueError:
        opt.param_groups.pop()
        raise


def register_sharded(base: type, wants: Callable, cls: type) -> None:
    """`base(params)` builds `cls` (a subclass of base) when wants(params) is true."""
    _SHARDED.setdefault(base, []).append((wants, cls))


class ShardDispatch:
    """Mixin: constructing the class itself over a runtime's parameters builds its registered sharded subclass.
    The params iterable is read once here and handed to __init__ through `_offload_params`."""

    def __new__(cls, params=None, *args, **kwargs):
        routes = _SHARDED.get(cls)
        if not routes or params is None:
            return super().__new__(cls)
        params = list(params)
        chosen = next((sub for wants, sub in routes if wants(params)), cls)
        inst = super().__new__(chosen)
        inst._offload_params = params
        return inst


def check_cpu_param(name: str, p: torch.Tensor) -> None:
    if p.device.type != "cpu":
        raise ValueError(f"{name}: a parameter is on {p.device}; this optimizer steps CPU tensors (keep params on "
                         "CPU, or use the offload runtime to shard them)")
    if p.dtype not in _PARAM_DTYPES:
        raise ValueError(f"{name}: parameter dtype {p.dtype} is not supported (float32, bfloat16, float16)")


class SchemaOptimizer(ShardDispatch, torch.optim.Optimizer):
    """A torch.optim.Optimizer over CPU tensors that steps `schema` (a class attribute): per parameter its
    `step`, the schema's stored states (shaped by their rules over the flattened parameter) and, for bf16/fp16
    parameters, an fp32 `master` the update writes back rounded into the parameter."""

    schema: Schema
    display: str = "offload optimizer"  # the name errors use ("offload.Lion")

    def __init__(self, params, defaults: dict[str, Any]):
        params = self.__dict__.pop("_offload_params", params)
        self._build(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        add_checked(self, super().add_param_group, param_group, self.display)

    def _build(self, params, defaults: dict[str, Any]) -> None:
        torch.optim.Optimizer.__init__(self, params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                check_cpu_param(self.display, p)

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        n = p.numel()
        state["step"] = torch.tensor(0.0)
        for s in self.schema.states:
            state[s.name] = torch.full((s.numel(n),), s.fill, dtype=s.dtype)
        if p.dtype != torch.float32:
            state["master"] = p.detach().reshape(-1).to(torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        check_groups(self.display, self.param_groups)  # (a key may have been set since construction)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self.display} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                self._step_param(p, state, hyper, int(state["step"].item()))
        return loss

    def _step_param(self, p: torch.Tensor, state: dict, hyper: dict, step: int) -> None:
        grad = p.grad.reshape(-1) if p.grad.is_contiguous() else p.grad.contiguous().reshape(-1)
        states = {s.name: state[s.name] for s in self.schema.states}
        scale = 1.0  # (maximize is the step function's, from hyper)
        master = state.get("master")
        flat = p.detach().reshape(-1) if p.is_contiguous() else None
        if master is None:  # fp32: the parameter is its own master
            work = flat if flat is not None else p.detach().contiguous().reshape(-1)
            self.schema.step_chunk(work, grad, states, None, 0, work.numel(), hyper, step, scale)
            if flat is None:
                p.copy_(work.view(p.shape))
            return
        self.schema.step_chunk(master, grad, states, flat, 0, master.numel(), hyper, step, scale)
        if flat is None:
            p.copy_(master.view(p.shape))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts floating states to the parameter's dtype (a bf16 parameter's fp32 master and
        scales would round): restore the saved tensors with the schema's dtypes as private contiguous copies."""
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        check_groups(self.display, saved_groups, " of the state dict")
        super().load_state_dict(state_dict)
        by_id = {pid: p for saved, group in zip(saved_groups, self.param_groups)
                 for pid, p in zip(saved["params"], group["params"])}
        for pid, saved in saved_state.items():
            p = by_id.get(pid)
            if p is None:
                continue
            st = self.state[p]
            for s in self.schema.states:
                if s.name in saved:
                    st[s.name] = saved[s.name].detach().to(device="cpu", dtype=s.dtype, copy=True).contiguous()
            if "master" in saved:
                st["master"] = saved["master"].detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
