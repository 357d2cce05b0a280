"""The collective watchdog: a rank that stalls or dies stops the others within `Config.collective_timeout`,
with an error that says where each rank was, instead of a silent 30-minute hang.

Every collective of the runtime runs through `Watchdog.run(group, collective, what, fn)`, which counts it
per group (main, gather, reduce: each group's collectives are in the same order on every rank) and notes
what this rank is waiting in. That position goes to the process group's store when the watchdog starts
(before any collective) and then once a second from a heartbeat thread. The process groups are created with the timeout, so a collective that waits too long (or
whose peer died) raises inside `fn`; the watchdog then reads every rank's last position and raises
CollectiveError naming this rank's collective and unit and, for each other rank, its last collective and
whether its heartbeat is fresh (alive but stuck in its own code) or stale (dead or frozen). After one
failure every later collective fails at once with the same message, so closing the runtime does not wait
out the timeout again for each queued one.

On NCCL the host never blocks in a collective (a wait makes a stream wait), so nothing above raises: NCCL's own
watchdog aborts the process at the group's timeout. So every collective issued with async_op is also watched while
it is in flight: the heartbeat thread checks each second whether one has been incomplete for `overdue_s` (on NCCL
90% of the timeout, before NCCL's abort), and then describes where every rank is, prints it to stderr (the
process may not live to raise it) and marks the watchdog broken, so the next collective raises it. On gloo the
host blocks in the wait, which raises at the timeout, so nothing is watched in flight (and gloo's reduce_scatter
works never report completion: tracking them held every gradient they read).
"""
from __future__ import annotations

import contextlib
import json
import sys
import threading
import time

HEARTBEAT_S = 1.0
_KEY = "offload/watchdog/rank{}"


class CollectiveError(RuntimeError):
    pass


