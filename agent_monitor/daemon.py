"""The monitor daemon: an async context manager whose loops (MQTT link, scorers, sweeper) run in one TaskGroup."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, Self

import structlog
from prometheus_client import CollectorRegistry

from .events import MAX_IMAGE_BYTES, MAX_PAYLOAD_BYTES, EventError, decode_event
from .images import FrameBudget
from .judges.base import Judge
from .judges.circuit import CircuitJudge
from .metrics import MeteredJudge, Metrics, RunCollector
from .mqtt import MqttLink, Protocol
from .outbox import Outbox
from .policy import Policy
from .runs import RunLimits, Runs
from .scale import DEFAULT_MIN_MASS
from .settings import BrokerSettings
from .sources import fetch_images
from .store import RunStore, SqliteStore

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
        store: RunStore | None = None,
        retention_s: float = 7 * 24 * 3600.0,
        rescore: bool = False,
        image_dirs: tuple[str, ...] = (),
        image_hosts: tuple[str, ...] = (),
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
            store=store,
        )
        self.store = store
        self.retention_s = retention_s
        self.rescore = rescore
        # Off by default: a network event must not make the monitor read local files or fetch URLs.
        self.image_dirs = tuple(str(Path(d).resolve()) for d in image_dirs)
        self.image_hosts = image_hosts
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
        if self.store is not None:
            # Rebuilt before connecting: steps the broker redelivers then meet the runs they belong to.
            restored = await self.runs.restore(await self.store.live_runs(), rescore=self.rescore)
            if restored:
                log.info("runs_restored", runs=restored)
        first = await self.link.connect() if self.link is not None else None
        stack = contextlib.AsyncExitStack()
        try:
            tg = await stack.enter_async_context(asyncio.TaskGroup())
            if self.link is not None:
                self._tasks.append(tg.create_task(self.link.run(self.handle, self.outbox, first=first), name="mqtt"))
            for i in range(self.max_concurrency):
                self._tasks.append(tg.create_task(self.runs.work(), name=f"scorer-{i + 1}"))
            self._tasks.append(tg.create_task(self.runs.sweeper(self.sweep_interval_s), name="sweeper"))
            if isinstance(self.store, SqliteStore):
                self._tasks.append(tg.create_task(self._retention(), name="retention"))
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
        pending = {t for t in tasks if not t.done()}
        while pending:
            # On Python 3.11, asyncio.wait_for (inside aiomqtt's publish, and the circuit's wait) can swallow a
            # cancel that lands as its inner future completes; a loop that goes on is cancelled again.
            _, pending = await asyncio.wait(pending, timeout=0.5)
            for task in pending:
                task.cancel()
        if stack is not None:
            # The loops run forever, so they end only by cancellation; the TaskGroup awaits each one.
            with contextlib.suppress(asyncio.CancelledError):
                await stack.aclose()
        self._stopped.set()
        log.info("monitor_stopped", scorings=self.runs.scorings, live_runs=len(self.runs.live))

    async def _retention(self) -> None:
        """Delete ended runs older than `retention_s` (hourly)."""
        assert isinstance(self.store, SqliteStore)
        while True:
            try:
                deleted = await self.store.prune(self.retention_s)
                if deleted:
                    log.info("runs_pruned", runs=deleted)
            except Exception:
                log.exception("prune_failed")
            await asyncio.sleep(3600)

    def _judge_state(self, degraded: bool) -> None:
        self.metrics.judge_degraded.set(1 if degraded else 0)
        if not degraded:
            self.runs.judge_recovered()

    async def wait(self) -> None:
        """Serve until the surrounding task is cancelled (or the monitor is left)."""
        await self._stopped.wait()

    async def handle(self, topic: str, payload: bytes) -> None:
        """Decode one message, journal it, fold it into its run; bad input is reported and counted, never raised.

        Raises only when the run store cannot write: the message is then not acknowledged.
        """
        try:
            if len(payload) > _INLINE_DECODE_BYTES:
                run_id, event = await asyncio.to_thread(decode_event, topic, payload, **self._decode_options)
            else:
                run_id, event = decode_event(topic, payload, **self._decode_options)
            if any(getattr(i, "remote", False) for i in getattr(event, "images", ())):
                await asyncio.to_thread(
                    fetch_images, run_id, event, image_dirs=self.image_dirs, max_bytes=self.max_image_bytes
                )
        except EventError as e:
            self.runs.reject(topic, e)
            return
        if self.store is not None:
            # Journaled before the event counts, and before the broker is told it arrived (the link acks on
            # return): a crash in between makes the broker redeliver it. A failure here raises: no ack.
            await self.store.journal(run_id, event)
        try:
            await self.runs.accept(run_id, event)
        except Exception:
            # A bug in handling one event must not stop the daemon or the other runs.
            log.exception("event_handling_failed", run_id=run_id, topic=topic)

    @property
    def _decode_options(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "max_payload": self.max_payload_bytes,
            "max_image_bytes": self.max_image_bytes,
            "image_dirs": self.image_dirs,
            "image_hosts": self.image_hosts,
        }

    def status(self) -> dict[str, Any]:
        """A snapshot for logs and health checks."""
        return {
            "live_runs": len(self.runs.live),
            "queued": self.outbox.__len__(),
            "scorings": self.runs.scorings,
            "connected": bool(self.link and self.link.connected.is_set()),
        }
