"""The command line: settings from flags and environment (generated from the settings classes),
turned into objects."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import socket
import sqlite3
import sys
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ..criteria import CriteriaError, load_criteria
from ..daemon import DEFAULT_GC_THRESHOLD, ClusterSettings, MonitorConfig, ProxySettings
from ..judges.base import FRAMES_NOT_SEEN, BaseJudge, JudgeError, recommended_min_mass, sees_frames
from ..judges.llamacpp import DEFAULT_KV_BUDGET_MB
from ..offline.baselines import DEFAULT_RESAMPLES
from ..offline.evaluate import DEFAULT_ORDERS
from ..offline.recorded import RecordedRunError, iter_recorded
from ..offline.robotmetrics import robot_json, robot_metrics, robot_summary
from ..options import ScoringOptions
from ..policy import Policy, PolicyError
from ..progress import Progress
from ..selection import DEFAULT_PAIR_CHARS, DEFAULT_PIVOTS
from ..tracker import AsyncProgressTracker
from ..wire import DEFAULT_BROKER, BrokerSettings, SettingsError
from ._flags import CONFIG_ENV, FlagError, HelpFormatter, Settings, add_flags, build, given
from ._top import TopOptions

if TYPE_CHECKING:
    from ..daemon import Monitor, SqliteStore

JudgeKind = Literal["openai", "gemini", "local", "replay"]
T = TypeVar("T")


class CliError(Exception):
    """A setting the command cannot work with; printed as one line, exit code 2."""


@dataclass(frozen=True, slots=True)
class JudgeOptions:
    """Which judge scores, and where it is."""

    judge: JudgeKind | None = field(default=None, metadata={"help": "judge backend"})
    judge_url: str | None = field(
        default=None, metadata={"help": "OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"}
    )
    judge_model: str | None = field(
        default=None,
        metadata={
            "help": "model id (openai, gemini), GGUF path (local), or a file of recorded "
            "answers (replay, see "
            "agent_monitor.testing.ReplayJudge); none: the server's"
        },
    )
    judge_api: Literal["chat", "completions"] = field(
        default="chat", metadata={"help": "OpenAI-compatible API to use"}
    )
    judge_timeout: float | None = field(
        default=None,
        metadata={"help": "seconds per judge call; none: the judge's own (60; local 120)"},
    )
    judge_context: int | None = field(
        default=None,
        metadata={
            "help": "the judge's context window in tokens (prompt and answer); none: read "
            "from the server (vLLM's "
            "/v1/models max_model_len, llama.cpp's /props n_ctx, Gemini's model limit; "
            "local: its n_ctx) or "
            "learned from its first context-length refusal. Set, it wins over what the server says"
        },
    )
    judge_sampled: bool = field(
        default=False,
        metadata={
            "help": "openai judge: score letters sampled from several answers a step, for a "
            "server that returns "
            "no logprobs (slower and coarser than logprobs)"
        },
    )
    judge_check: Literal["refuse", "warn"] = field(
        default="refuse",
        metadata={
            "help": "when the start-up check finds the judge answering without logprobs (no "
            "score possible): "
            "refuse to start (exit 2, the fix named) or warn and start"
        },
    )
    judge_kv_budget: float = field(
        default=DEFAULT_KV_BUDGET_MB,
        metadata={
            "help": "local judge: MB of KV prefixes kept for runs not in its context, least "
            "recently used "
            "dropped first; 0: one prefix shared by all runs"
        },
    )


@dataclass(frozen=True, slots=True)
class BrokerOptions:
    """How `serve` reaches the MQTT broker (the URL is parsed into BrokerSettings)."""

    broker: str = field(
        default=DEFAULT_BROKER, metadata={"help": "mqtt://[user[:pass]@]host:port or mqtts://..."}
    )
    broker_username: str | None = field(default=None, metadata={"help": "broker user name"})
    broker_password: str | None = field(
        default=None, metadata={"help": "broker password; prefer the env var"}
    )
    tls_ca: str | None = field(
        default=None, metadata={"help": "CA file for mqtts://; none: the system CAs"}
    )
    tls_cert: str | None = field(default=None, metadata={"help": "client certificate (PEM)"})
    tls_key: str | None = field(default=None, metadata={"help": "client key (PEM)"})
    embedded_broker: bool = field(
        default=False,
        metadata={
            "help": "run an MQTT 3.1.1 broker in-process on --broker's host:port (needs "
            "agent-monitor[embedded])"
        },
    )

    def settings(self) -> BrokerSettings:
        """The broker settings these options describe."""
        return BrokerSettings.from_url(
            self.broker,
            username=self.broker_username,
            password=self.broker_password,
            ca_file=self.tls_ca,
            cert_file=self.tls_cert,
            key_file=self.tls_key,
        )


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What `serve` sets up around the Monitor, for the process: the run store, logs, the garbage
    collector."""

    state_dir: str | None = field(
        default=None,
        metadata={"help": "where the run store lives; none: $XDG_DATA_HOME/agent-monitor"},
    )
    no_store: bool = field(
        default=False, metadata={"help": "keep runs in memory only (a restart forgets them)"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})
    gc_threshold: int = field(
        default=DEFAULT_GC_THRESHOLD,
        metadata={
            "help": "allocations between collections of Python's cyclic garbage collector "
            "(its first generation); "
            "the default 700 spends a third of a burst's CPU walking the live runs' state; "
            "0: Python's default"
        },
    )


def build_judge(options: JudgeOptions) -> BaseJudge:
    """The judge the options name; a warning it gives (e.g.

    a tiny local model's) becomes one log line.
    """
    import structlog

    with warnings.catch_warnings(record=True) as caught:
        # advice to the user; deprecations stay as filtered
        warnings.simplefilter("always", UserWarning)
        judge = _new_judge(options)
    for w in caught:
        # Python's own format would add a file name and a source line to what is one line of advice.
        structlog.get_logger("agent_monitor.cli").warning(
            "judge_warning", judge=judge.name, warning=str(w.message)
        )
    return judge


def _new_judge(options: JudgeOptions) -> BaseJudge:
    kind, timeout = options.judge, options.judge_timeout
    extra: dict[str, Any] = {} if timeout is None else {"timeout_s": timeout}
    if options.judge_context is not None:
        if options.judge_context < 1:
            raise CliError(
                f"--judge-context {options.judge_context}: give the judge's "
                "context in tokens (>= 1)"
            )
        extra["context_tokens"] = options.judge_context
    if kind == "openai":
        from ..judges.openai import OpenAIJudge

        return OpenAIJudge(
            base_url=options.judge_url,
            model=options.judge_model,
            api=options.judge_api,
            logprobs=not options.judge_sampled,
            **extra,
        )
    if kind == "gemini":
        from ..judges.gemini import GeminiJudge

        return GeminiJudge(
            model=options.judge_model or "gemini-2.5-flash", base_url=options.judge_url, **extra
        )
    if kind == "local":
        from ..judges.llamacpp import LlamaCppJudge

        return LlamaCppJudge(
            model_path=options.judge_model, kv_budget_mb=options.judge_kv_budget, **extra
        )
    if kind == "replay":
        from ..testing import ReplayJudge

        if not options.judge_model:
            raise CliError(
                "--judge replay replays recorded answers: name their file with --judge-model FILE"
            )
        replay = ReplayJudge.load(options.judge_model)
        replay.context_tokens = extra.get("context_tokens")
        return replay
    raise CliError(f"unknown judge {kind!r}; choose openai, gemini, local or replay")


