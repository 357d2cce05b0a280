"""TieredStore round trips: random data through every tier and path, many moves in flight."""
import concurrent.futures as cf
import os
import sys

import pytest
import torch

from offload import inject
from offload.store import Residency, StoreConfig, StoreError, TieredStore
from offload.store.residency import TRANSITIONS
from offload.telemetry import Queue

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import store_grid  # noqa: E402

R = Residency


def rand(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g)
    return torch.randn(numel, generator=g).to(dtype)


def same(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def store(tmp_path):
    with TieredStore(StoreConfig(device_budget="32MiB", cpu_budget="32MiB", nvme_budget="256MiB",
                                 nvme_path=str(tmp_path / "swap"), io_workers=8)) as st:
        yield st


# 1 byte .. a few MiB, odd sizes
CASES = [(0, torch.float32), (1, torch.uint8), (3, torch.bfloat16), (1023, torch.float32), (4096, torch.bfloat16),
         (4097, torch.float32), (65_537, torch.bfloat16), (1_048_579, torch.float32)]


@pytest.mark.parametrize("home", ["nvme", "cpu", "device"])
def test_round_trip_every_path(store, home):
    data = {}
    for i, (n, dt) in enumerate(CASES):
        name = f"{home}-{i}"
        data[name] = rand(n, dt, i)
        store.register(name, n, dt, home=home, tier_class="params" if i % 2 else "optim", init=data[name]).result()
        assert store.info(name).nbytes == n * data[name].element_size()
    for name, x in data.items():
        # home copy as registered
        for tier in ["device", "cpu", "nvme"][: ["device", "cpu", "nvme"].index(home) + 1]:
            if tier == "nvme":
                continue
            t = store.fetch(name, tier).result()
            assert same(t, x), (name, tier)
        if home != "device":
            # modify the working copy on the device, write it home, drop it, fetch again from home
            t = store.fetch(name, "device").result()
            assert store.residency(name) is R.DEVICE
            t.copy_(rand(x.numel(), x.dtype, 1000 + len(name)))
            y = t.clone()
            store.release(name, writeback=True).result()
            assert store.residency(name) is (R.NVME if home == "nvme" else R.CPU)
            back = store.fetch(name, "cpu").result()
            assert same(back, y)
            store.release(name).result()
    s = store.stats()
    if home == "nvme":
        assert s["moved"]["nvme->cpu"] > 0 and s["moved"]["cpu->nvme"] > 0
    if home != "device":
        assert s["moved"]["cpu->device"] > 0 and s["moved"]["device->cpu"] > 0


def test_nvme_shard_cpu_then_device_then_down(store):
    x = rand(10_000, torch.float32, 7)
    store.register("s", 10_000, torch.float32, home="nvme", init=x).result()
    assert store.residency("s") is R.NVME
    c = store.fetch("s", "cpu").result()
    assert store.residency("s") is R.CPU and same(c, x)
    c.add_(1)
    d = store.fetch("s", "device").result()  # the working copy moves up, staging freed
    assert store.residency("s") is R.DEVICE and same(d, x + 1)
    d.add_(1)
    c2 = store.fetch("s", "cpu").result()  # and back down, without touching the file
    assert store.residency("s") is R.CPU and same(c2, (x + 1) + 1)
    store.release("s").result()  # no writeback: the home copy is unchanged
    assert same(store.fetch("s", "cpu").result(), x)
    store.writeback("s").result()
    store.release("s").result()


def test_unwritten_nvme_and_cpu_shards_read_zeros(store):
    store.register("z1", 5000, torch.bfloat16, home="nvme").result()
    store.register("z2", 5000, torch.float32, home="cpu").result()
    assert torch.count_nonzero(store.fetch("z1", "device").result()) == 0
    assert torch.count_nonzero(store.fetch("z2", "device").result()) == 0


def test_many_in_flight_interleaved_under_buffer_pressure(tmp_path):
    # cpu budget for ~6 shards at a time; 120 shards fetched, modified, written back and released with
    # many moves queued: buffers are recycled constantly, and any reuse during a move corrupts data.
    n = 16_381  # odd: every slot has padding
    with TieredStore(StoreConfig(device_budget="1MiB", cpu_budget=6 * 65_536, nvme_budget="64MiB",
                                 nvme_path=str(tmp_path / "s"), io_workers=8, alloc_timeout=60)) as st:
        ref = {}
        for i in range(120):
            ref[f"p{i}"] = rand(n, torch.float32, i)
            st.register(f"p{i}", n, torch.float32, home="nvme", init=ref[f"p{i}"])
        st.wait_all()
        for rnd in range(2):
            futs = {name: st.fetch(name, "cpu") for name in list(ref)[:4]}
            for k, name in enumerate(ref):
                t = futs.pop(name).result()
                assert same(t, ref[name]), (rnd, name)
                t.mul_(-1)
                ref[name] = t.clone()
                st.release(name, writeback=True)
                nxt = list(ref)[k + 4] if k + 4 < len(ref) else None
                if nxt:
                    futs[nxt] = st.fetch(nxt, "cpu")  # a read queued while writes are in flight
                assert st.stats()["cpu"]["bytes_in_use"] <= st.stats()["cpu"]["capacity"]
            st.wait_all()
        assert st.stats()["cpu"]["peak_bytes"] <= 6 * 65_536
        for name, x in ref.items():
            assert same(st.fetch(name, "device").result(), x)
            st.release(name)
        st.wait_all()


def test_hundreds_of_concurrent_fetches(tmp_path):
    with TieredStore(StoreConfig(device_budget="8MiB", cpu_budget="8MiB", nvme_budget="64MiB",
                                 nvme_path=str(tmp_path / "s"), io_workers=8)) as st:
        ref = {f"q{i}": rand(1000 + i, torch.bfloat16, i) for i in range(300)}
        for name, x in ref.items():
            st.register(name, x.numel(), x.dtype, home="nvme", init=x)
        st.wait_all()
        futs = {name: st.fetch(name, "device") for name in ref}  # 300 moves queued at once
        for name, f in futs.items():
            assert same(f.result(), ref[name])
        cf.wait([st.release(n) for n in ref])
        assert st.stats()["device"]["bytes_in_use"] == 0 and st.stats()["cpu"]["bytes_in_use"] == 0


def test_api_errors(store):
    store.register("a", 10, torch.float32, home="cpu").result()
    with pytest.raises(ValueError, match="already registered"):
        store.register("a", 10)
    with pytest.raises(KeyError, match="no shard named 'nope'"):
        store.fetch("nope", "cpu")
    with pytest.raises(ValueError, match=r"can only fetch to the home tier \(cpu\) or a faster one"):
        store.fetch("a", "nvme")
    store.register("d", 10, torch.float32, home="device").result()
    with pytest.raises(ValueError, match=r"home tier \(device\)"):
        store.fetch("d", "cpu")
    with pytest.raises(ValueError, match="init has 3 elements but numel is 10"):
        store.register("b", 10, init=torch.ones(3))
    with pytest.raises(ValueError, match="'gpu': not a tier of this store"):
        store.register("c", 10, home="gpu")


def test_nvme_needs_a_path():
    with TieredStore(StoreConfig(device_budget="1MiB", cpu_budget="1MiB")) as st:
        with pytest.raises(StoreError, match="need StoreConfig.nvme_path"):
            st.register("x", 10, home="nvme")


def test_transitions_assert_their_preconditions(store):
    store.register("x", 100, home="nvme").result()
    s = store._shards["x"]
    with pytest.raises(AssertionError, match="move CPU->NVME while NVME"):
        store._transition(s, R.CPU, R.NVME)
    with pytest.raises(AssertionError, match="move NVME->TO_CPU while NVME"):  # not an allowed edge
        store._transition(s, R.NVME, R.TO_CPU)
    assert store.residency("x") is R.NVME
    # every in-flight state has a way back (a failed move returns where it started)
    for mid in (R.READING, R.TO_DEVICE, R.TO_CPU, R.WRITING):
        assert any(a is mid for a, _ in TRANSITIONS) and any(b is mid for _, b in TRANSITIONS)


def test_threads_on_disjoint_shards_under_tight_budgets(tmp_path):
    # 4 threads, each fetching / modifying / writing back / releasing its own shards at random, with
    # budgets for about 3 buffers per tier: they block on each other's releases and must never see
    # another shard's bytes.
    import random
    import threading

    n = 20_000  # 80 KB fp32
    errors = []
    # 4 home-cpu shards hold 4 buffers for good; the rest of the cpu budget is ~3 working buffers
    with TieredStore(StoreConfig(device_budget=3 * 81_920, cpu_budget=7 * 81_920 + 65_536, nvme_budget="16MiB",
                                 nvme_path=str(tmp_path / "s"), alloc_timeout=60)) as st:
        ref = {}
        for t in range(4):
            for i in range(6):
                name = f"t{t}-{i}"
                ref[name] = rand(n, torch.float32, 100 * t + i)
                st.register(name, n, torch.float32, home="nvme" if i else "cpu", init=ref[name])
        st.wait_all()

        def worker(t):
            rng = random.Random(t)
            try:
                for step in range(40):
                    name = f"t{t}-{rng.randrange(6)}"
                    tier = rng.choice(["cpu", "device"]) if st.info(name).home.value == "nvme" else "device"
                    x = st.fetch(name, tier).result()
                    assert same(x, ref[name]), (name, step)
                    if rng.random() < 0.5:
                        x.add_(1.0)
                        ref[name] = x.clone()
                        st.release(name, writeback=True)
                    else:
                        st.release(name)
            except BaseException as e:  # reported below
                errors.append(e)

        ths = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        assert not errors, errors[0]
        st.wait_all()
        s = st.stats()
        assert s["cpu"]["peak_bytes"] <= s["cpu"]["capacity"] and s["device"]["peak_bytes"] <= s["device"]["capacity"]
        for name, x in ref.items():  # every change was written home
            assert same(st.fetch(name, "cpu").result(), x)
            st.release(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slow", [Queue.COPY, Queue.NVME_WRITE], ids=lambda q: f"slow_{q.value}")
def test_the_leases_grid_with_a_slow_queue_ends_with_one_lease_at_a_time(tmp_path, dtype, slow):
    """108 shards x 3 rounds of READ / UPDATE / OVERWRITE leases to the device and the cpu tier, every release left in
    flight (store_grid.py), one queue slowed: the bytes and the READ snapshots are the sequence replayed on plain
    tensors. The same grid on a GPU found cpu-homed shards leased home while their device lease's release was in
    flight losing the home lease's writes; on the CPU it needs a slow queue to show."""
    with inject.delay(slow, 0.002), TieredStore(StoreConfig(
            device_budget="256MiB", cpu_budget="256MiB", nvme_budget="1GiB", nvme_path=str(tmp_path / "swap"),
            io_workers=8, lock_memory=False)) as st:
        got = store_grid.run(st, dtype)
    bad = store_grid.differing(got, store_grid.expected(dtype))
    assert not bad, f"{len(bad)} shards differ from one lease at a time, e.g. {bad[:5]}"
    assert got["stats"]["device"]["bytes_in_use"] == got["homes"], got["stats"]  # every working copy was given back
