"""What every trainer integration shares: the stop kind, a run's verdict, the reward-unavailable
error, turn splitting."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..progress import Progress

StopKind = Literal["judged", "infra"]
"""Why the monitor's latest answer is what it is: a judged score, or a judge/infrastructure
failure (no score)."""

DEFAULT_MAX_STEPS = 64
"""Steps a finished trajectory is split into at most (later pieces are merged into the last):
bounds one reward's work."""
DEFAULT_MAX_CHARS = 200_000
"""Characters of a trajectory scored at most (its head is kept, the rest cut): bounds one
reward's prompt."""


class RewardUnavailable(RuntimeError):
    """The judge failed, so there is no reward: the trainer should drop the rollout, not score it.

    `reason` is the failure's code (see `agent_monitor.progress.FAILURES`); `stop_kind` is always
    "infra".
    """

    stop_kind: StopKind = "infra"

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.reason = "nothing_scored" if progress is None else progress.reason or "scoring_failed"
        why = (
            "no step was scored"
            if progress is None
            else f"the judge failed at step {progress.step} ({self.reason}: {progress.error})"
        )
        super().__init__(
            f"no reward: {why}; a failed judge never yields a score: drop this rollout (or, "
            "for verl, pass "
            "infra_reward= to get a number marked stop_kind='infra')"
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """The monitor's answer on a run at its latest result, in a trainer's terms."""

    step: int
    """The step of the latest result (0: nothing scored yet)."""
    score: float | None
    """The latest result's score (None: it failed, or nothing was scored)."""
    reward: float | None
    """The reward the run had earned so far: the newest judged score (None: no step was judged
    yet)."""
    signal: str | None
    """The policy's signal after the latest result (None: no policy)."""
    reason: str
    """Why: the policy's reason, or the judge failure's code."""
    stop: bool
    """Stop the rollout now: the policy (or the group) aborted it, on judged scores; never
    because a judge failed."""
    stop_kind: StopKind
    """"judged": the answer rests on scores (an abort, or a scored latest result); "infra": the
    latest judge call failed and nothing was aborted, so nothing here may stop or penalise the run.
    """

    def to_json(self) -> dict[str, Any]:
        """A plain mapping (what crosses a Ray boundary and lands in a trace's info)."""
        return {
            "step": self.step,
            "score": self.score,
            "reward": self.reward,
            "signal": self.signal,
            "reason": self.reason,
            "stop": self.stop,
            "stop_kind": self.stop_kind,
        }


def verdict(latest: Progress | None, last_ok: Progress | None) -> Verdict:
    """The verdict of a run whose newest result is `latest` and newest scored result is
    `last_ok`."""
    reward = last_ok.score if last_ok is not None else None
    if latest is None:
        return Verdict(0, None, reward, None, "nothing scored yet", False, "judged")
    decision = latest.signal
    signal = decision.signal if decision is not None else None
    if signal == "abort" and decision is not None:
        # An abort is final and only judged scores reach one (the policy fails open), or the group's
        # ranking prunes the run: judged, even when the newest call, made after it, failed.
        return Verdict(latest.step, latest.score, reward, signal, decision.reason, True, "judged")
    if not latest.ok:
        # A failed judge is no evidence about the run: never a stop, never a penalty (fail open).
        return Verdict(
            latest.step, None, reward, signal, latest.reason or "scoring_failed", False, "infra"
        )
    reason = decision.reason if decision is not None else "scored"
    return Verdict(latest.step, latest.score, reward, signal, reason, False, "judged")


# Chat-template turn openers (ChatML/Qwen, Llama 3, Gemma, Mistral), then tool blocks: the first
# rule that cuts a text in two or more pieces splits it.
_TURN_MARKERS = (
    re.compile(r"<\|im_start\|>"),
    re.compile(r"<\|start_header_id\|>"),
    re.compile(r"<start_of_turn>"),
    re.compile(r"\[INST\]"),
    re.compile(r"(?=<tool_call>)|(?=<tool_response>)|(?=<\|tool_call\|>)"),
)


def split_turns(
    text: str, *, max_steps: int = DEFAULT_MAX_STEPS, max_chars: int = DEFAULT_MAX_CHARS
) -> list[str]:
    """A decoded trajectory as steps: chat-template turns, else tool-call blocks, else blank-line
    paragraphs.

    At most `max_steps` steps (the rest joined into the last) over at most `max_chars` characters,
    so one reward request's work is bounded whatever the trainer sends.
    """
    if max_steps < 1 or max_chars < 1:
        raise ValueError(f"max_steps={max_steps}, max_chars={max_chars}; use 1 or more")
    text = text[:max_chars]
    pieces: list[str] = []
    for marker in _TURN_MARKERS:
        pieces = [p.strip() for p in marker.split(text) if p.strip()]
        if len(pieces) > 1:
            break
    else:
        pieces = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if len(pieces) > max_steps:
        pieces = [*pieces[: max_steps - 1], "\n\n".join(pieces[max_steps - 1 :])]
    return pieces


def task_text(
    extra_info: Mapping[str, Any] | None, keys: tuple[str, ...] = ("task", "question", "prompt")
) -> str | None:
    """The task a sample's `extra_info` names (its first non-empty `keys` entry), else None."""
    if not isinstance(extra_info, Mapping):
        return None
    for key in keys:
        value = extra_info.get(key)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, list) and value and isinstance(value[-1], Mapping):
            # A chat prompt (verl's raw_prompt form): the last user message is the task.
            content = value[-1].get("content")
            if isinstance(content, str) and content.strip():
                return content
    return None
