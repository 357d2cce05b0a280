"""A covering design over a list of test configurations: the fewest (by cost) that still put every pair of axis
values that any configuration of the list has together into at least one chosen configuration.

The parity grid's full list (every tier pair x accumulation x dtype x ... at each world size) is larger than CI's
2 cores can run in its share of 20 minutes; an all-pairs cover of it keeps every two-way interaction the list
tests (a bug needing one tier pair with one queue slowed, or bf16 with 3 ranks, still runs) and drops only
repeats of pairs already run. Choosing among the listed configurations, never composing new ones, keeps every
constraint the list encodes (no clipping for bf16 on 2 ranks, control flow in fp32 only, ...).
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import Callable, Hashable, Sequence, TypeVar

T = TypeVar("T")


def pairs_of(axes: dict[str, Hashable]) -> set[tuple]:
    """Every pair of (axis, value) of one configuration, in a fixed axis order."""
    items = sorted(axes.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def all_pairs_cover(items: Sequence[T], axes_of: Callable[[T], dict], cost_of: Callable[[T], float],
                    keep: Callable[[T], bool] = lambda item: False) -> list[T]:
    """The items `keep` names plus, chosen greedily by new pairs covered per unit of cost (ties: the earlier
    item), items until every pair of axis values found in `items` is covered, less the picks that turned out
    redundant. Returned in `items`' order."""
    wanted = set().union(*(pairs_of(axes_of(i)) for i in items))
    chosen = {id(i) for i in items if keep(i)}
    for i in items:
        if id(i) in chosen:
            wanted -= pairs_of(axes_of(i))
    candidates = [(i, pairs_of(axes_of(i)), cost_of(i)) for i in items if id(i) not in chosen]
    while wanted:
        best, best_gain = None, 0.0
        for item, pairs, cost in candidates:
            if id(item) in chosen:
                continue
            gain = len(pairs & wanted) / cost
            if gain > best_gain:
                best, best_gain = (item, pairs), gain
        item, pairs = best  # (never None: every wanted pair came from some item)
        chosen.add(id(item))
        wanted -= pairs
    # Greedy picks can make earlier ones redundant: drop those whose every pair another pick holds, dearest first
    picked = [(i, pairs_of(axes_of(i)), cost_of(i)) for i in items if id(i) in chosen]
    held = Counter(p for _, pairs, _ in picked for p in pairs)
    for item, pairs, _ in sorted(picked, key=lambda entry: -entry[2]):
        if not keep(item) and all(held[p] > 1 for p in pairs):
            chosen.discard(id(item))
            held.subtract(pairs)
    return [i for i in items if id(i) in chosen]
