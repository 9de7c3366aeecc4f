"""OTLP spans as agent steps: decode an export request (protobuf or JSON), read the semantic
conventions. Pure.

`decode_protobuf` and `decode_json` turn an `ExportTraceServiceRequest` into `Span`s (ids as
lowercase hex, attribute values as plain Python, every string bounded), the spans they could not
read counted, never raised for. `classify` says what agent action a span is, reading both the
OpenTelemetry GenAI conventions (`gen_ai.operation.name`; the current
`gen_ai.input.messages`/`gen_ai.output.messages` and the deprecated
`gen_ai.prompt`/`gen_ai.completion` attributes and events) and OpenInference's
(`openinference.span.kind`, `input.value`, `output.value`, `llm.input_messages.*`,
`llm.output_messages.*`, `tool.*`); `step_text` writes a step's text from them, `task_of` a run's
task, `span_outcome` a root span's outcome.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "MAX_EVENTS",
    "MAX_LINKS",
    "Decoded",
    "Span",
    "SpanError",
    "TooManySpans",
    "classify",
    "decode_json",
    "decode_protobuf",
    "span_outcome",
    "span_run_key",
    "step_text",
    "task_of",
]

Action = Literal["agent", "tool", "model", "handoff"]

STATUS_ERROR = 2
RUN_ID_ATTR = "agent_monitor.run_id"
TASK_ATTR = "agent_monitor.task"
OUTCOME_ATTR = "agent_monitor.outcome"
CONVERSATION_ATTR = "gen_ai.conversation.id"
# Attributes kept per span at most (the SDK's own default limit is 128): the rest are dropped, not
# read.
MAX_ATTRIBUTES = 256
# Events and links of one span read at most (the SDK's defaults are 128 each); the rest are dropped,
# counted.
MAX_EVENTS = 128
MAX_LINKS = 128
_MAX_DEPTH = 8


class SpanError(ValueError):
    """A request body that is not an OTLP trace export request (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One finished span of an export request: ids in lowercase hex, attributes as plain values."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    status: int = 0
    """0 unset, 1 ok, 2 error (OTLP's StatusCode)."""
    status_message: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    resource: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_root(self) -> bool:
        """Whether the span has no parent (the trace's root)."""
        return not self.parent_id


@dataclass(slots=True)
class Decoded:
    """The spans of one request, how many could not be read and why (the first reason), and
    truncations."""

    spans: list[Span] = field(default_factory=list)
    rejected: int = 0
    reason: str = ""
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Items over their per-span cap, not read, by kind: `events`, `links`, `attributes`."""

    def drop(self, kind: str, n: int) -> None:
        """Count `n` items of a kind dropped over their cap."""
        if n > 0:
            self.dropped[kind] = self.dropped.get(kind, 0) + n

    def reject(self, why: str) -> None:
        """Count one span that could not be read."""
        self.rejected += 1
        self.reason = self.reason or why


class _Bound:
    """Bounds every string value of a request (attribute bytes), counting the strings cut."""

    def __init__(self, max_bytes: int) -> None:
        self.max = max_bytes
        self.cut = 0

    def text(self, value: str) -> str:
        if len(value) <= self.max // 4 or len(value.encode("utf-8", "surrogatepass")) <= self.max:
            return value
        self.cut += 1
        return value.encode("utf-8", "surrogatepass")[: self.max].decode("utf-8", "ignore") + "…"


# -- protobuf --


def decode_protobuf(body: bytes, *, max_spans: int, max_attribute_bytes: int) -> Decoded:
    """The spans of a protobuf `ExportTraceServiceRequest`; SpanError when it is not one or has
    over `max_spans`."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    # protobuf's DecodeError (its module is untyped), RecursionError on deep nesting
    except Exception as e:
        raise SpanError(f"the body is not a protobuf ExportTraceServiceRequest ({e})") from None
    n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    if n > max_spans:
        raise TooManySpans(n)
    bound = _Bound(max_attribute_bytes)
    out = Decoded()
    for rs in request.resource_spans:
        resource = _pb_attributes(rs.resource.attributes, bound)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.drop("events", len(s.events) - MAX_EVENTS)
                out.drop("links", len(s.links) - MAX_LINKS)
                out.drop("attributes", len(s.attributes) - MAX_ATTRIBUTES)
                trace_id, span_id = s.trace_id.hex(), s.span_id.hex()
                if (
                    len(trace_id) != 32
                    or trace_id == "0" * 32
                    or len(span_id) != 16
                    or span_id == "0" * 16
                ):
                    out.reject("a span has no valid trace_id (16 bytes) or span_id (8 bytes)")
                    continue
                if not s.end_time_unix_nano:
                    out.reject(f"span {span_id} has no end time")
                    continue
                out.spans.append(
                    Span(
                        trace_id=trace_id,
                        span_id=span_id,
                        parent_id=s.parent_span_id.hex() if len(s.parent_span_id) == 8 else "",
                        name=bound.text(s.name),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status=int(s.status.code),
                        status_message=bound.text(s.status.message),
                        attributes=_pb_attributes(s.attributes, bound),
                        events=tuple(
                            (bound.text(e.name), _pb_attributes(e.attributes, bound))
                            for e in s.events[:MAX_EVENTS]
                        ),
                        resource=resource,
                    )
                )
    out.truncated = bound.cut
    return out


class TooManySpans(SpanError):
    """A request with more spans than the limit (HTTP 413)."""

    def __init__(self, n: int) -> None:
        super().__init__(f"{n} spans")
        self.n = n


def _pb_attributes(kvs: Any, bound: _Bound) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs[:MAX_ATTRIBUTES]:
        out[bound.text(kv.key)] = _pb_value(kv.value, bound, 0)
    return out


def _pb_value(v: Any, bound: _Bound, depth: int) -> Any:
    which = v.WhichOneof("value")
    if which == "string_value":
        return bound.text(v.string_value)
    if which in ("bool_value", "int_value", "double_value"):
        return getattr(v, which)
    if which == "bytes_value":
        return bound.text(bytes(v.bytes_value).hex())
    if depth >= _MAX_DEPTH:
        return None
    if which == "array_value":
        return [_pb_value(x, bound, depth + 1) for x in v.array_value.values[:MAX_ATTRIBUTES]]
    if which == "kvlist_value":
        return {
            bound.text(kv.key): _pb_value(kv.value, bound, depth + 1)
            for kv in v.kvlist_value.values[:MAX_ATTRIBUTES]
        }
    return None


# -- JSON (the OTLP/JSON mapping: lowerCamelCase names, hex ids, 64-bit integers as strings or
# numbers) --


def decode_json(body: bytes, *, max_spans: int, max_attribute_bytes: int) -> Decoded:
    """The spans of an OTLP/JSON `ExportTraceServiceRequest`; SpanError when it is not one or has
    over `max_spans`."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise SpanError(f"the body is not JSON ({e})") from None
    if not isinstance(request, dict):
        raise SpanError(
            "the body is not an OTLP/JSON ExportTraceServiceRequest (an object with resourceSpans)"
        )
    resource_spans = _list(request.get("resourceSpans"), "resourceSpans")
    scopes = [
        (rs, ss)
        for rs in resource_spans
        if isinstance(rs, dict)
        for ss in _list(rs.get("scopeSpans"), "scopeSpans")
        if isinstance(ss, dict)
    ]
    n = sum(len(_list(ss.get("spans"), "spans")) for _, ss in scopes)
    if n > max_spans:
        raise TooManySpans(n)
    bound = _Bound(max_attribute_bytes)
    out = Decoded()
    resources: dict[int, dict[str, Any]] = {}
    for rs, ss in scopes:
        resource = resources.get(id(rs))
        if resource is None:
            res = rs.get("resource")
            resource = resources[id(rs)] = _json_attributes(
                res.get("attributes") if isinstance(res, dict) else None, bound
            )
        for s in _list(ss.get("spans"), "spans"):
            if isinstance(s, dict):
                for kind, cap in (
                    ("events", MAX_EVENTS),
                    ("links", MAX_LINKS),
                    ("attributes", MAX_ATTRIBUTES),
                ):
                    items = s.get(kind)
                    out.drop(kind, len(items) - cap if isinstance(items, list) else 0)
            try:
                out.spans.append(_json_span(s, resource, bound))
            except (TypeError, ValueError) as e:
                out.reject(str(e))
    out.truncated = bound.cut
    return out


_HEX = re.compile(r"[0-9a-fA-F]*")


def _list(value: object, name: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpanError(f"{name} is not a list")
    return value


def _hex_id(value: object, size: int, name: str, *, required: bool = True) -> str:
    if value in (None, "") and not required:
        return ""
    if (
        not isinstance(value, str)
        or len(value) != size * 2
        or not _HEX.fullmatch(value)
        or not value.strip("0")
    ):
        raise ValueError(
            f"a span's {name} is not {size} bytes of hex (the OTLP/JSON mapping writes ids in hex)"
        )
    return value.lower()


def _nanos(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"a span's {name} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise ValueError(f"a span's {name} is not an integer of nanoseconds")


def _json_span(s: object, resource: dict[str, Any], bound: _Bound) -> Span:
    if not isinstance(s, dict):
        raise ValueError("a span is not an object")
    span_id = _hex_id(s.get("spanId"), 8, "spanId")
    end = _nanos(s.get("endTimeUnixNano", 0), "endTimeUnixNano")
    if not end:
        raise ValueError(f"span {span_id} has no end time")
    status = s.get("status") if isinstance(s.get("status"), dict) else {}
    assert isinstance(status, dict)
    code = status.get("code", 0)
    code = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}.get(code, code)
    events = []
    for e in _list(s.get("events"), "events")[:MAX_EVENTS]:
        if isinstance(e, dict):
            events.append(
                (bound.text(str(e.get("name", ""))), _json_attributes(e.get("attributes"), bound))
            )
    return Span(
        trace_id=_hex_id(s.get("traceId"), 16, "traceId"),
        span_id=span_id,
        parent_id=_hex_id(s.get("parentSpanId"), 8, "parentSpanId", required=False),
        name=bound.text(str(s.get("name", ""))),
        start_ns=_nanos(s.get("startTimeUnixNano", 0), "startTimeUnixNano"),
        end_ns=end,
        status=code if isinstance(code, int) and not isinstance(code, bool) else 0,
        status_message=bound.text(str(status.get("message", ""))),
        attributes=_json_attributes(s.get("attributes"), bound),
        events=tuple(events),
        resource=resource,
    )


def _json_attributes(kvs: object, bound: _Bound) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not isinstance(kvs, list):
        return out
    for kv in kvs[:MAX_ATTRIBUTES]:
        if isinstance(kv, dict) and isinstance(kv.get("key"), str):
            out[bound.text(kv["key"])] = _json_value(kv.get("value"), bound, 0)
    return out


def _json_value(v: object, bound: _Bound, depth: int) -> Any:
    if not isinstance(v, dict):
        return None
    if "stringValue" in v:
        return bound.text(str(v["stringValue"]))
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        try:
            return int(v["intValue"])
        except (TypeError, ValueError):
            return None
    if "doubleValue" in v:
        try:
            return float(v["doubleValue"])
        except (TypeError, ValueError):
            return None
    if "bytesValue" in v:  # base64 in the JSON mapping; kept as it came
        return bound.text(str(v["bytesValue"]))
    if depth >= _MAX_DEPTH:
        return None
    if isinstance(v.get("arrayValue"), dict):
        values = v["arrayValue"].get("values")
        return (
            [_json_value(x, bound, depth + 1) for x in values[:MAX_ATTRIBUTES]]
            if isinstance(values, list)
            else []
        )
    if isinstance(v.get("kvlistValue"), dict):
        values = v["kvlistValue"].get("values")
        return (
            {
                bound.text(kv["key"]): _json_value(kv.get("value"), bound, depth + 1)
                for kv in values[:MAX_ATTRIBUTES]
                if isinstance(kv, dict) and isinstance(kv.get("key"), str)
            }
            if isinstance(values, list)
            else {}
        )
    return None


# -- the conventions --

_GENAI_ACTIONS: dict[str, Action] = {
    "invoke_agent": "agent",
    "create_agent": "agent",
    "execute_tool": "tool",
    "chat": "model",
    "text_completion": "model",
    "generate_content": "model",
}
_OPENINFERENCE_ACTIONS: dict[str, Action] = {"AGENT": "agent", "TOOL": "tool", "LLM": "model"}


def classify(span: Span) -> Action | None:
    """What agent action the span is (agent, tool, model, handoff), or None for a span that is no
    action."""
    a = span.attributes
    op = a.get("gen_ai.operation.name")
    if isinstance(op, str) and op in _GENAI_ACTIONS:
        return _GENAI_ACTIONS[op]
    if op in ("handoff", "transfer"):
        return "handoff"
    kind = a.get("openinference.span.kind")
    if isinstance(kind, str):
        action = _OPENINFERENCE_ACTIONS.get(kind.upper())
        if action == "tool" and span.name.startswith("handoff to "):
            return "handoff"  # the Agents SDK's hand-offs surface as TOOL spans named so
        return action
    return None


def span_run_key(span: Span) -> tuple[str, str] | None:
    """The run a span names besides its trace: ("run_id" | "conversation", id), from the span or
    its resource."""
    for attrs in (span.attributes, span.resource):
        v = attrs.get(RUN_ID_ATTR)
        if isinstance(v, str) and v:
            return "run_id", v
    for attrs in (span.attributes, span.resource):
        v = attrs.get(CONVERSATION_ATTR)
        if isinstance(v, str) and v:
            return "conversation", v
    return None


def span_outcome(span: Span) -> Literal["success", "failure"] | None:
    """A root span's outcome: `agent_monitor.outcome` when it says success or failure, else
    failure on ERROR."""
    v = span.attributes.get(OUTCOME_ATTR)
    if isinstance(v, str) and v.lower() in ("success", "failure"):
        return "success" if v.lower() == "success" else "failure"
    return "failure" if span.status == STATUS_ERROR else None


def task_of(span: Span, action: Action | None) -> str | None:
    """The user input a span records (`agent_monitor.task` first), for an agent or model span;
    else None."""
    explicit = span.attributes.get(TASK_ATTR)
    if isinstance(explicit, str) and explicit.strip():
        return explicit.strip()
    if action not in ("agent", "model"):
        return None
    a = span.attributes
    for messages in _input_messages(span):
        text = _first_user_text(messages)
        if text:
            return text
    if action == "agent":
        value = a.get("input.value")
        if isinstance(value, str) and value.strip():
            parsed = _maybe_json(value)
            text = _first_user_text(parsed) if isinstance(parsed, list) else None
            return text or (
                value.strip() if not isinstance(parsed, (dict, list)) else _as_text(parsed)
            )
    return None


def step_text(span: Span, action: Action, max_chars: int) -> str | None:
    """The text of a step for an action span (None: a model turn whose content was not recorded)."""
    text: str | None
    if action == "tool":
        text = _tool_text(span)
    elif action == "model":
        text = _model_text(span)
    elif action == "handoff":
        a = span.attributes
        src, dst = a.get("input.value"), a.get("output.value")
        text = (
            f"Hand-off{f' from {src}' if src else ''}{f' to {dst}' if dst else ''}"
            if src or dst
            else span.name
        )
    else:
        return None
    if text is None:
        return None
    if span.status == STATUS_ERROR:
        text += f"\nError: {span.status_message or 'the span ended with status ERROR'}"
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _tool_text(span: Span) -> str:
    a = span.attributes
    name = (
        a.get("gen_ai.tool.name") or a.get("tool.name") or span.name.removeprefix("execute_tool ")
    )
    args = a.get("gen_ai.tool.call.arguments")
    if args is None:
        args = a.get("input.value")
    result = a.get("gen_ai.tool.call.result")
    if result is None:
        result = a.get("output.value")
    text = f"Tool call: {name}({_as_text(args) if args is not None else ''})"
    if result is not None:
        text += f"\nResult: {_as_text(result)}"
    return text


def _model_text(span: Span) -> str | None:
    a = span.attributes
    parts: list[str] = []
    for messages in _output_messages(span):
        parts.extend(_message_lines(messages))
        if parts:
            break
    if not parts:
        value = a.get("output.value")
        if isinstance(value, str) and value.strip():
            parsed = _maybe_json(value)
            parts = _response_lines(parsed) if isinstance(parsed, dict) else []
            if not parts:
                parts = [f"Assistant: {value.strip()}"]
    return "\n".join(parts) if parts else None


def _input_messages(span: Span) -> Iterator[Any]:
    """The input messages a span records, in each form the conventions have used, most current
    first."""

    def user(name: str, attrs: Mapping[str, Any]) -> Any:
        return (
            [{"role": "user", "content": attrs.get("content")}]
            if name == "gen_ai.user.message"
            else None
        )

    return _messages(span, "gen_ai.input.messages", "prompt", "llm.input_messages", user)


def _output_messages(span: Span) -> Iterator[Any]:
    """The output messages a span records, in each form the conventions have used, most current
    first."""

    def choice(name: str, attrs: Mapping[str, Any]) -> Any:
        return [attrs.get("message", attrs)] if name == "gen_ai.choice" else None

    return _messages(span, "gen_ai.output.messages", "completion", "llm.output_messages", choice)


def _messages(
    span: Span,
    current: str,
    legacy: str,
    openinference: str,
    event: Callable[[str, Mapping[str, Any]], Any],
) -> Iterator[Any]:
    """One side's messages: the current attribute, the legacy `gen_ai.{legacy}` (whole, indexed, or
    in a `gen_ai.content.{legacy}` event), OpenInference's flattened list, and the side's own event
    (`event`)."""
    a, old = span.attributes, f"gen_ai.{legacy}"
    for key in (current, old):
        v = a.get(key)
        if v is not None:
            yield _maybe_json(v) if isinstance(v, str) else v
    yield _indexed(a, old)
    yield _openinference_messages(a, openinference)
    for name, attrs in span.events:
        if name == f"gen_ai.content.{legacy}" and old in attrs:
            v = attrs[old]
            yield _maybe_json(v) if isinstance(v, str) else v
        elif (own := event(name, attrs)) is not None:
            yield own


def _maybe_json(value: str) -> Any:
    s = value.strip()
    if s[:1] in ("[", "{"):
        try:
            return json.loads(s)
        except (ValueError, RecursionError):
            return value
    return value


def _indexed(a: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Messages flattened as `{prefix}.{i}.role`, `.content`, `.tool_calls.{j}.name|arguments`
    (the older form)."""
    out: dict[int, dict[str, Any]] = {}
    p = prefix + "."
    for key, value in a.items():
        if not key.startswith(p):
            continue
        head, _, rest = key[len(p) :].partition(".")
        if not head.isdigit() or not rest:
            continue
        msg = out.setdefault(int(head), {})
        if rest.startswith("tool_calls."):
            j, _, field_ = rest[len("tool_calls.") :].partition(".")
            if j.isdigit():
                call = msg.setdefault("tool_calls", {}).setdefault(int(j), {})
                call[field_.removeprefix("function.")] = value
        else:
            msg[rest] = value
    for msg in out.values():
        if "tool_calls" in msg:
            msg["tool_calls"] = [msg["tool_calls"][j] for j in sorted(msg["tool_calls"])]
    return [out[i] for i in sorted(out)]


