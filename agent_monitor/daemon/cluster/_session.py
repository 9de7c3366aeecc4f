"""Cluster mode: taking a departed replica's MQTT session over, so what the broker queued there is
not lost.

A replica that died (or stepped aside) leaves its persistent session on the broker, still a member
of the shared subscription and still holding its share of the runs' inputs. One survivor resumes it
(same client id, clean start off), unsubscribes it, journals what it delivers into the runs'
inboxes, and only once it fell quiet lets the broker delete it (session expiry 0 on the DISCONNECT).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog

from ..sinks import Metrics
from ..sources import Receive

if TYPE_CHECKING:
    from ..sources import MqttLink

log = structlog.get_logger("agent_monitor.cluster")

_SESSION_TRIES = 10
"""Attempts at taking a departed replica's session over (one every two heartbeats) before leaving
it."""
_QUIET_S = 1.0
"""Taking a session over: it is emptied once the broker has sent nothing for this long."""


class SessionTaker:
    """Take departed replicas' MQTT sessions over, one at a time (the `cluster-sessions` task)."""

    def __init__(
        self,
        *,
        receive: Receive,
        alive: Callable[[str], Awaitable[bool]],
        metrics: Metrics,
        retry_s: float,
    ) -> None:
        self.receive = receive
        """Where the session's messages go: the runs' inboxes (before each is acknowledged)."""
        self.alive = alive
        self.metrics = metrics
        self.retry_s = retry_s
        self.link: MqttLink | None = None
        """The replica's own link (its broker, session expiry and shared filters), once the
        monitor has one."""
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        """Departed replicas' session infos (`replica`, `client_id`) to take over."""

    async def run(self) -> None:
        """Take each queued session over; one that fails is tried again later, unless its replica
        is back."""
        while True:
            info = await self.queue.get()
            try:
                await self._take(info)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                tries = int(info.get("tries", 0)) + 1
                gone = str(info.get("replica", ""))
                back = await self.alive(gone)
                log.warning(
                    "cluster_session_not_taken",
                    replica=gone,
                    error=f"{type(e).__name__}: {e}",
                    retry=not back and tries < _SESSION_TRIES,
                    note="the replica is back: its session is its own" if back else None,
                )
                if not back and tries < _SESSION_TRIES:
                    # Its queued messages stay in the session (kept: nothing asked the broker to
                    # delete it); again.
                    await asyncio.sleep(self.retry_s)
                    self.queue.put_nowait({**info, "tries": tries})

    async def _take(self, info: Mapping[str, Any]) -> None:
        """Empty a departed replica's MQTT session into the inboxes, then let the broker delete
        it."""
        link = self.link
        client_id = str(info.get("client_id") or "")
        if link is None or not client_id:
            return
        import aiomqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        b = link.broker
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        # Resume the session (clean start off), keeping its expiry: if this fails halfway, what is
        # still queued there stays for the next attempt. Only once it is empty does the DISCONNECT
        # ask the broker to delete it.
        props.SessionExpiryInterval = link.session_expiry_s
        client = aiomqtt.Client(
            b.host,
            b.port,
            identifier=client_id,
            username=b.username,
            password=b.password,
            tls_context=b.ssl_context(),
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=False,
            properties=props,
            timeout=10,
        )
        client._client.manual_ack_set(True)
        taken = 0
        async with client:
            # Out of the shared subscription first: as a member, the resumed session gets its turn
            # of every new message, so under steady traffic it would never fall quiet (and a second
            # dead session, queued behind this one, would wait as long). The messages already queued
            # in the session are still delivered after the UNSUBSCRIBE (MQTT 5 3.10.4; measured on
            # Mosquitto 2.0.11: 100 queued of 100 arrived).
            await client.unsubscribe(link.shared_filters())
            it: AsyncIterator[aiomqtt.Message] = client.messages.__aiter__()
            while True:
                try:
                    first = await asyncio.wait_for(it.__anext__(), _QUIET_S)
                except TimeoutError:
                    break  # emptied
                batch = [first]
                while not client._queue.empty():
                    batch.append(client._queue.get_nowait())
                items = []
                for msg in batch:
                    payload = (
                        msg.payload
                        if isinstance(msg.payload, bytes)
                        else str(msg.payload or "").encode()
                    )
                    items.append((msg.topic.value, payload, None))
                errors = await self.receive(items)
                for msg, error in zip(batch, errors, strict=True):
                    if error is None and msg.qos > 0:
                        client._client.ack(msg.mid, msg.qos)
                taken += sum(e is None for e in errors)
                if any(e is not None for e in errors):
                    raise ConnectionError(
                        "messages could not be journaled; the session is left for another attempt"
                    )
            gone = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
            gone.SessionExpiryInterval = 0  # emptied and unsubscribed: the broker may delete it now
            client._client.disconnect(properties=gone)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(client._disconnected), 10)
        self.metrics.sessions_adopted.inc()
        log.info(
            "cluster_session_taken",
            replica=info.get("replica"),
            client_id=client_id,
            messages=taken,
        )
