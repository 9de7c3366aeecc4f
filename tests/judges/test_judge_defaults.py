"""A judge's recommended minimum letter mass, the hook's spelled-out options, and what a low mass
says to do."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor import AsyncProgressTracker, ProgressTracker, atrack, track
from agent_monitor.cli._flags import build
from agent_monitor.cli._main import _parser
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.judges.base import recommended_min_mass
from agent_monitor.judges.circuit import CircuitJudge
from agent_monitor.offline.evaluate import score_runs
from agent_monitor.offline.recorded import RecordedRun, RecordedStep
from agent_monitor.scale import DEFAULT_MIN_MASS, ScoreError, distribution
from agent_monitor.testing import FakeJudge

# Letters hold 0.1 of the probability, as the packaged tiny models' do (0.10-0.23 measured).
THIN = {"K": 0.1, "The": 0.9}


def tiny_fake(answers: Any = None) -> FakeJudge:
    """A FakeJudge that recommends a low minimum mass, as LlamaCppJudge on a packaged tiny model
    does."""
    judge = FakeJudge(answers if answers is not None else [THIN])
    judge.min_mass = 0.05
    return judge


# -- the low-mass message says what to change --


def test_low_mass_error_names_the_setting_and_what_to_do() -> None:
    with pytest.raises(ScoreError) as info:
        distribution({"K": math.log(0.161), "The": math.log(0.839)}, min_mass=0.5)
    e = info.value
    assert e.reason == "low_mass"
    assert "scale letters hold 0.161 of the probability, below the minimum 0.5" in str(e)
    assert "min_mass" in str(e) and "--min-mass" in str(e)
    assert "lower min_mass, or use a stronger judge" in str(e)
    # A value to try, spelt out for both places (not the empty "min_mass=;" it used to print).
    assert "min_mass=0.08 in Python, --min-mass 0.08 on the command line" in str(
        e
    ) and "=;" not in str(e)


# -- the judge's recommendation, unless the user sets min_mass --


async def test_tracker_takes_the_judges_recommended_min_mass() -> None:
    p = await AsyncProgressTracker("t", judge=tiny_fake()).update("s1")
    assert p.ok and p.mass == pytest.approx(0.1) and p.score == pytest.approx(10 / 19)


async def test_an_explicit_min_mass_wins_over_the_judges() -> None:
    tracker = AsyncProgressTracker("t", judge=tiny_fake(), min_mass=0.5)
    assert tracker.min_mass == 0.5
    p = await tracker.update("s1")
    assert not p.ok and p.reason == "low_mass" and "below the minimum 0.5" in (p.error or "")
    # An explicit value below the judge's recommendation wins too.
    assert AsyncProgressTracker("t", judge=tiny_fake(), min_mass=0.0).min_mass == 0.0


async def test_a_judge_without_a_recommendation_gets_the_library_default() -> None:
    judge = FakeJudge([THIN])
    assert judge.min_mass is None and recommended_min_mass(judge) == DEFAULT_MIN_MASS

    class Bare:  # a third-party judge that knows nothing of min_mass
        name = "bare"

    assert recommended_min_mass(Bare()) == DEFAULT_MIN_MASS
    tracker = AsyncProgressTracker("t", judge=judge)
    assert tracker.min_mass == DEFAULT_MIN_MASS
    p = await tracker.update("s1")
    assert not p.ok and p.reason == "low_mass"


def test_tracker_refuses_a_min_mass_outside_0_1() -> None:
    with pytest.raises(ValueError, match=r"min_mass=5; use a number in \[0, 1\]"):
        AsyncProgressTracker("t", judge=FakeJudge(), min_mass=5)


def test_sync_hook_and_track_take_the_judges_recommendation() -> None:
    judge = tiny_fake()
    try:
        with ProgressTracker("t", judge=judge) as tracker:
            assert tracker.min_mass == 0.05
            assert tracker.update("s1").ok
        curve = track("t", ["a", "b"], judge=judge)
        assert [p.ok for p in curve] == [True, True]
        assert not track("t", ["a"], judge=judge, min_mass=0.5)[0].ok
    finally:
        judge.close()


def test_wrappers_pass_the_recommendation_through() -> None:
    assert CircuitJudge(tiny_fake()).min_mass == 0.05
    assert CircuitJudge(FakeJudge()).min_mass is None


async def test_daemon_uses_the_judges_recommendation_unless_configured() -> None:
    async def first_progress(config: MonitorConfig) -> dict[str, Any]:
        async with Monitor(config, judge=tiny_fake(), registry=CollectorRegistry()) as mon:
            await mon.handle("agents/r/start", json.dumps({"task": "t"}).encode())
            await mon.handle("agents/r/step", json.dumps({"index": 1, "text": "s1"}).encode())
            await asyncio.wait_for(mon.drain(), 10)
            while (m := mon.outbox.get_nowait()) is not None:
                if m.topic.endswith("/progress"):
                    return dict(json.loads(m.payload))
        raise AssertionError("no progress published")

    assert MonitorConfig().min_mass is None
    assert (await first_progress(MonitorConfig()))["ok"] is True
    explicit = await first_progress(MonitorConfig(min_mass=0.5))
    assert explicit["ok"] is False and explicit["reason"] == "low_mass"


def test_min_mass_flag_defaults_to_the_judges_and_an_explicit_one_wins(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in (["serve"], ["score", "x.json"], ["eval", "x"], ["demo"]):
        args = _parser({}).parse_args(command)
        assert args.min_mass is None, command
    args = _parser({}).parse_args(["serve", "--min-mass", "0.2"])
    assert build(MonitorConfig, args).min_mass == 0.2
    args = _parser({"AGENT_MONITOR_MIN_MASS": "0.3"}).parse_args(["serve"])
    assert build(MonitorConfig, args).min_mass == 0.3
    with pytest.raises(SystemExit):
        _parser({}).parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--min-mass X" in help_text and "none: the judge's recommendation" in help_text
    assert f"else {DEFAULT_MIN_MASS} (default: none)" in help_text


async def test_eval_scoring_takes_the_judges_recommendation() -> None:
    run = RecordedRun("r", "t", (RecordedStep("a"), RecordedStep("b")), 1.0)
    (curve,) = await score_runs([run], judge=tiny_fake())
    assert curve.scores == [pytest.approx(10 / 19)] * 2


# -- the sync hook's options are its own --


def test_progress_tracker_typo_names_progress_tracker() -> None:
    with pytest.raises(TypeError) as info:
        ProgressTracker("t", judge=FakeJudge(), min_mas=0.1)  # type: ignore[call-arg]
    assert "ProgressTracker" in str(info.value) and "AsyncProgressTracker" not in str(info.value)
    assert "min_mas" in str(info.value)


def test_progress_tracker_signature_spells_out_the_async_trackers_options() -> None:
    sync = inspect.signature(ProgressTracker)
    core = inspect.signature(AsyncProgressTracker)
    # Every option a keyword of its own (generated from TrackerOptions' fields), none hidden in
    # **options.
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sync.parameters.values())
    assert "min_mass" in sync.parameters
    assert "extract_budget_s" in sync.parameters
    assert [(p.name, p.default, p.kind) for p in sync.parameters.values()] == [
        (p.name, p.default, p.kind) for p in core.parameters.values()
    ]
    for fn in (track, atrack):
        sig = inspect.signature(fn)
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()), (
            fn.__name__
        )
        # Same options and defaults as the tracker, except `images`, which is per step here.
        for name, p in core.parameters.items():
            if name not in ("task", "images"):
                assert sig.parameters[name].default == p.default, (fn.__name__, name)
    with pytest.raises(TypeError, match=r"^track\(\) got an unexpected keyword argument 'min_mas'"):
        track("t", ["a"], judge=FakeJudge(), min_mas=0.1)  # type: ignore[call-arg]


def test_progress_tracker_bad_option_leaves_no_loop_thread_behind() -> None:
    import threading

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="repeats=0"):
        ProgressTracker("t", judge=_NotBase(), repeats=0)
    assert {t.name for t in threading.enumerate()} - before == set()


class _NotBase:
    """A judge that is not a BaseJudge: the sync hook would start its own loop for it."""

    name = "plain"

    async def grade(self, request: Any) -> Any:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


# -- which local models are the packaged tiny ones --


def test_only_the_packaged_tiny_models_recommend_a_low_min_mass(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from agent_monitor.judges.llamacpp import TINY_MIN_MASS, LlamaCppJudge, TinyJudgeWarning
    from tests.llama_models import smollm2_path

    with pytest.warns(
        TinyJudgeWarning, match="tiny judge for demos and trials, not a real grader"
    ) as caught:
        default = LlamaCppJudge()  # the packaged Gemma 3 270M
    assert len(caught) == 1 and "min_mass=0.05" in str(caught[0].message)
    # pointed at the user's line, so Python shows it once per line
    assert caught[0].filename == __file__
    assert default.min_mass == TINY_MIN_MASS == 0.05
    with pytest.warns(TinyJudgeWarning, match="SmolLM2-135M"):
        smol = LlamaCppJudge(smollm2_path())
    assert smol.min_mass == TINY_MIN_MASS
    # Another GGUF, even one named like a packaged model, is the user's own: no recommendation, no
    # warning.
    other = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    other.write_bytes(b"GGUF")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own = LlamaCppJudge(other)
    assert own.min_mass is None and recommended_min_mass(own) == DEFAULT_MIN_MASS
