"""The OpenTelemetry sink: every score as `gen_ai.evaluation.result` events to an OTLP/HTTP
collector.

The sink has a LoggerProvider of its own (never the global one) with a BatchLogRecordProcessor:
emitting appends to a bounded queue that the SDK's worker thread exports, so scoring never waits
for the collector. Past the queue's size a result's events are dropped and counted. A collector
that cannot be reached is counted and logged once per outage, never fatal; the Monitor closes the
sink when it exits, flushing for a bounded time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from ...otel import (
    INSTALL_HINT,
    EvaluationEmitter,
    detached_context,
    evaluation_attributes,
    span_context,
)
from .._events import MonitorEvent, Scored

# Imported only when the monitor is given an OTLP endpoint (the Monitor imports this module then).
try:
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
    from opentelemetry.sdk._logs.export import (
        BatchLogRecordProcessor,
        LogRecordExporter,
        LogRecordExportResult,
    )
    from opentelemetry.sdk.resources import Resource
except ImportError as e:
    raise ImportError(
        f"--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporter ({e.name} is "
        f"missing): {INSTALL_HINT}"
    ) from None

log = structlog.get_logger("agent_monitor.daemon.otel")

DROP_REASONS = ("queue_full", "export_failed", "shutdown")
# The exporter logs every failed batch (and each retry) through stdlib logging; the sink says it
# once per outage.
_NOISY_LOGGERS = ("opentelemetry.exporter.otlp.proto.http._log_exporter",)


def logs_url(endpoint: str) -> str:
    """The OTLP/HTTP logs URL of a collector: `/v1/logs` appended, as the SDK does for
    OTEL_EXPORTER_OTLP_ENDPOINT."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/logs") else f"{base}/v1/logs"


