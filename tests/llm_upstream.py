"""A scripted LLM API upstream for the proxy's tests: OpenAI chat and responses, Anthropic messages,
streamed or not.

Each POST takes the next scripted reply: an `Answer` (text and tool calls, written in the format of
the path that was asked, as a stream of server-sent events when the request says `stream: true`,
one choice per answer for chat's `n`), or an `Error` (status and body, sent as they are). Requests
are recorded with their headers. Written independently of the proxy's own encoders, from the
providers' documented wire formats, so a wrong proxy cannot pass by agreeing with itself.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Answer:
    """An assistant turn: text and tool calls (name, arguments)."""

    text: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cut_after: int | None = None
    """Streamed: close the connection after this many events, mid-body (an upstream that breaks
    off)."""


@dataclass
class Error:
    """An error reply, sent unchanged."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


Reply = Answer | Error | list[Answer]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def _chat(answers: list[Answer], model: str) -> dict[str, Any]:
    choices = []
    for i, a in enumerate(answers):
        msg: dict[str, Any] = {"role": "assistant", "content": a.text or None}
        if a.calls:
            msg["tool_calls"] = [
                {
                    "id": f"call_{i}_{j}",
                    "type": "function",
                    "function": {"name": n, "arguments": json.dumps(args)},
                }
                for j, (n, args) in enumerate(a.calls)
            ]
        choices.append(
            {
                "index": i,
                "message": msg,
                "logprobs": None,
                "finish_reason": "tool_calls" if a.calls else "stop",
            }
        )
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def _chat_stream(a: Answer, model: str) -> Iterator[bytes]:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return (
            "data: "
            + json.dumps(
                {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            )
            + "\n\n"
        ).encode()

    yield chunk({"role": "assistant", "content": ""})
    for piece in _pieces(a.text):
        yield chunk({"content": piece})
    for j, (n, args) in enumerate(a.calls):
        raw = json.dumps(args)
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": j,
                        "id": f"call_{j}",
                        "type": "function",
                        "function": {"name": n, "arguments": ""},
                    }
                ]
            }
        )
        for piece in _pieces(raw):
            yield chunk({"tool_calls": [{"index": j, "function": {"arguments": piece}}]})
    yield chunk({}, "tool_calls" if a.calls else "stop")
    yield b"data: [DONE]\n\n"


def _pieces(text: str) -> list[str]:
    if not text:
        return []
    third = max(1, len(text) // 3)
    return [text[i : i + third] for i in range(0, len(text), third)]


def _responses(a: Answer, model: str) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if a.text:
        output.append(
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": a.text, "annotations": []}],
            }
        )
    for j, (n, args) in enumerate(a.calls):
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{j}",
                "call_id": f"call_{j}",
                "name": n,
                "arguments": json.dumps(args),
                "status": "completed",
            }
        )
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 10,
            "output_tokens": 5,
            "total_tokens": 15,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def _responses_stream(a: Answer, model: str) -> Iterator[bytes]:
    full = _responses(a, model)
    seq = 0

    def ev(kind: str, data: dict[str, Any]) -> bytes:
        nonlocal seq
        seq += 1
        return (
            f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n"
        ).encode()

    yield ev("response.created", {"response": {**full, "status": "in_progress", "output": []}})
    for i, item in enumerate(full["output"]):
        yield ev("response.output_item.added", {"output_index": i, "item": item})
        if item["type"] == "message":
            for piece in _pieces(a.text):
                yield ev(
                    "response.output_text.delta",
                    {
                        "item_id": "msg_1",
                        "output_index": i,
                        "content_index": 0,
                        "delta": piece,
                        "logprobs": [],
                    },
                )
        yield ev("response.output_item.done", {"output_index": i, "item": item})
    yield ev("response.completed", {"response": full})


def _message(a: Answer, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if a.text:
        content.append({"type": "text", "text": a.text})
    for j, (n, args) in enumerate(a.calls):
        content.append({"type": "tool_use", "id": f"toolu_{j}", "name": n, "input": args})
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if a.calls else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 5},
    }