def _robot_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that say how robot data (a LeRobot dataset, an .mcap bag) becomes runs: replay's
    and eval's."""
    robot = parser.add_argument_group("robot data (LeRobot v3 datasets, .mcap bags)")
    robot.add_argument(
        "--every",
        type=int,
        default=1,
        metavar="N",
        help="one step per N control ticks (frames), the Nth's text",
    )
    robot.add_argument(
        "--episodes",
        metavar="LIST",
        help="LeRobot episode indexes to replay, e.g. 0,3,7 (default: all)",
    )
    robot.add_argument(
        "--task",
        metavar="TEXT",
        help="the task text (replaces the recorded one; needed for a bag without a task topic)",
    )
    robot.add_argument(
        "--task-topic",
        default="/task",
        metavar="TOPIC",
        help="the bag's std_msgs/String task topic",
    )
    robot.add_argument(
        "--outcome-topic",
        default="/outcome",
        metavar="TOPIC",
        help="the bag's outcome topic ('success'/'failure' or a Bool)",
    )
    robot.add_argument(
        "--camera",
        action="append",
        metavar="TOPIC",
        help="a bag's camera topic (repeat for several; the first sets the ticks; default: "
        "every image topic)",
    )
    robot.add_argument(
        "--max-side",
        type=int,
        default=320,
        metavar="PIXELS",
        help="downscale frames to this longer side (0: as recorded)",
    )
    robot.add_argument(
        "--frames",
        choices=("all", "budget"),
        default="all",
        help="all: every step carries its frames (the monitor's budget chooses); budget: "
        "only the frames the default "
        "frame budget shows at the episode's end are encoded and sent",
    )


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    more: str = "",
) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is its entry in `agent-monitor --help` and the top of
    its own --help."""
    parser = sub.add_parser(
        name,
        help=summary,
        description=f"{summary[0].upper()}{summary[1:]}." + (f" {more}" if more else ""),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML settings file: keys are serve's long flags with - as _ (metrics_port = "
        "9464), at the top "
        "level or in [serve]; a flag given wins, then its environment twin, then the file "
        f"(`agent-monitor config` shows each setting and where it came from) [{CONFIG_ENV}]",
    )
    return parser


def _group_flags(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--group-by",
        choices=("task", "folder", "name"),
        default="task",
        help="siblings are runs with the same task text, in the same folder, or with the "
        "same name before '__'",
    )


_PROXY_FLAGS = [f.name for f in dataclasses.fields(ProxySettings) if f.name != "upstream"]
SERVE_CONFIG = MonitorConfig(metrics_port=9464)
"""serve's defaults: a MonitorConfig's own but the metrics port (a Monitor built in Python binds
none)."""


def _serve_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """The flags of serve (and of proxy, which is serve with the proxy as its front door)."""
    add_flags(parser, BrokerOptions, environ, title="MQTT broker")
    add_flags(parser, JudgeOptions, environ, title="judge")
    add_flags(parser, MonitorConfig, environ, default=SERVE_CONFIG, title="monitor")
    add_flags(parser, ServeOptions, environ, title="run store and logs")


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="agent-monitor",
        description="Live, fine-grained progress scores for AI agents and robots.",
        epilog="`agent-monitor COMMAND --help` shows a command's flags, their defaults and their "
        "AGENT_MONITOR_* environment twins. Start with `agent-monitor demo` (offline, "
        "nothing to set up).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"agent-monitor {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND", help="one of:")
    score = _command(
        sub,
        "score",
        "score every prefix of recorded runs (ATIF or plain JSON), as a live monitor would",
    )
    score.add_argument("path", help="a recorded run (.json) or a folder of them")
    add_flags(score, JudgeOptions, environ, title="judge")
    score.add_argument(
        "--criteria",
        metavar="RUBRIC",
        help="bundled rubric name (progress, coding, robot) or a .md path (default: progress)",
    )
    score.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="score at most this many steps per run (default: all)",
    )
    add_flags(
        score,
        ScoringOptions,
        environ,
        only=["min_mass", "prompt_budget", "digest"],
        title="scoring",
    )
    score.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per scored step instead of a table",
    )

    serve = _command(
        sub,
        "serve",
        "follow live runs over MQTT; publish progress and abort/resample signals",
        "Every flag has an AGENT_MONITOR_* environment twin (shown in brackets); a flag "
        "given wins over its twin.",
    )
    _serve_flags(serve, environ)
    add_flags(
        serve, ProxySettings, environ, title="LLM API proxy (with --proxy-upstream; docs/proxy.md)"
    )
    proxy = _command(
        sub,
        "proxy",
        "an LLM API proxy that watches every turn of an agent you did not write (serve, with "
        "the proxy as its door)",
        "Point the agent's base URL at --listen (OPENAI_BASE_URL=http://HOST:PORT/v1, "
        "ANTHROPIC_BASE_URL=http://HOST:PORT): "
        "each conversation is a run, each assistant turn with its tool results a step "
        "(docs/proxy.md). Takes every "
        "flag of serve.",
    )
    proxy.add_argument(
        "--upstream",
        metavar="URL",
        default=environ.get("AGENT_MONITOR_PROXY_UPSTREAM") or None,
        help="the LLM API to forward to, e.g. https://api.openai.com/v1 or "
        "https://api.anthropic.com (required) "
        "[AGENT_MONITOR_PROXY_UPSTREAM]",
    )
    add_flags(proxy, ProxySettings, environ, only=_PROXY_FLAGS, title="LLM API proxy")
    _serve_flags(proxy, environ)

    ev = _command(
        sub,
        "eval",
        "score recorded runs with known outcomes as live; report AUROC, "
        "correlation, abort thresholds",
    )
    ev.add_argument(
        "path",
        help="a recorded run (.json), a folder of them (ATIF or plain), a LeRobot v3 "
        "dataset or an .mcap file",
    )
    add_flags(ev, JudgeOptions, environ, title="judge")
    ev.add_argument(
        "--criteria",
        metavar="RUBRIC",
        help="bundled rubric name or a criteria file (default: progress)",
    )
    add_flags(
        ev,
        ScoringOptions,
        environ,
        only=["min_mass", "repeats", "prompt_budget", "digest"],
        title="scoring",
    )
    ev.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="score at most this many steps per run (default: all); runs keep their whole "
        "length for steps saved",
    )
    side = ev.add_argument_group("the judge beside baselines (step_index, chars, errors)")
    side.add_argument(
        "--at-steps",
        metavar="LIST",
        default="",
        help="fixed steps (comma-separated) to compare the signals at, besides 2,4,8,16",
    )
    side.add_argument(
        "--resamples",
        type=int,
        default=DEFAULT_RESAMPLES,
        metavar="N",
        help="bootstrap resamples and label permutations per figure",
    )
    side.add_argument(
        "--baselines-only",
        action="store_true",
        help="no judge: the baselines, the calibrated step budget and the verdict from the "
        "runs' text alone",
    )
    add_flags(
        ev,
        Policy,
        environ,
        only=[
            "min_steps",
            "patience",
            "max_uncertainty",
            "abort_below",
            "alpha",
            "holdout",
            "max_gap",
            "margin",
            "repeats_near",
        ],
        title="policy",
    )
    ev.add_argument(
        "--schedule",
        # not `schedule`: that is the policy setting's name, read from the namespace by build()
        dest="schedules",
        metavar="LIST",
        help="also step the runs through these schedules (comma-separated: every,adaptive) "
        "with --abort-below's "
        "threshold in force, and print each one's judge calls and tokens and its abort "
        "decisions side by side "
        "(eval_schedule.json)",
    )
    ev.add_argument(
        "--max-false-abort",
        type=float,
        default=0.05,
        metavar="X",
        help="false-abort rate the recommendation must keep",
    )
    online = ev.add_argument_group("online calibration (abort-below auto)")
    online.add_argument(
        "--calibrate",
        action="store_true",
        help="also replay the runs through the online calibration of --abort-below auto at "
        "--alpha, as the monitor "
        "would learn it, and report the false aborts it would have made (eval_calibrate.json)",
    )
    online.add_argument(
        "--orders",
        type=int,
        default=DEFAULT_ORDERS,
        metavar="N",
        help="random orders to replay besides the recorded one",
    )
    online.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of the random orders"
    )
    online.add_argument(
        "--family-by",
        choices=("task", "all"),
        default="task",
        help="a family per task (as the monitor keys runs without start.family), or all runs "
        "in one (pools tasks)",
    )
    groups = ev.add_argument_group("best of N (group pruning)")
    groups.add_argument(
        "--groups",
        action="store_true",
        help="also treat runs of one task as siblings launched together, replay them through "
        "the live group policy "
        "for a grid of keep-top / prune-margin, and compare with random pruning at the same "
        "step budget "
        "(eval_groups.json)",
    )
    _group_flags(groups)
    _robot_flags(ev)
    ev.add_argument(
        "--out",
        default="agent-monitor-eval",
        metavar="DIR",
        help="folder for the CSVs, PNG and JSON report",
    )
    ev.add_argument(
        "--cache",
        metavar="FILE",
        help="score cache file (default: OUT/score-cache.sqlite3); re-runs are free",
    )

    sel = _command(
        sub,
        "select",
        "pick the best of each group of finished runs (best of N); with outcomes, report the "
        "pick accuracy",
        "Groups are runs of one task (--group-by). The pick is the highest pointwise score "
        "of the last step, or with "
        "--pairwise the pivot tournament of pairwise judge comparisons (both orders each). "
        "With known outcomes it "
        "reports the share of groups whose pick succeeded, against a random pick and the "
        "last step's pointwise pick.",
    )
    sel.add_argument("path", help="a folder of recorded runs (.json, ATIF or plain)")
    add_flags(sel, JudgeOptions, environ, title="judge")
    sel.add_argument(
        "--criteria",
        metavar="RUBRIC",
        help="bundled rubric name or a criteria file (default: progress)",
    )
    add_flags(sel, ScoringOptions, environ, only=["min_mass", "repeats"], title="scoring")
    sel.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="judge at most this many steps per run (default: all)",
    )
    _group_flags(sel)
    pair = sel.add_argument_group("pairwise (pivot tournament)")
    pair.add_argument(
        "--pairwise",
        action="store_true",
        help="pick by the pivot tournament of pairwise comparisons",
    )
    pair.add_argument(
        "--pivots",
        type=int,
        default=DEFAULT_PIVOTS,
        metavar="K",
        help="candidates that meet every other one",
    )
    pair.add_argument(
        "--rings",
        type=int,
        default=1,
        metavar="N",
        help="ring passes (random Hamiltonian cycles) that pick the pivots",
    )
    pair.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the ring passes")
    pair.add_argument(
        "--max-chars",
        type=int,
        default=DEFAULT_PAIR_CHARS,
        metavar="N",
        help="characters of step text a pairwise prompt holds for both runs (each keeps its "
        "newest steps)",
    )
    sel.add_argument(
        "--out", default="agent-monitor-select", metavar="DIR", help="folder for the JSON report"
    )
    sel.add_argument(
        "--cache",
        metavar="FILE",
        help="score cache file (default: OUT/score-cache.sqlite3; eval's cache serves the "
        "pointwise scores)",
    )

    rp = _command(
        sub,
        "replay",
        "publish recorded runs to a broker as live runs (to watch the monitor)",
        "PATH may also be robot data (the robot extra): a LeRobot v3 dataset directory or a "
        "ROS 2 bag (.mcap), "
        "replayed episode by episode at its own pace with its camera frames (docs/robots.md).",
    )
    rp.add_argument(
        "path",
        help="a recorded run (.json), a folder of them, a LeRobot v3 dataset or an .mcap file",
    )
    add_flags(
        rp, BrokerOptions, environ, only=["broker"], title="MQTT broker (where the monitor listens)"
    )
    add_flags(
        rp, MonitorConfig, environ, only=["prefix"], title="topics (the monitor's --topic-prefix)"
    )
    rp.add_argument(
        "--speed",
        type=float,
        default=1.0,
        metavar="X",
        help="time scale: 10 replays ten times faster than recorded (robot data: 0 sends as "
        "fast as frames decode)",
    )
    rp.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between steps without timestamps (before --speed)",
    )
    rp.add_argument(
        "--max-gap",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="cap on one recorded pause (before --speed)",
    )
    rp.add_argument(
        "--run-prefix",
        default="replay-",
        metavar="PREFIX",
        help="prefix of the run ids (the file name follows)",
    )
    rp.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="publish at most this many steps per run (default: all)",
    )
    rp.add_argument(
        "--settle",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="recorded runs: hold a run's end until the monitor scored its last step (or "
        "aborted it), at most this "
        "long after the last event, so the summary shows each run's final score; 0: end on "
        "schedule",
    )
    rp.add_argument(
        "--criteria",
        metavar="RUBRIC",
        help="bundled rubric name to send in each start (default: none sent: the monitor's "
        "default, progress)",
    )
    _robot_flags(rp)

    tp = _command(
        sub,
        "top",
        "a live table of every run on the broker: score, uncertainty, step, signal, cost",
        "A read-only subscriber of the monitors' progress, signal, start and end topics "
        "(random client id, clean "
        "session): any broker, any number of monitor replicas. q or Ctrl-C quits.",
    )
    add_flags(
        tp,
        BrokerOptions,
        environ,
        only=["broker", "broker_username", "broker_password", "tls_ca", "tls_cert", "tls_key"],
        title="MQTT broker (where the monitors publish)",
    )
    add_flags(
        tp, MonitorConfig, environ, only=["prefix"], title="topics (the monitors' --topic-prefix)"
    )
    add_flags(tp, TopOptions, environ, title="view")

    demo = _command(
        sub,
        "demo",
        "the whole loop offline: embedded broker, tiny local judge, example runs live",
        "No broker, GPU or API key needed; the runs are kept in a temporary store of their "
        "own (never serve's).",
    )
    demo.add_argument("--short", action="store_true", help="three steps per run (CI)")
    demo.add_argument(
        "--out", default="agent-monitor-demo", metavar="DIR", help="folder for the progress plot"
    )
    add_flags(
        demo,
        MonitorConfig,
        environ,
        default=SERVE_CONFIG,
        only=["metrics_port"],
        title="metrics (a taken port: any free one)",
    )
    demo.add_argument(
        "--pace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between steps of each run (default: paced to the judge, so each step "
        "can get its own score)",
    )
    demo.add_argument(
        "--judge-only",
        action="store_true",
        help="score the coding runs with the judge alone (no test_ratio rule, no abort "
        "threshold): the second act",
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="after the runs end, keep the broker, the monitor and /metrics up until Ctrl-C "
        "(to open Grafana)",
    )
    # Not the environment's: an AGENT_MONITOR_MIN_MASS set for serve's real judge would fail the
    # tiny one here.
    add_flags(demo, ScoringOptions, {}, only=["min_mass"], title="scoring")
    add_flags(demo, JudgeOptions, environ, title="a real judge instead of the packaged tiny one")

    runs = _command(sub, "runs", "list live and recent runs from the run store")
    add_flags(runs, ServeOptions, environ, only=["state_dir"])
    add_flags(
        runs,
        ClusterSettings,
        environ,
        only=["url", "name"],
        title="cluster (read the shared journal)",
    )
    runs.add_argument(
        "--limit", type=int, default=50, metavar="N", help="at most this many runs, newest first"
    )
    runs.add_argument("--json", action="store_true", help="one JSON object per run")

    cal = _command(
        sub,
        "calibration",
        "list the run families abort_below auto learns thresholds from, or reset one",
        "Reads the run store serve writes (the one `agent-monitor runs` reads). A running "
        "agent-monitor serve keeps "
        "its calibration in memory: it forgets a reset family only when it restarts.",
    )
    add_flags(cal, ServeOptions, environ, only=["state_dir"])
    add_flags(
        cal,
        ClusterSettings,
        environ,
        only=["url", "name"],
        title="cluster (read the shared journal)",
    )
    add_flags(
        cal,
        Policy,
        environ,
        only=["alpha", "min_steps", "patience", "max_uncertainty"],
        title="policy (the thresholds shown are the ones a run with it gets)",
    )
    cal.add_argument("--json", action="store_true", help="one JSON object per family")
    cal.add_argument(
        "--reset",
        metavar="FAMILY",
        help="delete the samples of FAMILY (every judge model and rubric) and say how many; "
        "restart serve to apply",
    )

    export = _command(sub, "export", "write a run's steps and score curve as JSON")
    export.add_argument("run_id", help="the run to export (`agent-monitor runs` lists them)")
    add_flags(export, ServeOptions, environ, only=["state_dir"])
    add_flags(
        export,
        ClusterSettings,
        environ,
        only=["url", "name"],
        title="cluster (read the shared journal)",
    )
    export.add_argument(
        "-o", "--output", default="-", metavar="FILE", help="file to write (default: stdout)"
    )

    schemas = _command(sub, "schemas", "write or check the JSON Schemas of every MQTT payload")
    g = schemas.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--write", metavar="DIR", help="write the JSON Schemas of every payload into DIR"
    )
    g.add_argument("--check", metavar="DIR", help="exit 1 if the schemas in DIR are not up to date")
    from ._selfcheck import add_parser as _self_check_parser

    _self_check_parser(sub, _command)
    from ._judge_server import add_parser as _judge_server_parser

    _judge_server_parser(sub, _command, environ)

    config = _command(
        sub,
        "config",
        "print the effective settings of serve and where each came from (flag, env, file or "
        "default)",
        "Takes every flag of serve: `agent-monitor config --config monitor.toml "
        "--metrics-port 9000`. Secrets "
        "(tokens, keys, passwords) are masked.",
    )
    _serve_flags(config, environ)
    add_flags(config, ProxySettings, environ, title="LLM API proxy")
    config.add_argument(
        "--json", action="store_true", help="one JSON object per setting instead of a table"
    )
    if isinstance(environ, Settings):
        # every command's flags are known now: a file key none of them has is a mistake
        environ.check()
    return parser


def _row(p: Progress) -> str:
    if not p.ok:
        return f"{p.step:>5}  {'FAILED':>6}  {p.reason}: {p.error}"
    bar = "#" * round((p.score or 0.0) * 20)
    return (
        f"{p.step:>5}  {p.score:6.3f}  ±{p.uncertainty:5.3f}  mass {p.mass:4.2f}  "
        f"{p.latency_s:6.2f}s  in {p.usage.input_tokens:>6} cached "
        f"{p.usage.cached_input_tokens:>6}  {bar}"
    )


def _fail(message: str) -> int:
    print(f"agent-monitor: {message}", file=sys.stderr)
    return 2


_NO_JUDGE = (
    "no judge chosen; pass --judge openai --judge-url URL, --judge gemini, or --judge local "
    "(or set AGENT_MONITOR_JUDGE)"
)


async def _score(args: argparse.Namespace) -> int:
    if not args.judge:
        return _fail(_NO_JUDGE)
    runs = list(iter_recorded(args.path))
    # Probed first, as `serve` does: a dead judge is one line now, not a failed row per step after
    # retries.
    judge = await _ready_judge(args)
    failures = 0
    try:
        for run in runs:
            steps = run.steps[: args.max_steps] if args.max_steps else run.steps
            tracker = AsyncProgressTracker(
                run.task,
                judge=judge,
                criteria=args.criteria,
                min_mass=args.min_mass,
                run_id=run.name,
                prompt_budget=getattr(args, "prompt_budget", None),
                digest=getattr(args, "digest", None),
            )
            if not args.json:
                print(f"\n{run.name}  ({len(steps)} steps, outcome {run.outcome})")
            for s in steps:
                p = await tracker.update(s.text)
                failures += not p.ok
                print(
                    json.dumps({"run": run.name, **p.to_json()}) if args.json else _row(p),
                    flush=True,
                )
    finally:
        await judge.aclose()
    if not args.json:
        print(
            f"\njudge {judge.name} model {judge.model or '(unknown)'}: {judge.calls} calls, "
            f"{judge.failures} failed; "
            f"tokens in {judge.usage.input_tokens}, cached {judge.usage.cached_input_tokens}"
        )
    return 1 if failures else 0


async def _ready_judge(args: argparse.Namespace, concurrency: int | None = None) -> BaseJudge:
    """Build the judge and check it can answer before any run depends on it; raise CliError with
    one line."""
    options = build(JudgeOptions, args)
    try:
        judge = build_judge(options)
    except Exception as e:  # SDKs raise their own types for a missing key or extra
        raise CliError(f"cannot set up the {options.judge} judge: {e}") from None
    if concurrency is not None:
        judge.concurrency = concurrency
    try:
        if options.judge == "openai":
            from ..judges.openai import OpenAIJudge

            assert isinstance(judge, OpenAIJudge)
            # With a model given there is nothing to resolve, but a dead URL must still be said now,
            # in one try.
            await (judge.check_reachable() if options.judge_model else judge.resolve_model())
            # with the model given: its context, where the server says it
            await judge.resolve_model()
            if not options.judge_sampled:
                await _check_scores(judge, options)
        elif options.judge == "local":
            from ..judges.llamacpp import LlamaCppJudge

            assert isinstance(judge, LlamaCppJudge)
            await judge.load()
    except CliError:
        await judge.aclose()
        raise
    except (JudgeError, OSError, ValueError, RuntimeError) as e:
        await judge.aclose()
        # The OpenAI judge's errors name the URL they tried; said once, the line stays readable.
        url = options.judge_url
        where = f" at {url}" if url and url.rstrip("/") not in str(e) else ""
        raise CliError(f"the {options.judge} judge{where} is not usable: {e}") from None
    return judge


CHECK_TASK = "agent-monitor start-up check: can this judge score? (one scored answer; not a run)"
"""The task of the start-up check's one judge call (a test server may tell it from the scoring
calls by it)."""
CHECK_WAIT_S = 20.0
"""How long start-up waits for the check's answer; a slower judge starts unchecked (the log says
so)."""


async def _check_scores(judge: BaseJudge, options: JudgeOptions) -> None:
    """Ask the judge for one scored answer: a server that answers without logprobs cannot score
    (refused or warned).

    Other failures of this one call are left to the scoring path (retried, counted, the circuit):
    the URL was reachable, and a judge busy at start is no reason to refuse.
    """
    import structlog

    from ..judges.base import JudgeRequest
    from ..judges.openai import no_logprobs_fix
    from ..prompts import Step, build_prompt

    rubric = load_criteria(None)
    prompt = build_prompt(
        CHECK_TASK, rubric, [Step(1, "ran the test suite: 3 of 10 tests pass")], rubric.criteria[0]
    )
    log = structlog.get_logger("agent_monitor.cli")
    # The check is not the user's work: the judge's counters (`score`'s summary) leave it out.
    counted = (judge.calls, judge.failures, judge.usage)
    try:
        async with asyncio.timeout(CHECK_WAIT_S):
            await judge.grade(JudgeRequest(prompt, run_key="agent-monitor-check"))
    except TimeoutError:
        log.warning("judge_check_slow", judge=judge.name, waited_s=CHECK_WAIT_S)
    except JudgeError as e:
        if e.reason != "no_logprobs":
            log.warning("judge_check_failed", judge=judge.name, error=str(e))
            return
        fix = no_logprobs_fix(options.judge_url or "the judge server")
        if options.judge_check == "refuse":
            raise CliError(
                f"{fix} (--judge-check warn starts anyway; every scoring then fails)"
            ) from None
        log.warning("judge_without_logprobs", judge=judge.name, fix=fix)
        print(
            f"agent-monitor: warning: {fix}; starting anyway (--judge-check warn)", file=sys.stderr
        )
    finally:
        judge.calls, judge.failures, judge.usage = counted


def announce_frames(judge: BaseJudge, registry: Any) -> bool | None:
    """Say at start when frames will not reach the judge: stderr, the log and
    `agent_monitor_judge_sees_frames`."""
    import structlog
    from prometheus_client import Gauge

    seen = sees_frames(judge)
    gauge = Gauge(
        "agent_monitor_judge_sees_frames",
        "1 when camera frames reach the judge as pixels, 0 when it gets text placeholders "
        "instead (a text-only "
        "judge); absent until known (an OpenAI-compatible server says at the first frame).",
        registry=registry,
    )
    if seen is not None:
        gauge.set(1 if seen else 0)
    if seen is False:
        structlog.get_logger("agent_monitor.cli").warning("judge_drops_frames", judge=judge.name)
        print(
            f"agent-monitor: {FRAMES_NOT_SEEN} ({judge.name}, text-only): a step's camera "
            "frames reach it as "
            "one-line placeholders and robot runs are scored on their text; use a vision "
            "model to score frames",
            file=sys.stderr,
        )
    return seen


async def _broker_unreachable(
    broker: BrokerSettings, wait_s: float = 5.0, *, within: float = 0.0
) -> str | None:
    """Why nothing accepts a TCP connection at the broker's address (None: something does; MQTT is
    checked later).

    `within`: seconds to keep trying (--broker-wait: a broker that starts with the monitor).
    """
    import structlog

    deadline, said = time.monotonic() + within, False
    while True:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(broker.host, broker.port), wait_s
            )
            break
        except (OSError, TimeoutError) as e:
            if time.monotonic() < deadline:
                if not said:
                    said = True
                    left = round(deadline - time.monotonic(), 1)
                    structlog.get_logger("agent_monitor.cli").warning(
                        "broker_waiting", broker=broker.url, wait_s=left
                    )
                await asyncio.sleep(0.25)
                continue
            waited = f" for {within:g}s" if within > 0 else ""
            return (
                f"cannot connect to the MQTT broker at {broker.url}{waited} "
                f"({getattr(e, 'strerror', None) or type(e).__name__}): is the broker running "
                "there? Start one "
                "(apt-get install mosquitto), or pass --embedded-broker"
            )
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def _serve(args: argparse.Namespace) -> int:
    import signal

    import structlog
    from prometheus_client import CollectorRegistry

    from ..daemon import BrokerUnavailable, ClusterUnavailable, Monitor, tune_gc

    if not args.judge:
        return _fail(_NO_JUDGE)
    broker_options = build(BrokerOptions, args)
    serve = build(ServeOptions, args)
    try:
        tune_gc(serve.gc_threshold)
    except ValueError as e:
        return _fail(f"--gc-threshold: {e}")
    broker = broker_options.settings()
    proxy = (
        build(ProxySettings, args) if args.command == "proxy" or args.upstream else ProxySettings()
    )
    policy_given = given(args, "policy")
    config = build(
        MonitorConfig,
        args,
        default=SERVE_CONFIG,
        broker=broker,
        policy_given=policy_given,
        proxy=proxy,
    )
    if problem := _serve_problem(config, args.command, broker_options.embedded_broker):
        return _fail(problem)
    if broker_options.embedded_broker and config.protocol == "auto":
        # amqtt speaks only 3.1.1: skip the doomed v5 attempt (and amqtt's warnings about it).
        config = dataclasses.replace(config, protocol="3.1.1")
    # In cluster mode the journal is in Redis (the Monitor opens it): no SQLite store of this
    # replica's own.
    store = (
        None if serve.no_store or config.cluster.url is not None else _open_store(serve.state_dir)
    )
    log = structlog.get_logger("agent_monitor.cli")
    async with contextlib.AsyncExitStack() as stack:
        if broker_options.embedded_broker:
            from ..daemon import BrokerStartError, EmbeddedBroker

            try:
                embedded = await stack.enter_async_context(EmbeddedBroker(broker.host, broker.port))
            except BrokerStartError as e:
                return _fail(f"{e}; {_other_port(broker)}" if e.port_in_use else str(e))
            log.info("embedded_broker_started", url=embedded.url)
        if store is not None:
            stack.push_async_callback(store.aclose)
        if not broker_options.embedded_broker and (
            problem := await _broker_unreachable(broker, within=config.broker_wait)
        ):
            # before the judge loads: a missing broker is said in a second, not after it
            return _fail(problem)
        judge = await _ready_judge(args, config.max_concurrency)
        stack.push_async_callback(judge.aclose)
        registry = CollectorRegistry()
        announce_frames(judge, registry)
        try:
            # Opens every door, sink and store the config names (a taken port or a missing extra is
            # one line).
            monitor = await stack.enter_async_context(
                Monitor(config, judge=judge, store=store, registry=registry)
            )
        except (ImportError, OSError, BrokerUnavailable, ClusterUnavailable) as e:
            return _fail(str(e))
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        if store is not None:
            print(
                await _store_line(store, monitor.restored, default=serve.state_dir is None),
                file=sys.stderr,
            )
        print(_serving_line(monitor, judge, store), file=sys.stderr, flush=True)
        try:
            await monitor.wait()
        except asyncio.CancelledError:
            log.info("shutting_down")
    return 0


def _serve_problem(config: MonitorConfig, command: str, embedded_broker: bool) -> str | None:
    """What keeps serve's settings from working together, said before anything starts (None:
    nothing)."""
    if config.proxy.upstream is None and command == "proxy":
        return "agent-monitor proxy needs --upstream URL, e.g. --upstream https://api.openai.com/v1"
    if config.reward_api.reward_api and not config.metrics_port:
        return "--reward-api serves the reward endpoints on the metrics port: pass --metrics-port N"
    if config.reward_api.reward_api and config.cluster.url is not None:
        # A rollout's run may be owned (and scored) by another replica, whose scores this one never
        # sees.
        return (
            "--reward-api runs on one monitor, not in --cluster mode: serve it from a "
            "monitor of its own"
        )
    try:
        # before the judge is probed: a bad --criteria is the first thing said
        load_criteria(config.criteria)
    except CriteriaError as e:
        return f"--criteria {config.criteria}: {e}"
    if config.prompt is not None:
        from ..templates import TemplateError, load_template

        try:  # before the judge is probed, as --criteria
            load_template(Path(config.prompt)).check_for("progress")
        except TemplateError as e:
            return f"--prompt: {e}"
    if embedded_broker and config.cluster.url is not None:
        return (
            "--embedded-broker speaks MQTT 3.1.1 only, and --cluster needs MQTT 5 shared "
            "subscriptions: run the "
            "replicas against one Mosquitto 2 (or EMQX, HiveMQ) with --broker"
        )
    return None


def _serving_line(monitor: Monitor, judge: BaseJudge, store: SqliteStore | None) -> str:
    """serve's start line: what it listens to, with which judge, where runs are kept, and each
    door's address."""
    config, web, doors = monitor.config, monitor.http, {src.name: src for src in monitor.sources}
    assert config.broker is not None
    min_mass = recommended_min_mass(judge) if config.min_mass is None else config.min_mass
    if (c := monitor.cluster) is not None:
        where = (
            f"cluster {config.cluster.name} on {config.cluster.url} as replica {c.replica_id} "
            f"({len(c.live)} live), shared subscription $share/{config.cluster.name}/"
        )
    else:
        where = f"run store {store.path if store else 'off (in memory)'}"
    receiver = doors.get("otlp")
    proxy = doors.get("proxy")
    return (
        (
            f"agent-monitor: proxy on {getattr(proxy, 'url', '?')} -> "
            f"{getattr(proxy, 'upstream', '?')}\n"
            if proxy
            else ""
        )
        + f"agent-monitor: serving {config.prefix}/+/start|step|end on {config.broker.url} "
        f"with the {judge.name} judge ({judge.model or 'model from server'}, min_mass "
        f"{min_mass:g}); "
        f"{where}"
        + (f"; OTLP traces on {getattr(receiver, 'url', '?')}" if receiver else "")
        + (
            f"; progress annotations to Phoenix at {config.phoenix.url}"
            if config.phoenix.url
            else ""
        )
        + (
            f"; reward endpoints {web.url}get_reward, slime/reward, v1/score"
            if "reward" in doors and web
            else ""
        )
        + (
            f"; board {web.url}"
            if web and monitor.board
            else f"; metrics {web.url}metrics"
            if web
            else ""
        )
    )


