"""The monitor's settings: one frozen dataclass tree, each default and its help text written once.

`agent-monitor serve` generates its flags and their `AGENT_MONITOR_*` environment twins from
these fields (`flag`/`env` metadata keep the names users' scripts already use), so a default
changed here is the default everywhere, `--help` included.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from ..calibration import DEFAULT_STRATA, DEFAULT_SUCCESS_AT
from ..criteria import MAX_CRITERIA, MAX_CRITERION_BYTES, MAX_RUBRIC_BYTES, RubricBounds
from ..options import ScoringOptions
from ..policy import Policy
from ..progress import Prices
from ..wire import MAX_IMAGE_BYTES, MAX_PAYLOAD_BYTES, BrokerSettings, Topics

MAX_JUDGE_CALLS_PER_STEP = 64
"""Judge calls one scoring of one run may make (judged criteria x repeats); a start over it is
refused."""
MAX_JUDGE_CALLS_PER_RUN_MINUTE = 600
"""Judge calls one run may make in any 60 s; past it the run's newest prefix waits (steps
coalesce)."""


MqttProtocol = Literal["auto", "5", "3.1.1"]
"""The MQTT protocol version the monitor speaks: "auto" tries 5, then 3.1.1."""
Protocol = MqttProtocol
"""The old name of `MqttProtocol` (kept: `agent_monitor.daemon` exports it)."""


@dataclass(frozen=True, slots=True)
class RunLimits:
    """How long things wait and how much is kept; every buffer here is bounded."""

    hold_s: float = field(
        default=10.0,
        metadata={"help": "seconds a step waits for its run's start, or for missing earlier steps"},
    )
    idle_timeout_s: float = field(
        default=3600.0,
        metadata={"help": "seconds without events before a run expires (its signal is cleared)"},
    )
    max_runs: int = field(
        default=10_000,
        metadata={"help": "live runs; a start beyond this evicts the run idle longest"},
    )
    max_held_steps: int = field(
        default=1_000,
        metadata={
            "help": "out-of-order steps kept per run, and steps kept for a run not started yet"
        },
    )
    max_orphan_runs: int = field(
        default=1_000, metadata={"help": "run ids with steps but no start yet"}
    )
    ended_memory: int = field(
        default=10_000,
        metadata={"help": "ended run ids remembered, so a late step is reported, not a ghost run"},
    )
    max_groups: int = field(
        default=1_000,
        metadata={
            "help": "live groups (start.group); a start for a new group beyond this is refused"
        },
    )
    max_group_runs: int = field(
        default=100, metadata={"help": "runs in one group; a start beyond this is refused"}
    )
    group_grace_s: float = field(
        default=60.0,
        metadata={
            "help": "seconds a group's ranking stays retained after its last run ended "
            "(then it is cleared)"
        },
    )
    redelivery_window: int = field(
        default=1_024,
        metadata={
            "help": "recent MQTT deliveries remembered to recognise a broker's "
            "redelivery (DUP) of one"
        },
    )

    def __post_init__(self) -> None:
        if self.group_grace_s < 0:
            raise ValueError(f"group_grace_s={self.group_grace_s}; use 0 or more seconds")
        if self.hold_s < 0 or self.idle_timeout_s <= 0:
            raise ValueError(
                f"hold_s={self.hold_s} and idle_timeout_s={self.idle_timeout_s}: use hold >= "
                "0 and idle timeout > 0"
            )
        small = {
            k: v
            for k, v in (
                ("max_runs", self.max_runs),
                ("max_held_steps", self.max_held_steps),
                ("max_orphan_runs", self.max_orphan_runs),
                ("ended_memory", self.ended_memory),
                ("redelivery_window", self.redelivery_window),
                ("max_groups", self.max_groups),
                ("max_group_runs", self.max_group_runs),
            )
            if v < 1
        }
        if small:
            raise ValueError(f"run limits {small} must be >= 1")


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """What the per-run Prometheus gauges show."""

    labels: tuple[str, ...] = field(
        default=("group", "model"),
        metadata={
            "flag": "--metric-labels",
            "comma": True,
            "help": "start.labels that become labels of the per-run gauges (comma-separated; "
            "keep them few); a run "
            "whose start names none of them (e.g. no labels.model) gets an empty label",
        },
    )
    max_series: int = field(
        default=1000,
        metadata={
            "flag": "--max-series",
            "help": "runs exported per run at most (the most recently active); the rest are "
            "counted in "
            "agent_monitor_run_series_capped",
        },
    )
    grace_s: float = field(
        default=60.0,
        metadata={
            "flag": "--metrics-grace",
            "help": "seconds an ended run's per-run series stay visible",
        },
    )
    families: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "--metric-families",
            "comma": True,
            "help": "calibration families exported by name (comma-separated); none: any "
            "family, up to "
            "--max-families (family names come from runs' starts: keep them few)",
        },
    )
    groups: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "--metric-groups",
            "comma": True,
            "help": "groups (start.group) exported by name in the group gauges "
            "(comma-separated); none: any group, "
            "up to --max-group-series",
        },
    )
    max_group_series: int = field(
        default=100,
        metadata={
            "help": "groups exported in the group gauges at most, the most recently active "
            "first; the rest are "
            "counted in agent_monitor_group_series_capped"
        },
    )
    max_families: int = field(
        default=100,
        metadata={
            "help": "calibration families (with their judge model and rubric) exported at "
            "most, the most recently "
            "ended first; the rest are counted in agent_monitor_calibration_series_capped"
        },
    )

    def __post_init__(self) -> None:
        bad = [
            n
            for n in self.labels
            if not n.isidentifier() or n.startswith("__") or n in ("run_id", "signal")
        ]
        if bad:
            raise ValueError(
                f"metric labels {bad} are not allowed; use identifiers other than run_id and signal"
            )
        if (
            self.max_series < 0
            or self.grace_s < 0
            or self.max_families < 0
            or self.max_group_series < 0
        ):
            raise ValueError(
                f"max_series={self.max_series}, grace_s={self.grace_s}, "
                f"max_families={self.max_families}: "
                "use numbers >= 0"
            )


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """Cluster mode: replicas share runs through Redis and MQTT shared subscriptions
    (docs/cluster.md)."""

    url: str | None = field(
        default=None,
        metadata={
            "flag": "--cluster",
            "help": "join the cluster kept in this Redis (redis://HOST:PORT/DB; rediss:// "
            "for TLS); none: one process "
            "with its own run store. Needs pip install -e '.[cluster]' (in the agent-monitor "
            "checkout)",
        },
    )
    name: str = field(
        default="agent-monitor",
        metadata={
            "flag": "--cluster-name",
            "help": "the cluster's name: its Redis keys (am:NAME:...) and shared "
            "subscription group ($share/NAME/...)",
        },
    )
    replica_id: str | None = field(
        default=None,
        metadata={
            "help": "this replica's id in the cluster; none: host-pid-random (new each start)"
        },
    )
    lease_s: float = field(
        default=5.0,
        metadata={
            "flag": "--cluster-lease",
            "help": "seconds a replica owns its runs without renewing; a dead replica's runs "
            "move after this",
        },
    )
    heartbeat_s: float = field(
        default=1.0,
        metadata={
            "flag": "--cluster-heartbeat",
            "help": "seconds between heartbeats and lease renewals",
        },
    )

    def __post_init__(self) -> None:
        if self.url is not None and urlsplit(self.url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"cluster url {self.url!r} is not a Redis URL; use redis://HOST:PORT/DB"
            )
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"cluster name {self.name!r}; use letters, digits, '.', '_' or '-' (1-64)"
            )
        if self.replica_id is not None and not _NAME.fullmatch(self.replica_id):
            raise ValueError(
                f"replica id {self.replica_id!r}; use letters, digits, '.', '_' or '-' (1-64)"
            )
        if not (self.heartbeat_s > 0 and self.lease_s >= 2 * self.heartbeat_s):
            raise ValueError(
                f"cluster lease {self.lease_s}s, heartbeat {self.heartbeat_s}s: the lease "
                "must be at least two "
                "heartbeats (a renewal may be late once), and the heartbeat > 0"
            )


@dataclass(frozen=True, slots=True)
class PhoenixSettings:
    """The Arize Phoenix sink: every score as a span annotation on the step's own span
    (docs/phoenix.md)."""

    url: str | None = field(
        default=None,
        metadata={
            "flag": "--phoenix",
            "help": "annotate runs in this Arize Phoenix server (http://HOST:6006): each "
            "scored step's span gets a "
            "progress annotation, each run's trace its final score; trace-fed runs "
            "(--otlp-receiver) on the agent's "
            "own spans; none: off",
        },
    )
    api_key: str | None = field(
        default=None,
        repr=False,  # a secret: never in a logged or printed config
        metadata={
            "flag": "--phoenix-api-key",
            "help": "Phoenix API key, sent as 'Authorization: Bearer KEY' (Phoenix with auth "
            "enabled). Prefer the "
            "environment twin: a flag is visible in the process list. none: no header",
        },
    )
    project: str = field(
        default="default",
        metadata={
            "flag": "--phoenix-project",
            "help": "the Phoenix project of the spans agent-monitor exports for runs that "
            "came by other doors",
        },
    )
    annotation: str = field(
        default="progress",
        metadata={"flag": "--phoenix-annotation", "help": "the annotations' name in Phoenix"},
    )
    max_queue: int = field(
        default=10_000,
        metadata={
            "flag": "--phoenix-queue",
            "help": "annotations waiting to be sent at most; past it new ones are dropped "
            "and counted",
        },
    )
    max_batch: int = field(
        default=200,
        metadata={
            "flag": "--phoenix-batch",
            "help": "annotations in one request to Phoenix at most",
        },
    )
    retries: int = field(
        default=5,
        metadata={
            "flag": "--phoenix-retries",
            "help": "times a failed request is retried (with backoff, from 0.5 s up to 30 s) "
            "before its annotations "
            "are dropped and counted",
        },
    )
    timeout_s: float = field(
        default=10.0,
        metadata={"flag": "--phoenix-timeout", "help": "seconds one request to Phoenix may take"},
    )

    def __post_init__(self) -> None:
        if self.url is not None:
            url = urlsplit(self.url)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(
                    f"phoenix url {self.url!r} is not an HTTP URL; use http://HOST:6006 (--phoenix)"
                )
        if self.max_queue < 1 or self.max_batch < 1 or self.retries < 0 or self.timeout_s <= 0:
            raise ValueError(
                "phoenix: --phoenix-queue and --phoenix-batch must be >= 1, "
                "--phoenix-retries >= 0, "
                "--phoenix-timeout > 0"
            )
        if not self.annotation.strip() or self.annotation == "note":
            raise ValueError(
                f"phoenix annotation name {self.annotation!r}; use a non-empty "
                "name other than 'note'"
            )
        if not self.project.strip():
            raise ValueError(
                "phoenix project name is empty; use a project name (--phoenix-project)"
            )


RewardShape = Literal["final", "dense", "calibrated"]
"""What a reward answer's reward is: the final score, its change over the step before, or a pass
probability."""


@dataclass(frozen=True, slots=True)
class RewardApiSettings:
    """The reward endpoints on the metrics port: RL trainers ask for rewards over HTTP
    (docs/rl.md)."""

    reward_api: bool = field(
        default=False,
        metadata={
            "help": "serve the reward endpoints on the metrics port: POST /get_reward "
            "(OpenRLHF --remote_rm_url), "
            "/slime/reward (slime --rm-url), /v1/score; each rollout is scored as a run"
        },
    )
    shape: RewardShape = field(
        default="final",
        metadata={
            "flag": "--reward-shape",
            "help": "the reward: final (the whole rollout's score, 0-1), dense (the last "
            "step's score minus the "
            "step before's; /v1/score gives every step's), calibrated (the pass probability "
            "from ended runs' "
            "outcomes, where the family is calibrated; else the final score, said in the answer)",
        },
    )
    token: str | None = field(
        default=None,
        repr=False,  # a secret: never in a logged or printed config
        metadata={
            "flag": "--reward-token",
            "help": "require this token on every reward request, as 'Authorization: Bearer "
            "TOKEN' or in the URL's "
            "query (?token=TOKEN: the trainers send no headers, so put it in --remote_rm_url "
            "/ --rm-url); 401 "
            "without it. Prefer the environment twin. none: anyone who reaches the metrics "
            "port may spend judge calls",
        },
    )
    timeout_s: float = field(
        default=100.0,
        metadata={
            "flag": "--reward-timeout",
            "help": "seconds a reward request may take; past it the answer is 503 (both "
            "trainers retry it). Under "
            "slime's 120 s and OpenRLHF's 180 s client timeouts",
        },
    )
    max_body_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata={
            "flag": "--reward-max-body-bytes",
            "help": "largest reward request body (413 beyond it)",
        },
    )
    max_batch: int = field(
        default=256,
        metadata={
            "flag": "--reward-max-batch",
            "help": "rollouts in one /get_reward request at most (413 beyond)",
        },
    )
    max_steps: int = field(
        default=64,
        metadata={
            "flag": "--reward-max-steps",
            "help": "steps a rollout is split into at most; the ones past it are joined into "
            "the last",
        },
    )
    max_inflight: int = field(
        default=1024,
        metadata={
            "flag": "--reward-max-inflight",
            "help": "rollouts being scored at once; a request beyond it is answered 503 with "
            "Retry-After",
        },
    )
    cache: int = field(
        default=10_000,
        metadata={
            "flag": "--reward-cache",
            "help": "answers kept by the rollout's digest: a retried batch re-scores only "
            "the rollouts that failed",
        },
    )

    def __post_init__(self) -> None:
        if (
            self.timeout_s <= 0
            or self.max_body_bytes < 1024
            or self.max_batch < 1
            or self.max_steps < 1
        ):
            raise ValueError(
                "reward API: --reward-timeout must be > 0, --reward-max-body-bytes >= 1024, "
                "--reward-max-batch and "
                "--reward-max-steps >= 1"
            )
        if self.max_inflight < 1 or self.cache < 0:
            raise ValueError(
                "reward API: --reward-max-inflight must be >= 1 and --reward-cache >= 0"
            )


@dataclass(frozen=True, slots=True)
class OtlpReceiverSettings:
    """The OTLP traces receiver: agents that export OpenTelemetry spans become runs
    (docs/opentelemetry.md)."""

    address: str | None = field(
        default=None,
        metadata={
            "flag": "--otlp-receiver",
            "help": "receive OTLP/HTTP traces (POST /v1/traces, protobuf or JSON) on "
            "HOST:PORT (the conventional "
            "port is 4318); each trace becomes a run; none: off. Needs pip install -e "
            "'.[otel]' (in the agent-monitor checkout)",
        },
    )
    token: str | None = field(
        default=None,
        repr=False,  # a secret: never in a logged or printed config
        metadata={
            "flag": "--otlp-token",
            "help": "require 'Authorization: Bearer TOKEN' on every export request (401 "
            "without it); exporters send "
            "it with OTEL_EXPORTER_OTLP_HEADERS='Authorization=Bearer TOKEN'. Prefer the "
            "environment twin: a flag "
            "is visible in the process list. none: anyone who reaches the port may feed runs "
            "(and their outcomes)",
        },
    )
    idle_s: float = field(
        default=300.0,
        metadata={
            "flag": "--otlp-idle",
            "help": "seconds without a span after which a trace's run ends (outcome unknown) "
            "when its root never ends",
        },
    )
    max_body_bytes: int = field(
        default=4 * 1024 * 1024,
        metadata={
            "flag": "--otlp-max-body-bytes",
            "help": "largest request body, compressed and decompressed (413 beyond it)",
        },
    )
    max_spans_per_batch: int = field(
        default=10_000,
        metadata={
            "flag": "--otlp-max-spans-per-batch",
            "help": "spans in one request at most (413 beyond it)",
        },
    )
    max_live_traces: int = field(
        default=1_000,
        metadata={
            "flag": "--otlp-max-live-traces",
            "help": "runs fed by traces at once; spans of a new one beyond this are answered "
            "503 with Retry-After",
        },
    )
    max_spans_per_trace: int = field(
        default=2_000,
        metadata={
            "flag": "--otlp-max-spans-per-trace",
            "help": "spans remembered per run (steps and the rest); spans beyond it are "
            "rejected (partial success)",
        },
    )
    max_attribute_bytes: int = field(
        default=16 * 1024,
        metadata={
            "flag": "--otlp-max-attribute-bytes",
            "help": "bytes of one attribute value kept; longer values are cut (and counted)",
        },
    )
    max_step_chars: int = field(
        default=8_000,
        metadata={
            "flag": "--otlp-max-step-chars",
            "help": "characters of a step's text built from one span",
        },
    )
    max_connections: int = field(
        default=64,
        metadata={
            "flag": "--otlp-max-connections",
            "help": "open connections at once; more are answered 503",
        },
    )
    read_timeout_s: float = field(
        default=30.0,
        metadata={
            "flag": "--otlp-read-timeout",
            "help": "seconds a connection may wait between bytes of a request",
        },
    )
    retry_after_s: int = field(
        default=5,
        metadata={
            "flag": "--otlp-retry-after",
            "help": "the Retry-After seconds of a 429 or 503 answer",
        },
    )

    def __post_init__(self) -> None:
        if self.address is not None:
            _host, sep, port = self.address.rpartition(":")
            if not sep or not port.isdigit() or not 0 <= int(port) <= 65_535:
                raise ValueError(
                    f"otlp receiver address {self.address!r}; use HOST:PORT, e.g. 127.0.0.1:4318"
                )
        small = {
            k: getattr(self, k)
            for k in (
                "max_body_bytes",
                "max_spans_per_batch",
                "max_live_traces",
                "max_spans_per_trace",
                "max_attribute_bytes",
                "max_step_chars",
                "max_connections",
                "retry_after_s",
            )
            if getattr(self, k) < 1
        }
        if small:
            raise ValueError(f"otlp receiver limits {small} must be >= 1")
        if not (self.idle_s > 0 and self.read_timeout_s > 0):
            raise ValueError(
                f"otlp idle {self.idle_s}s and read timeout {self.read_timeout_s}s must be > 0"
            )

    @property
    def host_port(self) -> tuple[str, int]:
        """The address as (host, port); ValueError when the receiver is off."""
        if self.address is None:
            raise ValueError("the OTLP receiver is off (no address)")
        host, _, port = self.address.rpartition(":")
        return host.strip("[]") or "127.0.0.1", int(port)


@dataclass(frozen=True, slots=True)
class BoardSettings:
    """What the web board at `/` of the metrics port keeps, and how many browsers it serves."""

    no_board: bool = field(
        default=False,
        metadata={
            "help": "serve only /metrics on the metrics port: no web board at /, "
            "/events and /api/runs"
        },
    )
    max_runs: int = field(
        default=100,
        metadata={
            "flag": "--board-runs",
            "help": "runs the board keeps and shows (the most recently active); it says how "
            "many more are live",
        },
    )
    points: int = field(
        default=500,
        metadata={
            "flag": "--board-points",
            "help": "points of each run's curve the board keeps (newest)",
        },
    )
    grace_s: float = field(
        default=60.0,
        metadata={"flag": "--board-grace", "help": "seconds an ended run stays on the board"},
    )
    max_clients: int = field(
        default=16,
        metadata={
            "flag": "--board-clients",
            "help": "browsers following the board at once (/events); one more is answered "
            "503 and retries",
        },
    )
    client_queue: int = field(
        default=1000,
        metadata={
            "flag": "--board-client-queue",
            "help": "updates waiting for one browser; a browser further behind is dropped "
            "and reconnects to a "
            "fresh snapshot (scoring never waits for a browser)",
        },
    )
    keepalive_s: float = field(
        default=15.0,
        metadata={
            "flag": "--board-keepalive",
            "help": "seconds between keep-alive comments on an idle /events stream",
        },
    )

    def __post_init__(self) -> None:
        small = {
            k: v
            for k, v in (
                ("max_runs", self.max_runs),
                ("points", self.points),
                ("max_clients", self.max_clients),
                ("client_queue", self.client_queue),
            )
            if v < 1
        }
        if small:
            raise ValueError(f"board settings {small}: use 1 or more")
        if self.grace_s < 0 or not self.keepalive_s > 0:
            raise ValueError(
                f"board grace_s={self.grace_s}, keepalive_s={self.keepalive_s}: use grace >= "
                "0 and keep-alive > 0"
            )


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """The LLM API proxy (`agent-monitor proxy`, `serve --proxy-upstream`): where it listens,
    what it forwards to."""

    upstream: str | None = field(
        default=None,
        metadata={
            "flag": "--proxy-upstream",
            "help": "the LLM API the proxy forwards to, e.g. https://api.openai.com/v1 or "
            "https://api.anthropic.com; "
            "none: no proxy. Needs pip install -e '.[proxy]' (in the agent-monitor checkout)",
        },
    )
    listen: str = field(
        default="127.0.0.1:8888",
        metadata={
            "help": "HOST:PORT the proxy listens on (agents set their base URL to it; "
            "port 0: any free one)"
        },
    )
    enforce: bool = field(
        default=False,
        metadata={
            "help": "answer the next request of a run whose signal is abort with the API's "
            "own error (HTTP 409), "
            "so the agent stops; off: the proxy only watches"
        },
    )
    best_of: int = field(
        default=1,
        metadata={
            "help": "candidates per request (the API's n where it has one, else parallel "
            "requests); the judge's "
            "pivot tournament picks the one returned; 1: forward as is"
        },
    )
    max_conversations: int = field(
        default=10_000,
        metadata={
            "help": "conversations watched at once; a new one beyond this is "
            "forwarded, not watched (counted)"
        },
    )
    max_conversation_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata={
            "help": "largest request body (a conversation's whole history) the proxy reads; "
            "a larger one is "
            "forwarded, not watched (counted)"
        },
    )
    max_upstream_requests: int = field(
        default=256,
        metadata={
            "help": "watched requests in flight at once; one beyond this is forwarded, "
            "not watched (counted)"
        },
    )
    conversation_idle_s: float = field(
        default=3600.0,
        metadata={
            "flag": "--conversation-idle",
            "help": "seconds without a request before a conversation's run ends",
        },
    )
    upstream_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds the upstream may stay silent (connecting, or between two "
            "chunks of a stream)"
        },
    )
    final_grace_s: float = field(
        default=5.0,
        metadata={
            "flag": "--final-grace",
            "help": "seconds an answer without tool calls is held before it is sent as a "
            "step: a text-only agent's "
            "next request brings what its words did (a ReAct loop), sent with it; later, the "
            "step sent is amended "
            "(its text replaced by index) and scored again; 0: at once, amended when the "
            "conversation goes on",
        },
    )
    max_connections: int = field(
        default=4096,
        metadata={
            "flag": "--proxy-max-connections",
            "help": "client connections open at once; when full the longest-idle (or slowest "
            "to send its head) "
            "is closed for a new one, and a new one is refused only when every one is "
            "working (counted)",
        },
    )
    max_connections_per_peer: int = field(
        default=1024,
        metadata={
            "flag": "--proxy-max-connections-per-peer",
            "help": "client connections open at once from one address (shed and refused as "
            "--proxy-max-connections)",
        },
    )
    head_timeout_s: float = field(
        default=10.0,
        metadata={
            "flag": "--proxy-head-timeout",
            "help": "seconds a request's head (request line and headers) may take from its "
            "first byte",
        },
    )
    read_timeout_s: float = field(
        default=60.0,
        metadata={
            "flag": "--proxy-read-timeout",
            "help": "seconds each read of a request's body, and each write of its answer, "
            "may wait on the client",
        },
    )

    def __post_init__(self) -> None:
        if self.upstream is not None:
            url = urlsplit(self.upstream)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(
                    f"proxy upstream {self.upstream!r} is not an HTTP URL; use e.g. "
                    "https://api.openai.com/v1"
                )
        self.address  # noqa: B018 - raises ValueError for a listen address that is not HOST:PORT
        if self.best_of < 1 or self.max_conversations < 1 or self.max_upstream_requests < 1:
            raise ValueError(
                f"best_of={self.best_of}, max_conversations={self.max_conversations}, "
                f"max_upstream_requests={self.max_upstream_requests}: use 1 or more"
            )
        if (
            self.max_conversation_bytes < 0
            or not self.conversation_idle_s > 0
            or not self.upstream_timeout_s > 0
        ):
            raise ValueError(
                "max_conversation_bytes must be >= 0, conversation_idle_s and "
                "upstream_timeout_s > 0"
            )
        if self.max_connections < 1 or self.max_connections_per_peer < 1:
            raise ValueError(
                f"max_connections={self.max_connections}, "
                f"max_connections_per_peer={self.max_connections_per_peer}: "
                "use 1 or more"
            )
        if self.final_grace_s < 0:
            raise ValueError(f"final_grace_s={self.final_grace_s}: use 0 or more")
        if not self.head_timeout_s > 0 or not self.read_timeout_s > 0:
            raise ValueError(
                f"head_timeout_s={self.head_timeout_s}, "
                f"read_timeout_s={self.read_timeout_s}: use > 0"
            )

    @property
    def address(self) -> tuple[str, int]:
        """The listen address as (host, port); ValueError when it is not HOST:PORT."""
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(
                f"proxy listen address {self.listen!r} is not HOST:PORT; use e.g. 127.0.0.1:8888"
            )
        return host.strip("[]") or "127.0.0.1", int(port)


_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True, slots=True)
class WorkLimits:
    """The work one event may cause: rubric size on a start, judge calls per step and per run per
    minute."""

    max_criteria: int = field(
        default=MAX_CRITERIA,
        metadata={
            "help": "criteria in a start's rubric; a start with more is refused (each "
            "is a judge call per step)"
        },
    )
    max_criterion_bytes: int = field(
        default=MAX_CRITERION_BYTES,
        metadata={"help": "bytes of one criterion of a start's rubric, as JSON"},
    )
    max_rubric_bytes: int = field(
        default=MAX_RUBRIC_BYTES,
        metadata={"help": "bytes of a start's whole rubric (start.criteria), as JSON"},
    )
    max_judge_calls_per_step: int = field(
        default=MAX_JUDGE_CALLS_PER_STEP,
        metadata={
            "help": "judge calls one scoring of a run may make (judged criteria x repeats); "
            "a start over it is refused"
        },
    )
    max_judge_calls_per_run_minute: int = field(
        default=MAX_JUDGE_CALLS_PER_RUN_MINUTE,
        metadata={
            "help": "judge calls one run may make in any 60 s; past it the run waits "
            "and its steps coalesce"
        },
    )

    def __post_init__(self) -> None:
        small = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) < 1
        }
        if small:
            raise ValueError(f"work limits {small} must be >= 1")
        if self.max_judge_calls_per_run_minute < self.max_judge_calls_per_step:
            raise ValueError(
                f"max_judge_calls_per_run_minute={self.max_judge_calls_per_run_minute} is below "
                f"max_judge_calls_per_step={self.max_judge_calls_per_step}: one scoring would "
                "never fit in a minute"
            )

    @property
    def rubric(self) -> RubricBounds:
        """The bounds a start's rubric is checked against on decode."""
        return RubricBounds(self.max_criteria, self.max_criterion_bytes, self.max_rubric_bytes)


