"""The command line: settings from flags and environment, turned into objects; `agent-monitor score`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sqlite3
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .criteria import CriteriaError
from .judges.base import BaseJudge, JudgeError
from .policy import Policy, PolicyError
from .recorded import RecordedRunError, iter_recorded
from .settings import DEFAULT_BROKER, BrokerSettings, SettingsError
from .store import SqliteStore, default_state_dir
from .tracker import AsyncProgressTracker, Progress

_JUDGES = ("openai", "gemini", "local")


class CliError(Exception):
    """A setting the command cannot work with; printed as one line, exit code 2."""


def _env(environ: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    return environ.get(f"AGENT_MONITOR_{name}", default)


def build_judge(
    kind: str, *, url: str | None, model: str | None, api: str = "chat", timeout_s: float = 60.0
) -> BaseJudge:
    """The judge named on the command line."""
    if kind == "openai":
        from .judges.openai import OpenAIJudge

        return OpenAIJudge(
            base_url=url, model=model, api="completions" if api == "completions" else "chat", timeout_s=timeout_s
        )
    if kind == "gemini":
        from .judges.gemini import GeminiJudge

        return GeminiJudge(model=model or "gemini-2.5-flash", base_url=url, timeout_s=timeout_s)
    if kind == "local":
        from .judges.llamacpp import LlamaCppJudge

        return LlamaCppJudge(model_path=model, timeout_s=max(timeout_s, 600.0))
    raise SystemExit(f"agent-monitor: unknown judge {kind!r}; choose one of {', '.join(_JUDGES)}")


def _judge_flags(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    p.add_argument(
        "--judge", choices=_JUDGES, default=_env(environ, "JUDGE"), help="judge backend [AGENT_MONITOR_JUDGE]"
    )
    p.add_argument(
        "--judge-url",
        default=_env(environ, "JUDGE_URL"),
        help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 [AGENT_MONITOR_JUDGE_URL]",
    )
    p.add_argument(
        "--judge-model",
        default=_env(environ, "JUDGE_MODEL"),
        help="model id (openai/gemini) or GGUF path (local) [AGENT_MONITOR_JUDGE_MODEL]",
    )
    p.add_argument(
        "--judge-api",
        choices=("chat", "completions"),
        default=_env(environ, "JUDGE_API", "chat"),
        help="OpenAI-compatible API to use [AGENT_MONITOR_JUDGE_API]",
    )
    p.add_argument(
        "--judge-timeout",
        type=float,
        default=float(_env(environ, "JUDGE_TIMEOUT", "60") or 60),
        help="seconds per judge call",
    )


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-monitor", description="Live, fine-grained progress scores for AI agents and robots."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser(
        "score", help="score every prefix of recorded runs (ATIF or plain JSON), as a live monitor would"
    )
    score.add_argument("path", help="a recorded run (.json) or a folder of them")
    _judge_flags(score, environ)
    score.add_argument("--criteria", default=None, help="bundled rubric name (progress, coding, robot) or a .md path")
    score.add_argument("--max-steps", type=int, default=None, help="score at most this many steps per run")
    score.add_argument("--min-mass", type=float, default=0.5, help="minimum letter probability mass for a score")
    score.add_argument("--json", action="store_true", help="print one JSON object per scored step instead of a table")
    _serve_flags(
        sub.add_parser("serve", help="follow live runs over MQTT; publish progress and abort/resample signals"), environ
    )
    ev = sub.add_parser(
        "eval", help="score recorded runs with known outcomes as live; report AUROC, correlation, abort thresholds"
    )
    ev.add_argument("path", help="a recorded run (.json) or a folder of them (ATIF or plain)")
    _judge_flags(ev, environ)
    ev.add_argument("--criteria", default=None, help="bundled rubric name or a criteria file")
    ev.add_argument("--min-mass", type=float, default=0.5, help="minimum letter probability mass for a score")
    ev.add_argument("--repeats", type=int, default=1, help="judge repeats per criterion")
    ev.add_argument("--max-steps", type=int, default=None, help="score at most this many steps per run")
    ev.add_argument("--min-steps", type=int, default=3, help="policy: no abort before this step")
    ev.add_argument("--patience", type=int, default=3, help="policy: low scores in a row before abort")
    ev.add_argument(
        "--max-uncertainty", type=float, default=0.35, help="policy: scores more uncertain than this don't count"
    )
    ev.add_argument("--abort-below", type=float, default=None, help="also report each run's decision at this threshold")
    ev.add_argument("--max-false-abort", type=float, default=0.05, help="false-abort rate the recommendation must keep")
    ev.add_argument("--out", default="agent-monitor-eval", help="folder for the CSVs, PNG and JSON report")
    ev.add_argument(
        "--cache", default=None, help="score cache file (default: OUT/score-cache.sqlite3); re-runs are free"
    )
    rp = sub.add_parser("replay", help="publish recorded runs to a broker as live runs (to watch the monitor)")
    rp.add_argument("path", help="a recorded run (.json) or a folder of them")
    rp.add_argument("--broker", default=_env(environ, "BROKER", DEFAULT_BROKER), help="[AGENT_MONITOR_BROKER]")
    rp.add_argument("--topic-prefix", default=_env(environ, "TOPIC_PREFIX", "agents"))
    rp.add_argument("--speed", type=float, default=1.0, help="time scale: 10 replays ten times faster than recorded")
    rp.add_argument(
        "--interval", type=float, default=1.0, help="seconds between steps without timestamps (before --speed)"
    )
    rp.add_argument(
        "--max-gap", type=float, default=30.0, help="cap on one recorded pause, in seconds (before --speed)"
    )
    rp.add_argument("--run-prefix", default="replay-", help="prefix of the run ids (the file name follows)")
    rp.add_argument("--max-steps", type=int, default=None, help="publish at most this many steps per run")
    rp.add_argument("--criteria", default=None, help="bundled rubric name to send in each start")
    demo = sub.add_parser("demo", help="the whole loop offline: embedded broker, tiny local judge, example runs live")
    demo.add_argument("--short", action="store_true", help="three steps per run (CI)")
    demo.add_argument("--out", default="agent-monitor-demo", help="folder for the progress plot")
    demo.add_argument("--metrics-port", type=int, default=9464, help="/metrics port while the demo runs (0: any free)")
    demo.add_argument("--pace", type=float, default=1.0, help="seconds between steps of each run")
    demo.add_argument("--min-mass", type=float, default=0.05, help="minimum letter mass (the tiny judge needs it low)")
    demo.add_argument("--judge", choices=_JUDGES, default=None, help="a real judge instead of the packaged tiny one")
    demo.add_argument("--judge-url", default=None)
    demo.add_argument("--judge-model", default=None)
    demo.add_argument("--judge-api", choices=("chat", "completions"), default="chat")
    demo.add_argument("--judge-timeout", type=float, default=60.0)
    runs = sub.add_parser("runs", help="list live and recent runs from the run store")
    _state_flag(runs, environ)
    runs.add_argument("--limit", type=int, default=50, help="at most this many runs, newest first")
    runs.add_argument("--json", action="store_true", help="one JSON object per run")
    export = sub.add_parser("export", help="write a run's steps and score curve as JSON")
    export.add_argument("run_id")
    _state_flag(export, environ)
    export.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    return parser


def _state_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup, environ: Mapping[str, str]) -> None:
    p.add_argument(
        "--state-dir",
        default=_env(environ, "STATE_DIR"),
        help="where the run store lives (default: $XDG_DATA_HOME/agent-monitor) [AGENT_MONITOR_STATE_DIR]",
    )


def _num(environ: Mapping[str, str], name: str, kind: type[float] | type[int], default: float | int | None) -> Any:
    raw = _env(environ, name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise CliError(f"AGENT_MONITOR_{name}={raw!r} is not a{'n integer' if kind is int else ' number'}") from None


def _serve_flags(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    e = environ
    mq = p.add_argument_group("MQTT")
    mq.add_argument(
        "--broker",
        default=_env(e, "BROKER", DEFAULT_BROKER),
        help="mqtt://[user[:pass]@]host:port or mqtts://... [AGENT_MONITOR_BROKER]",
    )
    mq.add_argument("--broker-username", default=_env(e, "BROKER_USERNAME"), help="[AGENT_MONITOR_BROKER_USERNAME]")
    mq.add_argument(
        "--broker-password",
        default=_env(e, "BROKER_PASSWORD"),
        help="prefer the env var [AGENT_MONITOR_BROKER_PASSWORD]",
    )
    mq.add_argument(
        "--tls-ca", default=_env(e, "TLS_CA"), help="CA file for mqtts:// (default: system CAs) [AGENT_MONITOR_TLS_CA]"
    )
    mq.add_argument("--tls-cert", default=_env(e, "TLS_CERT"), help="client certificate (PEM) [AGENT_MONITOR_TLS_CERT]")
    mq.add_argument("--tls-key", default=_env(e, "TLS_KEY"), help="client key (PEM) [AGENT_MONITOR_TLS_KEY]")
    mq.add_argument(
        "--topic-prefix", default=_env(e, "TOPIC_PREFIX", "agents"), help="topic prefix [AGENT_MONITOR_TOPIC_PREFIX]"
    )
    mq.add_argument(
        "--client-id",
        default=_env(e, "CLIENT_ID", "agent-monitor"),
        help="fixed MQTT client id: the broker keeps its session across restarts [AGENT_MONITOR_CLIENT_ID]",
    )
    mq.add_argument(
        "--mqtt-protocol",
        choices=("auto", "5", "3.1.1"),
        default=_env(e, "MQTT_PROTOCOL", "auto"),
        help="auto: v5, else 3.1.1 [AGENT_MONITOR_MQTT_PROTOCOL]",
    )
    mq.add_argument(
        "--session-expiry",
        type=int,
        default=_num(e, "SESSION_EXPIRY", int, 3600),
        help="seconds the broker keeps queueing steps while the monitor is down [AGENT_MONITOR_SESSION_EXPIRY]",
    )
    mq.add_argument(
        "--embedded-broker",
        action="store_true",
        default=_env(e, "EMBEDDED_BROKER", "") in ("1", "true", "yes"),
        help="run an MQTT 3.1.1 broker in-process on --broker's host:port (needs agent-monitor[embedded]) [AGENT_MONITOR_EMBEDDED_BROKER=1]",
    )
    _judge_flags(p, environ)
    sc = p.add_argument_group("scoring")
    sc.add_argument(
        "--max-concurrency",
        type=int,
        default=_num(e, "MAX_CONCURRENCY", int, 8),
        help="judge calls in flight at once, shared by all runs [AGENT_MONITOR_MAX_CONCURRENCY]",
    )
    sc.add_argument(
        "--repeats",
        type=int,
        default=_num(e, "REPEATS", int, 1),
        help="judge repeats per criterion [AGENT_MONITOR_REPEATS]",
    )
    sc.add_argument(
        "--min-mass",
        type=float,
        default=_num(e, "MIN_MASS", float, 0.5),
        help="minimum letter probability mass for a score [AGENT_MONITOR_MIN_MASS]",
    )
    po = p.add_argument_group("policy defaults (a run's start.policy overrides them, same names in snake_case)")
    po.add_argument(
        "--abort-below",
        type=float,
        default=_num(e, "ABORT_BELOW", float, None),
        help="abort when the score stays below this [AGENT_MONITOR_ABORT_BELOW]",
    )
    po.add_argument(
        "--resample-below",
        type=float,
        default=_num(e, "RESAMPLE_BELOW", float, None),
        help="resample when the score is below this [AGENT_MONITOR_RESAMPLE_BELOW]",
    )
    po.add_argument(
        "--min-steps",
        type=int,
        default=_num(e, "MIN_STEPS", int, 3),
        help="no signal before this step [AGENT_MONITOR_MIN_STEPS]",
    )
    po.add_argument(
        "--patience",
        type=int,
        default=_num(e, "PATIENCE", int, 3),
        help="scored steps below abort-below before abort [AGENT_MONITOR_PATIENCE]",
    )
    po.add_argument(
        "--regression",
        type=float,
        default=_num(e, "REGRESSION", float, None),
        help="resample on a fall this large from the run's best [AGENT_MONITOR_REGRESSION]",
    )
    po.add_argument(
        "--max-uncertainty",
        type=float,
        default=_num(e, "MAX_UNCERTAINTY", float, 0.35),
        help="scores more uncertain than this neither abort nor resample [AGENT_MONITOR_MAX_UNCERTAINTY]",
    )
    ru = p.add_argument_group("runs")
    _state_flag(ru, environ)
    ru.add_argument(
        "--no-store",
        action="store_true",
        default=_env(e, "NO_STORE", "") in ("1", "true", "yes"),
        help="keep runs in memory only (a restart forgets them) [AGENT_MONITOR_NO_STORE=1]",
    )
    ru.add_argument(
        "--allow-image-dir",
        action="append",
        default=[d for d in (_env(e, "ALLOW_IMAGE_DIRS") or "").split(os.pathsep) if d],
        help='let events name image files under this directory ({"path": ...}); repeatable; off by default '
        "[AGENT_MONITOR_ALLOW_IMAGE_DIRS, os.pathsep-separated]",
    )
    ru.add_argument(
        "--allow-image-host",
        action="append",
        default=[h for h in (_env(e, "ALLOW_IMAGE_HOSTS") or "").split(",") if h],
        help='let events name image URLs on this host ({"url": ...}); repeatable; off by default '
        "[AGENT_MONITOR_ALLOW_IMAGE_HOSTS, comma-separated]",
    )
    ru.add_argument(
        "--rescore",
        action="store_true",
        help="on start, score restored runs afresh instead of keeping their stored scores (e.g. a new judge)",
    )
    ru.add_argument(
        "--retention",
        type=float,
        default=_num(e, "RETENTION", float, 7 * 24 * 3600.0),
        help="seconds ended runs stay in the store (for runs / export) [AGENT_MONITOR_RETENTION]",
    )
    ru.add_argument(
        "--hold",
        type=float,
        default=_num(e, "HOLD", float, 10.0),
        help="seconds a step waits for its start or for missing earlier steps [AGENT_MONITOR_HOLD]",
    )
    ru.add_argument(
        "--idle-timeout",
        type=float,
        default=_num(e, "IDLE_TIMEOUT", float, 3600.0),
        help="seconds without events before a run expires [AGENT_MONITOR_IDLE_TIMEOUT]",
    )
    ru.add_argument(
        "--max-runs",
        type=int,
        default=_num(e, "MAX_RUNS", int, 10_000),
        help="live runs; the idlest is evicted beyond [AGENT_MONITOR_MAX_RUNS]",
    )
    ob = p.add_argument_group("observability")
    ob.add_argument(
        "--metrics-port",
        type=int,
        default=_num(e, "METRICS_PORT", int, 9464),
        help="Prometheus /metrics port, 0 to disable [AGENT_MONITOR_METRICS_PORT]",
    )
    ob.add_argument(
        "--metrics-host",
        default=_env(e, "METRICS_HOST", "127.0.0.1"),
        help="address /metrics binds to [AGENT_MONITOR_METRICS_HOST]",
    )
    ob.add_argument(
        "--metric-labels",
        default=_env(e, "METRIC_LABELS", "group,model"),
        help="start.labels that become labels of the per-run gauges (comma-separated; keep them few) "
        "[AGENT_MONITOR_METRIC_LABELS]",
    )
    ob.add_argument(
        "--max-series",
        type=int,
        default=_num(e, "MAX_SERIES", int, 1000),
        help="runs exported per run at most (the most recently active); the rest are counted in "
        "agent_monitor_run_series_capped [AGENT_MONITOR_MAX_SERIES]",
    )
    ob.add_argument(
        "--metrics-grace",
        type=float,
        default=_num(e, "METRICS_GRACE", float, 60.0),
        help="seconds an ended run's per-run series stay visible [AGENT_MONITOR_METRICS_GRACE]",
    )
    ob.add_argument(
        "--log-level",
        default=_env(e, "LOG_LEVEL", "info"),
        help="debug, info, warning, error [AGENT_MONITOR_LOG_LEVEL]",
    )


def _row(p: Progress) -> str:
    if not p.ok:
        return f"{p.step:>5}  {'FAILED':>6}  {p.reason}: {p.error}"
    bar = "#" * round((p.score or 0.0) * 20)
    return (
        f"{p.step:>5}  {p.score:6.3f}  ±{p.uncertainty:5.3f}  mass {p.mass:4.2f}  "
        f"{p.latency_s:6.2f}s  in {p.usage.input_tokens:>6} cached {p.usage.cached_input_tokens:>6}  {bar}"
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
    try:
        judge = build_judge(
            args.judge, url=args.judge_url, model=args.judge_model, api=args.judge_api, timeout_s=args.judge_timeout
        )
    except Exception as e:  # SDKs raise their own types for missing keys or extras; one line for the user
        print(f"agent-monitor: cannot set up the {args.judge} judge: {e}", file=sys.stderr)
        return 2
    failures = 0
    try:
        for run in runs:
            steps = run.steps[: args.max_steps] if args.max_steps else run.steps
            tracker = AsyncProgressTracker(
                run.task, judge=judge, criteria=args.criteria, min_mass=args.min_mass, run_id=run.name
            )
            if not args.json:
                print(f"\n{run.name}  ({len(steps)} steps, outcome {run.outcome})")
            for s in steps:
                p = await tracker.update(s.text)
                failures += not p.ok
                print(json.dumps({"run": run.name, **p.as_dict()}) if args.json else _row(p), flush=True)
    finally:
        await judge.aclose()
    if not args.json:
        print(
            f"\njudge {judge.name} model {judge.model}: {judge.calls} calls, {judge.failures} failed; tokens in {judge.usage.input_tokens}, cached {judge.usage.cached_input_tokens}"
        )
    return 1 if failures else 0


async def _ready_judge(args: argparse.Namespace, concurrency: int) -> BaseJudge:
    """Build the judge and check it can answer before any run depends on it; raise CliError with one line."""
    try:
        judge = build_judge(
            args.judge, url=args.judge_url, model=args.judge_model, api=args.judge_api, timeout_s=args.judge_timeout
        )
    except Exception as e:  # SDKs raise their own types for a missing key or extra
        raise CliError(f"cannot set up the {args.judge} judge: {e}") from None
    judge.concurrency = concurrency
    try:
        if args.judge == "openai" and not args.judge_model:
            from .judges.openai import OpenAIJudge

            assert isinstance(judge, OpenAIJudge)
            await judge.resolve_model()
        elif args.judge == "local":
            from .judges.llamacpp import LlamaCppJudge

            assert isinstance(judge, LlamaCppJudge)
            await judge.load()
    except (JudgeError, OSError, ValueError, RuntimeError) as e:
        await judge.aclose()
        where = f" at {args.judge_url}" if args.judge_url else ""
        raise CliError(f"the {args.judge} judge{where} is not usable: {e}") from None
    return judge


async def _serve(args: argparse.Namespace) -> int:
    import signal

    import structlog
    from prometheus_client import CollectorRegistry, start_http_server

    from .daemon import Monitor
    from .mqtt import BrokerUnavailable
    from .runs import RunLimits

    if not args.judge:
        return _fail(_NO_JUDGE)
    if args.max_concurrency < 1:
        return _fail(f"--max-concurrency {args.max_concurrency}: use 1 or more")
    broker = BrokerSettings.from_url(
        args.broker,
        username=args.broker_username,
        password=args.broker_password,
        ca_file=args.tls_ca,
        cert_file=args.tls_cert,
        key_file=args.tls_key,
    )
    policy = Policy(
        abort_below=args.abort_below,
        resample_below=args.resample_below,
        min_steps=args.min_steps,
        patience=args.patience,
        regression=args.regression,
        max_uncertainty=args.max_uncertainty,
    )
    limits = RunLimits(hold_s=args.hold, idle_timeout_s=args.idle_timeout, max_runs=args.max_runs)
    store = None if args.no_store else _open_store(args.state_dir)
    log = structlog.get_logger("agent_monitor.cli")
    async with contextlib.AsyncExitStack() as stack:
        if args.embedded_broker:
            from .broker import BrokerStartError, EmbeddedBroker

            try:
                embedded = await stack.enter_async_context(EmbeddedBroker(broker.host, broker.port))
            except BrokerStartError as e:
                return _fail(str(e))
            log.info("embedded_broker_started", url=embedded.url)
        if store is not None:
            stack.push_async_callback(store.aclose)
        judge = await _ready_judge(args, args.max_concurrency)
        stack.push_async_callback(judge.aclose)
        registry = CollectorRegistry()
        monitor = Monitor(
            judge=judge,
            broker=broker,
            prefix=args.topic_prefix,
            policy=policy,
            max_concurrency=args.max_concurrency,
            registry=registry,
            limits=limits,
            repeats=args.repeats,
            min_mass=args.min_mass,
            client_id=args.client_id,
            # amqtt speaks only 3.1.1: skip the doomed v5 attempt (and amqtt's warnings about it).
            protocol="3.1.1" if args.embedded_broker and args.mqtt_protocol == "auto" else args.mqtt_protocol,
            session_expiry_s=args.session_expiry,
            metric_labels=tuple(n.strip() for n in args.metric_labels.split(",") if n.strip()),
            max_series=args.max_series,
            metrics_grace_s=args.metrics_grace,
            store=store,
            retention_s=args.retention,
            rescore=args.rescore,
            image_dirs=tuple(args.allow_image_dir),
            image_hosts=tuple(args.allow_image_host),
        )
        if args.metrics_port:
            try:
                server, thread = start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
            except OSError as e:
                return _fail(
                    f"cannot serve /metrics on {args.metrics_host}:{args.metrics_port}: {e}; pass --metrics-port"
                )
            stack.callback(thread.join, 5)
            stack.callback(server.shutdown)
            log.info("metrics_serving", url=f"http://{args.metrics_host}:{args.metrics_port}/metrics")
        try:
            await stack.enter_async_context(monitor)
        except BrokerUnavailable as e:
            return _fail(str(e))
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        print(
            f"agent-monitor: serving {args.topic_prefix}/+/start|step|end on {broker.url} "
            f"with the {judge.name} judge ({judge.model or 'model from server'}); "
            f"run store {store.path if store else 'off (in memory)'}",
            file=sys.stderr,
            flush=True,
        )
        try:
            await monitor.wait()
        except asyncio.CancelledError:
            log.info("shutting_down")
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    judge = await _ready_judge(args, 2) if args.judge else None
    try:
        await run_demo(
            judge=judge, short=args.short, out_dir=args.out, metrics_port=args.metrics_port,
            min_mass=args.min_mass, pace_s=args.pace,
        )  # fmt: skip
    finally:
        if judge is not None:
            await judge.aclose()
    return 0


async def _eval(args: argparse.Namespace) -> int:
    from . import evaluate as ev

    if not args.judge:
        return _fail(_NO_JUDGE)
    runs = list(iter_recorded(args.path))
    if not runs:
        return _fail(f"no recorded runs in {args.path}")
    judge = await _ready_judge(args, 8)
    out = Path(args.out)
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
                on_step=lambda run, p: advance(f"{run.name} step {p.step}"),
            )
    finally:
        cache.close()
        await judge.aclose()
    policy = Policy(
        abort_below=args.abort_below,
        min_steps=args.min_steps,
        patience=args.patience,
        max_uncertainty=args.max_uncertainty,
    )
    report = ev.evaluate(curves, policy=policy, max_false_abort=args.max_false_abort)
    files = ev.write_csv(report, out)
    (out / "eval.json").write_text(json.dumps(ev.report_json(report), indent=2))
    files.append(out / "eval.json")
    try:
        files.append(ev.plot(report, out / "eval.png"))
    except ImportError:
        print("agent-monitor: no PNG: pip install 'agent-monitor[plot]' (matplotlib)", file=sys.stderr)
    failed = sum(s is None for c in curves for s in c.scores)
    cached = sum(c.cached for c in curves)
    print(ev.summary(report))
    print(
        f"\n{total} prefixes scored ({cached} from the cache, {failed} without a score); wrote "
        + ", ".join(map(str, files))
    )
    return 0


@contextlib.contextmanager
def _progress_bar(total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (plain lines when rich is missing or stderr is not a terminal)."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if not Console(stderr=True).is_terminal:
            raise ImportError  # a log file gets plain lines, not a bar redrawn in place
    except ImportError:
        done = [0]

        def plain(note: str) -> None:
            done[0] += 1
            if done[0] % 10 == 0 or done[0] == total:
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
    path = Path(state_dir).expanduser() if state_dir else default_state_dir()
    try:
        return SqliteStore(path / "runs.sqlite3")
    except (OSError, sqlite3.Error) as e:
        raise CliError(f"cannot open the run store in {path}: {e}; pass --state-dir, or --no-store") from None


async def _runs(args: argparse.Namespace) -> int:
    store = _open_store(args.state_dir)
    try:
        rows = await store.list_runs(args.limit)
    finally:
        await store.aclose()
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print(f"no runs in {store.path}")
        return 0
    print(f"{'run_id':<32} {'state':<9} {'outcome':<9} {'step':>5} {'score':>6} {'signal':<9} task")
    for r in rows:
        state = "ended" if r["ended_at"] else "live"
        score = "" if r["last_score"] is None else f"{r['last_score']:.3f}"
        print(
            f"{r['run_id']:<32} {state:<9} {r['outcome'] or '':<9} {r['last_step'] or 0:>5} {score:>6} "
            f"{r['signal'] or '':<9} {(r['task'] or '')[:60]}"
        )
    return 0


async def _read_export(args: argparse.Namespace) -> tuple[Path, dict[str, Any] | None]:
    store = _open_store(args.state_dir)
    try:
        return store.path, await store.export(args.run_id)
    finally:
        await store.aclose()


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


class _Stderr:
    """Whatever sys.stderr is when a line is written (it may be swapped after logging is configured)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _configure_logging(level: str) -> None:
    import logging

    import structlog

    # Logs go to stderr so that stdout stays the command's output (tables, JSON lines).
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
    )


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of the `agent-monitor` console script."""
    env = os.environ if environ is None else environ
    try:
        args = _parser(env).parse_args(argv)
    except CliError as e:
        return _fail(str(e))
    _configure_logging(_env(env, "LOG_LEVEL", "warning") or "warning")
    try:
        if args.command == "score":
            return asyncio.run(_score(args))
        if args.command == "serve":
            _configure_logging(args.log_level)
            return asyncio.run(_serve(args))
        if args.command == "demo":
            return asyncio.run(_demo(args))
        if args.command == "eval":
            return asyncio.run(_eval(args))
        if args.command == "replay":
            from .replay import replay_cli

            return replay_cli(args)
        if args.command == "runs":
            return asyncio.run(_runs(args))
        if args.command == "export":
            return _export(args)
    except (RecordedRunError, CriteriaError, SettingsError, PolicyError, CliError) as e:
        print(f"agent-monitor: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
