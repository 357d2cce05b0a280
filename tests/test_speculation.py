"""Speculative exact updates (Config.speculative_updates, offload/zero/update/speculation.py): a step that does not
clip updates its nvme-paged states under the backward, a step that clips after all is redone from the old states,
and every way a step can fail to come takes the updates back; in every case the results are those of the
path without speculation, bit for bit. The parity grid (tests/test_zero_parity.py, speculation_cases) runs the
same against plain PyTorch on 1 and 2 ranks with every queue slowed; these tests check the cases one at a time
and what rt.stats() says about them."""
import contextlib
import logging
import os
import sys

import pytest
import torch

import offload
from offload import inject
from offload.telemetry import Queue

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alternated_runs import fastest_alternated  # noqa: E402
from zero_common import TinyTransformer, compute_loss, one_torch_thread, slow_backward_steps, token_ids  # noqa: E402

NEVER = 1e9  # a max norm no gradient reaches: the clip coefficient is exactly 1.0


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_torch_thread()


def _config(nvme_path, speculate=True, **kw):
    os.makedirs(nvme_path, exist_ok=True)
    # bf16 compute, every state on nvme and a cpu budget that keeps little resident: the states page every step
    kw = dict(params="nvme", optimizer="nvme", nvme_path=str(nvme_path), cpu_budget="128KiB",
              device_budget="64MiB", compute_dtype="bf16", speculative_updates=speculate) | kw
    return offload.Config(**kw)


@contextlib.contextmanager
def _training(nvme_path, speculate=True, layers=2, **kw):
    torch.manual_seed(0)
    model = TinyTransformer(layers=layers)
    with offload.init(_config(nvme_path, speculate, **kw)) as rt:
        rt.wrap(model)
        yield rt, model, offload.AdamW(model.parameters(), lr=1e-2)


def _step(rt, model, opt, s, max_norm=NEVER, before_step=lambda: None):
    loss = compute_loss(model, token_ids(s), "tiny")
    loss.backward()
    before_step()
    rt.clip_grad_norm_(max_norm)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _run(nvme_path, speculate, steps, **kw):
    """(losses, final full state dict, rt.stats()["speculation"]) of `steps`: [(max_norm, before_step(rt, model,
    opt) or None)]."""
    with _training(nvme_path, speculate, **kw) as (rt, model, opt):
        losses = [_step(rt, model, opt, s, norm, (lambda: hook(rt, model, opt)) if hook else lambda: None)
                  for s, (norm, hook) in enumerate(steps)]
        final = rt.full_state_dict(model)
        report = rt.stats()["speculation"]
    return losses, final, report


def _assert_same(a, b):
    assert a[0] == b[0]  # every step's loss, bit for bit
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_a_step_that_clips_after_speculating_is_redone_exactly(tmp_path):
    """Three steps that do not clip (the second and third speculate and commit), one that clips (speculated, then
    redone from the old states with its coefficient), two after it (no speculation: after a miss it waits for two
    steps in a row that do not clip), and speculation resumes. Every queue a speculative update goes through is
    slowed."""
    steps = [(NEVER, None)] * 3 + [(1e-3, None)] + [(NEVER, None)] * 3
    with inject.delay(Queue.NVME_WRITE, 0.003), inject.delay(Queue.OPTIMIZER, 0.003):
        fast = _run(tmp_path / "a", True, steps)
    exact = _run(tmp_path / "b", False, steps)
    _assert_same(fast, exact)
    report = fast[2]
    assert report["steps"] == 4  # steps 1, 2, 3, 6: not 0 (nothing before it), not 4 and 5 (the miss's back-off)
    per_step = report["committed"] // 3
    assert per_step >= 1 and report["committed"] == 3 * per_step and report["missed"] == per_step, report
    assert report["commit_rate"] == pytest.approx(0.75)


def test_clipping_that_comes_and_goes_stops_the_misses(tmp_path):
    """Every other step clips: the first speculation misses, and the next would need two calm steps in a row,
    which never come, so no update is paid twice again (exact all along)."""
    steps = [(NEVER, None), (1e-3, None)] * 5
    fast = _run(tmp_path / "a", True, steps)
    exact = _run(tmp_path / "b", False, steps)
    _assert_same(fast, exact)
    report = fast[2]
    assert report["steps"] == 1 and report["committed"] == 0 and report["missed"] >= 1, report
    assert exact[2]["steps"] == 0 and not exact[2]["enabled"]


def test_speculation_waits_while_steps_clip(tmp_path):
    """A run that clips every step never speculates (no update is done twice)."""
    with _training(tmp_path) as (rt, model, opt):
        for s in range(4):
            _step(rt, model, opt, s, max_norm=1e-3)
        report = rt.stats()["speculation"]
    assert report["steps"] == report["committed"] == report["missed"] == 0 and report["commit_rate"] is None


