"""The web board's state: a sink that keeps what the board shows of each run, and tells every
connected browser.

`Board` takes the monitor's `RunOpened`, `Scored`, `SignalChanged` and `RunClosed` events and keeps,
for the most recently active runs (`BoardSettings.max_runs`), the newest points of each curve, the
score, uncertainty, spread, step, signal and reason, the task (truncated) and the labels; an ended
run stays for a grace period, then leaves. Each browser following the board (`subscribe`, the web
server's `/events`) gets its own bounded queue of encoded server-sent events: a browser that falls
more than `client_queue` updates behind is dropped (its connection aborted, counted in
`agent_monitor_board_clients_dropped_total{reason="slow"}`) and reconnects to a fresh snapshot, so a
slow browser never slows scoring. Everything here runs on the event loop and never blocks.

Text in these events comes from the network (run ids, tasks, labels, reasons): the board page puts
it in the DOM with `textContent` only, never as markup.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from ...progress import Progress, finite
from .._config import BoardSettings
from .._events import MonitorEvent, RunClosed, RunOpened, Scored, SignalChanged

if TYPE_CHECKING:
    from ..runs import RunView

TASK_CHARS = 300
"""A run's task is cut to this many characters on the board (the whole task can be megabytes)."""
TEXT_CHARS = 300
"""Reasons and error texts are cut to this many characters."""


def _cut(text: str | None, n: int = TEXT_CHARS) -> str | None:
    if text is None:
        return None
    return text if len(text) <= n else text[: n - 1] + "…"


@dataclass(eq=False, slots=True)
class _Run:
    """What the board shows of one run."""

    run_id: str
    task: str
    labels: dict[str, str]
    started: float
    updated: float
    curve: deque[tuple[int, float | None, float | None]]
    step: int = 0
    score: float | None = None
    uncertainty: float | None = None
    spread: float | None = None
    mass: float | None = None
    ok: bool = True
    failure: str | None = None
    """The reason code of the newest scoring when it gave no score."""
    error: str | None = None
    signal: str = "continue"
    signal_reason: str = ""
    signal_step: int | None = None
    tokens: tuple[int, int, int] = (0, 0, 0)
    """The run's judge tokens so far (input, cached input, output): the newest result's running
    totals."""
    cost: float | None = None
    """What they cost in USD (None: the monitor has no prices)."""
    outcome: str | None = None
    """How the run ended (success, failure, expired, ...); None while it is live."""
    ended_at: float | None = None

    def score_with(self, p: Progress, at: float) -> tuple[int, float | None, float | None]:
        self.updated = at
        self.step = max(self.step, p.step)
        score, uncertainty = finite(p.score), finite(p.uncertainty)
        self.ok, self.mass = p.ok, finite(p.mass)
        t = p.totals
        self.tokens, self.cost = (
            (t.input_tokens, t.cached_input_tokens, t.output_tokens),
            finite(p.cost),
        )
        if p.ok:
            # The curve and the big number keep the last good score through a failed scoring (as the
            # gauges do).
            self.score, self.uncertainty, self.spread = score, uncertainty, finite(p.spread)
            self.failure = self.error = None
        else:
            self.failure, self.error = p.reason, _cut(p.error)
        if p.signal is not None:
            self.signal, self.signal_reason, self.signal_step = (
                p.signal.signal,
                _cut(p.signal.reason) or "",
                p.signal.step,
            )
        point = (p.step, score, uncertainty)
        while self.curve and self.curve[-1][0] >= p.step:
            self.curve.pop()  # a step scored again (after a judge outage): its newest score stands
        self.curve.append(point)
        return point

    def json(self, *, curve: bool) -> dict[str, Any]:
        data: dict[str, Any] = {
            "run_id": self.run_id,
            "task": self.task,
            "labels": self.labels,
            "group": self.labels.get("group"),
            "started": self.started,
            "updated": self.updated,
            "step": self.step,
            "score": self.score,
            "uncertainty": self.uncertainty,
            "spread": self.spread,
            "mass": self.mass,
            "tokens": {
                "input": self.tokens[0],
                "cached_input": self.tokens[1],
                "output": self.tokens[2],
            },
            "cost": self.cost,
            "ok": self.ok,
            "failure": self.failure,
            "error": self.error,
            "signal": self.signal,
            "signal_reason": self.signal_reason,
            "signal_step": self.signal_step,
            "outcome": self.outcome,
            "ended_at": self.ended_at,
        }
        if curve:
            data["curve"] = list(self.curve)  # (step, score, uncertainty) tuples: JSON arrays
        return data


