"""The program's own torch.distributed collectives take their place in the runtime's one order
(offload/zero/collectives/user_calls.py, issue 44): 2 gloo ranks whose lanes run at different speeds (rank 0's
gathers late, rank 1's reduces), a user all_reduce after each forward (gathers ahead in flight), one inside the
backward (a block's backward hook: reduces and the backward's gathers in flight) and a broadcast after each step.
Each rank enqueues each user call at the same place among the lanes' collectives (the recorded sequences, in
enqueue order, are equal across ranks), no hang, and the training is bit for bit the unslowed run's."""
import collections
import json
import textwrap

import rank_sequences

CODE = """
import contextlib, json, torch, torch.distributed as dist
import offload
from offload import inject
from offload.telemetry import Queue
from zero_common import TinyTransformer, compute_loss, param_groups, small_config, token_ids

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
SKEW = {0: {Queue.GATHER: 0.01}, 1: {Queue.REDUCE: 0.01}}


def train(skewed):
    torch.manual_seed(0)
    model = TinyTransformer(layers=3)
    seen = []

    def hook(*_):
        t = torch.ones(1)
        dist.all_reduce(t)
        seen.append(t.item())

    model.layers[2].register_full_backward_hook(hook)
    with offload.init(small_config()) as rt, contextlib.ExitStack() as slow:
        if skewed:
            for queue, seconds in SKEW[rank].items():
                slow.enter_context(inject.delay(queue, seconds))
        rt.wrap(model)
        opt = offload.AdamW(param_groups(model.named_parameters()), lr=1e-2)
        losses = []
        for s in range(4):
            loss = compute_loss(model, token_ids(10 * s + rank), "tiny")
            total = loss.detach().clone()
            dist.all_reduce(total)
            loss.backward()
            rt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            flag = torch.tensor([float(s + rank)])
            dist.broadcast(flag, 0)
            losses.append((total.item(), flag.item()))
        state = rt.full_state_dict(model)
    return losses, seen, state


plain, skewed = train(False), train(True)
same = plain[:2] == skewed[:2] and all(torch.equal(plain[2][k], skewed[2][k]) for k in plain[2])
with open(f"{OUT}/user{rank}.json", "w") as f:
    json.dump({"same": same, "seen": skewed[1], "losses": skewed[0]}, f)
"""


def test_user_collectives_take_their_place_in_the_order_on_two_skewed_ranks(tmp_path):
    from zero_common import run_rank_script

    run_rank_script(textwrap.dedent(CODE).replace("{OUT}", str(tmp_path)), tmp_path, timeout=600)
    for r in range(2):
        out = json.loads((tmp_path / f"user{r}.json").read_text())
        assert out["same"] and out["seen"] == [2.0] * 4, out
        assert [flag for _, flag in out["losses"]] == [0.0, 1.0, 2.0, 3.0], out  # rank 0's broadcast value
    seq = rank_sequences.load(str(tmp_path / "collectives"), 2)[0]  # (equal on both ranks: run_rank_script checked)
    user = collections.Counter(op for _, op, _, _ in seq["entries"] if op.startswith("user:"))
    assert user == {"user:all_reduce": 2 * 2 * 4, "user:broadcast": 2 * 4}, user  # two runs of 4 steps
