"""The daemon and the harness client against a locked-down Mosquitto: passwords, TLS, mutual TLS,
per-run ACLs.

Each test starts its own Mosquitto on a free port with its own config (the system broker on 1883 is
left alone); certificates are made with the `openssl` CLI into a temporary directory. The judge is
the instant FakeJudge. docs/broker-security.md shows the same configs to operators.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiomqtt
import pytest

from agent_monitor.daemon import BrokerUnavailable, Monitor, MonitorConfig, RunView
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, MonitorClient, ProgressOut, SignalOut
from tests.brokers import Mosquitto
from tests.openai_server import chat_choice, chat_reply, scripted_server

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(
        any(shutil.which(tool) is None for tool in ("mosquitto", "mosquitto_passwd", "openssl")),
        reason="needs mosquitto, mosquitto_passwd and openssl",
    ),
]

WAIT = 8.0  # seconds for anything that should happen at once
MONITOR_USER, MONITOR_PASSWORD = "agent-monitor", "monitor-s3cret"
HARNESS_PASSWORD = "harness-s3cret"


# -- brokers --


@contextmanager
def secure_broker(workdir: Path, config: str) -> Iterator[Mosquitto]:
    """A private Mosquitto on a free port whose listener is configured by `config` (auth, TLS,
    ACL lines)."""
    broker = Mosquitto(workdir)
    broker.conf.write_text(
        f"listener {broker.port} 127.0.0.1\n"
        f"{config.strip()}\n"
        "log_dest stderr\n"
        "log_type error\n"
        "log_type warning\n"
        # Started as root, mosquitto drops to user `mosquitto`, which cannot read our files in
        # tmp_path.
        f"user {pwd.getpwuid(os.geteuid()).pw_name}\n"
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def password_file(path: Path, users: dict[str, str]) -> Path:
    """A Mosquitto password file (hashed) made with `mosquitto_passwd -b`."""
    for i, (user, password) in enumerate(users.items()):
        flags = ["-b", "-c"] if i == 0 else ["-b"]
        subprocess.run(
            ["mosquitto_passwd", *flags, str(path), user, password], check=True, capture_output=True
        )
    return path


def auth_config(tmp_path: Path, users: dict[str, str], acl: str | None = None) -> str:
    lines = f"allow_anonymous false\npassword_file {password_file(tmp_path / 'passwd', users)}\n"
    if acl is not None:
        (tmp_path / "acl").write_text(acl)
        lines += f"acl_file {tmp_path / 'acl'}\n"
    return lines


# -- certificates --


@dataclass(frozen=True)
class Pki:
    """A test CA, a server certificate for 127.0.0.1/localhost and a client certificate, all PEM
    files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def listener(self, *, require_certificate: bool = False) -> str:
        tls = f"cafile {self.ca}\ncertfile {self.server_cert}\nkeyfile {self.server_key}\n"
        if require_certificate:
            tls += "require_certificate true\n"
        return tls + "allow_anonymous true\n"


def _openssl(cwd: Path, *args: str) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {out.stderr.strip()}")


