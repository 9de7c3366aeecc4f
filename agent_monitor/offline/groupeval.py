"""Best of N on recorded runs: `agent-monitor select` (pick accuracy) and `eval --groups` (what
pruning costs).

Sibling runs are recorded runs of one task, grouped by `group_runs` (by task text, by folder, or
by the name before `__`, as Harbor / Terminal-Bench name trials).

`select_groups` picks the best run of each group (pointwise final score, or the pivot tournament
of pairwise comparisons) and, where every run's outcome is known, reports the share of groups whose
pick succeeded against a random pick (its expected value, exact: the share of successes in each
group) and against the pick by the last step's pointwise score.

`prune_report` replays each group's scored runs through the live group policy
(`agent_monitor.groups.GroupState`), as if the siblings had been launched together: steps in
recorded time order relative to each run's start (by step index when the runs carry no
timestamps). Per setting of `keep_top` / `prune_margin`: tasks where some run succeeded; of those,
tasks where a succeeding run was never pruned ("best-of-N kept"); the share of all steps saved by
pruning; and the same figures for random pruning at the same step budget (in each group as many
runs as the policy pruned, chosen at random, each stopped after as many steps as one of the
policy's prunes), averaged over seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..criteria import CriteriaSpec, load_criteria
from ..groups import GroupState
from ..judges.base import Judge, recommended_min_mass
from ..policy import Policy
from ..progress import Usage
from ..selection import (
    DEFAULT_PAIR_CHARS,
    DEFAULT_PIVOTS,
    Comparison,
    Selection,
    compare,
    tournament,
)
from .evaluate import RunCurve, ScoreCache, pair_key, score_runs
from .recorded import RecordedRun, load_recorded

GroupBy = Literal["task", "folder", "name"]
"""How recorded runs become sibling groups: same task text, same folder, or same name before
`__`."""

DEFAULT_KEEP_TOPS = (1, 2, 3)
DEFAULT_MARGINS = (0.05, 0.1, 0.2, 0.3)
DEFAULT_SEEDS = 200
"""Random prunings averaged per setting (`eval --groups`)."""


@dataclass(frozen=True, slots=True)
class Group:
    """Sibling runs: a label and the runs, in file order."""

    name: str
    runs: tuple[RecordedRun, ...]

    @property
    def known(self) -> bool:
        """Every run's outcome is known."""
        return all(r.outcome is not None for r in self.runs)

    @property
    def successes(self) -> int:
        """Runs that succeeded (outcome >= 0.5)."""
        return sum(_success(r.outcome) for r in self.runs)


def _success(outcome: float | None) -> bool:
    return outcome is not None and outcome >= 0.5


def load_runs(path: str | Path) -> list[tuple[RecordedRun, Path]]:
    """Recorded runs in a file or under a folder (sorted), each with the file it came from."""
    p = Path(path)
    files = sorted(p.rglob("*.json")) if p.is_dir() else [p]
    return [(load_recorded(f), f) for f in files]


def group_runs(runs: Sequence[tuple[RecordedRun, Path]], by: GroupBy = "task") -> list[Group]:
    """Sibling groups, in the order their first run comes; a group's name says what its runs
    share."""
    keyed: dict[str, list[RecordedRun]] = {}
    labels: dict[str, str] = {}
    for run, path in runs:
        if by == "folder":
            key = label = str(path.parent)
        elif by == "name":
            key = label = run.name.split("__")[0]
        elif by == "task":
            key = hashlib.sha256(run.task.encode()).hexdigest()[:12]
            label = f"{run.name.split('__')[0]} (task {key})"
        else:
            raise ValueError(f"group_by={by!r}; use task, folder or name")
        keyed.setdefault(key, []).append(run)
        labels.setdefault(key, label)
    return [Group(labels[k], tuple(v)) for k, v in keyed.items()]


