"""The JSON Schemas of every payload, generated from the wire models (shipped in schemas/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from ._inputs import RunEnd, RunStart, StepIn
from ._outputs import ErrorOut, ProgressOut, RankingOut, SignalOut, StateOut

SCHEMA_MODELS: dict[str, tuple[type[BaseModel], Literal["validation", "serialization"]]] = {
    "start": (RunStart, "validation"),
    "step": (StepIn, "validation"),
    "end": (RunEnd, "validation"),
    "progress": (ProgressOut, "serialization"),
    "signal": (SignalOut, "serialization"),
    "error": (ErrorOut, "serialization"),
    "ranking": (RankingOut, "serialization"),
    "state": (StateOut, "serialization"),
}
"""Each topic kind's model, and whether its schema describes what is accepted or what is sent."""

_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def schemas() -> dict[str, str]:
    """Every payload's JSON Schema, as file name -> file text (`start.schema.json`, ...)."""
    out: dict[str, str] = {}
    for kind, (model, mode) in SCHEMA_MODELS.items():
        schema = {"$schema": _SCHEMA_DIALECT, **model.model_json_schema(mode=mode)}
        schema["title"] = f"{kind}: {schema.get('title', model.__name__)}"
        out[f"{kind}.schema.json"] = json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
    return out


def write_schemas(directory: str | Path) -> list[Path]:
    """Write every payload's JSON Schema into `directory`; return the paths written."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in schemas().items():
        path = d / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale_schemas(directory: str | Path) -> list[str]:
    """Schema files in `directory` that are missing, differ from the models, or are left over."""
    d = Path(directory)
    fresh = schemas()
    bad = [
        n
        for n, t in fresh.items()
        if not (d / n).is_file() or (d / n).read_text(encoding="utf-8") != t
    ]
    bad += sorted(p.name for p in d.glob("*.schema.json") if p.name not in fresh)
    return bad
