"""Seconds to mlock a fresh mapping of N GiB (argv[1], default 4): alone (the kernel faults every page in on one
thread), and after offload.store.arena.prefault with 1 and 2 threads; medians of 3 interleaved rounds. Needs the
right to lock that much (root or CAP_IPC_LOCK).

    python benchmarks/bench_prefault.py 4
"""
import ctypes, mmap, statistics, sys, time
import torch
from offload.store.arena import _libc, prefault
N = int(sys.argv[1]) << 30 if len(sys.argv) > 1 else 4 << 30
libc = _libc()
res = {"mlock alone": [], "prefault 1 thread + mlock": [], "prefault 2 threads + mlock": []}
for r in range(3):
    for name in res:
        m = mmap.mmap(-1, N, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(m, dtype=torch.uint8); ptr = t.data_ptr()
        t0 = time.perf_counter()
        if "prefault" in name:
            p = prefault(ptr, N, threads=1 if "1 thread" in name else 2)
        t1 = time.perf_counter()
        assert libc.mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(N)) == 0, ctypes.get_errno()
        t2 = time.perf_counter()
        res[name].append((t2 - t0, t1 - t0, t2 - t1))
        libc.munlock(ctypes.c_void_p(ptr), ctypes.c_size_t(N)); del t; m.close()
for name, v in res.items():
    tot = statistics.median(x[0] for x in v); pf = statistics.median(x[1] for x in v); ml = statistics.median(x[2] for x in v)
    print(f"{name:28s} total {tot:.3f} s (prefault {pf:.3f}, mlock {ml:.3f})  GiB/s {N/2**30/tot:.2f}")
