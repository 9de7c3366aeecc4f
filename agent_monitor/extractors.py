"""Per-step text extractors: small composable `str -> str` transforms applied before any
criterion sees a step."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ._runtime.budget import DOTALL, IGNORECASE, MULTILINE, Pattern
from ._runtime.config import check_number, compile_pattern, instantiate, known, registrar

# Every pattern here reads untrusted step text: each is a budgeted `Pattern` (see _budget), ours
# included, since a lazy `.*?` before a backreference or a `[ \t]*$` is quadratic on a crafted step.


class Extractor(Protocol):
    """Anything that maps a step's text to the text a criterion should see."""

    def __call__(self, text: str, /) -> str: ...


_T = TypeVar("_T", bound=Extractor)

EXTRACTORS: dict[str, type[Extractor]] = {}
"""Extractor types by config name; add your own with `@register_extractor("name")`."""


def register_extractor(name: str) -> Callable[[type[_T]], type[_T]]:
    """Register an extractor type under `name` so that config can build it; its constructor takes
    the config keys."""
    return registrar(EXTRACTORS, "extractor", name)


@register_extractor("strip_reasoning")
@dataclass(frozen=True, slots=True)
class StripReasoning:
    """Remove reasoning blocks such as `<think>...</think>` and `<thinking>...</thinking>`.

    Case-insensitive and multiline. An opening tag that is never closed drops
    everything after it (a model cut off mid-thought), and a closing tag with
    no opening one drops everything before it (chat templates such as
    DeepSeek-R1's and Qwen3's put the opening `<think>` in the prompt, so the
    output starts inside the block). The result is stripped of outer whitespace.
    """

    tags: tuple[str, ...] = ("think", "thinking")
    _blocks: Pattern = field(init=False, repr=False, compare=False)
    _open: Pattern = field(init=False, repr=False, compare=False)
    _close: Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (
            isinstance(self.tags, str)
            or not self.tags
            or not all(isinstance(t, str) and t for t in self.tags)
        ):
            raise ValueError(
                f"strip_reasoning: tags must be a non-empty list of tag names, got {self.tags!r}"
            )
        object.__setattr__(self, "tags", tuple(self.tags))
        names = "|".join(re.escape(t) for t in self.tags)
        flags = IGNORECASE | DOTALL
        object.__setattr__(self, "_blocks", Pattern(rf"<({names})\b[^>]*>.*?</\1\s*>", flags))
        object.__setattr__(self, "_open", Pattern(rf"<(?:{names})\b[^>]*>.*\Z", flags))
        object.__setattr__(self, "_close", Pattern(rf"\A.*?</(?:{names})\s*>", flags))

    def __call__(self, text: str) -> str:
        """The text without its reasoning blocks."""
        text = self._blocks.sub("", text)
        text = self._close.sub("", text, count=1)
        return self._open.sub("", text).strip()


# `<|im_start|>`, `<|eot_id|>`, DeepSeek's tokens written with full-width bars (U+FF5C), and the
# common bare tokens.
_SPECIAL = Pattern(
    r"<[|\uff5c][^<>|\uff5c\n]{1,60}[|\uff5c]>"
    r"|</?s>|<(?:bos|eos|pad)>|<(?:start|end)_of_turn>|\[/?INST\]"
)


_TRAILING_SPACE = Pattern(r"[ \t\r\f\v]+$", MULTILINE)
_BLANK_LINES = Pattern(r"\n{3,}")


@register_extractor("strip_special_tokens")
@dataclass(frozen=True, slots=True)
class StripSpecialTokens:
    """Remove chat special tokens and tidy whitespace.

    Removes `<|...|>` tokens (`<|im_start|>`, `<|im_end|>`, `<|eot_id|>`,
    `<|start_header_id|>`, ...), DeepSeek's tokens with full-width bars (U+FF5C), `<s>`, `</s>`,
    `<bos>`, `<eos>`, `<pad>`, Gemma's `<start_of_turn>`/`<end_of_turn>` and
    `[INST]`/`[/INST]`; role words after them (`user`, `assistant`) stay. Then
    trailing whitespace goes from every line, any run of blank lines becomes one
    blank line, and the text is stripped. Indentation is kept (tracebacks need it).
    """

    def __call__(self, text: str) -> str:
        """The text without special tokens, with tidy whitespace."""
        text = _SPECIAL.sub("", text)
        text = _TRAILING_SPACE.sub("", text)
        return _BLANK_LINES.sub("\n\n", text).strip()


