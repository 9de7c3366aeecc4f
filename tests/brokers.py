"""Private Mosquitto brokers for integration tests: free port, own persistence, stop and restart
on demand."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, *, up: bool = True, timeout: float = 10.0) -> None:
    """Wait until something listens on 127.0.0.1:port (or, with up=False, until nothing does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.02)
    raise TimeoutError(f"port {port} did not come {'up' if up else 'down'} within {timeout}s")


class Mosquitto:
    """One private Mosquitto on a free port; persistence keeps sessions and queued messages
    across restarts."""

    def __init__(
        self, workdir: Path, port: int | None = None, *, extra: Sequence[str] = ()
    ) -> None:
        """Stock limits; `extra` adds configuration lines (only for a test about a limit, which
        says why)."""
        if shutil.which("mosquitto") is None:
            raise RuntimeError(
                "mosquitto is not installed; `apt-get install mosquitto mosquitto-clients`"
            )
        self.port = port or free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence true\n"
            f"persistence_location {workdir}/\n"
            "autosave_interval 1\n"
            "log_dest stderr\n"
            "log_type error\n"
            "log_type warning\n"
            # Started as root, mosquitto drops to user `mosquitto`, which cannot write our
            # persistence dir.
            f"user {pwd.getpwuid(os.geteuid()).pw_name}\n" + "".join(f"{line}\n" for line in extra)
        )

    @property
    def url(self) -> str:
        """The broker URL for `agent-monitor serve --broker`."""
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the broker and wait until it accepts connections."""
        self.proc = subprocess.Popen(
            ["mosquitto", "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            wait_port(self.port)
        except TimeoutError:
            self.proc.kill()
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise RuntimeError(f"mosquitto did not start on port {self.port}: {err}") from None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the broker (SIGTERM saves its persistence file; SIGKILL does not)."""
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        wait_port(self.port, up=False)

    def restart(self) -> None:
        """Stop and start again on the same port, keeping sessions."""
        self.stop()
        self.start()


@contextmanager
def mosquitto(workdir: Path, *, extra: Sequence[str] = ()) -> Iterator[Mosquitto]:
    """A running private broker for the duration of the block."""
    broker = Mosquitto(workdir, extra=extra)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def mosquitto_sub(
    port: int, topic: str, *, count: int, timeout: float, extra: tuple[str, ...] = ()
) -> list[str]:
    """Run `mosquitto_sub` until `count` messages arrive (topic + payload lines) or the timeout
    passes."""
    out = subprocess.run(
        [
            "mosquitto_sub",
            "-p",
            str(port),
            "-t",
            topic,
            "-C",
            str(count),
            "-W",
            str(int(timeout)),
            "-v",
            *extra,
        ],
        capture_output=True,
        text=True,
        env={**os.environ},
        check=False,
    )
    return [line for line in out.stdout.splitlines() if line]


def input_listener(port: int, on_message: Callable[..., None], *, wait_s: float = 10.0) -> Any:
    """A plain paho client playing the monitor: subscribed (QoS 1) to every run's start, step and
    end."""
    import threading

    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    ready = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv311)
    client.on_subscribe = lambda *a: ready.set()
    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.subscribe([("agents/+/start", 1), ("agents/+/step", 1), ("agents/+/end", 1)])
    client.loop_start()
    if not ready.wait(wait_s):
        raise TimeoutError(f"no SUBACK from the broker on port {port} within {wait_s}s")
    return client
