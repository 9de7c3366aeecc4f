"""verifiers 0.4: a `@vf.stop`-style hook that scores each turn and ends a rollout when the monitor
says abort.

verifiers 0.4.0 (`verifiers.v1`, read in its wheel and in PrimeIntellect-ai/verifiers at
a60a606ecc4d309247edf9ff92c3eabca362781f) has neither `vf.on_response` nor `vf.Terminate`: a rollout
is
ended by a stop predicate, `@vf.stop` (`verifiers/v1/utils/decorators.py`), a function of a typed
`Request`, `Response` or `Trace` that returns a bool. `RolloutSession.refused()`
(`verifiers/v1/session.py`)
runs the `Trace` stops before every model call; the first that returns True refuses the turn and
becomes
the trace's `stop_condition` (`Trace.stop`). A reward is a `@vf.reward` function of the trace, run
when
the rollout is scored (`Task.score`, `verifiers/v1/task.py`). Both can be plugged by configuration
(`TaskConfig.stops` / `.rewards`, `verifiers/v1/configs/task.py`: `fn = "pkg.module:function"`).

So `monitor_hooks(judge=...)` gives the pair: `stop` submits each finished turn (the observation
that
led to it and the model's reply) to a tracker for that trace and returns True on a judged abort,
with the
verdict and the reward the run had earned so far in `trace.info["agent_monitor"]`; `reward` answers
that
reward. A judge failure (`stop_kind="infra"`) never stops a rollout; when the last turn's judge call
failed, `reward` raises `RewardUnavailable`, so verifiers records the trace as failed (dropped, not
penalised).

```python
# my_monitor.py
from agent_monitor import OpenAIJudge
from agent_monitor.integrations.verifiers import monitor_hooks

hooks = monitor_hooks(judge=OpenAIJudge(base_url="http://judge:8000/v1"), policy={"abort_below":
0.1})
stop, reward = hooks.stop, hooks.reward
# --env.taskset.task.stops.agent_monitor.fn my_monitor:stop
--env.taskset.task.rewards.agent_monitor.fn my_monitor:reward
```
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..judges.base import Judge
from ..options import TrackerOptions
from ..tracker import AsyncProgressTracker
from ._common import RewardUnavailable, verdict

if TYPE_CHECKING:
    from verifiers.v1 import Trace

INFO_KEY = "agent_monitor"
"""The key of `trace.info` the verdict is written under."""
DEFAULT_MAX_ROLLOUTS = 4096
"""Rollouts followed at once at most; the one idle the longest is dropped beyond it (counted in
`statistics`)."""
DEFAULT_MAX_STEP_CHARS = 20_000
"""Characters of one turn shown to the judge at most (its head; tool outputs can be any size):
bounds a turn's work."""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        # Content parts: the text ones (images are not shown to the judge here).
        return "\n".join(
            str(getattr(part, "text", "") or "") for part in content if getattr(part, "text", None)
        )
    return ""


def _message_text(message: Any) -> str:
    role = getattr(message, "role", "?")
    parts = [_text(getattr(message, "content", None))]
    for call in getattr(message, "tool_calls", None) or ():
        parts.append(f"tool call {call.name}({call.arguments})")
    body = "\n".join(p for p in parts if p)
    return f"{role}: {body}" if body else f"{role}: (empty)"


@dataclass(slots=True)
class _Rollout:
    tracker: AsyncProgressTracker
    seen: int
    """Messages of the trace already turned into steps (or the task)."""


@dataclass(frozen=True, slots=True)
class MonitorHooksStatistics:
    """What a `MonitorHooks` did: rollouts followed now, turns scored, stops, infra results,
    evictions, cuts."""

    rollouts: int
    """Rollouts followed now (a rollout's tracker is freed once it is scored)."""
    turns: int
    """Turns scored (a step each: the messages up to and including a model reply)."""
    stops: int
    """Rollouts stopped by the monitor."""
    infra: int
    """Checks the judge could not answer (an outage): never a reason to stop."""
    evicted: int
    """Rollouts dropped because `max_rollouts` were followed (the one idle the longest)."""
    truncated: int
    """Turns cut to `max_step_chars`."""


@dataclass(slots=True)
class _Counts:
    turns: int = 0
    stops: int = 0
    infra: int = 0
    evicted: int = 0
    truncated: int = 0


