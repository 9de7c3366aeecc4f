"""The topic grammar: `{prefix}/{run_id}/{kind}`, run ids that are one safe topic level, precomputed topic names."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Literal

from pydantic import StringConstraints

from ._common import clip
from ._limits import MAX_RUN_ID_CHARS

INPUT_KINDS = ("start", "step", "end")
OUTPUT_KINDS = ("progress", "signal", "error", "resend", "state")
ERRORS_LEVEL = "_errors"
GROUPS_LEVEL = "_groups"

Kind = Literal["start", "step", "end"]

_RUN_ID = re.compile(r"[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}")
_RUN_ID_PATTERN = r"^[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}$"

RunId = Annotated[str, StringConstraints(pattern=_RUN_ID_PATTERN, max_length=MAX_RUN_ID_CHARS)]
GroupName = Annotated[str, StringConstraints(pattern=_RUN_ID_PATTERN, max_length=MAX_RUN_ID_CHARS)]
"""A group name has a run id's grammar: it becomes one topic level (`{prefix}/_groups/{group}/ranking`)."""


class TopicError(ValueError):
    """A topic that is not `{prefix}/{run_id}/{kind}`, or a run id that is not a valid topic level.

    `reason` is `unknown_topic` for a well-formed topic whose kind is none of start, step, end (a
    typo such as `steps`), else `bad_topic`.
    """

    def __init__(self, message: str, *, reason: Literal["bad_topic", "unknown_topic"] = "bad_topic") -> None:
        super().__init__(message)
        self.reason: Literal["bad_topic", "unknown_topic"] = reason


def check_run_id(run_id: object) -> str:
    """Return `run_id` if it is a valid run id (one safe topic level); raise TopicError saying why not."""
    if not isinstance(run_id, str):
        raise TopicError(f"run id must be a string, got {type(run_id).__name__}")
    if not run_id:
        raise TopicError("run id is empty; use 1-128 characters from A-Z a-z 0-9 . _ : -")
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise TopicError(f"run id has {len(run_id)} characters, over the limit of {MAX_RUN_ID_CHARS}")
    if any(c in run_id for c in "/+#\x00"):
        raise TopicError(f"run id {clip(run_id)!r} contains '/', '+', '#' or NUL; it must be one topic level")
    if run_id.startswith("_"):
        raise TopicError(f"run id {clip(run_id)!r} starts with '_', which is reserved for the monitor's topics")
    if run_id in (".", "..") or not _RUN_ID.fullmatch(run_id):
        raise TopicError(f"run id {clip(run_id)!r} is not allowed; use 1-128 characters from A-Z a-z 0-9 . _ : -")
    return run_id


def check_prefix(prefix: str) -> str:
    levels = prefix.split("/")
    if not prefix or any(not lv for lv in levels) or any(c in prefix for c in "+#\x00"):
        raise TopicError(f"topic prefix {clip(prefix)!r} is invalid; use levels without '+', '#', NUL or empty parts")
    return prefix


def parse_topic(topic: str, prefix: str = "agents") -> tuple[str, Kind]:
    """Split an input topic `{prefix}/{run_id}/{start|step|end}` into (run_id, kind); raise TopicError."""
    check_prefix(prefix)
    if not topic.startswith(prefix + "/"):
        raise TopicError(
            f"topic {clip(topic)!r} is not under {prefix!r}; publish to {prefix}/<run_id>/<start|step|end>"
        )
    parts = topic[len(prefix) + 1 :].split("/")
    if len(parts) != 2:
        raise TopicError(f"topic {clip(topic)!r} has the wrong depth; publish to {prefix}/<run_id>/<start|step|end>")
    run_id, kind = parts
    check_run_id(run_id)
    if kind == "start":
        return run_id, "start"
    if kind == "step":
        return run_id, "step"
    if kind == "end":
        return run_id, "end"
    if kind in OUTPUT_KINDS:
        raise TopicError(
            f"topic {clip(topic)!r} is one of the monitor's outputs, not an input; "
            f"publish to {prefix}/{run_id}/<start|step|end>"
        )
    guess = difflib.get_close_matches(kind.lower(), INPUT_KINDS, n=1, cutoff=0.6)
    hint = f"{prefix}/{run_id}/{guess[0]}" if guess else f"{prefix}/{run_id}/<start|step|end>"
    raise TopicError(
        f"unknown topic {clip(topic)!r}: the monitor reads only {prefix}/<run_id>/start, step and end, "
        f"not {clip(kind, 40)!r}; publish to {hint}",
        reason="unknown_topic",
    )


def topic(prefix: str, run_id: str, kind: str) -> str:
    """The topic `{prefix}/{run_id}/{kind}` for an input or output kind (progress, signal, error, ...)."""
    check_prefix(prefix)
    check_run_id(run_id)
    if kind not in INPUT_KINDS + OUTPUT_KINDS:
        raise TopicError(f"unknown topic kind {kind!r}; use one of {', '.join(INPUT_KINDS + OUTPUT_KINDS)}")
    return f"{prefix}/{run_id}/{kind}"


def ranking_topic(prefix: str, group: str) -> str:
    """The retained ranking topic of a group: `{prefix}/_groups/{group}/ranking` (a group name is a run id's grammar)."""
    check_prefix(prefix)
    try:
        check_run_id(group)
    except TopicError as e:
        raise TopicError(str(e).replace("run id", "group name")) from None
    return f"{prefix}/{GROUPS_LEVEL}/{group}/ranking"


def errors_topic(prefix: str = "agents") -> str:
    """The topic for events whose run cannot be told (bad topic): `{prefix}/_errors`."""
    return f"{check_prefix(prefix)}/{ERRORS_LEVEL}"


def input_filters(prefix: str = "agents") -> list[str]:
    """The subscription filters for every input topic under `prefix`."""
    return [f"{check_prefix(prefix)}/+/{k}" for k in INPUT_KINDS]


class Topics:
    """The topic names under one prefix, checked once: building a name for a run id already checked costs a join.

    The daemon builds every output topic from run ids that decoding validated, so nothing is
    validated again on the way out.
    """

    def __init__(self, prefix: str = "agents") -> None:
        self.prefix = check_prefix(prefix)
        self.errors = f"{prefix}/{ERRORS_LEVEL}"
        self.subscription = f"{prefix}/+/+"
        """What the daemon subscribes to: every input, and every misspelt one (reported as unknown_topic)."""
        self.inputs = [f"{prefix}/+/{k}" for k in INPUT_KINDS]
        """The exact input filters (where a broker refuses the wider subscription)."""
        self._under = prefix + "/"

    def ranking(self, group: str) -> str:
        """`{prefix}/_groups/{group}/ranking` (retained) for a group name that is already known valid."""
        return f"{self.prefix}/{GROUPS_LEVEL}/{group}/ranking"

    def of(self, run_id: str, kind: str) -> str:
        """`{prefix}/{run_id}/{kind}` for a run id that is already known valid."""
        return f"{self.prefix}/{run_id}/{kind}"

    def is_output(self, topic: str) -> bool:
        """Whether `topic` is one the monitor publishes (progress, signal, error, `_errors`, other `_` levels).

        The daemon's subscription also matches these (its own messages and other monitors'); they are
        ignored, not reported. A `_` level followed by an input kind is not one of them: it is a bad run id.
        """
        if not topic.startswith(self._under):
            return False
        levels = topic[len(self._under) :].split("/")
        if levels[0].startswith("_"):
            return levels[-1] not in INPUT_KINDS
        return len(levels) == 2 and levels[1] in OUTPUT_KINDS
