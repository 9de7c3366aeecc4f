"""The daemon's owned parts as the monitor wires them: the HTTP server as its task, the store's
bounded queue."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import (
    HttpServer,
    MemoryStore,
    Monitor,
    MonitorConfig,
    OtlpReceiverSettings,
    RewardApiSettings,
    SqliteStore,
)
from agent_monitor.daemon.sinks import BoardSite
from agent_monitor.daemon.stores._store import SqliteStoreStatistics
from agent_monitor.testing import FakeJudge


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


async def test_the_http_server_is_a_named_task_of_the_monitor_and_stops_with_it(
    tmp_path: Path,
) -> None:
    registry = CollectorRegistry()
    store = SqliteStore(tmp_path / "runs.db")
    web = HttpServer(registry, port=0)
    await web.bind()  # bound before the monitor enters: a taken port fails first (as serve does)
    try:
        async with Monitor(
            MonitorConfig(), judge=FakeJudge(), store=store, registry=registry, http=web
        ) as mon:
            assert "http" in {t.get_name() for t in mon._tasks}
            await mon.handle("agents/r1/start", b'{"task": "count"}')
            text = await asyncio.to_thread(_get, f"{web.url}metrics")
            assert "agent_monitor_runs_active 1.0" in text
            # The run store's writer queue, read at scrape time from its statistics().
            assert "agent_monitor_store_queue_max 100000.0" in text
            assert "agent_monitor_store_queue_depth" in text
        with pytest.raises(urllib.error.URLError):
            # left with the monitor: nothing listens
            await asyncio.to_thread(_get, f"{web.url}metrics")
    finally:
        await web.aclose()
        await store.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_config_names_the_doors_and_the_monitor_opens_each_as_a_named_task() -> None:
    """One composition root: the metrics port's server (board, run pages, /healthz), the OTLP
    receiver and the reward API built from the config alone, each given what it reads at
    construction, bound on entering."""
    pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    config = MonitorConfig(
        metrics_port=_free_port(),
        otlp_receiver=OtlpReceiverSettings(address="127.0.0.1:0"),
        reward_api=RewardApiSettings(reward_api=True),
    )
    async with Monitor(
        config, judge=FakeJudge(), store=MemoryStore(), registry=CollectorRegistry()
    ) as mon:
        names = {t.get_name() for t in mon._tasks}
        assert {"http", "source-otlp", "source-reward"} <= names
        assert mon.http is not None and mon.board is not None
        assert isinstance(mon.http.site, BoardSite) and mon.http.site.pages is not None
        # the board is one of the monitor's sinks, given at construction
        assert mon.board in mon.sinks
        reward = next(src for src in mon.sources if src.name == "reward")
        assert getattr(reward, "calibration", None) is mon.calibration
        await mon.handle("agents/r1/start", b'{"task": "count"}')
        await asyncio.wait_for(reward.ready.wait(), 10)  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)  # bound on entering, listening once the task `http` runs
        health = await asyncio.to_thread(_get, f"{mon.http.url}healthz")
        assert '"live_runs":1' in health
        assert "agent_monitor_runs_active 1.0" in await asyncio.to_thread(
            _get, f"{mon.http.url}metrics"
        )
        url = mon.http.url
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(_get, f"{url}metrics")  # left with the monitor: nothing listens


async def test_a_taken_metrics_port_fails_the_start_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = MonitorConfig(metrics_port=taken.getsockname()[1])
        with pytest.raises(
            OSError, match=r"cannot serve /metrics on 127\.0\.0\.1:.*pass " r"--metrics-port"
        ):
            async with Monitor(config, judge=FakeJudge(), registry=CollectorRegistry()):
                pass


async def test_the_reward_api_needs_a_server_for_its_routes() -> None:
    config = MonitorConfig(reward_api=RewardApiSettings(reward_api=True))
    with pytest.raises(ValueError, match="pass --metrics-port"):
        Monitor(config, judge=FakeJudge(), registry=CollectorRegistry())


async def test_the_store_queue_is_bounded_and_reports_its_depth(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_queue"):
        SqliteStore(tmp_path / "bad.db", max_queue=0)
    store = SqliteStore(tmp_path / "runs.db", max_queue=2)
    try:
        assert store.statistics() == SqliteStoreStatistics(queue_depth=0, queue_max=2)
        # More writes than the queue holds: the writer applies back-pressure, none is lost.
        for i in range(20):
            store.record_ranking(f"g{i}", {"runs": []})
        assert store.statistics().queue_depth <= 2
        assert len(await store.rankings()) == 20
    finally:
        await store.aclose()


async def test_runs_with_nothing_to_score_end_without_taking_a_scorers_slot() -> None:
    """A burst of empty runs (start, then end) ends while the only scorer waits on a slow judge,
    in few commits."""
    judge = FakeJudge(latency_s=30.0)
    async with Monitor(
        MonitorConfig(max_concurrency=1), judge=judge, registry=CollectorRegistry()
    ) as mon:
        await mon.handle("agents/busy/start", b'{"task": "count"}')
        await mon.handle("agents/busy/step", b'{"index": 1, "text": "one"}')
        await asyncio.sleep(0.05)  # the one scorer is in the judge now, for 30 s
        empty = [f"empty-{i}" for i in range(300)]
        for run_id in empty:
            await mon.handle(f"agents/{run_id}/start", b'{"task": "count"}')
            await mon.handle(f"agents/{run_id}/end", b'{"outcome": "failure"}')
        async with asyncio.timeout(10):
            while any(r in mon.book.live for r in empty):  # noqa: ASYNC110 - the monitor's tasks end them
                await asyncio.sleep(0.01)
        # still scoring its step: nothing waited on it
        assert "busy" in mon.book.live and judge.calls_made == 1


async def test_the_monitor_statistics_are_its_status_and_each_parts_counters() -> None:
    """One pull for everything a part counts (scoring, the finisher, the early group calls, the
    HTTP server)."""
    web = HttpServer(CollectorRegistry(), port=0)
    async with Monitor(
        MonitorConfig(), judge=FakeJudge(), registry=CollectorRegistry(), http=web
    ) as mon:
        await mon.handle("agents/r1/start", b'{"task": "count"}')
        await mon.handle("agents/r1/step", b'{"index": 1, "text": "one"}')
        await mon.drain()
        stats = mon.statistics()
    assert (
        stats.status["live_runs"] == 1
        and stats.scoring.scorings == 1
        and stats.scoring.closing == 0
    )
    assert stats.uniform is not None and stats.http is not None and stats.http.routes == ()
    healthy, body = mon.health()
    assert healthy and body["status"] == "ok" and body["problems"] == [] and body["live_runs"] == 1


async def test_an_event_no_sink_takes_is_not_built_and_no_store_means_no_store_calls() -> None:
    """The step's path skips what nothing receives: `Accepted` without a sink for it, the journal
    without a store."""
    from agent_monitor.daemon import Accepted, MemoryStore, Refused, Scored
    from agent_monitor.daemon._events import Fanout
    from agent_monitor.daemon.sinks import StoreSink

    def scores_only(event: object) -> None:
        """A sink that takes scores."""

    scores_only.events = (Scored,)  # type: ignore[attr-defined]
    got: list[object] = []
    fan = Fanout([scores_only])
    assert fan.taken == {Scored}
    fan.sinks = [scores_only, got.append]  # a sink naming no `events` takes every kind
    assert Accepted in fan.taken and Refused in fan.taken
    fan(Accepted("r1", "step"))
    assert got == [Accepted("r1", "step")]

    step = b'{"index": 1, "text": "one"}'
    async with Monitor(MonitorConfig(), judge=FakeJudge(), registry=CollectorRegistry()) as mon:
        assert Accepted not in mon._emit.taken  # none of the monitor's own sinks takes it
        assert not any(isinstance(s, StoreSink) for s in mon.sinks) and not mon._intake.keeps
        await mon.handle("agents/r1/start", b'{"task": "count"}')
        await mon.handle("agents/r1/step", step)
        await mon.drain()
        # counted all the same
        assert mon._intake.statistics().accepted == {"start": 1, "step": 1, "end": 0, "amend": 0}
        assert mon._scoring.tracker("r1") is not None and mon._scoring.runs["r1"].scored == 1
    store, seen = MemoryStore(), []
    async with Monitor(MonitorConfig(), judge=FakeJudge(), store=store, sinks=[seen.append]) as mon:
        assert any(isinstance(s, StoreSink) for s in mon.sinks) and mon._intake.keeps
        await mon.handle("agents/r1/start", b'{"task": "count"}')
        await mon.handle("agents/r1/step", step)
        await mon.drain()
    assert [type(r).__name__ for r in store.records] == ["Started", "Stepped"]
    assert [e for e in seen if isinstance(e, Accepted)] == [
        Accepted("r1", "start"),
        Accepted("r1", "step"),
    ]
    assert (await store.replay()).progress.get("r1")  # the store sink kept the score
