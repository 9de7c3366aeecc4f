"""The adaptive schedule in the hook and in `eval --schedule`, on the 32 shared recorded runs
replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_monitor import AsyncProgressTracker, Policy
from agent_monitor.cli import main
from agent_monitor.policy import FAR
from agent_monitor.testing import FakeJudge, ReplayJudge
from tests.paths import FIXTURES

FIXTURE = FIXTURES / "adaptive" / "answers.json.gz"
DATA = Path("/work/shared/data")


async def test_the_hook_skips_far_steps_and_scores_them_at_drain() -> None:
    judge = FakeJudge(["R"])  # 0.89, far above 0.3
    pol = Policy(abort_below=0.3, schedule="adaptive", max_gap=3)
    async with AsyncProgressTracker("t", judge=judge, policy=pol) as tracker:
        for i in range(1, 6):
            tracker.submit(f"step {i}")
            await tracker.drain() if i == 5 else await _settle(tracker)
        got = [(p.step, p.scheduled, p.coalesced, p.skipped) for p in tracker.curve]
    assert got == [(1, "first", 1, None), (4, "max_gap 3", 3, FAR), (5, "end", 1, None)]
    assert judge.calls_made == 3


async def _settle(tracker: AsyncProgressTracker) -> None:
    assert tracker._scheduler is not None
    await tracker._scheduler.drain()


def test_replay_judge_fails_an_unrecorded_prompt_never_scores_it() -> None:
    judge = ReplayJudge({})
    from agent_monitor import ProgressTracker

    p = ProgressTracker("t", judge=judge).update("a step")
    assert not p.ok and p.reason == "bad_response" and judge.missing == 1


@pytest.mark.skipif(not DATA.exists(), reason="the shared recorded runs are not on this machine")
@pytest.mark.xfail(
    strict=True,
    reason="the recorded answers (tests/fixtures/adaptive) are keyed by the prompts of the "
    "layout before issue 42 "
    "(criteria in the tail); the replay finds none for today's prompts: re-record with "
    "bench/adaptive_record.py",
)
def test_eval_schedule_every_adaptive_on_the_recorded_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both schedules side by side, from the replayed recording: calls, tokens, aborts and their
    steps."""
    code = main(
        [
            "eval",
            str(DATA),
            "--judge",
            "replay",
            "--judge-model",
            str(FIXTURE),
            "--max-steps",
            "16",
            "--abort-below",
            "0.13",
            "--margin",
            "0.2",
            "--schedule",
            "every,adaptive",
            "--out",
            str(tmp_path),
            "--cache",
            str(tmp_path / "cache.sqlite3"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "schedule   scorings skipped  calls judge tokens" in out
    data = json.loads((tmp_path / "eval_schedule.json").read_text())
    every, adaptive = data["schedules"]["every"], data["schedules"]["adaptive"]
    assert every["totals"]["skipped"] == 0 and adaptive["totals"]["skipped"] > 0
    assert every["totals"]["aborts"]  # the threshold is where aborts happen
    # Every step of every run is either scored (and why) or skipped (and why).
    run = adaptive["runs"][0]
    assert [c["step"] for c in run["curve"]] == list(range(1, run["steps"] + 1))
    assert {c.get("skipped") for c in run["curve"]} <= {None, FAR}
    c = data["compare"]
    assert c["same_runs"] and c["within_max_gap"]
    assert adaptive["totals"]["tokens"] < every["totals"]["tokens"]
