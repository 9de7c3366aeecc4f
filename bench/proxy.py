"""LLM API proxy overhead: added latency per streamed chunk and per request, against the upstream called directly.

One process, one event loop: an upstream (asyncio + h11, as lean as a server gets in Python) that
streams chat-completion chunks (OpenAI's SSE shape, ~200 bytes each, `--gap-ms` apart so the
network does not merge them) or answers a plain chat completion; the proxy (`ProxySource`, the
source of a `Monitor` with no broker, a memory journal and a judge that answers at once, so every
turn is read, ingested and scored as in `serve`); and a pooled httpx client (the transport of the
openai and anthropic SDKs). Each request carries a `--history`-message conversation (~100 bytes a
message), so the proxy reads a real history each time.

Baseline: the same client calling the upstream directly, interleaved request by request with the
proxied calls, so both see the same machine load. Per chunk: time from the upstream's write
(its timestamp inside the chunk) to the client's read of it. Per request: time from sending to
the last byte of a non-streamed answer. Figures bound: loopback only (no network), one client at a
time, so they are the proxy's own work per chunk and per request, not contention between agents.

    .venv/bin/python bench/proxy.py [--requests 200] [--chunks 40] [--gap-ms 2] [--history 20] [--turns 20] [--bare]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import h11
import httpx2
import structlog
from _common import kv_line, percentile

from agent_monitor.daemon import Ingest, MemoryStore, Monitor, MonitorConfig, ProxySettings, ProxySource
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import Topics


class _NoRuns:
    def is_live(self, run_id: str) -> bool:
        return False

    def signal(self, run_id: str) -> None:
        return None

    def latest(self, run_id: str) -> None:
        return None


class Upstream:
    """A streaming chat-completions upstream on asyncio streams and h11."""

    def __init__(self, chunks: int, gap_s: float) -> None:
        self.chunks = chunks
        self.gap_s = gap_s
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                body = b""
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        data = await reader.read(65536)
                        if not data:
                            return
                        conn.receive_data(data)
                    elif isinstance(ev, h11.Data):
                        body += ev.data
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                    elif isinstance(ev, h11.ConnectionClosed):
                        return
                req = json.loads(body)
                if req.get("stream"):
                    await self._stream(conn, writer)
                else:
                    out = json.dumps(_completion(time.perf_counter())).encode()
                    hdr = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
                    writer.write(conn.send(h11.Response(status_code=200, headers=hdr)))
                    writer.write(conn.send(h11.Data(data=out)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError):
            pass
        except asyncio.CancelledError:
            pass  # the loop ends under a keep-alive connection: this server's tasks are nobody else's
        finally:
            writer.close()

    async def _stream(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        writer.write(conn.send(h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])))
        for i in range(self.chunks):
            await asyncio.sleep(self.gap_s)
            chunk = {
                "id": "chatcmpl-bench",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "bench",
                "t": time.perf_counter(),
                "choices": [{"index": 0, "delta": {"content": f"token {i} of the answer "}, "finish_reason": None}],
            }
            writer.write(conn.send(h11.Data(data=f"data: {json.dumps(chunk)}\n\n".encode())))
            await writer.drain()
        writer.write(conn.send(h11.Data(data=b"data: [DONE]\n\n")) + conn.send(h11.EndOfMessage()))
        await writer.drain()


def _completion(t: float) -> dict[str, object]:
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": "bench",
        "t": t,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }


def conversation(run: str, history: int) -> dict[str, object]:
    """A chat request with `history` messages after the system prompt (a tool loop's alternating turns)."""
    msgs: list[dict[str, object]] = [
        {"role": "system", "content": "You are a coding agent. " * 4},
        {"role": "user", "content": f"Task {run}: make the failing test pass."},
    ]
    for i in range(history // 2):
        call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"cmd": f"pytest -k t{i}"})},
        }
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"test t{i}: 1 failed, 3 passed " * 2})
    return {"model": "bench", "messages": msgs}


async def streamed(client: httpx2.AsyncClient, url: str, body: dict[str, object]) -> list[float]:
    """Per-chunk latency (upstream write -> client read), in ms."""
    out: list[float] = []
    buf = b""
    async with client.stream("POST", f"{url}/chat/completions", json={**body, "stream": True}) as resp:
        async for raw in resp.aiter_raw():
            now = time.perf_counter()
            buf += raw
            while (end := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:end], buf[end + 2 :]
                data = event.removeprefix(b"data: ")
                if data != b"[DONE]":
                    out.append((now - json.loads(data)["t"]) * 1000)
    return out


