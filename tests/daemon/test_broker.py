"""The embedded amqtt broker with real clients: aiomqtt, paho-mqtt and the
mosquitto_pub/mosquitto_sub binaries."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiomqtt
import aiomqtt.exceptions
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from agent_monitor.daemon._broker import BrokerStartError, EmbeddedBroker, _broker_class
from tests.brokers import free_port

pytestmark = pytest.mark.timeout(30)

needs_mosquitto_clients = pytest.mark.skipif(
    shutil.which("mosquitto_sub") is None or shutil.which("mosquitto_pub") is None,
    reason="mosquitto_pub/mosquitto_sub are not installed (apt-get install mosquitto-clients)",
)


@pytest.fixture
async def embedded() -> AsyncIterator[EmbeddedBroker]:
    """A running embedded broker on a free port."""
    async with EmbeddedBroker(port=free_port()) as b:
        yield b


def client(port: int, **kwargs: Any) -> aiomqtt.Client:
    """An aiomqtt MQTT 3.1.1 client for the broker on 127.0.0.1:port."""
    return aiomqtt.Client(
        "127.0.0.1", port, protocol=aiomqtt.ProtocolVersion.V311, timeout=5, **kwargs
    )


async def receive(c: aiomqtt.Client, n: int, within: float = 3.0) -> list[aiomqtt.Message]:
    """The next n messages the client gets (TimeoutError if they do not all arrive in time)."""
    got: list[aiomqtt.Message] = []
    async with asyncio.timeout(within):
        async for m in c.messages:
            got.append(m)
            if len(got) == n:
                break
    return got


async def run(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run a command in a thread (so the broker on this event loop keeps serving it), killed
    after 10 s."""
    return await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=10, check=False
    )


async def mosquitto_pub(port: int, topic: str, *args: str) -> None:
    """Publish with the mosquitto_pub binary over MQTT 3.1.1 and require success."""
    p = await run("mosquitto_pub", "-p", str(port), "-V", "mqttv311", "-t", topic, *args)
    assert p.returncode == 0, p.stderr


class Paho:
    """A paho-mqtt sync client on its own network thread; the test awaits its events from a
    worker thread."""

    def __init__(
        self,
        port: int,
        client_id: str,
        protocol: MQTTProtocolVersion = MQTTProtocolVersion.MQTTv311,
    ) -> None:
        self.port = port
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol)
        self.connack = threading.Event()
        self.reason: Any = None
        self.c.on_connect = self._on_connect

    def _on_connect(self, _c: mqtt.Client, _u: Any, _flags: Any, reason: Any, _props: Any) -> None:
        self.reason = reason
        self.connack.set()

    async def connect(self) -> Any:
        """Connect, wait for the CONNACK and return its reason code."""
        await asyncio.to_thread(self.c.connect, "127.0.0.1", self.port)
        self.c.loop_start()
        assert await asyncio.to_thread(self.connack.wait, 5), "no CONNACK within 5 s"
        return self.reason

    async def close(self) -> None:
        """Disconnect and stop the network thread."""
        self.c.disconnect()
        await asyncio.to_thread(self.c.loop_stop)


@needs_mosquitto_clients
async def test_qos1_publish_subscribe(embedded: EmbeddedBroker) -> None:
    """QoS 1 messages from aiomqtt, paho and mosquitto_pub reach a QoS 1 subscriber at QoS 1."""
    port = embedded.port
    assert embedded.url == f"mqtt://127.0.0.1:{port}"
    async with client(port, identifier="sub") as sub, client(port) as pub:
        await sub.subscribe("agent/+/step", qos=1)
        await pub.publish("agent/r1/step", b"from-aiomqtt", qos=1)
        paho = Paho(port, "paho-pub")
        assert await paho.connect() == 0
        info = paho.c.publish("agent/r1/step", b"from-paho", qos=1)
        # returns once the broker's PUBACK arrived
        await asyncio.to_thread(info.wait_for_publish, 5)
        assert info.is_published()
        await paho.close()
        await mosquitto_pub(port, "agent/r1/step", "-q", "1", "-m", "from-mosquitto")
        got = await receive(sub, 3)
    # Sorted: MQTT orders messages per publisher, not across the three clients.
    assert sorted(m.payload for m in got) == [b"from-aiomqtt", b"from-mosquitto", b"from-paho"]
    assert all(m.qos == 1 and str(m.topic) == "agent/r1/step" for m in got)


