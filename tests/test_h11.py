"""The sources' shared HTTP/1.1 door (`daemon._h11`): keep-alive, bounded bodies, the connection bound, a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import h11

from agent_monitor.daemon._h11 import H11Conn, H11Server


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


def _post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


async def test_keep_alive_bounded_bodies_the_connection_bound_and_a_clean_stop() -> None:
    refused: list[int] = []
    server = H11Server("t", _echo, max_head=4096, max_connections=1, on_refused=lambda: refused.append(1))
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
        # One connection open: the next is closed at once, counted.
        reader, writer = await asyncio.open_connection("127.0.0.1", bound[1])
        await _until(lambda: server.connections == 1)
        assert await asyncio.wait_for(_exchange(bound[1], _post("/d", b"")), 5) == b"" and refused == [1]
    # Leaving `serving()` ended the open connection.
    assert server.connections == 0 and await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await server.close()
    assert not server.bound
