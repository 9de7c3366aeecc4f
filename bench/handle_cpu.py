"""The monitor's own CPU per step, without a broker: events fed to `Monitor.handle`, scored by an
instant judge.

`bench/overhead.py` measures the whole system (broker, publisher, subscriber) and on a 2-core
machine its latencies swing with whatever else runs; this one measures only the monitor's path
from a decoded message to a published progress message (journal, run state, scheduler, tracker,
prompt, scoring, policy, sinks), in one process, so that two versions can be compared.

    python bench/handle_cpu.py [--runs 300] [--steps 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time

import structlog
from _common import kv_line, load1

from agent_monitor import BaseJudge, JudgeRequest, JudgeResponse, Usage
from agent_monitor.daemon import MemoryStore, Monitor, MonitorConfig


class InstantJudge(BaseJudge):
    """Answers K at once, without looking at the prompt (the judge's cost is not the monitor's)."""

    name = "instant"

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        return JudgeResponse(samples=({"K": 0.0},), model="instant", usage=Usage(10, 0, 1))


async def one(runs: int, steps: int, journal: bool) -> float:
    """CPU milliseconds per step for `runs` runs of `steps` 1,000-character steps, round-robin."""
    config = MonitorConfig(sweep_interval_s=3600)
    async with Monitor(
        config, judge=InstantJudge(), store=MemoryStore() if journal else None
    ) as mon:
        for r in range(runs):
            await mon.handle(f"agents/r{r}/start", json.dumps({"task": "count"}).encode())
        t0, n = time.process_time(), 0
        for i in range(1, steps + 1):
            for r in range(runs):
                await mon.handle(
                    f"agents/r{r}/step", json.dumps({"index": i, "text": "x" * 1000}).encode()
                )
                n += 1
            await mon.drain()
            while mon.outbox.get_nowait() is not None:
                pass
        return (time.process_time() - t0) / n * 1000


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--journal", action="store_true", help="journal into a MemoryStore (the default keeps none)"
    )
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    load_start = load1()
    ms = [asyncio.run(one(args.runs, args.steps, args.journal)) for _ in range(args.repeat)]
    print(f"CPU ms per step over {args.repeat} rounds: {', '.join(f'{m:.3f}' for m in ms)}")
    print(f"machine load (1-min average) at start {load_start}, at end {load1()}")
    print(
        kv_line(
            runs=args.runs,
            steps=args.steps,
            cpu_ms_per_step_min=min(ms),
            cpu_ms_per_step_median=statistics.median(ms),
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
