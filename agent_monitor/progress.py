"""The one vocabulary of results: Progress, Decision, signal names and error reasons, with exactly
one JSON form.

A scored prefix is a `Progress`; the run policy's verdict on it is a `Decision`. Their JSON
form (`Progress.to_json`, `Decision.to_json`) is what the MQTT progress and signal messages
carry, what the run store keeps and what `agent-monitor score --json` prints; `from_json` is its
exact inverse. The wire models (`agent_monitor.wire`) validate this form; they do not define one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, NotRequired, TypedDict, get_args

from .scale import CriterionScore

Signal = Literal["continue", "abort", "resample", "done"]
"""What the harness should do with a run now."""
SIGNALS: tuple[Signal, ...] = get_args(Signal)
StopKind = Literal["judged", "infra"]
"""Why a run was stopped: the judge's scores said so ("judged"), or the judge or the plumbing failed
("infra"). A trainer drops an infra-stopped rollout without penalising the policy; a judged stop is
a verdict on it."""

OUTAGE_REASONS = frozenset(
    {
        "timeout",
        "connection",
        "server_error",
        "rate_limited",
        "judge_unavailable",
        "judge_exception",
        "inference",
    }
)
"""Judge failures that say the judge was down, not that the prompt or answer was bad: retried on
recovery."""

FAILURES: Mapping[str, str] = {
    # The judge call failed.
    "timeout": "the judge did not answer in time",
    "connection": "the judge server cannot be reached",
    "server_error": "the judge server answered 5xx",
    "rate_limited": "the judge server answered 429",
    "bad_request": "the judge server refused the request (400)",
    "auth": "the judge refused the credentials",
    "not_found": "no such model or endpoint on the judge server",
    "no_model": "the judge server lists no model",
    "client_error": "the judge client failed before reaching the server",
    "bad_response": "the judge's answer could not be read",
    "no_logprobs": "the judge server answered without logprobs (set it up to return them, or "
    "--judge-sampled)",
    "chat_template": "the local model's chat template failed",
    "context_overflow": "the prompt does not fit the judge's context",
    "inference": "the local model failed to evaluate the prompt",
    "closed": "the judge was closed",
    "judge_exception": "the judge backend raised an unexpected error",
    "judge_unavailable": "the judge keeps failing; the monitor is backing off (circuit open)",
    # The judge answered, but the answer is not a score.
    "no_letter": "no candidate token at the answer position is a scale letter",
    "low_mass": "scale letters hold less probability than the minimum mass",
    "no_answer": "a repeat returned no answer position",
    "missing_repeats": "fewer repeats came back than were asked for",
    "no_opinion": "no criterion could be scored (silent rules, no judge criterion)",
    "extractor_timeout": "a step's extractors or a criterion's rules ran over their time "
    "budget (untrusted text)",
    "scoring_failed": "scoring failed inside the monitor (a bug; the log has the traceback)",
}
"""Why a Progress has no score (`Progress.reason`), and what each reason means."""

REFUSALS: Mapping[str, str] = {
    "payload_too_large": "the payload is over the size limit",
    "bad_json": "the payload is not UTF-8 JSON",
    "bad_topic": "the topic is not {prefix}/{run_id}/{start|step|end}",
    "unknown_topic": "the topic's last level is not start, step or end (a typo such as "
    "steps); reported on {prefix}/_errors",
    "invalid": "the payload does not match its schema",
    "bad_image": "an image is not inline base64 PNG/JPEG/GIF/WebP, or is not allowed",
    "no_start": "steps came for a run whose start never came",
    "duplicate_start": "a second, different start for a live run",
    "run_ended": "an event came after the run's end",
    "unknown_run": "an end for a run the monitor does not know",
    "step_gap": "steps never arrived; later steps were scored without them",
    "index_too_far": "a step index too far ahead of the next expected step",
    "conflict": "a step re-sent under an index already taken, with different content; the "
    "first one stays",
    "too_many_held": "too many steps waiting for their start or for missing steps",
    "run_rejected": "a start the monitor cannot use",
    "group_refused": "the start may not join the group it names (no valid group auth, other "
    "group settings, a group "
    "limit); the run is scored on its own, in no group",
    "group_split": "the group's name is in use by runs of another task, rubric or group "
    "settings; the run ranks with "
    "the runs like it in {group}~{key}",
    "retained": "an input came with the MQTT retain flag (a stored copy replayed on every "
    "subscription); ignored",
}
"""Why the monitor refused (or could not fully use) an input event: the `reason` of an error
message."""

NOTICES: Mapping[str, str] = {
    "evicted": "the monitor follows at most --max-runs runs; the run idle the longest was dropped",
    "scoring_failed": FAILURES["scoring_failed"],
}
"""Errors that are the monitor's own doing, not the harness's: published like refusals, not
counted as invalid."""

ERROR_REASONS: tuple[str, ...] = tuple(dict.fromkeys([*REFUSALS, *NOTICES]))
"""Every `reason` an error message can carry."""


def finite(x: float | None) -> float | None:
    """A number JSON can carry: NaN and infinities become None ("no value", never a made-up one)."""
    return x if x is None or math.isfinite(x) else None


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens spent on a judge call (or summed over many); `input_tokens` includes the cached ones.

    Every backend reports it so: OpenAI's `prompt_tokens` and Gemini's `prompt_token_count` include
    the tokens served from the provider's cache, and the local judge counts its reused KV prefix in
    both.
    """

    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.cached_input_tokens + other.cached_input_tokens,
            self.output_tokens + other.output_tokens,
        )

    def most(self, other: Usage) -> Usage:
        """Each kind's larger count of the two."""
        return Usage(
            max(self.input_tokens, other.input_tokens),
            max(self.cached_input_tokens, other.cached_input_tokens),
            max(self.output_tokens, other.output_tokens),
        )


