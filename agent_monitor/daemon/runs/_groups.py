"""The daemon's groups: sibling runs (`start.group`) ranked together, bounded, cleared a grace
period after they end.

Pure bookkeeping around `agent_monitor.groups.GroupState` (no I/O, no clock of its own): the
monitor asks it what a start, a score or an end does to a group, and publishes what it says.
Group names come from the network: at most `max_groups` groups of `max_group_runs` runs each;
a start beyond either is scored as a run of its own, in no group, never an unbounded table. Who
ranks with whom is the book's membership rule (`GroupBook.join`): never the first publisher's say.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import structlog

from ...calibration import Caller, points
from ...groups import GroupFull, GroupState, GroupUpdate, UniformJSON, group_mac, group_settings
from ...judges.base import Judge
from ...policy import Policy
from ...progress import Decision, Progress
from ...selection import Comparison, compare, majority_of, tournament, tournament_calls
from ...tracker import AsyncProgressTracker
from .._events import GroupRanked, MonitorEvent
from ._replay import Replays

log = structlog.get_logger("agent_monitor.daemon")


@dataclass(frozen=True, slots=True)
class GroupSeries:
    """What the per-group gauges show of one group (read by the scrape thread: a copy)."""

    group: str
    live: int
    leader_score: float | None
    last_at: float


class GroupLimitError(ValueError):
    """A start that would take the monitor past its group limits; the message says which and what
    to do."""


class GroupRefused(GroupLimitError):
    """A start that may not join its group: no valid group auth, or other group settings than the
    monitor's."""


SPLIT = "~"
"""Between a group's name and a membership key in the name of a group split off (`{group}~{key}`).

Not in a group name's grammar (a run id's), so no harness can name a group that looks like a split
one.
"""


