"""Per-run state and the scheduler, driven through Monitor.handle (no broker): order,
idempotency, coalescing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Monitor, MonitorConfig, RunLimits
from agent_monitor.daemon.sinks import Message, Outbox
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge


class Clock:
    """A hand-moved clock for hold and idle timeouts."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def drained(outbox: Outbox) -> list[Message]:
    out = []
    while (m := outbox.get_nowait()) is not None:
        out.append(m)
    return out


def of(messages: list[Message], kind: str, run_id: str | None = None) -> list[dict[str, Any]]:
    return [
        json.loads(m.payload) if m.payload else {}
        for m in messages
        if (m.topic.endswith("/" + kind) or (kind == "error" and m.topic.endswith("/_errors")))
        and (run_id is None or f"/{run_id}/" in m.topic)
    ]


async def test_steps_in_order_duplicates_ignored_and_out_of_order_reordered() -> None:
    judge = FakeJudge()
    async with Monitor(MonitorConfig(max_concurrency=1), judge=judge) as mon:
        await mon.handle("agents/r1/start", j(task="count to five"))
        for i in (1, 3, 2, 2, 1, 4):  # 3 before 2; 2 and 1 re-delivered
            await mon.handle("agents/r1/step", j(index=i, text=f"said {i}"))
        await mon.drain()
        tracker = mon.tracker("r1")
        assert tracker is not None
        assert [s.text for s in tracker.steps] == ["said 1", "said 2", "said 3", "said 4"]
        assert mon.metrics.duplicate_steps._value.get() == 2
        # The newest prefix the judge saw holds all four steps, in order.
        last = judge.prompts[-1].prefix_text()
        assert (
            last.index("said 1")
            < last.index("said 2")
            < last.index("said 3")
            < last.index("said 4")
        )
        progress = of(drained(mon.outbox), "progress", "r1")
        assert progress[-1]["step"] == 4 and progress[-1]["ok"] is True
        assert [p["step"] for p in progress] == sorted(p["step"] for p in progress)


async def test_steps_before_start_are_held_then_replayed() -> None:
    judge = FakeJudge()
    async with Monitor(judge=judge) as mon:
        await mon.handle("agents/r1/step", j(index=1, text="early one"))
        await mon.handle("agents/r1/step", j(index=2, text="early two"))
        assert "r1" not in mon.book.live
        await mon.handle("agents/r1/start", j(task="t"))
        await mon.drain()
        assert [s.text for s in mon.tracker("r1").steps] == ["early one", "early two"]
        assert not of(drained(mon.outbox), "error")


async def test_steps_without_start_are_reported_after_hold() -> None:
    clock = Clock()
    config = MonitorConfig(limits=RunLimits(hold_s=5), sweep_interval_s=3600)
    async with Monitor(config, judge=FakeJudge(), clock=clock) as mon:
        await mon.handle("agents/ghost/step", j(index=1, text="x"))
        await mon.handle("agents/ghost/step", j(index=2, text="y"))
        await mon.sweep()
        assert not of(drained(mon.outbox), "error")
        clock.t += 6
        await mon.sweep()
        errors = of(drained(mon.outbox), "error", "ghost")
        assert (
            len(errors) == 1
            and errors[0]["reason"] == "no_start"
            and "2 step(s)" in errors[0]["error"]
        )
        assert errors[0]["topic"] == "agents/ghost/step"
        assert mon.metrics.invalid_events.labels("no_start")._value.get() == 2
        assert "ghost" not in mon.book.orphans


async def test_gap_is_filled_with_placeholder_after_hold() -> None:
    clock = Clock()
    judge = FakeJudge()
    config = MonitorConfig(limits=RunLimits(hold_s=5), sweep_interval_s=3600)
    async with Monitor(config, judge=judge, clock=clock) as mon:
        await mon.handle("agents/r/start", j(task="t"))
        await mon.handle("agents/r/step", j(index=1, text="one"))
        await mon.handle("agents/r/step", j(index=3, text="three"))
        await mon.drain()
        assert len(mon.tracker("r").steps) == 1
        clock.t += 6
        await mon.sweep()
        await mon.drain()
        steps = mon.tracker("r").steps
        assert [s.index for s in steps] == [1, 2, 3]
        assert "not received" in steps[1].text and steps[2].text == "three"
        msgs = drained(mon.outbox)
        assert [e["reason"] for e in of(msgs, "error", "r")] == ["step_gap"]
        assert of(msgs, "progress", "r")[-1]["step"] == 3
        # The missing step arriving late is a duplicate now, not a second step 2.
        await mon.handle("agents/r/step", j(index=2, text="two, late"))
        assert len(mon.tracker("r").steps) == 3


