"""The daemon's Prometheus metrics on a registry passed in: per-run gauges, caps, judge
accounting, zero-initialised."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent_monitor.criteria import load_criteria
from agent_monitor.daemon import Accepted, MetricsSettings, Monitor, MonitorConfig, Scored
from agent_monitor.daemon.sinks._metrics import RunCollector
from agent_monitor.judges.base import JudgeError
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


async def test_per_run_gauges_follow_live_runs_and_vanish_after_grace() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    judge = FakeJudge(lambda p: "K")  # K = 10/19
    config = MonitorConfig(metrics=MetricsSettings(labels=("group",), grace_s=30))
    async with Monitor(config, judge=judge, registry=reg, clock=clock) as mon:
        await mon.handle(
            "agents/r1/start", j(task="t", labels={"group": "g1", "secret": "not exported"})
        )
        await mon.handle("agents/r1/step", j(index=1, text="a"))
        await mon.handle("agents/r1/step", j(index=2, text="b"))
        await mon.drain()
        assert value(reg, "agent_monitor_run_progress", run_id="r1", group="g1") == pytest.approx(
            10 / 19
        )
        assert value(reg, "agent_monitor_run_step", run_id="r1", group="g1") == 2
        assert value(
            reg, "agent_monitor_run_uncertainty", run_id="r1", group="g1"
        ) == pytest.approx(0.0)
        assert (
            value(reg, "agent_monitor_run_signal", run_id="r1", group="g1", signal="continue") == 1
        )
        assert "secret" not in generate_latest(reg).decode()
        assert value(reg, "agent_monitor_runs_active") == 1

        await mon.handle("agents/r1/end", j(outcome="success"))
        await mon.drain()
        # Still visible during the grace period, so the board shows how the run finished ...
        assert value(reg, "agent_monitor_run_progress", run_id="r1", group="g1") == pytest.approx(
            10 / 19
        )
        assert value(reg, "agent_monitor_runs_active") == 0
        assert value(reg, "agent_monitor_runs_total", outcome="success") == 1
        clock.t += 31
        await mon.sweep()
        # ... then gone: ended runs leak no series.
        assert value(reg, "agent_monitor_run_progress", run_id="r1", group="g1") is None
        assert 'run_id="r1"' not in generate_latest(reg).decode()


async def test_series_cap_keeps_the_most_recent_runs_and_counts_the_rest() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    config = MonitorConfig(metrics=MetricsSettings(max_series=2))
    async with Monitor(config, judge=FakeJudge(), registry=reg, clock=clock) as mon:
        for name in ("a", "b", "c"):
            await mon.handle(f"agents/{name}/start", j(task="t"))
            clock.t += 1
        text = generate_latest(reg).decode()
        shown = {
            line.split('run_id="')[1].split('"')[0]
            for line in text.splitlines()
            if "agent_monitor_run_step{" in line
        }
        assert shown == {"b", "c"}
        assert value(reg, "agent_monitor_run_series_capped") == 1


async def test_judge_calls_latency_tokens_and_scoring_counted() -> None:
    reg = CollectorRegistry()
    fail = {"on": False}

    def answer(p: Any) -> str | Exception:
        return JudgeError("server_error", "HTTP 500") if fail["on"] else "C"

    judge = FakeJudge(answer, max_retries=0)
    async with Monitor(
        MonitorConfig(policy=Policy(abort_below=0.5, min_steps=1, patience=1)),
        judge=judge,
        registry=reg,
    ) as mon:
        await mon.handle("agents/r/start", j(task="t"))
        await mon.handle("agents/r/step", j(index=1, text="a"))
        await mon.drain()
        fail["on"] = True
        await mon.handle("agents/q/start", j(task="t"))
        await mon.handle("agents/q/step", j(index=1, text="b"))
        await mon.drain()
    assert value(reg, "agent_monitor_judge_calls_total", judge="fake", outcome="ok") == 1
    assert value(reg, "agent_monitor_judge_calls_total", judge="fake", outcome="error") == 1
    assert value(reg, "agent_monitor_judge_latency_seconds_count", judge="fake") == 2
    assert (
        value(reg, "agent_monitor_judge_tokens_total", kind="input") == judge.usage.input_tokens > 0
    )
    assert value(reg, "agent_monitor_judge_tokens_total", kind="output") == 1
    assert value(reg, "agent_monitor_scorings_total", outcome="ok") == 1
    assert value(reg, "agent_monitor_scorings_total", outcome="failed") == 1
    assert value(reg, "agent_monitor_signals_total", signal="abort") == 1
    assert value(reg, "agent_monitor_step_to_score_seconds_count") == 2
    assert value(reg, "agent_monitor_events_total", type="step") == 2
    assert value(reg, "agent_monitor_build_info", version=version("agent-monitor")) == 1


async def test_labelled_counters_exist_at_zero_before_any_event() -> None:
    reg = CollectorRegistry()
    async with Monitor(judge=FakeJudge(), registry=reg):
        pass
    for signal in ("continue", "abort", "resample", "done"):
        assert value(reg, "agent_monitor_signals_total", signal=signal) == 0
    for outcome in ("success", "failure", "expired", "evicted"):
        assert value(reg, "agent_monitor_runs_total", outcome=outcome) == 0
    for kind in ("input", "cached_input", "output"):
        assert value(reg, "agent_monitor_judge_tokens_total", kind=kind) == 0
    assert value(reg, "agent_monitor_invalid_events_total", reason="bad_json") == 0
    assert value(reg, "agent_monitor_judge_calls_total", judge="fake", outcome="error") == 0
    assert value(reg, "agent_monitor_run_series_capped") == 0
    # Cluster mode's counters too (a Monitor without a cluster exports them at 0, as a replica does
    # at start).
    for what in ("write", "publish"):
        assert value(reg, "agent_monitor_cluster_fenced_total", what=what) == 0
    for op in ("heartbeat", "receive", "notes", "take", "feed", "journal", "progress"):
        assert value(reg, "agent_monitor_cluster_errors_total", op=op) == 0


def test_every_cluster_operation_counted_is_there_from_start_up() -> None:
    """The op names cluster mode counts failures under are all pre-initialised (a new one must
    join CLUSTER_OPS)."""
    from agent_monitor.daemon.cluster import _cluster, _inbox, _session, _store
    from agent_monitor.daemon.sinks._metrics import CLUSTER_OPS

    modules = (_cluster, _inbox, _session, _store)
    source = "".join(Path(m.__file__).read_text() for m in modules)  # type: ignore[arg-type]
    ops = set(re.findall(r'cluster_errors\.labels\("(\w+)"\)', source)) | set(
        re.findall(r'_run\(\s*"(\w+)"', source)
    )
    assert {"receive", "journal", "heartbeat", "feed"} <= ops, ops
    assert ops <= set(CLUSTER_OPS), (
        f"counted but not at 0 from start-up: {sorted(ops - set(CLUSTER_OPS))}"
    )


def test_two_monitors_have_separate_registries() -> None:
    a, b = Monitor(judge=FakeJudge()), Monitor(judge=FakeJudge())
    # no global registry: two monitors in one process do not collide
    assert a.registry is not b.registry


def test_bad_metric_label_names_are_refused() -> None:
    with pytest.raises(ValueError, match="run_id"):
        RunCollector(list, label_names=("run_id",))
    with pytest.raises(ValueError, match="not allowed"):
        RunCollector(list, label_names=("bad-name",))


async def test_calibration_gauges_per_family_threshold_only_once_calibrated() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    # alpha 0.5 gives a threshold from ceil(1/0.5) - 1 = 1 successful run: one run is enough to see
    # it appear.
    config = MonitorConfig(
        policy=Policy(alpha=0.5, min_steps=1, patience=1),
        metrics=MetricsSettings(families=("kept", "late", "never"), max_families=2),
    )
    async with Monitor(config, judge=FakeJudge(lambda p: "K"), registry=reg, clock=clock) as mon:

        async def run(run_id: str, family: str, outcome: str) -> None:
            await mon.handle(f"agents/{run_id}/start", j(task="t", family=family))
            await mon.handle(f"agents/{run_id}/step", j(index=1, text="a"))
            await mon.handle(f"agents/{run_id}/end", j(outcome=outcome))
            await mon.drain()
            clock.t += 1

        await run("f1", "kept", "failure")
        labels = {"family": "kept", "model": "fake-1", "rubric": load_criteria(None).hash}
        assert value(reg, "agent_monitor_calibration_successes", **labels) == 0
        # not calibrated: no series
        assert value(reg, "agent_monitor_calibrated_threshold", **labels) is None
        await run("s1", "kept", "success")
        assert value(reg, "agent_monitor_calibration_successes", **labels) == 1
        assert value(reg, "agent_monitor_calibrated_threshold", **labels) == pytest.approx(10 / 19)
        assert value(reg, "agent_monitor_calibration_series_capped") == 0
        # A family not on the allow-list, and one past the cap (the least recently ended goes), are
        # counted.
        await run("x1", "unlisted", "success")
        await run("l1", "late", "success")
        await run("n1", "never", "success")
        text = generate_latest(reg).decode()
        shown = {
            line.split('family="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("agent_monitor_calibration_successes{")
        }
        assert shown == {"late", "never"}
        assert value(reg, "agent_monitor_calibration_series_capped") == 2


def test_calibration_gauges_forget_families_the_calibration_forgot() -> None:
    """Family names come from the network: the gauge table stays as bounded as the calibration it
    shows."""
    from agent_monitor.calibration import Calibration, Family, Point
    from agent_monitor.daemon.sinks._metrics import CalibrationCollector

    cal = Calibration(max_samples=1, max_total=2)
    gauges = CalibrationCollector(cal, Policy(alpha=0.5))
    for i in range(4):
        fam = Family(f"f{i}", "m", "r")
        cal.record(fam, "run", "success", [Point(1, 0.5, 0.1)])
        gauges.update(fam, float(i))
    reg = CollectorRegistry()
    reg.register(gauges)
    text = generate_latest(reg).decode()
    shown = {
        line.split('family="')[1].split('"')[0]
        for line in text.splitlines()
        if "calibration_successes{" in line
    }
    assert shown == {"f2", "f3"}


async def test_a_step_s_path_reaches_the_metrics_only_through_the_collectors_at_scrape_time() -> (
    None
):
    reg = CollectorRegistry()
    async with Monitor(MonitorConfig(), judge=FakeJudge(latency_s=0.03), registry=reg) as mon:
        # No sink on a scored step's way counts it: the metrics sink takes only the rarer events.
        takes = [getattr(s, "events", ()) for s in mon.sinks if type(s).__name__ == "MetricsSink"]
        assert takes and all(Scored not in t and Accepted not in t for t in takes)
        await mon.handle("agents/r/start", j(task="t"))
        for i in (1, 2, 3):
            await mon.handle("agents/r/step", j(index=i, text=f"s{i}"))
            await mon.drain()
    # Histograms built from the parts' bucket counts are cumulative, as Prometheus reads them.
    assert value(reg, "agent_monitor_judge_latency_seconds_bucket", judge="fake", le="0.025") == 0
    assert value(reg, "agent_monitor_judge_latency_seconds_bucket", judge="fake", le="0.05") == 3
    assert value(reg, "agent_monitor_judge_latency_seconds_bucket", judge="fake", le="+Inf") == 3
    assert value(reg, "agent_monitor_step_to_score_seconds_count") == 3
    assert value(reg, "agent_monitor_step_to_score_seconds_bucket", le="0.025") == 0
    assert value(reg, "agent_monitor_events_total", type="start") == 1
    assert value(reg, "agent_monitor_events_total", type="step") == 3
    assert value(reg, "agent_monitor_scoring_failures_total", reason="timeout") == 0


async def test_a_run_without_labels_has_an_empty_model_label_and_the_help_says_why() -> None:
    import json as _json

    from prometheus_client import CollectorRegistry, generate_latest

    from agent_monitor.daemon import Monitor, MonitorConfig
    from agent_monitor.testing import FakeJudge

    registry = CollectorRegistry()
    async with Monitor(MonitorConfig(), judge=FakeJudge(), registry=registry) as monitor:
        await monitor.handle("agents/bare/start", _json.dumps({"task": "t"}).encode())
        await monitor.handle(
            "agents/named/start", _json.dumps({"task": "t", "labels": {"model": "m1"}}).encode()
        )
        for rid in ("bare", "named"):
            await monitor.handle(
                f"agents/{rid}/step", _json.dumps({"index": 1, "text": "x"}).encode()
            )
        await monitor.drain()
        text = generate_latest(registry).decode()
    assert 'agent_monitor_run_progress{group="",model="",run_id="bare"}' in text
    assert 'agent_monitor_run_progress{group="",model="m1",run_id="named"}' in text
    (help_line,) = [
        line for line in text.splitlines() if line.startswith("# HELP agent_monitor_run_progress ")
    ]
    assert "start.labels" in help_line and "empty when the start names none" in help_line
