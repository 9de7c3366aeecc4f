"""Output payloads (progress, signal, error): validators of the JSON form `agent_monitor.progress`
defines.

The form itself is written once, in `Progress.to_json` / `Decision.to_json`; these models add
nothing to it and drop nothing from it (a test holds them to that), so a harness can validate
what it receives and the JSON Schemas can be generated. Unknown fields are ignored: a client
keeps working with a newer monitor.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..policy import Policy
from ..progress import ERROR_REASONS, Decision, Progress, Signal
from ._common import GroupName, RankedGroup, RunId


class _Out(BaseModel):
    """Base of output payloads: unknown fields ignored (clients tolerate newer monitors); NaN is
    sent as null."""

    model_config = ConfigDict(
        extra="ignore", frozen=True, ser_json_inf_nan="null", protected_namespaces=()
    )

    def to_payload(self) -> bytes:
        """The MQTT payload: compact JSON, UTF-8."""
        return self.model_dump_json().encode()


class Tokens(_Out):
    """Judge tokens spent on one scoring."""

    input: int = 0
    cached_input: int = 0
    output: int = 0


class Totals(_Out):
    """The run's judge tokens over every scoring so far (input includes cached_input), and what
    they cost."""

    input: int = 0
    cached_input: int = 0
    output: int = 0
    cost: float | None = Field(
        default=None,
        description="USD at the monitor's prices (--price-*), from these "
        "totals; null without prices.",
    )


class CriterionOut(_Out):
    """One criterion's part of a score."""

    score: float
    weight: float
    uncertainty: float
    mass: float
    source: str = "llm"
    confidence: float = 1.0
    detail: str = ""
    dispersion: float = 0.0
    spread: float = 0.0
    repeats: int = 0
    sampling_error: float = 0.0
    letters: dict[str, float] = Field(
        default_factory=dict, description="Pooled letter probabilities."
    )


class DecisionOut(_Out):
    """The run policy's verdict after this score."""

    signal: Signal
    reason: str
    step: int
    score: float | None = None
    best_step: int | None = None
    best_score: float | None = None
    changed: bool = False
    abort_below: float | None = Field(
        default=None,
        description="The abort threshold in force (null: no abort rule, or not calibrated yet).",
    )
    calibration: str | None = Field(
        default=None,
        description='With abort_below "auto": where the threshold came from, '
        "or why there is none yet.",
    )
    pruned: bool = Field(
        default=False,
        description="An abort decided by the group policy: the run fell behind its siblings.",
    )
    leader: str | None = Field(
        default=None, description="For a pruned run: the group's leading run at the time."
    )
    stop_kind: Literal["judged", "infra"] | None = Field(
        default=None,
        description='"judged" for an abort (decided on the scores); null when '
        "the run is not stopped.",
    )


class ProgressOut(_Out):
    """`{prefix}/{run_id}/progress`: the score of the run's newest scored prefix, or why there is
    none."""

    run_id: RunId
    step: int
    score: float | None = Field(description="Null when the judge failed; never a made-up default.")
    delta: float | None = Field(
        default=None,
        description="The score's change since the run's previous scored step (null at the "
        "first, or when either "
        "score is null): a shaped reward that needs no state.",
    )
    uncertainty: float | None = None
    criteria: dict[str, CriterionOut] = Field(default_factory=dict)
    ok: bool
    error: str | None = None
    reason: str | None = Field(
        default=None, description="Why there is no score: timeout, low_mass, ..."
    )
    mass: float | None = None
    dispersion: float | None = None
    spread: float | None = None
    judge: str = ""
    model: str = ""
    rubric: str = Field(default="", description="Hash of the rubric that produced the score.")
    coalesced: int = Field(default=1, description="Steps folded into this score.")
    latency_s: float = 0.0
    tokens: Tokens = Field(default_factory=Tokens, description="Judge tokens this scoring spent.")
    totals: Totals = Field(
        default_factory=Totals,
        description="The run's running totals: every judge token its scorings spent so far "
        "(failed, coalesced and "
        "superseded scorings included; continued across monitor restarts), with their cost.",
    )
    calls: int = Field(default=0, description="Judge calls made for this score.")
    calls_saved: int = Field(
        default=0, description="Judge calls not made because confident rules answered."
    )
    images_dropped: int = Field(
        default=0,
        description="Image parts the judge got as text placeholders instead of pixels (a "
        "text-only judge, "
        "or a model that refused images), over this score's judge calls.",
    )
    silent: list[str] = Field(default_factory=list)
    signal: Signal | None = None
    decision: DecisionOut | None = None
    degraded: bool = Field(
        default=False, description="The judge is failing and the monitor is backing off."
    )
    final: bool = Field(
        default=False,
        description="The run's final result, sent once more when the run ends (only when its "
        "rubric has "
        "pass/review thresholds and the result has a score), with its verdict.",
    )
    verdict: Literal["pass", "review", "fail"] | None = Field(
        default=None,
        description="On the final result: the rubric's verdict on its score (its pass and "
        "review thresholds).",
    )
    scheduled: str | None = Field(
        default=None,
        description='Under policy schedule "adaptive": why this step was scored ("near '
        'abort_below 0.4", '
        '"max_gap 4", "end", "first", "after a failure"); null under "every".',
    )
    skipped: str | None = Field(
        default=None,
        description="Why the coalesced - 1 steps folded into this score were not scored "
        "alone, when the adaptive "
        'schedule chose it ("far from thresholds"); null when they only arrived during a '
        "scoring. With serve "
        "--heartbeat, a step the schedule skips gets the run's last score again with three "
        "more keys: "
        '"heartbeat": true, "age_steps" (steps since it was made) and "age_s" (seconds since '
        "it was published); "
        "a heartbeat is not a new scoring.",
    )

    @classmethod
    def from_progress(cls, progress: Progress, *, run_id: str | None = None) -> ProgressOut:
        """The progress message of a result (`run_id` for a result that does not carry its own)."""
        data: dict[str, Any] = dict(progress.to_json())
        if run_id is not None:
            data["run_id"] = run_id
        return cls.model_validate(data)

    def to_progress(self) -> Progress:
        """The result this message carries."""
        return Progress.from_json(self.model_dump(mode="json"))