class MonitorHooks:
    """A stop predicate and a reward function for verifiers 0.4 rollouts, over one judge."""

    def __init__(
        self,
        judge: Judge,
        options: TrackerOptions | None = None,
        *,
        name: str = INFO_KEY,
        max_rollouts: int = DEFAULT_MAX_ROLLOUTS,
        max_step_chars: int = DEFAULT_MAX_STEP_CHARS,
        **tracker_options: Any,
    ) -> None:
        if max_rollouts < 1 or max_step_chars < 1:
            raise ValueError(
                f"max_rollouts={max_rollouts}, max_step_chars={max_step_chars}; use 1 or more"
            )
        self.max_step_chars = max_step_chars
        self.judge = judge
        self.options = TrackerOptions.of("monitor_hooks", options, **tracker_options)
        self.max_rollouts = max_rollouts
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        self._counts = _Counts()
        self.stop: Callable[..., Any] = self._make_stop(name)
        """`async (trace: vf.Trace) -> bool`: plug it as a task stop (or call it from a
        `@vf.stop` method)."""
        self.reward: Callable[..., Any] = self._make_reward(name)
        """`async (trace: vf.Trace) -> float`: the reward the rollout had earned when it ended."""

    def _rollout(self, trace: "Trace") -> _Rollout:
        key = str(trace.id)
        r = self._rollouts.get(key)
        if r is not None:
            self._rollouts.move_to_end(key)
            return r
        while len(self._rollouts) >= self.max_rollouts:
            self._rollouts.popitem(last=False)
            self._counts.evicted += 1
        messages = trace.messages
        # The task is what the model was given before its first reply: the prompt's messages.
        first = next(
            (i for i, m in enumerate(messages) if getattr(m, "role", None) == "assistant"),
            len(messages),
        )
        task = "\n".join(_message_text(m) for m in messages[:first]) or "(no prompt)"
        settings = {**self.options.settings(), "run_id": key}
        r = _Rollout(AsyncProgressTracker(task, judge=self.judge, **settings), first)
        self._rollouts[key] = r
        return r

    async def _turns(self, trace: "Trace") -> None:
        """Score each turn finished since the last call: the messages up to and including each
        new model reply."""
        r = self._rollout(trace)
        messages = trace.messages
        while True:
            end = next(
                (
                    i
                    for i in range(r.seen, len(messages))
                    if getattr(messages[i], "role", None) == "assistant"
                ),
                None,
            )
            if end is None:
                return
            step = "\n".join(_message_text(m) for m in messages[r.seen : end + 1])
            if len(step) > self.max_step_chars:
                self._counts.truncated += 1
                step = (
                    f"{step[: self.max_step_chars]}\n(turn cut at {self.max_step_chars} of "
                    f"{len(step)} characters)"
                )
            r.seen = end + 1
            self._counts.turns += 1
            await r.tracker.update(step)

    def _record(self, trace: "Trace") -> dict[str, Any]:
        r = self._rollout(trace)
        v = verdict(r.tracker.latest, r.tracker.summary.last_ok)
        info = {**v.to_json(), "turns": trace.num_turns}
        trace.info[INFO_KEY] = info
        return info

    def _make_stop(self, name: str) -> Callable[..., Any]:
        async def stop(trace: "Trace") -> bool:
            await self._turns(trace)
            info = self._record(trace)
            if info["stop_kind"] == "infra":
                self._counts.infra += 1
            if info["stop"]:
                self._counts.stops += 1
            return bool(info["stop"])

        return self._typed(stop, name)

    def _make_reward(self, name: str) -> Callable[..., Any]:
        async def reward(trace: "Trace") -> float:
            try:
                # the last reply, which no later model call's stop check saw
                await self._turns(trace)
                info = self._record(trace)
                latest = self._rollout(trace).tracker.latest
            finally:
                self._rollouts.pop(str(trace.id), None)
            if info["stop_kind"] == "infra" or info["reward"] is None:
                # The last turn's judge call failed: an earlier turn's score is not this rollout's
                # reward.
                raise RewardUnavailable(latest)
            return float(info["reward"])

        return self._typed(reward, name)

    @staticmethod
    def _typed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        # verifiers picks a hook's boundary from its resolved annotations (`session.hook_boundary`,
        # `get_type_hints`): set them to the real classes, imported only now.
        from verifiers.v1 import Trace

        fn.__annotations__ = {"trace": Trace, "return": fn.__annotations__.get("return")}
        fn.__name__ = fn.__qualname__ = name
        return fn

    def statistics(self) -> MonitorHooksStatistics:
        """Counters: rollouts followed now, turns scored, stops, infra results, rollouts evicted,
        turns cut."""
        c = self._counts
        return MonitorHooksStatistics(
            rollouts=len(self._rollouts),
            turns=c.turns,
            stops=c.stops,
            infra=c.infra,
            evicted=c.evicted,
            truncated=c.truncated,
        )


def monitor_hooks(
    *, judge: Judge, options: TrackerOptions | None = None, **keywords: Any
) -> MonitorHooks:
    """The stop and reward hooks for verifiers 0.4 over `judge`.

    Keywords: `name` (the stop's and reward's name), `max_rollouts`, `max_step_chars`, and tracker
    options.
    """
    return MonitorHooks(judge, options, **keywords)


__all__ = [
    "DEFAULT_MAX_ROLLOUTS",
    "DEFAULT_MAX_STEP_CHARS",
    "INFO_KEY",
    "MonitorHooks",
    "monitor_hooks",
]
