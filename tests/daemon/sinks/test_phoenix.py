"""The Phoenix sink against a real Arize Phoenix server (its own virtualenv,
tests/phoenix_server.py).

An agent instrumented with the real OpenTelemetry SDK exports its trace twice, as the recipe in
docs/phoenix.md deploys it: to Phoenix and to the monitor's OTLP receiver. The monitor scores each
step and annotates the step's own span in Phoenix; what Phoenix's REST API lists is checked against
the monitor's own scores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import (
    MemoryStore,
    Monitor,
    MonitorConfig,
    MonitorEvent,
    OtlpReceiver,
    OtlpReceiverSettings,
    PhoenixSettings,
    RunClosed,
    Scored,
)
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto, free_port
from tests.phoenix_server import Phoenix, phoenix_server

pytestmark = pytest.mark.timeout(300)

TASK = "Book the cheapest flight from Paris to Rome next Friday."
TOOLS = [
    (
        "search_flights",
        '{"from": "CDG", "to": "FCO"}',
        '[{"id": "AZ331", "eur": 89}, {"id": "AF1404", "eur": 121}]',
    ),
    ("hold_seat", '{"flight": "AZ331"}', '{"held": true, "until": "18:00"}'),
    ("pay", '{"flight": "AZ331", "eur": 89}', '{"paid": true, "ticket": "057-2211"}'),
]


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    with phoenix_server(tmp_path_factory.mktemp("phoenix")) as server:
        yield server


@contextmanager
def agent_sdk(*urls: str) -> Iterator[trace.Tracer]:
    """The real SDK exporting each span as it ends to every URL (OTLP/HTTP protobuf): Phoenix and
    the monitor."""
    provider = TracerProvider(resource=Resource.create({"service.name": "travel-agent"}))
    for url in urls:
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=10)))
    try:
        yield provider.get_tracer("travel-agent")
    finally:
        provider.shutdown()


class Agent:
    """A GenAI-conventions agent: invoke_agent, a chat turn that plans, then one execute_tool
    child per tool call."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        user = [{"role": "user", "parts": [{"type": "text", "content": TASK}]}]
        self.root = tracer.start_span(
            "invoke_agent travel",
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.input.messages": json.dumps(user),
            },
        )
        self.spans: list[str] = []

    def plan(self) -> None:
        context = trace.set_span_in_context(self.root)
        user = [{"role": "user", "parts": [{"type": "text", "content": TASK}]}]
        calls = [
            {
                "role": "assistant",
                "parts": [{"type": "tool_call", "name": n, "arguments": a} for n, a, _ in TOOLS],
            }
        ]
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.input.messages": json.dumps(user),
            "gen_ai.output.messages": json.dumps(calls),
        }
        with self.tracer.start_as_current_span(
            "chat gpt-x", context=context, attributes=attributes
        ) as s:
            self.spans.append(f"{s.get_span_context().span_id:016x}")

    def tool(self, name: str, arguments: str, result: str) -> None:
        context = trace.set_span_in_context(self.root)
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.arguments": arguments,
            "gen_ai.tool.call.result": result,
        }
        with self.tracer.start_as_current_span(
            f"execute_tool {name}", context=context, attributes=attributes
        ) as s:
            self.spans.append(f"{s.get_span_context().span_id:016x}")

    def end(self) -> None:
        self.root.set_attribute("agent_monitor.outcome", "success")
        self.root.end()

    @property
    def trace_id(self) -> str:
        return f"{self.root.get_span_context().trace_id:032x}"


@asynccontextmanager
async def monitoring(
    phoenix_url: str, judge: FakeJudge, registry: CollectorRegistry, **phoenix: Any
) -> AsyncIterator[tuple[Monitor, OtlpReceiver, list[MonitorEvent]]]:
    receiver = OtlpReceiver(OtlpReceiverSettings(address="127.0.0.1:0"), registry=registry)
    config = MonitorConfig(policy=Policy(), phoenix=PhoenixSettings(url=phoenix_url, **phoenix))
    events: list[MonitorEvent] = []
    async with Monitor(
        config,
        judge=judge,
        store=MemoryStore(),
        registry=registry,
        sources=[receiver],
        sinks=[events.append],
    ) as monitor:
        await asyncio.wait_for(receiver.ready.wait(), 10)
        yield monitor, receiver, events


