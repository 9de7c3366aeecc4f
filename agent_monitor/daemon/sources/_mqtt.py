"""The MQTT side in one place, as aiomqtt keeps it: the link, the outbox it publishes, the sink that fills it.

The link (aiomqtt): MQTT v5 with `clean_start=False` and a session expiry, so the broker queues a run's
steps while the monitor restarts (aiomqtt's default clean start would drop them). Brokers that only speak
3.1.1 (amqtt, many edge brokers) get 3.1.1 with `clean_session=False`, which keeps the session the same
way; `protocol="auto"` tries v5 first and says which it got. The outbox is a bounded queue of messages
to publish that drops the oldest droppable one when full. `MqttSink` turns the monitor's events into
those messages. paho's v5 `Properties` get their constant tables built once (`share_property_tables`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import aiomqtt
import paho.mqtt._packet as paho_packet
import paho.mqtt.client as mqtt
import structlog
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from ...wire import BrokerSettings, Topics, signal_json
from .._config import Protocol
from .._state import (
    Delivery,
    GroupRanked,
    MonitorEvent,
    Refused,
    RunClosed,
    RunOpened,
    Scored,
    SignalChanged,
    Skipped,
)
from ..sinks import Metrics

log = structlog.get_logger("agent_monitor.mqtt")

OnBatch = Callable[[list[tuple[str, bytes, Delivery | None]]], Awaitable[list[BaseException | None]]]
"""Handles messages in order; per message None (acknowledge it) or the error that kept it from being journaled."""

BROKER_DROPPED_TOPIC = "$SYS/broker/publish/messages/dropped"
"""Mosquitto's cumulative count of messages it dropped (queues full), published every `sys_interval` (10 s)."""
_BATCH_MAX = 1_000
"""Messages handled (and journaled in one transaction) at most at once: what is waiting, up to this."""


# -- the outbox --


@dataclass(frozen=True, slots=True)
class Message:
    """One MQTT message to publish."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False
    droppable: bool = True
    """Progress and error messages may be dropped when the outbox is full; signals never are."""
    run_id: str | None = None
    """The run the message is about (the outbox's `gate` may hold it back: cluster mode's fencing)."""
    sent: Callable[[], None] | None = field(default=None, compare=False)
    """Called once the broker acknowledged the message (cluster mode: a signal known to be out is not republished)."""


@dataclass(frozen=True, slots=True)
class OutboxStatistics:
    """The outbox's messages waiting, its bound, and the messages it did not publish."""

    depth: int
    """Messages waiting to be published."""
    maxsize: int
    """The bound: beyond it, the oldest droppable message makes room."""
    dropped: int
    """Droppable messages (progress, errors) dropped for room."""
    fenced: int
    """Messages the gate held back (cluster mode: this replica may no longer publish about their run)."""


