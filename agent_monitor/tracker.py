"""Trackers: score a trajectory's growing prefix step by step (async core, sync facade, offline)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import inspect
import itertools
import math
import time
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Self, TypeVar

import structlog

from ._compat import TrackResult, as_images, as_steps, reference_form
from ._runtime.budget import BudgetExceeded, within
from ._runtime.scheduler import Scheduler
from ._runtime.sync import Blocking, run_blocking
from .calibration import Family, Point, Sample, Threshold
from .criteria import Criterion, Rubric, load_criteria
from .images import Frame, FrameBudget, ImageInput, load_image
from .judges.base import (
    BaseJudge,
    Judge,
    JudgeError,
    JudgeRequest,
    JudgeResponse,
    Summariser,
    recommended_min_mass,
    require_summariser,
)

# The defaults live with the options; re-exported here, where users (and the daemon) found them
# first.
from .options import DEFAULT_ALLOW_FILES as DEFAULT_ALLOW_FILES
from .options import DEFAULT_CURVE_WINDOW as DEFAULT_CURVE_WINDOW
from .options import DEFAULT_EXTRACT_BUDGET_S as DEFAULT_EXTRACT_BUDGET_S
from .options import DEFAULT_MAX_SIDE as DEFAULT_MAX_SIDE
from .options import DEFAULT_REPEATS as DEFAULT_REPEATS
from .options import ProgressCallback as ProgressCallback
from .options import (
    ScoringOptions,
    TrackerOptions,
)
from .policy import EVERY, FAR, Plan, PolicyState, held_out, plan, resolve
from .progress import NO_USAGE, Decision, Progress, Usage, run_totals
from .prompts import PromptWindow, Step, prompt_budget
from .prompts import prompt_budget as _budget_for
from .rules import Composite, RuleInput, RuleScore
from .scale import (
    CriterionScore,
    ScoreError,
    aggregate,
    binary_as_letters,
    mirrored,
    rule_score,
    score_samples,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from .otel import EvaluationEmitter

log = structlog.get_logger("agent_monitor.tracker")

StepInput = str | Mapping[str, Any]
"""A step: its text (action plus observation), or a mapping rendered as `key: value` lines."""


def _step(p: Progress) -> int:
    return p.step


def _step_text(step: StepInput) -> str:
    if isinstance(step, str):
        return step
    if isinstance(step, Mapping):
        return "\n".join(f"{k}: {v}" for k, v in step.items())
    raise TypeError(f"a step is text or a mapping, not {type(step).__name__}")


def placed(steps: Sequence[Step]) -> Sequence[Step]:
    """The steps in the order the judge reads them: by end time where the source gave one,
    renumbered 1..n.

    A source that knows when each step ended (the OTLP receiver, as `meta["otel"]["end_ns"]`) may
    report a step after later ones were scored: it is judged in its place, not at the end. A step
    without an end time keeps its place after the steps before it. Steps in order (every MQTT run)
    come back as they are, with no copy.
    """
    keys: list[int] = []
    top = 0
    for s in steps:
        otel = s.meta.get("otel")
        end = otel.get("end_ns") if isinstance(otel, Mapping) else None
        if isinstance(end, int) and not isinstance(end, bool):
            keys.append(end)
            top = max(top, end)
        else:
            keys.append(top)
    if all(a <= b for a, b in itertools.pairwise(keys)):
        return steps
    order = sorted(range(len(steps)), key=keys.__getitem__)
    return [
        steps[i] if steps[i].index == at else dataclasses.replace(steps[i], index=at)
        for at, i in enumerate(order, 1)
    ]


class _FrameKeeper:
    """Drops the pixels of the frames the frame budget will never show again: neither an anchor nor
    among the newest.

    Once a prefix of `n` steps is scored, a frame that is not an anchor and has `recent` newer
    frames within that prefix is shown by no later prompt (anchors depend on the ordinal alone, and
    prompts only grow), so its pixels go: a run holds those of its anchors and of its newest frames
    only, and memory per run grows with the anchors (logarithmically in the run's length), not with
    its frames. A dropped frame keeps its type, size and digest (`data` empty), so frame ordinals
    and the prompt's layout stay as they were.
    """

    def __init__(self, budget: FrameBudget) -> None:
        self.budget = budget
        self.dropped = 0
        self.dropped_bytes = 0
        self._ends = array("q")  # frames in the first k + 1 steps
        # (step position, frame position, ordinal) still held
        self._open: deque[tuple[int, int, int]] = deque()

    def add(self, steps: Sequence[Step]) -> None:
        """Account for the steps appended since the last call."""
        for pos in range(len(self._ends), len(steps)):
            total = self._ends[-1] if self._ends else 0
            for i in range(len(steps[pos].frames)):
                if not self.budget.is_anchor(total + i):
                    self._open.append((pos, i, total + i))
            self._ends.append(total + len(steps[pos].frames))

    def settle(self, steps: list[Step], n: int) -> None:
        """After scoring the first `n` steps: drop the pixels no prompt of `n` or more steps
        shows."""
        self.add(steps)
        if not 1 <= n <= len(self._ends):
            return
        shown_from = self._ends[n - 1] - self.budget.recent
        changed: dict[int, list[Frame]] = {}
        while self._open and self._open[0][2] < shown_from:
            at, i, _ordinal = self._open.popleft()
            frames = changed.setdefault(at, list(steps[at].frames))
            f = frames[i]
            frames[i] = Frame(
                data=b"", mime=f.mime, width=f.width, height=f.height, digest=f.digest
            )
            self.dropped += 1
            self.dropped_bytes += len(f.data)
        for at, frames in changed.items():
            steps[at] = dataclasses.replace(steps[at], frames=tuple(frames))


@dataclass(slots=True)
class CurveSummary:
    """A run's whole curve in a few numbers, however few results `tracker.curve` still holds."""

    results: int = 0
    """Results recorded, failed ones included."""
    scored: int = 0
    """Results with a score (`ok`)."""
    first: Progress | None = None
    """The result for the lowest step."""
    last: Progress | None = None
    """The result for the highest step (the newest of a step scored twice): the tracker's
    `latest`."""
    last_ok: Progress | None = None
    """The scored result for the highest step: what a gauge shows through a failed scoring."""
    best_score: float | None = None
    best_step: int | None = None
    """The step of the first result with `best_score`."""
    min_score: float | None = None
    min_step: int | None = None
    """The step of the first result with `min_score`."""
    total: float = 0.0
    """The sum of the scores (see `mean`)."""
    signal_changes: int = 0
    """Results whose policy decision changed the run's signal."""

    @property
    def failed(self) -> int:
        """Results without a score."""
        return self.results - self.scored

    @property
    def mean(self) -> float | None:
        """The mean score over the scored results (None: none yet)."""
        return self.total / self.scored if self.scored else None

    def add(self, p: Progress) -> None:
        """Fold one result in (in any step order)."""
        self.results += 1
        if self.first is None or p.step < self.first.step:
            self.first = p
        if self.last is None or p.step >= self.last.step:
            self.last = p
        if p.signal is not None and p.signal.changed:
            self.signal_changes += 1
        if not p.ok or p.score is None:
            return
        score = p.score
        self.scored += 1
        self.total += score
        if self.last_ok is None or p.step >= self.last_ok.step:
            self.last_ok = p
        best, at = self.best_score, self.best_step
        if best is None or at is None or score > best or (score == best and p.step < at):
            self.best_score, self.best_step = score, p.step
        low, at = self.min_score, self.min_step
        if low is None or at is None or score < low or (score == low and p.step < at):
            self.min_score, self.min_step = score, p.step


@dataclass(slots=True)
class _Pending:
    text: str
    images: tuple[ImageInput, ...]
    meta: Mapping[str, Any]
    context: Context | None = None
    """The OpenTelemetry context the step was given in (with `otel=`): its events attach to that
    span."""


class _History:
    """A run's results: the newest `window` in full, every one as a point and folded into a
    summary."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.curve: list[Progress] = []
        self.summary = CurveSummary()
        # Every result's (step, score, uncertainty) in step order, NaN for "none": calibration
        # learns from the whole run, and 24 bytes a result keep it (a Progress is ~1.6 KB).
        self._steps = array("q")
        self._scores = array("d")
        self._uncertainties = array("d")

    def delta(self, p: Progress) -> float | None:
        """The score's change since the run's previous scored step (None at the first, or when
        either is None)."""
        # From the whole run's points, not the curve's window: a late result's predecessor may have
        # left it.
        at = bisect.bisect_left(self._steps, p.step) - 1
        if at < 0 or p.score is None or math.isnan(self._scores[at]):
            return None
        return p.score - self._scores[at]

    def keep(self, p: Progress) -> None:
        """Put a result in the curve's window, its point in the history, and fold it into the
        summary."""
        # After results for the same step (a step scored again): the order a sort of every result
        # would give.
        at = bisect.bisect_right(self.curve, p.step, key=_step)
        self.curve.insert(at, p)
        if len(self.curve) > self.window:
            del self.curve[0]
        at = bisect.bisect_right(self._steps, p.step)
        # As calibration.points reads a result: a failed one has neither score nor uncertainty.
        score, u = (p.score, p.uncertainty) if p.ok else (None, None)
        self._steps.insert(at, p.step)
        self._scores.insert(at, math.nan if score is None else score)
        self._uncertainties.insert(at, math.nan if u is None else u)
        self.summary.add(p)

    @property
    def points(self) -> tuple[Point, ...]:
        """Every result as (step, score, uncertainty), in step order; None where it had none
        (what calibration reads)."""
        return tuple(
            Point(step, None if math.isnan(s) else s, None if math.isnan(u) else u)
            for step, s, u in zip(self._steps, self._scores, self._uncertainties, strict=True)
        )


P = ParamSpec("P")
S = TypeVar("S")
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class _TrackerArgs(TrackerOptions):
    """A tracker's keywords: `TrackerOptions`' fields and what a tracker is given besides (never
    built)."""

    judge: Judge
    images: Sequence[ImageInput] = ()
    """The task's images (e.g. the goal), shown to the judge before the steps."""
    options: ScoringOptions | None = None
    """Options given whole (a `TrackerOptions`, or a `MonitorConfig`'s scoring settings);
    keywords given win."""


@dataclass(frozen=True, kw_only=True)
class _TrackArgs(TrackerOptions):
    """`track`'s and `atrack`'s keywords: `TrackerOptions`' fields, the judge and each step's
    images (never built)."""

    judge: Judge
    images: Iterable[Iterable[ImageInput]] | ImageInput | None = None
    """`images[i]` are step i's images (one image or a flat list: the task's, the reference
    library's form)."""
    options: ScoringOptions | None = None
    checkpoints: Sequence[int] | None = None
    """The 1-based steps to score (default: every step; the reference library's
    `checkpoint_steps`)."""


def _signature(form: Callable[..., object], args: Any) -> inspect.Signature:
    """`form`'s own positional parameters, then `args`' fields as keywords: the judge first, then
    the options."""
    own = [p for p in inspect.signature(form).parameters.values() if p.kind is not p.VAR_KEYWORD]
    fields = sorted(
        dataclasses.fields(args), key=lambda f: f.name not in ("judge", "images", "options")
    )
    keywords = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=(
                f.default
                if f.default is not dataclasses.MISSING
                else f.default_factory()
                if f.default_factory is not dataclasses.MISSING
                else inspect.Parameter.empty
            ),
            annotation=f.type,
        )
        for f in fields
    ]
    return inspect.Signature(
        [*own, *keywords], return_annotation=inspect.signature(form).return_annotation
    )


