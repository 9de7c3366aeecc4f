"""The command line: settings from flags and environment, turned into objects; `agent-monitor score`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence

from .criteria import CriteriaError
from .judges.base import BaseJudge
from .recorded import RecordedRunError, iter_recorded
from .tracker import AsyncProgressTracker, Progress

_JUDGES = ("openai", "gemini", "local")


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
    return parser


def _row(p: Progress) -> str:
    if not p.ok:
        return f"{p.step:>5}  {'FAILED':>6}  {p.reason}: {p.error}"
    bar = "#" * round((p.score or 0.0) * 20)
    return (
        f"{p.step:>5}  {p.score:6.3f}  ±{p.uncertainty:5.3f}  mass {p.mass:4.2f}  "
        f"{p.latency_s:6.2f}s  in {p.usage.input_tokens:>6} cached {p.usage.cached_input_tokens:>6}  {bar}"
    )


async def _score(args: argparse.Namespace) -> int:
    if not args.judge:
        print(
            "agent-monitor: no judge chosen; pass --judge openai|gemini|local (or set AGENT_MONITOR_JUDGE)",
            file=sys.stderr,
        )
        return 2
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
    args = _parser(env).parse_args(argv)
    _configure_logging(_env(env, "LOG_LEVEL", "warning") or "warning")
    try:
        if args.command == "score":
            return asyncio.run(_score(args))
    except (RecordedRunError, CriteriaError) as e:
        print(f"agent-monitor: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
