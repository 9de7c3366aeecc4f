"""The scoring scheduler: fair across runs, coalescing within a run (the one implementation, hook
and daemon alike).

Each key (a run) is in the ready queue at most once and is never scored by two workers at
once. A worker takes the key that has waited longest and calls `score(key)`, which scores that
run's *newest* prefix: steps that arrived while the key waited are folded into that one call
(coalescing). A key woken while it is being scored goes to the back of the queue when the
scoring ends, behind the keys that were already waiting (fairness: a chatty run cannot starve
the others). How many workers run is the caller's choice (the daemon: `max_concurrency`; a
hook tracker: one); the caller owns their tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger("agent_monitor._runtime.scheduler")

K = TypeVar("K", bound=Hashable)


class Scheduler(Generic[K]):
    """A fair, coalescing ready queue of keys, served by `worker()` loops the caller runs."""

    def __init__(
        self,
        score: Callable[[K], Awaitable[object]],
        *,
        on_depth: Callable[[int], object] | None = None,
    ):
        self._score = score
        self._on_depth = on_depth
        self._ready: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._inflight: set[K] = set()
        self._again: set[K] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def depth(self) -> int:
        """Keys waiting for a worker."""
        return len(self._queued)

    def wake(self, key: K) -> None:
        """Say `key` may have new work: queue it unless it is queued already (or re-queue it
        after its scoring)."""
        if key in self._inflight:
            self._again.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        self._idle.clear()
        self._ready.put_nowait(key)
        if self._on_depth is not None:
            self._on_depth(len(self._queued))

    def discard(self, key: K) -> None:
        """Forget `key` (its run is gone): a queued entry is skipped, a running scoring is not
        re-queued."""
        self._queued.discard(key)
        self._again.discard(key)
        self._check_idle()

    def idle_for(self, key: K) -> bool:
        """`key` is neither queued nor being scored."""
        return key not in self._queued and key not in self._inflight

    def idle(self) -> bool:
        """Nothing is queued or being scored."""
        return not self._queued and not self._inflight

    async def drain(self) -> None:
        """Wait until nothing is queued or being scored (bound it with asyncio.timeout)."""
        while not self.idle():
            await self._idle.wait()

    async def worker(self) -> None:
        """Serve forever: take the key waiting longest and score it; scoring errors are logged,
        never fatal."""
        while True:
            key = await self._ready.get()
            if key not in self._queued:
                continue  # discarded while it waited
            self._queued.discard(key)
            if self._on_depth is not None:
                self._on_depth(len(self._queued))
            self._inflight.add(key)
            try:
                await self._score(key)
            except Exception:
                # The score callback reports its own failures; one escaping here is a bug, and must
                # not stop this worker (it serves every run).
                log.exception("scoring_crashed", key=str(key))
            finally:
                self._inflight.discard(key)
                if key in self._again:
                    self._again.discard(key)
                    self.wake(key)
                self._check_idle()

    def _check_idle(self) -> None:
        if self.idle():
            self._idle.set()


__all__ = ["Scheduler"]