def _takes(
    args: Callable[P, object],
) -> Callable[[Callable[Concatenate[S, str, ...], None]], Callable[Concatenate[S, str, P], None]]:
    """A tracker's `__init__(self, task, **keywords)` typed and signed with `args`' fields as its
    keywords.

    The option list is written once, as `TrackerOptions`' fields: mypy reads the keywords from
    `args`' generated `__init__` (a ParamSpec), `help()` and `inspect` from the generated
    `__signature__`.
    """

    def sign(
        init: Callable[Concatenate[S, str, ...], None],
    ) -> Callable[Concatenate[S, str, P], None]:
        init.__signature__ = _signature(init, args)  # type: ignore[attr-defined]
        return init

    return sign


def _takes_steps(
    args: Callable[P, object],
) -> Callable[
    [Callable[Concatenate[str, Iterable[StepInput], ...], R]],
    Callable[Concatenate[str, Iterable[StepInput], P], R],
]:
    """`_takes` for `track(task, steps, **keywords)` and `atrack`."""

    def sign(
        form: Callable[Concatenate[str, Iterable[StepInput], ...], R],
    ) -> Callable[Concatenate[str, Iterable[StepInput], P], R]:
        form.__signature__ = _signature(form, args)  # type: ignore[attr-defined]
        return form

    return sign


