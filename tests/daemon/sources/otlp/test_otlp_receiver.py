"""The OTLP traces receiver: the real OpenTelemetry SDK exporter (and hand-written bodies) over a
real socket.

A trace is a run: its spans become the run's start, steps and end, scored like MQTT input. The
agents here are synthetic traces following the GenAI semantic conventions, sent by the SDK's own
OTLP/HTTP span exporter; the bodies written by hand follow the OTLP/JSON mapping (hex ids).
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import (
    MemoryStore,
    Monitor,
    MonitorConfig,
    MonitorEvent,
    OtlpReceiver,
    OtlpReceiverSettings,
    RunClosed,
    RunStore,
    SqliteStore,
)
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto, free_port

pytestmark = pytest.mark.timeout(120)

TASK = "What is the weather in Paris? Answer in Celsius."


# -- the pieces --


@asynccontextmanager
async def receiving(
    judge: FakeJudge | None = None,
    *,
    store: RunStore | None = None,
    registry: CollectorRegistry | None = None,
    config: MonitorConfig | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[Monitor, OtlpReceiver, list[MonitorEvent]]]:
    """A Monitor with an OTLP receiver on a free port, no broker; every monitor event is
    collected."""
    reg = registry if registry is not None else CollectorRegistry()
    receiver = OtlpReceiver(OtlpReceiverSettings(address="127.0.0.1:0", **settings), registry=reg)
    config = config or MonitorConfig(policy=Policy())
    events: list[MonitorEvent] = []
    async with Monitor(
        config,
        judge=judge or FakeJudge(),
        store=store or MemoryStore(),
        registry=reg,
        sources=[receiver],
        sinks=[events.append],
    ) as monitor:
        await asyncio.wait_for(receiver.ready.wait(), 10)
        yield monitor, receiver, events


@contextmanager
def sdk(url: str) -> Iterator[trace.Tracer]:
    """The real SDK: a TracerProvider exporting each span as it ends with the OTLP/HTTP
    (protobuf) exporter."""
    provider = TracerProvider(resource=Resource.create({"service.name": "weather-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=10)))
    try:
        yield provider.get_tracer("synthetic-agent")
    finally:
        provider.shutdown()


def user(text: str) -> str:
    return json.dumps([{"role": "user", "parts": [{"type": "text", "content": text}]}])


class Agent:
    """A synthetic agent whose trace follows the GenAI conventions: invoke_agent, then chat and
    execute_tool children."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        self.root: trace.Span | None = None
        self.spans: dict[str, trace.Span] = {}

    def begin(self) -> None:
        self.root = self.tracer.start_span(
            "invoke_agent weather",
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": "weather",
                "gen_ai.input.messages": user(TASK),
            },
        )

    def child(self, name: str, attributes: dict[str, Any], *, end: bool = True) -> trace.Span:
        assert self.root is not None
        span = self.tracer.start_span(
            name, context=trace.set_span_in_context(self.root), attributes=attributes
        )
        self.spans[name] = span
        if end:
            span.end()
        return span

    def chat_calls_tool(self) -> None:
        out = [
            {
                "role": "assistant",
                "parts": [
                    {"type": "tool_call", "name": "get_weather", "arguments": {"city": "Paris"}}
                ],
            }
        ]
        self.child(
            "chat gpt-x",
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.input.messages": user(TASK),
                "gen_ai.output.messages": json.dumps(out),
            },
        )

    def tool(self) -> None:
        self.child(
            "execute_tool get_weather",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "get_weather",
                "gen_ai.tool.call.arguments": '{"city": "Paris"}',
                "gen_ai.tool.call.result": '{"temp_f": 68}',
            },
        )

    def chat_answers(self) -> None:
        # The deprecated form (gen_ai.completion): still read.
        completion = json.dumps([{"role": "assistant", "content": "It is 20 °C in Paris."}])
        self.child(
            "chat gpt-x final", {"gen_ai.operation.name": "chat", "gen_ai.completion": completion}
        )

    def end(self, *, error: bool = False, outcome: str | None = None) -> None:
        assert self.root is not None
        if outcome is not None:
            self.root.set_attribute("agent_monitor.outcome", outcome)
        if error:
            self.root.set_status(Status(StatusCode.ERROR, "the agent gave up"))
        self.root.end()

    @property
    def trace_id(self) -> str:
        assert self.root is not None
        return f"{self.root.get_span_context().trace_id:032x}"


