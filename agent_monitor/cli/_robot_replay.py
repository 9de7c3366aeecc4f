"""`agent-monitor replay` of robot data: a LeRobot v3 dataset or an MCAP bag, episode by episode,
with frames."""

from __future__ import annotations

import argparse
import itertools
import sys

from ..images import FrameBudget
from ..offline.recorded import RecordedRun
from ..robotdata import (
    DEFAULT_MAX_STEPS,
    Episode,
    ReadOptions,
    RobotDataError,
    StepSink,
    read_episodes,
    replay_episodes,
)
from ..wire import MonitorClient, Run


def _episodes(spec: str | None) -> list[int] | None:
    if not spec:
        return None
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise RobotDataError(
            f"--episodes {spec!r}: give episode indexes separated by commas, e.g. 0,3,7"
        ) from None


def options_from(args: argparse.Namespace) -> ReadOptions:
    """The read options of the command line's flags."""
    return ReadOptions(
        every=args.every,
        max_steps=args.max_steps or DEFAULT_MAX_STEPS,
        max_side=args.max_side or None,
        frame_budget=FrameBudget() if args.frames == "budget" else None,
    )


def recorded_episodes(args: argparse.Namespace) -> list[RecordedRun]:
    """`eval`'s runs from robot data: each episode read whole (frames held in memory; `--frames
    budget` keeps fewer)."""
    episodes = read_episodes(
        args.path,
        options_from(args),
        episodes=_episodes(args.episodes),
        task=args.task,
        task_topic=args.task_topic,
        outcome_topic=args.outcome_topic,
        cameras=args.camera,
    )
    return [ep.recorded() for ep in episodes]


def robot_replay_cli(args: argparse.Namespace) -> int:
    """Replay a LeRobot dataset or an .mcap bag to the broker; 2 on a file that cannot be read."""
    try:
        opts = options_from(args)
        episodes = read_episodes(
            args.path,
            opts,
            episodes=_episodes(args.episodes),
            task=args.task,
            task_topic=args.task_topic,
            outcome_topic=args.outcome_topic,
            cameras=args.camera,
        )
        # The file is read (its metadata, the first episode's) before connecting: a bad file is the
        # answer, not a broker error or a run started and then failed.
        first = next(episodes, None)
        if first is None:
            raise RobotDataError(f"{args.path}: no episodes")
        speed = args.speed
        print(
            f"replaying {args.path} to {args.broker} at {speed:g}x (one step per {opts.every} "
            "ticks)",
            file=sys.stderr,
        )
        runs: dict[str, Run] = {}
        with MonitorClient(args.broker, prefix=args.prefix) as client:

            def start(rid: str, ep: Episode) -> StepSink:
                print(
                    f"start {rid}: {ep.planned_steps} steps, {len(ep.cameras)} cameras, task "
                    f"{ep.task!r}" + (" (truncated by --max-steps)" if ep.truncated else ""),
                    file=sys.stderr,
                    flush=True,
                )
                runs[rid] = client.start_run(
                    rid, task=ep.task or "(no task recorded)", criteria=args.criteria
                )
                return runs[rid]

            stats = replay_episodes(
                itertools.chain([first], episodes),
                start,
                speed=speed,
                run_prefix=args.run_prefix,
                pause_s=args.interval,
            )
            for rid, run in runs.items():
                p = run.progress
                last = f"step {p.step} score {p.score}" if p is not None else "no progress seen yet"
                print(f"{rid}: {last}", file=sys.stderr)
        print(
            f"replayed {stats.episodes} episodes, {stats.steps} steps, {stats.frames} frames"
            + (
                f"; up to {stats.late_s:.2f} s behind the episode's pace"
                if stats.late_s > 0.05
                else ""
            ),
            file=sys.stderr,
        )
    except (RobotDataError, ValueError) as e:
        print(f"agent-monitor: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:
        print(f"agent-monitor: {e}", file=sys.stderr)
        return 2
    return 0
