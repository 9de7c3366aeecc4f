"""A small synchronous MQTT client for harnesses: publish a run's start, steps and end; read back
progress and signals.

    with MonitorClient("mqtt://127.0.0.1:1883") as mon:
        run = mon.start_run("run-1", task="Fix the failing test", policy={"abort_below": 0.2})
        for action, observation in agent_loop():
            run.step(f"{action}\\n{observation}", images=[png_bytes])
            if run.should_abort:
                break
        run.end("success")

Built on paho-mqtt 2 with its own network thread, MQTT 3.1.1 (works with every broker). Inputs are
validated with the wire-protocol models before anything is sent. Steps are QoS 1 and do not wait for
the broker: while the connection is down paho queues them and sends them after it reconnects.
`start_run` and `end` wait for the PUBACK.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Literal, TypeAlias

import paho.mqtt.client as mqtt
import structlog
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from pydantic import BaseModel, ValidationError

from ..calibration import outcome_mac
from ..groups import group_mac
from ..progress import Signal
from ._inputs import OUTPUT_KINDS, ImageIn, RunEnd, RunStart, StepIn, errors_topic, summarise, topic
from ._outputs import ErrorOut, ProgressOut, SignalOut
from ._settings import DEFAULT_BROKER, BrokerSettings

# What a run's client reads: every output kind but `state` (a viewer's: `top` lists live runs from
# it).
_READS = tuple(k for k in OUTPUT_KINDS if k != "state")

log = structlog.get_logger("agent_monitor.client")

ImageArg: TypeAlias = bytes | bytearray | str | ImageIn
"""An image for a step or a start: encoded bytes (PNG, JPEG, GIF, WebP), base64 / data URL text,
or an ImageIn."""
SignalName: TypeAlias = Signal
_OUTPUT_MODELS: dict[str, type[SignalOut] | type[ProgressOut] | type[ErrorOut]] = {
    "signal": SignalOut,
    "progress": ProgressOut,
    "error": ErrorOut,
}


def _validated(model: type[BaseModel], payload: dict[str, Any], kind: str) -> None:
    """Check a payload against its wire model; raise ValueError with the model's one-line
    message."""
    try:
        model.model_validate(payload)
    except ValidationError as e:
        raise ValueError(f"{kind}: {summarise(e)[1]}") from None


def _image(image: ImageArg) -> dict[str, Any]:
    """The wire form `{"data": base64, "mime": sniffed}` of one image argument; ValueError if it
    is not an image."""
    try:
        if isinstance(image, bytes | bytearray):
            img = ImageIn.from_bytes(bytes(image))
        elif isinstance(image, ImageIn):
            img = image
        else:
            # base64 or data URL text; paths get the model's own message
            img = ImageIn.model_validate(image)
    except ValidationError as e:
        raise ValueError(f"image: {summarise(e)[1]}") from None
    return {"data": img.data, "mime": img.mime}


class Run:
    """One run on the monitor: send its steps and end, read back its latest progress, signal and
    errors."""

    def __init__(
        self,
        client: MonitorClient,
        run_id: str,
        on_signal: Callable[[SignalOut], None] | None,
        on_progress: Callable[[ProgressOut], None] | None,
    ) -> None:
        self.run_id = run_id
        self.started_at: float | None = None
        """The start's `started_at` (UNIX seconds): part of the outcome's HMAC."""
        self._client = client
        self._on_signal = on_signal
        self._on_progress = on_progress
        # paho's thread writes the state below, the harness reads it
        self._cond = threading.Condition()
        # keeps steps in index order; never taken by paho's thread
        self._send_lock = threading.Lock()
        self._next_index = 1
        self._ended = False
        self._signal: SignalOut | None = None
        self._progress: ProgressOut | None = None
        self._furthest: ProgressOut | None = None  # the progress with the highest step seen
        self._errors: list[ErrorOut] = []
        # Steps sent and not yet scored (the monitor's progress acknowledges them), for `resend`
        # requests.
        self._unacked: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.resent = 0
        """Steps sent again because the monitor asked (`{prefix}/{run_id}/resend`)."""

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, next_index={self._next_index}, ended={self._ended})"

    # -- sending --

    def step(
        self,
        text: str,
        *,
        images: Iterable[ImageArg] = (),
        meta: Mapping[str, Any] | None = None,
        index: int | None = None,
    ) -> int:
        """Publish one step (QoS 1, no wait for the broker) and return its index (auto-numbered
        1, 2, ...)."""
        with self._send_lock:
            if self._ended:
                raise RuntimeError(
                    f"run {self.run_id!r} has ended; start a new run to send more steps"
                )
            idx = self._next_index if index is None else index
            payload: dict[str, Any] = {"index": idx, "text": text, "ts": time.time()}
            if imgs := [_image(i) for i in images]:
                payload["images"] = imgs
            if meta is not None:
                payload["meta"] = dict(meta)
            _validated(StepIn, payload, "step")
            self._client._publish(
                topic(self._client.prefix, self.run_id, "step"), payload, wait=False
            )
            with self._cond:
                self._unacked[idx] = payload
                while len(self._unacked) > self._client.resend_buffer:
                    # bounded: the oldest unacknowledged step cannot be re-sent
                    self._unacked.popitem(last=False)
            # An explicit index (e.g. best_step + 1 after a rollback) restarts the numbering there.
            self._next_index = idx + 1
            return idx

    def end(self, outcome: Literal["success", "failure"] | float | None = None) -> None:
        """Publish the end of the run (QoS 1) and wait for the broker's PUBACK; a second call
        does nothing."""
        with self._send_lock:
            if self._ended:
                return
            payload: dict[str, Any] = {} if outcome is None else {"outcome": outcome}
            secret = self._client._outcome_secret
            if secret is not None and outcome is not None:
                payload["auth"] = outcome_mac(secret, self.run_id, self.started_at, outcome)
            _validated(RunEnd, payload, "end")
            self._ended = True
            try:
                self._client._publish(
                    topic(self._client.prefix, self.run_id, "end"), payload, wait=True
                )
            finally:
                self._client._forget(self)

    # -- state (written by paho's network thread) --

    @property
    def ended(self) -> bool:
        """Whether `end` was called."""
        return self._ended

    @property
    def signal(self) -> SignalOut | None:
        """The latest signal from the monitor, or None (none yet, or cleared)."""
        with self._cond:
            return self._signal

    @property
    def should_abort(self) -> bool:
        """Whether the monitor's latest signal says to abort the run."""
        s = self.signal
        return s is not None and s.signal == "abort"

    @property
    def pruned(self) -> bool:
        """Whether the latest signal is a prune: an abort because the run's group siblings are
        far ahead."""
        s = self.signal
        return s is not None and s.signal == "abort" and s.pruned

    @property
    def should_resample(self) -> bool:
        """Whether the monitor's latest signal says to roll back to `best_step` and resample."""
        s = self.signal
        return s is not None and s.signal == "resample"

    @property
    def is_done(self) -> bool:
        """Whether the latest signal says `done`: the score held above the threshold failing runs
        rarely pass."""
        s = self.signal
        return s is not None and s.signal == "done"

    @property
    def best_step(self) -> int | None:
        """The step where progress peaked, per the latest signal (roll back there), or None."""
        s = self.signal
        return None if s is None else s.best_step

    @property
    def progress(self) -> ProgressOut | None:
        """The latest progress message received, or None."""
        with self._cond:
            return self._progress

    @property
    def errors(self) -> list[ErrorOut]:
        """The errors the monitor reported for this run's events, oldest first (a copy)."""
        with self._cond:
            return list(self._errors)

    def wait_progress(self, step: int, timeout: float = 30.0) -> ProgressOut:
        """Block until a progress message for step >= `step` has arrived and return it;
        TimeoutError otherwise."""
        self._client._check_not_network_thread("wait_progress")
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._furthest is not None and self._furthest.step >= step, timeout
            ):
                raise TimeoutError(
                    f"no progress for step {step} of run {self.run_id!r} within {timeout}s"
                )
            assert self._furthest is not None
            return self._furthest

    def wait_signal(self, signal: SignalName | None = None, timeout: float = 30.0) -> SignalOut:
        """Block until the latest signal is `signal` (any signal when None) and return it;
        TimeoutError otherwise."""
        self._client._check_not_network_thread("wait_signal")

        def ready() -> bool:
            return self._signal is not None and (signal is None or self._signal.signal == signal)

        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                raise TimeoutError(
                    f"no {signal or 'any'} signal for run {self.run_id!r} within {timeout}s"
                )
            assert self._signal is not None
            return self._signal

    def _resend(self, payload: bytes) -> None:
        """The monitor asks for the steps from index N again (a gap it cannot fill): re-publish
        the buffered ones."""
        try:
            first = json.loads(payload)["from"]
            if isinstance(first, bool) or not isinstance(first, int):
                raise TypeError(first)
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed resend request", run_id=self.run_id)
            return
        with self._cond:
            again = [p for i, p in self._unacked.items() if i >= first]
        for p in again:  # QoS 1 from paho's thread: queued, never waited for here
            self._client._publish(topic(self._client.prefix, self.run_id, "step"), p, wait=False)
        self.resent += len(again)

    def _deliver(self, kind: str, payload: bytes) -> None:
        """Take one message from the run's output topics (paho's thread); malformed ones are
        logged and dropped."""
        if kind == "resend":
            self._resend(payload)
            return
        if kind == "signal" and not payload.strip():
            with self._cond:  # an empty retained payload: the monitor cleared the signal
                self._signal = None
                self._cond.notify_all()
            return
        model = _OUTPUT_MODELS.get(kind)
        if model is None:
            return
        try:
            msg = model.model_validate_json(payload)
        except ValidationError as e:
            log.warning(
                "ignoring malformed message", run_id=self.run_id, kind=kind, error=summarise(e)[1]
            )
            return
        if getattr(msg, "run_id", self.run_id) not in (self.run_id, None):
            log.warning("ignoring message for another run", run_id=self.run_id, kind=kind)
            return
        with self._cond:
            if isinstance(msg, SignalOut):
                self._signal = msg
            elif isinstance(msg, ProgressOut):
                # scored: the monitor has them
                for i in [i for i in self._unacked if i <= msg.step]:
                    del self._unacked[i]
                self._progress = msg
                if self._furthest is None or msg.step >= self._furthest.step:
                    self._furthest = msg
            elif isinstance(msg, ErrorOut):
                self._errors.append(msg)
            self._cond.notify_all()
        if isinstance(msg, ErrorOut):
            log.warning(
                "monitor refused an event", run_id=self.run_id, reason=msg.reason, error=msg.error
            )
        elif isinstance(msg, SignalOut) and self._on_signal is not None:
            self._call(self._on_signal, msg)
        elif isinstance(msg, ProgressOut) and self._on_progress is not None:
            self._call(self._on_progress, msg)

    def _call(self, callback: Callable[[Any], None], msg: BaseModel) -> None:
        try:
            callback(msg)
        # a harness callback bug must not stop paho's thread (it would stop all delivery)
        except Exception:
            log.exception(
                "run callback failed",
                run_id=self.run_id,
                callback=getattr(callback, "__name__", "?"),
            )