def _openinference_messages(a: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """OpenInference's
    `{prefix}.{i}.message.role|content|contents.{k}.message_content.text|tool_calls.{j}...`."""
    out: dict[int, dict[str, Any]] = {}
    p = prefix + "."
    for key, value in a.items():
        if not key.startswith(p):
            continue
        head, _, rest = key[len(p) :].partition(".")
        if not head.isdigit() or not rest.startswith("message."):
            continue
        rest = rest[len("message.") :]
        msg = out.setdefault(int(head), {})
        if rest in ("role", "content"):
            msg[rest] = value
        elif rest.startswith("contents.") and rest.endswith(".message_content.text"):
            msg.setdefault("texts", []).append(value)
        elif rest.startswith("tool_calls."):
            j, _, field_ = rest[len("tool_calls.") :].partition(".")
            if j.isdigit():
                call = msg.setdefault("tool_calls", {}).setdefault(int(j), {})
                call[field_.removeprefix("tool_call.").removeprefix("function.")] = value
    for msg in out.values():
        if "texts" in msg and not msg.get("content"):
            msg["content"] = "\n".join(str(t) for t in msg["texts"])
        if "tool_calls" in msg:
            msg["tool_calls"] = [msg["tool_calls"][j] for j in sorted(msg["tool_calls"])]
    return [out[i] for i in sorted(out)]


def _first_user_text(messages: Any) -> str | None:
    if isinstance(messages, str):
        return messages.strip() or None
    if not isinstance(messages, list):
        return None
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            text = _content_text(m)
            if text:
                return text
    return None


def _content_text(m: Mapping[str, Any]) -> str:
    """The text of a message: `content` (a string or parts) or the current conventions' `parts`."""
    pieces: list[str] = []
    content = m.get("content")
    if isinstance(content, str):
        pieces.append(content)
    elif isinstance(content, list):
        pieces.extend(_part_text(p) for p in content)
    for p in m.get("parts") or ():
        if isinstance(p, dict) and p.get("type") in (None, "text"):
            pieces.append(_part_text(p))
    return "\n".join(p for p in pieces if p).strip()


def _part_text(p: object) -> str:
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        for k in ("content", "text"):
            if isinstance(p.get(k), str):
                return str(p[k])
    return ""


def _message_lines(messages: Any) -> list[str]:
    """Assistant text and tool calls of output messages, one line each."""
    if isinstance(messages, str):
        return [f"Assistant: {messages.strip()}"] if messages.strip() else []
    if isinstance(messages, dict):
        messages = [messages]
    if not isinstance(messages, list):
        return []
    lines: list[str] = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in (None, "assistant", "model"):
            continue
        text = _content_text(m)
        if text:
            lines.append(f"Assistant: {text}")
        for p in m.get("parts") or ():
            if isinstance(p, dict) and p.get("type") == "tool_call":
                lines.append(_call_line(p.get("name"), p.get("arguments")))
        for c in m.get("tool_calls") or ():
            if isinstance(c, dict):
                fn = c.get("function") if isinstance(c.get("function"), dict) else c
                assert isinstance(fn, dict)
                lines.append(_call_line(fn.get("name"), fn.get("arguments")))
    return lines


def _response_lines(response: Mapping[str, Any]) -> list[str]:
    """The assistant text and function calls of a Responses API object or a chat completion
    (output.value)."""
    lines: list[str] = []
    for item in response.get("output") or ():
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            text = "\n".join(
                str(c.get("text"))
                for c in item.get("content") or ()
                if isinstance(c, dict) and c.get("text")
            )
            if text:
                lines.append(f"Assistant: {text}")
        elif item.get("type") == "function_call":
            lines.append(_call_line(item.get("name"), item.get("arguments")))
    for choice in response.get("choices") or ():
        if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
            lines.extend(_message_lines([choice["message"]]))
    return lines


def _call_line(name: object, arguments: object) -> str:
    return f"Tool call: {name or '?'}({_as_text(arguments) if arguments is not None else ''})"


def _as_text(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        return str(value)
