"""Connection admission for the monitor's HTTP doors: one cap counted at accept, a per-peer cap,
shedding.

A `Gate` admits each accepted connection before the next one is looked at (so the cap holds: the
count never runs ahead of it), at most `max_per_peer` from one address. A connection is *waiting*
(sheddable) while it owes a request's head (*slow*: a new connection, or a head begun and not
whole) or is idle between requests (keep-alive), *working* while a request is being answered.
When the server is full, or the new connection's peer is, a
waiting connection is closed to make room: the slowest head first (the one waited for longest),
then the longest-idle one; only when every connection is working is the new one refused. So a client
holding connections open by trickling bytes cannot keep a legitimate request out: its connections go
first, before even the idle keep-alive connections legitimate clients will reuse.

Written once, for the one server every door runs (`_h11`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Gate", "GateStatistics", "Slot", "peer_of"]


class Slot:
    """One admitted connection: its peer, how to close it, whether it is waiting (sheddable)."""

    __slots__ = ("close", "peer", "released")

    def __init__(self, peer: str, close: Callable[[], None]) -> None:
        self.peer = peer
        self.close = close
        """Closes the connection (called once, when it is shed)."""
        self.released = False


@dataclass(frozen=True, slots=True)
class GateStatistics:
    """A gate's counts: connections open, shed to make room, refused (every one working)."""

    connections: int
    shed: int
    refused: int
    refused_peer: int


class Gate:
    """Admits connections up to `max_connections` (and `max_per_peer` per address), shedding the
    longest-waiting."""

    def __init__(self, max_connections: int, max_per_peer: int | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections is {max_connections}; it must be at least 1")
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer if max_per_peer is not None else max_connections
        self._slots: set[Slot] = set()
        self._slow: OrderedDict[Slot, None] = OrderedDict()
        """The connections sending a head, the one that began longest ago first: shed first."""
        self._idle: OrderedDict[Slot, None] = OrderedDict()
        """The idle connections, the longest-idle first: shed when no head is being sent."""
        self._peers: dict[str, int] = {}
        self.shed = 0
        self.refused = 0
        self.refused_peer = 0

    @property
    def connections(self) -> int:
        """Connections admitted and not yet released."""
        return len(self._slots)

    def statistics(self) -> GateStatistics:
        """Open, shed, refused (full) and refused (the peer full) connections."""
        return GateStatistics(len(self._slots), self.shed, self.refused, self.refused_peer)

    @property
    def waiting_count(self) -> int:
        """Connections that may be shed now (sending a head, or idle)."""
        return len(self._slow) + len(self._idle)

    def admit(self, peer: str, close: Callable[[], None]) -> Slot | None:
        """Admit a new connection (its first head to come: slow), shedding when full; None:
        refused (counted)."""
        if self._peers.get(peer, 0) >= self.max_per_peer:
            victim = next((s for s in self._slow if s.peer == peer), None) or next(
                (s for s in self._idle if s.peer == peer), None
            )
            if victim is None:
                self.refused_peer += 1
                return None
            self._shed(victim)
        if len(self._slots) >= self.max_connections:
            victim = next(iter(self._slow), None) or next(iter(self._idle), None)
            if victim is None:
                self.refused += 1
                return None
            self._shed(victim)
        slot = Slot(peer, close)
        self._slots.add(slot)
        self._peers[peer] = self._peers.get(peer, 0) + 1
        self._slow[slot] = None
        return slot

    def heading(self, slot: Slot) -> None:
        """The connection is sending a request's head: sheddable first, as the newest such."""
        if not slot.released:
            self._idle.pop(slot, None)
            self._slow.pop(slot, None)
            self._slow[slot] = None

    def idle(self, slot: Slot) -> None:
        """The connection waits between requests: sheddable when no head is being sent, as the
        newest idle one."""
        if not slot.released:
            self._slow.pop(slot, None)
            self._idle.pop(slot, None)
            self._idle[slot] = None

    def working(self, slot: Slot) -> None:
        """The connection's request is being answered: never shed."""
        self._slow.pop(slot, None)
        self._idle.pop(slot, None)

    def release(self, slot: Slot) -> None:
        """The connection closed (idempotent)."""
        if slot.released:
            return
        slot.released = True
        self._slots.discard(slot)
        self._slow.pop(slot, None)
        self._idle.pop(slot, None)
        left = self._peers.get(slot.peer, 0) - 1
        if left > 0:
            self._peers[slot.peer] = left
        else:
            self._peers.pop(slot.peer, None)

    def _shed(self, victim: Slot) -> None:
        self.shed += 1
        self.release(victim)
        victim.close()


def peer_of(peername: object) -> str:
    """The address part of a transport's `peername` (a Unix socket's or an unknown one: "")."""
    if isinstance(peername, tuple) and peername:
        return str(peername[0])
    return ""
