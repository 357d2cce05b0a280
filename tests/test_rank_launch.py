"""The test launcher (tests/rank_launch.py): what the ranks see, what comes back, a failed rank stopping the rest."""
import textwrap
import time

import rank_launch


def _script(tmp_path, code: str):
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(code))
    return [str(path), str(tmp_path)]


def test_each_ranks_lines_come_back_whole_even_when_their_writes_interleave(tmp_path):
    """Rank 0 writes half a line, rank 1 a whole line, then rank 0 its newline (ordered by flag files): sharing one
    stream this reads "half-0 line-1" on one line (how CI once lost a rank's result); each rank's own file keeps
    every line whole, in rank order."""
    args = _script(tmp_path, """
        import os, sys, time
        from pathlib import Path
        rank, tmp = int(os.environ["RANK"]), Path(sys.argv[1])
        def wait(name):
            while not (tmp / name).exists():
                time.sleep(0.01)
        if rank == 0:
            sys.stdout.write("half-0"); sys.stdout.flush(); (tmp / "half").touch()
            wait("whole"); sys.stdout.write(" done\\n"); sys.stdout.flush()
        else:
            wait("half"); sys.stdout.write("line-1\\n"); sys.stdout.flush(); (tmp / "whole").touch()
    """)
    out = rank_launch.launch(args, 2, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["half-0 done", "line-1"]


def test_the_ranks_see_torchruns_environment(tmp_path):
    args = _script(tmp_path, """
        import os
        print(" ".join(os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                               "TORCHELASTIC_USE_AGENT_STORE")), os.getsid(0) == os.getpid())
    """)
    out = rank_launch.launch(args, 3, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{r} {r} 3 3 True True" for r in range(3)]  # each in a session of its own


def test_a_failed_rank_stops_the_others_and_its_traceback_comes_last(tmp_path):
    """Rank 1 raises at once; rank 0 would sleep 5 minutes: it is stopped (torchrun's rule), the launch fails, and
    rank 1's traceback ends stderr, after rank 0's words."""
    args = _script(tmp_path, """
        import os, sys, time
        from pathlib import Path
        said = Path(sys.argv[1]) / "said"
        if os.environ["RANK"] == "1":
            while not said.exists():  # rank 0 has spoken before rank 1 fails (else SIGTERM may come first)
                time.sleep(0.01)
            raise SystemExit("rank 1 gave up")
        print("rank 0 waits", file=sys.stderr, flush=True)
        said.touch()
        time.sleep(300)
    """)
    start = time.monotonic()
    out = rank_launch.launch(args, 2, timeout=120, grace_s=5)
    assert out.returncode == 1
    assert time.monotonic() - start < 60
    assert out.stderr.rstrip().endswith("rank 1 gave up"), out.stderr
    assert "rank 0 waits" in out.stderr

