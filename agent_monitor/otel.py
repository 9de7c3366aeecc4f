"""OpenTelemetry GenAI evaluation events: each scored step becomes `gen_ai.evaluation.result` log
events.

The GenAI semantic conventions (status: development) define the event `gen_ai.evaluation.result`;
in the Python SDK an event is a LogRecord with `event_name` set, emitted through the Logs API.
`evaluation_attributes` is the one place a `Progress` becomes those events' attributes; the hook
(`ProgressTracker(..., otel=True)`) and the daemon (`serve --otlp-endpoint`) both emit through
`EvaluationEmitter`. Importing this module imports no OpenTelemetry package: they are loaded
when an emitter is made (`pip install -e '.[otel]'` in the agent-monitor checkout).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .progress import Progress
from .scale import CriterionScore

if TYPE_CHECKING:
    from opentelemetry._logs import Logger, LoggerProvider
    from opentelemetry.context import Context

EVENT_NAME = "gen_ai.evaluation.result"
"""The event name of the GenAI semantic conventions' evaluation result."""
OVERALL = "agent_monitor.progress"
"""The evaluation name of a failed result's one event when the rubric's criteria are not known."""
INSTALL_HINT = "pip install -e '.[otel]' (in the agent-monitor checkout)"
# An explanation is a short why, never a copy of the step text or a judge's long error.
_MAX_EXPLANATION = 300

T = TypeVar("T")
AttributeValue = str | bool | int | float
Attributes = dict[str, AttributeValue]


def evaluation_attributes(progress: Progress, criteria: Sequence[str] = ()) -> list[Attributes]:
    """The attributes of the `gen_ai.evaluation.result` events for one result, one mapping per
    event.

    A scored result gives one event per criterion it scored (silent rule criteria give none), named
    after the criterion, with its score, its most likely letter as the label, and a short why. A
    failed result has no score for any criterion: it gives one event per name in `criteria` (the
    rubric's criteria; none given: one event named `OVERALL`) with `error.type` = the failure
    reason. Every event carries the run id, step, overall score and signal as `agent_monitor.*`.
    """
    common: Attributes = {"agent_monitor.step": progress.step}
    if progress.run_id is not None:
        common["agent_monitor.run_id"] = progress.run_id
    if progress.score is not None:
        common["agent_monitor.score"] = progress.score
    if progress.signal is not None:
        common["agent_monitor.signal"] = progress.signal.signal
        common["agent_monitor.signal.reason"] = progress.signal.reason[:_MAX_EXPLANATION]
    if progress.model:
        common["agent_monitor.judge.model"] = progress.model
    if progress.rubric:
        common["agent_monitor.rubric"] = progress.rubric
    if not progress.ok:
        names = tuple(criteria) or (OVERALL,)
        why = _clip(progress.error or progress.reason or "no score")
        return [
            {
                "gen_ai.evaluation.name": name,
                "error.type": progress.reason or "unknown",
                "gen_ai.evaluation.explanation": why,
                **common,
            }
            for name in names
        ]
    return [_criterion_attributes(c, progress, common) for c in progress.criteria.values()]


def _criterion_attributes(c: CriterionScore, progress: Progress, common: Attributes) -> Attributes:
    attrs: Attributes = {
        "gen_ai.evaluation.name": c.name,
        "gen_ai.evaluation.score.value": c.score,
    }
    label = _top_letter(c.letters)
    if label is not None:
        attrs["gen_ai.evaluation.score.label"] = label
    attrs["gen_ai.evaluation.explanation"] = _explain(c, progress)
    attrs.update(common)
    attrs["agent_monitor.uncertainty"] = c.uncertainty
    attrs["agent_monitor.mass"] = c.mass
    attrs["agent_monitor.weight"] = c.weight
    attrs["agent_monitor.source"] = c.source
    return attrs


def _top_letter(letters: Mapping[str, float]) -> str | None:
    # Ties go to the earlier (lower) letter: a label never claims more progress than the judge gave.
    return max(sorted(letters), key=lambda k: letters[k]) if letters else None