async def until(check: Any, wait_s: float = 60.0, every_s: float = 0.1) -> Any:
    """Poll `check()` (run in a thread: it may do HTTP) until it returns something truthy; return
    that."""
    async with asyncio.timeout(wait_s):
        while not (got := await asyncio.to_thread(check)):  # noqa: ASYNC110 - polls another process (Phoenix)
            await asyncio.sleep(every_s)
    return got


def span_annotations(
    phoenix: Phoenix, span_ids: list[str], project: str = "default"
) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode([("span_ids", s) for s in span_ids])
    try:
        return list(phoenix.get(f"/v1/projects/{project}/span_annotations?{query}")["data"])
    except OSError:  # 404 until Phoenix has the spans
        return []


def trace_annotations(
    phoenix: Phoenix, trace_id: str, project: str = "default"
) -> list[dict[str, Any]]:
    try:
        return list(
            phoenix.get(f"/v1/projects/{project}/trace_annotations?trace_ids={trace_id}")["data"]
        )
    except OSError:
        return []


def scores(events: list[MonitorEvent], run_id: str) -> dict[int, float | None]:
    return {
        e.progress.step: e.progress.score
        for e in events
        if isinstance(e, Scored) and e.run_id == run_id
    }


LETTERS = {1: "K", 2: "F", 3: "M", 4: "T"}


def by_step(prompt: Any) -> str:
    return LETTERS.get(prompt.step, "K")


async def test_each_scored_step_is_a_progress_annotation_on_its_span_and_the_run_a_trace_annotation(
    phoenix: Phoenix,
) -> None:
    registry = CollectorRegistry()
    async with monitoring(phoenix.url, FakeJudge(by_step), registry) as (monitor, receiver, events):
        with agent_sdk(phoenix.traces_url, receiver.url) as tracer:
            agent = await asyncio.to_thread(Agent, tracer)
            run_id = agent.trace_id
            await asyncio.to_thread(agent.plan)
            for n, call in enumerate(TOOLS, 2):
                await asyncio.to_thread(agent.tool, *call)
                # scored step by step, live
                await until(lambda n=n: len(scores(events, run_id)) >= n)
            await asyncio.to_thread(agent.end)
            await until(
                lambda: any(isinstance(e, RunClosed) and e.run_id == run_id for e in events)
            )
        got = await until(
            lambda: (
                len(span_annotations(phoenix, agent.spans)) == 4
                and trace_annotations(phoenix, run_id)
            )
        )
        stats = monitor.phoenix.statistics() if monitor.phoenix else None
    monitor_scores = scores(events, run_id)
    assert sorted(monitor_scores) == [1, 2, 3, 4] and all(
        s is not None for s in monitor_scores.values()
    )
    annotations = {a["span_id"]: a for a in span_annotations(phoenix, agent.spans)}
    for step, span_id in enumerate(agent.spans, 1):
        a = annotations[span_id]  # the step's own span: the tool call whose end made the step
        assert a["name"] == "progress" and a["annotator_kind"] == "LLM"
        assert a["result"]["score"] == pytest.approx(monitor_scores[step])
        assert a["result"]["label"] == LETTERS[step]  # the most likely letter
        assert "judge fake" in a["result"]["explanation"]
        assert (
            a["metadata"]["step"] == step
            and a["metadata"]["run_id"] == run_id
            and a["metadata"]["rubric"]
        )
        assert a["identifier"] == f"agent-monitor:{run_id}:{step}"
    (final,) = got
    closed = next(e for e in events if isinstance(e, RunClosed) and e.run_id == run_id)
    assert closed.latest is not None
    assert final["name"] == "progress" and final["result"]["score"] == pytest.approx(
        closed.latest.score
    )
    assert (
        final["result"]["label"] == "done"
        and "run success after 4 steps" in final["result"]["explanation"]
    )
    assert final["metadata"]["outcome"] == "success" and final["metadata"]["steps"] == 4
    assert (
        stats is not None
        and stats.sent == 5
        and stats.failed == stats.dropped == stats.exported == 0
    )
    assert (
        registry.get_sample_value("agent_monitor_phoenix_annotations_sent_total", {"kind": "span"})
        == 4
    )
    assert registry.get_sample_value("agent_monitor_phoenix_request_seconds_count")