def by_step(prompt: Any) -> str:
    return {1: "E", 2: "J", 3: "R"}.get(prompt.step, "T")


async def until(check: Callable[[], bool], wait_s: float = 30.0) -> None:
    async with asyncio.timeout(wait_s):
        while not check():  # noqa: ASYNC110 - set by other tasks and threads
            await asyncio.sleep(0.02)


def closed(events: list[MonitorEvent], run_id: str) -> RunClosed | None:
    return next((e for e in events if isinstance(e, RunClosed) and e.run_id == run_id), None)


def texts(monitor: Monitor, run_id: str) -> list[str]:
    view = monitor.run(run_id)
    return [s.text for s in view.steps] if view is not None else []


# -- the real SDK, in process --


async def test_a_genai_trace_from_the_sdk_exporter_is_a_run_scored_step_by_step() -> None:
    judge = FakeJudge(by_step)
    async with receiving(judge) as (monitor, receiver, events):
        with sdk(receiver.url) as tracer:
            agent = Agent(tracer)
            await asyncio.to_thread(agent.begin)
            run_id = agent.trace_id
            for i, act in enumerate((agent.chat_calls_tool, agent.tool, agent.chat_answers), 1):
                await asyncio.to_thread(act)
                await until(
                    lambda i=i: (p := receiver_latest(receiver, run_id)) is not None and p.step == i
                )
            assert texts(monitor, run_id) == [
                'Tool call: get_weather({"city":"Paris"})',
                'Tool call: get_weather({"city": "Paris"})\nResult: {"temp_f": 68}',
                "Assistant: It is 20 °C in Paris.",
            ]
            assert monitor.run(run_id).task == TASK  # type: ignore[union-attr]
            # The run is its trace id; the resource's service.name names the agent on the board and
            # in metrics.
            assert monitor.run(run_id).labels == {"service": "weather-agent"}  # type: ignore[union-attr]
            await asyncio.to_thread(agent.end, outcome="success")
            await until(lambda: closed(events, run_id) is not None)
        stats = receiver.statistics()
    end = closed(events, run_id)
    assert end is not None and end.outcome == "success" and end.steps == 3
    assert stats.steps == 3 and stats.late == 0


def receiver_latest(receiver: OtlpReceiver, run_id: str) -> Any:
    view = receiver.traces.view
    return view.latest(run_id) if view is not None else None


# -- OTLP/JSON bodies written to the spec's mapping (hex ids), over a real socket --

TRACE = "5b8efff798038103d269b633813fc60c"


def jspan(
    span_id: str,
    end: int,
    attrs: dict[str, Any],
    *,
    parent: str = "eee19b7ec3c1b174",
    trace_id: str = TRACE,
    **kw: Any,
) -> dict[str, Any]:
    """One span in the OTLP/JSON mapping: hex ids, nanoseconds as strings, typed attribute
    values."""

    def value(v: Any) -> dict[str, Any]:
        if isinstance(v, bool):
            return {"boolValue": v}
        if isinstance(v, int):
            return {"intValue": str(v)}
        return {"stringValue": v if isinstance(v, str) else json.dumps(v)}

    return {
        "traceId": trace_id,
        "spanId": span_id,
        "parentSpanId": parent,
        "name": kw.get("name", "span"),
        "kind": 1,
        "startTimeUnixNano": str(end - 1000),
        "endTimeUnixNano": str(end),
        "attributes": [{"key": k, "value": value(v)} for k, v in attrs.items()],
        "status": kw.get("status", {}),
    }


