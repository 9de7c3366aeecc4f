"""Runs for the web board's browser test and its screenshot in docs/metrics.md: a scripted judge
whose curves have shapes.

The task text names the shape; `answer` turns (shape, step) into a letter distribution with some
spread (so the board draws an uncertainty band), and `RUNS` lists runs of every kind the board
shows: groups, a climb, a plateau, a stall told to abort, a wobble told to resample, a judge
failure, an ended run.
"""

from __future__ import annotations

import math
from typing import Any

from agent_monitor.prompts import Prompt
from agent_monitor.scale import LETTERS
from agent_monitor.testing import Answer, FakeJudge


def _around(x: float, width: float = 0.3) -> dict[str, float]:
    """Most mass on the letter nearest x in [0, 1], `width` of it on the two letters either side."""
    i = round(min(1.0, max(0.0, x)) * (len(LETTERS) - 1))
    out: dict[str, float] = {}
    for offset, share in (
        (0, 1.0 - width),
        (-1, width * 0.3),
        (1, width * 0.3),
        (-2, width * 0.2),
        (2, width * 0.2),
    ):
        letter = LETTERS[min(len(LETTERS) - 1, max(0, i + offset))]
        out[letter] = out.get(letter, 0.0) + share
    return out


def shape(kind: str, step: int) -> float:
    """The progress a run of this kind has made by `step`."""
    if kind == "climb":
        return min(0.95, 0.08 + 0.045 * step + 0.03 * math.sin(step * 1.3))
    if kind == "plateau":
        return 0.55 * (1 - math.exp(-step / 4)) + 0.02 * math.sin(step)
    if kind == "stall":
        return max(0.02, 0.35 - 0.05 * step)
    if kind == "wobble":
        return 0.45 + 0.12 * math.sin(step * 0.9)
    if kind == "late":
        return 0.05 if step < 8 else min(0.9, 0.05 + 0.11 * (step - 7))
    return 0.05 * step


def answer(prompt: Prompt) -> Answer:
    """The scripted judge: the task's first word is the curve's shape; 'flaky' fails at step 3."""
    text = prompt.prefix_text()
    kind = next(
        (k for k in ("climb", "plateau", "stall", "wobble", "late", "flaky") if f"[{k}]" in text),
        "",
    )
    if kind == "flaky" and prompt.step == 3:
        return FakeJudge.failure("timeout", "the judge did not answer in 60 s")
    width = 0.5 if kind in ("climb", "late") else 0.8 if kind == "wobble" else 0.65
    return _around(shape(kind or "climb", prompt.step), width)


RUNS: list[dict[str, Any]] = [
    {
        "run_id": "swe-4211-attempt-1",
        "task": "[climb] Fix the off-by-one in the pagination helper so test_last_page passes",
        "labels": {"group": "swe-bench", "model": "gpt-5-mini"},
        "steps": 16,
    },
    {
        "run_id": "swe-4211-attempt-2",
        "task": "[stall] Fix the off-by-one in the pagination helper so test_last_page passes",
        "labels": {"group": "swe-bench", "model": "small-coder"},
        "steps": 9,
    },
    {
        "run_id": "tb-build-linux-07",
        "task": "[plateau] Build the kernel with the provided config and boot it in QEMU",
        "labels": {"group": "terminal-bench", "model": "gpt-5-mini"},
        "steps": 14,
    },
    {
        "run_id": "tb-git-bisect-02",
        "task": "[wobble] Find the commit that broke the date parser with git bisect",
        "labels": {"group": "terminal-bench", "model": "small-coder"},
        "steps": 12,
        "policy": {"resample_below": 0.4, "abort_below": None},
    },
    {
        "run_id": "robot-pick-place-3",
        "task": "[late] Pick the red cube and place it in the blue bin",
        "labels": {"group": "robot"},
        "steps": 15,
        "policy": {"abort_below": None},
    },
    {
        "run_id": "support-ticket-881",
        "task": "[flaky] Answer the customer's refund question from the policy document",
        "labels": {"model": "gpt-5-mini"},
        "steps": 6,
    },
]
