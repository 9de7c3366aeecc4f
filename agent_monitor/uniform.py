"""Groups flagged early (DAPO dynamic sampling): each live run's calibrated pass / fail call as a p-value. Pure logic.

An RL trainer wants to know, while a group's rollouts still run, that their outcomes will be all alike
(no variance, so no gradient). This module gives each member two conformal p-values from the family's
calibration (`agent_monitor.calibration`); `groups.GroupState.uniform` combines them over the group.

**Fail call.** A run's *running margin* is the calibration margin of its curve so far (the minimum over
its windows of `patience` consecutive counted scores of the window's maximum): the abort rule at
threshold t has stopped it iff that margin is below t. With the finite margins m_1..m_n of the family's
n successful runs, the p-value of "this run will fail" is

    fail_p = (1 + #{i : m_i <= m_live}) / (n + 1)        (1 while m_live is infinite, or n = 0)

If the run is in fact a success exchangeable with those n, its *final* margin's rank among the n + 1 is
uniform, so P(final p <= a) <= a; the running margin only ever falls as the run goes on, so the running
p-value is never below the final one: P(fail_p <= a at any step) <= a. This is exactly the calibration's
false-abort bound (`fail_p <= alpha` iff the calibrated rule at `alpha` aborts the run), as a number.

**Pass call**, the mirror image: a run's *pass margin* is the maximum over its windows of the window's
minimum (the rule "`patience` counted scores in a row above u" calls it a pass iff it exceeds u), it only
rises as the run goes on, and the reference set is the family's failed runs' pass margins M_j:

    pass_p = (1 + #{j : M_j >= M_live}) / (n_failures + 1)

**A group of N members** is called all-fail when 1 - N * max_i fail_p_i >= `uniform_confidence`. If some
member is in fact a success, P(flag) <= sum over members of P(member i succeeds and fail_p_i <= d / N)
<= (d / N) * E[#successes] <= d * P(some member succeeds): the flag is wrong with probability at most
d = 1 - confidence, whatever the dependence between the members (they share a prompt: they are not
independent, so no product of per-run confidences is claimed). Limits: docs/groups.md.

API: `pass_margin(curve, policy)`, `p_fail(margins, m)`, `p_pass(pass_margins, m)`, and
`Caller(calibration).calls(family, policy, curve) -> Calls` (evidence cached per family revision).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .calibration import Calibration, Family, Point, counted, margin
from .policy import Policy

MAX_CACHED = 256
"""(family, policy) evidence sets a Caller keeps; past it the oldest goes (families come from the network)."""


class Calls(NamedTuple):
    """One run's two calls: the p-values of "it will fail" and "it will pass" (1: no call)."""

    fail_p: float
    pass_p: float


NO_CALL = Calls(1.0, 1.0)
"""A run nothing is known about (no calibration, too few counted scores, a failing judge)."""


def pass_margin(curve: Iterable[Point], policy: Policy) -> float:
    """The largest u such that `patience` counted scores in a row all lie above it (-inf: fewer counted scores)."""
    scores = counted(curve, policy)
    w = policy.patience
    if len(scores) < w:
        return -math.inf
    # The mirror image of calibration.margin: the max over windows of the window's min, by negation.
    return -margin([Point(i, -s, None) for i, s in enumerate(scores)], _bare(policy))


def _bare(policy: Policy) -> Policy:
    """`policy`'s window with every score counted (the scores given are already the counted ones)."""
    return Policy(patience=policy.patience, min_steps=0, max_uncertainty=1.0)


def p_fail(margins: Sequence[float], m: float) -> float:
    """The p-value of "fails" for a running margin `m` against the successes' sorted finite `margins`."""
    if not margins or not math.isfinite(m):
        return 1.0
    return (1 + bisect.bisect_right(margins, m)) / (len(margins) + 1)


def p_pass(pass_margins: Sequence[float], m: float) -> float:
    """The p-value of "passes" for a running pass margin `m` against the failures' sorted finite `pass_margins`."""
    if not pass_margins or not math.isfinite(m):
        return 1.0
    return (1 + len(pass_margins) - bisect.bisect_left(pass_margins, m)) / (len(pass_margins) + 1)


class Caller:
    """Live runs' calls from a calibration's evidence; the family's margins are recomputed only when it learns."""

    def __init__(self, calibration: Calibration, *, max_cached: int = MAX_CACHED) -> None:
        self.calibration = calibration
        self.max_cached = max_cached
        self._cache: dict[tuple[Family, int, int, float], tuple[int, list[float], list[float]]] = {}
        self.recomputed = 0
        """Evidence sets computed (a cache miss: a new family or policy, or the family learnt a run)."""

    def calls(self, family: Family, policy: Policy, curve: Sequence[Point]) -> Calls:
        """A run's calls now, from its curve so far (step order; failed scorings have score None)."""
        fails, passes = self.evidence(family, policy)
        if not fails and not passes:
            return NO_CALL
        return Calls(p_fail(fails, margin(curve, policy)), p_pass(passes, pass_margin(curve, policy)))

    def evidence(self, family: Family, policy: Policy) -> tuple[list[float], list[float]]:
        """The family's successes' margins and failures' pass margins under `policy`'s window, sorted (finite only)."""
        key = (family, policy.min_steps, policy.patience, policy.max_uncertainty)
        rev = self.calibration.revision_of(family)
        got = self._cache.get(key)
        if got is not None and got[0] == rev:
            return got[1], got[2]
        fails = self.calibration.margins(family, policy)
        passes = sorted(
            pm
            for s in self.calibration.samples(family)
            if not s.success and math.isfinite(pm := pass_margin(s.curve, policy))
        )
        self._cache.pop(key, None)
        self._cache[key] = (rev, fails, passes)
        while len(self._cache) > self.max_cached:
            self._cache.pop(next(iter(self._cache)))
        self.recomputed += 1
        return fails, passes

    def statistics(self) -> dict[str, int]:
        """Evidence sets cached and computed."""
        return {"cached": len(self._cache), "recomputed": self.recomputed}


__all__ = ["NO_CALL", "Caller", "Calls", "p_fail", "p_pass", "pass_margin"]
