"""The monitor's scoring part: each live run's tracker, the scheduler its scorers take runs from,
the circuit.

Handed what it needs, never the monitor: the run state (`RunBook`, read), the judge behind its
circuit breaker, the calibration, the groups part, the sink to `emit` to and the clock. What the
ingest applies reaches it as effects (`act`); a run whose end is accepted finishes through `finish`
once its newest prefix is scored. It bounds the judge work of each run (calls per scoring, calls per
run-minute) and counts what its scorings gave (`ScoringCounts`, read by the metrics at scrape time).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..._runtime.scheduler import Scheduler
from ...calibration import Calibration
from ...criteria import Rubric
from ...judges.circuit import LATENCY_BUCKETS, CircuitJudge
from ...policy import EVERY, FAR, Plan, Policy, with_levels
from ...progress import OUTAGE_REASONS, Progress, Signal, run_totals
from ...tracker import AsyncProgressTracker
from ...wire import RunStart, Topics
from .._config import MonitorConfig
from .._events import MonitorEvent, Refused, RunClosed, RunOpened, Scored, SignalChanged, Skipped
from ._book import AcceptedStep, Appended, Closed, Closing, Effect, Opened, Revised, RunBook
from ._groups import Groups, Joiner
from ._replay import Replays, sample_key, spend_signed

WINDOW_S = 60.0
"""The window a run's judge calls are counted over (`max_judge_calls_per_run_minute`)."""
TOKEN_BUCKETS = (1e3, 1e4, 3e4, 1e5, 3e5, 1e6, 3e6, 1e7)
"""Upper bounds the judge tokens a run spent (over its life, or up to a decision) are counted in."""
_FINISH_BATCH = 1000
"""Runs ended per commit by the finisher (one journal transaction, one hold of the ingest lock)."""

log = structlog.get_logger("agent_monitor.daemon")


@dataclass(eq=False, slots=True)
class RunScoring:
    """The scoring side of one live run: its tracker (steps, curve, policy state) and what was
    published."""

    tracker: AsyncProgressTracker
    policy: Policy
    labels: dict[str, str]
    scored: int = 0
    signal: Signal = "continue"
    last_ok: Progress | None = None
    arrived: dict[int, float] = field(default_factory=dict)
    group: str | None = None
    """The run's group (`start.group`), while it is in one."""
    closing: str | None = None
    """The outcome to finish with once the newest prefix is scored (set when the end is
    accepted)."""
    planned: int = 0
    """The newest step the schedule decided not to score (each step is decided once)."""
    published_at: float | None = None
    """When the run's last score was published (a heartbeat says how old it is)."""
    amended: int = 0
    """The lowest step amended since the run's scoring in flight began (0: none): that scoring
    covers it as it was."""

    @property
    def wants_scoring(self) -> bool:
        """Steps wait to be scored, and the run was not told to abort (abort is final)."""
        return len(self.tracker.steps) > self.scored and self.signal != "abort"


@dataclass(frozen=True, slots=True)
class ScoringStatistics:
    """What the scorings gave (`ScoringCounts`), steps skipped, and the runs waiting for the
    finisher.

    Each histogram is three fields: `{name}_buckets` (its upper bounds), `{name}_counts` (one count
    per bound, then the ones over the last) and `{name}_sum`.
    """

    scorings: int
    """Scorings made since the part was built."""
    skipped: Mapping[str, int]
    """Steps the schedule did not score, by reason."""
    closing: int
    """Ended runs waiting for the finisher."""
    scored_ok: int
    scored_failed: int
    failures: Mapping[str, int]
    """Failed scorings by reason (judge failures, extractor_timeout, ...)."""
    coalesced: int
    """Steps folded into a later step's scoring instead of being scored alone."""
    superseded: int
    """Scorings whose run got newer steps while they were in flight: published, soon replaced by
    the next one."""
    held: int
    """Scorings not started while their run's previous message still waited to be published."""
    calls_saved: int
    """Judge calls not made because confident rules answered the criterion."""
    images_dropped: int
    """Image parts the judge got as text placeholders instead of pixels."""
    step_to_score_buckets: tuple[float, ...]
    step_to_score_counts: tuple[int, ...]
    step_to_score_sum: float
    """Steps by time (seconds) from arrival to the publication of the score that covers them."""
    decision_tokens_buckets: tuple[float, ...]
    decision_tokens_counts: tuple[int, ...]
    decision_tokens_sum: float
    """Changes of signal by the judge tokens their run had spent up to them."""


