"""The daemon's groups: sibling runs (`start.group`) ranked together, bounded, cleared a grace period after they end.

Pure bookkeeping around `agent_monitor.groups.GroupState` (no I/O, no clock of its own): the
monitor asks it what a start, a score or an end does to a group, and publishes what it says.
Group names come from the network: at most `max_groups` groups of `max_group_runs` runs each;
a start beyond either is refused (`run_rejected`), never an unbounded table.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..groups import GroupFull, GroupState, GroupUpdate, group_mac, group_settings
from ..policy import Policy
from ..progress import Progress


@dataclass(frozen=True, slots=True)
class GroupSeries:
    """What the per-group gauges show of one group (read by the scrape thread: a copy)."""

    group: str
    live: int
    leader_score: float | None
    last_at: float


class GroupLimitError(ValueError):
    """A start that would take the monitor past its group limits; the message says which and what to do."""


class GroupRefused(GroupLimitError):
    """A start that may not join its group: another task or rubric, another group policy, or no valid group auth."""


@dataclass(frozen=True, slots=True)
class Joiner:
    """What a start brings to its group: what it is graded on, its group settings, and its group auth."""

    family: str
    """The run's calibration family name (start.family, else its task text)."""
    rubric: str
    """The rubric's hash."""
    policy: Policy
    started_at: float | None = None
    auth: str | None = None