def _ec_key() -> tuple[str, ...]:
    return ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def make_pki(d: Path) -> Pki:
    """CA -> server cert (SAN IP:127.0.0.1, DNS:localhost; serverAuth) and client cert
    (clientAuth)."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl(
        d,
        *("req", "-x509", "-new", *_ec_key(), "-keyout", "ca.key", "-out", "ca.crt", "-days", "2"),
        *("-subj", "/CN=agent-monitor test CA"),
        *(
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ),
    )
    leaf = (
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    extensions = {
        "server": leaf + "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
        "client": leaf + "extendedKeyUsage=clientAuth\n",
    }
    for name, ext in extensions.items():
        (d / f"{name}.ext").write_text(ext)
        _openssl(
            d,
            "req",
            "-new",
            *_ec_key(),
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        _openssl(
            d,
            *(
                "x509",
                "-req",
                "-in",
                f"{name}.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-days",
                "2",
            ),
            *(
                "-set_serial",
                f"0x{uuid.uuid4().hex[:16]}",
                "-extfile",
                f"{name}.ext",
                "-out",
                f"{name}.crt",
            ),
        )
    return Pki(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# -- the two sides --


def monitor(settings: BrokerSettings, judge: FakeJudge, **kw: Any) -> Monitor:
    return Monitor(
        MonitorConfig(broker=settings, client_id=f"mon-{uuid.uuid4().hex[:8]}", **kw), judge=judge
    )


async def eventually(check: Callable[[], bool], what: str, within: float = WAIT) -> None:
    """Poll `check` (state with no event to wait on) until it holds; AssertionError after
    `within` seconds."""
    for _ in range(int(within / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} did not happen within {within}s")


@asynccontextmanager
async def serving(settings: BrokerSettings, judge: FakeJudge) -> AsyncIterator[Monitor]:
    """A running monitor, left only once its outbox is drained and the last PUBACK is in.

    Works around a shutdown hang: on Python 3.11, `asyncio.wait_for` (inside aiomqtt's publish)
    swallows a cancellation that lands in the same loop iteration as the PUBACK, so the
    `mqtt-publish` task goes back to `outbox.get()` and `Monitor.__aexit__` waits for it forever.
    """
    async with monitor(settings, judge) as mon:
        try:
            yield mon
        finally:
            with contextlib.suppress(AssertionError):
                await eventually(lambda: not len(mon.outbox), "outbox drained")
            await asyncio.sleep(0.2)


def harness_run(url: str, run_id: str = "run-1", steps: int = 2, **client_kw: Any) -> ProgressOut:
    """What a harness does (blocking): start a run, send steps, wait for the last one's progress,
    end it."""
    with MonitorClient(url, connect_timeout=WAIT, ack_timeout=WAIT, **client_kw) as mon:
        run = mon.start_run(run_id, task=f"task of {run_id}")
        for i in range(1, steps + 1):
            run.step(f"{run_id} step {i}")
        progress = run.wait_progress(steps, timeout=WAIT)
        run.end("success")
        return progress


@asynccontextmanager
async def raw_client(port: int, user: str) -> AsyncIterator[aiomqtt.Client]:
    """A plain MQTT v5 client logged in as `user`: what a misbehaving harness could do with its
    credentials."""
    async with aiomqtt.Client(
        "127.0.0.1",
        port,
        username=user,
        password=HARNESS_PASSWORD,
        identifier=f"raw-{user}-{uuid.uuid4().hex[:6]}",
        protocol=aiomqtt.ProtocolVersion.V5,
    ) as c:
        yield c


async def nothing_arrives(client: aiomqtt.Client, within: float = 0.5) -> None:
    with pytest.raises(TimeoutError):
        m = await asyncio.wait_for(anext(aiter(client.messages)), within)
        pytest.fail(f"{m.topic.value} reached a client that may not read it: {m.payload!r}")


async def scored_end_to_end(settings: BrokerSettings, url: str, **client_kw: Any) -> None:
    """The monitor connects with `settings`; a MonitorClient on `url` gets its run scored."""
    judge = FakeJudge()
    async with serving(settings, judge) as mon:
        assert mon.link is not None and mon.link.negotiated == "5"
        progress = await asyncio.to_thread(harness_run, url, **client_kw)
    assert progress.ok and progress.step == 2 and progress.score == pytest.approx(2 / 19)
    assert judge.prompts and all("task of run-1" in p.text() for p in judge.prompts)


async def refused(settings: BrokerSettings, *, connect_timeout_s: float | None = None) -> str:
    """The one-line BrokerUnavailable message the monitor fails with on `settings`."""
    mon = monitor(settings, FakeJudge())
    if connect_timeout_s is not None:
        assert mon.link is not None
        mon.link.connect_timeout_s = connect_timeout_s
    with pytest.raises(BrokerUnavailable) as ei:
        async with mon:
            pass
    text = str(ei.value)
    assert "\n" not in text
    return text


def client_refused(url: str, **client_kw: Any) -> str:
    with pytest.raises(ConnectionError) as ei:
        MonitorClient(url, **client_kw)
    text = str(ei.value)
    assert "\n" not in text
    return text


# -- a. username / password --


@pytest.fixture
def password_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    users = {MONITOR_USER: MONITOR_PASSWORD, "harness-run-1": HARNESS_PASSWORD}
    with secure_broker(tmp_path / "mosquitto", auth_config(tmp_path, users)) as b:
        yield b


async def test_password_auth_scores_a_run(password_broker: Mosquitto) -> None:
    settings = BrokerSettings.from_url(
        password_broker.url, username=MONITOR_USER, password=MONITOR_PASSWORD
    )
    await scored_end_to_end(
        settings, password_broker.url, username="harness-run-1", password=HARNESS_PASSWORD
    )


async def test_wrong_or_missing_credentials_are_refused_with_a_hint(
    password_broker: Mosquitto,
) -> None:
    url = password_broker.url
    expected = (
        f"cannot connect to the MQTT broker at {url}: [code:135] Not authorized; the "
        "broker refused the credentials: check --broker-username / --broker-password"
    )
    wrong_password = BrokerSettings.from_url(
        url, username=MONITOR_USER, password="not-the-password"
    )
    assert await refused(wrong_password) == expected
    assert (
        await refused(BrokerSettings.from_url(url, username="nobody", password=MONITOR_PASSWORD))
        == expected
    )
    assert await refused(BrokerSettings.from_url(url)) == expected  # anonymous: not allowed
    # The harness client says the same, without the flag hint (it has no flags).
    assert client_refused(url, username="harness-run-1", password="nope", connect_timeout=WAIT) == (
        f"the MQTT broker at {url} refused the connection: Not authorized"
    )


async def test_credentials_in_the_url(tmp_path: Path) -> None:
    # Characters that must be percent-encoded in a URL: from_url decodes them.
    password = "p@ss:w/rd%?#"
    with secure_broker(
        tmp_path / "mosquitto", auth_config(tmp_path, {MONITOR_USER: password})
    ) as b:
        url = f"mqtt://{MONITOR_USER}:{quote(password, safe='')}@127.0.0.1:{b.port}"
        settings = BrokerSettings.from_url(url)
        assert (settings.username, settings.password) == (MONITOR_USER, password)
        assert settings.url == b.url  # the URL that is logged carries no credentials
        await scored_end_to_end(settings, url)
        # A wrong password in the URL is refused, and never echoed in the error.
        text = await refused(
            BrokerSettings.from_url(f"mqtt://{MONITOR_USER}:leaked-secret@127.0.0.1:{b.port}")
        )
        assert "leaked-secret" not in text and "check --broker-username / --broker-password" in text


async def test_events_naming_files_or_urls_are_refused(password_broker: Mosquitto) -> None:
    # No ambient authority: a network event can never make the monitor read a file or fetch a URL.
    settings = BrokerSettings.from_url(
        password_broker.url, username=MONITOR_USER, password=MONITOR_PASSWORD
    )
    async with serving(settings, FakeJudge()):
        client = await asyncio.to_thread(
            MonitorClient, password_broker.url, username="harness-run-1", password=HARNESS_PASSWORD
        )
        try:
            run = await asyncio.to_thread(client.start_run, "run-1", task="task of run-1")
            # the client refuses before sending
            with pytest.raises(ValueError, match="looks like a file path"):
                run.step("look", images=["/etc/passwd"])
            # a harness without the client
            async with raw_client(password_broker.port, "harness-run-1") as raw:
                step = {
                    "index": 1,
                    "text": "look",
                    "images": [{"data": "https://example.com/screen.png"}],
                }
                await raw.publish("agents/run-1/step", json.dumps(step), qos=1)
                await raw.publish(
                    "agents/run-1/start",
                    json.dumps({"task": "t", "criteria": "/etc/rubric.md"}),
                    qos=1,
                )
            await eventually(lambda: len(run.errors) == 2, "two errors")
            (url_err, path_err) = run.errors
            assert (
                url_err.reason == "bad_image"
                and ("is a URL; images are inline base64 bytes only") in url_err.error
            )
            assert (
                path_err.reason == "invalid"
                and "files are not read for network events" in path_err.error
            )
            run.step("fine")
            assert (await asyncio.to_thread(run.wait_progress, 1, WAIT)).ok
            await asyncio.to_thread(run.end, "success")
        finally:
            await asyncio.to_thread(client.close)


# -- b. TLS --


async def test_tls_with_the_ca_file_scores_a_run(tmp_path: Path, pki: Pki) -> None:
    with secure_broker(tmp_path / "mosquitto", pki.listener()) as b:
        settings = BrokerSettings.from_url(f"mqtts://127.0.0.1:{b.port}", ca_file=str(pki.ca))
        # The harness names the broker `localhost`: the certificate's SAN covers both names.
        await scored_end_to_end(settings, f"mqtts://localhost:{b.port}", ca_file=str(pki.ca))


async def test_tls_without_the_ca_file_is_refused(tmp_path: Path, pki: Pki) -> None:
    with secure_broker(tmp_path / "mosquitto", pki.listener()) as b:
        url = f"mqtts://127.0.0.1:{b.port}"
        text = await refused(BrokerSettings.from_url(url))  # system CAs do not know the test CA
        # e.g. "...: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed
        # certificate in certificate chain (_ssl.c:1006); check the TLS settings (--tls-ca, or use
        # mqtt:// for a plain broker)"
        assert text.startswith(
            f"cannot connect to the MQTT broker at {url}: [SSL: CERTIFICATE_VERIFY_FAILED]"
        )
        assert "self-signed certificate in certificate chain" in text
        assert text.endswith(
            "; check the TLS settings (--tls-ca, or use mqtt:// for a plain broker)"
        )
        client_text = client_refused(url, connect_timeout=WAIT)
        assert client_text.startswith(
            f"cannot connect to the MQTT broker at {url}: [SSL: CERTIFICATE_VERIFY_FAILED]"
        )


async def test_mutual_tls_scores_a_run(tmp_path: Path, pki: Pki) -> None:
    with secure_broker(tmp_path / "mosquitto", pki.listener(require_certificate=True)) as b:
        url = f"mqtts://127.0.0.1:{b.port}"
        files = {
            "ca_file": str(pki.ca),
            "cert_file": str(pki.client_cert),
            "key_file": str(pki.client_key),
        }
        await scored_end_to_end(BrokerSettings.from_url(url, **files), url, **files)


async def test_mutual_tls_without_a_client_certificate_is_refused(tmp_path: Path, pki: Pki) -> None:
    with secure_broker(tmp_path / "mosquitto", pki.listener(require_certificate=True)) as b:
        url = f"mqtts://127.0.0.1:{b.port}"
        # The broker refuses after the TLS 1.3 handshake (alert "certificate required"); aiomqtt
        # ignores a disconnect before the CONNACK, so the monitor only notices at its connect
        # timeout (10 s by default; 1.5 s here).
        text = await refused(
            BrokerSettings.from_url(url, ca_file=str(pki.ca)), connect_timeout_s=1.5
        )
        assert text.startswith(f"cannot connect to the MQTT broker at {url}: ")
        client_text = client_refused(url, ca_file=str(pki.ca), connect_timeout=1.5)
        assert client_text == f"the MQTT broker at {url} did not answer (no CONNACK) within 1.5s"


@pytest.mark.xfail(
    strict=True,
    reason="bug: a broker that wants a client certificate is reported as 'Operation timed "
    "out; check the host, port "
    "and firewall' after the full connect timeout (aiomqtt drops the TLS alert that paho "
    "only logs)",
)
async def test_mutual_tls_refusal_names_the_certificate(tmp_path: Path, pki: Pki) -> None:
    with secure_broker(tmp_path / "mosquitto", pki.listener(require_certificate=True)) as b:
        text = await refused(
            BrokerSettings.from_url(f"mqtts://127.0.0.1:{b.port}", ca_file=str(pki.ca)),
            connect_timeout_s=1.5,
        )
        assert "certificate" in text and "--tls-cert" in text, text


# -- c. per-run ACLs --

MONITOR_ACL = """\
# The monitor: reads every run's inputs; writes every run's outputs and the bad-topic reports.
user agent-monitor
topic read agents/+/start
topic read agents/+/step
topic read agents/+/end
topic write agents/+/progress
topic write agents/+/signal
topic write agents/+/error
topic write agents/+/resend
topic write agents/+/state
topic write agents/_errors
topic write agents/_groups/+/ranking
"""


def harness_acl(user: str, run_id: str) -> str:
    return (
        f"\n# The harness of {run_id}: publishes only that run's inputs, reads only its outputs.\n"
        f"user {user}\n"
        + "".join(f"topic write agents/{run_id}/{k}\n" for k in ("start", "step", "end"))
        + "".join(f"topic read agents/{run_id}/{k}\n" for k in ("progress", "signal", "error"))
    )


PATTERN_ACL = (
    MONITOR_ACL
    + """
# Every other user is the harness of the run named like the user (run id = username).
pattern write agents/%u/start
pattern write agents/%u/step
pattern write agents/%u/end
pattern read agents/%u/progress
pattern read agents/%u/signal
pattern read agents/%u/error
"""
)

ACLS = {
    # one `user` block per harness user `harness-<run id>`
    "users": (
        MONITOR_ACL + harness_acl("harness-run-1", "run-1") + harness_acl("harness-run-2", "run-2"),
        "harness-",
    ),
    # `pattern` lines with %u: the harness user is named like its run
    "pattern": (PATTERN_ACL, ""),
}


@pytest.mark.parametrize("style", list(ACLS))
async def test_acl_confines_each_harness_to_its_own_run(tmp_path: Path, style: str) -> None:
    acl, user_prefix = ACLS[style]
    h1, h2 = f"{user_prefix}run-1", f"{user_prefix}run-2"
    users = {MONITOR_USER: MONITOR_PASSWORD, h1: HARNESS_PASSWORD, h2: HARNESS_PASSWORD}
    judge = FakeJudge()
    with secure_broker(tmp_path / "mosquitto", auth_config(tmp_path, users, acl)) as b:
        settings = BrokerSettings.from_url(b.url, username=MONITOR_USER, password=MONITOR_PASSWORD)
        async with serving(settings, judge) as mon:

            def run2_state() -> RunView:
                view = mon.run("run-2")
                assert view is not None, "run-2 is not live"
                return view

            client1 = await asyncio.to_thread(
                MonitorClient,
                b.url,
                username=h1,
                password=HARNESS_PASSWORD,
                connect_timeout=WAIT,
                ack_timeout=WAIT,
            )
            try:
                # 1. The harness of run-1 gets its progress.
                run1 = await asyncio.to_thread(client1.start_run, "run-1", task="task of run-1")
                run1.step("run-1 step 1")
                assert (await asyncio.to_thread(run1.wait_progress, 1, WAIT)).ok

                # 2. With run-1's credentials, inputs for run-2 and forged outputs are dropped by
                #    the broker.
                forged = {"run_id": "run-2", "signal": "abort", "reason": "forged", "step": 1}
                async with raw_client(b.port, h1) as rogue:
                    await rogue.publish(
                        "agents/run-2/start", json.dumps({"task": "hijacked"}), qos=1
                    )
                    await rogue.publish(
                        "agents/run-2/step", json.dumps({"index": 1, "text": "spoofed"}), qos=1
                    )
                    await rogue.publish(
                        "agents/run-2/signal", json.dumps(forged), qos=1, retain=True
                    )
                    await rogue.publish(
                        "agents/run-1/signal", json.dumps(forged | {"run_id": "run-1"}), qos=1
                    )
                    # A misspelt topic is a topic the harness may not write: dropped by the broker
                    # too.
                    await rogue.publish(
                        "agents/run-1/steps", json.dumps({"index": 2, "text": "typo"}), qos=1
                    )
                # The broker handles one connection's messages in order, and the monitor reads one
                # connection in order: once run-1's next step is scored, anything the broker let
                # through would have been seen.
                run1.step("run-1 step 2")
                assert (await asyncio.to_thread(run1.wait_progress, 2, WAIT)).ok
                assert "run-2" not in mon.book.live and "run-2" not in mon.book.orphans
                assert "run-2" not in mon.book.ended
                assert [p.step for p in judge.prompts] == [1, 2]
                assert all("task of run-1" in p.text() for p in judge.prompts)
                # the forged signal on its own topic did not arrive either
                assert run1.signal is None
                unknown = mon.registry.get_sample_value(
                    "agent_monitor_invalid_events_total", {"reason": "unknown_topic"}
                )
                assert unknown == 0

                # 3. run-2's own harness runs it; the monitor aborts it (a retained signal).
                seen2: list[SignalOut] = []
                client2 = await asyncio.to_thread(
                    MonitorClient,
                    b.url,
                    username=h2,
                    password=HARNESS_PASSWORD,
                    connect_timeout=WAIT,
                )
                try:
                    policy = {"abort_below": 0.5, "min_steps": 0, "patience": 1}
                    run2 = await asyncio.to_thread(
                        client2.start_run,
                        "run-2",
                        task="task of run-2",
                        policy=policy,
                        on_signal=seen2.append,
                    )
                    run2.step("run-2 step 1")
                    sig = await asyncio.to_thread(run2.wait_signal, "abort", WAIT)
                    assert sig.reason != "forged" and [s.reason for s in seen2] == [sig.reason]
                    assert [s.text for s in run2_state().steps] == ["run-2 step 1"]

                    # 4. run-1's credentials cannot read run-2's signal (retained right now) or
                    #    progress.
                    async with raw_client(b.port, h1) as snoop:
                        for f in (
                            "agents/run-2/signal",
                            "agents/run-2/progress",
                            "agents/+/signal",
                            "agents/#",
                        ):
                            await snoop.subscribe(f, qos=1)
                        await nothing_arrives(snoop)
                    # Mosquitto's acl_file grants such subscriptions and filters at delivery;
                    # publishes it denies are acknowledged and dropped. So a hijacking "start" looks
                    # fine to the client and does nothing.
                    hijack = await asyncio.to_thread(client1.start_run, "run-2", task="hijacked")
                    hijack.step("hijacked step")
                    # same connection: once this is scored, the hijack was dropped
                    run1.step("run-1 step 3")
                    assert (await asyncio.to_thread(run1.wait_progress, 3, WAIT)).ok
                    assert run2_state().task == "task of run-2"
                    assert [s.text for s in run2_state().steps] == ["run-2 step 1"]
                    # the retained abort was not delivered
                    assert hijack.signal is None and hijack.progress is None
                    # ... while run-2's own credentials can (the abort is there to be read).
                    async with raw_client(b.port, h2) as own:
                        await own.subscribe("agents/run-2/signal", qos=1)
                        m = await asyncio.wait_for(anext(aiter(own.messages)), WAIT)
                        assert m.retain and json.loads(bytes(m.payload))["signal"] == "abort"
                    await asyncio.to_thread(run2.end, "failure")
                finally:
                    await asyncio.to_thread(client2.close)
                await asyncio.to_thread(run1.end, "success")
            finally:
                await asyncio.to_thread(client1.close)


@pytest.mark.parametrize("pinned", [False, True], ids=["any-client-id", "use_username_as_clientid"])
async def test_a_harness_cannot_take_over_the_monitors_client_id(
    tmp_path: Path, pinned: bool
) -> None:
    users = {
        MONITOR_USER: MONITOR_PASSWORD,
        "harness-run-1": HARNESS_PASSWORD,
        "harness-run-2": HARNESS_PASSWORD,
    }
    config = auth_config(tmp_path, users, ACLS["users"][0]) + (
        "use_username_as_clientid true\n" if pinned else ""
    )
    with secure_broker(tmp_path / "mosquitto", config) as b:
        settings = BrokerSettings.from_url(b.url, username=MONITOR_USER, password=MONITOR_PASSWORD)
        async with serving(settings, FakeJudge()) as mon:
            assert mon.link is not None
            await asyncio.wait_for(mon.link.connected.wait(), WAIT)
            assert mon.link.connections == 1
            # Valid harness credentials, the monitor's client id (it is no secret: --client-id,
            # logs).
            with contextlib.suppress(aiomqtt.MqttError):
                async with aiomqtt.Client(
                    "127.0.0.1",
                    b.port,
                    username="harness-run-2",
                    password=HARNESS_PASSWORD,
                    identifier=mon.link.client_id,
                ):
                    # the broker drops the monitor's connection for the newcomer with its id
                    if not pinned:
                        link = mon.link
                        await eventually(
                            lambda: not link.connected.is_set() or link.connections > 1, "takeover"
                        )
            progress = await asyncio.to_thread(
                harness_run, b.url, username="harness-run-1", password=HARNESS_PASSWORD
            )
            assert progress.ok
            # Pinned, the newcomer got the client id "harness-run-2" and the monitor was never
            # disconnected.
            assert (mon.link.connections == 1) is pinned


# -- the command line, as docs/broker-security.md shows it --


def test_serve_with_tls_and_a_password_from_the_environment(tmp_path: Path, pki: Pki) -> None:
    users = {MONITOR_USER: MONITOR_PASSWORD, "harness-run-1": HARNESS_PASSWORD}
    config = pki.listener().replace("allow_anonymous true\n", "") + auth_config(tmp_path, users)
    with secure_broker(tmp_path / "mosquitto", config) as b, scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("C", {"C": 1.0})]))
        url = f"mqtts://127.0.0.1:{b.port}"
        args = ["--broker", url, "--broker-username", MONITOR_USER, "--tls-ca", str(pki.ca)]
        args += ["--judge", "openai", "--judge-url", judge.url, "--metrics-port", "0"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_MONITOR")}
        # The run store goes to tmp_path, never to the user's data directory.
        env |= {
            "XDG_DATA_HOME": str(tmp_path / "xdg"),
            "AGENT_MONITOR_STATE_DIR": str(tmp_path / "state"),
        }

        wrong = subprocess.run(
            [sys.executable, "-m", "agent_monitor", "serve", *args],
            env={**env, "AGENT_MONITOR_BROKER_PASSWORD": "not-the-password"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert wrong.returncode == 2
        assert wrong.stderr.strip().splitlines()[-1] == (
            f"agent-monitor: cannot connect to the MQTT broker at {url}: [code:135] Not "
            "authorized; "
            "the broker refused the credentials: check --broker-username / --broker-password"
        )

        proc = subprocess.Popen(
            [sys.executable, "-m", "agent_monitor", "serve", *args],
            env={
                **env,
                "AGENT_MONITOR_BROKER_PASSWORD": MONITOR_PASSWORD,
                "AGENT_MONITOR_LOG_LEVEL": "warning",
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            deadline = time.monotonic() + 20
            line = ""
            while time.monotonic() < deadline and not line.startswith("agent-monitor: serving"):
                line = proc.stderr.readline()
                assert line, f"serve exited with {proc.wait()}"
            assert line.startswith(f"agent-monitor: serving agents/+/start|step|end on {url} ")
            progress = harness_run(
                url, username="harness-run-1", password=HARNESS_PASSWORD, ca_file=str(pki.ca)
            )
            assert progress.ok and progress.score == pytest.approx(2 / 19)
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# amqtt 0.12.1's plugin Config has no `subscribe_acl` field yet; its `acl` is what it reads for
# subscriptions.
@pytest.mark.filterwarnings("ignore:The 'acl' option is deprecated:DeprecationWarning")
async def test_a_broker_that_refuses_the_wide_subscription_gets_the_three_input_filters() -> None:
    """amqtt's topic ACL refuses `agents/+/+` when it lists only the inputs (EMQX and HiveMQ ACLs
    can too).

    Mosquitto's acl_file grants any subscription and filters at delivery, so this broker is amqtt.
    """
    from amqtt.broker import Broker
    from structlog.testing import capture_logs

    from tests.brokers import free_port

    port = free_port()
    inputs = ["agents/+/start", "agents/+/step", "agents/+/end"]
    broker = Broker(
        {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
                "amqtt.plugins.topic_checking.TopicAccessControlListPlugin": {
                    "acl": {"anonymous": inputs}
                },
            },
        }
    )
    await broker.start()
    try:
        judge = FakeJudge()
        settings = BrokerSettings.from_url(f"mqtt://127.0.0.1:{port}")
        with capture_logs() as logs:
            async with (
                monitor(settings, judge, protocol="3.1.1") as mon,
                aiomqtt.Client("127.0.0.1", port, protocol=aiomqtt.ProtocolVersion.V311) as harness,
            ):
                await harness.publish("agents/r1/start", json.dumps({"task": "t"}), qos=1)
                await harness.publish(
                    "agents/r1/step", json.dumps({"index": 1, "text": "one"}), qos=1
                )
                await eventually(
                    lambda: bool((view := mon.run("r1")) and view.scored == 1), "step 1 scored"
                )
        narrowed = [e for e in logs if e["event"] == "subscription_narrowed"]
        assert [e["refused"] for e in narrowed] == ["agents/+/+"]
    finally:
        await broker.shutdown()
