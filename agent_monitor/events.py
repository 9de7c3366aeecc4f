"""The MQTT wire protocol: pydantic models of every payload, topic helpers, safe decoding, JSON Schema export.

Topics (prefix `agents` by default, configurable, may have several levels):

- inputs: `{prefix}/{run_id}/start` (RunStart), `.../step` (StepIn), `.../end` (RunEnd);
- outputs: `.../progress` (ProgressOut), `.../signal` (SignalOut), `.../error` (ErrorOut);
  events whose topic or run id cannot be parsed are reported on `{prefix}/_errors`.

A run id is one topic level of 1 to 128 characters from `A-Z a-z 0-9 . _ : -`, not starting
with `_` (reserved for the monitor's own topics such as `_errors`) and not `.` or `..`.
MQTT wildcards (`+`, `#`), `/`, NUL and whitespace can therefore never appear in one.

Decisions, for harness authors:

- Unknown fields are IGNORED on every payload, so a harness may add its own fields and an
  older monitor keeps working. The one exception is `start.policy`: an unknown (e.g. misspelt)
  policy key is an error, because silently dropping `abort_belw` would disable an abort the
  user asked for.
- Types are strict: `"3"` is not an integer, `true` is not a number, `NaN`/`Infinity` are
  refused. Optional list/dict fields may be omitted or `null`.
- Images are inline bytes only: `{"data": base64, "mime": optional}`, a bare base64 string, or
  a `data:image/...;base64,...` URL. File paths and URLs are refused (no ambient authority);
  the bytes must be standard base64 and a PNG, JPEG, GIF or WebP (sniffed by magic number; the
  sniffed type replaces any `mime` given). Pixel limits are checked later, off the event loop,
  by `agent_monitor.images.load_image`.
- `start.criteria` is a bundled rubric name or inline criteria; a criteria *file* name is
  refused (a network event must not make the monitor read files).
- An empty payload is read as `{}` (so `mosquitto_pub -n -t agents/r1/end` ends a run).

`decode_event` turns one MQTT message into `(run_id, model)` or raises `EventError` with a short
`reason` (payload_too_large, bad_json, bad_topic, invalid, bad_image) and a one-line message;
it never reads files, fetches URLs or calls the judge. Regenerate the shipped JSON Schemas with
`python -m agent_monitor.events --write schemas/`.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import json
import math
import posixpath
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    JsonValue,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from .criteria import CriteriaError, Rubric, bundled_criteria, load_criteria
from .images import sniff_mime
from .policy import Policy, PolicyError

if TYPE_CHECKING:
    from .policy import Decision
    from .tracker import Progress

# -- limits (the daemon may pass its own via decode_event / validation context) --

MAX_PAYLOAD_BYTES = 32 * 1024 * 1024
"""Default cap on one MQTT payload, checked before any parsing."""
MAX_IMAGE_BYTES = 8 * 1024 * 1024
"""Default cap on one image's decoded bytes (override with context `{"max_image_bytes": n}`)."""
MAX_IMAGES = 16
MAX_TASK_CHARS = 100_000
MAX_STEP_CHARS = 200_000
MAX_STEP_INDEX = 1_000_000
MAX_LABELS = 16
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_META_BYTES = 64 * 1024
MAX_META_DEPTH = 16
MAX_RUN_ID_CHARS = 128

INPUT_KINDS = ("start", "step", "end")
OUTPUT_KINDS = ("progress", "signal", "error")
ERRORS_LEVEL = "_errors"
POLICY_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Policy))
"""The keys `start.policy` may set (the fields of `agent_monitor.policy.Policy`)."""

Kind = Literal["start", "step", "end"]
ErrorReason = Literal["payload_too_large", "bad_json", "bad_topic", "invalid", "bad_image"]

_RUN_ID = re.compile(r"[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}")
_RUN_ID_PATTERN = r"^[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}$"
_LABEL_KEY = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_MIME = re.compile(r"image/[a-z0-9][a-z0-9.+-]{0,62}", re.IGNORECASE)
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]{0,100})(?P<b64>;base64)?,", re.IGNORECASE)
_URL = re.compile(r"[a-z][a-z0-9+.-]{0,30}://", re.IGNORECASE)
_IMAGE_SUFFIX = re.compile(r"\.(png|jpe?g|gif|webp|bmp|tiff?|heic|avif)$", re.IGNORECASE)