def body(*spans: dict[str, Any]) -> bytes:
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "agent"}}]}
    return json.dumps(
        {
            "resourceSpans": [
                {"resource": resource, "scopeSpans": [{"scope": {}, "spans": list(spans)}]}
            ]
        }
    ).encode()


def tool(span_id: str, end: int, name: str, result: str, **kw: Any) -> dict[str, Any]:
    attrs = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.result": result,
    }
    return jspan(span_id, end, attrs, **kw)


def root(
    end: int, *, outcome: str | None = None, error: bool = False, trace_id: str = TRACE
) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.input.messages": user(TASK),
    }
    if outcome:
        attrs["agent_monitor.outcome"] = outcome
    status = {"code": 2, "message": "boom"} if error else {}
    return jspan("eee19b7ec3c1b174", end, attrs, parent="", trace_id=trace_id, status=status)


def post(
    url: str, data: bytes, *, ctype: str = "application/json", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """POST over a real socket (http.client); returns status, headers (lowercase) and body."""
    u = url.removeprefix("http://")
    hostport, _, path = u.partition("/")
    host, _, port = hostport.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "POST", "/" + path, body=data, headers={"Content-Type": ctype, **(headers or {})}
        )
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


async def apost(url: str, data: bytes, **kw: Any) -> tuple[int, dict[str, str], bytes]:
    return await asyncio.to_thread(post, url, data, **kw)


async def test_json_bodies_out_of_order_children_first_a_late_span_and_the_root_ending_with_an_error() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    judge = FakeJudge(by_step)
    reg = CollectorRegistry()
    async with receiving(judge, registry=reg) as (monitor, receiver, events):
        # Children before the root, in one batch and out of end-time order; the model span records
        # the task.
        chat = jspan(
            "00000000000000a1",
            1_000,
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.input.messages": user(TASK),
                "gen_ai.completion": "Let me look.",
            },
        )
        status, headers, reply = await apost(
            receiver.url, body(tool("00000000000000a3", 3_000, "search", "sunny"), chat)
        )
        assert (status, headers["content-type"], json.loads(reply)) == (200, "application/json", {})
        await until(lambda: len(texts(monitor, TRACE)) == 2)
        assert texts(monitor, TRACE) == [
            "Assistant: Let me look.",
            "Tool call: search()\nResult: sunny",
        ]
        # A span that ended between the two, reported after both were scored: judged in its place,
        # re-scored.
        late = tool("00000000000000a2", 2_000, "weather", "20 C")
        assert (await apost(receiver.url, body(late)))[0] == 200
        await until(lambda: len(texts(monitor, TRACE)) == 3)
        assert texts(monitor, TRACE)[2] == "Tool call: weather()\nResult: 20 C"
        await monitor.drain()
        assert monitor.run(TRACE).latest.step == 3  # type: ignore[union-attr]  # re-scored with it
        assert judged_order(judge) == [
            "Assistant: Let me look.",
            "Tool call: weather()",
            "Tool call: search()",
        ]
        # The same span again is a duplicate (200, nothing new); a span that is no action is
        # ignored.
        other = jspan("00000000000000a4", 4_000, {"http.method": "GET"})
        assert (await apost(receiver.url, body(late, other)))[0] == 200
        assert (await apost(receiver.url, body(root(5_000, error=True))))[0] == 200
        await until(lambda: closed(events, TRACE) is not None)
    end = closed(events, TRACE)
    assert end is not None and end.outcome == "failure" and end.steps == 3
    assert monitor.run(TRACE) is None
    assert reg.get_sample_value("agent_monitor_otlp_late_spans_total") == 1
    assert (
        reg.get_sample_value("agent_monitor_otlp_spans_ignored_total", {"reason": "duplicate"}) == 1
    )
    assert (
        reg.get_sample_value("agent_monitor_otlp_spans_ignored_total", {"reason": "not_an_action"})
        == 1
    )
    assert reg.get_sample_value("agent_monitor_otlp_spans_received_total") == 6
    assert reg.get_sample_value("agent_monitor_otlp_final_score_seconds_count") == 1


