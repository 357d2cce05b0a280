"""The pipelined runtime beyond parity (tests/test_zero_parity.py checks it is bit for bit the synchronous one):
the work really overlaps, the cpu budget is planned (the lanes' working set first, then read-ahead, then
resident states), states that fit stay resident and stop round-tripping through the disk, and every step
reports where its time and bytes went."""
import contextlib
import json
import logging
import os
import sys
import time

import pytest
import torch

import offload
from offload import inject, telemetry
from offload.telemetry import Queue
from offload.zero.shards import StateKind

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alternated_runs import fastest_alternated  # noqa: E402
from zero_common import TinyTransformer, compute_loss, one_torch_thread, small_config, token_ids as _ids  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_torch_thread()


def _train(cfg, steps, layers=2, delays=(), seed=0):
    """Train TinyTransformer for `steps` steps under `cfg` (with `delays` injected from the second step on);
    returns (per-step seconds, losses, final values, rt.stats())."""
    torch.manual_seed(seed)
    model = TinyTransformer(layers=layers)
    times, losses = [], []
    with offload.init(cfg) as rt, contextlib.ExitStack() as slow:
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for s in range(steps):
            if s == 1:  # the first step is traced synchronously: slow from the second on
                for queue, seconds in delays:
                    slow.enter_context(inject.delay(queue, seconds))
            t0 = time.perf_counter()
            loss = compute_loss(model, _ids(s), "tiny")
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
        values = rt.full_state_dict(model)
        stats = rt.stats()
    return times, losses, values, stats


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- overlap ----------------------------------------------------------------------------------------
def test_slow_queues_overlap_instead_of_adding_up():
    """FSDP2-style overlap check: every gather, reduce and optimizer chunk is made 20 ms slow. Synchronously
    the step is their sum; pipelined, gathers run ahead of compute, reduces behind the backward and the
    optimizer's tail under the next forward. Asserted on the two runs' fastest steps from the third on (the
    second's forward waits for the first's optimizer tail, not slowed) as the time saved: at least 100 ms, five of
    the delays (measured: 150-250 ms, of a synchronous step of 390-560 ms, under load). The runs alternate and
    repeat (up to 3 each) until it holds: load that lasts a whole run can slow one and not the other
    (tests/alternated_runs.py). A gap, not a ratio (< 0.8 before, measured 0.42-0.62): a loaded machine's
    stretched compute adds to both runs alike and pulls their ratio toward 1."""
    delays = [(Queue.GATHER, 0.02), (Queue.REDUCE, 0.02), (Queue.OPTIMIZER, 0.02)]
    first = {}

    def run(pipeline):
        result = _train(small_config(pipeline=pipeline), steps=6, layers=4, delays=delays)
        first.setdefault(pipeline, result)
        return min(result[0][2:])

    fastest = fastest_alternated({"sync": lambda: run(False), "piped": lambda: run(True)},
                                 lambda t: t["sync"] - t["piped"] >= 0.1)
    sync, piped = first[False], first[True]
    assert _same(sync[2], piped[2]) and sync[1] == piped[1]  # overlapped, yet the same bits
    assert fastest["sync"] - fastest["piped"] >= 0.1, fastest
    waits = piped[3]["last_step"]["wait_s"]
    assert waits.get("gather", 0) > 0  # the training thread did wait, and says on what


