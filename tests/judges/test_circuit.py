"""Judge outages: the circuit breaker fails fast, reports degraded, probes, recovers; an outage
never aborts a run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry

from agent_monitor.cli._main import JudgeOptions, build_judge
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.daemon.sinks import Message
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
        lambda p: JudgeError("connection", "refused", retryable=True) if down["on"] else "K",
        max_retries=0,
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
    """A real OpenAI-compatible server answering 503 for a while, then well; the policy would
    abort any low score."""
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
        config = MonitorConfig(
            policy=policy, circuit_threshold=2, circuit_cooldown_s=0.5, max_concurrency=1
        )
        async with Monitor(config, judge=judge, registry=reg) as mon:
            await mon.handle("agents/r/start", json.dumps({"task": "t"}).encode())
            for i in range(1, 3):  # one failed call per step: two in a row open the circuit
                await mon.handle(
                    "agents/r/step", json.dumps({"index": i, "text": f"s{i}"}).encode()
                )
                await until(lambda i=i: state["calls"] == i)
            await until(lambda: mon.circuit.degraded)
            assert reg.get_sample_value("agent_monitor_judge_degraded") == 1
            calls_when_open = state["calls"]
            # Steps keep coming during the outage: held, not spent on certain failures ...
            for i in range(3, 9):
                await mon.handle(
                    "agents/r/step", json.dumps({"index": i, "text": f"s{i}"}).encode()
                )
            await asyncio.sleep(0.2)
            assert state["calls"] == calls_when_open
            # ... until the cool-down ends: one probe, which fails, and the next cool-down is
            # longer.
            await until(lambda: state["calls"] == calls_when_open + 1)
            assert mon.circuit.degraded
            failed = progress(drained(mon))
            assert failed and not any(p["ok"] for p in failed) and failed[-1]["degraded"] is True
            state["down"] = False
            await asyncio.wait_for(mon.drain(), 10)
            msgs = drained(mon)
    back = progress(msgs)
    assert back[-1]["ok"] is True and back[-1]["step"] == 8 and back[-1]["degraded"] is False
    # The steps that waited out the outage, and the one whose probe failed, are folded into one
    # score.
    assert [p["step"] for p in back if p["ok"]] == [8] and next(p for p in back if p["ok"])[
        "coalesced"
    ] == 8
    assert not [m for m in msgs if m.topic.endswith("/signal")]  # no abort from the outage
    assert reg.get_sample_value("agent_monitor_judge_degraded") == 0
    assert reg.get_sample_value("agent_monitor_signals_total", {"signal": "abort"}) == 0


# -- a judge that hangs
# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def hanging_server() -> Iterator[str]:
    """An OpenAI-compatible base URL whose server takes connections and never answers (a wedged
    judge)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # the kernel completes the handshakes; nothing ever reads or replies
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        sock.close()


async def test_a_hanging_judge_is_degraded_within_two_timeouts_with_the_default_retries() -> None:
    """The daemon as `serve --judge openai --judge-timeout 0.5` builds it: default retries,
    circuit and config."""
    timeout = 0.5
    reg = CollectorRegistry()
    with hanging_server() as url:
        judge = build_judge(
            JudgeOptions(judge="openai", judge_url=url, judge_model="m", judge_timeout=timeout)
        )
        # one failed call: 4 timeouts plus backoff
        assert judge.max_retries == 3 and judge.backoff_s > 0
        async with Monitor(MonitorConfig(), judge=judge, registry=reg) as mon:
            assert mon.circuit.threshold == 5  # the old rule alone: 5 such calls, about 20 timeouts
            await mon.handle("agents/r/start", json.dumps({"task": "t"}).encode())
            start = time.monotonic()
            await mon.handle("agents/r/step", json.dumps({"index": 1, "text": "s1"}).encode())
            await until(lambda: mon.circuit.degraded, within_s=3 * timeout)
            took = time.monotonic() - start
            assert reg.get_sample_value("agent_monitor_judge_degraded") == 1
            # Reported while the first call is still retrying: no call has even failed yet.
            assert (
                reg.get_sample_value(
                    "agent_monitor_judge_calls_total", {"judge": "openai", "outcome": "error"}
                )
                == 0
            )
            assert mon.circuit.failures_in_row == 0 and "no answer" in str(mon.circuit.last_error)
        await judge.aclose()
    assert 2 * timeout - 0.05 <= took < 3 * timeout


