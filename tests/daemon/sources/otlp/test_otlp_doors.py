"""The OTLP receiver's door under hostile bodies: an event bomb decoded off the loop with every
repeated field capped.

The real SDK exporter sends a span with thousands of events (its own limit raised); a hand-built
protobuf body carries 1.5 million empty events under the 4 MiB cap, as the issue's attacker did.
Timing is left to bench/doors.py: here the caps, the worker-thread decode and /metrics answering
while a bomb is decoded (by order, not by time) are asserted.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import HttpServer
from agent_monitor.daemon.sources.otlp import _receiver as _otlp_receiver
from agent_monitor.daemon.sources.otlp._spans import MAX_EVENTS, decode_protobuf
from tests.daemon.sources.otlp.test_otlp_receiver import apost, receiving, until, user

pytestmark = pytest.mark.timeout(120)


def _bomb(events: int, links: int = 0) -> bytes:
    """An ExportTraceServiceRequest of one finished tool span with `events` empty events and
    `links` links."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = b"\x01" * 16, b"\x02" * 8, "bomb"
    span.start_time_unix_nano, span.end_time_unix_nano = 1, 2
    for _ in range(events):
        span.events.add()
    for _ in range(links):
        link = span.links.add()
        link.trace_id, link.span_id = b"\x03" * 16, b"\x04" * 8
    return req.SerializeToString()


def _dropped(reg: CollectorRegistry, kind: str) -> float:
    return (
        reg.get_sample_value("agent_monitor_otlp_span_items_dropped_total", {"kind": kind}) or 0.0
    )


async def test_an_event_bomb_is_decoded_in_a_worker_thread_with_its_events_and_links_capped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a bomb is being decoded, /metrics (the same process's metrics port) is answered.

    The decode is held until /metrics has answered: were it on the event loop, /metrics could not
    answer and the hold would run out (no timing is asserted, only the order).
    """
    threads: list[str] = []
    released: list[bool] = []
    answered = threading.Event()

    def spying(body: bytes, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        if len(body) > 1_000_000:
            released.append(answered.wait(30))
        return decode_protobuf(body, **kw)

    monkeypatch.setattr(_otlp_receiver, "decode_protobuf", spying)
    reg = CollectorRegistry()
    async with receiving(registry=reg) as (_, receiver, _), HttpServer(reg, port=0) as web:
        data = _bomb(1_500_000, links=1_000)
        # under the body cap, as the attacker's
        assert 2_000_000 < len(data) < receiver.settings.max_body_bytes
        bomb = asyncio.create_task(apost(receiver.url, data, ctype="application/x-protobuf"))
        await until(lambda: bool(threads))  # the decode began (and holds)

        def scrape() -> bytes:
            with urllib.request.urlopen(f"{web.url}metrics", timeout=30) as r:
                return bytes(r.read())

        text = await asyncio.to_thread(scrape)
        answered.set()
        assert b"agent_monitor_otlp_span_items_dropped_total" in text
        status, _, _ = await bomb
        # /metrics answered while the bomb was being decoded
        assert status == 200 and released == [True]
        assert threads[0] != threading.main_thread().name  # decoded off the event loop's thread
        assert receiver.statistics().decoded_off_loop == 1
        assert (
            _dropped(reg, "events") == 1_500_000 - MAX_EVENTS
            and _dropped(reg, "links") == 1_000 - 128
        )
        # A small body is decoded on the loop (a thread hop costs more than it saves).
        status, _, _ = await apost(receiver.url, _bomb(10), ctype="application/x-protobuf")
        assert status == 200 and receiver.statistics().decoded_off_loop == 1


def test_decoding_reads_no_more_than_the_cap_of_events() -> None:
    decoded = decode_protobuf(_bomb(1_000), max_spans=10, max_attribute_bytes=1024)
    (span,) = decoded.spans
    assert len(span.events) == MAX_EVENTS and decoded.dropped == {"events": 1_000 - MAX_EVENTS}


async def test_the_sdk_exporters_span_with_thousands_of_events_keeps_its_step_and_counts_the_rest() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    reg = CollectorRegistry()
    async with receiving(registry=reg) as (_, receiver, _):
        provider = TracerProvider(
            resource=Resource.create({"service.name": "chatty-agent"}),
            span_limits=SpanLimits(max_events=5_000),
        )
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.url, timeout=10))
        )
        tracer = provider.get_tracer("chatty")

        def run() -> str:
            root = tracer.start_span(
                "invoke_agent a", attributes={"gen_ai.operation.name": "invoke_agent"}
            )
            from opentelemetry import trace

            ctx = trace.set_span_in_context(root)
            tool = tracer.start_span(
                "execute_tool t",
                context=ctx,
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "grep",
                    "gen_ai.tool.call.result": "3 matches",
                    "agent_monitor.task": "find the bug",
                    "gen_ai.input.messages": user("find the bug"),
                },
            )
            for i in range(3_000):
                tool.add_event(f"tick {i}")
            tool.end()
            root.end()
            return f"{root.get_span_context().trace_id:032x}"

        try:
            trace_id = await asyncio.to_thread(run)
        finally:
            await asyncio.to_thread(provider.shutdown)
        await until(lambda: _dropped(reg, "events") == 3_000 - MAX_EVENTS)
        # The span is still the run's step (its events past the cap dropped, not the span).
        await until(lambda: receiver.statistics().steps == 1)
        assert trace_id and reg.get_sample_value("agent_monitor_otlp_spans_accepted_total") == 2


async def test_a_run_id_set_only_on_the_root_span_names_the_run() -> None:
    """The root ends (and is exported) last: the trace's steps sent so far move to the run the
    root names."""
    from opentelemetry import trace

    from tests.daemon.sources.otlp.test_otlp_receiver import closed, sdk, texts

    async with receiving() as (monitor, receiver, events):
        with sdk(receiver.url) as tracer:
            root = tracer.start_span(
                "invoke_agent a",
                attributes={
                    "gen_ai.operation.name": "invoke_agent",
                    "gen_ai.input.messages": user("fix it"),
                },
            )
            trace_id = f"{root.get_span_context().trace_id:032x}"

            def children() -> None:
                ctx = trace.set_span_in_context(root)
                chat = {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.input.messages": user("fix it"),
                    "gen_ai.completion": "Let me grep for the bug.",
                }
                tracer.start_span("chat m", context=ctx, attributes=chat).end()
                attributes = {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "grep",
                    "gen_ai.tool.call.result": "3 matches",
                }
                tracer.start_span("execute_tool grep", context=ctx, attributes=attributes).end()

            await asyncio.to_thread(children)
            # The children arrived first: a run of the trace id holds their steps.
            await until(lambda: len(texts(monitor, trace_id)) == 2)
            before = texts(monitor, trace_id)
            # only on the root, as the docs allow
            root.set_attribute("agent_monitor.run_id", "job-7")
            await asyncio.to_thread(root.end)
        # The named run holds the trace's steps, in order; the trace id's run ended with no outcome.
        await until(
            lambda: texts(monitor, "job-7") == before and closed(events, trace_id) is not None
        )
        assert monitor.run(trace_id) is None and len(before) == 2 and "3 matches" in before[1]
        assert receiver.traces.span_of("job-7", 2) is not None  # the steps keep their spans
