"""Judge calls per recorded run with and without rules before the judge (coding vs coding_tests
rubrics).

Replays every recorded run under a folder (default: ../shared/data) step by step
through AsyncProgressTracker with an instant judge that only counts calls, once
with the `coding` rubric (judge only) and once with `coding_tests` (a pytest /
unittest / jest summary in the latest steps answers the goal criterion without
a call). Prints a table and, last, `key=value` pairs.

    python bench/rules_calls.py [PATH]
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from agent_monitor import AsyncProgressTracker
from agent_monitor.offline.recorded import iter_recorded
from agent_monitor.testing import FakeJudge


async def replay(path: Path) -> None:
    rows = []
    for run in iter_recorded(path):
        counts = []
        for rubric in ("coding", "coding_tests"):
            judge = FakeJudge(["K"])  # answers at once; counts calls (BaseJudge.calls)
            tracker = AsyncProgressTracker(run.task, judge=judge, criteria=rubric)
            for s in run.steps:
                await tracker.update(s.text)
            counts.append((judge.calls, tracker.calls_saved))
        rows.append((run.name, len(run.steps), counts[0][0], counts[1][0], counts[1][1]))
    print(
        f"{'run':<44} {'steps':>5} {'calls (judge only)':>19} {'calls (rules first)':>20} "
        f"{'saved':>6}"
    )
    for name, steps, without, with_rules, saved in rows:
        print(f"{name[:44]:<44} {steps:>5} {without:>19} {with_rules:>20} {saved:>6}")
    steps = sum(r[1] for r in rows)
    without = sum(r[2] for r in rows)
    with_rules = sum(r[3] for r in rows)
    saved = sum(r[4] for r in rows)
    share = saved / without if without else 0.0
    print(
        f"runs={len(rows)} steps={steps} calls_without_rules={without} "
        f"calls_with_rules={with_rules} "
        f"calls_saved={saved} saved_share={share:.3f}"
    )


if __name__ == "__main__":
    default = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
    asyncio.run(replay(Path(sys.argv[1]) if len(sys.argv) > 1 else default))