class Outbox:
    """The bounded queue of messages to publish; when full, the oldest droppable message makes room.

    Droppable and kept messages wait in two queues, each message numbered in arrival order, and leave
    in that order: finding the oldest droppable one is O(1) however many signals wait (a burst of
    evictions at --max-runs queues thousands of signal clears, and a scan past them per message was
    the ingest's cost there).
    """

    def __init__(
        self,
        maxsize: int = 10_000,
        *,
        on_dropped: Callable[[], None] | None = None,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError("outbox maxsize must be >= 1")
        self.maxsize = maxsize
        self.on_dropped = on_dropped
        """Told each message dropped for room (the dropped counter); the depth is read, `statistics()`."""
        self.on_fenced = on_fenced
        """Told each message the gate held back (cluster mode's fenced publishes)."""
        self.dropped = 0
        self.fenced = 0
        self._droppable: deque[tuple[int, Message]] = deque()
        self._kept: deque[tuple[int, Message]] = deque()
        self._next = 0
        self._first = 0
        """The number a requeued message gets: below every other, so it goes first."""
        self._ready = asyncio.Event()
        self.gate: Callable[[str], bool] | None = None
        """Cluster mode: whether this replica may still publish about a run; a message it may not is dropped."""
        self._by_run: dict[str, int] = {}
        """Messages waiting per run (those that name one): a replica handing a run over waits for them to leave."""
        self.on_run_out: Callable[[str], None] | None = None
        """Told when a run's last waiting message left (published, dropped or fenced): the scoring held for it."""

    def put(self, m: Message) -> None:
        """Queue a message (never blocks: a scorer must not wait on a slow broker)."""
        if len(self) >= self.maxsize:
            # The oldest droppable message makes room; with none queued, a droppable newcomer is the one dropped,
            # and a signal still goes in (there is at most one per run change).
            newcomer_dropped = not self._droppable and m.droppable
            if self._droppable or newcomer_dropped:
                if self._droppable:
                    self._left(self._droppable.popleft()[1])
                self.dropped += 1
                if self.on_dropped is not None:
                    self.on_dropped()
            if newcomer_dropped:
                return
        self._next += 1
        (self._droppable if m.droppable else self._kept).append((self._next, m))
        if m.run_id is not None:
            self._by_run[m.run_id] = self._by_run.get(m.run_id, 0) + 1
        self._ready.set()

    def requeue(self, m: Message) -> None:
        """Put back a message whose publication failed, first in line."""
        self._first -= 1
        (self._droppable if m.droppable else self._kept).appendleft((self._first, m))
        if m.run_id is not None:
            self._by_run[m.run_id] = self._by_run.get(m.run_id, 0) + 1
        self._ready.set()

    async def get(self) -> Message:
        """The next message, waiting for one."""
        while True:
            while not len(self):
                self._ready.clear()
                await self._ready.wait()
            m = self._pop()
            # Checked as it leaves, not as it came: a replica paused past its lease (a zombie) must not publish
            # what it queued before the pause, once another replica owns the run.
            if self._may(m):
                return m

    def get_nowait(self) -> Message | None:
        """The next message, or None (the gate applies as in `get`)."""
        while len(self):
            m = self._pop()
            if self._may(m):
                return m
        return None

    def _may(self, m: Message) -> bool:
        if m.run_id is None or self.gate is None or self.gate(m.run_id):
            return True
        self.fenced += 1
        if self.on_fenced is not None:
            self.on_fenced()
        return False

    def pending(self, run_id: str) -> int:
        """Messages about one run waiting to be published."""
        return self._by_run.get(run_id, 0)

    def _pop(self) -> Message:
        d, k = self._droppable, self._kept
        m = d.popleft()[1] if d and (not k or d[0][0] < k[0][0]) else k.popleft()[1]
        self._left(m)
        return m

    def _left(self, m: Message) -> None:
        if m.run_id is not None:
            n = self._by_run.pop(m.run_id, 1) - 1
            if n > 0:
                self._by_run[m.run_id] = n
            elif self.on_run_out is not None:
                self.on_run_out(m.run_id)

    def __len__(self) -> int:
        return len(self._droppable) + len(self._kept)

    def statistics(self) -> OutboxStatistics:
        """Messages waiting, the bound, and how many were dropped for room or held back by the gate."""
        return OutboxStatistics(depth=len(self), maxsize=self.maxsize, dropped=self.dropped, fenced=self.fenced)


# -- paho's v5 Properties with their constant tables built once --
#
# paho builds a `Properties` object for every v5 PUBLISH it decodes and every PUBACK it reports, and
# each one rebuilds two 28-entry tables (property names and types) in `__init__`. Sampled with py-spy
# in `bench/ingest.py`, that was 11% of the monitor's CPU, the largest single cost of ingesting a
# burst. The tables are never written after `__init__` (paho only reads them), so one copy serves
# every instance: paho's packet decoder and client create instances of a subclass that takes them.

_TABLES = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]


class SharedTableProperties(Properties):
    """A paho `Properties` whose name and type tables are the shared read-only ones, not built anew."""

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
    """The broker cannot be reached or refused the connection; the message says which and what to check."""


class _Redeliver(aiomqtt.MqttError):
    """Messages could not be journaled: reconnect, so that the broker delivers them again (it does only then)."""