NO_USAGE = Usage()
"""No tokens spent (immutable: one instance serves every result that spent none)."""

_PER_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class Prices:
    """What the judge's tokens cost, in USD per million tokens: `Prices(input=2.5, output=10.0,
    cached_input=1.25)`.

    `input` is the price of input tokens not served from the provider's cache; `cached_input` the
    price of those that were, and None bills them as ordinary input (an upper bound where the
    provider discounts them). Negative or non-finite prices are refused.
    """

    input: float
    output: float
    cached_input: float | None = None

    def __post_init__(self) -> None:
        for name in ("input", "output", "cached_input"):
            value = getattr(self, name)
            if value is None and name == "cached_input":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"Prices {name}={value!r}; use a finite number of USD per million tokens, "
                    "0 or more"
                    + (
                        " (or None: cached input is billed as input)"
                        if name == "cached_input"
                        else ""
                    )
                )

    def cost(self, usage: Usage) -> float:
        """The cost of `usage` in USD, computed once and exactly from the token counts (then rounded
        to a float).

        The prices are read as the decimals they are written as (2.5, 0.15), so a figure such as
        1234 input tokens at 0.15 is 0.0001851, not a sum of rounded per-call costs.
        """
        cached = min(usage.cached_input_tokens, usage.input_tokens)
        cached_price = self.input if self.cached_input is None else self.cached_input
        total = (
            (usage.input_tokens - cached) * _decimal(self.input)
            + cached * _decimal(cached_price)
            + usage.output_tokens * _decimal(self.output)
        )
        return float(total / _PER_TOKENS)


def _decimal(price: float) -> Fraction:
    # The shortest repr of a float is the decimal the user wrote: 0.15, not the binary
    # 0.1499999999999999944..
    return Fraction(repr(float(price)))


class DecisionJSON(TypedDict):
    """The JSON form of a Decision."""

    signal: Signal
    reason: str
    step: int
    score: float | None
    best_step: int | None
    best_score: float | None
    changed: bool
    abort_below: float | None
    calibration: str | None
    pruned: bool
    leader: str | None
    stop_kind: StopKind | None