async def _store_line(store: SqliteStore, restored: Sequence[str], *, default: bool) -> str:
    """Where the run store is and what came back from it, so restored runs are never a surprise."""
    _, ended = await store.count_runs()
    where = f"run store {store.path}"
    if default:
        where += (
            " (the default, shared by every agent-monitor of this user; --state-dir DIR "
            "for another, --no-store for none)"
        )
    if not restored and not ended:
        return f"agent-monitor: {where}: no runs yet"
    shown = ", ".join(restored[:5]) + (f", +{len(restored) - 5} more" if len(restored) > 5 else "")
    live = f"restored {len(restored)} live run{'s' if len(restored) != 1 else ''}" + (
        f" ({shown})" if restored else ""
    )
    runs = "agent-monitor runs" + ("" if default else f" --state-dir {store.path.parent}")
    return f"agent-monitor: {where}: {live}, {ended} ended (`{runs}` lists them)"


def _other_port(broker: BrokerSettings) -> str:
    """What to do when --embedded-broker's port is taken: use the broker there, or a free port."""
    host = f"[{broker.host}]" if ":" in broker.host else broker.host
    here = f"mqtt://{host}:{broker.port}"
    try:
        with socket.socket(socket.AF_INET6 if ":" in broker.host else socket.AF_INET) as s:
            s.bind((broker.host, 0))
            free = f"mqtt://{host}:{s.getsockname()[1]} (free now)"
    except OSError:
        free = f"mqtt://{host}:PORT with a free PORT"
    return (
        f"to use the broker already there, drop --embedded-broker (and keep --broker {here}); "
        f"to run the embedded one anyway, move it to a free port: --embedded-broker --broker {free}"
    )


