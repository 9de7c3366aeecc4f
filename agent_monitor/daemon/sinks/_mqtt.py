"""The MQTT sink: the monitor's events as MQTT messages (progress, signals, run states, rankings, errors).

It fills the outbox (`daemon._outbox`); the MQTT link (`sources.MqttLink`) publishes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from ...wire import Topics, signal_json
from .._events import GroupRanked, MonitorEvent, Refused, RunClosed, RunOpened, Scored, SignalChanged, Skipped
from .._outbox import Message, Outbox

__all__ = ["MqttSink", "compact_form"]


def _payload(data: Mapping[str, Any]) -> bytes:
    # The JSON form has no NaN (progress.to_json maps non-finite numbers to null); compact UTF-8.
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


_COMPACT_KEYS = ("run_id", "step", "score", "delta", "uncertainty", "criteria", "ok", "error", "reason", "mass",
                 "signal", "decision", "degraded", "final", "verdict")  # fmt: skip
_REQUIRED = frozenset(("run_id", "step", "score", "ok"))
_CRITERION_KEYS = ("score", "weight", "uncertainty", "mass")


def _rounded(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def compact_form(data: Mapping[str, Any]) -> dict[str, Any]:
    """A progress message for terminals (`mosquitto_sub -v`): what a person reads, numbers to 4 decimals.

    Each criterion keeps its score, weight, uncertainty and mass (no letter distribution); the
    bookkeeping (tokens, totals, judge, latency, ...) and empty values are left out. It is still a
    progress message: `ProgressOut` reads it, with defaults for what is left out.
    """
    out: dict[str, Any] = {}
    for k in _COMPACT_KEYS:
        v = data.get(k)
        if k == "criteria":
            out[k] = {n: {f: _rounded(c.get(f)) for f in _CRITERION_KEYS} for n, c in (v or {}).items()}
        elif k == "decision" and isinstance(v, Mapping):
            out[k] = {f: _rounded(x) for f, x in v.items() if x is not None and x is not False}
        elif k in _REQUIRED or (v is not None and v is not False):
            out[k] = _rounded(v)
    return out


class MqttSink:
    """Publish progress, signals and run states (both retained; cleared when the run closes) and errors."""

    events = (Scored, Skipped, SignalChanged, Refused, RunOpened, RunClosed, GroupRanked)

    def __init__(
        self,
        outbox: Outbox,
        topics: Topics,
        *,
        on_signal_sent: Callable[[str, int], None] | None = None,
        on_progress_sent: Callable[[str, int], None] | None = None,
        compact: bool = False,
    ) -> None:
        self.outbox = outbox
        self.topics = topics
        self.compact = compact
        """Progress in the compact form (`serve --progress-form compact`): no letter distributions, rounded."""
        self.on_signal_sent = on_signal_sent
        """Told (run id, the decision's step) once a signal is out: cluster mode remembers which one is."""
        self.on_progress_sent = on_progress_sent
        """Told (run id, step) once a progress message is out: cluster mode remembers the last one."""
        self._progress_topics: dict[str, str] = {}

    def __call__(self, event: MonitorEvent) -> None:
        """Queue the messages for one event."""
        t = self.topics
        if isinstance(event, Scored):
            # One topic name per live run, built once: a run id is checked when its event is decoded.
            where = self._progress_topics.get(event.run_id)
            if where is None:
                where = self._progress_topics[event.run_id] = t.of(event.run_id, "progress")
            shown = self.on_progress_sent
            sent = None if shown is None else partial(shown, event.run_id, event.progress.step)
            data = compact_form(event.data) if self.compact else event.data
            self.outbox.put(Message(where, _payload(data), run_id=event.run_id, sent=sent))
        elif isinstance(event, Skipped):
            if event.heartbeat is not None:
                self.outbox.put(Message(t.of(event.run_id, "progress"), _payload(event.heartbeat), run_id=event.run_id))
        elif isinstance(event, SignalChanged):
            payload = _payload(signal_json(event.run_id, event.decision, event.policy))
            sent = (
                None if self.on_signal_sent is None else partial(self.on_signal_sent, event.run_id, event.decision.step)
            )
            self.outbox.put(
                Message(
                    t.of(event.run_id, "signal"), payload, retain=True, droppable=False, run_id=event.run_id, sent=sent
                )
            )
        elif isinstance(event, Refused):
            where = t.of(event.run_id, "error") if event.run_id else t.errors
            body = {"run_id": event.run_id, "topic": event.topic[:512], "reason": event.reason, "error": event.message}
            self.outbox.put(Message(where, _payload(body), run_id=event.run_id or None))
        elif isinstance(event, GroupRanked):
            # Retained, so a late subscriber sees the ranking now; an empty payload clears it.
            ranking = b"" if event.ranking is None else _payload(event.ranking)
            self.outbox.put(Message(t.ranking(event.group), ranking, retain=True, droppable=False))
        elif isinstance(event, RunOpened):
            # Retained while the run lives: a viewer subscribing later (`top`) lists it at once. The signal topic
            # stays the policy's alone (its first message is the first decision). Droppable, as progress is: in a
            # burst of starts a full outbox loses a viewer's row, never a signal; its clearing is not droppable.
            s = event.start
            state = {"run_id": event.run_id, "state": "live", "task": s.task[:200], "group": s.group,
                     "labels": dict(s.labels), "started_at": s.started_at}  # fmt: skip
            self.outbox.put(Message(t.of(event.run_id, "state"), _payload(state), retain=True, run_id=event.run_id))
        elif isinstance(event, RunClosed):
            self.outbox.put(
                Message(t.of(event.run_id, "state"), b"", retain=True, droppable=False, run_id=event.run_id)
            )
            where = self._progress_topics.pop(event.run_id, None) or t.of(event.run_id, "progress")
            if event.final is not None:
                final = compact_form(event.final) if self.compact else event.final
                self.outbox.put(Message(where, _payload(final), droppable=False, run_id=event.run_id))
            # An empty retained payload deletes the retained signal: a later subscriber sees no stale abort.
            self.outbox.put(
                Message(t.of(event.run_id, "signal"), b"", retain=True, droppable=False, run_id=event.run_id)
            )