def judged_order(judge: FakeJudge) -> list[str]:
    """The first line of each step the newest prompt shows, in the order shown."""
    prompt = judge.requests[-1].prompt.text()
    return [s.splitlines()[1] for s in prompt.split("\n### Step ")[1:]]


async def test_a_span_reported_after_later_ones_were_scored_is_judged_in_its_place_over_protobuf() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    """The SDK's protobuf exporter: a tool span ending between two scored steps, exported after
    them."""
    judge = FakeJudge(by_step)
    reg = CollectorRegistry()
    async with receiving(judge, registry=reg) as (monitor, receiver, events):
        with sdk(receiver.url) as tracer:
            agent = Agent(tracer)
            await asyncio.to_thread(agent.begin)
            run_id = agent.trace_id
            t0 = time.time_ns()
            # The tool span starts first but its exporter is slow: it ends (and is exported) after
            # the answer.
            slow = await asyncio.to_thread(
                agent.child,
                "execute_tool get_weather",
                {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "get_weather",
                    "gen_ai.tool.call.result": '{"temp_f": 68}',
                },
                end=False,
            )
            await asyncio.to_thread(agent.chat_calls_tool)
            await until(
                lambda: (p := receiver_latest(receiver, run_id)) is not None and p.step == 1
            )
            final = agent.child(
                "chat gpt-x final",
                {"gen_ai.operation.name": "chat", "gen_ai.completion": "It is 20 C in Paris."},
                end=False,
            )
            await asyncio.to_thread(final.end, t0 + 3_000_000_000)
            await until(
                lambda: (p := receiver_latest(receiver, run_id)) is not None and p.step == 2
            )
            answer_first = [
                'Tool call: get_weather({"city":"Paris"})',
                "Assistant: It is 20 C in Paris.",
            ]
            assert judged_order(judge) == answer_first
            # Ends before the answer did, arrives after it was scored: placed by its end time, and
            # re-scored.
            await asyncio.to_thread(slow.end, t0 + 2_000_000_000)
            await until(
                lambda: (p := receiver_latest(receiver, run_id)) is not None and p.step == 3
            )
            assert judged_order(judge) == [
                answer_first[0],
                "Tool call: get_weather()",
                answer_first[1],
            ]
            # The steps as received keep their index (the journal's order); nothing is marked late
            # in the text.
            assert [t.splitlines()[0] for t in texts(monitor, run_id)] == [
                'Tool call: get_weather({"city":"Paris"})',
                "Assistant: It is 20 C in Paris.",
                "Tool call: get_weather()",
            ]
            # The third result judged a trajectory whose last span is the answer: its evaluation
            # events name that.
            answer = f"{final.get_span_context().span_id:016x}"
            assert receiver.span_of(run_id, 3) == (run_id, answer)
            assert receiver.span_of(run_id, 2) == (run_id, answer)
            await asyncio.to_thread(agent.end, outcome="success")
            await until(lambda: closed(events, run_id) is not None)
    end = closed(events, run_id)
    assert end is not None and end.steps == 3
    assert reg.get_sample_value("agent_monitor_otlp_late_spans_total") == 1


