"""The README's synchronous hook end to end on the packaged offline judge (real model, real
logprobs)."""

import json
import subprocess
import sys
import textwrap

import pytest

from agent_monitor import LlamaCppJudge, ProgressTracker
from agent_monitor.judges.llamacpp import TinyJudgeWarning
from tests.judges.test_llamacpp import ACTIONS, TASK

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow


def test_sync_hook_with_the_default_offline_judge() -> None:
    """The README's hook on the packaged Gemma: real scores with its own min_mass, prefix reuse,
    strict low mass."""
    with pytest.warns(TinyJudgeWarning):
        judge = LlamaCppJudge(n_ctx=4096)  # no path: the packaged Gemma 3 270M
    try:
        # Gemma 270M puts ~0.1-0.2 of its probability on letters: below the library's 0.5, no score
        # when asked for it.
        strict = ProgressTracker(TASK, judge=judge, min_mass=0.5)
        p = strict.update(ACTIONS[0])
        assert (
            not p.ok
            and p.score is None
            and p.reason == "low_mass"
            and ("below the minimum 0.5") in (p.error or "")
        )
        assert "lower min_mass, or use a stronger judge" in (p.error or "")
        strict.close()

        # With no min_mass the judge's recommendation applies: the first five minutes get scores.
        tracker = ProgressTracker(TASK, judge=judge, run_id="hook")
        assert tracker.min_mass == 0.05
        curve = [tracker.update(a) for a in ACTIONS[:4]]
        assert all(q.ok for q in curve), [q.error for q in curve]
        assert [q.step for q in curve] == [1, 2, 3, 4] == [q.step for q in tracker.curve]
        for q in curve:
            assert q.score is not None and 0.0 <= q.score <= 1.0
            # a real distribution, not one letter
            assert q.uncertainty is not None and q.uncertainty > 0.0
            assert (
                0.05 <= (q.mass or 0.0) <= 1.0
                and q.model == "gemma-3-270m-q4_k_m"
                and q.judge == "llamacpp"
            )
        # Each update re-reads only the new step: most of the prompt is a cached prefix.
        assert all(q.usage.cached_input_tokens > q.usage.input_tokens // 2 for q in curve[1:])
        tracker.close()
    finally:
        judge.close()


QUIET = textwrap.dedent(
    """
    import asyncio, json, sys
    from agent_monitor import LlamaCppJudge, ProgressTracker

    for _ in range(2):  # one line making two judges: one warning
        judge = LlamaCppJudge(n_ctx=2048)
    with ProgressTracker(TASK, judge=judge) as tracker:
        p = tracker.update(ACTION)
    judge.close()
    print(json.dumps({"ok": p.ok, "error": p.error, "min_mass": tracker.min_mass}))
    print("--- verbose from here ---", file=sys.stderr, flush=True)
    loud = LlamaCppJudge(n_ctx=1024, verbose=True)
    asyncio.run(loud.load())
    loud.close()
    """
)


def test_the_packaged_judge_is_quiet_and_warns_once() -> None:
    """llama.cpp's warnings stay out of stderr unless verbose=True; the tiny-judge warning comes
    once."""
    script = f"TASK = {TASK!r}\nACTION = {ACTIONS[0]!r}\n" + QUIET
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    quiet, _, verbose = done.stderr.partition("--- verbose from here ---")
    assert verbose, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["min_mass"] == 0.05, result
    assert "llama_kv_cache" not in quiet and "llama_" not in quiet, quiet
    assert quiet.count("TinyJudgeWarning") == 1 and "not a real grader" in quiet
    # verbose=True still shows llama.cpp's log, the same notice included.
    assert "llama_kv_cache_iswa: using full-size SWA cache" in verbose
