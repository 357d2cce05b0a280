"""One simulated rank of a world of 8 over torch's fake process group, for tests/test_fake_world8.py:

    python tests/fake_rank_worker.py OUT_PREFIX RANK [RANK ...]

The fake group completes every collective at once without moving data (an all-gather leaves its output as it
was), so a process plays its ranks one after the other, each in a fresh group and runtime, and the test compares
what the 8 simulated ranks did: shard sizes, the device
and gathered peaks, and the recorded collective sequences. Two settings of the runtime stand aside for it, and
only here: the watchdog and the entry points' meeting (they need a real store: FakeStore has none), and the
pass check (it compares all-gathered rows, which the fake group leaves unwritten: the recorded sequences are
compared instead).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import offload  # noqa: E402
import rank_sequences  # noqa: E402
from offload.zero import runtime as runtime_module  # noqa: E402
from offload.zero.collectives import comm, divergence  # noqa: E402

WORLD = 8


def small_llama3_70b_like():
    """Llama-3-70B's proportions (8 query heads per key-value head, an MLP 3.5 times the width, untied head)
    at a width a shared CPU runs: 2 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=896, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def play(rank: int, prefix: str) -> None:
    """One simulated rank, start to end: its stats and its recorded collective sequence written under prefix."""
    os.environ["RANK"] = str(rank)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    cfg = offload.Config(params="cpu", optimizer="cpu", device_budget="256MiB", cpu_budget="256MiB")
    with comm.recording() as recorder, offload.init(cfg) as rt:
        model = small_llama3_70b_like()
        opt = offload.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        stats = rt.stats()
        out = {"units": [[u.name, u.layout.numel, u.layout.padded_numel, u.layout.shard_numel] for u in rt.units],
               "peak_device": stats["peak_resident_bytes"]["device"], "peak_gathered": stats["peak_gathered_bytes"],
               "gathered_bound": stats["gathered_bound_bytes"]}
    rank_sequences.write(prefix, rank, recorder)
    with open(f"{prefix}.stats{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def main() -> int:
    prefix, ranks = sys.argv[1], [int(r) for r in sys.argv[2:]]
    # Patched for this worker process only, for its whole life (see the module docstring): the group is built
    # from the rank being played, and the pass check stands aside.
    runtime_module.Runtime._setup_group = lambda self: comm.Group(int(os.environ["RANK"]), WORLD, device=self.device)
    divergence.check_pass = lambda group, units, where: None
    torch.set_num_threads(1)
    for rank in ranks:
        play(rank, prefix)
    return 0

if __name__ == "__main__":
    sys.exit(main())
