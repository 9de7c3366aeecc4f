"""The MQTT door: the link to the broker (aiomqtt) that receives the runs' inputs and publishes the
outbox.

The link (aiomqtt): MQTT v5 with `clean_start=False` and a session expiry, so the broker queues a
run's steps while the monitor restarts (aiomqtt's default clean start would drop them). Brokers that
only speak 3.1.1 (amqtt, many edge brokers) get 3.1.1 with `clean_session=False`, which keeps the
session the same way; `protocol="auto"` tries v5 first and says which it got. The outbox it
publishes is the MQTT sink's (`sinks.Outbox`), read through the narrow `Publishing` protocol; the
link counts into a narrow `LinkMetrics`: this door imports no sink. paho's v5 `Properties` get their
constant tables built once (`share_property_tables`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import aiomqtt
import paho.mqtt._packet as paho_packet
import paho.mqtt.client as mqtt
import structlog
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from ...wire import BrokerSettings, Topics
from .._config import MqttProtocol
from ..stores import Delivery

log = structlog.get_logger("agent_monitor.mqtt")

OnBatch = Callable[
    [list[tuple[str, bytes, Delivery | None]]], Awaitable[list[BaseException | None]]
]
"""Handles messages in order; per message None (acknowledge it) or the error that kept it from
being journaled."""

BROKER_DROPPED_TOPIC = "$SYS/broker/publish/messages/dropped"
"""Mosquitto's cumulative count of messages it dropped (queues full), published every
`sys_interval` (10 s)."""
_BATCH_MAX = 1_000
"""Messages handled (and journaled in one transaction) at most at once: what is waiting, up to
this."""


class Outgoing(Protocol):
    """One message to publish, as the link reads it (`sinks.Message` is one)."""

    @property
    def topic(self) -> str: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def qos(self) -> int: ...
    @property
    def retain(self) -> bool: ...
    @property
    def sent(self) -> Callable[[], None] | None: ...


M = TypeVar("M", bound=Outgoing)


class Publishing(Protocol[M]):
    """The queue the link publishes (`sinks.Outbox` is one): the next message, and a failed one
    put back first."""

    async def get(self) -> M: ...
    def requeue(self, m: M, /) -> None: ...


class _Gauge(Protocol):
    def set(self, value: float) -> None: ...


class _Counter(Protocol):
    def inc(self) -> None: ...


class LinkMetrics(Protocol):
    """What the link counts: the connection, reconnections and the broker's own drop counter
    (`sinks.Metrics` is one)."""

    @property
    def broker_connected(self) -> _Gauge: ...
    @property
    def broker_reconnects(self) -> _Counter: ...
    @property
    def broker_dropped(self) -> _Gauge: ...


# -- paho's v5 Properties with their constant tables built once --
#
# paho builds a `Properties` object for every v5 PUBLISH it decodes and every PUBACK it reports, and
# each one rebuilds two 28-entry tables (property names and types) in `__init__`. Sampled with
# py-spy in `bench/ingest.py`, that was 11% of the monitor's CPU, the largest single cost of
# ingesting a burst. The tables are never written after `__init__` (paho only reads them), so one
# copy serves every instance: paho's packet decoder and client create instances of a subclass that
# takes them.

_TABLES = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]


class SharedTableProperties(Properties):
    """A paho `Properties` whose name and type tables are the shared read-only ones, not built
    anew."""

    def __init__(self, packetType: int) -> None:
        object.__setattr__(self, "packetType", packetType)
        object.__setattr__(self, "types", _TABLES.types)
        object.__setattr__(self, "names", _TABLES.names)
        object.__setattr__(self, "properties", _TABLES.properties)


def share_property_tables() -> None:
    """Have paho's decoder and client build `SharedTableProperties` (idempotent)."""
    module: Any
    for module in (paho_packet, mqtt):
        if getattr(module, "Properties", None) is Properties:
            module.Properties = SharedTableProperties


# -- the link --


class BrokerUnavailable(ConnectionError):
    """The broker cannot be reached or refused the connection; the message says which and what to
    check."""


class _Redeliver(aiomqtt.MqttError):
    """Messages could not be journaled: reconnect, so that the broker delivers them again (it
    does only then)."""


