"""Launch the ranks of a multi-rank test as `torchrun --standalone --nproc_per_node N` would, without its agent.

Why: torchrun's launcher process imports torch and the elastic agent and runs a rendezvous before any rank starts:
about 2.5 s of CPU a launch (3 s of wall on a loaded 2-core VM, measured with a script that only joins a gloo
group), and a suite run makes dozens of 2-rank launches. Here the ranks start at once.

What the ranks see is what torchrun gives them: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS=1 unless set, and, as under torchrun, a
TCPStore hosted by the launcher (this process), TORCHELASTIC_USE_AGENT_STORE=True: every rank joins it as a client,
so no rank binds a port and there is no race for a free one. As torchrun does, the first rank to exit non-zero
stops the others (SIGTERM, then SIGKILL after `grace_s`), and the launch's exit status is 1 if any rank failed.
Each rank runs in a session of its own, as under torchrun.
Unlike torchrun, each rank writes to files of its own, and the result's stdout and stderr are theirs joined whole:
stdout in rank order, stderr in rank order with the ranks that failed last (their tracebacks are what a test's
`stderr[-4000:]` shows). Under torchrun the ranks share one stdout, and two ranks' `print`s can interleave within a
line (`print` writes the text and the newline apart when the stream is unbuffered: CI once read
"WORST 0 2.1e-06WORST 1 2.1e-06" as one line).

Tests of torchrun itself (`offload finetune` under torchrun, the launcher naming a dead rank) still run torchrun.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from torch.distributed import TCPStore


def launch(args: list[str], nproc: int, env: dict | None = None, timeout: float = 600,
           grace_s: float = 30.0) -> subprocess.CompletedProcess:
    """Run `python args...` as `nproc` ranks of one group; returns their exit (0 if every rank exited 0, else 1)
    and their stdout and stderr as text. Raises subprocess.TimeoutExpired past `timeout`, the ranks killed."""
    store, joins = hosted_store()  # held until the ranks are gone
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    base.update(joins, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    outs = [tempfile.TemporaryFile("w+") for _ in range(nproc)]
    errs = [tempfile.TemporaryFile("w+") for _ in range(nproc)]
    try:
        # Each rank in a session of its own, as torchrun starts them: where the kernel groups CPU time by session
        # (autogroup), 8 ranks in one session would share one session's time against every other session's
        procs = [subprocess.Popen([sys.executable, *args], stdout=outs[r], stderr=errs[r], start_new_session=True,
                                  env=dict(base, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r)))
                 for r in range(nproc)]
        deadline, stop_at = time.monotonic() + timeout, None
        try:
            while [p.poll() for p in procs].count(None):  # every rank polled (any() would stop at the first live one)
                now = time.monotonic()
                if now > deadline:
                    raise subprocess.TimeoutExpired(args, timeout)
                failed = any(p.returncode not in (None, 0) for p in procs)
                if failed and stop_at is None:  # torchrun's rule: one rank failed, the rest are stopped
                    stop_at = now + grace_s
                    _signal(procs, signal.SIGTERM)
                elif stop_at is not None and now > stop_at:
                    _signal(procs, signal.SIGKILL)
                time.sleep(0.02)
        finally:
            _signal(procs, signal.SIGKILL)
            for p in procs:
                p.wait()
            del store
        code = 0 if all(p.returncode == 0 for p in procs) else 1
        stderr_order = sorted(range(nproc), key=lambda r: (procs[r].returncode != 0, r))  # failed ranks last
        return subprocess.CompletedProcess(args, code, "".join(_read(f) for f in outs),
                                           "".join(_read(errs[r]) for r in stderr_order))
    finally:
        for f in outs + errs:
            f.close()


def hosted_store() -> tuple[TCPStore, dict[str, str]]:
    """A TCPStore this process hosts on a port the kernel picks, and the environment that makes every rank join it
    as a client (torchrun's agent store). Keep the store alive until the ranks are gone. No rank binds a port, so
    there is no race for one: a port probed free and handed to rank 0 can be taken before rank 0 binds it."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _read(f) -> str:
    f.seek(0)
    return f.read()


def _signal(procs: list[subprocess.Popen], sig: int) -> None:
    """`sig` to each live rank and whatever it started (its session's process group)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:  # (exited since the poll)
                pass
