"""Generate `agent-monitor.json`, the Grafana dashboard of the monitor daemon's Prometheus metrics.

    python dashboards/generate.py # rewrite dashboards/agent-monitor.json python
    dashboards/generate.py --check # exit 1 if the committed JSON is not what this script makes

The committed JSON is what users import; this script only keeps it consistent (unique ids, one
datasource variable everywhere, a gapless grid). Plain dicts in Grafana's classic JSON model
(schemaVersion 39, Grafana 11); no Grafana SDK needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("agent-monitor.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24

# Every query is scoped to the selected daemons; per-run queries to the selected runs too.
INST = 'instance=~"$instance"'
RUNS = f'{INST}, run_id=~"$run_id"'
RATE = "$__rate_interval"

SIGNAL_CODES = {"0": ("continue", "green"), "1": ("resample", "orange"), "2": ("abort", "red")}


def target(
    ref: str, expr: str, legend: str = "__auto", *, instant: bool = False, table: bool = False
) -> dict[str, Any]:
    """One Prometheus query of a panel."""
    t: dict[str, Any] = {
        "datasource": DS,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "editorMode": "code",
    }
    if table:
        t["format"] = "table"
    return t


def timeseries(
    title: str,
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    description: str = "",
    w: int = 8,
    h: int = 8,
    min_: float | None = 0,
    max_: float | None = None,
    no_value: str | None = None,
    stack: bool = False,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        },
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    if no_value is not None:
        defaults["noValue"] = no_value
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "_size": (w, h),
    }


def stat(
    title: str,
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    description: str = "",
    mappings: list[dict[str, Any]] | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
    text_mode: str = "auto",
    w: int = 6,
    h: int = 4,
) -> dict[str, Any]:
    steps = [{"value": v, "color": c} for v, c in (thresholds or [(None, "green")])]
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "mappings": mappings or [],
                "thresholds": {"mode": "absolute", "steps": steps},
                "color": {"mode": "thresholds"},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "justifyMode": "auto",
            "textMode": text_mode,
            "orientation": "auto",
        },
        "_size": (w, h),
    }


def value_map(codes: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    return [
        {
            "type": "value",
            "options": {
                code: {"text": text, "color": color, "index": i}
                for i, (code, (text, color)) in enumerate(codes.items())
            },
        }
    ]


def quantiles(metric: str, by: str = "") -> list[dict[str, Any]]:
    """p50 and p95 of a histogram over the selected daemons."""
    group = f"{by}, le" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        target(
            ref,
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{INST}}}[{RATE}])))",
            f"p{int(q * 100)}{suffix}",
        )
        for ref, q in (("A", 0.5), ("B", 0.95))
    ]


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_size": (WIDTH, 1)}


def runs_table() -> dict[str, Any]:
    """One row per live run: progress, uncertainty, step and current signal, merged on the run's
    labels.

    Each query aggregates away `__name__` (and the signal gauge its `signal` label, folded into a
    code 0 continue / 1 resample / 2 abort) so all four have the same label set and Grafana's merge
    joins them.
    """
    sig = f'agent_monitor_run_signal{{{RUNS}, signal="%s"}} == 1'
    signal_code = (
        f"max without (signal) (({sig % 'abort'}) * 2 or ({sig % 'resample'}) * 1 or "
        f"({sig % 'continue'}) * 0)"
    )
    targets = [
        target(
            "A", f"max without () (agent_monitor_run_progress{{{RUNS}}})", instant=True, table=True
        ),
        target(
            "B",
            f"max without () (agent_monitor_run_uncertainty{{{RUNS}}})",
            instant=True,
            table=True,
        ),
        target("C", f"max without () (agent_monitor_run_step{{{RUNS}}})", instant=True, table=True),
        target("D", signal_code, instant=True, table=True),
    ]

    def override(field: str, props: list[dict[str, Any]]) -> dict[str, Any]:
        return {"matcher": {"id": "byName", "options": field}, "properties": props}

    return {
        "type": "table",
        "title": "Current runs",
        "description": "Every live run of the selected daemons: latest score, its "
        "uncertainty, the latest scored step and the "
        "current signal. Ended runs leave the table a grace period after they end.",
        "targets": targets,
        "transformations": [
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "job": True},
                    "indexByName": {
                        "run_id": 0,
                        "Value #A": 1,
                        "Value #B": 2,
                        "Value #C": 3,
                        "Value #D": 4,
                    },
                    "renameByName": {
                        "Value #A": "progress",
                        "Value #B": "uncertainty",
                        "Value #C": "step",
                        "Value #D": "signal",
                    },
                },
            },
            {"id": "sortBy", "options": {"sort": [{"field": "progress", "desc": False}]}},
        ],
        "fieldConfig": {
            "defaults": {"custom": {"align": "auto", "cellOptions": {"type": "auto"}}},
            "overrides": [
                override(
                    "progress",
                    [
                        {"id": "unit", "value": "percentunit"},
                        {"id": "min", "value": 0},
                        {"id": "max", "value": 1},
                        {"id": "custom.cellOptions", "value": {"type": "gauge", "mode": "basic"}},
                        {
                            "id": "thresholds",
                            "value": {
                                "mode": "absolute",
                                "steps": [
                                    {"value": None, "color": "red"},
                                    {"value": 0.2, "color": "orange"},
                                    {"value": 0.5, "color": "green"},
                                ],
                            },
                        },
                    ],
                ),
                override("uncertainty", [{"id": "decimals", "value": 2}]),
                override("step", [{"id": "decimals", "value": 0}]),
                override(
                    "signal",
                    [
                        {"id": "mappings", "value": value_map(SIGNAL_CODES)},
                        {"id": "custom.cellOptions", "value": {"type": "color-text"}},
                    ],
                ),
            ],
        },
        "options": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
        "_size": (WIDTH, 9),
    }


def panels() -> list[dict[str, Any]]:
    return [
        row("Runs"),
        stat(
            "Runs active",
            [target("A", f"sum(agent_monitor_runs_active{{{INST}}})", "runs")],
            description="Runs the selected daemons are following now.",
            w=5,
        ),
        stat(
            "Broker",
            [target("A", f"agent_monitor_broker_connected{{{INST}}}", "{{instance}}")],
            description="1 while the daemon is connected to its MQTT broker.",
            mappings=value_map({"0": ("disconnected", "red"), "1": ("connected", "green")}),
            thresholds=[(None, "red"), (1, "green")],
            w=5,
        ),
        stat(
            "Judge",
            [
                target(
                    "A",
                    f"max by (instance) (agent_monitor_judge_degraded{{{INST}}})",
                    "{{instance}}",
                )
            ],
            description="degraded while the judge's circuit breaker is open: the judge keeps "
            "failing, scoring waits "
            "for it (runs are never aborted for it).",
            mappings=value_map({"0": ("ok", "green"), "1": ("degraded", "red")}),
            thresholds=[(None, "green"), (1, "red")],
            w=5,
        ),
        stat(
            "Runs not exported (series cap)",
            [target("A", f"sum(agent_monitor_run_series_capped{{{INST}}})", "runs")],
            description="Live runs without per-run series because the daemon's series cap is "
            "reached; they are still "
            "monitored and counted everywhere else.",
            thresholds=[(None, "green"), (1, "orange")],
            w=5,
        ),
        stat(
            "Version",
            [
                target(
                    "A", f"count by (version) (agent_monitor_build_info{{{INST}}})", "{{version}}"
                )
            ],
            description="agent-monitor versions of the selected daemons (value: how many "
            "daemons run it).",
            text_mode="name",
            thresholds=[(None, "blue")],
            w=4,
        ),
        timeseries(
            "Live progress per run",
            [target("A", f"agent_monitor_run_progress{{{RUNS}}}", "{{run_id}}")],
            unit="percentunit",
            min_=0,
            max_=1,
            w=16,
            h=9,
            description="Latest judged score of each live run, in [0, 1]. A run's line ends "
            "a grace period after the "
            "run ends or expires.",
        ),
        timeseries(
            "Aborts and resamples per minute",
            [
                target(
                    "A",
                    f"sum by (signal) (rate(agent_monitor_signals_total{{{INST}, "
                    f'signal=~"abort|resample"}}[{RATE}])) * 60',
                    "{{signal}}",
                )
            ],
            w=8,
            h=9,
            description="Signal changes to abort or resample published per minute.",
        ),
        runs_table(),
        timeseries(
            "Uncertainty per run",
            [target("A", f"agent_monitor_run_uncertainty{{{RUNS}}}", "{{run_id}}")],
            min_=0,
            w=12,
            description="Standard deviation of each live run's latest score: the judge's own "
            "spread over the letters, "
            "the disagreement between repeats and, for a judge without logprobs, the "
            "sampling error. The policy "
            "ignores scores above --max-uncertainty.",
        ),
        timeseries(
            "Disagreement between repeats per run (spread)",
            [target("A", f"agent_monitor_run_spread{{{RUNS}}}", "{{run_id}}")],
            min_=0,
            w=12,
            description="Standard deviation of the judge's repeats' expectations on each "
            "live run's latest score "
            "(--repeats; weighted over criteria). Always 0 with one repeat; a high value "
            "says the judge cannot make "
            "up its mind about that run: more repeats, or a stronger judge.",
        ),
        timeseries(
            "Runs ended per minute, by outcome",
            [
                target(
                    "A",
                    f"sum by (outcome) (rate(agent_monitor_runs_total{{{INST}}}[{RATE}])) * 60",
                    "{{outcome}}",
                )
            ],
            w=12,
            description="Runs that ended (success, failure, scored, unknown), expired after "
            "the idle timeout, or "
            "were evicted by the live-run cap.",
        ),
        timeseries(
            "Events and scorings per second",
            [
                target(
                    "A",
                    f"sum by (type) (rate(agent_monitor_events_total{{{INST}}}[{RATE}]))",
                    "{{type}}",
                ),
                target(
                    "B",
                    f"sum by (outcome) (rate(agent_monitor_scorings_total{{{INST}}}[{RATE}]))",
                    "scoring {{outcome}}",
                ),
                target(
                    "C",
                    f"sum(rate(agent_monitor_duplicate_steps_total{{{INST}}}[{RATE}]))",
                    "duplicate steps",
                ),
                target(
                    "D",
                    "sum by (reason) "
                    f"(rate(agent_monitor_scoring_failures_total{{{INST}}}[{RATE}]))",
                    "no score: {{reason}}",
                ),
            ],
            unit="ops",
            w=12,
            description="Input events accepted by type, prefix scorings by result (one "
            "scoring may cover "
            "several coalesced steps), re-delivered steps ignored as duplicates, and "
            "scorings that gave no "
            "score by reason (judge failures, low_mass, extractor_timeout, ...).",
        ),
        row("Calibration"),
        timeseries(
            "Calibrated abort thresholds (abort_below auto)",
            [
                target(
                    "A",
                    f"agent_monitor_calibrated_threshold{{{INST}}}",
                    "{{family}} ({{model}}, {{rubric}})",
                )
            ],
            unit="percentunit",
            min_=0,
            max_=1,
            w=12,
            description="Each family's abort_below auto threshold under the daemon's own "
            "policy flags and --alpha: "
            "at most that share of the family's successful runs is aborted. A family has no "
            "line until it has "
            "enough successful runs (19 at alpha 0.05); until then its auto runs are never "
            "aborted.",
        ),
        timeseries(
            "Successful runs learnt from, per family",
            [
                target(
                    "A",
                    f"agent_monitor_calibration_successes{{{INST}}}",
                    "{{family}} ({{model}}, {{rubric}})",
                )
            ],
            w=8,
            description="Runs of each family (with its judge model and rubric) that ended "
            "with a success: the "
            "evidence its threshold rests on. A new judge model or rubric starts from nothing.",
        ),
        stat(
            "Families not exported (cap)",
            [target("A", f"sum(agent_monitor_calibration_series_capped{{{INST}}})", "families")],
            description="Calibration families without series: not on --metric-families, or "
            "past --max-families. "
            "They are still calibrated and used.",
            thresholds=[(None, "green"), (1, "orange")],
            w=4,
            h=8,
        ),
        row("Groups (best of N)"),
        timeseries(
            "Group leader score",
            [target("A", f"agent_monitor_group_leader_score{{{INST}}}", "{{group}}")],
            unit="percentunit",
            min_=0,
            max_=1,
            w=8,
            description="The score of each group's leading run (rank 1 of its retained ranking on "
            "{prefix}/_groups/{group}/ranking): the best of the sibling runs started with "
            "the same start.group.",
        ),
        timeseries(
            "Live runs per group",
            [target("A", f"agent_monitor_group_live_runs{{{INST}}}", "{{group}}")],
            w=6,
            description="Sibling runs still live in each group; pruned and ended runs are "
            "not counted. The group "
            "policy never prunes below keep_top live runs.",
        ),
        timeseries(
            "Pruned runs and pairwise judge calls per minute",
            [
                target(
                    "A", f"sum(rate(agent_monitor_pruned_total{{{INST}}}[{RATE}])) * 60", "pruned"
                ),
                target(
                    "B",
                    "sum by (outcome) "
                    f"(rate(agent_monitor_compare_calls_total{{{INST}}}[{RATE}])) * 60",
                    "compare calls {{outcome}}",
                ),
                target(
                    "C",
                    f"sum(rate(agent_monitor_compare_calls_saved_total{{{INST}}}[{RATE}])) * 60",
                    "compare calls saved (majority)",
                ),
                target(
                    "D",
                    "sum by (call, event) "
                    f"(rate(agent_monitor_groups_uniform_total{{{INST}}}[{RATE}])) * 60",
                    "groups {{event}} {{call}}",
                ),
            ],
            w=6,
            description="Runs pruned by the group policy (aborted with pruned: true, behind "
            "their siblings by more "
            "than prune_margin), the judge calls spent comparing leaders pairwise (policy "
            "compare: true; "
            "zero unless it is on) and those the majority shortcut saved, and groups flagged "
            "early as all_fail or "
            "all_pass (flagged, withdrawn, contradicted: a wrong early call; docs/groups.md).",
        ),
        stat(
            "Groups not exported / refused, outcomes refused",
            [
                target("A", f"sum(agent_monitor_group_series_capped{{{INST}}})", "not exported"),
                target(
                    "B", f"sum(agent_monitor_groups_refused_total{{{INST}}})", "starts in no group"
                ),
                target(
                    "C",
                    f"sum by (reason) (agent_monitor_outcomes_refused_total{{{INST}}})",
                    "outcomes refused {{reason}}",
                ),
                target(
                    "D",
                    f"sum(agent_monitor_groups_split_total{{{INST}}})",
                    "starts split off their group",
                ),
                target(
                    "E",
                    f"sum by (kind) (agent_monitor_retained_inputs_total{{{INST}}})",
                    "retained {{kind}} ignored",
                ),
            ],
            description="Groups without gauges (not on --metric-groups, or past "
            "--max-group-series; still ranked and "
            "pruned), starts scored in no group because their group was full "
            "(--max-group-runs), the monitor had "
            "--max-groups groups, or the start may not join (other group settings, no group "
            "auth); starts of another "
            "task or rubric ranked apart in a group split off the name they gave; run "
            "outcomes that taught nothing "
            "(unauthenticated with --outcome-secret, replayed, stale, or over "
            "--calibration-rate); and retained "
            "input messages ignored (a stored copy re-delivered at a restart, never run again).",
            thresholds=[(None, "green"), (1, "orange")],
            w=4,
            h=8,
        ),
        row("Judge"),
        timeseries(
            "Judge latency p50 / p95",
            quantiles("agent_monitor_judge_latency_seconds", "judge"),
            unit="s",
            description="Wall time of one judge call, retries included.",
        ),
        timeseries(
            "Step-to-score lag p50 / p95",
            quantiles("agent_monitor_step_to_score_seconds"),
            unit="s",
            description="From a step's arrival to the publication of the score that includes "
            "it: queueing, "
            "coalescing and the judge call.",
        ),
        timeseries(
            "Judge calls per second, by outcome",
            [
                target(
                    "A",
                    "sum by (judge, outcome) "
                    f"(rate(agent_monitor_judge_calls_total{{{INST}}}[{RATE}]))",
                    "{{judge}} {{outcome}}",
                )
            ],
            unit="reqps",
        ),
        timeseries(
            "Judge tokens per second, by kind",
            [
                target(
                    "A",
                    f"sum by (kind) (rate(agent_monitor_judge_tokens_total{{{INST}}}[{RATE}]))",
                    "{{kind}}",
                ),
                target(
                    "B",
                    f"sum(rate(agent_monitor_run_judge_tokens_sum{{{INST}}}[{RATE}])) / "
                    f"sum(rate(agent_monitor_run_judge_tokens_count{{{INST}}}[{RATE}]))",
                    "per closed run",
                ),
                target(
                    "C",
                    f"sum(rate(agent_monitor_decision_judge_tokens_sum{{{INST}}}[{RATE}])) / "
                    f"sum(rate(agent_monitor_decision_judge_tokens_count{{{INST}}}[{RATE}]))",
                    "per decision",
                ),
                target(
                    "D",
                    "sum by (reason) "
                    f"(rate(agent_monitor_scorings_skipped_total{{{INST}}}[{RATE}]))",
                    "steps skipped/s ({{reason}})",
                ),
            ],
            w=12,
            description="input includes cached_input (the share of the prompt the provider "
            "served from its cache). "
            "Per closed run and per decision (a change of signal): the tokens a run spent, "
            "on average; with "
            "policy schedule adaptive, the steps it did not score alone (docs/schedule.md).",
        ),
        timeseries(
            "Prompt cache-hit share",
            [
                target(
                    "A",
                    f"sum(rate(agent_monitor_judge_tokens_total{{{INST}, "
                    f'kind="cached_input"}}[{RATE}]))'
                    f" / sum(rate(agent_monitor_judge_tokens_total{{{INST}, "
                    f'kind="input"}}[{RATE}]))',
                    "cached / input",
                )
            ],
            unit="percentunit",
            min_=0,
            max_=1,
            w=6,
            description="cached_input / input tokens: how much of each prompt the judge's "
            "prefix cache served.",
        ),
        timeseries(
            "Judge calls saved, steps coalesced, frames unseen",
            [
                target(
                    "A",
                    f"sum(rate(agent_monitor_judge_calls_saved_total{{{INST}}}[{RATE}]))",
                    "calls saved",
                ),
                target(
                    "B",
                    f"sum(rate(agent_monitor_coalesced_steps_total{{{INST}}}[{RATE}]))",
                    "steps coalesced",
                ),
                target(
                    "C",
                    f"sum(rate(agent_monitor_images_dropped_total{{{INST}}}[{RATE}]))",
                    "frames unseen",
                ),
                target(
                    "D",
                    f"sum(rate(agent_monitor_scorings_held_total{{{INST}}}[{RATE}]))",
                    "scorings held",
                ),
                target(
                    "E",
                    f"sum(rate(agent_monitor_scorings_superseded_total{{{INST}}}[{RATE}]))",
                    "scorings superseded",
                ),
            ],
            unit="ops",
            w=6,
            description="Judge calls not made because confident rules answered, steps folded "
            "into a later "
            "step's scoring while the judge was busy, and frames the judge got as text "
            "placeholders (a text-only "
            "judge, or a model that refused images: see the judge_refuses_images warning). "
            "Scorings held: not "
            "started while the run's last score still waited to be published (the publisher "
            "is behind); "
            "superseded: newer steps came while the judge read the prefix.",
        ),
        row("Cost"),
        timeseries(
            "Judge cost per hour",
            [
                target(
                    "A",
                    f"sum(rate(agent_monitor_judge_cost_usd_total{{{INST}}}[{RATE}])) * 3600",
                    "USD per hour",
                )
            ],
            unit="currencyUSD",
            no_value="no prices (--price-input, --price-output)",
            description="What the judge's tokens cost per hour, at the daemon's "
            "--price-input, --price-cached-input "
            "and --price-output (USD per million tokens). No line without prices.",
        ),
        timeseries(
            "Cost per run",
            [target("A", f"agent_monitor_run_cost_usd{{{RUNS}}}", "{{run_id}}")],
            unit="currencyUSD",
            no_value="no prices (--price-input, --price-output)",
            description="Each live run's judge cost so far: its tokens over every scoring "
            "(failed and coalesced ones "
            "included, continued across daemon restarts) at the daemon's prices.",
        ),
        timeseries(
            "Judge tokens per run",
            [target("A", f"sum without (kind) (agent_monitor_run_tokens{{{RUNS}}})", "{{run_id}}")],
            description="Each live run's judge tokens so far, every kind together (input, "
            "which includes "
            "cached_input, plus output); agent_monitor_run_tokens has them by kind.",
        ),
        row("Pipeline health"),
        timeseries(
            "Invalid events per second, by reason",
            [
                target(
                    "A",
                    "sum by (reason) "
                    f"(rate(agent_monitor_invalid_events_total{{{INST}}}[{RATE}])) > 0",
                    "{{reason}}",
                )
            ],
            unit="ops",
            w=12,
            no_value="no invalid events",
            description="Input events refused, by reason (each one is also published on the "
            "run's error topic). "
            "Only reasons that occurred are drawn.",
        ),
        timeseries(
            "Queue and outbox depth",
            [
                target("A", f"agent_monitor_queue_depth{{{INST}}}", "queue {{instance}}"),
                target("B", f"agent_monitor_outbox_depth{{{INST}}}", "outbox {{instance}}"),
            ],
            w=12,
            description="queue: runs waiting for a scorer (each run at most once). outbox: "
            "messages waiting to be "
            "published to the broker.",
        ),
        timeseries(
            "Outbox drops, broker drops and reconnects",
            [
                target(
                    "A",
                    "sum by (instance) "
                    f"(increase(agent_monitor_outbox_dropped_total{{{INST}}}[{RATE}]))",
                    "dropped {{instance}}",
                ),
                target(
                    "B",
                    "sum by (instance) "
                    f"(increase(agent_monitor_broker_reconnects_total{{{INST}}}[{RATE}]))",
                    "reconnects {{instance}}",
                ),
                target(
                    "C",
                    "max by (instance) "
                    f"(increase(agent_monitor_broker_dropped_messages{{{INST}}}[{RATE}]))",
                    "broker dropped {{instance}}",
                ),
            ],
            w=24,
            h=7,
            description="Progress messages dropped because the outbox was full (signals are "
            "never dropped), "
            "reconnections to the broker, and messages the broker itself dropped (its $SYS "
            "count, any client's: "
            "queues full; see docs/broker-settings.md).",
        ),
        timeseries(
            "OpenTelemetry export (serve --otlp-endpoint)",
            [
                target(
                    "A",
                    "sum by (instance) "
                    f"(rate(agent_monitor_otlp_exported_events_total{{{INST}}}[{RATE}]))",
                    "exported {{instance}}",
                ),
                target(
                    "B",
                    "sum by (instance, reason) "
                    f"(rate(agent_monitor_otlp_dropped_events_total{{{INST}}}[{RATE}]))",
                    "dropped ({{reason}}) {{instance}}",
                ),
                target(
                    "C",
                    "sum by (instance) "
                    f"(rate(agent_monitor_otlp_export_failures_total{{{INST}}}[{RATE}]))",
                    "failed requests {{instance}}",
                ),
                target("D", f"agent_monitor_otlp_queue_depth{{{INST}}}", "queued {{instance}}"),
            ],
            unit="ops",
            w=12,
            no_value="no OTLP endpoint",
            description="gen_ai.evaluation.result events sent to the OTLP collector per "
            "second, events dropped (queue "
            "full, export failed, still queued at shutdown), failed export requests, and the "
            "export queue. Empty "
            "when no daemon has --otlp-endpoint.",
        ),
        timeseries(
            "Web board browsers",
            [
                target("A", f"agent_monitor_board_clients{{{INST}}}", "following {{instance}}"),
                target(
                    "B",
                    "sum by (instance, reason) "
                    f"(increase(agent_monitor_board_clients_dropped_total{{{INST}}}[{RATE}]))",
                    "dropped ({{reason}}) {{instance}}",
                ),
            ],
            w=12,
            no_value="board off",
            description="Browsers following the live board (/events) now, and browsers let "
            "go: slow (fell behind "
            "their queue; they reconnect to a fresh snapshot) or full (over "
            "--board-clients). Scoring never waits "
            "for a browser.",
        ),
        row("OpenTelemetry traces in (serve --otlp-receiver)"),
        timeseries(
            "Spans received, accepted, ignored, refused",
            [
                target(
                    "A",
                    "sum by (instance) "
                    f"(rate(agent_monitor_otlp_spans_received_total{{{INST}}}[{RATE}]))",
                    "received {{instance}}",
                ),
                target(
                    "B",
                    "sum by (instance) "
                    f"(rate(agent_monitor_otlp_spans_accepted_total{{{INST}}}[{RATE}]))",
                    "accepted {{instance}}",
                ),
                target(
                    "C",
                    "sum by (instance, reason) "
                    f"(rate(agent_monitor_otlp_spans_ignored_total{{{INST}}}[{RATE}]))",
                    "ignored ({{reason}}) {{instance}}",
                ),
                target(
                    "D",
                    "sum by (instance, reason) "
                    f"(rate(agent_monitor_otlp_spans_refused_total{{{INST}}}[{RATE}]))",
                    "refused ({{reason}}) {{instance}}",
                ),
                target(
                    "E",
                    "sum by (instance, kind) "
                    f"(rate(agent_monitor_otlp_span_items_dropped_total{{{INST}}}[{RATE}]))",
                    "{{kind}} dropped past the cap {{instance}}",
                ),
            ],
            unit="ops",
            w=10,
            no_value="no OTLP receiver",
            description="Spans per second in the trace export requests, taken into runs, "
            "taken but unused (no agent "
            "action, a model turn without recorded content, a duplicate, a span of an ended "
            "run), and refused by "
            "reason (the exporter was told: partial success, 400, 413, or 503 to retry); and "
            "the span events, links "
            "and attributes dropped past their per-span caps (a span bomb shows here). Empty "
            "when no daemon has "
            "--otlp-receiver.",
        ),
        timeseries(
            "Trace-fed runs, late spans, requests",
            [
                target("A", f"agent_monitor_otlp_traces_live{{{INST}}}", "live {{instance}}"),
                target(
                    "B",
                    "sum by (instance) "
                    f"(increase(agent_monitor_otlp_late_spans_total{{{INST}}}[{RATE}]))",
                    "late {{instance}}",
                ),
                target(
                    "C", f"agent_monitor_otlp_connections{{{INST}}}", "connections {{instance}}"
                ),
                target(
                    "D",
                    "sum by (instance, code) "
                    f"(increase(agent_monitor_otlp_receiver_requests_total{{{INST}}}[{RATE}]))",
                    "requests {{code}} {{instance}}",
                ),
                target(
                    "E",
                    "sum by (instance) "
                    f"(increase(agent_monitor_otlp_attributes_truncated_total{{{INST}}}[{RATE}]))",
                    "attributes cut {{instance}}",
                ),
            ],
            w=7,
            no_value="no OTLP receiver",
            description="Runs the receiver follows (one per trace, conversation or "
            "agent_monitor.run_id), action "
            "spans that arrived after later ones were sent (appended as the next step, "
            "marked late), open "
            "exporter connections (bounded by --otlp-max-connections), export requests by "
            "HTTP status, and "
            "attribute values cut to --otlp-max-attribute-bytes.",
        ),
        timeseries(
            "Last span to final score",
            quantiles("agent_monitor_otlp_final_score_seconds"),
            unit="s",
            w=7,
            no_value="no trace ended yet",
            description="Seconds from a trace-fed run's last span to its final score (the "
            "run closed): the judge's "
            "time for the last prefix plus queueing. Idle-closed runs count from their last "
            "span, so they show "
            "--otlp-idle here.",
        ),
        row("Cluster (serve --cluster)"),
        timeseries(
            "Live replicas, as each replica sees them",
            [target("A", f"agent_monitor_cluster_replicas{{{INST}}}", "{{instance}}")],
            w=6,
            no_value="not in cluster mode",
            description="Replicas with a fresh heartbeat in the cluster's Redis, counted by "
            "each replica. All lines "
            "agree in a healthy cluster; a replica that sees fewer than the others is cut "
            "off from Redis. A replica "
            "that stops is counted for one --cluster-lease more, then its runs are taken over.",
        ),
        timeseries(
            "Runs owned per replica",
            [
                target(
                    "A", f"sum by (instance) (agent_monitor_runs_owned{{{INST}}})", "{{instance}}"
                )
            ],
            w=6,
            stack=True,
            no_value="not in cluster mode",
            description="Runs each replica owns (holds the lease of, scores and publishes "
            "for). Placement keeps "
            "them within one of each other, groups excepted (a group's runs stay on one "
            "replica); stacked, the "
            "total is the cluster's live runs.",
        ),
        timeseries(
            "Run takeovers per minute",
            [
                target(
                    "A",
                    "sum by (instance) "
                    f"(rate(agent_monitor_run_takeovers_total{{{INST}}}[{RATE}])) * 60",
                    "{{instance}}",
                )
            ],
            w=4,
            no_value="not in cluster mode",
            description="Runs a replica took over from another owner: a dead replica's runs "
            "(lease expired), runs "
            "handed over by a replica that stopped, or moved to a replica that joined. Zero "
            "while nothing changes.",
        ),
        timeseries(
            "MQTT sessions adopted",
            [
                target(
                    "A",
                    "sum by (instance) "
                    f"(increase(agent_monitor_cluster_sessions_adopted_total{{{INST}}}[{RATE}]))",
                    "{{instance}}",
                )
            ],
            w=4,
            no_value="not in cluster mode",
            description="Dead replicas' broker sessions this replica took over: it connected "
            "with the dead "
            "replica's client id, journaled the messages the broker had queued for it and "
            "ended the session.",
        ),
        timeseries(
            "Fenced writes and publications, Redis errors",
            [
                target(
                    "A",
                    "sum by (instance, what) "
                    f"(increase(agent_monitor_cluster_fenced_total{{{INST}}}[{RATE}]))",
                    "fenced {{what}} {{instance}}",
                ),
                target(
                    "B",
                    "sum by (instance, op) "
                    f"(increase(agent_monitor_cluster_errors_total{{{INST}}}[{RATE}]))",
                    "redis {{op}} failed {{instance}}",
                ),
                target(
                    "C",
                    "sum by (instance) "
                    f"(increase(agent_monitor_cluster_redis_emptied_total{{{INST}}}[{RATE}]))",
                    "redis came back EMPTY {{instance}}",
                ),
            ],
            w=4,
            no_value="not in cluster mode",
            description="Writes refused because the replica's fencing token was no longer "
            "the run's current one "
            "(write), and publications dropped after its lease deadline (publish): an owner "
            "that was paused or cut "
            "off past its lease, whose runs another replica now owns. A few around a "
            "failover are expected; a "
            "steady rise is not. Redis operations that failed, by operation: inputs stay "
            "unacknowledged (the "
            "broker delivers them again) while Redis is unreachable. Redis came back empty: "
            "it restarted without "
            "persistence (or was flushed) and the live runs' journals are gone (run it with "
            "appendonly yes).",
        ),
    ]


def layout(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give panels ids and a left-to-right, top-to-bottom gridPos (a row starts on a new line)."""
    x = y = line_h = 0
    out = []
    for pid, p in enumerate(items, start=1):
        w, h = p.pop("_size")
        if x + w > WIDTH or p["type"] == "row":
            x, y, line_h = 0, y + line_h, 0
        out.append({"id": pid, "datasource": DS, **p, "gridPos": {"h": h, "w": w, "x": x, "y": y}})
        x += w
        line_h = max(line_h, h)
        if p["type"] == "row":
            x, y, line_h = 0, y + h, 0
    return out


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "definition": query,
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "hide": 0,
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "agent-monitor",
        "title": "Agent monitor",
        "description": "Live progress of AI agent runs followed by agent-monitor, its LLM "
        "judge, and the daemon's health.",
        "tags": ["agent-monitor", "prometheus"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Prometheus",
                    "query": "prometheus",
                    "regex": "",
                    "refresh": 1,
                    "hide": 0,
                    "current": {},
                    "options": [],
                },
                variable("instance", "Daemon", "label_values(agent_monitor_build_info, instance)"),
                variable(
                    "run_id", "Run", f"label_values(agent_monitor_run_progress{{{INST}}}, run_id)"
                ),
            ]
        },
        "panels": layout(panels()),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
