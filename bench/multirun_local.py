"""Several runs on one in-process judge: one after the other against interleaved step by step.

The packaged Gemma 3 270M in `LlamaCppJudge`, the recorded runs from ../shared/data (the two
ATIF pytorch-model-cli runs; for more, the first terminal-bench-2.1 run of each task), the
first `--steps` agent steps of each. Every run has its own `AsyncProgressTracker` (its run id
becomes the judge calls' `run_key`), all on one judge. For each run count in `--runs`:

- sequential: each run's steps in turn, the next run only when one is done;
- interleaved: step 1 of every run, then step 2 of every run, ... (what the daemon does with
  live runs); with `--shared` also interleaved on a judge with `kv_budget_mb=0` (one prefix
  for all runs: the behaviour before per-run prefixes, slow).

Each mode starts on a fresh judge, after an untimed warm-up (3 steps of one run). Reported: prompt
tokens, tokens the model evaluated, wall seconds, saved-state restores and evictions, and the
largest score difference between the modes (the kept prefixes are exact: it should be 0). Target
(issue 14): interleaved evaluates at most 1.25x the tokens and takes at most 1.3x the time of
sequential.

    .venv/bin/python bench/multirun_local.py [--runs 2,8] [--steps 10] [--shared] [--kv-budget MB]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from _common import REPO, configure_logs, gemma_path, kv_line, load1

from agent_monitor import AsyncProgressTracker
from agent_monitor.judges.llamacpp import DEFAULT_KV_BUDGET_MB, LlamaCppJudge, TinyJudgeWarning
from agent_monitor.offline.recorded import RecordedRun, load_recorded

# ../shared/data from the main checkout; a worktree one level deeper finds it further up.
DATA = next(
    (p / "shared" / "data" for p in REPO.parents if (p / "shared" / "data").is_dir()), REPO / "data"
)


def recorded_runs(count: int, data: Path = DATA) -> list[RecordedRun]:
    """The two ATIF runs, then one terminal-bench-2.1 run per task (sorted), up to `count`."""
    files = sorted((data / "atif" / "pytorch-model-cli").glob("*.json"))
    bench = data / "terminal-bench-2.1"
    for task in sorted(p for p in bench.iterdir() if p.is_dir()) if bench.is_dir() else []:
        files.append(sorted(task.glob("*.json"))[0])
    if len(files) < count:
        sys.exit(
            f"only {len(files)} recorded runs under {data}; ask for fewer with --runs, "
            "or name --data"
        )
    return [load_recorded(f) for f in files[:count]]


@dataclass
class Result:
    """One mode's figures."""

    mode: str
    prompted: int
    evaluated: int
    seconds: float
    restores: int
    evictions: int
    scores: dict[tuple[str, int], float]


async def measure(mode: str, runs: list[RecordedRun], steps: int, budget_mb: float) -> Result:
    """Score every run's first `steps` steps on a fresh judge, in the order `mode` says."""
    with warnings.catch_warnings():
        # known: the benchmark measures cost, not grades
        warnings.simplefilter("ignore", TinyJudgeWarning)
        judge = LlamaCppJudge(gemma_path(), kv_budget_mb=budget_mb)
    await judge.load()
    trackers = {r.name: AsyncProgressTracker(r.task, judge=judge, run_id=r.name) for r in runs}
    if mode == "sequential":
        order = [(r, i) for r in runs for i in range(min(steps, len(r.steps)))]
    else:
        order = [(r, i) for i in range(steps) for r in runs if i < len(r.steps)]
    scores: dict[tuple[str, int], float] = {}
    start = time.perf_counter()
    for run, i in order:
        p = await trackers[run.name].update(run.steps[i].text)
        scores[run.name, i + 1] = p.score if p.ok and p.score is not None else math.nan
    seconds = time.perf_counter() - start
    result = Result(
        mode,
        judge.tokens_prompted,
        judge.tokens_evaluated,
        seconds,
        judge.kv_restores,
        judge.kv_evictions,
        scores,
    )
    await judge.aclose()
    print(
        f"  {mode:>12}: {result.evaluated:>7,} of {result.prompted:,} prompt tokens evaluated "
        f"({result.evaluated / max(1, result.prompted):.0%}) in {seconds:6.1f} s; "
        f"{result.restores} restores, {result.evictions} evictions",
        flush=True,
    )
    return result


def max_diff(a: dict[tuple[str, int], float], b: dict[tuple[str, int], float]) -> float:
    """The largest score difference between two modes over the same (run, step) keys (nan: a
    failure in one)."""
    diffs = [abs(a[k] - b[k]) for k in a]
    return max(diffs) if diffs else math.nan


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="2,8", help="run counts to measure, comma-separated")
    ap.add_argument("--steps", type=int, default=10, help="agent steps scored per run")
    ap.add_argument(
        "--shared",
        action="store_true",
        help="also interleave on one shared prefix (kv_budget_mb=0)",
    )
    ap.add_argument(
        "--data", type=Path, default=DATA, help="the recorded runs' folder (shared/data)"
    )
    ap.add_argument(
        "--kv-budget", type=float, default=DEFAULT_KV_BUDGET_MB, help="the judge's kv_budget_mb"
    )
    args = ap.parse_args()
    configure_logs("error")
    counts = [int(c) for c in args.runs.split(",")]
    print(
        f"load {load1()}; Gemma 3 270M in-process, {args.steps} steps per run, "
        f"kv_budget_mb={args.kv_budget:g}"
    )
    line: dict[str, object] = {}
    for count in counts:
        runs = recorded_runs(count, args.data)
        print(f"{count} runs: {', '.join(Path(r.name).name for r in runs)}", flush=True)
        # Untimed: the first judge of a process pays for paging the model in and first touches of
        # its buffers.
        await measure("warm-up", runs[:1], 3, args.kv_budget)
        seq = await measure("sequential", runs, args.steps, args.kv_budget)
        inter = await measure("interleaved", runs, args.steps, args.kv_budget)
        tokens_ratio = inter.evaluated / max(1, seq.evaluated)
        time_ratio = inter.seconds / seq.seconds
        diff = max_diff(seq.scores, inter.scores)
        met = tokens_ratio <= 1.25 and time_ratio <= 1.3
        print(
            f"  interleaved / sequential: {tokens_ratio:.3f}x tokens (target <= 1.25), "
            f"{time_ratio:.3f}x time (target <= 1.3): {'met' if met else 'MISSED'}; "
            f"largest score difference {diff:.2g}",
            flush=True,
        )
        line.update(
            {
                f"seq_tokens_{count}": seq.evaluated,
                f"inter_tokens_{count}": inter.evaluated,
                f"seq_s_{count}": seq.seconds,
                f"inter_s_{count}": inter.seconds,
                f"tokens_ratio_{count}": tokens_ratio,
                f"time_ratio_{count}": time_ratio,
                f"score_diff_{count}": diff,
            }
        )
        if args.shared:
            shared = await measure("shared", runs, args.steps, 0.0)
            line[f"shared_tokens_{count}"] = shared.evaluated
            line[f"shared_s_{count}"] = shared.seconds
    print(f"load {load1()}")
    print(kv_line(**line))


if __name__ == "__main__":
    asyncio.run(main())
