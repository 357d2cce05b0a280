"""Budgets: sizes and "auto", never exceeded under random fetch/release, blocking and clear errors."""
import threading
import time

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from offload.store import (AUTO_FRACTION, ArenaFullError, StoreConfig, SwapSpaceError, TieredStore, parse_size,
                           resolve_budget)
from offload.store.budget import fit_auto_device_budget


def test_parse_size():
    assert parse_size("60GiB") == 60 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512M") == 512 << 20
    assert parse_size(" 4096B ") == 4096 and parse_size(7, counts=True) == 7  # (a bare number: tests/test_size_rule.py)
    for bare in (" 4096 ", 7):
        with pytest.raises(ValueError, match="add a unit"):
            parse_size(bare, "cpu_budget")
    for bad in ["60 gigs", "", "-1GiB", "auto"]:
        with pytest.raises(ValueError, match="cpu_budget must be a size like '60GiB'"):
            parse_size(bad, "cpu_budget")


def test_bad_budget_names_the_setting():
    with pytest.raises(ValueError, match=r"cpu_budget must be a size like '60GiB'.* got 'lots'"):
        TieredStore(StoreConfig(cpu_budget="lots", device_budget="1MiB"))
    with pytest.raises(ValueError, match=r"device_budget must be >= 0 bytes"):
        TieredStore(StoreConfig(cpu_budget="1MiB", device_budget=-5))


def test_auto_budgets_are_the_stated_fractions(tmp_path):
    avail = psutil.virtual_memory().available
    assert abs(resolve_budget("auto", "cpu") - AUTO_FRACTION["cpu"] * avail) < 0.05 * avail
    if not torch.cuda.is_available():
        assert abs(resolve_budget("auto", "device") - AUTO_FRACTION["device_host"] * avail) < 0.05 * avail
    import shutil

    free = shutil.disk_usage(tmp_path).free
    got = resolve_budget("auto", "nvme", nvme_path=str(tmp_path / "not-yet" / "created"))
    assert abs(got - AUTO_FRACTION["nvme"] * free) < 0.05 * free
    assert resolve_budget("3GiB", "device") == 3 << 30


def test_an_auto_device_budget_is_fitted_to_what_the_first_step_left_free():
    """The rule (store/budget.py): what the tier holds plus 90% of what was free at the peak, within the budget
    taken at the start, never under the tier's own peak in that step."""
    mib = 1 << 20
    fit = fit_auto_device_budget
    assert fit(1000 * mib, 100 * mib, 300 * mib, 5000 * mib) == 1000 * mib  # ample room: the budget stays
    assert fit(1000 * mib, 100 * mib, 300 * mib, 500 * mib) == 550 * mib  # activations took most: 100 + 450
    assert fit(1000 * mib, 100 * mib, 300 * mib, 100 * mib) == 300 * mib  # under the working set: its floor
    assert fit(200 * mib, 100 * mib, 300 * mib, 0) == 200 * mib  # never above the budget
    assert fit(1000 * mib, 0, 0, -5) == 0


def test_a_device_tier_limit_holds_on_the_host_device(tmp_path):
    """TieredStore.limit_device on a CPU run (the device tier a host region): the tier's capacity becomes the
    limit, a device fetch that would pass it times out, one under it goes through."""
    with TieredStore(StoreConfig(device_budget="1MiB", cpu_budget="1MiB")) as st:
        st.register("a", 40_000, torch.float32, home="cpu").result()
        st.register("b", 40_000, torch.float32, home="cpu").result()
        st.fetch("a", "device", timeout=5).result()
        assert st.limit_device(200_000) == 200_704 == st.stats()["device"]["capacity"]  # 49 pages
        with pytest.raises(ArenaFullError, match=r"timed out after 0.05s"):
            st.fetch("b", "device", timeout=0.05)  # 160 KiB in use + 160 KiB > 196 KiB
        st.release("a").result()
        st.fetch("b", "device", timeout=5).result()
        assert st.stats()["device"]["peak_bytes"] <= 1 << 20


def test_request_that_can_never_fit(tmp_path):
    with TieredStore(StoreConfig(device_budget="64KiB", cpu_budget="64KiB", nvme_budget="1MiB",
                                 nvme_path=str(tmp_path / "s"))) as st:
        with pytest.raises(ArenaFullError, match=r"shard 'big' .* can never fit in the arena's capacity of 64.00 KiB"):
            st.register("big", 20_000, torch.float32, home="cpu")
        st.register("n", 20_000, torch.float32, home="nvme").result()
        with pytest.raises(ArenaFullError, match=r"can never fit in the arena's capacity of 64.00 KiB; raise the cpu budget"):
            st.fetch("n", "cpu")
        with pytest.raises(SwapSpaceError, match=r"shard 'n2' needs 1003520 bytes of swap but the nvme budget of 1.00 MiB has 966656 bytes left"):
            st.register("n2", 1_000_000, torch.uint8, home="nvme")
        assert st.stats()["nvme"]["bytes_in_use"] == 81920  # the failed registration took nothing