@pytest.mark.parametrize("breach", ["state_dict", "eval_forward", "zero_grad_no_step"])
def test_taken_back_when_the_step_does_not_come_first(tmp_path, breach):
    """Between a speculating backward and its opt.step(): the optimizer's state dict (the states are read as they
    were before the step), a forward under no_grad (it reads the params as they were), or zero_grad() with no
    step at all (a skipped step). Each takes the updates back; the run stays bitwise the exact path's."""
    def hook(rt, model, opt):
        if breach == "state_dict":
            opt.state_dict()
        elif breach == "eval_forward":
            with torch.no_grad():
                compute_loss(model, token_ids(99), "tiny")
        else:
            opt.zero_grad()  # the step is skipped: clip and step below find no gradient and do nothing

    steps = [(NEVER, None), (NEVER, None), (NEVER, hook), (NEVER, None), (NEVER, None)]
    fast = _run(tmp_path / "a", True, steps)
    _assert_same(fast, _run(tmp_path / "b", False, steps))
    assert fast[2]["voided"] >= 1 and fast[2]["committed"] >= 1, fast[2]


def _accumulated_outside(tmp_path, speculate):
    """A step of one micro-batch (it arms speculation), then one of two micro-batches each reduced (no
    rt.no_sync(), no rt.accumulating()): the second forward takes the first backward's speculative updates back.
    (losses, final full state dict, rt.stats()["speculation"])."""
    with _training(tmp_path / str(speculate), speculate) as (rt, model, opt):
        losses = [_step(rt, model, opt, 0), _step(rt, model, opt, 1)]
        for k in (2, 3):
            loss = compute_loss(model, token_ids(k), "tiny") / 2
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(_step(rt, model, opt, 4))
        return losses, rt.full_state_dict(model), rt.stats()["speculation"]


def test_taken_back_by_accumulation_outside_accumulating(tmp_path):
    """A step of one micro-batch arms speculation; the next accumulates two micro-batches without
    rt.accumulating(): the second forward gathers units the first backward already updated, so those updates are
    taken back first (the params it reads are the old ones) and the step updates from scratch."""
    fast = _accumulated_outside(tmp_path, True)
    _assert_same(fast, _accumulated_outside(tmp_path, False))
    assert fast[2]["voided"] >= 1, fast[2]


def test_the_updates_overlap_a_slow_backward(tmp_path):
    """FSDP2's overlap test, for the default path: every block's backward made 30 ms slow (a sleep: compute the
    cores are free for) and each unit's update 25 ms (one chunk each). Without speculation the 9 updates wait for
    opt.step() and follow the backward (about 240 + 225 ms); with it, a step that does not clip updates under the
    backward, and only the last two reduced (block 0, the root) follow it. Asserted on the two runs' fastest steps
    after the second (the first speculating step is the second), as the time saved: at least half of the seven
    hidden updates' 175 ms, the runs alternated and repeated (up to 3 each) until it holds: load that lasts a whole
    run can slow one run and not the other (tests/alternated_runs.py). A gap, not a ratio: a loaded machine's
    stretched compute adds to both runs alike and pulls a ratio toward 1. Measured here: 190-235 ms saved."""
    reports = []

    def run(speculate):
        seconds, stats = slow_backward_steps(_config(tmp_path / str(speculate), speculate), _step, steps=8,
                                             update_s=0.025)
        if speculate:
            reports.append(stats["speculation"])
        return min(seconds)

    hidden = 7 * 0.025  # blocks 7..1's updates, each 25 ms, run under the backward
    fastest = fastest_alternated({"exact": lambda: run(False), "fast": lambda: run(True)},
                                 lambda t: t["exact"] - t["fast"] >= hidden / 2)
    for report in reports:
        assert report["steps"] == 7 and report["missed"] == 0 and report["committed"] >= 7 * 8, report
    assert fastest["exact"] - fastest["fast"] >= hidden / 2, fastest


def test_no_room_for_the_spare_slots_turns_it_off_with_one_warning(tmp_path, caplog):
    """The spare slots take nvme budget beside the states (12 bytes per speculated bf16 parameter against the
    states' 14): a budget with a little room above what the placement asks for the states turns speculation off
    at the first spare it cannot hold, says so once, and trains the same."""
    steps = [(NEVER, None)] * 4
    exact = _run(tmp_path / "a", False, steps)
    with _training(tmp_path / "b", False) as (rt, model, opt):
        _step(rt, model, opt, 0)
        states_bytes = rt.states.stats()["nvme"]["bytes_in_use"]
    with caplog.at_level(logging.WARNING, logger="offload"):
        tight = _run(tmp_path / "c", True, steps, nvme_budget=f"{int(states_bytes * 1.3)}B")  # (the placement's check
        # counts 18 bytes per parameter: the gradient's too)
    _assert_same(tight, exact)
    assert not tight[2]["enabled"]
    warnings = [r for r in caplog.records if "speculative updates are off" in r.getMessage()]
    assert len(warnings) == 1 and "nvme_budget" in warnings[0].getMessage()