RunId = Annotated[str, StringConstraints(pattern=_RUN_ID_PATTERN, max_length=MAX_RUN_ID_CHARS)]


class TopicError(ValueError):
    """A topic that is not `{prefix}/{run_id}/{kind}`, or a run id that is not a valid topic level."""


class EventError(ValueError):
    """An MQTT event that cannot be accepted: `reason` is a short code, the message says what to fix."""

    def __init__(self, reason: ErrorReason, message: str, *, run_id: str | None = None) -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason
        self.message = message
        self.run_id = run_id

    def to_out(self, topic: str) -> ErrorOut:
        """The error message to publish for this event."""
        return ErrorOut(run_id=self.run_id, topic=_clip(topic, 512), reason=self.reason, error=self.message)


# -- topics --


def check_run_id(run_id: object) -> str:
    """Return `run_id` if it is a valid run id (one safe topic level); raise TopicError saying why not."""
    if not isinstance(run_id, str):
        raise TopicError(f"run id must be a string, got {type(run_id).__name__}")
    if not run_id:
        raise TopicError("run id is empty; use 1-128 characters from A-Z a-z 0-9 . _ : -")
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise TopicError(f"run id has {len(run_id)} characters, over the limit of {MAX_RUN_ID_CHARS}")
    if any(c in run_id for c in "/+#\x00"):
        raise TopicError(f"run id {_clip(run_id)!r} contains '/', '+', '#' or NUL; it must be one topic level")
    if run_id.startswith("_"):
        raise TopicError(f"run id {_clip(run_id)!r} starts with '_', which is reserved for the monitor's topics")
    if run_id in (".", "..") or not _RUN_ID.fullmatch(run_id):
        raise TopicError(f"run id {_clip(run_id)!r} is not allowed; use 1-128 characters from A-Z a-z 0-9 . _ : -")
    return run_id


def _check_prefix(prefix: str) -> str:
    levels = prefix.split("/")
    if not prefix or any(not lv for lv in levels) or any(c in prefix for c in "+#\x00"):
        raise TopicError(f"topic prefix {_clip(prefix)!r} is invalid; use levels without '+', '#', NUL or empty parts")
    return prefix


def parse_topic(topic: str, prefix: str = "agents") -> tuple[str, Kind]:
    """Split an input topic `{prefix}/{run_id}/{start|step|end}` into (run_id, kind); raise TopicError."""
    _check_prefix(prefix)
    if not topic.startswith(prefix + "/"):
        raise TopicError(
            f"topic {_clip(topic)!r} is not under {prefix!r}; publish to {prefix}/<run_id>/<start|step|end>"
        )
    parts = topic[len(prefix) + 1 :].split("/")
    if len(parts) != 2:
        raise TopicError(f"topic {_clip(topic)!r} has the wrong depth; publish to {prefix}/<run_id>/<start|step|end>")
    run_id, kind = parts
    check_run_id(run_id)
    if kind == "start":
        return run_id, "start"
    if kind == "step":
        return run_id, "step"
    if kind == "end":
        return run_id, "end"
    raise TopicError(f"topic {_clip(topic)!r} has unknown kind {_clip(kind, 40)!r}; use start, step or end")


def topic(prefix: str, run_id: str, kind: str) -> str:
    """The topic `{prefix}/{run_id}/{kind}` for an input or output kind (progress, signal, error, ...)."""
    _check_prefix(prefix)
    check_run_id(run_id)
    if kind not in INPUT_KINDS + OUTPUT_KINDS:
        raise TopicError(f"unknown topic kind {kind!r}; use one of {', '.join(INPUT_KINDS + OUTPUT_KINDS)}")
    return f"{prefix}/{run_id}/{kind}"