async def test_a_conversation_id_and_an_explicit_run_id_name_the_run_and_an_invalid_one_is_rejected() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    async with receiving() as (monitor, receiver, _):
        conv = jspan(
            "00000000000000b1",
            1_000,
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.conversation.id": "conv-7",
                "gen_ai.input.messages": user(TASK),
                "gen_ai.output.messages": json.dumps(
                    [{"role": "assistant", "parts": [{"type": "text", "content": "hi"}]}]
                ),
            },
        )
        # A second trace of the same conversation: its spans join the same run.
        t2 = "6b8efff798038103d269b633813fc60c"
        conv2 = jspan(
            "00000000000000b2",
            2_000,
            {
                "gen_ai.conversation.id": "conv-7",
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "x",
            },
            trace_id=t2,
        )
        named = tool(
            "00000000000000c1", 1_000, "y", "ok", trace_id="7b8efff798038103d269b633813fc60c"
        )
        named["attributes"].append(
            {"key": "agent_monitor.run_id", "value": {"stringValue": "job-42"}}
        )
        named["attributes"].append(
            {"key": "agent_monitor.task", "value": {"stringValue": "Run job 42"}}
        )
        bad = tool(
            "00000000000000d1", 1_000, "z", "ok", trace_id="8b8efff798038103d269b633813fc60c"
        )
        bad["attributes"].append(
            {"key": "gen_ai.conversation.id", "value": {"stringValue": "no/slashes"}}
        )
        status, _, reply = await apost(receiver.url, body(conv, conv2, named, bad))
        assert status == 200
        partial = json.loads(reply)["partialSuccess"]
        assert partial["rejectedSpans"] == "1" and "no/slashes" in partial["errorMessage"]
        await until(
            lambda: len(texts(monitor, "conv-7")) == 2 and len(texts(monitor, "job-42")) == 1
        )
        assert monitor.run("job-42").task == "Run job 42"  # type: ignore[union-attr]
        # A conversation's root span ends one of its traces, not the run: the run goes on.
        assert (await apost(receiver.url, body(root(3_000, trace_id=t2) | {"parentSpanId": ""})))[
            0
        ] == 200
        await monitor.drain()
        assert monitor.run("conv-7") is not None


async def test_a_trace_that_never_ends_is_closed_after_the_idle_time() -> None:
    now = [0.0]
    reg = CollectorRegistry()
    receiver = OtlpReceiver(
        OtlpReceiverSettings(address="127.0.0.1:0", idle_s=60), registry=reg, clock=lambda: now[0]
    )
    events: list[MonitorEvent] = []
    async with Monitor(
        MonitorConfig(),
        judge=FakeJudge(),
        store=MemoryStore(),
        registry=reg,
        sources=[receiver],
        sinks=[events.append],
    ) as monitor:
        await receiver.ready.wait()
        # No span records a task: the steps wait for one, then the idle close starts the run with a
        # stand-in.
        assert (await apost(receiver.url, body(tool("00000000000000e1", 1_000, "ls", "a b"))))[
            0
        ] == 200
        now[0] = 59.0
        await receiver.sweep()
        assert monitor.run(TRACE) is None and closed(events, TRACE) is None
        now[0] = 61.0
        await receiver.sweep()
        await until(lambda: closed(events, TRACE) is not None)
    end = closed(events, TRACE)
    assert end is not None and end.outcome == "unknown" and end.steps == 1
    # A span of the ended run is ignored, not a new run.
    assert receiver.statistics().live == 0


async def test_a_restart_mid_trace_picks_up_where_the_journal_left(tmp_path: Path) -> None:
    judge = FakeJudge(by_step)
    db = tmp_path / "runs.db"
    chat = jspan(
        "00000000000000f1",
        1_000,
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.input.messages": user(TASK),
            "gen_ai.completion": "Looking.",
        },
    )
    first = tool("00000000000000f2", 2_000, "search", "sunny")
    store = SqliteStore(db)
    async with receiving(judge, store=store) as (monitor, receiver, _):
        assert (await apost(receiver.url, body(chat, first)))[0] == 200
        await until(lambda: len(texts(monitor, TRACE)) == 2)
        await monitor.drain()
    await store.aclose()
    store = SqliteStore(db)
    try:
        async with receiving(judge, store=store) as (monitor, receiver, events):
            assert monitor.run(TRACE) is not None and len(texts(monitor, TRACE)) == 2
            # The exporter retries the batch it had sent (a duplicate), then the trace goes on.
            second = tool("00000000000000f3", 3_000, "answer", "20 C")
            assert (await apost(receiver.url, body(first, second, root(4_000, outcome="success"))))[
                0
            ] == 200
            await until(lambda: closed(events, TRACE) is not None)
            end = closed(events, TRACE)
            assert end is not None and end.outcome == "success" and end.steps == 3
            assert receiver.statistics().late == 0
    finally:
        await store.aclose()


# -- every limit, over a real socket: the spec's answers and a counter, nothing else lost --


