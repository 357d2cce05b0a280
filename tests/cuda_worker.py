"""One rank of a multi-GPU test, started by cuda_common.launch_ranks (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
in its environment, one process per rank):

    python tests/cuda_worker.py SPEC.json

SPEC["mode"]:
  parity      this process starts NCCL itself (as a user script would: the runtime then joins that group) and runs
              SPEC["cases"] through cuda_common.device_run_case (sync, pipelined, plain torch).
  train       offload.init starts NCCL itself (WORLD_SIZE > 1): SPEC["steps"] steps of a model; reports the
              device, the losses (mean over ranks), which GPUs hold a context of this process, and rank 0's
              profiler trace when SPEC["profile"].
  checkpoint  offload.init starts NCCL: train SPEC["steps"] steps then rt.save_checkpoint(SPEC["save"]); or, with
              SPEC["load"], load it and save what was loaded to SPEC["save"] at once (resharding checks).
Every rank writes SPEC["out"].rank{RANK}.json; any exception goes there too, and the exit status is 1.
"""
import contextlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cuda_common as cc  # noqa: E402
from zero_common import MICRO, SEQ, VOCAB, Case, TinyTransformer, compute_loss, param_groups  # noqa: E402


def _contexts(own: int) -> dict:
    """{ordinal: primary context active} for every visible GPU, and the caching allocator's bytes on the others."""
    n = torch.cuda.device_count()
    active = {d: cc.primary_context_active(d) for d in range(n)}  # before anything below could touch a device
    other_bytes = {d: torch.cuda.memory_allocated(d) for d in range(n) if d != own}
    return {"active": active, "other_allocated": other_bytes}


def _parity(spec: dict, rank: int) -> dict:
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    results = []
    for fields in spec["cases"]:
        against = fields.pop("against_torch", True)
        case = Case(**fields)
        try:
            results.append(cc.device_run_case(case, spec["nvme"], against_torch=against))
        except Exception:  # noqa: BLE001 - reported to the test with the traceback
            results.append({"case": case.name, "error": traceback.format_exc()})
    dist.destroy_process_group()
    return {"results": results, "contexts": _contexts(local)}


def _config(spec: dict):
    import offload

    return offload.Config(params=spec.get("params", "cpu"), optimizer=spec.get("optimizer", "cpu"),
                          nvme_path=spec.get("nvme"), compute_dtype=spec.get("compute_dtype", "fp32"),
                          cpu_budget=spec.get("cpu_budget", "256MiB"), device_budget=spec.get("device_budget", "1GiB"),
                          collective_timeout=spec.get("collective_timeout", "120s"), seed=7)


def _batch(spec: dict, step: int, rank: int, device) -> torch.Tensor:
    if spec.get("model", "tiny") == "mlp":  # made on the GPU: no input copy in a profile
        g = torch.Generator(device=device).manual_seed(1000 * step + rank)
        return torch.randn(spec.get("tokens", 8192), spec.get("dim", 1024), device=device, generator=g)
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g).to(device)


def _model(spec: dict):
    torch.manual_seed(3)
    if spec.get("model", "tiny") == "mlp":
        return cc.MLPStack(spec.get("dim", 1024), spec.get("ff", 4096), spec.get("layers", 6))
    return TinyTransformer(layers=spec.get("layers", 2))


def _loss(spec: dict, model, x):
    return cc.mlp_loss(model, x) if spec.get("model", "tiny") == "mlp" else compute_loss(model, x, "tiny")


def _steps(spec: dict, rt, model, opt, first: int, last: int) -> list:
    """Steps [first, last): forward, backward, clip, step; the loss averaged over ranks (read at the end)."""
    losses = []
    batches = [_batch(spec, s, rt.rank, rt.device) for s in range(first, last)]  # made before: no copies in the trace
    for x in batches:
        loss = _loss(spec, model, x)
        loss.backward()
        rt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    out = torch.stack(losses) if losses else torch.zeros(0, device=rt.device)
    if rt.world_size > 1:
        dist.all_reduce(out)
    return (out / rt.world_size).tolist()


def _train(spec: dict, rank: int) -> dict:
    import offload

    with offload.init(_config(spec)) as rt:
        model = rt.wrap(_model(spec))
        opt = offload.AdamW(param_groups(model.named_parameters()), lr=1e-3)
        steps = spec.get("steps", 5)
        profiled = bool(spec.get("profile"))
        first = 1 if profiled else 0  # the first step traces and plans: not profiled
        # every rank makes the same calls (each _steps all-reduces its losses); only rank 0 records a profile
        losses = _steps(spec, rt, model, opt, 0, first) if first else []
        trace = f"{spec['out']}.rank{rank}.trace.json" if profiled and rt.rank == 0 else None
        if trace:
            from torch.profiler import ProfilerActivity, profile

            recorder = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        else:
            recorder = contextlib.nullcontext()
        with recorder as prof:
            losses += _steps(spec, rt, model, opt, first, steps)
            rt.quiesce()
            torch.cuda.synchronize()
        if trace:
            prof.export_chrome_trace(trace)
        rt.quiesce()
        device = str(rt.device)
        own = rt.device.index
        contexts = _contexts(own)
        stats = rt.stats()
    return {"device": device, "device_count": torch.cuda.device_count(), "losses": losses, "contexts": contexts,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "trace": trace,
            "allgather_bytes": stats["allgather_bytes"], "reduce_scatter_bytes": stats["reduce_scatter_bytes"]}


def _checkpoint(spec: dict, rank: int) -> dict:
    import offload

    with offload.init(_config(spec)) as rt:
        model = rt.wrap(_model(spec))
        opt = offload.AdamW(param_groups(model.named_parameters()), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        losses = []
        if spec.get("load"):
            extra = rt.load_checkpoint(spec["load"], lr_scheduler=sched)
        else:
            losses = _steps(spec, rt, model, opt, 0, spec.get("steps", 3))
            extra = {"next_step": spec.get("steps", 3)}
        rt.save_checkpoint(spec["save"], extra=extra, lr_scheduler=sched)
        world = rt.world_size
    return {"losses": losses, "world_size": world}


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(2)
    out = f"{spec['out']}.rank{rank}.json"
    try:
        result = {"parity": _parity, "train": _train, "checkpoint": _checkpoint}[spec["mode"]](spec, rank)
        code = 0
    except Exception:  # noqa: BLE001 - reported to the test with the traceback
        result = {"error": traceback.format_exc()}
        print(result["error"], file=sys.stderr, flush=True)
        code = 1
    with open(out, "w") as f:
        json.dump(dict(result, rank=rank), f, default=str)
    return code


if __name__ == "__main__":
    sys.exit(main())