# -- select: pick accuracy
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class GroupPick:
    """One group's picks: by the chosen method, by the last step's pointwise score, and its
    random baseline."""

    group: str
    runs: list[str]
    outcomes: list[float | None]
    pick: str | None
    pointwise_pick: str | None
    selection: Selection
    pointwise_scores: dict[str, float | None]

    def _succeeded(self, name: str | None) -> bool | None:
        if name is None or any(o is None for o in self.outcomes):
            return None
        return _success(self.outcomes[self.runs.index(name)])

    @property
    def pick_success(self) -> bool | None:
        """The pick succeeded (None: no pick, or an outcome unknown)."""
        return self._succeeded(self.pick)

    @property
    def pointwise_success(self) -> bool | None:
        """The last step's pointwise pick succeeded."""
        return self._succeeded(self.pointwise_pick)

    @property
    def random_success(self) -> float | None:
        """A random pick's chance of success: the share of successful runs (None: an outcome
        unknown)."""
        if any(o is None for o in self.outcomes) or not self.outcomes:
            return None
        return sum(_success(o) for o in self.outcomes) / len(self.outcomes)


@dataclass(slots=True)
class SelectReport:
    """What `agent-monitor select` prints and writes."""

    method: Literal["pointwise", "pairwise"]
    picks: list[GroupPick]
    calls: int = 0
    """Judge calls made (a judge without a `calls` counter: 0); results from the cache cost none."""
    usage: Usage = field(default_factory=Usage)

    @property
    def known(self) -> list[GroupPick]:
        """The groups whose every outcome is known."""
        return [g for g in self.picks if g.random_success is not None]

    def _share(self, flags: Sequence[bool | None]) -> float | None:
        # A group with no pick (every call failed) counts as a miss: the selector gave nothing.
        n = len(self.known)
        return sum(bool(f) for f in flags) / n if n else None

    @property
    def accuracy(self) -> float | None:
        """Share of groups (outcomes known) whose pick succeeded."""
        return self._share([g.pick_success for g in self.known])

    @property
    def pointwise_accuracy(self) -> float | None:
        """The same for the pick by the last step's pointwise score."""
        return self._share([g.pointwise_success for g in self.known])

    @property
    def random_accuracy(self) -> float | None:
        """A random pick's expected accuracy (exact)."""
        n = len(self.known)
        return sum(g.random_success or 0.0 for g in self.known) / n if n else None

    @property
    def oracle(self) -> float | None:
        """Share of groups with at least one successful run: the best any pick can do."""
        return self._share([(g.random_success or 0.0) > 0 for g in self.known])

    @property
    def hits(self) -> int:
        """Groups (outcomes known) whose pick succeeded."""
        return sum(bool(g.pick_success) for g in self.known)

    @property
    def chance(self) -> float | None:
        """The probability that random picks succeed in at least as many groups as these picks did
        (exact).

        A random pick succeeds in each group independently with its share of successes (a Poisson
        binomial); a small value says the picks beat random beyond luck, a large one that they may
        not.
        """
        if not self.known:
            return None
        dist = [1.0]  # dist[j]: probability of exactly j successes over the groups so far
        for g in self.known:
            p = g.random_success or 0.0
            dist = [
                (dist[j] if j < len(dist) else 0.0) * (1 - p) + (dist[j - 1] * p if j else 0.0)
                for j in range(len(dist) + 1)
            ]
        return sum(dist[self.hits :])


