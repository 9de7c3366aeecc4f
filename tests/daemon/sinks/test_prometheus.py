"""Every dashboard query and alert rule, run by a real Prometheus against live Monitors.

Two in-process Monitors serve /metrics on free ports; a private Prometheus (free port, own TSDB in
tmp_path, scrape and rule evaluation every second, dashboards/alerts.yml loaded) scrapes them and a
third target where nothing listens. The scenario gives every query real data:

- daemon A: labelled runs that progress, one that resamples, one whose judge fails once, a burst
  that coalesces, bad input, and 14 runs told to abort (an abort storm); its judge reports cached
  tokens;
- daemon B: a judge that always fails, a 3-message outbox that overflows, a series cap of 0;
- neither has a broker (both are "disconnected"); the third target is down.

Activity comes in two waves with a scrape in between, so series born in the first wave have a
rate in the second. Then every panel query (Grafana variables substituted) and every alert
expression must succeed and return data, each alert for exactly the daemons it is about, every
rule must load healthy and go pending or firing, and an ended run's series must leave Prometheus
after the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from agent_monitor import JudgeError
from agent_monitor.daemon import (
    Board,
    HttpServer,
    MetricsSettings,
    Monitor,
    MonitorConfig,
    OtlpReceiver,
    OtlpReceiverSettings,
)
from agent_monitor.judges.base import JudgeRequest, JudgeResponse, Usage
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto, free_port, wait_port
from tests.daemon.sinks.test_dashboards import (
    ALERTS,
    alert_queries,
    dashboard_queries,
    letters,
    load_dashboard,
    variable_queries,
)
from tests.daemon.sources.otlp.test_otlp_receiver import apost, body, root, tool
from tests.redis_server import RedisServer

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus is not installed (Debian: `apt-get install prometheus`)",
    ),
]

GRACE_S = 1.0
DOOMED = 14  # aborted runs on daemon A: > 10 in 5 minutes is the AbortStorm threshold (2 a minute)
# daemon A's runs that end with a success: at its alpha 0.2 they calibrate their family
CALIBRATING = 4


class CachingJudge(FakeJudge):
    """A scripted judge whose provider says half of each prompt came from its prefix cache."""

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        r = await super()._call(request)
        u = r.usage
        return dataclasses.replace(
            r, usage=Usage(u.input_tokens, u.input_tokens // 2, u.output_tokens)
        )


class Prometheus:
    """A private Prometheus server and its HTTP API."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "global": {
                        "scrape_interval": "1s",
                        "evaluation_interval": "1s",
                        "scrape_timeout": "1s",
                    },
                    "rule_files": [str(ALERTS)],
                    # The job name alerts.yml's AgentMonitorDown expects (as in
                    # dashboards/prometheus.yml).
                    "scrape_configs": [
                        {"job_name": "agent-monitor", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        self.data = workdir / "tsdb"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert PROMETHEUS is not None
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.data}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_port(self.port, timeout=30)
            self._wait_ready(60)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"prometheus did not start: {self.logs()}") from None

    def _wait_ready(self, timeout: float) -> None:
        """Wait for /-/ready: the port opens before the TSDB is up, and queries answer 503 until
        it is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:  # URLError and HTTPError (503 while starting) included
                pass
            time.sleep(0.1)
        raise TimeoutError("prometheus was not ready in time")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def _get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:  # a bad query is a 400 with the error in the body
            body = json.loads(e.read())
        return body

    async def get(self, path: str, **params: str) -> Any:
        return await asyncio.to_thread(self._get, path, **params)

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; fails the test on any error."""
        body = await self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", (
            f"{expr!r}: {body.get('errorType')}: {body.get('error')}"
        )
        assert body["data"]["resultType"] == "vector", (expr, body["data"]["resultType"])
        return list(body["data"]["result"])

    async def value(self, expr: str) -> float | None:
        """The single value of an instant query, None when it has no result."""
        result = await self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None


@contextmanager
def prometheus(workdir: Path, targets: list[str]) -> Iterator[Prometheus]:
    p = Prometheus(workdir, targets)
    p.start()
    try:
        yield p
    finally:
        p.stop()


