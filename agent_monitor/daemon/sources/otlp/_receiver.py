"""The OTLP traces receiver: a source whose runs are traces an agent exports over OTLP/HTTP (`POST
/v1/traces`).

One task (the source's `run`) serves HTTP/1.1 through the sources' h11 server (`_h11`): the head and
the body are bounded before they are read, connections are counted, every read has a deadline. A
request's spans (protobuf or JSON, gzip or not) are decoded by `_spans` and folded into runs by
`_otlp_traces` (a run per trace or conversation, `start`, a `step` per finished action span, `end`),
handed to ingest as the wire-form events a harness would publish. Over a limit the answer is the
spec's (413, partial success, 503 with Retry-After) and a counter; nothing else is lost.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import h11
import structlog
from prometheus_client import CollectorRegistry

from ....otel import INSTALL_HINT
from ..._config import OtlpReceiverSettings
from ..._events import Sink
from ...http import H11Conn, H11Server, otlp_door
from .._protocol import RunsView, SourceInput
from ._spans import Decoded, SpanError, TooManySpans, decode_json, decode_protobuf
from ._traces import REFUSE_REASONS, OtlpMetrics, Traces

__all__ = ["REFUSE_REASONS", "OtlpReceiver"]

log = structlog.get_logger("agent_monitor.daemon.otlp")

_PATH = "/v1/traces"
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_SWEEP_S = 1.0
_LINGER_S = 2.0
_OFF_LOOP_BYTES = 64 * 1024
"""A body (as sent) from this size on is unzipped and decoded in a worker thread."""


@dataclass(slots=True)
class _Answer:
    status: int
    body: bytes
    content_type: str
    retry_after: int | None = None


@dataclass(frozen=True, slots=True)
class OtlpReceiverStatistics:
    """What the OTLP receiver took and sent on, and what it holds now."""

    requests: int
    """Export requests read whole (ones refused before their body was read are not counted)."""
    received: int
    """Spans received, rejected ones included."""
    accepted: int
    """Of those, spans taken (not rejected)."""
    decoded_off_loop: int
    """Requests large enough to be decoded in the receiver's decoding thread, off the event loop."""
    steps: int
    """Steps sent to ingest."""
    late: int
    """Of those, late steps (ending before steps already sent)."""
    live: int
    """Trace-fed runs followed now."""
    connections: int
    """Connections open now."""


