"""Replay recorded runs to a broker as live runs, honouring their recorded timing (scaled), to
watch the monitor."""

from __future__ import annotations

import argparse
import heapq
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..offline.recorded import RecordedRun, iter_recorded
from ..wire import MonitorClient, Run


@dataclass(frozen=True, slots=True, order=True)
class _Due:
    at: float
    order: int
    run: int
    kind: str
    step: int


def run_id_for(name: str, prefix: str = "replay-") -> str:
    """A valid run id (one topic level) from a recorded run's name."""
    clean = re.sub(r"[^A-Za-z0-9._:-]", "-", name).strip("-.") or "run"
    return (prefix + clean)[:128]


def schedule(
    runs: Sequence[RecordedRun],
    *,
    speed: float = 1.0,
    interval_s: float = 1.0,
    max_gap_s: float = 30.0,
) -> list[_Due]:
    """When each start, step and end is due (seconds from now): recorded gaps, capped and divided
    by `speed`."""
    if speed <= 0:
        raise ValueError("speed must be > 0")
    due: list[_Due] = []
    order = 0
    for r, run in enumerate(runs):
        t = 0.0
        due.append(_Due(0.0, order, r, "start", 0))
        order += 1
        prev = None
        for i, step in enumerate(run.steps, 1):
            if step.timestamp is not None and prev is not None:
                gap = (step.timestamp - prev).total_seconds()
                gap = min(max(gap, 0.0), max_gap_s)
            else:
                gap = interval_s
            prev = step.timestamp or prev
            t += gap / speed
            due.append(_Due(t, order, r, "step", i))
            order += 1
        due.append(_Due(t + interval_s / speed, order, r, "end", 0))
        order += 1
    heapq.heapify(due)
    return [heapq.heappop(due) for _ in range(len(due))]


def replay(
    runs: Sequence[RecordedRun],
    client: MonitorClient,
    *,
    speed: float = 1.0,
    interval_s: float = 1.0,
    max_gap_s: float = 30.0,
    run_prefix: str = "replay-",
    criteria: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_event: Callable[[str, str, int], object] | None = None,
    settle_s: float = 0.0,
) -> dict[str, Run]:
    """Publish every run as live (all runs at once, interleaved in recorded time); return the client
    runs.

    With `settle_s`, a run whose end comes before the monitor's score of its last step (or its
    abort) ends after the others' events, once that score came or `settle_s` passed: the client
    stops listening to a run it ended, so a fast replay would otherwise end every run before its
    last score.
    """
    plan = schedule(runs, speed=speed, interval_s=interval_s, max_gap_s=max_gap_s)
    live: dict[int, Run] = {}
    held: list[int] = []
    begin = time.monotonic()

    def end(i: int) -> None:
        outcome = runs[i].outcome
        live[i].end(None if outcome is None else "success" if outcome >= 0.5 else "failure")
        if on_event:
            on_event(run_id_for(runs[i].name, run_prefix), "end", len(runs[i].steps))

    for d in plan:
        wait = begin + d.at - time.monotonic()
        if wait > 0:
            sleep(wait)
        run = runs[d.run]
        rid = run_id_for(run.name, run_prefix)
        if d.kind == "start":
            live[d.run] = client.start_run(rid, task=run.task, criteria=criteria)
        elif d.kind == "step":
            live[d.run].step(run.steps[d.step - 1].text, index=d.step)
        elif settle_s > 0 and not _settled(live[d.run], len(run.steps)):
            held.append(d.run)
            continue
        else:
            end(d.run)
            continue
        if on_event:
            on_event(rid, d.kind, d.step)
    deadline = time.monotonic() + settle_s
    for i in held:
        while not _settled(live[i], len(runs[i].steps)) and time.monotonic() < deadline:
            time.sleep(0.05)
        end(i)
    return {run_id_for(runs[i].name, run_prefix): r for i, r in live.items()}


def _settled(run: Run, last: int) -> bool:
    """Whether the monitor told a run all it will: its last step's score, or an abort (nothing
    scored after)."""
    p = run.progress
    return (p is not None and p.step >= last) or run.should_abort


def replay_cli(args: argparse.Namespace) -> int:
    """`agent-monitor replay PATH`."""
    from ..robotdata import is_robot_data

    if is_robot_data(args.path):
        from ._robot_replay import robot_replay_cli

        return robot_replay_cli(args)
    runs = list(iter_recorded(args.path))
    if args.max_steps:
        runs = [RecordedRun(r.name, r.task, r.steps[: args.max_steps], r.outcome) for r in runs]
    if not runs:
        print(f"agent-monitor: no recorded runs in {args.path}", file=sys.stderr)
        return 2
    steps = sum(len(r.steps) for r in runs)
    print(
        f"replaying {len(runs)} runs ({steps} steps) to {args.broker} at {args.speed:g}x",
        file=sys.stderr,
    )
    try:
        with MonitorClient(args.broker, prefix=args.prefix) as client:

            def show(rid: str, kind: str, step: int) -> None:
                if kind != "step":
                    print(f"{kind:<5} {rid}", file=sys.stderr, flush=True)

            done = replay(
                runs,
                client,
                speed=args.speed,
                interval_s=args.interval,
                max_gap_s=args.max_gap,
                run_prefix=args.run_prefix,
                criteria=args.criteria,
                on_event=show,
                settle_s=args.settle,
            )
            heard = False
            for rid, run in done.items():
                p = run.progress
                heard = heard or p is not None
                last = (
                    f"step {p.step} score {p.score:.3f}"
                    if p is not None and p.score is not None
                    else None
                )
                if last is None:
                    last = (
                        f"step {p.step} not scored ({p.reason})"
                        if p is not None
                        else "no score received"
                    )
                print(
                    f"{rid}: {last}; signal {run.signal.signal if run.signal else 'continue'}",
                    file=sys.stderr,
                )
            if not heard:
                print(
                    f"agent-monitor: no monitor answered within {args.settle:g} s of the last "
                    "step: is "
                    f"`agent-monitor serve` running on {args.broker} with --topic-prefix "
                    f"{args.prefix}? "
                    "(a slow judge needs a longer --settle)",
                    file=sys.stderr,
                )
    except ConnectionError as e:
        print(f"agent-monitor: {e}", file=sys.stderr)
        return 2
    return 0
