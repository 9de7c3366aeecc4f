"""Judge criteria: bundled markdown rubrics, paths, dicts and lists; weights, thresholds and the
rubric hash."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeAlias

from .extractors import Pipeline, build_extractors
from .policy import AUTO
from .rules import RULES, Rule, build_rule
from .scale import LETTERS, phi

DEFAULT_RUBRIC = "progress"

MAX_CRITERIA = 16
"""Criteria one rubric from the network may have: each judged one costs a judge call per step and
repeat."""
MAX_CRITERION_BYTES = 4 * 1024
"""One criterion of a network rubric, as compact JSON (name, description, rules)."""
MAX_RUBRIC_BYTES = 32 * 1024
"""A whole network rubric (`start.criteria`) as compact JSON (criteria, extractors, thresholds)."""


class CriteriaError(ValueError):
    """Criteria that cannot be loaded or parsed."""


@dataclass(frozen=True, slots=True)
class Criterion:
    """One thing graded: a name, what it means to the judge, its weight, and rules tried first.

    `rules` run in order before the judge; the first whose confidence reaches
    `min_confidence` answers and the judge is not asked. An empty
    `description` means no judge fallback: a rule-only criterion that is
    silent on a step is left out of that step's weighted mean.
    """

    name: str
    description: str
    weight: float = 1.0
    rules: tuple[Rule, ...] = ()
    min_confidence: float = 0.5
    uses_judge: bool = field(init=False, compare=False, repr=False)
    """Whether the LLM judge grades this criterion when no rule is confident."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "uses_judge", bool(self.description))


Level: TypeAlias = "float | Literal['auto']"
"""A rubric threshold's value once mapped: a score in [0, 1], or "auto" (a calibrated abort
level)."""


