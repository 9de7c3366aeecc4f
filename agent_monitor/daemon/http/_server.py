"""The metrics port's HTTP server: /metrics, /healthz, the routes a site and the sources give it.

An `H11Server` (the one connection-handling path of every door) with the metrics port's answers:

- `/metrics`: the registry's exposition (Prometheus text or OpenMetrics, as the scraper asks; gzip
  when accepted), rendered in a worker thread (the collectors read copies of the run state);
- `/healthz`: the monitor's health (200, or 503 with why);
- the routes of the `site` it is built with (the board and the run pages: `sinks.BoardSite`), GET
  and HEAD, each answering an `HttpRequest` with an `HttpResponse` (or a stream: the board's
  /events);
- routes a source mounts while it runs (`mount`: the reward endpoints, `POST /get_reward` and the
  like), a POST with a body of at most the route's `max_body_bytes` (a `Content-Length` is required:
  411 without one, 413 beyond the bound, both counted in `statistics().refused` by reason and told
  to the route's `on_refused`).

Protections: the bounds of its `HttpSettings` (a request head of at most `max_head_bytes` within
`head_timeout_s`, a body within `body_timeout_s`, a cap on connections counted at accept, per
address too, the slowest head shed first when full); only the methods a route takes; no request
bodies on the GET routes; security headers on every response, and `Connection: close`. Every
connection is a task of the server; leaving the server closes them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol, Self

import h11
import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from ._gate import Gate
from ._h11 import H11Conn, H11Server
from ._settings import BOARD_PORT, HttpSettings

log = structlog.get_logger("agent_monitor.daemon")

_GZIP_MIN_BYTES = 1024
GET_HEAD = ("GET", "HEAD")
"""The methods of a page's route."""
# Security headers on every response; a page sends its own Content-Security-Policy (the board's:
# `sinks`).
_COMMON = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
    "Connection": "close",
}


def _no_abort() -> None:
    return None


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """A request to a route, its body read whole (bounded by the route's `max_body_bytes`)."""

    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    """Lower-case names."""
    body: bytes
    abort: Callable[[], None] = _no_abort
    """Closes the connection at once (a stream's producer giving up on a client that cannot keep
    up)."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """What a route answers: a whole body, or (`stream`) a body sent as it comes until the
    connection closes."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: AsyncIterator[bytes] | None = None
    """Sent after the head instead of `body` (server-sent events); the server closes it when the
    client goes."""


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
"""A route: answers one request (it must not raise; the server answers 500 and logs if it does)."""


@dataclass(frozen=True, slots=True)
class Route:
    """A route: its handler, the methods it takes, its body bound and who is told of refusals."""

    handler: Handler
    methods: tuple[str, ...] = ("POST",)
    max_body_bytes: int = 1024 * 1024
    """0: the route takes no body (a GET page's)."""
    on_refused: Callable[[str], None] = lambda reason: None
    """Told the reason of a request refused before the handler saw it (`body_too_large`,
    `no_length`, ..)."""
    prefix: bool = False
    """Answers every path under its own (which ends with `/`): `/runs/` serves `/runs/<id>`."""


class Site(Protocol):
    """Pages a server is built with (the board's): their routes, and the work they need while
    served."""

    @property
    def routes(self) -> Mapping[str, Route]:
        """Path to route (a prefix route's path ends with `/`)."""
        ...

    async def run(self) -> None:
        """Run while the server serves (cancelled when it stops)."""
        ...


def text(status: int, message: str, headers: Mapping[str, str] | None = None) -> HttpResponse:
    """A plain-text answer (an error's, saying what was wrong and what to do)."""
    return HttpResponse(
        status, message.encode() + b"\n", "text/plain; charset=utf-8", headers or {}
    )


class _Refused(Exception):
    """A request answered with an error status before a handler saw it (and the connection
    closed)."""

    def __init__(self, answer: HttpResponse, reason: str = "") -> None:
        super().__init__(answer.body)
        self.answer = answer
        self.reason = reason
        """Short code counted in the server's refusals (and told to the route's `on_refused`)."""


@dataclass(frozen=True, slots=True)
class HttpServerStatistics:
    """What the HTTP server refused, and the routes mounted on it now."""

    connections_refused: int
    """Connections closed unanswered: every one open was being answered (or their peer's were)."""
    connections_shed: int
    """Waiting connections (sending a head, or idle) closed to make room for a new one."""
    refused: Mapping[str, int]
    """Requests answered 4xx before any handler saw them, by reason (`body_too_large`, `path`,
    ..)."""
    routes: tuple[str, ...]
    """The paths sources mounted, sorted."""


