"""Run state: pure unit tests of the RunBook (no event loop), and the journal property: replay
rebuilds the state.

The property drives the real Monitor (FakeJudge, no broker) through random event sequences:
starts, steps in and out of order and without an index, duplicates, broker redeliveries (DUP),
gaps waited out past the hold, events the monitor refuses, ends, idle expiry and evictions. At
a random point the daemon "crashes" (its run store is kept, nothing else); a new Monitor on
the same store must then hold exactly the state the old one had; and the rest of the sequence
must leave it in exactly the state of a monitor that never crashed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_monitor import Policy
from agent_monitor.daemon import (
    Duplicated,
    MemoryStore,
    Monitor,
    MonitorConfig,
    Refused,
    RunLimits,
    SqliteStore,
)
from agent_monitor.daemon.runs import Appended, Closed, Closing, Opened, RunBook
from agent_monitor.daemon.stores import (
    Delivery,
    Ended,
    Finished,
    GapFilled,
    Orphaned,
    OrphansDropped,
    Started,
    Stepped,
)
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import RunEnd, RunStart, StepIn

LIMITS = RunLimits(
    hold_s=5, idle_timeout_s=30, max_runs=3, max_held_steps=4, max_orphan_runs=2, ended_memory=3
)


def start(task: str = "t") -> RunStart:
    return RunStart.model_validate({"task": task})


def step(text: str, index: int | None = None) -> StepIn:
    return StepIn.model_validate(
        {"text": text} if index is None else {"text": text, "index": index}
    )


SCORED: dict[int, dict[str, list[tuple[int, str, bool]]]] = {}
"""Per book, the steps each run handed to scoring (what the daemon's tracker would hold)."""


def apply(book: RunBook, record: Any) -> list[Any]:
    effects = book.apply(record)
    for e in effects:
        if isinstance(e, Appended):
            scored = SCORED.setdefault(id(book), {}).setdefault(e.run_id, [])
            scored += [(s.index, s.step.text, s.placeholder) for s in e.steps]
    return effects


def run(book: RunBook, run_id: str, event: Any, now: float, d: Delivery | None = None) -> list[Any]:
    """What the daemon does with an event: decide, then apply the record (the journal is elided)."""
    verdict = book.decide(run_id, event, now, d)
    if isinstance(verdict, (Refused, Duplicated)):
        return [verdict]
    return apply(book, verdict)


def texts(book: RunBook, run_id: str) -> list[tuple[int, str, bool]]:
    """The run's steps in order: what the state says of them, with the content handed to scoring."""
    scored = SCORED.get(id(book), {}).get(run_id, [])
    state = book.live[run_id]
    assert state.steps == len(scored) and state.placeholders == {i for i, _, p in scored if p}
    return scored


# -- the RunBook alone --


def test_steps_are_put_in_order_duplicates_and_too_far_refused() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    for i in (1, 3, 2, 2, 1):
        run(book, "r", step(f"s{i}", i), 1)
    assert texts(book, "r") == [(1, "s1", False), (2, "s2", False), (3, "s3", False)]
    (dup,) = run(book, "r", step("s2", 2), 2)
    assert isinstance(dup, Duplicated) and dup.counted
    (far,) = run(book, "r", step("far", 8), 2)
    assert (
        isinstance(far, Refused) and far.reason == "index_too_far" and "8 is 4 ahead" in far.message
    )
    assert not book.live["r"].held  # a refusal leaves nothing behind


def test_a_resend_with_other_content_is_a_conflict_and_the_first_stays() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    run(book, "r", step("one", 1), 1)
    run(book, "r", step("three", 3), 1)  # held, waiting for 2
    for index, text in ((1, "one, rewritten"), (3, "three, rewritten")):
        (verdict,) = run(book, "r", step(text, index), 2)
        assert isinstance(verdict, Refused) and verdict.reason == "conflict", verdict
        assert (
            f"step {index} was sent again with different content; the first one stays"
            in verdict.message
        )
    for index, text in ((1, "one"), (3, "three")):  # the same content again: a plain re-delivery
        (verdict,) = run(book, "r", step(text, index), 2)
        assert isinstance(verdict, Duplicated)
    run(book, "r", step("two", 2), 3)
    assert texts(book, "r") == [(1, "one", False), (2, "two", False), (3, "three", False)]
    # A step given up for missing and scored as a placeholder cannot come in late under its index
    # either.
    run(book, "r", step("five", 5), 4)
    for record in book.due(4 + LIMITS.hold_s + 1):
        apply(book, record)
    (late,) = run(book, "r", step("four, at last", 4), 20)
    assert (
        isinstance(late, Refused)
        and late.reason == "conflict"
        and "given up for missing" in late.message
    )


def test_unindexed_steps_take_the_next_free_index_after_held_ones() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    run(book, "r", step("three", 3), 1)
    verdict = book.decide("r", step("free"), 2)
    assert isinstance(verdict, Stepped) and verdict.step.index == 4


def test_a_gap_is_filled_only_when_its_hold_is_due_and_the_decision_is_a_record() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    run(book, "r", step("one", 1), 1)
    run(book, "r", step("three", 3), 2)
    assert book.due(6.9) == []
    (gap,) = book.due(7.0)
    assert gap == GapFilled("r", 3, 7.0)  # the steps before 3 are given up on
    effects = apply(book, gap)
    assert [e.reason for e in effects if isinstance(e, Refused)] == ["step_gap"]
    assert texts(book, "r")[1][2] is True and texts(book, "r")[2] == (3, "three", False)
    assert [s.index for e in effects if isinstance(e, Appended) for s in e.steps] == [2, 3]


def test_orphans_wait_for_their_start_and_expire_as_no_start() -> None:
    book = RunBook(LIMITS)
    (held,) = [book.decide("o", step("early", 1), 0)]
    assert isinstance(held, Orphaned)
    apply(book, held)
    effects = run(book, "o", start(), 1)
    assert any(isinstance(e, Opened) for e in effects) and texts(book, "o") == [(1, "early", False)]
    book.apply(book.decide("ghost", step("x"), 10))  # type: ignore[arg-type]
    (dropped,) = book.due(15)
    assert dropped == OrphansDropped("ghost", 15)
    (notice,) = book.apply(dropped)
    assert (
        isinstance(notice, Refused) and notice.reason == "no_start" and "ghost" not in book.orphans
    )


def test_orphans_and_held_steps_are_bounded() -> None:
    book = RunBook(LIMITS)
    for rid in ("a", "b"):
        book.apply(book.decide(rid, step("x"), 0))  # type: ignore[arg-type]
    (refused,) = run(book, "c", step("x"), 0)
    assert isinstance(refused, Refused) and refused.reason == "too_many_held"
    for i in range(3):
        book.apply(book.decide("a", step(f"x{i}"), 0))  # type: ignore[arg-type]
    (refused,) = run(book, "a", step("one too many"), 0)
    assert isinstance(refused, Refused) and refused.reason == "too_many_held"


def test_eviction_takes_the_least_recently_active_run_not_the_earliest_started() -> None:
    book = RunBook(LIMITS)
    for i, rid in enumerate(("busy", "idle1", "idle2")):
        run(book, rid, start(), i)
    run(book, "busy", step("still here", 1), 10)
    effects = run(book, "new", start(), 11)
    closed = [e for e in effects if isinstance(e, Closed)]
    assert closed == [Closed("idle1", "evicted", 11)] and list(book.live) == [
        "idle2",
        "busy",
        "new",
    ]


def test_idle_runs_expire_in_order_of_last_activity() -> None:
    book = RunBook(LIMITS)
    run(book, "a", start(), 0)
    run(book, "b", start(), 10)
    assert book.due(35) == [Finished("a", "expired", 35)]


def test_end_fills_gaps_and_a_step_after_it_is_refused() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    run(book, "r", step("two", 2), 1)
    effects = run(book, "r", RunEnd.model_validate({"outcome": "success"}), 2)
    assert Closing("r", "success") in effects and texts(book, "r")[0][2] is True
    (late,) = run(book, "r", step("late"), 3)
    assert isinstance(late, Refused) and late.reason == "run_ended"
    book.apply(book.finish("r", "success", 4))  # type: ignore[arg-type]
    (after,) = run(book, "r", step("later"), 5)
    assert isinstance(after, Refused) and after.reason == "run_ended"


def test_a_redelivery_is_recognised_by_packet_id_and_digest_only_when_marked_dup() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    d = Delivery.of(7, "agents/r/step", b'{"text":"x"}')
    run(book, "r", step("x"), 1, d)
    again = Delivery.of(7, "agents/r/step", b'{"text":"x"}', dup=True)
    (dup,) = run(book, "r", step("x"), 2, again)
    assert isinstance(dup, Duplicated)
    # The same packet id and payload without DUP is a new message (brokers reuse packet ids).
    run(book, "r", step("x"), 3, d)
    assert [t for _, t, _ in texts(book, "r")] == ["x", "x"]


def test_a_different_second_start_is_refused_and_the_same_one_is_a_duplicate() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start("a"), 0)
    assert isinstance(run(book, "r", start("a"), 1)[0], Duplicated)
    (refused,) = run(book, "r", start("b"), 1)
    assert isinstance(refused, Refused) and refused.reason == "duplicate_start"


