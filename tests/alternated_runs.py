"""Timing comparisons that other load cannot flip: two (or more) runs measured side by side, alternated, each
again until the comparison holds or the tries are spent.

An overlap test compares the fastest step of a run with a feature and of one without. Taking each run's fastest
step outlasts a burst of load, but not load that lasts a whole run: a suite's other processes, another test's disk
writes, a busy core can hit one run's every step and not the other's (test_update_in_backward's 140 ms gap once
measured 65 ms that way, under load 6). Alternating the runs and keeping each one's fastest step over all its
tries lets the hit run catch up, while a gap the feature does not make never appears: without it both runs'
fastest steps converge on the same floor.
"""
from __future__ import annotations

from typing import Callable


def fastest_alternated(runs: dict[str, Callable[[], float]], holds: Callable[[dict[str, float]], bool],
                       tries: int = 3) -> dict[str, float]:
    """{name: the fastest seconds any of its runs returned}, running each of `runs` (name -> a run returning its
    fastest step) in turn, again while `holds(fastest so far)` is false, at most `tries` rounds."""
    fastest: dict[str, float] = {}
    for _ in range(tries):
        for name, run in runs.items():
            fastest[name] = min(fastest.get(name, float("inf")), run())
        if holds(fastest):
            break
    return fastest
