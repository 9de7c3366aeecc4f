"""Run stores: the journal of accepted events and the scores, so a restarted daemon resumes every live run.

`SqliteStore` (the default, one WAL file under `--state-dir`) journals each decoded event
before the daemon acknowledges it to the broker: a crash between receipt and journal loses
nothing, because the broker redelivers what was not acknowledged. A run's state is a fold of
its journaled events, so it is rebuilt by replaying them; scores are stored too, so steps
already scored are not judged again. `MemoryStore` keeps the same records in memory (tests,
embedding). Images are stored once per digest; frames the frame budget will never show again
are pruned (replayed as a 1x1 placeholder, keeping the run's frame numbering and so its prompt
prefix). Nothing here assumes it is the only writer of a run except the step de-duplication.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import json
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog

from .events import InputEvent, RunEnd, RunStart, StepIn
from .images import FrameBudget

log = structlog.get_logger("agent_monitor.store")

T = TypeVar("T")

# A valid 1x1 PNG: what a pruned frame is replayed as (never shown to the judge by then).
PLACEHOLDER_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


@dataclass(slots=True)
class StoredRun:
    """A live run as the store has it: its events in arrival order and its stored scores."""

    run_id: str
    events: list[InputEvent] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)


class RunStore(Protocol):
    """Where runs are journaled: the narrow seam between the daemon and durable state."""

    async def journal(self, run_id: str, event: InputEvent) -> bool:
        """Record an event durably before it is acknowledged; False for a step index already journaled."""
        ...

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Record a published score (written in order, without waiting)."""
        ...

    def record_end(self, run_id: str, outcome: str) -> None:
        """Mark a run ended (or expired/evicted): it is no longer rebuilt."""
        ...

    async def live_runs(self) -> list[StoredRun]:
        """Every run not ended, with its events in arrival order and its scores in step order."""
        ...

    async def aclose(self) -> None:
        """Finish pending writes and close."""
        ...


def default_state_dir() -> Path:
    """A per-user data directory ($XDG_DATA_HOME/agent-monitor, else ~/.local/share/agent-monitor)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agent-monitor"


_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, task TEXT, started_at REAL, updated_at REAL, ended_at REAL, outcome TEXT,
    last_step INTEGER, last_score REAL, signal TEXT, labels TEXT
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, kind TEXT NOT NULL,
    step_index INTEGER, body TEXT NOT NULL, received_at REAL NOT NULL
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
"""