def status_of(reply: bytes) -> tuple[int, str]:
    """A protobuf google.rpc.Status body (code = 1, message = 2), decoded by hand."""
    from google.protobuf.internal.decoder import _DecodeVarint  # type: ignore[import-untyped]

    code, pos, message = 0, 0, ""
    while pos < len(reply):
        key, pos = _DecodeVarint(reply, pos)
        if key >> 3 == 1:
            code, pos = _DecodeVarint(reply, pos)
        else:
            n, pos = _DecodeVarint(reply, pos)
            message, pos = reply[pos : pos + n].decode(), pos + n
    return code, message


async def test_each_limit_is_answered_as_the_spec_says_and_counted() -> None:
    reg = CollectorRegistry()
    settings = {
        "max_body_bytes": 4_000,
        "max_spans_per_batch": 5,
        "max_live_traces": 1,
        "max_spans_per_trace": 3,
        "max_attribute_bytes": 200,
        "max_step_chars": 300,
        "retry_after_s": 7,
    }

    def refused(reason: str) -> float | None:
        return reg.get_sample_value("agent_monitor_otlp_spans_refused_total", {"reason": reason})

    async with receiving(registry=reg, **settings) as (monitor, receiver, _):
        url = receiver.url
        # Over the body size, told by Content-Length: 413 before the body is read (a protobuf
        # Status).
        status, headers, reply = await apost(url, b"x" * 5_000, ctype="application/x-protobuf")
        assert (status, headers["content-type"]) == (413, "application/x-protobuf")
        assert status_of(reply)[1] == "the body is 5000 bytes, over the limit of 4000"
        # A gzip body under the limit that inflates over it: 413 too, never inflated whole.
        bomb = gzip.compress(b" " * 100_000)
        assert len(bomb) < 4_000
        status, _, reply = await apost(url, bomb, headers={"Content-Encoding": "gzip"})
        assert status == 413 and "once decompressed" in json.loads(reply)["message"]
        assert refused("body_too_large") == 2
        # More spans in one request than allowed: 413.
        many = body(*(tool(f"{i + 1:016x}", 1_000 + i, "t", "r") for i in range(6)))
        status, _, reply = await apost(url, many)
        assert status == 413 and json.loads(reply)["message"] == (
            "6 spans in one request, over the limit of 5"
        )
        assert refused("batch_too_large") == 6
        # Not a body: 400; not a protobuf request: 400; an unknown type: 415; other paths and
        # methods: 404, 405.
        assert (await apost(url, b"{not json"))[0] == 400
        assert (await apost(url, b"\xff\xff\xff", ctype="application/x-protobuf"))[0] == 400
        assert (await apost(url, b"{}", ctype="text/plain"))[0] == 415
        assert (await apost(url.replace("/v1/traces", "/v1/logs"), b"{}"))[0] == 404
        assert refused("bad_body") == 2
        # Spans held per trace: beyond 3 the rest are rejected (partial success), the first ones
        # kept.
        task = jspan(
            "00000000000000a1",
            10_000,
            {
                "agent_monitor.task": "t",
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "x" * 1000,
            },
        )
        spans = [task, *(tool(f"{i + 2:016x}", 20_000 + i, "t", "r") for i in range(3))]
        status, _, reply = await apost(url, body(*spans))
        assert status == 200 and json.loads(reply)["partialSuccess"]["rejectedSpans"] == "1", reply
        assert refused("too_many_spans") == 1
        await until(lambda: len(texts(monitor, TRACE)) == 3)
        # An attribute value over its bytes is cut (and counted); so is a step's text.
        assert len(texts(monitor, TRACE)[0]) <= 300
        assert reg.get_sample_value("agent_monitor_otlp_attributes_truncated_total") == 1
        # A second live trace over max_live_traces: 503 with Retry-After (the exporter retries it
        # later).
        other = tool(
            "00000000000000b1", 1_000, "t", "r", trace_id="9b8efff798038103d269b633813fc60c"
        )
        status, headers, _ = await apost(url, body(other))
        assert (status, headers["retry-after"]) == (503, "7")
        assert refused("too_many_traces") == 1
        # The first trace was not disturbed by any of it.
        assert len(texts(monitor, TRACE)) == 3 and monitor.status()["live_runs"] == 1


