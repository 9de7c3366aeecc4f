"""The daemon's one HTTP/1.1 server: asyncio streams and h11, for every door (`HttpServer` is built
on it).

`H11Server` binds, accepts and admits the connections through a `Gate` (the cap counted at accept,
a per-peer cap; when full the longest-waiting connection, idle or slow to send its head, is shed
for the new one, and only when every connection is working is the new one answered by the
source's `busy` or closed at once), runs each connection's keep-alive loop (idle up to
`keepalive_s`, then the request's head within `head_timeout_s` of its first byte, the source's
handler, the next request once both sides are done) as a task of its own, and cancels and awaits
every one of them when the source stops serving. What a connection meets that is not the source's
protocol ends it quietly: the client gone, a deadline passed, bad HTTP (told to the source's
`bad_request` when it has one); anything else is the source's `failed`.

`H11Conn` is one connection as a handler sees it: the next event read within its deadlines, the body
read up to a bound, a whole response or a streamed one, and a lingering close. The protocols (paths,
bodies, answers, counters) stay in the doors; the bounds are the `HttpSettings` each door is built
with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from http import HTTPStatus
from typing import Any

import h11

from ._gate import Gate, Slot, peer_of
from ._settings import HttpSettings

__all__ = ["ClientGone", "H11Conn", "H11Server", "declared_length"]

_READ = 65_536
_MAX_BUSY = 64
"""Connections being answered `busy` at once; more are closed at once."""

Headers = Sequence[tuple[bytes, bytes]]


def declared_length(request: h11.Request) -> int | None:
    """The request's `Content-Length` (h11 checked it is one number), or None without one."""
    for k, v in request.headers:
        if k == b"content-length":
            return int(v)
    return None


def _phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _head_bytes(request: h11.Request) -> int:
    """The size of a request's head as sent (its request line and headers)."""
    line = len(request.method) + len(request.target) + 12  # spaces, "HTTP/1.x", CRLF
    return line + sum(len(k) + len(v) + 4 for k, v in request.headers) + 2


class ClientGone(ConnectionError):
    """The request's body ended other than with its end (the client closed, or paused,
    mid-message)."""


