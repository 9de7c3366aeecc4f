"""Bounded work per event: a start's rubric size, judge calls per step and per run per minute
(issue 27, item 1)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.criteria import load_criteria
from agent_monitor.daemon import HttpServer, MemoryStore, Monitor, MonitorConfig
from agent_monitor.daemon._config import WorkLimits
from agent_monitor.daemon.sinks import Message
from agent_monitor.prompts import INSTRUCTIONS, Step, build_prompt
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, EventError, decode_event
from agent_monitor.wire._limits import (
    MAX_CRITERIA,
    MAX_CRITERION_BYTES,
    MAX_STEP_CHARS,
    MAX_TASK_CHARS,
)
from tests.brokers import Mosquitto
from tests.daemon.sinks.test_board import get
from tests.daemon.test_daemon_mqtt import harness

pytestmark = pytest.mark.timeout(120)


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def many(n: int) -> dict[str, str]:
    return {
        f"c{i}": f"criterion {i}: is the agent doing thing number {i} well enough" for i in range(n)
    }


def errors(mon: Monitor) -> list[dict[str, Any]]:
    msgs: list[Message] = []
    while (m := mon.outbox.get_nowait()) is not None:
        msgs.append(m)
    return [
        json.loads(m.payload) for m in msgs if m.topic.endswith("/error") or "_errors" in m.topic
    ]


def rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_start_over_a_rubric_bound_is_refused_on_decode_with_the_bound_named() -> None:
    with pytest.raises(EventError) as e:
        decode_event("agents/r/start", j(task="t", criteria=many(10_000)))
    assert "10000 criteria" in e.value.message and "max_criteria" in e.value.message
    with pytest.raises(EventError) as e:
        decode_event("agents/r/start", j(task="t", criteria={"a": "x" * (MAX_CRITERION_BYTES + 1)}))
    assert "max_criterion_bytes" in e.value.message
    big = {f"c{i}": "y" * (MAX_CRITERION_BYTES - 20) for i in range(MAX_CRITERIA)}
    with pytest.raises(EventError) as e:
        decode_event("agents/r/start", j(task="t", criteria=big))
    assert "max_rubric_bytes" in e.value.message
    # The rubric-config and list forms are counted the same way.
    with pytest.raises(EventError, match="max_criteria"):
        decode_event("agents/r/start", j(task="t", criteria={"criteria": list(many(17).values())}))
    with pytest.raises(EventError, match="max_criteria"):
        decode_event("agents/r/start", j(task="t", criteria=list(many(17).values())))
    # At the bound it is fine.
    _, start = decode_event("agents/r/start", j(task="t", criteria=many(MAX_CRITERIA)))
    assert len(start.rubric().criteria) == MAX_CRITERIA  # type: ignore[union-attr]


async def test_the_bounds_are_the_monitors_config_and_a_refused_start_costs_no_judge_call() -> None:
    reg = CollectorRegistry()
    judge = FakeJudge()
    config = MonitorConfig(
        work=WorkLimits(
            max_criteria=2, max_judge_calls_per_step=4, max_judge_calls_per_run_minute=8
        )
    )
    async with Monitor(config, judge=judge, registry=reg, store=MemoryStore()) as mon:
        await mon.handle("agents/wide/start", j(task="t", criteria=many(3)))
        await mon.handle("agents/wide/step", j(index=1, text="x"))
        await mon.drain()
        errs = errors(mon)
        assert (
            errs[0]["reason"] == "invalid"
            and ("3 criteria, over the limit of 2 (max_criteria)") in errs[0]["error"]
        )
        assert mon.run("wide") is None and judge.calls_made == 0
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "invalid"}) == 1
        )
    # Judge calls per step: judged criteria x repeats.
    config = MonitorConfig(
        repeats=3, work=WorkLimits(max_judge_calls_per_step=4, max_judge_calls_per_run_minute=8)
    )
    async with Monitor(config, judge=judge, store=MemoryStore()) as mon:
        await mon.handle("agents/deep/start", j(task="t", criteria=many(2)))
        await mon.handle("agents/deep/step", j(index=1, text="x"))
        await mon.drain()
        errs = errors(mon)
        assert errs[0]["reason"] == "run_rejected", errs
        assert "2 judged criteria x 3 repeats = 6 judge calls per step" in errs[0]["error"]
        assert "max_judge_calls_per_step" in errs[0]["error"]
        assert mon.run("deep") is None and judge.calls_made == 0
    with pytest.raises(ValueError, match="below max_judge_calls_per_step"):
        WorkLimits(max_judge_calls_per_step=10, max_judge_calls_per_run_minute=5)


async def test_every_criterion_is_in_the_shared_head_and_each_tail_names_only_its_own() -> None:
    judge = FakeJudge()
    crit = {f"c{i}": f"unique-description-{i}." for i in range(MAX_CRITERIA)}
    async with Monitor(judge=judge, store=MemoryStore()) as mon:
        await mon.handle("agents/r/start", j(task="t", criteria=crit))
        await mon.handle("agents/r/step", j(index=1, text="x"))
        await mon.drain()
    assert len(judge.prompts) == MAX_CRITERIA  # one call per criterion per step, not more
    heads = {p.prefix_text() for p in judge.prompts}
    # one head for every criterion's call: a prefix cache reads the descriptions once
    assert len(heads) == 1
    assert all(d in next(iter(heads)) for d in crit.values())
    for p in judge.prompts:
        tail = p.text()[len(p.prefix_text()) :]
        assert f"'{p.criterion}'" in tail and not any(d in tail for d in crit.values())


def test_worst_case_prompt_of_one_event_is_bounded_by_the_limits() -> None:
    # The largest start (MAX_CRITERIA criteria of MAX_CRITERION_BYTES, a MAX_TASK_CHARS task) and
    # the largest step: one scoring makes MAX_CRITERIA calls (x repeats), each prompt instructions +
    # task + every criterion (the shared head) + trajectory + a tail that names its criterion only:
    # what a call adds beyond the shared prefix stays a line, whatever the number of criteria (the
    # tail carried the criterion's text before).
    desc = "d" * (MAX_CRITERION_BYTES - 40)
    rubric = load_criteria({f"c{i:02d}": desc + str(i) for i in range(MAX_CRITERIA)})
    task = "t" * MAX_TASK_CHARS
    steps = [Step(1, "s" * MAX_STEP_CHARS)]
    prompts = [build_prompt(task, rubric, steps, c) for c in rubric.criteria]
    bound = (
        len(INSTRUCTIONS)
        + MAX_TASK_CHARS
        + MAX_STEP_CHARS
        + MAX_CRITERIA * (MAX_CRITERION_BYTES + 40)
        + 600
    )
    assert max(len(p.text()) for p in prompts) <= bound
    assert len({p.prefix_text() for p in prompts}) == 1
    assert max(len(p.text()) - len(p.prefix_text()) for p in prompts) <= 300


async def test_judge_calls_per_run_per_minute_are_capped_and_the_steps_coalesce() -> None:
    now = [1000.0]
    judge = FakeJudge()
    config = MonitorConfig(
        work=WorkLimits(max_judge_calls_per_step=2, max_judge_calls_per_run_minute=3)
    )
    async with Monitor(config, judge=judge, store=MemoryStore(), clock=lambda: now[0]) as mon:
        await mon.handle("agents/r/start", j(task="t", criteria={"a": "is a"}))
        for i in range(1, 7):
            await mon.handle("agents/r/step", j(index=i, text=f"step {i}"))
            await mon.drain()
        assert judge.calls_made == 3  # the minute's budget: steps 4..6 wait
        stats = mon.status()["judge_rate"]
        assert stats["delayed"] >= 1 and stats["waiting"] == 1
        view = mon.run("r")
        assert view is not None and view.latest is not None and view.latest.step == 3
        now[0] += 61  # the window moved on: the waiting run is scored once, its newest prefix
        await mon.sweep()
        await mon.drain()
        assert judge.calls_made == 4
        view = mon.run("r")
        assert view is not None and view.latest is not None and view.latest.step == 6


async def test_ten_thousand_criteria_over_mqtt_are_refused_with_rss_flat_and_metrics_answering(
    broker: Mosquitto,
) -> None:
    reg = CollectorRegistry()
    judge = FakeJudge()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url), client_id=f"mon-{broker.port}"
    )
    payload = j(task="flood", criteria=many(10_000))
    assert len(payload) > 600_000
    async with (
        HttpServer(reg, port=0) as web,
        Monitor(config, judge=judge, registry=reg),
        harness(broker.port) as h,
    ):
        await h.publish("honest", "start", {"task": "t"})
        await h.publish("honest", "step", {"index": 1, "text": "warm up"})
        await h.until(lambda: h.last_step("honest") == 1)
        before = rss_kb()
        for k in range(10):
            await h.publish(f"flood{k}", "start", raw=payload)
            await h.publish(f"flood{k}", "step", {"index": 1, "text": "x"})
        await h.until(lambda: sum(len(h.seen[(f"flood{k}", "error")]) for k in range(10)) >= 20, 60)
        reply = await get(web.port, "/metrics")
        assert reply.status == 200 and b"agent_monitor_invalid_events_total" in reply.body
        grown_mb = (rss_kb() - before) / 1024
        assert grown_mb < 100, f"RSS grew {grown_mb:.0f} MB for 10 refused 10,000-criteria starts"
        first = h.seen[("flood0", "error")][0]
        assert first["reason"] == "invalid" and "max_criteria" in first["error"]
        await h.publish("honest", "step", {"index": 2, "text": "still here"})
        await h.until(lambda: h.last_step("honest") == 2)
        assert judge.calls_made == 2  # the floods reached the judge not once
        await asyncio.sleep(0)