def _explain(c: CriterionScore, progress: Progress) -> str:
    if c.source == "rule":
        why = f"rule (confidence {c.confidence:.2f})" + (f": {c.detail}" if c.detail else "")
    else:
        top = sorted(c.letters.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        spelled = ", ".join(f"{letter} {p:.0%}" for letter, p in top)
        how = "sampled, letter mass" if c.source == "sampled" else "letter mass"
        why = (
            f"{spelled} ({how} {c.mass:.2f}"
            + (f", {c.repeats} repeats" if c.repeats > 1 else "")
            + ")"
        )
    d = progress.signal
    if d is not None and d.signal != "continue":
        why += f"; {d.signal}: {d.reason}"
    return _clip(why)


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_EXPLANATION else text[: _MAX_EXPLANATION - 1] + "…"


def _require_otel() -> Any:
    try:
        import opentelemetry._logs as logs
    except ImportError as e:
        raise ImportError(
            f"OpenTelemetry events need the opentelemetry packages ({e.name} is missing): "
            f"{INSTALL_HINT}"
        ) from None
    return logs


def current_context() -> Context:
    """The caller's OpenTelemetry context (its active span), to attach a later event to (needs
    the otel extra)."""
    _require_otel()
    from opentelemetry.context import get_current

    return get_current()


async def in_context(context: Context, fn: Callable[[], Awaitable[T]]) -> T:
    """Await `fn()` with `context` current (a caller's spans carried to another thread's event
    loop)."""
    from opentelemetry.context import attach, detach

    token = attach(context)
    try:
        return await fn()
    finally:
        detach(token)


def detached_context() -> Context:
    """A context with no span: events emitted in it belong to no trace (the daemon's: its runs
    come over MQTT)."""
    _require_otel()
    from opentelemetry.context import Context
    from opentelemetry.trace import INVALID_SPAN, set_span_in_context

    # An empty Context would not do: the SDK takes the current context in its place.
    return set_span_in_context(INVALID_SPAN, Context())


def span_context(trace_id: str, span_id: str) -> Context:
    """A context whose span is another process's (hex ids): events emitted in it carry that trace
    and span id."""
    _require_otel()
    from opentelemetry.context import Context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    span = NonRecordingSpan(
        SpanContext(
            int(trace_id, 16),
            int(span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
    )
    return set_span_in_context(span, Context())


class EvaluationEmitter:
    """Emit a result's `gen_ai.evaluation.result` events through an OpenTelemetry Logger.

    `provider` is the LoggerProvider to use; None is the global one (`opentelemetry._logs.
    set_logger_provider`), looked up at each emit through the API's proxy, so a provider set
    after the tracker was made is still used. Emitting is as fast as the provider's processors:
    give it a `BatchLogRecordProcessor` so scoring never waits for the network.
    """

    def __init__(self, provider: LoggerProvider | None = None) -> None:
        logs = _require_otel()
        from importlib.metadata import PackageNotFoundError, version

        try:
            v: str | None = version("agent-monitor")
        except PackageNotFoundError:  # a checkout that was never installed
            v = None
        self.logger: Logger = logs.get_logger("agent_monitor", v, logger_provider=provider)
        self._record = logs.LogRecord

    def emit(
        self, progress: Progress, *, criteria: Sequence[str] = (), context: Context | None = None
    ) -> int:
        """Emit the events of one result in `context` (None: the current one); return how many."""
        return self.emit_attributes(evaluation_attributes(progress, criteria), context=context)

    def emit_attributes(
        self, events: Sequence[Attributes], *, context: Context | None = None
    ) -> int:
        """Emit one event per attribute mapping (from `evaluation_attributes`) in `context`;
        return how many."""
        now = time.time_ns()
        for attrs in events:
            self.logger.emit(
                self._record(
                    timestamp=now, context=context, event_name=EVENT_NAME, attributes=attrs
                )
            )
        return len(events)


__all__ = [
    "EVENT_NAME",
    "INSTALL_HINT",
    "OVERALL",
    "AttributeValue",
    "Attributes",
    "EvaluationEmitter",
    "current_context",
    "detached_context",
    "evaluation_attributes",
    "in_context",
    "span_context",
]
