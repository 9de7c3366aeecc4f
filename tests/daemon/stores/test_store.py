"""The run store: journal, de-duplication, frames by digest and budget, retention; a monitor
rebuilt from it."""

from __future__ import annotations

import base64
import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from agent_monitor.calibration import Family, Point, Sample
from agent_monitor.daemon import Duplicated, Monitor, MonitorConfig, Refused
from agent_monitor.daemon.runs import RunBook
from agent_monitor.daemon.sinks import Message
from agent_monitor.daemon.stores import Ended, Finished, Orphaned, Started, Stepped
from agent_monitor.daemon.stores._store import PLACEHOLDER_PNG, MemoryStore, NoStore, SqliteStore
from agent_monitor.images import FrameBudget
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import RunEnd, RunStart, StepIn, decode_event


def png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def ev(topic: str, **payload: Any) -> tuple[str, Any]:
    return decode_event(topic, json.dumps(payload))


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


async def journal_events(
    store: SqliteStore, events: list[tuple[str, dict[str, Any]]], now: float = 1000.0
) -> None:
    """What the daemon journals for these events: the run state decides, refusals and duplicates
    are not journaled."""
    book = RunBook()
    for topic, payload in events:
        run_id, event = ev(topic, **payload)
        verdict = book.decide(run_id, event, now)
        if isinstance(verdict, (Refused, Duplicated)):
            continue
        await store.journal(verdict)
        book.apply(verdict)


def drained(mon: Monitor) -> list[Message]:
    out = []
    while (m := mon.outbox.get_nowait()) is not None:
        out.append(m)
    return out


