"""The README's synchronous hook end to end on the packaged offline judge (real model, real logprobs)."""

import pytest

from agent_monitor import LlamaCppJudge, ProgressTracker
from tests.test_llamacpp import ACTIONS, TASK

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow


def test_sync_hook_with_the_default_offline_judge() -> None:
    """The README's hook on the packaged Gemma: real scores, prefix reuse, and low mass failing loudly."""
    judge = LlamaCppJudge(n_ctx=4096)  # no path: the packaged Gemma 3 270M
    try:
        # Gemma 270M puts ~0.1-0.2 of its probability on letters: below the default minimum, no score.
        strict = ProgressTracker(TASK, judge=judge)
        p = strict.update(ACTIONS[0])
        assert not p.ok and p.score is None and p.reason == "low_mass" and "below the minimum 0.5" in (p.error or "")
        strict.close()

        tracker = ProgressTracker(TASK, judge=judge, min_mass=0.02, run_id="hook")
        curve = [tracker.update(a) for a in ACTIONS[:4]]
        assert all(q.ok for q in curve), [q.error for q in curve]
        assert [q.step for q in curve] == [1, 2, 3, 4] == [q.step for q in tracker.curve]
        for q in curve:
            assert q.score is not None and 0.0 <= q.score <= 1.0
            assert q.uncertainty is not None and q.uncertainty > 0.0  # a real distribution, not one letter
            assert 0.02 <= (q.mass or 0.0) <= 1.0 and q.model == "gemma-3-270m-q4_k_m" and q.judge == "llamacpp"
        # Each update re-reads only the new step: most of the prompt is a cached prefix.
        assert all(q.usage.cached_input_tokens > q.usage.input_tokens // 2 for q in curve[1:])
        tracker.close()
    finally:
        judge.close()
