"""Ray: `MonitorActor`, one judge and its trackers in one actor, shared by a trainer's rollout
workers.

```python
import functools, ray
from agent_monitor import OpenAIJudge
from agent_monitor.integrations.ray import MonitorActor

monitor = MonitorActor.remote(judge=functools.partial(OpenAIJudge, base_url="http://judge:8000/v1"))
v = ray.get(monitor.update.remote("run-1", "ran the tests: 3 failed", task="Fix the failing tests"))
if v["stop"]: ... # the policy says abort on a judged score; v["stop_kind"] == "infra" never stops
```

The actor is an async actor (every method is a coroutine), so one judge's concurrency limit and
retries are shared by every worker, and a worker may `await monitor.update.remote(...)` from an
async actor of its own. Answers are plain mappings (`Verdict.to_json` and a few more keys). The
judge is given as a zero-argument factory, built inside the actor: judges hold connections and
locks, which do not pickle. Ray is imported only when `MonitorActor.remote` or `.options` is called
(`pip install -e '.[ray]'` in the checkout).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..judges.base import Judge
from ..options import TrackerOptions
from ..progress import Progress
from ..tracker import AsyncProgressTracker, StepInput
from ._common import verdict

if TYPE_CHECKING:
    from ray.actor import ActorClass, ActorHandle

DEFAULT_MAX_RUNS = 10_000
"""Live runs one actor follows at most; the run idle the longest is dropped (and counted) beyond
it."""


@dataclass(frozen=True, slots=True)
class MonitorServiceStatistics:
    """What a `MonitorService` (a `MonitorActor`) did: its runs, its calls by method, the
    results, the stops."""

    live_runs: int
    updates: int
    """`update` calls (a step scored in the background)."""
    submits: int
    """`submit` calls."""
    scores: int
    """`score` calls (a whole run scored at once)."""
    judged: int
    """Results the judge gave (a stop on them is a judged stop)."""
    infra: int
    """Results without a judgement (the judge failed): never a reason to stop."""
    stops: int
    """Results that said stop."""
    evicted: int
    """Runs dropped because `max_runs` were live (the one idle the longest)."""
    refused: int
    """Steps refused because their run was new and came without its task."""


@dataclass(slots=True)
class _Counters:
    updates: int = 0
    submits: int = 0
    scores: int = 0
    judged: int = 0
    infra: int = 0
    stops: int = 0
    evicted: int = 0
    refused: int = 0


class MonitorService:
    """What a `MonitorActor` runs: trackers by run id over one judge (usable in-process too)."""

    def __init__(
        self,
        judge: Callable[[], Judge],
        options: TrackerOptions | None = None,
        *,
        max_runs: int = DEFAULT_MAX_RUNS,
        **tracker_options: Any,
    ) -> None:
        if not callable(judge):
            raise TypeError(
                f"judge={judge!r}; pass a zero-argument factory (e.g. "
                "functools.partial(OpenAIJudge, ...))"
            )
        if max_runs < 1:
            raise ValueError(f"max_runs={max_runs}; use 1 or more")
        self.judge: Judge = judge()
        self.options = TrackerOptions.of("MonitorActor", options, **tracker_options)
        self.max_runs = max_runs
        self._runs: OrderedDict[str, AsyncProgressTracker] = OrderedDict()
        self._stacks: dict[str, contextlib.AsyncExitStack] = {}
        self._counts = _Counters()

    async def _tracker(self, run_id: str, task: str | None) -> AsyncProgressTracker:
        tracker = self._runs.get(run_id)
        if tracker is not None:
            self._runs.move_to_end(run_id)
            return tracker
        if not task:
            self._counts.refused += 1
            raise ValueError(
                f"run {run_id!r} is new to the monitor: give its task= with its first step"
            )
        while len(self._runs) >= self.max_runs:
            oldest = next(iter(self._runs))
            self._counts.evicted += 1
            await self.finish(oldest)
        tracker = AsyncProgressTracker(
            task, judge=self.judge, **{**self.options.settings(), "run_id": run_id}
        )
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(tracker)  # owns the worker that `submit` feeds
        self._runs[run_id], self._stacks[run_id] = tracker, stack
        return tracker

    def _answer(self, run_id: str, tracker: AsyncProgressTracker) -> dict[str, Any]:
        v = verdict(tracker.latest, tracker.summary.last_ok)
        return {"run_id": run_id, "steps": len(tracker.steps), **v.to_json()}

    def _count(self, p: Progress) -> None:
        v = verdict(p, p if p.ok else None)
        if v.stop_kind == "infra":
            self._counts.infra += 1
        else:
            self._counts.judged += 1
        self._counts.stops += v.stop

    async def update(
        self,
        run_id: str,
        step: StepInput,
        *,
        task: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Append a step to the run (its first step gives its `task`), score the prefix, and
        answer the verdict."""
        tracker = await self._tracker(run_id, task)
        self._counts.updates += 1
        p = await tracker.update(step, meta=meta)
        self._count(p)
        return self._answer(run_id, tracker)

    async def submit(
        self,
        run_id: str,
        step: StepInput,
        *,
        task: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """Queue a step and return its index at once; the actor scores the run's newest prefix in
        the background."""
        tracker = await self._tracker(run_id, task)
        self._counts.submits += 1
        return tracker.submit(step, meta=meta)

    async def score(
        self, task: str, steps: Sequence[StepInput], *, expected: str | None = None
    ) -> dict[str, Any]:
        """Score a finished trajectory's whole prefix once (a reward), keeping no run."""
        if not steps:
            raise ValueError("score() needs at least one step")
        settings = {**self.options.settings(), "run_id": None}
        if expected is not None:
            settings["expected"] = expected
        tracker = AsyncProgressTracker(task, judge=self.judge, **settings)
        for step in steps:
            await tracker.add(step)
        p = await tracker.score()
        self._counts.scores += 1
        self._count(p)
        v = verdict(p, p if p.ok else None)
        return {"run_id": None, "steps": len(steps), **v.to_json()}

    async def status(self, run_id: str, *, drain: bool = False) -> dict[str, Any] | None:
        """The run's verdict at its latest result (`drain`: after every submitted step is
        scored); None: unknown run."""
        tracker = self._runs.get(run_id)
        if tracker is None:
            return None
        if drain:
            await tracker.drain()
        return self._answer(run_id, tracker)

    async def finish(self, run_id: str, outcome: object = None) -> dict[str, Any] | None:
        """Forget the run (its final verdict is answered); `outcome` teaches the calibration, if
        one is set."""
        tracker = self._runs.pop(run_id, None)
        stack = self._stacks.pop(run_id, None)
        if tracker is None:
            return None
        if stack is not None:
            await stack.aclose()
        if outcome is not None:
            tracker.finish(outcome)
        return self._answer(run_id, tracker)

    async def close(self) -> None:
        """Forget every run and release the judge (call it before `ray.kill`, or at the end of
        training)."""
        for run_id in list(self._runs):
            await self.finish(run_id)
        await self.judge.aclose()

    async def statistics(self) -> MonitorServiceStatistics:
        """Counters: live runs, calls by method, judged and infra results, stops, evicted and
        refused runs."""
        c = self._counts
        return MonitorServiceStatistics(
            live_runs=len(self._runs),
            updates=c.updates,
            submits=c.submits,
            scores=c.scores,
            judged=c.judged,
            infra=c.infra,
            stops=c.stops,
            evicted=c.evicted,
            refused=c.refused,
        )


class MonitorActor:
    """`MonitorService` as a Ray actor: `MonitorActor.remote(judge=factory, **tracker_options)`
    gives its handle."""

    @staticmethod
    def actor_class() -> ActorClass[MonitorService]:
        """The Ray actor class (`ray.remote(MonitorService)`), made on first use: importing this
        module loads no Ray."""
        import ray

        return ray.remote(MonitorService)

    @staticmethod
    def remote(judge: Callable[[], Judge], **keywords: Any) -> ActorHandle[MonitorService]:
        """Start the actor with default Ray options; keywords are `MonitorService`'s."""
        # (Ray's stubs type `ActorClass.remote` as a union with the class itself.)
        return cast(
            "ActorHandle[MonitorService]", MonitorActor.actor_class().remote(judge, **keywords)
        )

    @staticmethod
    def options(**ray_options: Any) -> Any:
        """The actor class with Ray options (`name=`, `num_cpus=`, `max_concurrency=`..):
        `.remote(judge, ...)` starts it."""
        return MonitorActor.actor_class().options(**ray_options)


__all__ = ["DEFAULT_MAX_RUNS", "MonitorActor", "MonitorService"]
