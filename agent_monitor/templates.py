"""Editable judge prompt templates, checked at load: every placeholder present, nothing per-step
before the trajectory.

A progress template holds `{task}`, `{criteria}`, `{trajectory}` and `{question}`; `{question}`
(what changes per step: the step count, the criterion asked about) comes after `{trajectory}`, so
the prompt for step n, less its tail, stays a prefix of the prompt for step n + 1 and a serving
engine's prefix cache reads each step once. A directed pairwise template, as the llm-as-verifier
skill's `templates/prompt.md` (`{task}`, `{a}`, `{b}`, a letter per `<score_A>` / `<score_B>` tag),
grades two trajectories: it is for `compare` / `select`, and refused for progress with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
PROGRESS_PLACEHOLDERS = ("task", "criteria", "trajectory", "question")
"""A progress template's placeholders, in the order they must appear."""
PAIRWISE_PLACEHOLDERS = ("task", "a", "b")
"""A directed pairwise template's required placeholders, in order (`criterion_name`,
`criterion_description`, `note` are optional)."""
_PAIRWISE_OPTIONAL = ("criterion_name", "criterion_description", "note")
_SCORE_TAGS = ("<score_A>", "<score_B>")


class TemplateError(ValueError):
    """A prompt template that cannot be used; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class PromptTemplate:
    """A checked template: its text, what it grades (`kind`), and where it came from."""

    text: str
    kind: Literal["progress", "pairwise"]
    source: str

    @property
    def uses(self) -> str:
        """Where the template can be used, in words."""
        if self.kind == "progress":
            return "progress scoring (one trajectory as it grows)"
        return (
            "pairwise comparison (two trajectories, a letter per <score_A> / <score_B> "
            "tag), not progress"
        )

    def check_for(self, use: Literal["progress", "pairwise"]) -> None:
        """Raise TemplateError if this template cannot be used for `use`, saying why."""
        if use == self.kind:
            return
        if use == "progress":
            raise TemplateError(
                f"{self.source}: a directed pairwise template (trajectories {{a}} and {{b}}, "
                "a letter per "
                "<score_A>/<score_B> tag) grades two trajectories against each other; "
                "progress grades one "
                "trajectory as it grows: use it with compare/select, or write a progress "
                "template with "
                "{task}, {criteria}, {trajectory} and {question}"
            )
        raise TemplateError(
            f"{self.source}: a progress template grades one trajectory; compare/select need a "
            "pairwise one with "
            "{task}, {a}, {b} and <score_A>/<score_B> tags"
        )


def fill(text: str, values: Mapping[str, str]) -> str:
    """A template's text with each `{name}` of `values` replaced (other braces, and names not
    given, left as they are)."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def load_template(spec: str | Path) -> PromptTemplate:
    """A template from a file path (or, for a string holding `{`, the template text itself),
    checked."""
    if isinstance(spec, Path) or "{" not in spec:
        path = Path(spec)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise TemplateError(f"cannot read prompt template {path}: {e.strerror}") from None
        return check_template(text, source=str(path))
    return check_template(spec)


def check_template(text: str, *, source: str = "<template>") -> PromptTemplate:
    """Check a template's placeholders and their order; raise TemplateError with the reason."""
    found = _PLACEHOLDER.findall(text)
    at = {
        name: m.start()
        for m in reversed(list(_PLACEHOLDER.finditer(text)))
        for name in [m.group(1)]
    }
    if "a" in at or "b" in at:
        return _pairwise(text, found, at, source)
    unknown = sorted(set(found) - set(PROGRESS_PLACEHOLDERS))
    if unknown:
        raise TemplateError(
            f"{source}: unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; a "
            "progress template uses "
            f"{', '.join('{' + p + '}' for p in PROGRESS_PLACEHOLDERS)}"
        )
    missing = [p for p in PROGRESS_PLACEHOLDERS if p not in at]
    if missing:
        raise TemplateError(
            f"{source}: lacks {', '.join('{' + p + '}' for p in missing)}; a progress "
            "template holds each of "
            f"{', '.join('{' + p + '}' for p in PROGRESS_PLACEHOLDERS)} once"
        )
    repeated = sorted({p for p in found if found.count(p) > 1})
    if repeated:
        raise TemplateError(
            f"{source}: {', '.join('{' + p + '}' for p in repeated)} appear more than once; "
            "use each once"
        )
    if at["question"] < at["trajectory"]:
        raise TemplateError(
            f"{source}: {{question}} comes before {{trajectory}}; the question changes with "
            "every step (the step "
            "count, the criterion asked about), so placed first it changes the prompt's head "
            "and no prefix cache "
            "can reuse the trajectory: put {question} after {trajectory}"
        )
    for p in ("task", "criteria"):
        if at[p] > at["trajectory"]:
            raise TemplateError(
                f"{source}: {{{p}}} comes after {{trajectory}}; it is the same for every "
                "step, and after the growing "
                f"trajectory it breaks prefix stability: put {{{p}}} before {{trajectory}}"
            )
    return PromptTemplate(text, "progress", source)


def _pairwise(text: str, found: list[str], at: dict[str, int], source: str) -> PromptTemplate:
    unknown = sorted(set(found) - set(PAIRWISE_PLACEHOLDERS) - set(_PAIRWISE_OPTIONAL))
    if unknown:
        raise TemplateError(
            f"{source}: unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)} in "
            "a pairwise template; "
            f"use {', '.join('{' + p + '}' for p in (*PAIRWISE_PLACEHOLDERS, *_PAIRWISE_OPTIONAL))}"
        )
    missing = [p for p in PAIRWISE_PLACEHOLDERS if p not in at]
    if missing:
        raise TemplateError(
            f"{source}: a pairwise template lacks {', '.join('{' + p + '}' for p in missing)}"
        )
    if not at["task"] < at["a"] < at["b"]:
        raise TemplateError(
            f"{source}: a pairwise template shows {{task}}, then {{a}}, then {{b}}; both "
            "orders then share the task"
        )
    tags = [t for t in _SCORE_TAGS if t not in text]
    if tags:
        raise TemplateError(
            f"{source}: a pairwise template asks for a letter per trajectory; it lacks "
            f"{', '.join(tags)}"
        )
    return PromptTemplate(text, "pairwise", source)


__all__ = [
    "PAIRWISE_PLACEHOLDERS",
    "PROGRESS_PLACEHOLDERS",
    "PromptTemplate",
    "TemplateError",
    "check_template",
    "fill",
    "load_template",
]