def clip_middle(text: str, limit: int, *, room: int = 0) -> str:
    """The text, or when it is over `limit` characters its head and tail around a `[... N characters
    cut ...]` line.

    Head and tail: a text's start says what ran, its end how it ended. `room`: characters each half
    gives up so that the result, marker line included, stays within `limit` (a wire bound).
    """
    if len(text) <= limit:
        return text
    half = max(1, limit // 2 - room)
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


@register_extractor("truncate")
@dataclass(frozen=True, slots=True)
class Truncate:
    """Keep at most `max_chars` characters: the head and the tail, with a marker line saying how
    much was cut.

    `head_share` of the budget goes to the head (an observation's start says
    what ran), the rest to the tail (its end says how it ended). The marker
    line `[... N characters cut ...]` comes on top of the budget. Text within
    the budget is returned unchanged.
    """

    max_chars: int = 4000
    head_share: float = 0.5

    def __post_init__(self) -> None:
        check_number("truncate", "max_chars", self.max_chars, 1, float("inf"), integer=True)
        check_number("truncate", "head_share", self.head_share, 0.0, 1.0)

    def __call__(self, text: str) -> str:
        """The text, cut in the middle if it is over budget."""
        if len(text) <= self.max_chars:
            return text
        head = round(self.max_chars * self.head_share)
        tail = self.max_chars - head
        cut = len(text) - self.max_chars
        return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail :]}"


@register_extractor("regex_capture")
@dataclass(frozen=True, slots=True)
class RegexCapture:
    """The text captured by `group` of the first match of `pattern` (all matches, one a line, when
    `all`).

    No match gives "" rather than the input: used as a filter (say, to pick a
    `Final answer:` line), passing the whole text on would let a later rule
    read an answer the agent never declared. A group that did not take part
    in a match counts as no capture. `group` may be a number (0 = the whole
    match) or a group name; write flags inline, e.g. `(?im)`.
    """

    pattern: str
    group: int | str = 1
    all: bool = False
    _regex: Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = compile_pattern("regex_capture", self.pattern)
        g = self.group
        if isinstance(g, bool) or not isinstance(g, (int, str)):
            raise ValueError(f"regex_capture: group must be a number or a group name, got {g!r}")
        if isinstance(g, int) and not 0 <= g <= regex.groups:
            raise ValueError(
                f"regex_capture: pattern {self.pattern!r} has {regex.groups} group(s), so "
                f"group {g} does not exist; "
                "add parentheses around the part to capture, or use group=0 for the whole match"
            )
        if isinstance(g, str) and g not in regex.groupindex:
            raise ValueError(f"regex_capture: pattern {self.pattern!r} has no group named {g!r}")
        if not isinstance(self.all, bool):
            raise ValueError(f"regex_capture: all must be true or false, got {self.all!r}")
        object.__setattr__(self, "_regex", regex)

    def __call__(self, text: str) -> str:
        """The captured text, or "" when nothing matches."""
        if not self.all:
            m = self._regex.search(text)
            return (m.group(self.group) or "") if m else ""
        found = (m.group(self.group) for m in self._regex.finditer(text))
        return "\n".join(s for s in found if s)


# A number not glued to a word before or after it ("x2", "3rd" do not count; "1-3" ends in 3, not
# -3). Thousands separators only in groups of exactly three digits, so "[1,2,3]" reads as three
# numbers.
_NUMBER = Pattern(
    r"(?<![\w.])[-+\u2212]?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?!\w)"
)


def _normalise_number(s: str) -> str:
    s = s.replace(",", "").replace("\u2212", "-")
    return s[1:] if s.startswith("+") else s


@register_extractor("last_number")
@dataclass(frozen=True, slots=True)
class LastNumber:
    """The last number in the text, normalised (`-1,234.5` -> `-1234.5`, `+3` -> `3`), or "" when
    there is none.

    Understands integers, decimals, a leading sign (also the Unicode minus U+2212),
    exponents (`1e-5`), thousands separators in groups of three, and a trailing
    `%` (the number without it). A number glued to letters before or after it
    (`x2`, `v1`, `3rd`) is not one; decimal commas (`3,5`) are not understood.
    """

    def __call__(self, text: str) -> str:
        """The last number, or ""."""
        found = _NUMBER.findall(text)
        return _normalise_number(found[-1]) if found else ""


_BOXED = Pattern(r"\\(?:boxed|fbox)\s*\{")


