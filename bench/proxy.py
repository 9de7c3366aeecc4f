"""LLM API proxy overhead: added latency per streamed chunk and per request, against the upstream
called directly.

Two shapes, one after the other in one run (`--shapes`, both by default), each beside its own
baseline:

- in-process: one process, one event loop: an upstream (asyncio + h11, as lean as a server gets in
  Python), the proxy (`ProxySource`, the source of a `Monitor` with no broker, a memory journal and
  a FakeJudge that answers at once, so every turn is read, ingested and scored as in `serve`;
  `--bare`: the proxy alone, its events taken by a no-op ingest) and the client.
- deployed, the shape users run: the same upstream in a process of its own (this script with
  `--serve-upstream PORT`); the real CLI, `agent-monitor proxy`, in its own (serve's defaults: a
  SQLite journal, logs at info to a file, a private Mosquitto as its broker) judging through an
  OpenAI-compatible HTTP judge in a third (scripted: one letter with logprob 0, at once); the client
  here.

The upstream streams chat-completion chunks (OpenAI's SSE shape, ~200 bytes each, `--gap-ms` apart
so the network does not merge them) or answers a plain chat completion. The client is a pooled httpx
client (the transport of the openai and anthropic SDKs). Each request carries a `--history`-message
conversation (~100 bytes a message) growing by a turn per request, so the proxy reads a real
history.

Baseline: the same client calling the upstream directly, interleaved request by request with the
proxied calls, so both see the same machine load. Per chunk: time from the upstream's write (its
`perf_counter` inside the chunk: CLOCK_MONOTONIC, one clock for all processes) to the client's read
of it. Per request: time from sending to the last byte of a non-streamed answer. Figures bound:
loopback only (no network), one client at a time, so they are the proxy's own work per chunk and per
request (plus, deployed, its process's share of two cores with the scoring it triggers), not
contention between agents; a judge that answers at once, so no judge latency is in them.

    .venv/bin/python bench/proxy.py [--requests 200] [--chunks 40] [--gap-ms 2] [--history 20]
    [--turns 20]
                                    [--shapes in-process,deployed] [--bare]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import h11
import httpx2
import structlog
from _common import (
    cleanup_on_sigterm,
    free_port,
    kv_line,
    load1,
    mosquitto,
    percentile,
    scripted_judge,
    wait_port,
)

from agent_monitor.daemon import (
    Ingest,
    MemoryStore,
    Monitor,
    MonitorConfig,
    ProxySettings,
    ProxySource,
)
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

    async def start(self, port: int = 0) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", port)
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
                    hdr = [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(out)).encode()),
                    ]
                    writer.write(conn.send(h11.Response(status_code=200, headers=hdr)))
                    writer.write(conn.send(h11.Data(data=out)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError):
            pass
        except asyncio.CancelledError:
            # the loop ends under a keep-alive connection: this server's tasks are nobody else's
            pass
        finally:
            writer.close()

    async def _stream(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        writer.write(
            conn.send(
                h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])
            )
        )
        for i in range(self.chunks):
            await asyncio.sleep(self.gap_s)
            chunk = {
                "id": "chatcmpl-bench",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "bench",
                "t": time.perf_counter(),
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": f"token {i} of the answer "},
                        "finish_reason": None,
                    }
                ],
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
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "done"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }


def conversation(run: str, history: int) -> dict[str, object]:
    """A chat request with `history` messages after the system prompt (a tool loop's alternating
    turns)."""
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
        msgs.append(
            {
                "role": "tool",
                "tool_call_id": f"c{i}",
                "content": f"test t{i}: 1 failed, 3 passed " * 2,
            }
        )
    return {"model": "bench", "messages": msgs}


async def streamed(client: httpx2.AsyncClient, url: str, body: dict[str, object]) -> list[float]:
    """Per-chunk latency (upstream write -> client read), in ms."""
    out: list[float] = []
    buf = b""
    async with client.stream(
        "POST", f"{url}/chat/completions", json={**body, "stream": True}
    ) as resp:
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
        f"{name:<8} direct p50 {d50:7.3f} ms  p99 {d99:7.3f} ms | via proxy p50 {p50:7.3f} ms "
        f" p99 {p99:7.3f} ms | "
        f"added p50 {p50 - d50:+7.3f} ms  p99 {p99 - d99:+7.3f} ms  (n={len(proxied)})"
    )
    return {f"{name}_added_p50_ms": p50 - d50, f"{name}_added_p99_ms": p99 - d99}


@dataclass
class Samples:
    """One shape's latencies (ms): per streamed chunk and per plain request, direct and through
    the proxy."""

    direct_chunks: list[float] = field(default_factory=list)
    proxy_chunks: list[float] = field(default_factory=list)
    direct_req: list[float] = field(default_factory=list)
    proxy_req: list[float] = field(default_factory=list)


async def measure(url: str, via: str, args: argparse.Namespace) -> Samples:
    """Every request twice, to the upstream directly and through the proxy, interleaved, from one
    pooled client."""
    out = Samples()
    async with httpx2.AsyncClient(timeout=30) as client:
        jobs: list[tuple[Callable[[], Awaitable[object]], list[float]]] = []
        # Agents in a tool loop: each request of a run carries one more turn (and its tool result)
        # than the last.
        for i in range(args.requests):
            run, turn = divmod(i, args.turns)
            for kind, fn, via_sink, direct_sink in (
                ("s", streamed, out.proxy_chunks, out.direct_chunks),
                ("p", plain, out.proxy_req, out.direct_req),
            ):
                body = conversation(f"{kind}{run}", 2 * (turn + 1) + args.history)
                jobs.append((lambda b=body, f=fn: f(client, url, b), direct_sink))  # type: ignore[misc]
                jobs.append((lambda b=body, f=fn: f(client, via, b), via_sink))  # type: ignore[misc]
        for fn, _sink in jobs[:8]:  # warm-up: connections, first parses
            await fn()
        for fn, sink in jobs:
            got = await fn()
            sink.extend(got if isinstance(got, list) else [float(got)])  # type: ignore[arg-type]
    return out


async def in_process(args: argparse.Namespace) -> tuple[Samples, str]:
    """Upstream, proxy, monitor (FakeJudge, memory journal) and client on one event loop."""
    # Logging as serve does (JSON lines at info), to /dev/null: its cost counts, its lines do not
    # clutter.
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(open(os.devnull, "w")),  # noqa: SIM115, ASYNC230 - /dev/null, kept
    )
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
        samples = await measure(url, f"{proxy.url}/v1", args)
        if monitor is not None:
            await monitor.drain()
        stats = dict(proxy.statistics().counts)
    assert up.server is not None
    up.server.close()
    await asyncio.sleep(0.2)  # the upstream's connections see their clients close
    unwatched = sum(v for k, v in stats.items() if k.startswith("unwatched"))
    calls = "none (bare)" if args.bare else str(judge.calls_made)
    note = (
        f"proxy: requests watched {stats.get('watched', 0)}, steps sent "
        f"{stats.get('steps_sent', 0)}, unwatched {unwatched}; "
        f"judge calls {calls}"
    )
    return samples, note


def _start(
    cmd: list[str], log: Path, port: int, what: str, timeout_s: float = 60.0
) -> subprocess.Popen[bytes]:
    """Start a process logging to `log` and wait until it listens on `port` (its log tail if it
    dies first)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            wait_port(port, 0.2)
            return proc
        except TimeoutError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(
                    f"{what} not listening in {timeout_s:g}s:\n{log.read_text()[-3000:]}"
                ) from None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def deployed(args: argparse.Namespace) -> tuple[Samples, str]:
    """Upstream, proxy (the `agent-monitor proxy` CLI) and judge each in its own process; the
    client here."""
    with (
        tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp,
        mosquitto() as broker,
        scripted_judge(0.0) as judge,
        contextlib.ExitStack() as procs,
    ):
        up_port, proxy_port = free_port(), free_port()
        up_cmd = [sys.executable, __file__, "--serve-upstream", str(up_port)]
        up_cmd += ["--chunks", str(args.chunks), "--gap-ms", str(args.gap_ms)]
        up = _start(up_cmd, Path(tmp) / "upstream.log", up_port, "the upstream")
        procs.callback(_stop, up)
        url = f"http://127.0.0.1:{up_port}/v1"
        # serve's defaults otherwise: a SQLite journal, logs at info (to a file, as a service's go
        # to its journal).
        cmd = [
            sys.executable,
            "-m",
            "agent_monitor",
            "proxy",
            "--upstream",
            url,
            "--listen",
            f"127.0.0.1:{proxy_port}",
        ]
        cmd += [
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--judge-model",
            "scripted",
        ]
        cmd += ["--state-dir", str(Path(tmp) / "state"), "--client-id", "bench-proxy"]
        log = Path(tmp) / "proxy.log"
        proxy = _start(cmd, log, proxy_port, "agent-monitor proxy")
        procs.callback(_stop, proxy)
        checks = judge.calls  # the start-up check's calls, not the runs'
        samples = asyncio.run(measure(url, f"http://127.0.0.1:{proxy_port}/v1", args))
        # The proxied turns are scored after their answers went back: wait for the judge calls to
        # settle.
        seen, deadline = -1, time.monotonic() + 30
        while judge.calls != seen and time.monotonic() < deadline:
            seen = judge.calls
            time.sleep(1.0)
        errors = sum(
            '"level": "error"' in line for line in log.read_text(errors="replace").splitlines()
        )
        note = (
            f"judge calls {judge.calls - checks} (after {checks} at start-up); error lines in "
            f"the proxy's log {errors}"
        )
    return samples, note


