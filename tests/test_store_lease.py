"""Leases: a claim on a shard's bytes handed out at once, waited on only where the bytes are needed, and
given back with a write-behind. Also the store's per-link accounting and back-off under budget pressure."""
from dataclasses import dataclass

import pytest
import torch

from offload import inject
from offload.store import ArenaBusyError, LeaseMode, Residency, StoreConfig, StoreError, TieredStore
from offload.store.swap_file import page_bytes
from offload.telemetry import Queue

R = Residency
N = 100_000  # 400 KB of fp32


@dataclass(frozen=True)
class Key:  # shards may be named by small records, not only strings
    unit: str
    state: str

    def __str__(self):
        return f"{self.unit}/{self.state}"


@pytest.fixture
def store(tmp_path):
    with TieredStore(StoreConfig(device_budget="4MiB", cpu_budget="2MiB", nvme_budget="64MiB",
                                 nvme_path=str(tmp_path / "swap"), io_workers=4)) as st:
        yield st


def moved(store, link):
    return store.stats()["moved"][link]


@pytest.mark.parametrize("tier", ["cpu", "device"])
def test_read_lease_brings_bytes_in_and_writes_nothing(store, tier):
    x = torch.randn(N)
    store.register(Key("u0", "param"), N, home="nvme", init=x).result()
    written = moved(store, "cpu->nvme")
    lease = store.lease(Key("u0", "param"), tier, LeaseMode.READ)
    assert torch.equal(lease.wait(), x)
    lease.release().result()
    assert moved(store, "cpu->nvme") == written  # nothing written back
    assert store.residency(Key("u0", "param")) is R.NVME
    assert store.stats()["cpu"]["bytes_in_use"] == 0 and store.stats()["device"]["bytes_in_use"] == 0


@pytest.mark.parametrize("tier", ["cpu", "device"])
def test_update_lease_writes_behind(store, tier):
    x = torch.randn(N)
    store.register("s", N, home="nvme", init=x).result()
    lease = store.lease("s", tier, LeaseMode.UPDATE)
    lease.wait().mul_(2)
    lease.release().result()
    again = store.lease("s", "cpu", LeaseMode.READ)
    assert torch.equal(again.wait(), x * 2)
    again.release()