def test_a_units_gradient_is_reduced_as_soon_as_its_backward_is_done():
    """The reduce of the last block is queued before backward reaches the first block (was: every reduce
    waited for the end of the backward pass, because the views' autograd split, made once at construction,
    was the oldest node and autograd runs the newest first)."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=4)
    log = []
    with offload.init(small_config()) as rt:
        rt.wrap(model)
        for unit in rt.units:
            def reduce(full_grad, unit=unit, original=unit.reduce):
                log.append(("reduce", unit.name))
                original(full_grad)
            unit.reduce = reduce
        for i, layer in enumerate(model.layers):
            layer.register_full_backward_pre_hook(lambda *a, i=i: log.append(("backward", f"layers.{i}")))
        compute_loss(model, _ids(0), "tiny").backward()
    order = [entry for entry in log if entry[1] in ("layers.3", "layers.0")]
    assert order.index(("reduce", "layers.3")) < order.index(("backward", "layers.0")), log


def test_the_next_updates_first_states_are_read_while_the_backward_computes(tmp_path):
    """Optimizer states on nvme: once the step is planned, the backward's start queues reads of the next
    update's first moment chunks on the idle optimizer lane (within the lane's share of the cpu budget), so
    they are in before opt.step(); the update then reads only the rest: no state is read twice a step. An
    optimizer state dict taken between backward and step (it reads the moments whole) gives those reads back
    first; the values stay bit for bit the synchronous run's."""
    def run(pipeline):
        cfg = small_config(params="cpu", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="160KiB",
                           pipeline=pipeline)
        torch.manual_seed(0)
        model = TinyTransformer()
        during, per_step, paged, sd = [], [], None, None
        with offload.init(cfg) as rt:
            rt.wrap(model)
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            for step in range(4):
                loss = compute_loss(model, _ids(step), "tiny")
                rt.quiesce()  # (the forward has waited for every update: only write-behinds were left)
                start = rt.stats()["nvme_read_bytes"]
                loss.backward()
                rt.ctx.lanes.optimizer.drain()  # the read-ahead queued at the backward's start has run
                rt.states.wait_moves()
                during.append(rt.stats()["nvme_read_bytes"] - start)
                if step == 2:
                    sd = opt.state_dict()
                opt.step()
                opt.zero_grad()
                rt.quiesce()
                per_step.append(rt.stats()["nvme_read_bytes"] - start)
            resident = rt.states.resident_keys()
            paged = sum(u.shards.spec(kind, c).nbytes for u in rt.units for c in u.shards.chunks
                        for kind in u.shards.schema.states
                        if u.shards.spec(kind, c).key not in resident)
            budget = rt.schedule.plan.state_budget
            values = rt.full_state_dict(model)
        return during, per_step, paged, budget, values, sd

    during, per_step, paged, budget, values, sd = run(pipeline=True)
    assert paged > 0 and budget > 0
    assert during[0] == 0  # the first step is traced, not planned
    assert 0 < during[1] <= budget and 0 < during[3] <= budget, (during, budget)
    assert during[2] == during[1]  # (the state dict came after the backward's reads)
    # every paged moment read once a step, no more; at step 2 the state dict gave the read-ahead back and read
    # the moments itself, and the update read them again
    assert per_step == [per_step[0], paged, during[2] + 2 * paged, paged], (per_step, paged, during)
    _, _, _, _, sync_values, sync_sd = run(pipeline=False)
    assert _same(values, sync_values)
    assert all(torch.equal(sd["state"][i]["exp_avg_sq"], sync_sd["state"][i]["exp_avg_sq"]) for i in sd["state"])