class OtelSink:
    """Send every score's evaluation events to an OTLP/HTTP collector, batched in the SDK's worker
    thread.

    `criteria(run_id)` names the run's criteria (a failed score gives one event per criterion);
    `max_queue` bounds the events waiting for export. Made with the Monitor (its metrics exist from
    start-up), opened when the Monitor is entered and closed when it exits. The exporter's own
    `OTEL_EXPORTER_OTLP_*` environment variables (headers, timeout, certificates) apply.
    """

    events = (Scored,)

    def __init__(
        self,
        endpoint: str,
        *,
        registry: CollectorRegistry,
        criteria: Callable[[str], Sequence[str]] = lambda _run_id: (),
        spans: Callable[[str, int], tuple[str, str] | None] | None = None,
        max_queue: int = 2048,
        max_batch: int = 512,
        schedule_delay_s: float = 1.0,
    ) -> None:
        self.url = logs_url(endpoint)
        self.criteria = criteria
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.schedule_delay_s = schedule_delay_s
        self.exported = Counter(
            "agent_monitor_otlp_exported_events",
            "gen_ai.evaluation.result events the OTLP collector accepted.",
            registry=registry,
        )
        self.failures = Counter(
            "agent_monitor_otlp_export_failures",
            "OTLP export requests that failed after the exporter's retries (collector down "
            "or refusing).",
            registry=registry,
        )
        self.dropped = Counter(
            "agent_monitor_otlp_dropped_events",
            "Evaluation events never delivered, by reason: queue_full (the export queue was full), "
            "export_failed (their request failed), shutdown (still queued when the monitor "
            "stopped).",
            ["reason"],
            registry=registry,
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        Gauge(
            "agent_monitor_otlp_queue_depth",
            "Evaluation events waiting for export.",
            registry=registry,
        ).set_function(lambda: self._queued)
        # Events handed to the SDK and not yet taken by its exporter: never fewer than its queue
        # holds (counted up before the SDK appends, down after it pops), so the SDK's own
        # drop-oldest never happens unseen.
        self._queued = 0
        self._lock = threading.Lock()
        self._failing = False
        self.provider: LoggerProvider | None = None
        self._exporter: _CountingExporter | None = None
        self._emitter: EvaluationEmitter | None = None
        # The monitor's runs come over MQTT: their events belong to no span of this process.
        self._context = detached_context()
        self.spans = spans
        """Which span a run's step is (trace id, span id in hex), for runs fed by traces: the OTLP
        receiver's `span_of`. A score's events then carry the trace and the judged span's id; None,
        or no span: no trace."""

    def open(self) -> None:
        """Start the provider, its batch processor (a worker thread) and the OTLP exporter."""
        if self.provider is not None:
            return
        for name in _NOISY_LOGGERS:
            logger = logging.getLogger(name)
            if logger.level == logging.NOTSET:
                logger.setLevel(logging.CRITICAL)
        try:
            v = version("agent-monitor")
        except PackageNotFoundError:
            v = "unknown"
        self._failing = False
        self._exporter = _CountingExporter(OTLPLogExporter(endpoint=self.url), self)
        # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, if set, refine this (Resource.create merges
        # them).
        resource = Resource.create({"service.name": "agent-monitor", "service.version": v})
        provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_log_record_processor(
            BatchLogRecordProcessor(
                self._exporter,
                schedule_delay_millis=self.schedule_delay_s * 1000,
                max_export_batch_size=self.max_batch,
                max_queue_size=self.max_queue,
            )
        )
        self._emitter = EvaluationEmitter(provider)
        self.provider = provider
        log.info("otlp_exporting", endpoint=self.url)

    def __call__(self, event: MonitorEvent) -> None:
        """Queue the evaluation events of one score (never blocks: the SDK's worker thread
        exports them)."""
        emitter = self._emitter
        if not isinstance(event, Scored) or event.republished or emitter is None:
            return
        events = evaluation_attributes(event.progress, self.criteria(event.run_id))
        with self._lock:
            room = self.max_queue - self._queued
            if len(events) > room:
                full = True
            else:
                full = False
                self._queued += len(events)
        if full:
            # A score's events go together or not at all: half a verdict is worse than a counted
            # gap.
            self.dropped.labels("queue_full").inc(len(events))
            return
        context = self._context
        if self.spans is not None:
            ref = self.spans(event.run_id, event.progress.step)
            if ref is not None:
                context = span_context(*ref)
        emitter.emit_attributes(events, context=context)

    # -- called from the SDK's worker thread --

    def _taken(self, n: int) -> None:
        with self._lock:
            self._queued = max(0, self._queued - n)

    def _settled(self, n: int, ok: bool, error: str | None = None) -> None:
        if ok:
            self.exported.inc(n)
            if self._failing:
                self._failing = False
                log.info("otlp_export_recovered", endpoint=self.url)
            return
        self.failures.inc()
        self.dropped.labels("export_failed").inc(n)
        if not self._failing:
            self._failing = True
            # Once per outage: the next line about the collector is the recovery.
            log.warning(
                "otlp_export_failing",
                endpoint=self.url,
                events=n,
                error=error,
                hint="is the collector running and listening for OTLP/HTTP there? scoring "
                "goes on; events are "
                "dropped and counted in agent_monitor_otlp_dropped_events_total until it answers",
            )

    # -- lifecycle --

    def close(self, timeout_s: float = 5.0) -> None:
        """Export what is queued, for at most about `timeout_s`, then stop (blocks: call it in a
        worker thread)."""
        provider, exporter = self.provider, self._exporter
        if provider is None or exporter is None:
            return
        self._emitter = None  # scores from now on are not queued
        self.provider = self._exporter = None
        done = threading.Thread(target=provider.shutdown, name="otlp-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            # The collector is not answering: cut the exporter's retries short instead of waiting
            # them out.
            exporter.shutdown()
            done.join(1.0)
        with self._lock:
            left, self._queued = self._queued, 0
        if left:
            self.dropped.labels("shutdown").inc(left)
            log.warning("otlp_events_unsent", endpoint=self.url, events=left)


class _CountingExporter(LogRecordExporter):
    """An exporter that tells the sink what it takes from the queue and how each request ended."""

    def __init__(self, inner: LogRecordExporter, sink: OtelSink) -> None:
        self.inner = inner
        self.sink = sink
        self._shut = threading.Lock()
        self._down = False

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        """Export one batch through the inner exporter; count it either way."""
        self.sink._taken(len(batch))
        try:
            result = self.inner.export(batch)
        except Exception as e:
            self.sink._settled(len(batch), False, f"{type(e).__name__}: {e}")
            return LogRecordExportResult.FAILURE
        ok = result == LogRecordExportResult.SUCCESS
        self.sink._settled(len(batch), ok, None if ok else "the export request failed")
        return result

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """The inner exporter's flush."""
        return bool(self.inner.force_flush(timeout_millis))

    def shutdown(self) -> None:
        """Shut the inner exporter down once (the SDK at shutdown, and close() when the collector
        hangs)."""
        with self._shut:
            if self._down:
                return
            self._down = True
        self.inner.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it unannotated


__all__ = ["DROP_REASONS", "OtelSink", "logs_url"]
