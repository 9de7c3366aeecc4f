"""Groups flagged early (issue 31), replayed as an RL trainer would: steps generated with and
without the signal.

The Terminal-Bench 2.1 runs in ../shared/data are six tasks x five rollouts (16 pass, 14 fail). Each
task is one group (`start.group`), replayed live through the daemon (`Monitor.handle`, the same path
as MQTT): step k of every rollout of the group, then the scorings drained, then the group's early
call read from the group book (what the retained ranking's `uniform` field says), as a trainer
generating its rollouts in lockstep would see it. A trainer using the signal stops generating a
group when it is flagged (cancel it, resample the prompt); one without it generates every step. All
rollouts are then played to their end anyway, so each call can be checked against the recorded
outcomes.

Calibration: one family for all six tasks (five runs of one task teach nothing), under the policy's
window (`--min-steps`, `--patience`). Two ways:

- sequential: groups in order, the daemon learning from each group's ended runs, as a trainer's
  monitor would (the first groups can never be flagged: no evidence yet);
- leave-one-group-out (LOGO): each group replayed on a fresh daemon holding the other five groups'
  runs (the most evidence these data allow).

The six real groups are all mixed (every task has a pass and a fail): the right call is never to
flag, so on them the benchmark measures wrong calls, and the steps a wrong call would have thrown
away. To show the saving on groups that *are* uniform, five more groups are built from same-outcome
runs across tasks (3 all-pass, 2 all-fail; LOGO only; built, not recorded as groups: said in the
output).

Judges: `scripted` (the letter follows the recorded outcome: a pass drifts up, a fail down, with
seeded noise, so early steps are ambiguous), and `local` (the packaged Gemma 3 270M in-process, a
weak judge; its scores of the sequential pass are recorded per (run, step) and the other modes
replay them: the model is deterministic and each run's prompt depends only on that run, so a
rescoring would give the same scores and cost as much again). `--max-steps` caps every rollout
(figures are for the capped runs).

    .venv/bin/python bench/rl_groups.py [--judge scripted|local|both] [--max-steps 12] [--levels
    0.9,0.75,0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from _common import REPO, configure_logs, gemma_path, load1

from agent_monitor.calibration import Sample
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.judges.base import BaseJudge, JudgeError, JudgeRequest, JudgeResponse
from agent_monitor.offline.recorded import RecordedRun, load_recorded
from agent_monitor.policy import Policy
from agent_monitor.progress import Usage
from agent_monitor.scale import LETTERS

DATA = next(
    (p / "shared" / "data" for p in REPO.parents if (p / "shared" / "data").is_dir()), REPO / "data"
)
FAMILY = "terminal-bench-2.1"


@dataclass(frozen=True)
class Rollout:
    """One recorded rollout: its id, group, task, steps (capped) and outcome."""

    run_id: str
    task: str
    text: str
    steps: tuple[str, ...]
    success: bool


def load(max_steps: int, max_step_chars: int) -> dict[str, list[Rollout]]:
    """The six groups (one per task), each of its five rollouts capped at `max_steps` agent
    steps."""
    root = DATA / "terminal-bench-2.1"
    if not root.is_dir():
        sys.exit(f"no recorded runs under {root}; see ../shared/data/README.md")
    groups: dict[str, list[Rollout]] = {}
    for task_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in sorted(task_dir.glob("*.json")):
            r: RecordedRun = load_recorded(f, max_step_chars=max_step_chars)
            run_id = f.stem.removesuffix("_trajectory")
            steps = tuple(s.text for s in r.steps[:max_steps])
            groups.setdefault(task_dir.name, []).append(
                Rollout(run_id, task_dir.name, r.task, steps, bool(r.outcome and r.outcome >= 0.5))
            )
    return groups


# -- judges
# --------------------------------------------------------------------------------------------------


class OutcomeJudge(BaseJudge):
    """A scripted judge whose letter follows the run's recorded outcome, with seeded noise (by
    run and step)."""

    name = "scripted"

    def __init__(self, rollouts: Sequence[Rollout], noise: float) -> None:
        super().__init__(max_retries=0)
        self.model = "scripted-outcome"
        self.of = {r.run_id: r for r in rollouts}
        self.noise = noise

    def score(self, run_id: str, step: int) -> float:
        r = self.of[run_id]
        x = step / max(1, len(r.steps))
        mean = 0.45 + 0.4 * x if r.success else 0.45 - 0.25 * x  # ambiguous early, apart late
        rng = random.Random(hashlib.sha256(f"{run_id}/{step}".encode()).digest())
        return min(1.0, max(0.0, rng.gauss(mean, self.noise)))

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        assert request.run_key is not None
        letter = LETTERS[
            round(self.score(request.run_key, request.prompt.step) * (len(LETTERS) - 1))
        ]
        return JudgeResponse(
            samples=({letter: 0.0},) * request.repeats, model=self.model, usage=Usage(1, 0, 1)
        )


class Recording(BaseJudge):
    """A judge's answers kept per (run, step); `replay=True`: answer from them without the judge."""

    def __init__(self, inner: BaseJudge | None, name: str, model: str) -> None:
        super().__init__(max_retries=0, timeout_s=600.0, concurrency=1)
        self.inner, self.name, self.model = inner, name, model
        # the judge's recommendation (Gemma 270M: 0.05)
        self.min_mass = getattr(inner, "min_mass", None)
        self.answers: dict[tuple[str | None, int], JudgeResponse | JudgeError] = {}
        self.replay = False
        self.seconds = 0.0

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        key = (request.run_key, request.prompt.step)
        if self.replay:
            got = self.answers[key]
            if isinstance(got, JudgeError):
                raise got  # a failure replays as the same failure
            return got
        assert self.inner is not None
        start = time.perf_counter()
        try:
            got = await self.inner.grade(request)
        except JudgeError as e:
            self.answers[key] = e
            raise
        finally:
            self.seconds += time.perf_counter() - start
        self.answers[key] = got
        return got


