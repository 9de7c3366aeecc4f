"""A scripted local HTTP server that speaks the Gemini REST `generateContent` protocol, for judge
tests."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One scripted answer: HTTP status, extra headers, JSON body, and a delay before answering."""

    body: Any
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass(frozen=True)
class Received:
    """One request as the server saw it."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: Any
    at: float


class GeminiServer:
    """A real HTTP server on 127.0.0.1 that answers POST .../models/{model}:generateContent from a
    script.

    Tests `queue()` replies; each request pops the next one, or gets `default`
    when the queue is empty (a 500 naming the missing script, unless a test sets
    it; a function of the request's JSON body answers each request itself, e.g.
    by drawing `generationConfig.candidateCount` answers). Every request is
    recorded in `requests`, in arrival order.
    """

    def __init__(self, *, model_info: Mapping[str, Any] | None = None) -> None:
        """`model_info`: what `GET .../models/{model}` answers (the model's
        `inputTokenLimit`...); None: 404."""
        self.model_info = None if model_info is None else dict(model_info)
        self.gets: list[str] = []
        self.requests: list[Received] = []
        self.default: Reply | Callable[[Any], Reply] = error(
            500, "the test server has no scripted reply left"
        )
        self._replies: deque[Reply] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        # A short poll interval keeps shutdown (every test's teardown) quick.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.02,), name="gemini-test-server", daemon=True
        )

    @property
    def url(self) -> str:
        """Base URL to give the SDK as `HttpOptions(base_url=...)`."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def queue(self, *replies: Reply) -> None:
        """Append replies to the script."""
        with self._lock:
            self._replies.extend(replies)

    def start(self) -> GeminiServer:
        """Serve in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; delayed replies still sleeping are cut short."""
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _next(self, body: Any) -> Reply:
        with self._lock:
            reply = self._replies.popleft() if self._replies else self.default
        return reply(body) if callable(reply) else reply

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with server._lock:
                    server.gets.append(self.path)
                found = server.model_info is not None and "/models/" in self.path
                reply = Reply(server.model_info) if found else error(404, f"no route {self.path}")
                payload = json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                with server._lock:
                    server.requests.append(
                        Received(
                            method="POST",
                            path=self.path,
                            headers={k.lower(): v for k, v in self.headers.items()},
                            body=body,
                            at=time.monotonic(),
                        )
                    )
                reply = (
                    server._next(body)
                    if ":generateContent" in self.path
                    else error(404, f"no route {self.path}")
                )
                if reply.delay_s and server._stop.wait(reply.delay_s):
                    return
                payload = json.dumps(reply.body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json; charset=UTF-8")
                    self.send_header("Content-Length", str(len(payload)))
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test); nothing to answer

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep pytest output clean

        return Handler


def error(
    status: int,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    details: Sequence[Any] = (),
) -> Reply:
    """A Google API error reply, shaped like the real one: {"error": {code, message, status,
    details}}."""
    names = {
        400: "INVALID_ARGUMENT",
        401: "UNAUTHENTICATED",
        403: "PERMISSION_DENIED",
        404: "NOT_FOUND",
    }
    names |= {429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
    body: dict[str, Any] = {
        "code": status,
        "message": message,
        "status": names.get(status, "UNKNOWN"),
    }
    if details:
        body["details"] = list(details)
    return Reply({"error": body}, status=status, headers=dict(headers or {}))


def step(
    top: Mapping[str, float], chosen: str | None = None, chosen_lp: float | None = None
) -> tuple[str, float, Mapping[str, float]]:
    """One decoding step: the top candidates (token -> logprob) and the chosen token (default:
    the most likely)."""
    token = chosen if chosen is not None else max(top, key=lambda t: top[t])
    return token, chosen_lp if chosen_lp is not None else top[token], top


def candidate(*steps: tuple[str, float, Mapping[str, float]], index: int = 0) -> dict[str, Any]:
    """A response candidate whose text is the chosen tokens, with its `logprobsResult`."""
    return {
        "content": {"role": "model", "parts": [{"text": "".join(s[0] for s in steps)}]},
        "finishReason": "MAX_TOKENS",
        "index": index,
        "logprobsResult": {
            "topCandidates": [
                {"candidates": [{"token": t, "logProbability": lp} for t, lp in s[2].items()]}
                for s in steps
            ],
            "chosenCandidates": [{"token": s[0], "logProbability": s[1]} for s in steps],
        },
    }


def text_candidate(text: str, *, index: int = 0) -> dict[str, Any]:
    """A response candidate without `logprobsResult`, as a model answers when logprobs are not
    asked for."""
    return {
        "content": {"role": "model", "parts": [{"text": text}]},
        "finishReason": "STOP",
        "index": index,
    }


def response(
    *candidates: Mapping[str, Any],
    prompt: int = 100,
    cached: int = 0,
    output: int = 1,
    thoughts: int = 0,
) -> Reply:
    """A successful generateContent reply with these candidates and usage."""
    usage: dict[str, Any] = {
        "promptTokenCount": prompt,
        "candidatesTokenCount": output,
        "totalTokenCount": prompt + output + thoughts,
    }
    if cached:
        usage["cachedContentTokenCount"] = cached
    if thoughts:
        usage["thoughtsTokenCount"] = thoughts
    body = {"candidates": list(candidates), "usageMetadata": usage, "modelVersion": "gemini-test"}
    return Reply(body)


def letter_reply(
    top: Mapping[str, float], *, n: int = 1, prompt: int = 100, cached: int = 0
) -> Reply:
    """`n` identical one-token candidates with these top logprobs."""
    return response(
        *(candidate(step(top), index=i) for i in range(n)), prompt=prompt, cached=cached, output=n
    )


def iter_parts(received: Received) -> Iterator[Mapping[str, Any]]:
    """The parts of every content in a recorded request."""
    for content in received.body.get("contents", []):
        yield from content.get("parts", [])
