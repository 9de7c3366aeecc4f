"""The sources' shared HTTP/1.1 door (`daemon._h11`): keep-alive, bounded bodies, the connection
bound, a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import h11

from agent_monitor.daemon.http import H11Conn, H11Server, HttpSettings


async def _echo(conn: H11Conn, request: h11.Request) -> None:
    body = await conn.body(8)
    if body is None:
        await conn.respond(413, b"too large", [(b"content-type", b"text/plain")], close=True)
        return
    await conn.respond(200, request.target + b":" + body, [(b"content-type", b"text/plain")])


async def _exchange(port: int, requests: bytes) -> bytes:
    """Send the requests, half-close, and read everything until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(requests)
    with contextlib.suppress(OSError):  # a refused connection may be gone already
        writer.write_eof()
    try:
        data = await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        data = b""
    writer.close()
    return data


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _bounds(**kw: Any) -> HttpSettings:
    """A test server's bounds: no deadline but those the test sets."""
    return HttpSettings(
        **{"max_head_bytes": 4096, "head_timeout_s": None, "read_timeout_s": None, **kw}
    )


def _post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


async def test_keep_alive_bounded_bodies_the_connection_bound_and_a_clean_stop() -> None:
    refused: list[int] = []
    server = H11Server("t", _echo, _bounds(max_connections=1), on_refused=lambda: refused.append(1))
    await server.open("127.0.0.1", 0, start_serving=False)
    bound = server.sockname
    assert bound is not None
    async with server.serving():
        # Two requests on one connection: both answered, in order.
        got = await _exchange(bound[1], _post("/a", b"1") + _post("/b", b"22"))
        assert got.count(b"HTTP/1.1 200") == 2 and got.index(b"/a:1") < got.index(b"/b:22")
        await _until(lambda: server.connections == 0)
        # A body over the bound: 413 and the connection closed.
        got = await _exchange(bound[1], _post("/c", b"123456789"))
        assert got.startswith(b"HTTP/1.1 413") and b"connection: close" in got
        await _until(lambda: server.connections == 0)
        # One idle connection open (the bound): a new one sheds it and is answered; the idle one is
        # closed.
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", bound[1])
        await _until(lambda: server.connections == 1)
        got = await asyncio.wait_for(_exchange(bound[1], _post("/d", b"")), 5)
        assert got.startswith(b"HTTP/1.1 200") and server.gate.shed == 1 and refused == []
        assert await asyncio.wait_for(idle_r.read(), 5) == b""
        idle_w.close()
        await _until(lambda: server.connections == 0)
        # One connection working (its body still coming): the next is closed at once, counted.
        reader, writer = await asyncio.open_connection("127.0.0.1", bound[1])
        writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n12")
        await writer.drain()
        await _until(lambda: server.connections == 1 and server.gate.waiting_count == 0)
        assert await asyncio.wait_for(
            _exchange(bound[1], _post("/f", b"")), 5
        ) == b"" and refused == [1]
    # Leaving `serving()` ended the open connection.
    assert server.connections == 0 and await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await server.close()
    assert not server.bound


async def test_the_cap_holds_under_a_burst_and_a_trickling_head_is_cut_at_its_deadline() -> None:
    """Connections are counted at accept (a burst never overruns the cap); a head that trickles
    is closed."""
    peak = 0
    server = H11Server("t", _echo, _bounds(max_connections=8, head_timeout_s=0.5, keepalive_s=30))
    await server.open("127.0.0.1", 0, start_serving=False)
    bound = server.sockname
    assert bound is not None
    async with server.serving():
        opened = await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", bound[1]) for _ in range(40))
        )
        for _ in range(50):
            peak = max(peak, server.connections)
            await asyncio.sleep(0.01)
        assert peak == 8 and server.gate.shed == 32  # every newer connection shed an older idle one
        for _, w in opened:
            w.close()
        await _until(lambda: server.connections == 0)
        # A head sent a byte at a time, slower than its deadline allows: closed, never answered.
        reader, writer = await asyncio.open_connection("127.0.0.1", bound[1])
        head = _post("/slow", b"")
        got = b""
        with contextlib.suppress(ConnectionError):
            for i in range(len(head)):
                writer.write(head[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.05)
                if reader.at_eof():
                    break
        got = await asyncio.wait_for(reader.read(), 5)
        assert got == b"" and reader.at_eof()
        writer.close()


async def test_one_peer_over_its_bound_sheds_its_own_oldest_connection() -> None:
    server = H11Server(
        "t", _echo, _bounds(max_connections=100, max_connections_per_peer=3, keepalive_s=30)
    )
    await server.open("127.0.0.1", 0, start_serving=False)
    bound = server.sockname
    assert bound is not None
    async with server.serving():
        opened = [await asyncio.open_connection("127.0.0.1", bound[1]) for _ in range(5)]
        await _until(lambda: server.gate.shed == 2)
        assert server.connections == 3
        # The two oldest were shed, the three newest are served.
        for r, _ in opened[:2]:
            assert await asyncio.wait_for(r.read(), 5) == b""
        r, w = opened[-1]
        w.write(_post("/x", b"1"))
        await w.drain()
        assert (await asyncio.wait_for(r.read(200), 5)).startswith(b"HTTP/1.1 200")
        for _, w in opened:
            w.close()
