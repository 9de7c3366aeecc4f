"""Group policy: sibling runs of one task ranked as they run, laggards pruned (live best-of-N). Pure
logic, no I/O.

A group is the runs that share a `start.group` (or a `GroupTracker`). Its settings are the run
`Policy`'s: `keep_top`, `prune_margin`, `min_steps`, `patience`, `max_uncertainty` (and `compare`,
which the daemon and the hook act on; this module only says when pointwise scores cannot separate
the leaders: `GroupState.tied_leaders`).

The rule. A live run is *behind* on one of its scored steps when, at or after `min_steps`, with an
uncertainty no larger than `max_uncertainty`, its score is more than `prune_margin` below the
`keep_top`-th best score among its live siblings (runs with no score yet do not count), and that gap
exceeds the two runs' combined uncertainty (root sum of squares; a missing uncertainty counts 0).
It is pruned after `patience` such steps in a row; a scored step that is not behind resets the
count. A failed scoring, a too-uncertain one, or one before `min_steps` counts nothing and breaks
nothing (fail-open: a judge outage prunes nothing). Since a run is compared with its `keep_top`-th
best *live sibling*, a prune always leaves at least `keep_top` live runs. A prune is final.

The ranking: runs not pruned (live or ended) before pruned ones; within each, higher score first,
runs with no score last, then the order they joined. Rank 1 is the `leader`.

API (stable; the daemon, `GroupTracker` and `eval --groups` use it):

- `GroupState(group, policy, max_runs=None)`: one group's memory.
- `.join(run_id) -> GroupUpdate`: a run joins (a live member again: no change; an ended or pruned
  one joining again is a new run under that id; `GroupFull` past `max_runs`).
- `.observe(run_id, step=, score=, uncertainty=, ok=, decide=True) -> GroupUpdate` (or
  `.observe_progress(run_id, p)`): fold one scoring of that run, in the run's step order;
  `update.prunes` lists the runs pruned now (`decide=False`: count, never prune; for rebuilding).
- `.prune(run_id)`: mark a run pruned as decided before (a restart restoring its stored abort);
  `.restore(ranked_run)`: take a pruned or ended run from a published ranking (a restart).
- `.end(run_id, outcome=None) -> GroupUpdate`: the run ended (its rank stays, state "ended").
- `.set_order(run_ids)`: a pairwise verdict on the order of some runs (e.g. the pivot tournament's),
  used as the tie-break among runs whose pointwise scores cannot be separated; cleared by
  `set_order(())`.
- `.ranking() -> RankingJSON`, `.ranked() -> list[Member]`, `.leader`, `.live`, `.members`, `.done`.
- `GroupUpdate.changed`: the order or a state changed (publish the ranking now).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

from .policy import Policy
from .progress import Decision, Progress, finite

RunState = Literal["live", "pruned", "ended"]
"""A sibling's state in its group."""

GROUP_NAME_MAX = 128
"""The longest group name (characters): a name becomes a topic level and a metric label value."""


GROUP_SETTINGS = (
    "keep_top",
    "prune_margin",
    "min_steps",
    "patience",
    "max_uncertainty",
    "compare",
    "uniform_confidence",
)
"""The policy settings a group acts on: one value per group, fixed by its first run (or the
monitor's flags)."""


def group_settings(policy: Policy) -> dict[str, Any]:
    """The group's part of a run policy."""
    return {k: getattr(policy, k) for k in GROUP_SETTINGS}


def group_mac(secret: str | bytes, run_id: str, started_at: float | None, group: str) -> str:
    """The hex HMAC-SHA256 a harness puts in `start.auth` to join `group` when the monitor has a
    group secret.

    Signed: `"{run_id}\n{started_at:.3f}\n{group}"` (started_at empty when the start gives none).
    """
    key = secret.encode() if isinstance(secret, str) else secret
    started = "" if started_at is None else f"{float(started_at):.3f}"
    return hmac.new(key, f"{run_id}\n{started}\n{group}".encode(), hashlib.sha256).hexdigest()


class GroupFull(ValueError):
    """A run cannot join: the group already has its maximum number of runs."""


class RankedRunJSON(TypedDict):
    """One run in a group's ranking."""

    run_id: str
    rank: int
    score: float | None
    uncertainty: float | None
    step: int | None
    state: RunState
    outcome: NotRequired[str]


