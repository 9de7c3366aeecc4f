"""What the judge sees of a long robot episode: time covered by its frames, images per prompt,
prefix reuse.

A 10-minute episode at 10 Hz (6,000 steps, one camera frame a step) is scored once a second (every
10th step, the fleet target). At each update the prompt is built as the monitor builds it, with the
frame budget of today (`FrameBudget`: strided anchors whose stride doubles, plus the newest frames)
and, in the same process, with the rule it replaced (an anchor every 8th frame until 64 anchors,
then none: "anchors stop after 64"), both with the newest 4 frames in the tail.

Reported, per layout:
- coverage: the share of the episode so far (its 10-second windows, and its minutes) holding at
  least one frame the judge sees, averaged over the updates and at the last one;
- images per prompt at the last update;
- prefix reuse: the share of each prompt that is a prefix of the next one (what a prefix cache
  keeps), averaged over the updates, counting text as 4 characters a token and an image as 100
  tokens (a 320x240 frame in Qwen2.5-VL's 28-pixel merged patches). What bounds it: the step text is
  short, as a robot's is, so images are most of the prompt.

    .venv/bin/python bench/frame_coverage.py [--minutes 10] [--hz 10] [--every-updates 10]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys

from _common import kv_line, load1

from agent_monitor import load_criteria
from agent_monitor.images import Frame, FrameBudget
from agent_monitor.prompts import ImagePart, Part, Prompt, Step, build_prompt

IMAGE_TOKENS = 100
CHARS_PER_TOKEN = 4


class CappedBudget:
    """The replaced rule: an anchor every `every`-th frame until `max_frames` anchors, then the
    recent ones only."""

    def __init__(self, every: int = 8, recent: int = 4, max_frames: int = 64) -> None:
        self.every, self.recent, self.max_frames = every, recent, max_frames

    def select(self, total: int) -> tuple[list[int], list[int]]:
        anchors = list(range(0, total, self.every))[: self.max_frames]
        kept = set(anchors)
        return anchors, [i for i in range(max(0, total - self.recent), total) if i not in kept]


def frame(i: int) -> Frame:
    data = f"f{i}".encode()
    return Frame(
        data=data, mime="image/jpeg", width=320, height=240, digest=hashlib.sha256(data).hexdigest()
    )


def tokens(parts: tuple[Part, ...] | list[Part]) -> float:
    return sum(
        IMAGE_TOKENS if isinstance(p, ImagePart) else len(p.text) / CHARS_PER_TOKEN for p in parts
    )


def shared_prefix(a: Prompt, b: Prompt) -> float:
    """Tokens of `a` (instructions and parts) that `b` starts with."""
    n = len(a.instructions) / CHARS_PER_TOKEN
    for x, y in zip(a.parts, b.parts, strict=False):
        if isinstance(x, ImagePart) or isinstance(y, ImagePart):
            if not (
                isinstance(x, ImagePart)
                and isinstance(y, ImagePart)
                and x.frame.digest == y.frame.digest
            ):
                return n
            n += IMAGE_TOKENS
            continue
        common = 0
        for cx, cy in zip(x.text, y.text, strict=False):
            if cx != cy:
                break
            common += 1
        n += common / CHARS_PER_TOKEN
        if common < len(x.text):
            return n
    return n


def covered(shown: list[int], n: int, window: int) -> float:
    """The share of the first `n` frames' windows of `window` frames that hold a shown frame."""
    windows = -(-n // window)
    return len({i // window for i in shown}) / windows


def run(budget: object, steps: list[Step], every_updates: int, hz: int) -> dict[str, float]:
    rubric = load_criteria("robot")
    crit = rubric.criteria[0]
    cov10, cov60, reuse = [], [], []
    prev: Prompt | None = None
    last: Prompt | None = None
    for n in range(every_updates, len(steps) + 1, every_updates):
        p = build_prompt(
            "Put the red block on the blue one.", rubric, steps[:n], crit, budget=budget
        )  # type: ignore[arg-type]
        shown = [int(part.frame.data[1:]) for part in p.parts if isinstance(part, ImagePart)]
        cov10.append(covered(shown, n, 10 * hz))
        cov60.append(covered(shown, n, 60 * hz))
        if prev is not None:
            reuse.append(
                shared_prefix(prev, p)
                / (len(prev.instructions) / CHARS_PER_TOKEN + tokens(list(prev.parts)))
            )
        prev = last = p
    assert last is not None
    return {
        "coverage_10s_mean": statistics.fmean(cov10),
        "coverage_10s_last": cov10[-1],
        "coverage_60s_mean": statistics.fmean(cov60),
        "coverage_60s_last": cov60[-1],
        "coverage_60s_min": min(cov60),
        "images_last": float(last.image_count),
        "prefix_reuse": statistics.fmean(reuse),
        "prefix_reuse_min": min(reuse),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--hz", type=int, default=10)
    ap.add_argument(
        "--every-updates",
        type=int,
        default=10,
        help="steps between updates (10 at 10 Hz: 1 a second)",
    )
    args = ap.parse_args()
    total = int(args.minutes * 60 * args.hz)
    steps = [
        Step(
            i,
            f"tick {i}: move_ee dx=+0.01 dy=-0.02 gripper=open; ee=(0.41, 0.12, 0.30)",
            (frame(i - 1),),
        )
        for i in range(1, total + 1)
    ]
    print(
        f"episode: {total} steps at {args.hz} Hz, scored every {args.every_updates} steps; "
        f"load {load1()}"
    )
    results = {}
    for name, budget in (("before", CappedBudget()), ("after", FrameBudget())):
        results[name] = r = run(budget, steps, args.every_updates, args.hz)
        print(kv_line(layout=name, **{k: round(v, 3) for k, v in r.items()}))
    print(
        kv_line(
            prefix_reuse_delta_points=round(
                100 * (results["after"]["prefix_reuse"] - results["before"]["prefix_reuse"]), 2
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