@dataclass(frozen=True, slots=True)
class MonitorConfig(ScoringOptions):
    """Everything a Monitor needs besides its judge, run store and registry: `Monitor(config,
    judge=...)`.

    The scoring settings every run's tracker gets (repeats, min_mass, criteria, frame_budget,
    extract_budget_s) are `ScoringOptions`' fields, inherited: written once, for the trackers too.
    """

    broker: BrokerSettings | None = field(
        default=None,
        metadata={
            "cli": False,
            "help": "where the MQTT broker is; None: no broker (feed events with handle())",
        },
    )
    prefix: str = field(
        default="agents", metadata={"flag": "--topic-prefix", "help": "topic prefix"}
    )
    client_id: str = field(
        default="agent-monitor",
        metadata={
            "help": "fixed MQTT client id: the broker keeps its session (and queues "
            "steps) across restarts"
        },
    )
    protocol: MqttProtocol = field(
        default="auto",
        metadata={"flag": "--mqtt-protocol", "help": "MQTT version; auto: 5, else 3.1.1"},
    )
    session_expiry_s: int = field(
        default=3600,
        metadata={"help": "seconds the broker keeps queueing steps while the monitor is down"},
    )
    broker_wait_s: float | None = field(
        default=None,
        metadata={
            "help": "seconds to wait at start-up for the broker to accept connections; none: "
            "0 for one monitor "
            "(a missing broker is said at once), 60 for a cluster replica (replicas restart "
            "with their broker)"
        },
    )
    receive_window: int = field(
        default=65_535,
        metadata={
            "help": "MQTT v5 receive maximum: unacknowledged messages the broker may send at "
            "once (a burst beyond "
            "it waits in the broker's queue, max_queued_messages; 1..65535)"
        },
    )
    max_concurrency: int = field(
        default=8,
        metadata={"help": "judge calls in flight at once, shared by all runs (scorer tasks)"},
    )
    policy: Policy = field(
        default_factory=Policy,
        metadata={
            "help": "policy defaults (a run's start.policy overrides them, same names "
            "in snake_case)"
        },
    )
    policy_given: tuple[str, ...] = field(
        default=(),
        metadata={
            "cli": False,
            "help": "policy settings chosen explicitly (serve: the policy flags given): they "
            "win over a rubric's "
            "thresholds even at their default value; settings that differ from the default "
            "always win",
        },
    )
    calibration_success_at: float = field(
        default=DEFAULT_SUCCESS_AT,
        metadata={
            "help": "a numeric end.outcome at or above this counts as a success when "
            "calibrating abort_below auto"
        },
    )
    calibration_strata: int = field(
        default=DEFAULT_STRATA,
        metadata={
            "help": "length strata of abort_below auto (1: none; 2-3 when a harness's "
            "scoring rate varies, e.g. "
            "steps coalescing under load): a run is judged against runs of its own length "
            "(docs/calibration.md)"
        },
    )
    calibration_rate: int = field(
        default=60,
        metadata={
            "help": "outcomes one calibration family learns per minute at most (outcomes "
            "come from the network); "
            "the rest teach nothing and are counted in agent_monitor_outcomes_refused_total"
        },
    )
    outcome_secret: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "shared secret: only run outcomes whose end carries auth = "
            "HMAC-SHA256(secret, run id, "
            "start.started_at, outcome) teach abort_below auto "
            "(MonitorClient(outcome_secret=...) adds it); none: "
            "anyone who may publish ends teaches. Prefer the environment variable to the "
            "flag (ps shows flags)"
        },
    )
    group_secret: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "shared secret: a start joins a group only with auth = "
            "HMAC-SHA256(secret, run id, started_at, "
            "group) (MonitorClient(group_secret=...) adds it); none: any publisher may join "
            "a group whose first "
            "run's task and rubric it shares"
        },
    )
    signature_max_age_s: float = field(
        default=7 * 86_400.0,
        metadata={
            "flag": "--signature-max-age",
            "help": "seconds a signed start stays fresh: with --outcome-secret or "
            "--group-secret, an outcome or "
            "group join whose start.started_at is older (or over 5 minutes ahead) is "
            "refused, and each "
            "(run id, started_at) is used once (a replayed signature is refused and counted)",
        },
    )
    group_policy_fixed: bool = field(
        default=False,
        metadata={
            "help": "groups use the monitor's group settings (keep_top, prune_margin, "
            "min_steps, patience, "
            "max_uncertainty, compare); a grouped start asking for others is refused. Off: a "
            "group's first run fixes "
            "them, and a later run asking for others is refused"
        },
    )
    limits: RunLimits = field(default_factory=RunLimits, metadata={"help": "runs"})
    work: WorkLimits = field(default_factory=WorkLimits, metadata={"help": "work per event"})
    metrics: MetricsSettings = field(
        default_factory=MetricsSettings, metadata={"help": "observability"}
    )
    cluster: ClusterSettings = field(default_factory=ClusterSettings, metadata={"help": "cluster"})
    otlp_receiver: OtlpReceiverSettings = field(
        default_factory=OtlpReceiverSettings, metadata={"help": "OpenTelemetry traces receiver"}
    )
    reward_api: RewardApiSettings = field(
        default_factory=RewardApiSettings,
        metadata={"help": "reward endpoints for RL trainers (docs/rl.md)"},
    )
    phoenix: PhoenixSettings = field(
        default_factory=PhoenixSettings,
        metadata={"help": "Arize Phoenix annotations (docs/phoenix.md)"},
    )
    board: BoardSettings = field(
        default_factory=BoardSettings, metadata={"help": "web board (at / of the metrics port)"}
    )
    proxy: ProxySettings = field(
        default_factory=ProxySettings,
        # Its flags are made from ProxySettings itself: `agent-monitor proxy` names the upstream
        # --upstream, serve --proxy-upstream. With an upstream the monitor opens the proxy as its
        # door `proxy`.
        metadata={
            "cli": False,
            "help": "the LLM API proxy (docs/proxy.md); off without an upstream",
        },
    )
    image_dirs: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "--allow-image-dir",
            "env": "ALLOW_IMAGE_DIRS",
            "help": 'let events name image files under this directory ({"path": ...}); '
            "repeatable; off by default",
        },
    )
    image_hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "--allow-image-host",
            "env": "ALLOW_IMAGE_HOSTS",
            "help": 'let events name image URLs on this host ({"url": ...}); repeatable; off '
            "by default",
        },
    )
    max_payload_bytes: int = field(
        default=MAX_PAYLOAD_BYTES, metadata={"help": "largest MQTT payload accepted"}
    )
    max_image_bytes: int = field(
        default=MAX_IMAGE_BYTES, metadata={"help": "largest image accepted (decoded)"}
    )
    retention_s: float = field(
        default=7 * 24 * 3600.0,
        metadata={
            "flag": "--retention",
            "help": "seconds ended runs stay in the run store (for runs / export)",
        },
    )
    rescore: bool = field(
        default=False,
        metadata={
            "help": "on start, score restored runs afresh instead of keeping their "
            "stored scores (a new judge)"
        },
    )
    heartbeat: bool = field(
        default=False,
        metadata={
            "help": "for a step the adaptive schedule does not score, publish the run's last "
            "score again on its "
            "progress topic (heartbeat: true, with age_steps and age_s): progress keeps one "
            "message per step"
        },
    )
    outbox_size: int = field(
        default=10_000,
        metadata={
            "help": "messages waiting for the broker; past it the oldest progress is dropped"
        },
    )
    sweep_interval_s: float = field(
        default=0.5,
        metadata={"help": "seconds between checks for held steps, orphans and idle runs"},
    )
    circuit_threshold: int = field(
        default=5,
        metadata={
            "help": "judge calls failed in a row before the monitor backs off (degraded); a "
            "judge that gives "
            "no answer for two of its timeouts while calls wait is degraded sooner"
        },
    )
    circuit_cooldown_s: float = field(
        default=2.0,
        metadata={
            "help": "first back-off, in seconds, before probing a failing judge (doubles to 60)"
        },
    )
    price_input: float | None = field(
        default=None,
        metadata={
            "help": "USD per million judge input tokens not served from the provider's "
            "cache; with --price-output, "
            "progress messages and the run gauges carry each run's cost; none: no cost, tokens only"
        },
    )
    price_cached_input: float | None = field(
        default=None,
        metadata={
            "help": "USD per million cached judge input tokens; none: billed as "
            "--price-input (an upper bound)"
        },
    )
    price_output: float | None = field(
        default=None,
        metadata={
            "help": "USD per million judge output tokens (needed with --price-input; 0 is fine)"
        },
    )
    progress_form: Literal["full", "compact"] = field(
        default="full",
        metadata={
            "help": "progress messages on MQTT: full (every criterion's letter distribution, "
            "numbers at full "
            "precision) or compact (no letter distributions, numbers to 4 decimals: a line a "
            "terminal can read, "
            "e.g. mosquitto_sub -v); the run store and export keep the full form either way"
        },
    )
    prompt: str | None = field(
        default=None,
        metadata={
            "flag_type": str | None,
            "help": "a progress prompt template file ({task}, {criteria}, {trajectory}, "
            "{question}, the question after "
            "the trajectory; docs/coming-from.md) laying out every run's judge prompts; "
            "checked at start-up; none: "
            "ours",
        },
    )
    otlp_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "send OpenTelemetry gen_ai.evaluation.result events for every score to "
            "this OTLP/HTTP collector "
            "(protobuf; /v1/logs is appended, as for OTEL_EXPORTER_OTLP_ENDPOINT); none: "
            "off. Needs "
            "pip install -e '.[otel]' (in the agent-monitor checkout)"
        },
    )
    # 0 here: a Monitor built in Python binds no port unless told to; `agent-monitor serve`'s
    # default is 9464.
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus /metrics port, 0 to disable"}
    )
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "address /metrics binds to"})

    def __post_init__(self) -> None:
        # (zero-argument super() fails in slotted dataclasses before 3.14)
        ScoringOptions.__post_init__(self)
        Topics(self.prefix)  # raises TopicError (a ValueError) for a prefix that is not a topic
        if self.cluster.url is not None and self.protocol == "3.1.1":
            raise ValueError(
                "cluster mode needs MQTT 5 (shared subscriptions, taking a departed "
                "replica's session over); "
                "use --mqtt-protocol 5 or auto, and a broker that speaks it (Mosquitto 2, "
                "EMQX, HiveMQ)"
            )
        if self.broker_wait_s is not None and not self.broker_wait_s >= 0:
            raise ValueError(
                f"broker_wait_s={self.broker_wait_s}; use seconds >= 0 (0: do not wait)"
            )
        if not 1 <= self.receive_window <= 65_535:
            raise ValueError(f"receive_window={self.receive_window}; MQTT allows 1..65535")
        for name in ("max_concurrency", "outbox_size", "circuit_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; use 1 or more")
        for name in ("session_expiry_s", "max_payload_bytes", "max_image_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}; use 0 or more")
        if self.sweep_interval_s <= 0 or self.circuit_cooldown_s <= 0 or self.retention_s < 0:
            raise ValueError(
                "sweep_interval_s and circuit_cooldown_s must be > 0, retention_s >= 0"
            )
        if not (
            isinstance(self.calibration_success_at, (int, float))
            and math.isfinite(self.calibration_success_at)
        ):
            raise ValueError(
                f"calibration_success_at={self.calibration_success_at!r}; use a number "
                "(outcomes at or above it "
                "are successes)"
            )
        if not 1 <= self.calibration_strata <= 8 or self.calibration_rate < 1:
            raise ValueError(
                f"calibration_strata={self.calibration_strata} (use 1..8), "
                f"calibration_rate={self.calibration_rate} "
                "(use 1 or more outcomes per family per minute)"
            )
        for name in ("outcome_secret", "group_secret"):
            secret = getattr(self, name)
            if secret is not None and len(secret) < 16:
                raise ValueError(f"{name} is shorter than 16 characters; use a long random secret")
        unknown = sorted(set(self.policy_given) - {f.name for f in dataclasses.fields(Policy)})
        if unknown:
            raise ValueError(
                f"policy_given names {unknown}, which are not policy settings; "
                "use Policy's field names"
            )
        if self.otlp_endpoint is not None:
            url = urlsplit(self.otlp_endpoint)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(
                    f"otlp_endpoint={self.otlp_endpoint!r} is not an OTLP/HTTP collector URL; use "
                    "http://host:4318 (the collector's OTLP/HTTP port; /v1/logs is appended)"
                )
        self.prices  # noqa: B018 - raises ValueError for prices that cannot be used

    @property
    def broker_wait(self) -> float:
        """Seconds to wait at start-up for the broker: `broker_wait_s`, else 60 for a cluster
        replica and 0 for one."""
        if self.broker_wait_s is not None:
            return self.broker_wait_s
        return 60.0 if self.cluster.url is not None else 0.0

    @property
    def prices(self) -> Prices | None:
        """The judge's prices the price_* fields give (None: none given, no cost); ValueError for
        unusable ones."""
        given = {
            "input": self.price_input,
            "cached_input": self.price_cached_input,
            "output": self.price_output,
        }
        if all(v is None for v in given.values()):
            return None
        if self.price_input is None or self.price_output is None:
            missing = " and ".join(f"price_{k}" for k in ("input", "output") if given[k] is None)
            raise ValueError(
                f"{missing} not given: a cost needs both price_input and price_output "
                "(--price-input, --price-output; give 0 for tokens the judge does not bill)"
            )
        for name, value in given.items():
            if value is not None and not (math.isfinite(value) and value >= 0):
                flag = "--price-" + name.replace("_", "-")
                raise ValueError(
                    f"price_{name}={value!r} ({flag}); use a finite number of "
                    "USD per million tokens >= 0"
                )
        return Prices(
            input=self.price_input, output=self.price_output, cached_input=self.price_cached_input
        )


__all__ = [
    "BoardSettings",
    "ClusterSettings",
    "MetricsSettings",
    "MonitorConfig",
    "MqttProtocol",
    "OtlpReceiverSettings",
    "PhoenixSettings",
    "Protocol",
    "ProxySettings",
    "RewardApiSettings",
    "RewardShape",
    "WorkLimits",
]
