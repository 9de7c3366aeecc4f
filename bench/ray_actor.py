"""MonitorActor: tracker updates/s and latency through one Ray actor, beside the same service
in-process.

`--workers` concurrent trainer workers (asyncio tasks of the driver, each awaiting its call) each
send `--steps` `update`s of a run of its own (its first step names the task) to one `MonitorActor`
on a local `ray.init(num_cpus=2)`, with an instant judge (`FakeJudge`, one letter, recording
nothing): the figure is the actor's own cost (Ray's hop, the tracker, the prompt, the scoring), no
judge time. The baseline, in the same process just before, is the same workload on `MonitorService`
called directly (what the actor runs).

Figures: `inproc_updates_per_s`, `inproc_p50_ms`, `inproc_p99_ms`; `ray_updates_per_s`,
`ray_p50_ms`, `ray_p99_ms` (per update, submission to answer, with `--workers` in flight); the load
average at start and end.

    .venv/bin/python bench/ray_actor.py [--workers 64] [--steps 10]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from _common import configure_logs, kv_line, load1, percentile

from agent_monitor.integrations.ray import MonitorActor, MonitorService
from agent_monitor.testing import FakeJudge

TASK = (
    "Find the failing test in the repository, fix the parser and run the test suite until "
    "it passes."
)


async def workload(
    update: Callable[..., Awaitable[Any]], workers: int, steps: int, tag: str
) -> tuple[float, list[float]]:
    """Every worker's steps through `update`; the wall time and each update's latency."""
    latencies: list[float] = []

    async def worker(w: int) -> None:
        for s in range(steps):
            t0 = time.perf_counter()
            v = await update(
                f"{tag}-{w}",
                f"step {s}: ran `pytest -q`, {steps - s} failed",
                task=TASK if s == 0 else None,
            )
            latencies.append(time.perf_counter() - t0)
            assert v["stop_kind"] == "judged", v

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return time.perf_counter() - t0, latencies


async def in_process(workers: int, steps: int) -> tuple[float, list[float]]:
    service = MonitorService(functools.partial(FakeJudge, ["K"], record=False))
    try:
        return await workload(service.update, workers, steps, "inproc")
    finally:
        await service.close()


async def through_ray(workers: int, steps: int) -> tuple[float, list[float]]:
    import ray

    monitor = MonitorActor.options(num_cpus=0).remote(
        judge=functools.partial(FakeJudge, ["K"], record=False)
    )

    async def update(run_id: str, step: str, *, task: str | None) -> Any:
        return await monitor.update.remote(run_id, step, task=task)

    await update("warm-up", "step 0", task=TASK)  # the actor's process start, not counted
    try:
        return await workload(update, workers, steps, "ray")
    finally:
        await monitor.close.remote()
        ray.kill(monitor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    configure_logs()
    import ray

    start_load = load1()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        n = args.workers * args.steps
        wall_i, lat_i = asyncio.run(in_process(args.workers, args.steps))
        wall_r, lat_r = asyncio.run(through_ray(args.workers, args.steps))
    finally:
        ray.shutdown()
    print(
        f"{args.workers} workers x {args.steps} updates, instant judge; load {start_load} "
        f"-> {load1()}"
    )
    print(
        kv_line(
            inproc_updates_per_s=n / wall_i,
            inproc_p50_ms=percentile(lat_i, 50) * 1e3,
            inproc_p99_ms=percentile(lat_i, 99) * 1e3,
            ray_updates_per_s=n / wall_r,
            ray_p50_ms=percentile(lat_r, 50) * 1e3,
            ray_p99_ms=percentile(lat_r, 99) * 1e3,
            load_start=start_load,
            load_end=load1(),
        )
    )


if __name__ == "__main__":
    main()
