"""Moves: each shard's moves run one after another in the order they were asked for, moves of different shards
in parallel on a pool of worker threads. The store's state machine (tiered_store.py) writes what a move does;
this runs them.

A move is a generator: it runs until it has submitted an I/O and yields the handle (a `wait()`), or yields
TO_WORKER before work that must not run in the caller (a copy); a worker waits for the handle and resumes it.
When nothing of the shard is queued before it, the first step runs in the calling thread, so the I/O is in the
engine's queue at once and a worker only finishes it: the disk stays busy however slowly Python threads get the
GIL. The blocks a move was handed (`new`: {kind: block}) that it did not keep are freed when it ends.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Callable

__all__ = ["Moves", "TO_WORKER", "drop_unused"]

TO_WORKER = object()  # yielded by a move before work that must run in a worker thread


def drop_unused(new: dict) -> None:
    """Frees the blocks of `new` a move did not keep (it sets the ones it keeps to None)."""
    for k, b in list(new.items()):
        if b is not None and not b.freed:
            b.free()
        new[k] = None


def _finish(fut: cf.Future, result=None, exc: BaseException | None = None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class Moves:
    """The moves in flight and the workers that run them. `lock` is the store's (re-entrant: a future's
    done-callbacks, which take it, can fire inside chain(), which is called with it held); `error` the type of
    the store's errors."""

    def __init__(self, lock, error: type[Exception]):
        self.lock = lock
        self.error = error
        self.pool: cf.ThreadPoolExecutor | None = None  # start() makes it
        self.inflight: set[cf.Future] = set()
        self.cancelling = False  # close(cancel=True): nothing new starts

    def start(self, workers: int, initializer: Callable[[], None]) -> None:
        self.pool = cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="offload-store",
                                          initializer=initializer)

    def chain(self, s, make: Callable, new: dict, settle: Callable[[], None]):
        """Queues the move make() creates as shard s's next (s.last: the last one queued, s.name names it);
        returns (future, kick), and the caller calls kick() once it has released the lock (held here).
        settle() runs under the lock when the move failed and nothing of s is queued behind it."""
        fut: cf.Future = cf.Future()
        prev, s.last = s.last, fut
        self.inflight.add(fut)
        fut.add_done_callback(self._forget)

        def failed(e: BaseException) -> None:
            with self.lock:
                if s.last is fut:  # nothing queued behind: the plan is where the bytes really are
                    settle()
            _finish(fut, exc=e)

        def drive(gen, pending) -> None:  # in a worker, to the end of the move
            try:
                while True:
                    if pending is not TO_WORKER:
                        try:
                            pending.wait()  # the move resumes only once its I/O is over
                        except Exception:
                            pass  # the move calls wait() again and handles the error where it can undo its state
                    pending = gen.send(None)
            except StopIteration as stop:
                _finish(fut, result=stop.value)
            except BaseException as e:
                failed(e)

        def begin(in_worker: bool) -> None:  # the first step, up to the move's first wait
            if self.cancelling:
                fut.cancel()  # close(cancel=True): nothing new starts, even if queued behind a cancelled move
            if not fut.set_running_or_notify_cancel():
                drop_unused(new)
                return
            gen = make()
            try:
                pending = gen.send(None)
            except StopIteration as stop:
                _finish(fut, result=stop.value)
                return
            except BaseException as e:
                failed(e)
                return
            if in_worker:
                drive(gen, pending)
                return
            try:
                self.pool.submit(drive, gen, pending)
            except RuntimeError as e:  # cannot happen while open (close waits for running moves); be safe
                gen.close()
                failed(self.error(f"shard {s.name!r}: no worker to finish the move ({e})"))

        def after_prev(_=None) -> None:
            try:
                self.pool.submit(begin, True)
            except RuntimeError:  # pool shut down by close(): this move never runs
                drop_unused(new)
                _finish(fut, exc=self.error(f"shard {s.name!r}: the store closed before this move ran"))

        if prev is None or prev.done():
            return fut, (lambda: begin(False))
        # moves of one shard run in the order they were asked for
        return fut, (lambda: prev.add_done_callback(after_prev))

    def _forget(self, fut: cf.Future) -> None:
        with self.lock:
            self.inflight.discard(fut)