async def test_connections_are_bounded_and_a_silent_client_is_cut_off() -> None:
    async with receiving(max_connections=1, read_timeout_s=0.5) as (_, receiver, _):
        assert receiver.port is not None
        # An idle connection holds the only place: a new request sheds it and is answered.
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        try:
            await until(lambda: receiver.statistics().connections == 1)
            status, _, reply = await apost(receiver.url, body())
            assert (status, json.loads(reply)) == (200, {})
            assert await asyncio.wait_for(idle_reader.read(), 10) == b""
        finally:
            idle_writer.close()
        await until(lambda: receiver.statistics().connections == 0)
        # A connection whose request is being read (its body still coming) is working: one too many
        # gets 503.
        slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        try:
            slow_writer.write(
                b"POST /v1/traces HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\ncontent-length: 9\r\n\r\n{"
            )
            await slow_writer.drain()
            await until(
                lambda: receiver.http.connections == 1 and receiver.http.gate.waiting_count == 0
            )
            status, headers, _ = await apost(receiver.url, body())
            assert (status, headers["retry-after"]) == (503, "5")
            # The silent one is closed after the read timeout.
            assert await asyncio.wait_for(slow_reader.read(), 10) == b""
        finally:
            slow_writer.close()
        status, _, reply = await apost(receiver.url, body())
        assert (status, json.loads(reply)) == (200, {})


# -- serve --otlp-receiver as a user runs it: the SDK exporter in, progress on MQTT, evaluation
# events out --


async def test_serve_otlp_receiver_scores_an_sdk_trace_on_mqtt_and_its_events_carry_the_trace(
    broker: Mosquitto,
) -> None:
    from tests.cli.test_serve_cli import serve, wait_serving
    from tests.daemon.sinks.test_otel import receiver as logs_receiver
    from tests.daemon.test_daemon_mqtt import harness
    from tests.openai_server import chat_choice, chat_reply, scripted_server

    port = free_port()
    with scripted_server() as judge, logs_receiver() as collector:
        judge.default = chat_reply(chat_choice([("K", {"K": 0.8, "L": 0.2})]))
        args = [
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--metrics-port",
            "0",
            "--otlp-receiver",
            f"127.0.0.1:{port}",
            "--otlp-endpoint",
            collector.url,
        ]
        with serve(*args) as proc:
            lines = await asyncio.to_thread(wait_serving, proc)
            assert f"OTLP traces on http://127.0.0.1:{port}/v1/traces" in lines[-1]
            async with harness(broker.port) as h:
                with sdk(f"http://127.0.0.1:{port}/v1/traces") as tracer:
                    agent = Agent(tracer)
                    await asyncio.to_thread(agent.begin)
                    run_id = agent.trace_id
                    for i, act in enumerate(
                        (agent.chat_calls_tool, agent.tool, agent.chat_answers), 1
                    ):
                        await asyncio.to_thread(act)
                        await h.until(lambda i=i: h.last_step(run_id) == i)  # scored step by step
                    await asyncio.to_thread(agent.end, outcome="success")
                    # The run closed: its retained signal is cleared (an empty payload).
                    await h.until(lambda: None in h.seen[(run_id, "signal")])
                progress = h.progress(run_id)
                spans = {
                    name: f"{s.get_span_context().span_id:016x}" for name, s in agent.spans.items()
                }
            await until(
                lambda: (
                    len({r["attributes"]["agent_monitor.step"] for r in collector.records()}) == 3
                )
            )
    assert [p["step"] for p in progress] == [1, 2, 3] and all(p["ok"] for p in progress)
    records = collector.records()
    assert {r["trace_id"].hex() for r in records} == {run_id}
    judged = {r["attributes"]["agent_monitor.step"]: r["span_id"].hex() for r in records}
    assert judged == {
        1: spans["chat gpt-x"],
        2: spans["execute_tool get_weather"],
        3: spans["chat gpt-x final"],
    }


