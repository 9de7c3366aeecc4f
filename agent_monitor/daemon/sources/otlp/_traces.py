"""The OTLP receiver's trace assembly: spans to runs and steps, handed to ingest as the wire-form
events.

A request's decoded spans (`_spans`) are grouped by trace into runs:

- a run per trace, or per `agent_monitor.run_id` / `gen_ai.conversation.id` when a span carries one;
- `start` once a task is known (`agent_monitor.task`, the root agent span's user input, else the
  first user message of a model span); action spans wait for it, bounded;
- a `step` per finished action span (tool execution, model turn, hand-off) in end-time order, its
  key the span id, its meta the trace and span ids (so a restarted receiver knows what was sent, and
  evaluation events can name the judged span);
- `end` when the root span ends (a trace's run), or after `idle_s` without spans.

A span that ends before steps already sent ("late") is sent as the next step, its meta carrying its
end time; the tracker judges every prefix in end-time order (`tracker.placed`), so the late span
takes its place. `OtlpMetrics` are the receiver's metrics, its HTTP door's included.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ....wire import MAX_LABEL_VALUE_CHARS, TopicError, check_run_id
from ..._config import OtlpReceiverSettings
from ..._events import MonitorEvent, RunClosed
from .._protocol import Inbound, RunsView, SourceInput
from ._spans import Decoded, Span, classify, span_outcome, span_run_key
from ._spans import step_text as span_step_text
from ._spans import task_of as span_task_of

__all__ = ["IGNORE_REASONS", "REFUSE_REASONS", "OtlpMetrics", "Traces"]

log = structlog.get_logger("agent_monitor.daemon.otlp")

IGNORE_REASONS = ("not_an_action", "no_content", "duplicate", "run_ended")
REFUSE_REASONS = (
    "invalid",
    "bad_run_id",
    "too_many_spans",
    "too_many_traces",
    "body_too_large",
    "batch_too_large",
    "bad_body",
    "unavailable",
    "unauthorized",
)
_ENDED_MEMORY = 10_000


@dataclass(eq=False, slots=True)
class _Run:
    """What the receiver knows of one trace-fed run: the spans it took, the steps it sent, what
    waits for a start."""

    run_id: str
    by_trace: bool
    """The run is one trace (its root span ends it); else a conversation or an explicit run id."""
    last_span: float
    started: bool = False
    seen: set[str] = field(default_factory=set)
    steps: list[tuple[int, str]] = field(default_factory=list)
    """(end time, span id) of each step sent, in index order."""
    last_end: int = 0
    """The latest end time among the steps sent: a step ending before it is late."""
    waiting: list[tuple[Span, str]] = field(default_factory=list)
    """Action spans (with their step text) waiting for the run's start."""
    task: str | None = None
    ended: bool = False
    traces: set[str] = field(default_factory=set)
    service: str | None = None
    """The resource's `service.name` (the agent's name): the run's `service` label, so the board
    names it."""


