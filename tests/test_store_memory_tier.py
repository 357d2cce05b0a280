"""The cpu and device tiers are HomeTiers like a storage tier (home_tier.py, memory_tier.py): a slot is a block, its
read a view; home blocks hold their bytes for good (a request that can never fit is refused at once, naming the
setting) and give them back when freed; the device tier's copies land before they return."""
import time

import pytest
import torch

from offload.store import ArenaFullError, StoreConfig, Tier, TieredStore
from offload.store.cpu_tier import CpuMemoryTier
from offload.store.device_tier import DeviceMemoryTier
from offload.store.home_tier import HomeTier
from offload.store.storage_tier import StorageTier

KiB = 1024
CPU = torch.device("cpu")


def test_the_cpu_tier_holds_home_blocks_for_good_and_gives_them_back_when_freed():
    tier = CpuMemoryTier(64 * KiB, CPU, lock_memory=False, numa_node=None)
    try:
        assert isinstance(tier, HomeTier) and tier.level is Tier.CPU and tier.name == "cpu"
        home = tier.reserve("h", 48 * KiB, "params")
        tier.view(home, torch.float32, 12 * KiB).fill_(2.0)
        assert torch.equal(home.view(torch.float32, 12 * KiB), torch.full((12 * KiB,), 2.0))  # a view, not a copy
        with pytest.raises(ArenaFullError, match=r"shard 'w' \(20.00 KiB\): can never fit in the cpu budget of "
                                                 r"64.00 KiB: home shards hold 48.00 KiB of it for good; raise "
                                                 r"cpu_budget"):
            tier.take("w", 20 * KiB, timeout=30)  # at once, not after the timeout
        tier.free(home)
        assert tier.bytes_in_use == 0
        tier.take("w", 20 * KiB, timeout=0).free()  # the held bytes came back with the block
        assert tier.stats() | {"locked": False} == {"capacity": 64 * KiB, "bytes_in_use": 0,
                                                    "peak_bytes": 48 * KiB, "locked": False, "lock_kind": "none"}
    finally:
        tier.close()


def test_the_cpu_tier_lends_short_lived_blocks_in_staging_slots_and_homes_in_their_size():
    tier = CpuMemoryTier(64 * KiB, CPU, lock_memory=False, numa_node=None)
    try:
        tier.set_staging_slot(16 * KiB - 100)
        assert tier.staged_nbytes(5000) == 16 * KiB and tier.staged_nbytes(40 * KiB) == 40 * KiB
        short = tier.take("s", 5000, timeout=0, short_lived=True)
        home = tier.reserve("h", 5000, "params")
        assert (short.span, home.span) == (16 * KiB, 8 * KiB)
        assert tier.free_staging_bytes() == 32 * KiB  # 40 KiB free: two whole slots
    finally:
        tier.close()


def test_the_device_tier_copies_and_its_fitted_limit_holds():
    tier = DeviceMemoryTier(64 * KiB, CPU)  # without a GPU: a budgeted region of host memory, the same code
    try:
        assert isinstance(tier, HomeTier) and tier.level is Tier.DEVICE and tier.name == "device"
        a, b = tier.take("a", 4 * KiB, timeout=0), tier.take("b", 4 * KiB, timeout=0)
        src = torch.arange(KiB, dtype=torch.float32)
        a.view(torch.float32, KiB).copy_(src)
        tier.copy(b.view(torch.float32, KiB), a.view(torch.float32, KiB), tier.stream_point())
        assert torch.equal(b.view(torch.float32, KiB), src)
        assert tier.set_limit(8 * KiB) == 8 * KiB == tier.capacity
        with pytest.raises(ArenaFullError):  # the limit is full: a prefetch backs off at once
            tier.take("c", 4 * KiB, timeout=0)
    finally:
        tier.close()


def test_a_store_speaks_to_every_home_through_the_interface(tmp_path):
    """Each home of a store is a HomeTier; an unregistered memory home's bytes come back (the next home fits)."""
    with TieredStore(StoreConfig(device_budget="64KiB", cpu_budget="64KiB", nvme_budget="1MiB",
                                 nvme_path=str(tmp_path / "s"), alloc_timeout=30)) as st:
        homes = st._homes()
        assert sorted(homes) == ["cpu", "device", "nvme"]
        assert all(isinstance(t, HomeTier) for t in homes.values()) and isinstance(homes["nvme"], StorageTier)
        for home in ("cpu", "device"):
            st.register("a", 12 * KiB, torch.float32, home=home, init=torch.ones(12 * KiB)).result()
            first = st.fetch("a", home).result()
            first.mul_(3)
            assert first.data_ptr() == st.fetch("a", home).result().data_ptr()  # the home copy itself
            st.unregister("a").result()
            started = time.monotonic()
            st.register("b", 12 * KiB, torch.float32, home=home).result()  # 48 KiB again: fits only if freed
            assert time.monotonic() - started < 20
            st.unregister("b").result()
