"""An in-process MQTT 3.1.1 broker (amqtt) for one-machine setups: `agent-monitor serve
--embedded-broker`.

Checked against amqtt 0.12.1 by tests/daemon/test_broker.py: QoS 1 publish/subscribe, retained
messages, clearing a retained message with an empty retained payload (current subscribers get the
empty message, later ones get nothing), and persistent sessions (a `clean_session=False` subscriber
gets the QoS 1 messages published while it was away).

amqtt 0.12.1 bugs worked around here:

- Its anonymous-auth plugin marks every session anonymous, and amqtt neither keeps anonymous
  sessions nor queues messages for them, so persistent sessions would silently not work. An
  allow-all plugin that leaves sessions non-anonymous replaces it.
- On every CONNECT it sends the client the retained messages matching any filter any client holds
  (even a client that left less than a second ago). Only the client's own subscriptions count here.
- Its shutdown forgets connections that have not sent CONNECT (a pending task; on Python 3.12+ a
  hang in `Server.wait_closed`), and a client hanging up right after a refused CONNECT makes its
  connection callback raise. So this module owns the TCP listener and the connection tasks, and
  hands each connection to amqtt through its "external" listener.

What callers should know:

- MQTT v5 CONNECTs are refused with the 3.1.1 CONNACK "unacceptable protocol version" (code 1);
  aiomqtt raises `aiomqtt.exceptions.MqttConnectError` (an `MqttCodeError`) with `rc` 132,
  "[code:132] Unsupported protocol version", and amqtt logs two WARNING lines per refusal.
- Messages queued for an offline persistent session arrive with the RETAIN flag set, and a
  reconnecting persistent session is sent the retained messages of its subscriptions again, at QoS
  0.
- Sessions never expire and live in memory only; nothing is written to disk.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
from typing import Any

import structlog

__all__ = ["BrokerStartError", "EmbeddedBroker"]

_INSTALL_HINT = (
    "the embedded broker needs amqtt: pip install -e '.[embedded]' (in the agent-monitor checkout)"
)
# amqtt logs every connection at INFO; `transitions` runs its state machines and logs each callback.
_NOISY_LOGGERS = ("amqtt", "transitions")
_LISTENER = "default"

log = structlog.get_logger("agent_monitor.broker")


class BrokerStartError(RuntimeError):
    """The embedded broker could not start (port in use, amqtt missing); the message is one line.

    `port_in_use` says the address was taken (another broker, most likely), so a caller can offer
    to use that broker or another port.
    """

    def __init__(self, message: str, *, port_in_use: bool = False) -> None:
        super().__init__(message)
        self.port_in_use = port_in_use


class EmbeddedBroker:
    """An in-process MQTT 3.1.1 broker (amqtt) on host:port, as an async context manager."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1883) -> None:
        self.host = host
        self.port = port
        self._broker: Any = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        """The broker's address as an mqtt:// URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"

    async def __aenter__(self) -> EmbeddedBroker:
        """Start the broker; raise BrokerStartError if amqtt is missing or the port cannot be
        bound."""
        try:
            broker_class = _broker_class()
        except ImportError:
            raise BrokerStartError(_INSTALL_HINT) from None
        _quiet_amqtt_logs()
        config = {
            # "external": amqtt opens no socket of its own; _serve hands it our connections.
            "listeners": {_LISTENER: {"type": "external", "bind": f"{self.host}:{self.port}"}},
            # Only the auth plugin: no $SYS topics, no event or packet loggers, no topic filters.
            "plugins": {f"{__name__}._AllowAllAuthPlugin": {}},
        }
        self._broker = broker_class(config)
        await self._broker.start()
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as e:
            broker, self._broker = self._broker, None
            await broker.shutdown()
            raise BrokerStartError(
                _start_failure(self.url, e), port_in_use=e.errno == errno.EADDRINUSE
            ) from e
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop accepting, end every session, then wait for every connection task to finish."""
        broker, self._broker = self._broker, None
        server, self._server = self._server, None
        if broker is None or server is None:
            return
        server.close()
        try:
            await broker.shutdown()
        finally:
            # amqtt's shutdown closes established sessions; what is left has not finished CONNECT.
            for task in self._connections:
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Run one client connection through amqtt, tracked so shutdown can end and await it."""
        from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter

        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._broker.external_connected(
                StreamReaderAdapter(reader), StreamWriterAdapter(writer), _LISTENER
            )
        except asyncio.CancelledError:
            # Only __aexit__ cancels these; ending quietly keeps asyncio's stream callback from
            # logging an error.
            pass
        except OSError as e:
            # amqtt raises when a client hangs up right after a refused CONNECT (mosquitto v5
            # clients do).
            log.debug("embedded_broker_client_gone", error=repr(e))
        except Exception as e:
            # amqtt lets some races escape (e.g. subscriptions changing while a client connects, or
            # at shutdown, when it is not worth a line); the client loses the connection and
            # reconnects, so a line beats asyncio's traceback.
            if self._broker is not None:
                log.warning("embedded_broker_connection_failed", error=repr(e))
        finally:
            writer.close()
            self._connections.discard(task)


def _start_failure(url: str, e: OSError) -> str:
    """One line saying why the listener could not bind."""
    if e.errno == errno.EADDRINUSE:
        return (
            f"cannot start the embedded MQTT broker on {url}: the port is already in use "
            "(another broker running?)"
        )
    return f"cannot start the embedded MQTT broker on {url}: {' '.join(str(e).split())}"


def _quiet_amqtt_logs() -> None:
    """Raise amqtt's loggers to WARNING, unless the application set their level itself."""
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


@functools.cache
def _broker_class() -> Any:
    """amqtt's Broker with one fix, and the auth plugin, defined on first use because amqtt is
    imported lazily."""
    from amqtt.broker import Broker
    from amqtt.plugins.base import BaseAuthPlugin

    class _AllowAllAuthPlugin(BaseAuthPlugin):  # type: ignore[misc]
        """Accept every client, leaving the session non-anonymous so amqtt keeps persistent
        sessions."""

        async def authenticate(self, *, session: Any) -> bool:
            return True

    class _Broker(Broker):  # type: ignore[misc]
        """amqtt's Broker, sending retained messages only for a client's own subscriptions."""

        async def _publish_retained_messages_for_subscription(
            self, subscription: tuple[str, int], session: Any
        ) -> None:
            # On every CONNECT amqtt calls this for each filter any client holds; without the check
            # a new client gets unsolicited retained messages (the monitor would get harnesses'
            # `signal` topics as bad input).
            holders = self._subscriptions.get(subscription[0], ())
            if any(s.client_id == session.client_id for s, _qos in holders):
                await super()._publish_retained_messages_for_subscription(subscription, session)

    # amqtt loads plugins by dotted path, so the class must be reachable as a module attribute.
    globals()["_AllowAllAuthPlugin"] = _AllowAllAuthPlugin
    return _Broker