@dataclass(frozen=True, slots=True)
class Rubric:
    """An ordered set of criteria whose weights sum to 1, the step extractors, and a content hash.

    `thresholds` are the run-policy levels the rubric config's `thresholds` map to, as
    (policy setting, value) pairs: `abort_below`, `resample_below`, `regression` (see
    `map_thresholds`). They decide what a run does about its scores, not the scores, so the
    hash leaves them out; a run's own policy (the hook's `policy=`, a start's `policy`, the
    daemon's policy flags) wins over them.
    """

    title: str
    criteria: tuple[Criterion, ...]
    extractors: Pipeline = field(default_factory=Pipeline)
    thresholds: tuple[tuple[str, Level], ...] = ()
    note: str = ""
    """A note the judge sees with the criteria in every prompt (the reference library's
    ground-truth note)."""
    scale: str = ""
    """The rubric's own scale as the judge is told it ("" = ours, A = worst .. T = best); see
    `reversed_scale`."""
    reversed_scale: bool = False
    """The rubric's scale puts the best letter first (A = best .. T = worst, as the skill's
    rubric.json): the judge is told so, and its letters are mirrored onto ours before the
    expectation (a score means the same)."""
    verdicts: tuple[float, float] | None = None
    binary: bool = False
    """The binary scale (config `"scale": "binary"`): the judge answers True or False to "is it
    complete?", and the score is P(True) renormalised over the two answers (TOPReward's reading for
    vision judges); see scale.binary_as_letters."""
    template: str = ""
    """A checked progress prompt template (`agent_monitor.templates`) the judge's prompts are
    laid out by; "" = ours."""
    """(pass, review) levels: a final score >= pass is "pass", >= review "review", else "fail".

    See `verdict`.
    """
    # Computed once: they are read on every scoring.
    hash: str = field(init=False, compare=False, repr=False)
    """A short hash of the rubric's content (rules and extractors included); it travels with
    every result."""
    judged: tuple[Criterion, ...] = field(init=False, compare=False, repr=False)
    """The criteria the LLM judge may be asked about (shown to it in every prompt)."""
    prompt_text: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)
    """Prompt fragments made from this rubric's own text (fenced once, not per scoring); filled
    by `build_prompt`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hash", self._content_hash())
        object.__setattr__(self, "judged", tuple(c for c in self.criteria if c.uses_judge))

    def verdict(self, score: float | None) -> str | None:
        """ "pass", "review" or "fail" for a final score at the rubric's thresholds; None without
        them or a score."""
        if self.verdicts is None or score is None:
            return None
        passing, review = self.verdicts
        return "pass" if score >= passing else "review" if score >= review else "fail"

    def _content_hash(self) -> str:
        body = json.dumps(
            [
                self.title,
                [
                    [c.name, c.description, c.weight, [repr(r) for r in c.rules], c.min_confidence]
                    for c in self.criteria
                ],
                [repr(e) for e in self.extractors.extractors],
                # Only when present: a rubric without them keeps the hash it always had.
                *([self.note] if self.note else []),
                *([self.scale, self.reversed_scale] if self.scale else []),
                *([self.template] if self.template else []),
                *(["binary"] if self.binary else []),
            ],
            separators=(",", ":"),
        )
        return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class RubricBounds:
    """How large a rubric from the network may be; each judged criterion costs judge calls on
    every step."""

    max_criteria: int
    """Criteria in the rubric (rule-only ones included: their rules run on every step too)."""
    max_criterion_bytes: int
    """One criterion as compact JSON (its name, description, rules)."""
    max_rubric_bytes: int
    """The whole rubric as compact JSON (criteria, extractors, thresholds, title)."""


def check_bounds(spec: object, bounds: RubricBounds) -> None:
    """Refuse (CriteriaError naming the bound) a rubric spec over `bounds`, before anything is built
    from it.

    Cheap on purpose: the item count first (no copy), then one serialisation, so a start with 10,000
    criteria is refused in the time it takes to count them. Bundled names (trusted files) pass.
    """
    if spec is None or isinstance(spec, str):
        return
    if isinstance(spec, Mapping) and isinstance(spec.get("criteria"), list):
        items: list[object] = list(spec["criteria"])
    elif isinstance(spec, Mapping):
        items = [{k: v} for k, v in spec.items()]
    elif isinstance(spec, Sequence):
        items = list(spec)
    else:
        return  # the loader says what shape is wanted
    if len(items) > bounds.max_criteria:
        raise CriteriaError(
            f"{len(items)} criteria, over the limit of {bounds.max_criteria} (max_criteria): "
            "each judged criterion "
            "is a judge call on every step; merge criteria or ask the operator to raise the bound"
        )
    size = _json_size(spec)
    if size > bounds.max_rubric_bytes:
        raise CriteriaError(
            f"the rubric is {size} bytes as JSON, over the limit of {bounds.max_rubric_bytes} "
            "(max_rubric_bytes); "
            "send shorter criteria"
        )
    for i, item in enumerate(items, 1):
        size = _json_size(item)
        if size > bounds.max_criterion_bytes:
            raise CriteriaError(
                f"criterion {i} is {size} bytes as JSON, over the limit of "
                f"{bounds.max_criterion_bytes} "
                "(max_criterion_bytes); say it in fewer words"
            )


def _json_size(value: object) -> int:
    try:
        return len(
            json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=repr).encode()
        )
    except (TypeError, ValueError, RecursionError):
        return 1 << 62  # not plain JSON: over any bound


CriteriaSpec: TypeAlias = (
    "str | Path | Mapping[str, str] | Sequence[str | Criterion | Mapping[str, object]] | "
    "Rubric | None"
)

_HEADER = re.compile(r"^##\s+(?P<name>\S.*?)\s*$")
_TITLE = re.compile(r"^#\s+(?P<title>\S.*?)\s*$")
_WEIGHT = re.compile(r"^weight:\s*(?P<w>\S+)\s*$", re.IGNORECASE)


def bundled_criteria() -> list[str]:
    """Names of the rubrics shipped with the package."""
    return sorted(
        p.name.rsplit(".", 1)[0]
        for p in _bundled_dir().iterdir()
        if p.name.endswith((".md", ".json")) and p.name != "README.md"
    )


def _bundled_dir() -> resources.abc.Traversable:
    return resources.files("agent_monitor.criteria_files")


_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_SUBHEADER = re.compile(r"^###\s+(?P<name>\S.*?)(?:\s*\{#(?P<id>[A-Za-z0-9_.-]+)\})?\s*$")


def parse_criteria(text: str, *, source: str = "<text>") -> Rubric:
    """Parse a markdown rubric: ours (`# Title`, `## name` sections, optional `weight:` line) or the
    reference library's.

    The reference library's `criteria/*.md` layout is `# Title`, an optional `## Ground Truth Note`
    section (the judge sees it with the criteria), and `## Criteria` holding one `### Name {#id}`
    section per criterion (the id names the criterion). HTML comments are the author's and are
    never shown to the judge, in either layout.
    """
    text = _COMMENT.sub("", text)
    if any(_SUBHEADER.match(line) for line in text.splitlines()):
        return _parse_reference(text, source)
    title = ""
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if m := _HEADER.match(line):
            sections.append((m["name"], []))
        elif not sections and (m := _TITLE.match(line)):
            title = m["title"]
        elif sections:
            sections[-1][1].append(line)
    if not sections:
        raise CriteriaError(
            f"{source}: no criteria found; write each as a '## name' header followed by its "
            "description"
        )
    criteria = []
    for name, body in sections:
        weight = 1.0
        lines: list[str] = []
        for line in body:
            if (m := _WEIGHT.match(line.strip())) and not lines:
                try:
                    weight = float(m["w"])
                except ValueError:
                    raise CriteriaError(
                        f"{source}: criterion {name!r} has weight {m['w']!r}; write a number"
                    ) from None
            else:
                lines.append(line)
        description = "\n".join(lines).strip()
        if not description:
            raise CriteriaError(
                f"{source}: criterion {name!r} has no description; say what the judge should grade"
            )
        criteria.append(Criterion(name=name, description=description, weight=weight))
    return _normalised(title or source, criteria, source)


def _parse_reference(text: str, source: str) -> Rubric:
    """The reference library's criteria file: a ground-truth note and `### Name {#id}` criteria
    under `## Criteria`."""
    title, section = "", ""
    note: list[str] = []
    found: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines():
        if m := _SUBHEADER.match(line):
            if section != "criteria":
                raise CriteriaError(
                    f"{source}: criterion {m['name']!r} is outside '## Criteria'; in the "
                    "reference layout every "
                    "'### Name' heading goes under '## Criteria'"
                )
            found.append((m["id"] or _slug(m["name"]), m["name"], []))
        elif m := _HEADER.match(line):
            name = m["name"].strip().lower()
            if name not in ("ground truth note", "criteria"):
                raise CriteriaError(
                    f"{source}: section '## {m['name']}' is not part of the reference layout; use "
                    "'## Ground Truth Note' and '## Criteria' (with '### Name' criteria), or "
                    "our layout ('## name' only)"
                )
            section = "note" if name == "ground truth note" else "criteria"
        elif not section and not found and (m := _TITLE.match(line)):
            title = m["title"]
        elif section == "note":
            note.append(line)
        elif found:
            found[-1][2].append(line)
        elif line.strip() and section == "criteria":
            raise CriteriaError(
                f"{source}: text under '## Criteria' before its first '### Name' heading"
            )
    criteria = []
    for name, heading, body in found:
        description = "\n".join(body).strip()
        if not description:
            raise CriteriaError(
                f"{source}: criterion {name!r} has no description; say what the judge should grade"
            )
        # Named by its id (the stable key, as the reference library's cache keys it); the judge
        # reads the heading too.
        criteria.append(Criterion(name=name, description=f"{heading}: {description}"))
    rubric = _normalised(title or source, criteria, source)
    return dataclasses.replace(rubric, note="\n".join(note).strip())


def _slug(name: str) -> str:
    """A criterion id from its name, as the reference library slugs it ("Final Answer" ->
    "final_answer")."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _normalised(
    title: str,
    criteria: Sequence[Criterion],
    source: str,
    extractors: Pipeline | None = None,
    thresholds: tuple[tuple[str, Level], ...] = (),
) -> Rubric:
    names = [c.name for c in criteria]
    if len(set(names)) != len(names):
        raise CriteriaError(f"{source}: criterion names repeat ({names}); give each a unique name")
    for c in criteria:
        if not c.weight >= 0.0 or c.weight == float("inf"):
            raise CriteriaError(
                f"{source}: criterion {c.name!r} has weight {c.weight}; weights must be "
                "finite and >= 0"
            )
    total = sum(c.weight for c in criteria)
    if total <= 0.0:
        raise CriteriaError(
            f"{source}: all criterion weights are zero; give at least one a positive weight"
        )
    for c in criteria:
        if not c.description and not c.rules:
            raise CriteriaError(
                f"{source}: criterion {c.name!r} has neither a description for the judge nor rules"
            )
    return Rubric(
        title=title,
        criteria=tuple(dataclasses.replace(c, weight=c.weight / total) for c in criteria),
        extractors=extractors or Pipeline(),
        thresholds=thresholds,
    )


