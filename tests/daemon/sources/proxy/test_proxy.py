"""The LLM API proxy: real openai and anthropic SDK clients through it, a scripted upstream, a real
broker and store.

A multi-turn tool-using conversation is one run with one step per turn, scored and published on
MQTT; streams pass through; upstream errors come back unchanged; the API key reaches the upstream
and nothing else; --enforce refuses an aborted run's next request in the API's own error format;
--best-of picks the judged best (or the majority, or the first when the judge is down).
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import structlog

from agent_monitor.daemon import Monitor, MonitorConfig, ProxySettings, ProxySource, SqliteStore
from agent_monitor.daemon.sources._chat import Item, Turn, parse_request
from agent_monitor.daemon.sources.proxy._turns import Conversations, majority, run_key, steps_of
from agent_monitor.judges.base import JudgeError
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.selection import PAIRWISE_INSTRUCTIONS
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings
from tests.brokers import Mosquitto
from tests.daemon.test_daemon_mqtt import Harness, harness
from tests.llm_upstream import Answer, Error, Upstream, upstream

pytestmark = pytest.mark.timeout(120)

SECRET = "sk-proxy-test-7f3a9c1e5b"
SYSTEM = "You are a coding agent. Use the tools."
TASK = "Fix the failing test in a.py"
SCRIPT = [
    Answer("Let me look at the file.", [("read_file", {"path": "a.py"})]),
    Answer("", [("run_tests", {"k": "a"})]),
    Answer("All tests pass now."),
]
TOOL = {"read_file": "def f(): return 1", "run_tests": "1 passed"}


# The agents: each API's SDK in a plain tool loop, as an unmodified agent would run it.

Between = Callable[[int], Awaitable[None]]


async def _nothing(turn: int) -> None:
    return None


async def chat_agent(
    client: openai.AsyncOpenAI, *, stream: bool, between: Between = _nothing, **kw: Any
) -> str:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in TOOL
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK},
    ]
    for turn in range(1, 6):
        if stream:
            text, calls = "", {}  # type: ignore[var-annotated]
            async for chunk in await client.chat.completions.create(
                model="m",
                messages=messages,
                tools=tools,
                stream=True,
                **kw,  # type: ignore[arg-type]
            ):
                if not chunk.choices:
                    continue
                d = chunk.choices[0].delta
                text += d.content or ""
                for tc in d.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    c["name"] += (tc.function.name or "") if tc.function else ""
                    c["arguments"] += (tc.function.arguments or "") if tc.function else ""
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
        else:
            r = await client.chat.completions.create(
                model="m", messages=messages, tools=tools, **kw
            )  # type: ignore[arg-type]
            m = r.choices[0].message
            text = m.content or ""
            tool_calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls or []
                if c.type == "function"
            ]
        messages.append(
            {
                "role": "assistant",
                "content": text or None,
                **({"tool_calls": tool_calls} if tool_calls else {}),
            }
        )
        if not tool_calls:
            return text
        for c in tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": c["id"], "content": TOOL[c["function"]["name"]]}
            )
        await between(turn)
    raise AssertionError("the agent did not finish")


async def messages_agent(
    client: anthropic.AsyncAnthropic, *, stream: bool, between: Between = _nothing
) -> str:
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in TOOL]
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for turn in range(1, 6):
        if stream:
            async with client.messages.stream(
                model="claude-x",
                max_tokens=100,
                system=SYSTEM,
                messages=messages,
                tools=tools,  # type: ignore[arg-type]
            ) as s:
                final = await s.get_final_message()
        else:
            final = await client.messages.create(
                model="claude-x",
                max_tokens=100,
                system=SYSTEM,
                messages=messages,
                tools=tools,  # type: ignore[arg-type]
            )
        blocks = [b.model_dump(exclude_none=True) for b in final.content]
        messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in final.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in final.content if b.type == "text")
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": TOOL[u.name]}
                    for u in uses
                ],
            }
        )
        await between(turn)
    raise AssertionError("the agent did not finish")


async def responses_agent(
    client: openai.AsyncOpenAI, *, stream: bool, between: Between = _nothing
) -> str:
    tools = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in TOOL]
    items: list[Any] = [{"role": "user", "content": TASK}]
    for turn in range(1, 6):
        if stream:
            final = None
            async for event in await client.responses.create(
                model="m",
                instructions=SYSTEM,
                input=items,
                tools=tools,
                stream=True,  # type: ignore[arg-type]
            ):
                if event.type == "response.completed":
                    final = event.response
            assert final is not None
        else:
            final = await client.responses.create(
                model="m", instructions=SYSTEM, input=items, tools=tools
            )  # type: ignore[arg-type]
        calls = [o for o in final.output if o.type == "function_call"]
        items += [o.model_dump(exclude_none=True) for o in final.output]
        if not calls:
            return final.output_text
        items += [
            {"type": "function_call_output", "call_id": c.call_id, "output": TOOL[c.name]}
            for c in calls
        ]
        await between(turn)
    raise AssertionError("the agent did not finish")


# The rig: upstream, broker, monitor with the proxy as its source, SQLite journal.


@dataclass
class Rig:
    up: Upstream
    proxy: ProxySource
    monitor: Monitor
    mqtt: Harness
    store_path: Path
    logs: io.StringIO

    def openai(self, **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(api_key=SECRET, base_url=f"{self.proxy.url}/v1", **kw)

    def anthropic(self, **kw: Any) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(api_key=SECRET, base_url=self.proxy.url, **kw)

    def run_id(self) -> str:
        (rid,) = [r for r in self.proxy.conversations.live]
        return rid

    async def settle(self, run_id: str, steps: int) -> None:
        """Wait until the monitor holds `steps` steps of the run and has scored them all."""

        async def loop() -> None:
            while (v := self.monitor.run(run_id)) is None or len(v.steps) < steps:  # noqa: ASYNC110 - the monitor's state
                await asyncio.sleep(0.01)
            await self.monitor.drain()
            while (v := self.monitor.run(run_id)) is None or v.scored < steps:  # noqa: ASYNC110 - the monitor's state
                await asyncio.sleep(0.01)

        await asyncio.wait_for(loop(), 20)


@asynccontextmanager
async def rig(
    broker: Mosquitto,
    tmp_path: Path,
    *,
    judge: FakeJudge | None = None,
    policy: Policy | None = None,
    **settings: Any,
) -> AsyncIterator[Rig]:
    logs = io.StringIO()
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(logs),
    )
    judge = judge or FakeJudge(lambda p: "P")
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{tmp_path.name}"[:60],
        policy=policy or Policy(),
    )
    store_path = tmp_path / "runs.sqlite3"
    store = SqliteStore(store_path)
    try:
        with upstream() as up:
            # an answer without tool calls is held this long
            settings.setdefault("final_grace_s", 0.3)
            proxy = ProxySource(
                ProxySettings(upstream=up.url, listen="127.0.0.1:0", **settings), judge=judge
            )
            async with (
                proxy,
                Monitor(config, judge=judge, store=store, sources=[proxy]) as monitor,
                harness(broker.port) as h,
            ):
                yield Rig(up, proxy, monitor, h, store_path, logs)
    finally:
        await store.aclose()
        structlog.reset_defaults()


def secret_nowhere(r: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """The API key reached the upstream on every request, and neither the journal nor any log."""
    for s in r.up.seen:
        headers = {k.lower(): v for k, v in s.headers.items()}
        assert SECRET in headers.get("authorization", "") + headers.get("x-api-key", ""), s.path
    assert r.up.seen
    for path in r.store_path.parent.glob("runs.sqlite3*"):
        assert SECRET.encode() not in path.read_bytes(), path
    assert r.store_path.exists()
    assert SECRET not in r.logs.getvalue()
    assert SECRET not in caplog.text


AGENTS = {
    "chat": lambda r, stream, **kw: chat_agent(r.openai(), stream=stream, **kw),
    "responses": lambda r, stream, **kw: responses_agent(r.openai(), stream=stream, **kw),
    "messages": lambda r, stream, **kw: messages_agent(r.anthropic(), stream=stream, **kw),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", sorted(AGENTS))
async def test_a_tool_using_conversation_is_one_run_with_a_step_per_turn_on_mqtt(
    broker: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture, api: str, stream: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    async with rig(broker, tmp_path) as r:
        r.up.add(*SCRIPT)

        async def between(turn: int) -> None:
            # Before request turn+1: the previous request brought turn-1's tool results back (its
            # step), scored before the next one comes, so each step gets its own progress message.
            if turn > 1:
                await r.settle(r.run_id(), turn - 1)

        answer = await AGENTS[api](r, stream, between=between)
        assert answer == "All tests pass now."
        rid = r.run_id()
        assert rid == run_key(SYSTEM, TASK)
        await r.settle(rid, 3)
        view = r.monitor.run(rid)
        assert view is not None and view.task == TASK
        texts = [s.text for s in view.steps]
        assert len(texts) == 3, texts
        assert (
            "Let me look at the file." in texts[0]
            and "read_file" in texts[0]
            and TOOL["read_file"] in texts[0]
        )
        assert "run_tests" in texts[1] and TOOL["run_tests"] in texts[1]
        assert texts[2] == "All tests pass now."
        await r.mqtt.until(lambda: r.mqtt.last_step(rid) == 3)
        assert [p["step"] for p in r.mqtt.progress(rid)] == [1, 2, 3]
        assert all(p["ok"] for p in r.mqtt.progress(rid))
        # The upstream got each request as the agent sent it (its own model, messages, stream flag).
        posts = r.up.posts()
        assert len(posts) == 3 and all(bool(p.body.get("stream")) == stream for p in posts)
        stats = r.proxy.statistics().counts
        assert stats["watched"] == 3 and stats["steps_sent"] == 3 and stats["starts_sent"] == 1
        secret_nowhere(r, caplog)


async def test_models_and_other_paths_are_forwarded_and_upstream_errors_come_back_unchanged(
    broker: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with rig(broker, tmp_path) as r:
        client = r.openai(max_retries=0)
        assert [m.id async for m in client.models.list()] == ["up-model"]
        body = {
            "error": {
                "message": "no such model",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
        r.up.add(Error(404, body, {"x-request-id": "req-42"}))
        with pytest.raises(openai.NotFoundError) as e:
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}]
            )
        assert e.value.status_code == 404 and e.value.body == body["error"]
        assert e.value.response.headers["x-request-id"] == "req-42"
        overloaded = {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "Overloaded"},
        }
        r.up.add(Error(529, overloaded))
        with pytest.raises(anthropic.APIStatusError) as ea:
            await r.anthropic(max_retries=0).messages.create(
                model="claude-x", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
        assert ea.value.status_code == 529 and ea.value.body == overloaded
        # A request the SDK retries after a 500 is the same turn: one step, not two.
        r.up.add(Error(500, {"error": {"message": "boom", "type": "server_error"}}), *SCRIPT)
        answer = await chat_agent(r.openai(max_retries=2), stream=False)
        assert answer == "All tests pass now."
        rid = run_key(SYSTEM, TASK)
        await r.settle(rid, 3)
        view = r.monitor.run(rid)
        assert view is not None and [s.index for s in view.steps] == [1, 2, 3]
        # the two errors, then the retried first request and two more
        assert len(r.up.posts()) == 2 + 4
        assert r.proxy.statistics().counts["upstream_status_500"] == 1
        secret_nowhere(r, caplog)


@pytest.mark.parametrize("api", sorted(AGENTS))
async def test_a_stream_is_passed_on_chunk_by_chunk_not_buffered(
    broker: Mosquitto, tmp_path: Path, api: str
) -> None:
    import httpx2

    async with rig(broker, tmp_path) as r:
        r.up.chunk_delay_s = 0.1
        r.up.add(Answer("a long answer streamed in pieces", [("read_file", {"path": "a.py"})]))
        path = {
            "chat": "/v1/chat/completions",
            "responses": "/v1/responses",
            "messages": "/v1/messages",
        }[api]
        body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 10}
        body |= (
            {"input": TASK}
            if api == "responses"
            else {"messages": [{"role": "user", "content": TASK}]}
        )
        seen_at: list[int] = []
        async with (
            httpx2.AsyncClient(base_url=r.proxy.url) as raw,
            raw.stream("POST", path, json=body) as s,
        ):
            assert s.headers["content-type"].startswith("text/event-stream")
            async for chunk in s.aiter_raw():
                if chunk.strip():
                    seen_at.append(r.up.written)
        total = r.up.written
        # The first event reached the client while the upstream still had events to write.
        # a buffering proxy: seen_at[0] == total
        assert total >= 6 and seen_at[0] < total, (seen_at, total)
        assert len(seen_at) >= 3


async def test_two_agents_on_one_key_are_split_when_their_histories_diverge(
    broker: Mosquitto, tmp_path: Path
) -> None:
    async with rig(broker, tmp_path) as r:
        a, b = r.openai(), r.openai()
        # Turn 1 of both is the same request; their answers differ, so their second requests
        # diverge.
        r.up.add(Answer("A looks.", [("read_file", {"path": "a.py"})]))
        r.up.add(Answer("B looks.", [("read_file", {"path": "b.py"})]))
        r.up.add(Answer("A done."), Answer("B done."))
        results = []
        for client in (a, b):
            results.append(
                await client.chat.completions.create(
                    model="m",
                    messages=[
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": TASK},
                    ],
                )
            )
        for client, res in zip((a, b), results, strict=True):
            m = res.choices[0].message
            assert m.tool_calls
            c = m.tool_calls[0]
            await client.chat.completions.create(
                model="m",
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": TASK},
                    {
                        "role": "assistant",
                        "content": m.content,
                        "tool_calls": [
                            {
                                "id": c.id,
                                "type": "function",
                                "function": {
                                    "name": c.function.name,
                                    "arguments": c.function.arguments,
                                },
                            }
                        ],
                    },  # type: ignore[union-attr]
                    {"role": "tool", "tool_call_id": c.id, "content": "x"},
                ],
            )
        base = run_key(SYSTEM, TASK)
        assert set(r.proxy.conversations.live) == {base, f"{base}-2"}
        assert r.proxy.statistics().splits == 1
        await r.settle(base, 2)
        await r.settle(f"{base}-2", 2)
        one, two = r.monitor.run(base), r.monitor.run(f"{base}-2")
        assert one is not None and two is not None
        assert "A looks." in one.steps[0].text and one.steps[1].text == "A done."
        assert "B looks." in two.steps[0].text and two.steps[1].text == "B done."


async def test_the_run_header_names_the_run(broker: Mosquitto, tmp_path: Path) -> None:
    async with rig(broker, tmp_path) as r:
        r.up.add(*SCRIPT)
        client = r.openai(default_headers={"X-Agent-Monitor-Run": "my-run-1"})
        await chat_agent(client, stream=True)
        await r.settle("my-run-1", 3)
        assert list(r.proxy.conversations.live) == ["my-run-1"]
        assert not any("x-agent-monitor-run" in {k.lower() for k in s.headers} for s in r.up.seen)


# --enforce


@pytest.mark.parametrize("api", sorted(AGENTS))
async def test_enforce_refuses_a_low_scoring_run_at_its_next_request_in_the_apis_format(
    broker: Mosquitto, tmp_path: Path, api: str
) -> None:
    policy = Policy(abort_below=0.5, min_steps=1, patience=1)
    async with rig(
        broker, tmp_path, judge=FakeJudge(lambda p: "B"), policy=policy, enforce=True
    ) as r:
        r.up.add(*SCRIPT)

        async def between(turn: int) -> None:
            if turn == 1:
                return
            await r.settle(r.run_id(), turn - 1)
            await r.mqtt.until(
                lambda: any(
                    s and s.get("signal") == "abort" for s in r.mqtt.seen[(r.run_id(), "signal")]
                )
            )

        error = openai.ConflictError if api != "messages" else anthropic.ConflictError
        with pytest.raises(error) as e:
            await AGENTS[api](r, False, between=between)
        rid = r.run_id()
        assert e.value.status_code == 409
        body = e.value.body
        if api == "messages":
            assert (
                isinstance(body, dict)
                and body["type"] == "error"
                and body["error"]["type"] == "conflict_error"
            )
            message = body["error"]["message"]
        else:
            assert isinstance(body, dict) and body["type"] == "conflict_error"
            message = body["message"]
        assert f"agent-monitor stopped run {rid}" in message and "score is 0." in message
        assert e.value.response.headers["x-should-retry"] == "false"
        # Step 1 (turn 1 and its tool result, brought by request 2) scored low: request 3 was
        # refused, once.
        assert len(r.up.posts()) == 2
        assert r.proxy.statistics().counts["refused"] == 1


@pytest.mark.parametrize("api", sorted(AGENTS))
async def test_enforce_never_refuses_a_run_that_scores_well(
    broker: Mosquitto, tmp_path: Path, api: str
) -> None:
    policy = Policy(abort_below=0.5, min_steps=1, patience=1)
    async with rig(
        broker, tmp_path, judge=FakeJudge(lambda p: "S"), policy=policy, enforce=True
    ) as r:
        r.up.add(*SCRIPT)

        async def between(turn: int) -> None:
            if turn > 1:
                await r.settle(r.run_id(), turn - 1)

        assert await AGENTS[api](r, True, between=between) == "All tests pass now."
        assert r.proxy.statistics().counts.get("refused", 0) == 0
        assert r.monitor.run(r.run_id()) is not None


# --best-of


def best_judge(calls: list[Prompt]) -> FakeJudge:
    """A judge that prefers the trajectory whose last step says BEST (both slot orders agree);
    `calls`: comparisons."""

    def answer(p: Prompt) -> str:
        if p.instructions != PAIRWISE_INSTRUCTIONS:
            return "P"  # the monitor scoring the run's steps (pointwise): not a comparison
        calls.append(p)
        head = "".join(getattr(part, "text", "") for part in p.prefix)
        one, _, two = head.partition("## Trajectory 2")
        if "BEST" in two:
            return "T"
        if "BEST" in one:
            return "A"
        return "K"

    return FakeJudge(answer)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_best_of_3_returns_the_judged_best_with_chats_n(
    broker: Mosquitto, tmp_path: Path, stream: bool
) -> None:
    calls: list[Prompt] = []
    async with rig(broker, tmp_path, judge=best_judge(calls), best_of=3) as r:
        r.up.add([Answer("a plain answer"), Answer("the BEST answer"), Answer("another answer")])
        client = r.openai()
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        if stream:
            text = ""
            async for chunk in await client.chat.completions.create(
                model="m", messages=msgs, stream=True
            ):  # type: ignore[arg-type]
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        else:
            res = await client.chat.completions.create(model="m", messages=msgs)  # type: ignore[arg-type]
            assert len(res.choices) == 1 and res.choices[0].index == 0
            text = res.choices[0].message.content or ""
        assert text == "the BEST answer"
        (post,) = r.up.posts()
        assert post.body["n"] == 3 and "stream" not in post.body
        assert calls, "the judge compared the candidates"
        stats = r.proxy.statistics().counts
        assert (
            stats["best_of_judged"] == 1
            and stats["best_of_candidates"] == 3
            and stats["best_of_judge_calls"] == len(calls)
        )
        await r.settle(r.run_id(), 1)
        view = r.monitor.run(r.run_id())
        assert view is not None and view.steps[0].text == "the BEST answer"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_best_of_3_in_parallel_requests_for_anthropic(
    broker: Mosquitto, tmp_path: Path, stream: bool
) -> None:
    calls: list[Prompt] = []
    async with rig(broker, tmp_path, judge=best_judge(calls), best_of=3) as r:
        r.up.add(
            Answer("first try"),
            Answer("", [("read_file", {"path": "BEST.py"})]),
            Answer("third try"),
        )
        client = r.anthropic()
        kw: dict[str, Any] = {
            "model": "claude-x",
            "max_tokens": 50,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": TASK}],
        }
        if stream:
            async with client.messages.stream(**kw) as s:
                final = await s.get_final_message()
        else:
            final = await client.messages.create(**kw)
        (block,) = final.content
        assert block.type == "tool_use" and block.input == {"path": "BEST.py"}
        assert len(r.up.posts()) == 3 and not any(p.body.get("stream") for p in r.up.posts())
        assert calls and r.proxy.statistics().counts["best_of_judged"] == 1


async def test_best_of_majority_skips_the_judge(broker: Mosquitto, tmp_path: Path) -> None:
    calls: list[Prompt] = []
    async with rig(broker, tmp_path, judge=best_judge(calls), best_of=3) as r:
        r.up.add(Answer("the BEST answer"), Answer("same  answer"), Answer("same answer"))
        res = await r.openai().responses.create(model="m", instructions=SYSTEM, input=TASK)
        # one of the two that agree (arrival order)
        assert " ".join(res.output_text.split()) == "same answer"
        assert calls == [] and r.proxy.statistics().counts["best_of_majority"] == 1
        assert len(r.up.posts()) == 3


async def test_best_of_with_the_judge_down_returns_the_first_candidate(
    broker: Mosquitto, tmp_path: Path
) -> None:
    def down(p: Prompt) -> JudgeError:
        return FakeJudge.failure("unavailable", "judge is down")

    async with rig(broker, tmp_path, judge=FakeJudge(down), best_of=3) as r:
        r.up.add([Answer("one"), Answer("two"), Answer("three")])
        res = await r.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": TASK}]
        )
        assert res.choices[0].message.content == "one"
        assert r.proxy.statistics().counts["best_of_judge_failed"] == 1


# The pure half: reading the formats, keying runs, steps, majority.


def test_requests_of_the_three_apis_read_as_the_same_conversation() -> None:
    chat = parse_request(
        "chat",
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "T"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a":1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "1", "content": "R"},
            ],
        },
    )
    msgs = parse_request(
        "messages",
        {
            "system": [{"type": "text", "text": "S"}],
            "messages": [
                {"role": "user", "content": "T"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm"},
                        {"type": "tool_use", "id": "1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "1",
                            "content": [{"type": "text", "text": "R"}],
                        }
                    ],
                },
            ],
        },
    )
    resp = parse_request(
        "responses",
        {
            "instructions": "S",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "T"}]},
                {"type": "reasoning", "id": "r", "summary": []},
                {"type": "function_call", "call_id": "1", "name": "f", "arguments": '{"a":1}'},
                {"type": "function_call_output", "call_id": "1", "output": "R"},
            ],
        },
    )
    assert chat.items == msgs.items == resp.items
    assert chat.system == msgs.system == resp.system == "S" and chat.task == "T"
    assert steps_of(chat.items) == [('[tool call] f({"a":1})\n[tool result] R', True)]
    with pytest.raises(ValueError):
        parse_request("chat", {"messages": "nope"})


def test_a_retried_request_is_no_new_step_and_a_prefix_of_another_conversation_splits() -> None:
    convs = Conversations(max_conversations=2)

    def req(*items: Item) -> Any:
        return parse_request(
            "chat",
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    *({"role": i.role, "content": i.text} for i in items),
                ]
            },
        )

    r1 = req(Item("user", "T"))
    c = convs.match(r1, None, 0.0)
    # no step yet: no run started for a side request
    assert c is not None and convs.events(c, r1) == []
    done = convs.events(c, r1, Turn("hello"))
    assert [e.kind for e in done] == ["start", "step"] and done[1].data == {
        "index": 1,
        "text": "hello",
    }
    # the retried request's answer is the same step
    assert convs.events(c, r1, Turn("hello again")) == []
    r2 = req(Item("user", "T"), Item("assistant", "hello"), Item("user", "more"))
    c2 = convs.match(r2, None, 1.0)
    assert c2 is c
    # Step 1 went out as it was (no grace): amended once to hold what followed it, not sent again.
    (amended,) = convs.events(c, r2)
    assert amended.kind == "step" and amended.data == {
        "index": 1,
        "text": "hello\n[user] more",
        "amend": True,
    }
    assert convs.events(c, r2) == []
    # a second agent starting the same task: a prefix, not an extension
    c3 = convs.match(r1, None, 2.0)
    assert c3 is not None and c3.run_id == f"{c.run_id}-2" and convs.splits == 1
    assert convs.match(req(Item("user", "other")), None, 3.0) is None and convs.full == 1
    assert [x.run_id for x in convs.expire(3600.0 + 1.5)] == [c.run_id]


def test_majority_needs_more_than_half() -> None:
    assert majority([Turn("a"), Turn(" a "), Turn("b")]) == 0
    assert majority([Turn("a"), Turn("b"), Turn("c")]) is None
    assert majority([Turn("a", (("f", "{}"),)), Turn("a"), Turn("a", (("f", "{}"),))]) == 0
    assert majority([None, None, Turn("a")]) is None


# Bounds and bad input: over a limit a request is forwarded, not watched, and counted; nothing stops
# the proxy.


async def test_over_a_bound_requests_are_forwarded_unwatched_and_counted(
    broker: Mosquitto, tmp_path: Path
) -> None:
    async with rig(
        broker, tmp_path, max_conversations=1, max_conversation_bytes=4000, max_upstream_requests=1
    ) as r:
        client = r.openai(max_retries=0)
        r.up.default = Answer("fine")

        async def ask(task: str, **kw: Any) -> str:
            res = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": task}], **kw
            )
            return res.choices[0].message.content or ""

        assert await ask("first task") == "fine"
        # the table holds one conversation: forwarded, not watched
        assert await ask("second task") == "fine"
        assert await ask("first task" + " padding" * 1000) == "fine"  # over 4,000 bytes: not read
        # One watched request in flight at most: a second one meanwhile is forwarded, not watched.
        r.up.chunk_delay_s = 0.2  # ~1.4 s of stream: the second request comes while it flows

        async def streamed() -> None:
            messages = [{"role": "user", "content": "first task"}]
            async for _ in await client.chat.completions.create(
                model="m", messages=messages, stream=True
            ):  # type: ignore[arg-type]
                pass

        slow = asyncio.create_task(streamed())
        while r.proxy.inflight == 0:  # noqa: ASYNC110 - the proxy's state
            await asyncio.sleep(0.01)
        assert await ask("first task") == "fine"
        r.up.chunk_delay_s = 0.0
        await slow
        stats = r.proxy.statistics().counts
        assert stats["unwatched_conversations"] >= 1 and stats["unwatched_too_large"] == 1
        assert stats["unwatched_busy"] == 1
        assert list(r.proxy.conversations.live) == [run_key("", "first task")]


async def test_bad_input_and_a_client_that_hangs_up_leave_the_proxy_serving(
    broker: Mosquitto, tmp_path: Path
) -> None:
    import httpx2

    async with rig(broker, tmp_path) as r:
        r.up.default = Answer("fine")
        async with httpx2.AsyncClient(base_url=r.proxy.url) as raw:
            res = await raw.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={"content-type": "application/json"},
            )
            # the upstream's
            assert res.status_code == 400 and res.json()["error"]["type"] == "invalid_request_error"
            assert r.proxy.statistics().counts["unwatched_unreadable"] == 1
            r.up.chunk_delay_s = 0.05
            async with raw.stream(
                "POST",
                "/v1/chat/completions",
                json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
            ) as s:
                async for _ in s.aiter_raw():
                    break  # hang up after the first chunk
            r.up.chunk_delay_s = 0.0
        reader, writer = await asyncio.open_connection(
            *r.proxy.url.removeprefix("http://").split(":")
        )
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        assert (await reader.read(100)).startswith(b"HTTP/1.1 400")
        writer.close()
        # An upstream that breaks off mid-stream: the client's stream breaks as well, the proxy goes
        # on.
        r.up.add(Answer("this answer is cut short", cut_after=2))
        with pytest.raises((openai.APIError, httpx2.HTTPError)):
            async for _ in await r.openai(max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            ):
                pass
        assert r.proxy.statistics().counts["upstream_broken"] == 1
        # A responses conversation kept by the provider (previous_response_id) has no history to
        # read: not watched.
        follow = await r.openai().responses.create(
            model="m", previous_response_id="resp_0", input="more"
        )
        assert (
            follow.output_text == "fine"
            and r.proxy.statistics().counts["unwatched_server_history"] == 1
        )
        res2 = await r.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "still there?"}]
        )
        assert res2.choices[0].message.content == "fine"
        assert (
            r.proxy.statistics().counts["bad_http"] == 1
            and r.proxy.statistics().counts.get("proxy_errors", 0) == 0
        )


async def test_an_idle_conversation_ends_its_run(broker: Mosquitto, tmp_path: Path) -> None:
    async with rig(broker, tmp_path, conversation_idle_s=0.4) as r:
        r.up.add(*SCRIPT)
        await chat_agent(r.openai(), stream=False)
        rid = run_key(SYSTEM, TASK)
        await r.mqtt.until(lambda: r.mqtt.last_step(rid) == 3)
        await r.mqtt.until(
            lambda: rid not in r.proxy.conversations.live and r.monitor.run(rid) is None
        )
        assert r.proxy.statistics().counts["ends_sent"] == 1


def test_a_stream_past_the_byte_bound_is_not_read() -> None:
    from agent_monitor.daemon.sources.proxy._turns import StreamTurn

    chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "abcdefghij"}}]}\n\n'
    small = StreamTurn("chat", max_bytes=10 * len(chunk))
    for _ in range(3):
        small.feed(chunk)
    assert small.turn() == Turn("abcdefghij" * 3)
    for _ in range(10):
        small.feed(chunk)
    assert small.turn() is None and len(small._text) == 10  # nothing more held once past the bound


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", sorted(AGENTS))
async def test_a_whole_tool_loop_through_best_of_3(
    broker: Mosquitto, tmp_path: Path, api: str, stream: bool
) -> None:
    # Every turn's three candidates agree (the majority shortcut): the winner's tool calls, replayed
    # as the API's stream when asked, must drive the SDK's agent loop to its end exactly as the
    # upstream's own answer would.
    calls: list[Prompt] = []
    async with rig(broker, tmp_path, judge=best_judge(calls), best_of=3) as r:
        for answer in SCRIPT:
            if api == "chat":
                r.up.add([answer, answer, answer])
            else:
                r.up.add(answer, answer, answer)
        assert await AGENTS[api](r, stream) == "All tests pass now."
        rid = run_key(SYSTEM, TASK)
        await r.settle(rid, 3)
        view = r.monitor.run(rid)
        assert view is not None and len(view.steps) == 3 and TOOL["run_tests"] in view.steps[1].text
        assert calls == [] and r.proxy.statistics().counts["best_of_majority"] == 3


def test_the_proxys_statistics_are_prometheus_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    proxy = ProxySource(ProxySettings(upstream="http://127.0.0.1:9/v1"), registry=registry)
    proxy.counts["requests"] += 3
    proxy.counts["unwatched_busy"] += 1
    text = generate_latest(registry).decode()
    assert "agent_monitor_proxy_requests_total 3.0" in text
    assert "agent_monitor_proxy_unwatched_busy_total 1.0" in text
    assert "# TYPE agent_monitor_proxy_live_conversations gauge" in text
    with pytest.raises(ValueError, match="needs a judge"):
        ProxySource(ProxySettings(upstream="http://127.0.0.1:9/v1", best_of=3))
    with pytest.raises(ValueError, match="not HOST:PORT"):
        ProxySettings(upstream="http://127.0.0.1:9/v1", listen="nowhere")
