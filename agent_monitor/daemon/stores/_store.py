"""Run stores: the journal of what each run accepted, and its scores, so a restarted daemon resumes
every live run.

`SqliteStore` (the default, one WAL file under `--state-dir`) journals each record of the run
state (`stores._records`: a start, a step at its resolved index, an end, a gap
filled, orphan steps held or dropped, a run finished) before the daemon applies it, and the
daemon acknowledges an MQTT message only after its record is committed: a crash between
receipt and journal loses nothing, because the broker redelivers what was not acknowledged.
What the monitor refused is never journaled. Replaying the records of the runs still live
rebuilds exactly the state the daemon had; scores are stored too, so steps already scored are
not judged again. `MemoryStore` keeps the same records in memory (tests, embedding). Images
are stored once per digest; frames the frame budget will never show again are pruned
(replayed as a 1x1 placeholder, keeping the run's frame numbering and so its prompt prefix).
Writes run on one thread in submission order, so a crash leaves a consistent prefix.

The store also keeps the calibration samples (`agent_monitor.calibration`: each finished run's
outcome and score curve, per family, judge model and rubric) that "auto" abort thresholds are
learnt from. They are evidence, not run records: retention never deletes them; each family keeps
its most recent `Calibration.max_samples`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import hashlib
import json
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog

from ...calibration import Family, Sample
from ...images import FrameBudget
from ...progress import Usage
from ...wire import RunEnd, RunStart, StepIn
from ._records import (
    Amended,
    Delivery,
    Finished,
    GapFilled,
    OrphansDropped,
    Record,
    Started,
    Stepped,
    StoreFormatError,
    event_of,
    event_record,
)

log = structlog.get_logger("agent_monitor.store")

T = TypeVar("T")

# A valid 1x1 PNG: what a pruned frame is replayed as (never shown to the judge by then).
PLACEHOLDER_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
_SCHEMA_VERSION = 2
_GROUP_MAX = 256
"""Writes the writer thread commits in one transaction at most (it takes what is waiting, up to
this)."""
_QUEUE_MAX = 100_000
"""Writes the writer thread's queue holds (each a record, a batch or a score write); beyond,
writers wait."""
_DELIVERIES_KEPT = 65_536
"""Deliveries kept for redelivery detection after a restart (far more than any broker keeps in
flight)."""


@dataclass(frozen=True, slots=True)
class HistoryQuery:
    """Which ended runs `SqliteStore.history` lists: each filter given must match; `limit` runs a
    page."""

    outcome: str | None = None
    signal: str | None = None
    family: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    """(key, value) pairs the run's labels must all hold."""
    since: float | None = None
    """Ended at or after this Unix time."""
    until: float | None = None
    """Ended before this Unix time."""
    limit: int = 50
    cursor: tuple[float, str] | None = None
    """The (ended_at, run_id) of the previous page's last run: this page starts after it."""


@dataclass(slots=True)
class Replay:
    """What a store holds of the runs still live: their records in journal order, their scores,
    and ended ids."""

    records: list[Record] = field(default_factory=list)
    progress: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per run, its stored scores in step order (`Progress.to_json` forms)."""
    ended: list[tuple[str, float | None]] = field(default_factory=list)
    """The log of run ids ending (with when) and used again for a new run (None), oldest first:
    folded by the run state into its bounded memory of ended runs, exactly as it folded them live.
    """
    deliveries: list[tuple[int, str, str]] = field(default_factory=list)
    """The most recent MQTT deliveries journaled (packet id, digest, run id), oldest first,
    finished runs' too."""


class RunStore(Protocol):
    """Where runs are journaled: the narrow seam between the daemon and durable state.

    A store may also offer `async journal_batch(records)`: several records in order, all or none
    (one transaction), the daemon's group commit of the messages it handles together (SqliteStore,
    MemoryStore and NoStore do). Without it the daemon journals a batch's records one by one."""

    async def journal(self, record: Record) -> None:
        """Record durably, before the daemon applies it (and so before the message is
        acknowledged)."""
        ...

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Record a published score (written in order, without waiting)."""
        ...

    async def replay(self) -> Replay:
        """The records of every run not finished, in journal order, with their scores."""
        ...

    def record_sample(self, sample: Sample, keep: int, total: int) -> None:
        """Keep a calibration sample (in order, without waiting): its family's `keep` most
        recent, `total` in all."""
        ...

    async def samples(self) -> list[Sample]:
        """Every calibration sample kept, oldest first."""
        ...

    async def reset_family(self, name: str) -> int:
        """Delete the calibration samples of every family called `name` (any judge model or
        rubric); how many."""
        ...

    def record_ranking(self, group: str, ranking: Mapping[str, Any] | None) -> None:
        """Keep a group's published ranking (in order, without waiting); None: the group was
        cleared."""
        ...

    async def rankings(self) -> dict[str, dict[str, Any]]:
        """Every group's last published ranking not cleared (a restart rebuilds its ended and
        pruned runs from it)."""
        ...

    async def aclose(self) -> None:
        """Finish pending writes and close."""
        ...


def default_state_dir() -> Path:
    """A per-user data directory ($XDG_DATA_HOME/agent-monitor, else
    ~/.local/share/agent-monitor)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agent-monitor"