async def test_with_phoenix_stopped_mid_run_scoring_goes_on_and_the_failures_are_counted(
    tmp_path: Path,
) -> None:
    registry = CollectorRegistry()
    with phoenix_server(tmp_path / "phoenix") as phoenix:
        async with monitoring(phoenix.url, FakeJudge(by_step), registry, retries=1) as (
            monitor,
            receiver,
            events,
        ):
            assert monitor.phoenix is not None
            with agent_sdk(receiver.url) as tracer:
                agent = await asyncio.to_thread(Agent, tracer)
                run_id = agent.trace_id
                await asyncio.to_thread(agent.plan)
                await until(lambda: monitor.phoenix.statistics().sent == 1)  # type: ignore[union-attr]
                await asyncio.to_thread(phoenix.stop)
                for n, call in enumerate(TOOLS, 2):
                    await asyncio.to_thread(agent.tool, *call)
                    # scored while Phoenix is gone
                    await until(lambda n=n: len(scores(events, run_id)) >= n)
                await asyncio.to_thread(agent.end)
                await until(
                    lambda: any(isinstance(e, RunClosed) and e.run_id == run_id for e in events)
                )
                # Every step scored while Phoenix was gone; its annotations failed, were retried
                # once, then dropped.
                assert sorted(scores(events, run_id)) == [1, 2, 3, 4]
                assert all(s is not None for s in scores(events, run_id).values())
                stats = await until(lambda: (s := monitor.phoenix.statistics()).dropped >= 4 and s)  # type: ignore[union-attr]
    assert stats.sent == 1 and stats.failed == 2 * stats.dropped and stats.queued == 0
    assert (
        registry.get_sample_value(
            "agent_monitor_phoenix_annotations_dropped_total", {"reason": "gave_up"}
        )
        == 4
    )
    assert (
        registry.get_sample_value("agent_monitor_phoenix_annotations_failed_total") == stats.failed
    )