@dataclass(eq=False, slots=True)
class ScoringCounts:
    """What the scorings gave, as plain numbers: counted on the scorer's path, exported at scrape
    time."""

    ok: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    coalesced: int = 0
    """Steps folded into a later step's scoring instead of being scored alone."""
    superseded: int = 0
    """Scorings whose run got newer steps while they were in flight: published, soon replaced by
    the next one."""
    held: int = 0
    """Scorings not started while their run's previous message still waited to be published (they
    fold later)."""
    calls_saved: int = 0
    images_dropped: int = 0
    to_score: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    """Steps by time from arrival to the publication of the score that covers them (per bound,
    then over)."""
    to_score_sum: float = 0.0
    decision_tokens: list[int] = field(default_factory=lambda: [0] * (len(TOKEN_BUCKETS) + 1))
    """Changes of signal by the judge tokens the run had spent up to them."""
    decision_tokens_sum: float = 0.0

    def scored(self, p: Progress, arrived: Sequence[float], at: float) -> None:
        """Count one scoring's result (`arrived`: when each step it newly covers arrived)."""
        if p.ok:
            self.ok += 1
        else:
            self.failed += 1
            if p.reason:
                self.failures[p.reason] = self.failures.get(p.reason, 0) + 1
        if p.coalesced > 1:
            self.coalesced += p.coalesced - 1
        self.calls_saved += p.calls_saved
        self.images_dropped += p.images_dropped
        for t in arrived:
            took = max(0.0, at - t)
            self.to_score[bisect.bisect_left(LATENCY_BUCKETS, took)] += 1
            self.to_score_sum += took
        if p.signal is not None and p.signal.changed:
            spent = p.totals.input_tokens + p.totals.output_tokens
            self.decision_tokens[bisect.bisect_left(TOKEN_BUCKETS, spent)] += 1
            self.decision_tokens_sum += spent


def joiner_of(start: RunStart, scoring: RunScoring) -> Joiner:
    """What a start brings to its group: membership is by family, rubric and group settings (and
    the group auth)."""
    family = scoring.tracker.family
    return Joiner(family.name, family.rubric, scoring.policy, start.started_at, start.auth)


