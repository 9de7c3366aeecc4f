"""A scripted OpenAI-compatible HTTP server for tests: exact logprobs in, recorded requests out."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """One scripted HTTP reply."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


Script = Reply | Callable[[dict[str, Any]], Reply]
CHECK_MARK = "agent-monitor start-up check"
"""In the task of the CLI's start-up check (agent_monitor.cli._main.CHECK_TASK): see
`ScriptedServer.check`."""


def no_logprobs_reply(text: str = "K") -> Reply:
    """A chat completion as a server set up without logprobs answers it: the text, no `logprobs`."""
    reply = chat_reply(chat_choice([(text, {text: 1.0})]))
    for choice in reply.body["choices"]:
        choice["logprobs"] = None
    return reply


def top(dist: Mapping[str, float]) -> list[dict[str, Any]]:
    """Top-logprob entries from token -> probability."""
    return [
        {"token": t, "logprob": math.log(p), "bytes": list(t.encode())} for t, p in dist.items()
    ]


def chat_choice(tokens: list[tuple[str, Mapping[str, float]]], index: int = 0) -> dict[str, Any]:
    """A chat choice whose generated tokens are `tokens[i][0]` with top alternatives
    `tokens[i][1]`."""
    content = []
    for tok, dist in tokens:
        content.append(
            {
                "token": tok,
                "logprob": math.log(dist.get(tok, 1e-9)),
                "bytes": None,
                "top_logprobs": top(dist),
            }
        )
    return {
        "index": index,
        "message": {"role": "assistant", "content": "".join(t for t, _ in tokens)},
        "logprobs": {"content": content},
        "finish_reason": "length",
    }


def chat_reply(
    *choices: dict[str, Any], prompt_tokens: int = 100, cached: int = 0, model: str = "m"
) -> Reply:
    """A chat completion with the given choices and usage."""
    return Reply(
        body={
            "id": "cmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": list(choices),
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(choices),
                "total_tokens": prompt_tokens + len(choices),
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
    )


def completion_reply(
    dists: list[Mapping[str, float]], chosen: list[str] | None = None, model: str = "m"
) -> Reply:
    """A /v1/completions reply with one choice per distribution (one generated token each)."""
    choices = []
    for i, d in enumerate(dists):
        tok = chosen[i] if chosen else max(d, key=d.__getitem__)
        choices.append(
            {
                "index": i,
                "text": tok,
                "logprobs": {
                    "tokens": [tok],
                    "token_logprobs": [math.log(d.get(tok, 1e-9))],
                    "top_logprobs": [{t: math.log(p) for t, p in d.items()}],
                    "text_offset": [0],
                },
                "finish_reason": "length",
            }
        )
    return Reply(
        body={
            "id": "cmpl-2",
            "object": "text_completion",
            "created": 0,
            "model": model,
            "choices": choices,
            "usage": {
                "prompt_tokens": 50,
                "completion_tokens": len(dists),
                "total_tokens": 50 + len(dists),
            },
        }
    )


class ScriptedServer:
    """Serves scripted replies in order on /v1/chat/completions and /v1/completions; lists
    models."""

    def __init__(
        self,
        models: tuple[str, ...] = ("scripted-model",),
        port: int = 0,
        *,
        model_info: Mapping[str, Any] | None = None,
        props: Any = None,
        record: bool = True,
    ) -> None:
        """`port` 0 takes a free one; a given port lets a test start a server again where its judge
        expects it.

        `model_info`: more fields of every `/v1/models` entry (vLLM's `max_model_len`); `props`:
        what `GET /props` answers, as llama.cpp's llama-server does (None: 404); `record=False`
        keeps no request, only the count.
        """
        self.models = models
        self.model_info = dict(model_info or {})
        self.props = props
        self.record = record
        self.script: deque[Script] = deque()
        self.default: Script | None = None
        self.requests: list[dict[str, Any]] = []
        self.check: Script | None = None
        """The answer to the CLI's start-up check (one scored answer, told by its task): None, a
        valid one.

        Kept out of `script`, `default` and `requests`, so a test's script of the scoring calls is
        the same with or without the check; `checks` holds the check requests."""
        self.checks: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.times: list[float] = []
        self.posts = 0
        """POST requests received (recorded or not)."""
        self.gets: list[str] = []
        """The paths of the GET requests received."""
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, reply: Reply) -> None:
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                data = json.dumps(reply.body if reply.body is not None else {}).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def do_GET(self) -> None:
                with server._lock:
                    server.gets.append(self.path)
                if self.path.rstrip("/").endswith("/models"):
                    self._send(
                        Reply(
                            body={
                                "object": "list",
                                "data": [
                                    {
                                        "id": m,
                                        "object": "model",
                                        "created": 0,
                                        "owned_by": "test",
                                        **server.model_info,
                                    }
                                    for m in server.models
                                ],
                            }
                        )
                    )
                elif self.path == "/props" and server.props is not None:
                    self._send(Reply(body=server.props))
                else:
                    self._send(Reply(404, {"error": {"message": "no such path"}}))

            def do_POST(self) -> None:
                body = json.loads(
                    self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}"
                )
                if CHECK_MARK in json.dumps(body):
                    with server._lock:
                        server.checks.append(body)
                    check = server.check
                    if check is None:
                        valid = {"A": 0.5, "K": 0.5}
                        chat = self.path.endswith("/chat/completions")
                        check = (
                            chat_reply(chat_choice([("K", valid)]))
                            if chat
                            else completion_reply([valid])
                        )
                    self._send(check(body) if callable(check) else check)
                    return
                with server._lock:
                    server.posts += 1
                    if server.record:
                        server.requests.append(body)
                        server.paths.append(self.path)
                        server.times.append(time.monotonic())
                    item = server.script.popleft() if server.script else server.default
                if item is None:
                    self._send(Reply(500, {"error": {"message": "script exhausted"}}))
                    return
                self._send(item(body) if callable(item) else item)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def add(self, *items: Script) -> None:
        """Queue replies, served in order."""
        self.script.extend(items)


@contextmanager
def scripted_server(**kw: Any) -> Iterator[ScriptedServer]:
    """Run a ScriptedServer on a free port for the duration of the block."""
    s = ScriptedServer(**kw)
    t = threading.Thread(target=s.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    try:
        yield s
    finally:
        s.httpd.shutdown()
        s.httpd.server_close()


@contextmanager
def html_server() -> Iterator[str]:
    """A web server that is no OpenAI API: `200 text/html <html>hello</html>` on every path;
    yields its /v1 URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _page(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
            data = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _page

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()