def _arguments(owner: str, keywords: dict[str, Any]) -> tuple[Judge, Any, TrackerOptions]:
    """A form's keywords as (judge, images, options); a TypeError names the form for a missing or
    unknown one."""
    if "judge" not in keywords:
        raise TypeError(f"{owner}() missing required keyword argument: 'judge'")
    judge = keywords.pop("judge")
    images = keywords.pop("images", None)
    return judge, images, TrackerOptions.of(owner, keywords.pop("options", None), **keywords)


class AsyncProgressTracker:
    """Score one run's growing trajectory with a judge, on the event loop.

    `await update(step)` appends a step and scores the new prefix. For fast
    producers, `submit(step)` returns at once and a background worker scores
    the newest prefix, folding steps that arrived meanwhile into one call
    (results via `on_progress` and `latest`); it needs `async with tracker:`,
    which owns that worker. `curve` holds the newest `curve_window` results
    (default `DEFAULT_CURVE_WINDOW`), in step order; `summary` (counts, first,
    last, best, lowest and mean score) and `points` (every result's step, score
    and uncertainty) cover the whole run, so a long run's memory stays small.

    `policy` (a Policy, or a mapping of its settings) turns scores into
    continue / abort / resample signals; a rubric config's `thresholds` fill the
    levels it leaves open (a mapping's keys and a Policy's non-default settings
    win; with no `policy`, a rubric with thresholds still gets one).

    `min_mass` is the least probability the judge must put on the scale
    letters for an answer to be a score; None takes the judge's recommendation
    (`judge.min_mass`: the packaged tiny local models recommend a low one),
    else the library default `DEFAULT_MIN_MASS`.

    `usage` is the run's running totals of judge tokens: every scoring's, failed, coalesced and
    out-of-order ones included (each result carries them as `totals`); with `prices`, `cost` is
    their price in USD. `otel=True` emits OpenTelemetry `gen_ai.evaluation.result` events for every
    result through the global LoggerProvider (a `LoggerProvider` instead: through that one; see
    `agent_monitor.otel`). Each result's events carry the span that was current when its newest step
    was given (`add`, `update` or `submit`), so a trace shows the verdict on the step it judged.
    """

    @_takes(_TrackerArgs)
    def __init__(self, task: str, **keywords: Any) -> None:
        judge, images, options = _arguments("AsyncProgressTracker", keywords)
        if not task or not task.strip():
            raise ValueError("task is empty; pass the task the agent is working on")
        o = self.options = options
        """The options in use (`TrackerOptions`)."""
        repeats, min_mass, policy, run_id, calibration = (
            o.repeats,
            o.min_mass,
            o.policy,
            o.run_id,
            o.calibration,
        )
        self.task = task
        self.judge = judge
        self.rubric: Rubric = load_criteria(o.criteria)
        self.repeats = repeats
        self.min_mass: float = recommended_min_mass(judge) if min_mass is None else min_mass
        """The minimum letter mass in use: the one given, else the judge's recommendation."""
        self.max_side = o.max_side
        self.frame_budget: FrameBudget = o.frame_budget
        self.allow_files = o.allow_files
        self.expected = o.expected
        self.extract_budget_s = o.extract_budget_s
        self.calls_saved = 0
        self.prices = o.prices
        self.usage = Usage()
        """The run's judge tokens over every scoring recorded so far (continued across a restart
        by `restore`)."""
        # The rubric's thresholds fill what the caller's policy leaves open (see policy.resolve).
        policy = resolve(policy, dict(self.rubric.thresholds))
        self.calibration = calibration
        self._anon_id = f"anonymous-{uuid.uuid4().hex}"
        self.family = Family.of(
            family=o.family,
            task=task,
            model=str(getattr(judge, "model", "") or ""),
            rubric=self.rubric.hash,
            schedule=policy.schedule if policy is not None else "every",
        )
        """This run's calibration key: its family (default: the task), the judge's model, the
        rubric's hash (and the policy's schedule when it is not "every")."""
        self.policy_state = (
            PolicyState(
                policy,
                threshold=self._threshold if calibration is not None else None,
                held_out=held_out(run_id or self._anon_id, policy.holdout),
                budget=self._budget if calibration is not None else None,
                done=self._done if calibration is not None else None,
            )
            if policy is not None
            else None
        )
        self.on_signal = o.on_signal
        self.on_group: Callable[[Progress], Decision | None] | None = None
        """Set by a `GroupTracker` (or the daemon) for a run in a group: given each in-order result
        after the run policy's decision, it returns the group's prune (an abort with `pruned` set)
        or None."""
        self.run_id = run_id
        self.on_progress = o.on_progress
        self.steps: list[Step] = []
        self._frames = _FrameKeeper(self.frame_budget)
        self._window = PromptWindow(task, self.rubric, frame_budget=self.frame_budget)
        self._summariser: Summariser | None = require_summariser(judge, o.digest)
        self._window.summarising = self._summariser is not None
        self.summaries = 0
        """LLM digest summaries asked (one per folded chunk), failed ones included."""
        self.summary_failures = 0
        """LLM digest summaries that failed or came back empty: those chunks kept their
        deterministic lines."""
        self._summary_lock = asyncio.Lock()
        # whether a step carries an end time (then `placed` may reorder the steps)
        self._timed = False
        self.curve_window = o.curve_window
        self._history = _History(o.curve_window)
        self.curve: list[Progress] = self._history.curve
        """The newest `curve_window` results, in step order (`summary` and `points` cover every
        result)."""
        self.summary: CurveSummary = self._history.summary
        """Every result so far in a few numbers: counts, first and last, best, lowest and mean
        score."""
        self.latest: Progress | None = None
        self._task_images = as_images(images)
        self._task_frames: tuple[Frame, ...] | None = None
        self._pending: deque[_Pending] = deque()
        self._append_lock = asyncio.Lock()
        self._scored = 0
        self._skipped = 0
        # amendments so far (`amend`): a prefix scored again after one is the run's newest score
        self._revision = 0
        self._latest_revision = 0  # the amendments the latest result had seen
        # Made by `async with` only: a daemon's trackers are scored by the daemon's scheduler, not
        # their own.
        self._scheduler: Scheduler[int] | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._worker: asyncio.Task[None] | None = None
        self._log = log.bind(run_id=run_id) if run_id else log
        self._otel: EvaluationEmitter | None = None
        if o.otel:
            from .otel import EvaluationEmitter

            # Built here, not at import: without otel= no OpenTelemetry package is loaded.
            self._otel = EvaluationEmitter(None if o.otel is True else o.otel)
        self._contexts: dict[int, Context] = {}

    # -- lifecycle: the context owns the background worker used by submit() --

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("tracker is already entered")
        self._stack = contextlib.AsyncExitStack()
        tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._scheduler = Scheduler(self._background)
        self._worker = tg.create_task(
            self._scheduler.worker(), name=f"tracker-worker:{self.run_id or id(self)}"
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        stack, worker = self._stack, self._worker
        self._stack = self._worker = None
        if worker is not None:
            worker.cancel()
        if stack is not None:
            await stack.aclose()

    # -- steps --

    async def add(
        self,
        step: StepInput,
        *,
        images: Iterable[ImageInput] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """Append a step (loading its images once, off the event loop); return its 1-based index.

        `meta` is per-step data for rule criteria (e.g. `{"distance_to_goal": 0.4}`); the judge
        never sees it.
        """
        # a text step: nothing
        shown = as_images(images) if images or not isinstance(images, list | tuple) else ()
        return await self._add(step, shown, meta, self._context())

    async def _add(
        self,
        step: StepInput,
        images: tuple[ImageInput, ...],
        meta: Mapping[str, Any] | None,
        context: Context | None,
    ) -> int:
        self._pending.append(_Pending(_step_text(step), images, dict(meta or {}), context))
        await self._materialise()
        return len(self.steps)

    def _context(self) -> Context | None:
        """The caller's OpenTelemetry context when events are emitted (else None: nothing to
        carry)."""
        if self._otel is None:
            return None
        from .otel import current_context

        return current_context()

    def submit(
        self,
        step: StepInput,
        *,
        images: Iterable[ImageInput] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """Queue a step and return its index at once; the background worker scores the newest
        prefix."""
        return self._submit(step, as_images(images), meta, self._context())

    def _submit(
        self,
        step: StepInput,
        images: tuple[ImageInput, ...],
        meta: Mapping[str, Any] | None,
        context: Context | None,
    ) -> int:
        if self._worker is None or self._scheduler is None:
            raise RuntimeError(
                "submit() needs the background worker: use `async with AsyncProgressTracker(...)`"
            )
        self._pending.append(_Pending(_step_text(step), images, dict(meta or {}), context))
        self._scheduler.wake(0)
        return len(self.steps) + len(self._pending)

    async def _materialise(self) -> None:
        async with self._append_lock:
            if self._task_frames is None:
                self._task_frames = tuple(await self._load(self._task_images))
            while self._pending:
                # Popped before loading: a step whose images fail is rejected, not retried forever.
                p = self._pending.popleft()
                index = len(self.steps) + 1
                if p.context is not None:
                    self._contexts[index] = p.context
                if p.images or self.rubric.extractors.extractors:
                    # Image decoding and the extractors read untrusted input: a worker thread, never
                    # the event loop.
                    self.steps.append(await asyncio.to_thread(self._prepare, p, index))
                else:
                    self.steps.append(Step(index=index, text=p.text, meta=p.meta))
                self._timed = self._timed or "otel" in p.meta

    def _prepare(self, p: _Pending, index: int) -> Step:
        """A step made ready in a worker thread: images decoded, extractors run once under the
        time budget."""
        frames = tuple(self._decode(p.images))
        try:
            text = within(
                lambda: self.rubric.extractors(p.text),
                self.extract_budget_s,
                f"step {index}'s extractors",
            )
        except BudgetExceeded as e:
            # The raw text is not shown instead: the extractors may exist to keep parts of it from
            # the judge.
            why = f"step {index}: {e}; its text is withheld from the judge and the rules"
            self._log.warning("extractor_timeout", step=index, error=str(e))
            return Step(
                index=index,
                text=f"(step {index}: text withheld, {e})",
                frames=frames,
                meta=p.meta,
                withheld=why,
            )
        return Step(index=index, text=text, frames=frames, meta=p.meta)

    async def amend(self, index: int, step: StepInput) -> None:
        """Replace step `index`'s text (its frames and meta stay); prompts are laid out again from
        it on.

        A prefix holding it scored from now on is the run's newest result even at a step scored
        before (its policy reads it again): the text the judge graded has changed.
        """
        await self._materialise()
        if not 1 <= index <= len(self.steps):
            raise ValueError(f"cannot amend step {index}: the tracker has {len(self.steps)}")
        old = self.steps[index - 1]
        p = _Pending(_step_text(step), (), old.meta)
        # The extractors read untrusted input: a worker thread, as for a new step.
        new = (
            await asyncio.to_thread(self._prepare, p, index)
            if self.rubric.extractors.extractors
            else None
        )
        text, withheld = (new.text, new.withheld) if new is not None else (p.text, None)
        self.steps[index - 1] = dataclasses.replace(old, text=text, withheld=withheld)
        self._window.amended(index)
        self._revision += 1

    def _decode(self, images: Sequence[ImageInput]) -> list[Frame]:
        """Images loaded as this tracker allows (blocking: call it from a worker thread)."""
        return [load_image(i, max_side=self.max_side, allow_files=self.allow_files) for i in images]

    async def _load(self, images: Sequence[ImageInput]) -> list[Frame]:
        return await asyncio.to_thread(self._decode, images) if images else []

    # -- scoring --

    async def update(
        self,
        step: StepInput,
        *,
        images: Iterable[ImageInput] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> Progress:
        """Append a step and score the trajectory up to it."""
        return await self._update(step, as_images(images), meta, self._context())

    async def _update(
        self,
        step: StepInput,
        images: tuple[ImageInput, ...],
        meta: Mapping[str, Any] | None,
        context: Context | None,
    ) -> Progress:
        n = await self._add(step, images, meta, context)
        return await self.score(n)

    def plan(
        self, n: int | None = None, *, ending: bool = False, extra: Mapping[str, Any] | None = None
    ) -> Plan:
        """Whether the schedule scores the prefix of `n` steps now (`policy.plan`; `extra`: e.g.

        a `prune` line).
        """
        return _plan_of(self, len(self.steps) if n is None else n, ending, extra)

    async def score(
        self,
        n: int | None = None,
        *,
        coalesced: int = 1,
        plan: Plan | None = None,
        skipped: str | None = None,
    ) -> Progress:
        """Score the prefix of `n` steps (default: all steps so far) and record the result.

        `plan()`'s plan says why, and if the repeats are spent; `skipped` why the folded steps were
        not scored."""
        await self._materialise()
        n = len(self.steps) if n is None else n
        if not 1 <= n <= len(self.steps):
            raise ValueError(f"cannot score {n} steps: the tracker has {len(self.steps)}")
        budget = self.prompt_budget
        summarised = NO_USAGE
        if self._summariser is not None and budget is not None:
            steps = placed(self.steps[:n]) if self._timed or n < len(self.steps) else self.steps
            summarised = await self._summarise(steps, n, budget)
        # A step withheld since the last score fails this one (once): the run learns why that step
        # has no score.
        withheld = next((s.withheld for s in self.steps[self._scored : n] if s.withheld), None)
        # The whole list when it is the prefix (the usual case): no copy of the run per scoring.
        prefix = placed(self.steps[:n]) if self._timed or n < len(self.steps) else self.steps
        if not self._window.task_frames and self._task_frames:
            self._window.task_frames = self._task_frames
        revision = self._revision  # the amendments this prefix holds
        p = await score_prefix(
            self.task,
            prefix,
            judge=self.judge,
            rubric=self.rubric,
            repeats=self.repeats if plan is None or plan.full else 1,
            min_mass=self.min_mass,
            frame_budget=self.frame_budget,
            task_frames=self._task_frames or (),
            expected=self.expected,
            run_key=self.run_key,
            coalesced=coalesced,
            run_id=self.run_id,
            withheld=withheld,
            rule_budget_s=self.extract_budget_s,
            window=self._window,
            prompt_budget=budget,
        )
        if summarised is not NO_USAGE:
            # the run's tokens and cost count the summaries
            p = dataclasses.replace(p, usage=p.usage + summarised)
        # No later prompt of n or more steps shows the frames settled now (prompts in flight hold
        # their own copies).
        self._frames.settle(self.steps, n)
        self.calls_saved += p.calls_saved
        if plan is not None and plan is not EVERY:
            p = dataclasses.replace(
                p, scheduled=plan.reason, skipped=skipped if coalesced > 1 else None
            )
        return self._record(p, revision)

    async def _summarise(self, steps: Sequence[Step], n: int, budget: int) -> Usage:
        """Summarise the chunks the prompt for `n` steps folds and no summary settled yet (an LLM
        digest); their usage.

        Once per chunk, before any prompt shows it. A failed or empty summary is counted
        (`summary_failures`) and logged, and the chunk keeps its deterministic lines: a digest line,
        never a score.
        """
        assert self._summariser is not None
        model = None if self.options.digest == "judge" else self.options.digest
        spent = NO_USAGE
        # a chunk is asked once, whichever scorings of the run overlap
        async with self._summary_lock:
            for chunk in self._window.pending(steps, n=n, budget=budget):
                self.summaries += 1
                try:
                    text, usage = await self._summariser.summarise(
                        chunk.prompt, max_tokens=chunk.max_tokens, model=model
                    )
                except Exception as e:
                    self.summary_failures += 1
                    self._log.warning(
                        "digest_summary_failed",
                        steps=f"{chunk.first}-{chunk.last}",
                        error=f"{type(e).__name__}: {e}",
                        hint="the chunk keeps its deterministic digest lines",
                    )
                    self._window.settle(chunk, None)
                    continue
                spent = usage if spent is NO_USAGE else spent + usage
                if not text.strip():
                    self.summary_failures += 1
                    self._log.warning("digest_summary_empty", steps=f"{chunk.first}-{chunk.last}")
                self._window.settle(chunk, text)
        return spent

    @property
    def cost(self) -> float | None:
        """What `usage` cost in USD at `prices` (None without prices)."""
        return self.prices.cost(self.usage) if self.prices is not None else None

    @property
    def prompt_budget(self) -> int | None:
        """The most tokens a prompt may hold now: the judge's context (read per scoring: a refusal
        may lower it) less room for the answer, and at most the `prompt_budget` option; None (no
        limit) when neither is known."""
        return prompt_budget(_context_tokens(self.judge), self.options.prompt_budget)

    @property
    def window(self) -> PromptWindow:
        """The run's prompt layout (head, digest, recent steps): its `compactions` and current
        `budget`."""
        return self._window

    def _record(self, p: Progress, revision: int = 0) -> Progress:
        # Every recorded scoring counts, whatever became of its score: its tokens were spent.
        self.usage += p.usage
        signal = p.signal
        # Results older than the latest (a slow concurrent update) do not move the policy backwards.
        in_order = self.latest is None or p.step > self.latest.step
        # A step scored again after its first scoring failed (a judge outage ended) is the run's
        # newest score.
        in_order = in_order or (
            self.latest is not None and p.step == self.latest.step and p.ok and not self.latest.ok
        )
        # A step scored again after an amendment (`amend`) of the prefix it had: the newest
        # judgement of the run.
        in_order = in_order or (
            self.latest is not None
            and p.step == self.latest.step
            and revision > self._latest_revision
        )
        if self.policy_state is not None and in_order:
            # The policy reads the score, not the totals: one copy of the result carries both.
            signal = self.policy_state.observe(p)
        p = dataclasses.replace(
            p, totals=self.usage, cost=self.cost, delta=self._history.delta(p), signal=signal
        )
        if self.on_group is not None and in_order:
            p = self._group_decision(p)
        if in_order and p.signal is not None and p.signal.changed and self.on_signal is not None:
            try:
                self.on_signal(p.signal)
            except Exception:
                self._log.exception("on_signal_failed", step=p.step)
        self._history.keep(p)
        if self.latest is None or p.step >= self.latest.step:
            self.latest = p
            self._latest_revision = max(self._latest_revision, revision)
        self._scored = max(self._scored, p.step)
        if not p.ok:
            self._log.warning("score_failed", step=p.step, reason=p.reason, error=p.error)
        if self._otel is not None:
            self._emit_otel(p)
        if self.on_progress is not None:
            try:
                self.on_progress(p)
            except Exception:
                # A broken callback must not stop scoring of later steps.
                self._log.exception("on_progress_failed", step=p.step)
        return p

    def _group_decision(self, p: Progress) -> Progress:
        """`p` with its group's verdict: a prune is an abort (final), marked `pruned`, that
        replaces the run's own."""
        assert self.on_group is not None
        if p.signal is not None and p.signal.signal == "abort" and not p.signal.changed:
            return p  # aborted before: final, nothing for the group to decide
        try:
            d = self.on_group(p)
        except Exception:
            # The group is a side of the run, not the run: a failure there never stops its scoring.
            self._log.exception("group_failed", step=p.step)
            return p
        if d is None:
            return p
        if self.policy_state is not None:
            self.policy_state.signal, self.policy_state.reason = "abort", d.reason
        return dataclasses.replace(p, signal=d)

    @property
    def points(self) -> tuple[Point, ...]:
        """Every result as (step, score, uncertainty), in step order; None where it had none
        (what calibration reads)."""
        return self._history.points

    def _emit_otel(self, p: Progress) -> None:
        """Emit a result's evaluation events in the context its newest step was given in; never
        raises."""
        assert self._otel is not None
        context = self._contexts.get(p.step)
        # Contexts of steps this result covers are no longer needed (a coalesced score covers
        # several).
        for i in [i for i in self._contexts if i <= p.step]:
            del self._contexts[i]
        try:
            self._otel.emit(p, criteria=[c.name for c in self.rubric.criteria], context=context)
        except Exception:
            # Telemetry is a side channel: a broken provider or processor never stops scoring.
            self._log.exception("otel_emit_failed", step=p.step)

    @property
    def run_key(self) -> str:
        """The key this tracker's judge calls carry: the run id, else an anonymous id of its own."""
        return self.run_id or self._anon_id

    def _threshold(self) -> Threshold:
        assert self.calibration is not None and self.policy_state is not None
        # At the decision a counted score makes: the length stratum the run is in then.
        state = self.policy_state
        return self.calibration.threshold(self.family, state.policy, counted=state.counted + 1)

    def _budget(self) -> Threshold:
        assert self.calibration is not None and self.policy_state is not None
        return self.calibration.budget(self.family, self.policy_state.policy)

    def _done(self) -> Threshold:
        assert self.calibration is not None and self.policy_state is not None
        return self.calibration.done(self.family, self.policy_state.policy)

    def finish(self, outcome: object) -> Sample | None:
        """Teach the calibration this run's outcome ("success", "failure" or a number); the sample
        it kept, if any.

        Call it once the run has ended and its last step is scored. Nothing is learnt (None) without
        a calibration, from an outcome that says neither success nor failure, or from a run an abort
        rule could have stopped (its outcome is censored; see `Calibration.record`).
        """
        if self.calibration is None:
            return None
        # A run counts once per family: a tracker without a run id still needs an id of its own.
        run_id = self.run_key
        exposed = self.policy_state is not None and self.policy_state.exposed
        return self.calibration.record(self.family, run_id, outcome, self.points, exposed=exposed)

    def restore(self, results: Iterable[Progress], *, usage: Usage | None = None) -> None:
        """Take results scored before a restart as this tracker's own: curve, latest, policy state
        and totals.

        No callbacks. `usage` is the run's totals before the restart (None: what the results carry,
        see `run_totals`); scorings from here on add to them.
        """
        results = list(results)
        self.usage += run_totals(results) if usage is None else usage
        for p in sorted(results, key=lambda q: q.step):
            if self.policy_state is not None:
                if p.signal is not None and p.signal.pruned:
                    # The group's verdict is not a function of this run's scores: a prune is kept as
                    # it was decided.
                    self.policy_state.signal, self.policy_state.reason = "abort", p.signal.reason
                else:
                    # The policy is a function of the score sequence: replaying it rebuilds best
                    # step, streak and signal.
                    p = dataclasses.replace(p, signal=self.policy_state.observe(p))
            self._history.keep(p)
            self.latest = p
            self._scored = max(self._scored, p.step)
        # what was stored was scored on the steps as replayed
        self._latest_revision = self._revision

    async def _background(self, _key: int) -> None:
        """The scheduler's callback: materialise what was submitted, then score the newest prefix
        once."""
        while True:
            try:
                await self._materialise()
                break
            except Exception as e:
                # An undecodable image fails that step's submission (it was popped), not the run.
                self._log.error("step_rejected", error=str(e))
        await _follow_schedule(self, ending=False)

    async def drain(self) -> Progress | None:
        """Wait until every submitted step is folded into a score; return the latest result.

        Under "adaptive" the run's end as far as the tracker knows: the steps it skipped are scored
        now."""
        if self._scheduler is not None:
            await self._scheduler.drain()
        await _follow_schedule(self, ending=True)
        return self.latest


def _context_tokens(judge: object) -> int | None:
    """The judge's context window, looked up through wrappers (the daemon's circuit breaker holds
    it as `inner`)."""
    for _ in range(4):
        found = getattr(judge, "context_tokens", None)
        if found is not None or not hasattr(judge, "inner"):
            return found if isinstance(found, int) else None
        judge = judge.inner
    return None


def _plan_of(
    t: AsyncProgressTracker, n: int, ending: bool, extra: Mapping[str, Any] | None
) -> Plan:
    state = t.policy_state
    return (
        EVERY
        if state is None
        else plan(state, n, last=t.latest, last_step=t._scored, ending=ending, extra=extra)
    )


async def _follow_schedule(t: AsyncProgressTracker, *, ending: bool) -> None:
    """Score a tracker's newest prefix when its schedule says so (`ending`: the run's end, as far
    as it knows)."""
    n, state = len(t.steps), t.policy_state
    if n <= t._scored or (
        ending and (state is None or state.policy.every_step or state.signal == "abort")
    ):
        return
    plan = t.plan(n, ending=ending)
    if not plan.score:
        t._skipped = n  # the schedule waits: a later submit, or drain (the run's end), scores it
        return
    skipped = FAR if t._skipped > t._scored else None
    await t.score(n, coalesced=n - t._scored, plan=plan, skipped=skipped)


async def score_prefix(
    task: str,
    steps: Sequence[Step],
    *,
    judge: Judge,
    rubric: Rubric,
    repeats: int = DEFAULT_REPEATS,
    min_mass: float | None = None,
    frame_budget: FrameBudget | None = None,
    task_frames: Sequence[Frame] = (),
    expected: str | None = None,
    run_key: str | None = None,
    coalesced: int = 1,
    run_id: str | None = None,
    withheld: str | None = None,
    rule_budget_s: float = DEFAULT_EXTRACT_BUDGET_S,
    window: PromptWindow | None = None,
    prompt_budget: int | None = None,
) -> Progress:
    """Score one trajectory prefix: rules first, then one judge call per remaining criterion, then
    aggregate.

    The judge calls share the prompt prefix. A criterion whose rules are confident costs no call
    (counted in `calls_saved`); a rule-only criterion with no confident rule is `silent` and left
    out of the weighted mean. Rules run in a worker thread, each criterion's under `rule_budget_s`;
    one over it, or a `withheld` step, fails the result with `extractor_timeout`. `min_mass` None is
    the judge's recommendation (see `recommended_min_mass`). `run_key` goes to the judge with every
    call (see `JudgeRequest.run_key`). `window` is the run's prompt layout, kept between scorings (a
    tracker's: prompts then extend each other and cost what they hold, not the run); `prompt_budget`
    the most tokens a prompt may hold (None: no limit).
    """
    start = time.perf_counter()
    if min_mass is None:
        min_mass = recommended_min_mass(judge)
    n = steps[-1].index if steps else 0
    # `steps` may be a tracker's own list, which grows while the judge is awaited
    count = len(steps)
    if window is None:
        window = PromptWindow(task, rubric, frame_budget=frame_budget, task_frames=task_frames)
    scored: dict[str, CriterionScore] = {}
    silent: list[str] = []
    saved = 0
    ask: list[Criterion] = []
    failure: tuple[str, str] | None = ("extractor_timeout", withheld) if withheld else None
    verdicts: dict[str, RuleScore | None] = {}
    if failure is None and any(c.rules for c in rubric.criteria):
        rule_input = RuleInput(
            task=task,
            steps=[s.text for s in steps],
            metadata=[s.meta for s in steps],
            expected=expected,
        )
        verdicts, timeout = await asyncio.to_thread(
            _run_rules, rubric, rule_input, rule_budget_s, n
        )
        if timeout is not None:
            failure = ("extractor_timeout", timeout)
    for c in rubric.criteria:
        verdict = verdicts.get(c.name)
        if verdict is not None:
            scored[c.name] = rule_score(
                c.name, c.weight, verdict.score, verdict.confidence, verdict.detail
            )
            saved += c.uses_judge
        elif c.uses_judge:
            ask.append(c)
        else:
            silent.append(c.name)
    if failure is not None:
        ask = []  # the result is a failure whatever the judge says: do not pay for its calls

    async def one(c: Criterion) -> JudgeResponse | Exception:
        budget, retried = prompt_budget, False
        while True:
            prompt = window.build(steps, c, n=count, budget=budget)
            try:
                return await judge.grade(
                    JudgeRequest(prompt=prompt, repeats=repeats, run_key=run_key)
                )
            except JudgeError as e:
                # A context-length refusal taught the judge a context below this prompt's budget (a
                # server that says its context nowhere, as llama_cpp.server): the prefix is laid out
                # again under the learned budget and asked once more, so the refusal costs a call,
                # not the step's score.
                smaller = _budget_for(_context_tokens(judge), budget)
                if (
                    retried
                    or e.reason != "context_overflow"
                    or smaller is None
                    or smaller == budget
                ):
                    return e
                budget, retried = smaller, True
            except Exception as e:
                # A third-party judge's bug is a failed call, never a crash of the run or a made-up
                # score.
                log.exception("judge_raised", judge=getattr(judge, "name", "?"), step=n)
                return JudgeError("judge_exception", f"{type(e).__name__}: {e}")

    # One criterion (the common case) is awaited directly: gather would wrap it in a task of its
    # own. Through gather's task even for one criterion: it is a point where the event loop runs
    # other work. Awaited directly, an instant judge (a cache hit, a rule, FakeJudge) lets a scorer
    # run one scoring after another without yielding: ingest starves, steps stop coalescing, and
    # bench/overhead.py's flood fell from 8,841 to 740 steps/s.
    answers = await asyncio.gather(*(one(c) for c in ask))
    usage = NO_USAGE  # replaced by the first answer's (most scorings have one): nothing to add up
    model = ""
    dropped = 0
    for c, a in zip(ask, answers, strict=True):
        if isinstance(a, JudgeError):
            failure = failure or (a.reason, f"criterion {c.name!r}: judge call failed: {a}")
            continue
        assert isinstance(a, JudgeResponse)
        usage = a.usage if usage is NO_USAGE else usage + a.usage
        model = a.model or model
        dropped += a.images_dropped
        try:
            # A rubric whose scale puts the best letter first: the judge's letters, mirrored onto
            # ours; a binary rubric's True / False, placed on T / A (the same rules of mass and
            # renormalisation then apply).
            samples = tuple(mirrored(x) for x in a.samples) if rubric.reversed_scale else a.samples
            if rubric.binary:
                samples = tuple(binary_as_letters(x) for x in samples)
            scored[c.name] = score_samples(
                c.name, c.weight, samples, repeats=repeats, min_mass=min_mass, draws=a.draws
            )
        except ScoreError as e:
            failure = failure or (e.reason, f"criterion {c.name!r}: {e}")
    common: dict[str, Any] = {
        "step": n,
        "criteria": scored,
        "judge": getattr(judge, "name", type(judge).__name__),
        "model": model or getattr(judge, "model", "") or "",
        "rubric": rubric.hash,
        "coalesced": coalesced,
        "latency_s": time.perf_counter() - start,
        "usage": usage,
        # a run of one scoring; a tracker replaces them with the run's running totals
        "totals": usage,
        "calls": len(answers),
        "calls_saved": saved,
        "images_dropped": dropped,
        "silent": tuple(silent),
        "run_id": run_id,
    }
    if failure is None and not scored:
        failure = (
            "no_opinion",
            f"no criterion could be scored: rules {silent} had no confident answer and no judge",
        )
    if failure is not None:
        return Progress(
            score=None, uncertainty=None, ok=False, reason=failure[0], error=failure[1], **common
        )
    agg = aggregate(list(scored.values()))
    return Progress(
        score=agg.score,
        uncertainty=agg.uncertainty,
        ok=True,
        mass=agg.mass,
        dispersion=agg.dispersion,
        spread=agg.spread,
        **common,
    )


def _run_rules(
    rubric: Rubric, inp: RuleInput, budget_s: float, n: int
) -> tuple[dict[str, RuleScore | None], str | None]:
    """Each rule criterion's verdict (in a worker thread), or why one ran over its time budget."""
    out: dict[str, RuleScore | None] = {}
    for c in rubric.criteria:
        if not c.rules:
            continue
        rules = Composite(c.rules, c.min_confidence)
        try:
            out[c.name] = within(partial(rules, inp), budget_s, f"criterion {c.name!r}'s rules")
        except BudgetExceeded as e:
            log.warning("extractor_timeout", criterion=c.name, step=n, error=str(e))
            return out, f"criterion {c.name!r} at step {n}: {e}"
        except Exception:
            # A broken (user-registered) rule has no opinion; the judge, if any, still answers.
            log.exception("rule_failed", criterion=c.name, step=n)
            out[c.name] = None
    return out, None


class ProgressTracker:
    """The synchronous hook: a thin facade over AsyncProgressTracker, run on the judge's background
    loop.

    `update()` blocks until the new prefix is scored; `submit()` returns at
    once (for 10 Hz robot loops) and `latest` / `on_progress` carry results,
    the callback being called on the background loop's thread. Call `close()`
    (or use `with`) when the run ends. The options are AsyncProgressTracker's:
    same names, same defaults, same meaning.
    """

    _owned_judge: BaseJudge | None = None

    @reference_form("tracker")
    @_takes(_TrackerArgs)
    def __init__(self, task: str, **keywords: Any) -> None:
        judge, images, options = _arguments("ProgressTracker", keywords)
        # Built before any loop starts: a bad option then leaves no thread behind.
        self._core = AsyncProgressTracker(task, judge=judge, images=images or (), options=options)
        self._sync = Blocking(judge, "progress-tracker-loop")
        self._cm = self._sync.enter(self._core)
        self._closed = False

    def update(
        self,
        step: StepInput,
        *,
        images: Iterable[ImageInput] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> Progress:
        """Append a step and block until the trajectory up to it is scored."""
        self._check()
        # Taken here, on the caller's thread, and passed along: the step's events then carry the
        # caller's span whatever context the loop thread runs the call in.
        context = self._core._context()
        return self._sync.call(partial(self._core._update, step, as_images(images), meta, context))

    def submit(
        self,
        step: StepInput,
        *,
        images: Iterable[ImageInput] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """Queue a step and return at once; the newest prefix is scored in the background."""
        self._check()
        context = self._core._context()
        return self._sync.call(partial(self._core._submit, step, as_images(images), meta, context))

    def drain(self) -> Progress | None:
        """Block until every submitted step is folded into a score; return the latest result."""
        self._check()
        return self._sync.call(self._core.drain)

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("the tracker is closed; create a new one for a new run")

    @property
    def latest(self) -> Progress | None:
        """The result for the newest scored prefix."""
        return self._core.latest

    @property
    def curve(self) -> list[Progress]:
        """The newest `curve_window` results, in step order (`summary` and `points` cover every
        result)."""
        return list(self._core.curve)

    @property
    def summary(self) -> CurveSummary:
        """Every result so far in a few numbers: counts, first and last, best, lowest and mean
        score (a copy)."""
        return dataclasses.replace(self._core.summary)

    @property
    def points(self) -> tuple[Point, ...]:
        """Every result as (step, score, uncertainty), in step order."""
        return self._core.points

    @property
    def steps(self) -> list[Step]:
        """The steps received so far."""
        return list(self._core.steps)

    @property
    def rubric(self) -> Rubric:
        """The criteria in use."""
        return self._core.rubric

    @property
    def options(self) -> TrackerOptions:
        """The options in use (`TrackerOptions`)."""
        return self._core.options

    @property
    def min_mass(self) -> float:
        """The minimum letter mass in use: the one given, else the judge's recommendation."""
        return self._core.min_mass

    @property
    def family(self) -> Family:
        """This run's calibration key: its family, the judge's model, the rubric's hash."""
        return self._core.family

    @property
    def usage(self) -> Usage:
        """The run's judge tokens over every scoring so far (failed and coalesced ones included)."""
        return self._core.usage

    @property
    def window(self) -> PromptWindow:
        """The run's prompt layout (head, digest, recent steps): its `compactions` and current
        `budget`."""
        return self._core.window

    @property
    def summaries(self) -> int:
        """LLM digest summaries asked (one per folded chunk), failed ones included."""
        return self._core.summaries

    @property
    def summary_failures(self) -> int:
        """LLM digest summaries that failed or came back empty: those chunks kept their
        deterministic lines."""
        return self._core.summary_failures

    @property
    def cost(self) -> float | None:
        """What `usage` cost in USD at the tracker's `prices` (None without prices)."""
        return self._core.cost

    def finish(self, outcome: object) -> Sample | None:
        """Teach the calibration this run's outcome (see AsyncProgressTracker.finish); call after
        the last step."""
        self._check()
        return self._sync.call(self._finish, outcome)

    async def _finish(self, outcome: object) -> Sample | None:
        # On the tracker's loop: the calibration is shared with other trackers there.
        await self._core.drain()
        return self._core.finish(outcome)

    def close(self) -> None:
        """Stop the background worker; the judge stays open for other trackers."""
        if self._closed:
            return
        self._closed = True
        self._cm.__exit__(None, None, None)
        self._sync.close()
        if self._owned_judge is not None:
            # built from the environment for this tracker (the reference library's form)
            self._owned_judge.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@_takes_steps(_TrackArgs)
async def atrack(task: str, steps: Iterable[StepInput], **keywords: Any) -> TrackResult:
    """Score every prefix of a finished trajectory, in order, as a live run would have been.

    `images[i]` are step i's images (one image or a flat list of them: the task's, seen at every
    step, as the reference library's `images=`); `checkpoints` the 1-based steps to score (default:
    every step); the other options are AsyncProgressTracker's (`TrackerOptions`).
    """
    checkpoints = keywords.pop("checkpoints", None)
    judge, images, options = _arguments("atrack", keywords)
    steps = as_steps(steps)
    task_images, images = _task_images(images)
    tracker = AsyncProgressTracker(task, judge=judge, images=task_images, options=options)
    frames = list(images) if images is not None else None
    for i, s in enumerate(steps):
        await tracker.add(s, images=frames[i] if frames is not None and i < len(frames) else ())
    # One prefix at a time: a prefix cache (llama.cpp, vLLM) then reads each step once.
    scored = [await tracker.score(n) for n in _checkpoints(checkpoints, len(tracker.steps))]
    return TrackResult(scored, tracker.repeats, tracker.rubric)


def _task_images(
    images: Iterable[Iterable[ImageInput]] | ImageInput | None,
) -> tuple[tuple[ImageInput, ...], Iterable[Iterable[ImageInput]] | None]:
    """(task images, per-step images): one image or a flat list of them is the task's (the
    reference form)."""
    if images is None:
        return (), None
    flat = as_images(images)
    if all(isinstance(i, str | bytes | bytearray) or not isinstance(i, Iterable) for i in flat):
        return flat, None
    return (), images  # type: ignore[return-value]


def _checkpoints(checkpoints: Sequence[int] | None, n: int) -> list[int]:
    if checkpoints is None:
        return list(range(1, n + 1))
    bad = [
        k for k in checkpoints if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n
    ]
    if bad:
        raise ValueError(f"checkpoint_steps out of range 1..{n}: {bad}; give 1-based step numbers")
    return sorted(set(checkpoints))


@reference_form("track")
@_takes_steps(_TrackArgs)
def track(task: str, steps: Iterable[StepInput], **keywords: Any) -> TrackResult:
    """Synchronous `atrack`: score every prefix of a finished trajectory."""
    checkpoints = keywords.pop("checkpoints", None)
    judge, images, options = _arguments("track", keywords)
    # On the judge's loop thread (or a private one), the caller's context variables (its spans)
    # carried along.
    run = partial(
        atrack, task, steps, judge=judge, images=images, options=options, checkpoints=checkpoints
    )
    return run_blocking(judge, run, "track")
