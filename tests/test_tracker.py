"""Trackers: async core, sync facade, non-blocking submit with coalescing, offline track()."""

import asyncio
import threading
import time

import pytest

from agent_monitor import AsyncProgressTracker, JudgeError, ProgressTracker, atrack, track
from agent_monitor.images import ImageError
from agent_monitor.prompts import Prompt
from agent_monitor.testing import FakeJudge


async def test_update_scores_each_growing_prefix() -> None:
    judge = FakeJudge()
    t = AsyncProgressTracker("Reverse a string.", judge=judge, run_id="r1")
    for i in range(1, 4):
        p = await t.update(f"step {i}")
        assert p.ok and p.step == i and p.score == pytest.approx(i / 19)
        assert p.uncertainty == pytest.approx(0.0) and p.mass == pytest.approx(1.0)
        assert p.model == "fake-1" and p.judge == "fake" and p.rubric == t.rubric.hash
    assert [p.step for p in t.curve] == [1, 2, 3]
    assert t.latest is not None and t.latest.step == 3
    assert [p.step for p in judge.prompts] == [1, 2, 3]
    assert judge.prompts[2].prefix_text().startswith(judge.prompts[1].prefix_text())


async def test_weighted_criteria_one_call_each_sharing_the_prefix() -> None:
    def answer(p: Prompt) -> str:
        return "T" if p.criterion == "done" else "A"

    judge = FakeJudge(answer)
    crit = [
        {"name": "done", "description": "is it done", "weight": 3},
        {"name": "tidy", "description": "is it tidy"},
    ]
    t = AsyncProgressTracker("task", judge=judge, criteria=crit)
    p = await t.update("did it")
    assert p.ok and p.score == pytest.approx(0.75) and p.calls == 2
    assert set(p.criteria) == {"done", "tidy"} and p.criteria["done"].weight == pytest.approx(0.75)
    assert judge.prompts[0].prefix_text() == judge.prompts[1].prefix_text()


async def test_judge_failure_is_reported_never_scored() -> None:
    judge = FakeJudge(
        lambda p: JudgeError("server_error", "HTTP 503", retryable=True),
        max_retries=1,
        backoff_s=0.001,
    )
    seen = []
    t = AsyncProgressTracker("task", judge=judge, on_progress=seen.append)
    p = await t.update("x")
    assert not p.ok and p.score is None and p.uncertainty is None and p.reason == "server_error"
    assert seen == [p] and len(judge.prompts) == 2  # retried once


async def test_partial_criteria_failure_fails_the_step_but_keeps_what_scored() -> None:
    judge = FakeJudge(lambda p: "K" if p.criterion == "a" else "The")
    t = AsyncProgressTracker("task", judge=judge, criteria={"a": "x", "b": "y"})
    p = await t.update("x")
    assert (
        not p.ok
        and p.score is None
        and p.reason == "no_letter"
        and "criterion 'b'" in (p.error or "")
    )
    assert set(p.criteria) == {"a"}


async def test_buggy_third_party_judge_is_a_failure_not_a_crash() -> None:
    class Broken:
        name = "broken"
        model = "b"

        async def grade(self, request: object) -> object:
            raise KeyError("oops")

        async def aclose(self) -> None:
            pass

    t = AsyncProgressTracker("task", judge=Broken())  # type: ignore[arg-type]
    p = await t.update("x")
    assert not p.ok and p.reason == "judge_exception" and "KeyError" in (p.error or "")


async def test_repeats_and_min_mass() -> None:
    judge = FakeJudge(lambda p: {"K": 0.3, "The": 0.7})
    t = AsyncProgressTracker("task", judge=judge, repeats=2, min_mass=0.25)
    p = await t.update("x")
    assert p.ok and p.mass == pytest.approx(0.3) and p.criteria["task_progress"].repeats == 2
    strict = AsyncProgressTracker("task", judge=judge)
    assert (await strict.update("x")).reason == "low_mass"


async def test_submit_coalesces_a_burst_and_scores_the_newest_prefix() -> None:
    judge = FakeJudge(latency_s=0.1)
    results = []
    async with AsyncProgressTracker("task", judge=judge, on_progress=results.append) as t:
        for i in range(1, 41):
            assert t.submit(f"step {i}") == i
            await asyncio.sleep(0.005)
        last = await t.drain()
    assert last is not None and last.step == 40 and last.ok
    assert len(judge.prompts) <= 8  # 40 steps in ~0.2 s, 0.1 s per call
    assert sum(p.coalesced for p in results) == 40
    assert max(p.coalesced for p in results) > 1
    assert [p.step for p in results] == sorted(p.step for p in results)


async def test_submit_needs_the_context() -> None:
    t = AsyncProgressTracker("task", judge=FakeJudge())
    with pytest.raises(RuntimeError, match="async with"):
        t.submit("x")


