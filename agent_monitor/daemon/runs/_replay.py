"""Replay refusal for signed messages: a signature over `(run_id, started_at, ...)` is good once,
and only while fresh.

The HMACs of outcomes (`--outcome-secret`) and group joins (`--group-secret`) bind the run id and
the start's `started_at`, both chosen by the publisher: a captured signed `end` stays valid for any
start that repeats them. `Replays` makes it single-use: it remembers every `(run_id, started_at)`
already used, and refuses a `started_at` outside the freshness window (older than `max_age_s`, or
more than `_SKEW_S` in the future), so the record need only reach back that far. It is bounded: past
`max_entries` the oldest is forgotten and its `started_at` becomes a floor (nothing at or before it
is fresh), so forgetting never re-opens a replay. The outcome record is persisted through the
calibration samples (their key holds the signed `started_at`) and rebuilt from them on restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ...calibration import outcome_authentic

__all__ = ["Replays", "sample_key", "spend_signed"]

_SKEW_S = 300.0
"""How far in the future a `started_at` may be (clocks of publishers and the monitor differ)."""


def sample_key(run_id: str, started_at: float) -> str:
    """The calibration sample key of a signed outcome: the run id and its signed `started_at`."""
    return f"{run_id}@{float(started_at):.3f}"


class Replays:
    """The `(run_id, started_at)` pairs already used, within a freshness window; `check` says why
    one may not be."""

    def __init__(
        self, max_age_s: float, max_entries: int, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self.clock = clock
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._floor = float("-inf")

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, run_id: str, started_at: float | None) -> str | None:
        """None when the pair may be used; else why not: `no_started_at`, `stale`, `future` or
        `replayed`."""
        if started_at is None:
            return "no_started_at"
        now = self.clock()
        at = float(started_at)
        if at > now + _SKEW_S:
            return "future"
        if at < now - self.max_age_s or at <= self._floor:
            return "stale"
        if (run_id, f"{at:.3f}") in self._seen:
            return "replayed"
        return None

    def used(self, run_id: str, started_at: float) -> None:
        """Remember the pair (its signature is spent); the stale and, past the bound, the oldest
        are forgotten."""
        self._seen[(run_id, f"{float(started_at):.3f}")] = float(started_at)
        self._seen.move_to_end((run_id, f"{float(started_at):.3f}"))
        horizon = self.clock() - self.max_age_s
        while self._seen:
            key, at = next(iter(self._seen.items()))
            if at >= horizon and len(self._seen) <= self.max_entries:
                break
            del self._seen[key]
            if at >= horizon:
                self._floor = max(self._floor, at)

    def restore(self, keys: Iterable[str]) -> None:
        """Remember the pairs of stored sample keys (`run@started_at`; others are skipped)."""
        for key in keys:
            run_id, sep, started = key.rpartition("@")
            try:
                at = float(started)
            except ValueError:
                continue
            if sep and run_id:
                self.used(run_id, at)


def spend_signed(
    secret: str,
    replays: Replays,
    run_id: str,
    started_at: float | None,
    outcome: object,
    auth: str | None,
) -> str | None:
    """Check a signed outcome and spend its signature; None: it may teach, else why not (a refusal
    reason).

    `unauthenticated`: no valid HMAC; `replayed`: its (run id, started_at) was used already;
    `stale`: its started_at is missing or outside the freshness window.
    """
    if not outcome_authentic(secret, run_id, started_at, outcome, auth):
        return "unauthenticated"
    why = replays.check(run_id, started_at)
    if why is not None:
        return "replayed" if why == "replayed" else "stale"
    assert started_at is not None
    replays.used(run_id, started_at)
    return None