class OtlpMetrics:
    """The receiver's metrics (`agent_monitor_otlp_*`): requests by status, spans by fate, late
    spans, latencies."""

    def __init__(
        self,
        registry: CollectorRegistry | None,
        *,
        live: Callable[[], int],
        connections: Callable[[], int],
    ) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "agent_monitor_otlp_receiver_requests",
            "OTLP/HTTP trace export requests, by HTTP status.",
            ["code"],
            registry=r,
        )
        self.received = Counter(
            "agent_monitor_otlp_spans_received",
            "Spans in the trace export requests read.",
            registry=r,
        )
        self.accepted = Counter(
            "agent_monitor_otlp_spans_accepted",
            "Spans taken into a run (as a step, a start, an end, or as context).",
            registry=r,
        )
        self.ignored = Counter(
            "agent_monitor_otlp_spans_ignored",
            "Spans taken but not used, by reason: not_an_action (no GenAI or OpenInference "
            "action), no_content "
            "(a model turn whose content was not recorded), duplicate (the same span again), "
            "run_ended.",
            ["reason"],
            registry=r,
        )
        self.refused = Counter(
            "agent_monitor_otlp_spans_refused",
            "Spans refused, by reason (the exporter was told: partial success, 400, 401, 413 "
            "or 503); a request "
            "refused before its spans are read (unauthorized, body_too_large, bad_body, "
            "unavailable) counts one.",
            ["reason"],
            registry=r,
        )
        self.late = Counter(
            "agent_monitor_otlp_late_spans",
            "Action spans that ended before steps already sent: judged in their place by end "
            "time, re-scored.",
            registry=r,
        )
        self.truncated = Counter(
            "agent_monitor_otlp_attributes_truncated",
            "Attribute values cut to --otlp-max-attribute-bytes.",
            registry=r,
        )
        self.dropped = Counter(
            "agent_monitor_otlp_span_items_dropped",
            "A span's events, links or attributes over their per-span cap (128, 128, 256), "
            "dropped unread, by kind.",
            ["kind"],
            registry=r,
        )
        self.final_latency = Histogram(
            "agent_monitor_otlp_final_score_seconds",
            "Seconds from a trace-fed run's last span to its final score (the run closed).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        Gauge(
            "agent_monitor_otlp_traces_live", "Trace-fed runs the receiver follows.", registry=r
        ).set_function(live)
        Gauge(
            "agent_monitor_otlp_connections", "Open OTLP/HTTP connections.", registry=r
        ).set_function(connections)
        for code in ("200", "400", "401", "404", "405", "413", "415", "503"):
            self.requests.labels(code)
        for reason in IGNORE_REASONS:
            self.ignored.labels(reason)
        for kind in ("events", "links", "attributes"):
            self.dropped.labels(kind)
        for reason in REFUSE_REASONS:
            self.refused.labels(reason)


