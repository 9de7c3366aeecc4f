"""Input payloads (start, step, end): strict pydantic models with every field bounded; unknown fields ignored."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Literal, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    JsonValue,
    PrivateAttr,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from ..criteria import CriteriaError, Rubric, RubricBounds, bundled_criteria, check_bounds, load_criteria
from ..images import sniff_mime
from ..policy import Policy, PolicyError
from ._common import JSON_TYPES, check_json_value, clip, err, none_to
from ._limits import (
    MAX_CRITERIA,
    MAX_CRITERION_BYTES,
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_LABEL_KEY_CHARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_META_BYTES,
    MAX_RUBRIC_BYTES,
    MAX_STEP_CHARS,
    MAX_STEP_INDEX,
    MAX_TASK_CHARS,
)
from ._refs import check_image_path, check_image_url, looks_like_path
from ._topics import GroupName

POLICY_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Policy))
"""The keys `start.policy` may set (the fields of `agent_monitor.policy.Policy`)."""

_GROUP = re.compile(r"[A-Za-z0-9.:-][A-Za-z0-9._:-]{0,127}")
_LABEL_KEY = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_MIME = re.compile(r"image/[a-z0-9][a-z0-9.+-]{0,62}", re.IGNORECASE)
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]{0,100})(?P<b64>;base64)?,", re.IGNORECASE)
_URL = re.compile(r"[a-z][a-z0-9+.-]{0,30}://", re.IGNORECASE)


DEFAULT_RUBRIC_BOUNDS = RubricBounds(MAX_CRITERIA, MAX_CRITERION_BYTES, MAX_RUBRIC_BYTES)
"""The rubric bounds a start is checked against when the decoder is given none (context `rubric_bounds`)."""


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
                    raise err("bad_image", "a data URL image must be base64 (data:image/png;base64,...)")
                return {**value, "data": data[m.end() :], "mime": value.get("mime") or m["mime"] or None}
            if isinstance(data, str) and _URL.match(data):
                raise err("bad_image", f"image data {clip(data, 60)!r} is a URL; images are inline base64 bytes only")
        return value

    @field_validator("mime")
    @classmethod
    def _check_mime(cls, mime: str | None) -> str | None:
        if mime is not None and not _MIME.fullmatch(mime):
            raise err("bad_image", f"mime {clip(mime, 60)!r} is not an image type; use e.g. image/png or omit it")
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
            raise err("bad_image", f"image data {clip(data, 60)!r} is a URL; images are inline base64 bytes only")
        if len(data) > 4 * ((limit + 2) // 3):
            raise err(
                "bad_image",
                f"image is about {len(data) * 3 // 4} bytes, over the limit of {limit}; downscale or re-encode it",
            )
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            if looks_like_path(data):
                raise err(
                    "bad_image",
                    f"image data {clip(data, 60)!r} looks like a file path; send the image bytes inline as base64",
                ) from None
            raise err(
                "bad_image",
                "image data is not valid base64; use the standard alphabet (A-Z a-z 0-9 + /) with '=' padding "
                "and no line breaks",
            ) from None
        if not raw:
            raise err("bad_image", "image data is empty; send the encoded image bytes as base64")
        if len(raw) > limit:
            raise err("bad_image", f"image is {len(raw)} bytes, over the limit of {limit}; downscale or re-encode it")
        sniffed = sniff_mime(raw)
        if sniffed is None:
            if looks_like_path(data):
                raise err(
                    "bad_image",
                    f"image data {clip(data, 60)!r} looks like a file path; send the image bytes inline as base64",
                )
            raise err("bad_image", "image bytes are not PNG, JPEG, GIF or WebP")
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
        "{'criteria': [...], 'thresholds': {'abort_below': ..., 'resample_below': ...}} (thresholds become this "
        "run's policy levels where its policy and the monitor's policy flags leave them open); never a file path. "
        "Null: the monitor's default rubric (serve --criteria; the bundled progress rubric unless set).",
    )
    images: ImageList
    policy: dict[str, bool | float | int | str | None] | None = Field(
        default=None,
        description="Overrides of the monitor's policy defaults and of the rubric's thresholds; unknown keys are an "
        "error.",
        json_schema_extra={"propertyNames": {"enum": list(POLICY_KEYS)}},
    )
    labels: dict[
        Annotated[str, StringConstraints(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$", max_length=MAX_LABEL_KEY_CHARS)],
        Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE_CHARS)],
    ] = Field(default_factory=dict, max_length=MAX_LABELS)
    expected: str | None = Field(default=None, max_length=MAX_TASK_CHARS, description="Known final answer (eval).")
    group: GroupName | None = Field(
        default=None,
        description="The group of sibling runs (best-of-N rollouts of one task) this one belongs to: ranked together "
        "on {prefix}/_groups/{group}/ranking, laggards pruned by the policy's keep_top and prune_margin. A topic "
        "level: 1-128 characters from A-Z a-z 0-9 . _ : -, not starting with '_'.",
    )
    family: str | None = Field(
        default=None,
        max_length=MAX_LABEL_VALUE_CHARS,
        description='The family of runs this one belongs to, for abort_below "auto" (calibration is kept per '
        "family, judge model and rubric); default: the task text.",
    )

    started_at: float | None = Field(
        default=None,
        ge=0,
        description="When the harness started the run (UNIX seconds): part of the outcome's HMAC (end.auth), so an "
        "end signed for one run cannot be replayed on a later run with the same id.",
    )

    auth: str | None = Field(
        default=None,
        pattern=r"^[0-9a-fA-F]{64}$",
        description="Hex HMAC-SHA256 of run id, started_at and group (agent_monitor.groups.group_mac): needed to join "
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
                    f"label name {clip(k, 40)!r} is not allowed; use up to {MAX_LABEL_KEY_CHARS} characters "
                    "from a-z A-Z 0-9 _, not starting with a digit",
                )
            if k.startswith("__"):
                raise err("labels", f"label name {clip(k, 40)!r} starts with '__', which is reserved")
            if not isinstance(v, str):
                raise err("labels", f"label {k!r} has a {JSON_TYPES.get(type(v), 'non-string')} value; use a string")
            if len(v) > MAX_LABEL_VALUE_CHARS:
                raise err("labels", f"label {k!r} is {len(v)} characters, over the limit of {MAX_LABEL_VALUE_CHARS}")
            if k == "group" and not _GROUP.fullmatch(v):
                # It becomes a metric label and a board filter, like start.group: the same rule.
                raise err(
                    "labels",
                    f"label group {clip(v, 40)!r} is not a group name; use 1-128 characters from A-Z a-z 0-9 . _ : -, "
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
            check_bounds(spec, bounds)  # before anything is built from it: the work one start causes is bounded
        except CriteriaError as e:
            raise err("criteria_too_large", str(e)) from None
        if isinstance(spec, str):
            names = bundled_criteria()
            if "/" in spec or "\\" in spec or spec.startswith((".", "~")) or re.search(r"\.(md|json|ya?ml)$", spec):
                raise err(
                    "criteria_path",
                    f"criteria {clip(spec, 60)!r} looks like a file path; files are not read for network events. "
                    f"Use a bundled name ({', '.join(names)}) or send the criteria inline",
                )
            if spec not in names:
                raise err("criteria", f"no bundled criteria named {clip(spec, 60)!r}; use one of {', '.join(names)}")
        elif isinstance(spec, dict):
            if "verifier" in spec:  # lmms-eval's pipeline config: named, not read as a criterion called "verifier"
                raise err("criteria", "'verifier' makes this an lmms-eval verification pipeline config, not a rubric; "
                          "use agent_monitor.verifiers.build_verification_pipeline, or send a 'criteria' list")  # fmt: skip
            if not isinstance(spec.get("criteria"), list) and not all(isinstance(v, str) for v in spec.values()):
                raise err(
                    "criteria",
                    "criteria as a dict is {name: description} with string descriptions, or a rubric config "
                    "with a 'criteria' list",
                )
        elif not isinstance(spec, list):
            raise err(
                "criteria", "criteria must be a bundled name, a {name: description} dict, a list or a rubric config"
            )
        check_json_value(spec, "criteria")
        try:
            load_criteria(spec)  # type: ignore[arg-type]  # JSON shapes checked above
        except CriteriaError as e:
            raise err("criteria", str(e)) from None
        except Exception as e:  # a config the loader did not foresee must be an input error, not a crash
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
                f"unknown policy key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(POLICY_KEYS)}",
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
            raise err("ts", f"ts {value!r} is not an ISO 8601 date-time; use e.g. 2025-01-31T12:00:00Z") from None
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
            raise err("meta", f"meta is {size} bytes as JSON, over the limit of {MAX_META_BYTES}; send less")
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> StepIn:
        if not self.text and not self.images:
            raise err("empty_step", "the step has no text and no images; send at least one")
        return self


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
        description="Hex HMAC-SHA256 of run id, start.started_at and outcome (see agent_monitor.calibration."
        "outcome_mac); with the monitor's --outcome-secret, only outcomes carrying it teach the calibration.",
    )

    @field_validator("outcome", mode="before")
    @classmethod
    def _outcome(cls, value: object) -> object:
        ok = value is None or value in ("success", "failure")
        ok = ok or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
        if not ok:
            raise err("outcome", f'outcome {value!r} is not allowed; use "success", "failure" or a finite number')
        return value


InputEvent: TypeAlias = RunStart | StepIn | RunEnd
INPUT_MODELS: dict[str, type[RunStart] | type[StepIn] | type[RunEnd]] = {
    "start": RunStart,
    "step": StepIn,
    "end": RunEnd,
}
