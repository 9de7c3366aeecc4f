"""Connection admission for the monitor's HTTP doors: one cap counted at accept, a per-peer cap, shedding.

A `Gate` admits each accepted connection before the next one is looked at (so the cap holds: the
count never runs ahead of it), at most `max_per_peer` from one address. A connection is *waiting*
(sheddable) while it is idle between requests or still sending its request's head, *working* while
a request is being answered. When the server is full, or the new connection's peer is, the waiting
connection that has waited longest (the oldest idle one, or the slowest head) is closed to make room;
only when every connection is working is the new one refused. So a client holding connections open
by trickling bytes cannot keep a legitimate request out: its connections go first.

Written once for both servers (the sources' `_h11` door and the metrics port's `_http`).
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
    """Admits connections up to `max_connections` (and `max_per_peer` per address), shedding the longest-waiting."""

    def __init__(self, max_connections: int, max_per_peer: int | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections is {max_connections}; it must be at least 1")
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer if max_per_peer is not None else max_connections
        self._slots: set[Slot] = set()
        self._waiting: OrderedDict[Slot, None] = OrderedDict()
        """The sheddable connections, the one that has waited longest first."""
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

    def admit(self, peer: str, close: Callable[[], None]) -> Slot | None:
        """Admit a new connection (waiting), shedding the longest-waiting one when full; None: refused (counted)."""
        if self._peers.get(peer, 0) >= self.max_per_peer:
            victim = next((s for s in self._waiting if s.peer == peer), None)
            if victim is None:
                self.refused_peer += 1
                return None
            self._shed(victim)
        if len(self._slots) >= self.max_connections:
            victim = next(iter(self._waiting), None)
            if victim is None:
                self.refused += 1
                return None
            self._shed(victim)
        slot = Slot(peer, close)
        self._slots.add(slot)
        self._peers[peer] = self._peers.get(peer, 0) + 1
        self._waiting[slot] = None
        return slot

    def waiting(self, slot: Slot) -> None:
        """The connection waits (idle, or reading a head): sheddable, as the newest waiting one."""
        if not slot.released:
            self._waiting[slot] = None
            self._waiting.move_to_end(slot)

    def working(self, slot: Slot) -> None:
        """The connection's request is being answered: never shed."""
        self._waiting.pop(slot, None)

    def release(self, slot: Slot) -> None:
        """The connection closed (idempotent)."""
        if slot.released:
            return
        slot.released = True
        self._slots.discard(slot)
        self._waiting.pop(slot, None)
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
