"""Live runs: per-run state (ordered, idempotent steps), the fair coalescing scheduler, and the outbox.

Each event that `decode_event` accepted goes to `Runs.accept`. A run's steps are put in
`index` order: a re-delivered step is ignored, an early one waits in `held` for the missing
ones, and a gap that is not filled within `hold_s` is scored without them (a placeholder
step says so, so step numbers stay the harness's). Scoring is done by `work()` loops (the
daemon runs `max_concurrency` of them): a run is in the ready queue at most once, so a
chatty run waits its turn behind the others (fairness), and each scoring takes the newest
prefix, folding every step that arrived meanwhile into one judge call (coalescing).
Results, signals and errors go to a bounded `Outbox` that the MQTT link publishes.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from .events import (
    ErrorOut,
    EventError,
    InputEvent,
    ProgressOut,
    RunEnd,
    RunStart,
    SignalOut,
    StepIn,
    errors_topic,
    topic,
)
from .images import FrameBudget
from .judges.base import Judge
from .judges.circuit import CircuitJudge
from .metrics import Metrics, RunSeries
from .outbox import Message, Outbox
from .policy import Policy
from .scale import DEFAULT_MIN_MASS
from .store import RunStore, StoredRun
from .tracker import AsyncProgressTracker, Progress, progress_from_dict

log = structlog.get_logger("agent_monitor.runs")


OUTAGE_REASONS = frozenset(
    {"timeout", "connection", "server_error", "rate_limited", "judge_unavailable", "judge_exception", "inference"}
)
"""Judge failures that say the judge was down, not that the prompt or answer was bad: retried on recovery."""


@dataclass(frozen=True, slots=True)
class RunLimits:
    """How long things wait and how much is kept; every buffer here is bounded."""

    hold_s: float = 10.0
    """How long a step waits for its run's start, or for the missing steps before it."""
    idle_timeout_s: float = 3600.0
    """A run with no event for this long is expired (its retained signal cleared)."""
    max_runs: int = 10_000
    """Live runs; a start beyond this evicts the run idle the longest."""
    max_held_steps: int = 1_000
    """Out-of-order steps kept per run (and steps kept for a run whose start has not come)."""
    max_orphan_runs: int = 1_000
    """Run ids with steps but no start yet."""
    ended_memory: int = 10_000
    """Ended run ids remembered, so a late step for them is reported instead of starting a ghost."""

    def __post_init__(self) -> None:
        if self.hold_s < 0 or self.idle_timeout_s <= 0:
            raise ValueError("hold_s must be >= 0 and idle_timeout_s > 0")
        if min(self.max_runs, self.max_held_steps, self.max_orphan_runs, self.ended_memory) < 1:
            raise ValueError("run limits must be >= 1")


@dataclass(eq=False)
class Run:
    """One live run: its start, its tracker (steps, scores, policy state) and the ordering buffer."""

    run_id: str
    start: RunStart
    tracker: AsyncProgressTracker
    policy: Policy
    last_event: float
    held: dict[int, StepIn] = field(default_factory=dict)
    gap_since: float | None = None
    arrived: dict[int, float] = field(default_factory=dict)
    scored: int = 0
    queued: bool = False
    inflight: bool = False
    ended: RunEnd | None = None
    signal: str = "continue"
    last_ok: Progress | None = None
    log: Any = None

    @property
    def next_index(self) -> int:
        """The index the next in-order step must have."""
        return len(self.tracker.steps) + 1

    @property
    def wants_scoring(self) -> bool:
        """Steps are waiting to be scored and the run has not been told to abort (abort is final)."""
        return len(self.tracker.steps) > self.scored and self.signal != "abort"


@dataclass(slots=True)
class _Orphan:
    first_seen: float
    steps: list[StepIn] = field(default_factory=list)
    end: RunEnd | None = None


