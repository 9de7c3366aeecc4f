"""Cluster mode's lease table: the runs this replica holds (token, publish deadline, inbox cursors).

Kept apart from the replica's loops so that the store (fenced writes), the outbox gate and the
loops that take and give up runs read one table through its methods, never each other's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


class Fenced(RuntimeError):
    """A write refused because this replica no longer owns the run (another took it over)."""


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def later(a: str, b: str) -> str:
    """The later of two stream ids ('' is before every id)."""
    if not a:
        return b
    if not b:
        return a
    return a if _id(a) >= _id(b) else b


@dataclass(slots=True)
class Lease:
    """A run this replica holds the lease of."""

    token: int
    deadline: float
    """Monotonic time until which this replica may publish about the run."""
    cursor: str = ""
    """The inbox id of the last event journaled (persisted with the records)."""
    fed: str = ""
    """The inbox id of the last event handed to the monitor."""
    ready: bool = False
    """Taken over (its journal replayed): only then are its inbox's events handed to the monitor."""


class Leases:
    """The runs this replica owns, and those it just gave up whose queued messages may still be
    published."""

    def __init__(
        self,
        replica_id: str,
        *,
        on_fenced: Callable[[], None] = lambda: None,
        on_owned: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.replica_id = replica_id
        self.on_fenced = on_fenced
        """Told each write refused here for a run not owned (the fenced-writes counter)."""
        self.on_owned = on_owned
        """Told the number of runs owned whenever it changes (the owned-runs gauge)."""
        self.owned: dict[str, Lease] = {}
        self._closing: dict[str, tuple[float, int]] = {}
        """Runs no longer owned here (finished, or being handed over) whose queued messages may
        still be published, with the lease deadline until which they may, and the token they were
        held with."""

    def __contains__(self, run_id: object) -> bool:
        return run_id in self.owned

    def __len__(self) -> int:
        return len(self.owned)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.owned))

    def get(self, run_id: str) -> Lease | None:
        """The run's lease, when held here."""
        return self.owned.get(run_id)

    def hold(self, run_id: str, lease: Lease) -> None:
        """Hold a run's lease."""
        self.owned[run_id] = lease
        self.on_owned(len(self.owned))

    def drop(self, run_id: str) -> Lease | None:
        """Forget a run's lease (lost, or never taken over)."""
        lease = self.owned.pop(run_id, None)
        self.on_owned(len(self.owned))
        return lease

    def close(self, run_id: str) -> Lease | None:
        """Give a run up: what it queued may still be published until its lease's deadline."""
        lease = self.drop(run_id)
        if lease is not None:
            self._closing[run_id] = (lease.deadline, lease.token)
        return lease

    def closed(self, run_id: str) -> None:
        """A given-up run's queued messages are out (or its time is up): nothing more is
        published about it."""
        self._closing.pop(run_id, None)

    def expire(self, now: float) -> None:
        """Forget given-up runs whose lease deadline passed."""
        for run_id in [r for r, (until, _) in self._closing.items() if until <= now]:
            del self._closing[run_id]

    def may_publish(self, run_id: str) -> bool:
        """Whether this replica owns the run now (holds its lease, with time to spare): only the
        owner publishes."""
        o = self.owned.get(run_id)
        if o is not None:
            return time.monotonic() < o.deadline
        # A run that just finished or is being handed over: what it queued (a retained signal) still
        # goes out.
        return time.monotonic() < self._closing.get(run_id, (0.0, 0))[0]

    def token(self, run_id: str) -> int:
        """The run's fencing token this replica holds; Fenced when it holds none."""
        o = self.owned.get(run_id)
        if o is None:
            self.on_fenced()
            raise Fenced(f"run {run_id!r} is not owned by replica {self.replica_id}")
        return o.token

    def last_token(self, run_id: str) -> int:
        """The token the run is or was just held with (0: none)."""
        o = self.owned.get(run_id)
        return o.token if o is not None else self._closing.get(run_id, (0.0, 0))[1]

    def advance(self, run_id: str, cursor: str) -> None:
        """The run's records up to inbox id `cursor` are journaled."""
        held = self.owned.get(run_id)
        if held is not None and cursor:
            held.cursor = later(held.cursor, cursor)