class BoardClient:
    """One browser's queue of encoded events; dropped (never waited for) when it falls too far
    behind."""

    def __init__(self, limit: int, on_drop: Callable[[], object]) -> None:
        self.limit = limit
        self.dropped = False
        self._on_drop = on_drop
        self._queue: deque[bytes] = deque()
        self._wake = asyncio.Event()

    def push(self, message: bytes) -> bool:
        """Queue one encoded event; False (and nothing queued) when the queue is full."""
        if len(self._queue) >= self.limit:
            return False
        self._queue.append(message)
        self._wake.set()
        return True

    def drop(self) -> None:
        """Stop this client: its writer ends and its connection is aborted (it cannot be waited
        for)."""
        if self.dropped:
            return
        self.dropped = True
        self._queue.clear()
        self._wake.set()
        self._on_drop()

    async def take(self, timeout_s: float) -> list[bytes]:
        """The events queued so far (waiting up to `timeout_s` for one); empty on a timeout or
        once dropped."""
        if not self._queue and not self.dropped:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
        self._wake.clear()
        if self.dropped:
            return []
        out = list(self._queue)
        self._queue.clear()
        return out


def sse(kind: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event: JSON on a single `data:` line (json.dumps escapes the newlines
    inside strings)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return f"event: {kind}\ndata: {text}\n\n".encode()


class Board:
    """The sink behind the web board: the most recently active runs, their curves and signals;
    pushes to browsers.

    ```python
    board = Board(BoardSettings(), registry=registry)
    async with Monitor(config, judge=judge, registry=registry, sinks=[board]) as monitor:
        ...  # HttpServer(registry, site=BoardSite(board), port=9464) serves it at /
    ```
    """

    events = (RunOpened, Scored, SignalChanged, RunClosed)

    def __init__(
        self,
        settings: BoardSettings | None = None,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings if settings is not None else BoardSettings()
        self.clock = clock
        self.registry = registry if registry is not None else CollectorRegistry()
        self._runs: OrderedDict[str, _Run] = OrderedDict()  # least recently active first
        # Task and labels of every live run (bounded by the monitor's live runs), so a run that was
        # off the board (more than max_runs active) comes back with its task when it is active
        # again.
        self._known: dict[str, tuple[str, dict[str, str], float]] = {}
        self._live = 0
        self._clients: set[BoardClient] = set()
        self._clients_gauge = Gauge(
            "agent_monitor_board_clients",
            "Browsers following the web board (/events) now.",
            registry=self.registry,
        )
        self._dropped = Counter(
            "agent_monitor_board_clients_dropped",
            "Browsers the web board let go, by reason: slow (fell --board-client-queue "
            "updates behind; it "
            "reconnects) or full (turned away: --board-clients already connected).",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("slow", "full"):
            self._dropped.labels(reason)

    # -- the sink --

    def __call__(self, event: MonitorEvent) -> None:
        """Fold one monitor event into the board and tell the browsers."""
        if isinstance(event, Scored):
            run = self._touch(event.run_id, event.at)
            point = run.score_with(event.progress, event.at)
            self._publish("run", {"run": run.json(curve=False), "point": list(point)})
        elif isinstance(event, SignalChanged):
            run = self._touch(event.run_id, self.clock())
            d = event.decision
            run.signal, run.signal_reason, run.signal_step = d.signal, _cut(d.reason) or "", d.step
            self._publish("run", {"run": run.json(curve=False)})
        elif isinstance(event, RunOpened):
            now = self.clock()
            self._live = event.live
            self._known[event.run_id] = (
                _cut(event.start.task, TASK_CHARS) or "",
                dict(event.start.labels),
                now,
            )
            self._runs.pop(event.run_id, None)  # a run id used again is a new run
            run = self._touch(event.run_id, now)
            self._publish("run", {"run": run.json(curve=True)})
        elif isinstance(event, RunClosed):
            self._live = event.live
            self._known.pop(event.run_id, None)
            shown = self._runs.get(event.run_id)
            if shown is None:
                # a run off the board ended: only the count of the others changed
                self._publish("counts", {})
                return
            if self.settings.grace_s <= 0:
                self._forget(event.run_id)
                return
            shown.outcome, shown.ended_at, shown.updated = event.outcome, event.at, event.at
            shown.signal = event.signal
            if event.latest is not None:
                shown.step = max(shown.step, event.latest.step)
            self._runs.move_to_end(event.run_id)
            self._publish("run", {"run": shown.json(curve=False)})

    def _touch(self, run_id: str, at: float) -> _Run:
        """The run's board entry, made most recently active (made, evicting the least recent, if
        needed)."""
        run = self._runs.get(run_id)
        if run is not None:
            run.updated = at
            self._runs.move_to_end(run_id)
            return run
        task, labels, started = self._known.get(run_id, ("", {}, at))
        run = self._runs[run_id] = _Run(
            run_id, task, labels, started, at, deque(maxlen=self.settings.points)
        )
        while len(self._runs) > self.settings.max_runs:
            old, _ = self._runs.popitem(last=False)
            self._publish("gone", {"run_id": old})
        return run

    def _forget(self, run_id: str) -> None:
        if self._runs.pop(run_id, None) is not None:
            self._publish("gone", {"run_id": run_id})

    def prune(self) -> None:
        """Drop ended runs past the grace period (the web server calls it every second)."""
        if not self._runs:
            return
        now = self.clock()
        for run_id in [r.run_id for r in self._runs.values() if r.ended_at is not None]:
            ended = self._runs[run_id].ended_at
            if ended is not None and now - ended >= self.settings.grace_s:
                self._forget(run_id)

    def restore(self, views: Iterable[RunView | None], *, live: int) -> None:
        """Put runs restored from the store on the board (`Monitor.run()` views, least recently
        active first)."""
        for v in views:
            if v is None:
                continue
            self._known[v.run_id] = (_cut(v.task, TASK_CHARS) or "", dict(v.labels), v.last_event)
            run = self._touch(v.run_id, v.last_event)
            for p in v.curve:
                run.score_with(p, v.last_event)
            run.signal = v.signal
        self._live = live
        self._publish("counts", {})

    # -- what browsers get --

    @property
    def hidden(self) -> int:
        """Live runs not on the board (more than max_runs are live)."""
        return max(0, self._live - sum(1 for r in self._runs.values() if r.outcome is None))

    def snapshot(self) -> dict[str, Any]:
        """Every run on the board with its curve, most recently active first (`/api/runs`, and
        /events on connect)."""
        self.prune()
        return {
            "runs": [r.json(curve=True) for r in reversed(self._runs.values())],
            **self._counts(),
            "max_runs": self.settings.max_runs,
            "points": self.settings.points,
            "grace_s": self.settings.grace_s,
            "now": self.clock(),
        }

    def entry(self, run_id: str) -> dict[str, Any] | None:
        """One run as the board holds it, with its curve (None: not on the board)."""
        run = self._runs.get(run_id)
        return None if run is None else run.json(curve=True)

    def _counts(self) -> dict[str, int]:
        return {"live": self._live, "hidden": self.hidden}

    def subscribe(self, on_drop: Callable[[], object]) -> tuple[BoardClient, dict[str, Any]] | None:
        """A new browser's queue and the snapshot to send it first, or None when --board-clients are
        connected.

        The snapshot is taken when the queue starts, so the browser misses nothing between the two.
        It is a copy (encode it anywhere, e.g. in a worker thread: a full board is a megabyte of
        JSON).
        """
        if len(self._clients) >= self.settings.max_clients:
            self._dropped.labels("full").inc()
            return None
        client = BoardClient(self.settings.client_queue, on_drop)
        self._clients.add(client)
        self._clients_gauge.set(len(self._clients))
        return client, self.snapshot()

    def unsubscribe(self, client: BoardClient) -> None:
        """Forget a browser that went away."""
        self._clients.discard(client)
        self._clients_gauge.set(len(self._clients))

    @property
    def clients(self) -> int:
        """Browsers following the board now."""
        return len(self._clients)

    def _publish(self, kind: str, data: dict[str, Any]) -> None:
        if not self._clients:
            return
        message = sse(kind, {**data, **self._counts()})
        for client in list(self._clients):
            if not client.push(message):
                # Never wait for a browser: one that cannot keep up starts again from a snapshot.
                self._clients.discard(client)
                self._dropped.labels("slow").inc()
                client.drop()
        self._clients_gauge.set(len(self._clients))

    def close(self) -> None:
        """Drop every browser (the web server is stopping)."""
        for client in list(self._clients):
            client.drop()
        self._clients.clear()
        self._clients_gauge.set(0)


__all__ = ["Board", "BoardClient", "BoardSettings", "sse"]
