"""The outbox: a bounded queue of MQTT messages to publish, dropping the oldest droppable one when full."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._metrics import Metrics


@dataclass(frozen=True, slots=True)
class Message:
    """One MQTT message to publish."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False
    droppable: bool = True
    """Progress and error messages may be dropped when the outbox is full; signals never are."""


class Outbox:
    """The bounded queue of messages to publish; when full, the oldest droppable message makes room."""

    def __init__(self, maxsize: int = 10_000, *, metrics: Metrics | None = None) -> None:
        if maxsize < 1:
            raise ValueError("outbox maxsize must be >= 1")
        self.maxsize = maxsize
        self.metrics = metrics
        self.dropped = 0
        self._q: deque[Message] = deque()
        self._ready = asyncio.Event()

    def put(self, m: Message) -> None:
        """Queue a message (never blocks: a scorer must not wait on a slow broker)."""
        if len(self._q) >= self.maxsize:
            victim = next((x for x in self._q if x.droppable), None)
            if victim is not None:
                self._q.remove(victim)
            elif m.droppable:
                victim = m
            # With nothing droppable queued, a signal still goes in: there is at most one per run change.
            if victim is not None:
                self.dropped += 1
                if self.metrics:
                    self.metrics.outbox_dropped.inc()
            if victim is m:
                return
        self._q.append(m)
        self._ready.set()
        self._gauge()

    def requeue(self, m: Message) -> None:
        """Put back a message whose publication failed, first in line."""
        self._q.appendleft(m)
        self._ready.set()
        self._gauge()

    async def get(self) -> Message:
        """The next message, waiting for one."""
        while not self._q:
            self._ready.clear()
            await self._ready.wait()
        m = self._q.popleft()
        self._gauge()
        return m

    def get_nowait(self) -> Message | None:
        """The next message, or None."""
        m = self._q.popleft() if self._q else None
        self._gauge()
        return m

    def __len__(self) -> int:
        return len(self._q)

    def _gauge(self) -> None:
        if self.metrics:
            self.metrics.outbox_depth.set(len(self._q))
