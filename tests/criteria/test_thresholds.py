"""A rubric's `thresholds` mapped onto the run policy: the mapping, what is refused, and who
wins, in hook and daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent_monitor import AsyncProgressTracker, Policy
from agent_monitor.cli import main
from agent_monitor.cli._flags import build, given
from agent_monitor.criteria import CriteriaError, load_criteria, map_thresholds
from agent_monitor.daemon import Monitor, MonitorConfig, MonitorEvent, Refused
from agent_monitor.testing import FakeJudge
from tests.cli.test_flags import parse

CRITERIA = [{"name": "goal", "description": "How much of the task is done."}]


def rubric(thresholds: Any, criteria: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"criteria": criteria or CRITERIA, "thresholds": thresholds}


def levels(thresholds: Any) -> dict[str, Any]:
    return dict(load_criteria(rubric(thresholds)).thresholds)


# -- the mapping --


def test_levels_map_onto_the_policy_settings() -> None:
    assert levels({"abort_below": 0.2, "resample_below": 0.4, "regression": 0.25}) == {
        "abort_below": 0.2,
        "resample_below": 0.4,
        "regression": 0.25,
    }
    # Aliases, scale letters (their score), "auto" for the abort level, null for no level.
    assert levels({"abort": "E", "resample": "h", "regression": None}) == {
        "abort_below": 4 / 19,
        "resample_below": 7 / 19,
    }
    assert levels({"abort_below": "auto"}) == {"abort_below": "auto"}
    assert levels({}) == {} and load_criteria({"criteria": CRITERIA}).thresholds == ()


def test_thresholds_leave_the_rubric_hash_alone() -> None:
    # They decide what a run does with its scores, not the scores: calibration and stored scores
    # keep matching.
    assert (
        load_criteria(rubric({"abort_below": 0.2})).hash
        == load_criteria({"criteria": CRITERIA}).hash
    )


def test_a_rubric_file_carries_its_thresholds(tmp_path: Path) -> None:
    js = tmp_path / "r.json"
    js.write_text(json.dumps(rubric({"abort_below": 0.1})))
    yml = tmp_path / "r.yaml"
    yml.write_text(
        "criteria:\n  - name: goal\n    description: how far\nthresholds:\n  resample: 0.3\n"
    )
    assert load_criteria(str(js)).thresholds == (("abort_below", 0.1),)
    assert load_criteria(str(yml)).thresholds == (("resample_below", 0.3),)


@pytest.mark.parametrize(
    ("thresholds", "criteria", "names"),
    [
        ({"pass": 0.7}, None, ["thresholds.pass", "no pass mark", "abort_below"]),
        ({"min_score": 0.5}, None, ["thresholds.min_score", "no pass mark"]),
        ({"goal": 0.3}, None, ["thresholds.goal", "per-criterion", "abort_below"]),
        ({"abort_below": {"goal": 0.3}}, None, ["thresholds.abort_below", "per-criterion"]),
        ({"patience": 2}, None, ["thresholds.patience", "policy setting", "--patience"]),
        (
            {"stop_if": 0.1},
            None,
            ["thresholds.stop_if", "not a threshold", "abort_below, resample_below"],
        ),
        ({"abort_below": 5}, None, ["thresholds.abort_below=5", "[0, 1]", "1-20 scale"]),
        ({"abort_below": True}, None, ["thresholds.abort_below=True", "a score in [0, 1]"]),
        (
            {"resample_below": "auto"},
            None,
            ["thresholds.resample_below='auto'", "a score in [0, 1]"],
        ),
        ({"regression": "C"}, None, ["thresholds.regression='C'", "a fall"]),
        ({"abort": 0.1, "abort_below": 0.2}, None, ["thresholds.abort_below", "second time"]),
        ([0.2], None, ["'thresholds' is a list", "abort_below"]),
        (
            None,
            [{**CRITERIA[0], "threshold": 0.5}],
            ["item 1 (goal)", "'threshold'", "per-criterion"],
        ),
        (
            None,
            [{**CRITERIA[0], "thresholds": {"abort": 0.5}}],
            ["item 1 (goal)", "'thresholds'", "top-level"],
        ),
    ],
)
def test_what_cannot_be_mapped_is_refused_by_name(
    thresholds: Any, criteria: list[dict[str, Any]] | None, names: list[str]
) -> None:
    with pytest.raises(CriteriaError) as e:
        load_criteria(rubric(thresholds, criteria))
    for n in names:
        assert n in str(e.value)


def test_map_thresholds_is_the_mapping_the_loader_uses() -> None:
    assert map_thresholds({"abort": "A"}, ["goal"], "x") == (("abort_below", 0.0),)
    with pytest.raises(CriteriaError, match=r"^x: thresholds\.goal: per-criterion"):
        map_thresholds({"goal": 0.1}, ["goal"], "x")


# -- the hook --


async def scored(policy: Any, thresholds: Any, steps: int = 4) -> AsyncProgressTracker:
    # B = 1/19 ~ 0.05 on every step: below every level used here.
    t = AsyncProgressTracker(
        "t", judge=FakeJudge(["B"]), criteria=rubric(thresholds), policy=policy
    )
    for i in range(steps):
        await t.update(f"step {i + 1}")
    return t


async def test_a_rubric_with_thresholds_gives_the_hook_a_policy() -> None:
    t = await scored(None, {"abort_below": 0.2, "resample_below": 0.4})
    assert t.policy_state is not None
    pol = t.policy_state.policy
    assert (pol.abort_below, pol.resample_below, pol.min_steps, pol.patience) == (0.2, 0.4, 3, 3)
    assert [p.signal.signal for p in t.curve if p.signal] == [
        "continue",
        "continue",
        "resample",
        "resample",
    ]
    t = await scored(None, {"abort_below": 0.2}, steps=5)
    assert (
        t.latest is not None and t.latest.signal is not None and t.latest.signal.signal == "abort"
    )
    # No thresholds and no policy: no signals at all, as before.
    assert (await scored(None, None)).policy_state is None


@pytest.mark.parametrize(
    ("policy", "abort_below", "resample_below"),
    [
        ({"patience": 1}, 0.2, 0.4),  # a mapping's other keys keep the rubric's levels
        # a mapping's key wins, even when it switches the level off
        ({"abort_below": None}, None, 0.4),
        ({"abort_below": 0.1}, 0.1, 0.4),
        (Policy(abort_below=0.1), 0.1, 0.4),  # a Policy's non-default settings win
        (Policy(min_steps=1), 0.2, 0.4),  # ... and its defaults leave the rubric's levels in
    ],
)
async def test_the_callers_policy_wins_over_the_rubric(
    policy: Any, abort_below: float | None, resample_below: float | None
) -> None:
    t = await scored(policy, {"abort_below": 0.2, "resample_below": 0.4}, steps=1)
    assert t.policy_state is not None
    assert (t.policy_state.policy.abort_below, t.policy_state.policy.resample_below) == (
        abort_below,
        resample_below,
    )


# -- the daemon --


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


async def daemon_policy(
    config: MonitorConfig, start: dict[str, Any]
) -> tuple[Policy | None, str | None, list[Refused]]:
    """The policy in force for a run of five low scores, its signal after them, and what was
    refused."""
    refused: list[Refused] = []

    def sink(e: MonitorEvent) -> None:
        if isinstance(e, Refused):
            refused.append(e)

    async with Monitor(config, judge=FakeJudge(["B"]), sinks=[sink]) as mon:
        await mon.handle("agents/r1/start", j(**start))
        for i in range(1, 6):
            await mon.handle("agents/r1/step", j(index=i, text=f"s{i}"))
            # one scoring per step: a streak needs scored steps, not coalesced ones
            await mon.drain()
        tracker = mon.tracker("r1")
        view = mon.run("r1")
        if tracker is None or tracker.policy_state is None or view is None:
            return None, None, refused
        return tracker.policy_state.policy, view.signal, refused


async def test_a_starts_rubric_thresholds_set_the_runs_levels_in_the_daemon() -> None:
    pol, signal, refused = await daemon_policy(
        MonitorConfig(), {"task": "t", "criteria": rubric({"abort": 0.2})}
    )
    assert not refused and pol is not None and pol.abort_below == 0.2
    assert signal == "abort"  # five scores of 1/19 after min_steps 3, patience 3
    # Without the rubric's level the same run goes on.
    assert (
        await daemon_policy(MonitorConfig(), {"task": "t", "criteria": {"criteria": CRITERIA}})
    )[1] == "continue"


@pytest.mark.parametrize(
    ("config", "start_policy", "abort_below", "resample_below"),
    [
        # A flag left at its default does not beat the rubric ...
        (MonitorConfig(), None, 0.2, 0.4),
        # ... a flag's non-default value does, for that setting only ...
        (MonitorConfig(policy=Policy(abort_below=0.1)), None, 0.1, 0.4),
        # ... and so does a flag given at its default value (serve --abort-below none).
        (MonitorConfig(policy_given=("abort_below",)), None, None, 0.4),
        # The start's own policy wins over both.
        (MonitorConfig(policy=Policy(abort_below=0.1)), {"abort_below": 0.3}, 0.3, 0.4),
        (MonitorConfig(), {"resample_below": None}, 0.2, None),
    ],
)
async def test_precedence_in_the_daemon(
    config: MonitorConfig,
    start_policy: Any,
    abort_below: float | None,
    resample_below: float | None,
) -> None:
    start: dict[str, Any] = {
        "task": "t",
        "criteria": rubric({"abort_below": 0.2, "resample_below": 0.4}),
    }
    if start_policy is not None:
        start["policy"] = start_policy
    pol, _, _ = await daemon_policy(config, start)
    assert pol is not None and (pol.abort_below, pol.resample_below) == (
        abort_below,
        resample_below,
    )


async def test_a_start_whose_thresholds_cannot_be_mapped_is_refused_with_the_reason() -> None:
    pol, _, refused = await daemon_policy(
        MonitorConfig(), {"task": "t", "criteria": rubric({"pass": 0.7})}
    )
    assert pol is None
    assert (
        len(refused) == 1
        and "thresholds.pass" in refused[0].message
        and "no pass mark" in refused[0].message
    )


def test_serve_knows_which_policy_flags_were_given() -> None:
    assert given(parse([]), "policy") == ()
    assert given(parse(["--abort-below", "none", "--patience", "2"]), "policy") == (
        "abort_below",
        "patience",
    )
    assert given(parse([], {"AGENT_MONITOR_RESAMPLE_BELOW": "0.3"}), "policy") == (
        "resample_below",
    )
    args = parse(["--abort-below", "none"])
    config = build(MonitorConfig, args, policy_given=given(args, "policy"))
    assert config.policy.abort_below is None and config.policy_given == ("abort_below",)


def test_policy_given_names_policy_settings() -> None:
    with pytest.raises(ValueError, match="abort_bellow"):
        MonitorConfig(policy_given=("abort_bellow",))


def test_serve_refuses_a_bad_default_rubric_before_anything_else(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The judge URL is never reached: the rubric is checked first.
    argv = [
        "serve",
        "--judge",
        "openai",
        "--judge-url",
        "http://127.0.0.1:9/v1",
        "--no-store",
        "--metrics-port",
        "0",
    ]
    assert main([*argv, "--criteria", "nope"], environ={}) == 2
    err = capsys.readouterr().err
    assert "--criteria nope" in err and "no bundled criteria named 'nope'" in err
    assert main([*argv, "--criteria", "/nonexistent/rubric.json"], environ={}) == 2
    assert "cannot read criteria file /nonexistent/rubric.json" in capsys.readouterr().err