async def select_groups(
    groups: Sequence[Group],
    *,
    judge: Judge,
    pairwise: bool = False,
    criteria: CriteriaSpec = None,
    repeats: int = 1,
    min_mass: float | None = None,
    max_steps: int | None = None,
    pivots: int = DEFAULT_PIVOTS,
    rings: int = 1,
    seed: int = 0,
    max_chars: int = DEFAULT_PAIR_CHARS,
    cache: ScoreCache | None = None,
    on_call: Callable[[str], object] | None = None,
) -> SelectReport:
    """Pick the best run of each group; the pointwise pick by the latest score always comes along.

    A run's pointwise score is the latest one it got, prefix by prefix as live (up to `max_steps`;
    a step whose scoring failed, e.g. a prompt over the judge's context, keeps the one before).
    Scores and comparisons are cached in `cache` (the same cache and keys as `eval`: after an
    `eval` with the same `max_steps` the pointwise scores are free).
    """
    rubric = load_criteria(criteria)
    mass = recommended_min_mass(judge) if min_mass is None else min_mass
    report = SelectReport("pairwise" if pairwise else "pointwise", [])
    # The judge's own counters: results served from the cache cost no call, and are not counted.
    calls0, usage0 = getattr(judge, "calls", 0), getattr(judge, "usage", Usage())
    for g in groups:
        names = [r.name for r in g.runs]
        if len(set(names)) != len(names):
            names = [f"{i}:{n}" for i, n in enumerate(names)]
        curves = await score_runs(
            g.runs,
            judge=judge,
            criteria=rubric,
            min_mass=min_mass,
            repeats=repeats,
            max_steps=max_steps,
            cache=cache,
            on_step=(lambda run, p: on_call(f"{run.name} step {p.step}")) if on_call else None,
        )
        # As live: a run's pointwise standing is its latest score (a step whose scoring failed keeps
        # the one before).
        scores = {
            n: next((x for x in reversed(c.scores) if x is not None), None)
            for n, c in zip(names, curves, strict=True)
        }
        pointwise = _pick_pointwise(names, scores)
        if pairwise:
            texts = {
                n: [s.text for s in (r.steps[:max_steps] if max_steps else r.steps)]
                for n, r in zip(names, g.runs, strict=True)
            }
            task = g.runs[0].task
            fresh: list[Comparison] = []

            async def cmp(
                a: str,
                b: str,
                texts: dict[str, list[str]] = texts,
                task: str = task,
                fresh: list[Comparison] = fresh,
                label: str = g.name,
            ) -> Comparison:
                key = pair_key(
                    judge, rubric.hash, mass, repeats, max_chars, task, texts[a], texts[b]
                )
                hit = cache.get_pair(key) if cache else None
                if hit is not None:
                    return hit
                c = await compare(
                    task,
                    texts[a],
                    texts[b],
                    judge=judge,
                    criteria=rubric,
                    repeats=repeats,
                    min_mass=min_mass,
                    max_chars=max_chars,
                )
                fresh.append(c)
                if cache:
                    cache.put_pair(key, c)
                if on_call:
                    on_call(f"{label}: {a} vs {b}")
                return c

            t = await tournament(names, cmp, pivots=pivots, repeats=rings, seed=seed)
            usage = sum((c.usage for c in fresh), Usage())
            sel = Selection(
                "pairwise",
                t.winner,
                t.ranking,
                dict(t.wins),
                sum(c.calls for c in fresh),
                usage,
                t.failed,
                t.reason,
                tournament=t,
            )
        else:
            sel = pointwise
        report.picks.append(
            GroupPick(
                g.name,
                names,
                [r.outcome for r in g.runs],
                sel.winner,
                pointwise.winner,
                sel,
                scores,
            )
        )
    report.calls = getattr(judge, "calls", 0) - calls0
    u = getattr(judge, "usage", Usage())
    report.usage = Usage(
        u.input_tokens - usage0.input_tokens,
        u.cached_input_tokens - usage0.cached_input_tokens,
        u.output_tokens - usage0.output_tokens,
    )
    return report


def _pick_pointwise(names: list[str], scores: Mapping[str, float | None]) -> Selection:
    ranking = sorted(names, key=lambda k: (scores[k] is None, -(scores[k] or 0.0), names.index(k)))
    unscored = sum(scores[n] is None for n in names)
    winner = ranking[0] if ranking and scores[ranking[0]] is not None else None
    return Selection(
        "pointwise",
        winner,
        ranking,
        dict(scores),
        0,
        Usage(),
        unscored,
        "no_score" if unscored else None,
    )


