"""In-process best-of-N: sibling trackers sharing one group, ranked as they run, laggards pruned
(async and sync).

```python
from agent_monitor import GroupTracker, Policy

with GroupTracker("Fix the failing test", judge=judge,
                  policy=Policy(keep_top=2, prune_margin=0.2, min_steps=3, patience=2)) as group:
    runs = {i: group.run(f"rollout-{i}") for i in range(4)}
    ...
    p = runs[3].update("ran pytest: 3 failed")
    if p.signal and p.signal.pruned:     # an abort: this rollout fell behind its siblings
        stop(3)
    group.ranking() # {"group", "leader", "runs": [{"run_id", "rank", "score", ...}]}
    group.end("rollout-0", "success")
```

Each sibling is an ordinary tracker (`AsyncProgressTracker` for `AsyncGroupTracker`,
`ProgressTracker` for `GroupTracker`) made with the group's options; its results go through the
group's policy (`agent_monitor.groups`) after the run's own, so a pruned run's `Progress.signal` is
an abort with `pruned=True`, `leader` and the reason, and `on_signal` hears of it like of any abort.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Generic, Self, TypeVar

from .groups import GROUP_NAME_MAX, GroupState, GroupUpdate, RankingJSON
from .judges.base import Judge
from .policy import Policy
from .progress import Decision, Progress
from .selection import DEFAULT_PIVOTS, Comparison, Tournament, compare, tournament
from .tracker import AsyncProgressTracker, ProgressTracker

RankingCallback = Callable[[RankingJSON], object]
T = TypeVar("T", AsyncProgressTracker, ProgressTracker)


class _Group:
    """The group both facades share: its state under a lock (sync siblings may score on several
    threads)."""

    def __init__(
        self,
        name: str,
        policy: Policy | Mapping[str, Any] | None,
        max_runs: int | None,
        on_ranking: RankingCallback | None,
    ) -> None:
        if not name or len(name) > GROUP_NAME_MAX:
            raise ValueError(f"group name {name[:40]!r}: use 1 to {GROUP_NAME_MAX} characters")
        self.policy = policy if isinstance(policy, Policy) else Policy().with_overrides(policy)
        self.state = GroupState(name, self.policy, max_runs=max_runs)
        self.on_ranking = on_ranking
        self._lock = threading.Lock()

    def join(self, run_id: str) -> None:
        with self._lock:
            update = self.state.join(run_id)
        self._tell(update)

    def verdict(self, run_id: str, p: Progress) -> Decision | None:
        """The group's prune of this result (an abort marked pruned), or None."""
        with self._lock:
            update = self.state.observe_progress(run_id, p)
        self._tell(update)
        if not update.prunes:
            return None
        return update.prunes[0].decision(p)

    def end(self, run_id: str, outcome: str | None) -> None:
        with self._lock:
            update = self.state.end(run_id, outcome)
        self._tell(update)

    def ranking(self) -> RankingJSON:
        with self._lock:
            return self.state.ranking()

    def tied(self) -> list[str]:
        with self._lock:
            return self.state.tied_leaders()

    def order(self, run_ids: list[str]) -> None:
        with self._lock:
            update = self.state.set_order(run_ids)
        self._tell(update)

    def _tell(self, update: GroupUpdate) -> None:
        if update.changed and self.on_ranking is not None and update.ranking is not None:
            self.on_ranking(update.ranking)


async def _tournament(
    group: _Group, trackers: Mapping[str, AsyncProgressTracker], pivots: int
) -> Tournament[str] | None:
    """Order the leaders pointwise scores cannot separate by a pivot tournament of pairwise
    comparisons."""
    tied = [r for r in group.tied() if r in trackers]
    if len(tied) < 2:
        return None
    first = trackers[tied[0]]

    async def pair(a: str, b: str) -> Comparison:
        ta, tb = trackers[a], trackers[b]
        return await compare(
            first.task,
            list(ta.steps),
            list(tb.steps),
            judge=first.judge,
            criteria=first.rubric,
            repeats=first.repeats,
            min_mass=first.min_mass,
        )

    result = await tournament(tied, pair, pivots=pivots)
    # A failed tournament leaves the pointwise order (fail-open).
    group.order(result.ranking if result.ok else [])
    return result


