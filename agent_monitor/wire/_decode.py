"""Decoding one MQTT message into an input event, or an EventError with a reason and a one-line message."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from ..criteria import RubricBounds
from ._common import JSON_TYPES, clip
from ._inputs import INPUT_MODELS, InputEvent
from ._limits import MAX_IMAGE_BYTES, MAX_PAYLOAD_BYTES
from ._outputs import ErrorOut
from ._topics import TopicError, parse_topic

ErrorReason = Literal["payload_too_large", "bad_json", "bad_topic", "unknown_topic", "invalid", "bad_image"]
"""The refusals decoding can give (a subset of `agent_monitor.progress.REFUSALS`)."""


class EventError(ValueError):
    """An MQTT event that cannot be accepted: `reason` is a short code, the message says what to fix."""

    def __init__(self, reason: ErrorReason, message: str, *, run_id: str | None = None) -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason
        self.message = message
        self.run_id = run_id

    def to_out(self, topic: str) -> ErrorOut:
        """The error message to publish for this event."""
        return ErrorOut(run_id=self.run_id, topic=clip(topic, 512), reason=self.reason, error=self.message)


def _loc(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("function-after", "function-before"):
            continue  # union / validator tags, not fields
        else:
            out += f".{part}" if out else part
    return out or "payload"


_LISTED = 5
"""Problems one error message spells out; more are counted (a hostile payload can have thousands)."""


def _problem(error: Any) -> str:
    where = _loc(error["loc"])
    if error["type"] == "missing":
        return f"{where} is required"
    text = f"{where}: {str(error['msg']).removeprefix('Value error, ')}"
    if error["type"].endswith("_type") or error["type"] in ("model_type", "dict_type", "list_type"):
        text += f" (got {JSON_TYPES.get(type(error['input']), type(error['input']).__name__)})"
    return text


def summarise(error: ValidationError) -> tuple[ErrorReason, str]:
    """One readable line (and a reason code) for a pydantic error: every problem with its field, up to a few."""
    errors = error.errors(include_url=False, include_context=False)
    text = "; ".join(_problem(e) for e in errors[:_LISTED])
    if len(errors) > _LISTED:
        rest = len(errors) - _LISTED
        text += f" (and {rest} more problem{'s' if rest > 1 else ''})"
    reason: ErrorReason = "bad_image" if errors[0]["type"] == "bad_image" else "invalid"
    return reason, clip(text, 600)


def _json_problem(e: json.JSONDecodeError) -> str:
    """The decoder's message with its position (`Invalid control character at line 1 column 28`) and what to do.

    Some of the decoder's messages end in "at" already ("Invalid control character at", "Unterminated
    string starting at"), others do not ("Expecting value").
    """
    where = f"line {e.lineno} column {e.colno}"
    problem = f"{e.msg} {where}" if e.msg.endswith(" at") else f"{e.msg} at {where}"
    if e.msg.startswith("Invalid control character"):
        return f"{problem}; write a tab or line break inside a string as \\t or \\n"
    return f"{problem}; send one JSON object (e.g. from json.dumps)"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number in JSON")


def decode_event(
    topic: str,
    payload: bytes | bytearray | memoryview | str,
    *,
    prefix: str = "agents",
    max_payload: int = MAX_PAYLOAD_BYTES,
    max_image_bytes: int = MAX_IMAGE_BYTES,
    image_dirs: Sequence[str | Path] = (),
    image_hosts: Sequence[str] = (),
    rubric_bounds: RubricBounds | None = None,
) -> tuple[str, InputEvent]:
    """Parse and validate one MQTT input message into (run_id, RunStart | StepIn | RunEnd); raise EventError.

    CPU-bound for large images (base64 and JSON): call it off the event loop. Image paths and URLs are
    refused unless `image_dirs` / `image_hosts` allow them; allowed ones are checked here but read or
    fetched later (`agent_monitor.sources.fetch_images`), never by this function.
    """
    try:
        run_id, kind = parse_topic(topic, prefix)
    except TopicError as e:
        raise EventError(e.reason, str(e)) from None
    raw = payload.encode() if isinstance(payload, str) else bytes(payload)
    if len(raw) > max_payload:
        raise EventError(
            "payload_too_large",
            f"payload is {len(raw)} bytes, over the limit of {max_payload}; send smaller or fewer images",
            run_id=run_id,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EventError("bad_json", f"payload is not UTF-8 text (byte {e.start}); send JSON", run_id=run_id) from None
    if not text.strip():
        text = "{}"
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise EventError("bad_json", f"payload is not valid JSON: {_json_problem(e)}", run_id=run_id) from None
    except (ValueError, RecursionError) as e:
        detail = "nested too deeply" if isinstance(e, RecursionError) else clip(str(e), 120)
        raise EventError("bad_json", f"payload is not acceptable JSON: {detail}", run_id=run_id) from None
    if not isinstance(data, dict):
        raise EventError(
            "invalid",
            f"{kind} payload must be a JSON object, got {JSON_TYPES.get(type(data), 'a value')}",
            run_id=run_id,
        )
    try:
        context = {
            "max_image_bytes": max_image_bytes,
            "image_dirs": tuple(image_dirs),
            "image_hosts": tuple(image_hosts),
            "rubric_bounds": rubric_bounds,
        }
        model = INPUT_MODELS[kind].model_validate(data, context=context)
    except ValidationError as e:
        reason, message = summarise(e)
        raise EventError(reason, f"{kind}: {message}", run_id=run_id) from None
    except RecursionError:
        raise EventError("invalid", f"{kind}: payload is nested too deeply", run_id=run_id) from None
    return run_id, model
