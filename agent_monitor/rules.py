"""Rule-based progress criteria: cheap, exact signals that give a score and a confidence, or no
opinion."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from ._runtime.budget import IGNORECASE, MULTILINE, Pattern
from ._runtime.config import check_number, compile_pattern, instantiate, known, registrar
from .extractors import Extractor, LastNumber, build_extractors


@dataclass(frozen=True, slots=True)
class RuleScore:
    """A rule's verdict: progress in [0, 1], how sure the rule is in [0, 1], and a human-readable
    reason."""

    score: float
    confidence: float
    detail: str

    def __post_init__(self) -> None:
        for name in ("score", "confidence"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"RuleScore.{name} must be a number in [0, 1], got {v!r}")


@dataclass(frozen=True, slots=True)
class RuleInput:
    """What a rule sees: the task, the extracted step texts so far (oldest first), per-step
    metadata, a known answer."""

    task: str
    steps: Sequence[str]
    metadata: Sequence[Mapping[str, Any]] = ()
    expected: str | None = None

    def __post_init__(self) -> None:
        # Empty metadata means "none for any step"; otherwise it must line up with the steps.
        if self.metadata and len(self.metadata) != len(self.steps):
            raise ValueError(
                f"RuleInput has {len(self.steps)} steps but {len(self.metadata)} metadata entries; "
                "give one dict per step (empty dicts are fine) or none at all"
            )


class Rule(Protocol):
    """A progress criterion computed by code: a RuleScore, or None for "no opinion"."""

    def __call__(self, inp: RuleInput, /) -> RuleScore | None: ...


_R = TypeVar("_R", bound=Rule)

RULES: dict[str, type[Rule]] = {}
"""Rule types by config name (without the `rule.` prefix); add your own with
`@register_rule("name")`."""

_PREFIX = "rule."


def _bare(name: str) -> str:
    return name[len(_PREFIX) :] if name.startswith(_PREFIX) else name


def register_rule(name: str) -> Callable[[type[_R]], type[_R]]:
    """Register a rule type under `name` (a `rule.` prefix is dropped); its constructor takes the
    config keys."""
    if not isinstance(name, str):
        raise ValueError(f"rule name must be a non-empty string, got {name!r}")
    return registrar(RULES, "rule", _bare(name))


def rule_name(rule: object) -> str:
    """A rule's display name: its `name` attribute, else its registered name, else its class
    name."""
    own = getattr(rule, "name", None)
    if isinstance(own, str) and own:
        return own
    for key, cls in RULES.items():
        if type(rule) is cls:
            return f"{_PREFIX}{key}"
    return type(rule).__name__


def _check_confidence(owner: str, value: object) -> None:
    check_number(owner, "confidence", value, 0.0, 1.0)


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


# mini-swe-agent and similar harnesses report tool output as JSON, where line breaks are the two
# characters `\n`. Budgeted patterns (see _budget): every one of them reads untrusted step text.
_ESCAPED_NEWLINE = Pattern(r"\\r?\\n")
_UNITTEST = Pattern(
    r"^Ran (?P<ran>\d+) tests? in [^\n]*\n(?:[ \t]*\n)*[ \t]*(?P<status>OK|FAILED)\b(?:[ "
    r"\t]*\((?P<counts>[^)\n]*)\))?",
    MULTILINE,
)
# What may follow a count in a summary: "7 passed, 1 error", "8 passed; 2 failed", "5 passed in
# 0.1s", "== 5 passed ==", "9 passing (2s)", or the line's end. Code and prose ("ctx*99 passed to
# get_integer", from a recorded run) do not count.
_AFTER_COUNT = Pattern(r"[ \t]*(?:[,;=(]|in[ \t]|\.?[ \t]*$)")
_DURATION = Pattern(r"\bin \d+(?:\.\d+)?s\b")
_UNITTEST_COUNT = Pattern(r"(failures|errors|skipped|expected failures|unexpected successes)=(\d+)")


def _count(pattern: Pattern, line: str) -> Any:
    return next((m for m in pattern.finditer(line) if _AFTER_COUNT.match(line, m.end())), None)


@register_rule("test_ratio")
@dataclass(frozen=True, slots=True)
class TestRatio:
    """Progress as the share of passing tests in the latest test summary: passed / (passed + failed
    + errors).

    Looks at the last `lookback` steps, newest first, and uses the first that
    holds a summary (within a step, the last summary). Understood forms:

    - one-line summaries read with the `passed`/`failed`/`errors` patterns (each with one group: the
      count; case-sensitive, so pytest -v's `test_case_2 PASSED` is not a summary; add `(?i)` if
      needed). A match counts only when followed by `,` `;` `=` `(`, the word `in`, or the line's
      end, so code and prose such as `99 passed to f()` do not; the summary is the last line where
      any pattern matches, a pattern missing from it counts 0 (a line with only an errors count must
      also show a run time such as `in 0.31s`, so that mypy's `Found 3 errors in 1 file` is not read
      as tests). With the defaults this covers pytest (`== 3 failed, 7 passed, 1 error in 2.10s ==`,
      also `-q`), jest/vitest (`Tests: 2 failed, 8 passed, 10 total`) and cargo (`test result:
      FAILED. 8 passed; 2 failed; 0 ignored`);
    - unittest: `Ran 10 tests in 0.01s` then `OK` or `FAILED (failures=2, errors=1)`;
      skipped tests and expected failures are left out, unexpected successes
      count as failures.

    Line breaks escaped as `\\n` (tool output inside JSON) count as line breaks.
    No summary, a summary with no tests (`0 passed`, `Ran 0 tests`) or a
    unittest `Ran` line without its verdict: no opinion. Skipped and xfailed
    tests never count.
    """

    __test__ = False  # not a pytest test class, whatever its name

    passed: str = r"(\d+) passed"
    failed: str = r"(\d+) failed"
    errors: str = r"(\d+) errors?"
    confidence: float = 0.9
    lookback: int = 3
    _patterns: tuple[Pattern, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pats = []
        for name in ("passed", "failed", "errors"):
            p = compile_pattern(f"test_ratio {name}", getattr(self, name))
            if p.groups < 1:
                raise ValueError(
                    f"test_ratio: the {name} pattern {p.pattern!r} needs a group around the count"
                )
            pats.append(p)
        object.__setattr__(self, "_patterns", tuple(pats))
        _check_confidence("test_ratio", self.confidence)
        check_number("test_ratio", "lookback", self.lookback, 1, float("inf"), integer=True)

    def _line_summary(self, text: str) -> tuple[int, tuple[int, int, int]] | None:
        offset = 0
        best: tuple[int, tuple[int, int, int]] | None = None
        for line in text.split("\n"):
            found = [_count(p, line) for p in self._patterns]
            # An errors count alone is a summary only with a run time ("1 error in 0.31s", pytest's
            # collection failure): "Found 3 errors in 1 file" is mypy or ruff, not a test run.
            if found[0] or found[1] or (found[2] and _DURATION.search(line)):
                counts = [
                    int(m.group(1)) if m and m.group(1) and m.group(1).isdigit() else 0
                    for m in found
                ]
                best = (offset, (counts[0], counts[1], counts[2]))
            offset += len(line) + 1
        return best

    @staticmethod
    def _unittest_summary(text: str) -> tuple[int, tuple[int, int, int]] | None:
        runs = list(_UNITTEST.finditer(text))
        if not runs:
            return None
        last = runs[-1]
        counts = {k: int(v) for k, v in _UNITTEST_COUNT.findall(last["counts"] or "")}
        failed = counts.get("failures", 0) + counts.get("unexpected successes", 0)
        errors = counts.get("errors", 0)
        run = int(last["ran"]) - counts.get("skipped", 0) - counts.get("expected failures", 0)
        return last.start(), (max(run - failed - errors, 0), failed, errors)

    def __call__(self, inp: RuleInput) -> RuleScore | None:
        """The pass ratio of the latest summary, or None."""
        n = len(inp.steps)
        for back in range(min(self.lookback, n)):
            text = _ESCAPED_NEWLINE.sub("\n", inp.steps[n - 1 - back])
            found = [
                s for s in (self._line_summary(text), self._unittest_summary(text)) if s is not None
            ]
            if not found:
                continue
            passed, failed, errors = max(found)[1]
            total = passed + failed + errors
            if total == 0:
                return None  # "no tests ran" is not evidence of progress either way
            return RuleScore(
                passed / total,
                self.confidence,
                f"step {n - back}: {passed} passed, {failed} failed, {errors} errors -> "
                f"{passed}/{total}",
            )
        return None


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        x = float(value)
    elif isinstance(value, str):
        try:
            x = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return x if math.isfinite(x) else None


_MISSING = object()


def _lookup(meta: Mapping[str, Any], path: str) -> object:
    # A literal key wins; otherwise a dotted path walks nested dicts ("pose.distance").
    if not isinstance(meta, Mapping):
        return _MISSING
    if path in meta:
        return meta[path]
    node: object = meta
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


@register_rule("metric_curve")
@dataclass(frozen=True, slots=True)
class MetricCurve:
    """Progress from a numeric metadata field, e.g. a robot's distance to its goal.

    Reads `field` (a key, or a dotted path into nested dicts) from the newest
    step whose metadata has it; the value must be a finite number (or a
    numeric string), else no opinion. With d the value:

    - `linear`: 1 - |d - goal| / |start - goal|, where `start` defaults to the
      first value the run reported: 0 where the run started, 1 at the goal,
      rising or falling goals alike. If start equals goal there is no scale:
      no opinion.
    - `exp`: exp(-|d - goal| / scale): 1 at the goal, 0.37 at one `scale` away,
      never quite 0. Suits distances without a natural start.

    The result is clamped to [0, 1] (moving away from the goal past the start gives 0).
    """

    field: str = "distance_to_goal"
    start: float | None = None
    goal: float = 0.0
    curve: Literal["linear", "exp"] = "linear"
    scale: float = 1.0
    confidence: float = 0.8

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field:
            raise ValueError(
                f"metric_curve: field must be a non-empty metadata key, got {self.field!r}"
            )
        if self.curve not in ("linear", "exp"):
            raise ValueError(f"metric_curve: curve must be 'linear' or 'exp', got {self.curve!r}")
        inf = float("inf")
        if self.start is not None:
            check_number("metric_curve", "start", self.start, -inf, inf)
        check_number("metric_curve", "goal", self.goal, -inf, inf)
        check_number("metric_curve", "scale", self.scale, 0.0, inf)
        if self.scale == 0.0:
            raise ValueError("metric_curve: scale must be above 0")
        _check_confidence("metric_curve", self.confidence)

    def __call__(self, inp: RuleInput) -> RuleScore | None:
        """The mapped progress of the newest reading, or None."""
        present = [(i, _lookup(m, self.field)) for i, m in enumerate(inp.metadata)]
        present = [(i, v) for i, v in present if v is not _MISSING]
        if not present:
            return None
        index, raw = present[-1]
        d = _number(raw)
        if d is None:
            return None
        gap = abs(d - self.goal)
        if self.curve == "exp":
            progress = math.exp(-gap / self.scale)
            how = f"exp(-{gap:g}/{self.scale:g})"
        else:
            start = (
                self.start
                if self.start is not None
                else next((x for _, v in present if (x := _number(v)) is not None), None)
            )
            if start is None or start == self.goal:
                return None
            progress = 1.0 - gap / abs(start - self.goal)
            how = f"linear from {start:g} to {self.goal:g}"
        return RuleScore(
            _clamp(progress), self.confidence, f"step {index + 1}: {self.field}={d:g}, {how}"
        )


# "Final answer: 42", "**Final Answer:** 42", "FINAL ANSWER = Paris" on a line of its own.
_FINAL_ANSWER = Pattern(
    r"^[ \t>#*_-]*final[ \t_]+answer[ \t*_]*[:=][ \t]*(?P<answer>.*?)[ \t]*$",
    IGNORECASE | MULTILINE,
)
_FRACTION = Pattern(r"^([-+]?\d+)\s*/\s*(\d+)$")


_DIGITS = Pattern(r"\d[\d,.]*")


def _declared(text: str) -> str:
    found = _FINAL_ANSWER.findall(text)
    return found[-1].strip().strip("*_`").strip() if found else ""


def _normalise(s: str) -> str:
    # Case, inner whitespace, wrapping quotes/backticks and closing full stops are presentation, not
    # content.
    s = " ".join(s.casefold().split()).rstrip(".").strip().strip("\"'`").strip()
    return s.rstrip(".").rstrip()


def _parse_float(s: str) -> float | None:
    s = s.strip().strip("$").rstrip("%").strip()
    if m := _FRACTION.match(s):
        den = int(m.group(2))
        return int(m.group(1)) / den if den else None
    x = _number(s.replace(",", ""))
    if x is not None:
        return x
    # "x = 42" or "42 apples": exactly one number in the answer is that number; two or more is
    # ambiguous.
    numbers = _DIGITS.findall(s)
    return _number(LastNumber()(s)) if len(numbers) == 1 else None


@register_rule("answer_match")
@dataclass(frozen=True, slots=True)
class AnswerMatch:
    """Compare the answer declared in the latest step with the known `expected` answer.

    The declared answer is `extractor(latest step)` when an extractor is given
    (e.g. `Boxed()`, `LastNumber()`), else the text after the last line starting
    `Final answer:` (case-insensitive, markdown emphasis allowed). Modes:
    `exact` compares after normalising case, whitespace, wrapping quotes and a
    final full stop; `contains` asks whether the normalised expected answer
    occurs in the normalised declared one; `numeric` parses both as numbers
    (thousands separators, `$`, `%`, `a/b` fractions, or the single number in
    "x = 42") and compares with math.isclose(rel_tol=abs_tol=tolerance).

    No expected answer, no steps, no declared answer, or (numeric) a side that
    does not parse: no opinion. A clean comparison that fails is a confident 0.
    """

    mode: Literal["exact", "contains", "numeric"] = "exact"
    tolerance: float = 1e-6
    confidence: float = 1.0
    extractor: Extractor | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("exact", "contains", "numeric"):
            raise ValueError(
                f"answer_match: mode must be 'exact', 'contains' or 'numeric', got {self.mode!r}"
            )
        check_number("answer_match", "tolerance", self.tolerance, 0.0, float("inf"))
        _check_confidence("answer_match", self.confidence)
        if self.extractor is not None and not callable(self.extractor):
            raise ValueError(
                f"answer_match: extractor must be a str -> str callable, got {self.extractor!r}"
            )

    @classmethod
    def from_config(cls, *, extractor: Any = None, **params: Any) -> AnswerMatch:
        """Build from config, where `extractor` may be a name, a dict or a list as in
        `build_extractors`."""
        if isinstance(extractor, (str, Mapping)):
            extractor = [extractor]
        built = None if extractor is None else build_extractors(extractor)
        made: AnswerMatch = instantiate("rule", "answer_match", cls, {**params, "extractor": built})
        return made

    def __call__(self, inp: RuleInput) -> RuleScore | None:
        """1.0 (right) or 0.0 (wrong) with this rule's confidence, or None."""
        if inp.expected is None or not inp.expected.strip() or not inp.steps:
            return None
        text = inp.steps[-1]
        answer = (self.extractor(text) if self.extractor is not None else _declared(text)).strip()
        if not answer:
            return None
        if self.mode == "numeric":
            got, want = _parse_float(answer), _parse_float(inp.expected)
            if got is None or want is None:
                return None
            right = math.isclose(got, want, rel_tol=self.tolerance, abs_tol=self.tolerance)
        elif self.mode == "contains":
            right = _normalise(inp.expected) in _normalise(answer)
        else:
            right = _normalise(answer) == _normalise(inp.expected)
        verdict = "matches" if right else "does not match"
        shown = answer if len(answer) <= 80 else answer[:77] + "..."
        return RuleScore(
            1.0 if right else 0.0,
            self.confidence,
            f"declared answer {shown!r} {verdict} the expected answer ({self.mode})",
        )