async def test_a_token_is_required_when_set_and_never_shown() -> None:
    reg = CollectorRegistry()
    async with receiving(registry=reg, token="s3cret") as (monitor, receiver, _):
        assert "s3cret" not in repr(receiver.settings)
        status, _, reply = await apost(
            receiver.url, body(tool("00000000000000a1", 1_000, "t", "r"))
        )
        assert status == 401 and "--otlp-token" in json.loads(reply)["message"]
        wrong = {"Authorization": "Bearer guess"}
        assert (await apost(receiver.url, body(), headers=wrong))[0] == 401
        assert (
            reg.get_sample_value(
                "agent_monitor_otlp_spans_refused_total", {"reason": "unauthorized"}
            )
            == 2
        )
        right = {"Authorization": "Bearer s3cret"}
        task = jspan(
            "00000000000000a2",
            2_000,
            {"agent_monitor.task": "t", "gen_ai.operation.name": "execute_tool"},
        )
        assert (await apost(receiver.url, body(task), headers=right))[0] == 200
        await until(lambda: len(texts(monitor, TRACE)) == 1)


async def test_an_ended_run_the_monitor_does_not_have_is_forgotten_after_another_idle_time() -> (
    None
):
    now = [0.0]
    receiver = OtlpReceiver(
        OtlpReceiverSettings(address="127.0.0.1:0", idle_s=10), clock=lambda: now[0]
    )
    # The monitor's closes never reach the receiver (as for a start the monitor refused).
    receiver.sink = None
    async with Monitor(
        MonitorConfig(), judge=FakeJudge(), store=MemoryStore(), sources=[receiver]
    ) as monitor:
        await receiver.ready.wait()
        assert (await apost(receiver.url, body(tool("00000000000000e1", 1_000, "ls", "a"))))[
            0
        ] == 200
        now[0] = 11.0
        await receiver.sweep()  # idle: started with a stand-in task and ended
        await until(lambda: monitor.run(TRACE) is None)
        assert receiver.statistics().live == 1
        now[0] = 21.0
        await receiver.sweep()
        assert receiver.statistics().live == 0
        # A span of it now is ignored (the run ended), not a new run.
        assert (await apost(receiver.url, body(tool("00000000000000e2", 2_000, "ls", "b"))))[
            0
        ] == 200
        assert receiver.statistics().live == 0


async def test_a_span_after_the_root_ended_is_ignored_not_refused() -> None:
    reg = CollectorRegistry()
    async with receiving(registry=reg) as (_, receiver, events):
        first = tool("00000000000000a1", 1_000, "t", "r")
        first["attributes"].append({"key": "agent_monitor.task", "value": {"stringValue": "t"}})
        assert (await apost(receiver.url, body(first, root(3_000))))[0] == 200
        assert (await apost(receiver.url, body(tool("00000000000000a2", 2_000, "t", "late"))))[
            0
        ] == 200
        await until(lambda: closed(events, TRACE) is not None)
    end = closed(events, TRACE)
    assert end is not None and end.steps == 1
    assert (
        reg.get_sample_value("agent_monitor_otlp_spans_ignored_total", {"reason": "run_ended"}) == 1
    )
    assert not [e for e in events if type(e).__name__ == "Refused"]


def test_the_judge_reads_steps_by_end_time_and_steps_without_one_keep_their_place() -> None:
    from agent_monitor.prompts import Step
    from agent_monitor.tracker import placed

    def at(i: int, end: int | None) -> Step:
        return Step(
            index=i, text=f"s{i}", meta={"otel": {"end_ns": end}} if end is not None else {}
        )

    plain = [at(1, None), at(2, None)]
    assert placed(plain) is plain  # MQTT steps: as they are, no copy
    steps = [at(1, 10), at(2, 30), at(3, None), at(4, 20)]
    out = placed(steps)
    assert [(s.index, s.text) for s in out] == [(1, "s1"), (2, "s4"), (3, "s2"), (4, "s3")]