def test_orphan_end_is_applied_when_the_start_comes() -> None:
    book = RunBook(LIMITS)
    book.apply(book.decide("r", step("x"), 0))  # type: ignore[arg-type]
    end = book.decide("r", RunEnd.model_validate({}), 1)
    assert isinstance(end, Ended)
    book.apply(end)
    effects = run(book, "r", start(), 2)
    assert Closing("r", "unknown") in effects


def test_started_record_of_a_live_run_is_not_applied_twice() -> None:
    book = RunBook(LIMITS)
    run(book, "r", start(), 0)
    assert book.apply(Started("r", start(), 1)) == []


# -- the journal property, through the real Monitor and its run stores --

RUN_IDS = st.sampled_from(["a", "b", "c", "d"])
START = st.tuples(st.just("start"), RUN_IDS, st.sampled_from(["task one", "task two"]))
STEP = st.tuples(
    st.just("step"),
    RUN_IDS,
    st.one_of(st.none(), st.integers(1, 7)),
    st.sampled_from(["x", "y", "z"]),
)
WAIT = st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 6.0, 6.0, 31.0]))
# Steps, starts and waits weigh most: gaps, orphans, evictions and expiry need several of them in a
# row.
OPS = st.one_of(
    START,
    START,
    STEP,
    STEP,
    STEP,
    STEP,
    WAIT,
    WAIT,
    st.tuples(st.just("end"), RUN_IDS, st.sampled_from([None, "success", "failure", 0.5])),
    st.tuples(st.just("redeliver"), st.integers(0, 40)),
    st.tuples(st.just("garbage"), RUN_IDS),
)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