def test_an_update_after_the_backward_hands_its_params_to_the_next_forward_without_a_read_back(tmp_path):
    """Clipping every step, each update runs after the backward and the next forward gathers its unit right after
    it (issue 46). With params paging, the update wrote each param chunk home and the gather read it straight back
    from nvme: a write-then-read on the forward's critical path. Now the update keeps the chunk it wrote for that
    gather, within the read-ahead budget: between opt.step() and the end of the next forward, every paged param
    chunk is either read once or handed over, some are handed over, and the values stay the synchronous run's."""
    width = 256

    class Blocks(torch.nn.Module):  # 4 units of 64K params: their bf16 params (515 KiB) page in a 512 KiB budget
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                              for _ in range(4))
            self.head = torch.nn.Linear(width, 1)

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return self.head(x).float().pow(2).mean()

    def run(pipeline):
        cfg = small_config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="512KiB",
                           chunk_size="32KiB", compute_dtype="bf16", pipeline=pipeline)
        torch.manual_seed(0)
        model, windows = Blocks(), []
        batch = lambda i: torch.randn(8, width, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        with offload.init(cfg) as rt:
            rt.wrap(model)
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            loss = model(batch(0))
            for step in range(4):
                loss.backward()
                rt.clip_grad_norm_(1e-3)  # clips every step: no update runs under the backward
                handed = rt.schedule.param_bytes_handed_over
                telemetry.start_trace()
                opt.step()
                opt.zero_grad()
                loss = model(batch(step + 1))
                events = telemetry.stop_trace()
                read = sum(e.get("args", {}).get("bytes", 0) for e in events
                           if e["tid"] == "nvme read" and "/param[" in e["name"])
                resident = rt.states.resident_keys()
                paged = sum(spec.nbytes for u in rt.units for c in u.shards.chunks
                            for spec in [u.shards.spec(StateKind.PARAM, c)] if spec.key not in resident)
                windows.append((read, rt.schedule.param_bytes_handed_over - handed, paged))
            values = rt.full_state_dict(model)
        return windows, values

    windows, values = run(pipeline=True)
    for read, handed, paged in windows:
        assert paged > 0 and handed > 0 and read + handed == paged, windows  # measured: 329728 + 197632
    assert _same(values, run(pipeline=False)[1])


# ---- the cpu budget ---------------------------------------------------------------------------------
def test_the_smallest_cpu_budget_accepted_trains_and_one_page_less_is_refused(tmp_path):
    """The placement's working set (largest unit's param chunks + one chunk of every stepped state + one
    gradient chunk, page-rounded) is what the lanes may hold at once: exactly that much trains, pipelined,
    bit for bit as the synchronous runtime (no deadlock between lanes waiting for each other's buffers)."""
    working = 96 * 1024  # TinyTransformer, fp32, nvme/nvme: 16 KiB gather + 4 x 16 KiB step + 16 KiB reduce

    def cfg(budget, pipeline=True):  # gradients paged too (grads="nvme"): every lane stages in the cpu budget
        return small_config(params="nvme", optimizer="nvme", grads="nvme", nvme_path=str(tmp_path),
                            cpu_budget=budget if isinstance(budget, str) else f"{budget}B", pipeline=pipeline)

    piped = _train(cfg(working), steps=4)
    sync = _train(cfg(working, pipeline=False), steps=4)
    assert _same(piped[2], sync[2]) and piped[1] == sync[1]
    assert piped[3]["peak_resident_bytes"]["cpu"] <= working
    assert piped[3]["resident_bytes"] == 0  # no room to keep anything: every state paged every step
    with pytest.raises(MemoryError, match=r"cpu_budget: .* needs 96.00 KiB \(98304 bytes\).*only 92.00 KiB"):
        _train(cfg(working - 4096), steps=1)


def test_states_that_fit_stay_resident_and_stop_paging(tmp_path):
    """With room in the cpu budget the plan keeps nvme-homed states resident, most traffic saved per byte
    first (a bf16 param saves 3 bytes of I/O per byte, a gradient or optimizer state 2): once planned, a
    step reads and writes fewer bytes, and gradients homed on nvme no longer round-trip through the disk."""
    def cfg(budget):
        return small_config(params="nvme", optimizer="nvme", grads="nvme", nvme_path=str(tmp_path),
                            cpu_budget=budget, compute_dtype="bf16")

    tight = _train(cfg("112KiB"), steps=3)  # the working set: 7 staging slots of 16 KiB (bf16 chunks too)
    roomy = _train(cfg("8MiB"), steps=3)
    assert _same(tight[2], roomy[2])  # where a state lives never changes a result
    t, r = tight[3], roomy[3]
    assert t["resident_bytes"] == 0 and r["resident_bytes"] > 0
    per_step = {name: {link: s["last_step"]["links"].get(link, {}).get("bytes", 0)
                       for link in ("nvme->cpu", "cpu->nvme")} for name, s in (("tight", t), ("roomy", r))}
    assert per_step["tight"]["nvme->cpu"] > 0 and per_step["tight"]["cpu->nvme"] > 0
    assert per_step["roomy"]["nvme->cpu"] == per_step["roomy"]["cpu->nvme"] == 0, per_step  # it all fits


def test_params_stay_resident_first_when_only_some_states_fit(tmp_path):
    """A bf16 param saves 3 bytes of I/O per byte held (forward read, backward read, step write), a gradient
    or optimizer state 2: with room for some, every param is kept and some other state is not."""
    cfg = small_config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="160KiB",
                       compute_dtype="bf16")
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    with offload.init(cfg) as rt:
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for s in range(2):
            compute_loss(model, _ids(s), "tiny").backward()
            opt.step()
            opt.zero_grad()
        resident = rt.states.resident_keys()
        params = {(u.uid, c.index) for u in rt.units for c in u.shards.chunks}
        others = {(u.uid, kind, c.index) for u in rt.units for kind in u.shards.kinds() if kind is not StateKind.PARAM
                  for c in u.shards.chunks}
    assert {(k.unit, k.chunk) for k in resident if k.kind is StateKind.PARAM} == params
    kept_others = {(k.unit, k.kind, k.chunk) for k in resident if k.kind is not StateKind.PARAM}
    assert kept_others and kept_others < others  # some of the rest fits, not all