_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, task TEXT, started_at REAL, updated_at REAL, ended_at REAL, outcome TEXT,
    last_step INTEGER, last_score REAL, signal TEXT, labels TEXT
);
CREATE TABLE IF NOT EXISTS ended_log (seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, at REAL);
CREATE TABLE IF NOT EXISTS deliveries (seq INTEGER PRIMARY KEY AUTOINCREMENT, mid INTEGER, digest TEXT, run_id TEXT);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, kind TEXT NOT NULL,
    step_index INTEGER, body TEXT NOT NULL, received_at REAL NOT NULL, mid INTEGER, digest TEXT
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, seq);
CREATE UNIQUE INDEX IF NOT EXISTS steps_once ON events (run_id, step_index) WHERE kind = 'step';
CREATE TABLE IF NOT EXISTS event_frames (
    seq INTEGER NOT NULL, position INTEGER NOT NULL, run_id TEXT NOT NULL, ordinal INTEGER,
    digest TEXT NOT NULL, mime TEXT, pruned INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (seq, position)
);
CREATE INDEX IF NOT EXISTS frames_by_run ON event_frames (run_id, ordinal);
CREATE TABLE IF NOT EXISTS frames (digest TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS progress (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, body TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (run_id, step)
);
CREATE TABLE IF NOT EXISTS calibration (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, family TEXT NOT NULL, model TEXT NOT NULL, rubric TEXT NOT NULL,
    run_id TEXT NOT NULL, body TEXT NOT NULL, at REAL NOT NULL, UNIQUE (family, model, rubric, run_id)
);
CREATE INDEX IF NOT EXISTS calibration_by_family ON calibration (family, model, rubric, seq);
CREATE TABLE IF NOT EXISTS group_rankings (group_name TEXT PRIMARY KEY, body TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS runs_by_end ON runs (ended_at, run_id);
"""
# Tables are only ever added here (CREATE ... IF NOT EXISTS): an older store opens and gains them,
# and an older agent-monitor still reads a newer store of the same format. A change to an existing
# table needs a new format.


@dataclass(frozen=True, slots=True)
class SqliteStoreStatistics:
    """The store's writer queue (exported as agent_monitor_store_*, `STORE_GAUGES`)."""

    queue_depth: int
    """Writes waiting for the writer thread."""
    queue_max: int
    """The queue's bound (`max_queue`): beyond it, writers wait."""


class SqliteStore:
    """The embedded run store: one SQLite file in WAL mode, written by one thread in submission
    order.

    `synchronous=NORMAL` in WAL mode survives a crash of the process (the case here: SIGKILL, OOM)
    without an fsync per record; pass `fsync=True` to survive power loss too, at a cost per record.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        frame_budget: FrameBudget | None = None,
        fsync: bool = False,
        clock: Callable[[], float] = time.time,
        max_queue: int = _QUEUE_MAX,
    ) -> None:
        self.path = Path(path)
        self.budget = frame_budget or FrameBudget()
        self.clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self._db.execute("PRAGMA foreign_keys=OFF")
        _check_format(self._db, self.path)
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        self._frames_total: dict[str, int] = {}
        self._progress_lock = threading.Lock()
        self._progress_rows: list[tuple[Any, ...]] | None = None
        """Scores waiting for the write already queued for them (see record_progress); None: none
        queued."""
        self._writer = _Writer(
            self._db, commit=self._commit, on_failed=self._frames_total.clear, maxsize=max_queue
        )
        self._closed = False

    def _commit(self, db: sqlite3.Connection) -> None:
        """End the writer's transaction (a seam: tests make it fail, as a full disk or an I/O
        error would)."""
        db.execute("COMMIT")

    def _submit(
        self, fn: Callable[[sqlite3.Connection], T], *, seal: bool = True
    ) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("the run store is closed")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if seal:
            with self._progress_lock:
                self._progress_rows = None  # scores recorded after this write are written after it
        self._writer.put(fn, fut)
        return fut

    def _background(
        self, fn: Callable[[sqlite3.Connection], Any], what: str, *, seal: bool = True
    ) -> None:
        def done(f: concurrent.futures.Future[Any]) -> None:
            if f.exception() is not None:
                log.error("store_write_failed", what=what, error=str(f.exception()))

        self._submit(fn, seal=seal).add_done_callback(done)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.wrap_future(self._submit(fn))

    # -- writes --

    async def journal(self, record: Record) -> None:
        """Write one record (images once per digest) and wait until it is committed."""
        await self._run(self._writer_for(record))

    async def journal_batch(self, records: Sequence[Record]) -> None:
        """Write records in order in one transaction and wait until it is committed; on a failure
        none is kept."""
        if not records:
            return
        writers = [self._writer_for(r) for r in records]

        def write(db: sqlite3.Connection) -> None:
            for w in writers:
                w(db)

        await self._run(write)

    def _writer_for(self, record: Record) -> Callable[[sqlite3.Connection], None]:
        run_id, at = record.run_id, record.at
        if isinstance(record, Finished):
            return lambda db: _finish(db, run_id, record.outcome, at, self._frames_total)
        if isinstance(record, OrphansDropped):
            return lambda db: _drop_orphans(db, run_id)
        if isinstance(record, GapFilled):
            body = json.dumps({"upto": record.upto})

            def gap(db: sqlite3.Connection) -> None:
                _insert(db, run_id, "gap", None, body, at, None)

            return gap
        kind, event = event_of(record)
        body = event.model_dump_json(exclude={"images"} if not isinstance(event, RunEnd) else None)
        images = [
            (hashlib.sha256(i.decoded()).hexdigest(), i.mime, i.decoded())
            for i in getattr(event, "images", [])
        ]
        index = event.index if kind in ("step", "amend") and isinstance(event, StepIn) else None
        delivery = record.delivery
        budget = self.budget

        def write(db: sqlite3.Connection) -> None:
            if (
                kind not in ("step", "amend")
                and db.execute(
                    "SELECT 1 FROM runs WHERE run_id = ? AND ended_at IS NOT NULL", (run_id,)
                ).fetchone()
            ):
                _delete_run(db, run_id)  # a run id used again after its run ended: a new run
                db.execute("INSERT INTO ended_log (run_id, at) VALUES (?, NULL)", (run_id,))
                self._frames_total.pop(run_id, None)
            if kind == "start":
                assert isinstance(event, RunStart)
                db.execute(
                    "INSERT INTO runs (run_id, task, started_at, updated_at, labels) VALUES "
                    "(?, ?, ?, ?, ?) "
                    "ON CONFLICT (run_id) DO UPDATE SET task = excluded.task, started_at = "
                    "excluded.started_at, "
                    "updated_at = excluded.updated_at, ended_at = NULL, outcome = NULL, "
                    "labels = excluded.labels",
                    (run_id, event.task, at, at, json.dumps(event.labels)),
                )
            seq = _insert(db, run_id, kind, index, body, at, delivery)
            total = self._frame_count(db, run_id) if kind == "step" else None
            for pos, (digest, mime, data) in enumerate(images):
                db.execute(
                    "INSERT OR IGNORE INTO frames (digest, data) VALUES (?, ?)", (digest, data)
                )
                ordinal = None if total is None else total + pos
                db.execute(
                    "INSERT INTO event_frames (seq, position, run_id, ordinal, digest, mime) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (seq, pos, run_id, ordinal, digest, mime),
                )
            if total is not None and images:
                before, total = total, total + len(images)
                self._frames_total[run_id] = total
                # Frames the budget will never show again: not anchors, and just out of the newest
                # `recent`.
                gone = range(max(0, before - budget.recent), max(0, total - budget.recent))
                db.executemany(
                    "UPDATE event_frames SET pruned = 1 WHERE run_id = ? AND ordinal = ? AND "
                    "pruned = 0",
                    [(run_id, o) for o in gone if not budget.is_anchor(o)],
                )

        return write

    def _frame_count(self, db: sqlite3.Connection, run_id: str) -> int:
        if run_id not in self._frames_total:
            row = db.execute(
                "SELECT COALESCE(MAX(ordinal) + 1, 0) FROM event_frames WHERE run_id = ? AND "
                "ordinal IS NOT NULL",
                (run_id,),
            ).fetchone()
            self._frames_total[run_id] = int(row[0])
        return self._frames_total[run_id]

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Record a score and the run's summary (in the background, in order).

        Scores recorded one after another share one write (one queue hop, one executemany): a scored
        step each costs a thread wake-up and a future otherwise, which a burst of scorings pays
        thousands of times a second. A write of another kind submitted meanwhile closes the group,
        so every write still runs in submission order.
        """
        row = (run_id, step, json.dumps(data), self.clock(), data.get("score"), data.get("signal"))
        with self._progress_lock:
            rows = self._progress_rows
            if rows is None:
                rows = self._progress_rows = []
                group = rows
                self._background(lambda db: self._write_progress(db, group), "progress", seal=False)
            rows.append(row)

    def _write_progress(self, db: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
        with self._progress_lock:
            if self._progress_rows is rows:
                self._progress_rows = None  # closed: later scores go to the next write
            taken = list(rows)
        db.executemany(
            "INSERT OR REPLACE INTO progress (run_id, step, body, at) VALUES (?, ?, ?, ?)",
            [(r[0], r[1], r[2], r[3]) for r in taken],
        )
        db.executemany(
            "UPDATE runs SET updated_at = ?, last_step = ?, last_score = COALESCE(?, last_score), "
            "signal = COALESCE(?, signal) WHERE run_id = ?",
            [(r[3], r[1], r[4], r[5], r[0]) for r in taken],
        )

    def record_sample(self, sample: Sample, keep: int, total: int) -> None:
        """Keep a calibration sample (in the background, in order): its family's `keep` most
        recent, `total` in all."""
        f = sample.family
        key = (f.name, f.model, f.rubric)
        body = json.dumps(sample.to_json())

        def write(db: sqlite3.Connection) -> None:
            c = db.execute(
                "INSERT OR IGNORE INTO calibration (family, model, rubric, run_id, body, at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (*key, sample.run_id, body, sample.at),
            )
            if c.rowcount:
                # The same window Calibration keeps in memory: the family's most recent `keep` runs.
                db.execute(
                    "DELETE FROM calibration WHERE family = ? AND model = ? AND rubric = ? "
                    "AND seq <= ("
                    "SELECT seq FROM calibration WHERE family = ? AND model = ? AND rubric = ? "
                    "ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                    (*key, *key, keep),
                )
                # And a bound over all families (they come from the network): the oldest samples go.
                db.execute(
                    "DELETE FROM calibration WHERE seq <= (SELECT seq FROM calibration ORDER "
                    "BY seq DESC LIMIT 1 OFFSET ?)",
                    (total,),
                )

        self._background(write, "calibration")

    async def samples(self) -> list[Sample]:
        """Every calibration sample kept, oldest first (the order Calibration keeps its window
        in)."""

        def read(db: sqlite3.Connection) -> list[Sample]:
            return [
                Sample.from_json(json.loads(b))
                for (b,) in db.execute("SELECT body FROM calibration ORDER BY seq")
            ]

        return await self._run(read)

    async def reset_family(self, name: str) -> int:
        """Delete the calibration samples of every family called `name` (any judge model or
        rubric); how many."""
        return await self._run(
            lambda db: db.execute("DELETE FROM calibration WHERE family = ?", (name,)).rowcount
        )

    def record_ranking(self, group: str, ranking: Mapping[str, Any] | None) -> None:
        """Keep a group's published ranking (in the background, in order); None deletes it (the
        group was cleared)."""
        body, now = (None if ranking is None else json.dumps(ranking)), self.clock()

        def write(db: sqlite3.Connection) -> None:
            if body is None:
                db.execute("DELETE FROM group_rankings WHERE group_name = ?", (group,))
            else:
                db.execute(
                    "INSERT OR REPLACE INTO group_rankings (group_name, body, at) VALUES (?, ?, ?)",
                    (group, body, now),
                )

        self._background(write, "ranking")

    async def rankings(self) -> dict[str, dict[str, Any]]:
        """Every group's last published ranking not cleared."""

        def read(db: sqlite3.Connection) -> dict[str, dict[str, Any]]:
            rows = db.execute("SELECT group_name, body FROM group_rankings ORDER BY at")
            return {g: json.loads(b) for g, b in rows}

        return await self._run(read)

    async def frame(self, digest: str) -> tuple[str, bytes] | None:
        """A stored frame's type and bytes by its digest (None: never stored, or pruned by the
        frame budget)."""

        def read(db: sqlite3.Connection) -> tuple[str, bytes] | None:
            row = db.execute(
                "SELECT ef.mime, f.data FROM event_frames ef JOIN frames f ON f.digest = ef.digest "
                "WHERE ef.digest = ? AND ef.pruned = 0 LIMIT 1",
                (digest,),
            ).fetchone()
            return None if row is None or not row[0] else (str(row[0]), bytes(row[1]))

        return await self._run(read)

    async def ranking(self, group: str) -> dict[str, Any] | None:
        """One group's last published ranking (None: none kept)."""

        def read(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(
                "SELECT body FROM group_rankings WHERE group_name = ?", (group,)
            ).fetchone()
            return None if row is None else dict(json.loads(row[0]))

        return await self._run(read)

    async def prune(self, older_than_s: float) -> int:
        """Delete runs that ended more than `older_than_s` ago, and frames nothing live refers to;
        return runs deleted.

        Calibration samples stay: they are the evidence "auto" thresholds rest on, bounded per
        family instead.
        """
        cutoff = self.clock() - older_than_s

        def write(db: sqlite3.Connection) -> int:
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT run_id FROM runs WHERE ended_at IS NOT NULL AND ended_at < ?", (cutoff,)
                )
            ]
            for rid in ids:
                _delete_run(db, rid)
            db.execute(
                "DELETE FROM frames WHERE digest NOT IN (SELECT digest FROM "
                "event_frames WHERE pruned = 0)"
            )
            return len(ids)

        return await self._run(write)

    # -- reads --

    async def replay(self) -> Replay:
        """The records of every run not finished (and of steps still waiting for a start), in
        journal order."""

        def read(db: sqlite3.Connection) -> Replay:
            ended = {r[0] for r in db.execute("SELECT run_id FROM runs WHERE ended_at IS NOT NULL")}
            log_rows = db.execute(
                "SELECT run_id, at FROM ended_log ORDER BY seq DESC LIMIT ?", (_DELIVERIES_KEPT,)
            )
            deliveries = db.execute(
                "SELECT mid, digest, run_id FROM deliveries ORDER BY seq DESC LIMIT ?",
                (_DELIVERIES_KEPT,),
            )
            out = Replay(
                ended=[(r[0], r[1]) for r in reversed(list(log_rows))],
                deliveries=[tuple(r) for r in reversed(list(deliveries))],
            )
            frames = _frames_by_seq(db, set(ended))
            rows = db.execute(
                "SELECT seq, run_id, kind, body, received_at, mid, digest FROM events ORDER BY seq"
            )
            for seq, run_id, kind, body, at, mid, digest in rows:
                if run_id not in ended:
                    delivery = Delivery(mid, digest) if mid is not None and digest else None
                    out.records.append(
                        _record(run_id, kind, body, at, delivery, frames.get(seq, []))
                    )
            for run_id, body in db.execute(
                "SELECT run_id, body FROM progress ORDER BY run_id, step"
            ):
                if run_id not in ended:
                    out.progress.setdefault(run_id, []).append(json.loads(body))
            return out

        return await self._run(read)

    async def count_runs(self) -> tuple[int, int]:
        """How many runs the store holds: (live, ended), ended ones until --retention drops them."""

        def read(db: sqlite3.Connection) -> tuple[int, int]:
            live, ended = db.execute(
                "SELECT COUNT(*) - COUNT(ended_at), COUNT(ended_at) FROM runs"
            ).fetchone()
            return int(live), int(ended)

        return await self._run(read)

    async def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        """Live and recent runs, newest first: id, task, times, outcome, last step, score and
        signal."""

        def read(db: sqlite3.Connection) -> list[dict[str, Any]]:
            cols = [
                "run_id",
                "task",
                "started_at",
                "updated_at",
                "ended_at",
                "outcome",
                "last_step",
                "last_score",
                "signal",
            ]
            rows = db.execute(
                f"SELECT {', '.join(cols)} FROM runs ORDER BY updated_at DESC LIMIT ?", (limit,)
            )
            out = [dict(zip(cols, r, strict=True)) for r in rows]
            by_run: dict[str, list[tuple[Any, ...]]] = {r["run_id"]: [] for r in out}
            for run_id, *values in db.execute(
                f"SELECT run_id, {_TOTALS_COLUMNS} FROM progress WHERE run_id IN "
                f"(SELECT run_id FROM runs ORDER BY updated_at DESC LIMIT ?)",
                (limit,),
            ):
                if run_id in by_run:
                    by_run[run_id].append(tuple(values))
            for r in out:
                r["totals"] = stored_totals(by_run[r["run_id"]])
            return out

        return await self._run(read)

    async def history(
        self, query: HistoryQuery
    ) -> tuple[list[dict[str, Any]], tuple[float, str] | None]:
        """Ended runs matching `query`, most recently ended first, and the cursor of the next page
        (None: the last).

        A page is `query.limit` runs; the cursor is the last run's (ended_at, run_id), so paging is
        stable while runs keep ending (the newer ones are before the first page, not in the next).
        """

        def read(db: sqlite3.Connection) -> tuple[list[dict[str, Any]], tuple[float, str] | None]:
            family = (
                "COALESCE((SELECT json_extract(e.body, '$.family') FROM events e WHERE "
                "e.run_id = runs.run_id "
                "AND e.kind = 'start' ORDER BY e.seq LIMIT 1), runs.task)"
            )
            where, args = ["ended_at IS NOT NULL"], list[Any]()
            for column, value in (("outcome", query.outcome), ("signal", query.signal)):
                if value is not None:
                    where.append(f"{column} = ?")
                    args.append(value)
            if query.family is not None:
                where.append(f"{family} = ?")
                args.append(query.family)
            for key, value in query.labels:
                where.append(
                    "EXISTS (SELECT 1 FROM json_each(runs.labels) WHERE key = ? AND value = ?)"
                )
                args += [key, value]
            if query.since is not None:
                where.append("ended_at >= ?")
                args.append(query.since)
            if query.until is not None:
                where.append("ended_at < ?")
                args.append(query.until)
            if query.cursor is not None:
                where.append("(ended_at < ? OR (ended_at = ? AND run_id < ?))")
                args += [query.cursor[0], query.cursor[0], query.cursor[1]]
            cols = [
                "run_id",
                "task",
                "started_at",
                "ended_at",
                "outcome",
                "last_step",
                "last_score",
                "signal",
            ]
            rows = db.execute(
                f"SELECT {', '.join(cols)}, labels, {family} FROM runs WHERE {' AND '.join(where)} "
                "ORDER BY ended_at DESC, run_id DESC LIMIT ?",
                (*args, query.limit + 1),
            ).fetchall()
            out = []
            for r in rows[: query.limit]:
                run = dict(zip(cols, r[: len(cols)], strict=True))
                run["labels"] = json.loads(r[len(cols)] or "{}")
                run["family"] = r[len(cols) + 1]
                out.append(run)
            more = len(rows) > query.limit
            return out, (out[-1]["ended_at"], out[-1]["run_id"]) if more and out else None

        return await self._run(read)

    async def export(self, run_id: str) -> dict[str, Any] | None:
        """A run's task, steps (in index order, placeholders marked, images as digests) and score
        curve, or None."""

        def read(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(
                "SELECT task, started_at, ended_at, outcome, labels FROM runs WHERE run_id = ?",
                (run_id,),
            ).fetchone()
            if row is None:
                return None
            steps: dict[int, dict[str, Any]] = {}
            for seq, kind, index, body in db.execute(
                "SELECT seq, kind, step_index, body FROM events WHERE run_id = ? AND kind IN "
                "('step', 'gap', 'orphan', "
                "'amend') "
                "ORDER BY seq",
                (run_id,),
            ):
                data = json.loads(body)
                # the step's text replaced (journaled only for a step accepted before it)
                if kind == "amend":
                    if index in steps:
                        steps[index]["text"] = data.get("text", "")
                    continue
                if kind == "orphan":
                    # A step that came before the start, which placed it (dropped ones were
                    # deleted): its index, or the next position; a second one with the same index
                    # was refused there.
                    index = data.get("index") or max(steps, default=0) + 1
                    if index in steps:
                        continue
                elif kind == "gap":
                    # The steps given up on: below `upto` and not received by the time of the
                    # decision.
                    for i in range(1, int(data["upto"])):
                        steps.setdefault(
                            i,
                            {
                                "index": i,
                                "placeholder": True,
                                "text": None,
                                "ts": None,
                                "images": [],
                            },
                        )
                    continue
                digests = [
                    d
                    for (d,) in db.execute(
                        "SELECT digest FROM event_frames WHERE seq = ? ORDER BY position", (seq,)
                    )
                ]
                # a step journaled by agent-monitor 0.1 without an index: the next position
                if index is None:
                    index = max(steps, default=0) + 1
                steps[index] = {
                    "index": index,
                    "text": data.get("text", ""),
                    "ts": data.get("ts"),
                    "images": digests,
                }
            curve = [
                json.loads(b)
                for (b,) in db.execute(
                    "SELECT body FROM progress WHERE run_id = ? ORDER BY step", (run_id,)
                )
            ]
            totals = stored_totals([totals_row(p) for p in curve])
            first = db.execute(
                "SELECT body FROM events WHERE run_id = ? AND kind = 'start' ORDER BY seq LIMIT 1",
                (run_id,),
            ).fetchone()
            start = json.loads(first[0]) if first else {}
            return {
                "run_id": run_id,
                "task": row[0],
                # What the start asked for besides its task (never its `auth`: the run page shows
                # this).
                "group": start.get("group"),
                "family": start.get("family"),
                "policy": start.get("policy"),
                "started_at": row[1],
                "ended_at": row[2],
                "outcome": row[3],
                "labels": json.loads(row[4] or "{}"),
                "steps": [steps[i] for i in sorted(steps)],
                "curve": curve,
                # The rubric's pass / review / fail on the final score (a rubric with thresholds, a
                # run that ended scored).
                "verdict": curve[-1].get("verdict") if curve else None,
                "totals": totals,
            }

        return await self._run(read)

    async def aclose(self) -> None:
        """Finish every pending write, then close the database."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._writer.close)
        self._db.close()

    def statistics(self) -> SqliteStoreStatistics:
        """The writer thread's queue: writes waiting, and its bound."""
        return SqliteStoreStatistics(queue_depth=self._writer.depth, queue_max=self._writer.maxsize)


_KINDS = ("input", "cached_input", "output")
_TOTALS_COLUMNS = ", ".join(
    [f"json_extract(body, '$.totals.{k}')" for k in (*_KINDS, "cost")]
    + [f"json_extract(body, '$.tokens.{k}')" for k in _KINDS]
)
"""A stored score's totals (input, cached_input, output, cost), then its own tokens (input,
cached_input, output)."""


def totals_row(progress: dict[str, Any]) -> tuple[Any, ...]:
    """A stored score's `_TOTALS_COLUMNS`, read from its JSON form."""
    t, u = progress.get("totals") or {}, progress.get("tokens") or {}
    return (*(t.get(k) for k in _KINDS), t.get("cost"), *(u.get(k) for k in _KINDS))


def stored_totals(rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    """A run's totals from its stored scores (rows as `_TOTALS_COLUMNS`): the `run_totals` rule, and
    the last cost.

    Totals only grow, so the largest are the newest; scores stored before totals existed count their
    own tokens.
    """
    carried, summed = Usage(), Usage()
    cost: float | None = None
    for ti, tc, to, c, ui, uc, uo in rows:
        carried = carried.most(Usage(int(ti or 0), int(tc or 0), int(to or 0)))
        summed += Usage(int(ui or 0), int(uc or 0), int(uo or 0))
        if c is not None and (cost is None or c > cost):
            cost = float(c)
    t = carried.most(summed)
    return {
        "input": t.input_tokens,
        "cached_input": t.cached_input_tokens,
        "output": t.output_tokens,
        "cost": cost,
    }


def _insert(
    db: sqlite3.Connection,
    run_id: str,
    kind: str,
    index: int | None,
    body: str,
    at: float,
    d: Delivery | None,
) -> int:
    cur = db.execute(
        "INSERT INTO events (run_id, kind, step_index, body, received_at, mid, digest) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (run_id, kind, index, body, at, d.mid if d else None, d.digest if d else None),
    )
    assert cur.lastrowid is not None
    if d is not None:
        c = db.execute(
            "INSERT INTO deliveries (mid, digest, run_id) VALUES (?, ?, ?)",
            (d.mid, d.digest, run_id),
        )
        if c.lastrowid is not None and c.lastrowid % 1024 == 0:
            db.execute("DELETE FROM deliveries WHERE seq <= ?", (c.lastrowid - _DELIVERIES_KEPT,))
    return cur.lastrowid


def _finish(
    db: sqlite3.Connection, run_id: str, outcome: str, at: float, totals: dict[str, int]
) -> None:
    totals.pop(run_id, None)
    db.execute(
        "UPDATE runs SET ended_at = ?, outcome = ?, updated_at = ? WHERE run_id = ?",
        (at, outcome, at, run_id),
    )
    c = db.execute("INSERT INTO ended_log (run_id, at) VALUES (?, ?)", (run_id, at))
    if c.lastrowid is not None and c.lastrowid % 1024 == 0:
        db.execute("DELETE FROM ended_log WHERE seq <= ?", (c.lastrowid - _DELIVERIES_KEPT,))


def _drop_orphans(db: sqlite3.Connection, run_id: str) -> None:
    """Forget the steps (and end) held for a run id that never started."""
    if db.execute("SELECT 1 FROM runs WHERE run_id = ? AND ended_at IS NULL", (run_id,)).fetchone():
        return  # started meanwhile: its held steps belong to it now
    seqs = [
        s
        for (s,) in db.execute(
            "SELECT seq FROM events WHERE run_id = ? AND kind IN ('orphan', 'end')", (run_id,)
        )
    ]
    db.executemany("DELETE FROM event_frames WHERE seq = ?", [(s,) for s in seqs])
    db.executemany("DELETE FROM events WHERE seq = ?", [(s,) for s in seqs])


def _delete_run(db: sqlite3.Connection, run_id: str) -> None:
    for table in ("events", "event_frames", "progress", "runs"):
        db.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))


def _frames_by_seq(
    db: sqlite3.Connection, ended: set[str]
) -> dict[int, list[tuple[str | None, bytes | None]]]:
    out: dict[int, list[tuple[str | None, bytes | None]]] = {}
    rows = db.execute(
        "SELECT ef.seq, ef.run_id, ef.mime, ef.pruned, f.data FROM event_frames ef "
        "LEFT JOIN frames f ON f.digest = ef.digest ORDER BY ef.seq, ef.position"
    )
    for seq, run_id, mime, pruned, data in rows:
        if run_id not in ended:
            out.setdefault(seq, []).append((mime, None if pruned or data is None else bytes(data)))
    return out


def _record(
    run_id: str,
    kind: str,
    body: str,
    at: float,
    d: Delivery | None,
    frames: list[tuple[str | None, bytes | None]],
) -> Record:
    data = json.loads(body)
    if kind == "gap":
        return GapFilled(run_id, int(data["upto"]), at)
    if kind in ("start", "step", "orphan"):
        data["images"] = [
            {
                "data": base64.b64encode(raw if raw is not None else PLACEHOLDER_PNG).decode(
                    "ascii"
                ),
                "mime": mime if raw else None,
            }
            for mime, raw in frames
        ]
    return event_record(kind, run_id, data, at, d, where="the run store")


def _check_format(db: sqlite3.Connection, path: Path) -> None:
    """Refuse a newer format; migrate format 1 (its live runs closed as "migrated")."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    has_events = (
        db.execute("SELECT 1 FROM sqlite_master WHERE name = 'events'").fetchone() is not None
    )
    if version > _SCHEMA_VERSION:
        raise StoreFormatError(
            f"the run store {path} was written by a newer agent-monitor (format {version}); "
            "upgrade, or pass another --state-dir"
        )
    if has_events and version < _SCHEMA_VERSION:
        # Format 1 journaled raw events (including refused ones) and no gap decisions: replaying it
        # could not rebuild the state exactly. Its ended runs stay readable (runs / export); its
        # live runs are closed with outcome "migrated" rather than resumed wrongly.
        db.execute("ALTER TABLE events ADD COLUMN mid INTEGER")
        db.execute("ALTER TABLE events ADD COLUMN digest TEXT")
        now = time.time()
        n = db.execute(
            "UPDATE runs SET ended_at = ?, outcome = 'migrated' WHERE ended_at IS NULL", (now,)
        ).rowcount
        # steps of runs never started
        db.execute("DELETE FROM events WHERE run_id NOT IN (SELECT run_id FROM runs)")
        log.warning("store_migrated", path=str(path), closed_live_runs=n)


Job = tuple[Callable[[sqlite3.Connection], Any], concurrent.futures.Future[Any]]


class _Writer:
    """The store's writer thread: every statement runs there, in submission order, in group commits.

    Its queue is bounded (`maxsize` writes): when it is full, submitting waits until the thread took
    a group (back-pressure on whoever writes, the event loop included, rather than memory without
    bound).
    """

    def __init__(
        self,
        db: sqlite3.Connection,
        *,
        commit: Callable[[sqlite3.Connection], None],
        on_failed: Callable[[], None],
        maxsize: int,
    ) -> None:
        if maxsize < 1:
            raise ValueError(
                f"the run store's queue needs room for at least one write, got max_queue={maxsize}"
            )
        self.db = db
        self.commit = commit
        self.on_failed = on_failed
        self.maxsize = maxsize
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._loop, name="run-store-writer", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Writes waiting for the thread."""
        return self._jobs.qsize()

    def put(
        self, fn: Callable[[sqlite3.Connection], Any], fut: concurrent.futures.Future[Any]
    ) -> None:
        """Queue one write (waits while the queue is full: the overflow policy is back-pressure)."""
        self._jobs.put((fn, fut))

    def close(self) -> None:
        """Finish every queued write, then stop the thread (blocking: run it in a worker thread)."""
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        # Group commit: every write waiting when the thread gets to it shares one transaction (one
        # WAL commit), each inside its own savepoint so one failing write fails alone. Futures
        # resolve only after COMMIT.
        stop = False
        while not stop:
            job = self._jobs.get()
            if job is None:
                break
            group = [job]
            while len(group) < _GROUP_MAX:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                group.append(nxt)
            self._run_group(group)

    def _run_group(self, group: list[Job]) -> None:
        db = self.db
        done: list[tuple[concurrent.futures.Future[Any], Any]] = []
        failed: list[tuple[concurrent.futures.Future[Any], BaseException]] = []
        try:
            db.execute("BEGIN IMMEDIATE")
        except BaseException as e:
            for _, fut in group:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(e)
            return
        for fn, fut in group:
            if not fut.set_running_or_notify_cancel():
                continue
            db.execute("SAVEPOINT job")
            try:
                result = fn(db)
            except BaseException as e:
                failed.append((fut, e))
                if db.in_transaction:
                    db.execute("ROLLBACK TO job")
                    db.execute("RELEASE job")
                # SQLite rolled the whole transaction back (e.g. a full disk): the writes before it
                # are gone too
                else:
                    failed.extend((f, e) for f, _ in done)
                    done.clear()
                    db.execute("BEGIN IMMEDIATE")
            else:
                db.execute("RELEASE job")
                done.append((fut, result))
        try:
            self.commit(db)
        except BaseException as e:
            if db.in_transaction:
                db.execute("ROLLBACK")
            failed.extend((f, e) for f, _ in done)
            done.clear()
        if failed:
            # the store's caches of what is committed: a rolled-back write may have moved them
            self.on_failed()
        for fut, result in done:
            fut.set_result(result)
        for fut, error in failed:
            fut.set_exception(error)


class MemoryStore:
    """The run store in memory: the same records and semantics as SqliteStore, for tests and
    embedding."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.progress: dict[str, dict[int, dict[str, Any]]] = {}
        self.ended: dict[str, float] = {}
        self.ended_log: collections.deque[tuple[str, float | None]] = collections.deque(
            maxlen=_DELIVERIES_KEPT
        )
        self.deliveries: collections.deque[tuple[int, str, str]] = collections.deque(
            maxlen=_DELIVERIES_KEPT
        )
        self.calibration: dict[tuple[Family, str], Sample] = {}
        """Calibration samples by (family, run id), oldest first."""
        self.group_rankings: dict[str, dict[str, Any]] = {}
        """Each group's last published ranking, by group."""

    async def journal(self, record: Record) -> None:
        """Keep one record."""
        run_id = record.run_id
        if isinstance(record, Finished):
            self.ended.pop(run_id, None)
            self.ended[run_id] = record.at
            self.ended_log.append((run_id, record.at))
            self.records = [r for r in self.records if r.run_id != run_id]
            return
        if isinstance(record, OrphansDropped):
            if not any(isinstance(r, Started) and r.run_id == run_id for r in self.records):
                self.records = [r for r in self.records if r.run_id != run_id]
            return
        delivery = getattr(record, "delivery", None)
        if delivery is not None:
            self.deliveries.append((delivery.mid, delivery.digest, run_id))
        if not isinstance(record, (Stepped, Amended)) and self.ended.pop(run_id, None) is not None:
            self.progress.pop(run_id, None)  # a run id used again after its run ended: a new run
            self.ended_log.append((run_id, None))
        self.records.append(record)

    async def journal_batch(self, records: Sequence[Record]) -> None:
        """Keep records, in order."""
        for r in records:
            await self.journal(r)

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Keep a score."""
        self.progress.setdefault(run_id, {})[step] = data

    async def replay(self) -> Replay:
        """The records of runs not finished, in journal order."""
        live = {r.run_id for r in self.records}
        return Replay(
            records=list(self.records),
            progress={
                rid: [p[s] for s in sorted(p)] for rid, p in self.progress.items() if rid in live
            },
            ended=list(self.ended_log),
            deliveries=list(self.deliveries),
        )

    def record_sample(self, sample: Sample, keep: int, total: int) -> None:
        """Keep a calibration sample: its family's `keep` most recent, `total` in all."""
        if (sample.family, sample.run_id) in self.calibration:
            return
        self.calibration[(sample.family, sample.run_id)] = sample
        mine = [k for k in self.calibration if k[0] == sample.family]
        for k in mine[: max(0, len(mine) - keep)]:
            del self.calibration[k]
        while len(self.calibration) > total:
            del self.calibration[next(iter(self.calibration))]

    async def samples(self) -> list[Sample]:
        """Every calibration sample kept, oldest first."""
        return list(self.calibration.values())

    async def reset_family(self, name: str) -> int:
        """Forget the calibration samples of every family called `name`; how many."""
        gone = [k for k in self.calibration if k[0].name == name]
        for k in gone:
            del self.calibration[k]
        return len(gone)

    def record_ranking(self, group: str, ranking: Mapping[str, Any] | None) -> None:
        """Keep a group's published ranking; None forgets it."""
        self.group_rankings.pop(group, None)
        if ranking is not None:
            # a copy, as a database would keep
            self.group_rankings[group] = json.loads(json.dumps(ranking))

    async def rankings(self) -> dict[str, dict[str, Any]]:
        """Every group's last published ranking not cleared."""
        return dict(self.group_rankings)

    async def aclose(self) -> None:
        """Nothing to release."""


class NoStore:
    """No run store: nothing is journaled and a restart forgets every run (a Monitor given no
    store)."""

    async def journal(self, record: Record) -> None:
        """Keep nothing."""

    async def journal_batch(self, records: Sequence[Record]) -> None:
        """Keep nothing."""

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Keep nothing."""

    async def replay(self) -> Replay:
        """Nothing to replay."""
        return Replay()

    def record_sample(self, sample: Sample, keep: int, total: int) -> None:
        """Keep nothing (calibration lives in memory until the daemon stops)."""

    async def samples(self) -> list[Sample]:
        """No samples kept."""
        return []

    async def reset_family(self, name: str) -> int:
        """Nothing to forget."""
        return 0

    def record_ranking(self, group: str, ranking: Mapping[str, Any] | None) -> None:
        """Keep nothing."""

    async def rankings(self) -> dict[str, dict[str, Any]]:
        """No rankings kept."""
        return {}

    async def aclose(self) -> None:
        """Nothing to release."""
