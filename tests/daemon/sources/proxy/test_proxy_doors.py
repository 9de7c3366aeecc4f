"""The LLM API proxy's door under hostile clients: trickling connections, dot-segment paths, a huge
Content-Length.

A real proxy (real monitor, real broker, the scripted upstream recording every path that reaches it)
and real clients: the openai SDK for the legitimate agent, raw sockets for the hostile ones (an HTTP
client library normalises a path before it sends it, so only a raw socket sends `/v1/../../admin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.daemon import SqliteStore
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto
from tests.daemon.sources.proxy.test_proxy import rig
from tests.llm_upstream import Answer

pytestmark = pytest.mark.timeout(120)


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _raw(url: str, request: bytes) -> bytes:
    """Send one raw request and read the answer until the proxy closes or 5 s pass."""
    reader, writer = await asyncio.open_connection(*_hostport(url))
    writer.write(request)
    await writer.drain()
    got = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(5):
            while chunk := await reader.read(65_536):
                got += chunk
                if b"\r\n\r\n" in got:
                    head, _, rest = got.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(x.split(b":")[1])
                            for x in head.lower().split(b"\r\n")
                            if x.startswith(b"content-length")
                        ),
                        None,
                    )
                    if length is not None and len(rest) >= length:
                        break
    writer.close()
    return got


async def test_under_trickling_connections_a_legitimate_request_gets_its_answer(
    broker: Mosquitto, tmp_path: Path
) -> None:
    """Twice the connection bound, each trickling a header line: the cap holds and a real agent is
    answered.

    Scaled down from the issue's 4,200 against 4,096 (bench/proxy_doors.py runs that) to 120 against
    48.
    """
    async with rig(
        broker, tmp_path, max_connections=48, max_connections_per_peer=48, head_timeout_s=3.0
    ) as r:
        r.up.default = Answer("fine")
        host, port = _hostport(r.proxy.url)
        held: list[asyncio.StreamWriter] = []
        stop = asyncio.Event()
        peak = 0

        async def trickle() -> None:
            # Reconnects whenever the proxy closes it: a client that keeps the door as full as it
            # can.
            while not stop.is_set():
                try:
                    reader, writer = await asyncio.open_connection(host, port)
                    held.append(writer)
                    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                    while not stop.is_set() and not reader.at_eof():
                        await asyncio.sleep(0.2)
                        writer.write(b"x-slow: 1\r\n")
                        await writer.drain()
                except (ConnectionError, OSError):
                    await asyncio.sleep(0.05)

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, r.proxy.http.connections)
                await asyncio.sleep(0.005)

        tasks = [asyncio.create_task(trickle()) for _ in range(120)]
        watcher = asyncio.create_task(watch())
        try:
            while r.proxy.http.connections < 48:  # noqa: ASYNC110 - the proxy's state
                await asyncio.sleep(0.01)
            client = r.openai(max_retries=0, timeout=20)
            answers = []
            for _ in range(3):
                res = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
                answers.append(res.choices[0].message.content)
                await asyncio.sleep(0.3)
            assert answers == ["fine"] * 3
        finally:
            stop.set()
            await asyncio.gather(*tasks, watcher, return_exceptions=True)
            for w in held:
                w.close()
        stats = r.proxy.statistics().counts
        assert peak <= 48, peak  # counted at accept: never over the bound
        assert stats["connections_shed"] > 0 and stats.get("connections_refused", 0) == 0


async def test_a_head_that_trickles_past_its_deadline_is_closed(
    broker: Mosquitto, tmp_path: Path
) -> None:
    async with rig(broker, tmp_path, head_timeout_s=0.5) as r:
        reader, writer = await asyncio.open_connection(*_hostport(r.proxy.url))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        began = time.monotonic()
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                await asyncio.sleep(0.1)
                if reader.at_eof():
                    break
                writer.write(b"x-slow: 1\r\n")
                await writer.drain()
                await asyncio.sleep(0)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.01):
                        await reader.read(1)
        # cut near 0.5 s, never left open for 10 s
        assert reader.at_eof() and time.monotonic() - began < 5
        writer.close()


async def test_a_huge_content_length_is_413_at_once(broker: Mosquitto, tmp_path: Path) -> None:
    async with rig(broker, tmp_path) as r:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        )
        began = time.monotonic()
        got = await _raw(r.proxy.url, head + b"content-length: 1000000000000\r\n\r\n{")
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        assert time.monotonic() - began < 4  # answered before any body, not after a read deadline
        assert r.proxy.statistics().counts["too_large"] == 1 and not r.up.seen


@pytest.mark.parametrize(
    "request_line",
    [
        b"POST /v1/../../admin/x HTTP/1.1",
        b"GET /../../../etc/passwd HTTP/1.1",
        b"GET /v1/%2e%2e/%2e%2e/etc/passwd HTTP/1.1",
        b"GET /v1/%2E%2E/admin HTTP/1.1",
        b"GET /v1/%252e%252e/admin HTTP/1.1",
        b"GET /v1/..%5cadmin HTTP/1.1",
        b"GET /v1/./models/../../admin HTTP/1.1",
        b"GET http://evil.example/admin HTTP/1.1",
    ],
)
async def test_a_path_never_leaves_the_upstreams_base(
    broker: Mosquitto, tmp_path: Path, request_line: bytes
) -> None:
    async with rig(broker, tmp_path) as r:
        body = b"{}" if request_line.startswith(b"POST") else b""
        request = (
            request_line
            + b"\r\nhost: x\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        got = await _raw(r.proxy.url, request)
        assert got.startswith(b"HTTP/1.1 400"), got[:200]
        assert r.up.seen == []  # nothing reached the upstream, under its base or outside it
        # The proxy goes on: a normal path on the same upstream is forwarded under its base.
        ok = await _raw(r.proxy.url, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200")
        assert [s.path for s in r.up.seen] == ["/v1/models"]
        assert r.proxy.statistics().counts["bad_path"] == 1


# Finding 4: a text-only (ReAct) agent's observations reach the judge.

REACT = [
    Answer("THOUGHT: read the file.\n```bash\ncat a.py\n```"),
    Answer("THOUGHT: run the tests.\n```bash\npytest -q\n```"),
    Answer("The fix is in. COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
]
OBSERVATIONS = ["<output>def f(): return 1</output>", "<output>1 passed in 0.01s</output>"]


async def _react_agent(client: Any, *, pause_s: float = 0.0) -> None:
    """mini-swe-agent's loop: no tools; each command's output comes back as the next user
    message."""
    messages: list[dict[str, Any]] = [
        {
            "role": "system",
            "content": "You are a helpful assistant that can interact with a computer.",
        },
        {"role": "user", "content": "Fix the failing test in a.py"},
    ]
    for i in range(3):
        res = await client.chat.completions.create(model="m", messages=messages)
        messages.append({"role": "assistant", "content": res.choices[0].message.content})
        if i < 2:
            await asyncio.sleep(pause_s)  # the command runs
            messages.append({"role": "user", "content": OBSERVATIONS[i]})


@pytest.mark.parametrize("pause_s", [0.0, 1.0], ids=["within-grace", "after-grace"])
async def test_a_text_only_agents_observations_reach_the_judge(
    broker: Mosquitto, tmp_path: Path, pause_s: float
) -> None:
    """Each answer looks final (no tool call); the observation comes in the next request, in time or
    late.

    In time (within --final-grace): the step is the answer with its observation, sent once. Late:
    the answer went out as it was and is amended (its text replaced by index) once the observation
    comes. Either way each step holds its own observation, the judge reads every one, and the run
    has one step per turn, none sent twice.
    """
    judge = FakeJudge(lambda p: "P")
    async with rig(broker, tmp_path, judge=judge, final_grace_s=0.5) as r:
        r.up.add(*REACT)
        await _react_agent(r.openai(), pause_s=pause_s)
        rid = r.run_id()
        await r.settle(rid, 3)
        view = r.monitor.run(rid)
        assert view is not None
        texts = [s.text for s in view.steps]
        assert len(texts) == 3, texts
        assert all(obs in "\n".join(texts) for obs in OBSERVATIONS)
        assert OBSERVATIONS[0] in texts[0] and OBSERVATIONS[1] in texts[1]
        last = judge.prompts[-1].text()
        assert all(obs in last for obs in OBSERVATIONS), last
        assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in last


async def test_a_late_observation_amends_its_step_and_the_judge_reads_it_there(
    broker: Mosquitto, tmp_path: Path
) -> None:
    """Past --final-grace, each answer is scored as it was, then amended: the observation is in its
    own step.

    The judge's later prompt shows step 1 as the answer with its output and step 2 without it (no
    `[after step 1]` head); the run has three steps, each sent once, and two amendments, journaled.
    """
    judge = FakeJudge(lambda p: "P")
    async with rig(broker, tmp_path, judge=judge, final_grace_s=0.2) as r:
        r.up.add(*REACT)
        await _react_agent(r.openai(), pause_s=0.8)
        rid = r.run_id()
        await r.settle(rid, 3)
        view = r.monitor.run(rid)
        assert view is not None and len(view.steps) == 3
        # Step 1 was scored before its observation came (the provisional answer), then again once
        # amended.
        early = [p.text() for p in judge.prompts if p.step == 1]
        assert any(OBSERVATIONS[0] not in t for t in early) and any(
            OBSERVATIONS[0] in t for t in early
        )
        last = judge.prompts[-1].text()
        blocks = last.split("\n### Step ")[1:]
        assert len(blocks) == 3, last
        assert OBSERVATIONS[0] in blocks[0] and OBSERVATIONS[1] in blocks[1], last
        assert OBSERVATIONS[0] not in blocks[1] and "[after step" not in last, last
        stats = r.proxy.statistics().counts
        assert stats["steps_sent"] == 3 and stats["amendments_sent"] == 2, stats
        store = r.monitor.store
        assert isinstance(store, SqliteStore)
        exported = await store.export(rid)  # the journal: three steps, the first two amended
        assert exported is not None
        assert [[o in s["text"] for o in OBSERVATIONS] for s in exported["steps"]] == [
            [True, False],
            [False, True],
            [False, False],
        ]