@needs_mosquitto_clients
async def test_retained_message_and_clearing_it(embedded: EmbeddedBroker) -> None:
    """A retained message reaches later subscribers; an empty retained payload reaches current
    ones and deletes it."""
    port = embedded.port
    await mosquitto_pub(port, "agent/r1/signal", "-q", "1", "-r", "-m", "abort")
    p = await run(
        "mosquitto_sub",
        "-p",
        str(port),
        "-V",
        "mqttv311",
        "-t",
        "agent/+/signal",
        "-v",
        "-C",
        "1",
        "-W",
        "4",
    )
    assert p.stdout.splitlines() == ["agent/r1/signal abort"], p.stderr

    async with client(port) as watcher:
        await watcher.subscribe("agent/+/signal", qos=1)
        [m] = await receive(watcher, 1)
        assert (str(m.topic), m.payload, m.retain) == ("agent/r1/signal", b"abort", True)
        # What the monitor does at run end: an empty retained payload on the run's signal topic.
        await watcher.publish("agent/r1/signal", b"", qos=1, retain=True)
        [cleared] = await receive(watcher, 1)
        assert (str(cleared.topic), cleared.payload) == ("agent/r1/signal", b"")

    # A new subscriber gets retained messages right after its SUBACK, before anything published
    # later, so everything before its own marker message is what the broker still retains.
    async with client(port) as late:
        await late.subscribe("agent/+/signal", qos=1)
        await late.publish("agent/marker/signal", b"marker", qos=1)
        topics: list[str] = []
        while "agent/marker/signal" not in topics:
            [m] = await receive(late, 1)
            topics.append(str(m.topic))
    assert topics == ["agent/marker/signal"]


async def test_clients_get_retained_messages_only_for_their_own_subscriptions(
    embedded: EmbeddedBroker,
) -> None:
    """A client connecting while others subscribe to a retained topic is not sent it (amqtt
    0.12.1 would)."""
    port = embedded.port
    async with client(port, identifier="harness") as harness:
        await harness.subscribe("agent/r1/signal", qos=1)
        await harness.publish("agent/r1/signal", b"abort", qos=1, retain=True)
        [m] = await receive(harness, 1)
        assert m.payload == b"abort"
        # amqtt sends retained-on-connect messages before it reads the new client's first packet, so
        # if the marker is the first message the client gets, nothing unsolicited came before it.
        async with client(port, identifier="monitor", clean_session=False) as monitor:
            await monitor.subscribe("agent/+/step", qos=1)
            await monitor.publish("agent/r1/step", b"marker", qos=1)
            [first] = await receive(monitor, 1)
            assert (str(first.topic), first.payload) == ("agent/r1/step", b"marker")


async def test_persistent_session_gets_messages_published_while_away(
    embedded: EmbeddedBroker,
) -> None:
    """A clean_session=False subscriber gets, on reconnecting, the QoS 1 messages published while
    it was away."""
    port = embedded.port
    async with client(port, identifier="monitor", clean_session=False) as mon:
        await mon.subscribe("agent/+/step", qos=1)
    async with client(port) as pub:
        for i in range(3):
            await pub.publish(f"agent/r{i}/step", f"step-{i}".encode(), qos=1)
    async with client(port, identifier="monitor", clean_session=False) as mon:
        got = await receive(mon, 3)  # no new SUBSCRIBE: the session kept it
    assert [m.payload for m in got] == [b"step-0", b"step-1", b"step-2"]  # one publisher: in order
    assert all(m.qos == 1 for m in got)


@needs_mosquitto_clients
async def test_persistent_session_with_mosquitto_sub(embedded: EmbeddedBroker) -> None:
    """mosquitto_sub -c: subscribe and leave, messages get published, the same client id picks
    them up."""
    port = embedded.port
    sub = (
        "mosquitto_sub",
        "-p",
        str(port),
        "-V",
        "mqttv311",
        "-c",
        "-i",
        "harness-sub",
        "-q",
        "1",
        "-t",
        "agent/#",
    )
    p = await run(*sub, "-E")  # exits once the broker acknowledged the subscription
    assert p.returncode == 0, p.stderr
    for i in range(2):
        await mosquitto_pub(port, f"agent/r1/progress/{i}", "-q", "1", "-m", f"p{i}")
    p = await run(*sub, "-v", "-C", "2", "-W", "4")
    assert sorted(p.stdout.splitlines()) == ["agent/r1/progress/0 p0", "agent/r1/progress/1 p1"], (
        p.stderr
    )