def test_home_buffers_count_as_held_for_good(tmp_path):
    with TieredStore(StoreConfig(device_budget="64KiB", cpu_budget="64KiB", nvme_budget="1MiB",
                                 nvme_path=str(tmp_path / "s"), alloc_timeout=30)) as st:
        st.register("h1", 4000, torch.float32, home="cpu").result()  # 16 KiB each, for good
        st.register("h2", 4000, torch.float32, home="cpu").result()
        st.register("n", 4000, torch.float32, home="nvme").result()
        st.fetch("n", "cpu").result()  # 16 KiB more: fits beside the home buffers
        st.release("n").result()
        # a 36 KiB home shard cannot fit beside them: refused at once, not after the 30 s timeout
        with pytest.raises(ArenaFullError, match=r"shard 'h3' .* can never fit in the cpu budget of 64.00 KiB: "
                                                 r"home shards hold 32.00 KiB of it for good"):
            st.register("h3", 9000, torch.float32, home="cpu")
        st.register("big", 5000, torch.float32, home="nvme").result()
        st.register("h4", 4000, torch.float32, home="cpu").result()  # 16 KiB still fits
        with pytest.raises(ArenaFullError, match=r"shard 'big' .* home shards hold 48.00 KiB"):
            st.fetch("big", "cpu")  # a 20 KiB working copy > the 16 KiB left


def test_a_staging_slot_larger_than_what_home_buffers_leave_is_refused_at_once(tmp_path):
    """A short-lived buffer takes a whole staging slot: 16 KiB left beside 48 KiB of home buffers cannot hold a
    32 KiB slot, whatever the shard's size; it waited for room that never comes (for ever without a timeout)."""
    with TieredStore(StoreConfig(device_budget="1MiB", cpu_budget="64KiB", nvme_budget="1MiB",
                                 nvme_path=str(tmp_path / "s"), alloc_timeout=30)) as st:
        st.register("home", 12 * 1024, torch.float32, home="cpu").result()  # 48 KiB for good
        st.register("n", 1024, torch.float32, home="nvme", init=torch.ones(1024)).result()
        st.set_staging_slot(32 * 1024)
        started = time.monotonic()
        with pytest.raises(ArenaFullError, match=r"shard 'n' \(4.00 KiB, in a staging slot of 32.00 KiB\): can never "
                                                 r"fit in the cpu budget of 64.00 KiB: home shards hold 48.00 KiB"):
            st.fetch("n", "cpu")
        assert time.monotonic() - started < 20  # at once, not after the 30 s timeout


