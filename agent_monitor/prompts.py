"""Prefix-stable judge prompts: fixed instructions, task, criteria, steps; what varies goes last."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .criteria import Criterion, Rubric
from .images import Frame, FrameBudget
from .scale import LETTERS

INSTRUCTIONS = f"""You are a strict, calibrated judge of progress. An agent (software or robot) is working on a task; you see the task, the grading criteria, and the agent's trajectory so far (each step's action and observation, sometimes camera frames). The trajectory may be unfinished: grade how complete the task is *now*, from the evidence shown, not how it might end.

Grade on this 20-letter scale, from worst to best:
A = nothing useful done yet (or things made worse)
B-E = first steps: orientation, setup, some relevant information gathered
F-J = early real progress: some sub-goals verifiably reached
K-O = substantial progress: most sub-goals reached, the rest clearly within reach
P-S = nearly complete: the result exists, final checks or small fixes remain
T = complete, and the trajectory shows evidence that it is

Use the whole scale; the letters {LETTERS[0]}..{LETTERS[-1]} are evenly spaced. Answer with exactly one capital letter and nothing else."""

ANSWER_CUE = "Answer:"
"""Ends a plain-text prompt so that the next token is the letter (completions and in-process judges)."""


@dataclass(frozen=True, slots=True)
class TextPart:
    """Plain text in a prompt."""

    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An image in a prompt."""

    frame: Frame


Part = TextPart | ImagePart


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a trajectory: 1-based index, text, frames, and metadata for rule criteria.

    `meta` (e.g. a robot's distance to goal) is never shown to the judge.
    """

    index: int
    text: str
    frames: tuple[Frame, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A judge prompt split into a shared, prefix-stable head and a varying tail.

    `instructions` and `prefix` never change for a run except by appending
    steps; `tail` holds everything that depends on the step count or on the
    criterion. `criterion` names what is graded, for results and logs.
    """

    instructions: str
    prefix: tuple[Part, ...]
    tail: tuple[Part, ...]
    criterion: str
    step: int
    frames: int = field(default=0)

    @property
    def parts(self) -> tuple[Part, ...]:
        """Prefix then tail."""
        return self.prefix + self.tail

    @property
    def image_count(self) -> int:
        """How many image parts the prompt holds (task frames included)."""
        return sum(isinstance(p, ImagePart) for p in self.parts)

    def text(self, image: Callable[[Frame], str] = Frame.describe) -> str:
        """The whole prompt as plain text ending in the answer cue; images become `image(frame)`."""
        return render_text(self.instructions, self.parts, image) + ANSWER_CUE

    def prefix_text(self, image: Callable[[Frame], str] = Frame.describe) -> str:
        """The shared head as plain text: a prefix of the next step's `text()`."""
        return render_text(self.instructions, self.prefix, image)


def render_text(instructions: str, parts: Sequence[Part], image: Callable[[Frame], str] = Frame.describe) -> str:
    """Concatenate instructions and parts as plain text."""
    out = [instructions, "\n\n"]
    for p in parts:
        out.append(p.text if isinstance(p, TextPart) else image(p.frame) + "\n")
    return "".join(out)


def _criteria_text(rubric: Rubric) -> str:
    lines = [f"## Grading criteria ({rubric.title})\n"]
    for c in rubric.judged:
        lines.append(f"- {c.name} (weight {c.weight:.2f}): {c.description}\n")
    return "".join(lines)


def build_prompt(
    task: str,
    rubric: Rubric,
    steps: Sequence[Step],
    criterion: Criterion,
    *,
    budget: FrameBudget | None = None,
    task_frames: Sequence[Frame] = (),
) -> Prompt:
    """Build the prompt grading `criterion` after `steps`.

    Layout: instructions -> task (and its images) -> all criteria -> step 1..n,
    each step's anchor frames right after its text -> tail (recent frames, the
    step count and the criterion asked about). So the prompt for n steps, less
    its tail, is a prefix of the prompt for n + 1 steps.
    """
    budget = budget or FrameBudget()
    prefix: list[Part] = [TextPart(f"## Task\n{task.strip()}\n")]
    prefix.extend(ImagePart(f) for f in task_frames)
    prefix.append(TextPart("\n" + _criteria_text(rubric) + "\n## Trajectory so far\n"))

    ordinal: list[tuple[int, Frame]] = [(s.index, f) for s in steps for f in s.frames]
    anchors, recent = budget.select(len(ordinal))
    anchor_set = set(anchors)
    k = 0
    text: list[str] = []
    for s in steps:
        text.append(f"\n### Step {s.index}\n{s.text.strip()}\n")
        for f in s.frames:
            if k in anchor_set:
                prefix.append(TextPart("".join(text)))
                text.clear()
                prefix.append(ImagePart(f))
            k += 1
    if text:
        prefix.append(TextPart("".join(text)))

    tail: list[Part] = []
    if recent:
        tail.append(TextPart("\n## Most recent camera frames\n"))
        for i in recent:
            idx, f = ordinal[i]
            tail.append(TextPart(f"Step {idx}:\n"))
            tail.append(ImagePart(f))
    n = steps[-1].index if steps else 0
    tail.append(
        TextPart(
            f"\n## Question\nThe trajectory above has {n} step{'s' if n != 1 else ''} so far. "
            f"Grade only the criterion '{criterion.name}': {criterion.description}\n"
            f"Reply with one letter from {LETTERS[0]} (nothing done) to {LETTERS[-1]} (complete and verified).\n"
        )
    )
    return Prompt(
        instructions=INSTRUCTIONS,
        prefix=_merge(prefix),
        tail=tuple(tail),
        criterion=criterion.name,
        step=n,
        frames=len(anchors) + len(recent),
    )


def _merge(parts: Sequence[Part]) -> tuple[Part, ...]:
    """Join adjacent text parts, so the head is one text block between images."""
    out: list[Part] = []
    for p in parts:
        if isinstance(p, TextPart) and out and isinstance(out[-1], TextPart):
            out[-1] = TextPart(out[-1].text + p.text)
        elif not (isinstance(p, TextPart) and not p.text):
            out.append(p)
    return tuple(out)
