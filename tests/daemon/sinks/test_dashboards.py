"""The Grafana dashboard and the Prometheus rules in dashboards/, checked without a Prometheus
server.

Structure (ids, datasource variable, grid), that every metric, label and label value a query uses is
really exported by a live Monitor, promtool's checks, and promtool unit tests of every alert rule.
`test_prometheus.py` then runs every query against a real Prometheus; it imports the helpers here.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent_monitor import JudgeError
from agent_monitor.daemon import Board, Monitor, MonitorConfig, OtlpReceiver, OtlpReceiverSettings
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from tests.brokers import free_port
from tests.paths import REPO

ROOT = REPO
DASHBOARDS = ROOT / "dashboards"
DASHBOARD = DASHBOARDS / "agent-monitor.json"
ALERTS = DASHBOARDS / "alerts.yml"
DS = {"type": "prometheus", "uid": "${datasource}"}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian: `apt-get install prometheus`, which ships it)",
)

# Values for Grafana's variables when a query runs outside Grafana: every daemon and run, typical
# intervals.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
    "$instance": ".*",
    "$run_id": ".*",
}
# Series Prometheus makes itself rather than scraping them.
PROMETHEUS_SYNTHETIC = {"up"}
# Labels Prometheus attaches to every scraped series.
TARGET_LABELS = {"job", "instance"}


# -- helpers (also used by test_prometheus.py) --


def load_dashboard() -> dict[str, Any]:
    d: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return d


def load_alerts() -> list[dict[str, Any]]:
    """Every rule of alerts.yml."""
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def to_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced (longest names first: $__range before
    $__rate...)."""
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name]).replace(
            "${" + name[1:] + "}", GRAFANA_VARIABLES[name]
        )
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def label_values_query(definition: str) -> tuple[str, str]:
    """`label_values(selector, label)` -> (selector, label)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_]\w*)\s*\)\s*", definition)
    assert m, f"not a label_values() query: {definition!r}"
    return m.group(1), m.group(2)


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, Grafana variables substituted."""
    return [
        (f"panel {p['id']} {p['title']!r} target {t['refId']}", to_promql(t["expr"]))
        for p in all_panels(dashboard)
        for t in p.get("targets", [])
    ]