class HttpServer:
    """Serve /metrics of `registry`, /healthz, and `site`'s pages (the board) on host:port, within
    `settings`.

    ```python
    async with HttpServer(registry, site=BoardSite(board), port=9464) as server:
        print(server.url)  # http://127.0.0.1:9464/
    ```
    Entering binds the port (raising OSError when it is taken) and runs the site's task
    (`board-prune`); leaving stops listening, ends the site's task and closes every connection.
    `port=0` binds a free port (`server.port` says which). The bounds are `settings`
    (`HttpSettings`): when `max_connections` are open, the connection waiting longest for its head
    is closed for the new one (`_gate`), and a new one is refused only when every open one is being
    answered.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        host: str = "127.0.0.1",
        port: int = 9464,
        settings: HttpSettings = BOARD_PORT,
        site: Site | None = None,
        health: Callable[[], tuple[bool, Mapping[str, Any]]] | None = None,
    ) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.settings = settings
        self.site = site
        self.http = H11Server(
            "http",
            self._request,
            settings,
            bad_request=self._bad_request,
            timed_out=self._timed_out,
            failed=lambda _: log.exception("http_request_failed"),
        )
        own = {
            "/metrics": Route(self._metrics, GET_HEAD, 0),
            "/healthz": Route(self._healthz, GET_HEAD, 0),
        }
        self._served: dict[str, Route] = {**own, **(site.routes if site is not None else {})}
        """The routes the server was built with (its own and its site's)."""
        self.routes: dict[str, Route] = {}
        """The routes sources mounted (path to route): see `mount`."""
        self.refusals: Counter[str] = Counter()
        """Requests answered 4xx before any handler saw them, by reason."""
        self.health = health
        """What GET /healthz answers (the monitor's health): healthy or not, and why; None:
        always healthy."""
        self._stack: contextlib.AsyncExitStack | None = None

    @property
    def gate(self) -> Gate:
        """The connections' admission: open, shed and refused counts."""
        return self.http.gate

    def mount(self, path: str, route: Route) -> None:
        """Serve `path` with a source's handler (`POST` by default); a path taken already raises
        ValueError."""
        if path in self.routes or self._find(self._served, path) is not None:
            raise ValueError(f"{path} is served already")
        self.routes[path] = route

    def unmount(self, path: str) -> None:
        """Stop serving a mounted path (its source stopped); a request to it is then 404."""
        self.routes.pop(path, None)

    def statistics(self) -> HttpServerStatistics:
        """Connections refused, requests refused by reason, routes mounted."""
        return HttpServerStatistics(
            connections_refused=self.refused,
            connections_shed=self.gate.shed,
            refused=dict(self.refusals),
            routes=tuple(sorted(self.routes)),
        )

    @property
    def refused(self) -> int:
        """Connections closed unanswered: every one open was being answered (or their peer's
        were)."""
        return self.gate.refused + self.gate.refused_peer

    @property
    def url(self) -> str:
        """The board's address (the metrics are at `url + "metrics"`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def bind(self) -> None:
        """Bind the port (OSError when it is taken) without serving yet: `serve()` serves it."""
        if not self.http.bound:
            await self.http.open(self.host, self.port, start_serving=False)
            bound = self.http.sockname
            assert bound is not None
            self.port = bound[1]

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("the server is already running")
        stack = contextlib.AsyncExitStack()
        try:
            await self.bind()
            stack.push_async_callback(self.http.close)
            await stack.enter_async_context(self.http.serving())
            if self.site is not None:
                task = asyncio.create_task(self.site.run(), name="board-prune")
                stack.push_async_callback(_cancelled, task)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def serve(self) -> None:
        """Serve until cancelled, as one task of its owner's TaskGroup (the monitor's `http`); binds
        if not bound.

        Cancelling it stops listening, ends the site's task and closes every connection, as leaving
        the context manager does.
        """
        async with self:
            await asyncio.Event().wait()  # until cancelled

    async def aclose(self) -> None:
        """Stop listening (a server bound and never served, or served and cancelled)."""
        if self._stack is None:
            await self.http.close()

    async def __aexit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await stack.aclose()

    # -- answering --

    @staticmethod
    def _find(routes: Mapping[str, Route], path: str) -> Route | None:
        if (route := routes.get(path)) is not None and not route.prefix:
            return route
        for base, r in routes.items():
            if r.prefix and path.startswith(base):
                return r
        return None

    async def _request(self, conn: H11Conn, request: h11.Request) -> None:
        method = request.method.decode("ascii", "replace")
        path, _, query = request.target.decode("latin-1").partition("?")
        # h11: lower-case names
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
        route = self.routes.get(path) or self._find(self._served, path)
        try:
            if route is None:
                raise _Refused(
                    self._unknown(method, path), "path" if method not in GET_HEAD else ""
                )
            body = await self._body(conn, route, method, headers)
        except _Refused as e:
            if e.reason:
                self.refusals[e.reason] += 1
                if route is not None:
                    route.on_refused(e.reason)
            await self._send(conn, e.answer, head=method == "HEAD")
            return
        req = HttpRequest(method, path, query, headers, body, conn.writer.transport.abort)
        try:
            answer = await route.handler(req)
        except Exception:
            log.exception("http_route_failed", path=path)
            answer = HttpResponse(500, b'{"error": "the handler failed; see the daemon log"}')
        await self._send(conn, answer, head=method == "HEAD")

    def _unknown(self, method: str, path: str) -> HttpResponse:
        """The 404 of a path nobody serves, saying what is served."""
        if method not in GET_HEAD:
            mounted = f"; POST routes here: {', '.join(sorted(self.routes))}" if self.routes else ""
            return text(404, f"no {path[:100]} here{mounted}")
        if self.site is None:
            return text(
                404, f"no {path[:100]} here: the board is off (serve --no-board); see /metrics"
            )
        return text(404, f"no {path[:100]} here: the board is at /, metrics at /metrics")

    async def _body(
        self, conn: H11Conn, route: Route, method: str, headers: Mapping[str, str]
    ) -> bytes:
        """The request's body: its method checked, bounded by the route, read within
        `body_timeout_s`."""
        if method not in route.methods:
            allow = ", ".join(route.methods)
            raise _Refused(
                text(405, f"{method[:20]} is not allowed here: use {allow}", {"Allow": allow}),
                "method",
            )
        if route.max_body_bytes == 0:
            if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                raise _Refused(text(413, "requests here have no body"), "body")
            return b""
        raw = headers.get("content-length")
        if "transfer-encoding" in headers or raw is None:
            raise _Refused(text(411, "send the body with a Content-Length"), "no_length")
        if (length := int(raw)) > route.max_body_bytes:
            message = (
                f"a body of {length} bytes is over this route's {route.max_body_bytes}; send "
                "fewer or smaller items"
            )
            raise _Refused(text(413, message), "body_too_large")
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                body = await conn.body(route.max_body_bytes)
        except TimeoutError:
            raise _Refused(
                text(408, f"the body did not arrive within {self.settings.body_timeout_s:g} s"),
                "body_timeout",
            ) from None
        if body is None:  # more than its Content-Length said: h11 refuses it before
            raise _Refused(text(413, "the body is over its Content-Length"), "body_too_large")
        return body

    async def _send(self, conn: H11Conn, answer: HttpResponse, *, head: bool = False) -> None:
        fields = {**_COMMON, "Content-Type": answer.content_type, **answer.headers}
        if answer.stream is not None:
            if head:
                await _aclose(answer.stream)
            else:
                await conn.stream(answer.status, _encoded(fields), answer.stream)
                return
        # a request h11 refused: its answer may be unsendable
        with contextlib.suppress(h11.LocalProtocolError):
            await conn.respond(answer.status, answer.body, _encoded(fields), head=head)

    async def _bad_request(self, conn: H11Conn, e: h11.RemoteProtocolError) -> None:
        """A request h11 refused: 431 (its head too large) or 400, told, and the connection
        closed."""
        if e.error_status_hint == 431:
            answer = text(431, f"request head over {self.settings.max_head_bytes} bytes")
        else:
            answer = text(e.error_status_hint, f"not an HTTP/1.x request ({e})")
        if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._send(conn, answer)

    async def _timed_out(self, conn: H11Conn) -> None:
        """A request whose head did not arrive within `head_timeout_s`: 408, and the connection
        closed."""
        if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._send(
                conn, text(408, f"no request within {self.settings.head_timeout_s:g} s")
            )

    async def _healthz(self, _: HttpRequest) -> HttpResponse:
        # 503 when the monitor cannot do its job (an orchestrator's readiness probe takes it out),
        # with why.
        ok, why = self.health() if self.health is not None else (True, {"status": "ok"})
        return HttpResponse(200 if ok else 503, _json(why))

    async def _metrics(self, req: HttpRequest) -> HttpResponse:
        encoder, content_type = choose_encoder(req.headers.get("accept", ""))
        zipped = "gzip" in req.headers.get("accept-encoding", "")

        def render() -> tuple[bytes, bool]:
            body = encoder(self.registry)
            if zipped and len(body) >= _GZIP_MIN_BYTES:
                return gzip.compress(body, compresslevel=6), True
            return body, False

        # Off the loop: a big registry takes milliseconds to render, and scoring must not wait for a
        # scrape.
        body, gzipped = await asyncio.to_thread(render)
        extra = {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"} if gzipped else {}
        return HttpResponse(HTTPStatus.OK, body, content_type, extra)


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _encoded(fields: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in fields.items()]


async def _aclose(stream: AsyncIterator[bytes]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = [
    "GET_HEAD",
    "Handler",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "Route",
    "Site",
    "text",
]