async def test_a_run_from_another_door_gets_spans_of_its_own_in_the_project_and_annotations_on_them(
    phoenix: Phoenix,
) -> None:
    registry = CollectorRegistry()
    config = MonitorConfig(
        policy=Policy(), phoenix=PhoenixSettings(url=phoenix.url, project="agent-monitor-runs")
    )
    events: list[MonitorEvent] = []
    run_id = "mqtt-run-7"
    async with Monitor(
        config,
        judge=FakeJudge(by_step),
        store=MemoryStore(),
        registry=registry,
        sinks=[events.append],
    ) as monitor:
        # The MQTT door's wire form, handed in directly (no broker needed to be a run without
        # spans).
        await monitor.handle(f"agents/{run_id}/start", json.dumps({"task": TASK}).encode())
        for i, (name, arguments, result) in enumerate(TOOLS, 1):
            step = {"index": i, "text": f"Tool call: {name}({arguments})\nResult: {result}"}
            await monitor.handle(f"agents/{run_id}/step", json.dumps(step).encode())
            await until(lambda i=i: len(scores(events, run_id)) >= i)
        await monitor.handle(f"agents/{run_id}/end", b'{"outcome": "failure"}')
        await until(lambda: any(isinstance(e, RunClosed) and e.run_id == run_id for e in events))
        await until(
            lambda: monitor.phoenix is not None and monitor.phoenix.statistics().queued == 0
        )
        stats = monitor.phoenix.statistics() if monitor.phoenix else None
    # a root and three step spans
    assert stats is not None and stats.exported == 4 and stats.dropped == 0
    spans = await until(lambda: len(own_spans(phoenix, run_id)) == 4 and own_spans(phoenix, run_id))
    by_name = {s["name"]: s for s in spans}
    root = by_name[f"agent-monitor run {run_id}"]
    trace_id = root["context"]["trace_id"]
    step_ids = [by_name[f"agent-monitor step {i}"]["context"]["span_id"] for i in (1, 2, 3)]
    assert all(
        by_name[f"agent-monitor step {i}"]["parent_id"] == root["context"]["span_id"]
        for i in (1, 2, 3)
    )
    got = await until(
        lambda: (
            len(span_annotations(phoenix, step_ids, "agent-monitor-runs")) == 3
            and trace_annotations(phoenix, trace_id, "agent-monitor-runs")
        )
    )
    monitor_scores = scores(events, run_id)
    for a in span_annotations(phoenix, step_ids, "agent-monitor-runs"):
        step = a["metadata"]["step"]
        assert a["span_id"] == step_ids[step - 1] and a["result"]["score"] == pytest.approx(
            monitor_scores[step]
        )
    (final,) = got
    assert final["metadata"]["outcome"] == "failure" and final["result"]["score"] == pytest.approx(
        monitor_scores[3]
    )


def own_spans(phoenix: Phoenix, run_id: str) -> list[dict[str, Any]]:
    try:
        spans = phoenix.get("/v1/projects/agent-monitor-runs/spans?limit=100")["data"]
    except OSError:
        return []
    return [s for s in spans if s["attributes"].get("agent_monitor.run_id") == run_id]


def test_a_full_queue_drops_and_counts_instead_of_waiting() -> None:
    from agent_monitor.daemon import PhoenixSink
    from agent_monitor.progress import Progress

    registry = CollectorRegistry()
    sink = PhoenixSink(
        PhoenixSettings(url="http://127.0.0.1:9", max_queue=2),
        registry=registry,
        spans=lambda r, s: ("a" * 32, "b" * 16),
    )
    for step in range(1, 6):
        progress = Progress(step=step, score=0.5, uncertainty=0.1, criteria={}, ok=True)
        # no sender running: nothing drains
        sink(Scored("run-1", progress, progress.to_json(), arrived=(), at=0.0))
    stats = sink.statistics()
    assert stats.queued == 2 and stats.dropped == 3
    assert (
        registry.get_sample_value(
            "agent_monitor_phoenix_annotations_dropped_total", {"reason": "queue_full"}
        )
        == 3
    )


