"""Hostile clients at the monitor's doors: /metrics and a legitimate agent keep their answers (issue
44).

The monitor runs in a child process (a `Monitor` with the door under test and its metrics port, an
instant judge, an in-memory store); the hostile clients and the probes run in this process.

- `otlp`: `--clients` clients (2) each POST, in a loop for `--seconds` (10), a protobuf span of 1.5
  million empty events (about 3 MB, under the 4 MiB body cap). Meanwhile /metrics is fetched every
  0.1 s: `metrics_p50_ms`/`metrics_max_ms` under the bomb beside `base_p50_ms`/`base_max_ms` (the
  same probe for 3 s before it, in the same run), and the child's RSS: `rss_start_mb`,
  `rss_peak_mb` (sampled every 0.1 s). The issue's bounds: p50 0.5 s, max 2 s, RSS within 200 MB.
- `proxy`: `--conns` connections (4,200, over the proxy's 4,096 bound) each send a request line and
  then one header line every 5 s, forever (reconnecting when closed), for `--seconds` (40);
  meanwhile a legitimate chat completion (urllib, 10 s timeout) every second through the proxy to a
  local upstream: `legit_ok`/`legit_sent`, `legit_p50_ms`/`legit_max_ms` (beside `base_p50_ms`, the
  same request before the attack), and the peak of the proxy's connection gauge (`conn_peak`,
  bounded by 4,096), connections shed and refused. Every client here is one address, so the
  per-address bound is set to 4,096 (`--per-peer`) to test the global one. `ulimit -n` must allow
  twice `--conns` plus some (this process holds one end, the child the other).

Each line ends with the load average at start and end (a 2-core machine shared with other work
bounds every latency here).

    .venv/bin/python bench/doors.py otlp [--clients 2] [--seconds 10]
    .venv/bin/python bench/doors.py proxy [--conns 4200] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import multiprocessing as mp
import resource
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from _common import configure_logs, free_port, kv_line, load1, percentile, proc_status_kb, wait_port


def _serve(kind: str, port: int, metrics_port: int, upstream: str, per_peer: int = 1) -> None:
    """The child: a Monitor with the door under test and its metrics port, until killed."""
    configure_logs("error")
    from prometheus_client import CollectorRegistry

    from agent_monitor.daemon import (
        HttpServer,
        MemoryStore,
        Monitor,
        MonitorConfig,
        OtlpReceiver,
        OtlpReceiverSettings,
        ProxySettings,
        ProxySource,
    )
    from agent_monitor.policy import Policy
    from agent_monitor.testing import FakeJudge

    async def main() -> None:
        reg = CollectorRegistry()
        http = HttpServer(reg, port=metrics_port)
        await http.bind()
        source: Any
        if kind == "otlp":
            source = OtlpReceiver(OtlpReceiverSettings(address=f"127.0.0.1:{port}"), registry=reg)
        else:
            source = ProxySource(
                ProxySettings(
                    upstream=upstream, listen=f"127.0.0.1:{port}", max_connections_per_peer=per_peer
                ),
                registry=reg,
            )
        judge = FakeJudge(lambda p: "K", record=False)
        config = MonitorConfig(policy=Policy())
        async with Monitor(
            config, judge=judge, store=MemoryStore(), registry=reg, sources=[source], http=http
        ):
            await asyncio.Event().wait()

    asyncio.run(main())


def _bomb() -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = b"\x01" * 16, b"\x02" * 8, "bomb"
    span.start_time_unix_nano, span.end_time_unix_nano = 1, 2
    for _ in range(1_500_000):
        span.events.add()
    return req.SerializeToString()


def _probe(metrics_port: int, seconds: float, pid: int) -> tuple[list[float], int]:
    """Fetch /metrics every 0.1 s for `seconds`: the latencies and the child's peak RSS (kB)."""
    lat: list[float] = []
    peak = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read()
        except OSError:
            lat.append(30.0)
        else:
            lat.append(time.perf_counter() - t0)
        peak = max(peak, proc_status_kb("VmRSS", pid))
        time.sleep(0.1)
    return lat, peak


