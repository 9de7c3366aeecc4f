"""Cluster mode in one process: several Monitors (replicas) on one private Mosquitto and one private
Redis.

The must-show failover tests (replica processes, SIGKILL) are in test_cluster_e2e.py beside this
file; these check the mechanisms one by one, with short leases so that they run in seconds:
placement and moves on join and leave, fencing of a replica that lost its runs, groups kept on one
replica, the shared journal's readers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from agent_monitor.cli import main
from agent_monitor.daemon import (
    ClusterJournal,
    ClusterSettings,
    ClusterUnavailable,
    Monitor,
    MonitorConfig,
    RunLimits,
)
from agent_monitor.daemon.cluster._cluster import Fenced
from agent_monitor.daemon.sinks import Message
from agent_monitor.daemon.stores import Stepped
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, MonitorClient, StepIn
from tests.brokers import Mosquitto, free_port
from tests.daemon.test_daemon_mqtt import Harness, harness
from tests.redis_server import RedisServer, redis_server

pytestmark = pytest.mark.timeout(120)

LEASE, BEAT = 1.0, 0.25
"""Short leases for these tests (the default is 5 s, heartbeat 1 s): a departed replica's runs
move in ~1 s."""


def replica(
    broker: Mosquitto,
    redis: RedisServer,
    name: str,
    *,
    judge: FakeJudge | None = None,
    via: tuple[str | None, str | None] = (None, None),
    **kw: Any,
) -> Monitor:
    """One replica of cluster "t"; `via`: other URLs (a proxy) for its broker and its Redis."""
    config = MonitorConfig(
        broker=BrokerSettings.from_url(via[0] or broker.url),
        client_id="cl",
        cluster=ClusterSettings(
            url=via[1] or redis.url, name="t", replica_id=name, lease_s=LEASE, heartbeat_s=BEAT
        ),
        **kw,
    )
    return Monitor(config, judge=judge or FakeJudge(latency_s=0.01), registry=CollectorRegistry())


async def cluster_export(settings: ClusterSettings, run_id: str) -> dict[str, Any] | None:
    async with ClusterJournal(settings) as journal:
        return await journal.export(run_id)


async def owners(redis: RedisServer) -> dict[str, str]:
    r = aioredis.Redis.from_url(redis.url, decode_responses=True)
    try:
        return dict(await r.hgetall("am:t:assign"))
    finally:
        await r.aclose()


@asynccontextmanager
async def replicas(
    broker: Mosquitto, redis: RedisServer, *names: str, **kw: Any
) -> AsyncIterator[dict[str, Monitor]]:
    async with AsyncExitStack() as stack:
        out = {n: await stack.enter_async_context(replica(broker, redis, n, **kw)) for n in names}
        yield out


async def step_all(h: Harness, runs: list[str], index: int) -> None:
    for r in runs:
        await h.publish(r, "step", {"index": index, "text": f"did {index}"})


def metric(m: Monitor, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


async def test_runs_are_spread_over_replicas_and_move_on_join_and_leave(
    broker: Mosquitto, redis: RedisServer
) -> None:
    runs = [f"run-{i}" for i in range(6)]
    async with harness(broker.port) as h, replica(broker, redis, "a") as a:
        for r in runs:
            await h.publish(r, "start", {"task": "count"})
        await step_all(h, runs, 1)
        await h.until(lambda: all(h.last_step(r) == 1 for r in runs))
        assert set((await owners(redis)).values()) == {"a"}
        async with replica(broker, redis, "b") as b:
            # b joins: the heartbeat's rebalance moves ungrouped runs until loads differ by at most
            # one.
            for _ in range(40):
                placed = await owners(redis)
                if sorted(placed.values()).count("b") == 3 and len(b.cluster.owned) == 3:  # type: ignore[union-attr]
                    break
                await asyncio.sleep(BEAT)
            assert sorted(placed.values()) == ["a"] * 3 + ["b"] * 3
            assert metric(b, "agent_monitor_runs_owned") == 3
            assert metric(b, "agent_monitor_cluster_replicas") == 2
            # each moved run had an owner before
            assert metric(b, "agent_monitor_run_takeovers_total") == 3
            # Each run's gauges come from its owner only: the two replicas' series are disjoint.
            series = {
                m: {
                    s.labels["run_id"]
                    for f in m.registry.collect()
                    for s in f.samples
                    if "run_id" in s.labels
                }
                for m in (a, b)
            }
            assert series[a] | series[b] == set(runs) and not series[a] & series[b]
            for i in (2, 3):
                await step_all(h, runs, i)
            await h.until(lambda: all(h.last_step(r) == 3 for r in runs))
        # b left: it handed its runs back at once (no lease to wait for).
        for _ in range(40):
            if len(a.cluster.owned) == 6:  # type: ignore[union-attr]
                break
            await asyncio.sleep(BEAT)
        assert set((await owners(redis)).values()) == {"a"}
        await step_all(h, runs, 4)
        await h.until(lambda: all(h.last_step(r) == 4 for r in runs))
        for r in runs:
            await h.publish(r, "end", {"outcome": "success"})
        await h.until(lambda: all(h.retained[(r, "signal")] for r in runs))
    for r in runs:
        steps = [p["step"] for p in h.progress(r)]
        assert steps == sorted(steps), f"{r}'s progress went backwards: {steps}"
        run = await cluster_export(ClusterSettings(url=redis.url, name="t"), r)
        assert run is not None and [s["index"] for s in run["steps"]] == [1, 2, 3, 4]
        assert run["outcome"] == "success" and [p["step"] for p in run["curve"]] == [1, 2, 3, 4]
    assert await owners(redis) == {}  # finished runs leave the directory


async def test_a_replica_that_lost_its_run_can_neither_write_nor_publish(
    broker: Mosquitto, redis: RedisServer
) -> None:
    async with harness(broker.port) as h, replicas(broker, redis, "a", "b") as ms:
        await h.publish("r1", "start", {"task": "count"})
        await h.publish("r1", "step", {"index": 1, "text": "one"})
        await h.until(lambda: h.last_step("r1") == 1)
        owner = (await owners(redis))["r1"]
        zombie, survivor = ms[owner], ms["b" if owner == "a" else "a"]
        zc, sc = zombie.cluster, survivor.cluster
        assert zc is not None and sc is not None
        stale = zc.owned["r1"]
        # The owner stops renewing (as if paused): its heartbeat task is cancelled, nothing else.
        beat = next(t for t in zombie._tasks if t.get_name() == "cluster-heartbeat")
        beat.cancel()
        for _ in range(40):
            if "r1" in sc.owned:
                break
            await asyncio.sleep(BEAT)
        assert "r1" in sc.owned and sc.owned["r1"].token > stale.token
        assert not zombie.cluster.may_publish("r1")  # type: ignore[union-attr]
        # What it had queued to publish about the run is dropped as it leaves the outbox, and
        # counted.
        before = metric(zombie, "agent_monitor_cluster_fenced_total", what="publish")
        zombie.outbox.put(Message("agents/r1/progress", b'{"step": 1}', run_id="r1"))
        for _ in range(40):
            if metric(zombie, "agent_monitor_cluster_fenced_total", what="publish") > before:
                break
            await asyncio.sleep(0.05)
        assert metric(zombie, "agent_monitor_cluster_fenced_total", what="publish") == before + 1
        # Its late write is refused by Redis (the token is not the run's any more), and counted.
        step = StepIn.model_validate({"index": 2, "text": "late"})
        with pytest.raises(Fenced):
            await zc.store.journal_batch([Stepped("r1", step, 0.0, None)])
        assert metric(zombie, "agent_monitor_cluster_fenced_total", what="write") >= 1
        await h.publish("r1", "step", {"index": 2, "text": "two"})
        await h.until(lambda: h.last_step("r1") == 2)
        run = await cluster_export(ClusterSettings(url=redis.url, name="t"), "r1")
        assert run is not None and [s["text"] for s in run["steps"]] == ["one", "two"]


async def test_a_group_is_scored_on_one_replica(broker: Mosquitto, redis: RedisServer) -> None:
    sibs = [f"g-{i}" for i in range(4)]
    async with harness(broker.port) as h, replicas(broker, redis, "a", "b"):
        for r in ["solo-1", *sibs, "solo-2"]:
            await h.publish(r, "start", {"task": "count", **({"group": "G"} if r in sibs else {})})
        await step_all(h, sibs, 1)
        await h.until(lambda: all(h.last_step(r) == 1 for r in sibs))
        placed = await owners(redis)
        assert len({placed[r] for r in sibs}) == 1, placed


async def test_cli_reads_the_shared_journal(
    broker: Mosquitto, redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async with harness(broker.port) as h, replicas(broker, redis, "a"):
        await h.publish("cli-1", "start", {"task": "Say hello"})
        for i in (1, 2):
            await h.publish("cli-1", "step", {"index": i, "text": f"said {i}"})
        await h.until(lambda: h.last_step("cli-1") == 2)
        await asyncio.sleep(0.3)  # scores are written in the background
    url = ["--cluster", redis.url, "--cluster-name", "t"]
    capsys.readouterr()  # the replica's own log lines
    assert await asyncio.to_thread(main, ["runs", *url, "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["run_id"] == "cli-1" and row["task"] == "Say hello" and row["last_step"] == 2
    assert await asyncio.to_thread(main, ["export", "cli-1", *url]) == 0
    run = json.loads(capsys.readouterr().out)
    assert [s["index"] for s in run["steps"]] == [1, 2] and len(run["curve"]) == 2
    assert await asyncio.to_thread(main, ["export", "nope", *url]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
    dead = ["--cluster", f"redis://127.0.0.1:{free_port()}/0"]
    assert await asyncio.to_thread(main, ["runs", *dead]) == 2
    assert "check the URL (--cluster)" in capsys.readouterr().err


async def test_ended_runs_leave_the_listing_after_the_retention(
    broker: Mosquitto, redis: RedisServer
) -> None:
    r = aioredis.Redis.from_url(redis.url, decode_responses=True)
    try:
        async with harness(broker.port) as h, replicas(broker, redis, "a", retention_s=1.0):
            for run in ("old", "new"):
                await h.publish(run, "start", {"task": "count"})
                await h.publish(run, "step", {"index": 1, "text": "one"})
                await h.until(lambda run=run: h.last_step(run) == 1)
                await h.publish(run, "end", {"outcome": "success"})
                for _ in range(40):
                    if await r.zscore("am:t:ended", run) is not None:
                        break
                    await asyncio.sleep(BEAT)
                if run == "old":
                    await asyncio.sleep(1.5)  # past the retention: old's journal keys expire
            # The next run to end trims the listing: old is gone from it (as its journal is), new is
            # listed.
            assert await r.zscore("am:t:ended", "old") is None
            assert await r.zscore("am:t:ended", "new") is not None
            assert not await r.exists("am:t:rec:old")
    finally:
        await r.aclose()


async def test_unindexed_steps_take_the_journals_order(
    broker: Mosquitto, redis: RedisServer
) -> None:
    async with harness(broker.port) as h, replicas(broker, redis, "a", "b"):
        await h.publish("u", "start", {"task": "count"})
        for i in range(1, 4):
            await h.publish("u", "step", {"text": f"step {i}"})
            # one at a time: the journal's order is the publish order
            await h.until(lambda i=i: h.last_step("u") == i)
    run = await cluster_export(ClusterSettings(url=redis.url, name="t"), "u")
    assert run is not None and [(s["index"], s["text"]) for s in run["steps"]] == [
        (1, "step 1"),
        (2, "step 2"),
        (3, "step 3"),
    ]


async def test_an_owner_behind_its_inboxes_feeds_them_in_rounds(
    broker: Mosquitto, redis: RedisServer
) -> None:
    """A backlog (a burst, a run taken over) is fed every run's next event together, one journal
    write a round.

    The ingest commits a batch holding one record per run, so a backlog fed run after run cost one
    journal write (a Redis round trip) per event: the owner fell behind what it received (issue 35:
    300 runs at 2,000 steps/s, one replica applied ~420 steps/s while it journaled every one into
    the inboxes).
    """
    runs, steps = [f"bk-{i}" for i in range(12)], 5
    async with harness(broker.port) as h, replica(broker, redis, "a") as a:
        cluster, host = a.cluster, a.cluster.host if a.cluster else None  # type: ignore[union-attr]
        assert cluster is not None and host is not None
        for r in runs:
            await h.publish(r, "start", {"task": "count"})
        for _ in range(200):
            if all(r in cluster.owned and cluster.owned[r].ready and host.is_live(r) for r in runs):
                break
            await asyncio.sleep(0.05)
        # Held back (taken over, not yet ready to feed) while every run's steps reach its inbox.
        for r in runs:
            cluster.owned[r].ready = False
        for i in range(1, steps + 1):
            await step_all(h, runs, i)
        r_ = aioredis.Redis.from_url(redis.url)
        try:
            for _ in range(200):
                waiting = [
                    len(await r_.xrange(f"am:t:in:{r}", min=f"({cluster.owned[r].fed}"))
                    for r in runs
                ]
                if waiting == [steps] * len(runs):
                    break
                await asyncio.sleep(0.05)
            assert waiting == [steps] * len(runs)
        finally:
            await r_.aclose()
        store, writes = cluster.store, []
        journal_batch = store.journal_batch

        async def counted(records: Any) -> None:
            writes.append(len(records))
            await journal_batch(records)

        store.journal_batch = counted  # type: ignore[method-assign]
        for r in runs:
            cluster.owned[r].ready = True
            cluster.inboxes.mark(r)
        await h.until(lambda: all(h.last_step(r) == steps for r in runs))
        assert sum(writes) == steps * len(runs)  # every step journaled once
        # in rounds of one step of every run (run after run: 60 writes)
        assert len(writes) <= steps + 1, writes


async def test_bad_input_is_refused_once_by_the_owner(
    broker: Mosquitto, redis: RedisServer
) -> None:
    async with harness(broker.port) as h, replicas(broker, redis, "a", "b") as ms:
        await h.publish("bad", "start", {"task": "count"})
        await h.publish("bad", "step", raw=b"{not json")
        await h.publish("bad", "step", {"index": 1, "text": "fine"})
        await h.until(lambda: h.last_step("bad") == 1 and bool(h.seen[("bad", "error")]))
        await asyncio.sleep(3 * BEAT)
        errors = h.seen[("bad", "error")]
        assert len(errors) == 1 and errors[0]["reason"] == "bad_json"
        assert (
            sum(
                metric(m, "agent_monitor_invalid_events_total", reason="bad_json")
                for m in ms.values()
            )
            == 1
        )


async def test_no_redis_is_a_clear_start_up_error(broker: Mosquitto) -> None:
    port = free_port()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        cluster=ClusterSettings(url=f"redis://127.0.0.1:{port}/0"),
    )
    with pytest.raises(ClusterUnavailable, match=f"127.0.0.1:{port}.*check that Redis runs there"):
        async with Monitor(config, judge=FakeJudge()):
            pass


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"url": "http://x"}, "is not a Redis URL"),
        ({"name": "a/b"}, "cluster name"),
        ({"replica_id": "#1"}, "replica id"),
        ({"lease_s": 1.0, "heartbeat_s": 1.0}, "at least two heartbeats"),
    ],
)
def test_cluster_settings_say_what_is_wrong(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterSettings(**kw)


def test_a_store_beside_a_cluster_is_refused() -> None:
    from agent_monitor.daemon import MemoryStore

    config = MonitorConfig(cluster=ClusterSettings(url="redis://127.0.0.1:1/0"))
    with pytest.raises(ValueError, match="pass no store"):
        Monitor(config, judge=FakeJudge(), store=MemoryStore())


async def test_a_redis_restart_loses_nothing(broker: Mosquitto, tmp_path: Any) -> None:
    """Redis with its append-only file (what docs/cluster.md asks for) restarts mid-run: the runs
    go on, whole."""
    runs = ["rr-1", "rr-2", "rr-3", "rr-4"]
    with redis_server(tmp_path / "aof", appendonly=True) as redis:
        async with harness(broker.port) as h, replicas(broker, redis, "a", "b") as ms:
            for r in runs:
                await h.publish(r, "start", {"task": "count"})
            for i in (1, 2, 3):
                await step_all(h, runs, i)
            await h.until(lambda: all(h.last_step(r) == 3 for r in runs))
            redis.stop()
            # Published while Redis is down: not journaled, so not acknowledged; the broker keeps
            # them.
            for i in (4, 5):
                await step_all(h, runs, i)
            await asyncio.sleep(1.0)
            redis.start()
            for i in (6, 7):
                await step_all(h, runs, i)
            await h.until(lambda: all(h.last_step(r) == 7 for r in runs), wait_s=40)
            # Its data came back with it (append-only file): no replica says Redis was emptied.
            assert [
                metric(m, "agent_monitor_cluster_redis_emptied_total") for m in ms.values()
            ] == [0.0, 0.0]
        for r in runs:
            run = await cluster_export(ClusterSettings(url=redis.url, name="t"), r)
            assert run is not None and [s["index"] for s in run["steps"]] == list(range(1, 8)), run
            steps = [p["step"] for p in h.progress(r)]
            assert steps == sorted(steps)


async def test_a_score_the_old_owner_never_got_out_is_published_by_the_new_one(
    broker: Mosquitto, redis: RedisServer
) -> None:
    """A score journaled by a replica that lost the run before publishing it reaches the harness
    from the new owner.

    The old owner journals a score, then publishes it; a run it no longer owns has its queued
    messages dropped as they leave (the outbox's gate). Here a's gate drops everything from step 2
    on: without the takeover republishing the run's latest stored score, the harness never sees step
    2's progress. A score the broker acknowledged (noted in the run's listing, as its signal is) is
    not published again.
    """
    async with harness(broker.port) as h, AsyncExitStack() as stack:
        a = await stack.enter_async_context(replica(broker, redis, "a"))
        await h.publish("lost-1", "start", {"task": "count"})
        await h.publish("lost-1", "step", {"index": 1, "text": "one"})
        await h.publish("seen-1", "start", {"task": "count"})
        await h.publish("seen-1", "step", {"index": 1, "text": "one"})
        await h.until(lambda: h.last_step("lost-1") == 1 and h.last_step("seen-1") == 1)
        # the broker's acknowledgements of those progress messages are noted
        await asyncio.sleep(0.3)
        a.outbox.gate = lambda run: False  # what a queues from here on is dropped as it leaves
        await h.publish("lost-1", "step", {"index": 2, "text": "two"})
        for _ in range(250):
            scoring = a._scoring.runs.get("lost-1")
            if scoring is not None and scoring.scored == 2:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert h.last_step("lost-1") == 1  # scored and journaled by a, never published
        async with replica(broker, redis, "b") as b:
            await stack.aclose()  # a leaves: its journal (step 2 scored) goes to b
            await h.until(lambda: h.last_step("lost-1") == 2)
            assert [p["step"] for p in h.progress("lost-1")] == [1, 2]
            await asyncio.sleep(0.5)
            # A score the broker acknowledged is not published twice: b took seen-1 over without a
            # word.
            assert [p["step"] for p in h.progress("seen-1")] == [1]
            # Published again, not scored again: b's judge was not asked and its scorings counter
            # did not move.
            assert metric(b, "agent_monitor_scorings_total", outcome="ok") == 0.0


async def test_a_redis_that_comes_back_empty_is_said_in_the_log_the_metrics_and_healthz(
    broker: Mosquitto, redis: RedisServer
) -> None:
    """Redis restarted without persistence forgets every live run: each replica says so once, not
    per run."""
    from agent_monitor.daemon import HttpServer
    from tests.daemon.sinks.test_board import get

    registry = CollectorRegistry()
    web = HttpServer(registry, port=0)
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id="cl",
        cluster=ClusterSettings(
            url=redis.url, name="t", replica_id="a", lease_s=LEASE, heartbeat_s=BEAT
        ),
    )
    a = Monitor(config, judge=FakeJudge(latency_s=0.01), registry=registry, http=web)
    await web.bind()
    try:
        async with harness(broker.port) as h, a:
            await h.publish("e-1", "start", {"task": "count"})
            await h.publish("e-1", "step", {"index": 1, "text": "one"})
            await h.until(lambda: h.last_step("e-1") == 1)
            healthy = await get(web.port, "/healthz")
            assert healthy.status == 200 and json.loads(healthy.body)["status"] == "ok"
            redis.restart()  # no append-only file: it comes back empty
            for _ in range(100):
                if metric(a, "agent_monitor_cluster_redis_emptied_total") == 1:
                    break
                await asyncio.sleep(0.1)
            assert metric(a, "agent_monitor_cluster_redis_emptied_total") == 1
            reply = await get(web.port, "/healthz")
            body = json.loads(reply.body)
            assert reply.status == 503 and body["status"] == "unhealthy"
            assert any("came back without the cluster's data" in p for p in body["problems"]), body
            await asyncio.sleep(4 * BEAT)
            # said once, not every heartbeat
            assert metric(a, "agent_monitor_cluster_redis_emptied_total") == 1
    finally:
        await web.aclose()


async def test_what_one_replica_learns_every_replica_uses(
    broker: Mosquitto, redis: RedisServer
) -> None:
    """A calibration sample (a run that ended with an outcome) reaches every replica's "auto"
    thresholds at once."""
    async with harness(broker.port) as h, replicas(broker, redis, "a", "b") as ms:
        await h.publish("cal-1", "start", {"task": "count", "family": "fam"})
        await h.publish("cal-1", "step", {"index": 1, "text": "one"})
        await h.until(lambda: h.last_step("cal-1") == 1)
        await h.publish("cal-1", "end", {"outcome": "success"})
        for _ in range(40):
            if all(sum(f.successes for f in m.calibration.families()) == 1 for m in ms.values()):
                break
            await asyncio.sleep(BEAT)
        assert [sum(f.successes for f in m.calibration.families()) for m in ms.values()] == [1, 1]
    # And a replica that starts later loads it from the cluster.
    async with replica(broker, redis, "c") as c:
        assert sum(f.successes for f in c.calibration.families()) == 1


async def test_calibration_cli_reads_and_resets_the_clusters_samples(
    broker: Mosquitto, redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async with harness(broker.port) as h, replicas(broker, redis, "a"):
        await h.publish("c-1", "start", {"task": "count", "family": "fam"})
        await h.publish("c-1", "step", {"index": 1, "text": "one"})
        await h.until(lambda: h.last_step("c-1") == 1)
        await h.publish("c-1", "end", {"outcome": "success"})
        await h.until(lambda: bool(h.retained[("c-1", "signal")]))
        await asyncio.sleep(0.3)
    url = ["--cluster", redis.url, "--cluster-name", "t"]
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["calibration", *url, "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["family"] == "fam" and row["successes"] == 1
    assert await asyncio.to_thread(main, ["calibration", *url, "--reset", "fam"]) == 0
    assert "deleted 1 sample of family 'fam' from cluster t on" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["calibration", *url]) == 0
    assert "no calibration samples in cluster t" in capsys.readouterr().out


async def test_the_outbox_counts_what_waits_per_run() -> None:
    """A replica handing a run over waits until the run's queued messages left: the outbox counts
    them per run."""
    from agent_monitor.daemon.sinks import Outbox

    box = Outbox(3)
    box.put(Message("agents/a/progress", b"1", run_id="a"))
    box.put(Message("agents/a/signal", b"2", run_id="a", droppable=False))
    box.put(Message("agents/b/progress", b"3", run_id="b"))
    assert (box.pending("a"), box.pending("b")) == (2, 1)
    # full: the oldest droppable one (a's progress) goes
    box.put(Message("agents/b/progress", b"4", run_id="b"))
    assert (box.pending("a"), box.pending("b")) == (1, 2)
    # b is not this replica's any more: its messages are dropped as they leave
    box.gate = lambda run: run != "b"
    box.put(Message("agents/a/progress", b"5", run_id="a"))
    # b's two were skipped
    assert [(await box.get()).payload, (await box.get()).payload] == [b"2", b"5"]
    assert (box.pending("a"), box.pending("b"), len(box)) == (0, 0, 0)


async def test_made_up_runs_leave_nothing_behind(broker: Mosquitto, redis: RedisServer) -> None:
    """Steps for runs that never start (a typo, a flood) are dropped after --hold, and their keys
    go with them."""
    async with (
        harness(broker.port) as h,
        replicas(broker, redis, "a", limits=RunLimits(hold_s=0.5)) as ms,
    ):
        for i in range(5):
            await h.publish(f"ghost-{i}", "step", {"index": 1, "text": "no start"})
        await h.until(lambda: all(h.seen[(f"ghost-{i}", "error")] for i in range(5)))
        for _ in range(40):
            if not await owners(redis):
                break
            await asyncio.sleep(BEAT)
        assert await owners(redis) == {}
        assert ms["a"].status()["owned"] == 0
    r = aioredis.Redis.from_url(redis.url)
    try:
        assert not [k for k in await r.keys("am:t:in:*")]
    finally:
        await r.aclose()


class Cut:
    """A TCP proxy (to Redis, or the broker) that cuts one replica off (connections closed, new
    ones refused)."""

    def __init__(self, port: int, scheme: str = "redis", path: str = "/0") -> None:
        self.port = port
        self.scheme, self.path = scheme, path
        self.cut = False
        self.conns: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Cut:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.sever()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"{self.scheme}://127.0.0.1:{self.server.sockets[0].getsockname()[1]}{self.path}"

    def sever(self) -> None:
        for w in self.conns:
            w.close()
        self.conns.clear()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.cut:
            w.close()
            return
        ur, uw = await asyncio.open_connection("127.0.0.1", self.port)
        self.conns += [w, uw]

        async def pump(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await a.read(65536):
                    b.write(data)
                    await b.drain()
            b.close()

        await asyncio.gather(pump(r, uw), pump(ur, w))


@pytest.mark.parametrize("cut_from", ["redis", "broker"])
async def test_a_replica_cut_off_loses_nothing(
    broker: Mosquitto, redis: RedisServer, cut_from: str
) -> None:
    """One replica is cut off past its lease, from Redis or from the broker (not both); its runs and
    its MQTT session go to the other, and when it is back it joins again: every step once, in order,
    no progress backwards.

    Cut from Redis, it cannot heartbeat: it is counted dead, and it does not connect to the broker
    again until Redis answers (a second client with its id would push the session's taker off). Cut
    from the broker, it steps aside: it hands its runs over and counts as departed, so a survivor
    empties its session (the broker queues a share of every run's inputs there) and the other runs
    do not wait for it."""
    runs = [f"cut-{i}" for i in range(6)]
    port, scheme, path = (
        (redis.port, "redis", "/0") if cut_from == "redis" else (broker.port, "mqtt", "")
    )
    async with Cut(port, scheme, path) as cut, harness(broker.port) as h:
        via = (None, cut.url) if cut_from == "redis" else (cut.url, None)
        async with (
            replica(broker, redis, "a", via=via) as cut_off,
            replica(broker, redis, "b") as b,
        ):
            for r in runs:
                await h.publish(r, "start", {"task": "count"})
            await step_all(h, runs, 1)
            await h.until(lambda: all(h.last_step(r) == 1 for r in runs))
            assert sorted((await owners(redis)).values()) == ["a"] * 3 + ["b"] * 3
            cut.cut = True
            cut.sever()
            for i in (2, 3, 4):
                await step_all(h, runs, i)
                await asyncio.sleep(LEASE)
            # Every run goes on, a's included, before a is back.
            await h.until(lambda: all(h.last_step(r) == 4 for r in runs), wait_s=30)
            assert set((await owners(redis)).values()) == {"b"}
            for _ in range(40):  # emptied once the broker has sent nothing for a second
                if metric(b, "agent_monitor_cluster_sessions_adopted_total"):
                    break
                await asyncio.sleep(BEAT)
            assert metric(b, "agent_monitor_cluster_sessions_adopted_total") == 1
            cut.cut = False
            for _ in range(80):
                if cut_off.status()["replicas"] == 2 and (
                    cut_off.status()["owned"],
                    b.status()["owned"],
                ) == (3, 3):
                    break
                await asyncio.sleep(BEAT)
            # back, and balanced again
            assert (cut_off.status()["owned"], b.status()["owned"]) == (3, 3)
            for i in (5, 6):
                await step_all(h, runs, i)
            await h.until(lambda: all(h.last_step(r) == 6 for r in runs), wait_s=30)
    for r in runs:
        steps = [p["step"] for p in h.progress(r)]
        assert steps == sorted(steps), f"{r}'s progress went backwards: {steps}"
        run = await cluster_export(ClusterSettings(url=redis.url, name="t"), r)
        assert run is not None and [s["index"] for s in run["steps"]] == list(range(1, 7))


async def test_a_new_owner_publishes_an_abort_again_only_if_it_may_not_be_out(
    broker: Mosquitto, redis: RedisServer
) -> None:
    """An abort the broker acknowledged is not published again by the run's next owner (a harness
    sees it once); one the previous owner decided and stored but never got out (it died first) is.
    """
    policy = {"abort_below": 0.5, "min_steps": 1, "patience": 1}
    judge = FakeJudge(["A"])
    async with harness(broker.port) as h, replica(broker, redis, "a", judge=judge) as a:
        assert a.cluster is not None
        for r in ("out", "lost"):
            await h.publish(r, "start", {"task": "count", "policy": policy})
        await h.publish("out", "step", {"index": 1, "text": "nothing done"})
        await h.until(lambda: any(s and s["signal"] == "abort" for s in h.seen[("out", "signal")]))
        await asyncio.sleep(0.3)  # the broker's acknowledgement is noted in Redis
        # The next abort is decided and stored, but its publication never leaves (as if the owner
        # died first).
        a.outbox.gate = lambda run: run != "lost"
        await h.publish("lost", "step", {"index": 1, "text": "nothing done"})
        for _ in range(40):
            t = a.tracker("lost")
            if t is not None and t.latest is not None:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert not [s for s in h.seen[("lost", "signal")] if s]
        # it stops renewing: "dead"
        next(t for t in a._tasks if t.get_name() == "cluster-heartbeat").cancel()
        async with replica(broker, redis, "b", judge=judge) as b:
            for _ in range(60):
                if b.status()["owned"] == 2:
                    break
                await asyncio.sleep(BEAT)
            assert b.status()["owned"] == 2
            await h.until(
                lambda: any(s and s["signal"] == "abort" for s in h.seen[("lost", "signal")])
            )
            await asyncio.sleep(1.0)
    aborts = {
        r: [s for s in h.seen[(r, "signal")] if s and s["signal"] == "abort"]
        for r in ("out", "lost")
    }
    assert (len(aborts["out"]), len(aborts["lost"])) == (1, 1), aborts


async def test_steps_published_while_no_replica_is_subscribed_are_sent_again_after_a_broker_restart(
    broker: Mosquitto, redis: RedisServer
) -> None:
    """The broker restarts (persistence on) and the harness is back before any replica: what it
    publishes then reaches no subscriber (Mosquitto 2.0.11 restores sessions but not their $share
    subscriptions), yet every run's journal ends exact. The monitor asks for each gap again
    (`resend`) and MonitorClient re-sends its unscored steps.
    """
    runs = [f"rs-{i}" for i in range(3)]
    limits = RunLimits(hold_s=4.0)
    async with Cut(broker.port, "mqtt", "") as cut, AsyncExitStack() as stack:
        ms = [
            await stack.enter_async_context(
                replica(broker, redis, name, via=(cut.url, None), limits=limits)
            )
            for name in ("a", "b")
        ]
        client = MonitorClient(broker.url, connect_timeout=10, ack_timeout=10)
        await asyncio.to_thread(client.__enter__)
        stack.callback(client.__exit__, None, None, None)
        handles = [await asyncio.to_thread(client.start_run, r, task="count") for r in runs]
        for i in (1, 2):
            for run in handles:
                await asyncio.to_thread(run.step, f"did {i}")
        for run in handles:
            await asyncio.to_thread(run.wait_progress, 2, 30)
        cut.cut = True  # the replicas cannot reach the broker until the harness has published
        cut.sever()
        await asyncio.to_thread(broker.restart)
        for _ in range(200):
            if client.connected:
                break
            await asyncio.sleep(0.05)
        assert client.connected
        for i in (3, 4):  # acknowledged by the broker, delivered to no replica
            for run in handles:
                await asyncio.to_thread(run.step, f"did {i}")
        cut.cut = False
        async with harness(broker.port) as h:
            for _ in range(300):  # the replicas reconnect and subscribe again
                if all(m.link is not None and m.link.connected.is_set() for m in ms):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            # the next step shows the gap: the monitor asks, the client sends 3 and 4 again
            for run in handles:
                await asyncio.to_thread(run.step, "did 5")
            await h.until(lambda: all(h.last_step(r) == 5 for r in runs), wait_s=40)
        assert sum(run.resent for run in handles) >= 2 * len(runs)
    for r in runs:
        journal = await cluster_export(ClusterSettings(url=redis.url, name="t"), r)
        assert journal is not None
        assert [(s["index"], s["text"]) for s in journal["steps"]] == [
            (i, f"did {i}") for i in range(1, 6)
        ], journal