@dataclass(frozen=True, slots=True)
class Joiner:
    """What a start brings to its group: what it is graded on, its group settings, and its group
    auth."""

    family: str
    """The run's calibration family name (start.family, else its task text)."""
    rubric: str
    """The rubric's hash."""
    policy: Policy
    started_at: float | None = None
    auth: str | None = None

    def key(self, *, settings: bool = True) -> str:
        """The membership key: runs rank together only with the same family, rubric (and group
        settings)."""
        what = [self.family, self.rubric, group_settings(self.policy) if settings else None]
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[
            :12
        ]


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a start went: a group (the one it named, or one split off it), or none (scored as a
    run of its own)."""

    group: str | None
    """The group the run ranks in (`start.group`, or `{group}~{key}`); None: in none, scored on
    its own."""
    update: GroupUpdate | None = None
    reason: Literal["group_refused", "group_split"] | None = None
    """Why the run is not in the group it named: refused (auth, settings, limits) or split
    (another key)."""
    message: str = ""
    """What the run's error topic says (with `reason`)."""


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
    """Starts that named a group they may not join (auth, settings, limits): scored as runs of
    their own."""
    split: int = 0
    """Starts ranked in a group split off the one they named (its name taken by runs of another
    key)."""
    secret: str | None = field(default=None, repr=False)
    """With it, a start joins a group only with `start.auth` = `groups.group_mac(secret, ...)`."""
    policy: Policy | None = None
    """The group settings every group uses (the monitor's policy flags); None: each group's first
    run's."""
    keys: dict[str, str] = field(default_factory=dict)
    """Each group's membership key (`Joiner.key`): only runs of that family, rubric and settings
    join it."""
    replays: Replays | None = None
    """With the secret: the signed (run id, started_at) that joined already; a replayed or stale
    one is refused."""

    def check(self, run_id: str, group: str) -> None:
        """Raise GroupLimitError if `run_id` cannot join `group` for the group limits."""
        g = self.groups.get(group)
        if g is None:
            if len(self.groups) >= self.max_groups:
                raise GroupLimitError(
                    f"the monitor follows at most {self.max_groups} groups (--max-groups) and "
                    "has that many; "
                    f"group {group!r} is refused: end the groups' runs or raise --max-groups"
                )
        elif run_id not in g.members and len(g.members) >= self.max_group_runs:
            raise GroupLimitError(
                f"group {group!r} already has {len(g.members)} runs, the most allowed "
                "(--max-group-runs); "
                "start this run in another group or raise the limit"
            )

    def _check_joiner(self, run_id: str, group: str, joiner: Joiner) -> None:
        if self.secret is not None:
            want = group_mac(self.secret, run_id, joiner.started_at, group)
            if not joiner.auth or not hmac.compare_digest(joiner.auth.lower(), want):
                raise GroupRefused(
                    f"group {group!r} needs start.auth, the HMAC of run id, started_at and "
                    "group with the monitor's "
                    "group secret (MonitorClient(group_secret=...) adds it); this start has "
                    "none or a wrong one"
                )
            # The MAC binds what the publisher chose: a signed start joins once (a member's
            # redelivery aside).
            why = (
                self.replays.check(run_id, joiner.started_at) if self.replays is not None else None
            )
            if why is not None and self.of_run.get(run_id, "").split(SPLIT)[0] != group:
                raise GroupRefused(
                    f"group {group!r}: this start's signature is {why.replace('_', ' ')} (a "
                    "signed start joins once, "
                    "with a started_at within --signature-max-age); start a new run with a "
                    "new started_at"
                )
        mine = group_settings(joiner.policy)
        if self.policy is not None and mine != (fixed := group_settings(self.policy)):
            diff = ", ".join(
                f"{k}={mine[k]!r} (the monitor's: {fixed[k]!r})"
                for k in mine
                if mine[k] != fixed[k]
            )
            raise GroupRefused(
                f"group {group!r} uses the monitor's group settings; this start asks for {diff}"
            )

    def _name(self, group: str, key: str) -> str | None:
        """The group a run of membership `key` ranks in: the name asked for, unless runs of
        another key hold it."""
        for name in (group, f"{group}{SPLIT}{key}"):
            # free, made without a key (a restored ranking), or this key's
            if self.keys.get(name, key) == key:
                return name
        return None  # 48 bits collide: no group rather than another key's

    def join(
        self, run_id: str, group: str, policy: Policy, at: float, joiner: Joiner | None = None
    ) -> Placed:
        """A run joins a group: the one it names, one split off it for its key, or none (limits,
        auth, settings).

        With `joiner`, a run ranks only with runs of the same family, rubric and group settings (its
        key): the first key to use a group's name keeps it while the group lives, a run of another
        key ranks in `{group}~{key}` with the runs like it, so whoever starts first decides nothing
        for the others. A start lacking the group auth the group secret requires, or asking for
        other settings than the monitor's fixed ones, is in no group. Never raises: every run is
        scored.
        """
        name, key = group, None
        try:
            if joiner is not None:
                self._check_joiner(run_id, group, joiner)
                key = joiner.key(settings=self.policy is None)
                found = self._name(group, key)
                if found is None:
                    raise GroupRefused(
                        f"group {group!r}: the names for this run's task and rubric are taken"
                    )
                name = found
            self.check(run_id, name)
            g = self.groups.get(name)
            if g is None:
                # The group's policy is its first run's (or the monitor's, when fixed): its key
                # keeps it one.
                g = self.groups[name] = GroupState(
                    name, self.policy or policy, max_runs=self.max_group_runs
                )
            update = g.join(run_id)
        except (GroupLimitError, GroupFull) as e:
            self.refused += 1
            return Placed(
                None,
                reason="group_refused",
                message=f"{e}; the run is scored on its own, in no group",
            )
        if key is not None:
            self.keys.setdefault(name, key)
        self.of_run[run_id] = name
        if self.replays is not None and joiner is not None and joiner.started_at is not None:
            self.replays.used(run_id, joiner.started_at)
        self.done_at.pop(name, None)
        self.last_at[name] = at
        if name == group:
            return Placed(name, update)
        self.split += 1
        return Placed(
            name,
            update,
            "group_split",
            f"group {group!r} is in use by runs of another task, rubric or group settings; "
            "this run ranks with the "
            f"runs like it in group {name!r} (its ranking: _groups/{name}/ranking); use a "
            "group name of its own",
        )

    def uniform(self, group: str) -> UniformJSON | None:
        """A group's early dynamic-sampling call (all_fail / all_pass, its confidence), or None: no
        call, no group.

        Pure: what the retained ranking's `uniform` says now. For the reward endpoints, per run:
        `uniform_of`.
        """
        g = self.groups.get(group)
        return None if g is None else g.called

    def uniform_of(self, run_id: str) -> UniformJSON | None:
        """The early call of a live run's group (None: ungrouped, not live, or no call)."""
        name = self.of_run.get(run_id)
        return None if name is None else self.uniform(name)

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
        """The run left the live set (ended, expired, evicted); a group all ended is cleared
        after `grace_s`."""
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
        """Drop a run that moved to another replica (cluster mode); its group goes with its last
        run here. Its name."""
        name = self.of_run.pop(run_id, None)
        if name is not None and not any(g == name for g in self.of_run.values()):
            self.groups.pop(name, None)
            self.keys.pop(name, None)
            self.done_at.pop(name, None)
            self.last_at.pop(name, None)
        return name

    def due(self, now: float) -> list[str]:
        """The groups whose last run ended `grace_s` ago or more: forgotten now (their ranking is
        to be cleared)."""
        out = [name for name, at in self.done_at.items() if now - at >= self.grace_s]
        for name in out:
            self.done_at.pop(name, None)
            self.last_at.pop(name, None)
            g = self.groups.pop(name, None)
            self.keys.pop(name, None)
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
        return GroupSeries(
            name, live, leader.score if leader else None, self.last_at.get(name, 0.0)
        )

    def series(self, allow: Iterable[str] = ()) -> list[GroupSeries]:
        """Each group's gauges, most recently active first (groups not on `allow`, when it is
        given, left out)."""
        allowed = frozenset(allow)
        out = [
            s
            for name in list(self.groups)
            if (not allowed or name in allowed) and (s := self.series_of(name))
        ]
        return sorted(out, key=lambda s: s.last_at, reverse=True)


