"""The bounds of each door's HTTP server, in one place: one frozen record, and what each door builds
it from.

Every server the daemon runs (the board and metrics port with the reward API's routes, the OTLP
receiver, the LLM proxy's listener, judge-server) is an `H11Server` built with an `HttpSettings`;
the functions below say which bounds each door takes (from its own flags where it has them). A
route's own body cap (the reward API's `--reward-max-body-bytes`) is on its `Route`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._config import OtlpReceiverSettings, ProxySettings, RewardApiSettings

__all__ = [
    "BOARD_PORT",
    "HttpSettings",
    "board_port",
    "judge_server_door",
    "otlp_door",
    "proxy_door",
]


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """One HTTP server's bounds: connections, request head and body sizes, and the deadline of every
    wait.

    None as a deadline: no deadline of its own.
    """

    max_connections: int = 64
    """Connections open at once; when full the longest-waiting one is shed, and only when all
    work is one refused."""
    max_connections_per_peer: int | None = None
    """Connections open at once from one address (None: `max_connections`)."""
    max_head_bytes: int = 8 * 1024
    """The largest request head (request line and headers); a bigger one is answered 431."""
    max_body_bytes: int = 1024 * 1024
    """The largest request body the door reads; a bigger one is answered 413."""
    head_timeout_s: float | None = 10.0
    """A new connection's first request must begin within this, and any request's head be whole
    within it."""
    read_timeout_s: float | None = 10.0
    """Each read from the client."""
    body_timeout_s: float | None = 10.0
    """A request's body (the board port: all of it; the other doors: each part of it)."""
    keepalive_s: float | None = None
    """An idle keep-alive connection's wait for its next request (None: `read_timeout_s`)."""
    write_timeout_s: float | None = 30.0
    """Each write: a client that does not read its response does not hold its connection for
    ever."""

    def __post_init__(self) -> None:
        if self.max_connections < 1 or (self.max_connections_per_peer or 1) < 1:
            raise ValueError(
                f"max_connections={self.max_connections}, "
                f"max_connections_per_peer={self.max_connections_per_peer}:"
                " use at least 1"
            )
        if self.max_head_bytes < 1024 or self.max_body_bytes < 0:
            raise ValueError(
                f"max_head_bytes={self.max_head_bytes}, max_body_bytes={self.max_body_bytes}: "
                "use >= 1024 and >= 0"
            )


BOARD_PORT = HttpSettings()
"""The board and metrics port's bounds (`serve --metrics-port`) without the reward API."""

_SOURCE_HEAD_BYTES = 16 * 1024
"""The OTLP receiver's and judge-server's request heads (an exporter's or a client's few
headers)."""
_PROXY_HEAD_BYTES = 64 * 1024
"""The proxy's request heads: an LLM client's headers (keys, tracing, vendor options) pass
through it."""
_PROXY_BODY_BYTES = 64 * 1024 * 1024
"""A proxied request body past this is refused (413): nothing an LLM API takes is larger."""
_PROXY_KEEPALIVE_S = 300.0
"""Seconds an idle keep-alive connection to the proxy stays open between two requests."""


def board_port(reward: RewardApiSettings | None = None) -> HttpSettings:
    """The board and metrics port's bounds; with the reward API, room for every trainer worker
    waiting on a reward."""
    if reward is None or not reward.reward_api:
        return BOARD_PORT
    # Every trainer worker asking for a reward holds a connection until its rollout is scored.
    return HttpSettings(max_connections=max(BOARD_PORT.max_connections, reward.max_inflight))


def otlp_door(s: OtlpReceiverSettings) -> HttpSettings:
    """The OTLP receiver's bounds, from its flags (`--otlp-max-connections`,
    `--otlp-read-timeout`, ...)."""
    return HttpSettings(
        max_connections=s.max_connections,
        max_head_bytes=_SOURCE_HEAD_BYTES,
        max_body_bytes=s.max_body_bytes,
        head_timeout_s=s.read_timeout_s,
        read_timeout_s=s.read_timeout_s,
        body_timeout_s=None,
        write_timeout_s=s.read_timeout_s,
    )


def proxy_door(s: ProxySettings) -> HttpSettings:
    """The proxy's listener's bounds, from its flags (`--proxy-max-connections`,
    `--proxy-head-timeout`, ...)."""
    return HttpSettings(
        max_connections=s.max_connections,
        max_connections_per_peer=s.max_connections_per_peer,
        max_head_bytes=_PROXY_HEAD_BYTES,
        max_body_bytes=_PROXY_BODY_BYTES,
        head_timeout_s=s.head_timeout_s,
        read_timeout_s=s.read_timeout_s,
        body_timeout_s=s.upstream_timeout_s,
        keepalive_s=_PROXY_KEEPALIVE_S,
        write_timeout_s=s.read_timeout_s,
    )


def judge_server_door(*, max_connections: int, max_body_bytes: int) -> HttpSettings:
    """judge-server's bounds: a prompt may take a minute to arrive, and a client two to send its
    next request."""
    return HttpSettings(
        max_connections=max_connections,
        max_head_bytes=_SOURCE_HEAD_BYTES,
        max_body_bytes=max_body_bytes,
        head_timeout_s=120.0,
        read_timeout_s=60.0,
        body_timeout_s=60.0,
        write_timeout_s=60.0,
    )
