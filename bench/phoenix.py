"""The Phoenix sink's overhead: scoring a trace-fed agent at ~1,000 spans/s with the sink off, on,
and Phoenix down.

The monitor (`Monitor` in this process, pinned to one core, a SQLite journal in a temporary
directory, no broker, an instant judge, the OTLP receiver) takes `--traces` traces of `--steps`
`execute_tool` spans and an `invoke_agent` root each from a second process running the real
OpenTelemetry SDK (a `BatchSpanProcessor` with the OTLP/HTTP protobuf exporter), paced at `--rate`
spans/s (0: as fast as it can). A real Phoenix server (`phoenix serve` from `.venv-phoenix`, `make
phoenix-venv`; SQLite in a temporary directory) shares the other core with the exporter. Three
configurations, one after the other in this process:

- `off`: no Phoenix sink (the baseline);
- `on`: `--phoenix` pointing at the running Phoenix: every scored step is a span annotation, every
  run a trace annotation (the agent's spans are not sent to Phoenix here, only the annotations);
- `down`: `--phoenix` pointing at a port nobody listens on: every request fails, is retried once,
  dropped.

The three run `--repeats` times, interleaved; each figure is the median of its rounds.

Figures per configuration: `spans_per_s` (spans / first span exported -> every run closed),
`scorings_per_s` (scorings in that time), `cpu_us_per_span` (the monitor process's CPU per span: the
sink's cost shows here first, bounded by the one core), `drain_ms` (the last span exported -> the
last run closed: a sink in the scoring path would show here), `export_s` (the exporter's own time:
Phoenix taking CPU on its core slows the agent, not the monitor), and for the sink: annotations
sent, failed, dropped and the mean Phoenix request time. Last, `sink_us_per_annotation`: the sink's
own CPU per annotation in the monitor's process (taking 20,000 scores and encoding them in batches,
no network), the bound on what the sink adds to scoring.

    .venv/bin/python bench/phoenix.py [--traces 400] [--steps 10] [--rate 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import (
    REPO,
    batch_provider,
    cleanup_on_sigterm,
    configure_logs,
    cpu_seconds,
    free_port,
    kv_line,
    load1,
)

TASK = (
    "Find the failing test in the repository, fix the parser and run the test suite until "
    "it passes."
)


def pin(core: int) -> None:
    """Pin this process to one core (the other one when there are two), if the machine lets us."""
    with contextlib.suppress(AttributeError, OSError):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[core % len(cores)]})


def exporter(url: str, conn: Connection, traces: int, steps: int, rate: float) -> None:
    """On command, export every trace through the SDK's batch processor at `rate` spans/s; report
    the times."""
    pin(1)
    from opentelemetry import trace

    provider = batch_provider(url, traces * (steps + 1))
    tracer = provider.get_tracer("bench-agent")
    user = json.dumps([{"role": "user", "parts": [{"type": "text", "content": TASK}]}])
    conn.recv()
    t0 = time.time()
    sent = 0
    for t in range(traces):
        root = tracer.start_span(
            "invoke_agent bench",
            attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.input.messages": user},
        )
        ctx = trace.set_span_in_context(root)
        for s in range(steps):
            tracer.start_span(
                "execute_tool run_tests",
                context=ctx,
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "run_tests",
                    "gen_ai.tool.call.arguments": json.dumps({"path": f"tests/test_{t}_{s}.py"}),
                    "gen_ai.tool.call.result": f"{s} passed, {steps - s} failed",
                },
            ).end()
        root.set_attribute("agent_monitor.outcome", "success")
        root.end()
        sent += steps + 1
        if rate > 0 and (ahead := t0 + sent / rate - time.time()) > 0:
            # paced: the agent's spans arrive at `rate` per second, not in one burst
            time.sleep(ahead)
    provider.force_flush(120_000)
    conn.send(("ok", t0, time.time()))
    provider.shutdown()


@contextlib.contextmanager
def phoenix_server(workdir: Path) -> Iterator[str]:
    """`phoenix serve` from .venv-phoenix on free ports, SQLite under `workdir`, pinned beside
    the exporter."""
    exe = (
        Path(os.environ.get("AGENT_MONITOR_PHOENIX_VENV") or REPO / ".venv-phoenix")
        / "bin"
        / "phoenix"
    )
    if not exe.exists():
        raise SystemExit(f"no Phoenix at {exe}: run `make phoenix-venv` first")
    port = free_port()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(workdir),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    }
    cores = sorted(os.sched_getaffinity(0))
    cmd = ["taskset", "-c", str(cores[1 % len(cores)]), str(exe), "serve"]
    with (workdir / "phoenix.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/healthz", timeout=2):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"phoenix serve did not start: {(workdir / 'phoenix.log').read_text()[-1500:]}"
                )
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


class Closed:
    """A sink counting closed runs, with the time of the last close."""

    def __init__(self) -> None:
        from agent_monitor.daemon import RunClosed

        self.events = (RunClosed,)
        self.n = 0
        self.last = 0.0

    def __call__(self, event: Any) -> None:
        self.n += 1
        self.last = time.time()


async def answer(conn: Connection, wait_s: float) -> Any:
    deadline = time.monotonic() + wait_s
    while not await asyncio.to_thread(conn.poll, 0.2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {wait_s}s")
    return conn.recv()


async def until(check: Any, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the monitor did not finish in time")
        await asyncio.sleep(0.01)


async def one(
    name: str, phoenix_url: str | None, tmp: Path, args: argparse.Namespace
) -> dict[str, float]:
    """Score every trace with the sink configured so; the figures of that configuration, prefixed
    by `name`."""
    from prometheus_client import CollectorRegistry

    from agent_monitor.daemon import (
        Monitor,
        MonitorConfig,
        OtlpReceiver,
        OtlpReceiverSettings,
        PhoenixSettings,
        SqliteStore,
    )
    from agent_monitor.testing import FakeJudge

    registry = CollectorRegistry()
    receiver = OtlpReceiver(
        OtlpReceiverSettings(address=f"127.0.0.1:{free_port()}", max_live_traces=args.traces + 10),
        registry=registry,
    )
    config = MonitorConfig(phoenix=PhoenixSettings(url=phoenix_url, retries=1))
    state = tmp / name
    state.mkdir(parents=True)
    sink = Closed()
    ctx = mp.get_context("spawn")
    store = SqliteStore(state / "runs.db")
    judge = FakeJudge(record=False)
    monitor = Monitor(
        config, judge=judge, store=store, registry=registry, sinks=[sink], sources=[receiver]
    )
    async with monitor:
        await receiver.ready.wait()
        here, there = ctx.Pipe()
        proc = ctx.Process(
            target=exporter,
            args=(receiver.url, there, args.traces, args.steps, args.rate),
            daemon=True,
        )
        proc.start()
        await asyncio.sleep(2.0)  # the exporter's imports
        cpu0, scorings0 = cpu_seconds(os.getpid()), monitor.scorings
        here.send("go")
        _, t0, t1 = await answer(here, 600)
        await until(lambda: sink.n >= args.traces, 600)
        cpu = cpu_seconds(os.getpid()) - cpu0
        scorings = monitor.scorings - scorings0
        proc.join(10)
        if monitor.phoenix is not None:
            # What the sink still has queued goes out (or is dropped) before the figures are read.
            await until(
                lambda: monitor.phoenix is not None and monitor.phoenix.statistics().queued == 0,
                120,
            )
            await asyncio.sleep(1.0)
    spans = args.traces * (args.steps + 1)
    out = {
        "spans_per_s": spans / (sink.last - t0),
        "scorings_per_s": scorings / (sink.last - t0),
        "cpu_us_per_span": cpu / spans * 1e6,
        "drain_ms": max(0.0, sink.last - t1) * 1000,
        "export_s": t1 - t0,
    }
    if monitor.phoenix is not None:
        s = monitor.phoenix.statistics()
        n = registry.get_sample_value("agent_monitor_phoenix_request_seconds_count") or 0.0
        total = registry.get_sample_value("agent_monitor_phoenix_request_seconds_sum") or 0.0
        out |= {
            "sent": s.sent,
            "failed": s.failed,
            "dropped": s.dropped,
            "request_ms": total / n * 1000 if n else 0.0,
        }
    return {f"{name}_{k}": v for k, v in out.items()}


def sink_cost(n: int = 20_000) -> float:
    """CPU microseconds the sink spends per annotation in the monitor's process: taking the
    event, encoding it."""
    from prometheus_client import CollectorRegistry

    from agent_monitor.daemon import PhoenixSettings, PhoenixSink, Scored
    from agent_monitor.progress import Progress
    from agent_monitor.scale import CriterionScore

    letters = {chr(65 + i): 1 / 20 for i in range(20)}
    c = CriterionScore("progress", 1.0, 0.5, 0.1, 0.1, 0.1, 0.99, 1, letters)
    settings = PhoenixSettings(url="http://127.0.0.1:9", max_queue=n)
    sink = PhoenixSink(
        settings, registry=CollectorRegistry(), spans=lambda r, s: ("a" * 32, "b" * 16)
    )
    events = []
    for i in range(n):
        p = Progress(
            step=i + 1,
            score=0.5,
            uncertainty=0.1,
            criteria={"progress": c},
            ok=True,
            model="judge-model",
        )
        events.append(Scored(f"run-{i % 100}", p, p.to_json(), arrived=(), at=0.0))
    t0 = time.process_time()
    for e in events:
        sink(e)
    batch = settings.max_batch
    items = [item.data for item in sink._queue]
    for k in range(0, n, batch):
        json.dumps({"data": items[k : k + batch]}, separators=(",", ":"), allow_nan=False).encode()
    return (time.process_time() - t0) / n * 1e6


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    pin(0)
    out: dict[str, Any] = {
        "traces": args.traces,
        "steps": args.steps,
        "rate": args.rate,
        "repeats": args.repeats,
    }
    rounds: list[dict[str, float]] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-phoenix-") as tmp,
        phoenix_server(Path(tmp)) as url,
    ):
        out["load_before"] = load1()
        # Interleaved (off, on, down, off, ...): a load change from the other processes on the
        # machine spreads over every configuration instead of landing on one.
        for r in range(args.repeats):
            figures: dict[str, float] = {}
            for name, target in (
                ("off", None),
                ("on", url),
                ("down", f"http://127.0.0.1:{free_port()}"),
            ):
                figures |= await one(name, target, Path(tmp) / str(r), args)
            rounds.append(figures)
        out["load_after"] = load1()
    for key in rounds[0]:
        out[key] = statistics.median(f[key] for f in rounds)
    out["sink_us_per_annotation"] = sink_cost()
    return out


def main() -> int:
    cleanup_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--traces", type=int, default=400)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--rate",
        type=float,
        default=1000.0,
        help="spans/s the agent exports (0: as fast as it can)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of the three configurations; medians are shown",
    )
    args = p.parse_args()
    with open(os.devnull, "w") as devnull:
        configure_logs("warning", devnull)
        out = asyncio.run(bench(args))
    print(
        f"Phoenix sink, {args.traces} traces x ({args.steps} tool spans + root) at "
        f"{args.rate:g} spans/s "
        "(SDK batch exporter) -> monitor on one core, instant judge"
    )
    for name in ("off", "on", "down"):
        line = (
            f"  {name:>4}: {out[f'{name}_spans_per_s']:.0f} spans/s, "
            f"{out[f'{name}_scorings_per_s']:.0f} scorings/s, "
            f"{out[f'{name}_cpu_us_per_span']:.0f} us CPU per span, last span -> last run closed "
            f"{out[f'{name}_drain_ms']:.0f} ms (the agent exported in "
            f"{out[f'{name}_export_s']:.1f} s)"
        )
        if f"{name}_sent" in out:
            line += (
                f"; annotations sent {out[f'{name}_sent']}, failed {out[f'{name}_failed']}, "
                "dropped "
                f"{out[f'{name}_dropped']}, mean request {out[f'{name}_request_ms']:.1f} ms"
            )
        print(line)
    print(
        f"  the sink's own CPU in the monitor per annotation (take the score, encode its JSON): "
        f"{out['sink_us_per_annotation']:.1f} us"
    )
    print(f"  load average before {out['load_before']}, after {out['load_after']}")
    print(kv_line(**out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