async def test_bad_image_rejects_that_step_only() -> None:
    async with AsyncProgressTracker("task", judge=FakeJudge()) as t:
        with pytest.raises(ImageError, match="not PNG, JPEG"):
            await t.update("x", images=[b"not an image"])
        assert t.steps == []
        t.submit("y", images=[b"garbage"])
        t.submit("z")
        p = await t.drain()
    assert p is not None and p.ok and p.step == 1 and t.steps[0].text == "z"


async def test_network_origin_trackers_can_refuse_file_paths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = AsyncProgressTracker("task", judge=FakeJudge(), allow_files=False)
    with pytest.raises(ImageError, match="paths are not allowed"):
        await t.update("x", images=["/etc/hostname"])


async def test_callback_errors_do_not_stop_scoring() -> None:
    def boom(p: object) -> None:
        raise RuntimeError("callback bug")

    async with AsyncProgressTracker("task", judge=FakeJudge(), on_progress=boom) as t:
        t.submit("a")
        await t.drain()
        t.submit("b")
        p = await t.drain()
    assert p is not None and p.step == 2


async def test_image_loading_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import agent_monitor.tracker as tracker_mod

    loop_thread = threading.get_ident()
    threads = []
    real = tracker_mod.load_image

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        threads.append(threading.get_ident())
        return real(*a, **k)

    monkeypatch.setattr(tracker_mod, "load_image", spy)
    from PIL import Image

    t = AsyncProgressTracker("task", judge=FakeJudge())
    await t.update("x", images=[Image.new("RGB", (4, 4))])
    assert threads and loop_thread not in threads


def test_sync_tracker_update_submit_and_shared_judge_loop() -> None:
    judge = FakeJudge(latency_s=0.02)
    got = []
    with (
        ProgressTracker("task A", judge=judge, on_progress=got.append) as a,
        ProgressTracker("task B", judge=judge) as b,
    ):
        p = a.update("first")
        assert p.ok and p.step == 1 and p.score == pytest.approx(1 / 19)
        assert b.update("other run").step == 1
        t0 = time.perf_counter()
        for i in range(2, 22):
            a.submit(f"step {i}")
        assert time.perf_counter() - t0 < 0.2  # submit does not wait for the judge
        last = a.drain()
        assert last is not None and last.step == 21 and a.latest == last
        assert a.curve[0].step == 1 and a.curve[-1].step == 21
        assert got[-1] == last and len(a.steps) == 21
    with pytest.raises(RuntimeError, match="closed"):
        a.update("late")
    judge.close()


def test_track_scores_every_prefix_offline() -> None:
    judge = FakeJudge()
    curve = track("task", ["a", "b", {"action": "ls", "observation": "file.txt"}], judge=judge)
    assert [p.step for p in curve] == [1, 2, 3]
    assert [p.score for p in curve] == pytest.approx([1 / 19, 2 / 19, 3 / 19])
    assert "action: ls\nobservation: file.txt" in judge.prompts[-1].text()
    judge.close()


async def test_atrack_in_order_for_prefix_caches() -> None:
    judge = FakeJudge()
    curve = await atrack("task", [f"s{i}" for i in range(5)], judge=judge)
    assert [p.step for p in judge.prompts] == [1, 2, 3, 4, 5] and curve[-1].score == pytest.approx(
        5 / 19
    )


def test_invalid_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="task is empty"):
        AsyncProgressTracker("  ", judge=FakeJudge())
    with pytest.raises(ValueError, match="repeats"):
        AsyncProgressTracker("t", judge=FakeJudge(), repeats=0)


async def test_trackers_sharing_a_judge_tell_it_which_run_each_call_is() -> None:
    judge = FakeJudge()
    named = AsyncProgressTracker("first task", judge=judge, run_id="r-1")
    anonymous = AsyncProgressTracker("second task", judge=judge)
    other = AsyncProgressTracker("third task", judge=judge)
    for i in range(3):
        await named.update(f"step {i}")
        await anonymous.update(f"step {i}")
        await other.update(f"step {i}")
    keys = [r.run_key for r in judge.requests]
    # One stable key per tracker, with no code of the caller's: the run id, else an id of the
    # tracker's own.
    assert keys[0::3] == ["r-1"] * 3 and named.run_key == "r-1"
    assert keys[1::3] == [anonymous.run_key] * 3 and keys[2::3] == [other.run_key] * 3
    assert len({named.run_key, anonymous.run_key, other.run_key}) == 3
    # The key never enters the prompt: the prompt stays a function of the trajectory (prefix
    # stability).
    assert all(anonymous.run_key not in p.text() for p in judge.prompts)


def test_sync_tracker_carries_its_run_key() -> None:
    judge = FakeJudge()
    with ProgressTracker("task", judge=judge, run_id="sync-run") as tracker:
        tracker.update("did a thing")
    assert [r.run_key for r in judge.requests] == ["sync-run"]