@register_extractor("boxed")
@dataclass(frozen=True, slots=True)
class Boxed:
    """The content of the last balanced `\\boxed{...}` (or `\\fbox{...}`), nested braces
    included, or ""."""

    def __call__(self, text: str) -> str:
        """The boxed content, stripped, or ""."""
        starts = [m.end() for m in _BOXED.finditer(text)]
        if not starts:
            return ""
        # One pass matching every brace (not a scan to the end per `\boxed{`: that is quadratic on a
        # crafted step).
        closes: dict[int, int] = {}
        open_at: list[int] = []
        for i, c in enumerate(text):
            if c == "{":
                open_at.append(i + 1)
            elif c == "}" and open_at:
                closes[open_at.pop()] = i
        for start in reversed(starts):
            end = closes.get(start)
            if end is not None:
                return text[start:end].strip()
        return ""


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Extractors applied in order; an empty pipeline returns the text unchanged."""

    extractors: Sequence[Extractor] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extractors", tuple(self.extractors))
        for i, e in enumerate(self.extractors):
            if not callable(e):
                raise ValueError(
                    f"pipeline item {i} is a {type(e).__name__}, not an "
                    "extractor (a str -> str callable)"
                )

    def __call__(self, text: str) -> str:
        """The text after every extractor."""
        for e in self.extractors:
            text = e(text)
        return text


ExtractorSpec = str | Mapping[str, Any] | Extractor
"""A config item: a registered name, a dict `{"type": name, **params}`, or an extractor object."""


def build_extractor(spec: ExtractorSpec) -> Extractor:
    """Build one extractor from a name, a `{"type": name, **params}` dict, or pass an extractor
    object through."""
    if isinstance(spec, str):
        name, params = spec, {}
    elif isinstance(spec, Mapping):
        if not isinstance(spec.get("type"), str):
            raise ValueError(
                f"extractor config {dict(spec)!r} needs a 'type' naming one of: {known(EXTRACTORS)}"
            )
        name, params = spec["type"], {k: v for k, v in spec.items() if k != "type"}
    elif callable(spec):
        return spec
    else:
        raise ValueError(
            f"an extractor config item is a {type(spec).__name__}; use a name or a dict with "
            "'type' "
            f"(one of: {known(EXTRACTORS)})"
        )
    cls = EXTRACTORS.get(name)
    if cls is None:
        raise ValueError(f"unknown extractor {name!r}; known extractors: {known(EXTRACTORS)}")
    built: Extractor = instantiate("extractor", name, cls, params)
    return built


def build_extractors(spec: Sequence[ExtractorSpec] | None) -> Pipeline:
    """Build a Pipeline from config: a list of names (`"strip_reasoning"`) or dicts (`{"type":
    "truncate", ...}`)."""
    if spec is None:
        return Pipeline()
    if isinstance(spec, (str, Mapping)):
        raise ValueError(
            f"extractors config must be a list, got {spec!r}; wrap a single item in a list"
        )
    out: list[Extractor] = []
    for i, item in enumerate(spec):
        try:
            out.append(build_extractor(item))
        except ValueError as e:
            raise ValueError(f"extractors[{i}]: {e}") from None
    return Pipeline(tuple(out))


_ERRORS = (
    # A shell's or harness's non-zero exit: "[exit code 1]", "exit code: 2", "returncode=1", "exit
    # status 127".
    r"(?i)(?:exit[ _]code|returncode|exit status)\W{0,3}(-?0*[1-9]\d*)",
    # A Python traceback (one per traceback, whatever its depth).
    r"(Traceback \(most recent call last\))",
    # Failed tests: pytest's "3 failed" summary and per-test "FAILED" lines, unittest's "FAILED
    # (failures=2)".
    r"(?m)(\d+ failed\b|^FAILED\b.*$|FAILED \((?:failures|errors)=\d+\))",
)


@register_extractor("errors")
@dataclass(frozen=True, slots=True)
class ErrorLines:
    """One line per error the text shows: non-zero exit codes, Python tracebacks, failed-test
    reports.

    `eval` counts them as a baseline a live monitor has without a judge (the `errors` signal); as an
    extractor it hands a criterion only the errors of a step.
    """

    _captures: tuple[RegexCapture, ...] = field(
        default=tuple(RegexCapture(p, all=True) for p in _ERRORS),
        init=False,
        repr=False,
        compare=False,
    )

    def __call__(self, text: str) -> str:
        """The errors found, one a line, or ""."""
        return "\n".join(found for c in self._captures if (found := c(text)))