def test_clip_norm_comes_from_the_reduce_without_reading_gradients_back(tmp_path):
    """Gradients paged to disk: the reduce takes each piece's norm from the bytes it stores, so clipping reads
    nothing; the norm read back from the chunks (what it falls back to after accumulation) is the same."""
    cfg = small_config(params="nvme", optimizer="nvme", grads="nvme", nvme_path=str(tmp_path), cpu_budget="96KiB")
    torch.manual_seed(0)
    model = TinyTransformer()
    with offload.init(cfg) as rt:
        rt.wrap(model)
        compute_loss(model, _ids(0), "tiny").backward()
        rt.quiesce()
        read0 = rt.stats()["nvme_read_bytes"]
        cached = rt.clip_grad_norm_(1.0)
        assert rt.stats()["nvme_read_bytes"] == read0  # nothing read back
        for unit in rt.units:
            unit.grad_norms = None  # as after an accumulating reduce
        read_back = rt.clip_grad_norm_(1.0)
        assert rt.stats()["nvme_read_bytes"] > read0  # the gradient chunks came back from disk
    assert torch.equal(cached, read_back)


def test_gradients_stay_in_a_given_device_budget_instead_of_round_tripping_through_nvme(tmp_path):
    """Optimizer states on nvme: with room in a device budget the user gave, "auto" homes the gradient shards
    there, so no backward writes them to disk and no step reads them back: the run moves at least a gradient
    copy fewer each way per step after the first (with gradients on nvme every state pages here: the cpu
    budget keeps nothing resident), and the results are the same bit for bit. With device_budget "auto" (activations unknown) or no room beside the
    gathered units, they stay with the optimizer states."""
    def run(**kw):
        cfg = small_config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="96KiB", **kw)
        return _train(cfg, steps=3)

    on_device, on_nvme = run(), run(grads="nvme")
    assert on_device[3]["grads_tier"] == "device" and on_nvme[3]["grads_tier"] == "nvme"
    assert on_nvme[3]["resident_bytes"] == 0  # (the other keeps a few KiB the gradients' staging left free)
    assert _same(on_device[2], on_nvme[2]) and on_device[1] == on_nvme[1]
    grad_bytes = 4 * sum(p.numel() for p in TinyTransformer(layers=2).parameters())  # one fp32 copy, 1 rank
    for total in ("nvme_read_bytes", "nvme_written_bytes"):  # over the run (per-step windows shift with the
        saved = on_nvme[3][total] - on_device[3][total]  # write-behind): a gradient copy fewer each way from
        assert saved >= 2 * grad_bytes, (total, saved, grad_bytes)  # the second step on, at least
    assert on_device[3]["peak_resident_bytes"]["device"] <= on_device[3]["budgets"]["device"]

    assert run(device_budget="auto")[3]["grads_tier"] == "nvme"
    gathered = on_device[3]["gathered_bound_bytes"]  # root + the largest unit twice (gathered one ahead)
    short = gathered + grad_bytes - 4096  # a page short of holding the gradients beside the gathered units
    assert run(device_budget=f"{short}B")[3]["grads_tier"] == "nvme"
    with pytest.raises(MemoryError, match=r"offload.Config.grads='device': the gradient shards need .* raise "
                                          r"device_budget or set grads='auto'"):
        run(device_budget=f"{short}B", grads="device")


