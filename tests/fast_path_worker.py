"""Two-rank worker for tests/test_fast_path.py, launched by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fast_path_worker.py OUT DRAIN_DELAY_S

Trains a 4-block transformer whose shards span several chunks, synchronously (Config.pipeline=False, the
reference) and pipelined with every reduce's drain slowed by DRAIN_DELAY_S in the last step, whose spans it records
(telemetry's trace) with the collectives issued in it. Writes OUT.RANK (JSON): the launches of the last step in
issue order, the spans' ends per work, both runs' counters and whether their results are equal bit for bit.
"""
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rank_sequences  # noqa: E402
from zero_common import TinyTransformer, compute_loss, token_ids  # noqa: E402

import offload  # noqa: E402
from offload import inject, telemetry  # noqa: E402
from offload.telemetry import Queue  # noqa: E402
from offload.zero.collectives import comm  # noqa: E402

STEPS = 3


def train(pipeline: bool, drain_delay_s: float, rank: int) -> dict:
    torch.manual_seed(0)
    model = TinyTransformer(d=64, layers=4)
    cfg = offload.Config(params="cpu", optimizer="cpu", device_budget="256MiB", cpu_budget="256MiB",
                         chunk_size="8KiB", pipeline=pipeline)
    losses, launches, spans = [], [], []
    with offload.init(cfg) as rt:
        rt.wrap(model)
        chunks = {u.name: len(u.shards.chunks) for u in rt.units}
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for s in range(STEPS):
            last = s == STEPS - 1
            with contextlib.ExitStack() as stack:
                if last:  # the plan is made (first step traced); this step's launches and spans are recorded
                    stack.enter_context(inject.delay(Queue.REDUCE_DRAIN, drain_delay_s))
                    recorder = stack.enter_context(comm.recording())
                    telemetry.start_trace()
                ids = token_ids(100 * s + rank)
                loss = compute_loss(model, ids, "tiny")
                loss.backward()
                opt.step()  # waits for every drain (the gradients are read)
                opt.zero_grad()
                if last:
                    spans = telemetry.stop_trace()
                    launches = [[op, what] for (_, op, _, _), what in zip(recorder.entries, recorder.whats)]
            losses.append(loss.item())
        state = {k: v.clone() for k, v in rt.full_state_dict(model).items()}
        stats = rt.stats()
    return {"losses": losses, "state": state, "chunks": chunks, "launches": launches,
            "spans": [[e["name"], e["tid"], e["ts"], e["ts"] + e["dur"]] for e in spans],
            "gather_copy_bytes": stats["gather_copy_bytes"], "allgather_bytes": stats["allgather_bytes"]}


def main() -> int:
    out_path, drain_delay_s = sys.argv[1], float(sys.argv[2])
    rank_sequences.record(out_path + ".collectives")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    reference = train(pipeline=False, drain_delay_s=0.0, rank=rank)
    piped = train(pipeline=True, drain_delay_s=drain_delay_s, rank=rank)
    equal = reference["losses"] == piped["losses"] and all(
        torch.equal(reference["state"][k], piped["state"][k]) for k in reference["state"])
    result = {"rank": rank, "bitwise_equal": equal, "chunks": piped["chunks"],
              "launches": piped["launches"], "spans": piped["spans"], "world": dist.get_world_size(),
              "copies": {name: {"gather_copy_bytes": r["gather_copy_bytes"], "allgather_bytes": r["allgather_bytes"]}
                         for name, r in (("synchronous", reference), ("pipelined", piped))}}
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
