"""Small helpers shared by the wire modules: clipping text for messages, pydantic errors, JSON
checks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated

from pydantic import StringConstraints
from pydantic_core import PydanticCustomError

from ._limits import MAX_META_DEPTH, MAX_RUN_ID_CHARS

RUN_ID_PATTERN = r"^[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}$"
"""A run id's grammar: one safe topic level of 1 to 128 characters, not starting with `_`."""
RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN, max_length=MAX_RUN_ID_CHARS)]
GroupName = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN, max_length=MAX_RUN_ID_CHARS)]
"""A group name has a run id's grammar: it becomes one topic level
(`{prefix}/_groups/{group}/ranking`)."""
RankedGroup = Annotated[
    str,
    StringConstraints(
        pattern=r"^[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}(~[0-9a-f]{12})?$",
        max_length=MAX_RUN_ID_CHARS + 13,
    ),
]
"""The group a ranking is of: a group name, or one split off it, `{group}~{key}` (the runs of
another task or rubric)."""


def clip(s: str, n: int = 80) -> str:
    """`s`, cut to `n` characters with an ellipsis (for quoting input in error messages)."""
    return s if len(s) <= n else s[:n] + "..."


def err(kind: str, message: str) -> PydanticCustomError:
    """A validation error whose type is `kind` and whose text is `message` as written."""
    return PydanticCustomError(kind, message)


def none_to(value: object, empty: object) -> object:
    """`empty` for None, else `value` (optional list/dict fields may be null)."""
    return empty if value is None else value


JSON_TYPES: dict[type, str] = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def check_json_value(value: object, where: str, depth: int = 0) -> None:
    """Refuse nesting deeper than MAX_META_DEPTH and non-finite numbers in free-form JSON."""
    if depth > MAX_META_DEPTH:
        raise err(
            "too_deep", f"{where} is nested more than {MAX_META_DEPTH} levels deep; flatten it"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise err("not_finite", f"{where} holds {value}; numbers must be finite")
    if isinstance(value, Mapping):
        for v in value.values():
            check_json_value(v, where, depth + 1)
    elif isinstance(value, list):
        for v in value:
            check_json_value(v, where, depth + 1)
