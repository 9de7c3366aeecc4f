"""The scoring options are written once, as TrackerOptions' fields: the four tracker forms,
MonitorConfig and the flags are derived from them, and no second copy of the list exists in the
source."""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import inspect
from typing import Any

import pytest

from agent_monitor import (
    AsyncProgressTracker,
    MonitorConfig,
    Policy,
    ProgressTracker,
    TrackerOptions,
    atrack,
    track,
)
from agent_monitor._compat import MissingJudgeError
from agent_monitor.cli._flags import add_flags, build, flag_name
from agent_monitor.options import OPTION_NAMES, ScoringOptions
from agent_monitor.testing import FakeJudge
from tests.paths import REPO

FORMS: list[Any] = [ProgressTracker, AsyncProgressTracker, track, atrack]
# What a form takes besides the options: the judge, images (the task's; track's: each step's),
# options whole; track's and atrack's checkpoints (the steps to score: the reference library's
# checkpoint_steps).
BESIDES = {"judge", "images", "options"}
BESIDES_OF = {"track": {"checkpoints"}, "atrack": {"checkpoints"}}


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_each_form_takes_exactly_the_options_fields_with_their_defaults(form: Any) -> None:
    params = inspect.signature(form).parameters
    keywords = {n: p for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(keywords) == OPTION_NAMES | BESIDES | BESIDES_OF.get(form.__name__, set())
    for f in dataclasses.fields(TrackerOptions):
        assert keywords[f.name].default == _default(f), f.name
    assert keywords["judge"].default is inspect.Parameter.empty  # required
    # The forms' own code spells no option: their signature is generated, not a second list.
    code = (vars(form)["__init__"] if isinstance(form, type) else form).__code__
    spelled = set(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
    assert spelled & OPTION_NAMES == set()


def test_help_lists_every_option_of_the_tracker_itself() -> None:
    text = inspect.signature(ProgressTracker)
    for name in ("judge", "repeats", "policy", "min_mass", "on_progress", "curve_window"):
        assert f"{name}:" in str(text)


def _call(form: Any, **keywords: Any) -> Any:
    if form in (track, atrack):
        out = form("t", ["step"], **keywords)
        return asyncio.run(out) if inspect.iscoroutine(out) else out
    tracker = form("t", **keywords)
    if isinstance(tracker, ProgressTracker):
        tracker.close()
    return tracker


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_a_misspelt_option_is_a_type_error_naming_the_form_and_the_options(form: Any) -> None:
    with pytest.raises(
        TypeError,
        match=rf"^{form.__name__}\(\) got an unexpected keyword argument 'repeat'; " r".*repeats",
    ):
        _call(form, judge=FakeJudge(), repeat=2)
    if form in (ProgressTracker, track):
        # The reference library's forms (issue 28): no judge= means one from the environment, or
        # this error.
        with pytest.raises(MissingJudgeError, match="no judge: pass judge="):
            _call(form, repeats=2)
        return
    with pytest.raises(
        TypeError, match=rf"^{form.__name__}\(\) missing required keyword " r"argument: 'judge'"
    ):
        _call(form, repeats=2)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("repeats", 0, r"repeats=0; use 1 or more"),
        ("min_mass", 1.5, r"min_mass=1.5; use a number in \[0, 1\]"),
        ("extract_budget_s", 0, r"extract_budget_s=0; use a number of seconds > 0"),
        ("curve_window", 0, r"curve_window=0; use a number of results >= 1"),
    ],
)
def test_every_form_checks_values_with_the_options_one_check(
    form: Any, option: str, value: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _call(form, judge=FakeJudge(), **{option: value})
    with pytest.raises(ValueError, match=message):
        TrackerOptions(**{option: value})


def test_options_given_whole_and_keywords_beside_them_win() -> None:
    careful = TrackerOptions(repeats=3, curve_window=7, run_id="from-options")
    with ProgressTracker("t", judge=FakeJudge(["K"]), options=careful, run_id="given") as tracker:
        assert tracker.options == dataclasses.replace(careful, run_id="given")
        p = tracker.update("ran the tests")
        assert (
            p.run_id == "given" and tracker._core.repeats == 3 and tracker._core.curve_window == 7
        )
    with pytest.raises(TypeError, match=r"options=.*use a TrackerOptions"):
        AsyncProgressTracker("t", judge=FakeJudge(), options={"repeats": 2})  # type: ignore[arg-type]


def test_a_monitor_config_is_options_for_its_runs() -> None:
    config = MonitorConfig(repeats=2, min_mass=0.1, extract_budget_s=0.5)
    tracker = AsyncProgressTracker("t", judge=FakeJudge(), options=config)
    assert (tracker.repeats, tracker.min_mass, tracker.extract_budget_s) == (2, 0.1, 0.5)
    # what the config does not set: defaults
    assert tracker.options.curve_window == TrackerOptions().curve_window


def test_monitor_config_inherits_the_scoring_fields_and_declares_none_again() -> None:
    config_fields = {f.name: f for f in dataclasses.fields(MonitorConfig)}
    for f in dataclasses.fields(ScoringOptions):
        assert config_fields[f.name] is f, f"MonitorConfig.{f.name} is not ScoringOptions' field"
    # Only `policy` is MonitorConfig's own: the policy defaults a start's policy overrides, a nested
    # group whose flags are Policy's fields (the one list of policy settings); the tracker's
    # `policy` may also be a mapping.
    assert set(inspect.get_annotations(MonitorConfig)) & OPTION_NAMES == {"policy"}
    assert config_fields["policy"].default_factory is Policy
    with pytest.raises(ValueError, match=r"repeats=0; use 1 or more"):
        MonitorConfig(repeats=0)


def test_the_generated_flags_of_the_scoring_settings_are_the_options_fields() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, MonitorConfig, {})
    actions = {a.dest: a for a in parser._actions}
    flagged = [f for f in dataclasses.fields(ScoringOptions) if f.metadata.get("cli") is not False]
    assert {f.name for f in flagged} == {
        "repeats",
        "min_mass",
        "criteria",
        "extract_budget_s",
        "prompt_budget",
        "digest",
    }
    for f in flagged:
        action = actions[f.name]
        assert action.option_strings == [flag_name(f)]
        assert action.help is not None and action.help.startswith(f.metadata["help"])
    config = build(
        MonitorConfig,
        parser.parse_args(["--repeats", "3", "--criteria", "progress", "--min-mass", "none"]),
    )
    assert (config.repeats, config.criteria, config.min_mass) == (3, "progress", None)
    assert config.prompt_budget is None
    assert (
        build(MonitorConfig, parser.parse_args(["--prompt-budget", "6000"])).prompt_budget == 6000
    )
    assert (
        config.digest is None
        and build(MonitorConfig, parser.parse_args(["--digest", "judge"])).digest == "judge"
    )
    env = {"AGENT_MONITOR_DIGEST": "qwen2.5-1.5b"}
    twin = argparse.ArgumentParser()
    add_flags(twin, MonitorConfig, env)
    assert build(MonitorConfig, twin.parse_args([])).digest == "qwen2.5-1.5b"
    # Where --prompt-budget is, --digest is: serve (above), score and eval.
    from agent_monitor.cli._main import _parser

    for command in (["score", "runs/"], ["eval", "runs/"]):
        args = _parser({}).parse_args([*command, "--digest", "judge", "--prompt-budget", "6000"])
        assert (args.digest, args.prompt_budget) == ("judge", 6000)
    # A subcommand's scoring flags come from the same fields, without MonitorConfig.
    sub = argparse.ArgumentParser()
    add_flags(sub, ScoringOptions, {"AGENT_MONITOR_REPEATS": "4"}, only=["repeats", "min_mass"])
    assert build(ScoringOptions, sub.parse_args([])).repeats == 4


def _spelled(node: ast.AST) -> set[str] | None:
    """The names a def takes, or a class declares as fields; None for anything else."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        a = node.args
        return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
    if isinstance(node, ast.ClassDef):
        return {
            s.target.id
            for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
    return None


def test_no_second_copy_of_the_option_list_in_the_source() -> None:
    # A copy is a def or a class that spells more than half of the options; options.py holds the one
    # list.
    copies = []
    for path in sorted(
        [*(REPO / "agent_monitor").rglob("*.py"), *(REPO / "adapters").rglob("*.py")]
    ):
        if path.name == "options.py" and path.parent.name == "agent_monitor":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = _spelled(node)
            if names is not None and len(names & OPTION_NAMES) > len(OPTION_NAMES) // 2:
                copies.append(
                    f"{path.relative_to(REPO)}:{node.lineno} {node.name}: "
                    f"{sorted(names & OPTION_NAMES)}"
                )  # type: ignore[attr-defined]
    assert copies == [], (
        "the tracker options are spelled again (derive them from TrackerOptions instead)"
    )