class MqttLink:
    """One MQTT connection for the daemon: subscribe to `{prefix}/+/+`, deliver messages, publish
    the outbox."""

    def __init__(
        self,
        broker: BrokerSettings,
        *,
        topics: Topics,
        client_id: str = "agent-monitor",
        protocol: MqttProtocol = "auto",
        session_expiry_s: int = 3600,
        keepalive_s: int = 30,
        connect_timeout_s: float = 10.0,
        max_backoff_s: float = 30.0,
        publish_window: int = 64,
        receive_window: int = 65_535,
        metrics: LinkMetrics | None = None,
        share: str | None = None,
    ) -> None:
        share_property_tables()  # paho rebuilt two tables per v5 packet: 11% of ingest's CPU
        self.broker = broker
        self.topics = topics
        self.client_id = client_id
        self.protocol: MqttProtocol = protocol
        self.session_expiry_s = session_expiry_s
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.max_backoff_s = max_backoff_s
        self.publish_window = publish_window
        self.receive_window = receive_window
        self.redeliver_delay_s = 0.5
        self.metrics = metrics
        self.share = share
        """Cluster mode: the shared subscription group ($share/{share}/...) the replicas receive
        through."""
        self.client: aiomqtt.Client | None = None
        """The connection being served (None between connections)."""
        self.allowed = asyncio.Event()
        """Cleared: do not connect again once the connection ends (cluster mode, cut off from
        Redis)."""
        self.allowed.set()
        self.connected = asyncio.Event()
        self.connections = 0
        self.negotiated: Literal["5", "3.1.1"] | None = None
        self._dups: dict[int, bool] = {}
        self._dropped_seen = 0.0
        self.on_retained: Callable[[str], None] | None = None
        """Told the topic of each message that came with the retain flag (not handled: a stored
        copy, see `_serve`)."""

    def _client(self, version: Literal["5", "3.1.1"]) -> aiomqtt.Client:
        b = self.broker
        common = {
            "username": b.username,
            "password": b.password,
            "identifier": self.client_id,
            "keepalive": self.keepalive_s,
            "timeout": self.connect_timeout_s,
            "tls_context": b.ssl_context(),
            # The publish window is on the wire: paho's default of 20 in flight would cap it.
            "max_inflight_messages": self.publish_window,
        }
        if version == "5":
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = self.session_expiry_s
            # The receive window: how many unacknowledged messages the broker may send at once.
            # Mosquitto's default for a client that names none is 20 (max_inflight_messages), and a
            # burst beyond that and max_queued_messages (1,000) is dropped after the publisher got
            # its PUBACK. Messages in flight wait in this process instead, bounded by this window.
            props.ReceiveMaximum = self.receive_window
            return aiomqtt.Client(
                b.host,
                b.port,
                protocol=aiomqtt.ProtocolVersion.V5,
                clean_start=False,
                properties=props,
                **common,  # type: ignore[arg-type]
            )
        return aiomqtt.Client(
            b.host,
            b.port,
            protocol=aiomqtt.ProtocolVersion.V311,
            clean_session=False,
            **common,  # type: ignore[arg-type]
        )

    def _keep_dup(self, client: aiomqtt.Client) -> None:
        """Record paho's DUP flag by packet id: aiomqtt's messages drop it, and the run state needs
        it.

        DUP says the broker is delivering a message again (to a resumed persistent session), which
        is how a redelivered step without an index is recognised. Installed before connecting: the
        broker redelivers as soon as the session resumes.
        """
        dups = self._dups = {}
        paho = client._client
        deliver = paho.on_message

        def keep_dup(c: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
            dups[msg.mid] = bool(msg.dup)
            if deliver is not None:
                deliver(c, userdata, msg)

        paho.on_message = keep_dup

    async def wait_reachable(self, wait_s: float) -> None:
        """Wait up to `wait_s` seconds for the broker to accept TCP connections (one that starts
        with the monitor)."""
        loop = asyncio.get_running_loop()
        deadline, said = loop.time() + wait_s, False
        while True:
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.broker.host, self.broker.port),
                    max(0.1, min(2.0, wait_s)),
                )
            except (OSError, TimeoutError) as e:
                left = deadline - loop.time()
                if left <= 0:
                    return  # connect() says why, in its words
                if not said:
                    said = True
                    log.warning(
                        "broker_waiting",
                        broker=self.broker.url,
                        error=str(e),
                        wait_s=round(left, 1),
                    )
                await asyncio.sleep(min(0.25, left))
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return

    async def connect_within(self, wait_s: float) -> aiomqtt.Client:
        """`connect()`, tried again for up to `wait_s` seconds (a broker still starting);
        BrokerUnavailable after."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + wait_s, 0.25
        while True:
            try:
                return await self.connect()
            except BrokerUnavailable as e:
                left = deadline - loop.time()
                if left <= 0:
                    raise
                log.warning(
                    "broker_waiting", broker=self.broker.url, error=str(e), wait_s=round(left, 1)
                )
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, 2.0)

    async def connect(self) -> aiomqtt.Client:
        """Open one connection (v5, or 3.1.1 where the broker refuses v5); raise
        BrokerUnavailable."""
        versions: list[Literal["5", "3.1.1"]]
        if self.share is not None:
            versions = ["5"]  # cluster mode: shared subscriptions and session takeover need MQTT 5
        elif self.negotiated is not None:
            versions = [self.negotiated]
        elif self.protocol == "auto":
            versions = ["5", "3.1.1"]
        else:
            versions = [self.protocol]
        last: Exception | None = None
        for v in versions:
            client = self._client(v)
            self._keep_dup(client)
            # Acknowledged only once handled (journaled): a crash before that makes the broker
            # redeliver.
            client._client.manual_ack_set(True)
            # aiomqtt warns on every publish beyond 10 pending; a full window is normal here, not a
            # problem.
            client.pending_calls_threshold = self.publish_window + 1
            try:
                await client.__aenter__()
            except aiomqtt.MqttError as e:
                last = e
                if v == "5" and _protocol_refused(e):
                    log.info("broker_refused_v5", broker=self.broker.url, error=str(e))
                    continue
                break
            try:
                # Subscribed before the monitor counts as started: the broker session queues from
                # here on.
                await self._subscribe(client, v)
            except aiomqtt.MqttError as e:
                with contextlib.suppress(Exception):
                    await client.__aexit__(None, None, None)
                last = e
                break
            log.info(
                "broker_connected", broker=self.broker.url, protocol=v, client_id=self.client_id
            )
            self.negotiated = v
            return client
        raise BrokerUnavailable(_explain(self.broker, last))

    async def _subscribe(self, client: aiomqtt.Client, version: Literal["5", "3.1.1"]) -> None:
        """Subscribe to `{prefix}/+/+`, or to the three input kinds where the broker refuses that;
        else raise.

        The wide filter is what lets a misspelt topic (`agents/run-3/steps`) be reported as
        unknown_topic instead of never arriving. It matches the monitor's own outputs too: MQTT v5's
        no-local option keeps the broker from sending them back; on 3.1.1 they come back and
        `Monitor.handle` drops them.
        """
        t = self.topics
        if self.share is not None:
            await self._subscribe_shared(client, version)
            return

        async def subscribe(f: str) -> str | None:
            if version == "5":
                granted = await client.subscribe(f, options=SubscribeOptions(qos=1, noLocal=True))
            else:
                granted = await client.subscribe(f, qos=1)
            refused = [c for c in (granted or ()) if _code(c) >= 0x80]
            return str(refused[0]) if refused else None

        await self._watch_drops(client)
        refused = await subscribe(t.subscription)
        if refused is None:
            # A session kept by the broker from an older monitor still holds the three input
            # filters, and a broker sends a message once per matching subscription: each step would
            # arrive twice.
            await client.unsubscribe(t.inputs)
            return
        log.warning(
            "subscription_narrowed",
            refused=t.subscription,
            reason=refused,
            note="misspelt topics will not be reported (unknown_topic); the broker's ACL "
            "allows only the inputs",
        )
        for f in t.inputs:
            refused = await subscribe(f)
            if refused is not None:
                await client.__aexit__(None, None, None)
                raise BrokerUnavailable(
                    f"the MQTT broker at {self.broker.url} refused the subscription to {f} "
                    f"({refused}); "
                    f"check the broker's ACL: the monitor must read {t.prefix}/+/start|step|end"
                )

    def shared_filters(self) -> list[str]:
        """Cluster mode's subscriptions: the three input kinds, shared by the replicas
        ($share/{group}/...)."""
        return [f"$share/{self.share}/{f}" for f in self.topics.inputs]

    async def _subscribe_shared(
        self, client: aiomqtt.Client, version: Literal["5", "3.1.1"]
    ) -> None:
        """Subscribe to the inputs through the cluster's shared subscription; a refusal is fatal (it
        says why).

        Only the inputs: a wide `{prefix}/+/+` would bring every replica's own progress back (MQTT 5
        forbids no-local on a shared subscription), so a misspelt topic is not reported in cluster
        mode.
        """
        await self._watch_drops(client)
        for f in self.shared_filters():
            granted = await client.subscribe(f, qos=1)
            refused = [c for c in (granted or ()) if _code(c) >= 0x80]
            if refused:
                await client.__aexit__(None, None, None)
                raise BrokerUnavailable(
                    f"the MQTT broker at {self.broker.url} refused the shared subscription "
                    f"{f} ({refused[0]}); "
                    "cluster mode needs MQTT shared subscriptions (Mosquitto 2, EMQX, "
                    "HiveMQ) and read access "
                    f"to {self.topics.prefix}/+/start|step|end"
                )

    async def stop_receiving(self) -> None:
        """Unsubscribe the inputs (cluster mode, leaving): the broker stops sending this replica
        its share."""
        client = self.client
        if client is None or self.share is None:
            return
        with contextlib.suppress(aiomqtt.MqttError, asyncio.TimeoutError):
            await asyncio.wait_for(client.unsubscribe(self.shared_filters()), 5.0)

    async def _watch_drops(self, client: aiomqtt.Client) -> None:
        """Subscribe to the broker's own drop counter where it allows it; a refusal or an error is
        logged, never fatal.

        Mosquitto publishes it (retained) under `$SYS`; other brokers have no such topic (nothing
        arrives), and an ACL may refuse it (granted code >= 0x80). QoS 0: it is a gauge, the next
        one replaces it.
        """
        try:
            granted = await client.subscribe(BROKER_DROPPED_TOPIC, qos=0)
        except aiomqtt.MqttError as e:
            log.info("broker_drops_unwatched", topic=BROKER_DROPPED_TOPIC, reason=str(e))
            return
        refused = [c for c in (granted or ()) if _code(c) >= 0x80]
        if refused:
            log.info("broker_drops_unwatched", topic=BROKER_DROPPED_TOPIC, reason=str(refused[0]))

    def _broker_stat(self, topic: str, payload: bytes) -> None:
        """Take one `$SYS` message (the broker's drop counter) into its gauge; anything
        unreadable is ignored."""
        if topic != BROKER_DROPPED_TOPIC or self.metrics is None:
            return
        try:
            dropped = float(payload.decode().strip())
        except (UnicodeDecodeError, ValueError):
            return
        gauge = self.metrics.broker_dropped
        if dropped > self._dropped_seen:
            log.warning(
                "broker_dropped_messages",
                dropped=int(dropped),
                new=int(dropped - self._dropped_seen),
            )
        self._dropped_seen = dropped
        gauge.set(dropped)

    async def run(
        self, on_message: OnBatch, outbox: Publishing[M], *, first: aiomqtt.Client | None = None
    ) -> None:
        """Serve forever: receive inputs and publish the outbox; on a lost connection, reconnect
        with backoff."""
        client = first
        backoff = 0.5
        while True:
            if client is None:
                await self.allowed.wait()
                try:
                    client = await self.connect()
                except BrokerUnavailable as e:
                    # full jitter: many monitors must not reconnect in step
                    delay = random.uniform(0, backoff)
                    log.warning("broker_unavailable", error=str(e), retry_in_s=round(delay, 2))
                    await asyncio.sleep(delay)
                    backoff = min(backoff * 2, self.max_backoff_s)
                    continue
            backoff = 0.5
            redeliver = False
            try:
                await self._serve(client, on_message, outbox)
            except* _Redeliver as group:
                log.warning(
                    "reconnecting_for_redelivery",
                    broker=self.broker.url,
                    error=str(group.exceptions[0]),
                )
                redeliver = True
            except* aiomqtt.MqttError as group:  # raised by the receive loop or the publisher task
                log.warning(
                    "broker_connection_lost", broker=self.broker.url, error=str(group.exceptions[0])
                )
            finally:
                self.connected.clear()
                self.client = None
                if self.metrics:
                    self.metrics.broker_connected.set(0)
                # a dead connection may fail to close; it is gone either way
                with contextlib.suppress(Exception):
                    await client.__aexit__(None, None, None)
                client = None
            if redeliver:
                # the store failed: give it a moment before the retry
                await asyncio.sleep(self.redeliver_delay_s)

    async def _serve(
        self, client: aiomqtt.Client, on_message: OnBatch, outbox: Publishing[M]
    ) -> None:
        self.connections += 1
        if self.metrics:
            self.metrics.broker_connected.set(1)
            if self.connections > 1:
                self.metrics.broker_reconnects.inc()
        self.connected.set()
        self.client = client
        dups = self._dups
        paho = client._client
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._publish(client, outbox), name="mqtt-publish")
            waiting = client._queue
            async for first in client.messages:
                # Group commit: what has arrived meanwhile is handled with it, journaled in one
                # transaction, and acknowledged only after that commits (never before: a crash must
                # make the broker resend).
                messages = [first]
                while len(messages) < _BATCH_MAX and not waiting.empty():
                    messages.append(waiting.get_nowait())
                batch: list[tuple[str, bytes, Delivery | None]] = []
                # Each message to acknowledge, in arrival order (MQTT acknowledges in order), with
                # its place in `batch` (None: ignored, acknowledged as handled).
                taken: list[tuple[aiomqtt.Message, int | None]] = []
                for message in messages:
                    payload = message.payload
                    data = payload if isinstance(payload, bytes) else str(payload or "").encode()
                    topic = message.topic.value
                    if topic.startswith("$SYS/"):
                        self._broker_stat(topic, data)
                        continue
                    if message.retain and self.on_retained is not None:
                        # A broker sets the retain flag only on a stored copy it sends because a
                        # subscription was made (a live message to an existing subscription has it
                        # cleared, MQTT 3.1.1 and 5 alike): one more replay of an old input on every
                        # restart, never a new event. Acknowledged, ignored.
                        self.on_retained(topic)
                        dups.pop(message.mid, None)
                        taken.append((message, None))
                        continue
                    batch.append(
                        (
                            topic,
                            data,
                            Delivery.of(message.mid, topic, data, dup=dups.pop(message.mid, False)),
                        )
                    )
                    taken.append((message, len(batch) - 1))
                errors: list[BaseException | None] = []
                if batch:
                    try:
                        errors = await on_message(batch)
                    except Exception:
                        # Not acknowledged: the broker redelivers them on the next connection.
                        log.exception("messages_not_acknowledged", messages=len(batch))
                        continue
                failed = 0
                for message, error in ((m, None if at is None else errors[at]) for m, at in taken):
                    if error is not None:
                        failed += 1
                        log.error(
                            "message_not_acknowledged",
                            topic=message.topic.value,
                            mid=message.mid,
                            error=str(error),
                        )
                    elif message.qos > 0:
                        paho.ack(message.mid, message.qos)
                if failed:
                    # MQTT resends an unacknowledged message only on a new connection: reconnect to
                    # get them again.
                    raise _Redeliver(
                        f"{failed} message(s) could not be journaled; "
                        "reconnecting for their redelivery"
                    )

    async def _publish(self, client: aiomqtt.Client, outbox: Publishing[M]) -> None:
        # Up to `publish_window` messages wait for their PUBACK at once: one at a time caps the
        # outbox at ~1,000 messages/s (measured), and a backlog there is latency every harness sees.
        window = asyncio.Semaphore(self.publish_window)
        async with asyncio.TaskGroup() as tg:
            while True:
                m = await outbox.get()
                await window.acquire()
                # Tasks start in creation order, so the PUBLISH packets leave in the outbox's order.
                tg.create_task(
                    self._publish_one(client, outbox, m, window), name="mqtt-publish-one"
                )
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError  # a cancel swallowed by wait_for (Python 3.11)

    async def _publish_one(
        self, client: aiomqtt.Client, outbox: Publishing[M], m: M, window: asyncio.Semaphore
    ) -> None:
        try:
            await client.publish(m.topic, m.payload, qos=m.qos, retain=m.retain)
        except BaseException:
            outbox.requeue(m)  # published on the next connection (a lost connection, or shutdown)
            raise
        finally:
            window.release()
        if m.sent is not None:
            try:
                m.sent()
            except Exception:
                log.exception("sent_callback_failed", topic=m.topic)


def _code(c: object) -> int:
    value = getattr(c, "value", c)
    return int(value) if isinstance(value, int) else 0


def _protocol_refused(e: aiomqtt.MqttError) -> bool:
    rc = getattr(e, "rc", None)
    value = getattr(rc, "value", rc)
    # 1: 3.1.1 "unacceptable protocol version"; 132 (0x84): v5 "Unsupported protocol version".
    return value in (1, 132) or "protocol" in str(e).lower()


def _explain(broker: BrokerSettings, e: Exception | None) -> str:
    text = str(e) if e else "no connection attempt was made"
    low = text.lower()
    if "refused" in low and ("111" in low or "errno" in low):
        hint = "is the broker running? start one (mosquitto) or pass --embedded-broker"
    elif (
        "not authorized" in low
        or "bad user" in low
        or "code:5" in low
        or "code:134" in low
        or "code:135" in low
    ):
        hint = "the broker refused the credentials: check --broker-username / --broker-password"
    elif "certificate required" in low:
        hint = "the broker wants a client certificate: pass --tls-cert and --tls-key"
    elif "timed out" in low or "timeout" in low:
        hint = "check the host, port and firewall"
    elif "ssl" in low or "certificate" in low:
        hint = "check the TLS settings (--tls-ca, or use mqtt:// for a plain broker)"
    else:
        hint = "check the broker URL"
    return f"cannot connect to the MQTT broker at {broker.url}: {text}; {hint}"