class Runs:
    """Every live run of one daemon, the ready queue of runs to score, and what to publish about them."""

    def __init__(
        self,
        *,
        judge: Judge,
        outbox: Outbox,
        prefix: str = "agents",
        policy: Policy | None = None,
        limits: RunLimits | None = None,
        metrics: Metrics | None = None,
        repeats: int = 1,
        min_mass: float = DEFAULT_MIN_MASS,
        frame_budget: FrameBudget | None = None,
        max_side: int | None = 1024,
        clock: Callable[[], float] = time.monotonic,
        series_grace_s: float = 60.0,
        store: RunStore | None = None,
    ) -> None:
        self.judge = judge
        self.outbox = outbox
        self.prefix = prefix
        self.policy = policy or Policy()
        self.limits = limits or RunLimits()
        self.metrics = metrics
        self.repeats = repeats
        self.min_mass = min_mass
        self.frame_budget = frame_budget
        self.max_side = max_side
        self.clock = clock
        self.live: dict[str, Run] = {}
        self.ended: OrderedDict[str, float] = OrderedDict()
        self.orphans: dict[str, _Orphan] = {}
        self.store = store
        self._replaying = False
        self.series_grace_s = series_grace_s
        # Ended runs' last values, shown for `series_grace_s` so a board sees how a run finished.
        self._finished_series: OrderedDict[str, tuple[float, RunSeries]] = OrderedDict()
        self.scorings = 0
        self._ready: asyncio.Queue[str] = asyncio.Queue()
        self._busy = 0
        self._scored_event = asyncio.Event()

    # -- input --

    async def accept(self, run_id: str, event: InputEvent) -> None:
        """Fold one decoded event into its run (never raises for bad input: it is reported instead)."""
        if self.metrics and not self._replaying:
            self.metrics.events.labels(_kind(event)).inc()
        if isinstance(event, RunStart):
            await self._start(run_id, event)
        elif isinstance(event, StepIn):
            await self._step(run_id, event)
        else:
            await self._end(run_id, event)

    def reject(self, topic_: str, error: EventError) -> None:
        """Report an event that could not be decoded: an error message, a counter, a log line."""
        self._error(error.run_id, error.reason, error.message, topic_)

    async def _start(self, run_id: str, start: RunStart) -> None:
        now = self.clock()
        run = self.live.get(run_id)
        if run is not None:
            if _same_start(run.start, start):
                run.last_event = now  # QoS 1 re-delivery of the same start
                return
            self._error(
                run_id,
                "duplicate_start",
                "the run has already started with another start; use a new run id",
                kind="start",
            )
            return
        try:
            policy = start.resolved_policy(self.policy)
            tracker = AsyncProgressTracker(
                start.task,
                judge=self.judge,
                criteria=start.criteria,  # type: ignore[arg-type]  # validated JSON shapes
                repeats=self.repeats,
                min_mass=self.min_mass,
                images=[i.decoded() for i in start.images],
                max_side=self.max_side,
                frame_budget=self.frame_budget,
                allow_files=False,  # network events never name local files
                expected=start.expected,
                run_id=run_id,
                metrics=self.metrics,
                policy=policy,
            )
        except Exception as e:  # validated on decode; a failure here is still the run's problem, not the daemon's
            self._error(run_id, "run_rejected", f"start cannot be used: {type(e).__name__}: {e}", kind="start")
            return
        if len(self.live) >= self.limits.max_runs:
            self._evict_idlest()
        self.ended.pop(run_id, None)
        run = Run(run_id, start, tracker, policy, last_event=now, log=log.bind(run_id=run_id))
        self.live[run_id] = run
        if self.metrics:
            self.metrics.runs_active.set(len(self.live))
        run.log.info("run_started", task=start.task[:200], rubric=tracker.rubric.hash, labels=start.labels)
        orphan = self.orphans.pop(run_id, None)
        if orphan is not None:
            for s in orphan.steps:
                await self._step(run_id, s)
            if orphan.end is not None:
                await self._end(run_id, orphan.end)

    async def _step(self, run_id: str, step: StepIn) -> None:
        now = self.clock()
        run = self.live.get(run_id)
        if run is None:
            self._hold_orphan(run_id, step, now)
            return
        run.last_event = now
        if run.ended is not None:
            self._error(run_id, "run_ended", "a step came after the run's end; it was ignored")
            return
        index = step.index
        if index is None:  # no index: the next free position
            index = max(run.next_index, max(run.held, default=0) + 1)
        if index < run.next_index or index in run.held:
            if self.metrics:
                self.metrics.duplicate_steps.inc()
            return
        if index - run.next_index >= self.limits.max_held_steps:
            self._error(
                run_id,
                "index_too_far",
                f"step index {index} is {index - run.next_index} ahead of the next expected ({run.next_index}); "
                f"at most {self.limits.max_held_steps} out-of-order steps are kept",
            )
            return
        run.held[index] = step
        run.arrived[index] = now
        await self._flush(run)
        run.gap_since = (run.gap_since or now) if run.held else None
        self._schedule(run)

    async def _flush(self, run: Run) -> None:
        """Append held steps that are now in order."""
        while run.next_index in run.held:
            i = run.next_index
            s = run.held.pop(i)
            try:
                await run.tracker.add(s.text, images=[im.decoded() for im in s.images], meta=s.meta)
            except Exception as e:
                # The images passed the sniff but not the decoder: keep the step's text, report the images.
                self._error(run.run_id, "bad_image", f"step {i}: an image could not be decoded ({e}); scored without")
                await run.tracker.add(s.text or f"(step {i}: its images could not be decoded)", meta=s.meta)

    async def _fill_gap(self, run: Run, upto: int) -> None:
        """Give up on the missing steps before `upto`: placeholders keep the harness's step numbers."""
        missing = [i for i in range(run.next_index, upto) if i not in run.held]
        if missing:
            span = f"{missing[0]}" if len(missing) == 1 else f"{missing[0]}..{missing[-1]}"
            self._error(
                run.run_id,
                "step_gap",
                f"step(s) {span} never arrived within {self.limits.hold_s:g}s; later steps are scored without them",
            )
        for i in missing:
            run.held[i] = StepIn(index=i, text=f"(step {i} was not received by the monitor)", images=[])
        await self._flush(run)
        run.gap_since = self.clock() if run.held else None

    def _hold_orphan(self, run_id: str, step: StepIn, now: float) -> None:
        if run_id in self.ended:
            self._error(run_id, "run_ended", "a step came for a run that has ended; it was ignored")
            return
        orphan = self.orphans.get(run_id)
        if orphan is None:
            if len(self.orphans) >= self.limits.max_orphan_runs:
                self._error(run_id, "too_many_held", "too many runs have steps but no start; publish start first")
                return
            orphan = self.orphans[run_id] = _Orphan(first_seen=now)
        if len(orphan.steps) >= self.limits.max_held_steps:
            self._error(run_id, "too_many_held", "too many steps before the run's start; publish start first")
            return
        orphan.steps.append(step)

    async def _end(self, run_id: str, end: RunEnd) -> None:
        run = self.live.get(run_id)
        if run is None:
            if run_id in self.ended:
                return  # a re-delivered end
            if run_id in self.orphans:
                self.orphans[run_id].end = end
                return
            self._error(
                run_id, "unknown_run", "end for a run that never started (or has expired); it was ignored", kind="end"
            )
            return
        run.last_event = self.clock()
        if run.ended is not None:
            return
        run.ended = end
        if run.held:
            await self._fill_gap(run, max(run.held) + 1)
        if run.inflight or run.queued:
            return  # the scorer finishes the run after the newest prefix is scored
        if run.wants_scoring:
            self._schedule(run)
        else:
            self._finish(run, _outcome(end))

    # -- scheduling and scoring --

    def _schedule(self, run: Run) -> None:
        if self._replaying:
            return  # scoring starts once every run is rebuilt, from its stored scores on
        if run.queued or run.inflight or not run.wants_scoring:
            return
        run.queued = True
        self._ready.put_nowait(run.run_id)
        if self.metrics:
            self.metrics.queue_depth.set(self._ready.qsize())

    async def work(self) -> None:
        """One scorer: forever take the run waiting longest and score its newest prefix."""
        while True:
            run_id = await self._ready.get()
            if self.metrics:
                self.metrics.queue_depth.set(self._ready.qsize())
            run = self.live.get(run_id)
            if run is None or not run.queued:
                self._scored_event.set()
                continue
            run.queued = False
            self._busy += 1
            try:
                await self._score(run)
            finally:
                self._busy -= 1
                self._scored_event.set()

    async def _score(self, run: Run) -> None:
        n = len(run.tracker.steps)
        if n <= run.scored or run.signal == "abort":
            self._after_score(run)
            return
        run.inflight = True
        circuit = self.judge if isinstance(self.judge, CircuitJudge) else None
        probe = False
        try:
            if circuit is not None and circuit.degraded:
                # The judge is down: wait for its next probe instead of spending this run's steps on certain
                # failures; steps arriving meanwhile fold into the one scoring made when it is back.
                probe = await circuit.wait_ready()
                n = len(run.tracker.steps)
            coalesced = n - run.scored
            p: Progress | None = await run.tracker.score(n, coalesced=coalesced)
        except Exception as e:
            # The tracker turns judge failures into results; anything else is a bug, reported, never a score.
            run.log.exception("scoring_crashed", step=n)
            self._error(run.run_id, "scoring_failed", f"scoring step {n} failed inside the monitor: {e}", invalid=False)
            p = None
        finally:
            run.inflight = False
            if probe and circuit is not None:
                circuit.release()
        first = run.scored + 1
        run.scored = n
        self.scorings += 1
        if p is not None:
            self._publish(run, p, first)
            if not p.ok and p.reason in OUTAGE_REASONS and circuit is not None and circuit.degraded:
                self._rewind(run)  # retried (after the judge's cool-down) until the judge is back
        self._after_score(run)

    def _after_score(self, run: Run) -> None:
        if self.live.get(run.run_id) is not run:
            return  # expired or evicted while scoring
        if run.wants_scoring:
            self._schedule(run)  # to the back of the queue: other runs go first
        elif run.ended is not None:
            self._finish(run, _outcome(run.ended))

    def _publish(self, run: Run, p: Progress, first: int) -> None:
        now = self.clock()
        if p.ok:
            run.last_ok = p
        degraded = isinstance(self.judge, CircuitJudge) and self.judge.degraded
        out = ProgressOut.from_progress(run.run_id, p, degraded=degraded)
        if self.store is not None:
            self.store.record_progress(run.run_id, p.step, out.model_dump(mode="json"))
        self.outbox.put(Message(topic(self.prefix, run.run_id, "progress"), out.to_payload()))
        m = self.metrics
        if m:
            m.scorings.labels("ok" if p.ok else "failed").inc()
            m.coalesced_steps.inc(p.coalesced - 1)
        for i in range(first, p.step + 1):
            t = run.arrived.pop(i, None)
            if t is not None and m:
                m.step_to_score.observe(max(0.0, now - t))
        d = p.signal
        if d is not None and d.changed:
            run.signal = d.signal
            self.outbox.put(
                Message(
                    topic(self.prefix, run.run_id, "signal"),
                    SignalOut.from_decision(run.run_id, d, run.policy).to_payload(),
                    retain=True,
                    droppable=False,
                )
            )
            if m:
                m.signals.labels(d.signal).inc()
            run.log.info("signal", signal=d.signal, reason=d.reason, step=d.step, score=d.score, best_step=d.best_step)

    def _finish(self, run: Run, outcome: str) -> None:
        """Forget a run: clear its retained signal, remember its id for a while, count its outcome."""
        if self.live.pop(run.run_id, None) is None:
            return
        if self.store is not None:
            self.store.record_end(run.run_id, outcome)
        # An empty retained payload deletes the retained signal, so a later subscriber sees no stale abort.
        self.outbox.put(Message(topic(self.prefix, run.run_id, "signal"), b"", retain=True, droppable=False))
        self.ended[run.run_id] = self.clock()
        while len(self.ended) > self.limits.ended_memory:
            self.ended.popitem(last=False)
        latest = run.tracker.latest
        if self.series_grace_s > 0:
            self._finished_series.pop(run.run_id, None)
            self._finished_series[run.run_id] = (self.clock(), _series(run))
            while len(self._finished_series) > self.limits.ended_memory:
                self._finished_series.popitem(last=False)
        if self.metrics:
            self.metrics.runs.labels(outcome).inc()
            self.metrics.runs_active.set(len(self.live))
        run.log.info(
            "run_finished",
            outcome=outcome,
            steps=len(run.tracker.steps),
            score=latest.score if latest else None,
            signal=run.signal,
        )

    def _evict_idlest(self) -> None:
        idle = [r for r in self.live.values() if not r.inflight] or list(self.live.values())
        victim = min(idle, key=lambda r: r.last_event)
        self._error(
            victim.run_id,
            "evicted",
            f"the monitor follows at most {self.limits.max_runs} runs; this one was idle longest and was dropped",
            kind="start",
            invalid=False,
        )
        self._finish(victim, "evicted")

    async def restore(self, stored: Iterable[StoredRun], *, rescore: bool = False) -> int:
        """Rebuild runs from a store after a restart: replay their events, take their stored scores; return runs live.

        Nothing is published or judged while replaying; afterwards each run's unscored steps (only those)
        are scheduled, and a run that had ended but not finished scoring finishes. With `rescore`, stored
        scores are ignored and each run's newest prefix is scored afresh (e.g. after changing the judge).
        """
        stored = list(stored)
        self._replaying = True
        try:
            for sr in stored:
                for event in sr.events:
                    await self.accept(sr.run_id, event)
        finally:
            self._replaying = False
        for sr in stored:
            run = self.live.get(sr.run_id)
            if run is None:
                continue
            results = [] if rescore else [progress_from_dict(d) for d in sr.progress]
            run.tracker.restore(results)
            ok = [p for p in results if p.ok]
            run.last_ok = ok[-1] if ok else None
            run.scored = min(run.tracker.latest.step, len(run.tracker.steps)) if run.tracker.latest else 0
            if run.tracker.policy_state is not None:
                run.signal = run.tracker.policy_state.signal
            for i in range(1, run.scored + 1):
                run.arrived.pop(i, None)
            if run.wants_scoring:
                self._schedule(run)
            elif run.ended is not None:
                self._finish(run, _outcome(run.ended))
        if self.metrics:
            self.metrics.runs_active.set(len(self.live))
        return len(self.live)

    def judge_recovered(self) -> None:
        """Re-score runs whose newest result was lost to the judge outage that just ended."""
        for run in list(self.live.values()):
            latest = run.tracker.latest
            if latest is not None and not latest.ok and latest.reason in OUTAGE_REASONS:
                self._rewind(run)
                self._schedule(run)

    def _rewind(self, run: Run) -> None:
        """Mark steps whose scoring was lost to an outage as unscored: the next scoring covers them again."""
        run.scored = max((p.step for p in run.tracker.curve if p.ok), default=0)

    # -- time --

    async def sweep(self) -> None:
        """Expire what waited too long: steps with no start, gaps nobody fills, idle runs, ended runs' series."""
        now = self.clock()
        self._prune_series(now)
        for run_id, orphan in list(self.orphans.items()):
            if now - orphan.first_seen >= self.limits.hold_s:
                del self.orphans[run_id]
                self._error(
                    run_id,
                    "no_start",
                    f"{len(orphan.steps)} step(s) came but no start within {self.limits.hold_s:g}s; publish "
                    f"{self.prefix}/{run_id}/start before the steps",
                    count=max(1, len(orphan.steps)),
                )
        for run in list(self.live.values()):
            if run.gap_since is not None and now - run.gap_since >= self.limits.hold_s and run.held:
                await self._fill_gap(run, min(run.held))
                self._schedule(run)
            if now - run.last_event >= self.limits.idle_timeout_s and not run.inflight:
                run.log.warning("run_expired", idle_s=round(now - run.last_event, 1))
                self._finish(run, "expired")

    async def sweeper(self, interval_s: float = 0.5) -> None:
        """Sweep forever."""
        while True:
            await asyncio.sleep(interval_s)
            await self.sweep()

    def series(self) -> list[RunSeries]:
        """What the per-run gauges show: live runs, and ended ones within the grace period (scrape thread safe)."""
        now = self.clock()
        # list() copies under the GIL: the scrape runs on another thread while the loop mutates these.
        finished = list(self._finished_series.items())
        live = list(self.live.values())
        shown = {r.run_id for r in live}
        out = [_series(r) for r in live]
        out += [s for rid, (t, s) in finished if now - t < self.series_grace_s and rid not in shown]
        return out

    def _prune_series(self, now: float) -> None:
        while self._finished_series:
            rid, (t, _) = next(iter(self._finished_series.items()))
            if now - t < self.series_grace_s:
                break
            del self._finished_series[rid]

    def idle(self) -> bool:
        """Nothing is waiting for or in scoring."""
        return self._ready.empty() and self._busy == 0 and not any(r.wants_scoring for r in self.live.values())

    async def drain(self) -> None:
        """Wait until every step received so far is scored (for tests and shutdown; bound it with asyncio.timeout)."""
        while not self.idle():
            self._scored_event.clear()
            await self._scored_event.wait()

    # -- errors --

    def _error(
        self,
        run_id: str | None,
        reason: str,
        message: str,
        topic_: str | None = None,
        *,
        kind: str = "step",
        count: int = 1,
        invalid: bool = True,
    ) -> None:
        """Publish an error for a run (or on `_errors`), count it as an invalid event unless it is the monitor's own."""
        if self._replaying:
            return  # reported when the event first came
        if self.metrics and invalid:
            self.metrics.invalid_events.labels(reason).inc(count)
        where = topic(self.prefix, run_id, "error") if run_id else errors_topic(self.prefix)
        came_on = topic_ or (topic(self.prefix, run_id, kind) if run_id else where)
        out = ErrorOut(run_id=run_id, topic=came_on, reason=reason, error=message)
        self.outbox.put(Message(where, out.to_payload()))
        log.warning("event_refused", run_id=run_id, reason=reason, error=message, topic=topic_)


def _series(run: Run) -> RunSeries:
    # The curve keeps the last good score through a failed scoring (a gap would read as "no data").
    p, ok = run.tracker.latest, run.last_ok
    return RunSeries(
        run_id=run.run_id,
        labels=run.start.labels,
        progress=ok.score if ok else None,
        uncertainty=ok.uncertainty if ok else None,
        step=p.step if p else 0,
        signal=run.signal,
        last_event=run.last_event,
    )


def _kind(event: InputEvent) -> str:
    return "start" if isinstance(event, RunStart) else "step" if isinstance(event, StepIn) else "end"


def _outcome(end: RunEnd) -> str:
    if end.outcome in ("success", "failure"):
        return str(end.outcome)
    return "unknown" if end.outcome is None else "scored"


def _same_start(a: RunStart, b: RunStart) -> bool:
    # Images compared by their base64 text: dumping the models would also compare cached decoded bytes.
    return a.model_dump(exclude={"images"}) == b.model_dump(exclude={"images"}) and [i.data for i in a.images] == [
        i.data for i in b.images
    ]
