"""The reward endpoints: reward requests/s and p99 latency with an instant judge, 64 concurrent
trainer workers.

One process, one event loop: a `Monitor` (in-memory journal, no broker, `FakeJudge(record=False)`:
an instant judge) with the reward endpoints mounted on its metrics server, and `--workers` trainer
workers (aiohttp, each posting one rollout per request as OpenRLHF's `SingleTurnAgentExecutor` does:
a new `ClientSession` per request, `{"query": [q], "prompts": [p], "labels": [l]}`), `--requests` in
all. Each rollout is a ChatML query of `--steps` assistant turns (one judge call per rollout: final
shape).

Figures:
- `api_rps`, `api_p50_ms`, `api_p99_ms`: `POST /get_reward` answered per second and its latency;
- the baseline in the same process: the same scoring called in-process (`score_prefix`, the
  tracker's one-prefix scoring, with the same judge and rubric) by the same number of concurrent
  workers: `inproc_rps`, `inproc_p99_ms`. The difference is the price of the HTTP door, the run's
  journal, ingest and the scheduler;
- `load_start`, `load_end`: the 1-minute load average (the machine is shared).

The client runs in the daemon's loop, so its CPU counts against the daemon: the API figures are a
floor.

    .venv/bin/python bench/reward_api.py [--workers 64] [--requests 2000] [--steps 4] [--shape
    final|dense]

With `--shape dense` each rollout's steps are sent one at a time, each prefix scored (4 judge calls
a rollout); the in-process baseline stays the one-call final scoring.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
from _common import configure_logs, kv_line, load1, percentile
from prometheus_client import CollectorRegistry

from agent_monitor.criteria import load_criteria
from agent_monitor.daemon import (
    HttpServer,
    MemoryStore,
    Monitor,
    MonitorConfig,
    RewardApiSettings,
    RewardSource,
)
from agent_monitor.daemon.http import HttpSettings
from agent_monitor.prompts import Step
from agent_monitor.testing import FakeJudge
from agent_monitor.tracker import score_prefix

TASK = "Make the failing test in calc.py pass without changing the test."


def rollout(i: int, steps: int) -> tuple[str, str]:
    """A ChatML prompt and the query OpenRLHF decodes (prompt and response with their special
    tokens)."""
    prompt = f"<|im_start|>user\n{TASK} (sample {i})<|im_end|>\n<|im_start|>assistant\n"
    turns = "<|im_end|>\n<|im_start|>assistant\n".join(
        f"step {k}: ran the tests, {k} of {steps} fixed" for k in range(1, steps + 1)
    )
    return prompt, prompt + turns + "<|im_end|>"


async def drive(
    workers: int, requests: int, one: object, first: int = 0
) -> tuple[float, list[float]]:
    """`workers` concurrent loops sharing `requests` calls of `one(i)`, i from `first`; (seconds,
    latencies).

    Every i is a different rollout: none is answered from the reward cache.
    """
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(first, first + requests):
        queue.put_nowait(i)
    latencies: list[float] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            t0 = time.perf_counter()
            await one(i)  # type: ignore[operator]
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return time.perf_counter() - t0, latencies


async def main(args: argparse.Namespace) -> None:
    configure_logs("warning")
    load_start = load1()
    judge = FakeJudge(lambda p: "K", record=False)
    registry = CollectorRegistry()
    http = HttpServer(registry, port=0, settings=HttpSettings(max_connections=4 * args.workers))
    settings = RewardApiSettings(reward_api=True, max_inflight=4 * args.workers, shape=args.shape)
    source = RewardSource(http, settings, registry=registry)
    await http.bind()
    config = MonitorConfig(max_concurrency=8)
    url = f"{http.url}get_reward"
    async with Monitor(
        config, judge=judge, store=MemoryStore(), registry=registry, sources=[source], http=http
    ):
        await asyncio.wait_for(source.ready.wait(), 10)

        async def via_api(i: int) -> None:
            prompt, query = rollout(i, args.steps)
            # As OpenRLHF's _post_request: one session per request, the body as json=.
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:  # noqa: SIM117
                async with session.post(
                    url, json={"query": [query], "prompts": [prompt], "labels": [None]}
                ) as r:
                    r.raise_for_status()
                    body = await r.json()
                    assert len(body["rewards"]) == 1

        await drive(args.workers, min(200, args.requests), via_api)  # warm-up
        api_s, api_lat = await drive(args.workers, args.requests, via_api, first=10**6)
        cached = (
            registry.get_sample_value("agent_monitor_reward_rollouts_total", {"outcome": "cached"})
            or 0.0
        )
        assert cached == 0.0, "a benchmark rollout was answered from the cache"

    rubric = load_criteria(None)

    async def in_process(i: int) -> None:
        steps = [
            Step(k, f"step {k}: ran the tests, {k} of {args.steps} fixed")
            for k in range(1, args.steps + 1)
        ]
        p = await score_prefix(f"{TASK} (sample {i})", steps, judge=judge, rubric=rubric)
        assert p.ok

    await drive(args.workers, min(200, args.requests), in_process)
    base_s, base_lat = await drive(args.workers, args.requests, in_process, first=10**6)
    print(
        kv_line(
            workers=args.workers,
            requests=args.requests,
            steps=args.steps,
            shape=args.shape,
            api_rps=args.requests / api_s,
            api_p50_ms=percentile(api_lat, 50) * 1000,
            api_p99_ms=percentile(api_lat, 99) * 1000,
            inproc_rps=args.requests / base_s,
            inproc_p50_ms=percentile(base_lat, 50) * 1000,
            inproc_p99_ms=percentile(base_lat, 99) * 1000,
            load_start=load_start,
            load_end=load1(),
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--shape",
        choices=("final", "dense"),
        default="final",
        help="dense: every prefix scored, a step at a time",
    )
    asyncio.run(main(parser.parse_args()))