async def _demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    judge = await _ready_judge(args, 2) if args.judge else None
    try:
        await run_demo(
            judge=judge,
            short=args.short,
            out_dir=args.out,
            metrics_port=args.metrics_port,
            min_mass=args.min_mass,
            pace_s=args.pace,
            keep=args.keep,
            judge_only=args.judge_only,
        )
    finally:
        if judge is not None:
            await judge.aclose()
    return 0


async def _eval(args: argparse.Namespace) -> int:
    from ..offline import baselines as bl
    from ..offline import evaluate as ev

    if not args.judge and not args.baselines_only:
        return _fail(_NO_JUDGE + "; or --baselines-only to measure the baselines without one")
    try:
        at_steps = [int(k) for k in args.at_steps.split(",") if k.strip()]
    except ValueError:
        return _fail(
            f"--at-steps {args.at_steps}: use a comma-separated list of step numbers, e.g. 3,12"
        )
    if (
        any(k < 1 for k in at_steps)
        or args.resamples < 1
        or (args.max_steps is not None and args.max_steps < 1)
    ):
        return _fail("--at-steps, --resamples and --max-steps take numbers >= 1")
    policy = _eval_policy(args)
    from ..robotdata import is_robot_data

    if is_robot_data(args.path):
        from ..robotdata import RobotDataError
        from ._robot_replay import recorded_episodes

        try:
            # decoding: a worker thread, never the loop
            runs = await asyncio.to_thread(recorded_episodes, args)
        except RobotDataError as e:
            return _fail(str(e))
    else:
        runs = list(iter_recorded(args.path))
    if not runs:
        return _fail(f"no recorded runs in {args.path}")
    out = Path(args.out)
    if args.baselines_only:
        if args.schedules or args.groups or args.calibrate:
            return _fail("--baselines-only has no judge: drop --schedule, --groups and --calibrate")
        curves, total = [ev.baseline_curve(r) for r in runs], 0
    else:
        curves, total = await _eval_scores(args, runs, out)
    report = ev.evaluate(curves, policy=policy, max_false_abort=args.max_false_abort)
    judged = not args.baselines_only
    sides = bl.signal_report(
        curves,
        at_steps=at_steps,
        judged=judged,
        max_steps=args.max_steps,
        resamples=args.resamples,
        seed=args.seed,
    )
    rules = bl.simulate(curves, policy=policy, judged=judged)
    scheduled = await _eval_schedules(args, runs, policy, out) if args.schedules else None
    robot = robot_metrics(curves, seed=args.seed)
    files = ev.write_csv(report, out)
    data = {**ev.report_json(report), "robot": robot_json(robot), **bl.report_json(sides, rules)}
    (out / "eval.json").write_text(json.dumps(data, indent=2))
    files.append(out / "eval.json")
    calibrated = None
    if args.calibrate:
        calibrated = ev.calibrate(
            curves, policy=policy, orders=args.orders, seed=args.seed, family_by=args.family_by
        )
        (out / "eval_calibrate.json").write_text(
            json.dumps(ev.calibrate_json(calibrated), indent=2)
        )
        files.append(out / "eval_calibrate.json")
    grouped = None
    if args.groups:
        grouped, data = _eval_groups(args, curves, policy)
        (out / "eval_groups.json").write_text(json.dumps(data, indent=2))
        files.append(out / "eval_groups.json")
    try:
        more = functools.partial(bl.plot_curves, sides)
        files.append(ev.plot(report, out / "eval.png", note=robot_summary(robot), more=more))
    except ImportError:
        print(
            "agent-monitor: no PNG: pip install -e '.[plot]' in the agent-monitor checkout "
            "(matplotlib)",
            file=sys.stderr,
        )
    failed = sum(s is None for c in curves for s in c.scores)
    cached = sum(c.cached for c in curves)
    if judged:
        print(ev.summary(report))
        print(robot_summary(robot))
        print()
    print(bl.report_text(sides, rules))
    if calibrated is not None:
        print("\n" + ev.calibrate_summary(calibrated))
    if grouped is not None:
        print("\n" + grouped)
    if scheduled is not None:
        print("\n" + ev.schedule_summary(scheduled))
        files.append(out / "eval_schedule.json")
    print(
        f"\n{total} prefixes scored ({cached} from the cache, {failed} without a score); wrote "
        + ", ".join(map(str, files))
    )
    return 0


