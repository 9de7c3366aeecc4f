"""The OTLP traces receiver: a source whose runs are traces an agent exports over OTLP/HTTP (`POST /v1/traces`).

One task (the source's `run`) serves HTTP/1.1 on asyncio streams with h11: the head and the body
are bounded before they are read, connections are counted, every read has a deadline. A request's
spans (protobuf or JSON, gzip or not) are decoded by `_spans` and handed to ingest as the wire-form
events a harness would publish:

- a run per trace, or per `agent_monitor.run_id` / `gen_ai.conversation.id` when a span carries one;
- `start` once a task is known (`agent_monitor.task`, the root agent span's user input, else the first
  user message of a model span); action spans wait for it, bounded;
- a `step` per finished action span (tool execution, model turn, hand-off) in end-time order, its key
  the span id, its meta the trace and span ids (so a restarted receiver knows what was sent, and
  evaluation events can name the judged span);
- `end` when the root span ends (a trace's run), or after `idle_s` without spans.

A span that ends before steps already sent ("late") is sent as the next step (the run state
appends steps by index, and the journal keeps them so), its meta carrying its end time; the
tracker judges every prefix in end-time order (`tracker.placed`), so the late span takes its
place and the newest prefix, scored next as for MQTT, judges the trajectory with it there. Over a limit the
answer is the spec's (413, partial success, 503 with Retry-After) and a counter; nothing else is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import h11
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..otel import INSTALL_HINT
from ..wire import TopicError, check_run_id
from ._config import OtlpReceiverSettings
from ._source import Inbound, Ingest, RunsView
from ._spans import Decoded, Span, SpanError, TooManySpans, classify, decode_json, decode_protobuf, outcome_of, run_key
from ._spans import step_text as span_step_text
from ._spans import task_of as span_task_of
from ._state import MonitorEvent, RunClosed, Sink

__all__ = ["REFUSE_REASONS", "OtlpReceiver"]

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
_PATH = "/v1/traces"
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_MAX_HEAD = 16 * 1024
_ENDED_MEMORY = 10_000
_SWEEP_S = 1.0
_LINGER_S = 2.0


@dataclass(eq=False, slots=True)
class _Run:
    """What the receiver knows of one trace-fed run: the spans it took, the steps it sent, what waits for a start."""

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


@dataclass(slots=True)
class _Answer:
    status: int
    body: bytes
    content_type: str
    retry_after: int | None = None


class OtlpReceiver:
    """A monitor source serving OTLP/HTTP traces: `Monitor(config, judge=..., sources=[OtlpReceiver(settings)])`.

    `registry` takes its metrics; `clock` is monotonic seconds (idle closes, latencies). `port` is the
    bound port once `ready` is set (an address with port 0 binds a free one).
    """

    name = "otlp"

    def __init__(
        self,
        settings: OtlpReceiverSettings,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.ready = asyncio.Event()
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.sink: Sink | None = self._on_event
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        self._traces: dict[str, str] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._connections = 0
        self._lock = asyncio.Lock()
        self._view: RunsView | None = None
        self._ingest: Ingest | None = None
        self._stats: dict[str, int] = {"requests": 0, "received": 0, "accepted": 0, "steps": 0, "late": 0}
        r = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "agent_monitor_otlp_receiver_requests",
            "OTLP/HTTP trace export requests, by HTTP status.",
            ["code"],
            registry=r,
        )
        self.received = Counter(
            "agent_monitor_otlp_spans_received", "Spans in the trace export requests read.", registry=r
        )
        self.accepted = Counter(
            "agent_monitor_otlp_spans_accepted",
            "Spans taken into a run (as a step, a start, an end, or as context).",
            registry=r,
        )
        self.ignored = Counter(
            "agent_monitor_otlp_spans_ignored",
            "Spans taken but not used, by reason: not_an_action (no GenAI or OpenInference action), no_content "
            "(a model turn whose content was not recorded), duplicate (the same span again), run_ended.",
            ["reason"],
            registry=r,
        )
        self.refused = Counter(
            "agent_monitor_otlp_spans_refused",
            "Spans refused, by reason (the exporter was told: partial success, 400, 401, 413 or 503); a request "
            "refused before its spans are read (unauthorized, body_too_large, bad_body, unavailable) counts one.",
            ["reason"],
            registry=r,
        )
        self.late = Counter(
            "agent_monitor_otlp_late_spans",
            "Action spans that ended before steps already sent: judged in their place by end time, re-scored.",
            registry=r,
        )
        self.truncated = Counter(
            "agent_monitor_otlp_attributes_truncated", "Attribute values cut to --otlp-max-attribute-bytes.", registry=r
        )
        self.final_latency = Histogram(
            "agent_monitor_otlp_final_score_seconds",
            "Seconds from a trace-fed run's last span to its final score (the run closed).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        Gauge("agent_monitor_otlp_traces_live", "Trace-fed runs the receiver follows.", registry=r).set_function(
            lambda: len(self._runs)
        )
        Gauge("agent_monitor_otlp_connections", "Open OTLP/HTTP connections.", registry=r).set_function(
            lambda: self._connections
        )
        for code in ("200", "400", "401", "404", "405", "413", "415", "503"):
            self.requests.labels(code)
        for reason in IGNORE_REASONS:
            self.ignored.labels(reason)
        for reason in REFUSE_REASONS:
            self.refused.labels(reason)

    # -- the source protocol --

    async def open(self) -> None:
        """Bind the address (before the monitor starts, to report a taken port at once); OSError when it cannot."""
        if self._server is None:
            host, port = self.settings.host_port
            self._server = await asyncio.start_server(self._connection, host, port, limit=_MAX_HEAD)
            self.port = self._server.sockets[0].getsockname()[1]

    def check_installed(self) -> None:
        """Raise ImportError naming the extra when the OTLP protobuf classes are not installed."""
        try:
            import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"--otlp-receiver needs the OpenTelemetry protobuf classes ({e.name} is missing): {INSTALL_HINT}"
            ) from None

    @property
    def url(self) -> str:
        """Where exporters send spans (the traces endpoint), once bound."""
        host = self.settings.host_port[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}{_PATH}"

    async def run(self, ingest: Ingest, runs: RunsView) -> None:
        """Serve OTLP/HTTP until cancelled, closing idle runs; raises OSError when the address cannot be bound."""
        self._ingest, self._view = ingest, runs
        await self.open()
        assert self._server is not None
        log.info("otlp_receiving", url=self.url)
        self.ready.set()
        try:
            async with self._server:
                while True:
                    await asyncio.sleep(_SWEEP_S)
                    await self.sweep()
        finally:
            # Connections are this task's too: none outlives it (a cancelled handler returns quietly).
            handlers = list(self._handlers)
            for t in handlers:
                t.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

    def _on_event(self, event: MonitorEvent) -> None:
        """Forget a run the monitor closed, and time its last span to its final score."""
        if isinstance(event, RunClosed):
            run = self._runs.pop(event.run_id, None)
            if run is not None:
                for t in run.traces:
                    self._traces.pop(t, None)
                self._remember_ended(event.run_id)
                if run.ended:
                    self.final_latency.observe(max(0.0, self.clock() - run.last_span))

    def statistics(self) -> Mapping[str, Any]:
        """Requests, spans received, accepted, steps sent, late steps, live runs and open connections."""
        return {**self._stats, "live": len(self._runs), "connections": self._connections}

    def span_of(self, run_id: str, step: int) -> tuple[str, str] | None:
        """The (trace id, span id) a trace-fed run's result judged, for its evaluation events; None for other runs.

        That is the span ending last among the prefix's steps (the judge reads them in end-time order): a late
        span's own result names the span it was placed before, not itself.
        """
        view = self._view
        metas = view.step_meta(run_id) if view is not None else None
        if not metas or not 1 <= step <= len(metas):
            return None
        best: tuple[int, str, str] | None = None
        for m in metas[:step]:
            otel = m.get("otel")
            if not isinstance(otel, Mapping):
                continue
            trace_id, span_id, end = otel.get("trace_id"), otel.get("span_id"), otel.get("end_ns", 0)
            if not (isinstance(trace_id, str) and isinstance(span_id, str) and isinstance(end, int)):
                continue
            if best is None or end >= best[0]:
                best = (end, trace_id, span_id)
        return (best[1], best[2]) if best is not None else None

    # -- spans to events --

    async def take(self, decoded: Decoded) -> tuple[int, str, bool]:
        """Hand a request's spans to ingest; return (spans rejected, why, whether to answer 503 Retry-After)."""
        async with self._lock:
            return await self._take(decoded)

    async def _take(self, decoded: Decoded) -> tuple[int, str, bool]:
        if self._ingest is None:
            return 0, "", True  # bound, the monitor not started yet: the exporter retries
        now = self.clock()
        rejected, reason, retry = decoded.rejected, decoded.reason, False
        if decoded.rejected:
            self.refused.labels("invalid").inc(decoded.rejected)
        by_trace: dict[str, list[Span]] = {}
        for s in decoded.spans:
            by_trace.setdefault(s.trace_id, []).append(s)
        events: list[Inbound] = []
        touched: list[_Run] = []
        for trace_id, spans in by_trace.items():
            run_id = self._traces.get(trace_id)
            explicit = None
            if run_id is None:
                explicit = next((k for k in map(run_key, spans) if k is not None), None)
                run_id = explicit[1] if explicit else trace_id
                try:
                    check_run_id(run_id)
                except TopicError as e:
                    rejected += len(spans)
                    reason = reason or f"trace {trace_id}: {e}"
                    self.refused.labels("bad_run_id").inc(len(spans))
                    continue
            if run_id in self._ended:
                self.ignored.labels("run_ended").inc(len(spans))
                self.accepted.inc(len(spans))
                continue
            run = self._runs.get(run_id) or self._recover(run_id, explicit is None, now)
            if run is not None and run.ended:
                # After its end was sent (the monitor is finishing it): too late to be a step.
                fresh = [s for s in spans if s.span_id not in run.seen]
                self.ignored.labels("run_ended").inc(len(fresh))
                self.ignored.labels("duplicate").inc(len(spans) - len(fresh))
                self.accepted.inc(len(spans))
                continue
            if run is None:
                if len(self._runs) >= self.settings.max_live_traces:
                    self.refused.labels("too_many_traces").inc(len(spans))
                    retry = True
                    continue
                run = _Run(run_id, by_trace=explicit is None, last_span=now)
            self._runs[run_id] = run
            self._runs.move_to_end(run_id)
            self._traces[trace_id] = run_id
            run.traces.add(trace_id)
            n, why = self._spans(run, spans, now, events)
            if n:
                rejected += n
                reason = reason or why
            touched.append(run)
        if events and not await self._send(events, touched):
            retry = True
        return rejected, reason, retry

    def _recover(self, run_id: str, by_trace: bool, now: float) -> _Run | None:
        """A run the monitor has live but this receiver does not know (it restarted): what it sent, from the steps."""
        view = self._view
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

    def _spans(self, run: _Run, spans: list[Span], now: float, events: list[Inbound]) -> tuple[int, str]:
        """Fold one trace's spans of a request into its run, appending the events to send; return (rejected, why)."""
        rejected, why = 0, ""
        fresh: list[Span] = []
        for s in spans:
            if s.span_id in run.seen:
                self.ignored.labels("duplicate").inc()
                self.accepted.inc()
                continue
            if len(run.seen) >= self.settings.max_spans_per_trace:
                rejected += 1
                why = why or f"run {run.run_id} holds {self.settings.max_spans_per_trace} spans, the limit"
                self.refused.labels("too_many_spans").inc()
                continue
            run.seen.add(s.span_id)
            fresh.append(s)
        if not fresh:
            return rejected, why
        run.last_span = now
        self.accepted.inc(len(fresh))
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
                    self.ignored.labels("not_an_action").inc()
                continue
            text = span_step_text(s, action, self.settings.max_step_chars)
            if text is None:
                self.ignored.labels("no_content").inc()
                continue
            actions.append((s, text))
        ends = root is not None and (run.by_trace or outcome_of(root) is not None)
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
            events.append(Inbound(run.run_id, "end", {"outcome": outcome_of(root)}, key=f"end:{root.span_id}"))
        return rejected, why

    def _start(self, run: _Run, events: list[Inbound]) -> None:
        task = run.task or f"(the agent's task was not recorded in the spans of run {run.run_id})"
        events.append(Inbound(run.run_id, "start", {"task": task[:100_000]}, key=f"start:{run.run_id}"))
        run.started = True

    def _step(self, run: _Run, s: Span, text: str, events: list[Inbound]) -> None:
        if s.end_ns < run.last_end:
            # Placed by its end time when judged (the meta below): the next score judges the trajectory with it there.
            self.late.inc()
            self._stats["late"] += 1
        run.steps.append((s.end_ns, s.span_id))
        run.last_end = max(run.last_end, s.end_ns)
        meta = {"otel": {"trace_id": s.trace_id, "span_id": s.span_id, "end_ns": s.end_ns}}
        data = {"index": len(run.steps), "text": text, "ts": s.end_ns / 1e9, "meta": meta}
        events.append(Inbound(run.run_id, "step", data, key=s.span_id))
        self._stats["steps"] += 1

    async def _send(self, events: list[Inbound], touched: list[_Run]) -> bool:
        """Hand the events to ingest; on a store error forget the touched runs (rebuilt from the monitor's steps)."""
        assert self._ingest is not None
        try:
            errors = await self._ingest.events(events)
        except Exception as e:
            errors = [e]
        failed = [e for e in errors if e is not None]
        if not failed:
            return True
        log.warning("otlp_spans_not_journaled", events=len(failed), error=f"{type(failed[0]).__name__}: {failed[0]}")
        for run in touched:
            self._runs.pop(run.run_id, None)
            for t in run.traces:
                self._traces.pop(t, None)
        return False

    async def sweep(self) -> None:
        """End the runs whose spans stopped coming `idle_s` ago (their roots never ended here)."""
        now = self.clock()
        async with self._lock:
            # An ended run the monitor never opened or no longer has (its start refused, the run evicted before
            # the close reached us) would stay here for ever: forgotten one more idle time after its end.
            view = self._view
            gone = [
                r
                for r in self._runs.values()
                if r.ended and now - r.last_span >= 2 * self.settings.idle_s and not (view and view.is_live(r.run_id))
            ]
            for run in gone:
                self._runs.pop(run.run_id, None)
                for t in run.traces:
                    self._traces.pop(t, None)
                self._remember_ended(run.run_id)
            idle = [r for r in self._runs.values() if not r.ended and now - r.last_span >= self.settings.idle_s]
            events: list[Inbound] = []
            for run in idle:
                if not run.started:
                    self._start(run, events)
                    run.waiting.sort(key=lambda a: (a[0].end_ns, a[0].span_id))
                    for s, text in run.waiting:
                        self._step(run, s, text, events)
                    run.waiting = []
                run.ended = True
                events.append(Inbound(run.run_id, "end", {"outcome": None}, key=f"idle:{run.run_id}"))
                log.info("otlp_run_idle", run_id=run.run_id, idle_s=self.settings.idle_s)
            if events:
                await self._send(events, idle)

    def _remember_ended(self, run_id: str) -> None:
        self._ended[run_id] = self.clock()
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    # -- HTTP --

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self._connected(reader, writer)
        except asyncio.CancelledError:
            pass  # the receiver is stopping: asyncio's streams would report a cancelled handler as an error
        finally:
            if task is not None:
                self._handlers.discard(task)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        try:
            if self._connections > self.settings.max_connections:
                self.refused.labels("unavailable").inc()
                conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
                if isinstance(await self._next(conn, reader), h11.Request):  # an answer needs a request
                    busy = self._error(503, "too many connections", _JSON, retry_after=self.settings.retry_after_s)
                    await self._write(writer, conn, busy, close=True, reader=reader)
                return
            await self._serve(reader, writer)
        except (TimeoutError, ConnectionError, h11.ProtocolError):
            pass
        except Exception:
            log.exception("otlp_connection_failed")
        finally:
            self._connections -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        limit = self.settings.max_body_bytes
        while True:
            request = await self._next(conn, reader)
            if not isinstance(request, h11.Request):
                return
            headers = {k.decode().lower(): v.decode("latin-1") for k, v in request.headers}
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            reply_type = _JSON if ctype == _JSON else _PROTOBUF
            target = request.target.decode("latin-1").split("?")[0]
            answer: _Answer | None = None
            token = self.settings.token
            if token is not None and not hmac.compare_digest(
                headers.get("authorization", "").encode(), f"Bearer {token}".encode()
            ):
                self.refused.labels("unauthorized").inc()
                answer = self._error(401, "missing or wrong 'Authorization: Bearer' token (--otlp-token)", reply_type)
            elif target != _PATH:
                answer = self._error(404, f"no such path {target[:100]}; POST spans to {_PATH}", reply_type)
            elif request.method != b"POST":
                answer = self._error(405, f"use POST {_PATH}", reply_type)
            elif ctype not in (_JSON, _PROTOBUF):
                answer = self._error(415, f"content type {ctype!r}: use {_PROTOBUF} or {_JSON}", reply_type)
            elif headers.get("content-encoding", "identity").lower() not in ("gzip", "identity"):
                answer = self._error(415, "content encoding: use gzip or none", reply_type)
            length = headers.get("content-length")
            if answer is None and length is not None and length.isdigit() and int(length) > limit:
                self.refused.labels("body_too_large").inc()
                answer = self._error(413, f"the body is {length} bytes, over the limit of {limit}", reply_type)
            if answer is not None:
                # The body is not read: close once answered (the client may be sending it still).
                await self._write(writer, conn, answer, close=True, reader=reader)
                return
            body = bytearray()
            while True:
                event = await self._next(conn, reader)
                if isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > limit:
                        self.refused.labels("body_too_large").inc()
                        await self._write(
                            writer,
                            conn,
                            self._error(413, f"the body is over the limit of {limit} bytes", reply_type),
                            close=True,
                            reader=reader,
                        )
                        return
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return
            self._stats["requests"] += 1
            answer = await self._export(bytes(body), ctype, headers.get("content-encoding", "").lower() == "gzip")
            await self._write(writer, conn, answer)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _next(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await asyncio.wait_for(reader.read(65_536), self.settings.read_timeout_s)
            conn.receive_data(data)

    async def _export(self, body: bytes, ctype: str, gzipped: bool) -> _Answer:
        s = self.settings
        if gzipped:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                raw = d.decompress(body, s.max_body_bytes + 1)
            except zlib.error as e:
                self.refused.labels("bad_body").inc()
                return self._error(400, f"the body is not gzip ({e})", ctype)
            if len(raw) > s.max_body_bytes or d.unconsumed_tail:
                self.refused.labels("body_too_large").inc()
                return self._error(413, f"the body is over {s.max_body_bytes} bytes once decompressed", ctype)
            body = raw
        decode = decode_json if ctype == _JSON else decode_protobuf
        try:
            decoded = decode(body, max_spans=s.max_spans_per_batch, max_attribute_bytes=s.max_attribute_bytes)
        except TooManySpans as e:
            self.refused.labels("batch_too_large").inc(e.n)
            return self._error(413, f"{e.n} spans in one request, over the limit of {s.max_spans_per_batch}", ctype)
        except SpanError as e:
            self.refused.labels("bad_body").inc()
            return self._error(400, str(e), ctype)
        n = len(decoded.spans) + decoded.rejected
        self.received.inc(n)
        self._stats["received"] += n
        if decoded.truncated:
            self.truncated.inc(decoded.truncated)
        rejected, reason, retry = await self.take(decoded)
        self._stats["accepted"] += n - rejected
        if retry:
            return self._error(
                503, "the monitor cannot take these spans now; retry", ctype, retry_after=s.retry_after_s
            )
        return _Answer(200, _success(rejected, reason, ctype), ctype)

    def _error(self, status: int, message: str, ctype: str, *, retry_after: int | None = None) -> _Answer:
        code = {400: 3, 401: 16, 404: 5, 405: 12, 413: 8, 415: 3, 503: 14}.get(status, 2)  # google.rpc.Code
        body = json.dumps({"code": code, "message": message}).encode() if ctype == _JSON else _status_pb(code, message)
        return _Answer(status, body, ctype, retry_after)

    async def _write(
        self,
        writer: asyncio.StreamWriter,
        conn: h11.Connection,
        answer: _Answer,
        *,
        close: bool = False,
        reader: asyncio.StreamReader | None = None,
    ) -> None:
        self.requests.labels(str(answer.status)).inc()
        headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body)))]
        if answer.retry_after is not None:
            headers.append(("retry-after", str(answer.retry_after)))
        if close:
            headers.append(("connection", "close"))
        try:
            data = conn.send(h11.Response(status_code=answer.status, headers=headers))
            data = (
                (data or b"") + (conn.send(h11.Data(data=answer.body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
            )
        except h11.LocalProtocolError:
            return
        writer.write(data)
        await asyncio.wait_for(writer.drain(), self.settings.read_timeout_s)
        if close and reader is not None:
            # A lingering close: what the client still sends is read and dropped (bounded), so closing with
            # unread bytes does not reset the connection before the client has read the answer.
            with contextlib.suppress(OSError, RuntimeError):
                writer.write_eof()
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(min(self.settings.read_timeout_s, _LINGER_S)):
                    left = self.settings.max_body_bytes + _MAX_HEAD
                    while left > 0 and (chunk := await reader.read(65_536)):
                        left -= len(chunk)


def _success(rejected: int, message: str, ctype: str) -> bytes:
    """An ExportTraceServiceResponse: empty, or with partial_success (rejected spans and why)."""
    if ctype == _JSON:
        if not rejected:
            return b"{}"
        return json.dumps({"partialSuccess": {"rejectedSpans": str(rejected), "errorMessage": message}}).encode()
    if not rejected:
        return b""
    inner = _varint_field(1, rejected) + _bytes_field(2, message.encode())
    return _bytes_field(1, inner)


def _status_pb(code: int, message: str) -> bytes:
    """A google.rpc.Status (code = 1, message = 2), the body of every OTLP/HTTP error answer."""
    return _varint_field(1, code) + _bytes_field(2, message.encode())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def decoded_of(spans: Sequence[Span]) -> Decoded:
    """A Decoded of given spans (tests and benchmarks hand spans to `take` without HTTP)."""
    return Decoded(spans=list(spans))
