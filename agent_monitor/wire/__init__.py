"""The MQTT wire protocol: topics, payload models, decoding, JSON Schemas, broker settings and the
harness client.

Topics (prefix `agents` by default, configurable, may have several levels):

- inputs: `{prefix}/{run_id}/start` (RunStart), `.../step` (StepIn), `.../end` (RunEnd);
- outputs: `.../progress` (ProgressOut), `.../signal` (SignalOut, retained), `.../error` (ErrorOut),
  `.../state` (StateOut, retained while the run lives);
  `{prefix}/_groups/{group}/ranking` (RankingOut, retained) for runs started with `start.group`;
  events whose topic or run id cannot be parsed (`bad_topic`), or whose kind is none of start,
  step, end (`unknown_topic`: a typo such as `steps`), are reported on `{prefix}/_errors`.

A run id is one topic level of 1 to 128 characters from `A-Z a-z 0-9 . _ : -`, not starting
with `_` (reserved for the monitor's own topics such as `_errors`) and not `.` or `..`.

Decisions, for harness authors:

- Unknown fields are IGNORED on every payload, so a harness may add its own fields and an
  older monitor keeps working. The one exception is `start.policy`: an unknown (e.g. misspelt)
  policy key is an error, because silently dropping `abort_belw` would disable an abort the
  user asked for.
- Types are strict: `"3"` is not an integer, `true` is not a number, `NaN`/`Infinity` are
  refused. Optional list/dict fields may be omitted or `null`.
- Images are inline bytes: `{"data": base64, "mime": optional}`, a bare base64 string, or a
  `data:image/...;base64,...` URL; the bytes must be a PNG, JPEG, GIF or WebP (sniffed). File
  paths and URLs are refused unless the operator allowed their directory or host.
- `start.criteria` is a bundled rubric name or inline criteria; a criteria *file* name is
  refused (a network event must not make the monitor read files).
- An empty payload is read as `{}` (so `mosquitto_pub -n -t agents/r1/end` ends a run).

This package imports only the top level of `agent_monitor`, never the daemon.
"""

from ._client import ImageArg, MonitorClient, Run, SignalName
from ._inputs import (
    INPUT_KINDS,
    OUTPUT_KINDS,
    POLICY_KEYS,
    Decoder,
    EventError,
    ImageIn,
    InputEvent,
    RunEnd,
    RunStart,
    StepIn,
    TopicError,
    Topics,
    check_run_id,
    decode_event,
    errors_topic,
    input_filters,
    parse_topic,
    ranking_topic,
    summarise,
    topic,
)
from ._limits import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_LABEL_KEY_CHARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_META_BYTES,
    MAX_META_DEPTH,
    MAX_PAYLOAD_BYTES,
    MAX_RUN_ID_CHARS,
    MAX_STEP_CHARS,
    MAX_STEP_INDEX,
    MAX_TASK_CHARS,
)
from ._outputs import (
    CriterionOut,
    DecisionOut,
    ErrorOut,
    ProgressOut,
    RankedRunOut,
    RankingOut,
    SignalOut,
    StateOut,
    Tokens,
    Totals,
    UniformOut,
    signal_json,
)
from ._schema import schemas, stale_schemas, write_schemas
from ._settings import DEFAULT_BROKER, BrokerSettings, SettingsError

__all__ = [
    "DEFAULT_BROKER",
    "INPUT_KINDS",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_LABELS",
    "MAX_LABEL_KEY_CHARS",
    "MAX_LABEL_VALUE_CHARS",
    "MAX_META_BYTES",
    "MAX_META_DEPTH",
    "MAX_PAYLOAD_BYTES",
    "MAX_RUN_ID_CHARS",
    "MAX_STEP_CHARS",
    "MAX_STEP_INDEX",
    "MAX_TASK_CHARS",
    "OUTPUT_KINDS",
    "POLICY_KEYS",
    "BrokerSettings",
    "CriterionOut",
    "DecisionOut",
    "Decoder",
    "ErrorOut",
    "EventError",
    "ImageArg",
    "ImageIn",
    "InputEvent",
    "MonitorClient",
    "ProgressOut",
    "RankedRunOut",
    "RankingOut",
    "Run",
    "RunEnd",
    "RunStart",
    "SettingsError",
    "SignalName",
    "SignalOut",
    "StateOut",
    "StepIn",
    "Tokens",
    "TopicError",
    "Topics",
    "Totals",
    "UniformOut",
    "check_run_id",
    "decode_event",
    "errors_topic",
    "input_filters",
    "parse_topic",
    "ranking_topic",
    "schemas",
    "signal_json",
    "stale_schemas",
    "summarise",
    "topic",
    "write_schemas",
]
