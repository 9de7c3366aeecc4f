"""One sync helper over the async objects (agent_monitor._runtime.sync): every synchronous form
goes through it."""

from __future__ import annotations

import contextvars
import inspect
import threading

from agent_monitor import GroupTracker, ProgressTracker, aselect, select, track
from agent_monitor.judges.base import JudgeRequest, JudgeResponse
from agent_monitor.testing import FakeJudge
from tests.paths import REPO

PACKAGE = REPO / "agent_monitor"
caller = contextvars.ContextVar("caller", default="unset")


class _PlainJudge:
    """A judge that is no BaseJudge (no loop of its own), noting the thread and context each call
    runs in."""

    name = "plain"
    model = "plain"

    def __init__(self) -> None:
        self.inner = FakeJudge(["K"])
        self.seen: list[tuple[str, str]] = []

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        self.seen.append((threading.current_thread().name, caller.get()))
        return await self.inner.grade(request)


def test_only_the_helper_reaches_into_event_loops_from_synchronous_code() -> None:
    # The sync forms once each held their own portal or anyio.run; now _runtime/sync.py alone does
    # (and judges/base.py, which owns a judge's loop, and _runtime/loop.py, the loop thread itself).
    users = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "daemon" not in p.parts
        and any(s in p.read_text() for s in ("anyio.run(", "LoopThread(", ".portal.call("))
    )
    assert users == ["_runtime/loop.py", "_runtime/sync.py", "judges/base.py"]


def test_select_is_aselect_s_twin_with_its_very_signature() -> None:
    assert inspect.signature(select) == inspect.signature(aselect)


def test_one_shot_forms_run_a_plain_judge_on_a_private_loop_that_ends_with_the_call() -> None:
    # (A judge per call: each call's private loop is a loop of its own, and a judge serves one
    # loop.)
    tracked, selected = _PlainJudge(), _PlainJudge()
    before = set(threading.enumerate())
    token = caller.set("the caller's")
    try:
        results = track("t", ["a", "b"], judge=tracked)  # type: ignore[arg-type]
        picked = select("t", {"x": ["a"], "y": ["b"]}, judge=selected)  # type: ignore[arg-type]
    finally:
        caller.reset(token)
    assert [p.ok for p in results] == [True, True] and picked.winner in ("x", "y")
    assert {name for name, _ in tracked.seen} == {"track-loop"} and {
        n for n, _ in selected.seen
    } == {"select-loop"}
    # The caller's context variables went along.
    assert {value for _, value in tracked.seen + selected.seen} == {"the caller's"}
    assert set(threading.enumerate()) - before == set()


def test_trackers_and_groups_share_the_judge_s_loop_through_the_helper() -> None:
    judge = FakeJudge(["K"])
    with ProgressTracker("t", judge=judge) as a, GroupTracker("t", judge=judge) as group:
        b = group.run("r1")
        assert a._sync.portal is b._sync.portal is judge._portal()
        assert a.update("step").ok and b.update("step").ok
    plain = _PlainJudge()
    before = set(threading.enumerate())
    with ProgressTracker("t", judge=plain) as c:  # type: ignore[arg-type]
        assert c.update("step").ok
    assert plain.seen[0][0] == "progress-tracker-loop"
    assert set(threading.enumerate()) - before == set()  # its private loop stopped with it