class MonitorClient:
    """A connection to the broker that starts runs and carries their events; a context manager."""

    def __init__(
        self,
        broker_url: str = DEFAULT_BROKER,
        *,
        prefix: str = "agents",
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        connect_timeout: float = 10.0,
        ack_timeout: float = 10.0,
        outcome_secret: str | None = None,
        group_secret: str | None = None,
        resend_buffer: int = 1000,
    ) -> None:
        settings = BrokerSettings.from_url(
            broker_url,
            username=username,
            password=password,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
        )
        # raises TopicError (a ValueError) for a bad prefix, before any connection
        errors_topic(prefix)
        self.prefix = prefix
        self.url = settings.url
        self.ack_timeout = ack_timeout
        # The monitor's --outcome-secret: each end's outcome is signed with it (never sent, never
        # logged).
        self._outcome_secret = outcome_secret
        self._group_secret = group_secret  # likewise for joining groups (--group-secret)
        if resend_buffer < 0:
            raise ValueError(
                f"resend_buffer={resend_buffer}; use 0 (none) or more steps kept per run"
            )
        self.resend_buffer = resend_buffer
        """Unscored steps kept per run to answer the monitor's resend requests (the oldest go
        first)."""
        self._cond = threading.Condition()
        self._runs: dict[str, Run] = {}
        self._sub_acks: dict[int, list[ReasonCode]] = {}
        # SUBACKs nobody waits for (resubscriptions, timed-out waits)
        self._ignored_subs: set[int] = set()
        self._pending: list[mqtt.MQTTMessageInfo] = []  # un-acknowledged steps, flushed by close()
        self._prune_at = 64
        self._connected = False
        self._generation = 0  # successful CONNACKs so far
        self._refused: str | None = None
        self._closed = False
        self._net_thread: int | None = None
        c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"agent-monitor-client-{uuid.uuid4().hex[:12]}",
            protocol=MQTTProtocolVersion.MQTTv311,
            clean_session=True,
        )
        if settings.username is not None:
            c.username_pw_set(settings.username, settings.password)
        if (ctx := settings.ssl_context()) is not None:
            c.tls_set_context(ctx)
        c.reconnect_delay_set(min_delay=1, max_delay=30)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_subscribe = self._on_subscribe
        c.on_message = self._on_message
        # a bug in a callback must not end the network thread (our callbacks also log)
        c.suppress_exceptions = True
        self._client = c
        self._connect(settings, connect_timeout)

    def __enter__(self) -> MonitorClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MonitorClient({self.url!r}, prefix={self.prefix!r}, connected={self.connected})"

    @property
    def connected(self) -> bool:
        """Whether the client is connected right now (it reconnects by itself after a drop)."""
        with self._cond:
            return self._connected

    def _connect(self, settings: BrokerSettings, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._client.connect_timeout = timeout
        try:
            self._client.connect(settings.host, settings.port, keepalive=30)
        except OSError as e:
            raise ConnectionError(f"cannot connect to the MQTT broker at {self.url}: {e}") from e
        self._client.loop_start()
        with self._cond:
            self._cond.wait_for(
                lambda: self._connected or self._refused is not None,
                max(0.0, deadline - time.monotonic()),
            )
            connected, refused = self._connected, self._refused
        if not connected:
            self._client.disconnect()
            self._client.loop_stop()
            why = (
                f"refused the connection: {refused}"
                if refused
                else (f"did not answer (no CONNACK) within {timeout}s")
            )
            raise ConnectionError(f"the MQTT broker at {self.url} {why}")

    def start_run(
        self,
        run_id: str,
        *,
        task: str,
        criteria: str | dict[str, Any] | list[Any] | None = None,
        images: Iterable[ImageArg] = (),
        policy: Mapping[str, bool | float | int | str | None] | None = None,
        labels: Mapping[str, str] | None = None,
        family: str | None = None,
        on_signal: Callable[[SignalOut], None] | None = None,
        on_progress: Callable[[ProgressOut], None] | None = None,
        group: str | None = None,
    ) -> Run:
        """Subscribe to the run's outputs, publish its start (QoS 1) and wait for the PUBACK; return
        the Run.

        `group` makes the run a sibling of the runs started with the same group (best of N): ranked
        together on `{prefix}/_groups/{group}/ranking`, and pruned (an abort with `pruned` set) when
        far behind them.
        """
        # raises TopicError for a bad run id
        filters = [topic(self.prefix, run_id, k) for k in _READS]
        started_at = round(time.time(), 3)
        payload: dict[str, Any] = {"task": task, "started_at": started_at}
        optional = {
            "criteria": criteria,
            "policy": policy,
            "labels": labels,
            "family": family,
            "group": group,
        }
        payload |= {
            k: dict(v) if isinstance(v, Mapping) else v
            for k, v in optional.items()
            if v is not None
        }
        if imgs := [_image(i) for i in images]:
            payload["images"] = imgs
        if group is not None and self._group_secret is not None:
            payload["auth"] = group_mac(self._group_secret, run_id, started_at, group)
        _validated(RunStart, payload, "start")
        run = Run(self, run_id, on_signal, on_progress)
        run.started_at = started_at
        with self._cond:
            if self._closed:
                raise RuntimeError("the MonitorClient is closed")
            if run_id in self._runs:
                raise ValueError(
                    f"run {run_id!r} is already active on this client; end it "
                    "first or use another id"
                )
            self._runs[run_id] = run  # from here on, reconnects resubscribe it
            generation = self._generation
        try:
            self._subscribe(filters, generation)
            self._publish(topic(self.prefix, run_id, "start"), payload, wait=True)
        except BaseException:
            self._forget(run)
            raise
        return run

    def close(self) -> None:
        """Wait (up to ack_timeout) for unacknowledged steps, then disconnect; runs not ended
        stay open."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, open_runs = list(self._pending), list(self._runs)
        deadline = time.monotonic() + self.ack_timeout
        for info in pending:
            info.wait_for_publish(max(0.01, deadline - time.monotonic()))
        if lost := sum(not i.is_published() for i in pending):
            log.warning("closing with unacknowledged steps", count=lost, broker=self.url)
        if open_runs:
            log.info("closing with runs not ended", runs=open_runs)
        self._client.disconnect()
        self._client.loop_stop()

    # -- internals --

    def _publish(self, topic_: str, payload: dict[str, Any], *, wait: bool) -> None:
        if self._closed:  # paho would queue it forever without a network thread
            raise RuntimeError("the MonitorClient is closed")
        data = json.dumps(
            payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()
        info = self._client.publish(topic_, data, qos=1)
        if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
            # paho keeps QoS 1 messages published while disconnected and sends them after
            # reconnecting, but leaves rc at NO_CONN, so wait_for_publish / is_published would raise
            # although it is queued.
            info.rc = MQTTErrorCode.MQTT_ERR_SUCCESS
        elif info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise ConnectionError(
                f"cannot publish to {topic_} at {self.url}: {mqtt.error_string(info.rc)}"
            )
        if not wait:
            with self._cond:
                self._pending.append(info)
                # doubling keeps pruning cheap while the broker is away
                if len(self._pending) >= self._prune_at:
                    self._pending = [i for i in self._pending if not i.is_published()]
                    self._prune_at = max(64, 2 * len(self._pending))
            return
        if self._in_network_thread():
            return  # waiting in a paho callback would block the thread that reads the PUBACK
        info.wait_for_publish(self.ack_timeout)
        if not info.is_published():
            raise TimeoutError(
                f"no PUBACK for {topic_} from {self.url} within {self.ack_timeout}s; it stays "
                "queued until reconnect"
            )

    def _subscribe(self, filters: list[str], generation: int) -> None:
        rc, mid = self._client.subscribe([(f, 1) for f in filters])
        if rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
            return  # on_connect subscribes every active run, before paho re-sends the queued start
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise ConnectionError(
                f"cannot subscribe to {filters[0]} at {self.url}: {mqtt.error_string(rc)}"
            )
        if self._in_network_thread():  # in a callback: the SUBACK cannot be read before it returns
            with self._cond:
                self._ignored_subs.add(mid)
            return
        with self._cond:
            # A reconnect in between also counts: on_connect resubscribed this run on the new
            # connection.
            ok = self._cond.wait_for(
                lambda: mid in self._sub_acks or self._generation != generation, self.ack_timeout
            )
            codes = self._sub_acks.pop(mid, [])
            if not ok:
                self._ignored_subs.add(mid)
        if not ok:
            raise TimeoutError(
                f"no SUBACK for {filters[0]} from {self.url} within {self.ack_timeout}s"
            )
        if any(c.is_failure for c in codes):
            raise PermissionError(
                f"the broker at {self.url} refused the subscription to {', '.join(filters)}"
            )

    def _forget(self, run: Run) -> None:
        with self._cond:
            if self._runs.get(run.run_id) is not run:
                return
            del self._runs[run.run_id]
            closed = self._closed
        # best effort: a failed unsubscribe only costs a few late messages, which are dropped
        if not closed:
            self._client.unsubscribe([topic(self.prefix, run.run_id, k) for k in _READS])

    def _in_network_thread(self) -> bool:
        return threading.get_ident() == self._net_thread

    def _check_not_network_thread(self, what: str) -> None:
        if self._in_network_thread():
            raise RuntimeError(
                f"{what} cannot be called from an on_signal/on_progress "
                "callback (it would deadlock)"
            )

    # -- paho callbacks (network thread) --

    def _on_connect(
        self,
        client: mqtt.Client,
        _: Any,
        flags: mqtt.ConnectFlags,
        reason: ReasonCode,
        props: Properties | None,
    ) -> None:
        self._net_thread = threading.get_ident()
        if reason.is_failure:
            log.warning("broker refused the connection", broker=self.url, reason=str(reason))
            with self._cond:
                self._refused = str(reason)
                self._cond.notify_all()
            return
        with self._cond:
            self._connected, self._refused = True, None
            self._generation += 1
            # SUBACKs of the old connection will never come.
            self._sub_acks.clear()
            self._ignored_subs.clear()
            runs = list(self._runs.values())
            self._cond.notify_all()
        if self._generation > 1:
            log.info("reconnected to the broker", broker=self.url, runs=len(runs))
        if runs:
            # clean_session: the broker forgot our subscriptions. Queued publishes are re-sent after
            # this callback returns, so the subscriptions precede them on the wire. Their SUBACK
            # cannot be read before this callback returns either (same thread), so registering the
            # mid afterwards is safe.
            rc, mid = client.subscribe(
                [(topic(self.prefix, r.run_id, k), 1) for r in runs for k in _READS]
            )
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and mid is not None:
                with self._cond:
                    self._ignored_subs.add(mid)

    def _on_disconnect(
        self,
        _c: mqtt.Client,
        _: Any,
        flags: mqtt.DisconnectFlags,
        reason: ReasonCode,
        props: Properties | None,
    ) -> None:
        with self._cond:
            self._connected = False
            closing = self._closed
            self._cond.notify_all()
        if not closing:
            log.warning(
                "lost the broker connection; reconnecting", broker=self.url, reason=str(reason)
            )

    def _on_subscribe(
        self, _c: mqtt.Client, _: Any, mid: int, codes: list[ReasonCode], props: Properties | None
    ) -> None:
        with self._cond:
            if mid in self._ignored_subs:
                self._ignored_subs.discard(mid)
                if any(c.is_failure for c in codes):
                    log.warning("broker refused a resubscription", broker=self.url)
            else:
                self._sub_acks[mid] = list(codes)
                self._cond.notify_all()

    def _on_message(self, _c: mqtt.Client, _: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            rest = msg.topic.removeprefix(self.prefix + "/")  # may raise UnicodeDecodeError
            run_id, _sep, kind = rest.partition("/")
            with self._cond:
                run = self._runs.get(run_id)
            if run is not None:  # otherwise a late message for an ended run
                run._deliver(kind, bytes(msg.payload))
        except Exception:  # never let one bad message stop paho's thread
            log.exception("failed to handle a message", mid=msg.mid)