UniformCall = Literal["all_fail", "all_pass"]
"""A group's early dynamic-sampling call: every member will fail, or every member will pass."""


class UniformJSON(TypedDict):
    """A group flagged early: its runs' outcomes will be all alike (no variance, no gradient),
    with this confidence."""

    call: UniformCall
    confidence: float
    """1 - N * (the largest member p-value): the rule's lower bound on P(the call is right); see
    docs/groups.md."""
    at_step: int
    """The newest step any member had reached when the group first got this call."""
    runs: int
    """The members the call covers (a run joining later withdraws it until that run is called
    too)."""


class RankingJSON(TypedDict):
    """The JSON form of a group's ranking: the retained `{prefix}/_groups/{group}/ranking`
    message."""

    group: str
    leader: str | None
    runs: list[RankedRunJSON]
    uniform: NotRequired[UniformJSON]


@dataclass(slots=True)
class Member:
    """One sibling: its state, its latest counted scoring and how many scored steps in a row it
    has been behind."""

    run_id: str
    order: int
    state: RunState = "live"
    score: float | None = None
    uncertainty: float | None = None
    step: int | None = None
    outcome: str | None = None
    behind: int = 0
    last_step: int = -1
    """The newest step observed (scored or not): older results do not move the group backwards."""
    fail_p: float = 1.0
    """The conformal p-value of "this run will fail" (small: the calibrated rule calls it a
    failure; 1: no call)."""
    pass_p: float = 1.0
    """The conformal p-value of "this run will pass"."""


@dataclass(frozen=True, slots=True)
class Prune:
    """A run the group policy pruned, and why (the abort signal's `reason` and `leader`)."""

    run_id: str
    step: int
    score: float
    leader: str | None
    reason: str
    threshold_run: str
    threshold_score: float

    def decision(self, p: Progress) -> Decision:
        """The abort this prune makes of the result `p` (marked pruned; the run's own decision's
        context kept)."""
        d = p.signal
        return Decision(
            signal="abort",
            reason=self.reason,
            step=p.step,
            score=p.score,
            best_step=d.best_step if d else None,
            best_score=d.best_score if d else None,
            changed=True,
            abort_below=d.abort_below if d else None,
            calibration=d.calibration if d else None,
            pruned=True,
            leader=self.leader,
        )


@dataclass(frozen=True, slots=True)
class GroupUpdate:
    """What one event did to a group: the runs pruned now, and whether the published ranking must
    change."""

    changed: bool
    prunes: tuple[Prune, ...] = ()
    ranking: RankingJSON | None = None


def combined_uncertainty(a: float | None, b: float | None) -> float:
    """Two independent scores' combined uncertainty: the root sum of squares (a missing one
    counts 0)."""
    return math.hypot(a or 0.0, b or 0.0)