async def test_journal_dedupes_steps_and_rebuilds_events_in_order(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    try:
        await journal_events(
            store,
            [
                ("agents/r/start", {"task": "t", "labels": {"group": "g"}}),
                ("agents/r/step", {"index": 2, "text": "two"}),
                ("agents/r/step", {"index": 1, "text": "one"}),
                ("agents/r/step", {"index": 1, "text": "one again"}),
                ("agents/q/step", {"index": 1, "text": "orphan"}),
            ],
        )
        records = (await store.replay()).records
        r = [rec for rec in records if rec.run_id == "r"]
        assert [type(rec).__name__ for rec in r] == ["Started", "Stepped", "Stepped"]
        assert [rec.step.text for rec in r if isinstance(rec, Stepped)] == [
            "two",
            "one",
        ]  # the re-delivery was not kept
        (q,) = [rec for rec in records if rec.run_id == "q"]
        assert isinstance(q, Orphaned) and q.step.text == "orphan"
        exported = await store.export("r")
        assert exported is not None and [s["text"] for s in exported["steps"]] == ["one", "two"]
        assert exported["labels"] == {"group": "g"}
    finally:
        await store.aclose()


async def test_frames_stored_once_per_digest_and_pruned_by_budget(tmp_path: Path) -> None:
    store = SqliteStore(
        tmp_path / "s.db", frame_budget=FrameBudget(every=2, recent=1, per_stride=2)
    )
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    try:
        _, start = ev("agents/r/start", task="t", images=[{"data": base64.b64encode(red).decode()}])
        await store.journal(Started("r", start, 1000.0))
        frames = [red, blue, blue, red, blue]  # 5 step frames; ordinals 0..4
        for i, f in enumerate(frames, 1):
            await store.journal(
                Stepped(
                    "r",
                    StepIn.model_validate(
                        {
                            "index": i,
                            "text": f"s{i}",
                            "images": [{"data": base64.b64encode(f).decode()}],
                        }
                    ),
                    1000.0 + i,
                )
            )
        db = sqlite3.connect(tmp_path / "s.db")
        # red and blue, once each
        assert db.execute("SELECT COUNT(*) FROM frames").fetchone()[0] == 2
        pruned = [
            o
            for (o,) in db.execute(
                "SELECT ordinal FROM event_frames WHERE pruned = 1 ORDER BY ordinal"
            )
        ]
        # not anchors (0, 2 at stride 2; 4 at stride 4 from frame 4) and not the newest (4)
        assert pruned == [1, 3]
        first, *steps = (await store.replay()).records
        assert isinstance(first, Started) and all(isinstance(r, Stepped) for r in steps)
        step_images = [r.step.images[0].decoded() for r in steps if isinstance(r, Stepped)]
        assert step_images == [red, PLACEHOLDER_PNG, blue, PLACEHOLDER_PNG, blue]
        assert first.start.images[0].decoded() == red  # task images are never pruned
    finally:
        await store.aclose()


async def test_retention_deletes_ended_runs_and_unreferenced_frames(tmp_path: Path) -> None:
    clock = {"t": 1000.0}
    store = SqliteStore(tmp_path / "s.db", clock=lambda: clock["t"])
    try:
        for rid in ("old", "new"):
            _, start = ev(
                f"agents/{rid}/start", task=rid, images=[base64.b64encode(png((1, 2, 3))).decode()]
            )
            await store.journal(Started(rid, start, clock["t"]))
        store.record_progress("old", 1, {"step": 1, "score": 0.5, "ok": True})
        await store.journal(Finished("old", "success", clock["t"]))
        clock["t"] += 100
        await store.journal(Finished("new", "failure", clock["t"]))
        assert await store.prune(older_than_s=50) == 1
        assert [r["run_id"] for r in await store.list_runs()] == ["new"]
        assert await store.export("old") is None
        clock["t"] += 1
        store.record_sample(sample("old", "fam"), keep=10, total=100)
        assert await store.prune(older_than_s=0) == 1
        db = sqlite3.connect(tmp_path / "s.db")
        assert db.execute("SELECT COUNT(*) FROM frames").fetchone()[0] == 0
        # Calibration samples are the evidence thresholds rest on, not run records: retention leaves
        # them.
        assert [s.run_id for s in await store.samples()] == ["old"]
    finally:
        await store.aclose()


def sample(
    run_id: str, family: str, *, model: str = "m", success: bool = True, at: float = 0.0
) -> Sample:
    curve = (Point(1, 0.5, 0.1), Point(2, None, None), Point(3, 0.75, 0.0))
    return Sample(
        run_id,
        Family(family, model, "r"),
        success,
        curve,
        outcome="success" if success else 0.1,
        at=at,
    )


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_calibration_samples_are_kept_once_bounded_per_family_and_reset_by_name(
    tmp_path: Path, kind: str
) -> None:
    store = SqliteStore(tmp_path / "s.db") if kind == "sqlite" else MemoryStore()
    try:
        for i in range(5):
            store.record_sample(sample(f"a{i}", "fam", at=float(i)), keep=3, total=100)
        store.record_sample(
            sample("a4", "fam", success=False), keep=3, total=100
        )  # counted already: the first one stays
        store.record_sample(
            sample("b0", "fam", model="other"), keep=3, total=100
        )  # another judge model: its own window
        store.record_sample(sample("c0", "docs", success=False), keep=3, total=100)
        got = await store.samples()
        assert [(s.family.name, s.family.model, s.run_id) for s in got] == [
            ("fam", "m", "a2"),
            ("fam", "m", "a3"),
            ("fam", "m", "a4"),
            ("fam", "other", "b0"),
            ("docs", "m", "c0"),
        ]
        # the whole sample comes back: curve, outcome, time
        assert got[2] == sample("a4", "fam", at=4.0)
        assert got[4].outcome == 0.1 and got[4].success is False
        assert await store.reset_family("fam") == 4
        assert [s.run_id for s in await store.samples()] == ["c0"]
        assert await store.reset_family("fam") == 0
        # Families come from the network: over the total, the oldest samples go, whatever their
        # family.
        for i in range(4):
            store.record_sample(sample(f"x{i}", f"f{i}"), keep=3, total=3)
        assert [s.run_id for s in await store.samples()] == ["x1", "x2", "x3"]
    finally:
        await store.aclose()


async def test_no_store_keeps_no_samples() -> None:
    store = NoStore()
    store.record_sample(sample("a", "fam"), keep=3, total=100)
    assert await store.samples() == [] and await store.reset_family("fam") == 0


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_monitor_rebuilds_runs_from_the_store_without_rescoring(
    tmp_path: Path, kind: str
) -> None:
    def make() -> Any:
        return SqliteStore(tmp_path / "s.db") if kind == "sqlite" else memory

    memory = MemoryStore()
    judge = FakeJudge(lambda p: "B" if "bad" in p.prefix_text() else "K")
    policy = Policy(abort_below=0.2, min_steps=1, patience=2)
    store = make()
    async with Monitor(MonitorConfig(policy=policy), judge=judge, store=store) as mon:
        for rid, task in (("good", "good task"), ("bad", "bad task")):
            await mon.handle(f"agents/{rid}/start", j(task=task))
            for i in range(1, 4):
                await mon.handle(f"agents/{rid}/step", j(index=i, text=f"{rid} {i}"))
                await mon.drain()
        await mon.handle("agents/good/step", j(index=5, text="good 5 (4 is missing)"))
        assert [m for m in drained(mon) if m.topic == "agents/bad/signal"]  # aborted at step 2
    await store.aclose()
    calls = len(judge.prompts)

    store = make()
    async with Monitor(MonitorConfig(policy=policy), judge=judge, store=store) as mon:
        await mon.drain()
        assert len(judge.prompts) == calls  # nothing scored again
        good, bad, bad_tracker = mon.run("good"), mon.run("bad"), mon.tracker("bad")
        assert good is not None and bad is not None and bad_tracker is not None
        assert [s.text for s in good.steps] == ["good 1", "good 2", "good 3"]
        assert list(good.held) == [5] and good.scored == 3
        assert [p.step for p in good.curve] == [1, 2, 3] and good.last_ok is not None
        assert bad.signal == "abort" and bad_tracker.policy_state is not None
        assert bad_tracker.policy_state.signal == "abort"
        # Replaying publishes no duplicate progress and no errors; only the run's current signal is
        # published again (retained, the same decision: it may have been lost with the crash).
        replayed = drained(mon)
        assert [m.topic for m in replayed] == ["agents/bad/signal"]
        assert replayed[0].retain and json.loads(replayed[0].payload)["signal"] == "abort"
        # The run goes on where it was: the missing step arrives, then 4 and 5 are scored together.
        await mon.handle("agents/good/step", j(index=4, text="good 4"))
        await mon.handle("agents/bad/step", j(index=4, text="bad 4"))
        await mon.drain()
        progress = [json.loads(m.payload) for m in drained(mon) if m.topic.endswith("/progress")]
        assert [(p["run_id"], p["step"], p["coalesced"]) for p in progress] == [("good", 5, 2)]
        assert len(judge.prompts) == calls + 1  # the aborted run is not judged again
        await mon.handle("agents/good/end", j(outcome="success"))
        await mon.drain()
    await store.aclose()

    store = make()
    async with Monitor(judge=judge, store=store) as mon:
        assert set(mon.book.live) == {"bad"}  # an ended run is not rebuilt
    await store.aclose()


async def test_a_run_id_reused_after_its_end_is_a_new_run(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    try:
        await store.journal(Started("r", RunStart.model_validate({"task": "first"}), 1000.0))
        await store.journal(Stepped("r", StepIn.model_validate({"index": 1, "text": "a"}), 1001.0))
        await store.journal(Ended("r", RunEnd.model_validate({}), 1002.0))
        await store.journal(Finished("r", "unknown", 1002.0))
        await store.journal(Started("r", RunStart.model_validate({"task": "second"}), 1003.0))
        # Step 1 of the new run is journaled (not refused as step 1 of the old run already stored).
        await store.journal(Stepped("r", StepIn.model_validate({"index": 1, "text": "b"}), 1004.0))
        replay = await store.replay()
        first, *steps = replay.records
        assert isinstance(first, Started) and first.start.task == "second"
        assert [r.step.text for r in steps if isinstance(r, Stepped)] == ["b"] and len(steps) == 1
        assert replay.ended == [("r", 1002.0), ("r", None)]  # ended, then used again
        book = RunBook()
        book.remember_ended(replay.ended)
        assert "r" not in book.ended
    finally:
        await store.aclose()
