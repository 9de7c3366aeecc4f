"""Judge outages: the circuit breaker fails fast, reports degraded, probes, recovers; an outage never aborts a run."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.daemon._outbox import Message
from agent_monitor.judges.base import JudgeError, JudgeRequest
from agent_monitor.judges.circuit import CircuitJudge
from agent_monitor.judges.openai import OpenAIJudge
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.testing import FakeJudge
from tests.openai_server import Reply, chat_choice, chat_reply, scripted_server


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def until(check: Any, within_s: float = 10.0) -> None:
    async with asyncio.timeout(within_s):
        while not check():  # noqa: ASYNC110 - the condition is set by the HTTP server's thread
            await asyncio.sleep(0.01)


def request() -> JudgeRequest:
    return JudgeRequest(prompt=Prompt(instructions="i", prefix=[], tail=[], criterion="c", step=1))


async def test_breaker_opens_fails_fast_probes_and_closes() -> None:
    clock = Clock()
    down = {"on": True}
    judge = FakeJudge(
        lambda p: JudgeError("connection", "refused", retryable=True) if down["on"] else "K", max_retries=0
    )
    changes: list[bool] = []
    c = CircuitJudge(judge, threshold=3, cooldown_s=10, clock=clock, on_change=changes.append)
    for _ in range(3):
        try:
            await c.grade(request())
        except JudgeError as e:
            assert e.reason == "connection"
    assert c.degraded and changes == [True] and len(judge.prompts) == 3
    # Open: calls fail fast without touching the dead backend.
    for _ in range(5):
        try:
            await c.grade(request())
        except JudgeError as e:
            assert e.reason == "judge_unavailable" and "3 times in a row" in str(e)
    assert len(judge.prompts) == 3
    # After the cool-down one probe goes through; it fails, and the cool-down doubles.
    clock.t += 10
    try:
        await c.grade(request())
    except JudgeError as e:
        assert e.reason == "connection"
    assert len(judge.prompts) == 4 and c.open_until == clock.t + 20
    down["on"] = False
    clock.t += 20
    await c.grade(request())
    assert not c.degraded and changes == [True, False] and c.failures_in_row == 0


async def test_request_errors_do_not_trip_the_breaker() -> None:
    judge = FakeJudge(lambda p: JudgeError("bad_request", "HTTP 400"), max_retries=0)
    c = CircuitJudge(judge, threshold=2)
    for _ in range(5):
        with contextlib.suppress(JudgeError):
            await c.grade(request())
    assert not c.degraded and len(judge.prompts) == 5


def drained(mon: Monitor) -> list[Message]:
    out = []
    while (m := mon.outbox.get_nowait()) is not None:
        out.append(m)
    return out


def progress(msgs: list[Message]) -> list[dict[str, Any]]:
    return [json.loads(m.payload) for m in msgs if m.topic.endswith("/progress")]


async def test_outage_over_http_degrades_then_resumes_without_false_abort() -> None:
    """A real OpenAI-compatible server answering 503 for a while, then well; the policy would abort any low score."""
    state = {"down": True, "calls": 0}

    def reply(body: dict[str, Any]) -> Reply:
        state["calls"] += 1
        if state["down"]:
            return Reply(503, {"error": {"message": "overloaded"}})
        return chat_reply(chat_choice([("S", {"S": 1.0})]))  # 18/19: doing well

    reg = CollectorRegistry()
    with scripted_server() as server:
        server.default = reply
        judge = OpenAIJudge(base_url=server.url, model="m", max_retries=0)
        policy = Policy(abort_below=0.5, min_steps=0, patience=1)
        config = MonitorConfig(policy=policy, circuit_threshold=2, circuit_cooldown_s=0.5, max_concurrency=1)
        async with Monitor(config, judge=judge, registry=reg) as mon:
            await mon.handle("agents/r/start", json.dumps({"task": "t"}).encode())
            for i in range(1, 3):  # one failed call per step: two in a row open the circuit
                await mon.handle("agents/r/step", json.dumps({"index": i, "text": f"s{i}"}).encode())
                await until(lambda i=i: state["calls"] == i)
            await until(lambda: mon.circuit.degraded)
            assert reg.get_sample_value("agent_monitor_judge_degraded") == 1
            calls_when_open = state["calls"]
            # Steps keep coming during the outage: held, not spent on certain failures ...
            for i in range(3, 9):
                await mon.handle("agents/r/step", json.dumps({"index": i, "text": f"s{i}"}).encode())
            await asyncio.sleep(0.2)
            assert state["calls"] == calls_when_open
            # ... until the cool-down ends: one probe, which fails, and the next cool-down is longer.
            await until(lambda: state["calls"] == calls_when_open + 1)
            assert mon.circuit.degraded
            failed = progress(drained(mon))
            assert failed and not any(p["ok"] for p in failed) and failed[-1]["degraded"] is True
            state["down"] = False
            await asyncio.wait_for(mon.drain(), 10)
            msgs = drained(mon)
    back = progress(msgs)
    assert back[-1]["ok"] is True and back[-1]["step"] == 8 and back[-1]["degraded"] is False
    # The steps that waited out the outage, and the one whose probe failed, are folded into one score.
    assert [p["step"] for p in back if p["ok"]] == [8] and next(p for p in back if p["ok"])["coalesced"] == 8
    assert not [m for m in msgs if m.topic.endswith("/signal")]  # no abort from the outage
    assert reg.get_sample_value("agent_monitor_judge_degraded") == 0
    assert reg.get_sample_value("agent_monitor_signals_total", {"signal": "abort"}) == 0
