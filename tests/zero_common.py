"""Shared by tests/test_zero_*.py and the multi-rank worker: tiny models, a plain-PyTorch reference
training loop, the same loop through offload.init, and the per-step comparison.

Compared at every step: the loss (averaged over ranks) and every parameter (gathered fp32 values) against
the reference, as the relative error ||a - b|| / ||b|| per tensor.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The per-unit bench's model (benchmarks/bench_scale.py's Stack), so the cost tests count what the bench times: the
# benchmarks folder joins sys.path for the whole test session, as test_gpu_scale.py's import of gpu_scale does.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_scale import Stack as LinearStack  # noqa: E402

VOCAB, DIM, SEQ, MICRO = 32, 16, 8, 2  # MICRO: samples per rank per micro-batch


class Attention(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has no gradient in theory: Adam amplifies noise
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, ckpt_mlp=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.unused = nn.Linear(d, d)  # an unused branch: never called, so never gets a gradient
        self.register_buffer("gain", torch.linspace(0.9, 1.1, d))  # a buffer used in forward
        self.ckpt_mlp = ckpt_mlp

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        h = checkpoint(self.mlp, h, use_reentrant=False) if self.ckpt_mlp else self.mlp(h)
        return (x + h) * self.gain


def trained_stack(dim: int, units: int, x: torch.Tensor, steps: int):
    """A LinearStack (seed 0) and its offload.AdamW (lr 1e-3), inside the open runtime, trained `steps` steps on
    `x`: the first step traces and plans, the later ones follow the plan. Returns (model, opt)."""
    import offload

    torch.manual_seed(0)
    model = LinearStack(dim, units)
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


class TinyTransformer(nn.Module):
    """Tied embeddings, a frozen layer, a buffer, an unused branch, activation checkpointing (inside block
    0's MLP, and around the whole of block 1)."""

    def __init__(self, vocab=VOCAB, d=DIM, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.layers = nn.ModuleList([Block(d, ckpt_mlp=(i == 0)) for i in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids, skip=()):
        h = self.emb(ids)
        h = h + 0.5 * self.frozen(h)
        for i, layer in enumerate(self.layers):
            if i in skip:  # another branch: this block does not run in this step
                continue
            h = checkpoint(layer, h, use_reentrant=False) if i == 1 else layer(h)
        return self.head(self.ln_f(h))


def make_llama(tie=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM * 2, intermediate_size=DIM * 4, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def make_model(kind: str) -> nn.Module:
    if kind == "tiny":
        return TinyTransformer()
    if kind == "tiny-wide":  # fp32 params that do not all stay resident in a small cpu budget: they page too
        model = TinyTransformer(d=64)
        nn.init.normal_(model.emb.weight, std=0.25)  # (unit-variance rows of 64 would make the tied head an
        return model  # identity with a loss of 0)
    if kind == "llama":
        return make_llama()
    if kind.startswith("llama-ckpt"):  # HF's own activation checkpointing around every decoder layer
        model = make_llama()
        kwargs = {"use_reentrant": kind.endswith("reentrant")}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
        return model
    raise ValueError(kind)


def token_ids(seed: int, n: int = 2) -> torch.Tensor:
    """n sequences of SEQ random tokens, from `seed`."""
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def compute_loss(model, ids, kind, skip=()):
    if kind.startswith("llama"):
        return model(input_ids=ids, labels=ids).loss.float()
    logits = model(ids, skip=skip) if skip else model(ids)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids.reshape(-1))


def param_groups(named):
    """Two groups as in most fine-tuning scripts: weight decay on matrices, none on vectors."""
    named = [(n, p) for n, p in named if p.requires_grad]
    return [
        {"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


@dataclasses.dataclass
class Case:
    params: str = "cpu"
    optimizer: str = "cpu"
    grads: str = "auto"  # "auto": nvme-homed optimizer states leave their gradients in the 256MiB device budget
    world: int = 1
    accum: int = 1
    dtype: str = "fp32"
    model: str = "tiny"
    no_sync: bool = True  # accumulate locally under rt.no_sync(), reduce once (else reduce every micro-batch)
    steps: int = 10
    clip: float | None = 0.5  # None: no clipping and no norm taken, so nothing waits for the reduces before step
    cpu_budget: str = "256MiB"  # "128KiB": too small to keep any nvme-homed state resident: every state pages
    lr: float = 3e-3
    delay: str = ""  # injected into the pipelined run, as OFFLOAD_INJECT_DELAY ("nvme_read=0.005")
    # Parameters are compared every this many steps (and after the last). Taking them waits for every queued
    # update, so the delay cases take them only at the end: nothing drains the queues between steps, and a
    # missing wait shows in the next step's loss (compared at every step) or in the final values.
    snapshot_every: int = 1
    # Control flow that changes between steps (the runtime must notice, re-trace and stay exact):
    #   "skip"   block 1 does not run on odd steps     "accum"  step s runs 1 + s % accum micro-batches
    #   "eval"   a forward under no_grad (its loss compared too) before every step after the first
    #   "skipstep" steps s % 3 == 1 end after the backward with zero_grad() and no opt.step() (a skipped step)
    #   "lateeval" a forward under no_grad between every backward after the first and its opt.step()
    flow: str = ""
    # clip only at steps s % 3 == 2 (max norm `clip`), never at the others (max norm 1e9: coefficient exactly 1):
    # speculative updates commit, miss and resume (offload/zero/update/speculation.py)
    clip_some: bool = False
    chunk_size: str | None = None  # Config.chunk_size
    update_in_backward: bool = False  # Config.update_in_backward (offload_run only)
    reduce_dtype: str = "fp32"  # Config.reduce_dtype: "bf16" sums each rank's gradient rounded to bf16
    family: str = "adamw"  # the optimizer: adamw, adamw8bit or lion (offload's class; Config.optimizer_states)
    # dtype "fp16" trains through a loss scaler (offload.GradScaler; the reference: torch.amp.GradScaler) whose
    # first scale overflows the tiny model's fp16 gradients at some steps and whose growth makes them overflow
    # again later: steps are skipped, speculative updates voided, and clipping fires at others
    scaler_init: float = 2.0 ** 20
    scaler_growth_interval: int = 2
    # Config.compute_through_device_tier: a CPU run's gathers page through the device tier as a GPU run's do
    device_tier: bool = False
    # Config.collectives_at_world_size_1: one rank issues every collective through a one-rank group, as 8 would
    collectives_at_one: bool = False

    @property
    def name(self) -> str:
        sync = "nosync" if self.no_sync else "reduce-each"
        return (f"{self.model}-{self.dtype}-p_{self.params}-o_{self.optimizer}"
                f"{'-g_' + self.grads if self.grads != 'auto' else ''}-w{self.world}-acc{self.accum}"
                f"{'-' + sync if self.accum > 1 else ''}{'-noclip' if self.clip is None or self.clip >= 1e9 else ''}"
                f"{'-clipsome' if self.clip_some else ''}{'-chunk' + self.chunk_size if self.chunk_size else ''}"
                f"{'-cpu' + self.cpu_budget if self.cpu_budget != '256MiB' else ''}"
                f"{'-flow_' + self.flow if self.flow else ''}"
                f"{'-update_in_backward' if self.update_in_backward else ''}"
                f"{'-reduce_' + self.reduce_dtype if self.reduce_dtype != 'fp32' else ''}"
                f"{'-' + self.family if self.family != 'adamw' else ''}"
                f"{'-slow_' + self.delay.replace('=', '') if self.delay else ''}"
                f"{'-device_tier' if self.device_tier else ''}"
                f"{'-collectives_at_one' if self.collectives_at_one else ''}")


def max_norm(case: Case, s: int) -> float:
    """The clip threshold of the s-th clipped step."""
    return case.clip if not case.clip_some or s % 3 == 2 else 1e9


def optimizer_class(case: Case, reference: bool = False):
    """The case's offload optimizer class; for the fp32 reference of AdamW, torch's own."""
    import offload

    if case.family == "adamw":
        return torch.optim.AdamW if reference and case.dtype == "fp32" else offload.AdamW
    return {"adamw8bit": offload.AdamW8bit, "lion": offload.Lion}[case.family]


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _data(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, VOCAB, (case.steps, case.accum, case.world * MICRO, SEQ), generator=g)


@dataclasses.dataclass(frozen=True)
class StepFlow:
    micro: int  # micro-batches
    skip: tuple  # blocks that do not run
    evaluate: bool  # a forward under no_grad before the step's first
    late_eval: bool  # a forward under no_grad between the backward and opt.step()
    no_step: bool  # the step ends with zero_grad(), without opt.step()


def step_flow(case: Case, s: int) -> StepFlow:
    return StepFlow(micro=1 + s % case.accum if case.flow == "accum" else case.accum,
                    skip=(1,) if case.flow == "skip" and s % 2 else (),
                    evaluate=case.flow == "eval" and s > 0,
                    late_eval=case.flow == "lateeval" and s > 0,
                    no_step=case.flow == "skipstep" and s % 3 == 1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.float().norm().item()
    diff = (a.float() - b.float()).norm().item()
    return diff / denom if denom > 0 else diff


def _clip(params, case: Case, norms: list) -> float:
    """torch.nn.utils.clip_grad_norm_(params, case.clip); with Config.update_in_backward, the gradients are
    scaled by the previous step's coefficient instead (its stated bound; the first step is exact). Returns
    this step's norm."""
    if not case.update_in_backward or not norms:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm(case, len(norms))))
    norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))  # (coefficient min(1, inf) = 1: unscaled)
    previous = torch.clamp(case.clip / (torch.tensor(norms[-1], dtype=torch.float32) + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:  # (an unused parameter has none)
            p.grad.mul_(previous)  # as clip_grad_norm_ scales
    return norm


def _scaler(case: Case, reference: bool):
    """fp16: the loss scaler of the case (torch's for the reference, offload's for the runtime); else None."""
    if case.dtype != "fp16":
        return None
    import offload

    kw = dict(init_scale=case.scaler_init, growth_interval=case.scaler_growth_interval)
    return torch.amp.GradScaler("cpu", **kw) if reference else offload.GradScaler(**kw)


def _norm_record(norm) -> float:
    """A clip's norm as recorded: -1.0 where the gradients overflowed (inf or NaN: that step is skipped)."""
    norm = float(norm)
    return norm if math.isfinite(norm) else -1.0


def reference_run(case: Case, model: nn.Module, data: torch.Tensor, device: torch.device = torch.device("cpu")):
    """Plain PyTorch on `device`. fp32: full-batch micro-batches, torch.optim.AdamW. bf16 / fp16: a bf16 / fp16 model
    whose grads go to fp32 master params on the host (stepped by plain offload.AdamW, see below), with the same
    per-rank split and the same fp32 reduction order as the runtime, i.e. the same casts; fp16 with
    torch.amp.GradScaler over the master. Snapshots on the host."""
    losses, snaps, norms = [], {}, []
    data = data.to(device)
    W = case.world
    if case.flow and (case.dtype != "fp32" or not case.model.startswith("tiny")):
        raise ValueError("control-flow cases run an fp32 tiny model")
    if case.dtype == "fp32":
        model = model.to(device)
        opt = optimizer_class(case, reference=True)(param_groups(model.named_parameters()), lr=case.lr)
        for s in range(case.steps):
            flow = step_flow(case, s)
            if flow.evaluate:
                with torch.no_grad():
                    losses.append(compute_loss(model, data[s, 0], case.model).item())
            total = 0.0
            for k in range(flow.micro):
                loss = compute_loss(model, data[s, k], case.model, flow.skip) / flow.micro
                loss.backward()
                total += loss.item()
            if flow.late_eval:
                with torch.no_grad():
                    losses.append(compute_loss(model, data[s, 0], case.model).item())
            if not flow.no_step:
                if case.clip is not None:
                    norms.append(_clip([p for p in model.parameters() if p.requires_grad], case, norms))
                opt.step()
            opt.zero_grad()
            losses.append(total)
            snaps[s] = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        return losses, snaps, norms
    master = {n: nn.Parameter(p.detach().to("cpu", copy=True)) for n, p in model.named_parameters()}  # fp32 init
    model = model.to(device, torch.bfloat16 if case.dtype == "bf16" else torch.float16)
    named = [(n, p) for n, p in model.named_parameters()]
    # The fp32 master steps with offload.AdamW (plain, unsharded: the fused kernel, itself tested against
    # torch.optim.AdamW in test_adam*): a 1-ulp difference in a master value can flip its bf16 copy, and
    # over 10 steps Adam grows such flips far past any tolerance that would still catch a runtime bug.
    import offload

    opt = optimizer_class(case)(param_groups(list(master.items())), lr=case.lr)
    scaler = _scaler(case, reference=True)
    trainable = [n for n, p in named if p.requires_grad]
    A = case.accum
    for s in range(case.steps):
        total = 0.0
        acc = {n: None for n in trainable}  # the reduced fp32 grad shard (all shards: world-size free)
        local = [{n: None for n in trainable} for _ in range(W)]
        for k in range(A):
            per_rank = []
            for r in range(W):
                loss = compute_loss(model, data[s, k, r * MICRO:(r + 1) * MICRO], case.model) / A
                (loss if scaler is None else scaler.scale(loss)).backward()
                total += loss.item() / W
                per_rank.append({n: p.grad.float() for n, p in named if p.grad is not None})
                model.zero_grad(set_to_none=True)
            if case.no_sync and k < A - 1:
                for r in range(W):
                    for n, g in per_rank[r].items():
                        local[r][n] = g.clone() if local[r][n] is None else local[r][n].add_(g)
                continue
            for r in range(W):  # fold what no_sync kept, as the runtime does
                for n, g in per_rank[r].items():
                    if local[r][n] is not None:
                        per_rank[r][n] = local[r][n].add_(g)
                        local[r][n] = None
            low = torch.bfloat16 if case.reduce_dtype == "bf16" and W > 1 else torch.float32
            for n in per_rank[0]:  # the runtime's reduce: each rank's gradient in reduce_dtype, summed, / W
                red = per_rank[0][n].to(low, copy=True)
                for r in range(1, W):
                    red += per_rank[r][n].to(low)
                red = (red / W).float().cpu()
                acc[n] = red if acc[n] is None else acc[n].add_(red)
        for n in trainable:
            master[n].grad = acc[n]
        if scaler is not None:
            scaler.unscale_(opt)  # (the master's grads: fp32)
        if case.clip is not None:
            norms.append(_norm_record(_clip([master[n] for n in trainable], case, norms)))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in named:
                p.copy_(master[n])
        losses.append(total)
        snaps[s] = {n: master[n].detach().clone() for n in master}
        if scaler is not None:  # compared with the parameters: the same steps overflowed
            snaps[s]["loss_scale"] = torch.tensor(scaler.get_scale())
    return losses, snaps, norms


def offload_run(case: Case, model: nn.Module, data: torch.Tensor, nvme_dir: str, pipeline: bool = True):
    import offload

    rank, world = _rank_world()
    assert world == case.world, (world, case.world)
    cfg = offload.Config(params=case.params, optimizer=case.optimizer, grads=case.grads, compute_dtype=case.dtype,
                         nvme_path=nvme_dir if "nvme" in (case.params, case.optimizer, case.grads) else None,
                         device_budget="256MiB", cpu_budget=case.cpu_budget, pipeline=pipeline,
                         update_in_backward=case.update_in_backward, reduce_dtype=case.reduce_dtype,
                         optimizer_states=case.family, chunk_size=case.chunk_size,
                         compute_through_device_tier=case.device_tier,
                         collectives_at_world_size_1=case.collectives_at_one)
    losses, snaps, norms = [], {}, []
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    with offload.init(cfg) as rt:
        data = data.to(rt.device)
        rt.wrap(model)
        opt = optimizer_class(case)(param_groups(model.named_parameters()), lr=case.lr)
        scaler = _scaler(case, reference=False)

        def evaluate(s):
            with torch.no_grad():
                seen = compute_loss(model, data[s, 0, mine], case.model).detach()
            if world > 1:
                dist.all_reduce(seen)
            losses.append(seen.item() / world)

        for s in range(case.steps):
            flow = step_flow(case, s)
            if flow.evaluate:
                evaluate(s)
            total = torch.zeros((), device=rt.device)
            for k in range(flow.micro):
                ctx = contextlib.nullcontext()
                if k < flow.micro - 1:  # a micro-batch before the step's last
                    ctx = rt.no_sync() if case.no_sync else rt.accumulating()
                with ctx:
                    loss = compute_loss(model, data[s, k, mine], case.model, flow.skip) / flow.micro
                    (loss if scaler is None else scaler.scale(loss)).backward()
                total += loss.detach()
            if flow.late_eval:
                evaluate(s)
            if not flow.no_step:
                if scaler is not None:
                    scaler.unscale_(opt)
                if case.clip is not None:
                    norms.append(_norm_record(rt.clip_grad_norm_(max_norm(case, len(norms)))))
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
            opt.zero_grad()
            if world > 1:
                dist.all_reduce(total)
            losses.append(total.item() / world)
            if (s + 1) % case.snapshot_every == 0 or s == case.steps - 1:
                snaps[s] = rt.full_state_dict(model)  # waits for every queued update: not every step
                if scaler is not None:
                    snaps[s]["loss_scale"] = torch.tensor(scaler.get_scale())
        stats = rt.stats()
    return losses, snaps, norms, stats


def run_case(case: Case, nvme_dir: str) -> dict:
    """Both loops from the same init and data; the worst relative errors over all steps and tensors."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra intra-op threads only contend for the CI's 2 cores
    try:
        return _run_case(case, nvme_dir)
    finally:
        torch.set_num_threads(threads)


def _injected(spec: str):
    """inject.delay for each QUEUE=SECONDS of `spec` (the OFFLOAD_INJECT_DELAY syntax)."""
    from offload import inject
    from offload.telemetry import Queue

    stack = contextlib.ExitStack()
    for item in filter(None, spec.split(",")):
        queue, _, seconds = item.partition("=")
        stack.enter_context(inject.delay(Queue(queue), float(seconds)))
    return stack


def _bitwise_mismatches(a, b) -> int:
    """Tensors (or floats) of two runs' per-step records that are not bit-for-bit equal."""
    (a_losses, a_snaps, a_norms), (b_losses, b_snaps, b_norms) = a, b
    bad = sum(x != y for x, y in zip(a_losses + a_norms, b_losses + b_norms))
    assert a_snaps.keys() == b_snaps.keys()
    for k in a_snaps:
        bad += sum(not torch.equal(a_snaps[k][n], b_snaps[k][n]) for n in a_snaps[k])
    return int(bad)


def _run_case(case: Case, nvme_dir: str) -> dict:
    torch.manual_seed(1234)
    ref = make_model(case.model)
    model = copy.deepcopy(ref)
    sync_model = copy.deepcopy(ref)
    data = _data(case)
    r_losses, r_snaps, r_norms = reference_run(case, ref, data)
    # The synchronous runtime (every move waited where it is asked for) is the reference the pipelined one
    # must match bit for bit, also with one queue made slow: a missing wait shows as a difference.
    s_losses, s_snaps, s_norms, _ = offload_run(case, sync_model, data, nvme_dir, pipeline=False)
    with _injected(case.delay):
        o_losses, o_snaps, o_norms, stats = offload_run(case, model, data, nvme_dir, pipeline=True)
    mismatches = _bitwise_mismatches((o_losses, o_snaps, o_norms), (s_losses, s_snaps, s_norms))
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(o_losses, r_losses))
    norm_err = max((abs(a - b) / abs(b) for a, b in zip(o_norms, r_norms)), default=0.0)
    param_err, worst = worst_param_error(o_snaps, r_snaps)
    first, last = r_snaps[0], r_snaps[case.steps - 1]
    init_change = max(_rel(last[n], first[n]) for n in last)  # training really moved the params
    return {"case": case.name, "steps": stats["steps"], "loss_err": loss_err, "param_err": param_err,
            "norm_err": norm_err, "worst_param": worst, "first_loss": r_losses[0], "last_loss": r_losses[-1],
            "moved": init_change, "nvme_read": stats["nvme_read_bytes"], "nvme_written": stats["nvme_written_bytes"],
            "peak_gathered": stats["peak_gathered_bytes"], "gathered_bound": stats["gathered_bound_bytes"],
            "pipeline_mismatches": mismatches, "plans_made": stats["plans_made"],
            "peak_cpu": stats["peak_resident_bytes"]["cpu"], "cpu_budget": stats["budgets"]["cpu"],
            "peak_device": stats["peak_resident_bytes"]["device"], "device_budget": stats["budgets"]["device"],
            "grads_tier": stats["grads_tier"], "h2d_bytes": stats["host_to_device_bytes"],
            "updated_in_backward": (stats["last_step"].get("clip") or {}).get("in_backward", 0),
            "skipped_steps": stats["loss_scale"]["skipped_steps"],  # fp16: steps whose gradients overflowed
            "speculation": stats["speculation"]}


def worst_param_error(ours: dict, reference: dict) -> tuple[float, str]:
    """The largest relative error of any parameter at any snapshotted step (NaN counts as worst), and its name."""
    err, worst = 0.0, ""
    for step, snap in ours.items():
        for name, value in reference[step].items():
            e = _rel(snap[name], value)
            if e > err or math.isnan(e):
                err, worst = e, name
    return err, worst


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def inblock_values_check(seed: int = 5) -> dict:
    """Build TinyTransformer inside offload.init (every rank materializes each unit itself, seeded) and
    compare the gathered values with a local, runtime-free materialization of the same units: equal only
    if every rank computed the same full values before keeping its shard."""
    import offload
    from offload.zero.units.materialize import ConstructionCapture, materialize_unit
    from offload.zero.units.discover import discover_units

    with ConstructionCapture():
        local = TinyTransformer()
    expected = {}
    for index, spec in enumerate(s for s in discover_units(local, offload.Config()) if s.params):
        for (p, refs, fqn), value in zip(spec.params, materialize_unit(local, spec.params, seed + index)):
            expected[fqn] = value
    with offload.init(offload.Config(params="cpu", optimizer="cpu", seed=seed, cpu_budget="64MiB",
                                     device_budget="64MiB")) as rt:
        model = TinyTransformer()
        rt.materialize_pending()
        got = rt.full_state_dict(model)
    worst = max((got[k] - v).abs().max().item() for k, v in expected.items())
    return {"case": "inblock", "max_abs_diff": worst, "tensors": len(expected)}


def state_dict_check(seed: int = 11) -> dict:
    """model.load_state_dict into a model built inside offload.init, then model.state_dict(), on every rank
    (both are collectives): the values must come back exactly, and a rank's state_dict must hold the full
    tensors, not its shard."""
    import offload

    torch.manual_seed(seed)
    pre = TinyTransformer()
    want = pre.state_dict()
    with offload.init(offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB",
                                     device_budget="64MiB")):
        model = TinyTransformer()
        model.load_state_dict(want)
        got = model.state_dict()
        shapes_ok = all(got[k].shape == v.shape for k, v in want.items()) and list(got) == list(want)
        worst = max((got[k] - v).abs().max().item() for k, v in want.items())
    return {"case": "state_dict", "max_abs_diff": worst, "shapes_ok": shapes_ok, "tensors": len(want)}


def one_torch_thread():
    """Body of a fixture: torch ops on one thread (the 2-core CI box runs the grid side by side)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def slow_backward_steps(cfg, step, steps: int, update_s: float, layers: int = 8, block_s: float = 0.03):
    """FSDP2-style overlap runs: a TinyTransformer of `layers` blocks whose backward each sleeps `block_s` (compute
    the cores are free for), every optimizer lane item `update_s` slow, trained `steps` steps under `cfg` with
    step(rt, model, opt, s). ([seconds of each step after the second], rt.stats() after a quiesce): callers compare
    the fastest step of two runs, which a burst of other load on a shared machine cannot raise unless it hits
    every step of a run."""
    import time

    import offload
    from offload import inject
    from offload.telemetry import Queue

    torch.manual_seed(0)
    model = TinyTransformer(layers=layers)
    for block in model.layers:
        block.register_full_backward_hook(lambda *_: time.sleep(block_s))
    times = []
    with offload.init(cfg) as rt:
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        with inject.delay(Queue.OPTIMIZER, update_s):
            for s in range(steps):
                t0 = time.perf_counter()
                step(rt, model, opt, s)
                times.append(time.perf_counter() - t0)
        rt.quiesce()
        stats = rt.stats()
    return times[2:], stats


def small_config(**kw):
    """A cpu/cpu offload.Config with budgets that fit the tiny test models."""
    import offload

    kw.setdefault("params", "cpu")
    kw.setdefault("optimizer", "cpu")
    kw.setdefault("device_budget", "64MiB")
    kw.setdefault("cpu_budget", "256MiB")
    return offload.Config(**kw)


def run_rank_script(code: str, tmp_path, nproc: int = 2, timeout: float = 600, same_collectives: bool = True,
                    torchrun: bool = False):
    """`code` as a script run by `nproc` ranks of one gloo group (one thread per rank), launched as torchrun would
    (tests/rank_launch.py) or, with torchrun=True, by torchrun itself; asserts it exited 0 and, unless
    same_collectives=False (a test that makes the ranks differ on purpose), that every rank issued the same
    collectives (tests/rank_sequences.py). Returns the CompletedProcess (stdout, stderr as text)."""
    import os
    import subprocess
    import sys

    import rank_launch
    import rank_sequences

    prefix = str(tmp_path / "collectives")
    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "ranks.py"
    script.write_text(f"import sys as _sys; _sys.path.insert(0, {tests!r}); import rank_sequences as _rs; "
                      f"_rs.record({prefix!r})\n" + code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if torchrun:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                              str(nproc), str(script)], capture_output=True, text=True, timeout=timeout, env=env)
    else:
        out = rank_launch.launch([str(script)], nproc, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    if same_collectives:
        rank_sequences.assert_same_sequences(prefix, nproc)
    return out