class Watchdog:
    def __init__(self, rank: int, world_size: int, timeout_s: float, overdue_s: float | None = None):
        """`overdue_s`: how long an issued collective may stay incomplete before the heartbeat describes it (NCCL,
        whose host never blocks). None: not watched in flight; the thread that waits reports at the timeout (gloo:
        its host blocks, and some of its works, reduce_scatter's, never say they completed)."""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.overdue_s = overdue_s
        self.in_flight: list[tuple] = []  # (work, group, collective, what, count, issued at): issued, not seen done
        self.entered: dict[str, int] = {}  # group name -> collectives entered
        self.waiting: dict[int, tuple] = {}  # thread id -> (group, collective, what, count, since)
        self.last: tuple | None = None  # the last collective entered: (group, collective, what, count, when)
        self.broken: str | None = None
        self._describing = False
        self._lock = threading.Lock()
        self._store = _default_store() if world_size > 1 else None
        self._stop = threading.Event()
        self._thread = None
        if self._store is not None:
            # the first beat before any collective: a rank that dies within its first second (a fast step)
            # is then read as silent, not as one that never started
            self._publish()
            self._thread = threading.Thread(target=self._beat, name="offload-watchdog", daemon=True)
            self._thread.start()

    def run(self, group: str, collective: str, what: str, fn, counted: bool = True):
        """fn() (a collective's issue, or with counted=False the wait of one already counted), watched."""
        if self.broken is not None:
            raise CollectiveError(self.broken)
        tid = threading.get_ident()
        with self._lock:
            count = self.entered.get(group, 0) + counted
            self.entered[group] = count
            self.waiting[tid] = (group, collective, what, count, time.time())
            self.last = self.waiting[tid]
        try:
            result = fn()
            if counted and self.overdue_s is not None and self._thread is not None and hasattr(result, "is_completed"):
                with self._lock:  # watched until seen complete (the heartbeat prunes each second; a stopped one not)
                    if len(self.in_flight) >= 1024:
                        self.in_flight = [w for w in self.in_flight if not _completed(w[0])][-512:]
                    self.in_flight.append((result, group, collective, what, count, time.time()))
            return result
        except Exception as exc:  # noqa: BLE001 - a timeout, a dead peer's closed connection, an abort
            with self._lock:
                first = self.broken is None and not self._describing
                self._describing = True
            if first:  # described outside the lock: the heartbeat keeps beating while the peers are read
                with self._lock:
                    waited = time.time() - self.waiting.get(tid, (0, 0, 0, 0, time.time()))[4]
                message = self._describe(group, collective, what, count, _first_line(exc), waited, "gave up after")
                with self._lock:
                    self.broken = message
            else:
                while self.broken is None:  # another thread is describing the same failure
                    time.sleep(0.05)
            raise CollectiveError(self.broken) from exc
        finally:
            with self._lock:
                self.waiting.pop(tid, None)

    @contextlib.contextmanager
    def noted(self, group: str, collective: str, what: str):
        """A wait that is not a collective (agree.py's meeting) shown in this rank's published position."""
        tid = threading.get_ident()
        with self._lock:
            self.waiting[tid] = (group, collective, what, 0, time.time())
        try:
            yield
        finally:
            with self._lock:
                self.waiting.pop(tid, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- the heartbeat and the report ---------------------------------------------------------
    def _position(self) -> dict:
        with self._lock:
            return {"t": time.time(), "entered": dict(self.entered),
                    "waiting": [list(w) for w in self.waiting.values()], "last": list(self.last or ())}

    def _publish(self) -> bool:
        try:
            self._store.set(_KEY.format(self.rank), json.dumps(self._position()))
            return True
        except Exception:  # noqa: BLE001 - the store went with a dead launcher: nothing left to report to
            return False

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._publish():
                return
            self._check_overdue()

    def _check_overdue(self) -> None:
        """The heartbeat's check of the collectives in flight (the module docstring: NCCL's host never blocks)."""
        if self.overdue_s is None:
            return
        now = time.time()
        with self._lock:
            self.in_flight = [w for w in self.in_flight if not _completed(w[0])]
            late = next((w for w in self.in_flight if now - w[5] >= self.overdue_s), None)
            if late is None or self.broken is not None or self._describing:
                return
            self._describing = True
        _, group, collective, what, count, issued = late
        message = self._describe(group, collective, what, count, "incomplete, seen by the heartbeat",
                                 now - issued, "has waited")
        with self._lock:
            self.broken = message
        print(message, file=sys.stderr, flush=True)  # on NCCL the process may be aborted before anything raises

    def _describe(self, group: str, collective: str, what: str, count: int, cause: str, waited: float,
                  verb: str) -> str:
        head = (f"offload: rank {self.rank} {verb} {waited:.1f} s in {collective} #{count} on the {group} "
                f"group ({what or 'no unit'}); collective_timeout is {self.timeout_s:g} s. ")
        peers = self._peers(group, count)
        return head + (" ".join(peers) if peers else "The other ranks' positions are unknown.") + f" ({cause})"

    def _read(self, r: int) -> dict | None:
        key = _KEY.format(r)
        try:
            return json.loads(self._store.get(key)) if self._store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store is gone (the launcher died): nothing to read
            return None

    def _peers(self, group: str, count: int) -> list[str]:
        """One sentence per other rank. Alive or not is told by whether its heartbeat moves within
        2.5 heartbeats (a rank that just died still has a recent one)."""
        if self._store is None:
            return []
        others = [r for r in range(self.world_size) if r != self.rank]
        first = {r: self._read(r) for r in others}
        time.sleep(2.5 * HEARTBEAT_S)
        now, out = time.time(), []
        for r in others:
            pos = self._read(r)
            if pos is None:
                out.append(f"Rank {r} never reported (it died or froze before its first heartbeat).")
                continue
            alive = first[r] is None or pos["t"] != first[r]["t"]
            theirs = pos["entered"].get(group, 0)
            where = ", ".join(f"waiting {now - since:.1f} s for every rank to call {w}" if g == "agreement" else
                              f"{c} #{n} on the {g} group ({w or 'no unit'}) for {now - since:.1f} s"
                              for g, c, w, n, since in pos["waiting"]) or "in no collective"
            state = "alive" if alive else f"silent for {now - pos['t']:.1f} s (dead or frozen)"
            behind = (f"behind (it has entered {theirs} of the {group} group's collectives, this rank {count}) "
                      if theirs < count else "")
            last = pos["last"]
            last_txt = f"; its last collective was {last[1]} #{last[3]} on the {last[0]} group ({last[2] or 'no unit'})" \
                if last else ""
            out.append(f"Rank {r} is {behind}{state}, {where}{last_txt}.")
        return out


def _default_store():
    """The default process group's key-value store (torch's private accessor), or None."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - another launcher, another torch: the watchdog still names this rank
        return None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__


def _completed(work) -> bool:
    try:
        return work.is_completed()
    except Exception:  # noqa: BLE001 - a failed work: the thread that waits on it reports it
        return True