async def test_slow_judge_burst_is_coalesced_to_newest_prefix() -> None:
    judge = FakeJudge(latency_s=0.2)
    async with Monitor(MonitorConfig(max_concurrency=2), judge=judge) as mon:
        await mon.handle("agents/burst/start", j(task="t"))
        for i in range(1, 51):
            await mon.handle("agents/burst/step", j(index=i, text=f"s{i}"))
        await mon.drain()
        progress = of(drained(mon.outbox), "progress", "burst")
    assert len(judge.prompts) <= 3, len(judge.prompts)
    assert progress[-1]["step"] == 50
    assert sum(p["coalesced"] for p in progress) == 50
    assert judge.prompts[-1].step == 50


async def test_fairness_a_chatty_run_does_not_starve_others() -> None:
    judge = FakeJudge(latency_s=0.01)
    async with Monitor(MonitorConfig(max_concurrency=1), judge=judge) as mon:
        await mon.handle("agents/chatty/start", j(task="chatty task"))
        await mon.handle("agents/quiet/start", j(task="quiet task"))
        for i in range(1, 21):
            await mon.handle("agents/chatty/step", j(index=i, text=f"c{i}"))
            if i == 2:
                await mon.handle("agents/quiet/step", j(index=1, text="q1"))
            await asyncio.sleep(0.003)
        await mon.drain()
        tasks = ["quiet" if "quiet task" in p.prefix_text() else "chatty" for p in judge.prompts]
    # The quiet run is scored within the first few calls, not after the chatty run's twenty.
    assert "quiet" in tasks[:3], tasks


async def test_abort_end_to_end_and_abort_is_final() -> None:
    judge = FakeJudge(lambda p: "B")  # always ~5% done
    async with Monitor(
        MonitorConfig(policy=Policy(abort_below=0.3, min_steps=2, patience=2)), judge=judge
    ) as mon:
        await mon.handle("agents/bad/start", j(task="t"))
        for i in range(1, 4):
            await mon.handle("agents/bad/step", j(index=i, text=f"s{i}"))
            await mon.drain()
        calls = len(judge.prompts)
        await mon.handle("agents/bad/step", j(index=4, text="after abort"))
        await mon.drain()
        assert len(judge.prompts) == calls  # no judge spend on an aborted run
        msgs = drained(mon.outbox)
        signals = [m for m in msgs if m.topic == "agents/bad/signal"]
        assert len(signals) == 1 and signals[0].retain and not signals[0].droppable
        sig = json.loads(signals[0].payload)
        assert sig["signal"] == "abort" and sig["step"] == 3 and sig["policy"]["abort_below"] == 0.3
        await mon.handle("agents/bad/end", j(outcome="failure"))
        await mon.drain()  # the end is acted on by a scorer, once the newest prefix is scored
        msgs = drained(mon.outbox)
        cleared = [m for m in msgs if m.topic == "agents/bad/signal"]
        assert cleared and cleared[-1].payload == b"" and cleared[-1].retain
        assert "bad" not in mon.book.live
        assert mon.metrics.runs.labels("failure")._value.get() == 1
        assert mon.metrics.signals.labels("abort")._value.get() == 1


async def test_start_policy_overrides_defaults_and_resample_on_regression() -> None:
    scores = {1: "J", 2: "K", 3: "L", 4: "C"}
    judge = FakeJudge(lambda p: scores[p.step])
    async with Monitor(MonitorConfig(policy=Policy(abort_below=0.05)), judge=judge) as mon:
        await mon.handle("agents/r/start", j(task="t", policy={"regression": 0.3, "min_steps": 1}))
        for i in range(1, 5):
            await mon.handle("agents/r/step", j(index=i, text=f"s{i}"))
            await mon.drain()
        sig = [json.loads(m.payload) for m in drained(mon.outbox) if m.topic == "agents/r/signal"]
    assert [s["signal"] for s in sig] == ["resample"]
    assert sig[0]["best_step"] == 3 and sig[0]["policy"]["regression"] == 0.3


async def test_judge_failure_is_reported_and_never_aborts() -> None:
    from agent_monitor.judges.base import JudgeError

    judge = FakeJudge(lambda p: JudgeError("server_error", "HTTP 500"), max_retries=0)
    async with Monitor(
        MonitorConfig(policy=Policy(abort_below=0.9, min_steps=0, patience=1)), judge=judge
    ) as mon:
        await mon.handle("agents/r/start", j(task="t"))
        for i in range(1, 4):
            await mon.handle("agents/r/step", j(index=i, text=f"s{i}"))
            await mon.drain()
        msgs = drained(mon.outbox)
    progress = of(msgs, "progress", "r")
    assert progress and all(
        p["score"] is None and p["ok"] is False and p["reason"] == "server_error" for p in progress
    )
    assert not [m for m in msgs if m.topic.endswith("/signal")]


