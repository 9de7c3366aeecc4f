"""OpenTelemetry gen_ai.evaluation.result events: a real OTLP/HTTP receiver, an unreachable
collector, span linkage."""

from __future__ import annotations

import asyncio
import gzip
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from agent_monitor import AsyncProgressTracker, Policy, ProgressTracker, atrack, track
from agent_monitor.daemon import Monitor, MonitorConfig, Scored
from agent_monitor.daemon.sinks._otel import OtelSink, logs_url
from agent_monitor.otel import EVENT_NAME, OVERALL, evaluation_attributes
from agent_monitor.progress import Decision, Progress
from agent_monitor.scale import CriterionScore, rule_score
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings
from tests.brokers import Mosquitto, free_port
from tests.daemon.test_daemon_mqtt import harness

pytestmark = pytest.mark.timeout(120)

TWO = {"progress": "How far the task is done.", "tests": "How many of the tests pass."}


# -- a real OTLP/HTTP receiver --


class Receiver:
    """An OTLP/HTTP collector's logs endpoint on a free port: decodes each POST with
    opentelemetry-proto."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, ExportLogsServiceRequest]] = []
        self.content_types: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportLogsServiceRequest()
                request.ParseFromString(body)
                with receiver._lock:
                    receiver.requests.append((self.path, request))
                    receiver.content_types.append(self.headers.get("Content-Type", ""))
                reply = ExportLogsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def records(self) -> list[dict[str, Any]]:
        """Every log record received so far, flattened: event name, attributes, trace ids,
        resource."""
        out = []
        with self._lock:
            requests = list(self.requests)
        for path, req in requests:
            for rl in req.resource_logs:
                resource = {kv.key: _value(kv.value) for kv in rl.resource.attributes}
                for sl in rl.scope_logs:
                    for r in sl.log_records:
                        out.append(
                            {
                                "path": path,
                                "event_name": r.event_name,
                                "attributes": {kv.key: _value(kv.value) for kv in r.attributes},
                                "trace_id": r.trace_id,
                                "span_id": r.span_id,
                                "resource": resource,
                                "scope": sl.scope.name,
                            }
                        )
        return out


def _value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value"))


@contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r.server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()
        thread.join(5)


async def until(check: Callable[[], bool], wait_s: float = 30.0) -> None:
    async with asyncio.timeout(wait_s):
        while not check():  # noqa: ASYNC110 - set by the receiver's and the exporter's threads
            await asyncio.sleep(0.02)


def by_step(records: list[dict[str, Any]], run_id: str) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        a = r["attributes"]
        if a["agent_monitor.run_id"] == run_id:
            out.setdefault(a["agent_monitor.step"], []).append(a)
    return out


# -- the daemon, end to end: MQTT in, progress out, the same verdicts to the collector --


def two_criteria(prompt: Any) -> Any:
    """Per step and criterion: step 1 scored, step 2 not a score (letters hold too little mass),
    step 3 scored."""
    if prompt.step == 2:
        return {"The": 0.9, "K": 0.1}
    return {"progress": {"E": 0.6, "F": 0.3, "G": 0.1}, "tests": "M"}[prompt.criterion]


async def test_every_scored_step_reaches_the_collector_as_evaluation_events(
    broker: Mosquitto,
) -> None:
    reg = CollectorRegistry()
    with receiver() as collector:
        config = MonitorConfig(
            broker=BrokerSettings.from_url(broker.url),
            client_id=f"mon-{broker.port}",
            otlp_endpoint=collector.url,
            policy=Policy(resample_below=0.5, min_steps=1, patience=1),
        )
        async with (
            Monitor(config, judge=FakeJudge(two_criteria), registry=reg),
            harness(broker.port) as h,
        ):
            await h.publish("run-1", "start", {"task": "make the tests pass", "criteria": TWO})
            for i in (1, 2, 3):
                await h.publish("run-1", "step", {"index": i, "text": f"step {i}"})
                await h.until(lambda i=i: h.last_step("run-1") == i)
            published = {p["step"]: p for p in h.progress("run-1")}
            # Sent by the batch processor's thread within its schedule delay (1 s), not waited for
            # by scoring.
            await until(lambda: len(collector.records()) == 6)
        records = collector.records()

    assert {r["path"] for r in records} == {"/v1/logs"}
    assert set(collector.content_types) == {"application/x-protobuf"}
    assert {r["event_name"] for r in records} == {EVENT_NAME}
    assert {r["resource"]["service.name"] for r in records} == {"agent-monitor"}
    assert {r["scope"] for r in records} == {"agent_monitor"}
    # Steps come over MQTT: no span of the monitor's process is theirs.
    assert {(r["trace_id"], r["span_id"]) for r in records} == {(b"", b"")}

    steps = by_step(records, "run-1")
    assert sorted(steps) == [1, 2, 3]
    for step in (1, 3):
        p = published[step]
        assert p["ok"] is True
        events = {a["gen_ai.evaluation.name"]: a for a in steps[step]}
        assert set(events) == {"progress", "tests"}
        for name, a in events.items():
            c = p["criteria"][name]
            assert a["gen_ai.evaluation.score.value"] == c["score"]
            assert a["agent_monitor.uncertainty"] == c["uncertainty"]
            assert a["agent_monitor.mass"] == c["mass"]
            assert a["agent_monitor.weight"] == c["weight"]
            assert a["gen_ai.evaluation.score.label"] == max(c["letters"], key=c["letters"].get)
            assert a["agent_monitor.score"] == p["score"]
            assert a["agent_monitor.signal"] == p["signal"] == "resample"
            assert (
                a["agent_monitor.judge.model"] == p["model"]
                and a["agent_monitor.rubric"] == p["rubric"]
            )
            assert "error.type" not in a
        assert events["progress"]["gen_ai.evaluation.score.label"] == "E"
        assert events["progress"]["gen_ai.evaluation.explanation"].startswith(
            "E 60%, F 30%, G 10% (letter mass 1.00)"
        )
        assert "; resample: " in events["progress"]["gen_ai.evaluation.explanation"]
        assert events["tests"]["gen_ai.evaluation.score.label"] == "M"

    # A failed score: one event per criterion of the run's rubric, the reason as error.type, no
    # score.
    p = published[2]
    assert p["ok"] is False and p["reason"] == "low_mass"
    assert sorted(a["gen_ai.evaluation.name"] for a in steps[2]) == ["progress", "tests"]
    for a in steps[2]:
        assert a["error.type"] == "low_mass"
        assert a["gen_ai.evaluation.explanation"] == p["error"][:300]
        assert "gen_ai.evaluation.score.value" not in a and "agent_monitor.score" not in a
        assert a["agent_monitor.signal"] == p["signal"]

    assert reg.get_sample_value("agent_monitor_otlp_exported_events_total") == 6
    assert reg.get_sample_value("agent_monitor_otlp_export_failures_total") == 0
    for reason in ("queue_full", "export_failed", "shutdown"):
        assert (
            reg.get_sample_value("agent_monitor_otlp_dropped_events_total", {"reason": reason}) == 0
        )


async def test_an_unreachable_collector_is_counted_and_logged_once_and_scoring_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The exporter's own variable: give up on a request after 1 s of retries instead of 10.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    reg = CollectorRegistry()
    closed = f"http://127.0.0.1:{free_port()}"
    config = MonitorConfig(otlp_endpoint=closed)
    with capture_logs() as logs:
        async with Monitor(config, judge=FakeJudge(), registry=reg) as mon:
            await mon.handle("agents/r/start", json.dumps({"task": "count"}).encode())
            for i in (1, 2):
                await mon.handle("agents/r/step", json.dumps({"index": i, "text": f"{i}"}).encode())
                await mon.drain()
                await until(
                    lambda i=i: (
                        reg.get_sample_value("agent_monitor_otlp_export_failures_total") == i
                    )
                )
            view = mon.run("r")
            assert view is not None and [p.step for p in view.curve if p.ok] == [1, 2]
        failing = [e for e in logs if e["event"] == "otlp_export_failing"]
    assert len(failing) == 1 and failing[0]["endpoint"] == f"{closed}/v1/logs"
    assert (
        reg.get_sample_value("agent_monitor_otlp_dropped_events_total", {"reason": "export_failed"})
        == 2
    )
    assert reg.get_sample_value("agent_monitor_otlp_exported_events_total") == 0


def scored(run_id: str, p: Progress) -> Scored:
    return Scored(run_id, p, p.to_json(), (), 0.0)


def test_a_full_export_queue_drops_whole_results_and_counts_them() -> None:
    reg = CollectorRegistry()
    with receiver() as collector:
        # The worker exports when the queue holds a batch (3) or after the delay (long): nothing
        # leaves early.
        sink = OtelSink(collector.url, registry=reg, max_queue=3, max_batch=3, schedule_delay_s=600)
        sink.open()
        two = {
            n: CriterionScore(n, 0.5, 0.5, 0.1, 0.0, 0.1, 0.9, 1, {"K": 1.0}) for n in ("a", "b")
        }
        p = Progress(step=1, score=0.5, uncertainty=0.1, criteria=two, ok=True, run_id="r")
        sink(scored("r", p))  # 2 events queued
        sink(scored("r", p))  # 2 more do not fit in 3: dropped together
        assert reg.get_sample_value("agent_monitor_otlp_queue_depth") == 2
        assert (
            reg.get_sample_value(
                "agent_monitor_otlp_dropped_events_total", {"reason": "queue_full"}
            )
            == 2
        )
        sink.close()
        assert len(collector.records()) == 2  # flushed on close
    assert reg.get_sample_value("agent_monitor_otlp_exported_events_total") == 2
    assert reg.get_sample_value("agent_monitor_otlp_queue_depth") == 0


def test_logs_url_appends_the_signal_path_as_the_sdk_does() -> None:
    assert logs_url("http://c:4318") == "http://c:4318/v1/logs"
    assert logs_url("http://c:4318/") == "http://c:4318/v1/logs"
    assert logs_url("https://c/otlp") == "https://c/otlp/v1/logs"
    assert logs_url("http://c:4318/v1/logs") == "http://c:4318/v1/logs"


def test_the_endpoint_is_a_serve_flag_with_its_environment_twin() -> None:
    from agent_monitor.cli._flags import build
    from tests.cli.test_flags import parse

    assert build(MonitorConfig, parse([])).otlp_endpoint is None
    assert (
        build(MonitorConfig, parse(["--otlp-endpoint", "http://c:4318"])).otlp_endpoint
        == "http://c:4318"
    )
    env = {"AGENT_MONITOR_OTLP_ENDPOINT": "https://otel.example:4318"}
    assert build(MonitorConfig, parse([], env)).otlp_endpoint == "https://otel.example:4318"
    with pytest.raises(
        ValueError,
        match=r"otlp_endpoint='c:4318' is not an OTLP/HTTP " r"collector URL; use http://",
    ):
        MonitorConfig(otlp_endpoint="c:4318")


# -- the hook: events on the span of the step they judged --


class Spans:
    """A real TracerProvider (not the global one) and an SDK LoggerProvider writing to memory."""

    def __init__(self) -> None:
        self.tracer = TracerProvider().get_tracer("harness")
        self.exporter = InMemoryLogRecordExporter()
        self.logs = LoggerProvider()
        self.logs.add_log_record_processor(SimpleLogRecordProcessor(self.exporter))

    def events(self) -> list[ReadableLogRecord]:
        return list(self.exporter.get_finished_logs())


def ids(span: Any) -> tuple[int, int]:
    c = span.get_span_context()
    return c.trace_id, c.span_id


def linked(records: list[ReadableLogRecord]) -> dict[int, set[tuple[int, int]]]:
    """Step -> the (trace_id, span_id) pairs its events carry."""
    out: dict[int, set[tuple[int, int]]] = {}
    for r in records:
        lr = r.log_record
        assert lr.event_name == EVENT_NAME
        assert lr.attributes is not None
        step = lr.attributes["agent_monitor.step"]
        assert isinstance(step, int)
        out.setdefault(step, set()).add((lr.trace_id or 0, lr.span_id or 0))
    return out


def test_update_attaches_each_results_events_to_the_span_it_was_called_in() -> None:
    o = Spans()
    with ProgressTracker("t", judge=FakeJudge(), criteria=TWO, run_id="r", otel=o.logs) as tracker:
        spans = []
        for i in (1, 2):
            with o.tracer.start_as_current_span(f"step {i}") as span:
                tracker.update(f"step {i}")
                spans.append(ids(span))
        tracker.update("step 3, outside any span")
    got = linked(o.events())
    assert got == {1: {spans[0]}, 2: {spans[1]}, 3: {(0, 0)}}
    names = [r.log_record.attributes["gen_ai.evaluation.name"] for r in o.events()]  # type: ignore[index]
    assert names == ["progress", "tests"] * 3


def test_submit_attaches_events_to_the_submitting_span_not_the_one_current_when_scored() -> None:
    o = Spans()
    judge = FakeJudge(latency_s=0.05)
    with ProgressTracker("t", judge=judge, run_id="r", otel=o.logs) as tracker:
        spans = {}
        for i in range(1, 6):
            with o.tracer.start_as_current_span(f"step {i}") as span:
                tracker.submit(f"step {i}")
                spans[i] = ids(span)
        with o.tracer.start_as_current_span("waiting") as waiting:
            tracker.drain()
        curve = tracker.curve
    got = linked(o.events())
    assert sorted(got) == [p.step for p in curve] and curve[-1].step == 5
    # Coalesced steps give one score: its events are on the span of the newest step it covers.
    assert got == {s: {spans[s]} for s in got}
    assert ids(waiting) not in set().union(*got.values())


async def test_the_async_tracker_and_atrack_link_the_same_way() -> None:
    o = Spans()
    async with AsyncProgressTracker("t", judge=FakeJudge(latency_s=0.02), otel=o.logs) as tracker:
        spans = {}
        for i in (1, 2, 3):
            with o.tracer.start_as_current_span(f"step {i}") as span:
                tracker.submit(f"step {i}")
                spans[i] = ids(span)
        await tracker.drain()
        with o.tracer.start_as_current_span("update") as span:
            await tracker.update("step 4")
            spans[4] = ids(span)
    got = linked(o.events())
    assert got == {s: {spans[s]} for s in got} and 4 in got

    o = Spans()
    with o.tracer.start_as_current_span("replay") as span:
        await atrack("t", ["a", "b"], judge=FakeJudge(), otel=o.logs)
    assert linked(o.events()) == {1: {ids(span)}, 2: {ids(span)}}


def test_track_emits_through_the_provider_it_is_given_and_a_broken_one_never_stops_scoring() -> (
    None
):
    o = Spans()
    with o.tracer.start_as_current_span("replay") as span:
        # scored on the judge's loop thread
        curve = track("t", ["a", "b"], judge=FakeJudge(), otel=o.logs)
    assert [p.step for p in curve] == [1, 2] and linked(o.events()) == {
        1: {ids(span)},
        2: {ids(span)},
    }

    class Broken(LoggerProvider):
        def get_logger(self, *args: Any, **kwargs: Any) -> Any:
            class Logger:
                def emit(self, *args: Any, **kwargs: Any) -> None:
                    raise RuntimeError("the processor is broken")

            return Logger()

    with pytest.raises(
        TypeError,
        match=r"^otel='yes'; use True \(the global LoggerProvider\) " r"or a LoggerProvider$",
    ):
        ProgressTracker("t", judge=FakeJudge(), otel="yes")  # type: ignore[arg-type]
    with capture_logs() as logs:
        curve = track("t", ["a", "b"], judge=FakeJudge(), otel=Broken())
    assert [p.ok for p in curve] == [True, True]
    assert [e["event"] for e in logs if e["event"] == "otel_emit_failed"] == [
        "otel_emit_failed"
    ] * 2


# -- the attributes, built in one place --


def test_attributes_of_a_rule_a_judge_criterion_and_a_signal() -> None:
    judge = CriterionScore(
        "judge", 0.5, 0.6, 0.1, 0.0, 0.1, 0.8, 2, {"K": 0.45, "L": 0.45, "A": 0.1}
    )
    rule = rule_score("tests", 0.5, 1.0, 0.9, "7 of 7 tests pass")
    decision = Decision("abort", "score 0.10 < abort_below 0.15 for 3 steps", 4, 0.1, 1, 0.4, True)
    p = Progress(
        step=4,
        score=0.8,
        uncertainty=0.1,
        criteria={"judge": judge, "tests": rule},
        ok=True,
        signal=decision,
    )
    a, b = evaluation_attributes(p)
    # A tie goes to the lower letter: the label never claims more than the judge gave.
    assert a["gen_ai.evaluation.score.label"] == "K"
    assert a["gen_ai.evaluation.explanation"] == (
        "K 45%, L 45%, A 10% (letter mass 0.80, 2 repeats); abort: score 0.10 < abort_below "
        "0.15 for 3 steps"
    )
    assert "agent_monitor.run_id" not in a and a["agent_monitor.signal"] == "abort"
    assert b["gen_ai.evaluation.name"] == "tests" and "gen_ai.evaluation.score.label" not in b
    assert b["gen_ai.evaluation.explanation"].startswith(
        "rule (confidence 0.90): 7 of 7 tests pass; abort:"
    )
    assert b["agent_monitor.source"] == "rule" and b["gen_ai.evaluation.score.value"] == 1.0
    # A failure with no rubric known is one event under the overall name.
    failed = Progress(
        step=1,
        score=None,
        uncertainty=None,
        criteria={},
        ok=False,
        reason="timeout",
        error="x" * 400,
    )
    [f] = evaluation_attributes(failed)
    assert f["gen_ai.evaluation.name"] == OVERALL and f["error.type"] == "timeout"
    assert len(str(f["gen_ai.evaluation.explanation"])) == 300


def test_importing_agent_monitor_loads_no_opentelemetry_and_a_missing_extra_is_named() -> None:
    code = (
        "import sys\n"
        "import agent_monitor, agent_monitor.otel, agent_monitor.tracker, agent_monitor.daemon\n"
        "from agent_monitor.daemon import Monitor, MonitorConfig\n"
        "from agent_monitor.testing import FakeJudge\n"
        "Monitor(MonitorConfig(), judge=FakeJudge())\n"
        "agent_monitor.ProgressTracker('t', judge=FakeJudge()).close()\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], "
        "'opentelemetry imported'\n"
        # As if the extra were not installed:
        "sys.modules['opentelemetry'] = None\n"
        "for make in (lambda: agent_monitor.ProgressTracker('t', judge=FakeJudge(), otel=True),\n"
        "             lambda: Monitor(MonitorConfig(otlp_endpoint='http://c:4318'), "
        "judge=FakeJudge())):\n"
        "    try:\n"
        "        make()\n"
        "    except ImportError as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    lines = out.splitlines()
    assert len(lines) == 2, out
    assert all(
        "pip install -e '.[otel]' (in the agent-monitor checkout)" in line for line in lines
    ), out
    assert lines[1].startswith("--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporter")


def test_otel_true_uses_the_global_provider_even_one_set_after_the_tracker_was_made() -> None:
    # In a process of its own: the global LoggerProvider can be set once per process.
    code = (
        "from opentelemetry._logs import set_logger_provider\n"
        "from opentelemetry.sdk._logs import LoggerProvider\n"
        "from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, "
        "SimpleLogRecordProcessor\n"
        "from agent_monitor import ProgressTracker\n"
        "from agent_monitor.testing import FakeJudge\n"
        "tracker = ProgressTracker('t', judge=FakeJudge(), run_id='r', otel=True)\n"
        "memory = InMemoryLogRecordExporter()\n"
        "provider = LoggerProvider()\n"
        "provider.add_log_record_processor(SimpleLogRecordProcessor(memory))\n"
        "set_logger_provider(provider)\n"
        "tracker.update('one')\n"
        "tracker.close()\n"
        "for r in memory.get_finished_logs():\n"
        "    a = r.log_record.attributes\n"
        "    print(r.log_record.event_name, a['gen_ai.evaluation.name'], "
        "a['agent_monitor.run_id'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines() == [f"{EVENT_NAME} task_progress r"]


def test_serve_otlp_endpoint_as_a_user_runs_it(broker: Mosquitto) -> None:
    from tests.cli.test_serve_cli import pub, serve, wait_serving
    from tests.openai_server import chat_choice, chat_reply, scripted_server

    with scripted_server() as judge, receiver() as collector:
        judge.default = chat_reply(chat_choice([("K", {"K": 0.8, "L": 0.2})]))
        args = [
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--metrics-port",
            "0",
        ]
        with serve(*args, env={"AGENT_MONITOR_OTLP_ENDPOINT": collector.url}) as proc:
            wait_serving(proc)
            pub(broker.port, "agents/cli-1/start", '{"task": "Make the failing test pass"}')
            pub(broker.port, "agents/cli-1/step", '{"index": 1, "text": "pytest: 3 failed"}')
            deadline = time.monotonic() + 30
            while not collector.records() and time.monotonic() < deadline:
                time.sleep(0.05)
        [r] = collector.records()
    a = r["attributes"]
    assert r["event_name"] == EVENT_NAME and r["path"] == "/v1/logs"
    assert (
        a["gen_ai.evaluation.name"] == "task_progress" and a["gen_ai.evaluation.score.label"] == "K"
    )
    assert a["gen_ai.evaluation.score.value"] == pytest.approx((0.8 * 10 + 0.2 * 11) / 19)
    assert (a["agent_monitor.run_id"], a["agent_monitor.step"]) == ("cli-1", 1)