class Groups:
    """The monitor's groups part: the book, the retained rankings it publishes, the gauges' copy,
    the tournaments.

    Given what it needs, never the monitor: the sink to `emit` rankings to, the live runs' trackers
    (`trackers`, read only), the judge for tournaments, the clock, and once the monitor runs the
    TaskGroup its tournaments are named tasks of (`compare:{group}`).
    """

    def __init__(
        self,
        book: GroupBook,
        *,
        emit: Callable[[MonitorEvent], None],
        trackers: Callable[[str], AsyncProgressTracker | None],
        judge: Judge,
        repeats: int,
        clock: Callable[[], float],
        on_compared: Callable[[bool, int], None] = lambda ok, calls: None,
        on_majority: Callable[[int], None] = lambda saved: None,
        caller: Caller | None = None,
        on_uniform: Callable[[str, str], None] = lambda call, what: None,
        on_placed: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.book = book
        self.emit = emit
        self.trackers = trackers
        self.judge = judge
        self.repeats = repeats
        self.clock = clock
        self.on_compared = on_compared
        """Told (ok, judge calls) after each pairwise comparison (the compare-calls counter)."""
        self.on_majority = on_majority
        """Told the judge calls a tournament could have made when the majority shortcut skipped
        it (a counter)."""
        self.caller = caller
        """Each member's calibrated pass / fail call (None: groups are never flagged all_fail /
        all_pass)."""
        self.on_uniform = on_uniform
        """Told (call, "flagged" | "withdrawn" | "contradicted") when a group's early call
        changes (the counters)."""
        self.on_placed = on_placed
        """Told "group_refused" or "group_split" when a live start is not placed in the group it
        named (the counters)."""
        self._flagged: dict[str, str] = {}
        self.series: dict[str, GroupSeries] = {}
        """Kept current one group at a time on the event loop; the scrape thread reads a copy."""
        self.tasks: asyncio.TaskGroup | None = None
        """The monitor's TaskGroup while it runs (None: no tournaments, e.g. once it is leaving)."""
        # policy.compare: one pivot tournament in flight per group; what it last compared; groups to
        # compare again.
        self.comparing: dict[str, asyncio.Task[None]] = {}
        self._compared: dict[str, tuple[tuple[str, int], ...]] = {}
        self._compare_again: set[str] = set()

    def gauges(self) -> list[GroupSeries]:
        """The groups' gauges, most recently active first (called from the scrape thread: a
        copy)."""
        return sorted(dict(self.series).values(), key=lambda s: s.last_at, reverse=True)

    def join(
        self,
        run_id: str,
        group: str,
        policy: Policy,
        tracker: AsyncProgressTracker,
        joiner: Joiner | None = None,
        *,
        publish: bool,
    ) -> Placed:
        """A run opened naming a group: place it (its group, one split off it, or none), route
        its results there."""
        placed = self.book.join(run_id, group, policy, self.clock(), joiner)
        if placed.reason is not None:
            if publish:  # counted live, once (a replay places the run again the same way)
                self.on_placed(placed.reason)
            log.warning(
                placed.reason,
                run_id=run_id,
                group=group,
                placed=placed.group,
                replaying=not publish,
            )
        if placed.group is None or placed.update is None:
            return placed
        tracker.on_group = partial(self.verdict, run_id)
        self.changed(placed.group, placed.update.changed and publish)
        return placed

    def verdict(self, run_id: str, p: Progress) -> Decision | None:
        """A grouped run's result through its group: the prune decision, if the group policy
        prunes it now."""
        called = self._call(run_id, p)
        update = self.book.observe(run_id, p, self.clock())
        if update is None:
            return None
        group = self.book.of_run[run_id]
        self.changed(group, update.changed or called)
        self.maybe_compare(group)
        if not update.prunes:
            return None
        return update.prunes[0].decision(p)

    def _call(self, run_id: str, p: Progress) -> bool:
        """Update a member's calls from its curve and this result; whether the ranking changed by
        it."""
        g, tracker = self.book.group_of(run_id), self.trackers(run_id)
        if (
            self.caller is None
            or g is None
            or tracker is None
            or g.policy.uniform_confidence is None
        ):
            return False
        curve = tracker.points
        # the tracker keeps this result only after the group saw it
        if not curve or p.step > curve[-1].step:
            curve = (*curve, *points([p]))
        calls = self.caller.calls(tracker.family, g.policy, curve)
        return g.call(run_id, fail_p=calls.fail_p, pass_p=calls.pass_p).changed

    def prune_line(self, run_id: str) -> float | None:
        """The pruning line a grouped run's next score could cross (None: ungrouped, or no line
        yet)."""
        g = self.book.group_of(run_id)
        return None if g is None else g.prune_line(run_id)

    def ended(self, run_id: str, outcome: str | None, at: float, *, publish: bool) -> None:
        """A grouped run left the live set."""
        group = self.book.of_run.get(run_id)
        update = self.book.end(run_id, outcome, at)
        if group is not None and update is not None:
            self.changed(group, update.changed and publish)

    def forget(self, run_id: str) -> None:
        """A run moved to another replica (cluster mode): its group goes with its last run here."""
        group = self.book.forget(run_id)
        if group is not None and group not in self.book.groups:
            self.series.pop(group, None)
            self._flagged.pop(group, None)

    def due(self, now: float) -> None:
        """Clear the groups whose grace period passed (an empty retained payload clears a
        ranking)."""
        for group in self.book.due(now):
            self.series.pop(group, None)
            self._flagged.pop(group, None)
            self.emit(GroupRanked(group, None))

    def changed(self, group: str, publish: bool, *, republished: bool = False) -> None:
        """Refresh the group gauges; publish the group's ranking (retained) when asked."""
        series = self.book.series_of(group)
        if series is None:
            self.series.pop(group, None)
        else:
            self.series[group] = series
        g = self.book.groups.get(group)
        if g is not None:
            self._count_uniform(group, g)
        if publish and g is not None:
            self.emit(GroupRanked(group, g.ranking(), republished=republished))

    def _count_uniform(self, group: str, g: GroupState) -> None:
        now, before = g.called, self._flagged.get(group)
        if g.contradicted is not None:
            self.on_uniform(g.contradicted, "contradicted")
            log.warning("group_uniform_contradicted", group=group, call=g.contradicted)
            g.contradicted = None
        if now is not None and now["call"] != before:
            self._flagged[group] = now["call"]
            self.on_uniform(now["call"], "flagged")
            log.info("group_uniform", group=group, **now)
        elif now is None and before is not None:
            del self._flagged[group]
            self.on_uniform(before, "withdrawn")

    def maybe_compare(self, group: str) -> None:
        """With `policy.compare`: order the leaders pointwise scores cannot separate by a pivot
        tournament.

        Asked again only when the tied leaders or their steps changed since the last tournament, one
        tournament per group at a time (a change meanwhile asks once more after it). A failed
        tournament leaves the pointwise order (fail-open); pairwise verdicts order the ranking, they
        never prune.
        """
        g = self.book.groups.get(group)
        if g is None or not g.policy.compare or self.tasks is None:
            return
        steps = {r: len(t.steps) for r in g.tied_leaders() if (t := self.trackers(r)) is not None}
        if len(steps) < 2:
            self._compared.pop(group, None)
            return
        key = tuple(sorted(steps.items()))
        if self._compared.get(group) == key:
            return
        if group in self.comparing:
            self._compare_again.add(group)
            return
        self._compared[group] = key
        self.comparing[group] = self.tasks.create_task(
            self._compare(group, list(steps)), name=f"compare:{group}"
        )

    async def _compare(self, group: str, tied: list[str]) -> None:
        try:
            trackers = {r: t for r in tied if (t := self.trackers(r)) is not None}
            first = trackers[tied[0]]

            async def pair(a: str, b: str) -> Comparison:
                c = await compare(
                    first.task,
                    list(trackers[a].steps),
                    list(trackers[b].steps),
                    judge=self.judge,
                    criteria=first.rubric,
                    repeats=self.repeats,
                    min_mass=first.min_mass,
                )
                self.on_compared(c.ok, c.calls)
                return c

            members = majority_of({r: t.steps for r, t in trackers.items()})
            if members is not None:
                # TurboAgent's shortcut: most leaders give the same answer, so it leads with no
                # comparison.
                self.on_majority(tournament_calls(len(trackers), len(first.rubric.judged) or 1))
                ranking = members + [r for r in trackers if r not in members]
                log.info("group_majority", group=group, leaders=tied, majority=members)
            else:
                result = await tournament(list(trackers), pair)
                ranking = result.ranking if result.ok else []
                log.info(
                    "group_compared",
                    group=group,
                    leaders=tied,
                    winner=result.winner,
                    comparisons=result.comparisons,
                    failed=result.failed,
                )
            g = self.book.groups.get(group)
            if g is not None:
                update = g.set_order(ranking)
                self.changed(group, update.changed)
        except Exception:
            log.exception("group_compare_failed", group=group)  # the pointwise ranking stands
        finally:
            self.comparing.pop(group, None)
            if group in self._compare_again:
                self._compare_again.discard(group)
                self.maybe_compare(group)

    def restore(self, stored: Mapping[str, Mapping[str, Any]], policy: Policy) -> None:
        """Rebuild each group from its runs' restored scores, keep the prunes decided before,
        publish its ranking.

        The journal replay made the groups and their members (in start order); the runs' stored
        results fold in step by step across siblings (their order in time is not kept), counting
        streaks but deciding no prune: a prune is a decision taken live once and restored from the
        run's stored abort. Siblings that ended before the restart come from the group's last stored
        ranking; a group whose runs had all ended is published again and cleared after the grace
        period, as it would have been.
        """
        book, now = self.book, self.clock()
        for name, ranking in stored.items():
            if name not in book.groups:
                if len(book.groups) >= book.max_groups:
                    break
                book.groups[name] = GroupState(name, policy, max_runs=book.max_group_runs)
                book.done_at[name] = now
            g = book.groups[name]
            for run in ranking.get("runs") or ():
                if isinstance(run, Mapping) and len(g.members) < book.max_group_runs:
                    g.restore(run)
        for name, g in book.groups.items():
            curves = {r: t.curve for r in g.members if (t := self.trackers(r)) is not None}
            depth = max((len(c) for c in curves.values()), default=0)
            for i in range(depth):
                for run_id, curve in curves.items():
                    if i < len(curve):
                        p = curve[i]
                        g.observe_progress(run_id, p, decide=False)
                        if p.signal is not None and p.signal.pruned:
                            g.prune(run_id)
            for run_id, curve in curves.items():
                # the calls of the restored curves: a flagged group is flagged again, as it was
                if curve:
                    self._call(run_id, curve[-1])
            self.changed(name, True, republished=True)