class SqliteStore:
    """The embedded run store: one SQLite file in WAL mode, written by one thread in arrival order.

    `synchronous=NORMAL` in WAL mode survives a crash of the process (the case here: SIGKILL, OOM)
    without an fsync per event; pass `fsync=True` to survive power loss too, at a cost per event.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        frame_budget: FrameBudget | None = None,
        fsync: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.budget = frame_budget or FrameBudget()
        self.clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[sqlite3.Connection], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self._db.execute("PRAGMA foreign_keys=OFF")
        self._db.executescript(_SCHEMA)
        self._frames_total: dict[str, int] = {}
        self._thread = threading.Thread(target=self._writer, name="run-store-writer", daemon=True)
        self._thread.start()
        self._closed = False

    # -- the writer thread: every statement runs here, in submission order --

    def _writer(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                self._db.execute("BEGIN IMMEDIATE")
                result = fn(self._db)
                self._db.execute("COMMIT")
            except BaseException as e:
                self._db.execute("ROLLBACK")
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def _submit(self, fn: Callable[[sqlite3.Connection], T]) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("the run store is closed")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def _background(self, fn: Callable[[sqlite3.Connection], Any], what: str) -> None:
        def done(f: concurrent.futures.Future[Any]) -> None:
            if f.exception() is not None:
                log.error("store_write_failed", what=what, error=str(f.exception()))

        self._submit(fn).add_done_callback(done)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.wrap_future(self._submit(fn))

    # -- writes --

    async def journal(self, run_id: str, event: InputEvent) -> bool:
        """Record an event (images once per digest) and wait until it is committed."""
        kind = "start" if isinstance(event, RunStart) else "step" if isinstance(event, StepIn) else "end"
        body = event.model_dump_json(exclude={"images"} if not isinstance(event, RunEnd) else None)
        images = [(hashlib.sha256(i.decoded()).hexdigest(), i.mime, i.decoded()) for i in getattr(event, "images", [])]
        index = event.index if isinstance(event, StepIn) else None
        now = self.clock()
        budget = self.budget

        def write(db: sqlite3.Connection) -> bool:
            if (
                kind == "start"
                and db.execute("SELECT 1 FROM runs WHERE run_id = ? AND ended_at IS NOT NULL", (run_id,)).fetchone()
            ):
                _delete_run(db, run_id)  # a run id used again after its run ended: a new run
                self._frames_total.pop(run_id, None)
            try:
                cur = db.execute(
                    "INSERT INTO events (run_id, kind, step_index, body, received_at) VALUES (?, ?, ?, ?, ?)",
                    (run_id, kind, index, body, now),
                )
            except sqlite3.IntegrityError:
                return False  # a re-delivered step: journaled once
            seq = cur.lastrowid
            if kind == "start":
                db.execute(
                    "INSERT INTO runs (run_id, task, started_at, updated_at, labels) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT (run_id) DO UPDATE SET task = excluded.task, started_at = excluded.started_at, "
                    "updated_at = excluded.updated_at, ended_at = NULL, outcome = NULL, labels = excluded.labels",
                    (run_id, event.task, now, now, json.dumps(event.labels)),  # type: ignore[union-attr]
                )
            total = self._frame_count(db, run_id) if kind == "step" else None
            for pos, (digest, mime, data) in enumerate(images):
                db.execute("INSERT OR IGNORE INTO frames (digest, data) VALUES (?, ?)", (digest, data))
                ordinal = None if total is None else total + pos
                db.execute(
                    "INSERT INTO event_frames (seq, position, run_id, ordinal, digest, mime) VALUES (?, ?, ?, ?, ?, ?)",
                    (seq, pos, run_id, ordinal, digest, mime),
                )
            if total is not None and images:
                total += len(images)
                self._frames_total[run_id] = total
                # Frames the budget will never show again: neither anchors nor among the newest `recent`.
                db.execute(
                    "UPDATE event_frames SET pruned = 1 WHERE run_id = ? AND pruned = 0 AND ordinal IS NOT NULL "
                    "AND ordinal < ? AND (ordinal % ? != 0 OR ordinal / ? >= ?)",
                    (run_id, total - budget.recent, budget.every, budget.every, budget.max_frames),
                )
            return True

        return await self._run(write)

    def _frame_count(self, db: sqlite3.Connection, run_id: str) -> int:
        if run_id not in self._frames_total:
            row = db.execute(
                "SELECT COALESCE(MAX(ordinal) + 1, 0) FROM event_frames WHERE run_id = ? AND ordinal IS NOT NULL",
                (run_id,),
            ).fetchone()
            self._frames_total[run_id] = int(row[0])
        return self._frames_total[run_id]

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Record a score and the run's summary (in the background, in order)."""
        body, now = json.dumps(data), self.clock()

        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT OR REPLACE INTO progress (run_id, step, body, at) VALUES (?, ?, ?, ?)",
                (run_id, step, body, now),
            )
            db.execute(
                "UPDATE runs SET updated_at = ?, last_step = ?, last_score = COALESCE(?, last_score), "
                "signal = COALESCE(?, signal) WHERE run_id = ?",
                (now, step, data.get("score"), data.get("signal"), run_id),
            )

        self._background(write, "progress")

    def record_end(self, run_id: str, outcome: str) -> None:
        """Mark the run ended; its records stay until `prune`."""
        now = self.clock()
        self._frames_total.pop(run_id, None)
        self._background(
            lambda db: db.execute(
                "UPDATE runs SET ended_at = ?, outcome = ?, updated_at = ? WHERE run_id = ?",
                (now, outcome, now, run_id),
            ),
            "end",
        )

    async def prune(self, older_than_s: float) -> int:
        """Delete runs that ended more than `older_than_s` ago, and frames nothing live refers to; return runs deleted."""
        cutoff = self.clock() - older_than_s

        def write(db: sqlite3.Connection) -> int:
            ids = [
                r[0]
                for r in db.execute("SELECT run_id FROM runs WHERE ended_at IS NOT NULL AND ended_at < ?", (cutoff,))
            ]
            for rid in ids:
                _delete_run(db, rid)
            db.execute("DELETE FROM frames WHERE digest NOT IN (SELECT digest FROM event_frames WHERE pruned = 0)")
            return len(ids)

        return await self._run(write)

    # -- reads --

    async def live_runs(self) -> list[StoredRun]:
        """Every run that has not ended (and steps of runs never started), events in arrival order."""

        def read(db: sqlite3.Connection) -> list[StoredRun]:
            ended = {r[0] for r in db.execute("SELECT run_id FROM runs WHERE ended_at IS NOT NULL")}
            runs: dict[str, StoredRun] = {}
            frames = _frames_by_seq(db, ended)
            for seq, run_id, kind, body in db.execute("SELECT seq, run_id, kind, body FROM events ORDER BY seq"):
                if run_id in ended:
                    continue
                run = runs.setdefault(run_id, StoredRun(run_id))
                run.events.append(_event(kind, body, frames.get(seq, [])))
            for run_id, body in db.execute("SELECT run_id, body FROM progress ORDER BY run_id, step"):
                if run_id in runs:
                    runs[run_id].progress.append(json.loads(body))
            return list(runs.values())

        return await self._run(read)

    async def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        """Live and recent runs, newest first: id, task, times, outcome, last step, score and signal."""

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
            rows = db.execute(f"SELECT {', '.join(cols)} FROM runs ORDER BY updated_at DESC LIMIT ?", (limit,))
            return [dict(zip(cols, r, strict=True)) for r in rows]

        return await self._run(read)

    async def export(self, run_id: str) -> dict[str, Any] | None:
        """A run's task, steps (once each, in order, images as digests) and score curve, or None."""

        def read(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(
                "SELECT task, started_at, ended_at, outcome, labels FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            if row is None:
                return None
            steps: dict[int, dict[str, Any]] = {}
            nxt = 1
            for seq, body in db.execute(
                "SELECT seq, body FROM events WHERE run_id = ? AND kind = 'step' ORDER BY seq", (run_id,)
            ):
                data = json.loads(body)
                index = data.get("index") or max(nxt, max(steps, default=0) + 1)
                nxt = max(nxt, index + 1)
                digests = [
                    d for (d,) in db.execute("SELECT digest FROM event_frames WHERE seq = ? ORDER BY position", (seq,))
                ]
                steps.setdefault(
                    index, {"index": index, "text": data.get("text", ""), "ts": data.get("ts"), "images": digests}
                )
            curve = [
                json.loads(b)
                for (b,) in db.execute("SELECT body FROM progress WHERE run_id = ? ORDER BY step", (run_id,))
            ]
            return {
                "run_id": run_id,
                "task": row[0],
                "started_at": row[1],
                "ended_at": row[2],
                "outcome": row[3],
                "labels": json.loads(row[4] or "{}"),
                "steps": [steps[i] for i in sorted(steps)],
                "curve": curve,
            }

        return await self._run(read)

    async def aclose(self) -> None:
        """Finish every pending write, then close the database."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join)
        self._db.close()


def _delete_run(db: sqlite3.Connection, run_id: str) -> None:
    for table in ("events", "event_frames", "progress", "runs"):
        db.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))


def _frames_by_seq(db: sqlite3.Connection, ended: set[str]) -> dict[int, list[tuple[str | None, bytes | None]]]:
    out: dict[int, list[tuple[str | None, bytes | None]]] = {}
    rows = db.execute(
        "SELECT ef.seq, ef.run_id, ef.mime, ef.pruned, f.data FROM event_frames ef "
        "LEFT JOIN frames f ON f.digest = ef.digest ORDER BY ef.seq, ef.position"
    )
    for seq, run_id, mime, pruned, data in rows:
        if run_id not in ended:
            out.setdefault(seq, []).append((mime, None if pruned or data is None else bytes(data)))
    return out


def _event(kind: str, body: str, frames: Iterable[tuple[str | None, bytes | None]]) -> InputEvent:
    data = json.loads(body)
    if kind in ("start", "step"):
        data["images"] = [
            {
                "data": base64.b64encode(d if d is not None else PLACEHOLDER_PNG).decode("ascii"),
                "mime": m if d else None,
            }
            for m, d in frames
        ]
    # Validated again on the way in: a store written by an older version must still make sense.
    ctx = {"max_image_bytes": 1 << 40}
    if kind == "start":
        return RunStart.model_validate(data, context=ctx)
    if kind == "step":
        return StepIn.model_validate(data, context=ctx)
    return RunEnd.model_validate(data, context=ctx)


class MemoryStore:
    """The run store in memory: the same records and semantics as SqliteStore, for tests and the hook."""

    def __init__(self) -> None:
        self.events: list[tuple[str, InputEvent]] = []
        self.progress: dict[str, dict[int, dict[str, Any]]] = {}
        self.ended: dict[str, str] = {}
        self._steps: set[tuple[str, int]] = set()

    async def journal(self, run_id: str, event: InputEvent) -> bool:
        """Record an event; False for a step index already recorded."""
        if isinstance(event, StepIn) and event.index is not None:
            if (run_id, event.index) in self._steps:
                return False
            self._steps.add((run_id, event.index))
        if isinstance(event, RunStart):
            self.ended.pop(run_id, None)
        self.events.append((run_id, event))
        return True

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Record a score."""
        self.progress.setdefault(run_id, {})[step] = data

    def record_end(self, run_id: str, outcome: str) -> None:
        """Mark a run ended."""
        self.ended[run_id] = outcome

    async def live_runs(self) -> list[StoredRun]:
        """Runs not ended, events in arrival order."""
        runs: dict[str, StoredRun] = {}
        for run_id, event in self.events:
            if run_id not in self.ended:
                runs.setdefault(run_id, StoredRun(run_id)).events.append(event)
        for run_id, run in runs.items():
            run.progress = [self.progress[run_id][s] for s in sorted(self.progress.get(run_id, {}))]
        return list(runs.values())

    async def aclose(self) -> None:
        """Nothing to release."""
