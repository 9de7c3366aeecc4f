"""The Arize Phoenix sink: live progress annotations on the agent's own spans, outside the scoring
path.

A score of a trace-fed run (`serve --otlp-receiver`) names the span it judged (the OTLP receiver's
`span_of`); the sink turns it into a Phoenix span annotation on that span (`POST
/v1/span_annotations`) and, when the run closes, a trace annotation with the final score and
decision (`POST /v1/trace_annotations`). Taking an event appends to a bounded queue and returns: the
sink's own task (`phoenix` in the monitor's TaskGroup) sends batches, retries a failed request with
backoff and drops (counted) what Phoenix does not take in time. Each annotation's `identifier` is
fixed by the run and step, so Phoenix upserts: sent again after a restart or a retry, it replaces
itself. Phoenix accepts annotations for spans it has not ingested yet and applies them once the span
arrives, so the agent's exporter and the monitor need not agree on who reaches Phoenix first.

A run that came by another door (MQTT, the proxy, the reward API) has no span of its own: the sink
exports one for it over OTLP (`POST /v1/traces`, protobuf, in the project `--phoenix-project`), a
trace per run with a root span and a span per scored step, their ids derived from the run id and
step (a restart exports the same ids again), and annotates those.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..._runtime.http_client import WireConnectionError, WirePool, WireTimeout
from ...progress import Progress
from .._config import PhoenixSettings
from .._events import MonitorEvent, RunClosed, Scored

__all__ = ["DROP_REASONS", "KINDS", "PhoenixSink", "PhoenixStatistics"]

log = structlog.get_logger("agent_monitor.daemon.phoenix")

DROP_REASONS = ("queue_full", "gave_up", "refused", "shutdown")
KINDS = ("span", "trace", "run_span")
"""What the sink sends: span annotations, trace annotations, and the spans it exports for runs
without a trace."""
_BACKOFF_S = 0.5
_BACKOFF_MAX_S = 30.0
_LINGER_S = 0.2
"""How long the sender waits after the first queued annotation for others to join its batch."""
_TRACE_MEMORY = 100_000
"""Runs whose trace id the sink remembers until they close (more live runs than this is past any
limit)."""
_MAX_TEXT = 4_000
"""Characters of an explanation at most (a judge's error can be long)."""

Kind = Literal["span", "trace", "run_span"]
_PATHS: Mapping[Kind, str] = {
    "run_span": "/v1/traces",  # first: a batch's spans go before the annotations on them
    "span": "/v1/span_annotations",
    "trace": "/v1/trace_annotations",
}
_JSON = "application/json"
_PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True, slots=True)
class PhoenixStatistics:
    """What the Phoenix sink did since it was made."""

    queued: int
    """Annotations waiting to be sent now, the batch being sent included."""
    sent: int
    """Annotations (and spans exported for runs without a trace) Phoenix accepted."""
    failed: int
    """Of those, sent in requests that failed (each attempt counts; a retried one may be sent
    later)."""
    dropped: int
    """Never delivered: the queue was full, Phoenix refused them, or retries ran out."""
    exported: int
    """Spans agent-monitor exported for runs that came by other doors (MQTT, proxy, reward API)."""
    requests: int
    """Requests that reached Phoenix and were answered 2xx."""


@dataclass(frozen=True, slots=True)
class _Item:
    kind: Kind
    key: tuple[str, str]
    """(span or trace id, identifier): what Phoenix upserts on; a later item with the same key
    replaces it."""
    data: Any
    """An annotation's JSON, or (kind run_span) the `_RunSpan` to export."""


