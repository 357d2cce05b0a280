"""`offload bench pcie`: the aggregation and the all-GPU window's threading on the CPU (fake work in place of
copies); the copies themselves on a GPU (`cuda`, and `multi_gpu` for the all-at-once window)."""
from __future__ import annotations

import argparse
import json
import threading
import time

import pytest
import torch

from offload.bench import pcie

GB = 10 ** 9


def test_aggregate_is_every_byte_over_the_window_not_a_sum_of_rates():
    """Two GPUs each at 10 GB/s by their own events, one after the other in a 2 s window: together they moved
    20 GB in 2 s (10 GB/s), where summing the per-GPU rates would claim 20 GB/s."""
    per_gpu = [{"gpu": 0, "bytes": 10 * GB, "event_s": 1.0, "event_device": 0},
               {"gpu": 1, "bytes": 10 * GB, "event_s": 1.0, "event_device": 1}]
    w = pcie.window_figures(per_gpu, wall_s=2.0)
    assert w["GBps"] == pytest.approx(10.0)
    assert [g["GBps"] for g in w["per_gpu"]] == [pytest.approx(10.0)] * 2
    assert [g["event_device"] for g in w["per_gpu"]] == [0, 1]
    overlapped = pcie.window_figures(per_gpu, wall_s=1.0)  # fully at once: the aggregate is the sum
    assert overlapped["GBps"] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="positive"):
        pcie.window_figures(per_gpu, wall_s=0.0)


def _windows(n: int, size: int, rounds: int):
    def window(rate_gbps: float, wall_s: float) -> dict:
        per_gpu = [{"gpu": g, "bytes": size * rounds, "event_s": size * rounds / (rate_gbps * GB), "event_device": g}
                   for g in range(n)]
        return pcie.window_figures(per_gpu, wall_s)

    return window(20.0, n * size * rounds / (30.0 * GB)), window(15.0, n * size * rounds / (25.0 * GB))


def test_summary_keeps_the_keys_its_readers_use(tmp_path, monkeypatch, capsys):
    """The result as the planner (h2d_pinned_gbps), the plot (rows) and the CLI table (rows, all_gpus) read it:
    the planner takes the pinned H2D at the largest size, one GPU alone; the table prints the aggregate and
    each GPU's figure."""
    from offload.bench import cli
    from offload.bench.figures import bench_figures

    size, rounds = 256 << 20, 5
    rows = [{"gpu": g, "pinned": pinned, "bytes": b, "h2d_GBps": (25.0 if pinned else 9.0) + g + b / size,
             "d2h_GBps": 20.0 if pinned else 7.0, "event_devices": [g, g]}
            for g in range(2) for pinned in (True, False) for b in (size // 4, size)]
    r = pcie.summarize(["gpu a", "gpu b"], rows, {0: 40.0, 1: 41.0}, _windows(2, size, rounds), size, rounds)
    assert r["h2d_pinned_gbps"] == pytest.approx(27.0) and r["d2h_pinned_gbps"] == pytest.approx(20.0)
    assert r["all_gpus"]["h2d_GBps"] == pytest.approx(30.0) and r["all_gpus"]["d2h_GBps"] == pytest.approx(25.0)
    assert [(g["gpu"], g["event_devices"]) for g in r["all_gpus"]["per_gpu"]] == [(0, [0, 0]), (1, [1, 1])]
    assert pcie.summarize(["gpu a"], rows[:4], {0: 40.0}, None, size, rounds)["all_gpus"] == {}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"pcie": r}))
    assert bench_figures(str(path), "--bench-json")["pcie_Bps"] == pytest.approx(27.0e9)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(pcie, "pcie_bench", lambda sizes, rounds, progress: r)
    collected: dict = {}
    assert cli._cmd_pcie(argparse.Namespace(sizes=None, rounds=rounds), collected) == 0
    out = capsys.readouterr().out
    assert collected["pcie"] is r
    assert "all GPUs at once" in out and "h2d 30.00 GB/s, d2h 25.00 GB/s" in out and "1: 20.00/15.00" in out


def test_window_opens_after_every_setup_and_closes_after_the_last_work():
    """Setup (allocation, warm-up) is outside the window: no work starts before the slowest setup ends, and the
    window spans every work, the slowest included, but not the setups."""
    setup_ends, spans = {}, {}

    def setup(i):
        time.sleep(0.6 if i == 2 else 0.0)
        setup_ends[i] = time.perf_counter()
        return 0.05 * (i + 1)

    def work(i, seconds):
        t0 = time.perf_counter()
        time.sleep(seconds)
        spans[i] = (t0, time.perf_counter())
        return i

    wall, results = pcie.run_together(3, setup, work)
    returned = time.perf_counter()
    assert results == [0, 1, 2]
    assert min(s[0] for s in spans.values()) >= max(setup_ends.values())
    assert wall >= max(s[1] for s in spans.values()) - min(s[0] for s in spans.values()) >= 0.15
    assert wall <= returned - max(setup_ends.values())  # opened after the slow setup (0.6 s) ended: not in it