@dataclass(slots=True)
class GroupBook:
    """Every live group: its state, its runs, and when a group whose runs all ended is cleared."""

    max_groups: int
    max_group_runs: int
    grace_s: float
    groups: dict[str, GroupState] = field(default_factory=dict)
    of_run: dict[str, str] = field(default_factory=dict)
    """Each grouped live run's group."""
    done_at: dict[str, float] = field(default_factory=dict)
    """When each group's last run ended (cleared `grace_s` later unless a run joins again)."""
    last_at: dict[str, float] = field(default_factory=dict)
    refused: int = 0
    """Starts refused for the group limits."""
    secret: str | None = field(default=None, repr=False)
    """With it, a start joins a group only with `start.auth` = `groups.group_mac(secret, ...)`."""
    policy: Policy | None = None
    """The group settings every group uses (the monitor's policy flags); None: each group's first run's."""
    first: dict[str, Joiner] = field(default_factory=dict)
    """Each group's first run: a later one joins only with the same family, rubric and group settings."""

    def check(self, run_id: str, group: str, joiner: Joiner | None = None) -> None:
        """Raise GroupLimitError if `run_id` cannot join `group` (checked before its start is journaled).

        With `joiner`, also GroupRefused when the run is graded otherwise than the group's first run
        (another family or rubric: its scores do not compare), asks for other group settings, or lacks
        the group auth the monitor's group secret requires.
        """
        if joiner is not None:
            self._check_joiner(run_id, group, joiner)
        g = self.groups.get(group)
        if g is None:
            if len(self.groups) >= self.max_groups:
                self.refused += 1
                raise GroupLimitError(
                    f"the monitor follows at most {self.max_groups} groups (--max-groups) and has that many; "
                    f"group {group!r} is refused: end the groups' runs or raise --max-groups"
                )
        elif run_id not in g.members and len(g.members) >= self.max_group_runs:
            self.refused += 1
            raise GroupLimitError(
                f"group {group!r} already has {len(g.members)} runs, the most allowed (--max-group-runs); "
                "start this run in another group or raise the limit"
            )

    def _check_joiner(self, run_id: str, group: str, joiner: Joiner) -> None:
        if self.secret is not None:
            want = group_mac(self.secret, run_id, joiner.started_at, group)
            if not joiner.auth or not hmac.compare_digest(joiner.auth.lower(), want):
                self.refused += 1
                raise GroupRefused(
                    f"group {group!r} needs start.auth, the HMAC of run id, started_at and group with the monitor's "
                    "group secret (MonitorClient(group_secret=...) adds it); this start has none or a wrong one"
                )
        mine = group_settings(joiner.policy)
        if self.policy is not None and mine != (fixed := group_settings(self.policy)):
            self.refused += 1
            diff = ", ".join(f"{k}={mine[k]!r} (the monitor's: {fixed[k]!r})" for k in mine if mine[k] != fixed[k])
            raise GroupRefused(f"group {group!r} uses the monitor's group settings; this start asks for {diff}")
        first = self.first.get(group)
        if first is None or group not in self.groups:
            return
        if (joiner.family, joiner.rubric) != (first.family, first.rubric):
            self.refused += 1
            what = "task or family" if joiner.family != first.family else "rubric"
            raise GroupRefused(
                f"group {group!r} is for runs of the {what} of its first run ({first.family!r}, rubric "
                f"{first.rubric}); this run's is ({joiner.family!r}, rubric {joiner.rubric}): scores of different "
                "tasks or rubrics do not rank; use another group"
            )
        theirs = group_settings(first.policy)
        if mine != theirs:
            self.refused += 1
            diff = ", ".join(f"{k}={mine[k]!r} (the group's: {theirs[k]!r})" for k in mine if mine[k] != theirs[k])
            raise GroupRefused(f"group {group!r} has the group settings of its first run; this start asks for {diff}")

    def join(self, run_id: str, group: str, policy: Policy, at: float, joiner: Joiner | None = None) -> GroupUpdate:
        """A run joins its group (made with this run's policy when it is the first); GroupLimitError past a limit."""
        self.check(run_id, group)
        g = self.groups.get(group)
        if g is None:
            # The group's policy is its first run's (or the monitor's, when fixed): later runs must match it.
            g = self.groups[group] = GroupState(group, self.policy or policy, max_runs=self.max_group_runs)
            if joiner is not None:
                self.first[group] = joiner
        try:
            update = g.join(run_id)
        except GroupFull as e:  # checked above; kept for a bound set below the members already there
            raise GroupLimitError(str(e)) from None
        self.of_run[run_id] = group
        self.done_at.pop(group, None)
        self.last_at[group] = at
        return update

    def group_of(self, run_id: str) -> GroupState | None:
        """The live group of a run (None: ungrouped, or not live)."""
        name = self.of_run.get(run_id)
        return self.groups.get(name) if name is not None else None

    def observe(self, run_id: str, p: Progress, at: float) -> GroupUpdate | None:
        """Fold a run's result into its group (None: the run is in no group)."""
        g = self.group_of(run_id)
        if g is None:
            return None
        self.last_at[g.group] = at
        return g.observe_progress(run_id, p)

    def end(self, run_id: str, outcome: str | None, at: float) -> GroupUpdate | None:
        """The run left the live set (ended, expired, evicted); a group all ended is cleared after `grace_s`."""
        name = self.of_run.pop(run_id, None)
        g = self.groups.get(name) if name is not None else None
        if g is None:
            return None
        update = g.end(run_id, outcome)
        self.last_at[g.group] = at
        if not any(self.of_run.get(r) == g.group for r in g.members):
            self.done_at[g.group] = at
        return update

    def forget(self, run_id: str) -> str | None:
        """Drop a run that moved to another replica (cluster mode); its group goes with its last run here. Its name."""
        name = self.of_run.pop(run_id, None)
        if name is not None and not any(g == name for g in self.of_run.values()):
            self.groups.pop(name, None)
            self.first.pop(name, None)
            self.done_at.pop(name, None)
            self.last_at.pop(name, None)
        return name

    def due(self, now: float) -> list[str]:
        """The groups whose last run ended `grace_s` ago or more: forgotten now (their ranking is to be cleared)."""
        out = [name for name, at in self.done_at.items() if now - at >= self.grace_s]
        for name in out:
            self.done_at.pop(name, None)
            self.last_at.pop(name, None)
            g = self.groups.pop(name, None)
            self.first.pop(name, None)
            for r in g.members if g is not None else ():
                if self.of_run.get(r) == name:
                    del self.of_run[r]
        return out

    def series_of(self, name: str) -> GroupSeries | None:
        """One group's gauges now (None: no such group)."""
        g = self.groups.get(name)
        if g is None:
            return None
        live = sum(m.state == "live" for m in g.members.values())
        leader = next((m for m in g.ranked() if m.state != "pruned" and m.score is not None), None)
        return GroupSeries(name, live, leader.score if leader else None, self.last_at.get(name, 0.0))

    def series(self, allow: Iterable[str] = ()) -> list[GroupSeries]:
        """Each group's gauges, most recently active first (groups not on `allow`, when it is given, left out)."""
        allowed = frozenset(allow)
        out = [s for name in list(self.groups) if (not allowed or name in allowed) and (s := self.series_of(name))]
        return sorted(out, key=lambda s: s.last_at, reverse=True)
