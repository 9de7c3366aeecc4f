"""Best of N on recorded runs: select's pick accuracy and eval --groups' pruning figures, on
scripted judges."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.offline import evaluate as ev
from agent_monitor.offline import groupeval as ge
from agent_monitor.offline.recorded import RecordedRun, RecordedStep
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.scale import LETTERS
from agent_monitor.testing import FakeJudge
from tests.openai_server import Reply, chat_choice, chat_reply, scripted_server

# Per run: the letter its trajectory earns at each step (pointwise), and its outcome.
LEVELS = {"hi": 12, "mid": 7, "lo": 2}


def run(task: str, kind: str, i: int, outcome: float, steps: int = 6) -> RecordedRun:
    return RecordedRun(
        f"{task}__{kind}{i}",
        f"Solve {task}",
        tuple(RecordedStep(f"{kind} run step {k}") for k in range(steps)),
        outcome,
    )


def level(text: str) -> int:
    m = re.search(r"(hi|mid|lo) run step", text)
    assert m
    return LEVELS[m.group(1)]


def pointwise(prompt: Prompt) -> str:
    return LETTERS[level(prompt.prefix_text())]


def judge_both(prompt: Prompt) -> str:
    """Pointwise: the run's level. Pairwise: 9 + level(second) - level(first) (letters J..

    either way).
    """
    text = prompt.prefix_text()
    if "## Trajectory 2" not in text:
        return pointwise(prompt)
    one, two = text.split("## Trajectory 2")
    diff = level(two) - level(one.split("## Trajectory 1")[1])
    return LETTERS[max(0, min(19, 9 + diff))]


def groups() -> list[ge.Group]:
    # alpha: the high run succeeds; beta: the high run fails, a mid one succeeds; gamma: no run
    # succeeds.
    return [
        ge.Group(
            "alpha",
            (run("alpha", "lo", 0, 0.0), run("alpha", "hi", 1, 1.0), run("alpha", "mid", 2, 0.0)),
        ),
        ge.Group(
            "beta",
            (run("beta", "hi", 0, 0.0), run("beta", "mid", 1, 1.0), run("beta", "lo", 2, 1.0)),
        ),
        ge.Group("gamma", (run("gamma", "mid", 0, 0.0), run("gamma", "lo", 1, 0.0))),
    ]


def test_group_runs_by_task_folder_and_name(tmp_path: Path) -> None:
    a, b, c = run("alpha", "hi", 0, 1.0), run("alpha", "lo", 1, 0.0), run("beta", "hi", 0, 1.0)
    c_same_task = RecordedRun("other__x", a.task, a.steps, 0.0)
    pairs = [
        (a, tmp_path / "f1" / "a.json"),
        (b, tmp_path / "f2" / "b.json"),
        (c, tmp_path / "f1" / "c.json"),
        (c_same_task, tmp_path / "f2" / "d.json"),
    ]
    by_task = ge.group_runs(pairs, "task")
    assert [[r.name for r in g.runs] for g in by_task] == [
        ["alpha__hi0", "alpha__lo1", "other__x"],
        ["beta__hi0"],
    ]
    assert by_task[0].name.startswith("alpha (task ")
    assert [[r.name for r in g.runs] for g in ge.group_runs(pairs, "folder")] == [
        ["alpha__hi0", "beta__hi0"],
        ["alpha__lo1", "other__x"],
    ]
    assert [g.name for g in ge.group_runs(pairs, "name")] == ["alpha", "beta", "other"]
    with pytest.raises(ValueError, match="group_by"):
        ge.group_runs(pairs, "colour")  # type: ignore[arg-type]


async def test_select_pointwise_reports_pick_accuracy_against_random_exactly(
    tmp_path: Path,
) -> None:
    judge = FakeJudge(pointwise)
    cache = ev.ScoreCache(tmp_path / "c.sqlite3")
    report = await ge.select_groups(groups(), judge=judge, cache=cache)
    assert [g.pick for g in report.picks] == ["alpha__hi1", "beta__hi0", "gamma__mid0"]
    assert [g.pick_success for g in report.picks] == [True, False, False]
    assert report.accuracy == pytest.approx(1 / 3)
    # Random: 1/3 + 2/3 + 0, over three groups; the best possible: two groups have a success.
    assert report.random_accuracy == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)
    assert report.oracle == pytest.approx(2 / 3)
    # Random picks succeed in at least one group unless they miss in alpha (2/3) and beta (1/3): 1 -
    # 2/9.
    assert report.hits == 1 and report.chance == pytest.approx(7 / 9)
    assert report.pointwise_accuracy == report.accuracy and report.calls == 48
    # Every prefix is scored as live (8 runs of 6 steps); a run's standing is its latest score.
    assert judge.calls_made == 48 and {p.step for p in judge.prompts} == set(range(1, 7))
    again = await ge.select_groups(groups(), judge=judge, cache=cache)
    assert (
        judge.calls_made == 48
        and again.calls == 0
        and [g.pick for g in again.picks] == [g.pick for g in report.picks]
    )
    text = ge.select_summary(report)
    assert "pick accuracy (pointwise): 33%" in text and "random pick (expected): 33%" in text
    assert "at least 1 of these 3 groups with probability 78% (exact)" in text
    assert "verdict: no better than a random pick" in text
    data = ge.select_json(report)
    assert data["groups"][1]["random_success"] == pytest.approx(2 / 3)
    cache.close()


async def test_select_pairwise_runs_the_tournament_with_cached_comparisons(tmp_path: Path) -> None:
    judge = FakeJudge(judge_both)
    cache = ev.ScoreCache(tmp_path / "c.sqlite3")
    report = await ge.select_groups(groups(), judge=judge, pairwise=True, pivots=2, cache=cache)
    assert report.method == "pairwise"
    assert [g.pick for g in report.picks] == ["alpha__hi1", "beta__hi0", "gamma__mid0"]
    assert [g.pointwise_pick for g in report.picks] == ["alpha__hi1", "beta__hi0", "gamma__mid0"]
    made = judge.calls_made
    pairs = sum(g.selection.tournament.comparisons for g in report.picks if g.selection.tournament)
    assert made == report.calls == 48 + 2 * pairs
    again = await ge.select_groups(groups(), judge=judge, pairwise=True, pivots=2, cache=cache)
    assert judge.calls_made == made and again.calls == 0
    assert [g.pick for g in again.picks] == [g.pick for g in report.picks]
    cache.close()


async def test_select_with_a_failing_judge_counts_a_miss_and_says_why() -> None:
    report = await ge.select_groups(groups()[:1], judge=FakeJudge([FakeJudge.failure("auth")]))
    assert report.picks[0].pick is None and report.accuracy == 0.0
    assert "none (no_score)" in ge.select_summary(report)
    pair = await ge.select_groups(
        groups()[:1], judge=FakeJudge([FakeJudge.failure("auth")]), pairwise=True
    )
    assert pair.picks[0].pick is None and "none (auth)" in ge.select_summary(pair)


async def test_a_failed_last_step_keeps_the_runs_latest_score() -> None:
    def answer(prompt: Prompt) -> str | BaseException:
        return FakeJudge.failure("context_overflow") if prompt.step >= 5 else pointwise(prompt)

    report = await ge.select_groups(groups(), judge=FakeJudge(answer))
    assert [g.pick for g in report.picks] == ["alpha__hi1", "beta__hi0", "gamma__mid0"]
    assert report.picks[0].pointwise_scores["alpha__hi1"] == pytest.approx(12 / 19)


# -- eval --groups
# --------------------------------------------------------------------------------------------------


def curve(name: str, scores: list[float | None], outcome: float, unc: float = 0.01) -> ev.RunCurve:
    return ev.RunCurve(name, outcome, list(scores), [None if s is None else unc for s in scores])


def sibs(*curves: ev.RunCurve) -> list[ge.Sibling]:
    return [ge.Sibling(c, tuple(float(i) for i in range(len(c.scores)))) for c in curves]


FOUR = sibs(
    curve("lead", [0.5, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9], 1.0),
    curve("second", [0.5, 0.55, 0.6, 0.7, 0.75, 0.8, 0.8, 0.8], 1.0),
    curve("lag1", [0.2, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], 0.0),
    curve("lag2", [0.3, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2], 0.0),
)


def test_two_laggards_of_four_are_pruned_and_keep_top_holds() -> None:
    pol = Policy(min_steps=2, patience=2, keep_top=2, prune_margin=0.2)
    r = ge.replay_group("g", FOUR, pol)
    assert set(r.pruned) == {2, 3}
    # Behind from step 2 (min_steps), pruned after patience 2 scored steps: stopped after step 3.
    assert r.pruned == {2: 3, 3: 3} and r.saved == 5 + 5 and r.steps == 32
    # keep_top 3: lag1 is measured against the third best live sibling (lag2, 0.1 above it; at step
    # 2 lag2's step 1 is its latest), and once it is gone nothing can go: three live runs stay
    # whatever the margin.
    assert (
        ge.replay_group(
            "g", FOUR, Policy(min_steps=2, patience=2, keep_top=3, prune_margin=0.2)
        ).pruned
        == {}
    )
    assert ge.replay_group(
        "g", FOUR, Policy(min_steps=2, patience=2, keep_top=3, prune_margin=0.05)
    ).pruned == {2: 3}
    assert ge.replay_group(
        "g", FOUR, Policy(min_steps=0, patience=1, keep_top=3, prune_margin=0.0)
    ).pruned == {2: 2}


def test_a_judge_outage_prunes_nothing() -> None:
    down = sibs(*(curve(s.curve.name, [None] * 8, s.curve.outcome or 0.0) for s in FOUR))
    assert (
        ge.replay_group(
            "g", down, Policy(min_steps=0, patience=1, keep_top=1, prune_margin=0.0)
        ).pruned
        == {}
    )
    # Outages inside a streak break nothing and count nothing: lag1 still needs 2 scored steps
    # behind.
    gappy = sibs(FOUR[0].curve, curve("lag", [0.1, None, None, 0.1, None, 0.1, 0.1, 0.1], 0.0))
    r = ge.replay_group("g", gappy, Policy(min_steps=2, patience=2, keep_top=1, prune_margin=0.2))
    assert r.pruned == {1: 6}


def test_siblings_replay_in_recorded_time_order_relative_to_each_start() -> None:
    from datetime import datetime, timedelta

    t0, t1 = datetime(2026, 1, 1), datetime(2026, 6, 1)
    a = RecordedRun(
        "a",
        "t",
        tuple(RecordedStep(f"s{k}", t0 + timedelta(seconds=10 * k)) for k in range(3)),
        1.0,
    )
    b = RecordedRun(
        "b", "t", tuple(RecordedStep(f"s{k}", t1 + timedelta(seconds=k)) for k in range(3)), 0.0
    )
    s = ge.siblings([a, b], [curve("a", [0.5] * 3, 1.0), curve("b", [0.5] * 3, 0.0)])
    assert s[0].times == (0.0, 10.0, 20.0) and s[1].times == (0.0, 1.0, 2.0)
    untimed = RecordedRun("c", "t", (RecordedStep("x"), RecordedStep("y")), 0.0)
    assert ge.siblings([a, untimed], [curve("a", [0.5] * 3, 1.0), curve("c", [0.5] * 2, 0.0)])[
        0
    ].times == (0, 1, 2)


def test_prune_report_kept_steps_saved_and_random_pruning_at_the_same_budget() -> None:
    # A second task whose only success lags: pruning it loses the best of N there.
    trap = sibs(
        curve("flashy", [0.6, 0.7, 0.8, 0.8, 0.8, 0.8], 0.0),
        curve("quiet", [0.2, 0.2, 0.2, 0.2, 0.2, 0.2], 1.0),
    )
    rep = ge.prune_report(
        [("four", FOUR), ("trap", trap)],
        policy=Policy(min_steps=2, patience=2),
        keep_tops=[1],
        margins=[0.2],
        seeds=400,
    )
    (row,) = rep.rows
    assert row.tasks == 2 and row.tasks_with_success == 2 and row.kept == 1
    assert row.pruned_runs == 3 and row.pruned_successes == 1
    # Pruned after step 3: lag1, lag2 of 8 steps and quiet of 6 save 5 + 5 + 3 of 44 steps.
    assert row.steps_saved == pytest.approx(13 / 44)
    # Random: the same number of runs at the same stops; in "four" 2 of 4 pruned keep a success
    # unless both successes go (1/6), in "trap" the one pruned run is the success half the time.
    assert row.random_kept == pytest.approx((1 - 1 / 6) + 0.5, abs=0.08)
    assert row.random_steps_saved == pytest.approx(13 / 44, abs=0.03)
    text = ge.prune_summary(rep)
    assert "best-of-N kept" in text and "verdict: no better than random pruning" in text
    assert json.dumps(ge.prune_json(rep))


def test_prune_report_says_when_nothing_is_pruned() -> None:
    rep = ge.prune_report(
        [("four", FOUR)], policy=Policy(min_steps=2, patience=2), keep_tops=[1], margins=[0.9]
    )
    assert rep.rows[0].pruned_runs == 0 and rep.rows[0].kept == 1 and rep.rows[0].steps_saved == 0
    assert "pruned nothing at any setting" in ge.prune_summary(rep)


# -- the commands
# --------------------------------------------------------------------------------------------------


def write_runs(folder: Path) -> None:
    for g in groups():
        for r in g.runs:
            body = {
                "task": r.task,
                "steps": [s.text for s in r.steps],
                "outcome": r.outcome,
                "name": r.name,
            }
            (folder / f"{r.name}.json").write_text(json.dumps(body))


def http_reply(body: dict[str, Any]) -> Reply:
    text = "".join(m["content"] for m in body["messages"] if isinstance(m.get("content"), str))
    if "## Trajectory 2" in text:
        one, two = text.split("## Trajectory 2")
        letter = LETTERS[max(0, min(19, 9 + level(two) - level(one.split("## Trajectory 1")[1])))]
    else:
        letter = LETTERS[level(text)]
    return chat_reply(chat_choice([(letter, {letter: 1.0})]))


# three CLI subprocesses of up to 180 s each: the limit covers the test's own waits
@pytest.mark.timeout(600)
def test_select_and_eval_groups_commands_end_to_end(tmp_path: Path) -> None:
    data = tmp_path / "runs"
    data.mkdir()
    write_runs(data)
    with scripted_server() as server:
        server.default = http_reply
        base = [sys.executable, "-m", "agent_monitor"]
        judge = [
            "--judge",
            "openai",
            "--judge-url",
            server.url,
            "--cache",
            str(tmp_path / "cache.sqlite3"),
        ]
        ev_cmd = [
            *base,
            "eval",
            str(data),
            *judge,
            "--out",
            str(tmp_path / "ev"),
            "--groups",
            "--group-by",
            "name",
            "--min-steps",
            "2",
            "--patience",
            "2",
        ]
        done = subprocess.run(ev_cmd, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert "best-of-N kept" in done.stdout and "group pruning on 3 groups" in done.stdout
        rows = json.loads((tmp_path / "ev" / "eval_groups.json").read_text())["rows"]
        assert len(rows) == len(ge.DEFAULT_KEEP_TOPS) * len(ge.DEFAULT_MARGINS)
        scored = len(server.requests)
        sel = [
            *base,
            "select",
            str(data),
            *judge,
            "--out",
            str(tmp_path / "sel"),
            "--group-by",
            "name",
        ]
        done = subprocess.run(sel, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert len(server.requests) == scored  # every last step's score came from eval's cache
        assert "pick accuracy (pointwise): 33%" in done.stdout
        done = subprocess.run(
            [*sel, "--pairwise", "--pivots", "2"], capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stderr
        assert len(server.requests) > scored and "pick accuracy (pairwise): 33%" in done.stdout
    out = json.loads((tmp_path / "sel" / "select.json").read_text())
    assert out["method"] == "pairwise" and [g["pick"] for g in out["groups"]] == [
        "alpha__hi1",
        "beta__hi0",
        "gamma__mid0",
    ]
    assert out["random_accuracy"] == pytest.approx(1 / 3)


async def test_the_verdict_tells_luck_from_a_judge_that_finds_the_successes() -> None:
    def many(n: int) -> list[ge.Group]:
        return [
            ge.Group(
                f"g{i}",
                (
                    run(f"g{i}", "lo", 0, 0.0),
                    run(f"g{i}", "hi", 1, 1.0),
                    run(f"g{i}", "mid", 2, 0.0),
                ),
            )
            for i in range(n)
        ]

    sure = await ge.select_groups(many(6), judge=FakeJudge(pointwise))
    assert sure.accuracy == 1.0 and sure.chance == pytest.approx((1 / 3) ** 6)
    assert (
        "verdict: better than a random pick by 67% (random picks do as well 0.1% of the time)"
    ) in ge.select_summary(sure)
    lucky = await ge.select_groups(many(2), judge=FakeJudge(pointwise))
    assert lucky.chance == pytest.approx(1 / 9)
    assert "verdict: not distinguishable from a random pick" in ge.select_summary(lucky)