# -- the replay
# -----------------------------------------------------------------------------------------------


@dataclass
class GroupResult:
    """One group's replay: its rollouts, and per round (step k of every rollout) the two calls'
    confidences."""

    name: str
    rollouts: list[Rollout]
    built: bool = False
    rounds: list[tuple[float, float]] = field(default_factory=list)
    """Per round k = 1..: (confidence of all_fail, confidence of all_pass) after round k was
    scored."""
    published: list[str | None] = field(default_factory=list)
    """Per round: the call the group book published (at the daemon's own uniform_confidence)."""

    @property
    def generated(self) -> int:
        return sum(len(r.steps) for r in self.rollouts)

    def flag(self, level: float) -> tuple[str, int] | None:
        """The first (call, round) at which a call reached `level`."""
        for k, (fail, ok) in enumerate(self.rounds, start=1):
            if fail >= level:
                return "all_fail", k
            if ok >= level:
                return "all_pass", k
        return None

    def with_signal(self, level: float) -> int:
        got = self.flag(level)
        return (
            self.generated if got is None else sum(min(len(r.steps), got[1]) for r in self.rollouts)
        )

    def wrong(self, level: float) -> bool:
        got = self.flag(level)
        if got is None:
            return False
        return (
            any(r.success for r in self.rollouts)
            if got[0] == "all_fail"
            else not all(r.success for r in self.rollouts)
        )


def config(policy: Policy) -> MonitorConfig:
    return MonitorConfig(policy=policy, circuit_threshold=10_000, max_concurrency=4)


async def replay_group(
    mon: Monitor, name: str, rollouts: list[Rollout], built: bool = False
) -> GroupResult:
    """One group live through the daemon, in lockstep rounds; every rollout played to its end,
    then ended."""

    async def send(run_id: str, kind: str, body: dict[str, Any]) -> None:
        await mon.handle(f"agents/{run_id}/{kind}", json.dumps(body).encode())

    for r in rollouts:
        await send(r.run_id, "start", {"task": r.text, "family": FAMILY, "group": name})
    result = GroupResult(name, rollouts, built)
    for k in range(1, max(len(r.steps) for r in rollouts) + 1):
        for r in rollouts:
            if k <= len(r.steps):
                await send(r.run_id, "step", {"index": k, "text": r.steps[k - 1]})
        await mon.drain()
        g = mon.groups.groups[name]
        n = len(g.members)
        result.rounds.append(
            (
                1 - n * max(m.fail_p for m in g.members.values()),
                1 - n * max(m.pass_p for m in g.members.values()),
            )
        )
        flag = mon.groups.uniform(name)
        result.published.append(flag["call"] if flag else None)
    for r in rollouts:
        await send(r.run_id, "end", {"outcome": "success" if r.success else "failure"})
    await mon.drain()
    return result