class OtlpReceiver:
    """A monitor source serving OTLP/HTTP traces: `Monitor(config, judge=...,
    sources=[OtlpReceiver(settings)])`.

    `registry` takes its metrics; `clock` is monotonic seconds (idle closes, latencies). `port` is
    the bound port once `ready` is set (an address with port 0 binds a free one). `http` is its
    door, `traces` its runs.
    """

    name = "otlp"

    def __init__(
        self,
        settings: OtlpReceiverSettings,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.ready = asyncio.Event()
        self.port: int | None = None
        self.http = H11Server(
            "otlp",
            self._request,
            otlp_door(settings),
            busy=self._busy,
            failed=lambda _: log.exception("otlp_connection_failed"),
        )
        self.metrics = OtlpMetrics(
            registry, live=lambda: len(self.traces.runs), connections=lambda: self.http.connections
        )
        self.traces = Traces(settings, self.metrics, clock=clock)
        self.sink: Sink | None = self.traces.on_event
        self._stats: dict[str, int] = {
            "requests": 0,
            "received": 0,
            "accepted": 0,
            "decoded_off_loop": 0,
        }
        self._decoding = asyncio.Semaphore(1)
        self._decoder: ThreadPoolExecutor | None = None

    # -- the source protocol --

    async def open(self) -> None:
        """Bind the address (before the monitor starts, to report a taken port at once); OSError
        when it cannot."""
        if not self.http.bound:
            host, port = self.settings.host_port
            await self.http.open(host, port, start_serving=True)
            bound = self.http.sockname
            self.port = bound[1] if bound is not None else None

    def check_installed(self) -> None:
        """Raise ImportError naming the extra when the OTLP protobuf classes are not installed."""
        try:
            import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"--otlp-receiver needs the OpenTelemetry protobuf classes ({e.name} is "
                f"missing): {INSTALL_HINT}"
            ) from None

    @property
    def url(self) -> str:
        """Where exporters send spans (the traces endpoint), once bound."""
        host = self.settings.host_port[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}{_PATH}"

    async def run(self, ingest: SourceInput, runs: RunsView) -> None:
        """Serve OTLP/HTTP until cancelled, closing idle runs; raises OSError when the address
        cannot be bound."""
        self.traces.ingest, self.traces.view = ingest, runs
        await self.open()
        log.info("otlp_receiving", url=self.url)
        self.ready.set()
        try:
            # Connections are this task's too: none outlives it (a cancelled one ends quietly).
            async with self.http.serving():
                while True:
                    await asyncio.sleep(_SWEEP_S)
                    await self.sweep()
        finally:
            await self.http.close()
            decoder, self._decoder = self._decoder, None
            if decoder is not None:
                decoder.shutdown(wait=False)

    def statistics(self) -> OtlpReceiverStatistics:
        """Requests, spans received, accepted, steps sent, late steps, live runs and open
        connections."""
        t, n = self.traces, self._stats
        return OtlpReceiverStatistics(
            requests=n["requests"],
            received=n["received"],
            accepted=n["accepted"],
            decoded_off_loop=n["decoded_off_loop"],
            steps=t.steps,
            late=t.late,
            live=len(t.runs),
            connections=self.http.connections,
        )

    def span_of(self, run_id: str, step: int) -> tuple[str, str] | None:
        """The (trace id, span id) a trace-fed run's result judged, for its evaluation events;
        None for other runs."""
        return self.traces.span_of(run_id, step)

    async def take(self, decoded: Decoded) -> tuple[int, str, bool]:
        """Hand a request's spans to ingest; return (spans rejected, why, whether to answer 503
        Retry-After)."""
        return await self.traces.take(decoded)

    async def sweep(self) -> None:
        """End the runs whose spans stopped coming `idle_s` ago (their roots never ended here)."""
        await self.traces.sweep()

    # -- HTTP --

    async def _busy(self, conn: H11Conn) -> None:
        """One connection too many: its request (an answer needs one) is answered 503 with
        Retry-After."""
        self.metrics.refused.labels("unavailable").inc()
        if isinstance(await conn.next_event(), h11.Request):
            busy = self._error(
                503, "too many connections", _JSON, retry_after=self.settings.retry_after_s
            )
            await self._write(conn, busy, close=True)

    async def _request(self, conn: H11Conn, request: h11.Request) -> None:
        """Answer one request: its head checked (token, path, method, types, length) before its
        body is read."""
        limit = self.http.settings.max_body_bytes
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in request.headers}
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        reply_type = _JSON if ctype == _JSON else _PROTOBUF
        target = request.target.decode("latin-1").split("?")[0]
        answer: _Answer | None = None
        token = self.settings.token
        if token is not None and not hmac.compare_digest(
            headers.get("authorization", "").encode(), f"Bearer {token}".encode()
        ):
            self.metrics.refused.labels("unauthorized").inc()
            answer = self._error(
                401, "missing or wrong 'Authorization: Bearer' token (--otlp-token)", reply_type
            )
        elif target != _PATH:
            answer = self._error(
                404, f"no such path {target[:100]}; POST spans to {_PATH}", reply_type
            )
        elif request.method != b"POST":
            answer = self._error(405, f"use POST {_PATH}", reply_type)
        elif ctype not in (_JSON, _PROTOBUF):
            answer = self._error(
                415, f"content type {ctype!r}: use {_PROTOBUF} or {_JSON}", reply_type
            )
        elif headers.get("content-encoding", "identity").lower() not in ("gzip", "identity"):
            answer = self._error(415, "content encoding: use gzip or none", reply_type)
        length = headers.get("content-length")
        if answer is None and length is not None and length.isdigit() and int(length) > limit:
            self.metrics.refused.labels("body_too_large").inc()
            answer = self._error(
                413, f"the body is {length} bytes, over the limit of {limit}", reply_type
            )
        if answer is not None:
            # The body is not read: close once answered (the client may be sending it still).
            await self._write(conn, answer, close=True)
            return
        body = await conn.body(limit)
        if body is None:
            self.metrics.refused.labels("body_too_large").inc()
            await self._write(
                conn,
                self._error(413, f"the body is over the limit of {limit} bytes", reply_type),
                close=True,
            )
            return
        self._stats["requests"] += 1
        answer = await self._export(
            body, ctype, headers.get("content-encoding", "").lower() == "gzip"
        )
        await self._write(conn, answer)

    async def _export(self, body: bytes, ctype: str, gzipped: bool) -> _Answer:
        if len(body) < _OFF_LOOP_BYTES:
            got = self._decode(body, ctype, gzipped)
        else:
            # A large body can take long to unzip and decode (millions of tiny events fit under the
            # cap): in the receiver's one decoding thread, one at a time (each holds a decoded copy,
            # ~25x its bytes), so the loop answers /metrics meanwhile. One thread, not the default
            # pool: the memory a decode frees is reused by the next instead of held in each pool
            # thread's own malloc arena.
            async with self._decoding:
                self._stats["decoded_off_loop"] += 1
                if self._decoder is None:
                    self._decoder = ThreadPoolExecutor(1, thread_name_prefix="otlp-decode")
                loop = asyncio.get_running_loop()
                got = await loop.run_in_executor(self._decoder, self._decode, body, ctype, gzipped)
        if isinstance(got, _Answer):
            return got
        decoded = got
        s = self.settings
        for kind, n in decoded.dropped.items():
            self.metrics.dropped.labels(kind).inc(n)
        n = len(decoded.spans) + decoded.rejected
        self.metrics.received.inc(n)
        self._stats["received"] += n
        if decoded.truncated:
            self.metrics.truncated.inc(decoded.truncated)
        rejected, reason, retry = await self.take(decoded)
        self._stats["accepted"] += n - rejected
        if retry:
            return self._error(
                503,
                "the monitor cannot take these spans now; retry",
                ctype,
                retry_after=s.retry_after_s,
            )
        return _Answer(200, _success(rejected, reason, ctype), ctype)

    def _decode(self, body: bytes, ctype: str, gzipped: bool) -> Decoded | _Answer:
        """The request's spans (unzipped, decoded, every repeated field capped), or the error
        answer; thread-safe."""
        s = self.settings
        if gzipped:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                raw = d.decompress(body, s.max_body_bytes + 1)
            except zlib.error as e:
                self.metrics.refused.labels("bad_body").inc()
                return self._error(400, f"the body is not gzip ({e})", ctype)
            if len(raw) > s.max_body_bytes or d.unconsumed_tail:
                self.metrics.refused.labels("body_too_large").inc()
                return self._error(
                    413, f"the body is over {s.max_body_bytes} bytes once decompressed", ctype
                )
            body = raw
        decode = decode_json if ctype == _JSON else decode_protobuf
        try:
            return decode(
                body, max_spans=s.max_spans_per_batch, max_attribute_bytes=s.max_attribute_bytes
            )
        except TooManySpans as e:
            self.metrics.refused.labels("batch_too_large").inc(e.n)
            return self._error(
                413, f"{e.n} spans in one request, over the limit of {s.max_spans_per_batch}", ctype
            )
        except SpanError as e:
            self.metrics.refused.labels("bad_body").inc()
            return self._error(400, str(e), ctype)

    def _error(
        self, status: int, message: str, ctype: str, *, retry_after: int | None = None
    ) -> _Answer:
        # google.rpc.Code
        code = {400: 3, 401: 16, 404: 5, 405: 12, 413: 8, 415: 3, 503: 14}.get(status, 2)
        body = (
            json.dumps({"code": code, "message": message}).encode()
            if ctype == _JSON
            else _status_pb(code, message)
        )
        return _Answer(status, body, ctype, retry_after)

    async def _write(self, conn: H11Conn, answer: _Answer, *, close: bool = False) -> None:
        """Send the answer (counted by status); with `close`, say so and close lingering."""
        self.metrics.requests.labels(str(answer.status)).inc()
        headers = [(b"content-type", answer.content_type.encode())]
        if answer.retry_after is not None:
            headers.append((b"retry-after", str(answer.retry_after).encode()))
        try:
            await conn.respond(answer.status, answer.body, headers, close=close)
        except h11.LocalProtocolError:
            return
        if close:
            bounds = self.http.settings
            await conn.linger(
                bounds.max_body_bytes + bounds.max_head_bytes,
                min(self.settings.read_timeout_s, _LINGER_S),
            )


def _success(rejected: int, message: str, ctype: str) -> bytes:
    """An ExportTraceServiceResponse: empty, or with partial_success (rejected spans and why)."""
    if ctype == _JSON:
        if not rejected:
            return b"{}"
        return json.dumps(
            {"partialSuccess": {"rejectedSpans": str(rejected), "errorMessage": message}}
        ).encode()
    if not rejected:
        return b""
    inner = _varint_field(1, rejected) + _bytes_field(2, message.encode())
    return _bytes_field(1, inner)


def _status_pb(code: int, message: str) -> bytes:
    """A google.rpc.Status (code = 1, message = 2), the body of every OTLP/HTTP error answer."""
    return _varint_field(1, code) + _bytes_field(2, message.encode())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value
