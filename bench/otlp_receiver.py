"""The OTLP traces receiver: spans/s accepted on one core from the SDK's exporter, and last span ->
final score.

The monitor (`Monitor` in this process, pinned to one core, a SQLite journal in a temporary
directory, a private stock Mosquitto for its outputs, an instant judge) receives `--traces` traces
of `--steps` `execute_tool` spans and an `invoke_agent` root each, from a second process (pinned to
the other core when there is one) running the real OpenTelemetry SDK: a `BatchSpanProcessor` with
the OTLP/HTTP protobuf exporter, as an instrumented agent exports.

Figures:
- `otlp_spans_per_s`: spans / (the first span exported -> every span accepted and every run closed);
  `otlp_cpu_us_per_span`: the monitor process's CPU per span (its one core);
- the baseline, what a user without the receiver runs: a harness publishing the same runs as MQTT
  events (start, one step per tool call, end; paho, QoS 1) to the same kind of monitor:
  `mqtt_events_per_s`, `mqtt_cpu_us_per_event`. One span is one event (the root is the start and the
  end together, so the MQTT side has one event more per run);
- `final_p50_ms`/`final_p95_ms`: `--latency-traces` traces sent one after the other with the SDK's
  `SimpleSpanProcessor` from a thread of this process, the time from the root span's `end()` (the
  trace's last span) to the run's close (its final score written), with the instant judge: the
  receiver's and the pipeline's own latency, no judge time.

    .venv/bin/python bench/otlp_receiver.py [--traces 200] [--steps 10] [--latency-traces 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import (
    batch_provider,
    cleanup_on_sigterm,
    configure_logs,
    cpu_seconds,
    free_port,
    kv_line,
    load1,
    mosquitto,
    percentile,
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


def exporter(url: str, conn: Connection, traces: int, steps: int) -> None:
    """On command, export every trace through the SDK's batch processor; report when it started
    and finished."""
    pin(1)
    from opentelemetry import trace

    provider = batch_provider(url, traces * (steps + 1))
    tracer = provider.get_tracer("bench-agent")
    user = json.dumps([{"role": "user", "parts": [{"type": "text", "content": TASK}]}])
    conn.recv()
    t0 = time.time()
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
    provider.force_flush(120_000)
    conn.send(("ok", t0, time.time()))
    provider.shutdown()


def publisher(port: int, conn: Connection, traces: int, steps: int) -> None:
    """The baseline's harness: on command, publish every run's start, steps and end over MQTT
    (QoS 1)."""
    pin(1)
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id="bench-harness",
        protocol=MQTTProtocolVersion.MQTTv311,
    )
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    try:
        conn.recv()
        t0 = time.time()
        infos = []
        for t in range(traces):
            run = f"mqtt-{t}"
            infos.append(
                c.publish(f"agents/{run}/start", json.dumps({"task": TASK}).encode(), qos=1)
            )
            for s in range(steps):
                text = (
                    f'Tool call: run_tests({{"path": "tests/test_{t}_{s}.py"}})\nResult: {s} '
                    f"passed, {steps - s} failed"
                )
                infos.append(
                    c.publish(
                        f"agents/{run}/step",
                        json.dumps({"index": s + 1, "text": text}).encode(),
                        qos=1,
                    )
                )
            infos.append(c.publish(f"agents/{run}/end", b'{"outcome": "success"}', qos=1))
        for info in infos:
            info.wait_for_publish(300)
        conn.send(("ok", t0, time.time()))
        conn.recv()
    finally:
        c.disconnect()
        c.loop_stop()


class Closed:
    """A sink counting closed runs, with the time of the last close and each run's close time."""

    def __init__(self) -> None:
        from agent_monitor.daemon import RunClosed

        self.events = (RunClosed,)
        self.n = 0
        self.last = 0.0
        self.at: dict[str, float] = {}

    def __call__(self, event: Any) -> None:
        self.n += 1
        self.last = self.at[event.run_id] = time.time()


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


def monitor(broker_url: str, state: Path, sink: Closed, receiver: Any | None) -> Any:
    from prometheus_client import CollectorRegistry

    from agent_monitor.daemon import Monitor, MonitorConfig, SqliteStore
    from agent_monitor.testing import FakeJudge
    from agent_monitor.wire import BrokerSettings

    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker_url), client_id=f"bench-{state.name}"
    )
    registry = receiver.registry if receiver is not None else CollectorRegistry()
    return Monitor(
        config,
        judge=FakeJudge(record=False),
        store=SqliteStore(state / "runs.db"),
        registry=registry,
        sinks=[sink],
        sources=[receiver.source] if receiver is not None else [],
    )


class _Receiver:
    def __init__(self, **settings: Any) -> None:
        from prometheus_client import CollectorRegistry

        from agent_monitor.daemon import OtlpReceiver, OtlpReceiverSettings

        self.registry = CollectorRegistry()
        self.source = OtlpReceiver(
            OtlpReceiverSettings(address=f"127.0.0.1:{free_port()}", **settings),
            registry=self.registry,
        )