async def sequential(
    judge: BaseJudge, groups: dict[str, list[Rollout]], policy: Policy
) -> tuple[list[GroupResult], list[Sample], dict[str, float]]:
    """The groups in order on one daemon that learns from each group's ended runs; also its
    scorings by result."""
    out = []
    async with Monitor(config(policy), judge=judge) as mon:
        for name, rollouts in groups.items():
            out.append(await replay_group(mon, name, rollouts))
        samples = list(mon.calibration.samples())
        scorings = {
            s.labels.get("outcome") or s.labels.get("reason", "?"): s.value
            for metric in mon.registry.collect()
            if metric.name in ("agent_monitor_scorings", "agent_monitor_scoring_failures")
            for s in metric.samples
            if s.name.endswith("_total") and s.value
        }
    return out, samples, scorings


async def logo(
    judge: BaseJudge,
    groups: dict[str, list[Rollout]],
    samples: list[Sample],
    policy: Policy,
    *,
    built: bool = False,
) -> list[GroupResult]:
    """Each group on a fresh daemon holding every other run's sample (runs of the group itself
    left out)."""
    out = []
    for name, rollouts in groups.items():
        mine = {r.run_id for r in rollouts}
        async with Monitor(config(policy), judge=judge) as mon:
            for s in samples:
                if s.run_id.split("@")[0] not in mine:
                    mon.calibration.add(s)
            out.append(await replay_group(mon, name, rollouts, built))
    return out


