"""Amending a step by index (`step.amend`): the wire, the run state, the journal, a restart, the
prompts, the proxy.

A step already accepted can have its text replaced (the LLM API proxy's final answer once the
conversation went on: issue 44, finding 4). Only an accepted index can be amended; an amendment of
another one is refused (`unknown_step`) and counted; one that changes nothing is a duplicate. The
amendment is journaled as a record of its own, replayed after a restart; the run is scored again at
its newest step, and the prompts of the steps before the amended one keep their prefix.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.criteria import load_criteria
from agent_monitor.daemon import (
    Duplicated,
    MemoryStore,
    Monitor,
    MonitorConfig,
    MonitorEvent,
    Refused,
    SqliteStore,
)
from agent_monitor.daemon.runs import Appended, Revised, RunBook
from agent_monitor.daemon.sources._chat import parse_request
from agent_monitor.daemon.sources.proxy._turns import Conversations
from agent_monitor.daemon.stores import Amended, GapFilled, Record, Started, Stepped
from agent_monitor.prompts import PromptWindow, Step
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import EventError, RunStart, StepIn
from tests.daemon.test_state import LIMITS, run, start, step


def amend(text: str, index: int) -> StepIn:
    return StepIn.model_validate({"text": text, "index": index, "amend": True})


# -- the wire --


def test_an_amendment_needs_an_index_and_brings_text_alone() -> None:
    assert amend("new", 2).amend
    for bad in (
        {"text": "new", "amend": True},
        {"text": "new", "index": 1, "amend": True, "meta": {"a": 1}},
        {"index": 1, "amend": True, "images": ["iVBORw0KGgo="]},
    ):
        with pytest.raises(ValueError, match="amend"):
            StepIn.model_validate(bad)


def test_an_amendment_of_a_bad_payload_is_refused_on_decode_with_its_reason() -> None:
    from agent_monitor.wire import Decoder, Topics

    decode = Decoder(Topics())
    with pytest.raises(EventError, match="needs the index"):
        decode("agents/r/step", json.dumps({"text": "x", "amend": True}).encode())


# -- the run state --


def test_an_accepted_step_is_amended_and_the_scoring_is_told() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    run(book, "r", step("one", 1), 1)
    run(book, "r", step("two", 2), 2)
    verdict = book.decide("r", amend("one, then what it saw", 1), 3)
    assert isinstance(verdict, Amended)
    assert book.apply(verdict) == [Revised("r", 1, verdict.step, 3)]
    assert book.snapshot()["live"][0]["revised"] and book.live["r"].last_event == 3
    # The same amendment again (a re-delivery) changes nothing: a duplicate; so does the original
    # step re-sent.
    assert book.decide("r", amend("one, then what it saw", 1), 4) == Duplicated("r", "step")
    assert book.decide("r", step("one", 1), 4) == Duplicated("r", "step")
    # A second, different amendment is one more.
    assert isinstance(book.decide("r", amend("one, amended twice", 1), 5), Amended)
    # An amendment with the text the step has already is a duplicate too.
    assert book.decide("r", amend("two", 2), 5) == Duplicated("r", "step")


def test_an_amendment_of_an_index_never_accepted_is_refused() -> None:
    book = RunBook(LIMITS)
    (refused,) = run(book, "r", amend("x", 1), 0)
    assert isinstance(refused, Refused) and refused.reason == "unknown_step" and refused.invalid
    run(book, "r", start(), 0)
    run(book, "r", step("one", 1), 1)
    (refused,) = run(book, "r", amend("x", 3), 2)
    assert isinstance(refused, Refused) and refused.reason == "unknown_step"
    assert "no step 3 was accepted" in refused.message and refused.topic == "agents/r/step"
    assert book.live["r"].steps == 1 and not book.live["r"].revised


def test_a_held_step_is_amended_where_it_waits_and_a_placeholder_cannot_be() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    run(book, "r", step("three", 3), 1)  # waits for 1 and 2
    verdict = book.decide("r", amend("three, amended", 3), 2)
    assert isinstance(verdict, Amended) and book.apply(verdict) == []  # nothing to score yet
    effects = book.apply(GapFilled("r", 3, 10))  # 1 and 2 given up: placeholders, then 3 as amended
    (appended,) = [e for e in effects if isinstance(e, Appended)]
    assert [(s.index, s.placeholder) for s in appended.steps] == [(1, True), (2, True), (3, False)]
    assert appended.steps[-1].step.text == "three, amended"
    (refused,) = run(book, "r", amend("x", 1), 12)
    assert isinstance(refused, Refused) and refused.reason == "conflict"


def test_a_held_step_amended_is_scored_with_its_new_text() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    run(book, "r", step("two", 2), 1)
    verdict = book.decide("r", amend("two, amended", 2), 2)
    assert isinstance(verdict, Amended)
    book.apply(verdict)
    effects = run(book, "r", step("one", 1), 3)
    (appended,) = [e for e in effects if isinstance(e, Appended)]
    assert [s.step.text for s in appended.steps] == ["one", "two, amended"]


def test_an_amendment_after_the_end_is_refused() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    run(book, "r", step("one", 1), 1)
    run(book, "r", StepIn.model_validate({"text": "two", "index": 2}), 2)
    from agent_monitor.wire import RunEnd

    run(book, "r", RunEnd.model_validate({}), 3)
    (refused,) = run(book, "r", amend("x", 1), 4)
    assert isinstance(refused, Refused) and refused.reason == "run_ended"


# -- the journal --


RECORDS: list[Record] = [
    Started("r", RunStart.model_validate({"task": "t"}), 1.0),
    Stepped("r", StepIn.model_validate({"text": "one", "index": 1}), 2.0),
    Amended("r", StepIn.model_validate({"text": "one, amended", "index": 1, "amend": True}), 3.0),
    Amended(
        "r", StepIn.model_validate({"text": "one, amended twice", "index": 1, "amend": True}), 4.0
    ),
]


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_amendments_round_trip_through_the_store(tmp_path: Path, kind: str) -> None:
    store: Any = SqliteStore(tmp_path / "runs.sqlite3") if kind == "sqlite" else MemoryStore()
    await store.journal_batch(RECORDS[:3])
    # a second amendment of the same index: its own record (not `steps_once`)
    await store.journal(RECORDS[3])
    if kind == "sqlite":
        await store.aclose()
        store = SqliteStore(tmp_path / "runs.sqlite3")
        exported = await store.export("r")
        assert exported is not None and [s["text"] for s in exported["steps"]] == [
            "one, amended twice"
        ]
    replay = await store.replay()
    assert [type(r) for r in replay.records] == [Started, Stepped, Amended, Amended]
    assert [r.step.text for r in replay.records[2:]] == ["one, amended", "one, amended twice"]
    assert all(r.step.amend for r in replay.records[2:])
    await store.aclose()


# -- the monitor: scored again, refused and counted, rebuilt on restart --


async def _handle(mon: Monitor, kind: str, body: dict[str, Any]) -> None:
    await mon.handle(f"agents/r/{kind}", json.dumps(body).encode())
    await asyncio.wait_for(mon.drain(), 10)


async def test_the_monitor_scores_the_amended_run_again_and_a_restart_rebuilds_it(
    tmp_path: Path,
) -> None:
    judge = FakeJudge(lambda p: "K")
    seen: list[MonitorEvent] = []
    path = tmp_path / "runs.sqlite3"
    store = SqliteStore(path)
    config = MonitorConfig(sweep_interval_s=3600)
    async with Monitor(config, judge=judge, store=store, sinks=[seen.append]) as mon:
        await _handle(mon, "start", {"task": "fix the test"})
        await _handle(mon, "step", {"index": 1, "text": "THOUGHT: run it"})
        await _handle(mon, "step", {"index": 2, "text": "THOUGHT: done"})
        before = len(judge.prompts)
        await _handle(
            mon, "step", {"index": 1, "text": "THOUGHT: run it\n[user] 1 passed", "amend": True}
        )
        # Scored again at its newest step, the amended text in step 1.
        assert len(judge.prompts) > before
        again = judge.prompts[-1]
        assert again.step == 2 and "1 passed" in again.text().split("### Step 2")[0]
        # never accepted: refused, counted
        await _handle(mon, "step", {"index": 5, "text": "x", "amend": True})
        await _handle(
            mon, "step", {"index": 1, "text": "THOUGHT: run it\n[user] 1 passed", "amend": True}
        )
        refused = [e for e in seen if isinstance(e, Refused)]
        assert [e.reason for e in refused] == ["unknown_step"]
        assert sum(isinstance(e, Duplicated) for e in seen) == 1
        view = mon.run("r")
        assert view is not None
        texts = [s.text for s in view.steps]
        snapshot = mon.book.snapshot()
        tracker = mon.tracker("r")
        assert tracker is not None
        latest = tracker.latest
        assert latest is not None and latest.step == 2
    await store.aclose()
    assert texts == ["THOUGHT: run it\n[user] 1 passed", "THOUGHT: done"]
    store = SqliteStore(path)
    async with Monitor(config, judge=judge, store=store) as mon:
        await asyncio.wait_for(mon.drain(), 10)
        assert mon.book.snapshot() == snapshot
        view = mon.run("r")
        assert view is not None and [s.text for s in view.steps] == texts
        # The re-delivered amendment after the restart is still a duplicate; a new step is scored on
        # the amended run.
        n = len(judge.prompts)
        await _handle(
            mon, "step", {"index": 1, "text": "THOUGHT: run it\n[user] 1 passed", "amend": True}
        )
        assert len(judge.prompts) == n
        await _handle(mon, "step", {"index": 3, "text": "THOUGHT: submit"})
        assert "1 passed" in judge.prompts[-1].text().split("### Step 2")[0]
    await store.aclose()


# -- the prompts --


def _steps(texts: list[str]) -> list[Step]:
    return [Step(index=i, text=t) for i, t in enumerate(texts, 1)]


@pytest.mark.parametrize("budget", [None, 900])
def test_an_amended_step_is_laid_out_again_from_it_and_earlier_prompts_keep_their_prefix(
    budget: int | None,
) -> None:
    rubric = load_criteria(None)
    criterion = rubric.judged[0]
    texts = [f"step {i}: " + "words " * 40 for i in range(1, 13)]
    window = PromptWindow("the task", rubric)
    steps = _steps(texts)
    early = [window.build(steps, criterion, n=n, budget=budget).prefix_text() for n in range(1, 13)]
    steps[7] = Step(index=8, text=texts[7] + "\nwhat it saw " * 20)
    window.amended(8)
    after = [window.build(steps, criterion, n=n, budget=budget).prefix_text() for n in range(1, 13)]
    # under a budget, folds before and after the amended step
    assert budget is None or window.compactions > 1
    assert after[:7] == early[:7]  # the prefixes before the amended step: the same prompts
    assert after[7:] != early[7:]
    assert "what it saw" in after[-1] or budget is not None
    # The same as a new window (a restarted monitor, a new cluster owner) builds from the amended
    # steps.
    fresh = PromptWindow("the task", rubric)
    assert [
        fresh.build(steps, criterion, n=n, budget=budget).prefix_text() for n in range(1, 13)
    ] == after


# -- the proxy: a held answer sent after its grace is amended when the conversation goes on --


def _chat(*messages: tuple[str, str]) -> Any:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}]
        + [{"role": r, "content": c} for r, c in messages],
    }
    return parse_request("chat", body)


def test_the_proxy_amends_an_answer_sent_before_its_observation() -> None:
    from agent_monitor.daemon.sources.proxy._turns import Turn

    convs = Conversations()
    req = _chat(("user", "task"))
    conv = convs.match(req, None, 0.0)
    assert conv is not None
    assert convs.events(conv, req, Turn("ls"), now=0.0, grace_s=1.0) == []  # held
    sent = convs.due(2.0)  # the grace ran out: sent as it is
    assert [(e.kind, e.data.get("text"), e.data.get("amend")) for e in sent] == [
        ("start", None, None),
        ("step", "ls", None),
    ]
    req = _chat(("user", "task"), ("assistant", "ls"), ("user", "a.py"))
    conv = convs.match(req, None, 3.0)
    assert conv is not None
    out = convs.events(conv, req, Turn("cat a.py"), now=3.0, grace_s=1.0)
    assert [dict(e.data) for e in out] == [{"index": 1, "text": "ls\n[user] a.py", "amend": True}]
    assert out[0].key != "px:1"
    # Once amended, the next request does not amend it again.
    req = _chat(
        ("user", "task"),
        ("assistant", "ls"),
        ("user", "a.py"),
        ("assistant", "cat a.py"),
        ("user", "x"),
    )
    conv = convs.match(req, None, 3.5)
    assert conv is not None
    out = convs.events(conv, req, now=3.5, grace_s=1.0)
    assert [dict(e.data) for e in out] == [{"index": 2, "text": "cat a.py\n[user] x"}]


def test_an_amendment_round_trips_through_the_cluster_journals_form() -> None:
    """What a cluster owner journals in Redis, and what a new owner replays: the same record."""
    from agent_monitor.daemon.cluster._store import _record_body, _record_of

    kind, body, meta = _record_body(RECORDS[2])
    assert kind == "amend" and meta == {"updated_at": 3.0}
    assert _record_of("r", body) == RECORDS[2]


async def test_an_amendment_while_its_prefix_is_being_scored_is_scored_again(
    tmp_path: Path,
) -> None:
    """The scoring in flight read the step as it was: once it ends, the run is scored again with
    the new text."""
    judge = FakeJudge(lambda p: "K", latency_s=0.3)
    async with Monitor(MonitorConfig(sweep_interval_s=3600), judge=judge) as mon:
        await _handle(mon, "start", {"task": "fix the test"})
        await mon.handle(
            "agents/r/step", json.dumps({"index": 1, "text": "THOUGHT: run it"}).encode()
        )
        await asyncio.sleep(0.1)  # the judge is reading step 1
        await _handle(
            mon, "step", {"index": 1, "text": "THOUGHT: run it\n[user] 1 passed", "amend": True}
        )
        assert [("1 passed" in p.text()) for p in judge.prompts if p.step == 1][-1]
        view = mon.run("r")
        assert view is not None and view.scored == 1