class MqttLink:
    """One MQTT connection for the daemon: subscribe to `{prefix}/+/+`, deliver messages, publish the outbox."""

    def __init__(
        self,
        broker: BrokerSettings,
        *,
        topics: Topics,
        client_id: str = "agent-monitor",
        protocol: Protocol = "auto",
        session_expiry_s: int = 3600,
        keepalive_s: int = 30,
        connect_timeout_s: float = 10.0,
        max_backoff_s: float = 30.0,
        publish_window: int = 64,
        receive_window: int = 65_535,
        metrics: Metrics | None = None,
        share: str | None = None,
    ) -> None:
        share_property_tables()  # paho rebuilt two tables per v5 packet: 11% of ingest's CPU
        self.broker = broker
        self.topics = topics
        self.client_id = client_id
        self.protocol: Protocol = protocol
        self.session_expiry_s = session_expiry_s
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.max_backoff_s = max_backoff_s
        self.publish_window = publish_window
        self.receive_window = receive_window
        self.redeliver_delay_s = 0.5
        self.metrics = metrics
        self.share = share
        """Cluster mode: the shared subscription group ($share/{share}/...) the replicas receive through."""
        self.client: aiomqtt.Client | None = None
        """The connection being served (None between connections)."""
        self.allowed = asyncio.Event()
        """Cleared: do not connect again once the connection ends (cluster mode, cut off from Redis)."""
        self.allowed.set()
        self.connected = asyncio.Event()
        self.connections = 0
        self.negotiated: Literal["5", "3.1.1"] | None = None
        self._dups: dict[int, bool] = {}
        self._dropped_seen = 0.0
        self.on_retained: Callable[[str], None] | None = None
        """Told the topic of each message that came with the retain flag (not handled: a stored copy, see `_serve`)."""

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
            # The receive window: how many unacknowledged messages the broker may send at once. Mosquitto's
            # default for a client that names none is 20 (max_inflight_messages), and a burst beyond that and
            # max_queued_messages (1,000) is dropped after the publisher got its PUBACK. Messages in flight
            # wait in this process instead, bounded by this window.
            props.ReceiveMaximum = self.receive_window
            return aiomqtt.Client(
                b.host,
                b.port,
                protocol=aiomqtt.ProtocolVersion.V5,
                clean_start=False,
                properties=props,
                **common,  # type: ignore[arg-type]
            )
        return aiomqtt.Client(b.host, b.port, protocol=aiomqtt.ProtocolVersion.V311, clean_session=False, **common)  # type: ignore[arg-type]

    def _keep_dup(self, client: aiomqtt.Client) -> None:
        """Record paho's DUP flag by packet id: aiomqtt's messages drop it, and the run state needs it.

        DUP says the broker is delivering a message again (to a resumed persistent session), which is
        how a redelivered step without an index is recognised. Installed before connecting: the broker
        redelivers as soon as the session resumes.
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
        """Wait up to `wait_s` seconds for the broker to accept TCP connections (one that starts with the monitor)."""
        loop = asyncio.get_running_loop()
        deadline, said = loop.time() + wait_s, False
        while True:
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.broker.host, self.broker.port), max(0.1, min(2.0, wait_s))
                )
            except (OSError, TimeoutError) as e:
                left = deadline - loop.time()
                if left <= 0:
                    return  # connect() says why, in its words
                if not said:
                    said = True
                    log.warning("broker_waiting", broker=self.broker.url, error=str(e), wait_s=round(left, 1))
                await asyncio.sleep(min(0.25, left))
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return

    async def connect_within(self, wait_s: float) -> aiomqtt.Client:
        """`connect()`, tried again for up to `wait_s` seconds (a broker still starting); BrokerUnavailable after."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + wait_s, 0.25
        while True:
            try:
                return await self.connect()
            except BrokerUnavailable as e:
                left = deadline - loop.time()
                if left <= 0:
                    raise
                log.warning("broker_waiting", broker=self.broker.url, error=str(e), wait_s=round(left, 1))
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, 2.0)

    async def connect(self) -> aiomqtt.Client:
        """Open one connection (v5, or 3.1.1 where the broker refuses v5); raise BrokerUnavailable."""
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
            # Acknowledged only once handled (journaled): a crash before that makes the broker redeliver.
            client._client.manual_ack_set(True)
            # aiomqtt warns on every publish beyond 10 pending; a full window is normal here, not a problem.
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
                # Subscribed before the monitor counts as started: the broker session queues from here on.
                await self._subscribe(client, v)
            except aiomqtt.MqttError as e:
                with contextlib.suppress(Exception):
                    await client.__aexit__(None, None, None)
                last = e
                break
            log.info("broker_connected", broker=self.broker.url, protocol=v, client_id=self.client_id)
            self.negotiated = v
            return client
        raise BrokerUnavailable(_explain(self.broker, last))

    async def _subscribe(self, client: aiomqtt.Client, version: Literal["5", "3.1.1"]) -> None:
        """Subscribe to `{prefix}/+/+`, or to the three input kinds where the broker refuses that; else raise.

        The wide filter is what lets a misspelt topic (`agents/run-3/steps`) be reported as unknown_topic
        instead of never arriving. It matches the monitor's own outputs too: MQTT v5's no-local option
        keeps the broker from sending them back; on 3.1.1 they come back and `Monitor.handle` drops them.
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
            # A session kept by the broker from an older monitor still holds the three input filters, and a
            # broker sends a message once per matching subscription: each step would arrive twice.
            await client.unsubscribe(t.inputs)
            return
        log.warning(
            "subscription_narrowed",
            refused=t.subscription,
            reason=refused,
            note="misspelt topics will not be reported (unknown_topic); the broker's ACL allows only the inputs",
        )
        for f in t.inputs:
            refused = await subscribe(f)
            if refused is not None:
                await client.__aexit__(None, None, None)
                raise BrokerUnavailable(
                    f"the MQTT broker at {self.broker.url} refused the subscription to {f} ({refused}); "
                    f"check the broker's ACL: the monitor must read {t.prefix}/+/start|step|end"
                )

    def shared_filters(self) -> list[str]:
        """Cluster mode's subscriptions: the three input kinds, shared by the replicas ($share/{group}/...)."""
        return [f"$share/{self.share}/{f}" for f in self.topics.inputs]

    async def _subscribe_shared(self, client: aiomqtt.Client, version: Literal["5", "3.1.1"]) -> None:
        """Subscribe to the inputs through the cluster's shared subscription; a refusal is fatal (it says why).

        Only the inputs: a wide `{prefix}/+/+` would bring every replica's own progress back (MQTT 5 forbids
        no-local on a shared subscription), so a misspelt topic is not reported in cluster mode.
        """
        await self._watch_drops(client)
        for f in self.shared_filters():
            granted = await client.subscribe(f, qos=1)
            refused = [c for c in (granted or ()) if _code(c) >= 0x80]
            if refused:
                await client.__aexit__(None, None, None)
                raise BrokerUnavailable(
                    f"the MQTT broker at {self.broker.url} refused the shared subscription {f} ({refused[0]}); "
                    "cluster mode needs MQTT shared subscriptions (Mosquitto 2, EMQX, HiveMQ) and read access "
                    f"to {self.topics.prefix}/+/start|step|end"
                )

    async def stop_receiving(self) -> None:
        """Unsubscribe the inputs (cluster mode, leaving): the broker stops sending this replica its share."""
        client = self.client
        if client is None or self.share is None:
            return
        with contextlib.suppress(aiomqtt.MqttError, asyncio.TimeoutError):
            await asyncio.wait_for(client.unsubscribe(self.shared_filters()), 5.0)

    async def _watch_drops(self, client: aiomqtt.Client) -> None:
        """Subscribe to the broker's own drop counter where it allows it; a refusal or an error is logged, never fatal.

        Mosquitto publishes it (retained) under `$SYS`; other brokers have no such topic (nothing arrives),
        and an ACL may refuse it (granted code >= 0x80). QoS 0: it is a gauge, the next one replaces it.
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
        """Take one `$SYS` message (the broker's drop counter) into its gauge; anything unreadable is ignored."""
        if topic != BROKER_DROPPED_TOPIC or self.metrics is None:
            return
        try:
            dropped = float(payload.decode().strip())
        except (UnicodeDecodeError, ValueError):
            return
        gauge = self.metrics.broker_dropped
        if dropped > self._dropped_seen:
            log.warning("broker_dropped_messages", dropped=int(dropped), new=int(dropped - self._dropped_seen))
        self._dropped_seen = dropped
        gauge.set(dropped)

    async def run(self, on_message: OnBatch, outbox: Outbox, *, first: aiomqtt.Client | None = None) -> None:
        """Serve forever: receive inputs and publish the outbox; on a lost connection, reconnect with backoff."""
        client = first
        backoff = 0.5
        while True:
            if client is None:
                await self.allowed.wait()
                try:
                    client = await self.connect()
                except BrokerUnavailable as e:
                    delay = random.uniform(0, backoff)  # full jitter: many monitors must not reconnect in step
                    log.warning("broker_unavailable", error=str(e), retry_in_s=round(delay, 2))
                    await asyncio.sleep(delay)
                    backoff = min(backoff * 2, self.max_backoff_s)
                    continue
            backoff = 0.5
            redeliver = False
            try:
                await self._serve(client, on_message, outbox)
            except* _Redeliver as group:
                log.warning("reconnecting_for_redelivery", broker=self.broker.url, error=str(group.exceptions[0]))
                redeliver = True
            except* aiomqtt.MqttError as group:  # raised by the receive loop or the publisher task
                log.warning("broker_connection_lost", broker=self.broker.url, error=str(group.exceptions[0]))
            finally:
                self.connected.clear()
                self.client = None
                if self.metrics:
                    self.metrics.broker_connected.set(0)
                with contextlib.suppress(Exception):  # a dead connection may fail to close; it is gone either way
                    await client.__aexit__(None, None, None)
                client = None
            if redeliver:
                await asyncio.sleep(self.redeliver_delay_s)  # the store failed: give it a moment before the retry

    async def _serve(self, client: aiomqtt.Client, on_message: OnBatch, outbox: Outbox) -> None:
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
                # Group commit: what has arrived meanwhile is handled with it, journaled in one transaction,
                # and acknowledged only after that commits (never before: a crash must make the broker resend).
                messages = [first]
                while len(messages) < _BATCH_MAX and not waiting.empty():
                    messages.append(waiting.get_nowait())
                batch: list[tuple[str, bytes, Delivery | None]] = []
                # Each message to acknowledge, in arrival order (MQTT acknowledges in order), with its place in
                # `batch` (None: ignored, acknowledged as handled).
                taken: list[tuple[aiomqtt.Message, int | None]] = []
                for message in messages:
                    payload = message.payload
                    data = payload if isinstance(payload, bytes) else str(payload or "").encode()
                    topic = message.topic.value
                    if topic.startswith("$SYS/"):
                        self._broker_stat(topic, data)
                        continue
                    if message.retain and self.on_retained is not None:
                        # A broker sets the retain flag only on a stored copy it sends because a subscription was
                        # made (a live message to an existing subscription has it cleared, MQTT 3.1.1 and 5 alike):
                        # one more replay of an old input on every restart, never a new event. Acknowledged, ignored.
                        self.on_retained(topic)
                        dups.pop(message.mid, None)
                        taken.append((message, None))
                        continue
                    batch.append((topic, data, Delivery.of(message.mid, topic, data, dup=dups.pop(message.mid, False))))
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
                            "message_not_acknowledged", topic=message.topic.value, mid=message.mid, error=str(error)
                        )
                    elif message.qos > 0:
                        paho.ack(message.mid, message.qos)
                if failed:
                    # MQTT resends an unacknowledged message only on a new connection: reconnect to get them again.
                    raise _Redeliver(f"{failed} message(s) could not be journaled; reconnecting for their redelivery")

    async def _publish(self, client: aiomqtt.Client, outbox: Outbox) -> None:
        # Up to `publish_window` messages wait for their PUBACK at once: one at a time caps the outbox at
        # ~1,000 messages/s (measured), and a backlog there is latency every harness sees.
        window = asyncio.Semaphore(self.publish_window)
        async with asyncio.TaskGroup() as tg:
            while True:
                m: Message = await outbox.get()
                await window.acquire()
                # Tasks start in creation order, so the PUBLISH packets leave in the outbox's order.
                tg.create_task(self._publish_one(client, outbox, m, window), name="mqtt-publish-one")
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError  # a cancel swallowed by wait_for (Python 3.11)

    async def _publish_one(self, client: aiomqtt.Client, outbox: Outbox, m: Message, window: asyncio.Semaphore) -> None:
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
    elif "not authorized" in low or "bad user" in low or "code:5" in low or "code:134" in low or "code:135" in low:
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