def select_summary(report: SelectReport) -> str:
    """The selection report as readable text: per group, then the accuracies and a verdict."""
    lines = [f"{'group':<44} {'runs':>4} {'ok':>3}  {'pick':<30} {'':>7}  {'pointwise pick':<30}"]
    for g in report.picks:
        ok = sum(_success(o) for o in g.outcomes)
        mark = {True: "success", False: "failure", None: "?"}
        pick = g.pick or f"none ({g.selection.reason})"
        lines.append(
            f"{_short(g.group, 44):<44} {len(g.runs):>4} {ok:>3}  {_short(pick, 30):<30} "
            f"{mark[g.pick_success]:>7}  "
            f"{_short(g.pointwise_pick or 'none', 30):<30} {mark[g.pointwise_success]}"
        )
    known = report.known
    lines.append("")
    lines.append(
        f"{len(known)} groups with known outcomes; pick accuracy ({report.method}): "
        f"{_pct(report.accuracy)}; "
        f"by the latest pointwise score: {_pct(report.pointwise_accuracy)}; random pick "
        "(expected): "
        f"{_pct(report.random_accuracy)}; best possible (a group with a success): "
        f"{_pct(report.oracle)}"
    )
    chance = report.chance
    if report.accuracy is not None and report.random_accuracy is not None and chance is not None:
        lines.append(
            f"random picks succeed in at least {report.hits} of these {len(known)} groups "
            "with probability "
            f"{chance:.0%} (exact)"
        )
        if report.accuracy <= report.random_accuracy:
            lines.append(
                f"verdict: no better than a random pick: this judge's {report.method} picks "
                "do not find the "
                "successful runs; do not let it choose for you"
            )
        elif chance > 0.05:
            lines.append(
                "verdict: not distinguishable from a random pick: "
                f"{report.accuracy - report.random_accuracy:.0%} "
                f"above its expected accuracy, but random picks do as well {chance:.0%} of "
                "the time; judge more "
                "groups (or use a stronger judge) before trusting it"
            )
        else:
            lines.append(
                "verdict: better than a random pick by "
                f"{report.accuracy - report.random_accuracy:.0%} (random "
                f"picks do as well {chance:.1%} of the time)"
            )
    failed = sum(g.selection.failed for g in report.picks)
    if failed:
        lines.append(f"{failed} judge results failed (left out; see the JSON report for reasons)")
    lines.append(f"judge calls made: {report.calls} (cached results cost none)")
    return "\n".join(lines)


def select_json(report: SelectReport) -> dict[str, Any]:
    """The selection report as JSON-ready data."""
    groups = []
    for g in report.picks:
        t = g.selection.tournament
        groups.append(
            {
                "group": g.group,
                "runs": [
                    {
                        "name": n,
                        "outcome": o,
                        "pointwise_score": g.pointwise_scores.get(n),
                        "win_mass": t.wins.get(n) if t else None,
                    }
                    for n, o in zip(g.runs, g.outcomes, strict=True)
                ],
                "pick": g.pick,
                "pick_success": g.pick_success,
                "pointwise_pick": g.pointwise_pick,
                "pointwise_success": g.pointwise_success,
                "random_success": g.random_success,
                "ranking": g.selection.ranking,
                "failed": g.selection.failed,
                "reason": g.selection.reason,
                "comparisons": t.comparisons if t else None,
                "pivots": t.pivots if t else None,
            }
        )
    return {
        "method": report.method,
        "groups": groups,
        "accuracy": report.accuracy,
        "pointwise_accuracy": report.pointwise_accuracy,
        "random_accuracy": report.random_accuracy,
        "oracle": report.oracle,
        "random_at_least_as_good": report.chance,
        "calls": report.calls,
    }


# -- eval --groups: what pruning keeps and saves
# ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sibling:
    """A scored recorded run in a group: its curve and its steps' offsets from its start (seconds
    or indexes)."""

    curve: RunCurve
    times: tuple[float, ...]


