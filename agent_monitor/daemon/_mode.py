"""How a monitor is deployed, decided once from its config: where input goes, where it journals, who
publishes.

One object answers every question that differs between one monitor and a replica of a cluster
(`config.cluster.url`): the run store, where the sources' events go (`receive`), the outbox's gate,
the MQTT client id and shared subscription, the background loops beside the monitor's own, and what
entering and leaving do. `Monitor` asks it and has no cluster branch of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from ..calibration import Sample
from ._config import MonitorConfig
from .sinks import Metrics, Outbox
from .sources import Host, Receive
from .stores import NoStore, RunStore, SqliteStore

if TYPE_CHECKING:
    from .sources import MqttLink

log = structlog.get_logger("agent_monitor.daemon")

Loop = tuple[str, Coroutine[Any, Any, None]]


class Mode(Protocol):
    """The deployment's answers: one monitor (`Standalone`) or one replica of a cluster
    (`Cluster`)."""

    @property
    def store(self) -> RunStore:
        """Where the monitor journals its runs."""
        ...

    @property
    def share(self) -> str | None:
        """The shared subscription's group name (cluster mode), or None."""
        ...

    @property
    def gate(self) -> Callable[[str], bool] | None:
        """Whether this monitor may publish about a run now (the outbox drops what it may not);
        None: always."""
        ...

    @property
    def signal_sent(self) -> Callable[[str, int], None] | None:
        """Told (run id, step) once the broker acknowledged a run's signal; None: nobody needs to
        know."""
        ...

    @property
    def progress_sent(self) -> Callable[[str, int], None] | None:
        """Told (run id, step) once the broker acknowledged a run's progress message; None:
        nobody needs to know."""
        ...

    def client_id(self, base: str) -> str:
        """The MQTT client id this monitor connects with."""
        ...

    def receiver(self, own: Receive) -> Receive:
        """Where the sources' wire-form events go: the monitor's `own` ingest, or the runs'
        shared inboxes."""
        ...

    async def open(self, host: Host, link: MqttLink | None) -> None:
        """Before the store is replayed and the broker connected (a replica joins its cluster
        here)."""
        ...

    def loops(self) -> list[Loop]:
        """The background loops to run in the monitor's TaskGroup, with their task names."""
        ...

    async def leave(self) -> None:
        """Before the monitor's tasks stop (a replica hands its runs over)."""
        ...

    async def aclose(self) -> None:
        """After the tasks stopped."""
        ...

    def status(self) -> dict[str, Any]:
        """This mode's part of `Monitor.status()`."""
        ...


class Standalone:
    """One monitor: its own store, its own subscription; it publishes about every run it follows."""

    share: str | None = None
    gate: Callable[[str], bool] | None = None
    signal_sent: Callable[[str, int], None] | None = None
    progress_sent: Callable[[str, int], None] | None = None

    def __init__(self, store: RunStore | None, *, retention_s: float) -> None:
        self.store: RunStore = store if store is not None else NoStore()
        self.retention_s = retention_s

    def client_id(self, base: str) -> str:
        """The configured client id."""
        return base

    def receiver(self, own: Receive) -> Receive:
        """The monitor's own ingest."""
        return own

    async def open(self, host: Host, link: MqttLink | None) -> None:
        """Nothing to join."""

    def loops(self) -> list[Loop]:
        """Retention, for a SQLite store."""
        return (
            [("retention", self._retention(self.store))]
            if isinstance(self.store, SqliteStore)
            else []
        )

    async def leave(self) -> None:
        """Nothing to hand over."""

    async def aclose(self) -> None:
        """Nothing to close (the store is the caller's)."""

    def status(self) -> dict[str, Any]:
        """Nothing beyond the monitor's own."""
        return {}

    async def _retention(self, store: SqliteStore) -> None:
        """Delete ended runs older than the retention (hourly)."""
        while True:
            try:
                deleted = await store.prune(self.retention_s)
                if deleted:
                    log.info("runs_pruned", runs=deleted)
            except Exception:
                log.exception("prune_failed")
            await asyncio.sleep(3600)


def mode_of(
    config: MonitorConfig,
    store: RunStore | None,
    *,
    metrics: Metrics,
    outbox: Outbox,
    on_sample: Callable[[Sample], None],
) -> Mode:
    """The deployment `config` asks for: a replica of a cluster with `config.cluster.url`, else
    one monitor."""
    if config.cluster.url is None:
        return Standalone(store, retention_s=config.retention_s)
    if store is not None:
        raise ValueError("a Monitor in cluster mode keeps its journal in Redis: pass no store")
    # Imported here: without a cluster nothing loads redis (ImportError names the extra).
    from .cluster import Cluster

    return Cluster(
        config.cluster,
        metrics=metrics,
        retention_s=config.retention_s,
        topics_prefix=config.prefix,
        max_payload_bytes=config.max_payload_bytes,
        outbox=outbox,
        on_sample=on_sample,
    )