def load_criteria(spec: CriteriaSpec = None) -> Rubric:
    """Load criteria from a bundled name, a markdown path, a {name: description} dict, or a list.

    List items may be strings (the description; named c1, c2, ..), Criterion
    objects, or dicts with `name`, `description` and optional `weight`. Weights
    are normalised to sum to 1. None gives the default progress rubric.
    """
    if spec is None:
        spec = DEFAULT_RUBRIC
    if isinstance(spec, Rubric):
        return spec
    if isinstance(spec, Path) or (
        isinstance(spec, str) and (spec.endswith((".md", ".json", ".yaml", ".yml")) or "/" in spec)
    ):
        path = Path(spec)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise CriteriaError(f"cannot read criteria file {path}: {e.strerror}") from None
        if path.suffix in (".json", ".yaml", ".yml"):
            data = _load_structured(text, path)
            if not isinstance(data, Mapping):
                raise CriteriaError(f"{path}: a rubric file is a mapping with a 'criteria' list")
            return _from_config(data, str(path))
        return parse_criteria(text, source=str(path))
    if isinstance(spec, str):
        md, js = _bundled_dir() / f"{spec}.md", _bundled_dir() / f"{spec}.json"
        if md.is_file():
            return parse_criteria(md.read_text(encoding="utf-8"), source=spec)
        if js.is_file():
            return _from_config(json.loads(js.read_text(encoding="utf-8")), spec)
        raise CriteriaError(
            f"no bundled criteria named {spec!r}; choose one of {bundled_criteria()} or pass a path"
        )
    if isinstance(spec, Mapping):
        if _is_config(spec):
            return _from_config(spec, "rubric config")
        items = [Criterion(str(k), str(v)) for k, v in spec.items()]
        return _normalised("custom", items, "criteria dict")
    return _normalised("custom", [_item(x, i) for i, x in enumerate(spec, 1)], "criteria list")


