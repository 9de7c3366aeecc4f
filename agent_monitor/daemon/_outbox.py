"""The outbox: the bounded queue of MQTT messages to publish, which the sinks fill and the MQTT link drains.

At daemon level because both sides need it and neither may import the other (the sinks never import a
door): `sinks.MqttSink` and the monitor's resend put messages in, `sources.MqttLink` publishes them,
cluster mode gates them. It imports nothing of the daemon.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Message", "Outbox"]


@dataclass(frozen=True, slots=True)
class Message:
    """One MQTT message to publish."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False
    droppable: bool = True
    """Progress and error messages may be dropped when the outbox is full; signals never are."""
    run_id: str | None = None
    """The run the message is about (the outbox's `gate` may hold it back: cluster mode's fencing)."""
    sent: Callable[[], None] | None = field(default=None, compare=False)
    """Called once the broker acknowledged the message (cluster mode: a signal known to be out is not republished)."""


class Outbox:
    """The bounded queue of messages to publish; when full, the oldest droppable message makes room.

    Droppable and kept messages wait in two queues, each message numbered in arrival order, and leave
    in that order: finding the oldest droppable one is O(1) however many signals wait (a burst of
    evictions at --max-runs queues thousands of signal clears, and a scan past them per message was
    the ingest's cost there).
    """

    def __init__(
        self,
        maxsize: int = 10_000,
        *,
        on_dropped: Callable[[], None] | None = None,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError("outbox maxsize must be >= 1")
        self.maxsize = maxsize
        self.on_dropped = on_dropped
        """Told each message dropped for room (the dropped counter); the depth is read, `statistics()`."""
        self.on_fenced = on_fenced
        """Told each message the gate held back (cluster mode's fenced publishes)."""
        self.dropped = 0
        self.fenced = 0
        self._droppable: deque[tuple[int, Message]] = deque()
        self._kept: deque[tuple[int, Message]] = deque()
        self._next = 0
        self._first = 0
        """The number a requeued message gets: below every other, so it goes first."""
        self._ready = asyncio.Event()
        self.gate: Callable[[str], bool] | None = None
        """Cluster mode: whether this replica may still publish about a run; a message it may not is dropped."""
        self._by_run: dict[str, int] = {}
        """Messages waiting per run (those that name one): a replica handing a run over waits for them to leave."""
        self.on_run_out: Callable[[str], None] | None = None
        """Told when a run's last waiting message left (published, dropped or fenced): the scoring held for it."""

    def put(self, m: Message) -> None:
        """Queue a message (never blocks: a scorer must not wait on a slow broker)."""
        if len(self) >= self.maxsize:
            # The oldest droppable message makes room; with none queued, a droppable newcomer is the one dropped,
            # and a signal still goes in (there is at most one per run change).
            newcomer_dropped = not self._droppable and m.droppable
            if self._droppable or newcomer_dropped:
                if self._droppable:
                    self._left(self._droppable.popleft()[1])
                self.dropped += 1
                if self.on_dropped is not None:
                    self.on_dropped()
            if newcomer_dropped:
                return
        self._next += 1
        (self._droppable if m.droppable else self._kept).append((self._next, m))
        if m.run_id is not None:
            self._by_run[m.run_id] = self._by_run.get(m.run_id, 0) + 1
        self._ready.set()

    def requeue(self, m: Message) -> None:
        """Put back a message whose publication failed, first in line."""
        self._first -= 1
        (self._droppable if m.droppable else self._kept).appendleft((self._first, m))
        if m.run_id is not None:
            self._by_run[m.run_id] = self._by_run.get(m.run_id, 0) + 1
        self._ready.set()

    async def get(self) -> Message:
        """The next message, waiting for one."""
        while True:
            while not len(self):
                self._ready.clear()
                await self._ready.wait()
            m = self._pop()
            # Checked as it leaves, not as it came: a replica paused past its lease (a zombie) must not publish
            # what it queued before the pause, once another replica owns the run.
            if self._may(m):
                return m

    def get_nowait(self) -> Message | None:
        """The next message, or None (the gate applies as in `get`)."""
        while len(self):
            m = self._pop()
            if self._may(m):
                return m
        return None

    def _may(self, m: Message) -> bool:
        if m.run_id is None or self.gate is None or self.gate(m.run_id):
            return True
        self.fenced += 1
        if self.on_fenced is not None:
            self.on_fenced()
        return False

    def pending(self, run_id: str) -> int:
        """Messages about one run waiting to be published."""
        return self._by_run.get(run_id, 0)

    def _pop(self) -> Message:
        d, k = self._droppable, self._kept
        m = d.popleft()[1] if d and (not k or d[0][0] < k[0][0]) else k.popleft()[1]
        self._left(m)
        return m

    def _left(self, m: Message) -> None:
        if m.run_id is not None:
            n = self._by_run.pop(m.run_id, 1) - 1
            if n > 0:
                self._by_run[m.run_id] = n
            elif self.on_run_out is not None:
                self.on_run_out(m.run_id)

    def __len__(self) -> int:
        return len(self._droppable) + len(self._kept)

    def statistics(self) -> dict[str, Any]:
        """Messages waiting, the bound, and how many were dropped for room or held back by the gate."""
        return {"depth": len(self), "maxsize": self.maxsize, "dropped": self.dropped, "fenced": self.fenced}