async def otlp_throughput(broker_url: str, tmp: Path, traces: int, steps: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    rec = _Receiver(max_live_traces=traces + 10)
    sink = Closed()
    state = tmp / "otlp"
    state.mkdir()
    async with monitor(broker_url, state, sink, rec):
        await rec.source.ready.wait()
        here, there = ctx.Pipe()
        proc = ctx.Process(
            target=exporter, args=(rec.source.url, there, traces, steps), daemon=True
        )
        proc.start()
        await asyncio.sleep(2.0)  # the exporter's imports
        cpu0 = cpu_seconds(os.getpid())
        here.send("go")
        _, t0, _ = await answer(here, 600)
        await until(lambda: sink.n >= traces, 600)
        cpu = cpu_seconds(os.getpid()) - cpu0
        proc.join(10)
        stats = rec.source.statistics()
        assert stats.steps == traces * steps, stats
    spans = traces * (steps + 1)
    return {"otlp_spans_per_s": spans / (sink.last - t0), "otlp_cpu_us_per_span": cpu / spans * 1e6}


async def mqtt_baseline(
    broker_port: int, broker_url: str, tmp: Path, traces: int, steps: int
) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    sink = Closed()
    state = tmp / "mqtt"
    state.mkdir()
    async with monitor(broker_url, state, sink, None):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=publisher, args=(broker_port, there, traces, steps), daemon=True)
        proc.start()
        await asyncio.sleep(2.0)
        cpu0 = cpu_seconds(os.getpid())
        here.send("go")
        _, t0, _ = await answer(here, 600)
        await until(lambda: sink.n >= traces, 600)
        cpu = cpu_seconds(os.getpid()) - cpu0
        here.send("bye")
        proc.join(10)
    events = traces * (steps + 2)
    return {
        "mqtt_events_per_s": events / (sink.last - t0),
        "mqtt_cpu_us_per_event": cpu / events * 1e6,
    }


async def latency(broker_url: str, tmp: Path, traces: int, steps: int) -> dict[str, float]:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    rec = _Receiver()
    sink = Closed()
    state = tmp / "latency"
    state.mkdir()
    ends: dict[str, float] = {}
    async with monitor(broker_url, state, sink, rec):
        await rec.source.ready.wait()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=rec.source.url)))
        tracer = provider.get_tracer("bench-agent")
        user = json.dumps([{"role": "user", "parts": [{"type": "text", "content": TASK}]}])

        def one() -> str:
            root = tracer.start_span(
                "invoke_agent bench",
                attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.input.messages": user},
            )
            ctx = trace.set_span_in_context(root)
            for s in range(steps):
                attrs = {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "t",
                    "gen_ai.tool.call.result": str(s),
                }
                tracer.start_span("execute_tool t", context=ctx, attributes=attrs).end()
            run_id = f"{root.get_span_context().trace_id:032x}"
            ends[run_id] = time.time()
            root.end()  # exported (and answered) before end() returns: the simple processor
            return run_id

        for _ in range(traces):
            run_id = await asyncio.to_thread(one)
            await until(lambda run_id=run_id: run_id in sink.at, 60)
        await asyncio.to_thread(provider.shutdown)
    ms = [(sink.at[r] - ends[r]) * 1000 for r in ends]
    return {"final_p50_ms": percentile(ms, 50), "final_p95_ms": percentile(ms, 95)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    pin(0)
    out: dict[str, Any] = {"traces": args.traces, "steps": args.steps, "load_before": load1()}
    with mosquitto() as broker, tempfile.TemporaryDirectory(prefix="bench-otlp-") as tmp:
        out |= await otlp_throughput(broker.url, Path(tmp), args.traces, args.steps)
        out |= await mqtt_baseline(broker.port, broker.url, Path(tmp), args.traces, args.steps)
        out |= await latency(broker.url, Path(tmp), args.latency_traces, args.steps)
    out["load_after"] = load1()
    return out


def main() -> int:
    cleanup_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--traces", type=int, default=200)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--latency-traces", type=int, default=50)
    args = p.parse_args()
    with open(os.devnull, "w") as devnull:
        configure_logs("warning", devnull)
        out = asyncio.run(bench(args))
    print(
        f"OTLP receiver, {args.traces} traces x ({args.steps} tool spans + root), SDK batch "
        "exporter -> monitor on one core"
    )
    print(
        f"  otlp: {out['otlp_spans_per_s']:.0f} spans/s accepted, "
        f"{out['otlp_cpu_us_per_span']:.0f} us CPU per span"
    )
    print(
        f"  mqtt baseline: {out['mqtt_events_per_s']:.0f} events/s, "
        f"{out['mqtt_cpu_us_per_event']:.0f} us CPU per event"
    )
    print(
        f"  last span -> final score (instant judge): p50 {out['final_p50_ms']:.1f} ms, p95 "
        f"{out['final_p95_ms']:.1f} ms"
    )
    print(f"  load average before {out['load_before']}, after {out['load_after']}")
    print(kv_line(**out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