@asynccontextmanager
async def served(monitor: Monitor) -> AsyncIterator[str]:
    """Run the monitor and serve its registry on a free port, as `serve` does; yields the scrape
    target."""
    async with HttpServer(monitor.registry, port=0) as web, monitor:
        yield f"127.0.0.1:{web.port}"


async def until(what: str, check: Callable[[], Awaitable[bool]], wait_s: float = 30.0) -> None:
    """Poll `check` until it holds (Prometheus scrapes and evaluates every second)."""
    deadline = time.monotonic() + wait_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {wait_s:g}s waiting for {what}")
        await asyncio.sleep(0.2)


def registry_sum(monitor: Monitor, name: str) -> float:
    """The sum of every sample of one series name in the monitor's registry."""
    return sum(
        s.value for family in monitor.registry.collect() for s in family.samples if s.name == name
    )


CAUGHT_UP = (
    "agent_monitor_events_total",
    "agent_monitor_scorings_total",
    "agent_monitor_signals_total",
    "agent_monitor_judge_calls_total",
    "agent_monitor_runs_total",
    "agent_monitor_invalid_events_total",
    "agent_monitor_outbox_dropped_total",
)


async def caught_up(prom: Prometheus, monitors: dict[str, Monitor]) -> None:
    """Wait until Prometheus holds a scrape of each (drained) monitor's current counts."""

    async def check() -> bool:
        for target, mon in monitors.items():
            for name in CAUGHT_UP:
                seen = await prom.value(f'sum({name}{{instance="{target}"}})')
                if seen != registry_sum(mon, name):
                    return False
        return True

    await until("Prometheus to scrape the monitors' current state", check)


async def send(mon: Monitor, run: str, kind: str, payload: dict[str, Any] | bytes) -> None:
    await mon.handle(
        f"agents/{run}/{kind}",
        payload if isinstance(payload, bytes) else json.dumps(payload).encode(),
    )


async def steps(mon: Monitor, run: str, indexes: range) -> None:
    for i in indexes:
        await send(mon, run, "step", {"index": i, "text": f"{run} step {i}"})


async def drain(*monitors: Monitor) -> None:
    for mon in monitors:
        await asyncio.wait_for(mon.drain(), 20)


LIVE: dict[
    str, dict[str, Any]
    # daemon A's runs that stay live, with their labels (group and model are the default metric
    # labels)
] = {
    "run-a1": {
        "task": "Make the failing test pass",
        "group": "best-of-2",  # siblings: the group panels' series
        # siblings share a family (or task) and rubric: a group refuses others
        "family": "siblings",
        "labels": {"group": "alpha", "model": "m-large", "user": "x"},
    },
    "run-a2": {
        "task": "Refactor the parser",
        "family": "siblings",
        "group": "best-of-2",
        "labels": {"group": "beta", "model": "m-small"},
    },
    "run-flaky": {"task": "flaky", "labels": {"group": "beta"}},
    "run-wobbly": {
        "task": "wobbly",
        "policy": {"resample_below": 0.5, "abort_below": None},
        "labels": {"group": "alpha"},
    },
    "run-burst": {"task": "A long chatty run"},
}


