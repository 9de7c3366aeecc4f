"""Judge criteria: bundled markdown rubrics, paths, dicts and lists; weights and the rubric hash."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TypeAlias

DEFAULT_RUBRIC = "progress"


class CriteriaError(ValueError):
    """Criteria that cannot be loaded or parsed."""


@dataclass(frozen=True, slots=True)
class Criterion:
    """One thing the judge grades: a name, what it means, and its weight."""

    name: str
    description: str
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Rubric:
    """An ordered set of criteria whose weights sum to 1, with a content hash."""

    title: str
    criteria: tuple[Criterion, ...]

    @property
    def hash(self) -> str:
        """A short hash of the rubric's content; it travels with every result."""
        body = json.dumps(
            [self.title, [[c.name, c.description, c.weight] for c in self.criteria]],
            separators=(",", ":"),
        )
        return hashlib.sha256(body.encode()).hexdigest()[:16]


CriteriaSpec: TypeAlias = (
    "str | Path | Mapping[str, str] | Sequence[str | Criterion | Mapping[str, object]] | Rubric | None"
)

_HEADER = re.compile(r"^##\s+(?P<name>\S.*?)\s*$")
_TITLE = re.compile(r"^#\s+(?P<title>\S.*?)\s*$")
_WEIGHT = re.compile(r"^weight:\s*(?P<w>\S+)\s*$", re.IGNORECASE)


def bundled_criteria() -> list[str]:
    """Names of the rubrics shipped with the package."""
    return sorted(p.name[:-3] for p in _bundled_dir().iterdir() if p.name.endswith(".md") and p.name != "README.md")


def _bundled_dir() -> resources.abc.Traversable:
    return resources.files("agent_monitor.criteria_files")


def parse_criteria(text: str, *, source: str = "<text>") -> Rubric:
    """Parse the markdown rubric format: `# Title`, then `## name` sections with an optional `weight:` line."""
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
            f"{source}: no criteria found; write each as a '## name' header followed by its description"
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
                    raise CriteriaError(f"{source}: criterion {name!r} has weight {m['w']!r}; write a number") from None
            else:
                lines.append(line)
        description = "\n".join(lines).strip()
        if not description:
            raise CriteriaError(f"{source}: criterion {name!r} has no description; say what the judge should grade")
        criteria.append(Criterion(name=name, description=description, weight=weight))
    return _normalised(title or source, criteria, source)


def _normalised(title: str, criteria: Sequence[Criterion], source: str) -> Rubric:
    names = [c.name for c in criteria]
    if len(set(names)) != len(names):
        raise CriteriaError(f"{source}: criterion names repeat ({names}); give each a unique name")
    for c in criteria:
        if not c.weight >= 0.0 or c.weight == float("inf"):
            raise CriteriaError(
                f"{source}: criterion {c.name!r} has weight {c.weight}; weights must be finite and >= 0"
            )
    total = sum(c.weight for c in criteria)
    if total <= 0.0:
        raise CriteriaError(f"{source}: all criterion weights are zero; give at least one a positive weight")
    return Rubric(
        title=title,
        criteria=tuple(Criterion(c.name, c.description, c.weight / total) for c in criteria),
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
    if isinstance(spec, Path) or (isinstance(spec, str) and (spec.endswith(".md") or "/" in spec)):
        path = Path(spec)
        try:
            return parse_criteria(path.read_text(encoding="utf-8"), source=str(path))
        except OSError as e:
            raise CriteriaError(f"cannot read criteria file {path}: {e.strerror}") from None
    if isinstance(spec, str):
        item = _bundled_dir() / f"{spec}.md"
        if not item.is_file():
            raise CriteriaError(
                f"no bundled criteria named {spec!r}; choose one of {bundled_criteria()} or pass a path"
            )
        return parse_criteria(item.read_text(encoding="utf-8"), source=spec)
    if isinstance(spec, Mapping):
        items = [Criterion(str(k), str(v)) for k, v in spec.items()]
        return _normalised("custom", items, "criteria dict")
    return _normalised("custom", [_item(x, i) for i, x in enumerate(spec, 1)], "criteria list")


def _item(x: str | Criterion | Mapping[str, object], i: int) -> Criterion:
    if isinstance(x, Criterion):
        return x
    if isinstance(x, str):
        return Criterion(f"c{i}", x)
    if isinstance(x, Mapping):
        try:
            weight = x.get("weight", 1.0)
            return Criterion(str(x["name"]), str(x["description"]), float(weight))  # type: ignore[arg-type]
        except KeyError as e:
            raise CriteriaError(f"criteria list item {i} lacks {e.args[0]!r}; give 'name' and 'description'") from None
        except (TypeError, ValueError):
            raise CriteriaError(f"criteria list item {i} has a non-numeric weight") from None
    raise CriteriaError(f"criteria list item {i} is a {type(x).__name__}; use a string, a dict or a Criterion")