async def _eval_scores(
    args: argparse.Namespace, runs: Sequence[Any], out: Path
) -> tuple[list[Any], int]:
    """eval's judge pass: every prefix of every run (up to --max-steps) scored as live, through
    the cache."""
    from ..offline import evaluate as ev

    judge = await _ready_judge(args, 8)
    cache = ev.ScoreCache(args.cache or out / "score-cache.sqlite3")
    total = sum(min(len(r.steps), args.max_steps or len(r.steps)) for r in runs)
    try:
        with _progress_bar(total, "scoring prefixes") as advance:
            curves = await ev.score_runs(
                runs,
                judge=judge,
                criteria=args.criteria,
                min_mass=args.min_mass,
                repeats=args.repeats,
                max_steps=args.max_steps,
                cache=cache,
                prompt_budget=getattr(args, "prompt_budget", None),
                digest=getattr(args, "digest", None),
                on_step=lambda run, p: advance(f"{run.name} step {p.step}"),
            )
    finally:
        cache.close()
        await judge.aclose()
    return curves, total


async def _select(args: argparse.Namespace) -> int:
    from ..offline import evaluate as ev
    from ..offline import groupeval as ge

    if not args.judge:
        return _fail(_NO_JUDGE)
    if args.pivots < 1 or args.rings < 1:
        return _fail(f"--pivots {args.pivots} --rings {args.rings}: use 1 or more of each")
    groups = ge.group_runs(ge.load_runs(args.path), args.group_by)
    if not groups:
        return _fail(f"no recorded runs in {args.path}")
    judge = await _ready_judge(args, 8)
    out = Path(args.out)
    cache = ev.ScoreCache(args.cache or out / "score-cache.sqlite3")
    # Pointwise: every prefix of every run; pairwise adds about a ring and k meetings per run.
    steps = sum(min(len(r.steps), args.max_steps or len(r.steps)) for g in groups for r in g.runs)
    total = steps + sum(len(g.runs) * (1 + args.pivots) * args.pairwise for g in groups)
    try:
        with _progress_bar(total, "judging") as advance:
            report = await ge.select_groups(
                groups,
                judge=judge,
                pairwise=args.pairwise,
                criteria=args.criteria,
                repeats=args.repeats,
                min_mass=args.min_mass,
                max_steps=args.max_steps,
                pivots=args.pivots,
                rings=args.rings,
                seed=args.seed,
                max_chars=args.max_chars,
                cache=cache,
                on_call=advance,
            )
    finally:
        cache.close()
        await judge.aclose()
    _write_json(out / "select.json", ge.select_json(report))
    print(ge.select_summary(report))
    print(f"wrote {out / 'select.json'}")
    return 0


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