def test_a_state_read_or_a_load_between_backward_and_step_sees_the_step_before(tmp_path):
    """model.state_dict() and rt.full_state_dict() between a speculating backward and its opt.step() read the
    values before the step (they read its speculated update, which a clip could still take back), and a
    checkpoint loaded there (a roll-back after a loss spike) stays loaded (the update taken back at zero_grad
    restored the states from before the load). Bitwise the exact path's."""
    ckpt = tmp_path / "ckpt"
    seen = {}

    def save(rt, model, opt):
        rt.save_checkpoint(ckpt)

    def read(rt, model, opt):
        seen.setdefault("reads", []).append((model.state_dict(), rt.full_state_dict(model)))

    def roll_back(rt, model, opt):
        rt.load_checkpoint(ckpt)
        opt.zero_grad()  # the step is dropped: clip and step below find no gradient

    steps = [(NEVER, None), (NEVER, save), (NEVER, None), (NEVER, read), (NEVER, None), (NEVER, roll_back),
             (NEVER, None), (NEVER, None)]
    fast = _run(tmp_path / "a", True, steps)
    exact = _run(tmp_path / "b", False, steps)
    _assert_same(fast, exact)
    (fast_dict, fast_full), (exact_dict, exact_full) = seen["reads"]
    assert all(torch.equal(fast_full[k], exact_full[k]) for k in exact_full)
    assert all(torch.equal(fast_dict[k], exact_dict[k]) for k in exact_dict)
    assert fast[2]["voided"] >= 2 and fast[2]["committed"] >= 1, fast[2]


def test_an_lr_changed_before_every_step_backs_speculation_off(tmp_path):
    """An LR scheduler stepped between backward and opt.step() makes every speculated update miss (other
    hyperparameters): the misses back off as a clip's do (it speculated, and paid the update twice, every step)."""
    def scheduler_first(rt, model, opt):
        for group in opt.param_groups:
            group["lr"] *= 0.9

    steps = [(NEVER, scheduler_first)] * 8
    fast = _run(tmp_path / "a", True, steps)
    _assert_same(fast, _run(tmp_path / "b", False, steps))
    assert 1 <= fast[2]["missed"] and fast[2]["steps"] <= 3, fast[2]


def test_a_tensor_lr_changed_in_place_after_the_step_changes_only_the_next_step(tmp_path):
    """torch's schedulers change a tensor lr in place; the queued update read it when it ran, so a slow optimizer
    lane took the next step's lr (4.9e-4 apart from a fast one)."""
    def run(delay):
        torch.manual_seed(0)
        model = TinyTransformer()
        with offload.init(offload.Config(params="cpu", optimizer="cpu")) as rt:
            rt.wrap(model)
            opt = offload.AdamW(model.parameters(), lr=torch.tensor(1e-2))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 10 * s))
            with inject.delay(Queue.OPTIMIZER, delay):
                for s in range(3):
                    compute_loss(model, token_ids(s), "tiny").backward()
                    opt.step()
                    sched.step()
                    opt.zero_grad()
            return rt.full_state_dict(model)

    fast, slow = run(0.0), run(0.02)
    assert all(torch.equal(fast[k], slow[k]) for k in fast)


def test_a_read_ahead_cannot_slip_between_a_take_back_and_its_slots_exchanged_back(tmp_path, monkeypatch):
    """Taking a speculative update back gives back the states read ahead of it (they hold its new bytes), then
    exchanges its slots back. A read ahead the optimizer lane started in between read the new bytes again, and
    the step redone at opt.step() applied itself on top of the speculative one (or the exchange found the read in
    flight and raised). The order is forced here: the lane's read-ahead starts 5 ms late, and the training thread
    takes 30 ms to begin exchanging back. The lane's read-ahead table stays locked from the give-back until the
    slots are back, so the read waits and reads the old bytes: bitwise the path without speculation."""
    import threading
    import time

    from offload.zero.state_store import UnitStateStore
    from offload.zero.update.optimizer_pipeline import OptimizerPipeline

    read_ahead, exchange = OptimizerPipeline._read_states_ahead, UnitStateStore.exchange

    def late_read_ahead(self, units, allowance):
        time.sleep(0.005)
        return read_ahead(self, units, allowance)

    def slow_exchange(self, spec, spare):
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.03)
        return exchange(self, spec, spare)

    exact = _accumulated_outside(tmp_path, False)
    monkeypatch.setattr(OptimizerPipeline, "_read_states_ahead", late_read_ahead)
    monkeypatch.setattr(UnitStateStore, "exchange", slow_exchange)
    with inject.delay(Queue.OPTIMIZER, 0.02):
        fast = _accumulated_outside(tmp_path, True)
    _assert_same(fast, exact)
    assert fast[2]["voided"] >= 1, fast[2]
