"""A pattern that backtracks for ever stalls nothing: not other runs, not /metrics, not the next
start-up.

A run's `start.criteria` may carry any `regex_capture` pattern, and its steps are
network text. Here a real daemon (`agent-monitor serve` as a subprocess, a private
Mosquitto, a scripted judge) gets `(x+x+)+y` and a 10 kB step of `x`: with
Python's `re` that match would take longer than the universe; under the
monitor's time budget it costs that run one `extractor_timeout` and nobody else
anything. Then the daemon is SIGKILLed and restarted with that step in its
journal, and starts as fast as a daemon whose journal holds a harmless step.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.brokers import Mosquitto, free_port
from tests.daemon.test_restarts import Daemon, Harness, harness, judge, make_daemon  # noqa: F401  (fixtures)
from tests.openai_server import ScriptedServer

pytestmark = pytest.mark.timeout(300)

EVIL = {
    "title": "answers only",
    "extractors": [{"type": "regex_capture", "pattern": "(x+x+)+y", "group": 0}],
    "criteria": [{"type": "llm", "name": "progress", "description": "How far the task is."}],
}
HARMLESS = {**EVIL, "extractors": [{"type": "regex_capture", "pattern": "(x+)y", "group": 0}]}
STEP = "x" * 10_000


class Poller:
    """Scrapes /metrics every 20 ms in a thread and keeps each scrape's latency (a stalled loop
    shows here)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    r.read()
                self.latencies.append(time.monotonic() - t)
            except OSError as e:
                self.failures.append(str(e))
            time.sleep(0.02)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def start_time(daemon: Daemon) -> float:
    t = time.monotonic()
    daemon.start()
    return time.monotonic() - t


def test_a_backtracking_pattern_stalls_no_other_run_nor_metrics_nor_the_restart(
    tmp_path: Path,
    broker: Mosquitto,
    judge: ScriptedServer,  # noqa: F811
    harness: Harness,  # noqa: F811
    make_daemon: Callable[..., Daemon],  # noqa: F811
) -> None:
    metrics_port = free_port()
    daemon = make_daemon("--metrics-port", str(metrics_port))
    daemon.start()
    harness.send("bystander", "start", {"task": "count to forty"})
    harness.send("victim", "start", {"task": "never answer", "criteria": EVIL})
    assert harness.wait_progress("bystander", 0, timeout=1) is None  # nothing yet: no step
    harness.send("bystander", "step", {"index": 1, "text": "1"})
    assert harness.wait_progress("bystander", 1) is not None

    latencies: list[float] = []
    with Poller(metrics_port) as poller:
        for i in range(2, 42):
            if i == 5:
                mark = harness.mark()
                harness.send("victim", "step", {"index": 1, "text": STEP})
            sent = time.monotonic()
            since = harness.mark()
            harness.send("bystander", "step", {"index": i, "text": str(i)})
            got = harness.wait_progress("bystander", i, timeout=10, since=since)
            assert got is not None, f"no progress for the bystander's step {i}"
            latencies.append(time.monotonic() - sent)
            time.sleep(0.05)
        victim = harness.wait(
            lambda o: o.run_id == "victim" and o.kind == "progress", timeout=10, since=mark
        )

    assert victim is not None and victim.body["ok"] is False
    assert victim.body["reason"] == "extractor_timeout", victim.body
    assert "ran over its 50 ms budget" in victim.body["error"]
    print(
        f"\nbystander step->progress: max {max(latencies) * 1000:.0f} ms over "
        f"{len(latencies)} steps; "
        f"/metrics: max {max(poller.latencies) * 1000:.0f} ms over {len(poller.latencies)} scrapes"
    )
    assert not poller.failures, poller.failures[:3]
    assert len(poller.latencies) > 20
    assert max(latencies) < 0.2, latencies
    assert max(poller.latencies) < 0.2, sorted(poller.latencies)[-5:]
    # Over the wire too: a different text under a taken index is a `conflict` on the run's error
    # topic.
    since = harness.mark()
    harness.send("bystander", "step", {"index": 3, "text": "three, rewritten"})
    conflict = harness.wait_error("bystander", "conflict", timeout=10, since=since)
    assert conflict is not None and "the first one stays" in conflict.body["error"]
    scrape = (
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    assert 'agent_monitor_scoring_failures_total{reason="extractor_timeout"} 1.0' in scrape

    # The step is in the journal: a restart replays it under the same budget, and is up as fast as
    # a daemon whose journal holds the same runs with a pattern that does not backtrack.
    daemon.kill()
    evil_start = start_time(daemon)
    daemon.stop()

    calm = Daemon(tmp_path / "calm", broker, judge, ["--client-id", "calm-monitor"])
    (tmp_path / "calm").mkdir()
    calm.start()
    harness.send("calm-victim", "start", {"task": "never answer", "criteria": HARMLESS})
    since = harness.mark()
    harness.send("calm-victim", "step", {"index": 1, "text": STEP})
    assert harness.wait_progress("calm-victim", 1, since=since) is not None
    calm.kill()
    calm_start = start_time(calm)
    calm.stop()
    print(
        f"restart with the step journaled: {evil_start:.2f} s; with a harmless one: "
        f"{calm_start:.2f} s"
    )
    assert evil_start < calm_start + 1.0