# ---- telemetry --------------------------------------------------------------------------------------
def test_every_step_reports_its_split_and_logs_a_line(tmp_path, caplog):
    cfg = small_config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="128KiB",
                       log_every=1)
    with caplog.at_level(logging.INFO, logger="offload"):
        _, _, _, stats = _train(cfg, steps=3)
    last = stats["last_step"]
    assert stats["steps"] == last["step"] == 3
    assert last["wall_s"] > 0 and 0 <= last["compute_s"] <= last["wall_s"]
    assert sum(last["wait_s"].values()) <= last["wall_s"] + 1e-3
    assert set(last["lane_busy_s"]) <= {"gather", "reduce", "reduce drain", "optimizer"}, last["lane_busy_s"]
    assert last["lane_busy_s"]["optimizer"] > 0
    assert last["links"]["nvme->cpu"]["bytes"] > 0  # the forward's gathers read paged params every step
    assert all(link["bytes"] > 0 and link["GBps"] > 0 for link in last["links"].values())
    assert last["occupancy"]["cpu"]["peak_bytes"] <= last["occupancy"]["cpu"]["capacity"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("offload step")]
    assert len(lines) == 3 and "compute" in lines[-1] and "nvme->cpu" in lines[-1]
    if stats["memory"]["malloc_mode"] == "pool":  # the compute device's peak (the pool's tensors of 128 KiB and
        # up: none in this tiny model; tests/test_activation_offload.py checks its values against block sizes)
        assert last["device_peak_bytes"] is not None and "device peak" in lines[-1]
    # the updates' write-behinds land in whichever step's window the optimizer lane reaches them (a slow
    # machine moves them across the boundary: once, the third step's window had none)
    assert any("cpu->nvme" in line for line in lines)


def test_chrome_trace_has_a_row_per_lane(tmp_path):
    cfg = small_config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path / "swap"), cpu_budget="128KiB")
    (tmp_path / "swap").mkdir()
    torch.manual_seed(0)
    model = TinyTransformer()
    with offload.init(cfg) as rt:
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for s in range(3):
            if s == 2:
                telemetry.start_trace()
            compute_loss(model, _ids(s), "tiny").backward()
            opt.step()
            opt.zero_grad()
        rt.quiesce()
        n = telemetry.save_trace(tmp_path / "step.json")
    events = json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert n == len(spans) > 0
    rows = {e["tid"] for e in spans}
    # (one rank launches no reduce: a unit's reduce is one piece of work on the reduce-drain lane, units/unit.py)
    assert {"main", "gather", "reduce drain", "optimizer", "nvme read", "nvme write"} <= rows, rows
    assert any(e["name"].startswith("adamw:") for e in spans)  # (the family names the optimizer lane's spans)
    assert all(e["dur"] >= 0 for e in spans)


def test_malloc_mode_follows_the_compute_device_and_refuses_bad_values(monkeypatch):
    from offload.zero.host_memory import malloc_mode

    monkeypatch.delenv("OFFLOAD_MALLOC_TUNE", raising=False)
    assert malloc_mode(torch.device("cpu")) == "pool"  # activations and gathered units are host transients
    assert malloc_mode(torch.device("cuda", 0)) == "frugal"  # host malloc holds only transients
    for value, mode in (("frugal", "frugal"), ("FAST", "fast"), ("pool", "pool"), ("0", "off"), ("off", "off")):
        monkeypatch.setenv("OFFLOAD_MALLOC_TUNE", value)
        assert malloc_mode(torch.device("cpu")) == mode
    monkeypatch.setenv("OFFLOAD_MALLOC_TUNE", "small")
    with pytest.raises(ValueError, match="OFFLOAD_MALLOC_TUNE='small': expected auto, pool, frugal, fast or off"):
        offload.init(small_config()).__enter__()
