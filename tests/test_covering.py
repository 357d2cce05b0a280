"""tests/covering.py: the all-pairs cover the parity grid runs instead of its full product."""
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from covering import all_pairs_cover, pairs_of  # noqa: E402


def _axes(item):
    return dict(zip("abc", item))


def test_a_product_is_covered_by_fewer_items_that_hold_every_pair():
    product = list(itertools.product(range(3), range(3), range(2)))
    chosen = all_pairs_cover(product, _axes, lambda item: 1.0)
    assert set().union(*map(pairs_of, map(_axes, chosen))) == set().union(*map(pairs_of, map(_axes, product)))
    assert len(chosen) == 9 and chosen == [i for i in product if i in chosen]  # a x b needs 9; in list order


def test_the_cheaper_of_two_alike_is_chosen_and_a_kept_one_stays():
    items = [("slow", 0, 0), ("fast", 0, 0), ("other", 1, 1)]
    axes = lambda item: {"a": item[1], "b": item[2]}  # noqa: E731
    cost = {"slow": 10.0, "fast": 1.0, "other": 1.0}
    assert all_pairs_cover(items, axes, lambda item: cost[item[0]]) == [("fast", 0, 0), ("other", 1, 1)]
    assert all_pairs_cover(items, axes, lambda item: cost[item[0]], keep=lambda item: item[0] == "slow") == \
        [("slow", 0, 0), ("other", 1, 1)]