def siblings(runs: Sequence[RecordedRun], curves: Sequence[RunCurve]) -> list[Sibling]:
    """Scored runs with their steps' times relative to each run's start (step indexes when any
    run lacks times)."""
    pairs = list(zip(runs, curves, strict=True))
    timed = all(s.timestamp is not None for r, c in pairs for s in r.steps[: len(c.scores)])
    out = []
    for r, c in pairs:
        steps = r.steps[: len(c.scores)]
        if timed and steps:
            t0 = steps[0].timestamp
            times = tuple((s.timestamp - t0).total_seconds() for s in steps if s.timestamp and t0)
        else:
            times = tuple(float(i) for i in range(len(steps)))
        out.append(Sibling(c, times))
    return out


@dataclass(frozen=True, slots=True)
class Replayed:
    """One group replayed: the step each pruned run was stopped after (by run index), and the
    steps run."""

    pruned: dict[int, int]
    steps: int
    saved: int


def replay_group(group: str, runs: Sequence[Sibling], policy: Policy) -> Replayed:
    """The group's runs through the live group policy, all launched at once, their steps in time
    order."""
    state = GroupState(group, policy)
    ids = [f"{i}" for i in range(len(runs))]
    for rid in ids:
        state.join(rid)
    events = sorted(
        ((t, step, i) for i, s in enumerate(runs) for step, t in enumerate(s.times, 1)),
        key=lambda e: (e[0], e[1], e[2]),
    )
    pruned: dict[int, int] = {}
    for _t, step, i in events:
        if i in pruned:
            continue
        c = runs[i].curve
        score = c.scores[step - 1]
        unc = c.uncertainties[step - 1] if step - 1 < len(c.uncertainties) else None
        update = state.observe(
            ids[i], step=step, score=score, uncertainty=unc, ok=score is not None
        )
        for p in update.prunes:
            pruned[int(p.run_id)] = p.step
        if step == len(runs[i].times) and i not in pruned:
            state.end(ids[i])
    total = sum(len(s.times) for s in runs)
    saved = sum(len(runs[i].times) - at for i, at in pruned.items())
    return Replayed(pruned, total, saved)


@dataclass(frozen=True, slots=True)
class PruneRow:
    """One setting of keep_top / prune_margin over every group, with random pruning at the same
    budget."""

    keep_top: int
    prune_margin: float
    tasks: int
    tasks_with_success: int
    kept: int
    """Of the tasks with a success, those where a succeeding run was never pruned (best-of-N
    kept)."""
    steps_saved: float | None
    pruned_runs: int
    pruned_successes: int
    random_kept: float | None
    """The same for random pruning at the same step budget, averaged over seeds."""
    random_steps_saved: float | None


@dataclass(slots=True)
class PruneReport:
    """What `agent-monitor eval --groups` prints and writes."""

    policy: Policy
    rows: list[PruneRow]
    seeds: int
    groups: int


def _random_prune(runs: Sequence[Sibling], real: Replayed, rng: random.Random) -> dict[int, int]:
    """As many runs as the policy pruned, at random, each stopped after the step count of one of
    its prunes."""
    if not real.pruned:
        return {}
    chosen = rng.sample(range(len(runs)), len(real.pruned))
    stops = list(real.pruned.values())
    rng.shuffle(stops)
    return {i: at for i, at in zip(chosen, stops, strict=True) if at < len(runs[i].times)}


def _kept(runs: Sequence[Sibling], pruned: Mapping[int, int]) -> bool:
    return any(s.curve.success and i not in pruned for i, s in enumerate(runs))