def _load_structured(text: str, path: Path) -> Any:
    """A JSON or YAML rubric file's content."""
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise CriteriaError(f"{path} is not valid JSON: {e}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CriteriaError(f"{path} is not valid YAML: {e}") from None


# Top-level keys of rubric configs (ours, the skill's rubric.json, lmms-eval's pipeline config): a
# dict holding any of them is a config, never a {name: description} dict whose criteria would be
# named "extractors" or "thresholds".
_CONFIG_KEYS = frozenset(
    {
        "criteria",
        "extractors",
        "thresholds",
        "title",
        "scale",
        "schema",
        "passThreshold",
        "reviewThreshold",
        "verifier",
    }
)


def _is_config(spec: Mapping[Any, Any]) -> bool:
    """Whether a dict is a rubric config rather than a `{name: description}` dict."""
    return any(k in _CONFIG_KEYS for k in spec) or any(
        not isinstance(v, str) for v in spec.values()
    )


def _from_config(data: Mapping[str, Any], source: str) -> Rubric:
    """A rubric from config: `{"title", "extractors": [...], "criteria": [...], "thresholds":
    {...}}`.

    Other top-level keys (a `scale` description, notes) are ignored; `thresholds` are mapped onto
    the run policy or refused (see `map_thresholds`).
    """
    try:
        extractors = build_extractors(data.get("extractors"))
    except ValueError as e:
        raise CriteriaError(f"{source}: extractors: {e}") from None
    if "verifier" in data:
        raise CriteriaError(
            f"{source}: 'verifier' makes this an lmms-eval verification pipeline config, not "
            "a rubric; build it with "
            "agent_monitor.verifiers.build_verification_pipeline(config), or give a rubric "
            "with a 'criteria' list"
        )
    binary = data.get("scale") == "binary"
    if binary or data.get("scale") == "letters":
        data = {k: v for k, v in data.items() if k != "scale"}
    skill = _skill_format(data, source)
    items = data.get("criteria")
    if skill is not None and isinstance(items, list):
        items = [_skill_item(x, i, source) for i, x in enumerate(items, 1)]
    if isinstance(items, Mapping) and all(isinstance(v, str) for v in items.values()):
        # {"criteria": {name: description}}: the dict form, inside a config.
        items = [{"name": str(k), "description": v} for k, v in items.items()]
    if not isinstance(items, list):
        got = "missing" if items is None else f"a {type(items).__name__}"
        raise CriteriaError(
            f"{source}: 'criteria' is {got}; a rubric config's 'criteria' is a list of criteria "
            "(strings, or dicts with 'name' and 'description') or a {name: description} dict"
        )
    criteria = [_item(x, i) for i, x in enumerate(items, 1)]
    thresholds = map_thresholds(data.get("thresholds"), [c.name for c in criteria], source)
    rubric = _normalised(
        str(data.get("title") or "custom"), criteria, source, extractors, thresholds
    )
    if binary:
        rubric = dataclasses.replace(rubric, binary=True)
    if skill is None:
        return rubric
    total = sum(c.weight for c in criteria)
    if abs(total - 1.0) > 1e-6:
        raise CriteriaError(
            f"{source}: the criteria's weights sum to {total:g}; in this "
            "rubric format they sum to 1"
        )
    return dataclasses.replace(rubric, **skill)


# The skill's rubric.json (schema llm-verifier-rubric/v1): a 20-letter scale with a value per
# letter, weighted criteria with ids, pass/review thresholds.
_SKILL_KEYS = ("scale", "passThreshold", "reviewThreshold")


def _skill_format(data: Mapping[str, Any], source: str) -> dict[str, Any] | None:
    """The skill's scale and thresholds as Rubric fields, or None when `data` is not in its
    format."""
    if not any(k in data for k in _SKILL_KEYS) and not str(data.get("schema", "")).startswith(
        "llm-verifier-rubric"
    ):
        return None
    out: dict[str, Any] = {}
    scale = data.get("scale")
    if scale is not None:
        if not isinstance(scale, Mapping):
            raise CriteriaError(f"{source}: 'scale' is a mapping with 'tokens' and 'values'")
        tokens, values = scale.get("tokens"), scale.get("values")
        if scale.get("levels", len(LETTERS)) != len(LETTERS) or tokens != list(LETTERS):
            raise CriteriaError(
                f"{source}: scale tokens {tokens!r}: the judge answers on the 20 letters A..T "
                "in order; give "
                "'tokens': ['A', ..., 'T'] (and 'levels': 20)"
            )
        if (
            not isinstance(values, list)
            or len(values) != len(LETTERS)
            or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for v in values
            )
        ):
            raise CriteriaError(
                f"{source}: scale 'values' must be 20 finite numbers, one per letter A..T"
            )
        steps = {round(b - a, 9) for a, b in itertools.pairwise(values)}
        if len(steps) != 1 or 0 in steps:
            raise CriteriaError(
                f"{source}: scale values {values} are not evenly spaced; the expectation "
                "assumes evenly spaced letters"
            )
        reverse = steps.pop() < 0
        best, worst = ("A", "T") if reverse else ("T", "A")
        text = str(scale.get("description") or "").strip()
        out["scale"] = (
            f"{text}\nThe letters A..T are evenly spaced; {best} = best (value {max(values):g}), "
            f"{worst} = worst (value {min(values):g})."
        ).strip()
        out["reversed_scale"] = reverse
    levels = []
    for key in ("passThreshold", "reviewThreshold"):
        v = data.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
            raise CriteriaError(f"{source}: {key}={v!r}: use a score in [0, 1]")
        levels.append(float(v))
    if levels:
        if len(levels) != 2:
            raise CriteriaError(
                f"{source}: give both passThreshold and reviewThreshold (or neither)"
            )
        if levels[1] > levels[0]:
            raise CriteriaError(
                f"{source}: reviewThreshold {levels[1]} is above passThreshold {levels[0]}"
            )
        out["verdicts"] = (levels[0], levels[1])
    return out