class Traces:
    """Spans to runs: each request's spans folded into their runs, the runs' events handed to
    ingest.

    `ingest` and `view` are the monitor's, set when the receiver runs; until then `take` asks for a
    retry.
    """

    def __init__(
        self,
        settings: OtlpReceiverSettings,
        metrics: OtlpMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.runs: OrderedDict[str, _Run] = OrderedDict()
        self._traces: dict[str, str] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._lock = asyncio.Lock()
        self.view: RunsView | None = None
        self.ingest: SourceInput | None = None
        self.steps = 0
        """Steps sent."""
        self.late = 0
        """Late steps sent (ending before steps already sent)."""

    def on_event(self, event: MonitorEvent) -> None:
        """Forget a run the monitor closed, and time its last span to its final score."""
        if isinstance(event, RunClosed):
            run = self.runs.pop(event.run_id, None)
            if run is not None:
                for t in run.traces:
                    self._traces.pop(t, None)
                self._remember_ended(event.run_id)
                if run.ended:
                    self.metrics.final_latency.observe(max(0.0, self.clock() - run.last_span))

    def span_of(self, run_id: str, step: int) -> tuple[str, str] | None:
        """The (trace id, span id) a trace-fed run's result judged, for its evaluation events; None
        for other runs.

        That is the span ending last among the prefix's steps (the judge reads them in end-time
        order): a late span's own result names the span it was placed before, not itself.
        """
        view = self.view
        metas = view.step_meta(run_id) if view is not None else None
        if not metas or not 1 <= step <= len(metas):
            return None
        best: tuple[int, str, str] | None = None
        for m in metas[:step]:
            otel = m.get("otel")
            if not isinstance(otel, Mapping):
                continue
            trace_id, span_id, end = (
                otel.get("trace_id"),
                otel.get("span_id"),
                otel.get("end_ns", 0),
            )
            if not (
                isinstance(trace_id, str) and isinstance(span_id, str) and isinstance(end, int)
            ):
                continue
            if best is None or end >= best[0]:
                best = (end, trace_id, span_id)
        return (best[1], best[2]) if best is not None else None

    # -- spans to events --

    async def take(self, decoded: Decoded) -> tuple[int, str, bool]:
        """Hand a request's spans to ingest; return (spans rejected, why, whether to answer 503
        Retry-After)."""
        async with self._lock:
            return await self._take(decoded)

    async def _take(self, decoded: Decoded) -> tuple[int, str, bool]:
        if self.ingest is None:
            return 0, "", True  # bound, the monitor not started yet: the exporter retries
        now = self.clock()
        rejected, reason, retry = decoded.rejected, decoded.reason, False
        if decoded.rejected:
            self.metrics.refused.labels("invalid").inc(decoded.rejected)
        by_trace: dict[str, list[Span]] = {}
        for s in decoded.spans:
            by_trace.setdefault(s.trace_id, []).append(s)
        events: list[Inbound] = []
        touched: list[_Run] = []
        for trace_id, spans in by_trace.items():
            run_id = self._traces.get(trace_id)
            explicit = None
            if run_id is None:
                explicit = next((k for k in map(span_run_key, spans) if k is not None), None)
                run_id = explicit[1] if explicit else trace_id
                try:
                    check_run_id(run_id)
                except TopicError as e:
                    rejected += len(spans)
                    reason = reason or f"trace {trace_id}: {e}"
                    self.metrics.refused.labels("bad_run_id").inc(len(spans))
                    continue
            else:
                run_id = self._renamed(run_id, spans, events)
            if run_id in self._ended:
                self.metrics.ignored.labels("run_ended").inc(len(spans))
                self.metrics.accepted.inc(len(spans))
                continue
            run = self.runs.get(run_id) or self._recover(run_id, explicit is None, now)
            if run is not None and run.ended:
                # After its end was sent (the monitor is finishing it): too late to be a step.
                fresh = [s for s in spans if s.span_id not in run.seen]
                self.metrics.ignored.labels("run_ended").inc(len(fresh))
                self.metrics.ignored.labels("duplicate").inc(len(spans) - len(fresh))
                self.metrics.accepted.inc(len(spans))
                continue
            if run is None:
                if len(self.runs) >= self.settings.max_live_traces:
                    self.metrics.refused.labels("too_many_traces").inc(len(spans))
                    retry = True
                    continue
                run = _Run(run_id, by_trace=explicit is None, last_span=now)
            self.runs[run_id] = run
            self.runs.move_to_end(run_id)
            self._traces[trace_id] = run_id
            run.traces.add(trace_id)
            if run.service is None:
                run.service = next(
                    (str(v) for sp in spans if (v := sp.resource.get("service.name"))), None
                )
            n, why = self._spans(run, spans, now, events)
            if n:
                rejected += n
                reason = reason or why
            touched.append(run)
        if events and not await self._send(events, touched):
            retry = True
        return rejected, reason, retry

    def _renamed(self, run_id: str, spans: list[Span], events: list[Inbound]) -> str:
        """The run a trace's root names (`agent_monitor.run_id` on the root alone), its trace's run
        moved there.

        The root ends last, so the trace's earlier spans made a run of the trace id: its steps sent
        so far are sent again under the named run (same texts, same order), and the trace id's run
        is ended with no outcome. A name that is not a valid run id, or belongs to another run here,
        keeps the trace id.
        """
        run = self.runs.get(run_id)
        if run is None or not run.by_trace or run.ended:
            return run_id
        key = next((k for s in spans if s.is_root and (k := span_run_key(s)) is not None), None)
        if key is None or key[1] == run_id:
            return run_id
        new_id = key[1]
        try:
            check_run_id(new_id)
        except TopicError as e:
            log.warning("otlp_root_run_id_refused", trace_run=run_id, error=str(e))
            return run_id
        view = self.view
        if (
            new_id in self.runs
            or new_id in self._ended
            or (view is not None and view.is_live(new_id))
        ):
            log.warning("otlp_root_run_id_taken", trace_run=run_id, run_id=new_id)
            return run_id
        del self.runs[run_id]
        run.run_id, run.by_trace = new_id, False
        self.runs[new_id] = run
        for t in run.traces:
            self._traces[t] = new_id
        if run.started:
            texts = view.step_texts(run_id) if view is not None else None
            metas = view.step_meta(run_id) if view is not None else None
            self._start(run, events)
            for i, (text, meta) in enumerate(zip(texts or (), metas or (), strict=False), 1):
                otel = meta.get("otel") if isinstance(meta, Mapping) else None
                end = otel.get("end_ns", 0) if isinstance(otel, Mapping) else 0
                data = {
                    "index": i,
                    "text": text,
                    "ts": end / 1e9 if isinstance(end, int) else 0.0,
                    "meta": dict(meta),
                }
                span_id = otel.get("span_id") if isinstance(otel, Mapping) else None
                events.append(Inbound(new_id, "step", data, key=str(span_id or f"{run_id}:{i}")))
            events.append(Inbound(run_id, "end", {"outcome": None}, key=f"renamed:{run_id}"))
            self._remember_ended(run_id)
        log.info("otlp_run_renamed", trace_run=run_id, run_id=new_id, steps=len(run.steps))
        return new_id

    def _recover(self, run_id: str, by_trace: bool, now: float) -> _Run | None:
        """A run the monitor has live but this receiver does not know (it restarted): what it
        sent, from the steps."""
        view = self.view
        metas = view.step_meta(run_id) if view is not None else None
        if metas is None:
            return None
        run = _Run(run_id, by_trace=by_trace, last_span=now, started=True)
        for m in metas:
            otel = m.get("otel")
            if isinstance(otel, Mapping) and isinstance(otel.get("span_id"), str):
                run.seen.add(otel["span_id"])
                run.steps.append((int(otel.get("end_ns", 0)), otel["span_id"]))
                run.last_end = max(run.last_end, run.steps[-1][0])
            else:
                run.steps.append((0, ""))
        log.info("otlp_run_recovered", run_id=run_id, steps=len(run.steps))
        return run

    def _spans(
        self, run: _Run, spans: list[Span], now: float, events: list[Inbound]
    ) -> tuple[int, str]:
        """Fold one trace's spans of a request into its run, appending the events to send; return
        (rejected, why)."""
        rejected, why = 0, ""
        fresh: list[Span] = []
        for s in spans:
            if s.span_id in run.seen:
                self.metrics.ignored.labels("duplicate").inc()
                self.metrics.accepted.inc()
                continue
            if len(run.seen) >= self.settings.max_spans_per_trace:
                rejected += 1
                why = why or (
                    f"run {run.run_id} holds {self.settings.max_spans_per_trace} spans, the limit"
                )
                self.metrics.refused.labels("too_many_spans").inc()
                continue
            run.seen.add(s.span_id)
            fresh.append(s)
        if not fresh:
            return rejected, why
        run.last_span = now
        self.metrics.accepted.inc(len(fresh))
        fresh.sort(key=lambda s: (s.end_ns, s.span_id))
        root: Span | None = None
        actions: list[tuple[Span, str]] = []
        classified = [(s, classify(s)) for s in fresh]
        if run.task is None:
            # The root agent span's input wins over an agent's, and an agent's over a model turn's.
            order = sorted(classified, key=lambda c: (not c[0].is_root, c[1] != "agent"))
            run.task = next((t for s, a in order if (t := span_task_of(s, a)) is not None), None)
        for s, action in classified:
            if s.is_root:
                root = s
            if action is None or action == "agent":
                if not s.is_root:
                    self.metrics.ignored.labels("not_an_action").inc()
                continue
            text = span_step_text(s, action, self.settings.max_step_chars)
            if text is None:
                self.metrics.ignored.labels("no_content").inc()
                continue
            actions.append((s, text))
        ends = root is not None and (run.by_trace or span_outcome(root) is not None)
        if not run.started:
            run.waiting.extend(actions)
            actions = []
            if len(run.waiting) > self.settings.max_spans_per_trace:
                run.waiting = run.waiting[-self.settings.max_spans_per_trace :]
            if run.task is not None or ends:
                self._start(run, events)
                run.waiting.sort(key=lambda a: (a[0].end_ns, a[0].span_id))
                actions, run.waiting = run.waiting, []
        for s, text in actions:
            self._step(run, s, text, events)
        if ends and root is not None:
            run.ended = True
            events.append(
                Inbound(
                    run.run_id, "end", {"outcome": span_outcome(root)}, key=f"end:{root.span_id}"
                )
            )
        return rejected, why

    def _start(self, run: _Run, events: list[Inbound]) -> None:
        task = run.task or f"(the agent's task was not recorded in the spans of run {run.run_id})"
        start: dict[str, Any] = {"task": task[:100_000]}
        if run.service:
            start["labels"] = {"service": run.service[:MAX_LABEL_VALUE_CHARS]}
        events.append(Inbound(run.run_id, "start", start, key=f"start:{run.run_id}"))
        run.started = True

    def _step(self, run: _Run, s: Span, text: str, events: list[Inbound]) -> None:
        if s.end_ns < run.last_end:
            # Placed by its end time when judged (the meta below): the next score judges the
            # trajectory with it there.
            self.metrics.late.inc()
            self.late += 1
        run.steps.append((s.end_ns, s.span_id))
        run.last_end = max(run.last_end, s.end_ns)
        meta = {"otel": {"trace_id": s.trace_id, "span_id": s.span_id, "end_ns": s.end_ns}}
        data = {"index": len(run.steps), "text": text, "ts": s.end_ns / 1e9, "meta": meta}
        events.append(Inbound(run.run_id, "step", data, key=s.span_id))
        self.steps += 1

    async def _send(self, events: list[Inbound], touched: list[_Run]) -> bool:
        """Hand the events to ingest; on a store error forget the touched runs (rebuilt from the
        monitor's steps)."""
        assert self.ingest is not None
        try:
            errors = await self.ingest.events(events)
        except Exception as e:
            errors = [e]
        failed = [e for e in errors if e is not None]
        if not failed:
            return True
        log.warning(
            "otlp_spans_not_journaled",
            events=len(failed),
            error=f"{type(failed[0]).__name__}: {failed[0]}",
        )
        for run in touched:
            self.runs.pop(run.run_id, None)
            for t in run.traces:
                self._traces.pop(t, None)
        return False

    async def sweep(self) -> None:
        """End the runs whose spans stopped coming `idle_s` ago (their roots never ended here)."""
        now = self.clock()
        async with self._lock:
            # An ended run the monitor never opened or no longer has (its start refused, the run
            # evicted before the close reached us) would stay here for ever: forgotten one more idle
            # time after its end.
            view = self.view
            gone = [
                r
                for r in self.runs.values()
                if r.ended
                and now - r.last_span >= 2 * self.settings.idle_s
                and not (view and view.is_live(r.run_id))
            ]
            for run in gone:
                self.runs.pop(run.run_id, None)
                for t in run.traces:
                    self._traces.pop(t, None)
                self._remember_ended(run.run_id)
            idle = [
                r
                for r in self.runs.values()
                if not r.ended and now - r.last_span >= self.settings.idle_s
            ]
            events: list[Inbound] = []
            for run in idle:
                if not run.started:
                    self._start(run, events)
                    run.waiting.sort(key=lambda a: (a[0].end_ns, a[0].span_id))
                    for s, text in run.waiting:
                        self._step(run, s, text, events)
                    run.waiting = []
                run.ended = True
                events.append(
                    Inbound(run.run_id, "end", {"outcome": None}, key=f"idle:{run.run_id}")
                )
                log.info("otlp_run_idle", run_id=run.run_id, idle_s=self.settings.idle_s)
            if events:
                await self._send(events, idle)

    def _remember_ended(self, run_id: str) -> None:
        self._ended[run_id] = self.clock()
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    # -- HTTP --
