"""The input side of the wire in one place: the topic grammar, the payloads, and decoding a message
into an event.

Topics are `{prefix}/{run_id}/{kind}` with run ids that are one safe topic level (`Topics`
precomputes the names). Input payloads (start, step, end) are strict pydantic models with every
field bounded; unknown fields are ignored. `decode_event` turns one MQTT message into an input
event, or an `EventError` with a reason and a one-line message.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

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
from pydantic_core import CoreSchema

from ..criteria import (
    CriteriaError,
    Rubric,
    RubricBounds,
    bundled_criteria,
    check_bounds,
    load_criteria,
)
from ..images import sniff_mime
from ..policy import Policy, PolicyError
from ._common import JSON_TYPES, GroupName, check_json_value, clip, err, none_to
from ._limits import (
    MAX_CRITERIA,
    MAX_CRITERION_BYTES,
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_LABEL_KEY_CHARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_META_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_RUBRIC_BYTES,
    MAX_RUN_ID_CHARS,
    MAX_STEP_CHARS,
    MAX_STEP_INDEX,
    MAX_TASK_CHARS,
)
from ._outputs import ErrorOut
from ._refs import check_image_path, check_image_url, looks_like_path

# -- the topic grammar --

INPUT_KINDS = ("start", "step", "end")
OUTPUT_KINDS = ("progress", "signal", "error", "resend", "state")
ERRORS_LEVEL = "_errors"
GROUPS_LEVEL = "_groups"

Kind = Literal["start", "step", "end"]

_RUN_ID = re.compile(r"[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}")


class TopicError(ValueError):
    """A topic that is not `{prefix}/{run_id}/{kind}`, or a run id that is not a valid topic level.

    `reason` is `unknown_topic` for a well-formed topic whose kind is none of start, step, end (a
    typo such as `steps`), else `bad_topic`.
    """

    def __init__(
        self, message: str, *, reason: Literal["bad_topic", "unknown_topic"] = "bad_topic"
    ) -> None:
        super().__init__(message)
        self.reason: Literal["bad_topic", "unknown_topic"] = reason


def check_run_id(run_id: object) -> str:
    """Return `run_id` if it is a valid run id (one safe topic level); raise TopicError saying
    why not."""
    if not isinstance(run_id, str):
        raise TopicError(f"run id must be a string, got {type(run_id).__name__}")
    if not run_id:
        raise TopicError("run id is empty; use 1-128 characters from A-Z a-z 0-9 . _ : -")
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise TopicError(
            f"run id has {len(run_id)} characters, over the limit of {MAX_RUN_ID_CHARS}"
        )
    if any(c in run_id for c in "/+#\x00"):
        raise TopicError(
            f"run id {clip(run_id)!r} contains '/', '+', '#' or NUL; it must be one topic level"
        )
    if run_id.startswith("_"):
        raise TopicError(
            f"run id {clip(run_id)!r} starts with '_', which is reserved for the monitor's topics"
        )
    if run_id in (".", "..") or not _RUN_ID.fullmatch(run_id):
        raise TopicError(
            f"run id {clip(run_id)!r} is not allowed; use 1-128 characters from A-Z a-z 0-9 . _ : -"
        )
    return run_id


def check_prefix(prefix: str) -> str:
    levels = prefix.split("/")
    if not prefix or any(not lv for lv in levels) or any(c in prefix for c in "+#\x00"):
        raise TopicError(
            f"topic prefix {clip(prefix)!r} is invalid; use levels without '+', "
            "'#', NUL or empty parts"
        )
    return prefix


def parse_topic(topic: str, prefix: str = "agents") -> tuple[str, Kind]:
    """Split an input topic `{prefix}/{run_id}/{start|step|end}` into (run_id, kind); raise
    TopicError."""
    check_prefix(prefix)
    if not topic.startswith(prefix + "/"):
        raise TopicError(
            f"topic {clip(topic)!r} is not under {prefix!r}; publish to "
            f"{prefix}/<run_id>/<start|step|end>"
        )
    parts = topic[len(prefix) + 1 :].split("/")
    if len(parts) != 2:
        raise TopicError(
            f"topic {clip(topic)!r} has the wrong depth; publish to "
            f"{prefix}/<run_id>/<start|step|end>"
        )
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
        f"unknown topic {clip(topic)!r}: the monitor reads only {prefix}/<run_id>/start, step "
        "and end, "
        f"not {clip(kind, 40)!r}; publish to {hint}",
        reason="unknown_topic",
    )


def topic(prefix: str, run_id: str, kind: str) -> str:
    """The topic `{prefix}/{run_id}/{kind}` for an input or output kind (progress, signal, error,
    ...)."""
    check_prefix(prefix)
    check_run_id(run_id)
    if kind not in INPUT_KINDS + OUTPUT_KINDS:
        raise TopicError(
            f"unknown topic kind {kind!r}; use one of {', '.join(INPUT_KINDS + OUTPUT_KINDS)}"
        )
    return f"{prefix}/{run_id}/{kind}"


def ranking_topic(prefix: str, group: str) -> str:
    """The retained ranking topic of a group: `{prefix}/_groups/{group}/ranking` (a group name is
    a run id's grammar)."""
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
    """The topic names under one prefix, checked once: building a name for a run id already checked
    costs a join.

    The daemon builds every output topic from run ids that decoding validated, so nothing is
    validated again on the way out.
    """

    def __init__(self, prefix: str = "agents") -> None:
        self.prefix = check_prefix(prefix)
        self.errors = f"{prefix}/{ERRORS_LEVEL}"
        self.subscription = f"{prefix}/+/+"
        """What the daemon subscribes to: every input, and every misspelt one (reported as
        unknown_topic)."""
        self.inputs = [f"{prefix}/+/{k}" for k in INPUT_KINDS]
        """The exact input filters (where a broker refuses the wider subscription)."""
        self._under = prefix + "/"

    def ranking(self, group: str) -> str:
        """`{prefix}/_groups/{group}/ranking` (retained) for a group name that is already known
        valid."""
        return f"{self.prefix}/{GROUPS_LEVEL}/{group}/ranking"

    def of(self, run_id: str, kind: str) -> str:
        """`{prefix}/{run_id}/{kind}` for a run id that is already known valid."""
        return f"{self.prefix}/{run_id}/{kind}"

    def is_output(self, topic: str) -> bool:
        """Whether `topic` is one the monitor publishes (progress, signal, error, `_errors`, other
        `_` levels).

        The daemon's subscription also matches these (its own messages and other monitors'); they
        are ignored, not reported. A `_` level followed by an input kind is not one of them: it is a
        bad run id.
        """
        if not topic.startswith(self._under):
            return False
        levels = topic[len(self._under) :].split("/")
        if levels[0].startswith("_"):
            return levels[-1] not in INPUT_KINDS
        return len(levels) == 2 and levels[1] in OUTPUT_KINDS


# -- the payloads --

POLICY_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Policy))
"""The keys `start.policy` may set (the fields of `agent_monitor.policy.Policy`)."""