def _skill_item(x: object, i: int, source: str) -> object:
    """A skill criterion `{"id", "name", "weight", "description"}`: named by its id, its name
    shown to the judge."""
    if not isinstance(x, Mapping) or "id" not in x:
        return x
    if "description" not in x:
        raise CriteriaError(f"{source}: criterion {x['id']!r} lacks 'description'")
    name = x.get("name")
    desc = f"{name}: {x['description']}" if name and name != x["id"] else str(x["description"])
    return {"name": str(x["id"]), "description": desc, "weight": x.get("weight", 1.0)}


# A rubric's threshold names and the policy setting each one is; values are run-level scores.
_LEVELS = {
    "abort_below": "abort_below",
    "abort": "abort_below",
    "resample_below": "resample_below",
    "resample": "resample_below",
    "regression": "regression",
}
# Names rubric formats use for a pass mark: the monitor has none (a run's outcome comes from its end
# event).
_PASS_MARKS = (
    "pass",
    "passing",
    "pass_above",
    "success",
    "min_score",
    "minimum",
    "accept",
    "target",
    "good",
)
# Policy settings that are not levels: they belong to the run's policy, not to the rubric.
_NOT_LEVELS = ("min_steps", "patience", "max_uncertainty", "alpha", "holdout")
_USE = "use abort_below, resample_below or regression (a score in [0, 1], or a scale letter A..T)"


