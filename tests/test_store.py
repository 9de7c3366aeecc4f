"""The run store: journal, de-duplication, frames by digest and budget, retention; a monitor rebuilt from it."""

from __future__ import annotations

import base64
import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from agent_monitor.daemon import Monitor
from agent_monitor.events import RunEnd, RunStart, StepIn, decode_event
from agent_monitor.images import FrameBudget
from agent_monitor.outbox import Message
from agent_monitor.policy import Policy
from agent_monitor.store import PLACEHOLDER_PNG, MemoryStore, SqliteStore
from tests.fakes import ScriptedJudge


def png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def ev(topic: str, **payload: Any) -> tuple[str, Any]:
    return decode_event(topic, json.dumps(payload))


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def drained(mon: Monitor) -> list[Message]:
    out = []
    while (m := mon.outbox.get_nowait()) is not None:
        out.append(m)
    return out


async def test_journal_dedupes_steps_and_rebuilds_events_in_order(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    try:
        for topic, payload in [
            ("agents/r/start", {"task": "t", "labels": {"group": "g"}}),
            ("agents/r/step", {"index": 2, "text": "two"}),
            ("agents/r/step", {"index": 1, "text": "one"}),
            ("agents/r/step", {"index": 1, "text": "one again"}),
            ("agents/q/step", {"index": 1, "text": "orphan"}),
        ]:
            run_id, event = ev(topic, **payload)
            await store.journal(run_id, event)
        runs = {r.run_id: r for r in await store.live_runs()}
        assert [type(e).__name__ for e in runs["r"].events] == ["RunStart", "StepIn", "StepIn"]
        assert [e.text for e in runs["r"].events[1:]] == ["two", "one"]  # the re-delivery was not kept
        assert runs["q"].events[0].text == "orphan"
        exported = await store.export("r")
        assert exported is not None and [s["text"] for s in exported["steps"]] == ["one", "two"]
        assert exported["labels"] == {"group": "g"}
    finally:
        await store.aclose()


async def test_frames_stored_once_per_digest_and_pruned_by_budget(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db", frame_budget=FrameBudget(every=2, recent=1, max_frames=8))
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    try:
        _, start = ev("agents/r/start", task="t", images=[{"data": base64.b64encode(red).decode()}])
        await store.journal("r", start)
        frames = [red, blue, blue, red, blue]  # 5 step frames; ordinals 0..4
        for i, f in enumerate(frames, 1):
            await store.journal("r", StepIn.model_validate({"index": i, "text": f"s{i}", "images": [
                {"data": base64.b64encode(f).decode()}]}))  # fmt: skip
        db = sqlite3.connect(tmp_path / "s.db")
        assert db.execute("SELECT COUNT(*) FROM frames").fetchone()[0] == 2  # red and blue, once each
        pruned = [o for (o,) in db.execute("SELECT ordinal FROM event_frames WHERE pruned = 1 ORDER BY ordinal")]
        assert pruned == [1, 3]  # not anchors (0, 2, 4) and not the newest (4)
        (run,) = await store.live_runs()
        step_images = [e.images[0].decoded() for e in run.events[1:]]
        assert step_images == [red, PLACEHOLDER_PNG, blue, PLACEHOLDER_PNG, blue]
        assert run.events[0].images[0].decoded() == red  # task images are never pruned
    finally:
        await store.aclose()


async def test_retention_deletes_ended_runs_and_unreferenced_frames(tmp_path: Path) -> None:
    clock = {"t": 1000.0}
    store = SqliteStore(tmp_path / "s.db", clock=lambda: clock["t"])
    try:
        for rid in ("old", "new"):
            _, start = ev(f"agents/{rid}/start", task=rid, images=[base64.b64encode(png((1, 2, 3))).decode()])
            await store.journal(rid, start)
        store.record_progress("old", 1, {"step": 1, "score": 0.5, "ok": True})
        store.record_end("old", "success")
        clock["t"] += 100
        store.record_end("new", "failure")
        assert await store.prune(older_than_s=50) == 1
        assert [r["run_id"] for r in await store.list_runs()] == ["new"]
        assert await store.export("old") is None
        clock["t"] += 1
        assert await store.prune(older_than_s=0) == 1
        db = sqlite3.connect(tmp_path / "s.db")
        assert db.execute("SELECT COUNT(*) FROM frames").fetchone()[0] == 0
    finally:
        await store.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_monitor_rebuilds_runs_from_the_store_without_rescoring(tmp_path: Path, kind: str) -> None:
    def make() -> Any:
        return SqliteStore(tmp_path / "s.db") if kind == "sqlite" else memory

    memory = MemoryStore()
    judge = ScriptedJudge(lambda p: {"B": 0.0} if "bad" in p.prefix_text() else {"K": 0.0})
    policy = Policy(abort_below=0.2, min_steps=1, patience=2)
    store = make()
    async with Monitor(judge=judge, store=store, policy=policy) as mon:
        for rid, task in (("good", "good task"), ("bad", "bad task")):
            await mon.handle(f"agents/{rid}/start", j(task=task))
            for i in range(1, 4):
                await mon.handle(f"agents/{rid}/step", j(index=i, text=f"{rid} {i}"))
                await mon.runs.drain()
        await mon.handle("agents/good/step", j(index=5, text="good 5 (4 is missing)"))
        assert [m for m in drained(mon) if m.topic == "agents/bad/signal"]  # aborted at step 2
    await store.aclose()
    calls = len(judge.prompts)

    store = make()
    async with Monitor(judge=judge, store=store, policy=policy) as mon:
        await mon.runs.drain()
        assert len(judge.prompts) == calls  # nothing scored again
        good, bad = mon.runs.live["good"], mon.runs.live["bad"]
        assert [s.text for s in good.tracker.steps] == ["good 1", "good 2", "good 3"]
        assert list(good.held) == [5] and good.scored == 3
        assert [p.step for p in good.tracker.curve] == [1, 2, 3] and good.last_ok is not None
        assert bad.signal == "abort" and bad.tracker.policy_state is not None
        assert bad.tracker.policy_state.signal == "abort"
        assert not drained(mon)  # replaying publishes nothing: no duplicate progress, no errors
        # The run goes on where it was: the missing step arrives, then 4 and 5 are scored together.
        await mon.handle("agents/good/step", j(index=4, text="good 4"))
        await mon.handle("agents/bad/step", j(index=4, text="bad 4"))
        await mon.runs.drain()
        progress = [json.loads(m.payload) for m in drained(mon) if m.topic.endswith("/progress")]
        assert [(p["run_id"], p["step"], p["coalesced"]) for p in progress] == [("good", 5, 2)]
        assert len(judge.prompts) == calls + 1  # the aborted run is not judged again
        await mon.handle("agents/good/end", j(outcome="success"))
        await mon.runs.drain()
    await store.aclose()

    store = make()
    async with Monitor(judge=judge, store=store) as mon:
        assert set(mon.runs.live) == {"bad"}  # an ended run is not rebuilt
    await store.aclose()


async def test_a_run_id_reused_after_its_end_is_a_new_run(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    try:
        for payload in ({"task": "first"},):
            await store.journal("r", RunStart.model_validate(payload))
        await store.journal("r", StepIn.model_validate({"index": 1, "text": "a"}))
        await store.journal("r", RunEnd.model_validate({}))
        store.record_end("r", "unknown")
        await store.journal("r", RunStart.model_validate({"task": "second"}))
        assert await store.journal("r", StepIn.model_validate({"index": 1, "text": "b"})) is True
        (run,) = await store.live_runs()
        assert run.events[0].task == "second" and [e.text for e in run.events[1:]] == ["b"]
    finally:
        await store.aclose()