async def test_serve_with_phoenix_annotates_the_agents_spans_and_never_shows_the_api_key(
    phoenix: Phoenix, broker: Mosquitto
) -> None:
    from tests.cli.test_serve_cli import serve, wait_serving
    from tests.daemon.test_daemon_mqtt import harness
    from tests.openai_server import chat_choice, chat_reply, scripted_server

    port, key = free_port(), "phx-secret-key-0123456789"
    with scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("O", {"O": 0.7, "N": 0.2, "P": 0.1})]))
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
            "--phoenix",
            phoenix.url,
        ]
        with serve(*args, env={"AGENT_MONITOR_PHOENIX_API_KEY": key}) as proc:
            lines = await asyncio.to_thread(wait_serving, proc)
            assert f"progress annotations to Phoenix at {phoenix.url}" in lines[-1]
            async with harness(broker.port) as h:
                with agent_sdk(phoenix.traces_url, f"http://127.0.0.1:{port}/v1/traces") as tracer:
                    agent = await asyncio.to_thread(Agent, tracer)
                    await asyncio.to_thread(agent.plan)
                    await h.until(lambda: h.last_step(agent.trace_id) == 1)
                    for i, call in enumerate(TOOLS, 2):
                        await asyncio.to_thread(agent.tool, *call)
                        # each step scored alone
                        await h.until(lambda i=i: h.last_step(agent.trace_id) == i)
                    await asyncio.to_thread(agent.end)
            try:
                got = await until(
                    lambda: (
                        len(span_annotations(phoenix, agent.spans)) == 4
                        and trace_annotations(phoenix, agent.trace_id)
                    )
                )
            finally:
                proc.terminate()
                _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
                print(stderr[-3000:])  # the daemon's log, shown when the test fails
    annotations = span_annotations(phoenix, agent.spans)
    # The judge said O (0.7), N, P: the expectation on the 20-letter scale, on every step's own
    # span.
    expected = (0.7 * 14 + 0.2 * 13 + 0.1 * 15) / 19
    assert {a["span_id"] for a in annotations} == set(agent.spans)
    assert all(
        a["result"]["score"] == pytest.approx(expected, abs=1e-3) and a["result"]["label"] == "O"
        for a in annotations
    )
    assert got[0]["result"]["score"] == pytest.approx(expected, abs=1e-3)
    assert key not in stderr


async def test_a_batch_that_cannot_be_encoded_is_dropped_and_the_sender_goes_on() -> None:
    from agent_monitor.daemon import PhoenixSink
    from agent_monitor.progress import Progress

    settings = PhoenixSettings(url=f"http://127.0.0.1:{free_port()}", retries=0)
    sink = PhoenixSink(
        settings, registry=CollectorRegistry(), spans=lambda r, s: ("a" * 32, "b" * 16)
    )
    task = asyncio.create_task(sink.run())
    try:
        # JSON has no NaN
        bad = Progress(step=1, score=float("nan"), uncertainty=0.1, criteria={}, ok=True)
        sink(Scored("run-1", bad, bad.to_json(), arrived=(), at=0.0))
        await until(lambda: sink.statistics().dropped == 1)
        good = Progress(step=2, score=0.5, uncertainty=0.1, criteria={}, ok=True)
        sink(Scored("run-1", good, good.to_json(), arrived=(), at=0.0))
        # Still sending: the next batch reaches the (absent) server, fails once and is dropped.
        stats = await until(lambda: (s := sink.statistics()).failed == 1 and s.dropped == 2 and s)
        assert not task.done() and stats.sent == 0 and stats.queued == 0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sink.close(1.0)


async def test_a_restarted_monitor_sending_a_step_again_replaces_its_annotation_instead_of_adding_one(  # noqa: E501 (the test's name is its sentence)
    phoenix: Phoenix,
) -> None:
    from agent_monitor.daemon import PhoenixSink
    from agent_monitor.progress import Progress

    with agent_sdk(phoenix.traces_url) as tracer:
        agent = await asyncio.to_thread(Agent, tracer)
        await asyncio.to_thread(agent.tool, *TOOLS[0])
    ref = (agent.trace_id, agent.spans[0])
    # the same run and step from two sink instances: before and after a restart
    for score in (0.25, 0.75):
        sink = PhoenixSink(
            PhoenixSettings(url=phoenix.url), registry=CollectorRegistry(), spans=lambda r, s: ref
        )
        task = asyncio.create_task(sink.run())
        progress = Progress(
            step=1, score=score, uncertainty=0.05, criteria={}, ok=True, model="judge-x"
        )
        sink(Scored("restarted-run", progress, progress.to_json(), arrived=(), at=0.0))
        await until(lambda sink=sink: sink.statistics().sent == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sink.close(1.0)
        await until(
            lambda score=score: (
                [a["result"]["score"] for a in span_annotations(phoenix, agent.spans)] == [score]
            )
        )
    (annotation,) = span_annotations(phoenix, agent.spans)
    assert (
        annotation["identifier"] == "agent-monitor:restarted-run:1"
        and annotation["result"]["score"] == 0.75
    )
