"""Training runs that checkpoint and resume, for test_checkpoint.py (1 process, or torchrun workers).

    python checkpoint_worker.py SPEC.json
SPEC: one run's spec, or a list of them, run in turn in this process (one launch for several runs: each starts
from its seed and a fresh runtime, so a resume restores everything from its checkpoint as in a new process).
A run's spec: {"out": file, "nvme": dir, "ckpt": dir, "steps": total steps, "save_at": [steps after which to
save], "resume": bool, "save_loaded_to": dir, "params": tier, "optimizer": tier, "compute_dtype": ...,
"keep_last": n, "accum": micro-batches per step, "save_mid_at": step to save after its first micro-batch,
"cpu_budget": the runtime's (default 64MiB: every state stays resident), "family": "adamw" | "adamw8bit",
"slow_after": [step, queue, seconds]: from that step's end (its save included) each work item of the queue
takes that long (offload/inject.py; the kill tests' slow disk or slow steps), "kind": "train" (the default) |
"streams" (save or, with "resume", load a checkpoint of an untrained model, then draw from the random streams)}
Data come from the global torch RNG (so a resume must restore it); the LR follows a warmup schedule (so a
resume must restore the scheduler); the loop position travels in `extra`. Writes the per-step losses and
the final fp32 parameters (out + ".safetensors"); each rank's collectives of the run to out + ".collectives"
(rank_sequences; compared across ranks by the test).
"""
import contextlib
import json
import os
import random
import sys
import traceback

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload  # noqa: E402
import rank_sequences  # noqa: E402
from offload import inject  # noqa: E402
from offload.telemetry import Queue  # noqa: E402
from offload.zero.collectives import comm  # noqa: E402
from zero_common import SEQ, VOCAB, TinyTransformer, param_groups, small_config  # noqa: E402


class _FrozenFirstBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64).requires_grad_(False)  # first in the flat layout, frozen
        self.b = torch.nn.Linear(64, 4)

    def forward(self, h):
        return self.b(torch.tanh(self.a(h)))


class FrozenFront(torch.nn.Module):
    """Two blocks whose first half (a frozen 64x64 layer) fills a whole rank's shard at 2 ranks: that rank
    has no Adam moments for them, the other does."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 64)
        self.blocks = torch.nn.ModuleList(_FrozenFirstBlock() for _ in range(2))
        self.head = torch.nn.Linear(4, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(sum(blk(h) for blk in self.blocks))


def main():
    specs = json.load(open(sys.argv[1]))
    torch.set_num_threads(1)
    for spec in specs if isinstance(specs, list) else [specs]:
        with comm.recording() as recorder:
            try:
                (streams if spec.get("kind") == "streams" else train)(spec)
            except Exception:
                traceback.print_exc()
                print(f"checkpoint_worker: the run writing {spec['out']} failed (above)", file=sys.stderr, flush=True)
                sys.exit(1)
            finally:  # (also after a failure: what each rank issued up to it)
                rank_sequences.write(spec["out"] + ".collectives", int(os.environ.get("RANK", "0")), recorder)


def streams(spec):
    """Each rank seeds its generators by its rank, saves (or loads) a checkpoint, and writes what it draws next."""
    import numpy as np

    with offload.init(small_config()) as rt:
        model = TinyTransformer()
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(10 + rt.rank)
        random.seed(10 + rt.rank)
        np.random.seed(10 + rt.rank)
        (rt.load_checkpoint if spec.get("resume") else rt.save_checkpoint)(spec["ckpt"])
        draws = [torch.rand(3).tolist(), random.random(), float(np.random.rand())]
        with open(f"{spec['out']}.draws-{rt.rank}.json", "w") as f:
            json.dump(draws, f)
        del opt


def train(spec):
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(100 + rank)
    cfg = offload.Config(params=spec.get("params", "nvme"), optimizer=spec.get("optimizer", "nvme"),
                         nvme_path=spec["nvme"], compute_dtype=spec.get("compute_dtype", "fp32"),
                         cpu_budget=spec.get("cpu_budget", "64MiB"), device_budget="16MiB", seed=7,
                         optimizer_states=spec.get("family", "adamw"))
    losses = {}
    with offload.init(cfg) as rt:
        model = FrozenFront() if spec.get("model") == "frozen_front" else TinyTransformer()
        family = {"adamw": offload.AdamW, "adamw8bit": offload.AdamW8bit}[spec.get("family", "adamw")]
        opt = family(param_groups(model.named_parameters()), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        start, first_micro = 0, 0
        if spec.get("resume"):
            extra = rt.load_checkpoint(spec["ckpt"], lr_scheduler=sched)
            start, first_micro = extra["next_step"], extra.get("next_micro", 0)
            if spec.get("save_loaded_to"):  # resharding checks: the loaded state, saved again as it is
                rt.save_checkpoint(spec["save_loaded_to"], extra=extra, lr_scheduler=sched)
        accum = spec.get("accum", 1)
        with contextlib.ExitStack() as slow:  # (slow_after's delay, ended with the run)
            for step in range(start, spec["steps"]):
                for micro in range(first_micro if step == start else 0, accum):
                    ids = torch.randint(0, VOCAB, (2, SEQ))
                    logits = model(ids)
                    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), ids.reshape(-1)) / accum
                    loss.backward()
                    if step == spec.get("save_mid_at") and micro == 0 and not spec.get("resume"):
                        # in the middle of the accumulation: the partial gradient is part of the checkpoint
                        rt.save_checkpoint(spec["ckpt"], extra={"next_step": step, "next_micro": 1},
                                           lr_scheduler=sched)
                        print(f"saved mid {step}", flush=True)
                rt.clip_grad_norm_(1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                losses[step] = loss.item()
                if step + 1 in spec.get("save_at", []):
                    rt.save_checkpoint(spec["ckpt"], extra={"next_step": step + 1}, lr_scheduler=sched,
                                       keep_last=spec.get("keep_last"))
                    print(f"saved {step + 1}", flush=True)
                if step + 1 == spec.get("slow_after", [None])[0]:
                    slow.enter_context(inject.delay(Queue(spec["slow_after"][1]), spec["slow_after"][2]))
        final = rt.full_state_dict(model)
    if rank == 0:
        json.dump({"losses": losses, "checkpoint_s": rt.last_checkpoint_seconds}, open(spec["out"], "w"))
        save_file({k: v.clone() for k, v in final.items()}, spec["out"] + ".safetensors")  # tied: own copies


if __name__ == "__main__":
    main()