async def plain(client: httpx2.AsyncClient, url: str, body: dict[str, object]) -> float:
    """One non-streamed request, send to last byte, in ms."""
    t0 = time.perf_counter()
    resp = await client.post(f"{url}/chat/completions", json=body)
    resp.read()
    assert resp.status_code == 200, resp.text
    return (time.perf_counter() - t0) * 1000


def summary(name: str, direct: list[float], proxied: list[float]) -> dict[str, float]:
    d50, d99 = percentile(direct, 50), percentile(direct, 99)
    p50, p99 = percentile(proxied, 50), percentile(proxied, 99)
    print(
        f"{name:<22} direct p50 {d50:7.3f} ms  p99 {d99:7.3f} ms | via proxy p50 {p50:7.3f} ms  p99 {p99:7.3f} ms | "
        f"added p50 {p50 - d50:+7.3f} ms  p99 {p99 - d99:+7.3f} ms  (n={len(proxied)})"
    )
    return {f"{name}_added_p50_ms": p50 - d50, f"{name}_added_p99_ms": p99 - d99}


async def main(args: argparse.Namespace) -> None:
    # Logging as serve does (JSON lines at info), to /dev/null: its cost counts, its lines do not clutter.
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(open(os.devnull, "w")),  # noqa: SIM115, ASYNC230 - /dev/null, kept
    )  # fmt: skip
    up = Upstream(args.chunks, args.gap_ms / 1000)
    url = await up.start()
    proxy = ProxySource(ProxySettings(upstream=url, listen="127.0.0.1:0"))
    judge = FakeJudge(lambda p: "P", record=False)
    async with proxy, contextlib.AsyncExitStack() as stack:
        monitor: Monitor | None = None
        if args.bare:
            # The proxy alone: its events go to an ingest that takes them and does nothing.
            async def taken(messages: Sequence[object]) -> list[BaseException | None]:
                return [None] * len(messages)

            feed = asyncio.create_task(proxy.run(Ingest(taken, Topics("agents")), _NoRuns()))
            stack.callback(feed.cancel)
        else:
            monitor = Monitor(MonitorConfig(), judge=judge, store=MemoryStore(), sources=[proxy])
            await stack.enter_async_context(monitor)
        await asyncio.sleep(0.05)
        via = f"{proxy.url}/v1"
        async with httpx2.AsyncClient(timeout=30) as client:
            direct_chunks: list[float] = []
            proxy_chunks: list[float] = []
            direct_req: list[float] = []
            proxy_req: list[float] = []
            jobs: list[tuple[Callable[[], Awaitable[object]], list[float]]] = []
            # Agents in a tool loop: each request of a run carries one more turn (and its tool result) than the last.
            for i in range(args.requests):
                run, turn = divmod(i, args.turns)
                for kind, fn, via_sink, direct_sink in (
                    ("s", streamed, proxy_chunks, direct_chunks),
                    ("p", plain, proxy_req, direct_req),
                ):
                    body = conversation(f"{kind}{run}", 2 * (turn + 1) + args.history)
                    jobs.append((lambda b=body, f=fn: f(client, url, b), direct_sink))  # type: ignore[misc]
                    jobs.append((lambda b=body, f=fn: f(client, via, b), via_sink))  # type: ignore[misc]
            for fn, _sink in jobs[:8]:  # warm-up: connections, first parses
                await fn()
            for fn, sink in jobs:
                got = await fn()
                sink.extend(got if isinstance(got, list) else [float(got)])  # type: ignore[arg-type]
        if monitor is not None:
            await monitor.drain()
        stats = dict(proxy.statistics())
    assert up.server is not None
    up.server.close()
    await asyncio.sleep(0.2)  # the upstream's connections see their clients close
    print(
        ("bare proxy (events taken by a no-op ingest); " if args.bare else "proxy as a Monitor's source; ")
        + f"requests {args.requests} x (stream of {args.chunks} chunks, plain) x (direct, proxy); runs of {args.turns} "
        f"requests, history {args.history} + 2 per turn messages"
    )
    figures = summary("chunk", direct_chunks, proxy_chunks) | summary("request", direct_req, proxy_req)
    print(f"proxy: watched {stats.get('watched', 0)}, steps sent {stats.get('steps_sent', 0)}, "
          f"unwatched {sum(v for k, v in stats.items() if k.startswith('unwatched'))}; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(kv_line(**figures, load1=os.getloadavg()[0]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--history", type=int, default=20, help="messages of history before a run's first request")
    parser.add_argument("--bare", action="store_true", help="the proxy alone: no Monitor scoring in the process")
    parser.add_argument("--turns", type=int, default=20, help="requests per run (each one turn longer)")
    asyncio.run(main(parser.parse_args()))