async def _eval_schedules(
    args: argparse.Namespace, runs: Sequence[Any], policy: Policy, out: Path
) -> Any:
    """eval --schedule: the runs stepped through each schedule live, with the policy's thresholds
    in force."""
    from ..offline import evaluate as ev
    from ..policy import SCHEDULES

    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEDULES]
    if bad or not names:
        raise CliError(
            f"--schedule {args.schedules}: use a comma-separated list of {', '.join(SCHEDULES)}"
        )
    judge = await _ready_judge(args, 8)
    cache = ev.ScoreCache(args.cache or out / "score-cache.sqlite3")
    try:
        results = {
            name: await ev.score_scheduled(
                runs,
                judge=judge,
                policy=policy,
                schedule=name,
                criteria=args.criteria,
                min_mass=args.min_mass,
                repeats=args.repeats,
                max_steps=args.max_steps,
                cache=cache,
                prompt_budget=getattr(args, "prompt_budget", None),
                digest=getattr(args, "digest", None),
            )
            for name in dict.fromkeys(names)
        }
    finally:
        cache.close()
        await judge.aclose()
    report = ev.ScheduleReport(policy, results)
    _write_json(out / "eval_schedule.json", ev.schedule_json(report))
    return report


def _eval_groups(
    args: argparse.Namespace, curves: Sequence[Any], policy: Policy
) -> tuple[str, dict[str, Any]]:
    """eval --groups: the curves, grouped into siblings, replayed through the live group policy."""
    from ..offline import groupeval as ge

    # the files eval scored, in the same (sorted) order, with their folders
    loaded = ge.load_runs(args.path)
    if [r.name for r, _ in loaded] != [c.name for c in curves]:
        raise CliError(f"the recorded runs in {args.path} changed while eval ran; run it again")
    by_name = {id(r): c for (r, _p), c in zip(loaded, curves, strict=True)}
    sibling_groups = [
        (g.name, ge.siblings(g.runs, [by_name[id(r)] for r in g.runs]))
        for g in ge.group_runs(loaded, args.group_by)
    ]
    report = ge.prune_report(
        sibling_groups, policy=dataclasses.replace(policy, abort_below=None), seed=args.seed
    )
    return ge.prune_summary(report), ge.prune_json(report)