@pytest.mark.parametrize("home,tier", [("nvme", "cpu"), ("nvme", "device"), ("cpu", "device"), ("cpu", "cpu")])
def test_overwrite_lease_reads_nothing(store, home, tier):
    store.register("s", N, home=home, init=torch.randn(N)).result()
    read, h2d = moved(store, "nvme->cpu"), moved(store, "cpu->device")
    lease = store.lease("s", tier, LeaseMode.OVERWRITE)
    y = torch.randn(N)
    lease.wait().copy_(y)
    lease.release().result()
    assert moved(store, "nvme->cpu") == read and moved(store, "cpu->device") == h2d  # no read, no copy in
    back = store.lease("s", "cpu", LeaseMode.READ)
    assert torch.equal(back.wait(), y)
    back.release().result()
    assert store.stats()["cpu"]["bytes_in_use"] == (4096 * -(-N * 4 // 4096) if home == "cpu" else 0)


def test_lease_is_handed_out_before_the_bytes_arrive(store):
    store.register("s", N, home="nvme", init=torch.ones(N)).result()
    with inject.delay(Queue.NVME_READ, 2.0):  # the disk is slow: the read completes 2 s late
        lease = store.lease("s", "cpu", LeaseMode.READ)
        # lease() queued the read and returned; had it waited for the move, the bytes would be here
        assert not lease.ready()
        assert torch.equal(lease.wait(), torch.ones(N))
    lease.release().result()


def test_moves_of_one_shard_keep_their_order_under_a_slow_write(store):
    """A lease taken right after an UPDATE lease's release sees the released bytes even when the
    write-behind is slow: moves of one shard run in the order asked."""
    store.register("s", N, home="nvme", init=torch.zeros(N)).result()
    with inject.delay(Queue.NVME_WRITE, 0.3):
        for k in range(1, 4):
            lease = store.lease("s", "cpu", LeaseMode.UPDATE)
            lease.wait().add_(1)
            lease.release()  # not waited: the next lease queues behind the write
        last = store.lease("s", "cpu", LeaseMode.READ)
        assert torch.equal(last.wait(), torch.full((N,), 3.0))
        last.release().result()


def test_non_blocking_lease_backs_off_when_the_tier_is_full(store):
    big = 1_500_000 // 4  # 1.5 MB of a 2 MiB cpu budget
    store.register("a", big, home="nvme", init=torch.randn(big)).result()
    store.register("b", big, home="nvme", init=torch.randn(big)).result()
    held = store.lease("a", "cpu", LeaseMode.READ)
    held.wait()
    assert store.lease("b", "cpu", LeaseMode.READ, block=False) is None  # no room now: nothing queued
    assert store.residency("b") is R.NVME and store.stats()["in_flight"] == 0
    with pytest.raises(ArenaBusyError):
        store.fetch("b", "cpu", timeout=0)
    held.release().result()
    later = store.lease("b", "cpu", LeaseMode.READ, block=False)
    assert later is not None
    later.wait()
    later.release().result()


def test_lease_used_after_release_raises(store):
    store.register("s", N, home="nvme", init=torch.ones(N)).result()
    lease = store.lease("s", "cpu", LeaseMode.READ)
    lease.wait()
    assert lease.release() is lease.release()  # idempotent: one move
    with pytest.raises(RuntimeError, match="after release"):
        lease.wait()


def test_links_count_bytes_and_busy_time(store):
    x = torch.randn(N)
    store.register("s", N, home="nvme", init=x).result()
    before = store.stats()
    with inject.delay(Queue.NVME_READ, 0.05):
        lease = store.lease("s", "cpu", LeaseMode.READ)
        lease.wait()
    lease.release().result()
    after = store.stats()
    assert after["moved"]["nvme->cpu"] - before["moved"]["nvme->cpu"] == N * 4
    assert after["busy_s"]["nvme->cpu"] - before["busy_s"]["nvme->cpu"] >= 0.05  # includes the slow completion


def _read(store, name):
    lease = store.lease(name, "cpu", LeaseMode.READ)
    try:
        return lease.wait().clone()
    finally:
        lease.release().result()


def test_exchange_slots_writes_beside_the_old_bytes_and_takes_the_write_back(store):
    """A write that may be taken back (a speculative update): the shard's next write lands in the spare's slot,
    the old bytes stay in the spare; exchanging again after the write restores them, checksums and all."""
    x = torch.randn(N)
    store.register("home", N, home="nvme", tier_class="optim", init=x).result()
    store.register("spare", N, home="nvme", tier_class="optim").result()
    lease = store.lease("home", "cpu", LeaseMode.UPDATE)
    t = lease.wait()
    store.exchange_slots("home", "spare")  # the bytes are in: the write-behind goes to the other slot
    t.mul_(3)
    lease.release().result()
    assert torch.equal(_read(store, "home"), x * 3)  # kept: the write is the shard's value
    assert torch.equal(_read(store, "spare"), x)  # and its old value beside it (checksum verified on read)
    store.exchange_slots("home", "spare")  # taken back
    assert torch.equal(_read(store, "home"), x)
    assert torch.equal(_read(store, "spare"), x * 3)


def test_exchange_slots_refuses_moves_in_flight_and_unlike_slots(store):
    store.register("home", N, home="nvme", tier_class="optim", init=torch.randn(N)).result()
    store.register("spare", N, home="nvme", tier_class="optim").result()
    store.register("small", N // 2, home="nvme", tier_class="optim").result()
    store.register("other", N, home="nvme", tier_class="params").result()
    store.register("mem", N, home="cpu").result()
    for bad in ("small", "other", "mem", "home"):
        with pytest.raises(ValueError, match="exchange_slots"):
            store.exchange_slots("home", bad)
    with inject.delay(Queue.NVME_READ, 0.3):
        lease = store.lease("home", "cpu", LeaseMode.READ)  # its read held in flight
        with pytest.raises(Exception, match="in flight"):
            store.exchange_slots("home", "spare")
        lease.wait()
    held = store.lease("spare", "cpu", LeaseMode.READ)
    held.wait()
    with pytest.raises(Exception, match="working copy"):
        store.exchange_slots("home", "spare")  # the spare is not at rest
    held.release().result()
    lease.release().result()
    store.exchange_slots("home", "spare")


def test_two_leases_share_a_working_copy_until_the_last_release(store):
    """Two leases of one paged shard share its working copy: the first release must not free it under the
    second (its buffer would go to the next shard read, and the second holder would read that shard's bytes).
    An UPDATE holder's release writes home while a reader still holds the copy."""
    x, y = torch.randn(N), torch.randn(N)
    store.register("a", N, home="nvme", init=x).result()
    store.register("b", N, home="nvme", init=y).result()
    first = store.lease("a", "cpu", LeaseMode.UPDATE)
    second = store.lease("a", "cpu", LeaseMode.READ)
    first.wait().add_(1)
    first.release().result()  # written home; the copy stays for `second`
    assert store.residency("a") is R.CPU
    other = store.lease("b", "cpu", LeaseMode.READ)  # would take the freed buffer
    assert torch.equal(other.wait(), y)
    assert torch.equal(second.wait(), x + 1)
    other.release().result()
    second.release().result()
    assert store.residency("a") is R.NVME and store.stats()["cpu"]["bytes_in_use"] == 0
    assert torch.equal(_read(store, "a"), x + 1)


def test_a_lease_taken_while_the_last_one_is_being_released_keeps_the_copy(store):
    """The last holder's release is decided (no other lease), then another lease is taken and its fetch queued
    (the plan still the working copy: it returns that copy), and only then is the release queued, behind that
    fetch. The release must see the new lease and keep the copy: it freed it, and the new holder read whatever
    the next shard put in that range."""
    x = torch.full((N,), 7.0)
    store.register("a", N, home="nvme", init=x).result()
    first = store.lease("a", "device", LeaseMode.READ)
    first.wait()
    shard = store._get("a")
    with store._lock:  # first.release(), its first half: the count falls to 0, not shared
        shard.leases -= 1
    second = store.lease("a", "device", LeaseMode.READ)  # counted, its fetch queued: returns the copy
    held = second.wait()
    store.release("a", unless_leased=True).result()  # first.release(), its second half, queued behind
    assert store.residency("a") is R.DEVICE
    store.register("b", N, home="device", init=torch.full((N,), -1.0)).result()  # would take a freed range
    assert torch.equal(held, x)
    second.release().result()
    assert store.residency("a") is R.NVME and store.stats()["device"]["bytes_in_use"] == page_bytes(4 * N)  # b's


@pytest.mark.parametrize("first,second,want", [
    (LeaseMode.UPDATE, LeaseMode.UPDATE, 2.0),     # device +1, then home +1
    (LeaseMode.OVERWRITE, LeaseMode.UPDATE, 8.0),  # device := 7, then home +1
    (LeaseMode.UPDATE, LeaseMode.OVERWRITE, 7.0),  # device +1, then home := 7
    (LeaseMode.READ, LeaseMode.UPDATE, 1.0),       # device read, then home +1
], ids=["update-update", "overwrite-update", "update-overwrite", "read-update"])
def test_a_home_lease_taken_while_a_device_lease_is_released_keeps_its_writes(store, first, second, want):
    """A cpu-homed shard leased to the device, released (its write-back slowed, so still in flight), then leased
    home. The release keeps the device copy for the lease taken meanwhile; the home lease must take it home and drop
    it. It returned the home copy and left the device copy in place: the home lease's release wrote that stale copy
    home, over the home lease's writes (and a later device lease would have read it)."""
    store.register("a", N, home="cpu", init=torch.zeros(N)).result()
    with inject.delay(Queue.COPY, 0.05):
        lease = store.lease("a", "device", first)
        t = lease.wait()
        if first is LeaseMode.UPDATE:
            t.add_(1)
        elif first is LeaseMode.OVERWRITE:
            t.fill_(7)
        lease.release()
        home = store.lease("a", "cpu", second)
        t = home.wait()
        if second is LeaseMode.UPDATE:
            assert torch.equal(t, torch.full((N,), want - 1)), "the home lease did not see the device lease's bytes"
            t.add_(1)
        else:
            t.fill_(7)
        home.release()
        store.wait_all()
    assert store.residency("a") is R.CPU and store.stats()["device"]["bytes_in_use"] == 0
    assert torch.equal(_read(store, "a"), torch.full((N,), want))
    again = store.lease("a", "device", LeaseMode.READ)  # a later device lease reads the home bytes, not a kept copy
    assert torch.equal(again.wait(), torch.full((N,), want))
    again.release().result()


def test_a_lease_taken_while_the_last_release_is_in_flight_fits_a_budget_of_one_copy(tmp_path):
    """A device budget of one copy. Released with its write-back slowed, then leased again: the new lease's fetch
    brings its own copy, so the release must drop the old one. It kept it for the lease counted meanwhile (decided
    when the move ran): the fetch waited for the budget that copy held (a hang, or an ArenaBusyError after
    alloc_timeout), and the copy stayed in the device tier with no lease holding it."""
    with TieredStore(StoreConfig(device_budget=N * 4 + 4096, cpu_budget="2MiB", nvme_budget="64MiB",
                                 nvme_path=str(tmp_path / "swap"), io_workers=4, alloc_timeout=10)) as st:
        st.register("a", N, home="cpu", init=torch.zeros(N)).result()
        with inject.delay(Queue.COPY, 0.2):
            first = st.lease("a", "device", LeaseMode.UPDATE)
            first.wait().add_(1)
            first.release()  # the write-back in flight
            second = st.lease("a", "device", LeaseMode.READ)
            assert torch.equal(second.wait(), torch.ones(N))
            second.release()
            st.wait_all()
        assert st.residency("a") is R.CPU and st.stats()["device"]["bytes_in_use"] == 0


def test_a_release_without_room_for_its_write_back_stays_held_and_is_retried(tmp_path):
    """Two device leases of an nvme-homed shard; the first's release needs a cpu staging buffer and the cpu tier is
    full: it raises, and the lease is still held (it was uncounted first: releasing it again freed the copy under
    the second holder, whose release then wrote nothing: the first's change was lost)."""
    n = 1024  # 4 KiB: one page, the whole cpu budget
    with TieredStore(StoreConfig(device_budget="1MiB", cpu_budget=4096, nvme_budget="16MiB",
                                 nvme_path=str(tmp_path / "swap"), io_workers=4, alloc_timeout=0.3)) as st:
        for name in ("a", "b"):
            st.register(name, n, home="nvme", init=torch.zeros(n)).result()
        first, second = st.lease("a", "device", LeaseMode.UPDATE), st.lease("a", "device", LeaseMode.READ)
        first.wait().add_(1)
        held = second.wait()
        other = st.lease("b", "cpu", LeaseMode.READ)  # takes the whole cpu tier
        other.wait()
        with pytest.raises(ArenaBusyError):
            first.release()
        other.release().result()
        first.release().result()  # again, with room: written home; the copy stays for `second`
        assert st.residency("a") is R.DEVICE and torch.equal(held, torch.ones(n))
        second.release().result()
        st.wait_all()
        assert st.residency("a") is R.NVME and torch.equal(_read(st, "a"), torch.ones(n))


@pytest.mark.parametrize("home,first,second", [("cpu", "device", "cpu"), ("cpu", "cpu", "device"),
                                               ("nvme", "device", "cpu"), ("nvme", "cpu", "device")])
def test_leases_of_one_shard_held_at_once_in_two_tiers_are_refused(store, home, first, second):
    """Leases held at once share one working copy, so a second tier is refused with the fix. It moved the copy:
    the first holder's later writes were lost, and its buffer (freed by the move) went to the next shard leased."""
    store.register("a", N, home=home, init=torch.zeros(N)).result()
    held = store.lease("a", first, LeaseMode.UPDATE)
    held.wait().add_(1)
    with pytest.raises(StoreError, match=f"release the {first} lease first"):
        store.lease("a", second, LeaseMode.UPDATE)
    held.release().result()
    again = store.lease("a", second, LeaseMode.UPDATE)  # once released, any tier
    assert torch.equal(again.wait(), torch.ones(N))
    again.release().result()


def test_a_home_lease_counted_while_the_device_lease_is_being_released_gets_the_device_copys_bytes(store):
    """The order where the release keeps the device copy for a home lease: the device lease's release is decided
    (the count falls to 0), then a home lease is counted and its fetch queued, and only then is the release asked,
    so it keeps the copy (a lease is counted). The home fetch, queued behind it, must take that copy home and drop
    it: it handed out the home copy and left the device copy, whose write-back later overwrote the home lease's
    writes."""
    store.register("a", N, home="cpu", init=torch.zeros(N)).result()
    first = store.lease("a", "device", LeaseMode.UPDATE)
    first.wait().add_(1)
    shard = store._get("a")
    with store._lock:  # first.release(), its first half: the count falls to 0, not shared
        shard.leases -= 1
    home = store.lease("a", "cpu", LeaseMode.UPDATE)  # counted, its fetch queued
    store.release("a", writeback=True, unless_leased=True)  # first.release(), its second half: keeps the copy
    t = home.wait()
    assert torch.equal(t, torch.ones(N)) and store.residency("a") is R.CPU  # the device copy came home and went
    t.add_(1)
    home.release().result()
    store.wait_all()
    assert torch.equal(_read(store, "a"), torch.full((N,), 2.0)) and store.stats()["device"]["bytes_in_use"] == 0


@pytest.mark.parametrize("home", ["cpu", "device"])
def test_a_home_lease_with_nothing_moving_is_the_home_copy_and_queues_no_move(store, home):
    """The per-unit fast path (issue 42): a memory-homed shard with no working copy and no move in flight, leased in
    its home tier, is handed its home copy at once and released at once: no move is queued for either (they queued
    two moves that did nothing, a future and a chain step each, several times a unit a step). Once a move is in
    flight (a device working copy), the home lease waits behind it as before."""
    store.register("a", N, home=home, init=torch.zeros(N)).result()
    shard = store._get("a")
    before = shard.last
    lease = store.lease("a", home, LeaseMode.UPDATE)
    assert lease.ready()
    lease.wait().add_(1)
    assert lease.release().done() and shard.last is before  # nothing queued
    again = store.lease("a", home, LeaseMode.READ)
    assert torch.equal(again.wait(), torch.ones(N))
    again.release()
    if home == "cpu":  # a device working copy: the next home lease is queued behind its write-back and sees it
        with inject.delay(Queue.COPY, 0.05):
            dev = store.lease("a", "device", LeaseMode.UPDATE)
            dev.wait().add_(1)
            dev.release()
            back = store.lease("a", "cpu", LeaseMode.UPDATE)
            assert torch.equal(back.wait(), torch.full((N,), 2.0))
            back.release().result()
    assert store.stats()["device"]["bytes_in_use"] == (page_bytes(4 * N) if home == "device" else 0)