@dataclass(frozen=True, slots=True)
class Decision:
    """The policy's verdict after a scored step; `changed` says it differs from the one before."""

    signal: Signal
    reason: str
    step: int
    score: float | None
    best_step: int | None
    best_score: float | None
    changed: bool
    abort_below: float | None = None
    """The abort threshold in force for this decision (None: no abort rule, or not calibrated
    yet)."""
    calibration: str | None = None
    """For `abort_below="auto"`: where the threshold came from, or why there is none yet."""
    pruned: bool = False
    """An abort decided by the group policy: the run fell behind its siblings (see
    `agent_monitor.groups`)."""
    leader: str | None = None
    """For a pruned run: the group's leading run at the time."""

    @property
    def stop_kind(self) -> StopKind | None:
        """ "judged" for an abort (the policy decides only on scores: a judge failure keeps the
        signal), else None.

        The daemon fails open, so a signal is never an infra stop; reward answers say "infra" for a
        rollout the judge or the plumbing could not score (docs/rl.md).
        """
        return "judged" if self.signal == "abort" else None

    def to_json(self) -> DecisionJSON:
        """The JSON form."""
        return {
            "signal": self.signal,
            "reason": self.reason,
            "step": self.step,
            "score": finite(self.score),
            "best_step": self.best_step,
            "best_score": finite(self.best_score),
            "changed": self.changed,
            "abort_below": finite(self.abort_below),
            "calibration": self.calibration,
            "pruned": self.pruned,
            "leader": self.leader,
            "stop_kind": self.stop_kind,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Decision:
        """The Decision a `to_json` form describes."""
        return cls(
            signal=data["signal"],
            reason=data["reason"],
            step=int(data["step"]),
            score=data.get("score"),
            best_step=data.get("best_step"),
            best_score=data.get("best_score"),
            changed=bool(data.get("changed", False)),
            abort_below=data.get("abort_below"),
            calibration=data.get("calibration"),
            pruned=bool(data.get("pruned", False)),
            leader=data.get("leader"),
        )


class CriterionJSON(TypedDict):
    """The JSON form of one criterion's part of a score."""

    score: float
    weight: float
    uncertainty: float
    mass: float
    source: str
    confidence: float
    detail: str
    dispersion: float
    spread: float
    repeats: int
    sampling_error: float
    letters: dict[str, float]


class TokensJSON(TypedDict):
    """Judge tokens spent on one scoring."""

    input: int
    cached_input: int
    output: int


class TotalsJSON(TypedDict):
    """The run's judge tokens over every scoring so far, and their cost (None without prices)."""

    input: int
    cached_input: int
    output: int
    cost: float | None


class ProgressJSON(TypedDict):
    """The JSON form of a Progress: the MQTT progress message, a stored score, a `score --json`
    line."""

    run_id: str | None
    step: int
    score: float | None
    delta: float | None
    uncertainty: float | None
    criteria: dict[str, CriterionJSON]
    ok: bool
    error: str | None
    reason: str | None
    mass: float | None
    dispersion: float | None
    spread: float | None
    judge: str
    model: str
    rubric: str
    coalesced: int
    latency_s: float
    tokens: TokensJSON
    totals: TotalsJSON
    calls: int
    calls_saved: int
    images_dropped: int
    silent: list[str]
    signal: Signal | None
    decision: DecisionJSON | None
    degraded: bool
    scheduled: str | None
    skipped: str | None
    final: NotRequired[bool]
    """Only on a run's final result, sent once more at its end when its rubric has pass/review
    thresholds."""
    verdict: NotRequired[Literal["pass", "review", "fail"] | None]
    """With `final`: the rubric's verdict on the score."""


class ScoringFailed(ValueError):
    """A failed scoring read as a number (`float(p)`, `p < 0.05`): it has no score; `reason` and
    `error` say why."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.reason = progress.reason or "scoring_failed"
        super().__init__(
            f"step {progress.step} has no score ({self.reason}: {progress.error}); a failed "
            "scoring is never a "
            "number: check `ok` (or catch ScoringFailed) before reading it as one"
        )


@dataclass(frozen=True, slots=True)
class Progress:
    """The score of a trajectory prefix, or why there is none.

    `score` is None exactly when `ok` is False; `error` then says why and `reason` gives a short
    code (see `FAILURES`: timeout, rate_limited, no_letter, low_mass, ..). `criteria` holds the
    criteria that were scored, even on a partial failure. `signal` is the run policy's decision
    after this result, when the run has a policy (or a group). `delta` is the score's change since
    the run's previous scored step (None at the first or when either is None). `images_dropped`
    counts the image parts the judge got as text placeholders instead of pixels, over this result's
    judge calls (a text-only judge, or a model that refused images). `usage` is what this scoring's
    judge calls spent; `totals` the run's running totals: every judge token spent on the run by
    every scoring recorded up to and including this one (failed, coalesced and out-of-order ones
    too), and `cost` their price in USD at the tracker's `Prices` (None without).
    """

    step: int
    score: float | None
    uncertainty: float | None
    criteria: Mapping[str, CriterionScore]
    ok: bool
    error: str | None = None
    reason: str | None = None
    mass: float | None = None
    dispersion: float | None = None
    spread: float | None = None
    judge: str = ""
    model: str = ""
    rubric: str = ""
    coalesced: int = 1
    latency_s: float = 0.0
    usage: Usage = field(default_factory=Usage)
    totals: Usage = field(default_factory=Usage)
    cost: float | None = None
    calls: int = 0
    calls_saved: int = 0
    images_dropped: int = 0
    silent: tuple[str, ...] = ()
    signal: Decision | None = None
    run_id: str | None = None
    degraded: bool = False
    delta: float | None = None
    """The score's change since the run's previous scored step (None at the first, or when either
    has no score): a shaped reward an RL trainer can use without keeping state. Per scoring: under
    the adaptive schedule the previous scored step may be several steps back (`coalesced` says how
    many steps this one covers)."""
    scheduled: str | None = None
    """Under the adaptive schedule: why this step was scored ("near abort_below 0.4", "max_gap
    4", "end", ...)."""
    skipped: str | None = None
    """Why the `coalesced - 1` steps folded into this one were not scored alone, when the schedule
    chose it ("far from thresholds"); None: they only arrived while a scoring ran (coalescing)."""

    def __float__(self) -> float:
        """The score, as the reference library's `update` returns it; a failed scoring raises
        with its reason."""
        if self.score is None:
            raise ScoringFailed(self)
        return self.score

    # Compared with numbers as a float is (`if tracker.update(step) < 0.05`); a failed scoring
    # raises, never compares.
    def __lt__(self, other: float) -> bool:
        return float(self) < other

    def __le__(self, other: float) -> bool:
        return float(self) <= other

    def __gt__(self, other: float) -> bool:
        return float(self) > other

    def __ge__(self, other: float) -> bool:
        return float(self) >= other

    def __format__(self, spec: str) -> str:
        # f"{p:.3f}" formats the score (a failed one raises); the bare f"{p}" stays the dataclass
        # repr.
        return format(float(self), spec) if spec else repr(self)

    def to_json(self) -> ProgressJSON:
        """The one JSON form (the MQTT progress message; what the run store keeps)."""
        u, t = self.usage, self.totals
        out: ProgressJSON = {
            "run_id": self.run_id,
            "step": self.step,
            "score": finite(self.score),
            "delta": finite(self.delta),
            "uncertainty": finite(self.uncertainty),
            "criteria": {n: _criterion_json(c) for n, c in self.criteria.items()},
            "ok": self.ok,
            "error": self.error,
            "reason": self.reason,
            "mass": finite(self.mass),
            "dispersion": finite(self.dispersion),
            "spread": finite(self.spread),
            "judge": self.judge,
            "model": self.model,
            "rubric": self.rubric,
            "coalesced": self.coalesced,
            "latency_s": self.latency_s if math.isfinite(self.latency_s) else 0.0,
            "tokens": {
                "input": u.input_tokens,
                "cached_input": u.cached_input_tokens,
                "output": u.output_tokens,
            },
            "totals": {
                "input": t.input_tokens,
                "cached_input": t.cached_input_tokens,
                "output": t.output_tokens,
                "cost": finite(self.cost),
            },
            "calls": self.calls,
            "calls_saved": self.calls_saved,
            "images_dropped": self.images_dropped,
            "silent": list(self.silent),
            "signal": self.signal.signal if self.signal else None,
            "decision": self.signal.to_json() if self.signal else None,
            "degraded": self.degraded,
            "scheduled": self.scheduled,
            "skipped": self.skipped,
        }
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Progress:
        """The Progress a `to_json` form describes (the exact inverse; missing optional keys take
        defaults)."""
        tokens = data.get("tokens") or {}
        totals = data.get("totals") or {}
        decision = data.get("decision")
        return cls(
            step=int(data["step"]),
            score=data.get("score"),
            uncertainty=data.get("uncertainty"),
            criteria={n: _criterion(n, c) for n, c in (data.get("criteria") or {}).items()},
            ok=bool(data.get("ok")),
            error=data.get("error"),
            reason=data.get("reason"),
            mass=data.get("mass"),
            dispersion=data.get("dispersion"),
            spread=data.get("spread"),
            judge=data.get("judge") or "",
            model=data.get("model") or "",
            rubric=data.get("rubric") or "",
            coalesced=int(data.get("coalesced") or 1),
            latency_s=float(data.get("latency_s") or 0.0),
            usage=_usage(tokens),
            totals=_usage(totals),
            cost=totals.get("cost"),
            calls=int(data.get("calls") or 0),
            calls_saved=int(data.get("calls_saved") or 0),
            images_dropped=int(data.get("images_dropped") or 0),
            silent=tuple(data.get("silent") or ()),
            signal=Decision.from_json(decision) if decision else None,
            run_id=data.get("run_id"),
            degraded=bool(data.get("degraded", False)),
            delta=data.get("delta"),
            scheduled=data.get("scheduled"),
            skipped=data.get("skipped"),
        )


def _usage(tokens: Mapping[str, Any]) -> Usage:
    return Usage(
        int(tokens.get("input", 0)),
        int(tokens.get("cached_input", 0)),
        int(tokens.get("output", 0)),
    )


def run_totals(results: Iterable[Progress]) -> Usage:
    """A run's totals as its stored results tell them: the largest any carries, or their own usage
    summed if larger.

    Totals only grow, so the largest is the newest; the sum covers results stored before totals
    existed.
    """
    carried, summed = Usage(), Usage()
    for p in results:
        carried, summed = carried.most(p.totals), summed + p.usage
    return carried.most(summed)


def _criterion_json(c: CriterionScore) -> CriterionJSON:
    return {
        "score": c.score,
        "weight": c.weight,
        "uncertainty": c.uncertainty,
        "mass": c.mass,
        "source": c.source,
        "confidence": c.confidence,
        "detail": c.detail,
        "dispersion": c.dispersion,
        "spread": c.spread,
        "repeats": c.repeats,
        "sampling_error": c.sampling_error,
        "letters": dict(c.letters),
    }


def _criterion(name: str, c: Mapping[str, Any]) -> CriterionScore:
    return CriterionScore(
        name=name,
        weight=float(c["weight"]),
        score=float(c["score"]),
        dispersion=float(c.get("dispersion", 0.0)),
        spread=float(c.get("spread", 0.0)),
        uncertainty=float(c["uncertainty"]),
        mass=float(c["mass"]),
        repeats=int(c.get("repeats", 0)),
        letters=dict(c.get("letters") or {}),
        source=str(c.get("source", "llm")),
        sampling_error=float(c.get("sampling_error", 0.0)),
        confidence=float(c.get("confidence", 1.0)),
        detail=str(c.get("detail", "")),
    )


__all__ = [
    "ERROR_REASONS",
    "FAILURES",
    "NOTICES",
    "OUTAGE_REASONS",
    "REFUSALS",
    "SIGNALS",
    "CriterionJSON",
    "Decision",
    "DecisionJSON",
    "Prices",
    "Progress",
    "ProgressJSON",
    "ScoringFailed",
    "Signal",
    "StopKind",
    "TokensJSON",
    "TotalsJSON",
    "Usage",
    "finite",
    "run_totals",
]