_GROUP = re.compile(r"[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}")
_LABEL_KEY = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_MIME = re.compile(r"image/[a-z0-9][a-z0-9.+-]{0,62}", re.IGNORECASE)
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]{0,100})(?P<b64>;base64)?,", re.IGNORECASE)
_URL = re.compile(r"[a-z][a-z0-9+.-]{0,30}://", re.IGNORECASE)


DEFAULT_RUBRIC_BOUNDS = RubricBounds(MAX_CRITERIA, MAX_CRITERION_BYTES, MAX_RUBRIC_BYTES)
"""The rubric bounds a start is checked against when the decoder is given none (context
`rubric_bounds`)."""


class _In(BaseModel):
    """Base of input payloads: strict types, unknown fields ignored, immutable."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class ImageIn(_In):
    """An image: inline base64 bytes of a PNG, JPEG, GIF or WebP; a `path` or `url` only where
    the operator allows it."""

    data: str = Field(
        default="",
        description="Standard base64 (RFC 4648, padded) of the encoded image; no paths or URLs.",
    )
    mime: str | None = Field(
        default=None, description="A hint; replaced by the type sniffed from the bytes."
    )
    path: str | None = Field(
        default=None,
        max_length=1024,
        description="A file on the monitor's machine: refused unless the operator allows its "
        "directory "
        "(--allow-image-dir).",
    )
    url: str | None = Field(
        default=None,
        max_length=2048,
        description="An http(s) URL: refused unless the operator allows its host "
        "(--allow-image-host).",
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
                    raise err(
                        "bad_image", "a data URL image must be base64 (data:image/png;base64,...)"
                    )
                return {
                    **value,
                    "data": data[m.end() :],
                    "mime": value.get("mime") or m["mime"] or None,
                }
            if isinstance(data, str) and _URL.match(data):
                raise err(
                    "bad_image",
                    f"image data {clip(data, 60)!r} is a URL; images are inline base64 bytes only",
                )
        return value

    @field_validator("mime")
    @classmethod
    def _check_mime(cls, mime: str | None) -> str | None:
        if mime is not None and not _MIME.fullmatch(mime):
            raise err(
                "bad_image",
                f"mime {clip(mime, 60)!r} is not an image type; use e.g. image/png or omit it",
            )
        return mime

    @model_validator(mode="after")
    def _decode(self, info: ValidationInfo) -> ImageIn:
        ctx = info.context or {}
        limit = int(ctx.get("max_image_bytes", MAX_IMAGE_BYTES))
        given = [k for k in ("data", "path", "url") if getattr(self, k)]
        if len(given) > 1:
            raise err("bad_image", f"an image has {' and '.join(given)}; give exactly one")
        if self.path is not None:
            check_image_path(self.path, ctx.get("image_dirs", ()))
            return self  # read later, off the event loop (agent_monitor.sources)
        if self.url is not None:
            check_image_url(self.url, ctx.get("image_hosts", ()))
            return self
        data = self.data
        if _URL.match(data):
            raise err(
                "bad_image",
                f"image data {clip(data, 60)!r} is a URL; images are inline base64 bytes only",
            )
        if len(data) > 4 * ((limit + 2) // 3):
            raise err(
                "bad_image",
                f"image is about {len(data) * 3 // 4} bytes, over the limit of {limit}; "
                "downscale or re-encode it",
            )
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            if looks_like_path(data):
                raise err(
                    "bad_image",
                    f"image data {clip(data, 60)!r} looks like a file path; send the image "
                    "bytes inline as base64",
                ) from None
            raise err(
                "bad_image",
                "image data is not valid base64; use the standard alphabet (A-Z a-z 0-9 + /) "
                "with '=' padding "
                "and no line breaks",
            ) from None
        if not raw:
            raise err("bad_image", "image data is empty; send the encoded image bytes as base64")
        if len(raw) > limit:
            raise err(
                "bad_image",
                f"image is {len(raw)} bytes, over the limit of {limit}; downscale or re-encode it",
            )
        sniffed = sniff_mime(raw)
        if sniffed is None:
            if looks_like_path(data):
                raise err(
                    "bad_image",
                    f"image data {clip(data, 60)!r} looks like a file path; send the image "
                    "bytes inline as base64",
                )
            raise err("bad_image", "image bytes are not PNG, JPEG, GIF or WebP")
        object.__setattr__(self, "mime", sniffed)
        self._bytes = raw
        return self

    def decoded(self) -> bytes:
        """The image's encoded bytes (PNG/JPEG/...), decoded from base64 once (or as fetched for
        a path/URL)."""
        if self._bytes is None:
            if self.path is not None or self.url is not None:
                raise RuntimeError(
                    "this image is a path or URL that was not fetched yet; "
                    "see agent_monitor.sources"
                )
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
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The object form, or (on input) a bare base64 string."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        if handler.mode == "serialization":
            return schema
        bare = {
            "type": "string",
            "contentEncoding": "base64",
            "description": "Bare base64 image bytes.",
        }
        return {
            "anyOf": [bare, dict(schema)],
            "title": "ImageIn",
            "description": schema.get("description", ""),
        }

    @classmethod
    def from_bytes(cls, data: bytes, mime: str | None = None) -> ImageIn:
        """An ImageIn from encoded image bytes (for harness-side helpers and tests)."""
        return cls.model_validate({"data": base64.b64encode(data).decode("ascii"), "mime": mime})


ImageList = Annotated[list[ImageIn], Field(default_factory=list, max_length=MAX_IMAGES)]


class RunStart(_In):
    """`{prefix}/{run_id}/start`: the task, criteria, task images, policy overrides and labels of
    a run."""

    task: str = Field(max_length=MAX_TASK_CHARS, description="What the agent is working on.")
    criteria: JsonValue = Field(
        default=None,
        description="A bundled rubric name, {name: description}, a list of criteria, or a "
        "rubric config "
        "{'criteria': [...], 'thresholds': {'abort_below': ..., 'resample_below': ...}} "
        "(thresholds become this "
        "run's policy levels where its policy and the monitor's policy flags leave them "
        "open); never a file path. "
        "Null: the monitor's default rubric (serve --criteria; the bundled progress rubric "
        "unless set).",
    )
    images: ImageList
    policy: dict[str, bool | float | int | str | None] | None = Field(
        default=None,
        description="Overrides of the monitor's policy defaults and of the rubric's "
        "thresholds; unknown keys are an "
        "error.",
        json_schema_extra={"propertyNames": {"enum": list(POLICY_KEYS)}},
    )
    labels: dict[
        Annotated[
            str,
            StringConstraints(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$", max_length=MAX_LABEL_KEY_CHARS),
        ],
        Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE_CHARS)],
    ] = Field(default_factory=dict, max_length=MAX_LABELS)
    expected: str | None = Field(
        default=None, max_length=MAX_TASK_CHARS, description="Known final answer (eval)."
    )
    group: GroupName | None = Field(
        default=None,
        description="The group of sibling runs (best-of-N rollouts of one task) this one "
        "belongs to: ranked together "
        "on {prefix}/_groups/{group}/ranking, laggards pruned by the policy's keep_top and "
        "prune_margin. A topic "
        "level: 1-128 characters from A-Z a-z 0-9 . _ : -, not starting with '_'.",
    )
    family: str | None = Field(
        default=None,
        max_length=MAX_LABEL_VALUE_CHARS,
        description='The family of runs this one belongs to, for abort_below "auto" '
        "(calibration is kept per "
        "family, judge model and rubric); default: the task text.",
    )

    started_at: float | None = Field(
        default=None,
        ge=0,
        description="When the harness started the run (UNIX seconds): part of the outcome's "
        "HMAC (end.auth), so an "
        "end signed for one run cannot be replayed on a later run with the same id.",
    )

    auth: str | None = Field(
        default=None,
        pattern=r"^[0-9a-fA-F]{64}$",
        description="Hex HMAC-SHA256 of run id, started_at and group "
        "(agent_monitor.groups.group_mac): needed to join "
        "a group when the monitor runs with --group-secret.",
    )

    @field_validator("task")
    @classmethod
    def _task_not_blank(cls, task: str) -> str:
        if not task.strip():
            raise err("blank", "task is empty; say what the agent is working on")
        return task

    @field_validator("images", mode="before")
    @classmethod
    def _null_is_empty(cls, value: object) -> object:
        return none_to(value, [])

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_bounded(cls, value: object) -> object:
        if value is None:
            return {}
        if not isinstance(value, dict):
            return value  # the type check reports it
        if len(value) > MAX_LABELS:
            raise err("labels", f"{len(value)} labels, over the limit of {MAX_LABELS}; send fewer")
        for k, v in value.items():
            if len(k) > MAX_LABEL_KEY_CHARS or not _LABEL_KEY.fullmatch(k):
                raise err(
                    "labels",
                    f"label name {clip(k, 40)!r} is not allowed; use up to "
                    f"{MAX_LABEL_KEY_CHARS} characters "
                    "from a-z A-Z 0-9 _, not starting with a digit",
                )
            if k.startswith("__"):
                raise err(
                    "labels", f"label name {clip(k, 40)!r} starts with '__', which is reserved"
                )
            if not isinstance(v, str):
                raise err(
                    "labels",
                    f"label {k!r} has a "
                    f"{JSON_TYPES.get(type(v), 'non-string')} value; use a string",
                )
            if len(v) > MAX_LABEL_VALUE_CHARS:
                raise err(
                    "labels",
                    f"label {k!r} is {len(v)} characters, over the limit of "
                    f"{MAX_LABEL_VALUE_CHARS}",
                )
            if k == "group" and not _GROUP.fullmatch(v):
                # It becomes a metric label and a board filter, like start.group: the same rule.
                raise err(
                    "labels",
                    f"label group {clip(v, 40)!r} is not a group name; use 1-128 characters "
                    "from A-Z a-z 0-9 . _ : -, "
                    "not starting with '_' (as start.group)",
                )
        return value

    @field_validator("criteria")
    @classmethod
    def _criteria_loads(cls, spec: JsonValue, info: ValidationInfo) -> JsonValue:
        if spec is None:
            return None
        ctx = info.context or {}
        bounds = ctx.get("rubric_bounds") or DEFAULT_RUBRIC_BOUNDS
        try:
            # before anything is built from it: the work one start causes is bounded
            check_bounds(spec, bounds)
        except CriteriaError as e:
            raise err("criteria_too_large", str(e)) from None
        if isinstance(spec, str):
            names = bundled_criteria()
            if (
                "/" in spec
                or "\\" in spec
                or spec.startswith((".", "~"))
                or re.search(r"\.(md|json|ya?ml)$", spec)
            ):
                raise err(
                    "criteria_path",
                    f"criteria {clip(spec, 60)!r} looks like a file path; files are not read "
                    "for network events. "
                    f"Use a bundled name ({', '.join(names)}) or send the criteria inline",
                )
            if spec not in names:
                raise err(
                    "criteria",
                    f"no bundled criteria named {clip(spec, 60)!r}; use one of {', '.join(names)}",
                )
        elif isinstance(spec, dict):
            # lmms-eval's pipeline config: named, not read as a criterion called "verifier"
            if "verifier" in spec:
                raise err(
                    "criteria",
                    "'verifier' makes this an lmms-eval verification "
                    "pipeline config, not a rubric; "
                    "use agent_monitor.verifiers.build_verification_pipeline, or send "
                    "a 'criteria' list",
                )
            if not isinstance(spec.get("criteria"), list) and not all(
                isinstance(v, str) for v in spec.values()
            ):
                raise err(
                    "criteria",
                    "criteria as a dict is {name: description} with string descriptions, or "
                    "a rubric config "
                    "with a 'criteria' list",
                )
        elif not isinstance(spec, list):
            raise err(
                "criteria",
                "criteria must be a bundled name, a {name: description} dict, a "
                "list or a rubric config",
            )
        check_json_value(spec, "criteria")
        try:
            load_criteria(spec)  # type: ignore[arg-type]  # JSON shapes checked above
        except CriteriaError as e:
            raise err("criteria", str(e)) from None
        # a config the loader did not foresee must be an input error, not a crash
        except Exception as e:
            raise err("criteria", f"criteria cannot be loaded: {type(e).__name__}: {e}") from None
        return spec

    @field_validator("policy")
    @classmethod
    def _policy_known(
        cls, policy: dict[str, float | int | str | None] | None
    ) -> dict[str, float | int | str | None] | None:
        if policy is None:
            return None
        unknown = sorted(set(policy) - set(POLICY_KEYS))
        if unknown:
            raise err(
                "policy",
                f"unknown policy key(s) {', '.join(map(repr, unknown))}; known keys: "
                f"{', '.join(POLICY_KEYS)}",
            )
        try:
            Policy().with_overrides(policy)
        except (PolicyError, TypeError) as e:
            raise err("policy", str(e)) from None
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
            "anyOf": [
                {"type": "number"},
                {"type": "string", "format": "date-time"},
                {"type": "null"},
            ],
            "default": None,
            "description": "UNIX seconds, or an ISO 8601 date-time (UTC when it has no offset).",
        },
        mode="validation",
    ),
]


class StepIn(_In):
    """`{prefix}/{run_id}/step`: one step of the run (action and observation text, images, rule
    metadata)."""

    index: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STEP_INDEX,
        description="1-based position; makes re-delivery idempotent.",
    )
    text: str = Field(max_length=MAX_STEP_CHARS, description="The step's action and observation.")
    images: ImageList
    ts: Timestamp = None
    meta: dict[str, JsonValue] | None = Field(
        default=None,
        description=f"Per-step data for rule criteria (at most {MAX_META_BYTES} bytes as JSON).",
    )
    amend: bool = Field(
        default=False,
        description="Replace the text of the step already accepted under `index` (which it "
        "needs) instead of adding "
        "one: e.g. a final answer sent before what followed it; its images and meta stay "
        "(send none).",
    )

    @field_validator("images", mode="before")
    @classmethod
    def _null_is_empty(cls, value: object) -> object:
        return none_to(value, [])

    @field_validator("ts", mode="before")
    @classmethod
    def _timestamp(cls, value: object) -> object:
        if value is None or isinstance(value, bool) or not isinstance(value, str):
            return value
        if len(value) > 64:
            raise err("ts", "ts is too long for a date-time; use UNIX seconds or ISO 8601")
        try:
            dt = datetime.fromisoformat(value)
        except ValueError:
            raise err(
                "ts", f"ts {value!r} is not an ISO 8601 date-time; use e.g. 2025-01-31T12:00:00Z"
            ) from None
        return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()

    @field_validator("meta", mode="before")
    @classmethod
    def _meta_bounded(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, dict):
            return value  # the type check reports it
        check_json_value(value, "meta")
        try:
            size = len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode())
        except (TypeError, ValueError) as e:
            raise err("meta", f"meta is not plain JSON: {e}") from None
        if size > MAX_META_BYTES:
            raise err(
                "meta",
                f"meta is {size} bytes as JSON, over the limit of {MAX_META_BYTES}; send less",
            )
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> StepIn:
        if not self.text and not self.images:
            raise err("empty_step", "the step has no text and no images; send at least one")
        if self.amend:
            self._check_amend()
        return self

    def _check_amend(self) -> None:
        """An amendment names the step it replaces and brings its new text only."""
        if self.index is None:
            raise err(
                "amend",
                "an amendment (amend: true) needs the index of the step it replaces; send index",
            )
        if self.images or self.meta is not None or not self.text:
            raise err(
                "amend",
                "an amendment replaces a step's text only (its images and "
                "meta stay); send text alone",
            )


Outcome = Annotated[
    Literal["success", "failure"] | float | None,
    Field(description="How the run ended: success, failure, or a number (e.g. a reward)."),
]


class RunEnd(_In):
    """`{prefix}/{run_id}/end`: the run is over; its outcome, when known."""

    outcome: Outcome = None
    auth: str | None = Field(
        default=None,
        pattern=r"^[0-9a-fA-F]{64}$",
        description="Hex HMAC-SHA256 of run id, start.started_at and outcome (see "
        "agent_monitor.calibration."
        "outcome_mac); with the monitor's --outcome-secret, only outcomes carrying it teach "
        "the calibration.",
    )

    @field_validator("outcome", mode="before")
    @classmethod
    def _outcome(cls, value: object) -> object:
        ok = value is None or value in ("success", "failure")
        ok = ok or (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
        if not ok:
            raise err(
                "outcome",
                f'outcome {value!r} is not allowed; use "success", "failure" or a finite number',
            )
        return value


InputEvent: TypeAlias = RunStart | StepIn | RunEnd
INPUT_MODELS: dict[str, type[RunStart] | type[StepIn] | type[RunEnd]] = {
    "start": RunStart,
    "step": StepIn,
    "end": RunEnd,
}


# -- decoding one message --


ErrorReason = Literal[
    "payload_too_large", "bad_json", "bad_topic", "unknown_topic", "invalid", "bad_image"
]
"""The refusals decoding can give (a subset of `agent_monitor.progress.REFUSALS`)."""


class EventError(ValueError):
    """An MQTT event that cannot be accepted: `reason` is a short code, the message says what to
    fix."""

    def __init__(self, reason: ErrorReason, message: str, *, run_id: str | None = None) -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason
        self.message = message
        self.run_id = run_id

    def to_out(self, topic: str) -> ErrorOut:
        """The error message to publish for this event."""
        return ErrorOut(
            run_id=self.run_id, topic=clip(topic, 512), reason=self.reason, error=self.message
        )


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
"""Problems one error message spells out; more are counted (a hostile payload can have
thousands)."""


def _problem(error: Any) -> str:
    where = _loc(error["loc"])
    if error["type"] == "missing":
        return f"{where} is required"
    text = f"{where}: {str(error['msg']).removeprefix('Value error, ')}"
    if error["type"].endswith("_type") or error["type"] in ("model_type", "dict_type", "list_type"):
        text += f" (got {JSON_TYPES.get(type(error['input']), type(error['input']).__name__)})"
    return text


def summarise(error: ValidationError) -> tuple[ErrorReason, str]:
    """One readable line (and a reason code) for a pydantic error: every problem with its field,
    up to a few."""
    errors = error.errors(include_url=False, include_context=False)
    text = "; ".join(_problem(e) for e in errors[:_LISTED])
    if len(errors) > _LISTED:
        rest = len(errors) - _LISTED
        text += f" (and {rest} more problem{'s' if rest > 1 else ''})"
    reason: ErrorReason = "bad_image" if errors[0]["type"] == "bad_image" else "invalid"
    return reason, clip(text, 600)


def _json_problem(e: json.JSONDecodeError) -> str:
    """The decoder's message with its position (`Invalid control character at line 1 column 28`) and
    what to do.

    Some of the decoder's messages end in "at" already ("Invalid control character at",
    "Unterminated string starting at"), others do not ("Expecting value").
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
    """Parse and validate one MQTT input message into (run_id, RunStart | StepIn | RunEnd); raise
    EventError.

    CPU-bound for large images (base64 and JSON): call it off the event loop. Image paths and URLs
    are refused unless `image_dirs` / `image_hosts` allow them; allowed ones are checked here but
    read or fetched later (`agent_monitor.sources.fetch_images`), never by this function.
    """
    try:
        run_id, kind = parse_topic(topic, prefix)
    except TopicError as e:
        raise EventError(e.reason, str(e)) from None
    raw = payload.encode() if isinstance(payload, str) else bytes(payload)
    if len(raw) > max_payload:
        raise EventError(
            "payload_too_large",
            f"payload is {len(raw)} bytes, over the limit of {max_payload}; send smaller or "
            "fewer images",
            run_id=run_id,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EventError(
            "bad_json", f"payload is not UTF-8 text (byte {e.start}); send JSON", run_id=run_id
        ) from None
    if not text.strip():
        text = "{}"
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise EventError(
            "bad_json", f"payload is not valid JSON: {_json_problem(e)}", run_id=run_id
        ) from None
    except (ValueError, RecursionError) as e:
        detail = "nested too deeply" if isinstance(e, RecursionError) else clip(str(e), 120)
        raise EventError(
            "bad_json", f"payload is not acceptable JSON: {detail}", run_id=run_id
        ) from None
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
        raise EventError(
            "invalid", f"{kind}: payload is nested too deeply", run_id=run_id
        ) from None
    return run_id, model


class Decoder:
    """`decode_event` with a daemon's settings bound once; the monitor's own outputs decode to None,
    not an error.

    A daemon subscribed to `{prefix}/+/+` receives its own progress, signals and errors back (and
    other monitors'): those are ignored, not reported.
    """

    def __init__(
        self,
        topics: Topics,
        *,
        max_payload: int = MAX_PAYLOAD_BYTES,
        max_image_bytes: int = MAX_IMAGE_BYTES,
        image_dirs: Sequence[str | Path] = (),
        image_hosts: Sequence[str] = (),
        rubric_bounds: RubricBounds | None = None,
    ) -> None:
        self.topics = topics
        self._settings: dict[str, Any] = {
            "prefix": topics.prefix,
            "max_payload": max_payload,
            "max_image_bytes": max_image_bytes,
            "image_dirs": tuple(image_dirs),
            "image_hosts": tuple(image_hosts),
            "rubric_bounds": rubric_bounds,
        }

    def __call__(
        self, topic: str, payload: bytes | bytearray | memoryview | str
    ) -> tuple[str, InputEvent] | None:
        """The run id and event of one message, or None for one of the monitor's outputs; raise
        EventError."""
        if self.topics.is_output(topic):
            return None
        return decode_event(topic, payload, **self._settings)