async def test_a_judge_that_answers_again_closes_the_circuit_it_opened_by_hanging() -> None:
    state = {"hang": True}

    def reply(body: dict[str, Any]) -> Reply:
        if state["hang"]:
            return Reply(delay_s=5.0)  # far past the timeout: the client gives up first
        return chat_reply(chat_choice([("S", {"S": 1.0})]))

    changes: list[bool] = []
    with scripted_server() as server:
        server.default = reply
        judge = OpenAIJudge(base_url=server.url, model="m", timeout_s=0.3)
        c = CircuitJudge(judge, on_change=changes.append)
        assert c.silence_s == 0.6
        call = asyncio.create_task(c.grade(request()))
        await until(lambda: c.degraded, within_s=2.0)
        assert changes == [True] and not call.done()
        state["hang"] = False
        # The call in flight retries, gets its answer, and that closes the circuit.
        resp = await asyncio.wait_for(call, 10)
        assert (
            resp.attempts > 1
            and not c.degraded
            and changes == [True, False]
            and c.state == "closed"
        )
        await c.aclose()


async def test_failing_calls_add_up_to_silence_and_idle_time_does_not() -> None:
    judge = FakeJudge(lambda p: FakeJudge.failure("timeout"), latency_s=0.3, max_retries=0)
    c = CircuitJudge(judge, silence_s=0.5)  # threshold 5: only the silence rule can open it here
    with contextlib.suppress(JudgeError):
        await c.grade(request())
    assert not c.degraded
    await asyncio.sleep(0.6)  # idle: no call waits, so the judge is not "silent" meanwhile
    second = asyncio.create_task(c.grade(request()))
    await asyncio.sleep(0.05)
    assert not c.degraded  # 0.35 s of waiting so far, not 0.95 s of wall time
    with contextlib.suppress(JudgeError):
        await second
    assert c.degraded and "gave no answer" in c._why  # 0.6 s of waiting without an answer
    await c.aclose()


async def test_a_storm_of_bad_requests_never_degrades_but_the_same_storm_of_outages_does() -> None:
    async def storm(error: JudgeError) -> CircuitJudge:
        judge = FakeJudge(lambda p: error, latency_s=0.1, max_retries=0)
        c = CircuitJudge(judge, threshold=100, silence_s=0.25)
        for _ in range(6):  # 0.6 s of calls, back to back
            with contextlib.suppress(JudgeError):
                await c.grade(request())
        await c.aclose()
        return c

    # each 400 is an answer
    assert not (await storm(JudgeError("bad_request", "HTTP 400: bad prompt"))).degraded
    assert (await storm(JudgeError("server_error", "HTTP 503", retryable=True))).degraded


async def test_the_circuit_counts_only_the_calls_that_reach_the_judge_with_their_wall_time_and_tokens() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    clock = Clock()
    down = {"on": False}
    judge = FakeJudge(
        lambda p: JudgeError("connection", "refused", retryable=True) if down["on"] else "K",
        max_retries=0,
        latency_s=0.03,
    )
    c = CircuitJudge(judge, threshold=2, cooldown_s=10, clock=clock)
    await c.grade(request())
    down["on"] = True
    for _ in range(2):
        with contextlib.suppress(JudgeError):
            await c.grade(request())
    assert c.degraded
    for _ in range(3):  # refused while open: not judge calls
        with contextlib.suppress(JudgeError):
            await c.grade(request())
    stats = c.statistics()
    assert (stats.calls_ok, stats.calls_failed) == (1, 2)
    counts, bounds = stats.latency_counts, stats.latency_buckets
    assert sum(counts) == 3 and len(counts) == len(bounds) + 1
    # 30 ms a call: every one over 0.025 s and within 0.05 s.
    assert counts[bounds.index(0.05)] == 3 and 0.09 <= stats.latency_sum < 1.0
    assert stats.input_tokens == judge.usage.input_tokens > 0 and stats.output_tokens == 1