class _Siblings(Generic[T]):
    """What both group facades are: the group, the siblings' options and trackers, the ranking
    read out."""

    def __init__(
        self,
        task: str,
        *,
        judge: Judge,
        policy: Policy | Mapping[str, Any] | None = None,
        name: str = "group",
        max_runs: int | None = None,
        on_ranking: RankingCallback | None = None,
        **options: Any,
    ) -> None:
        self.task = task
        self.judge = judge
        self._group = _Group(name, policy, max_runs, on_ranking)
        self.options = options
        self.trackers: dict[str, T] = {}
        """Every sibling's tracker, by run id."""

    @property
    def state(self) -> GroupState:
        """The group's state (members, scores, states); read it, do not change it."""
        return self._group.state

    @property
    def policy(self) -> Policy:
        """The group's policy."""
        return self._group.policy

    def _join(self, run_id: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """Add a sibling to the group; the keyword arguments its tracker is made with."""
        if run_id in self.trackers:
            raise ValueError(
                f"run {run_id!r} is already in the group; give each sibling its own run id"
            )
        if "policy" in options:
            raise TypeError("a sibling's policy is the group's; set it on the group")
        self._group.join(run_id)
        return {
            "judge": self.judge,
            "run_id": run_id,
            "policy": self.policy,
            **self.options,
            **options,
        }

    def ranking(self) -> RankingJSON:
        """The ranking now: `{"group", "leader", "runs": [...]}`, best first."""
        return self._group.ranking()

    @property
    def leader(self) -> str | None:
        """The rank-1 run."""
        return self.ranking()["leader"]

    @property
    def pruned(self) -> list[str]:
        """The runs pruned so far."""
        return [r["run_id"] for r in self.ranking()["runs"] if r["state"] == "pruned"]


class AsyncGroupTracker(_Siblings[AsyncProgressTracker]):
    """Sibling runs of one task on the event loop: `run(run_id)` gives each its
    `AsyncProgressTracker`.

    `policy` (a Policy or a mapping of its settings) is the group's and every sibling's: `keep_top`,
    `prune_margin`, `min_steps`, `patience` decide prunes (see `agent_monitor.groups`); the run
    settings (abort_below, ...) act on each run as usual. `options` are AsyncProgressTracker's
    (criteria, repeats, min_mass, on_signal, ...), given to every sibling. `on_ranking` is called
    with the ranking whenever its order or a state changes.
    """

    def run(self, run_id: str, **options: Any) -> AsyncProgressTracker:
        """A new sibling's tracker (`options` override the group's for this run; its policy stays
        the group's)."""
        tracker = AsyncProgressTracker(self.task, **self._join(run_id, options))
        tracker.on_group = lambda p: self._group.verdict(run_id, p)
        self.trackers[run_id] = tracker
        return tracker

    def end(self, run_id: str, outcome: str | None = None) -> None:
        """A sibling ended (its rank stays; `outcome` shows in the ranking)."""
        self._group.end(run_id, outcome)

    async def compare(self, *, pivots: int = DEFAULT_PIVOTS) -> Tournament[str] | None:
        """Order the leaders whose scores are within their uncertainty by pairwise judge comparisons
        (both orders).

        The pivot tournament (`agent_monitor.tournament`) over the tied leaders orders them in the
        ranking; pruning stays pointwise. None when pointwise scores separate the leaders (no call
        made). It costs judge calls (`Tournament.comparisons` comparisons of two calls per
        criterion): call it when the order matters (e.g. before picking), the daemon's
        `policy.compare` does it as runs go.
        """
        return await _tournament(self._group, self.trackers, pivots)


class GroupTracker(_Siblings[ProgressTracker]):
    """The synchronous group: `run(run_id)` gives each sibling a `ProgressTracker`; `close()` closes
    them all.

    Options as for `AsyncGroupTracker`.
    """

    def run(self, run_id: str, **options: Any) -> ProgressTracker:
        """A new sibling's tracker (`options` override the group's for this run; its policy stays
        the group's)."""
        tracker = ProgressTracker(self.task, **self._join(run_id, options))
        tracker._core.on_group = lambda p: self._group.verdict(run_id, p)
        self.trackers[run_id] = tracker
        return tracker

    def end(self, run_id: str, outcome: str | None = None) -> None:
        """A sibling ended (its rank stays; `outcome` shows in the ranking); its tracker is
        closed."""
        self._group.end(run_id, outcome)
        tracker = self.trackers.get(run_id)
        if tracker is not None:
            tracker.close()

    def compare(self, *, pivots: int = DEFAULT_PIVOTS) -> Tournament[str] | None:
        """`AsyncGroupTracker.compare`, blocking: order the tied leaders by pairwise judge
        comparisons."""
        cores = {r: t._core for r, t in self.trackers.items()}
        if not cores:
            return None
        # the siblings' loop: the judge's, or the first's own
        sync = next(iter(self.trackers.values()))._sync
        return sync.call(partial(_tournament, self._group, cores, pivots))

    def close(self) -> None:
        """Close every sibling's tracker."""
        for tracker in self.trackers.values():
            tracker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AsyncGroupTracker", "GroupTracker", "RankingCallback"]
