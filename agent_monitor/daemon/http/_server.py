"""The metrics port's HTTP server, on the event loop: /metrics, and the web board at / with its live updates.

One small HTTP/1.0-style server on asyncio streams (no framework: four GET routes need none, and every
bound is in plain sight). Paths:

- `/metrics`: the registry's exposition (Prometheus text or OpenMetrics, as the scraper asks; gzip when
  accepted), rendered in a worker thread (the collectors read copies of the run state);
- `/`: the board, one static HTML file with its CSS and script inline (no external resources: it works
  air-gapped), sent with a Content-Security-Policy that allows exactly that script and style;
- `/events`: server-sent events, a snapshot of the board on connect, then one event per change;
- `/api/runs`: the board's snapshot as JSON; with a query (`?outcome=failure&limit=20`...), a page of the
  history of ended runs from the run store (`RunPages`);
- `/runs/<run_id>` and `/api/runs/<run_id>`: a run's page (its task, steps, curve and decisions) and its JSON;
  `/runs`: the history, browsable; `/api/frames/<sha256>`: a stored camera frame (the page's thumbnails).

Routes a source mounts (`mount`: the reward endpoints, `POST /get_reward` and the like) take a POST
with a body of at most the route's `max_body_bytes` (a `Content-Length` is required: 411 without one,
413 beyond the bound, both counted in `statistics()["refused"]` by reason and told to the route's
`on_refused`); the handler gets the method, path, query, headers and body and returns a response.

Protections: only GET and HEAD besides the mounted routes; no request bodies elsewhere; a request head of
at most 8 KiB read within a deadline; a cap on connections (counted at accept, per address too, the
slowest head shed first when full) and on board clients; each board client's queue bounded (a slow
browser is dropped, never waited for: see `Board`); every response says `Connection: close`. Every
connection is a task in the server's own TaskGroup; leaving the server closes them all.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import hashlib
import importlib.resources
import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Self
from urllib.parse import unquote

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from ..sinks import Board, BoardClient, QueryError, RunPages, sse
from ._gate import Gate, Slot, peer_of

log = structlog.get_logger("agent_monitor.daemon")

MAX_HEAD_BYTES = 8 * 1024
"""The largest request head (request line and headers) read; a bigger one is answered 431."""
_GZIP_MIN_BYTES = 1024
_OWN = ("/", "/index.html", "/metrics", "/healthz", "/events", "/api/runs", "/runs")
_OWN_PREFIXES = ("/runs/", "/api/runs/", "/api/frames/")
"""The paths the server answers itself (GET and HEAD); /runs/<id> and /api/runs/<id> too."""
# Security headers on every response; the board page gets its own Content-Security-Policy (see _page).
_COMMON = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
    "Connection": "close",
}


def _page(name: str = "board.html", *, img: str = "data:") -> tuple[bytes, str]:
    """A page (the board, the run pages) and its Content-Security-Policy: only its own inline script and style run."""
    html = importlib.resources.files("agent_monitor.daemon.sinks").joinpath(name).read_bytes()
    text = html.decode()

    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in found)

    csp = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        f"connect-src 'self'; img-src {img}; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html, csp


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """A request to a mounted route, its body read whole (bounded by the route's `max_body_bytes`)."""

    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    """Lower-case names."""
    body: bytes


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """What a mounted route answers."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
"""A mounted route: answers one request (it must not raise; the server answers 500 and logs if it does)."""


@dataclass(frozen=True, slots=True)
class Route:
    """A mounted route: its handler, the methods it takes, its body bound and who is told of refusals."""

    handler: Handler
    methods: tuple[str, ...] = ("POST",)
    max_body_bytes: int = 1024 * 1024
    on_refused: Callable[[str], None] = lambda reason: None
    """Told the reason of a request refused before the handler saw it (`body_too_large`, `no_length`, ..)."""


class _Refused(Exception):
    """A request answered with an error status (and the connection closed)."""

    def __init__(
        self, status: HTTPStatus, message: str, headers: Mapping[str, str] | None = None, *, reason: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.reason = reason
        """Short code counted in the server's refusals (and told to the route's `on_refused`)."""


class HttpServer:
    """Serve /metrics of `registry` and, with a `board`, the web board (/, /events, /api/runs) on host:port.

    ```python
    async with HttpServer(registry, board=board, host="127.0.0.1", port=9464) as server:
        print(server.url)  # http://127.0.0.1:9464/
    ```
    Entering binds the port (raising OSError when it is taken) and starts the named task `board-prune`;
    leaving stops listening, drops the board's browsers and closes every connection. `port=0` binds a
    free port (`server.port` says which). A request head must arrive within `request_timeout_s`, a
    response be read within `write_timeout_s`; at most `max_connections` are open at once (and
    `max_connections_per_peer` from one address, None: no bound of its own); when full, the connection
    waiting longest for its head is closed for the new one (`_gate`), and a new one is refused only
    when every open one is being answered.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        board: Board | None = None,
        pages: RunPages | None = None,
        health: Callable[[], tuple[bool, Mapping[str, Any]]] | None = None,
        host: str = "127.0.0.1",
        port: int = 9464,
        max_connections: int = 64,
        max_connections_per_peer: int | None = None,
        request_timeout_s: float = 10.0,
        write_timeout_s: float = 30.0,
    ) -> None:
        self.registry = registry
        self.board = board
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.write_timeout_s = write_timeout_s
        self._page, self._csp = _page() if board is not None else (b"", "")
        self._runs_page, self._runs_csp = _page("runs.html", img="'self' data:") if board is not None else (b"", "")
        self.pages = pages
        """What answers /runs, /runs/<id> and their JSON (with the run store); None: 404."""
        self._server: asyncio.Server | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.gate = Gate(max_connections, max_connections_per_peer)
        """Admits connections: counted at accept, at most `max_connections_per_peer` from one address; when
        full, the one waiting longest for its request head is shed for the new one."""
        self.routes: dict[str, Route] = {}
        """The routes sources mounted (path to route): see `mount`."""
        self.refusals: Counter[str] = Counter()
        """Requests answered 4xx before any handler saw them, by reason."""
        self.health = health
        """What GET /healthz answers (the monitor's health): healthy or not, and why; None: always healthy."""

    def mount(self, path: str, route: Route) -> None:
        """Serve `path` with a source's handler (`POST` by default); a path taken already raises ValueError."""
        if path in self.routes or path in _OWN or path.startswith(_OWN_PREFIXES):
            raise ValueError(f"{path} is served already")
        self.routes[path] = route

    def unmount(self, path: str) -> None:
        """Stop serving a mounted path (its source stopped); a request to it is then 404."""
        self.routes.pop(path, None)

    def statistics(self) -> dict[str, Any]:
        """Connections refused, requests refused by reason, routes mounted."""
        return {
            "connections_refused": self.refused,
            "connections_shed": self.gate.shed,
            "refused": dict(self.refusals),
            "routes": sorted(self.routes),
        }

    @property
    def refused(self) -> int:
        """Connections closed unanswered: every one open was being answered (or their peer's were)."""
        return self.gate.refused + self.gate.refused_peer

    @property
    def url(self) -> str:
        """The board's address (the metrics are at `url + "metrics"`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("the server is already running")
        stack = contextlib.AsyncExitStack()
        try:
            self._tg = await stack.enter_async_context(asyncio.TaskGroup())
            self._server = await asyncio.start_server(self._accept, self.host, self.port, limit=MAX_HEAD_BYTES)
            self.port = self._server.sockets[0].getsockname()[1]
            if self.board is not None:
                self._spawn(self._prune(self.board), "board-prune")
        except BaseException:
            await self._close(stack)
            raise
        self._stack = stack
        return self

    async def bind(self) -> None:
        """Bind the port (OSError when it is taken) without serving yet: `serve()` serves it."""
        if self._server is None:
            self._server = await asyncio.start_server(
                self._accept, self.host, self.port, limit=MAX_HEAD_BYTES, start_serving=False
            )
            self.port = self._server.sockets[0].getsockname()[1]

    async def serve(self) -> None:
        """Serve until cancelled, as one task of its owner's TaskGroup (the monitor's `http`); binds if not bound.

        The connections and `board-prune` are this task's children; cancelling it stops listening, drops
        the board's browsers and closes every connection, as leaving the context manager does.
        """
        if self._stack is not None:
            raise RuntimeError("the server is already running")
        await self.bind()
        assert self._server is not None
        stack = self._stack = contextlib.AsyncExitStack()
        try:
            self._tg = await stack.enter_async_context(asyncio.TaskGroup())
            if self.board is not None:
                self._spawn(self._prune(self.board), "board-prune")
            await self._server.start_serving()
            await asyncio.Event().wait()  # until cancelled
        finally:
            self._stack = None
            await self._close(stack)

    async def aclose(self) -> None:
        """Stop listening (a server bound and never served, or served and cancelled)."""
        if self._stack is None and self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aexit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await self._close(stack)

    async def _close(self, stack: contextlib.AsyncExitStack) -> None:
        if self._server is not None:
            self._server.close()
        if self.board is not None:
            self.board.close()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stack.aclose()  # the TaskGroup awaits every connection
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        self._tg = None

    def _spawn(self, coro: Any, name: str) -> None:
        assert self._tg is not None
        task = self._tg.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A new connection becomes a task in the server's TaskGroup (or is closed when too many are open)."""
        if self._tg is None:
            writer.transport.abort()
            return
        slot = self.gate.admit(peer_of(writer.get_extra_info("peername")), writer.transport.abort)
        if slot is None:
            writer.transport.abort()
            return
        self._spawn(self._connection(reader, writer, slot), "http-connection")

    async def _prune(self, board: Board) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                board.prune()
            except Exception:
                log.exception("board_prune_failed")

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot) -> None:
        try:
            await self._serve_one(reader, writer, slot)
        except _Refused as e:
            if e.reason:
                self.refusals[e.reason] += 1
            with contextlib.suppress(ConnectionError):
                await self._respond(
                    writer, e.status, e.message.encode() + b"\n", "text/plain; charset=utf-8", e.headers
                )
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client went away, or did not read its response within write_timeout_s
        except Exception:
            # A bug in answering one request must not end the server (a TaskGroup child that raises would).
            log.exception("http_request_failed")
        finally:
            self.gate.release(slot)
            writer.close()
            try:
                # What was written goes out first; a peer that reads nothing more is not waited for long.
                async with asyncio.timeout(5):
                    await writer.wait_closed()
            except (TimeoutError, ConnectionError):
                writer.transport.abort()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot) -> None:
        method, path, headers, query = await self._read_head(reader)
        self.gate.working(slot)  # its head is in: no longer sheddable
        if (route := self.routes.get(path)) is not None:
            await self._routed(route, method, path, query, headers, reader, writer)
            return
        if method not in ("GET", "HEAD") and not (path in _OWN or path.startswith(_OWN_PREFIXES)):
            mounted = f"; POST routes here: {', '.join(sorted(self.routes))}" if self.routes else ""
            raise _Refused(HTTPStatus.NOT_FOUND, f"no {path[:100]} here{mounted}", reason="path")
        if method not in ("GET", "HEAD"):
            raise _Refused(
                HTTPStatus.METHOD_NOT_ALLOWED,
                f"{method[:20]} is not allowed here: use GET or HEAD",
                {"Allow": "GET, HEAD"},
                reason="method",
            )
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            raise _Refused(HTTPStatus(413), "requests here have no body", reason="body")
        head = method == "HEAD"
        if path == "/metrics":
            await self._metrics(writer, headers, head)
            return
        if path == "/healthz":
            # 503 when the monitor cannot do its job (an orchestrator's readiness probe takes it out), with why.
            ok, why = self.health() if self.health is not None else (True, {"status": "ok"})
            status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
            await self._respond(
                writer, status, _json(why), "application/json", {"Cache-Control": "no-store"}, head=head
            )
            return
        if self.board is None:
            raise _Refused(HTTPStatus.NOT_FOUND, f"no {path} here: the board is off (serve --no-board); see /metrics")
        if path in ("/", "/index.html"):
            await self._respond(
                writer,
                HTTPStatus.OK,
                self._page,
                "text/html; charset=utf-8",
                {"Content-Security-Policy": self._csp, "X-Frame-Options": "DENY"},
                head=head,
            )
        elif path == "/api/runs" and not query:
            body = await asyncio.to_thread(_json, self.board.snapshot())
            await self._respond(writer, HTTPStatus.OK, body, "application/json", head=head)
        elif path in ("/runs", "/api/runs") or path.startswith(("/runs/", "/api/runs/", "/api/frames/")):
            await self._run_pages(writer, path, query, head)
        elif path == "/events":
            await self._events(self.board, reader, writer, head)
        else:
            raise _Refused(HTTPStatus.NOT_FOUND, f"no {path[:100]} here: the board is at /, metrics at /metrics")

    async def _run_pages(self, writer: asyncio.StreamWriter, path: str, query: str, head: bool) -> None:
        """A run's page or the history of ended runs (HTML, or JSON under /api)."""
        if self.pages is None:
            raise _Refused(HTTPStatus.NOT_FOUND, f"no {path[:100]} here: this server has no run pages; see /")
        if path == "/runs" or path.startswith("/runs/"):
            if path.startswith("/runs/") and not unquote(path[len("/runs/") :]):
                raise _Refused(HTTPStatus.NOT_FOUND, "no run id in the path: /runs lists the ended runs")
            headers = {"Content-Security-Policy": self._runs_csp, "X-Frame-Options": "DENY"}
            await self._respond(writer, HTTPStatus.OK, self._runs_page, "text/html; charset=utf-8", headers, head=head)
            return
        if path.startswith("/api/frames/"):
            frame = await self.pages.frame(path[len("/api/frames/") :])
            if frame is None:
                raise _Refused(HTTPStatus.NOT_FOUND, "no such frame here (never stored, or pruned by the frame budget)")
            # Content-addressed: a digest's bytes never change, so a browser may keep them.
            await self._respond(
                writer, HTTPStatus.OK, frame[1], frame[0], {"Cache-Control": "private, max-age=86400"}, head=head
            )
            return
        if path == "/api/runs":
            try:
                data = await self.pages.history(query)
            except QueryError as e:
                raise _Refused(HTTPStatus.BAD_REQUEST, f"/api/runs?{query[:100]}: {e}", reason="query") from None
            except LookupError as e:
                raise _Refused(HTTPStatus.NOT_FOUND, str(e)) from None
        else:
            run_id = unquote(path[len("/api/runs/") :])
            found = await self.pages.run(run_id) if run_id else None
            if found is None:
                raise _Refused(
                    HTTPStatus.NOT_FOUND, f"no run {run_id[:100]!r} here (never seen, or dropped by --retention)"
                )
            data = found
        body = await asyncio.to_thread(_json, data)
        await self._respond(writer, HTTPStatus.OK, body, "application/json", head=head)

    async def _routed(
        self,
        route: Route,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """A mounted route's request: its method checked, its body bounded and read within the deadline."""
        try:
            body = await self._body(route, method, headers, reader)
        except _Refused as e:
            route.on_refused(e.reason)
            raise
        try:
            answer = await route.handler(HttpRequest(method, path, query, dict(headers), body))
        except Exception:
            log.exception("http_route_failed", path=path)
            answer = HttpResponse(500, b'{"error": "the handler failed; see the daemon log"}')
        await self._respond(writer, HTTPStatus(answer.status), answer.body, answer.content_type, answer.headers)

    async def _body(self, route: Route, method: str, headers: Mapping[str, str], reader: asyncio.StreamReader) -> bytes:
        if method not in route.methods:
            allow = ", ".join(route.methods)
            raise _Refused(
                HTTPStatus.METHOD_NOT_ALLOWED, f"{method[:20]} is not allowed here: use {allow}", {"Allow": allow},
                reason="method",
            )  # fmt: skip
        if "transfer-encoding" in headers:
            raise _Refused(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length", reason="no_length")
        raw = headers.get("content-length")
        if raw is None or not raw.isdigit():
            raise _Refused(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length", reason="no_length")
        if (length := int(raw)) > route.max_body_bytes:
            raise _Refused(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"a body of {length} bytes is over this route's {route.max_body_bytes}; send fewer or smaller items",
                reason="body_too_large",
            )
        try:
            async with asyncio.timeout(self.request_timeout_s):
                return await reader.readexactly(length)
        except TimeoutError:
            raise _Refused(
                HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within {self.request_timeout_s:g} s",
                reason="body_timeout",
            ) from None  # fmt: skip

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], str]:
        """The request's method, path and headers (lower-case names); raises _Refused for anything else."""
        try:
            async with asyncio.timeout(self.request_timeout_s):
                raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Refused(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"request head over {MAX_HEAD_BYTES} bytes"
            ) from None
        except TimeoutError:
            raise _Refused(HTTPStatus.REQUEST_TIMEOUT, f"no request within {self.request_timeout_s:g} s") from None
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Refused(HTTPStatus.BAD_REQUEST, "not an HTTP/1.x request line")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _Refused(HTTPStatus.BAD_REQUEST, "a malformed header line")
            headers[name.lower()] = value.strip()
        path, _, query = target.partition("?")
        return method, path, headers, query

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        head: bool = False,
    ) -> None:
        fields = {**_COMMON, "Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})}
        writer.write(_status_line(status) + _fields(fields))
        if not head:
            writer.write(body)
        # A client that does not read its response does not keep its connection (one of max_connections) for ever.
        async with asyncio.timeout(self.write_timeout_s):
            await writer.drain()

    async def _metrics(self, writer: asyncio.StreamWriter, headers: Mapping[str, str], head: bool) -> None:
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        zipped = "gzip" in headers.get("accept-encoding", "")

        def render() -> tuple[bytes, bool]:
            body = encoder(self.registry)
            if zipped and len(body) >= _GZIP_MIN_BYTES:
                return gzip.compress(body, compresslevel=6), True
            return body, False

        # Off the loop: a big registry takes milliseconds to render, and scoring must not wait for a scrape.
        body, gzipped = await asyncio.to_thread(render)
        extra = {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"} if gzipped else {}
        await self._respond(writer, HTTPStatus.OK, body, content_type, extra, head=head)

    async def _events(
        self, board: Board, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bool
    ) -> None:
        """Server-sent events: the snapshot, then the board's updates, keep-alive comments while idle."""
        if head:
            await self._respond(writer, HTTPStatus.OK, b"", "text/event-stream; charset=utf-8", head=True)
            return
        joined = board.subscribe(on_drop=writer.transport.abort)
        if joined is None:
            raise _Refused(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"{board.settings.max_clients} browsers already follow the board (--board-clients); retry later",
                {"Retry-After": "10"},
            )
        client, snap = joined
        try:
            # A full board is a megabyte of JSON (tens of milliseconds): encoded off the loop.
            snapshot = await asyncio.to_thread(sse, "snapshot", snap)
            fields = {**_COMMON, "Content-Type": "text/event-stream; charset=utf-8", "X-Accel-Buffering": "no"}
            # retry: how long a browser's EventSource waits before reconnecting (to a fresh snapshot).
            writer.write(_status_line(HTTPStatus.OK) + _fields(fields) + b"retry: 2000\n\n" + snapshot)
            await writer.drain()
            gone = asyncio.Event()
            self._spawn(self._watch_eof(reader, gone, client), "board-client-eof")
            keepalive = board.settings.keepalive_s
            while not client.dropped and not gone.is_set():
                batch = await client.take(keepalive)
                if client.dropped or gone.is_set() or writer.is_closing():
                    break
                writer.write(b"".join(batch) if batch else b": keep-alive\n\n")
                await writer.drain()
        finally:
            board.unsubscribe(client)
            client.drop()  # ends the EOF watcher's wait too

    async def _watch_eof(self, reader: asyncio.StreamReader, gone: asyncio.Event, client: BoardClient) -> None:
        """Notice a browser that closed its /events connection at once, not at the next keep-alive."""
        with contextlib.suppress(ConnectionError):
            while not client.dropped and await reader.read(1024):
                pass  # a browser sends nothing after its request; anything it does send is read and ignored
        gone.set()
        client.drop()


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _status_line(status: HTTPStatus) -> bytes:
    return f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()


def _fields(fields: Mapping[str, str]) -> bytes:
    return "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode("latin-1") + b"\r\n"


__all__ = ["MAX_HEAD_BYTES", "Handler", "HttpRequest", "HttpResponse", "HttpServer", "Route"]