async def wave(a: Monitor, b: Monitor, n: int) -> None:
    """One wave of activity on both daemons (n = 1, 2)."""
    first, last = (1, 2) if n == 1 else (3, 4)
    if n == 1:
        for run, start in LIVE.items():
            await send(a, run, "start", start)
        await send(
            b, "run-b1", "start", {"task": "judged by a dead judge", "labels": {"group": "gamma"}}
        )
        for i in range(CALIBRATING):
            # No abort rule on these: a run one could have stopped has a censored outcome and
            # teaches nothing.
            start = {
                "task": "a finished task",
                "family": "release",
                "policy": {"abort_below": None},
            }
            await send(a, f"done-{i}", "start", start)
            await steps(a, f"done-{i}", range(1, 2))
            await send(a, f"done-{i}", "end", {"outcome": "success"})
    for run in ("run-a1", "run-a2", "run-wobbly"):
        await steps(a, run, range(first, last + 1))
    # The flaky run's judge fails on its step 2 (and only there): one at a time, so step 2 is scored
    # alone.
    for i in range(first, last + 1):
        await steps(a, "run-flaky", range(i, i + 1))
        await drain(a)
    # A burst while the judge is busy: folded into few scorings of the newest prefix.
    await steps(a, "run-burst", range(10 * n - 9, 10 * n + 1))
    doomed = range(0, DOOMED // 2) if n == 1 else range(DOOMED // 2, DOOMED)
    for i in doomed:
        await send(
            a, f"doomed-{i:02}", "start", {"task": "a doomed task", "labels": {"group": "omega"}}
        )
        await steps(a, f"doomed-{i:02}", range(1, 2))
    # Bad input: not JSON, an end for a run that never started, a step with the wrong type.
    await send(a, f"broken-{n}", "start", b"\xff not json")
    await send(a, f"ghost-{n}", "end", {})
    await send(a, "run-a1", "step", b'{"index": 99, "text": 5}')
    # B: each step scored alone, each scoring a judge failure, each failure a progress message for a
    # full outbox.
    for i in range(first * 2 - 1, last * 2 + 1):
        await steps(b, "run-b1", range(i, i + 1))
        await drain(b)
    await drain(a, b)
    # The harness stops the aborted runs (all but the last, so the table has a live abort).
    for i in doomed:
        if i != DOOMED - 1:
            await send(a, f"doomed-{i:02}", "end", {"outcome": "failure"})
    await drain(a, b)


def instances(result: list[dict[str, Any]]) -> set[str]:
    return {r["metric"].get("instance", "") for r in result}


async def test_dashboard_and_alert_queries_on_a_real_prometheus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The OTLP exporter retries a refused connection until its timeout (10 s): 1 s makes the dead
    # collector's failures (and so AgentMonitorOtlpExportFailing) show within the test.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_TIMEOUT", "1")
    registry = CollectorRegistry()
    a = Monitor(
        MonitorConfig(
            # alpha 0.2: a family is calibrated after ceil(1/0.2) - 1 = CALIBRATING successful runs,
            # so the threshold panel has data.
            policy=Policy(abort_below=0.2, min_steps=1, patience=1, alpha=0.2),
            # Prices: the Cost row's panels query the cost series, which a monitor without prices
            # has not.
            price_input=2.5,
            price_output=10.0,
            max_concurrency=4,
            metrics=MetricsSettings(grace_s=GRACE_S),
            # Nothing listens there: the OpenTelemetry panel's series exist and count the failures.
            otlp_endpoint=f"http://127.0.0.1:{free_port()}",
        ),
        judge=CachingJudge(letters, latency_s=0.02, max_retries=0),
        registry=registry,
        sinks=[Board(registry=registry)],  # the board panel's series
        # The OTLP traces receiver's row: its series exist from start-up (by reason, at 0).
        sources=[OtlpReceiver(OtlpReceiverSettings(address="127.0.0.1:0"), registry=registry)],
    )
    b = Monitor(
        MonitorConfig(outbox_size=3, metrics=MetricsSettings(max_series=0, grace_s=GRACE_S)),
        judge=FakeJudge(lambda p: JudgeError("server_error", "the judge is down"), max_retries=0),
        registry=CollectorRegistry(),
    )
    dead = f"127.0.0.1:{free_port()}"
    async with served(a) as ta, served(b) as tb:
        with prometheus(tmp_path, [ta, tb, dead]) as prom:
            started = time.monotonic()
            try:
                await run_scenario(prom, a, b, ta, tb, dead)
            except BaseException:
                print(prom.logs())
                raise
            print(f"scenario and queries: {time.monotonic() - started:.1f}s")


async def run_scenario(
    prom: Prometheus, a: Monitor, b: Monitor, ta: str, tb: str, dead: str
) -> None:
    monitors = {ta: a, tb: b}

    async def all_scraped() -> bool:
        up = {
            r["metric"]["instance"]: r["value"][1]
            for r in await prom.query('up{job="agent-monitor"}')
        }
        return up == {ta: "1", tb: "1", dead: "0"}

    # A first scrape before any activity: the pre-initialised counters have a 0 to rise from.
    await until("the first scrape of every target", all_scraped)
    # Neither monitor has a broker here: b's gauge moves as Mosquitto's $SYS drop count would move
    # it (tests/daemon/sources/test_ingest.py moves it with a real Mosquitto dropping messages).
    b.metrics.broker_dropped.set(12)
    await wave(a, b, 1)
    await caught_up(prom, monitors)
    await wave(a, b, 2)
    await caught_up(prom, monitors)
    live_runs = {*LIVE, f"doomed-{DOOMED - 1:02}"}
    assert set(a.book.live) == live_runs

    async def only_live_runs() -> bool:  # the aborted runs ended last leave after the grace period
        return {
            r["metric"]["run_id"] for r in await prom.query("agent_monitor_run_progress")
        } == live_runs

    # One trace through a's OTLP receiver, to its end: the row's final-score latency has an
    # observation.
    receiver = next(s for s in a.sources if isinstance(s, OtlpReceiver))
    now = time.time_ns()
    # No outcome: the trace's run teaches calibration nothing (the counts below are the waves' own).
    trace = body(tool("00f067aa0ba902b7", now, "run_tests", "2 passed"), root(now + 1000))
    status, _, _ = await apost(receiver.url, trace)
    assert status == 200

    async def trace_scored() -> bool:
        return registry_sum(a, "agent_monitor_otlp_final_score_seconds_count") > 0

    await until("the trace's final score", trace_scored)

    async def trace_scraped() -> bool:
        return bool(await prom.query("agent_monitor_otlp_final_score_seconds_count > 0"))

    await until("Prometheus to scrape the trace's final score", trace_scraped)

    await until("the ended runs' series to leave", only_live_runs)
    assert registry_sum(a, "agent_monitor_coalesced_steps_total") > 0, "the burst was not coalesced"
    assert b.outbox.dropped > 0 and registry_sum(a, "agent_monitor_outbox_dropped_total") == 0

    # Every panel query: a success with data, at least one number in it.
    dashboard = load_dashboard()
    for where, expr in dashboard_queries(dashboard):
        result = await prom.query(expr)
        assert result, f"{where}: no data for {expr}"
        values = [float(r["value"][1]) for r in result]
        assert any(math.isfinite(v) for v in values), f"{where}: only {values} for {expr}"

    # The variables' label_values() find the daemons and the live runs.
    for name, selector, label in variable_queries(dashboard):
        found = {r["metric"][label] for r in await prom.query(selector)}
        assert found == ({ta, tb} if name == "instance" else live_runs), (name, found)

    # The values behind the panels are the monitors' own.
    for run in LIVE:
        view = a.run(run)
        assert view is not None and view.latest is not None and view.latest.score is not None
        latest = view.latest
        seen = await prom.value(f'agent_monitor_run_progress{{run_id="{run}"}}')
        assert seen == pytest.approx(latest.score), run
    a1 = await prom.query('agent_monitor_run_progress{run_id="run-a1"}')
    assert {k: a1[0]["metric"][k] for k in ("group", "model")} == {
        "group": "alpha",
        "model": "m-large",
    }
    assert "user" not in a1[0]["metric"], "a start label outside --metric-labels became a label"
    table = next(p for p in dashboard["panels"] if p["type"] == "table")
    signal_code = next(
        expr
        for where, expr in dashboard_queries(dashboard)
        if where.startswith(f"panel {table['id']} ") and "target D" in where
    )
    codes = {r["metric"]["run_id"]: r["value"][1] for r in await prom.query(signal_code)}
    assert codes == {**dict.fromkeys(LIVE, "0"), "run-wobbly": "1", f"doomed-{DOOMED - 1:02}": "2"}
    share = await prom.value(
        'sum(rate(agent_monitor_judge_tokens_total{kind="cached_input"}[1m]))'
        ' / sum(rate(agent_monitor_judge_tokens_total{kind="input"}[1m]))'
    )
    assert share == pytest.approx(0.5, abs=0.01)
    assert (
        await prom.value("sum(agent_monitor_runs_active)")
        == len(a.book.live) + len(b.book.live)
        == len(LIVE) + 2
    )
    assert await prom.value(f'agent_monitor_run_series_capped{{instance="{tb}"}}') == 1

    # Every alert expression holds, for exactly the daemons it is about.
    expected = {
        "AgentMonitorDown": {dead},
        "AgentMonitorJudgeErrors": {tb},
        "AgentMonitorJudgeStuck": {tb},
        "AgentMonitorAbortStorm": {ta},
        "AgentMonitorBrokerDisconnected": {ta, tb},
        "AgentMonitorOutboxDropping": {tb},
        "AgentMonitorBrokerDropping": {tb},
        "AgentMonitorSeriesCapped": {tb},
        "AgentMonitorOtlpExportFailing": {ta},
        "AgentMonitorClusterRedisEmptied": set(),  # no cluster here: it must stay quiet
    }
    queries = dict(alert_queries())
    assert set(queries) == set(expected), "a new alert rule needs its expectation here"
    for alert, expr in queries.items():
        result = await prom.query(expr)
        assert instances(result) == expected[alert], (alert, result)

    # The rules load healthy, and each goes pending (or firing, once its `for` has passed) for those
    # daemons.
    async def rules_active() -> bool:
        body = await prom.get("/api/v1/rules")
        rules = [r for g in body["data"]["groups"] for r in g["rules"]]
        assert {r["name"] for r in rules} == set(expected)
        for r in rules:
            assert r["health"] == "ok", (r["name"], r.get("lastError"))
        return all(
            (
                r["state"] in ("pending", "firing")
                if expected[r["name"]]
                else r["state"] == "inactive"
            )
            and {x["labels"]["instance"] for x in r["alerts"]} == expected[r["name"]]
            for r in rules
        )

    await until("every alert rule to be pending or firing", rules_active)

    # An ended run's series stay for the grace period, then leave Prometheus; the other runs stay.
    ended = time.monotonic()
    await send(a, "run-a1", "end", {"outcome": "success"})
    await drain(a)
    kept = a.registry.get_sample_value(
        "agent_monitor_run_step", {"run_id": "run-a1", "group": "alpha", "model": "m-large"}
    )
    if time.monotonic() - ended < GRACE_S:
        assert kept == 4, "an ended run's series left before its grace period"

    async def gone() -> bool:
        return await prom.query('agent_monitor_run_progress{run_id="run-a1"}') == []

    await until("run-a1's progress series to leave Prometheus", gone, wait_s=15)
    assert time.monotonic() - ended >= GRACE_S
    assert await prom.query('agent_monitor_run_step{run_id="run-a1"}') == []
    assert await prom.value('agent_monitor_run_progress{run_id="run-a2"}') is not None
    assert (
        await prom.value(f'agent_monitor_runs_total{{instance="{ta}", outcome="success"}}')
        == CALIBRATING + 1
    )


# -- the Cluster row, against real `serve --cluster` replicas --

CLUSTER_RUNS = 6
# short: a dead replica's runs move within lease + heartbeat, and the test waits for that
LEASE_S = 2.0


@contextmanager
def replica(name: str, *args: str, workdir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`agent-monitor serve --cluster ... --replica-id NAME` with /metrics on a free port; yields
    (process, target)."""
    port = free_port()
    log = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "agent_monitor",
        "serve",
        "--replica-id",
        name,
        "--metrics-port",
        str(port),
        *args,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while "agent-monitor: serving" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"replica {name} exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"replica {name} did not come up: {log.read_text()[-3000:]}"
            )
            time.sleep(0.1)
        yield proc, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def publish(port: int, messages: list[tuple[str, dict[str, Any]]]) -> None:
    """Publish (topic, JSON) messages at QoS 1, as a harness does, and wait for every PUBACK."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        infos = [c.publish(topic, json.dumps(payload), qos=1) for topic, payload in messages]
        for info in infos:
            info.wait_for_publish(10)
    finally:
        c.disconnect()
        c.loop_stop()


def cluster_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of the Cluster row's targets."""
    dashboard = load_dashboard()
    titles: dict[int, str] = {}
    in_row = False
    for p in dashboard["panels"]:
        if p["type"] == "row":
            in_row = p["title"].startswith("Cluster")
        elif in_row:
            titles[p["id"]] = p["title"]
    return [
        (titles[int(where.split()[1])], expr)
        for where, expr in dashboard_queries(dashboard)
        if int(where.split()[1]) in titles
    ]


async def test_cluster_row_on_a_real_prometheus(
    tmp_path: Path, broker: Mosquitto, redis: RedisServer
) -> None:
    """Two replicas share the runs (3 and 3); one is killed; the survivor takes its runs and its
    MQTT session.

    The Cluster row's queries, run by a real Prometheus scraping both replicas, show it: two live
    replicas, then one; runs owned per replica; takeovers and the adopted session on the survivor;
    fencing and Redis errors (zero here) answer with data.
    """
    from tests.openai_server import chat_choice, chat_reply, scripted_server

    queries = cluster_queries()
    assert {t for t, _ in queries} >= {
        "Live replicas, as each replica sees them",
        "Runs owned per replica",
        "Run takeovers per minute",
        "MQTT sessions adopted",
        "Fenced writes and publications, Redis errors",
    }
    with contextlib.ExitStack() as stack:
        judge = stack.enter_context(scripted_server())
        judge.default = chat_reply(chat_choice([("K", {"K": 1.0})]))
        common = [
            "--cluster",
            redis.url,
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
        ]
        common += [
            "--cluster-lease",
            str(LEASE_S),
            "--cluster-heartbeat",
            str(LEASE_S / 4),
            "--no-board",
        ]
        r1, t1 = stack.enter_context(replica("r1", *common, workdir=tmp_path))
        r2, t2 = stack.enter_context(replica("r2", *common, workdir=tmp_path))
        prom = stack.enter_context(prometheus(tmp_path, [t1, t2]))
        try:

            async def value_of(expr: str) -> dict[str, float]:
                return {
                    r["metric"].get("instance", ""): float(r["value"][1])
                    for r in await prom.query(expr)
                }

            async def holds(expr: str, want: dict[str, float]) -> bool:
                return await value_of(expr) == want

            await until(
                "both replicas to see two",
                lambda: holds("agent_monitor_cluster_replicas", {t1: 2, t2: 2}),
            )
            runs = [f"c{i}" for i in range(CLUSTER_RUNS)]
            await asyncio.to_thread(
                publish,
                broker.port,
                [(f"agents/{r}/start", {"task": "Make the failing test pass"}) for r in runs]
                + [(f"agents/{r}/step", {"index": 1, "text": "pytest: 3 failed"}) for r in runs],
            )
            # Exact balance: 3 and 3.
            half = CLUSTER_RUNS / 2
            await until(
                "the runs placed 3 and 3",
                lambda: holds("agent_monitor_runs_owned", {t1: half, t2: half}),
            )

            r2.kill()  # no goodbye: its runs and its broker session wait for the survivor
            r2.wait()
            await asyncio.to_thread(
                publish,
                broker.port,
                [(f"agents/{r}/step", {"index": 2, "text": "pytest: 1 failed"}) for r in runs],
            )
            await until(
                "the survivor to own every run",
                lambda: holds("agent_monitor_runs_owned", {t1: CLUSTER_RUNS}),
                wait_s=60,
            )
            await until(
                "the survivor to see one replica",
                lambda: holds("agent_monitor_cluster_replicas", {t1: 1}),
            )
            await until(
                "the dead replica's session to be adopted",
                lambda: holds("agent_monitor_cluster_sessions_adopted_total", {t1: 1}),
                wait_s=60,
            )
            took = (await value_of("agent_monitor_run_takeovers_total"))[t1]
            assert took == half, "the survivor took exactly the dead replica's runs"

            # Every query of the row answers with data about the survivor (rates and increases over
            # the last minute still see the dead replica's samples from before it died).
            for title, expr in queries:
                result = await prom.query(expr)
                assert result, f"{title}: no data for {expr}"
                assert t1 in {r["metric"]["instance"] for r in result}, (title, result)
                values = [float(r["value"][1]) for r in result]
                assert all(math.isfinite(v) for v in values), (title, values)
            by_title = {t: e for t, e in queries}
            assert await value_of(by_title["Live replicas, as each replica sees them"]) == {t1: 1}
            assert await value_of(by_title["Runs owned per replica"]) == {t1: CLUSTER_RUNS}
            assert (await value_of(by_title["Run takeovers per minute"]))[t1] > 0
            assert (await value_of(by_title["MQTT sessions adopted"]))[t1] > 0
            assert r1.poll() is None
        except BaseException:
            # What the replicas said (their logs are in tmp_path) is what explains a failure here.
            for name in ("r1", "r2"):
                print(
                    f"--- {name}.log ---",
                    (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:],
                )
            raise