def built_groups(groups: dict[str, list[Rollout]]) -> dict[str, list[Rollout]]:
    """Uniform groups of five built from same-outcome rollouts across tasks (3 all-pass, 2
    all-fail)."""
    every = [r for rs in groups.values() for r in rs]
    passes = [r for r in every if r.success]
    fails = [r for r in every if not r.success]
    out = {f"built-pass-{i + 1}": passes[5 * i : 5 * i + 5] for i in range(len(passes) // 5)}
    out.update({f"built-fail-{i + 1}": fails[5 * i : 5 * i + 5] for i in range(len(fails) // 5)})
    return out


# -- figures
# --------------------------------------------------------------------------------------------------


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """The exact binomial interval for k of n (bisection on the binomial tail; no scipy)."""
    if n == 0:
        return (0.0, 1.0)
    a = (1 - conf) / 2

    def tail_ge(p: float) -> float:  # P(X >= k)
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))

    def tail_le(p: float) -> float:  # P(X <= k)
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, k + 1))

    def solve(f: Any, target: float, increasing: bool) -> float:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if (f(mid) < target) == increasing:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(tail_ge, a, True)
    upper = 1.0 if k == n else solve(tail_le, a, False)
    return lower, upper


def bootstrap_saved(
    results: list[GroupResult], level: float, reps: int = 2000
) -> tuple[float, float]:
    """A percentile bootstrap interval (over groups) for the share of steps the signal saves."""
    rng = random.Random(0)
    shares = []
    for _ in range(reps):
        pick = [results[rng.randrange(len(results))] for _ in results]
        gen = sum(r.generated for r in pick)
        shares.append(1 - sum(r.with_signal(level) for r in pick) / gen if gen else 0.0)
    shares.sort()
    return shares[int(0.025 * reps)], shares[int(0.975 * reps) - 1]


def report(
    title: str, results: list[GroupResult], levels: Sequence[float], daemon_level: float
) -> list[str]:
    lines = [f"### {title}", ""]
    head = "| group | runs (pass) | steps generated | highest confidence (all_fail / all_pass) | "
    head += " | ".join(f"with signal @{lv:g} (call, round)" for lv in levels)
    lines += [head + " |", "|" + "---|" * (4 + len(levels))]
    for r in results:
        cells = []
        for lv in levels:
            got = r.flag(lv)
            what = (
                "no flag"
                if got is None
                else (f"{got[0]} r{got[1]}{' WRONG' if r.wrong(lv) else ''}")
            )
            cells.append(f"{r.with_signal(lv)} ({what})")
        passes = sum(x.success for x in r.rollouts)
        # 1 - N * max p is below 0 while some member has no call: shown as 0.
        top = (
            f"{max(0.0, *(f for f, _ in r.rounds)):.2f} / {max(0.0, *(p for _, p in r.rounds)):.2f}"
        )
        lines.append(
            f"| {r.name} | {len(r.rollouts)} ({passes}) | {r.generated} | {top} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("")
    for lv in levels:
        flags = [r for r in results if r.flag(lv) is not None]
        wrong = sum(r.wrong(lv) for r in results)
        gen = sum(r.generated for r in results)
        saved = 1 - sum(r.with_signal(lv) for r in results) / gen
        lo, hi = clopper_pearson(wrong, len(flags))
        glo, ghi = clopper_pearson(wrong, len(results))
        slo, shi = bootstrap_saved(results, lv)
        lines.append(
            f"- level {lv:g}: {len(flags)} of {len(results)} groups flagged; wrong early "
            f"calls {wrong} "
            f"(of the groups: {wrong}/{len(results)}, 95% CI {glo:.2f}-{ghi:.2f}; of the "
            f"flags: {wrong}/{len(flags)}, "
            f"95% CI {lo:.2f}-{hi:.2f}); steps saved {saved:.1%} (bootstrap over groups, 95% "
            f"CI {slo:.1%}-{shi:.1%})"
        )
    # The daemon's own published flag agrees with the per-round confidences at its level.
    for r in results:
        got = r.flag(daemon_level)
        first = next(((c, k) for k, c in enumerate(r.published, start=1) if c), None)
        assert (got is None and first is None) or (got is not None and first == got), (
            r.name,
            got,
            first,
        )
    return [*lines, ""]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", choices=("scripted", "local", "both"), default="both")
    ap.add_argument(
        "--max-steps",
        type=int,
        default=12,
        help="cap on each rollout's agent steps (bounds runtime)",
    )
    ap.add_argument(
        "--max-step-chars",
        type=int,
        default=600,
        help="each step's text clipped to this (local judge context)",
    )
    ap.add_argument("--levels", default="0.9,0.75,0.5", help="uniform_confidence levels reported")
    ap.add_argument("--min-steps", type=int, default=2)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument(
        "--noise", type=float, default=0.15, help="the scripted judge's noise (sd of the score)"
    )
    args = ap.parse_args()
    configure_logs("error")  # the weak judge's low-mass failures are counted below, not logged
    levels = [float(x) for x in args.levels.split(",")]
    policy = Policy(
        min_steps=args.min_steps, patience=args.patience, uniform_confidence=min(levels)
    )
    groups = load(args.max_steps, args.max_step_chars)
    every = [r for rs in groups.values() for r in rs]
    print(f"load average at start: {load1()}")
    print(
        f"{len(groups)} groups x {len(every) // len(groups)} rollouts, "
        f"{sum(r.success for r in every)} pass; "
        f"steps capped at {args.max_steps}; policy min_steps={args.min_steps} "
        f"patience={args.patience}"
    )
    print(
        "six groups is few: every interval below is wide; read the figures as a smoke test "
        "of the rule.\n"
    )
    judges: list[tuple[str, BaseJudge]] = []
    if args.judge in ("scripted", "both"):
        judges.append(
            ("scripted", Recording(OutcomeJudge(every, args.noise), "scripted", "scripted-outcome"))
        )
    if args.judge in ("local", "both"):
        from agent_monitor.judges.llamacpp import LlamaCppJudge, TinyJudgeWarning

        with warnings.catch_warnings():
            # known: a weak judge, said in the report
            warnings.simplefilter("ignore", TinyJudgeWarning)
            inner = LlamaCppJudge(gemma_path())
        await inner.load()
        judges.append(("local (Gemma 3 270M)", Recording(inner, "llamacpp", inner.model)))
    for label, judge in judges:
        start = time.perf_counter()
        seq, samples, scorings = await sequential(judge, groups, policy)
        live_s = time.perf_counter() - start
        judge.replay = True  # the other modes read the same scores again (see the module docs)
        loo = await logo(judge, groups, samples, policy)
        built = await logo(judge, built_groups(groups), samples, policy, built=True)
        out = [
            f"## Judge: {label}",
            f"live sequential pass: {live_s:.1f} s wall, "
            f"{judge.seconds:.1f} s in the judge, "
            f"{len(judge.answers)} judge answers; scorings by result {scorings}; load "
            f"average now {load1()}",
            "",
        ]
        out += report(
            "The six recorded groups, calibration learnt group by group (sequential)",
            seq,
            levels,
            min(levels),
        )
        out += report(
            "The six recorded groups, calibration on the other five (LOGO)",
            loo,
            levels,
            min(levels),
        )
        out += report(
            "Built uniform groups (same-outcome rollouts across tasks; LOGO)",
            built,
            levels,
            min(levels),
        )
        print("\n".join(out), flush=True)  # each judge's figures as soon as they are in
    print(f"load average at end: {load1()}")


if __name__ == "__main__":
    asyncio.run(main())
