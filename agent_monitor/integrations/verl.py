"""verl: an async `compute_score` for `custom_reward_function`, scored by agent-monitor's judge.

verl's contract (read from volcengine/verl at b178a3cd56f58b2d502255daba591e92833930a7):
- `verl/trainer/ppo/reward.py::get_custom_reward_fn` loads `custom_reward_function.path` with
  `verl/utils/import_utils.py::load_extern_object` (a file path, or `pkg://package.module`), takes
  `custom_reward_function.name` from it, and merges `custom_reward_function.reward_kwargs` into
  every
  call's keywords; `inspect.iscoroutinefunction` decides whether it is awaited or run in an
  executor,
  so the reward must be a real `async def` function (a callable object would be called as sync).
- `verl/experimental/reward_loop/reward_manager/naive.py::NaiveRewardManager.run_single` calls it
  with
  keywords only: `data_source`, `solution_str` (the decoded response), `ground_truth`, `extra_info`
  (plus `reward_router_address` / `reward_model_tokenizer` when a reward model is configured), and
  reads
  a float, or a dict whose "score" is the reward and whose other keys become `reward_extra_info`.
- `verl/experimental/reward_loop/reward_loop.py::compute_rm_score` builds each extra key's column
  from
  every sample (`info[key] for info in ...`, keys from the first): every answer carries the same
  keys.

```python
# my_reward.py, then: custom_reward_function.path=my_reward.py
custom_reward_function.name=compute_score
from agent_monitor import OpenAIJudge
from agent_monitor.integrations.verl import make_compute_score

compute_score = make_compute_score(judge=OpenAIJudge(base_url="http://judge:8000/v1"),
criteria="progress")
```
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Literal, Protocol, cast

from .._runtime.sync import Blocking
from ..judges.base import Judge
from ..options import TrackerOptions
from ..tracker import AsyncProgressTracker
from ._common import DEFAULT_MAX_CHARS, DEFAULT_MAX_STEPS, RewardUnavailable, split_turns, task_text

RewardForm = Literal["dict", "float"]


class ComputeScore(Protocol):
    """verl's reward-loop signature (keywords only, as `NaiveRewardManager.run_single` calls it)."""

    def __call__(
        self,
        *,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Awaitable[float | dict[str, Any]]: ...


def make_compute_score(
    *,
    judge: Judge,
    options: TrackerOptions | None = None,
    form: RewardForm = "dict",
    infra_reward: float | None = None,
    task: Callable[[str, Mapping[str, Any]], str | None] | None = None,
    split: Callable[[str], list[str]] | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    max_chars: int = DEFAULT_MAX_CHARS,
    blocking: bool = False,
    **tracker_options: Any,
) -> ComputeScore:
    """An `async def compute_score(*, data_source, solution_str, ground_truth, extra_info,
    **kwargs)` for verl.

    Keyword-only, as verl calls it: `await compute_score(data_source=..., solution_str=...,
    ground_truth=...)`.

    The response is split into steps (`split`, default `split_turns`: chat-template turns, else
    tool-call
    blocks, else paragraphs, at most `max_steps` over `max_chars`) and its whole prefix scored once
    by
    `judge` with the tracker options given (`options` and/or `TrackerOptions` keywords: `criteria`,
    `repeats`, `min_mass`..; `ground_truth` is the rubric's `expected`). The task is
    `task(data_source,
    extra_info)`, default `extra_info`'s "task", "question" or "prompt".

    `form="dict"` answers `{"score", "progress", "uncertainty", "steps", "stop_kind", "reason"}`
    (the same
    keys every time, as verl's batching needs); `"float"` the score alone. A failed judge call is no
    reward: `RewardUnavailable` is raised, unless `infra_reward` is given, which is then answered
    with
    `stop_kind="infra"` so a trainer can drop the sample instead of learning from it.

    `blocking=True` gives a plain `def` instead, for verl's legacy reward managers
    (`reward_model.use_reward_loop=False`: `verl/workers/reward_manager/naive.py` calls the function
    without awaiting it); it runs the scoring on the judge's own loop (or a private one) and blocks.
    """
    if form not in ("dict", "float"):
        raise ValueError(f"form={form!r}; use 'dict' (verl's dict form, with stop_kind) or 'float'")
    base = TrackerOptions.of("make_compute_score", options, **tracker_options)
    cut = split or (lambda text: split_turns(text, max_steps=max_steps, max_chars=max_chars))

    async def compute_score(
        *,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: Mapping[str, Any] | None = None,
        # verl's reward_router_address / reward_model_tokenizer, a config's reward_kwargs
        **kwargs: Any,
    ) -> float | dict[str, Any]:
        info: Mapping[str, Any] = extra_info if isinstance(extra_info, Mapping) else {}
        goal = task(data_source, info) if task is not None else task_text(info)
        if not goal:
            raise ValueError(
                f"no task for a {data_source!r} sample: put it in extra_info['task'] (or "
                "'question'/'prompt'), "
                "or pass task=lambda data_source, extra_info: ... to make_compute_score"
            )
        steps = cut(solution_str) or ["(empty response)"]
        expected = base.expected if ground_truth is None else str(ground_truth)
        settings = {**base.settings(), "expected": expected}
        tracker = AsyncProgressTracker(goal, judge=judge, **settings)
        for step in steps:
            await tracker.add(step)
        p = await tracker.score()
        if not p.ok or p.score is None:
            if infra_reward is None:
                raise RewardUnavailable(p)
            score, uncertainty, kind, reason = (
                infra_reward,
                None,
                "infra",
                p.reason or "scoring_failed",
            )
        else:
            score, uncertainty, kind, reason = p.score, p.uncertainty, "judged", ""
        if form == "float":
            return float(score)
        return {
            "score": float(score),
            "progress": p.score,
            "uncertainty": uncertainty,
            "steps": len(steps),
            "stop_kind": kind,
            "reason": reason,
        }

    if not blocking:
        return compute_score
    loop = Blocking(judge, "verl-reward")

    def compute_score_blocking(
        *,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> float | dict[str, Any]:
        call = partial(
            compute_score,
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **kwargs,
        )
        result: float | dict[str, Any] = loop.call(call)
        return result

    return cast(ComputeScore, compute_score_blocking)


__all__ = ["ComputeScore", "RewardForm", "make_compute_score"]
