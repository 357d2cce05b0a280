"""Two ranks train; at step 2 one of them stalls in its own code (or dies). Run by test_watchdog.py.

    torchrun --nproc_per_node 2 watchdog_worker.py NVME_DIR stall|die
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload  # noqa: E402
from zero_common import SEQ, VOCAB, TinyTransformer  # noqa: E402


# every collective's limit, the start-up's included (the process group's rendezvous, the budgets' all-reduce): long
# enough for two ranks importing torch side by side on a busy 2-core machine to meet, short for the stalled one
TIMEOUT = "10s"


def main():
    nvme, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB", device_budget="16MiB",
                         collective_timeout=TIMEOUT, nvme_path=nvme)
    try:
        train(rank, mode, cfg)
    except offload.CollectiveError as exc:
        print(f"rank {rank} error at {time.time():.3f}: {exc}", flush=True)
        raise
    finally:
        print(f"rank {rank} closed at {time.time():.3f}", flush=True)


def train(rank, mode, cfg):
    with offload.init(cfg) as rt:
        model = TinyTransformer()
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for step in range(4):
            if step == 2 and rank == 1:
                print(f"rank 1 {mode}s at {time.time():.3f}", flush=True)
                if mode == "die":
                    os._exit(17)
                time.sleep(120)  # a stall in the user's own code (a data loader, a debugger)
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
            F.cross_entropy(model(ids).float().reshape(-1, VOCAB), ids.reshape(-1)).backward()
            rt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()


if __name__ == "__main__":
    main()
