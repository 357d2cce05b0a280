"""TieredStore overhead over the raw aio engine, side by side, interleaved rounds, one process.

K shards of S bytes live in one swap file. Per round:
  store read   fetch(name, "cpu") for all K at once, wait for all    (NVME -> CPU, arena buffers)
  raw read     AioEngine.read_many of the same K slots into aligned buffers
  store write  release(name, writeback=True) for all K, wait         (CPU -> NVME)
  raw write    AioEngine.write_many of the same K slots
GB/s = K*S / time; "median / best" over the rounds. The swap file is opened O_DIRECT (no page cache)
unless the filesystem refuses it.

    PYTHONPATH=. python benchmarks/bench_store.py --path /tmp/offload-bench --shards 64 --shard-size 4MiB --rounds 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from offload.store import StoreConfig, TieredStore, parse_size
from offload.store.aio import AioEngine, aligned_empty


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", default="/tmp/offload-bench-store")
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--shard-size", default="4MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--io-workers", type=int, default=16)
    args = ap.parse_args()
    size = parse_size(args.shard_size)
    k = args.shards
    total = k * size
    cfg = StoreConfig(device_budget="64MiB", cpu_budget=total + (64 << 20), nvme_budget=total + (64 << 20),
                      nvme_path=args.path, io_workers=args.io_workers)
    t = {"store read": [], "raw read": [], "store write": [], "raw write": []}
    with TieredStore(cfg) as st:
        names = [f"s{i}" for i in range(k)]
        for i, n in enumerate(names):
            st.register(n, size, torch.uint8, home="nvme", init=torch.full((size,), i % 251, dtype=torch.uint8))
        st.wait_all()
        swap = st._shards[names[0]].swap
        eng = AioEngine()
        f = eng.open(swap.path, "r+")
        bufs = [aligned_empty(size) for _ in range(k)]
        slots = [st._shards[n].slot for n in names]

        def store_read():
            for fu in [st.fetch(n, "cpu") for n in names]:
                fu.result()

        def store_write():
            for n in names:
                st.release(n, writeback=True)
            st.wait_all()

        def raw_read():
            eng.read_many([(f, off, b) for off, b in zip(slots, bufs)]).wait()

        def raw_write():
            eng.write_many([(f, off, b) for off, b in zip(slots, bufs)]).wait()

        for r in range(args.rounds):
            pairs = [("store read", store_read), ("raw read", raw_read)]
            if r % 2:
                pairs.reverse()
            for name, fn in pairs:
                t0 = time.perf_counter()
                fn()
                t[name].append(time.perf_counter() - t0)
            raw_read()  # the raw buffers now hold the same bytes the store holds: writes below are equivalent
            pairs = [("store write", store_write), ("raw write", raw_write)]
            if r % 2:
                pairs.reverse()
            for name, fn in pairs:
                if name == "store write":
                    store_read()  # store_write needs working copies; not timed
                t0 = time.perf_counter()
                fn()
                t[name].append(time.perf_counter() - t0)
        for i, n in enumerate(names):  # integrity after all that
            assert int(st.fetch(n, "cpu").result()[0]) == i % 251
        f.close()
        eng.close()
        print(f"# {k} shards x {args.shard_size}, swap file on {args.path} (direct={swap.file.direct}), "
              f"io_workers={args.io_workers}, load average {os.getloadavg()[0]:.1f}; GB/s median / best")
        for name, v in t.items():
            print(f"{name:<12} {total / statistics.median(v) / 1e9:6.2f} / {total / min(v) / 1e9:6.2f}")
        for op in ("read", "write"):
            med = statistics.median(t[f"raw {op}"]) / statistics.median(t[f"store {op}"])
            best = min(t[f"raw {op}"]) / min(t[f"store {op}"])
            print(f"store/raw {op}: {med:.2f}x median, {best:.2f}x best")


if __name__ == "__main__":
    main()
