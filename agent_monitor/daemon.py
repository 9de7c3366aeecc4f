"""The monitor daemon: an async context manager whose loops (MQTT link, scorers, sweeper) run in one TaskGroup."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Self

import structlog
from prometheus_client import CollectorRegistry

from .events import MAX_IMAGE_BYTES, MAX_PAYLOAD_BYTES, EventError, decode_event
from .images import FrameBudget
from .judges.base import Judge
from .judges.circuit import CircuitJudge
from .metrics import MeteredJudge, Metrics, RunCollector
from .mqtt import MqttLink, Protocol
from .policy import Policy
from .runs import Outbox, RunLimits, Runs
from .scale import DEFAULT_MIN_MASS
from .settings import BrokerSettings

log = structlog.get_logger("agent_monitor.daemon")

# Decoding a payload this big (base64 images) in a worker thread keeps the event loop, and so the
# MQTT keep-alive, responsive; smaller ones decode faster inline than a thread hop costs.
_INLINE_DECODE_BYTES = 64 * 1024


class Monitor:
    """Follow every run published under `prefix` on the broker, score each new prefix, publish progress and signals.

    ```python
    async with Monitor(judge=judge, broker=BrokerSettings.from_url("mqtt://127.0.0.1:1883")) as monitor:
        await monitor.wait()  # serve until cancelled
    ```
    Entering connects to the broker (raising `BrokerUnavailable` with a one-line reason) and starts
    the named tasks `mqtt`, `scorer-1..N` and `sweeper`; leaving cancels and awaits them all.
    Without a broker (`broker=None`) nothing is received: feed events with `handle()` (tests, embedding).
    """

    def __init__(
        self,
        *,
        judge: Judge,
        broker: BrokerSettings | None = None,
        prefix: str = "agents",
        policy: Policy | None = None,
        max_concurrency: int = 8,
        registry: CollectorRegistry | None = None,
        limits: RunLimits | None = None,
        repeats: int = 1,
        min_mass: float = DEFAULT_MIN_MASS,
        frame_budget: FrameBudget | None = None,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        max_image_bytes: int = MAX_IMAGE_BYTES,
        client_id: str = "agent-monitor",
        protocol: Protocol = "auto",
        session_expiry_s: int = 3600,
        outbox_size: int = 10_000,
        sweep_interval_s: float = 0.5,
        metric_labels: tuple[str, ...] = ("group", "model"),
        max_series: int = 1000,
        metrics_grace_s: float = 60.0,
        circuit_threshold: int = 5,
        circuit_cooldown_s: float = 2.0,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}; use 1 or more")
        self.prefix = prefix
        self.max_concurrency = max_concurrency
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        # Every judge call is counted (calls, latency, tokens) on its way through; the circuit breaker sits
        # in front, so the calls it refuses while the judge is down are not counted as judge calls.
        self.judge = CircuitJudge(
            MeteredJudge(judge, self.metrics),
            threshold=circuit_threshold,
            cooldown_s=circuit_cooldown_s,
            on_change=self._judge_state,
        )
        self.outbox = Outbox(outbox_size, metrics=self.metrics)
        self.runs = Runs(
            judge=self.judge,
            outbox=self.outbox,
            prefix=prefix,
            policy=policy,
            limits=limits,
            metrics=self.metrics,
            repeats=repeats,
            min_mass=min_mass,
            frame_budget=frame_budget,
            series_grace_s=metrics_grace_s,
        )
        self.registry.register(RunCollector(self.runs.series, label_names=metric_labels, max_series=max_series))
        self.max_payload_bytes = max_payload_bytes
        self.max_image_bytes = max_image_bytes
        self.sweep_interval_s = sweep_interval_s
        self.link = (
            MqttLink(
                broker,
                prefix=prefix,
                client_id=client_id,
                protocol=protocol,
                session_expiry_s=session_expiry_s,
                metrics=self.metrics,
            )
            if broker is not None
            else None
        )
        self._stack: contextlib.AsyncExitStack | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("the monitor is already running")
        first = await self.link.connect() if self.link is not None else None
        stack = contextlib.AsyncExitStack()
        try:
            tg = await stack.enter_async_context(asyncio.TaskGroup())
            if self.link is not None:
                self._tasks.append(tg.create_task(self.link.run(self.handle, self.outbox, first=first), name="mqtt"))
            for i in range(self.max_concurrency):
                self._tasks.append(tg.create_task(self.runs.work(), name=f"scorer-{i + 1}"))
            self._tasks.append(tg.create_task(self.runs.sweeper(self.sweep_interval_s), name="sweeper"))
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        log.info(
            "monitor_started",
            prefix=self.prefix,
            judge=self.judge.name,
            max_concurrency=self.max_concurrency,
            broker=self.link.broker.url if self.link else None,
            protocol=self.link.negotiated if self.link else None,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        stack, tasks = self._stack, self._tasks
        self._stack, self._tasks = None, []
        for task in tasks:
            task.cancel()
        if stack is not None:
            # The loops run forever, so they end only by cancellation; the TaskGroup awaits each one.
            with contextlib.suppress(asyncio.CancelledError):
                await stack.aclose()
        self._stopped.set()
        log.info("monitor_stopped", scorings=self.runs.scorings, live_runs=len(self.runs.live))

    def _judge_state(self, degraded: bool) -> None:
        self.metrics.judge_degraded.set(1 if degraded else 0)
        if not degraded:
            self.runs.judge_recovered()

    async def wait(self) -> None:
        """Serve until the surrounding task is cancelled (or the monitor is left)."""
        await self._stopped.wait()

    async def handle(self, topic: str, payload: bytes) -> None:
        """Decode one message and fold it into its run; bad input is reported and counted, never raised."""
        try:
            if len(payload) > _INLINE_DECODE_BYTES:
                run_id, event = await asyncio.to_thread(
                    decode_event,
                    topic,
                    payload,
                    prefix=self.prefix,
                    max_payload=self.max_payload_bytes,
                    max_image_bytes=self.max_image_bytes,
                )
            else:
                run_id, event = decode_event(
                    topic,
                    payload,
                    prefix=self.prefix,
                    max_payload=self.max_payload_bytes,
                    max_image_bytes=self.max_image_bytes,
                )
        except EventError as e:
            self.runs.reject(topic, e)
            return
        try:
            await self.runs.accept(run_id, event)
        except Exception:
            # A bug in handling one event must not stop the daemon or the other runs.
            log.exception("event_handling_failed", run_id=run_id, topic=topic)

    def status(self) -> dict[str, Any]:
        """A snapshot for logs and health checks."""
        return {
            "live_runs": len(self.runs.live),
            "queued": self.outbox.__len__(),
            "scorings": self.runs.scorings,
            "connected": bool(self.link and self.link.connected.is_set()),
        }
