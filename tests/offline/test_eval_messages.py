"""`eval`'s words for a new user: too few runs, settings under which no abort can happen,
symlinked folders, logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_monitor.offline.evaluate import RunCurve, evaluate, summary
from agent_monitor.offline.recorded import iter_recorded
from agent_monitor.policy import Policy


def curves(n: int, steps: int) -> list[RunCurve]:
    out = []
    for i in range(n):
        good = i % 2 == 0
        out.append(RunCurve(f"r{i}", 1.0 if good else 0.0, [0.8 if good else 0.1] * steps))
    return out


def test_two_runs_say_their_auroc_is_too_few_to_trust() -> None:
    text = summary(evaluate(curves(2, 6), policy=Policy(min_steps=2, patience=2)))
    assert "AUROC" in text and "from 1 successful and 1 failed runs: too few to trust" in text
    many = summary(evaluate(curves(40, 6), policy=Policy(min_steps=2, patience=2)))
    assert "too few to trust" not in many


def test_settings_that_make_any_abort_impossible_are_said_so_not_blamed_on_the_judge() -> None:
    # --max-steps 3 with min_steps 3, patience 3: the first possible abort is at step 5.
    text = summary(evaluate(curves(4, 3), policy=Policy(min_steps=3, patience=3)))
    assert (
        "no abort was possible" in text
        and "step 5 at the earliest" in text
        and "longest run has 3" in text
    )
    assert "do not let this judge abort runs yet" not in text


def test_symlinked_run_folders_are_read_once(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere" / "batch"
    real.mkdir(parents=True)
    (real / "a.json").write_text(
        json.dumps({"task": "t", "outcome": "success", "steps": [{"text": "x"}]})
    )
    root = tmp_path / "runs"
    root.mkdir()
    (root / "batch").symlink_to(real, target_is_directory=True)
    # a cycle must not loop or repeat runs
    (root / "loop").symlink_to(root, target_is_directory=True)
    assert [r.name for r in iter_recorded(root)] == ["a"]


def test_progress_to_a_log_says_it_began_and_reports_the_first_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent_monitor.cli._main import _progress_bar

    with _progress_bar(3, "scoring prefixes") as advance:
        advance("r1 step 1")
        advance("r1 step 2")
        advance("r1 step 3")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "scoring prefixes: 0/3"
    assert "scoring prefixes: 1/3 (r1 step 1)" in err and err[-1] == (
        "scoring prefixes: 3/3 (r1 step 3)"
    )