@dataclass(frozen=True, slots=True)
class CompositeScore(RuleScore):
    """A Composite's verdict: the answering member's score, with which member it was."""

    member_index: int = 0
    member_name: str = ""


@register_rule("composite")
@dataclass(frozen=True, slots=True)
class Composite:
    """An ordered chain of rules: the first member whose confidence reaches `min_confidence`
    answers.

    Cheap, exact rules go first and a costly judge last. Returns a
    CompositeScore naming the member (0-based index and name; the detail
    starts `[index] name:`), or None when no member is confident enough.
    """

    members: Sequence[Rule]
    min_confidence: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        if not self.members:
            raise ValueError("composite: members is empty; list at least one rule")
        for i, m in enumerate(self.members):
            if not callable(m):
                raise ValueError(f"composite: member {i} is a {type(m).__name__}, not a rule")
        check_number("composite", "min_confidence", self.min_confidence, 0.0, 1.0)

    @classmethod
    def from_config(cls, *, members: Any = None, **params: Any) -> Composite:
        """Build from config, where `members` is a list of rule configs as taken by `build_rule`."""
        if isinstance(members, (str, Mapping)) or not isinstance(members, Sequence):
            raise ValueError(
                f"rule 'composite': members must be a list of rule configs, got {members!r}"
            )
        built = []
        for i, m in enumerate(members):
            try:
                built.append(build_rule(m))
            except ValueError as e:
                raise ValueError(f"rule 'composite' members[{i}]: {e}") from None
        made: Composite = instantiate("rule", "composite", cls, {**params, "members": tuple(built)})
        return made

    def __call__(self, inp: RuleInput) -> CompositeScore | None:
        """The first confident member's verdict, or None."""
        for i, member in enumerate(self.members):
            result = member(inp)
            if result is not None and result.confidence >= self.min_confidence:
                name = rule_name(member)
                return CompositeScore(
                    result.score,
                    result.confidence,
                    f"[{i}] {name}: {result.detail}",
                    member_index=i,
                    member_name=name,
                )
        return None


def build_rule(spec: Mapping[str, Any]) -> Rule:
    """Build a rule from config such as `{"type": "rule.test_ratio", "confidence": 0.8}`.

    The `rule.` prefix is optional. The keys `weight` and `name` belong to the
    rubric entry the rule sits in and are not passed to the rule.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"a rule config must be a dict with a 'type', got {spec!r}")
    kind = spec.get("type")
    if not isinstance(kind, str):
        raise ValueError(f"rule config {dict(spec)!r} needs a 'type' naming one of: {known(RULES)}")
    cls = RULES.get(_bare(kind))
    if cls is None:
        raise ValueError(
            f"unknown rule {kind!r}; known rules: {known(RULES)} (with or "
            "without the 'rule.' prefix)"
        )
    params = {k: v for k, v in spec.items() if k not in ("type", "weight", "name")}
    factory: Callable[..., Any] = getattr(cls, "from_config", cls)
    built: Rule = instantiate("rule", _bare(kind), factory, params)
    return built