class H11Conn:
    """One client connection: its h11 state and streams, reads within deadlines, responses."""

    __slots__ = ("h11", "read_timeout_s", "reader", "write_timeout_s", "writer")

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, settings: HttpSettings
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=settings.max_head_bytes)
        self.read_timeout_s = settings.read_timeout_s
        """The deadline of each socket read (None: none)."""
        self.write_timeout_s = settings.write_timeout_s
        """The deadline of each drain (None: none)."""

    async def next_event(self, timeout_s: float | None = None) -> Any:
        """The connection's next h11 event, reading as h11 needs: each read within
        `read_timeout_s`, all in `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while True:
                event = self.h11.next_event()
                if event is not h11.NEED_DATA:
                    return event
                read = self.reader.read(_READ)
                data = await (
                    read
                    if self.read_timeout_s is None
                    else asyncio.wait_for(read, self.read_timeout_s)
                )
                self.h11.receive_data(data)

    async def body(self, limit: int, *, timeout_s: float | None = None) -> bytes | None:
        """The request's body, or None once it grows past `limit` bytes (the rest unread);
        ClientGone if it stops short.

        `timeout_s` bounds the wait for each part of it (a body that never ends).
        """
        body = bytearray()
        while True:
            event = await self.next_event(timeout_s)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                raise ClientGone

    def send(self, event: h11.Event) -> None:
        """Write one h11 event of a response (its head, a chunk of its body, its end); `drain`
        sends them."""
        self.writer.write(self.h11.send(event) or b"")

    async def drain(self) -> None:
        """Wait until what was written is sent (within `write_timeout_s`)."""
        if self.write_timeout_s is None:
            await self.writer.drain()
        else:
            await asyncio.wait_for(self.writer.drain(), self.write_timeout_s)

    async def respond(
        self, status: int, body: bytes, headers: Headers, *, close: bool = False, head: bool = False
    ) -> None:
        """Send a whole response, its `content-length` added after `headers` (and `connection:
        close` with `close`).

        With `head` (the answer to a HEAD request) the body is not sent; its length is.
        """
        fields = [*headers, (b"content-length", str(len(body)).encode())]
        if close:
            fields.append((b"connection", b"close"))
        data = (
            self.h11.send(h11.Response(status_code=status, headers=fields, reason=_phrase(status)))
            or b""
        )
        if body and not head:
            data += self.h11.send(h11.Data(data=body)) or b""
        data += self.h11.send(h11.EndOfMessage()) or b""
        self.writer.write(data)
        await self.drain()

    async def stream(self, status: int, headers: Headers, chunks: AsyncIterator[bytes]) -> None:
        """Send a response whose body is `chunks` as they come, ended by closing the connection;
        stops at the client's EOF.

        The body is close-delimited, not chunked (h11 would frame it so for an HTTP/1.1 client): a
        stream of server-sent events is read as it comes, and the connection is the stream's. So the
        head is written here, not by h11, and the connection is not reused. What the client sends
        meanwhile is read and dropped; its EOF (the browser closed the page) ends the stream at
        once.
        """
        line = f"HTTP/1.1 {status} {_phrase(status).decode()}\r\n".encode()
        self.writer.write(line + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n")
        pump = asyncio.ensure_future(self._pump(chunks))
        eof = asyncio.ensure_future(self._until_eof())
        try:
            await asyncio.wait({pump, eof}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, eof):
                task.cancel()
            await asyncio.gather(pump, eof, return_exceptions=True)
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
        if pump.done() and not pump.cancelled() and (e := pump.exception()) is not None:
            raise e

    async def _pump(self, chunks: AsyncIterator[bytes]) -> None:
        async for chunk in chunks:
            if self.writer.is_closing():
                return
            self.writer.write(chunk)
            await self.drain()

    async def _until_eof(self) -> None:
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(_READ):
                pass

    async def linger(self, max_bytes: int, timeout_s: float) -> None:
        """A lingering close: what the client still sends is read and dropped (at most `max_bytes`,
        in `timeout_s`).

        So closing with unread bytes does not reset the connection before the client has read the
        answer.
        """
        with contextlib.suppress(OSError, RuntimeError):
            self.writer.write_eof()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(timeout_s):
                left = max_bytes
                while left > 0 and (chunk := await self.reader.read(_READ)):
                    left -= len(chunk)

    def next_cycle(self) -> bool:
        """Ready the connection for its next request (keep-alive); False when it must close."""
        if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
            return False
        self.h11.start_next_cycle()
        return True


class H11Server:
    """A source's HTTP/1.1 server: `open` binds, `serving()` runs the connections, `close` unbinds.

    `handle(conn, request)` answers one request (reading its body as it needs). The bounds are
    `settings`: a new connection's first request must begin within `head_timeout_s`, a later one
    within `keepalive_s` (None: `read_timeout_s`) of the connection going idle, and a request's head
    must be whole within `head_timeout_s` of its first byte (else `timed_out(conn)` may answer it);
    `read_timeout_s` bounds each read, `write_timeout_s` each drain. At most `max_connections` are
    open (`max_connections_per_peer` from one address); when full, the longest-waiting one is shed
    (`on_shed`). When every one is working, `busy(conn)` answers the new one (at most `_MAX_BUSY` at
    once) or, without one, it is closed at once (`on_refused`).
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[H11Conn, h11.Request], Awaitable[None]],
        settings: HttpSettings,
        *,
        busy: Callable[[H11Conn], Awaitable[None]] | None = None,
        on_refused: Callable[[], None] | None = None,
        on_shed: Callable[[], None] | None = None,
        bad_request: Callable[[H11Conn, h11.RemoteProtocolError], Awaitable[None]] | None = None,
        timed_out: Callable[[H11Conn], Awaitable[None]] | None = None,
        failed: Callable[[Exception], None] | None = None,
    ) -> None:
        self.name = name
        self.handle = handle
        self.settings = settings
        self.gate = Gate(settings.max_connections, settings.max_connections_per_peer)
        self.head_timeout_s = settings.head_timeout_s
        self.keepalive_s = (
            settings.keepalive_s if settings.keepalive_s is not None else settings.read_timeout_s
        )
        self.busy = busy
        self.on_refused = on_refused
        self.on_shed = on_shed
        self.bad_request = bad_request
        self.timed_out = timed_out
        self.failed = failed
        self._busy_now = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    @property
    def max_connections(self) -> int:
        """Connections open at once at most."""
        return self.gate.max_connections

    @property
    def connections(self) -> int:
        """Connections open now (counted from their accept)."""
        return self.gate.connections

    @property
    def bound(self) -> bool:
        """Whether the address is bound."""
        return self._server is not None

    @property
    def sockname(self) -> tuple[str, int] | None:
        """The bound (host, port), or None when not bound."""
        if self._server is None or not self._server.sockets:
            return None
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def open(self, host: str, port: int, *, start_serving: bool) -> None:
        """Bind the address (once); with `start_serving`, connections are taken before
        `serving()` too."""
        if self._server is None:
            self._stopped = False
            self._server = await asyncio.start_server(
                self._accept,
                host,
                port,
                limit=self.settings.max_head_bytes,
                start_serving=start_serving,
                backlog=1024,
            )

    async def close(self) -> None:
        """Unbind (the connections are `serving()`'s)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Take connections while inside; on the way out none outlives it (each cancelled and
        awaited)."""
        assert self._server is not None
        self._stopped = False
        await self._server.start_serving()
        try:
            yield
        finally:
            self._stopped = True
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Admitted (and counted) here, before the loop accepts another: the cap cannot be overrun.
        if self._stopped:
            writer.transport.abort()
            return
        task: asyncio.Task[None] | None = None

        def close() -> None:
            if self.on_shed is not None:
                self.on_shed()
            writer.transport.abort()
            if task is not None:
                task.cancel()

        slot = self.gate.admit(peer_of(writer.get_extra_info("peername")), close)
        if slot is None:
            if self.busy is None or self._busy_now >= _MAX_BUSY:
                if self.on_refused is not None:
                    self.on_refused()
                writer.transport.abort()
                return
            self._busy_now += 1
        loop = asyncio.get_running_loop()
        task = loop.create_task(
            self._connection(reader, writer, slot), name=f"{self.name}-connection"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot | None
    ) -> None:
        conn = H11Conn(reader, writer, self.settings)
        try:
            if slot is None:
                assert self.busy is not None
                async with asyncio.timeout(self.head_timeout_s or self.settings.read_timeout_s):
                    await self.busy(conn)
            else:
                await self._serve(conn, slot)
        except asyncio.CancelledError:
            pass  # the source is stopping, or the connection was shed: it ends quietly
        except h11.RemoteProtocolError as e:
            if self.bad_request is not None:
                await self.bad_request(conn, e)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, h11.ProtocolError):
            # the client went away mid-message, a deadline passed, or h11 refused what was sent
            pass
        except Exception as e:
            if self.failed is not None:
                self.failed(e)
        finally:
            if slot is None:
                self._busy_now -= 1
            else:
                self.gate.release(slot)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, conn: H11Conn, slot: Slot) -> None:
        # A new connection owes its first request (it waits like a slow head); between requests it
        # is idle.
        wait_s, first = self.head_timeout_s, True
        while True:
            if not conn.h11.trailing_data[0]:
                # The first byte of the next request within its wait (or the client opens another
                # when it needs one).
                try:
                    read = conn.reader.read(_READ)
                    data = await (read if wait_s is None else asyncio.wait_for(read, wait_s))
                except TimeoutError:
                    if first and self.timed_out is not None:
                        await self.timed_out(conn)  # a new connection that never sent its request
                    return
                if not data:
                    return
                conn.h11.receive_data(data)
            self.gate.heading(slot)  # its head began: shed first if it is slow to come whole
            try:
                request = await conn.next_event(self.head_timeout_s)
            except TimeoutError:
                if self.timed_out is not None:
                    await self.timed_out(conn)
                return  # a head that never ends (a trickling client)
            if not isinstance(request, h11.Request):
                return
            if _head_bytes(request) > self.settings.max_head_bytes:
                # h11 bounds a head only while it is incomplete: one that came whole in a read is
                # measured here.
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            self.gate.working(slot)
            await self.handle(conn, request)
            if not conn.next_cycle():
                return
            self.gate.idle(slot)
            wait_s, first = self.keepalive_s, False