def errors_topic(prefix: str = "agents") -> str:
    """The topic for events whose run cannot be told (bad topic): `{prefix}/_errors`."""
    return f"{_check_prefix(prefix)}/{ERRORS_LEVEL}"


def input_filters(prefix: str = "agents") -> list[str]:
    """The subscription filters for every input topic under `prefix`."""
    return [f"{_check_prefix(prefix)}/+/{k}" for k in INPUT_KINDS]


# -- helpers --


def _clip(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


def _err(kind: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(kind, message)


def _looks_like_path(s: str) -> bool:
    return (
        s.startswith(("/", "~", "./", "../", "file:"))
        or re.match(r"[A-Za-z]:[\\/]", s) is not None
        or "\\" in s
        or _IMAGE_SUFFIX.search(s) is not None
    )


def check_image_path(path: str, allowed_dirs: Sequence[str | Path]) -> str:
    """Refuse an image path unless it is absolute, plain and under a directory the operator allowed."""
    if not allowed_dirs:
        raise _err(
            "bad_image",
            f"image path {_clip(path, 60)!r} refused: the monitor reads no files named in events "
            "unless its operator allows a directory (--allow-image-dir); send the bytes inline as base64",
        )
    norm = posixpath.normpath(path)
    if not path.startswith("/") or "\x00" in path or ".." in path.split("/") or norm != path.rstrip("/"):
        raise _err("bad_image", f"image path {_clip(path, 60)!r} must be absolute and plain (no '..', no '//')")
    if not any(norm.startswith(str(d).rstrip("/") + "/") for d in allowed_dirs):
        raise _err("bad_image", f"image path {_clip(path, 60)!r} is not under a directory the operator allowed")
    return norm


def check_image_url(url: str, allowed_hosts: Sequence[str]) -> str:
    """Refuse an image URL unless it is http(s) on a host the operator allowed."""
    if not allowed_hosts:
        raise _err(
            "bad_image",
            f"image URL {_clip(url, 60)!r} refused: the monitor fetches no URLs named in events unless its "
            "operator allows the host (--allow-image-host); send the bytes inline as base64",
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise _err("bad_image", f"image URL {_clip(url, 60)!r} must be http(s)://host/... without credentials")
    if parts.hostname.lower() not in {h.lower() for h in allowed_hosts}:
        raise _err("bad_image", f"image URL host {parts.hostname!r} is not one the operator allowed")
    return url


def _none_to(value: object, empty: object) -> object:
    return empty if value is None else value


def _check_json_value(value: object, where: str, depth: int = 0) -> None:
    """Refuse nesting deeper than MAX_META_DEPTH and non-finite numbers in free-form JSON."""
    if depth > MAX_META_DEPTH:
        raise _err("too_deep", f"{where} is nested more than {MAX_META_DEPTH} levels deep; flatten it")
    if isinstance(value, float) and not math.isfinite(value):
        raise _err("not_finite", f"{where} holds {value}; numbers must be finite")
    if isinstance(value, Mapping):
        for v in value.values():
            _check_json_value(v, where, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_json_value(v, where, depth + 1)


_JSON_TYPES: dict[type, str] = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


# -- inputs --


class _In(BaseModel):
    """Base of input payloads: strict types, unknown fields ignored, immutable."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class ImageIn(_In):
    """An image: inline base64 bytes of a PNG, JPEG, GIF or WebP; a `path` or `url` only where the operator allows it."""

    data: str = Field(
        default="", description="Standard base64 (RFC 4648, padded) of the encoded image; no paths or URLs."
    )
    mime: str | None = Field(default=None, description="A hint; replaced by the type sniffed from the bytes.")
    path: str | None = Field(
        default=None,
        max_length=1024,
        description="A file on the monitor's machine: refused unless the operator allows its directory "
        "(--allow-image-dir).",
    )
    url: str | None = Field(
        default=None,
        max_length=2048,
        description="An http(s) URL: refused unless the operator allows its host (--allow-image-host).",
    )

    _bytes: bytes | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _from_bare_string(cls, value: object) -> object:
        if isinstance(value, str):
            value = {"data": value}
        if isinstance(value, Mapping):
            data = value.get("data")
            if isinstance(data, str) and (m := _DATA_URL.match(data)):
                if not m["b64"]:
                    raise _err("bad_image", "a data URL image must be base64 (data:image/png;base64,...)")
                return {**value, "data": data[m.end() :], "mime": value.get("mime") or m["mime"] or None}
            if isinstance(data, str) and _URL.match(data):
                raise _err("bad_image", f"image data {_clip(data, 60)!r} is a URL; images are inline base64 bytes only")
        return value

    @field_validator("mime")
    @classmethod
    def _check_mime(cls, mime: str | None) -> str | None:
        if mime is not None and not _MIME.fullmatch(mime):
            raise _err("bad_image", f"mime {_clip(mime, 60)!r} is not an image type; use e.g. image/png or omit it")
        return mime

    @model_validator(mode="after")
    def _decode(self, info: ValidationInfo) -> ImageIn:
        ctx = info.context or {}
        limit = int(ctx.get("max_image_bytes", MAX_IMAGE_BYTES))
        given = [k for k in ("data", "path", "url") if getattr(self, k)]
        if len(given) > 1:
            raise _err("bad_image", f"an image has {' and '.join(given)}; give exactly one")
        if self.path is not None:
            check_image_path(self.path, ctx.get("image_dirs", ()))
            return self  # read later, off the event loop (agent_monitor.sources)
        if self.url is not None:
            check_image_url(self.url, ctx.get("image_hosts", ()))
            return self
        data = self.data
        if _URL.match(data):
            raise _err("bad_image", f"image data {_clip(data, 60)!r} is a URL; images are inline base64 bytes only")
        if len(data) > 4 * ((limit + 2) // 3):
            raise _err(
                "bad_image",
                f"image is about {len(data) * 3 // 4} bytes, over the limit of {limit}; downscale or re-encode it",
            )
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            if _looks_like_path(data):
                raise _err(
                    "bad_image",
                    f"image data {_clip(data, 60)!r} looks like a file path; send the image bytes inline as base64",
                ) from None
            raise _err(
                "bad_image",
                "image data is not valid base64; use the standard alphabet (A-Z a-z 0-9 + /) with '=' padding "
                "and no line breaks",
            ) from None
        if not raw:
            raise _err("bad_image", "image data is empty; send the encoded image bytes as base64")
        if len(raw) > limit:
            raise _err("bad_image", f"image is {len(raw)} bytes, over the limit of {limit}; downscale or re-encode it")
        sniffed = sniff_mime(raw)
        if sniffed is None:
            if _looks_like_path(data):
                raise _err(
                    "bad_image",
                    f"image data {_clip(data, 60)!r} looks like a file path; send the image bytes inline as base64",
                )
            raise _err("bad_image", "image bytes are not PNG, JPEG, GIF or WebP")
        object.__setattr__(self, "mime", sniffed)
        self._bytes = raw
        return self

    def decoded(self) -> bytes:
        """The image's encoded bytes (PNG/JPEG/...), decoded from base64 once (or as fetched for a path/URL)."""
        if self._bytes is None:
            if self.path is not None or self.url is not None:
                raise RuntimeError("this image is a path or URL that was not fetched yet; see agent_monitor.sources")
            self._bytes = base64.b64decode(self.data, validate=True)
        return self._bytes

    @property
    def remote(self) -> bool:
        """The image is a path or URL whose bytes are still to be fetched."""
        return self._bytes is None and (self.path is not None or self.url is not None)

    def set_fetched(self, raw: bytes, mime: str) -> None:
        """Attach the bytes fetched for this path/URL image (by agent_monitor.sources)."""
        object.__setattr__(self, "mime", mime)
        self._bytes = raw

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The object form, or (on input) a bare base64 string."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        if handler.mode == "serialization":
            return schema
        bare = {"type": "string", "contentEncoding": "base64", "description": "Bare base64 image bytes."}
        return {"anyOf": [bare, dict(schema)], "title": "ImageIn", "description": schema.get("description", "")}

    @classmethod
    def from_bytes(cls, data: bytes, mime: str | None = None) -> ImageIn:
        """An ImageIn from encoded image bytes (for harness-side helpers and tests)."""
        return cls.model_validate({"data": base64.b64encode(data).decode("ascii"), "mime": mime})


ImageList = Annotated[list[ImageIn], Field(default_factory=list, max_length=MAX_IMAGES)]


class RunStart(_In):
    """`{prefix}/{run_id}/start`: the task, criteria, task images, policy overrides and labels of a run."""

    task: str = Field(max_length=MAX_TASK_CHARS, description="What the agent is working on.")
    criteria: JsonValue = Field(
        default=None,
        description="A bundled rubric name, {name: description}, a list of criteria, or a rubric config "
        "{'criteria': [...]}; never a file path. Null: the default progress rubric.",
    )
    images: ImageList
    policy: dict[str, float | int | None] | None = Field(
        default=None,
        description="Overrides of the monitor's policy defaults; unknown keys are an error.",
        json_schema_extra={"propertyNames": {"enum": list(POLICY_KEYS)}},
    )
    labels: dict[
        Annotated[str, StringConstraints(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$", max_length=MAX_LABEL_KEY_CHARS)],
        Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE_CHARS)],
    ] = Field(default_factory=dict, max_length=MAX_LABELS)
    expected: str | None = Field(default=None, max_length=MAX_TASK_CHARS, description="Known final answer (eval).")

    @field_validator("task")
    @classmethod
    def _task_not_blank(cls, task: str) -> str:
        if not task.strip():
            raise _err("blank", "task is empty; say what the agent is working on")
        return task

    @field_validator("images", mode="before")
    @classmethod
    def _null_is_empty(cls, value: object) -> object:
        return _none_to(value, [])

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_bounded(cls, value: object) -> object:
        if value is None:
            return {}
        if not isinstance(value, dict):
            return value  # the type check reports it
        if len(value) > MAX_LABELS:
            raise _err("labels", f"{len(value)} labels, over the limit of {MAX_LABELS}; send fewer")
        for k, v in value.items():
            if len(k) > MAX_LABEL_KEY_CHARS or not _LABEL_KEY.fullmatch(k):
                raise _err(
                    "labels",
                    f"label name {_clip(k, 40)!r} is not allowed; use up to {MAX_LABEL_KEY_CHARS} characters "
                    "from a-z A-Z 0-9 _, not starting with a digit",
                )
            if k.startswith("__"):
                raise _err("labels", f"label name {_clip(k, 40)!r} starts with '__', which is reserved")
            if not isinstance(v, str):
                raise _err("labels", f"label {k!r} has a {_JSON_TYPES.get(type(v), 'non-string')} value; use a string")
            if len(v) > MAX_LABEL_VALUE_CHARS:
                raise _err("labels", f"label {k!r} is {len(v)} characters, over the limit of {MAX_LABEL_VALUE_CHARS}")
        return value

    @field_validator("criteria")
    @classmethod
    def _criteria_loads(cls, spec: JsonValue) -> JsonValue:
        if spec is None:
            return None
        if isinstance(spec, str):
            names = bundled_criteria()
            if "/" in spec or "\\" in spec or spec.startswith((".", "~")) or re.search(r"\.(md|json|ya?ml)$", spec):
                raise _err(
                    "criteria_path",
                    f"criteria {_clip(spec, 60)!r} looks like a file path; files are not read for network events. "
                    f"Use a bundled name ({', '.join(names)}) or send the criteria inline",
                )
            if spec not in names:
                raise _err("criteria", f"no bundled criteria named {_clip(spec, 60)!r}; use one of {', '.join(names)}")
        elif isinstance(spec, dict):
            if not isinstance(spec.get("criteria"), list) and not all(isinstance(v, str) for v in spec.values()):
                raise _err(
                    "criteria",
                    "criteria as a dict is {name: description} with string descriptions, or a rubric config "
                    "with a 'criteria' list",
                )
        elif not isinstance(spec, list):
            raise _err(
                "criteria", "criteria must be a bundled name, a {name: description} dict, a list or a rubric config"
            )
        _check_json_value(spec, "criteria")
        try:
            load_criteria(spec)  # type: ignore[arg-type]  # JSON shapes checked above
        except CriteriaError as e:
            raise _err("criteria", str(e)) from None
        except Exception as e:  # a config the loader did not foresee must be an input error, not a crash
            raise _err("criteria", f"criteria cannot be loaded: {type(e).__name__}: {e}") from None
        return spec

    @field_validator("policy")
    @classmethod
    def _policy_known(cls, policy: dict[str, float | int | None] | None) -> dict[str, float | int | None] | None:
        if policy is None:
            return None
        unknown = sorted(set(policy) - set(POLICY_KEYS))
        if unknown:
            raise _err(
                "policy",
                f"unknown policy key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(POLICY_KEYS)}",
            )
        try:
            Policy().with_overrides(policy)
        except (PolicyError, TypeError) as e:
            raise _err("policy", str(e)) from None
        return policy

    def rubric(self) -> Rubric:
        """The criteria of this run, loaded afresh (the default rubric when none was given)."""
        return load_criteria(self.criteria)  # type: ignore[arg-type]  # validated on input

    def resolved_policy(self, defaults: Policy | None = None) -> Policy:
        """The run's policy: `defaults` (the daemon's flags) with this start's overrides applied."""
        return (defaults or Policy()).with_overrides(self.policy)


Timestamp = Annotated[
    float | None,
    WithJsonSchema(
        {
            "anyOf": [{"type": "number"}, {"type": "string", "format": "date-time"}, {"type": "null"}],
            "default": None,
            "description": "UNIX seconds, or an ISO 8601 date-time (UTC when it has no offset).",
        },
        mode="validation",
    ),
]


class StepIn(_In):
    """`{prefix}/{run_id}/step`: one step of the run (action and observation text, images, rule metadata)."""

    index: int | None = Field(
        default=None, ge=1, le=MAX_STEP_INDEX, description="1-based position; makes re-delivery idempotent."
    )
    text: str = Field(max_length=MAX_STEP_CHARS, description="The step's action and observation.")
    images: ImageList
    ts: Timestamp = None
    meta: dict[str, JsonValue] | None = Field(
        default=None, description=f"Per-step data for rule criteria (at most {MAX_META_BYTES} bytes as JSON)."
    )

    @field_validator("images", mode="before")
    @classmethod
    def _null_is_empty(cls, value: object) -> object:
        return _none_to(value, [])

    @field_validator("ts", mode="before")
    @classmethod
    def _timestamp(cls, value: object) -> object:
        if value is None or isinstance(value, bool) or not isinstance(value, str):
            return value
        if len(value) > 64:
            raise _err("ts", "ts is too long for a date-time; use UNIX seconds or ISO 8601")
        try:
            dt = datetime.fromisoformat(value)
        except ValueError:
            raise _err("ts", f"ts {value!r} is not an ISO 8601 date-time; use e.g. 2025-01-31T12:00:00Z") from None
        return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()

    @field_validator("meta", mode="before")
    @classmethod
    def _meta_bounded(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, dict):
            return value  # the type check reports it
        _check_json_value(value, "meta")
        try:
            size = len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode())
        except (TypeError, ValueError) as e:
            raise _err("meta", f"meta is not plain JSON: {e}") from None
        if size > MAX_META_BYTES:
            raise _err("meta", f"meta is {size} bytes as JSON, over the limit of {MAX_META_BYTES}; send less")
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> StepIn:
        if not self.text and not self.images:
            raise _err("empty_step", "the step has no text and no images; send at least one")
        return self


Outcome = Annotated[
    Literal["success", "failure"] | float | None,
    Field(description="How the run ended: success, failure, or a number (e.g. a reward)."),
]


class RunEnd(_In):
    """`{prefix}/{run_id}/end`: the run is over; its outcome, when known."""

    outcome: Outcome = None

    @field_validator("outcome", mode="before")
    @classmethod
    def _outcome(cls, value: object) -> object:
        ok = value is None or value in ("success", "failure")
        ok = ok or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
        if not ok:
            raise _err("outcome", f'outcome {value!r} is not allowed; use "success", "failure" or a finite number')
        return value


InputEvent: TypeAlias = RunStart | StepIn | RunEnd
INPUT_MODELS: dict[str, type[RunStart] | type[StepIn] | type[RunEnd]] = {
    "start": RunStart,
    "step": StepIn,
    "end": RunEnd,
}


# -- outputs --


class _Out(BaseModel):
    """Base of output payloads: unknown fields ignored (clients tolerate newer monitors); NaN is sent as null."""

    model_config = ConfigDict(extra="ignore", frozen=True, ser_json_inf_nan="null")

    def to_payload(self) -> bytes:
        """The MQTT payload: compact JSON, UTF-8."""
        return self.model_dump_json().encode()


class Tokens(_Out):
    """Judge tokens spent on one scoring."""

    input: int = 0
    cached_input: int = 0
    output: int = 0


class CriterionOut(_Out):
    """One criterion's part of a score."""

    score: float
    weight: float
    uncertainty: float
    mass: float
    source: str = "llm"
    confidence: float = 1.0
    detail: str = ""


class ProgressOut(_Out):
    """`{prefix}/{run_id}/progress`: the score of the run's newest scored prefix, or why there is none."""

    run_id: RunId
    step: int
    score: float | None = Field(description="Null when the judge failed; never a made-up default.")
    uncertainty: float | None = None
    criteria: dict[str, CriterionOut] = Field(default_factory=dict)
    ok: bool
    error: str | None = None
    reason: str | None = None
    mass: float | None = None
    dispersion: float | None = None
    judge: str = ""
    model: str = ""
    rubric: str = Field(default="", description="Hash of the rubric that produced the score.")
    coalesced: int = Field(default=1, description="Steps folded into this score.")
    latency_s: float = 0.0
    tokens: Tokens = Field(default_factory=Tokens)
    calls_saved: int = 0
    silent: list[str] = Field(default_factory=list)
    signal: Literal["continue", "abort", "resample"] | None = None
    degraded: bool = Field(default=False, description="The judge is failing and the monitor is backing off.")

    model_config = ConfigDict(protected_namespaces=())

    @classmethod
    def from_progress(cls, run_id: str, progress: Progress, *, degraded: bool = False) -> ProgressOut:
        """The progress message for a tracker result."""
        # One mapping of a result to JSON: the tracker's own `as_dict`.
        return cls.model_validate({**progress.as_dict(), "run_id": run_id, "degraded": degraded})


class SignalOut(_Out):
    """`{prefix}/{run_id}/signal` (retained while the run lives): what the harness should do now."""

    run_id: RunId
    signal: Literal["continue", "abort", "resample"]
    reason: str
    step: int
    score: float | None = None
    best_step: int | None = Field(default=None, description="The step where progress peaked (roll back there).")
    policy: dict[str, float | int | None] = Field(default_factory=dict)

    @classmethod
    def from_decision(cls, run_id: str, decision: Decision, policy: Policy) -> SignalOut:
        """The signal message for a policy decision."""
        return cls(
            run_id=run_id,
            signal=decision.signal,
            reason=decision.reason,
            step=decision.step,
            score=decision.score,
            best_step=decision.best_step,
            policy=policy.as_dict(),
        )


class ErrorOut(_Out):
    """`{prefix}/{run_id}/error` or `{prefix}/_errors`: an event that was refused, and why."""

    run_id: RunId | None = None
    topic: str = Field(description="The topic the refused event came on.")
    reason: str = Field(pattern=r"^[a-z][a-z0-9_]{0,63}$", description="Short code, e.g. bad_json, invalid.")
    error: str = Field(description="What was wrong and what to do.")


# -- decoding --


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


def summarise(error: ValidationError) -> tuple[ErrorReason, str]:
    """One readable line (and a reason code) for a pydantic error: the first problem, its field, and a count."""
    errors = error.errors(include_url=False, include_context=False)
    first = errors[0]
    where = _loc(first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "missing":
        text = f"{where} is required"
    else:
        text = f"{where}: {msg}"
        if first["type"].endswith("_type") or first["type"] in ("model_type", "dict_type", "list_type"):
            text += f" (got {_JSON_TYPES.get(type(first['input']), type(first['input']).__name__)})"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    reason: ErrorReason = "bad_image" if first["type"] == "bad_image" else "invalid"
    return reason, _clip(text, 600)


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
) -> tuple[str, InputEvent]:
    """Parse and validate one MQTT input message into (run_id, RunStart | StepIn | RunEnd); raise EventError.

    CPU-bound for large images (base64 and JSON): call it off the event loop. Image paths and URLs are
    refused unless `image_dirs` / `image_hosts` allow them; allowed ones are checked here but read or
    fetched later (`agent_monitor.sources.fetch_images`), never by this function.
    """
    try:
        run_id, kind = parse_topic(topic, prefix)
    except TopicError as e:
        raise EventError("bad_topic", str(e)) from None
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
        raise EventError(
            "bad_json", f"payload is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", run_id=run_id
        ) from None
    except (ValueError, RecursionError) as e:
        detail = "nested too deeply" if isinstance(e, RecursionError) else _clip(str(e), 120)
        raise EventError("bad_json", f"payload is not acceptable JSON: {detail}", run_id=run_id) from None
    if not isinstance(data, dict):
        raise EventError(
            "invalid",
            f"{kind} payload must be a JSON object, got {_JSON_TYPES.get(type(data), 'a value')}",
            run_id=run_id,
        )
    try:
        context = {
            "max_image_bytes": max_image_bytes,
            "image_dirs": tuple(image_dirs),
            "image_hosts": tuple(image_hosts),
        }
        model = INPUT_MODELS[kind].model_validate(data, context=context)
    except ValidationError as e:
        reason, message = summarise(e)
        raise EventError(reason, f"{kind}: {message}", run_id=run_id) from None
    except RecursionError:
        raise EventError("invalid", f"{kind}: payload is nested too deeply", run_id=run_id) from None
    return run_id, model


# -- JSON Schema export --

SCHEMA_MODELS: dict[str, tuple[type[BaseModel], Literal["validation", "serialization"]]] = {
    "start": (RunStart, "validation"),
    "step": (StepIn, "validation"),
    "end": (RunEnd, "validation"),
    "progress": (ProgressOut, "serialization"),
    "signal": (SignalOut, "serialization"),
    "error": (ErrorOut, "serialization"),
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
    bad = [n for n, t in fresh.items() if not (d / n).is_file() or (d / n).read_text(encoding="utf-8") != t]
    bad += sorted(p.name for p in d.glob("*.schema.json") if p.name not in fresh)
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agent_monitor.events --write DIR | --check DIR`."""
    ap = argparse.ArgumentParser(prog="python -m agent_monitor.events", description=main.__doc__)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="DIR", help="write the JSON Schemas of every payload into DIR")
    g.add_argument("--check", metavar="DIR", help="exit 1 if the schemas in DIR are not up to date")
    args = ap.parse_args(argv)
    if args.write:
        for p in write_schemas(args.write):
            print(p)
        return 0
    bad = stale_schemas(args.check)
    if bad:
        print(
            f"stale schemas in {args.check}: {', '.join(bad)}; run python -m agent_monitor.events --write {args.check}"
        )
        return 1
    return 0


__all__ = [
    "INPUT_KINDS",
    "MAX_IMAGE_BYTES",
    "MAX_PAYLOAD_BYTES",
    "OUTPUT_KINDS",
    "POLICY_KEYS",
    "CriterionOut",
    "ErrorOut",
    "EventError",
    "ImageIn",
    "InputEvent",
    "ProgressOut",
    "RunEnd",
    "RunStart",
    "SignalOut",
    "StepIn",
    "Tokens",
    "TopicError",
    "check_run_id",
    "decode_event",
    "errors_topic",
    "input_filters",
    "parse_topic",
    "schemas",
    "stale_schemas",
    "summarise",
    "topic",
    "write_schemas",
]

if __name__ == "__main__":
    sys.exit(main())
