"""A lean HTTP/1.1 client for one request shape: POST a body, read the reply, keep the connection.

Used by the judge's transport (judges/_openai_transport.py) and the Phoenix sink
(daemon/_phoenix.py).

The OpenAI SDK builds request options, headers and a pydantic model of every reply (for a
20-way `top_logprobs` answer, hundreds of objects) on each call; a judge call needs none of
it: one JSON body out, a handful of fields read back. This client is asyncio streams with h11
(the HTTP/1.1 state machine httpx is built on) and a pool of keep-alive connections, bounded;
TLS through `ssl` for https URLs. Errors are three kinds the judge maps to its reasons:
`WireTimeout`, `WireConnectionError` and a reply with any status (the caller reads it); the errors'
messages leave the URL to the caller, which names its server once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

__all__ = ["WireConnectionError", "WirePool", "WireReply", "WireTimeout"]

_READ_CHUNK = 64 * 1024
MAX_REPLY_BYTES = 64 * 1024 * 1024
"""The largest reply body read (a judge's reply is a few KB; anything near this is not one)."""


class WireTimeout(Exception):
    """The server did not answer within the timeout."""


class WireConnectionError(Exception):
    """The connection could not be made, or broke before the reply was complete."""


@dataclass(frozen=True, slots=True)
class WireReply:
    """A complete HTTP reply: status, headers (lower-case names), body."""

    status: int
    headers: dict[str, str]
    body: bytes
    url: str


class _Conn:
    """One keep-alive connection: its streams and its h11 state machine."""

    __slots__ = ("h11", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            transport = self.writer.transport
            if transport.get_write_buffer_size():
                # Bytes not yet written (a server that answered, or stopped reading, before taking
                # the whole request body): a graceful close would keep them, megabytes of prompt,
                # until the server reads them, which it may never do. Dropped with the connection
                # instead.
                transport.abort()
            else:
                self.writer.close()


class WirePool:
    """Keep-alive connections to one server (`base_url`), at most `max_connections` open, idle
    ones reused."""

    def __init__(
        self, base_url: str, *, headers: dict[str, str], max_connections: int = 64
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url={base_url!r}: use an http:// or https:// URL")
        self.base_url = base_url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path = parts.path.rstrip("/")
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = self.port == (443 if self.tls else 80)
        authority = self.host if default_port else f"{self.host}:{self.port}"
        self._headers = [("Host", authority), *headers.items()]
        self._idle: deque[_Conn] = deque()
        self._slots = asyncio.Semaphore(max_connections)
        self.opened = 0
        """Connections opened so far (reuse shows as requests > opened)."""
        self.requests = 0

    async def request(
        self, method: str, path: str, body: bytes | None, *, timeout_s: float
    ) -> WireReply:
        """Send one request and read its whole reply within `timeout_s`; raise WireTimeout /
        WireConnectionError."""
        url = self.base_url + path
        async with self._slots:
            try:
                async with asyncio.timeout(timeout_s):
                    return await self._exchange(method, self.path + path, body, url)
            except TimeoutError:
                raise WireTimeout(f"no reply within {timeout_s:g} s") from None

    async def _exchange(self, method: str, target: str, body: bytes | None, url: str) -> WireReply:
        while True:
            reused = bool(self._idle)
            conn = self._idle.popleft() if reused else await self._open(url)
            try:
                reply = await self._roundtrip(conn, method, target, body, url)
            except _Stale:
                conn.close()
                if reused:
                    # the server closed an idle connection under us: a fresh one, once per idle conn
                    continue
                raise WireConnectionError(
                    "the server closed the connection before replying"
                ) from None
            except BaseException:
                # a cancelled or broken exchange leaves the connection in an unknown state
                conn.close()
                raise
            self.requests += 1
            if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
                conn.h11.start_next_cycle()
                self._idle.append(conn)
            else:
                conn.close()
            return reply

    async def _open(self, url: str) -> _Conn:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.tls)
        except (OSError, ssl.SSLError) as e:
            raise WireConnectionError(f"connecting failed: {e}") from None
        self.opened += 1
        return _Conn(reader, writer)

    async def _roundtrip(
        self, conn: _Conn, method: str, target: str, body: bytes | None, url: str
    ) -> WireReply:
        h = conn.h11
        headers = [*self._headers, ("Content-Length", str(len(body or b"")))]
        out = h.send(h11.Request(method=method, target=target, headers=headers))
        if body:
            out = (out or b"") + (h.send(h11.Data(data=body)) or b"")
        out = (out or b"") + (h.send(h11.EndOfMessage()) or b"")
        got_any = False
        try:
            conn.writer.write(out)
            await conn.writer.drain()
            status = 0
            reply_headers: dict[str, str] = {}
            chunks: list[bytes] = []
            size = 0
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    data = await conn.reader.read(_READ_CHUNK)
                    if not data and not got_any:
                        raise _Stale
                    got_any = True
                    h.receive_data(data)
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                    reply_headers = {
                        k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers
                    }
                elif isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > MAX_REPLY_BYTES:
                        raise WireConnectionError(f"the reply was over {MAX_REPLY_BYTES} bytes")
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return WireReply(status, reply_headers, b"".join(chunks), url)
                elif isinstance(event, h11.ConnectionClosed):
                    raise WireConnectionError("the server closed the connection mid-reply")
        except (ConnectionError, OSError) as e:
            if not got_any:
                raise _Stale from None
            raise WireConnectionError(f"the connection broke: {e}") from None
        except h11.RemoteProtocolError as e:
            raise WireConnectionError(f"the reply broke HTTP/1.1: {e}") from None

    async def aclose(self) -> None:
        """Close every idle connection (in-flight ones close when their request ends)."""
        while self._idle:
            self._idle.popleft().close()


class _Stale(Exception):
    """The connection gave no byte of a reply: closed by the server (idle) or refused the write."""