def map_thresholds(
    raw: object, criteria: Sequence[str] = (), source: str = "rubric"
) -> tuple[tuple[str, Level], ...]:
    """A rubric config's `thresholds` as run-policy levels; raise CriteriaError for any that cannot
    be one.

    `{"abort_below": 0.2, "resample_below": "H"}` (aliases `abort`, `resample`) become the policy's
    `abort_below` and `resample_below` (and `regression`, a fall from the run's best). A value is a
    run-level score in [0, 1], a scale letter (its score: A = 0, T = 1), "auto" for `abort_below`,
    or null (no level). A pass mark, a per-criterion threshold, or a policy setting that is not a
    level (min_steps, patience, ...) is refused, never silently ignored.
    """
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise CriteriaError(
            f"{source}: 'thresholds' is a {type(raw).__name__}; write a mapping such as "
            '{"abort_below": 0.2, "resample_below": 0.4}'
        )
    out: dict[str, Level] = {}
    for key, value in raw.items():
        name = str(key)
        where = f"{source}: thresholds.{name}"
        setting = _LEVELS.get(name.lower())
        if name in criteria or isinstance(value, Mapping):
            raise CriteriaError(
                f"{where}: per-criterion thresholds cannot be mapped: the run policy acts on "
                "the run's weighted "
                f"score, not on one criterion's; give run-level thresholds instead ({_USE}), "
                "or remove it"
            )
        if setting is None:
            if name.lower() in _PASS_MARKS:
                raise CriteriaError(
                    f"{where}: the monitor has no pass mark (a run's outcome comes from its "
                    "end event); to stop runs "
                    "that stay low use abort_below, to ask for a new attempt use "
                    "resample_below, or remove it"
                )
            if name.lower() in _NOT_LEVELS:
                raise CriteriaError(
                    f"{where} is a policy setting, not a threshold: set it in the run's "
                    "policy (start.policy, the "
                    f"hook's policy=, or serve --{name.lower().replace('_', '-')})"
                )
            raise CriteriaError(f"{where} is not a threshold the monitor knows; {_USE}")
        if setting in out:
            raise CriteriaError(f"{where} sets {setting} a second time; give it once")
        level = _level(value, setting, where)
        if level is not None:
            out[setting] = level
    return tuple(out.items())


