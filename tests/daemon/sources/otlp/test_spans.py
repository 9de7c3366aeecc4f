"""The span-to-step mapping (pure): both generations of the GenAI conventions, OpenInference, and
bounded decoding."""

from __future__ import annotations

import json
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from agent_monitor.daemon.sources.otlp._spans import (
    Span,
    SpanError,
    TooManySpans,
    classify,
    decode_json,
    decode_protobuf,
    span_outcome,
    span_run_key,
    step_text,
    task_of,
)


def span(
    attrs: dict[str, Any],
    *,
    name: str = "s",
    parent: str = "1" * 16,
    status: int = 0,
    events: Any = (),
) -> Span:
    return Span("a" * 32, "b" * 16, parent, name, 1, 2, status, "it broke", attrs, tuple(events))


def text(s: Span) -> str | None:
    action = classify(s)
    assert action is not None
    return step_text(s, action, 10_000)


def test_the_deprecated_genai_forms_are_read() -> None:
    flat = span(
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.prompt.0.role": "system",
            "gen_ai.prompt.0.content": "Be brief.",
            "gen_ai.prompt.1.role": "user",
            "gen_ai.prompt.1.content": "Fix the bug",
            "gen_ai.completion.0.role": "assistant",
            "gen_ai.completion.0.content": "Looking at parser.py",
            "gen_ai.completion.0.tool_calls.0.name": "read_file",
            "gen_ai.completion.0.tool_calls.0.arguments": '{"path": "parser.py"}',
        }
    )
    assert task_of(flat, "model") == "Fix the bug"
    assert text(flat) == (
        'Assistant: Looking at parser.py\nTool call: read_file({"path": "parser.py"})'
    )
    evented = span(
        {"gen_ai.operation.name": "text_completion"},
        events=[
            (
                "gen_ai.content.prompt",
                {"gen_ai.prompt": json.dumps([{"role": "user", "content": "Sum 2 and 2"}])},
            ),
            (
                "gen_ai.content.completion",
                {"gen_ai.completion": json.dumps([{"role": "assistant", "content": "4"}])},
            ),
        ],
    )
    assert task_of(evented, "model") == "Sum 2 and 2" and text(evented) == "Assistant: 4"


def test_current_genai_messages_and_a_model_turn_without_content() -> None:
    out = [
        {
            "role": "assistant",
            "parts": [
                {"type": "text", "content": "Done."},
                {"type": "tool_call", "name": "commit", "arguments": {"m": "fix"}},
            ],
        }
    ]
    # a structured value, not JSON text
    s = span({"gen_ai.operation.name": "chat", "gen_ai.output.messages": out})
    assert text(s) == 'Assistant: Done.\nTool call: commit({"m":"fix"})'
    assert text(span({"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"})) is None


def test_openinference_messages_tools_handoffs_and_errors() -> None:
    llm = span(
        {
            "openinference.span.kind": "LLM",
            "llm.input_messages.0.message.role": "user",
            "llm.input_messages.0.message.content": "Book a table",
            "llm.output_messages.0.message.role": "assistant",
            "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "book",
            "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": '{"n": 2}',
        }
    )
    assert task_of(llm, "model") == "Book a table" and text(llm) == 'Tool call: book({"n": 2})'
    tool = span(
        {"openinference.span.kind": "TOOL", "tool.name": "book", "input.value": '{"n": 2}'},
        status=2,
    )
    assert text(tool) == 'Tool call: book({"n": 2})\nError: it broke'
    handoff = span(
        {"openinference.span.kind": "TOOL", "input.value": "triage", "output.value": "billing"},
        name="handoff to billing",
    )
    assert classify(handoff) == "handoff" and text(handoff) == "Hand-off from triage to billing"
    assert classify(span({"openinference.span.kind": "CHAIN"})) is None
    assert classify(span({"http.method": "GET"})) is None
    agent = span({"openinference.span.kind": "AGENT", "input.value": "Plan a trip"}, parent="")
    assert classify(agent) == "agent" and task_of(agent, "agent") == "Plan a trip"


def test_run_keys_outcomes_and_bounded_text() -> None:
    assert span_run_key(span({"gen_ai.conversation.id": "c1", "agent_monitor.run_id": "r1"})) == (
        "run_id",
        "r1",
    )
    assert span_run_key(span({"gen_ai.conversation.id": "c1"})) == ("conversation", "c1")
    assert span_run_key(span({})) is None
    assert span_outcome(span({"agent_monitor.outcome": "SUCCESS"}, status=2)) == "success"
    assert span_outcome(span({}, status=2)) == "failure" and span_outcome(span({})) is None
    long = span(
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "t",
            "gen_ai.tool.call.result": "x" * 500,
        }
    )
    cut = step_text(long, "tool", 100)
    assert cut is not None and len(cut) == 100 and cut.endswith("…")


def pb_request(n: int, value: str = "v") -> bytes:
    spans = [
        PbSpan(
            trace_id=bytes.fromhex("ab" * 16),
            span_id=(i + 1).to_bytes(8, "big"),
            name="execute_tool t",
            start_time_unix_nano=1,
            end_time_unix_nano=2 + i,
            attributes=[
                KeyValue(key="gen_ai.tool.call.result", value=AnyValue(string_value=value))
            ],
        )
        for i in range(n)
    ]
    # an invalid trace id
    spans.append(PbSpan(trace_id=b"\0" * 16, span_id=b"\1" * 8, end_time_unix_nano=5))
    req = ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])]
    )
    return req.SerializeToString()


def test_protobuf_decoding_bounds_values_and_counts_unreadable_spans() -> None:
    d = decode_protobuf(pb_request(2, "é" * 300), max_spans=10, max_attribute_bytes=100)
    assert [s.span_id for s in d.spans] == ["0000000000000001", "0000000000000002"]
    assert d.rejected == 1 and "trace_id" in d.reason and d.truncated == 2
    value = d.spans[0].attributes["gen_ai.tool.call.result"]
    assert len(value.encode()) <= 100 + len("…".encode())
    with pytest.raises(TooManySpans):
        decode_protobuf(pb_request(3), max_spans=3, max_attribute_bytes=100)
    with pytest.raises(SpanError):
        decode_protobuf(b"\x0a\xff\xff\xff\xff", max_spans=3, max_attribute_bytes=100)


def test_json_decoding_takes_hex_ids_and_rejects_others() -> None:
    good = {
        "traceId": "AB" * 16,
        "spanId": "01" * 8,
        "endTimeUnixNano": 5,
        "attributes": [{"key": "k", "value": {"intValue": "7"}}],
    }
    b64 = {"traceId": "q83vEjRWeJq83vEjRWeJqw==", "spanId": "AQIDBAUGBwg=", "endTimeUnixNano": "5"}
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [good, b64]}]}]}).encode()
    d = decode_json(body, max_spans=10, max_attribute_bytes=100)
    assert [(s.trace_id, s.attributes) for s in d.spans] == [("ab" * 16, {"k": 7})]
    assert d.rejected == 1 and "hex" in d.reason
    for bad in (b"[]", b'{"resourceSpans": 3}', b"\xff"):
        with pytest.raises(SpanError):
            decode_json(bad, max_spans=10, max_attribute_bytes=100)