def variable_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(variable name, selector, label) of every label_values() query variable."""
    out = []
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            selector, label = label_values_query(v["definition"])
            out.append((v["name"], to_promql(selector), label))
    return out


def alert_queries() -> list[tuple[str, str]]:
    return [(rule.get("alert") or rule["record"], rule["expr"]) for rule in load_alerts()]


_STRING = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}
_KEYWORDS |= {"atan2", "inf", "nan", "start", "end"}
_IDENT = r"(?<![\w.:])[a-zA-Z_:][a-zA-Z0-9_:]*"


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (function names, keywords, label names left
    out)."""
    s = re.sub(_STRING, '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery durations
    # label lists
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(_IDENT, s):
        if m.group().lower() in _KEYWORDS or s[m.end() :].lstrip().startswith("("):
            continue  # a keyword or a function call
        names.add(m.group())
    return names


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each `metric{matchers}` of an expression: (metric, [(label, op, value)])."""
    out = []
    for m in re.finditer(_IDENT + r"\s*\{([^}]*)\}", expr):
        name = m.group().split("{")[0].strip()
        matchers = re.findall(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', m.group(1))
        out.append((name, matchers))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by(...), without(...), on(...), ignoring(...), group_left/right(...)."""
    labels: set[str] = set()
    for m in re.finditer(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr
    ):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    return labels


def exposed_names(text: str) -> set[str]:
    """Every series name an exposition offers: from `# TYPE` lines (a counter's `_total`, a
    histogram's `_bucket`/`_sum`/`_count`) and from its sample lines."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "counter":
                names.add(name if name.endswith("_total") else f"{name}_total")
            elif kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            m = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)
            assert m, line
            names.add(m.group())
    return names


def exposed_labels(text: str) -> dict[str, dict[str, set[str]]]:
    """Series name -> label name -> the values seen in the exposition."""
    labels: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for k, v in sample.labels.items():
                labels[sample.name][k].add(v)
    return labels


def letters(prompt: Any) -> str | Exception:
    """The scripted judge of the live Monitors: the run's task says how it goes."""
    text = prompt.prefix_text()
    if "doomed" in text:
        return "A"  # score 0: aborts
    if "wobbly" in text:
        return "H"  # 0.37: resample when resample_below is 0.5
    if "flaky" in text and prompt.step == 2:
        return JudgeError("server_error", "the judge is overloaded")
    return "P"


async def exercised_monitor() -> str:
    """The exposition of a Monitor that has seen a bit of everything: labels, abort, resample, a
    judge error, bad input."""
    registry = CollectorRegistry()
    mon = Monitor(
        MonitorConfig(
            policy=Policy(abort_below=0.2, min_steps=1, patience=1),
            price_input=2.5,
            price_output=10.0,
            # Nothing listens there: the OTLP sink's series exist (and count the failures) all the
            # same.
            otlp_endpoint=f"http://127.0.0.1:{free_port()}",
        ),
        judge=FakeJudge(letters, max_retries=0),
        registry=registry,
        sinks=[Board(registry=registry)],
        # The OTLP traces receiver's series exist from start-up (by reason, at 0).
        sources=[OtlpReceiver(OtlpReceiverSettings(address="127.0.0.1:0"), registry=registry)],
    )
    async with mon:
        await mon.handle(
            "agents/good/start",
            b'{"task": "a good task", "family": "two", "group": "best-of-2", "labels": '
            b'{"group": "g1", "model": "m1"}}',
        )
        await mon.handle(
            "agents/doomed/start",
            b'{"task": "a doomed task", "family": "two", "group": "best-of-2", "labels": '
            b'{"group": "g2"}}',
        )
        await mon.handle(
            "agents/dip/start",
            b'{"task": "wobbly", "policy": {"resample_below": 0.5, "abort_below": null}}',
        )
        await mon.handle("agents/flaky/start", b'{"task": "flaky"}')
        for run in ("good", "doomed", "dip", "flaky"):
            await mon.handle(f"agents/{run}/step", b'{"index": 1, "text": "x"}')
        await mon.handle("agents/flaky/step", b'{"index": 2, "text": "y"}')
        await mon.handle("agents/broken/start", b"not json")
        await mon.handle("agents/ghost/end", b"{}")
        await asyncio.wait_for(mon.drain(), 10)
        await mon.handle("agents/good/end", b'{"outcome": "success"}')
        await asyncio.wait_for(mon.drain(), 10)  # the end is acted on by a scorer
        return generate_latest(mon.registry).decode()


@pytest.fixture(scope="module")
def exposition() -> str:
    return asyncio.run(exercised_monitor())


# -- the dashboard's structure --


def test_committed_json_is_what_generate_py_makes() -> None:
    out = subprocess.run(
        [sys.executable, str(DASHBOARDS / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def test_dashboard_identity_and_variables() -> None:
    d = load_dashboard()
    assert d["uid"] == "agent-monitor" and d["schemaVersion"] == 39 and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("instance", "run_id"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"] == DS, name
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*", name
    selector, label = label_values_query(variables["run_id"]["definition"])
    assert label == "run_id" and metric_names(to_promql(selector)) == {"agent_monitor_run_progress"}
    assert variables["run_id"]["query"]["query"] == variables["run_id"]["definition"]


def test_panels_have_unique_ids_and_use_the_datasource_variable() -> None:
    panels = list(all_panels(load_dashboard()))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), sorted(ids)
    assert len(panels) >= 15
    for p in panels:
        assert p["datasource"] == DS, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS, (p["title"], t["refId"])
            assert t["expr"].strip(), (p["title"], t["refId"])
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_panels_tile_the_grid_without_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for p in load_dashboard()["panels"]:
        g = p["gridPos"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{p['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = p["title"]


def test_the_issue_s_panels_are_there() -> None:
    exprs = {
        p["title"]: " ".join(t["expr"] for t in p.get("targets", []))
        for p in all_panels(load_dashboard())
    }
    everything = " ".join(exprs.values())

    def panel(*needles: str) -> None:
        assert any(all(n in e for n in needles) for e in exprs.values()), (
            f"no panel queries {needles}"
        )

    assert 'agent_monitor_run_progress{instance=~"$instance", run_id=~"$run_id"}' in everything
    panel("agent_monitor_run_progress", "agent_monitor_run_step", "agent_monitor_run_signal")
    panel("agent_monitor_signals_total", "abort|resample")
    for histogram in (
        "agent_monitor_judge_latency_seconds_bucket",
        "agent_monitor_step_to_score_seconds_bucket",
    ):
        panel("histogram_quantile(0.5, sum by (", histogram, "histogram_quantile(0.95")
    panel("agent_monitor_judge_tokens_total", "sum by (kind)")
    panel('kind="cached_input"', 'kind="input"')
    panel("agent_monitor_invalid_events_total", "by (reason)")
    panel("agent_monitor_queue_depth", "agent_monitor_outbox_depth")
    panel("agent_monitor_judge_calls_total", "outcome")
    panel("agent_monitor_runs_active")
    panel("agent_monitor_broker_connected")
    panel("agent_monitor_run_cost_usd", 'run_id=~"$run_id"')
    panel("agent_monitor_run_tokens", 'run_id=~"$run_id"')
    panel("agent_monitor_judge_cost_usd_total")
    panel("agent_monitor_group_leader_score")
    panel("agent_monitor_group_live_runs")
    panel("agent_monitor_pruned_total", "agent_monitor_compare_calls_total")
    # Cluster mode (issue 15): membership, ownership by replica, takeovers, adopted sessions,
    # fencing.
    panel("agent_monitor_cluster_replicas", "instance")
    panel("agent_monitor_runs_owned", "by (instance)")
    panel("rate(agent_monitor_run_takeovers_total")
    panel("agent_monitor_cluster_sessions_adopted_total")
    panel("agent_monitor_cluster_fenced_total", "what")


def test_runs_table_merges_instant_queries_with_the_same_labels() -> None:
    table = next(p for p in load_dashboard()["panels"] if p["type"] == "table")
    assert table["transformations"][0]["id"] == "merge"
    for t in table["targets"]:
        assert t["instant"] and not t["range"] and t["format"] == "table", t["refId"]
        # The metric name (and the signal label) are aggregated away so every frame has the same
        # labels.
        assert t["expr"].startswith(("max without () (", "max without (signal) (")), t["expr"]


# -- every query reads what the Monitor really exports --


def test_metric_names_are_extracted_from_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, judge) (rate(a_bucket{x="y", le=~"1e3"}[5m]))) '
        "* 1e3 / on (job) "
        'group_left (kind) b_total offset 5m > bool 2 unless c and label_replace(d, "dst", '
        '"$1", "src", "(.*)")'
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}
    assert selectors('rate(a{x="1", y=~"b|c"}[1m])') == [
        ("a", [("x", "=", "1"), ("y", "=~", "b|c")])
    ]
    assert grouping_labels("sum by (job, instance) (x) unless on (job) y") == {"job", "instance"}


def test_every_query_reads_exported_metrics_labels_and_values(exposition: str) -> None:
    names = exposed_names(exposition)
    labels = exposed_labels(exposition)
    assert "agent_monitor_run_progress" in names, "the live monitor exported no per-run series"
    queries = [*dashboard_queries(load_dashboard()), *alert_queries()]
    queries += [
        (f"variable {name}", selector) for name, selector, _ in variable_queries(load_dashboard())
    ]
    used: set[str] = set()
    for where, expr in queries:
        metrics = metric_names(expr)
        assert metrics, f"{where}: no metric in {expr!r}"
        missing = metrics - names - PROMETHEUS_SYNTHETIC
        assert not missing, f"{where}: {sorted(missing)} not exported by the monitor"
        used |= metrics
        for metric, matchers in selectors(expr):
            if metric in PROMETHEUS_SYNTHETIC:
                continue
            for label, op, value in matchers:
                if label in TARGET_LABELS:
                    continue
                assert label in labels[metric], f"{where}: {metric} has no label {label!r}"
                if op == "=" or (op == "=~" and re.fullmatch(r"[\w|]+", value)):
                    for v in value.split("|"):
                        assert v in labels[metric][label], (
                            f"{where}: {metric}{{{label}={v!r}}} is never exported"
                        )
        known_labels = (
            set().union(*(labels[m] for m in metrics if m in labels)) | TARGET_LABELS | {"le"}
        )
        assert grouping_labels(expr) <= known_labels, f"{where}: groups by unknown labels"
    # Every family the monitor exports is on the board or in an alert (rows of the contract don't go
    # unwatched).
    families = {
        f.name
        for f in text_string_to_metric_families(exposition)
        if not f.name.endswith("_created")
    }
    shown = {f for f in families if any(u == f or u.startswith(f + "_") for u in used)}
    unwatched = families - shown
    assert not unwatched, f"exported but on no panel and in no alert: {sorted(unwatched)}"


# -- promtool --


@needs_promtool
def test_promtool_checks_rules_and_config() -> None:
    assert PROMTOOL is not None
    rules = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(load_alerts())} rules found" in rules.stdout
    # `check config` also loads the rule_files it names (alerts.yml, relative to the config).
    config = subprocess.run(
        [PROMTOOL, "check", "config", str(DASHBOARDS / "prometheus.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert config.returncode == 0, config.stdout + config.stderr
    assert "SUCCESS: 1 rule files found" in config.stdout + config.stderr


@needs_promtool
def test_promtool_lints_the_live_exposition(exposition: str) -> None:
    assert PROMTOOL is not None
    out = subprocess.run(
        [PROMTOOL, "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def _series(name: str, instance: str, values: str, **labels: str) -> dict[str, str]:
    sel = ", ".join(
        f'{k}="{v}"' for k, v in {"job": "agent-monitor", "instance": instance, **labels}.items()
    )
    return {"series": f"{name}{{{sel}}}", "values": values}


def _alerts(name: str, *instances: str, **labels: str) -> list[dict[str, Any]]:
    rule = next(r for r in load_alerts() if r.get("alert") == name)
    return [
        {"exp_labels": {**rule["labels"], "job": "agent-monitor", "instance": i, **labels}}
        for i in sorted(instances)
    ]


# Minute-by-minute series ("0+10x20": 0, 10, 20, ... for 20 minutes) and which alerts they must
# raise, when.
RULE_TESTS: list[dict[str, Any]] = [
    {
        "input_series": [
            _series("agent_monitor_cluster_redis_emptied_total", "a:9464", "0 0 1x20"),
            _series("agent_monitor_cluster_redis_emptied_total", "b:9464", "0x22"),
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "AgentMonitorClusterRedisEmptied", "exp_alerts": []},
            {
                "eval_time": "3m",
                "alertname": "AgentMonitorClusterRedisEmptied",
                "exp_alerts": _alerts("AgentMonitorClusterRedisEmptied", "a:9464"),
            },
            # said, then quiet
            {"eval_time": "15m", "alertname": "AgentMonitorClusterRedisEmptied", "exp_alerts": []},
        ],
    },
    {
        "input_series": [
            _series("up", "dead:9464", "1 1 0x10"),
            _series("up", "alive:9464", "1x12"),
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "AgentMonitorDown", "exp_alerts": []},
            {
                "eval_time": "4m",
                "alertname": "AgentMonitorDown",
                "exp_alerts": _alerts("AgentMonitorDown", "dead:9464"),
            },
        ],
    },
    {
        "input_series": [
            _series(
                "agent_monitor_judge_calls_total",
                "bad:9464",
                "0+10x20",
                judge="openai",
                outcome="error",
            ),
            _series(
                "agent_monitor_judge_calls_total",
                "bad:9464",
                "0+2x20",
                judge="openai",
                outcome="ok",
            ),
            _series(
                "agent_monitor_judge_calls_total",
                "fine:9464",
                "0+1x20",
                judge="openai",
                outcome="error",
            ),
            _series(
                "agent_monitor_judge_calls_total",
                "fine:9464",
                "0+10x20",
                judge="openai",
                outcome="ok",
            ),
        ],
        "alert_rule_test": [
            # pending: for 5m
            {"eval_time": "3m", "alertname": "AgentMonitorJudgeErrors", "exp_alerts": []},
            {
                "eval_time": "12m",
                "alertname": "AgentMonitorJudgeErrors",
                "exp_alerts": _alerts("AgentMonitorJudgeErrors", "bad:9464", judge="openai"),
            },
        ],
    },
    {
        "input_series": [
            _series("agent_monitor_events_total", "stuck:9464", "0+5x20", type="step"),
            _series("agent_monitor_scorings_total", "stuck:9464", "0x20", outcome="ok"),
            _series("agent_monitor_scorings_total", "stuck:9464", "0+5x20", outcome="failed"),
            _series("agent_monitor_events_total", "fine:9464", "0+5x20", type="step"),
            _series("agent_monitor_scorings_total", "fine:9464", "0+4x20", outcome="ok"),
            _series("agent_monitor_events_total", "idle:9464", "0x20", type="step"),
            _series("agent_monitor_scorings_total", "idle:9464", "0x20", outcome="ok"),
        ],
        "alert_rule_test": [
            {
                "eval_time": "12m",
                "alertname": "AgentMonitorJudgeStuck",
                "exp_alerts": _alerts("AgentMonitorJudgeStuck", "stuck:9464"),
            },
        ],
    },
    {
        "input_series": [
            _series("agent_monitor_signals_total", "storm:9464", "0+3x20", signal="abort"),
            _series("agent_monitor_signals_total", "calm:9464", "0+1x20", signal="abort"),
            _series("agent_monitor_signals_total", "calm:9464", "0+30x20", signal="resample"),
        ],
        "alert_rule_test": [
            {
                "eval_time": "10m",
                "alertname": "AgentMonitorAbortStorm",
                "exp_alerts": _alerts("AgentMonitorAbortStorm", "storm:9464"),
            },
        ],
    },
    {
        "input_series": [
            _series("agent_monitor_broker_connected", "lost:9464", "1 1 0x10"),
            _series("agent_monitor_broker_connected", "linked:9464", "1x12"),
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "AgentMonitorBrokerDisconnected", "exp_alerts": []},
            {
                "eval_time": "4m",
                "alertname": "AgentMonitorBrokerDisconnected",
                "exp_alerts": _alerts("AgentMonitorBrokerDisconnected", "lost:9464"),
            },
        ],
    },
    {
        "input_series": [
            _series("agent_monitor_outbox_dropped_total", "full:9464", "0 0 0 5 5 5 5 5 5 5 5 5"),
            _series("agent_monitor_outbox_dropped_total", "fine:9464", "0x12"),
        ],
        "alert_rule_test": [
            {
                "eval_time": "4m",
                "alertname": "AgentMonitorOutboxDropping",
                "exp_alerts": _alerts("AgentMonitorOutboxDropping", "full:9464"),
            },
            # Five minutes after the last drop the alert resolves.
            {"eval_time": "10m", "alertname": "AgentMonitorOutboxDropping", "exp_alerts": []},
        ],
    },
    {
        "input_series": [
            _series("agent_monitor_otlp_export_failures_total", "down:9464", "0+1x20"),
            _series("agent_monitor_otlp_exported_events_total", "down:9464", "0x20"),
            # A collector that fails now and then but still takes events is not down.
            _series("agent_monitor_otlp_export_failures_total", "flaky:9464", "0+1x20"),
            _series("agent_monitor_otlp_exported_events_total", "flaky:9464", "0+100x20"),
        ],
        "alert_rule_test": [
            # pending: for 5m
            {"eval_time": "3m", "alertname": "AgentMonitorOtlpExportFailing", "exp_alerts": []},
            {
                "eval_time": "8m",
                "alertname": "AgentMonitorOtlpExportFailing",
                "exp_alerts": _alerts("AgentMonitorOtlpExportFailing", "down:9464"),
            },
        ],
    },
    {
        "input_series": [
            _series(
                "agent_monitor_broker_dropped_messages",
                "lossy:9464",
                "0 0 0 12 12 12 12 12 12 12 12 12",
            ),
            _series("agent_monitor_broker_dropped_messages", "fine:9464", "40x12"),
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "AgentMonitorBrokerDropping", "exp_alerts": []},
            {
                "eval_time": "4m",
                "alertname": "AgentMonitorBrokerDropping",
                "exp_alerts": _alerts("AgentMonitorBrokerDropping", "lossy:9464"),
            },
            # A count that stopped rising: five minutes later the alert resolves.
            {"eval_time": "10m", "alertname": "AgentMonitorBrokerDropping", "exp_alerts": []},
        ],
    },
    {
        "input_series": [
            _series("agent_monitor_run_series_capped", "flooded:9464", "3x20"),
            _series("agent_monitor_run_series_capped", "fine:9464", "0x20"),
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "AgentMonitorSeriesCapped", "exp_alerts": []},
            {
                "eval_time": "16m",
                "alertname": "AgentMonitorSeriesCapped",
                "exp_alerts": _alerts("AgentMonitorSeriesCapped", "flooded:9464"),
            },
        ],
    },
]


@needs_promtool
def test_alert_rules_fire_when_they_should_and_only_then(tmp_path: Path) -> None:
    tested = {t["alertname"] for case in RULE_TESTS for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in load_alerts()}, "every alert rule has a unit test"
    # promtool compares annotations too; they are prose, so the rules are tested without them.
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "alerts.yml"
    rules.write_text(yaml.safe_dump(doc))
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules)],
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", **case} for case in RULE_TESTS],
            }
        )
    )
    assert PROMTOOL is not None
    out = subprocess.run(
        [PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