class Scoring:
    """The live runs' trackers and the scorers' queue: score each run's newest prefix, emit what
    it gave."""

    def __init__(
        self,
        config: MonitorConfig,
        *,
        criteria: Rubric,
        template: str = "",
        book: RunBook,
        circuit: CircuitJudge,
        calibration: Calibration,
        groups: Groups,
        topics: Topics,
        emit: Callable[[MonitorEvent], None],
        clock: Callable[[], float],
        on_depth: Callable[[int], None] | None = None,
        on_outcome_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.config = config
        self.criteria = criteria
        self.template = template
        """The operator's prompt template (serve --prompt): a start's own rubric is laid out by
        it too."""
        self.book = book
        self.circuit = circuit
        self.calibration = calibration
        self.groups = groups
        self.topics = topics
        self.emit = emit
        self.clock = clock
        self.on_outcome_refused = on_outcome_refused
        """Told why an outcome teaches nothing ("unauthenticated", "replayed", "stale", "rate"):
        a counter."""
        self.replays = Replays(config.signature_max_age_s, calibration.max_total, clock=clock)
        """The signed outcomes already used (`--outcome-secret`): a replayed one teaches nothing."""
        self.scheduler: Scheduler[str] = Scheduler(self._score, on_depth=on_depth)
        # Judge calls per run per minute: a run past it waits (its steps coalesce meanwhile).
        self.rate = CallRate(config.work.max_judge_calls_per_run_minute, clock=clock)
        self.runs: dict[str, RunScoring] = {}
        self.prepared: dict[str, RunScoring] = {}
        self.scorings = 0
        self.counts = ScoringCounts()
        self.skipped: dict[str, int] = {}
        """Steps the schedule did not score alone, by reason (they folded into a later scoring)."""
        self.finish: Callable[[str, str], Awaitable[None]] | None = None
        self.finish_many: Callable[[Sequence[tuple[str, str]]], Awaitable[None]] | None = None
        """Journal many runs' ends at once (wired by the monitor): what the `finisher` task
        calls."""
        self._closing: dict[str, str] = {}
        """Runs whose end came with nothing left to score: ended by the `finisher`, not in a
        scorer's slot."""
        self._closing_wake = asyncio.Event()
        self._closed_all = asyncio.Event()
        """Set while the finisher has nothing queued or in hand."""
        self._closed_all.set()
        """Finish a run (journal its end) once its newest prefix is scored.

        The ingest's, wired by the monitor.
        """
        self._default_policy: tuple[Policy, dict[str, Any]] | None = None
        self.unpublished: Callable[[str], int] | None = None
        """Messages about a run still waiting to be published (wired by a monitor that publishes;
        None: not held)."""
        self._held: set[str] = set()
        """Runs whose scoring waits for their previous messages to leave the outbox (`published`
        wakes them)."""

    def holding(self) -> int:
        """Runs whose scoring waits for their previous messages to be published."""
        return len(self._held)

    def published(self, run_id: str) -> None:
        """A run's waiting messages have left the outbox: score it now if its scoring was held
        for them."""
        if run_id in self._held:
            self._held.discard(run_id)
            self.scheduler.wake(run_id)

    def tracker(self, run_id: str) -> AsyncProgressTracker | None:
        """The tracker scoring a live run, or None."""
        s = self.runs.get(run_id)
        return s.tracker if s is not None else None

    def criteria_of(self, run_id: str) -> tuple[str, ...]:
        """The names of a live run's criteria (a failed score's evaluation events are one per
        criterion)."""
        t = self.tracker(run_id)
        return tuple(c.name for c in t.rubric.criteria) if t else ()

    # -- what the ingest applied --

    def prepare(self, run_id: str, start: RunStart) -> Joiner:
        """Build a start's tracker before it is journaled (a start that cannot be used is refused,
        not journaled).

        Returns what the run brings to its group, checked against the group before the start is
        journaled.
        """
        self.prepared[run_id] = scoring = self._new(run_id, start)
        return joiner_of(start, scoring)

    async def act(self, effect: Effect, replaying: bool) -> None:
        """Act on one effect of a journaled record (steps appended, a run opened, closing or
        closed)."""
        if isinstance(effect, Appended):
            await self._append(effect.run_id, effect.steps, replaying)
        elif isinstance(effect, Opened):
            self._open(effect.run_id, effect.start, replaying)
        elif isinstance(effect, Closing):
            scoring = self.runs.get(effect.run_id)
            if scoring is not None:
                scoring.closing = effect.outcome
                if replaying:
                    return  # a restored run is finished by `restore` (it wakes the scheduler)
                if not scoring.wants_scoring and self.scheduler.idle_for(effect.run_id):
                    # Nothing to score (a run with no step, or all scored): a scorer's slot is for
                    # the judge; a burst of such ends (50,000 empty runs) would hold every slot for
                    # minutes, one commit apiece.
                    self._closing[effect.run_id] = effect.outcome
                    self._closed_all.clear()
                    self._closing_wake.set()
                else:
                    # finishes the run once its newest prefix is scored
                    self.scheduler.wake(effect.run_id)
        elif isinstance(effect, Closed):
            self._closed(effect, replaying)
        elif isinstance(effect, Revised):
            await self._revise(effect, replaying)

    def _new(self, run_id: str, start: RunStart) -> RunScoring:
        c = self.config
        rubric = start.rubric() if start.criteria is not None else self.criteria
        if self.template and not rubric.template:
            rubric = dataclasses.replace(rubric, template=self.template)
        # WorkRefused names the bound
        check_start(rubric, c.repeats, c.work.max_judge_calls_per_step)
        # Precedence: start.policy, then the policy flags given (or not at their default), then the
        # rubric's thresholds, then the defaults. A start naming neither criteria nor policy (most)
        # gets the same one: resolved once (dataclasses.asdict per start was a third of a start's
        # cost in a burst).
        if start.criteria is None and not start.policy:
            if self._default_policy is None:
                resolved = with_levels(c.policy, dict(rubric.thresholds), keep=c.policy_given)
                self._default_policy = (resolved, resolved.as_dict())
            policy, settings = self._default_policy
        else:
            policy = start.resolved_policy(
                with_levels(c.policy, dict(rubric.thresholds), keep=c.policy_given)
            )
            settings = policy.as_dict()
        tracker = AsyncProgressTracker(
            start.task,
            judge=self.circuit,
            options=c,  # the config's scoring settings (ScoringOptions' fields), passed on whole
            criteria=rubric,
            images=[i.decoded() for i in start.images],
            allow_files=False,  # network events never name local files
            expected=start.expected,
            run_id=run_id,
            # Every setting named: resolved above, so the tracker must not fill any from the rubric
            # again.
            policy=settings,
            calibration=self.calibration,
            family=start.family,
            prices=c.prices,
        )
        return RunScoring(tracker, policy, dict(start.labels), group=start.group)

    def _open(self, run_id: str, start: RunStart, replaying: bool) -> None:
        scoring = self.prepared.pop(run_id, None) or self._new(run_id, start)
        self.runs[run_id] = scoring
        if not replaying:
            self.emit(RunOpened(run_id, start, len(self.book.live)))
        if start.group is not None:
            # Placed by what it is graded on: the group it named, one split off it, or none; scored
            # whichever.
            placed = self.groups.join(
                run_id,
                start.group,
                scoring.policy,
                scoring.tracker,
                joiner_of(start, scoring),
                publish=not replaying,
            )
            scoring.group = placed.group
            if placed.reason is not None and not replaying:
                where = self.topics.of(run_id, "start")
                self.emit(Refused(run_id, placed.reason, placed.message, where, invalid=False))

    async def _append(self, run_id: str, steps: tuple[AcceptedStep, ...], replaying: bool) -> None:
        scoring = self.runs.get(run_id)
        if scoring is None:
            return
        for s in steps:
            step = s.step
            try:
                await scoring.tracker.add(
                    step.text, images=[im.decoded() for im in step.images], meta=step.meta
                )
            except Exception as e:
                # The images passed the sniff but not the decoder: keep the step's text, report the
                # images.
                if not replaying:
                    where = self.topics.of(run_id, "step")
                    why = f"step {s.index}: an image could not be decoded ({e}); scored without"
                    self.emit(Refused(run_id, "bad_image", why, where))
                text = step.text or f"(step {s.index}: its images could not be decoded)"
                await scoring.tracker.add(text, meta=step.meta)
            scoring.arrived[s.index] = s.at
        if not replaying:
            self.scheduler.wake(run_id)

    async def _revise(self, effect: Revised, replaying: bool) -> None:
        """A step's text was amended: the tracker takes it, and the run is scored again at its
        newest step."""
        scoring = self.runs.get(effect.run_id)
        if scoring is None or effect.index > len(scoring.tracker.steps):
            return
        await scoring.tracker.amend(effect.index, effect.step.text)
        # Every result from the amended step on graded other words: the newest prefix is scored
        # again (on replay, `restore` knows from the stored scores what is left).
        scoring.scored = min(scoring.scored, effect.index - 1)
        scoring.amended = min(scoring.amended or effect.index, effect.index)
        scoring.arrived.setdefault(effect.index, effect.at)
        if not replaying:
            self.scheduler.wake(effect.run_id)

    def _closed(self, effect: Closed, replaying: bool) -> None:
        run_id = effect.run_id
        scoring = self.runs.pop(run_id, None)
        self._held.discard(run_id)
        self.scheduler.discard(run_id)
        self.rate.forget(run_id)
        self.groups.ended(run_id, effect.outcome, effect.at, publish=not replaying)
        if replaying and effect.outcome != "evicted":
            return
        latest = scoring.tracker.latest if scoring else None
        verdict = scoring.tracker.rubric.verdict(latest.score) if scoring and latest else None
        final = (
            {**latest.to_json(), "verdict": verdict, "final": True} if latest and verdict else None
        )
        self.emit(
            RunClosed(
                run_id,
                effect.outcome,
                len(scoring.tracker.steps) if scoring else 0,
                latest,
                scoring.last_ok if scoring else None,
                scoring.signal if scoring else "continue",
                scoring.labels if scoring else {},
                effect.at,
                len(self.book.live),
                final,
            )
        )

    def teach(self, run_id: str) -> None:
        """Teach the calibration a run that ended and is scored: its outcome and its curve (no
        outcome: nothing)."""
        state, scoring = self.book.live.get(run_id), self.runs.get(run_id)
        if state is None or state.ended is None or scoring is None:
            return
        tracker = scoring.tracker
        # A run id may be used again for a new run once its run ended: the start time tells the two
        # apart. The start's own started_at when it gives one: the same start run again (re-sent
        # after its end) is the same run and teaches once, even across restarts (the samples are
        # stored); else when the monitor opened it.
        when = state.start.started_at if state.start.started_at is not None else state.started_at
        key = f"{run_id}@{when!r}"
        secret = self.config.outcome_secret
        outcome = state.ended.outcome
        # With --outcome-secret, an outcome teaches only when its end carries the run's HMAC, once,
        # while fresh.
        if secret and outcome is not None:
            signed_at = state.start.started_at
            why = spend_signed(secret, self.replays, run_id, signed_at, outcome, state.ended.auth)
            if why is not None or signed_at is None:
                self.on_outcome_refused(why or "stale")
                log.warning(
                    "outcome_refused",
                    run_id=run_id,
                    why=why,
                    hint="a signed outcome teaches once, fresh",
                )
                return
            key = sample_key(run_id, signed_at)
        try:
            exposed = tracker.policy_state is not None and tracker.policy_state.exposed
            limited = self.calibration.rate_limited
            self.calibration.record(tracker.family, key, outcome, tracker.points, exposed=exposed)
            # the family's teaching rate was spent: counted
            if self.calibration.rate_limited > limited:
                self.on_outcome_refused("rate")
        except Exception:
            # one run's evidence lost, never the daemon
            log.exception("calibration_failed", run_id=run_id)

    async def finisher(self) -> None:
        """End the runs that have nothing left to score, many per commit (the `finisher` task)."""
        while True:
            await self._closing_wake.wait()
            self._closing_wake.clear()
            while self._closing:
                batch = list(self._closing.items())[:_FINISH_BATCH]
                for run_id, _ in batch:
                    del self._closing[run_id]
                live = [
                    (r, o)
                    for r, o in batch
                    if (s := self.runs.get(r)) is not None and not s.wants_scoring
                ]
                if live:
                    assert self.finish_many is not None, (
                        "Scoring.finish_many is wired by the monitor"
                    )
                    try:
                        await self.finish_many(live)
                    except Exception:
                        # Not journaled (the store failed): each is ended again, one by one, by a
                        # scorer.
                        log.exception("finish_failed", runs=len(live))
                        for run_id, _ in live:
                            self.scheduler.wake(run_id)
            self._closed_all.set()

    def closing(self) -> int:
        """Runs waiting for the finisher."""
        return len(self._closing)

    async def ended(self) -> None:
        """Wait until the finisher ended every run it was given."""
        await self._closed_all.wait()

    def forget(self, run_id: str) -> None:
        """Drop a run without ending it (cluster mode: another replica owns it now)."""
        self._held.discard(run_id)
        self.runs.pop(run_id, None)
        self.prepared.pop(run_id, None)
        self._closing.pop(run_id, None)
        self.scheduler.discard(run_id)
        self.rate.forget(run_id)
        self.groups.forget(run_id)

    # -- scoring (the scheduler's callback) --

    async def _score(self, run_id: str) -> None:
        scoring = self.runs.get(run_id)
        if scoring is None:
            return
        if scoring.wants_scoring:
            if self.unpublished is not None and self.unpublished(run_id):
                # Its last score is not out yet: a new one would queue behind it, superseded before
                # anyone read it. Held until that message leaves (`published`); the steps arriving
                # meanwhile fold into it.
                self._held.add(run_id)
                self.counts.held += 1
                return
            plan = self._plan(run_id, scoring)
            if plan is None:
                return
            # A run that spent its judge calls for the minute waits (its steps coalesce meanwhile;
            # `due` wakes it).
            calls = calls_per_scoring(
                scoring.tracker.rubric, self.config.repeats if plan.full else 1
            )
            wait = self.rate.wait(run_id, calls)
            if wait > 0:
                self.rate.defer(run_id, wait)
                return
            self.rate.spend(run_id, calls)
            # While the judge is down, wait for its next probe instead of spending this run's steps
            # on certain failures; steps arriving meanwhile fold into the one scoring made when it
            # is back.
            async with self.circuit.ready():
                n = len(scoring.tracker.steps)
                first = scoring.scored + 1
                scoring.amended = 0
                try:
                    skipped = FAR if scoring.planned > scoring.scored else None
                    p: Progress | None = await scoring.tracker.score(
                        n, coalesced=n - scoring.scored, plan=plan, skipped=skipped
                    )
                except Exception as e:
                    # The tracker turns judge failures into results; anything else is a bug,
                    # reported, never a score.
                    log.exception("scoring_crashed", run_id=run_id, step=n)
                    where = self.topics.of(run_id, "step")
                    self.emit(
                        Refused(
                            run_id,
                            "scoring_failed",
                            f"scoring step {n} failed: {e}",
                            where,
                            invalid=False,
                        )
                    )
                    p = None
            # else a step of this prefix was amended meanwhile: it is scored again
            if not 0 < scoring.amended <= n:
                scoring.scored = max(scoring.scored, n)
            self.scorings += 1
            if len(scoring.tracker.steps) > n:
                # Steps came while the judge read this prefix (one that came before it started would
                # have been in it: the prefix is taken when the scoring starts, newest prefix wins):
                # published, then replaced.
                self.counts.superseded += 1
            if self.runs.get(run_id) is not scoring:
                # the run moved to another replica meanwhile (cluster mode): its owner publishes,
                # not this one
                return
            if p is not None:
                self._scored(run_id, scoring, p, first)
        if (
            scoring.closing is not None
            and not scoring.wants_scoring
            and self.runs.get(run_id) is scoring
        ):
            assert self.finish is not None, "Scoring.finish is wired by the monitor"
            await self.finish(run_id, scoring.closing)

    def _plan(self, run_id: str, scoring: RunScoring) -> Plan | None:
        """The schedule's plan for the run's newest step; None when it is not scored now
        (counted, once per step)."""
        tracker = scoring.tracker
        state = tracker.policy_state
        if state is None or state.every_step:
            # what `policy.plan` says of it: no schedule to ask, nor a group's pruning line to read
            return EVERY
        n = len(tracker.steps)
        extra = {"prune": self.groups.prune_line(run_id)} if scoring.group is not None else None
        plan = tracker.plan(n, ending=scoring.closing is not None, extra=extra)
        if plan.score:
            return plan
        if n > scoring.planned:
            scoring.planned = n
            self.skipped[plan.reason] = self.skipped.get(plan.reason, 0) + 1
            self.emit(Skipped(run_id, n, plan.reason, self._heartbeat(scoring, n)))
        return None

    def _heartbeat(self, scoring: RunScoring, step: int) -> dict[str, Any] | None:
        """The run's last score again, marked as a heartbeat with its age (with --heartbeat; None
        otherwise)."""
        last = scoring.last_ok
        if not self.config.heartbeat or last is None:
            return None
        age_s = (
            None if scoring.published_at is None else max(0.0, self.clock() - scoring.published_at)
        )
        return {**last.to_json(), "heartbeat": True, "age_steps": step - last.step, "age_s": age_s}

    def statistics(self) -> ScoringStatistics:
        """Scorings made, what they gave (`ScoringCounts`), steps the schedule skipped and runs
        closing."""
        c = self.counts
        return ScoringStatistics(
            scorings=self.scorings,
            skipped=dict(self.skipped),
            closing=self.closing(),
            scored_ok=c.ok,
            scored_failed=c.failed,
            failures=dict(c.failures),
            coalesced=c.coalesced,
            superseded=c.superseded,
            held=c.held,
            calls_saved=c.calls_saved,
            images_dropped=c.images_dropped,
            step_to_score_buckets=LATENCY_BUCKETS,
            step_to_score_counts=tuple(c.to_score),
            step_to_score_sum=c.to_score_sum,
            decision_tokens_buckets=TOKEN_BUCKETS,
            decision_tokens_counts=tuple(c.decision_tokens),
            decision_tokens_sum=c.decision_tokens_sum,
        )

    def _scored(self, run_id: str, scoring: RunScoring, p: Progress, first: int) -> None:
        degraded = self.circuit.degraded
        if degraded:
            p = dataclasses.replace(p, degraded=True)
        scoring.published_at = self.clock()
        if p.ok:
            scoring.last_ok = p
        arrived = tuple(
            t for i in range(first, p.step + 1) if (t := scoring.arrived.pop(i, None)) is not None
        )
        now = self.clock()
        self.counts.scored(p, arrived, now)
        self.emit(Scored(run_id, p, p.to_json(), arrived, now))
        d = p.signal
        if d is not None and d.changed:
            scoring.signal = d.signal
            self.emit(SignalChanged(run_id, d, scoring.policy))
        if not p.ok and p.reason in OUTAGE_REASONS and degraded:
            # Scored again at the judge's next probe: woken now (it is in flight, so it goes to the
            # back of the queue when this scoring ends) and it waits in `circuit.ready()` until the
            # probe is due.
            _rewind(scoring)
            self.scheduler.wake(run_id)

    def due(self) -> None:
        """Wake the deferred runs whose minute has room for a scoring again (the sweeper's)."""
        for run_id in self.rate.due():
            self.scheduler.wake(run_id)

    def judge_back(self) -> None:
        """The judge answers again: score again the runs whose newest result was lost to the
        outage."""
        for run_id, scoring in list(self.runs.items()):
            latest = scoring.tracker.latest
            if latest is not None and not latest.ok and latest.reason in OUTAGE_REASONS:
                _rewind(scoring)
                self.scheduler.wake(run_id)

    def restore(
        self,
        run_id: str,
        progress: Sequence[Mapping[str, Any]],
        *,
        republish: bool = True,
        republish_score: bool = False,
    ) -> None:
        """Give a replayed run its stored scores; schedule what is left to score (or to finish);
        republish its signal.

        `republish_score`: publish the latest stored score again when it covers every step (a
        takeover: the previous owner may have journaled it without getting it out).
        """
        scoring = self.runs.get(run_id)
        if scoring is None:
            return
        stored = [Progress.from_json(dict(d)) for d in progress]
        results = [] if self.config.rescore else stored
        tracker = scoring.tracker
        # The tokens were spent whatever is kept of the scores: the totals go on from where they
        # were.
        tracker.restore(
            (r for r in results if r.step <= len(tracker.steps)), usage=run_totals(stored)
        )
        scoring.last_ok = tracker.summary.last_ok
        scoring.scored = tracker.latest.step if tracker.latest else 0
        for i in range(1, scoring.scored + 1):
            scoring.arrived.pop(i, None)
        latest = tracker.latest
        if latest is not None and republish_score and not scoring.wants_scoring:
            # Only when nothing is left to score: otherwise the next scoring publishes a later score
            # anyway, and a republished older one would follow a later one the previous owner got
            # out before journaling it.
            self.emit(Scored(run_id, latest, latest.to_json(), (), self.clock(), republished=True))
        if latest is not None and latest.signal is not None:
            scoring.signal = latest.signal.signal
            if tracker.summary.signal_changes and republish:
                self.emit(SignalChanged(run_id, latest.signal, scoring.policy, republished=True))
        if scoring.wants_scoring or scoring.closing is not None:
            self.scheduler.wake(run_id)


def _rewind(scoring: RunScoring) -> None:
    """Mark steps whose scoring was lost to an outage as unscored: the next scoring covers them
    again."""
    last_ok = scoring.tracker.summary.last_ok
    scoring.scored = last_ok.step if last_ok is not None else 0


# -- bounded work per event --
#
# A start's rubric is bounded on decode (`criteria.check_bounds`: criteria, bytes per criterion,
# rubric bytes). What it costs the judge is bounded here: one scoring of a run makes at most `judged
# criteria x repeats` calls (a start over `max_judge_calls_per_step` is refused), and a run makes at
# most `max_judge_calls_per_run_minute` calls in any 60 s; past it the run waits, and the steps
# arriving meanwhile fold into its next scoring (newest prefix wins), so a chatty or hostile run
# costs a bounded judge budget however fast it publishes.


class WorkRefused(ValueError):
    """A start whose judge work per step is over the monitor's bound; the message names the
    bound."""


def calls_per_scoring(rubric: Rubric, repeats: int) -> int:
    """Judge calls one scoring of a run with `rubric` makes at most (rules may answer some of
    them)."""
    return len(rubric.judged) * repeats


def check_start(rubric: Rubric, repeats: int, max_calls_per_step: int) -> int:
    """The calls one scoring makes; WorkRefused when that is over `max_calls_per_step`."""
    calls = calls_per_scoring(rubric, repeats)
    if calls > max_calls_per_step:
        raise WorkRefused(
            f"{len(rubric.judged)} judged criteria x {repeats} repeats = {calls} judge calls "
            "per step, over the "
            f"limit of {max_calls_per_step} (max_judge_calls_per_step); use fewer criteria"
        )
    return calls


@dataclass(frozen=True, slots=True)
class CallRateStatistics:
    """The per-run judge call rate: runs it holds, runs waiting for their window, and scorings
    put off."""

    runs: int
    """Runs with calls in their window."""
    waiting: int
    """Runs whose next scoring waits for their window to make room."""
    delayed: int
    """Scorings put off so far because their run had spent its calls for the window."""
    limit_per_window: int
    """Judge calls a run may spend in any window (`WorkLimits.max_judge_calls_per_run_minute`)."""


class CallRate:
    """Judge calls per run in any `window_s` seconds, at most `limit`: a sliding window of spent
    calls.

    Memory is bounded by the live runs times the scorings that fit in a window (each entry spends
    at least one call, so at most `limit` entries per run); `forget` drops an ended run's window.
    """

    def __init__(
        self, limit: int, *, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ):
        if limit < 1:
            raise ValueError(f"limit={limit}; use 1 or more judge calls per window")
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self._spent: dict[str, deque[tuple[float, int]]] = {}
        self._sums: dict[str, int] = {}
        self.delayed = 0
        """Scorings put off because their run had spent its calls for the window."""
        self._due: dict[str, float] = {}

    def _trim(self, run_id: str, now: float) -> deque[tuple[float, int]] | None:
        q = self._spent.get(run_id)
        if q is None:
            return None
        while q and q[0][0] <= now - self.window_s:
            _, n = q.popleft()
            self._sums[run_id] -= n
        if not q:
            del self._spent[run_id], self._sums[run_id]
            return None
        return q

    def wait(self, run_id: str, calls: int) -> float:
        """Seconds until `calls` more fit in the run's window (0: now); counts a delay when not
        0."""
        now = self.clock()
        q = self._trim(run_id, now)
        if q is None:
            return 0.0
        spent = self._sums[run_id]
        if spent + calls <= self.limit:
            return 0.0
        # The oldest entries leave the window first: wait until enough of them have.
        free = self.limit - calls
        for at, n in q:
            spent -= n
            if spent <= free:
                self.delayed += 1
                return max(at + self.window_s - now, 0.001)
        self.delayed += 1
        return self.window_s  # unreachable while calls <= limit (checked at start)

    def defer(self, run_id: str, wait_s: float) -> None:
        """Remember that the run's scoring waits `wait_s`; `due` hands it back when that passed."""
        self._due[run_id] = self.clock() + wait_s

    def due(self) -> list[str]:
        """Runs whose deferred scoring may go now (each handed back once)."""
        now = self.clock()
        ready = [r for r, at in self._due.items() if at <= now]
        for r in ready:
            del self._due[r]
        return ready

    def spend(self, run_id: str, calls: int) -> None:
        """Count `calls` judge calls made for the run now."""
        if calls <= 0:
            return
        self._spent.setdefault(run_id, deque()).append((self.clock(), calls))
        self._sums[run_id] = self._sums.get(run_id, 0) + calls

    def forget(self, run_id: str) -> None:
        """Drop an ended run's window."""
        self._spent.pop(run_id, None)
        self._sums.pop(run_id, None)
        self._due.pop(run_id, None)

    def statistics(self) -> CallRateStatistics:
        """Runs with calls in their window, and scorings delayed so far."""
        return CallRateStatistics(
            runs=len(self._spent),
            waiting=len(self._due),
            delayed=self.delayed,
            limit_per_window=self.limit,
        )
