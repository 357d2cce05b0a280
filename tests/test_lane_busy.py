"""A lane's busy time (rt.stats()["last_step"]["lane_busy_s"]) counts each second of its work once: the optimizer
lane's kernel runs as a span inside the lane item's own, and was counted twice (the lane's busy time then read
about twice the kernel's; benchmarks/bench_scale.py compares the two)."""
from __future__ import annotations

import threading
import time

from offload.telemetry import Lane, Meter


def test_work_nested_in_the_same_lanes_work_is_counted_once():
    meter = Meter()
    with meter.working(Lane.OPTIMIZER, "lane item"):
        with meter.working(Lane.OPTIMIZER, "kernel"):
            time.sleep(0.2)
    busy = meter.snapshot().busy_s[Lane.OPTIMIZER]
    assert 0.2 <= busy < 0.35  # counted twice it reads at least 0.4


def test_work_on_other_lanes_and_threads_is_counted_for_each():
    meter = Meter()

    def other_thread():
        with meter.working(Lane.OPTIMIZER, "another thread's item"):
            time.sleep(0.2)

    with meter.working(Lane.OPTIMIZER, "item"):
        with meter.working(Lane.GATHER, "a gather inside it"):
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
    busy = meter.snapshot().busy_s
    assert busy[Lane.GATHER] >= 0.2
    assert 0.4 <= busy[Lane.OPTIMIZER] < 0.55  # this thread's item and the other thread's, each once
    with meter.working(Lane.OPTIMIZER, "after"):  # the lane counts again once its outer work is over
        time.sleep(0.02)
    assert meter.snapshot().busy_s[Lane.OPTIMIZER] >= busy[Lane.OPTIMIZER] + 0.02
