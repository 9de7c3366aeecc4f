"""A run store written by agent-monitor 0.1 (raw events, no gap records): opened, its ended runs
kept, its live ones closed."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from agent_monitor.calibration import Family, Point, Sample
from agent_monitor.daemon import Monitor, SqliteStore, StoreFormatError
from agent_monitor.testing import FakeJudge

# The 0.1 schema, as it was written (format 1: no user_version).
V1 = """
CREATE TABLE runs (run_id TEXT PRIMARY KEY, task TEXT, started_at REAL, updated_at REAL, ended_at REAL, outcome TEXT,
    last_step INTEGER, last_score REAL, signal TEXT, labels TEXT);
CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, kind TEXT NOT NULL,
    step_index INTEGER, body TEXT NOT NULL, received_at REAL NOT NULL);
CREATE UNIQUE INDEX steps_once ON events (run_id, step_index) WHERE kind = 'step';
CREATE TABLE event_frames (seq INTEGER NOT NULL, position INTEGER NOT NULL, run_id TEXT NOT NULL, ordinal INTEGER,
    digest TEXT NOT NULL, mime TEXT, pruned INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (seq, position));
CREATE TABLE frames (digest TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE progress (run_id TEXT NOT NULL, step INTEGER NOT NULL, body TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (run_id, step));
"""


def v1_store(path: Path) -> None:
    db = sqlite3.connect(path)
    db.executescript(V1)
    for rid, ended in (("done", 50.0), ("live", None)):
        db.execute(
            "INSERT INTO runs (run_id, task, started_at, updated_at, ended_at, outcome, "
            "labels) VALUES (?, ?, 1, 1, ?, ?, '{}')",
            (rid, f"task {rid}", ended, "success" if ended else None),
        )
        db.execute(
            "INSERT INTO events (run_id, kind, body, received_at) VALUES (?, 'start', ?, 1)",
            (rid, json.dumps({"task": f"task {rid}"})),
        )
        for i, text in ((1, "one"), (None, "two, without an index")):
            db.execute(
                "INSERT INTO events (run_id, kind, step_index, body, received_at) VALUES (?, "
                "'step', ?, ?, 2)",
                (rid, i, json.dumps({"index": i, "text": text})),
            )
    # A step refused no_start, journaled all the same by 0.1.
    db.execute(
        "INSERT INTO events (run_id, kind, body, received_at) VALUES ('ghost', "
        "'step', '{\"text\": \"x\"}', 3)"
    )
    db.commit()
    db.close()


async def test_a_v1_store_opens_keeps_ended_runs_and_closes_live_ones(tmp_path: Path) -> None:
    path = tmp_path / "runs.sqlite3"
    v1_store(path)
    store = SqliteStore(path)
    try:
        runs = {r["run_id"]: r for r in await store.list_runs()}
        assert runs["done"]["outcome"] == "success" and runs["live"]["outcome"] == "migrated"
        exported = await store.export("done")
        assert exported is not None and [(s["index"], s["text"]) for s in exported["steps"]] == [
            (1, "one"),
            (2, "two, without an index"),
        ]
        replay = await store.replay()
        # nothing is resumed from a format that cannot be replayed exactly
        assert replay.records == []
        async with Monitor(judge=FakeJudge(), store=store) as mon:
            assert not mon.book.live and not mon.book.orphans
    finally:
        await store.aclose()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2
    SqliteStore(path)  # opening again is a no-op: already format 2


async def test_a_format_2_store_from_before_calibration_opens_and_gains_its_table(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.sqlite3"
    # today's schema, then made what agent-monitor wrote before calibration existed
    SqliteStore(path)
    db = sqlite3.connect(path)
    db.execute("DROP TABLE calibration")
    db.commit()
    db.close()
    store = SqliteStore(path)
    try:
        assert await store.samples() == []
        curve = (Point(1, 0.9, 0.0),)
        store.record_sample(Sample("r", Family("fam", "m", "h"), True, curve), keep=10, total=100)
        assert [s.run_id for s in await store.samples()] == ["r"]
    finally:
        await store.aclose()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2


def test_a_store_from_a_newer_version_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "runs.sqlite3"
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(
        StoreFormatError, match=r"written by a newer agent-monitor .* pass " r"another --state-dir"
    ):
        SqliteStore(path)
