"""Each rank's collective sequence, compared across ranks after a multi-rank test (issue 44).

A rank that issues a collective another does not, or the same ones in another order or size, hangs on NCCL or
pairs wrongly; on gloo a small mismatch can still finish. So every multi-rank CPU test records what each rank
issued through offload/zero/collectives/comm.py, (group, op, numel, dtype) in issue order, and the test compares
the ranks' lists once they have exited:

    record(prefix)                  in each rank, first: records until the process exits, then writes
                                    {prefix}.rank{RANK}.json (write(prefix, rank, recorder): the same, now)
    assert_same_sequences(prefix)   in the test, after the ranks exited: every rank's list equal, else an
                                    AssertionError naming the first collective where two ranks differ

Written at exit (atexit), not exchanged over the group: the ranks' own group may be gone or broken by then.
"""
from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

_open: list = []


def record(prefix: str) -> None:
    from offload.zero.collectives import comm

    context = comm.recording()
    _open.append(context)  # held: a context manager collected closes its generator, and the recording with it
    recorder = context.__enter__()  # until the process exits (the recorder costs a list append)
    rank = int(os.environ.get("RANK", "0"))

    def write_and_close() -> None:
        write(prefix, rank, recorder)
        context.__exit__(None, None, None)  # now, not when the interpreter's teardown collects it

    atexit.register(write_and_close)


def write(prefix: str, rank: int, recorder) -> None:
    """{prefix}.rank{rank}.json: what the recorder holds now."""
    with recorder._lock:
        entries, whats = list(recorder.entries), list(recorder.whats)
    Path(f"{prefix}.rank{rank}.json").write_text(json.dumps({"entries": entries, "whats": whats}))


def load(prefix: str, ranks: int) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(ranks)]


def first_difference(sequences: list[dict]) -> str | None:
    """None where every rank issued the same list; else where the first two differ, in words."""
    base = sequences[0]["entries"]
    for r, seq in enumerate(sequences[1:], start=1):
        mine = seq["entries"]
        for i in range(max(len(base), len(mine))):
            a = tuple(base[i]) if i < len(base) else None
            b = tuple(mine[i]) if i < len(mine) else None
            if a != b:
                said = [f"{s['whats'][i]!r} {tuple(s['entries'][i])}" if i < len(s["entries"]) else "nothing"
                        for s in (sequences[0], seq)]
                return (f"collective #{i}: rank 0 issued {said[0]}, rank {r} issued {said[1]} "
                        f"({len(base)} and {len(mine)} collectives in all)")
    return None


def assert_same_sequences(prefix: str, ranks: int = 2) -> int:
    """Every rank's recorded list equal; returns its length."""
    missing = [r for r in range(ranks) if not Path(f"{prefix}.rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no collective sequence (they did not exit normally)"
    sequences = load(prefix, ranks)
    differ = first_difference(sequences)
    assert differ is None, f"the ranks issued different collectives: {differ}"
    return len(sequences[0]["entries"])