@dataclass(slots=True)
class GroupState:
    """One group of sibling runs: their latest scores, states and the prune decisions (see the
    module docs)."""

    group: str
    policy: Policy
    max_runs: int | None = None
    _members: dict[str, Member] = field(default_factory=dict)
    _pairwise: dict[str, int] = field(default_factory=dict)
    _published: tuple[Any, ...] | None = None
    _uniform: UniformJSON | None = None
    contradicted: UniformCall | None = None
    """A call an outcome proved wrong (a success in an "all_fail" group, a failure in an
    "all_pass" one)."""

    @property
    def members(self) -> Mapping[str, Member]:
        """Every run that joined, by id."""
        return self._members

    @property
    def live(self) -> list[str]:
        """The live runs' ids, in join order."""
        return [m.run_id for m in self._members.values() if m.state == "live"]

    @property
    def done(self) -> bool:
        """Every run that joined has ended or been pruned (an empty group is done too)."""
        return all(m.state != "live" for m in self._members.values())

    @property
    def leader(self) -> str | None:
        """The rank-1 run's id (None for an empty group)."""
        ranked = self.ranked()
        return ranked[0].run_id if ranked else None

    def join(self, run_id: str) -> GroupUpdate:
        """A run joins the group (a live one again: nothing changes); `GroupFull` when it has
        `max_runs` runs already.

        A run id that ended or was pruned and joins again is a new run under the same id: it starts
        afresh.
        """
        old = self._members.get(run_id)
        if old is not None and old.state != "live":
            self._members[run_id] = Member(run_id=run_id, order=old.order)
        if run_id not in self._members:
            if self.max_runs is not None and len(self._members) >= self.max_runs:
                raise GroupFull(
                    f"group {self.group!r} already has {len(self._members)} runs (the most "
                    "allowed); "
                    "start the run in another group or raise the limit"
                )
            self._members[run_id] = Member(run_id=run_id, order=len(self._members))
        return self._update()

    def observe_progress(self, run_id: str, p: Progress, *, decide: bool = True) -> GroupUpdate:
        """Fold one of the run's results (see `observe`)."""
        return self.observe(
            run_id, step=p.step, score=p.score, uncertainty=p.uncertainty, ok=p.ok, decide=decide
        )

    def observe(
        self,
        run_id: str,
        *,
        step: int,
        score: float | None,
        uncertainty: float | None = None,
        ok: bool = True,
        decide: bool = True,
    ) -> GroupUpdate:
        """Fold one scoring of a member run (in that run's step order) and decide whether it is
        pruned now.

        `decide=False` (rebuilding a group after a restart) counts streaks but prunes nothing: a
        prune is a decision taken once, live, and restored as it was (`prune`).
        """
        m = self._member(run_id)
        if m.state != "live" or step <= m.last_step:
            # Final states stay; an older result (a slow concurrent scoring) does not move the group
            # backwards.
            return self._update()
        m.last_step = step
        if not ok or score is None or not math.isfinite(score):
            return self._update()  # fail-open: a failed scoring counts nothing and breaks nothing
        m.score, m.uncertainty, m.step = score, finite(uncertainty), step
        pol = self.policy
        prunes: tuple[Prune, ...] = ()
        certain = m.uncertainty is None or m.uncertainty <= pol.max_uncertainty
        if pol.prune_margin is not None and step >= pol.min_steps and certain:
            kth = self._kth_sibling(m)
            gap = None if kth is None else (kth.score or 0.0) - score
            if (
                kth is not None
                and gap is not None
                and gap > pol.prune_margin
                and gap > combined_uncertainty(m.uncertainty, kth.uncertainty)
            ):
                m.behind += 1
            else:
                m.behind = 0
            if decide and kth is not None and m.behind >= pol.patience:
                m.state = "pruned"
                leader = self.leader
                reason = (
                    f"pruned: score {score:.2f} stayed more than {pol.prune_margin:g} below "
                    f"the {_nth(pol.keep_top)} "
                    f"best live sibling ({kth.run_id}: {kth.score:.2f}) for {pol.patience} "
                    "scored steps"
                )
                prunes = (
                    Prune(
                        run_id=run_id,
                        step=step,
                        score=score,
                        leader=leader,
                        reason=reason,
                        threshold_run=kth.run_id,
                        threshold_score=kth.score or 0.0,
                    ),
                )
        return self._update(prunes)

    def end(self, run_id: str, outcome: str | None = None) -> GroupUpdate:
        """The run ended (a pruned run stays pruned; its outcome is kept either way)."""
        m = self._member(run_id)
        if outcome is not None:
            m.outcome = str(outcome)
            # A known outcome is certain: the member's call is settled (an unknown one, e.g. an
            # infra failure, settles nothing and keeps whatever the scores said).
            if m.outcome == "success":
                m.fail_p, m.pass_p = 1.0, 0.0
            elif m.outcome == "failure":
                m.fail_p, m.pass_p = 0.0, 1.0
        if m.state == "live":
            m.state = "ended"
        return self._update()

    @property
    def called(self) -> UniformJSON | None:
        """The early call in force (the ranking's `uniform`), as last updated; None: none."""
        return self._uniform

    def call(self, run_id: str, *, fail_p: float, pass_p: float) -> GroupUpdate:
        """Set a live member's calls: the p-values of "it will fail" and "it will pass" (see
        `agent_monitor.calibration`)."""
        m = self._member(run_id)
        if m.state == "live":
            m.fail_p, m.pass_p = _p(fail_p), _p(pass_p)
        return self._update()

    def uniform(self) -> UniformJSON | None:
        """The group's early call, if the policy's `uniform_confidence` is met (None: no call, or
        the flag is off).

        A group of N members is called all-fail when 1 - N * max(fail p-values) >=
        uniform_confidence (all-pass likewise): a union bound, valid however the members' outcomes
        depend on each other. A member with no call (no counted scores, a failing judge, an unknown
        end) has p = 1: no flag.
        """
        need = self.policy.uniform_confidence
        n = len(self._members)
        if need is None or n == 0:
            return None
        calls: tuple[tuple[UniformCall, list[float]], ...] = (
            ("all_fail", [m.fail_p for m in self._members.values()]),
            ("all_pass", [m.pass_p for m in self._members.values()]),
        )
        for call, ps in calls:
            confidence = 1.0 - n * max(ps)
            if confidence >= need:
                prev = self._uniform
                at = (
                    prev["at_step"]
                    if prev is not None and prev["call"] == call
                    else self._newest_step()
                )
                return {"call": call, "confidence": round(confidence, 6), "at_step": at, "runs": n}
        return None

    def prune(self, run_id: str, *, step: int | None = None) -> None:
        """Mark a run pruned without deciding (restoring a prune decided before a restart)."""
        m = self._member(run_id)
        if m.state == "live":
            m.state = "pruned"
        if step is not None:
            m.last_step = max(m.last_step, step)

    def restore(self, run: Mapping[str, Any]) -> None:
        """Take a run that is no longer live from a published ranking (`RankedRunJSON`); a member
        already here stays."""
        run_id = str(run["run_id"])
        state = run.get("state")
        if run_id in self._members or state not in ("pruned", "ended"):
            return
        step = run.get("step")
        self._members[run_id] = Member(
            run_id=run_id,
            order=len(self._members),
            state=state,
            score=finite(run.get("score")),
            uncertainty=finite(run.get("uncertainty")),
            step=step,
            outcome=run.get("outcome"),
            last_step=step if isinstance(step, int) else -1,
        )
        m = self._members[run_id]
        if m.outcome in ("success", "failure"):
            m.fail_p, m.pass_p = (1.0, 0.0) if m.outcome == "success" else (0.0, 1.0)

    def set_order(self, run_ids: Sequence[str]) -> GroupUpdate:
        """A pairwise order of some runs (best first): the tie-break among scores that cannot be
        separated."""
        self._pairwise = {r: i for i, r in enumerate(run_ids) if r in self._members}
        return self._update()

    def tied_leaders(self) -> list[str]:
        """The live runs whose scores are within their combined uncertainty of the best live run's
        (best first).

        With `policy.compare`, these are the candidates a pairwise comparison should order; fewer
        than two: pointwise scores separate the leaders. The best live run is the one with the
        highest score.
        """
        live = [m for m in self._pointwise() if m.state == "live" and m.score is not None]
        if not live:
            return []
        top = live[0]
        tied = [
            m
            for m in live
            if (top.score or 0.0) - (m.score or 0.0)
            <= combined_uncertainty(top.uncertainty, m.uncertainty)
        ]
        order = {m.run_id: i for i, m in enumerate(self.ranked())}
        return sorted((m.run_id for m in tied), key=order.__getitem__)

    def ranked(self) -> list[Member]:
        """The members, best first (see the module docs for the order; a pairwise order reorders
        tied leaders)."""
        base = self._pointwise()
        if not self._pairwise:
            return base
        live = [m for m in base if m.state == "live" and m.score is not None]
        if not live:
            return base
        top = live[0]
        tied = [
            i
            for i, m in enumerate(base)
            if m.state == "live"
            and m.score is not None
            and m.run_id in self._pairwise
            and (top.score or 0.0) - m.score <= combined_uncertainty(top.uncertainty, m.uncertainty)
        ]
        # The tied runs keep the places they hold, taken in the pairwise order.
        reordered = sorted((base[i] for i in tied), key=lambda m: self._pairwise[m.run_id])
        out = list(base)
        for i, m in zip(tied, reordered, strict=True):
            out[i] = m
        return out

    def _pointwise(self) -> list[Member]:
        def key(m: Member) -> tuple[bool, float, int]:
            return (m.state == "pruned", -m.score if m.score is not None else math.inf, m.order)

        return sorted(self._members.values(), key=key)

    def ranking(self) -> RankingJSON:
        """The ranking message (sorted by rank, 1 = best)."""
        runs: list[RankedRunJSON] = []
        for i, m in enumerate(self.ranked(), start=1):
            r: RankedRunJSON = {
                "run_id": m.run_id,
                "rank": i,
                "score": finite(m.score),
                "uncertainty": finite(m.uncertainty),
                "step": m.step,
                "state": m.state,
            }
            if m.outcome is not None:
                r["outcome"] = m.outcome
            runs.append(r)
        out: RankingJSON = {
            "group": self.group,
            "leader": runs[0]["run_id"] if runs else None,
            "runs": runs,
        }
        if self._uniform is not None:
            out["uniform"] = self._uniform
        return out

    # -- internals --

    def _member(self, run_id: str) -> Member:
        try:
            return self._members[run_id]
        except KeyError:
            raise KeyError(
                f"run {run_id!r} is not in group {self.group!r}; join it first"
            ) from None

    def prune_line(self, run_id: str) -> float | None:
        """The score below which a live member falls behind (the `keep_top`-th best sibling's less
        `prune_margin`).

        None: no pruning in this group, the run is not live in it, or it has too few scored
        siblings.
        """
        m = self._members.get(run_id)
        if self.policy.prune_margin is None or m is None or m.state != "live":
            return None
        kth = self._kth_sibling(m)
        return None if kth is None or kth.score is None else kth.score - self.policy.prune_margin

    def _kth_sibling(self, m: Member) -> Member | None:
        """The `keep_top`-th best scored live sibling of `m` (None: fewer than `keep_top` of
        them)."""
        k = self.policy.keep_top
        siblings = sorted(
            (
                s
                for s in self._members.values()
                if s is not m and s.state == "live" and s.score is not None
            ),
            key=lambda s: (-(s.score or 0.0), s.order),
        )
        return siblings[k - 1] if len(siblings) >= k else None

    def _newest_step(self) -> int:
        return max((m.last_step for m in self._members.values()), default=-1)

    def _refresh_uniform(self) -> None:
        before, now = self._uniform, self.uniform()
        if before is not None and (now is None or now["call"] != before["call"]):
            settled = [m for m in self._members.values() if m.outcome in ("success", "failure")]
            wrong = "success" if before["call"] == "all_fail" else "failure"
            if any(m.outcome == wrong for m in settled):
                self.contradicted = before["call"]
        self._uniform = now

    def _update(self, prunes: tuple[Prune, ...] = ()) -> GroupUpdate:
        self._refresh_uniform()
        ranking = self.ranking()
        # What a subscriber sees change: the order, the states and the scores (to 3 decimals). The
        # ranking is retained: a late subscriber reads the last one published, so a score that only
        # rode along on an order change stayed stale there (`score: null` long after every run was
        # scored). At most one publication per scoring of a member.
        shape: tuple[Any, ...] = tuple(
            (
                r["run_id"],
                r["state"],
                r.get("outcome"),
                None if r["score"] is None else round(r["score"], 3),
            )
            for r in ranking["runs"]
        )
        shape += (
            None if self._uniform is None else (self._uniform["call"], self._uniform["runs"]),
        )
        changed = shape != self._published
        self._published = shape
        return GroupUpdate(changed=changed, prunes=prunes, ranking=ranking)