def otlp(args: argparse.Namespace) -> None:
    load_start = load1()
    port, mport = free_port(), free_port()
    child = mp.get_context("spawn").Process(
        target=_serve, args=("otlp", port, mport, ""), daemon=True
    )
    child.start()
    assert child.pid is not None
    try:
        wait_port(port, 30)
        wait_port(mport, 30)
        time.sleep(1.0)
        rss_start = proc_status_kb("VmRSS", child.pid)
        base, _ = _probe(mport, 3.0, child.pid)
        data = _bomb()
        stop = threading.Event()
        sent = [0, 0]

        def client(i: int) -> None:
            while not stop.is_set():
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                c.request(
                    "POST",
                    "/v1/traces",
                    body=data,
                    headers={"content-type": "application/x-protobuf"},
                )
                status = c.getresponse().status
                c.close()
                sent[0 if status == 200 else 1] += 1

        threads = [
            threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        lat, peak = _probe(mport, args.seconds, child.pid)
        stop.set()
        for t in threads:
            t.join(60)
        print(
            kv_line(
                door="otlp",
                clients=args.clients,
                seconds=args.seconds,
                bomb_bytes=len(data),
                bombs_ok=sent[0],
                bombs_refused=sent[1],
                base_p50_ms=percentile(base, 50) * 1000,
                base_max_ms=max(base) * 1000,
                metrics_p50_ms=percentile(lat, 50) * 1000,
                metrics_max_ms=max(lat) * 1000,
                rss_start_mb=rss_start / 1024,
                rss_peak_mb=peak / 1024,
                load_start=load_start,
                load_end=load1(),
            )
        )
    finally:
        child.kill()
        child.join()


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = json.dumps(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "fine"},
                        "finish_reason": "stop",
                    }
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def proxy(args: argparse.Namespace) -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.conns + 200:
        raise SystemExit(
            f"ulimit -n is {soft}: {args.conns} connections need at least {args.conns + 200}"
        )
    load_start = load1()
    up = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    up.daemon_threads = True
    threading.Thread(target=up.serve_forever, daemon=True).start()
    port, mport = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up.server_address[1]}/v1"
    child = mp.get_context("spawn").Process(
        target=_serve, args=("proxy", port, mport, upstream, args.per_peer), daemon=True
    )
    child.start()
    try:
        wait_port(port, 30)
        wait_port(mport, 30)
        result = asyncio.run(_proxy_attack(args, port, mport))
        print(
            kv_line(
                door="proxy",
                conns=args.conns,
                seconds=args.seconds,
                **result,
                load_start=load_start,
                load_end=load1(),
            )
        )
    finally:
        child.kill()
        child.join()
        up.shutdown()


async def _proxy_attack(args: argparse.Namespace, port: int, mport: int) -> dict[str, Any]:
    stop = asyncio.Event()
    opened = [0]

    async def trickle() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            opened[0] += 1
            try:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(5):
                            if not await reader.read(1):
                                break
                    writer.write(b"x-trickle: 1\r\n")
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

    def gauge() -> tuple[float, float, float]:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30).read().decode()
        )
        got = {}
        for line in text.splitlines():
            for name in (
                "proxy_connections ",
                "proxy_connections_shed_total ",
                "proxy_connections_refused_total ",
            ):
                if line.startswith("agent_monitor_" + name):
                    got[name.strip()] = float(line.split()[-1])
        return (
            got.get("proxy_connections", 0.0),
            got.get("proxy_connections_shed_total", 0.0),
            got.get("proxy_connections_refused_total", 0.0),
        )

    def legit() -> float | None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            headers={"content-type": "application/json"},
        )
        t0 = time.perf_counter()
        try:
            body = json.loads(urllib.request.urlopen(req, timeout=10).read())
        except OSError:
            return None
        return (
            time.perf_counter() - t0 if body["choices"][0]["message"]["content"] == "fine" else None
        )

    # The baseline: the same legitimate request before any trickling connection.
    base: list[float] = []
    for _ in range(5):
        got = await asyncio.to_thread(legit)
        if got is not None:
            base.append(got)
    tasks = []
    for i in range(args.conns):
        tasks.append(asyncio.create_task(trickle()))
        if i % 200 == 199:
            await asyncio.sleep(0.05)
    lat: list[float] = []
    sent = 0
    peak = 0.0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        sent += 1
        got = await asyncio.to_thread(legit)
        if got is not None:
            lat.append(got)
        peak = max(peak, (await asyncio.to_thread(gauge))[0])
        await asyncio.sleep(max(0.0, 1.0 - (got or 0.0)))
    _, shed, refused = await asyncio.to_thread(gauge)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "base_p50_ms": percentile(base, 50) * 1000 if base else float("nan"),
        "legit_ok": len(lat),
        "legit_sent": sent,
        "legit_p50_ms": percentile(lat, 50) * 1000 if lat else float("nan"),
        "legit_max_ms": max(lat) * 1000 if lat else float("nan"),
        "conn_peak": int(peak),
        "shed": int(shed),
        "refused": int(refused),
        "trickler_connects": opened[0],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("door", choices=("otlp", "proxy"))
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--conns", type=int, default=4200)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument(
        "--per-peer",
        type=int,
        default=4096,
        help="the proxy's per-address bound (4096: the global bound is what holds)",
    )
    a = parser.parse_args()
    if a.seconds is None:
        a.seconds = 10.0 if a.door == "otlp" else 40.0
    (otlp if a.door == "otlp" else proxy)(a)