@pytest.mark.parametrize("where", ["setup", "work"])
def test_a_failing_thread_is_raised_and_the_others_do_not_wait_for_it(monkeypatch, where):
    monkeypatch.setattr(pcie, "WINDOW_TIMEOUT_S", 30.0)  # a hang would show as the timeout's error, not this one
    finished = []

    def setup(i):
        if where == "setup" and i == 1:
            raise RuntimeError("no memory on gpu 1")
        return i

    def work(i, state):
        if where == "work" and i == 1:
            raise RuntimeError("no memory on gpu 1")
        finished.append(i)
        return i

    with pytest.raises(RuntimeError, match="no memory on gpu 1"):
        pcie.run_together(3, setup, work)
    assert set(finished) <= ({0, 2} if where == "work" else set())  # no work starts once a setup failed
    assert not any(t.name.startswith("pcie-") for t in threading.enumerate())


def test_a_thread_that_never_arrives_times_out(monkeypatch):
    monkeypatch.setattr(pcie, "WINDOW_TIMEOUT_S", 0.2)

    def setup(i):
        time.sleep(1.0 if i == 0 else 0.0)
        return i

    with pytest.raises(RuntimeError, match="waited over"):
        pcie.run_together(2, setup, lambda i, state: i)


def test_without_cuda_there_is_nothing_to_measure():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert pcie.pcie_bench([1 << 20], 1) == {"available": False, "reason": "no CUDA device"}


# ---- on a GPU --------------------------------------------------------------------------------------

SIZE = 256 << 20


def _row(r: dict, gpu: int, pinned: bool) -> dict:
    return next(x for x in r["rows"] if x["gpu"] == gpu and x["pinned"] == pinned and x["bytes"] == SIZE)


@pytest.mark.cuda
def test_pinned_h2d_is_plausible_and_above_pageable_on_every_gpu():
    """256 MiB, every GPU alone: pinned H2D in 3-80 GB/s (PCIe 3 x16 .. 5 x16 and some headroom) and faster
    than pageable (which the driver stages through its own pinned buffer); every figure timed by events on
    its own GPU; both directions at once no more than the two alone."""
    r = pcie.pcie_bench([SIZE], rounds=5)
    assert r["available"] and len(r["devices"]) == torch.cuda.device_count()
    for gpu in range(torch.cuda.device_count()):
        pinned, pageable = _row(r, gpu, True), _row(r, gpu, False)
        assert 3.0 <= pinned["h2d_GBps"] <= 80.0, pinned
        assert pinned["h2d_GBps"] > pageable["h2d_GBps"], (pinned, pageable)
        assert pinned["event_devices"] == [gpu, gpu] and pageable["event_devices"] == [gpu, gpu]
        assert 0 < r["both_directions_GBps"][gpu] <= (pinned["h2d_GBps"] + pinned["d2h_GBps"]) * 1.05
    assert r["h2d_pinned_gbps"] == max(_row(r, g, True)["h2d_GBps"] for g in range(torch.cuda.device_count()))


@pytest.mark.cuda
def test_the_window_on_one_gpu_agrees_with_its_events():
    """The all-at-once window's code on whatever GPUs there are (one on the GPU check): each GPU's figure from
    events on its own device, the host-clock aggregate no more than the event rates' sum (the events lie inside
    the window) and, on one GPU, not far below it (the window adds only the threads' release and the sync)."""
    n = torch.cuda.device_count()
    for h2d in (True, False):
        w = pcie.all_gpus_window(n, SIZE, 5, h2d)
        assert [(g["gpu"], g["event_device"]) for g in w["per_gpu"]] == [(g, g) for g in range(n)]
        rates = sum(g["GBps"] for g in w["per_gpu"])
        assert w["GBps"] <= rates * 1.01
        if n == 1:
            assert w["GBps"] >= 0.5 * rates


@pytest.mark.cuda
@pytest.mark.multi_gpu
def test_all_gpus_at_once_is_no_more_than_the_singles_summed():
    """Every GPU at once cannot beat the GPUs one at a time summed (5% for noise): the aggregate is bytes over
    the host's wall clock of the whole window, each per-GPU figure from events on that GPU."""
    n = torch.cuda.device_count()
    r = pcie.pcie_bench([SIZE], rounds=5)
    together = r["all_gpus"]
    assert together["bytes_per_copy"] == SIZE and [g["gpu"] for g in together["per_gpu"]] == list(range(n))
    for d in ("h2d", "d2h"):
        singles = sum(_row(r, g, True)[f"{d}_GBps"] for g in range(n))
        assert 0 < together[f"{d}_GBps"] <= singles * 1.05, (d, together, singles)
        assert together[f"{d}_GBps"] <= sum(g[f"{d}_GBps"] for g in together["per_gpu"]) * 1.01
    for g in together["per_gpu"]:
        assert g["event_devices"] == [g["gpu"], g["gpu"]]
    for row in r["rows"]:
        assert row["event_devices"] == [row["gpu"], row["gpu"]]