def _level(value: object, setting: str, where: str) -> Level | None:
    if value is None:
        return None
    if isinstance(value, str):
        word = value.strip()
        if word.lower() == AUTO and setting == "abort_below":
            return AUTO
        if len(word) == 1 and word.upper() in LETTERS and setting != "regression":
            return phi(word.upper())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
        if math.isfinite(v) and 0.0 <= v <= 1.0:
            return v
        raise CriteriaError(
            f"{where}={value!r}: thresholds are run-level scores in [0, 1] (A = 0 .. T = 1), "
            "or a scale letter; "
            "on a 1-20 scale, k is letter number k (score (k - 1) / 19)"
        )
    what = (
        "a fall in [0, 1]"
        if setting == "regression"
        else ("a score in [0, 1] or a scale letter A..T")
    )
    auto = ', or "auto"' if setting == "abort_below" else ""
    raise CriteriaError(f"{where}={value!r}: use {what}{auto}")


def _item(x: str | Criterion | Mapping[str, object], i: int) -> Criterion:
    if isinstance(x, Criterion):
        return x
    if isinstance(x, str):
        return Criterion(f"c{i}", x)
    if not isinstance(x, Mapping):
        raise CriteriaError(
            f"criteria list item {i} is a {type(x).__name__}; use a string, a dict or a Criterion"
        )
    kind = str(x.get("type", "llm"))
    for key in ("threshold", "thresholds"):
        if key in x:
            raise CriteriaError(
                f"criteria list item {i} ({x.get('name') or kind}) has '{key}': per-criterion "
                "thresholds cannot be "
                "mapped: the run policy acts on the run's weighted score; put run-level "
                "levels in the rubric's "
                f"top-level 'thresholds' ({_USE}), or remove it"
            )
    try:
        weight = float(x.get("weight", 1.0))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CriteriaError(f"criteria list item {i} has a non-numeric weight") from None
    try:
        if kind == "llm":
            if "description" not in x:
                raise CriteriaError(
                    f"criteria list item {i} lacks 'description'; give 'name' and 'description'"
                )
            return Criterion(str(x.get("name", f"c{i}")), str(x["description"]), weight)
        if kind == "composite":
            return _composite(x, i, weight)
        if kind.removeprefix("rule.") in RULES:
            return Criterion(str(x.get("name") or kind), "", weight, rules=(build_rule(x),))
    except ValueError as e:
        if isinstance(e, CriteriaError):
            raise
        raise CriteriaError(f"criteria list item {i}: {e}") from None
    raise CriteriaError(
        f"criteria list item {i} has type {kind!r}; use 'llm', 'composite' or a rule "
        f"({', '.join(sorted(RULES))})"
    )


def _composite(x: Mapping[str, object], i: int, weight: float) -> Criterion:
    """An ordered chain: rule members first; an optional last `{"type": "llm", "description":
    ...}` member."""
    members = x.get("members")
    if not isinstance(members, list) or not members:
        raise CriteriaError(f"criteria list item {i} (composite) needs a non-empty 'members' list")
    description = ""
    rules: list[Rule] = []
    for j, m in enumerate(members):
        if isinstance(m, Mapping) and m.get("type", "llm") == "llm":
            if j != len(members) - 1:
                raise CriteriaError(
                    f"criteria list item {i} (composite): the llm member must come last"
                )
            description = str(m.get("description", ""))
        elif isinstance(m, Mapping):
            rules.append(build_rule(m))
        else:
            raise CriteriaError(f"criteria list item {i} (composite): member {j} is not a dict")
    min_conf = float(x.get("min_confidence", 0.5))  # type: ignore[arg-type]
    return Criterion(str(x.get("name", f"c{i}")), description, weight, tuple(rules), min_conf)
