"""A storage tier added in one file (slow_file_tier.py: bytes in a file on a second path, with latency) is a home
like nvme: shards round-trip through it within its budget, beside nvme, with the store's checksums and errors."""
import concurrent.futures as cf
import os
import sys

import pytest
import torch

from offload.store import (LeaseMode, Residency, StoreConfig, SwapCorruptError, SwapSpaceError, TieredStore,
                           register_storage_tier)
from offload.store.nvme_tier import NvmeTier
from offload.store.swap_file import page_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import slow_file_tier  # noqa: E402,F401  (registers "file2")

R = Residency


def rand(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype)


def same(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def make(tmp_path, budget="4MiB", latency_s=0.0, **kw):
    return TieredStore(StoreConfig(device_budget="8MiB", cpu_budget="8MiB", io_workers=8,
                                   tiers={"file2": {"path": str(tmp_path / "second"), "budget": budget,
                                                    "latency_s": latency_s}}, **kw))


CASES = [(0, torch.float32), (3, torch.bfloat16), (1023, torch.float32), (4097, torch.float32),
         (65_537, torch.bfloat16)]


def test_shards_round_trip_through_every_path_of_the_test_tier(tmp_path):
    with make(tmp_path, latency_s=0.001) as st:
        data = {}
        for i, (n, dt) in enumerate(CASES):
            data[f"s{i}"] = rand(n, dt, i)
            st.register(f"s{i}", n, dt, home="file2", tier_class="optim", init=data[f"s{i}"]).result()
            assert st.residency(f"s{i}") is R.NVME  # at rest: the bytes are only in the tier
            assert st.info(f"s{i}").home_name == "file2"
        for i, (name, x) in enumerate(data.items()):
            assert same(st.fetch(name, "cpu").result(), x)  # file2 -> cpu
            t = st.fetch(name, "device").result()  # the working copy moves up
            assert same(t, x) and st.residency(name) is R.DEVICE
            y = rand(x.numel(), x.dtype, 100 + i)
            t.copy_(y)
            st.release(name, writeback=True).result()  # device -> cpu -> file2
            assert st.residency(name) is R.NVME
            lease = st.lease(name, "cpu", LeaseMode.UPDATE)  # a lease reads it back and writes it home
            got = lease.wait()
            assert same(got, y)
            got.add_(1)
            y = got.clone()
            lease.release().result()
            assert same(st.fetch(name, "device").result(), y)
            st.release(name).result()
        s = st.stats()
        assert s["moved"]["file2->cpu"] > 0 and s["moved"]["cpu->file2"] > 0 and s["busy_s"]["file2->cpu"] > 0
        assert s["moved"]["nvme->cpu"] == 0  # nothing went through the nvme tier (there is none)
        assert s["file2"]["bytes_in_use"] == sum(page_bytes(x.numel() * x.element_size()) for x in data.values())
        assert s["cpu"]["bytes_in_use"] == 0 and s["device"]["bytes_in_use"] == 0  # every working copy returned
        paths = st.swap_paths()
        assert paths and all(os.path.exists(p) for p in paths)
    assert not any(os.path.exists(p) for p in paths)  # close removed the tier's file


def test_the_tier_budget_is_kept_and_freed_slots_are_reused(tmp_path):
    with make(tmp_path, budget="64KiB") as st:
        for i in range(4):
            st.register(f"a{i}", 4096, home="file2", init=torch.full((4096,), float(i))).result()  # 16 KiB each
        with pytest.raises(SwapSpaceError, match=r"raise StoreConfig.tiers\['file2'\].budget"):
            st.register("over", 4096, home="file2").result()
        assert "over" not in st.names() and st.stats()["cpu"]["bytes_in_use"] == 0  # the refusal left nothing
        st.unregister("a1").result()
        assert st.stats()["file2"]["bytes_in_use"] == 64 * 1024 - 16 * 1024
        st.register("z", 4096, home="file2").result()  # a1's old slot: the store writes the zeros it promised
        assert torch.equal(st.fetch("z", "cpu").result(), torch.zeros(4096))
        for i in (0, 2, 3):
            assert torch.equal(st.fetch(f"a{i}", "cpu").result(), torch.full((4096,), float(i)))
            st.release(f"a{i}").result()


def test_many_moves_in_flight_stay_within_the_cpu_budget(tmp_path):
    """With latency, fetches of 24 shards of 256 KiB through a cpu budget of 1 MiB wait for each other's
    releases; every byte comes back and the cpu tier never held more than its budget."""
    with TieredStore(StoreConfig(device_budget="8MiB", cpu_budget="1MiB", io_workers=8,
                                 tiers={"file2": {"path": str(tmp_path / "second"), "budget": "8MiB",
                                                  "latency_s": 0.002}})) as st:
        n = 64 * 1024
        data = {f"p{i}": rand(n, torch.float32, i) for i in range(24)}
        for name, x in data.items():
            st.register(name, n, home="file2", init=x).result()

        def round_trip(name):
            t = st.fetch(name, "cpu").result()
            ok = same(t, data[name])
            t.mul_(2)
            st.release(name, writeback=True).result()
            return ok

        with cf.ThreadPoolExecutor(6) as pool:
            assert all(pool.map(round_trip, data))
        assert st.stats()["cpu"]["peak_bytes"] <= 1 << 20
        for name, x in data.items():
            assert same(st.fetch(name, "cpu").result(), x * 2)
            st.release(name).result()


def test_beside_nvme_and_slots_exchange_only_within_one_tier(tmp_path):
    with make(tmp_path, nvme_budget="4MiB", nvme_path=str(tmp_path / "swap")) as st:
        a, b, c = rand(1000, torch.float32, 1), rand(1000, torch.float32, 2), rand(1000, torch.float32, 3)
        st.register("a", 1000, home="file2", init=a).result()
        st.register("b", 1000, home="file2", init=b).result()
        st.register("c", 1000, home="nvme", init=c).result()
        st.exchange_slots("a", "b")  # metadata only: each now reads the other's bytes
        assert same(st.fetch("a", "cpu").result(), b) and same(st.fetch("b", "cpu").result(), a)
        st.release("a").result()
        st.release("b").result()
        with pytest.raises(ValueError, match="one storage tier"):
            st.exchange_slots("a", "c")
        assert same(st.fetch("c", "cpu").result(), c)
        s = st.stats()
        assert s["moved"]["nvme->cpu"] > 0 and s["moved"]["file2->cpu"] > 0
        assert st.swap_location("a") is None and st.swap_location("c") is not None  # file2 offers no fd to pread


def test_a_flipped_byte_in_the_tier_is_caught_by_the_store_checksum(tmp_path):
    with make(tmp_path) as st:
        x = rand(5000, torch.float32, 5)
        st.register("x", 5000, home="file2", init=x).result()
        fd = os.open(st.swap_paths()[0], os.O_RDWR)
        try:
            os.pwrite(fd, b"\xff", 7)
        finally:
            os.close(fd)
        with pytest.raises(SwapCorruptError, match=r"rank0-file2.bin at offset 0 differ"):
            st.fetch("x", "cpu").result()
        assert st.residency("x") is R.NVME and st.stats()["cpu"]["bytes_in_use"] == 0


def test_bad_tier_names_are_named(tmp_path):
    with pytest.raises(ValueError, match="no storage tier named 'tape' is registered"):
        TieredStore(StoreConfig(device_budget="1MiB", cpu_budget="1MiB", tiers={"tape": {}}))
    with make(tmp_path) as st:
        with pytest.raises(ValueError, match="'tape': not a tier of this store"):
            st.register("t", 10, home="tape")
        st.register("f", 10, home="file2").result()
        with pytest.raises(ValueError, match=r"home tier \(file2\) or a faster one"):
            st.fetch("f", "file2")


def test_a_second_nvme_path_is_one_registration(tmp_path):
    """The nvme tier itself on another directory, under another name: its own swap files, budget and links."""
    register_storage_tier("nvme2", NvmeTier.on_path("nvme2"))
    with TieredStore(StoreConfig(device_budget="8MiB", cpu_budget="8MiB", nvme_budget="1MiB",
                                 nvme_path=str(tmp_path / "a"),
                                 tiers={"nvme2": {"path": str(tmp_path / "b"), "budget": "256KiB"}})) as st:
        x, y = rand(50_000, torch.float32, 1), rand(50_000, torch.float32, 2)
        st.register("x", 50_000, home="nvme", init=x).result()
        st.register("y", 50_000, home="nvme2", init=y).result()
        with pytest.raises(SwapSpaceError, match=r"nvme2 budget .* raise StoreConfig.tiers\['nvme2'\]\['budget'\]"):
            st.register("z", 50_000, home="nvme2").result()
        assert same(st.fetch("x", "device").result(), x) and same(st.fetch("y", "device").result(), y)
        s = st.stats()
        assert s["moved"]["nvme->cpu"] == s["moved"]["nvme2->cpu"] == 200_000
        assert s["nvme"]["bytes_in_use"] == s["nvme2"]["bytes_in_use"] == page_bytes(200_000)
        assert sorted(os.path.dirname(p) for p in st.swap_paths()) == [str(tmp_path / "a"), str(tmp_path / "b")]