def test_the_nvme_budget_bounds_the_swap_files_and_a_reused_slot_reads_zeros(tmp_path):
    """Shards of ever new sizes registered and removed (activations whose shapes change): freed space is reused
    and merged, so the file stays within the budget (it grew to 1.64 MB under a 1 MiB budget when only slots of
    one length were reused); a shard the files cannot take within the budget is refused. A shard registered
    with zeros in a reused slot reads zeros (it read the removed shard's bytes)."""
    import os

    with TieredStore(StoreConfig(device_budget="4MiB", cpu_budget="8MiB", nvme_budget="1MiB",
                                 nvme_path=str(tmp_path / "s"))) as st:
        for i in range(1, 9):  # 16 KiB, 32 KiB, ... 128 KiB
            st.register(("a", i), i * 4096, torch.float32, home="nvme", tier_class="act", zero=False).result()
            st.unregister(("a", i)).result()
        st.register("big", (1 << 20) // 4, torch.float32, home="nvme", tier_class="act", zero=False).result()
        assert os.path.getsize(st.swap_paths()[0]) == 1 << 20  # the whole budget, in one file, no more
        st.unregister("big").result()
        st.register("keep", 4096, torch.float32, home="nvme", tier_class="act", zero=False).result()  # at 0
        # 528 KiB of live shards fit the budget; the act file's freed 1008 KiB cannot serve another file's slot
        with pytest.raises(SwapSpaceError, match=r"the swap files take 1.00 MiB and this slot would grow them by"):
            st.register("half", (1 << 19) // 4, torch.float32, home="nvme", tier_class="other", zero=False)
        old = torch.arange(4096, dtype=torch.float32) + 1
        st.register("old", 4096, torch.float32, home="nvme", tier_class="act", init=old).result()
        st.unregister("old").result()
        st.register("new", 4096, torch.float32, home="nvme", tier_class="act").result()  # zeros, in old's slot
        assert torch.count_nonzero(st.fetch("new", "cpu").result()) == 0


def test_held_says_what_each_tier_holds(tmp_path):
    """held()[tier]: the blocks of shards homed in the tier and the working copies of shards homed below,
    by tier class, the copies a move is using, and the rest of the tier's bytes in use (staging no shard holds):
    together exactly what the tier counts as in use."""
    with TieredStore(StoreConfig(device_budget="1MiB", cpu_budget="1MiB", nvme_budget="4MiB",
                                 nvme_path=str(tmp_path / "s"), alloc_timeout=30)) as st:
        st.register("home", 4000, torch.float32, home="cpu", tier_class="params").result()  # 16000 -> 16 KiB
        st.register("paged", 3000, torch.float32, home="nvme", tier_class="optim").result()
        st.register("dev", 1000, torch.float32, home="device", tier_class="grads").result()
        held = st.held()["cpu"]
        assert held["homes"] == {"params": 16384} and held["copies"] == {} and held["moving"] == 0
        assert st.held()["device"]["homes"] == {"grads": 4096}
        st.fetch("paged", "cpu").result()  # a working copy (12000 -> 12 KiB) of an nvme-homed shard
        held = st.held()["cpu"]
        assert held["copies"] == {"optim": 12288} and held["moving"] == 0
        assert sum(held["homes"].values()) + sum(held["copies"].values()) + held["other"] \
            == st.stats()["cpu"]["bytes_in_use"] == 16384 + 12288
        st.release("paged").result()
        assert st.held()["cpu"]["copies"] == {}  # written back, the copy given up
        assert st.stats()["cpu"]["bytes_in_use"] == 16384


def test_fetch_blocks_until_a_release_and_times_out(tmp_path):
    with TieredStore(StoreConfig(device_budget="64KiB", cpu_budget="64KiB", nvme_budget="1MiB",
                                 nvme_path=str(tmp_path / "s"))) as st:
        for n in ("a", "b"):
            st.register(n, 10_000, torch.float32, home="nvme").result()  # 40 KB each: one fits at a time
        st.fetch("a", "cpu").result()
        with pytest.raises(ArenaFullError, match=r"timed out after 0.05s"):
            st.fetch("b", "cpu", timeout=0.05)
        got = []
        th = threading.Thread(target=lambda: got.append(st.fetch("b", "cpu", timeout=30).result()))
        th.start()
        time.sleep(0.1)
        assert not got
        st.release("a")
        th.join(30)
        assert len(got) == 1 and st.stats()["cpu"]["peak_bytes"] <= 64 * 1024


class Watcher:
    """Samples every tier's bytes in use from another thread while the sequence runs."""

    def __init__(self, st):
        self.st, self.max = st, {"device": 0, "cpu": 0, "nvme": 0}
        self.stop = threading.Event()
        self.th = threading.Thread(target=self.run)

    def run(self):
        while not self.stop.is_set():
            s = self.st.stats()
            for k in self.max:
                self.max[k] = max(self.max[k], s[k]["bytes_in_use"])
            time.sleep(0.0005)

    def __enter__(self):
        self.th.start()
        return self

    def __exit__(self, *e):
        self.stop.set()
        self.th.join()


SHARDS = [(n, dt, home) for n, dt, home in [
    (1000, torch.float32, "nvme"), (5000, torch.bfloat16, "nvme"), (9000, torch.float32, "nvme"),
    (3, torch.bfloat16, "nvme"), (7000, torch.float32, "cpu"), (2000, torch.bfloat16, "cpu"),
    (12000, torch.float32, "nvme"), (4097, torch.float32, "nvme"),
]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["fetch_cpu", "fetch_device", "release", "release_wb", "writeback"]),
                          st.integers(0, len(SHARDS) - 1)), min_size=1, max_size=40))
def test_random_fetch_release_never_exceeds_budgets(tmp_path_factory, ops):
    caps = {"device": 96 * 1024, "cpu": 128 * 1024, "nvme": 256 * 1024}
    with TieredStore(StoreConfig(device_budget=caps["device"], cpu_budget=caps["cpu"], nvme_budget=caps["nvme"],
                                 nvme_path=str(tmp_path_factory.mktemp("b") / "s"), io_workers=4)) as store:
        ref = {}
        for i, (n, dt, home) in enumerate(SHARDS):
            ref[f"s{i}"] = torch.randn(n).to(dt)
            store.register(f"s{i}", n, dt, home=home, init=ref[f"s{i}"])
        with Watcher(store) as w:
            for op, i in ops:
                name = f"s{i}"
                try:
                    if op == "fetch_cpu":
                        if SHARDS[i][2] == "nvme":
                            t = store.fetch(name, "cpu", timeout=0.2).result()
                            assert torch.equal(t, ref[name])
                    elif op == "fetch_device":
                        t = store.fetch(name, "device", timeout=0.2).result()
                        assert torch.equal(t, ref[name])
                    elif op == "release":
                        store.release(name)
                    elif op == "release_wb":
                        store.release(name, writeback=True, timeout=0.2)
                    else:
                        store.writeback(name, timeout=0.2)
                except ArenaFullError as e:
                    assert "timed out" in str(e)  # full right now (we hold buffers): refused, never exceeded
            store.wait_all()
        s = store.stats()
        for tier, cap in caps.items():
            assert s[tier]["capacity"] <= cap
            assert w.max[tier] <= cap and s[tier]["peak_bytes"] <= cap, (tier, w.max, s)
        for name in ref:
            store.release(name)
        store.wait_all()
        s = store.stats()
        assert s["device"]["bytes_in_use"] == 0
        assert s["cpu"]["bytes_in_use"] == sum(-(-n * (4 if dt == torch.float32 else 2) // 4096) * 4096
                                               for n, dt, h in SHARDS if h == "cpu")