@dataclass(frozen=True, slots=True)
class _RunSpan:
    """A span agent-monitor exports for a run without one: the run's root, or one scored step."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start: float
    end: float
    attributes: Mapping[str, str | int | float]


class PhoenixSink:
    """Annotate runs in Arize Phoenix: a monitor sink (`__call__`) plus the task that sends (`run`).

    `spans(run_id, step)` names the (trace id, span id) a run's result judged (the OTLP receiver's
    `span_of`); without it, or for a run it does not know, the sink exports a span of its own for
    the step and annotates that. `registry` takes the `agent_monitor_phoenix_*` metrics. `sleep`
    waits between retries (tests shorten it).
    """

    events = (Scored, RunClosed)

    def __init__(
        self,
        settings: PhoenixSettings,
        *,
        registry: CollectorRegistry,
        spans: Callable[[str, int], tuple[str, str] | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if settings.url is None:
            raise ValueError("PhoenixSink needs settings.url (--phoenix)")
        self.settings = settings
        self.url = settings.url.rstrip("/")
        self.spans = spans
        self.clock = clock
        self.sleep = sleep
        self._queue: deque[_Item] = deque()
        self._inflight = 0
        self._wake = asyncio.Event()
        self._traces: OrderedDict[str, tuple[str, float, bool]] = OrderedDict()
        """Per live run: its trace id, when its first score came, whether the trace is the sink's
        own."""
        self._failing = False
        self._pools: dict[str, WirePool] = {}
        self._stats = {"sent": 0, "failed": 0, "dropped": 0, "exported": 0, "requests": 0}
        self.sent = Counter(
            "agent_monitor_phoenix_annotations_sent",
            "Annotations Phoenix accepted, by kind: span, trace, and run_span (a span "
            "agent-monitor exported for a "
            "run that came by another door than OTLP traces).",
            ["kind"],
            registry=registry,
        )
        self.failed = Counter(
            "agent_monitor_phoenix_annotations_failed",
            "Annotations in requests to Phoenix that failed (each attempt; a retry may still "
            "deliver them).",
            registry=registry,
        )
        self.dropped = Counter(
            "agent_monitor_phoenix_annotations_dropped",
            "Annotations never delivered to Phoenix, by reason: queue_full (the sink's queue "
            "was full), gave_up "
            "(every retry failed), refused (Phoenix answered 4xx), shutdown (still queued "
            "when the monitor stopped).",
            ["reason"],
            registry=registry,
        )
        self.latency = Histogram(
            "agent_monitor_phoenix_request_seconds",
            "Seconds one annotation request to Phoenix took, answered or not.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        Gauge(
            "agent_monitor_phoenix_queue_depth",
            "Annotations waiting to be sent to Phoenix.",
            registry=registry,
        ).set_function(lambda: len(self._queue) + self._inflight)
        for kind in KINDS:
            self.sent.labels(kind)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)

    # -- the sink: called on the event loop by the monitor, never blocks --

    def __call__(self, event: MonitorEvent) -> None:
        """Queue the annotation an event makes (a score: its span's; a closed run: its trace's)."""
        if isinstance(event, Scored):
            self._scored(event)
        elif isinstance(event, RunClosed):
            self._closed(event)

    def _scored(self, event: Scored) -> None:
        p = event.progress
        ref = self.spans(event.run_id, p.step) if self.spans is not None else None
        label, explanation = _step_label(p)
        if ref is None:
            ref = self._own_span(event, label)
        trace_id, span_id = ref
        if event.run_id not in self._traces:
            self._remember(event.run_id, (trace_id, min(event.arrived, default=event.at), False))
        data = {
            "span_id": span_id,
            "name": self.settings.annotation,
            "annotator_kind": "LLM",
            "result": {"label": label, "score": p.score, "explanation": explanation},
            "metadata": {
                "run_id": event.run_id,
                "step": p.step,
                "rubric": p.rubric,
                "uncertainty": p.uncertainty,
                "judge": p.model or p.judge,
                **({"error": p.reason} if not p.ok else {}),
            },
            "identifier": (identifier := f"agent-monitor:{event.run_id}:{p.step}"),
        }
        self._put(_Item("span", (span_id, identifier), data))

    def _own_span(self, event: Scored, label: str) -> tuple[str, str]:
        """Export a span for a scored step of a run without spans of its own (its trace made on
        its first)."""
        run_id, p = event.run_id, event.progress
        trace_id, root_id = _ids(run_id, "run")
        known = self._traces.get(run_id)
        self._remember(
            run_id, (trace_id, known[1] if known else min(event.arrived, default=event.at), True)
        )
        span_id = _ids(run_id, str(p.step))[1]
        attributes: dict[str, str | int | float] = {
            "openinference.span.kind": "EVALUATOR",
            "agent_monitor.run_id": run_id,
            "agent_monitor.step": p.step,
            "agent_monitor.label": label,
        }
        if p.score is not None:
            attributes["agent_monitor.score"] = p.score
        started = min(event.arrived, default=event.at)
        span = _RunSpan(
            trace_id,
            span_id,
            root_id,
            f"agent-monitor step {p.step}",
            started,
            event.at,
            attributes,
        )
        self._put(_Item("run_span", (span_id, ""), span))
        return trace_id, span_id

    def _closed(self, event: RunClosed) -> None:
        known = self._traces.pop(event.run_id, None)
        if known is None:
            return  # never scored: nothing of it in Phoenix
        trace_id, started, own = known
        if own:
            # The root of the trace the sink made for this run, now that its end is known.
            attributes: dict[str, str | int | float] = {
                "openinference.span.kind": "AGENT",
                "agent_monitor.run_id": event.run_id,
                "agent_monitor.outcome": event.outcome,
                "agent_monitor.steps": event.steps,
            }
            name = f"agent-monitor run {event.run_id}"
            root = _RunSpan(
                trace_id, _ids(event.run_id, "run")[1], None, name, started, event.at, attributes
            )
            self._put(_Item("run_span", (root.span_id, ""), root))
        final = event.final or {}
        last = event.latest if event.latest is not None and event.latest.ok else event.last_ok
        score = final.get("score", last.score if last is not None else None)
        decision = last.signal if last is not None else None
        verdict = final.get("verdict")
        label = (
            str(verdict) if verdict else (event.signal if event.signal != "continue" else "done")
        )
        evidence = [f"run {event.outcome} after {event.steps} steps", f"decision {event.signal}"]
        if decision is not None:
            evidence.append(f"{decision.reason} at step {decision.step}")
            if decision.best_step is not None and decision.best_score is not None:
                evidence.append(f"best {decision.best_score:.3f} at step {decision.best_step}")
        if last is not None:
            evidence.append(
                f"last score {_num(last.score)} ± {_num(last.uncertainty)} at step {last.step}"
            )
            evidence.append(f"judge {last.model or last.judge}")
        data = {
            "trace_id": trace_id,
            "name": self.settings.annotation,
            "annotator_kind": "LLM",
            "result": {
                "label": label,
                "score": score,
                "explanation": "; ".join(evidence)[:_MAX_TEXT],
            },
            "metadata": {
                "run_id": event.run_id,
                "steps": event.steps,
                "outcome": event.outcome,
                "signal": event.signal,
                **({"verdict": verdict} if verdict else {}),
                **({"rubric": last.rubric} if last is not None else {}),
            },
            "identifier": (identifier := f"agent-monitor:{event.run_id}"),
        }
        self._put(_Item("trace", (trace_id, identifier), data))

    def _remember(self, run_id: str, known: tuple[str, float, bool]) -> None:
        self._traces[run_id] = known
        self._traces.move_to_end(run_id)
        while len(self._traces) > _TRACE_MEMORY:
            self._traces.popitem(last=False)

    def _put(self, item: _Item) -> None:
        if len(self._queue) >= self.settings.max_queue:
            self._drop("queue_full", 1)
            return
        self._queue.append(item)
        self._wake.set()

    def _drop(self, reason: str, n: int) -> None:
        self.dropped.labels(reason).inc(n)
        self._stats["dropped"] += n

    # -- the sender: the monitor's task `phoenix` --

    async def run(self) -> None:
        """Send queued annotations in batches until cancelled (what is still queued then is
        `close`'s)."""
        s = self.settings
        auth = {"Authorization": f"Bearer {s.api_key}"} if s.api_key is not None else {}
        for ctype in (_JSON, _PROTOBUF):
            self._pools[ctype] = WirePool(
                self.url, headers={"Content-Type": ctype, **auth}, max_connections=2
            )
        log.info("phoenix_annotating", url=self.url, annotation=s.annotation)
        while True:
            await self._wake.wait()
            await asyncio.sleep(_LINGER_S)  # let a burst of scores share one request
            while self._queue:
                batch = self._take()
                self._inflight = len(batch)
                try:
                    await self._send(batch, self.settings.retries)
                except asyncio.CancelledError:
                    # The monitor is stopping: `close` sends the batch once more (Phoenix upserts
                    # what arrived).
                    self._queue.extendleft(reversed(batch))
                    raise
                except Exception:
                    # A batch that cannot even be encoded must not end the monitor's TaskGroup:
                    # dropped, counted.
                    log.exception("phoenix_batch_failed", annotations=len(batch))
                    self._drop("gave_up", len(batch))
                finally:
                    self._inflight = 0
            self._wake.clear()

    def _take(self) -> list[_Item]:
        batch: list[_Item] = []
        while self._queue and len(batch) < self.settings.max_batch:
            batch.append(self._queue.popleft())
        return batch

    async def _send(self, batch: list[_Item], retries: int) -> None:
        """Send one batch (a request per kind), retrying with backoff; drop and count what never
        goes."""
        for kind in _PATHS:
            # The last annotation per key wins (a step re-scored, a signal after its score): one row
            # each.
            latest = {item.key: item.data for item in batch if item.kind == kind}
            if latest:
                await self._deliver(kind, list(latest.values()), retries)

    async def _deliver(self, kind: Kind, data: list[Any], retries: int) -> None:
        if kind == "run_span":
            ctype, body = _PROTOBUF, _export_request(self.settings.project, data)
        else:
            ctype, body = (
                _JSON,
                json.dumps({"data": data}, separators=(",", ":"), allow_nan=False).encode(),
            )
        n = len(data)
        for attempt in range(retries + 1):
            if attempt:
                await self.sleep(min(_BACKOFF_S * 2 ** (attempt - 1), _BACKOFF_MAX_S))
            outcome, error = await self._post(ctype, _PATHS[kind], body)
            if outcome == "ok":
                self.sent.labels(kind).inc(n)
                self._stats["sent"] += n
                if kind == "run_span":
                    self._stats["exported"] += n
                self._stats["requests"] += 1
                if self._failing:
                    self._failing = False
                    log.info("phoenix_recovered", url=self.url)
                return
            self.failed.inc(n)
            self._stats["failed"] += n
            if outcome == "refused":
                # A 4xx is an answer about these annotations: sending them again gets the same one.
                self._drop("refused", n)
                log.warning("phoenix_refused", url=self.url, kind=kind, annotations=n, error=error)
                return
            if not self._failing:
                self._failing = True
                # Once per outage: the next line about Phoenix is the recovery.
                hint = (
                    "is Phoenix running there? scoring goes on; annotations are retried, "
                    "then dropped and counted "
                    "in agent_monitor_phoenix_annotations_dropped_total"
                )
                log.warning("phoenix_failing", url=self.url, annotations=n, error=error, hint=hint)
        self._drop("gave_up", n)

    async def _post(
        self, ctype: str, path: str, body: bytes
    ) -> tuple[Literal["ok", "retry", "refused"], str | None]:
        started = self.clock()
        try:
            reply = await self._pools[ctype].request(
                "POST", path, body, timeout_s=self.settings.timeout_s
            )
        except (WireTimeout, WireConnectionError) as e:
            return "retry", str(e)
        finally:
            self.latency.observe(max(0.0, self.clock() - started))
        if 200 <= reply.status < 300:
            return "ok", None
        why = f"HTTP {reply.status}: {reply.body[:300].decode('utf-8', 'replace')}"
        if reply.status in (401, 403):
            why += " (check --phoenix-api-key)"
        # 408, 429 and 5xx are Phoenix busy or down: worth another try.
        return ("retry" if reply.status in (408, 429) or reply.status >= 500 else "refused"), why

    async def close(self, timeout_s: float = 5.0) -> None:
        """Send what is still queued for at most about `timeout_s` (one attempt per batch), then
        drop the rest."""
        if not self._pools:
            self._drop("shutdown", len(self._queue))
            self._queue.clear()
            return
        try:
            async with asyncio.timeout(timeout_s):
                while self._queue:
                    await self._send(self._take(), 0)
        except TimeoutError:
            pass
        finally:
            if self._queue:
                log.warning(
                    "phoenix_annotations_unsent", url=self.url, annotations=len(self._queue)
                )
                self._drop("shutdown", len(self._queue))
                self._queue.clear()
            for pool in self._pools.values():
                await pool.aclose()

    def statistics(self) -> PhoenixStatistics:
        """Queued, sent, failed, dropped and exported items, and requests answered."""
        return PhoenixStatistics(queued=len(self._queue) + self._inflight, **self._stats)


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


def _step_label(p: Progress) -> tuple[str, str]:
    """A score's label (the decision when it changed to a stop, else the most likely letter) and
    explanation."""
    d = p.signal
    parts: list[str] = []
    if not p.ok:
        parts.append(f"the judge failed ({p.reason}): {p.error}")
    else:
        parts.append(f"score {_num(p.score)} ± {_num(p.uncertainty)}")
    parts.append(f"judge {p.model or p.judge}")
    for name, c in p.criteria.items():
        if c.source != "llm" and c.detail:
            parts.append(f"rule {name}: {c.detail}")  # a rule criterion fired: what it saw
    if d is not None and (d.changed or d.signal != "continue"):
        parts.append(f"decision {d.signal}: {d.reason}")
    label: str
    if d is not None and d.changed and d.signal != "continue":
        label = d.signal
    elif not p.ok:
        label = "failed"
    else:
        label = _likely_letter(p) or "scored"
    return label, "; ".join(parts)[:_MAX_TEXT]


def _likely_letter(p: Progress) -> str | None:
    """The letter with the most probability over the criteria, weighted by each criterion's
    weight."""
    mass: dict[str, float] = {}
    for c in p.criteria.values():
        for letter, prob in c.letters.items():
            mass[letter] = mass.get(letter, 0.0) + c.weight * prob
    return max(mass, key=lambda k: mass[k]) if mass else None


def _ids(run_id: str, part: str) -> tuple[str, str]:
    """A run's own trace id and the span id of one of its parts ("run", or a step): the same
    after a restart."""
    trace = hashlib.sha256(f"agent-monitor:{run_id}".encode()).hexdigest()[:32]
    span = hashlib.sha256(f"agent-monitor:{run_id}:{part}".encode()).hexdigest()[:16]
    return trace, span


# -- OTLP/HTTP protobuf, written by hand: the few fields of ExportTraceServiceRequest a run's spans
# need --


def _export_request(project: str, spans: list[_RunSpan]) -> bytes:
    """An ExportTraceServiceRequest: one resource (service agent-monitor, the Phoenix project),
    one scope."""
    resource = b"".join(
        _len(1, _attribute(k, v))
        for k, v in (("service.name", "agent-monitor"), ("openinference.project.name", project))
    )
    scope = _len(1, _str(1, "agent-monitor"))
    scope_spans = _len(2, scope + b"".join(_len(2, _span(s)) for s in spans))
    return _len(1, _len(1, resource) + scope_spans)


def _span(s: _RunSpan) -> bytes:
    out = _len(1, bytes.fromhex(s.trace_id)) + _len(2, bytes.fromhex(s.span_id))
    if s.parent_id is not None:
        out += _len(4, bytes.fromhex(s.parent_id))
    out += _str(5, s.name) + _tag(6, 0) + _varint(1)  # kind INTERNAL
    out += (
        _tag(7, 1)
        + struct.pack("<Q", int(s.start * 1e9))
        + _tag(8, 1)
        + struct.pack("<Q", int(s.end * 1e9))
    )
    return out + b"".join(_len(9, _attribute(k, v)) for k, v in s.attributes.items())


def _attribute(key: str, value: str | int | float) -> bytes:
    """A KeyValue: the key, and an AnyValue holding a string, an int64 or a double."""
    if isinstance(value, str):
        any_value = _str(1, value)
    elif isinstance(value, int):
        any_value = _tag(3, 0) + _varint(value & 0xFFFFFFFFFFFFFFFF)
    else:
        any_value = _tag(4, 1) + struct.pack("<d", value)
    return _str(1, key) + _len(2, any_value)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if not n:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def _tag(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _len(number: int, value: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(value)) + value


def _str(number: int, value: str) -> bytes:
    return _len(number, value.encode())
