"""offload/dir_lock.py: a directory held by a live process, refused to others with its pid; the swap
directories of dead runs (kill -9) found and removed at the next start, and nothing else removed.

Every owner here is a real process holding a real flock; "dead" is a process killed with SIGKILL."""
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offload.dir_lock import LOCK_NAME, DirectoryInUse, DirLock, Owner, owner_of, remove_stale

SWAP = "offload swap"


def _holder(directory: Path, what: str, files: int = 0) -> subprocess.Popen:
    """A process that fills `directory` with `files` MiB, takes its lock for `what`, says so and sleeps."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from offload.dir_lock import DirLock
        os.makedirs({str(directory)!r}, exist_ok=True)
        for i in range({files}):
            with open(os.path.join({str(directory)!r}, f"rank0-{{i}}.swap"), "wb") as f:
                f.write(os.urandom(1 << 20))
        lock = DirLock.acquire({str(directory)!r}, {what!r})
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def test_a_live_owner_is_named_and_a_dead_one_is_not(tmp_path):
    d = tmp_path / "out"
    proc = _holder(d, "offload finetune --output")
    try:
        with pytest.raises(DirectoryInUse) as refused:
            DirLock.acquire(d, "a second run")
        assert refused.value.owner == Owner(proc.pid, socket.gethostname(), "offload finetune --output")
        assert f"pid {proc.pid}" in str(refused.value)
        assert owner_of(d).pid == proc.pid
    finally:
        _kill9(proc)
    assert owner_of(d) is None  # the kernel dropped the dead process's lock
    with DirLock.acquire(d, "the next run") as lock:
        assert lock.previous.pid == proc.pid  # what the dead owner left
        assert (d / LOCK_NAME).exists()
    assert not (d / LOCK_NAME).exists()  # released: no litter in the user's directory


def test_a_directory_made_for_the_lock_goes_when_left_empty(tmp_path):
    with DirLock.acquire(tmp_path / "new" / "out", "x"):
        assert (tmp_path / "new" / "out").is_dir()
    assert not (tmp_path / "new" / "out").exists()
    kept = tmp_path / "kept"
    with DirLock.acquire(kept, "x"):
        (kept / "model.safetensors").write_bytes(b"weights")
    assert (kept / "model.safetensors").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    DirLock.acquire(existing, "x").release()
    assert existing.is_dir()  # it was the user's before the run


def test_one_holder_at_a_time_under_contention(tmp_path):
    """Four processes take and release the lock 150 times each, sleeping at random inside and outside it
    (the slow queue that shows a missing check): the log they append to never shows two inside at once,
    including across a release that removes the file another process has just opened."""
    log = tmp_path / "log"
    code = textwrap.dedent(f"""
        import os, random, sys, time
        from offload.dir_lock import DirLock, DirectoryInUse
        random.seed(os.getpid())
        done = 0
        while done < 150:
            try:
                lock = DirLock.acquire({str(tmp_path / 'd')!r}, "contention")
            except DirectoryInUse:
                time.sleep(random.random() * 1e-3)
                continue
            with open({str(log)!r}, "a") as f:
                f.write(f"in {{os.getpid()}}\\n")
            time.sleep(random.random() * 2e-4)
            with open({str(log)!r}, "a") as f:
                f.write(f"out {{os.getpid()}}\\n")
            lock.release()
            done += 1
    """)
    (tmp_path / "d").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(4)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    lines = log.read_text().split("\n")[:-1]
    assert len(lines) == 4 * 150 * 2
    for enter, leave in zip(lines[::2], lines[1::2]):
        assert enter.startswith("in ") and leave == "out " + enter[3:], (enter, leave)


def test_a_dead_runs_swap_is_removed_and_said(tmp_path, caplog):
    live, dead, output, unlocked = (tmp_path / n for n in ("offload-1-rank0-a", "offload-2-rank0-b",
                                                              "offload-finetune-out", "offload-3-rank0-c"))
    keep_alive = _holder(live, SWAP, files=1)
    killed = _holder(dead, SWAP, files=3)
    run = _holder(output, "offload finetune --output")  # a fine-tune's output whose run died: never swap
    unlocked.mkdir()  # a run between mkdtemp and its lock, or an older version's: left alone
    (unlocked / "rank0-params.swap").write_bytes(b"x")
    _kill9(killed)
    _kill9(run)
    try:
        with caplog.at_level(logging.WARNING, logger="offload"):
            stale = remove_stale(tmp_path, "offload-", SWAP)
    finally:
        _kill9(keep_alive)
    assert [(s.path, s.owner.pid, s.removed) for s in stale] == [(dead, killed.pid, True)]
    assert stale[0].nbytes >= 3 << 20
    assert not dead.exists()
    assert live.is_dir() and output.is_dir() and unlocked.is_dir()
    assert owner_of(output) is None and (output / LOCK_NAME).exists()  # its record stays for the next look
    assert f"pid {killed.pid}" in caplog.text and "3.0" in caplog.text and str(dead) in caplog.text


def test_another_hosts_dead_swap_is_reported_not_removed(tmp_path, caplog):
    """On a drive shared between hosts a free lock says nothing about the other host's run."""
    d = tmp_path / "offload-9-rank0-z"
    d.mkdir()
    fd = os.open(d / LOCK_NAME, os.O_CREAT | os.O_WRONLY)
    os.write(fd, b'{"pid": 9, "host": "another-host", "what": "offload swap"}')
    os.close(fd)
    with caplog.at_level(logging.WARNING, logger="offload"):
        stale = remove_stale(tmp_path, "offload-", SWAP)
    assert [(s.removed, s.owner.host) for s in stale] == [(False, "another-host")]
    assert d.is_dir() and "another-host" in caplog.text
    assert remove_stale(tmp_path, "offload-", SWAP)[0].owner.host == "another-host"  # still found next time