def _message_stream(a: Answer, model: str) -> Iterator[bytes]:
    def ev(kind: str, data: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    full = _message(a, model)
    yield ev("message_start", {"message": {**full, "content": [], "stop_reason": None}})
    for i, block in enumerate(full["content"]):
        if block["type"] == "text":
            yield ev(
                "content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}
            )
            for piece in _pieces(block["text"]):
                yield ev(
                    "content_block_delta",
                    {"index": i, "delta": {"type": "text_delta", "text": piece}},
                )
        else:
            yield ev("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
            for piece in _pieces(json.dumps(block["input"])):
                yield ev(
                    "content_block_delta",
                    {"index": i, "delta": {"type": "input_json_delta", "partial_json": piece}},
                )
        yield ev("content_block_stop", {"index": i})
    yield ev(
        "message_delta",
        {
            "delta": {"stop_reason": full["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": 5},
        },
    )
    yield ev("message_stop", {})


class Upstream:
    """The scripted server: `add` replies, point the proxy's upstream at `url` (its /v1
    included)."""

    def __init__(self, *, chunk_delay_s: float = 0.0) -> None:
        self.script: deque[Reply] = deque()
        self.default: Reply | None = None
        self.seen: list[Seen] = []
        self.chunk_delay_s = chunk_delay_s
        self.written = 0
        """Stream events written so far (all streams)."""
        self._lock = threading.Lock()
        up = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                with up._lock:
                    up.seen.append(Seen(self.path, dict(self.headers.items()), {}))
                if self.path.rstrip("/").endswith("/models"):
                    self._json(
                        200,
                        {
                            "object": "list",
                            "data": [
                                {"id": "up-model", "object": "model", "created": 0, "owned_by": "t"}
                            ],
                        },
                    )
                else:
                    self._json(
                        404, {"error": {"message": "no such path", "type": "invalid_request_error"}}
                    )

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    self._json(
                        400,
                        {
                            "error": {
                                "message": "the body is not JSON",
                                "type": "invalid_request_error",
                            }
                        },
                    )
                    return
                with up._lock:
                    up.seen.append(Seen(self.path, dict(self.headers.items()), body))
                    reply = up.script.popleft() if up.script else up.default
                if reply is None:
                    self._json(500, {"error": {"message": "script exhausted"}})
                    return
                if isinstance(reply, Error):
                    self._json(reply.status, reply.body, reply.headers)
                    return
                answers = reply if isinstance(reply, list) else [reply]
                model = str(body.get("model", "m"))
                path = self.path.split("?")[0]
                if not body.get("stream"):
                    if path.endswith("/chat/completions"):
                        self._json(200, _chat(answers, model))
                    elif path.endswith("/responses"):
                        self._json(200, _responses(answers[0], model))
                    else:
                        self._json(200, _message(answers[0], model))
                    return
                events = (
                    _chat_stream(answers[0], model)
                    if path.endswith("/chat/completions")
                    else _responses_stream(answers[0], model)
                    if path.endswith("/responses")
                    else _message_stream(answers[0], model)
                )
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i, e in enumerate(events):
                    if answers[0].cut_after is not None and i >= answers[0].cut_after:
                        self.close_connection = True
                        return
                    if up.chunk_delay_s:
                        time.sleep(up.chunk_delay_s)
                    self.wfile.write(f"{len(e):x}\r\n".encode() + e + b"\r\n")
                    self.wfile.flush()
                    up.written += 1
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def add(self, *replies: Reply) -> None:
        """Queue replies, served in order."""
        self.script.extend(replies)

    def posts(self) -> list[Seen]:
        """The POST requests received, in order."""
        return [s for s in self.seen if s.body]


@contextmanager
def upstream(**kw: Any) -> Iterator[Upstream]:
    """A running scripted upstream for the duration of the block."""
    u = Upstream(**kw)
    t = threading.Thread(target=u.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    try:
        yield u
    finally:
        u.httpd.shutdown()
        u.httpd.server_close()