async def serve_upstream(port: int, chunks: int, gap_s: float) -> None:
    """The `--serve-upstream` sub-mode: the Upstream alone, until terminated."""
    up = Upstream(chunks, gap_s)
    await up.start(port)
    assert up.server is not None
    await up.server.serve_forever()


def main(args: argparse.Namespace) -> None:
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not shapes or set(shapes) - {"in-process", "deployed"}:
        raise SystemExit("--shapes takes in-process and deployed, comma-separated")
    load_start = load1()
    print(
        f"requests {args.requests} x (stream of {args.chunks} chunks {args.gap_ms:g} ms "
        "apart, plain) x "
        f"(direct, proxy); runs of {args.turns} requests, history {args.history} + 2 per turn "
        "messages; "
        f"load {load_start} at start"
    )
    figures: dict[str, float] = {}
    for shape in shapes:
        before = load1()
        if shape == "in-process":
            samples, note = asyncio.run(in_process(args))
            title = (
                "in-process, bare proxy (events taken by a no-op ingest)"
                if args.bare
                else "in-process: upstream, ProxySource + Monitor (FakeJudge at once, memory "
                "journal), client on one loop"
            )
        else:
            samples, note = deployed(args)
            title = (
                "deployed: upstream | `agent-monitor proxy` (SQLite journal, Mosquitto, logs "
                "at info) | "
                "scripted HTTP judge | client, each its own process"
            )
        print(f"{title}; load {before} -> {load1()}")
        figures |= {
            f"{shape.replace('-', '_')}_{k}": v
            for k, v in (
                summary("chunk", samples.direct_chunks, samples.proxy_chunks)
                | summary("request", samples.direct_req, samples.proxy_req)
            ).items()
        }
        print(f"  {note}")
    print(kv_line(**figures, load_start=float(load_start), load_end=float(load1())))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument(
        "--history", type=int, default=20, help="messages of history before a run's first request"
    )
    parser.add_argument(
        "--bare", action="store_true", help="in-process: the proxy alone, no Monitor scoring"
    )
    parser.add_argument(
        "--turns", type=int, default=20, help="requests per run (each one turn longer)"
    )
    parser.add_argument(
        "--shapes",
        default="in-process,deployed",
        help="in-process, deployed, or both (comma-separated, in order)",
    )
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.serve_upstream is not None:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_upstream(parsed.serve_upstream, parsed.chunks, parsed.gap_ms / 1000))
    else:
        cleanup_on_sigterm()
        main(parsed)