async def test_bad_events_are_reported_counted_and_other_runs_go_on() -> None:
    reg = CollectorRegistry()
    async with Monitor(judge=FakeJudge(), registry=reg) as mon:
        await mon.handle("agents/good/start", j(task="t"))
        await mon.handle("agents/good/step", b"{not json")
        await mon.handle("agents/good/step", j(index="one", text="x"))
        await mon.handle("agents/a/b/c/step", j(text="x"))
        await mon.handle("agents/good/step", j(index=1, text="fine"))
        await mon.handle("agents/good/start", j(task="another task"))
        await mon.handle("agents/nobody/end", j())
        await mon.drain()
        msgs = drained(mon.outbox)
    errors = of(msgs, "error")
    assert [e["reason"] for e in errors] == [
        "bad_json",
        "invalid",
        "bad_topic",
        "duplicate_start",
        "unknown_run",
    ]
    assert [m.topic for m in msgs if "error" in m.topic][2] == "agents/_errors"
    assert of(msgs, "progress", "good")[-1]["step"] == 1
    assert reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "bad_json"}) == 1
    assert reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "invalid"}) == 1
    assert reg.get_sample_value("agent_monitor_events_total", {"type": "step"}) == 1


async def test_redelivered_start_is_silent_and_idle_runs_expire() -> None:
    clock = Clock()
    config = MonitorConfig(limits=RunLimits(idle_timeout_s=60), sweep_interval_s=3600)
    async with Monitor(config, judge=FakeJudge(), clock=clock) as mon:
        await mon.handle("agents/r/start", j(task="t", labels={"team": "a"}))
        await mon.handle("agents/r/start", j(task="t", labels={"team": "a"}))
        assert not of(drained(mon.outbox), "error")
        clock.t += 61
        await mon.sweep()
        assert "r" not in mon.book.live
        assert [m.payload for m in drained(mon.outbox) if m.topic == "agents/r/signal"] == [b""]
        assert mon.metrics.runs.labels("expired")._value.get() == 1
        await mon.handle("agents/r/step", j(index=1, text="late"))
        assert [e["reason"] for e in of(drained(mon.outbox), "error")] == ["run_ended"]


async def test_end_waits_for_the_last_scoring() -> None:
    judge = FakeJudge(latency_s=0.05)
    async with Monitor(judge=judge) as mon:
        await mon.handle("agents/r/start", j(task="t"))
        await mon.handle("agents/r/step", j(index=1, text="a"))
        await mon.handle("agents/r/step", j(index=2, text="b"))
        await mon.handle("agents/r/end", j(outcome="success"))
        await mon.drain()
        msgs = drained(mon.outbox)
    assert of(msgs, "progress", "r")[-1]["step"] == 2
    assert msgs[-1].topic == "agents/r/signal" and msgs[-1].payload == b""


async def test_run_cap_evicts_the_idlest_run() -> None:
    clock = Clock()
    async with Monitor(
        MonitorConfig(limits=RunLimits(max_runs=2)), judge=FakeJudge(), clock=clock
    ) as mon:
        for name in ("a", "b"):
            await mon.handle(f"agents/{name}/start", j(task="t"))
            clock.t += 1
        await mon.handle("agents/a/step", j(index=1, text="a is active"))
        clock.t += 1
        await mon.handle("agents/c/start", j(task="t"))
        assert set(mon.book.live) == {"a", "c"}
        assert [e["reason"] for e in of(drained(mon.outbox), "error", "b")] == ["evicted"]


@pytest.mark.parametrize("n_runs", [200])
async def test_many_runs_at_once(n_runs: int) -> None:
    judge = FakeJudge(latency_s=0.001)
    async with Monitor(MonitorConfig(max_concurrency=8), judge=judge) as mon:
        for r in range(n_runs):
            await mon.handle(f"agents/run-{r}/start", j(task=f"task {r}"))
        for i in range(1, 4):
            for r in range(n_runs):
                await mon.handle(f"agents/run-{r}/step", j(index=i, text=f"run {r} step {i}"))
        await mon.drain()
        msgs = drained(mon.outbox)
    last = {}
    for m in msgs:
        if m.topic.endswith("/progress"):
            p = json.loads(m.payload)
            last[p["run_id"]] = p["step"]
    assert len(last) == n_runs and set(last.values()) == {3}


async def test_the_daemons_judge_calls_carry_their_run_id() -> None:
    judge = FakeJudge()
    async with Monitor(MonitorConfig(max_concurrency=1), judge=judge) as mon:
        for run in ("ra", "rb"):
            await mon.handle(f"agents/{run}/start", j(task=f"task of {run}"))
        for i in (1, 2):
            for run in ("ra", "rb"):
                await mon.handle(f"agents/{run}/step", j(index=i, text=f"{run} step {i}"))
        await mon.drain()
    keys = {(r.run_key, "task of ra" in r.prompt.prefix_text()) for r in judge.requests}
    assert keys == {("ra", True), ("rb", False)}
