"""The OTLP traces receiver: the real OpenTelemetry SDK exporter (and hand-written bodies) over a real socket.

A trace is a run: its spans become the run's start, steps and end, scored like MQTT input. The
agents here are synthetic traces following the GenAI semantic conventions, sent by the SDK's own
OTLP/HTTP span exporter; the bodies written by hand follow the OTLP/JSON mapping (hex ids).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import http.client
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
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
    RunClosed,
    OtlpReceiverSettings,
    RunStore,
    SqliteStore,
)
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge

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
    """A Monitor with an OTLP receiver on a free port, no broker; every monitor event is collected."""
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
    """The real SDK: a TracerProvider exporting each span as it ends with the OTLP/HTTP (protobuf) exporter."""
    provider = TracerProvider(resource=Resource.create({"service.name": "weather-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=10)))
    try:
        yield provider.get_tracer("synthetic-agent")
    finally:
        provider.shutdown()


def user(text: str) -> str:
    return json.dumps([{"role": "user", "parts": [{"type": "text", "content": text}]}])


class Agent:
    """A synthetic agent whose trace follows the GenAI conventions: invoke_agent, then chat and execute_tool children."""

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
        span = self.tracer.start_span(name, context=trace.set_span_in_context(self.root), attributes=attributes)
        self.spans[name] = span
        if end:
            span.end()
        return span

    def chat_calls_tool(self) -> None:
        out = [{"role": "assistant", "parts": [{"type": "tool_call", "name": "get_weather", "arguments": {"city": "Paris"}}]}]
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
        self.child("chat gpt-x final", {"gen_ai.operation.name": "chat", "gen_ai.completion": completion})

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
                await until(lambda i=i: (p := receiver_latest(receiver, run_id)) is not None and p.step == i)
            assert texts(monitor, run_id) == [
                'Tool call: get_weather({"city":"Paris"})',
                'Tool call: get_weather({"city": "Paris"})\nResult: {"temp_f": 68}',
                "Assistant: It is 20 °C in Paris.",
            ]
            assert monitor.run(run_id).task == TASK  # type: ignore[union-attr]
            await asyncio.to_thread(agent.end, outcome="success")
            await until(lambda: closed(events, run_id) is not None)
        stats = receiver.statistics()
    end = closed(events, run_id)
    assert end is not None and end.outcome == "success" and end.steps == 3
    assert stats["steps"] == 3 and stats["late"] == 0


def receiver_latest(receiver: OtlpReceiver, run_id: str) -> Any:
    view = receiver._view
    return view.latest(run_id) if view is not None else None
