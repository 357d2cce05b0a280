"""Every rank calls a collective entry point, or none does: a state dict, `rt.full_state_dict()`, an export,
`opt.full_state_dict()`, a checkpoint's save or load. Each gathers from every rank; called on rank 0 alone (the
usual `if rank == 0: model.state_dict()`) its first gather would wait `collective_timeout` (10 minutes) for peers
that never come, and a peer's own next collective could pair with it instead.

So each entry point first meets the other ranks here, within `Config.agreement_timeout` (2 min by default: longer
than the ranks' skew at a call they all make, tens of seconds of host work on a large model; a fifth of the collective
timeout). A rank that waits longer raises `NotOnEveryRank` naming the ranks that did not come and where they are
(the watchdog's published positions), and the fix; nothing was issued on any communicator, so the runtime goes on usable.

Why the process group's key-value store and not a collective (a barrier or `monitored_barrier` on a gloo group
with a short timeout): a collective that timed out leaves its group's sequence out of step (the late rank's
barrier would pair with the next one), so the group is unusable afterwards; and on NCCL the main group cannot
be given its own short timeout. The store has no sequence to break: each meeting is a set of keys of its own,
decided once by an atomic compare-and-set ("go" set by the last rank to arrive, or "abandoned" by the first to
give up, whichever comes first), so every rank reads the same verdict. A rank that comes to a meeting already
abandoned (it was late, or it never called) skips it and waits at the next, which the ranks' next call meets
at: a refused call costs the ranks nothing more. The wait polls the store (no blocking `wait`: the store's
client holds its lock through one, and the watchdog's heartbeat shares it)."""
from __future__ import annotations

import contextlib
import itertools
import time

_SERIAL = itertools.count()  # one key space per runtime of this process (every rank opens as many)


class NotOnEveryRank(RuntimeError):
    """A collective entry point was called on some ranks only (or on others more than agreement_timeout later)."""


class Agreement:
    def __init__(self, rank: int, world_size: int, timeout_s: float, store, watchdog=None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._store, self._watchdog = store, watchdog
        self._base = f"offload/agree/{next(_SERIAL)}/"
        self._next = 0  # the first meeting this rank has not taken part in

    def meet(self, what: str) -> None:
        """Return once every rank called `what` (here); raise NotOnEveryRank after timeout_s otherwise."""
        if self._store is None or self.world_size <= 1:
            return
        store, deadline = self._store, time.monotonic() + self.timeout_s
        with self._noted(what):
            while True:
                n, self._next = self._next, self._next + 1
                key = f"{self._base}{n}"
                if store.check([f"{key}/verdict"]):
                    continue  # abandoned before this rank came (a "go" needs every rank, this one too)
                store.set(f"{key}/rank{self.rank}", what)
                arrived = store.add(f"{key}/arrived", 1)
                verdict = self._verdict(key, arrived, deadline)
                if verdict == "go":
                    break
                if arrived == self.world_size:  # this rank came last, as another gave up: the next meeting
                    continue
                raise NotOnEveryRank(self._refusal(what, key, verdict))
        whats = {r: self._str(store.get(f"{key}/rank{r}")) for r in range(self.world_size)}
        if len(set(whats.values())) > 1:
            raise NotOnEveryRank(
                "offload: the ranks called different collective entry points at once ("
                + ", ".join(f"rank {r}: {w}" for r, w in whats.items()) + "): each gathers its own units, so "
                "their gathers would pair wrongly; call the same one on every rank, in the same order")

    def _verdict(self, key: str, arrived: int, deadline: float) -> str:
        store, verdict = self._store, f"{key}/verdict"
        if arrived == self.world_size:
            decided = self._str(store.compare_set(verdict, "", "go"))
            if decided == "go":
                self._forget(int(key.rsplit("/", 1)[1]) - 1)
            return decided
        pause = 0.001
        while time.monotonic() < deadline:
            if store.check([verdict]):
                return self._str(store.get(verdict))
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)
        # the first to give up decides, unless the last rank came first
        return self._str(store.compare_set(verdict, "", f"abandoned by rank {self.rank}"))

    def _forget(self, n: int) -> None:
        """Meeting n's keys go (by the rank that decided meeting n + 1: every rank came to it, so every rank is done
        with n): a run calling state dicts every step does not pile keys up in the store."""
        if n < 0:
            return
        for name in ["verdict", "arrived"] + [f"rank{r}" for r in range(self.world_size)]:
            try:
                self._store.delete_key(f"{self._base}{n}/{name}")
            except Exception:  # noqa: BLE001 - a store without deletes keeps them (a few bytes a meeting)
                return

    def _refusal(self, what: str, key: str, verdict: str) -> str:
        store = self._store
        missing = [r for r in range(self.world_size) if not store.check([f"{key}/rank{r}"])]
        who = ", ".join(f"rank {r}" + self._where(r) for r in missing) or "another rank"
        gave_up = "" if verdict == f"abandoned by rank {self.rank}" else f" ({verdict})"
        return (f"offload: {what} was called on rank {self.rank}, and {who} did not call it within "
                f"agreement_timeout={self.timeout_s:g} s{gave_up}: call it on every rank: it gathers shards from each "
                "(not under `if rank == 0`; a rank that only calls it later than the others by more than the timeout "
                "needs a larger offload.Config(agreement_timeout=...))")

    def _where(self, r: int) -> str:
        """Where rank r is, from its watchdog heartbeat (watchdog.py)."""
        pos = self._watchdog._read(r) if self._watchdog is not None else None
        if pos is None:
            return ""
        waiting = [f"a wait for every rank to call {w}" if g == "agreement" else
                   f"{c} #{n} on the {g} group ({w or 'no unit'})" for g, c, w, n, _ in pos["waiting"]]
        return f" (it is in {waiting[0]})" if waiting else " (it is in no collective of the runtime)"

    @contextlib.contextmanager
    def _noted(self, what: str):
        """The wait shows in this rank's published position (the others' diagnosis names it)."""
        if self._watchdog is None:
            yield
            return
        with self._watchdog.noted("agreement", "meeting", what):
            yield

    @staticmethod
    def _str(value) -> str:
        return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)