# -- the sink --


def _payload(data: Mapping[str, Any]) -> bytes:
    # The JSON form has no NaN (progress.to_json maps non-finite numbers to null); compact UTF-8.
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


_COMPACT_KEYS = ("run_id", "step", "score", "delta", "uncertainty", "criteria", "ok", "error", "reason", "mass",
                 "signal", "decision", "degraded", "final", "verdict")  # fmt: skip
_REQUIRED = frozenset(("run_id", "step", "score", "ok"))
_CRITERION_KEYS = ("score", "weight", "uncertainty", "mass")


def _rounded(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def compact_form(data: Mapping[str, Any]) -> dict[str, Any]:
    """A progress message for terminals (`mosquitto_sub -v`): what a person reads, numbers to 4 decimals.

    Each criterion keeps its score, weight, uncertainty and mass (no letter distribution); the
    bookkeeping (tokens, totals, judge, latency, ...) and empty values are left out. It is still a
    progress message: `ProgressOut` reads it, with defaults for what is left out.
    """
    out: dict[str, Any] = {}
    for k in _COMPACT_KEYS:
        v = data.get(k)
        if k == "criteria":
            out[k] = {n: {f: _rounded(c.get(f)) for f in _CRITERION_KEYS} for n, c in (v or {}).items()}
        elif k == "decision" and isinstance(v, Mapping):
            out[k] = {f: _rounded(x) for f, x in v.items() if x is not None and x is not False}
        elif k in _REQUIRED or (v is not None and v is not False):
            out[k] = _rounded(v)
    return out


class MqttSink:
    """Publish progress, signals and run states (both retained; cleared when the run closes) and errors."""

    events = (Scored, Skipped, SignalChanged, Refused, RunOpened, RunClosed, GroupRanked)

    def __init__(
        self,
        outbox: Outbox,
        topics: Topics,
        *,
        on_signal_sent: Callable[[str, int], None] | None = None,
        on_progress_sent: Callable[[str, int], None] | None = None,
        compact: bool = False,
    ) -> None:
        self.outbox = outbox
        self.topics = topics
        self.compact = compact
        """Progress in the compact form (`serve --progress-form compact`): no letter distributions, rounded."""
        self.on_signal_sent = on_signal_sent
        """Told (run id, the decision's step) once a signal is out: cluster mode remembers which one is."""
        self.on_progress_sent = on_progress_sent
        """Told (run id, step) once a progress message is out: cluster mode remembers the last one."""
        self._progress_topics: dict[str, str] = {}

    def __call__(self, event: MonitorEvent) -> None:
        """Queue the messages for one event."""
        t = self.topics
        if isinstance(event, Scored):
            # One topic name per live run, built once: a run id is checked when its event is decoded.
            where = self._progress_topics.get(event.run_id)
            if where is None:
                where = self._progress_topics[event.run_id] = t.of(event.run_id, "progress")
            shown = self.on_progress_sent
            sent = None if shown is None else partial(shown, event.run_id, event.progress.step)
            data = compact_form(event.data) if self.compact else event.data
            self.outbox.put(Message(where, _payload(data), run_id=event.run_id, sent=sent))
        elif isinstance(event, Skipped):
            if event.heartbeat is not None:
                self.outbox.put(Message(t.of(event.run_id, "progress"), _payload(event.heartbeat), run_id=event.run_id))
        elif isinstance(event, SignalChanged):
            payload = _payload(signal_json(event.run_id, event.decision, event.policy))
            sent = (
                None if self.on_signal_sent is None else partial(self.on_signal_sent, event.run_id, event.decision.step)
            )
            self.outbox.put(
                Message(
                    t.of(event.run_id, "signal"), payload, retain=True, droppable=False, run_id=event.run_id, sent=sent
                )
            )
        elif isinstance(event, Refused):
            where = t.of(event.run_id, "error") if event.run_id else t.errors
            body = {"run_id": event.run_id, "topic": event.topic[:512], "reason": event.reason, "error": event.message}
            self.outbox.put(Message(where, _payload(body), run_id=event.run_id or None))
        elif isinstance(event, GroupRanked):
            # Retained, so a late subscriber sees the ranking now; an empty payload clears it.
            ranking = b"" if event.ranking is None else _payload(event.ranking)
            self.outbox.put(Message(t.ranking(event.group), ranking, retain=True, droppable=False))
        elif isinstance(event, RunOpened):
            # Retained while the run lives: a viewer subscribing later (`top`) lists it at once. The signal topic
            # stays the policy's alone (its first message is the first decision). Droppable, as progress is: in a
            # burst of starts a full outbox loses a viewer's row, never a signal; its clearing is not droppable.
            s = event.start
            state = {"run_id": event.run_id, "state": "live", "task": s.task[:200], "group": s.group,
                     "labels": dict(s.labels), "started_at": s.started_at}  # fmt: skip
            self.outbox.put(Message(t.of(event.run_id, "state"), _payload(state), retain=True, run_id=event.run_id))
        elif isinstance(event, RunClosed):
            self.outbox.put(
                Message(t.of(event.run_id, "state"), b"", retain=True, droppable=False, run_id=event.run_id)
            )
            where = self._progress_topics.pop(event.run_id, None) or t.of(event.run_id, "progress")
            if event.final is not None:
                final = compact_form(event.final) if self.compact else event.final
                self.outbox.put(Message(where, _payload(final), droppable=False, run_id=event.run_id))
            # An empty retained payload deletes the retained signal: a later subscriber sees no stale abort.
            self.outbox.put(
                Message(t.of(event.run_id, "signal"), b"", retain=True, droppable=False, run_id=event.run_id)
            )
