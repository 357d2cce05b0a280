"""offload/dir_lock.py: a directory held by a live process, refused to others with its pid; the swap
directories of dead runs (kill -9) found and removed at the next start, and nothing else removed.

Every owner here is a real process holding a real flock; "dead" is a process killed with SIGKILL."""
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from offload.dir_lock import LOCK_NAME, DirectoryInUse, DirLock, Owner, boot_id, make_locked_dir, owner_of, remove_stale

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
        assert refused.value.owner == Owner(proc.pid, socket.gethostname(), "offload finetune --output", boot_id())
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
    with DirLock.acquire(tmp_path / "new" / "deeper" / "out", "x"):
        assert (tmp_path / "new" / "deeper" / "out").is_dir()
    assert not (tmp_path / "new").exists()  # every directory it made, not only the last
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
    live, dead, output, unlocked, unrecorded = (tmp_path / n for n in (
        "offload-1-rank0-a", "offload-2-rank0-b", "offload-finetune-out", "offload-3-rank0-c", "offload-4-rank0-d"))
    holders = []
    try:
        holders.append(_holder(live, SWAP, files=1))
        holders.append(_holder(dead, SWAP, files=3))
        holders.append(_holder(output, "offload finetune --output"))  # a fine-tune's output whose run died: not swap
        unlocked.mkdir()  # an older version's run directory: no lock file, left alone
        (unlocked / "rank0-params.swap").write_bytes(b"x")
        unrecorded.mkdir()  # its owner died between taking the lock and writing its record
        (unrecorded / LOCK_NAME).write_bytes(b"")
        keep_alive, killed, run = holders
        _kill9(killed)
        _kill9(run)
        with caplog.at_level(logging.WARNING, logger="offload"):
            stale = remove_stale(tmp_path, "offload-", SWAP)
    finally:
        for p in holders:
            p.kill()
            p.wait()
    assert [(s.path, s.owner.pid, s.removed) for s in stale] == [(dead, killed.pid, True)]
    assert stale[0].nbytes >= 3 << 20
    assert not dead.exists()
    assert live.is_dir() and output.is_dir() and unlocked.is_dir() and unrecorded.is_dir()
    assert not (unlocked / LOCK_NAME).exists()  # a look makes no lock file a run making the directory could find taken
    assert (unrecorded / LOCK_NAME).exists()  # nor removes one
    assert owner_of(output) is None and (output / LOCK_NAME).exists()  # its record stays for the next look
    assert f"pid {killed.pid}" in caplog.text and "3.0" in caplog.text and str(dead) in caplog.text


def test_another_kernels_dead_swap_is_reported_not_removed(tmp_path, caplog):
    """On a drive shared between nodes a free lock says nothing about another node's run: its flocks may not
    reach this kernel (what counts is the boot, not the host name, which containers share or change)."""
    d = tmp_path / "offload-9-rank0-z"
    d.mkdir()
    (d / LOCK_NAME).write_text('{"pid": 9, "host": "node-2", "what": "offload swap", "boot": "another-boot"}')
    with caplog.at_level(logging.WARNING, logger="offload"):
        stale = remove_stale(tmp_path, "offload-", SWAP)
    assert [(s.removed, s.owner.host) for s in stale] == [(False, "node-2")]
    assert d.is_dir() and "node-2" in caplog.text
    assert remove_stale(tmp_path, "offload-", SWAP)[0].owner.host == "node-2"  # still found next time


def test_a_new_directory_is_locked_before_it_shows(tmp_path):
    """Made under a hidden name, locked, then renamed: a scan (another rank's start-up) never sees it
    unlocked, and never takes its lock file first."""
    path, lock = make_locked_dir(tmp_path, "offload-5-rank0-", SWAP)
    try:
        assert path.name.startswith("offload-5-rank0-") and path.parent == tmp_path
        assert (path.stat().st_mode & 0o777) == 0o700
        assert owner_of(path).pid == os.getpid() and lock.directory == path
        assert remove_stale(tmp_path, "offload-", SWAP) == [] and path.is_dir()
    finally:
        lock.release()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the directory is the caller's to remove


def test_a_directory_this_user_cannot_look_into_is_skipped():
    """Another user's run directory (mode 0700) made the look raise PermissionError, which stopped every
    other user's start-up on a shared /tmp. Run as an unprivileged user where this test runs as root."""
    if os.getuid() != 0:
        pytest.skip("needs root, to make a directory another user cannot enter")
    shared = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path sits under a 0700 directory of root's
    try:
        shared.chmod(0o755)
        theirs = shared / "offload-6-rank0-e"
        theirs.mkdir(mode=0o700)
        (theirs / LOCK_NAME).write_text('{"pid": 6, "host": "h", "what": "offload swap", "boot": ""}')
        code = textwrap.dedent(f"""
            import os
            from offload.dir_lock import remove_stale  # imported first: the interpreter's files may be root's alone
            os.setgid(65534); os.setuid(65534)  # nobody
            print(remove_stale({str(shared)!r}, "offload-", "offload swap"))
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-3000:]
        assert theirs.is_dir()
    finally:
        shutil.rmtree(shared)


def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    """Another user makes offload-finetune-x/ under a shared parent and puts a `.offload-lock` symlink in it
    pointing at a file of ours: the cleanup's look took the lock through the link and emptied that file."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious data\n" * 100)
    planted = tmp_path / "parent" / "offload-finetune-x"
    planted.mkdir(parents=True)
    (planted / LOCK_NAME).symlink_to(victim)
    assert remove_stale(tmp_path / "parent", "offload-finetune-", "offload swap") == []
    with pytest.raises(OSError):
        DirLock.acquire(planted, "a run")
    assert victim.read_text() == "precious data\n" * 100
