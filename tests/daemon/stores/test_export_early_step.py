"""A step that arrives before its run's start is held, then kept when the start comes: `export` must
show it.

In cluster mode this is the common case, not a corner: the start and the first step go to different
replicas (a shared subscription hands out messages in turn) and the second may reach the run's inbox
first. Both run stores' exports left such a step out (it is journaled as an orphan, and the start
places it without a record of its own), although the run had it and scored it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_monitor.daemon import ClusterSettings
from agent_monitor.daemon.stores._store import SqliteStore
from tests.brokers import Mosquitto
from tests.daemon.cluster.test_cluster import cluster_export, replica
from tests.daemon.stores.test_store import journal_events
from tests.daemon.test_daemon_mqtt import harness
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)

EARLY_FIRST = [
    ("agents/e/step", {"index": 1, "text": "one"}),
    ("agents/e/start", {"task": "count"}),
    ("agents/e/step", {"index": 2, "text": "two"}),
]


async def test_sqlite_export_keeps_a_step_that_came_before_the_start(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    try:
        await journal_events(store, EARLY_FIRST)
        exported = await store.export("e")
    finally:
        await store.aclose()
    assert exported is not None
    assert [(s["index"], s["text"]) for s in exported["steps"]] == [(1, "one"), (2, "two")]


async def test_sqlite_export_places_an_unindexed_early_step(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    try:
        # An un-indexed early step goes to the next position when the start comes.
        await journal_events(
            store, [("agents/u/step", {"text": "first"}), ("agents/u/start", {"task": "t"})]
        )
        exported = await store.export("u")
    finally:
        await store.aclose()
    assert exported is not None and [(s["index"], s["text"]) for s in exported["steps"]] == [
        (1, "first")
    ]


async def test_cluster_export_keeps_a_step_that_came_before_the_start(
    broker: Mosquitto, redis: RedisServer
) -> None:
    async with harness(broker.port) as h, replica(broker, redis, "a"):
        for topic, payload in EARLY_FIRST:
            await h.publish(topic.split("/")[1], topic.rsplit("/", 1)[1], payload)
        await h.until(lambda: h.last_step("e") == 2)
        await h.publish("e", "end", {"outcome": "success"})
        await h.until(lambda: bool(h.retained[("e", "signal")]))
    exported = await cluster_export(ClusterSettings(url=redis.url, name="t"), "e")
    assert exported is not None
    assert [(s["index"], s["text"]) for s in exported["steps"]] == [(1, "one"), (2, "two")]
    # The run had it all along: the score of step 2 covered two steps.
    assert [p["step"] for p in exported["curve"]][-1] == 2