def _p(x: float) -> float:
    """A p-value kept in [0, 1] (NaN or junk: 1, no call)."""
    return min(1.0, max(0.0, float(x))) if isinstance(x, (int, float)) and math.isfinite(x) else 1.0


def _nth(k: int) -> str:
    if k == 1:
        return "1st"
    if k == 2:
        return "2nd"
    if k == 3:
        return "3rd"
    return f"{k}th"


def replay(group: str, policy: Policy, events: Iterable[tuple[str, str, Any]]) -> GroupState:
    """A group rebuilt from its events in time order: ("join", run_id, None), ("score", run_id,
    Progress), ("end", run_id, outcome)."""
    g = GroupState(group, policy)
    for kind, run_id, value in events:
        if kind == "join":
            g.join(run_id)
        elif kind == "score":
            g.observe_progress(run_id, value)
        elif kind == "end":
            g.end(run_id, value)
        else:
            raise ValueError(f"unknown group event {kind!r}; use join, score or end")
    return g


__all__ = [
    "GROUP_NAME_MAX",
    "GroupFull",
    "GroupState",
    "GroupUpdate",
    "Member",
    "Prune",
    "RankedRunJSON",
    "RankingJSON",
    "RunState",
    "UniformCall",
    "UniformJSON",
    "combined_uncertainty",
    "replay",
]