class Driver:
    """Plays operations into a monitor as a broker would: packet ids, DUP redeliveries, time
    passing."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, int]] = []
        self.mid = 0

    async def play(self, mon: Monitor, clock: Clock, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "wait":
            clock.t += op[1]
            await mon.sweep()
        elif kind == "redeliver":
            if self.sent:
                topic, payload, mid = self.sent[op[1] % len(self.sent)]
                await mon.handle(topic, payload, Delivery.of(mid, topic, payload, dup=True))
        else:
            rid = op[1]
            if kind == "start":
                topic, body = f"agents/{rid}/start", {"task": op[2]}
            elif kind == "step":
                topic, body = (
                    f"agents/{rid}/step",
                    {"text": op[3]} | ({} if op[2] is None else {"index": op[2]}),
                )
            elif kind == "end":
                topic, body = f"agents/{rid}/end", {} if op[2] is None else {"outcome": op[2]}
            else:
                topic, body = f"agents/{rid}/step", None
            payload = b"{not json" if body is None else json.dumps(body).encode()
            self.mid = self.mid % 65535 + 1
            self.sent.append((topic, payload, self.mid))
            clock.t += 0.25
            await mon.handle(topic, payload, Delivery.of(self.mid, topic, payload))
        await asyncio.wait_for(mon.drain(), 10)


def config() -> MonitorConfig:
    # Aborts make "abort is final" part of the state; no sweeper task: time moves only when the test
    # says.
    return MonitorConfig(
        limits=LIMITS,
        policy=Policy(abort_below=0.2, min_steps=2, patience=2),
        sweep_interval_s=3600,
    )


def view(mon: Monitor) -> dict[str, Any]:
    """The run state and each live run's scoring, as plain data."""
    scoring = {}
    for rid in mon.book.live:
        r = mon.run(rid)
        assert r is not None
        scoring[rid] = (
            r.scored,
            r.signal,
            [p.step for p in r.curve],
            [(s.index, s.text, s.placeholder) for s in r.steps],
        )
        tracker = mon.tracker(rid)
        assert tracker is not None and len(tracker.steps) == mon.book.live[rid].steps
    return {"state": mon.book.snapshot(), "scoring": scoring}


async def crash_and_replay(ops: list[tuple[Any, ...]], cut: int, make_store: Any) -> None:
    judge = FakeJudge(lambda p: "B" if "y" in p.prefix_text() else "K")
    clock, driver = Clock(), Driver()
    store = make_store()
    async with Monitor(config(), judge=judge, store=store, clock=clock) as mon:
        for op in ops[:cut]:
            await driver.play(mon, clock, op)
        before = view(mon)
    store = await reopen(store, make_store)
    async with Monitor(config(), judge=judge, store=store, clock=clock) as mon:
        await asyncio.wait_for(mon.drain(), 10)
        assert view(mon) == before, (
            "replaying the journal did not rebuild the state the monitor had"
        )
        for op in ops[cut:]:
            await driver.play(mon, clock, op)
        after_crash = view(mon)
    await store.aclose()

    # The same events into a monitor that never crashed end in the same state.
    reference_clock, reference_driver = Clock(), Driver()
    async with Monitor(config(), judge=judge, clock=reference_clock) as ref:
        for op in ops:
            await reference_driver.play(ref, reference_clock, op)
        assert view(ref) == after_crash, "the run went on differently after the restart"


async def reopen(store: Any, make_store: Any) -> Any:
    if isinstance(store, MemoryStore):
        return store  # the process died; the memory store stands for a disk that did not
    await store.aclose()
    return make_store()


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(OPS, min_size=4, max_size=40), data=st.data())
def test_replay_rebuilds_the_state_memory_store(
    ops: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(ops)))
    store = MemoryStore()
    asyncio.run(crash_and_replay(ops, cut, lambda: store))


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(OPS, min_size=4, max_size=30), data=st.data())
def test_replay_rebuilds_the_state_sqlite_store(
    ops: list[tuple[Any, ...]], data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cut = data.draw(st.integers(0, len(ops)))
    path: Path = tmp_path_factory.mktemp("store") / "runs.sqlite3"
    asyncio.run(crash_and_replay(ops, cut, lambda: SqliteStore(path)))