class SignalOut(_Out):
    """`{prefix}/{run_id}/signal` (retained while the run lives): what the harness should do now."""

    run_id: RunId
    signal: Signal
    reason: str
    step: int
    score: float | None = None
    best_step: int | None = Field(
        default=None, description="The step where progress peaked (roll back there)."
    )
    best_score: float | None = None
    changed: bool = True
    abort_below: float | None = Field(
        default=None,
        description="The abort threshold in force (null: no abort rule, or not calibrated yet).",
    )
    calibration: str | None = Field(
        default=None,
        description='With abort_below "auto": where the threshold came from, '
        "or why there is none yet.",
    )
    pruned: bool = Field(
        default=False,
        description="An abort decided by the group policy: the run fell behind its siblings.",
    )
    leader: str | None = Field(
        default=None, description="For a pruned run: the group's leading run at the time."
    )
    stop_kind: Literal["judged", "infra"] | None = Field(
        default=None,
        description='Why the run is stopped: "judged" (an abort decided on the scores); '
        '"infra" (the judge or the '
        "plumbing failed: drop the rollout, do not penalise it). Null when it is not stopped.",
    )
    policy: dict[str, bool | float | int | str | None] = Field(default_factory=dict)

    @classmethod
    def from_decision(cls, run_id: str, decision: Decision, policy: Policy) -> SignalOut:
        """The signal message for a policy decision."""
        return cls.model_validate(signal_json(run_id, decision, policy))


def signal_json(run_id: str, decision: Decision, policy: Policy) -> dict[str, Any]:
    """The signal message's JSON: the decision's one JSON form, with the run and the policy in
    force."""
    return {**decision.to_json(), "run_id": run_id, "policy": policy.as_dict()}


class RankedRunOut(_Out):
    """One run in a group's ranking."""

    run_id: RunId
    rank: int = Field(ge=1, description="1 = best.")
    score: float | None = Field(
        default=None, description="The run's latest counted score (null: none yet)."
    )
    uncertainty: float | None = None
    step: int | None = Field(default=None, description="The step that score is for.")
    state: Literal["live", "pruned", "ended"]
    outcome: str | None = Field(
        default=None, description="The run's end outcome, once it ended with one."
    )


class UniformOut(_Out):
    """A group flagged early: the calibrated calls of all its runs say they will all fail (or all
    pass)."""

    call: Literal["all_fail", "all_pass"] = Field(
        description="all_fail / all_pass: no variance in outcome, so no gradient (DAPO "
        "dynamic sampling drops it)."
    )
    confidence: float = Field(
        ge=0.0,
        le=1.0,
        description="1 - N x the largest member p-value: a lower bound on P(the call is right).",
    )
    at_step: int = Field(
        description="The newest step any member had reached when the group got this call."
    )
    runs: int = Field(ge=1, description="The members the call covers.")


class RankingOut(_Out):
    """`{prefix}/_groups/{group}/ranking` (retained): a group's sibling runs, best first; empty when
    it is cleared.

    Published when the order or a state changes; cleared when the group's last run has ended and the
    grace period passed. Runs not pruned come before pruned ones; within each, higher score first.
    """

    group: RankedGroup = Field(
        description="The group: its name, or `{group}~{key}` for the runs of another task, "
        "rubric or group settings "
        "that named it while its name was in use (docs/best-of-n.md, Who ranks with whom)."
    )
    leader: RunId | None = Field(description="The rank-1 run.")
    runs: list[RankedRunOut] = Field(description="Sorted by rank.")
    uniform: UniformOut | None = Field(
        default=None,
        description="Present while the group is flagged early as all_fail or all_pass "
        "(docs/groups.md).",
    )


class StateOut(_Out):
    """`{prefix}/{run_id}/state` (retained while the run lives): the run is live on a monitor.

    Published when the monitor opens the run (a refused start gets none) and cleared (an empty
    retained payload) when the run leaves its live set, so a viewer that subscribes late (`top`)
    lists every live run at once.
    """

    run_id: RunId
    state: Literal["live"] = "live"
    task: str = Field(default="", description="The run's task, its first 200 characters.")
    group: GroupName | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    started_at: float | None = Field(
        default=None, description="The start's own started_at, if it gave one."
    )


class ErrorOut(_Out):
    """`{prefix}/{run_id}/error` or `{prefix}/_errors`: an event that was refused, and why."""

    run_id: RunId | None = None
    topic: str = Field(description="The topic the refused event came on.")
    reason: str = Field(
        pattern=r"^[a-z][a-z0-9_]{0,63}$",
        description=f"Short code: one of {', '.join(ERROR_REASONS)} (newer monitors may add more).",
    )
    error: str = Field(description="What was wrong and what to do.")
