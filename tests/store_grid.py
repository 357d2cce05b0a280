"""The leases grid, shared by the CPU and GPU store tests: 108 shards (home device / cpu / nvme, six sizes), each
leased to the device or the cpu tier as READ / UPDATE / OVERWRITE for 3 rounds, with every lease of a round issued
before the first is waited and every release left in flight (no wait between rounds either), and `expected`, the
same sequence replayed on plain tensors: the bytes the store must end with, whatever its timing."""
from __future__ import annotations

import torch

from offload.store import LeaseMode, TieredStore

SIZES = [1, 3, 1023, 4096, 4097, 65_537]
HOMES = ("device", "cpu", "nvme")
ROUNDS = 3
PER_HOME = 36  # x 3 homes: 108 shards, each leased, changed and released every round with nothing waited between


def rand(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _shards(dtype: torch.dtype):
    """(name, home, numel, initial bytes, {round: OVERWRITE's bytes}) of every shard, in registration order."""
    out = []
    for home in HOMES:
        for i in range(PER_HOME):
            k = len(out) + 1
            n = SIZES[i % len(SIZES)]
            out.append((f"{home}-{i}", home, n, rand(n, dtype, 10_000 + k),
                        {rnd: rand(n, dtype, 20_000 + 97 * rnd + k) for rnd in range(ROUNDS)}))
    return out


def _step(rnd: int, i: int, home: str) -> tuple[LeaseMode, str]:
    """Round rnd's lease of the i-th shard: its mode and tier (a device home is always leased to the device)."""
    mode = (LeaseMode.UPDATE, LeaseMode.OVERWRITE, LeaseMode.READ)[(rnd + i) % 3]
    return mode, ("device" if home == "device" or (7 * rnd + i) % 2 == 0 else "cpu")


def _change(t: torch.Tensor, rnd: int, i: int) -> None:
    if (rnd + i) % 2:
        t.mul_(-2)
    else:
        t.add_(1)


def run(st: TieredStore, dtype: torch.dtype) -> dict:
    """The grid on a store: the changes run on the leased tier's device (GPU kernels on the current stream for a
    device lease, queued, never synchronized). Returns every shard's final home bytes and the READ leases'
    snapshots, on the host, with the store's stats."""
    dev = st.device
    shards = _shards(dtype)
    for k, (name, home, n, init, _) in enumerate(shards):
        st.register(name, n, dtype, home=home, tier_class="optim" if k % 2 else "params", init=init)
    patterns = {(rnd, name): (over[rnd].to(dev), over[rnd])  # already where they are written: no copy in the loop
                for name, _, _, _, over in shards for rnd in range(ROUNDS)}
    st.wait_all()
    homes = st.stats()["device"]["bytes_in_use"]  # the device-homed shards' own buffers
    snaps = {}
    for rnd in range(ROUNDS):
        leases = {}
        for i, (name, home, *_) in enumerate(shards):
            mode, tier = _step(rnd, i, home)
            leases[name] = (st.lease(name, tier, mode), mode, tier)
        for i, (name, (lease, mode, tier)) in enumerate(leases.items()):
            t = lease.wait()
            if mode is LeaseMode.UPDATE:
                _change(t, rnd, i)
            elif mode is LeaseMode.OVERWRITE:
                on_dev, on_host = patterns[(rnd, name)]  # by the leased tier: on a CPU store both are host tensors
                t.copy_(on_dev if tier == "device" else on_host)
            else:
                snaps[(rnd, name)] = t.clone()  # read on the current stream: the release must not free it under us
            lease.release()  # the write-behind's future is not waited
    st.wait_all()
    final = {}
    for name, home, *_ in shards:
        lease = st.lease(name, "device" if home == "device" else "cpu", LeaseMode.READ)
        final[name] = lease.wait().cpu().clone()
        lease.release()
    st.wait_all()
    return {"final": final, "snaps": {k: v.cpu() for k, v in snaps.items()}, "stats": st.stats(), "homes": homes}


def expected(dtype: torch.dtype) -> dict:
    """The grid replayed on plain host tensors, one lease at a time: {"final", "snaps"} as run() returns them."""
    shards = _shards(dtype)
    value = {name: init.clone() for name, _, _, init, _ in shards}
    snaps = {}
    for rnd in range(ROUNDS):
        for i, (name, home, _, _, over) in enumerate(shards):
            mode, _ = _step(rnd, i, home)
            if mode is LeaseMode.UPDATE:
                _change(value[name], rnd, i)
            elif mode is LeaseMode.OVERWRITE:
                value[name] = over[rnd].clone()
            else:
                snaps[(rnd, name)] = value[name].clone()
    return {"final": value, "snaps": snaps}


def differing(got: dict, want: dict) -> list:
    """The shards (and READ snapshots) whose bytes differ between two grids."""
    bad = [k for k in want["final"] if not same(got["final"][k], want["final"][k])]
    return bad + [k for k in want["snaps"] if not same(got["snaps"][k], want["snaps"][k])]