def _eval_policy(args: argparse.Namespace) -> Policy:
    """The policy eval measures; with --calibrate the abort threshold is the one calibration
    learns."""
    # eval's --max-steps limits scoring; the policy's step budget (max_steps) is simulated, never
    # read from it.
    policy = build(
        Policy, argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "max_steps"})
    )
    if args.calibrate:
        if policy.abort_below is not None and not policy.auto:
            raise CliError(
                "--calibrate learns the abort threshold (abort-below auto); drop "
                f"--abort-below {policy.abort_below:g}"
            )
        if args.orders < 0:
            raise CliError(
                f"--orders {args.orders}: use 0 or more random orders (0: the recorded order only)"
            )
        # The plain report's sweep and AUROC do not depend on the threshold; its decisions need a
        # number.
        return dataclasses.replace(policy, abort_below=None)
    if policy.auto:
        # The sweep's decisions need a fixed threshold; learning one run after run is --calibrate's
        # replay.
        raise CliError(
            "eval --abort-below auto: a threshold learnt online needs eval --calibrate --alpha A; "
            "pass a number here to see that threshold's decisions"
        )
    return policy


@contextlib.contextmanager
def _progress_bar(total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (plain lines when rich is missing or stderr is not a
    terminal)."""
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        if not Console(stderr=True).is_terminal:
            raise ImportError  # a log file gets plain lines, not a bar redrawn in place
    except ImportError:
        done, said = [0], [time.monotonic()]
        # a batch log shows at once that work began
        print(f"{what}: 0/{total}", file=sys.stderr, flush=True)

        def plain(note: str) -> None:
            done[0] += 1
            now = time.monotonic()
            # The first, every tenth, the last, and at least one line every 15 s: a slow judge never
            # looks hung.
            if done[0] in (1, total) or done[0] % 10 == 0 or now - said[0] >= 15.0:
                said[0] = now
                print(f"{what}: {done[0]}/{total} ({note})", file=sys.stderr, flush=True)

        yield plain
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(what, total=total, note="")
        yield lambda note: bar.update(task, advance=1, note=note)


def _open_store(state_dir: str | None) -> SqliteStore:
    from ..daemon import SqliteStore, StoreFormatError, default_state_dir

    path = Path(state_dir).expanduser() if state_dir else default_state_dir()
    try:
        return SqliteStore(path / "runs.sqlite3")
    except (OSError, sqlite3.Error, StoreFormatError) as e:
        raise CliError(
            f"cannot open the run store in {path}: {e}; pass --state-dir, or --no-store"
        ) from None


@contextlib.asynccontextmanager
async def _journal(args: argparse.Namespace) -> AsyncIterator[tuple[object, Any]]:
    """The journal the options name (a cluster's shared one with --cluster, else the SQLite store)
    and where it is.

    Both read alike (`list_runs`, `export`, `samples`, `reset_family`); a cluster that cannot be
    read is a CliError.
    """
    cluster = build(ClusterSettings, args)
    if cluster.url is None:
        store = _open_store(args.state_dir)
        try:
            yield store.path, store
        finally:
            await store.aclose()
        return
    from ..daemon import ClusterJournal, ClusterUnavailable

    try:
        async with ClusterJournal(cluster) as journal:
            yield journal.where, journal
    except (ClusterUnavailable, ImportError) as e:
        raise CliError(str(e)) from None


async def _runs(args: argparse.Namespace) -> int:
    async with _journal(args) as (store_path, store):
        rows = await store.list_runs(args.limit)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print(f"no runs in {store_path}")
        return 0
    print(
        f"{'run_id':<32} {'state':<9} {'outcome':<9} {'step':>5} {'score':>6} {'signal':<9} "
        f"{'tokens in':>10} {'cached':>10} {'out':>7} {'cost USD':>10} task"
    )
    for r in rows:
        state = "ended" if r["ended_at"] else "live"
        score = "" if r["last_score"] is None else f"{r['last_score']:.3f}"
        t = r["totals"]
        # Cost as the store has it (the monitor's prices when it scored); blank when it ran without
        # prices.
        cost = "" if t["cost"] is None else f"{t['cost']:.6f}"
        print(
            f"{r['run_id']:<32} {state:<9} {r['outcome'] or '':<9} {r['last_step'] or 0:>5} "
            f"{score:>6} "
            f"{r['signal'] or '':<9} {t['input']:>10} {t['cached_input']:>10} "
            f"{t['output']:>7} {cost:>10} "
            f"{(r['task'] or '')[:60]}"
        )
    return 0


async def _calibration(args: argparse.Namespace) -> int:
    from ..calibration import Calibration

    policy = build(Policy, args)
    async with _journal(args) as (where, store):
        if args.reset is not None:
            return _reset_family(args.reset, await store.reset_family(args.reset), where)
        cal = Calibration(await store.samples())
    rows = [(f, cal.threshold(f.family, policy)) for f in cal.families()]
    if args.json:
        for f, th in rows:
            fam = f.family
            data = {
                "family": fam.name,
                "model": fam.model,
                "rubric": fam.rubric,
                "successes": f.successes,
            }
            data |= {
                "failures": f.failures,
                "last_at": f.last_at,
                "alpha": th.alpha,
                "needed": th.needed,
            }
            data |= {"threshold": th.value, "reason": th.reason}
            # The other calibrated decisions of the same rule: the step budget (successes) and done
            # (failures).
            budget, done = cal.budget(fam, policy, policy.alpha), cal.done(fam, policy)
            data |= {
                "step_budget": budget.value,
                "done_above": done.value,
                "done_reason": done.reason,
            }
            print(json.dumps(data))
        return 0
    if not rows:
        print(
            f"no calibration samples in {where} yet: each run that ends with outcome success "
            "or failure adds one, "
            'if no abort rule could have stopped it (no abort_below, or "auto" not yet '
            "calibrated or held out; "
            "not a numeric abort_below)"
        )
        return 0
    print(
        f"{'family':<40} {'judge model':<24} {'rubric':<16} {'successes':>9} "
        f"{'failures':>8}  threshold"
    )
    for f, th in rows:
        fam = f.family
        shown = (
            f"{th.value:.4f}"
            if th.value is not None
            else (f"never aborts ({th.successes} of {th.needed} successes)")
        )
        print(
            f"{fam.name[:40]:<40} {fam.model[:24]:<24} {fam.rubric:<16} {f.successes:>9} "
            f"{f.failures:>8}  {shown}"
        )
    print(
        f"\nthresholds for alpha {policy.alpha:g}, min_steps {policy.min_steps}, patience "
        f"{policy.patience}, "
        f"max_uncertainty {policy.max_uncertainty:g}"
    )
    return 0


def _reset_family(name: str, deleted: int, path: object) -> int:
    if not deleted:
        return _fail(f"no family {name!r} in {path}; `agent-monitor calibration` lists them")
    print(
        f"deleted {deleted} sample{'s' if deleted != 1 else ''} of family {name!r} from {path}; "
        "a running agent-monitor serve keeps using them until it restarts"
    )
    return 0


async def _read_export(args: argparse.Namespace) -> tuple[object, dict[str, Any] | None]:
    async with _journal(args) as (where, store):
        return where, await store.export(args.run_id)


def _export(args: argparse.Namespace) -> int:
    path, data = asyncio.run(_read_export(args))
    if data is None:
        return _fail(f"no run {args.run_id!r} in {path}; `agent-monitor runs` lists them")
    text = json.dumps(data, indent=2)
    if args.output == "-":
        print(text)
    else:
        Path(args.output).write_text(text + "\n")
    return 0


def _schemas(args: argparse.Namespace) -> int:
    from ..wire import stale_schemas, write_schemas

    if args.write:
        for p in write_schemas(args.write):
            print(p)
        return 0
    bad = stale_schemas(args.check)
    if bad:
        print(
            f"stale schemas in {args.check}: {', '.join(bad)}; run agent-monitor schemas "
            f"--write {args.check}"
        )
        return 1
    return 0


def _top(args: argparse.Namespace) -> int:
    from ..wire import Topics
    from ._top import TopError, top

    broker = build(BrokerOptions, args).settings()
    options = build(TopOptions, args)
    # a prefix that is not a topic is one line now, not a refused subscription
    prefix = Topics(args.prefix).prefix
    try:
        asyncio.run(top(broker, prefix, options))
    except TopError as e:
        return _fail(str(e))
    return 0


class _Stderr:
    """Whatever sys.stderr is when a line is written (it may be swapped after logging is
    configured)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _configure_logging(level: str, *, drop: Sequence[str] = ()) -> None:
    """JSON log lines on stderr at `level` and above; events named in `drop` are left out."""
    import logging

    import structlog

    dropped = frozenset(drop)

    def leave_out(_logger: object, _method: str, event: Any) -> Any:
        if event.get("event") in dropped:
            raise structlog.DropEvent
        return event

    # Logs go to stderr so that stdout stays the command's output (tables, JSON lines).
    structlog.configure(
        processors=[
            leave_out,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
    )


def _config_path(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The settings file `--config FILE` names (read before the flags are built: it gives their
    defaults)."""
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == "--config":
            if i + 1 >= len(argv):
                raise FlagError("--config needs a FILE: the TOML settings file to read")
            return argv[i + 1]
        if a.startswith("--config="):
            return a.partition("=")[2]
    return environ.get(CONFIG_ENV) or None


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of the `agent-monitor` console script."""
    env = os.environ if environ is None else environ
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = _parser(Settings.load(env, _config_path(argv, env)))
        args = parser.parse_args(argv)
    except (CliError, FlagError, ValueError) as e:
        return _fail(str(e))
    if args.command is None:
        # No command is a usage error, as argparse treats any other (exit code 2), shown as the
        # whole help.
        parser.print_help(sys.stderr)
        return 2
    level = env.get("AGENT_MONITOR_LOG_LEVEL", "warning") or "warning"
    _configure_logging(level)
    try:
        if args.command == "score":
            # Each row already shows its failure; the tracker's log line would say it a second time.
            _configure_logging(level, drop=["score_failed"])
            return asyncio.run(_score(args))
        if args.command in ("serve", "proxy"):
            _configure_logging(args.log_level)
            return asyncio.run(_serve(args))
        if args.command == "demo":
            return asyncio.run(_demo(args))
        if args.command == "eval":
            return asyncio.run(_eval(args))
        if args.command == "select":
            return asyncio.run(_select(args))
        if args.command == "replay":
            from ._replay import replay_cli

            return replay_cli(args)
        if args.command == "top":
            return _top(args)
        if args.command == "schemas":
            return _schemas(args)
        if args.command == "runs":
            return asyncio.run(_runs(args))
        if args.command == "export":
            return _export(args)
        if args.command == "calibration":
            return asyncio.run(_calibration(args))
        if args.command == "judge-server":
            from ._judge_server import run as _judge_server

            return _judge_server(args)
        if args.command == "config":
            from ._config_cli import print_config

            args.config = _config_path(argv, env)
            return print_config(
                args,
                argv,
                (BrokerOptions, JudgeOptions, MonitorConfig, ServeOptions, ProxySettings),
            )
        if args.command == "self-check":
            from ._selfcheck import run as _self_check

            return _self_check(args)
    except (RecordedRunError, CriteriaError, SettingsError, PolicyError, CliError, ValueError) as e:
        print(f"agent-monitor: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