def prune_report(
    groups: Sequence[tuple[str, Sequence[Sibling]]],
    *,
    policy: Policy | None = None,
    keep_tops: Sequence[int] = DEFAULT_KEEP_TOPS,
    margins: Sequence[float] = DEFAULT_MARGINS,
    seeds: int = DEFAULT_SEEDS,
    seed: int = 0,
) -> PruneReport:
    """Every setting of the grid replayed through the live group policy, and random pruning at
    the same budget."""
    base = policy or Policy()
    rows = []
    for k in keep_tops:
        for m in margins:
            pol = dataclasses.replace(base, keep_top=k, prune_margin=m)
            tasks = with_success = kept = pruned_runs = pruned_successes = 0
            total = saved = 0
            replays: list[tuple[Sequence[Sibling], Replayed]] = []
            for name, runs in groups:
                r = replay_group(name, runs, pol)
                replays.append((runs, r))
                tasks += 1
                total += r.steps
                saved += r.saved
                pruned_runs += len(r.pruned)
                pruned_successes += sum(bool(runs[i].curve.success) for i in r.pruned)
                if any(s.curve.success for s in runs):
                    with_success += 1
                    kept += _kept(runs, r.pruned)
            rng = random.Random(seed)
            random_kept: list[float] = []
            random_saved: list[float] = []
            for _ in range(seeds):
                k_sum = s_sum = 0
                for runs, r in replays:
                    fake = _random_prune(runs, r, rng)
                    s_sum += sum(len(runs[i].times) - at for i, at in fake.items())
                    if any(s.curve.success for s in runs):
                        k_sum += _kept(runs, fake)
                random_kept.append(k_sum)
                random_saved.append(s_sum / total if total else 0.0)
            rows.append(
                PruneRow(
                    keep_top=k,
                    prune_margin=m,
                    tasks=tasks,
                    tasks_with_success=with_success,
                    kept=kept,
                    steps_saved=saved / total if total else None,
                    pruned_runs=pruned_runs,
                    pruned_successes=pruned_successes,
                    random_kept=sum(random_kept) / len(random_kept) if random_kept else None,
                    random_steps_saved=sum(random_saved) / len(random_saved)
                    if random_saved
                    else None,
                )
            )
    return PruneReport(base, rows, seeds, len(groups))


def prune_summary(report: PruneReport) -> str:
    """The pruning report as readable text."""
    pol = report.policy
    lines = [
        f"group pruning on {report.groups} groups of siblings (launched together; steps in "
        "recorded time order, by step index without timestamps), "
        f"min_steps {pol.min_steps}, patience {pol.patience}, max_uncertainty "
        f"{pol.max_uncertainty:g}; random "
        f"pruning at the same budget averaged over {report.seeds} seeds",
        "",
        f"{'keep_top':>8} {'margin':>6}  {'tasks w/ success':>16} {'best-of-N kept':>14} "
        f"{'steps saved':>11} "
        f"{'runs pruned':>11} {'successes pruned':>16}  {'random: kept':>12} {'steps saved':>11}",
    ]
    for r in report.rows:
        lines.append(
            f"{r.keep_top:>8} {r.prune_margin:>6.2f}  {r.tasks_with_success:>16} {r.kept:>14} "
            f"{_pct(r.steps_saved):>11} "
            f"{r.pruned_runs:>11} {r.pruned_successes:>16}  {_num(r.random_kept):>12} "
            f"{_pct(r.random_steps_saved):>11}"
        )
    if not any(r.pruned_runs for r in report.rows):
        lines.append(
            "\nverdict: the group policy pruned nothing at any setting: this judge's scores "
            "never put a run "
            "far enough below its siblings, beyond their uncertainty, for patience steps"
        )
    else:
        worse = [
            r
            for r in report.rows
            if r.pruned_runs and r.random_kept is not None and r.kept <= r.random_kept
        ]
        if len(worse) == sum(bool(r.pruned_runs) for r in report.rows):
            lines.append(
                "\nverdict: no better than random pruning: at every setting that prunes, "
                "random pruning at the "
                "same budget keeps a succeeding run in as many tasks or more"
            )
    return "\n".join(lines)


def prune_json(report: PruneReport) -> dict[str, Any]:
    """The pruning report as JSON-ready data."""
    return {
        "policy": report.policy.as_dict(),
        "groups": report.groups,
        "seeds": report.seeds,
        "rows": [dataclasses.asdict(r) for r in report.rows],
    }


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