async def test_mqtt5_connect_is_refused(embedded: EmbeddedBroker) -> None:
    """amqtt speaks only 3.1.1: v5 clients get "unsupported protocol version" and 3.1.1 clients
    still connect."""
    port = embedded.port
    with pytest.raises(aiomqtt.exceptions.MqttConnectError) as refused:
        async with aiomqtt.Client(
            "127.0.0.1", port, protocol=aiomqtt.ProtocolVersion.V5, timeout=5
        ):
            pass
    # What the daemon's 3.1.1 fallback keys on: an MqttCodeError whose rc is paho's ReasonCode 132.
    assert isinstance(refused.value, aiomqtt.MqttCodeError)
    assert refused.value.rc == 132
    assert str(refused.value) == "[code:132] Unsupported protocol version"

    paho = Paho(port, "paho-v5", protocol=MQTTProtocolVersion.MQTTv5)
    reason = await paho.connect()
    await paho.close()
    assert (
        reason.is_failure
        and reason.value == 132
        and reason.getName() == ("Unsupported protocol version")
    )

    async with client(port) as c:
        await c.publish("still/up", b"1", qos=1)


@needs_mosquitto_clients
async def test_mqtt5_mosquitto_sub_is_refused(embedded: EmbeddedBroker) -> None:
    """mosquitto_sub -V mqttv5 gets nothing and fails (exit 255 at the -W timeout); the broker
    keeps serving."""
    p = await run(
        "mosquitto_sub", "-p", str(embedded.port), "-V", "mqttv5", "-t", "x", "-C", "1", "-W", "2"
    )
    assert p.returncode != 0 and p.stdout == ""
    await mosquitto_pub(embedded.port, "still/up", "-q", "1", "-m", "1")


async def test_clean_shutdown_frees_the_port() -> None:
    """Exiting ends connected and half-open clients, leaves no task behind, and the port can be
    reused at once."""
    port = free_port()
    async with EmbeddedBroker(port=port) as b:
        half_open = socket.create_connection(("127.0.0.1", port))  # never sends CONNECT
        paho = Paho(port, "connected-at-shutdown")
        # the broker has accepted the earlier half-open connection too
        assert await paho.connect() == 0
    try:
        assert await asyncio.to_thread(half_open.recv, 1) == b""  # the broker closed it
    finally:
        half_open.close()
    await paho.close()
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()

    async with EmbeddedBroker(port=port) as again, client(port) as c:
        assert again.url == b.url
        await c.subscribe("t", qos=1)
        await c.publish("t", b"again", qos=1)
        [m] = await receive(c, 1)
        assert m.payload == b"again"


async def test_port_in_use_is_a_one_line_error() -> None:
    """Starting on a taken port (another embedded broker, or any listener) raises
    BrokerStartError, one line."""
    async with EmbeddedBroker(port=free_port()) as first:
        with pytest.raises(BrokerStartError) as taken:
            async with EmbeddedBroker(port=first.port):
                pass
    message = str(taken.value)
    assert "\n" not in message
    assert message == (
        f"cannot start the embedded MQTT broker on {first.url}: the port is already in use "
        "(another broker running?)"
    )

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(BrokerStartError, match="already in use"):
            async with EmbeddedBroker(port=other.getsockname()[1]):
                pass


async def test_missing_amqtt_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without amqtt, entering raises BrokerStartError naming the extra to install."""
    # makes `from amqtt.broker import ...` fail
    monkeypatch.setitem(sys.modules, "amqtt.broker", None)
    _broker_class.cache_clear()  # forget the classes built by earlier tests
    try:
        with pytest.raises(BrokerStartError) as missing:
            async with EmbeddedBroker(port=free_port()):
                pass
    finally:
        _broker_class.cache_clear()
    assert (
        str(missing.value)
        == "the embedded broker needs amqtt: pip install -e '.[embedded]' (in the "
        "agent-monitor checkout)"
    )


async def test_amqtt_logging_is_quiet_and_nothing_else_is_touched() -> None:
    """amqtt's loggers go to WARNING unless already configured; the root logger and its handlers
    stay as they were."""
    amqtt_logger, root = logging.getLogger("amqtt"), logging.getLogger()
    saved = amqtt_logger.level
    root_state = (root.level, list(root.handlers))
    try:
        amqtt_logger.setLevel(logging.NOTSET)
        async with EmbeddedBroker(port=free_port()):
            assert amqtt_logger.level == logging.WARNING
            assert not logging.getLogger("amqtt.broker").isEnabledFor(logging.INFO)
        assert (root.level, list(root.handlers)) == root_state

        # the application asked for amqtt's debug logs: left alone
        amqtt_logger.setLevel(logging.DEBUG)
        async with EmbeddedBroker(port=free_port()):
            assert amqtt_logger.level == logging.DEBUG
    finally:
        amqtt_logger.setLevel(saved)
