"""OpenAIJudge's lean transport against its SDK transport: the same request bodies, answers and
failures."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from agent_monitor import OpenAIJudge
from agent_monitor.criteria import load_criteria
from agent_monitor.judges.base import JudgeError, JudgeRequest
from agent_monitor.prompts import Step, build_prompt
from tests.openai_server import Reply, chat_choice, chat_reply, completion_reply, scripted_server

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ("lean", "sdk")
DIST = {"K": 0.5, "L": 0.3, "M": 0.15, "The": 0.05}


def prompt() -> Any:
    rubric = load_criteria("progress")
    return build_prompt(
        "Make the test pass.", rubric, [Step(1, "ran pytest: 1 failed")], rubric.criteria[0]
    )


async def grade_both(
    script: list[Reply], **kw: Any
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Grade once per transport, each against a fresh server with the same script; the answers
    and bodies."""
    answers: dict[str, Any] = {}
    bodies: dict[str, list[dict[str, Any]]] = {}
    for transport in TRANSPORTS:
        with scripted_server() as server:
            server.add(*script)
            async with OpenAIJudge(
                server.url, model="m", transport=transport, backoff_s=0.0, **kw
            ) as judge:  # type: ignore[arg-type]
                try:
                    answers[transport] = await judge.grade(
                        JudgeRequest(prompt(), repeats=kw.get("n", 1) or 1)
                    )
                except JudgeError as e:
                    answers[transport] = e
            bodies[transport] = server.requests
    return answers, bodies


async def test_the_default_is_lean_and_a_client_means_sdk() -> None:
    from openai import AsyncOpenAI

    assert OpenAIJudge("http://127.0.0.1:9/v1").transport == "lean"
    client = AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")
    assert OpenAIJudge(client=client).transport == "sdk"
    with pytest.raises(ValueError, match="not client="):
        OpenAIJudge(client=client, transport="lean")
    with pytest.raises(ValueError, match="transport='fast'"):
        OpenAIJudge("http://127.0.0.1:9/v1", transport="fast")  # type: ignore[arg-type]
    await client.close()


@pytest.mark.parametrize(
    ("kw", "script"),
    [
        ({}, [chat_reply(chat_choice([("K", DIST)]), prompt_tokens=900, cached=800)]),
        (
            {"prefill": "Grade: ", "constrain": True, "extra_body": {"user": "u1"}},
            [chat_reply(chat_choice([("K", DIST)]))],
        ),
        ({"api": "completions"}, [completion_reply([DIST])]),
        (
            {"logprobs": False, "samples": 3},
            [chat_reply(*(chat_choice([(t, {t: 1.0})], i) for i, t in enumerate("KKL")))],
        ),
    ],
    ids=["chat", "prefill-constrain-extra", "completions", "sampled"],
)
async def test_both_transports_send_the_same_body_and_read_the_same_answer(
    kw: dict[str, Any], script: list[Reply]
) -> None:
    answers, bodies = await grade_both(script, **kw)
    lean, sdk = answers["lean"], answers["sdk"]
    assert not isinstance(lean, BaseException) and not isinstance(sdk, BaseException), answers
    assert lean.samples == sdk.samples and lean.usage == sdk.usage and lean.model == sdk.model
    assert bodies["lean"] == bodies["sdk"] and len(bodies["lean"]) == 1
    if kw.get("prefill"):
        assert (
            bodies["lean"][0]["continue_final_message"] is True
            and bodies["lean"][0]["user"] == "u1"
        )


@pytest.mark.parametrize(
    ("reply", "reason", "text"),
    [
        (
            Reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}),
            "rate_limited",
            "HTTP 429",
        ),
        (Reply(500, {"error": {"message": "boom"}}), "server_error", "HTTP 500"),
        (Reply(401, {"error": {"message": "bad key"}}), "auth", "refused the API key"),
        (Reply(404, {"error": {"message": "no model"}}), "not_found", "check base_url"),
        (
            Reply(400, {"error": {"message": "logprobs not supported"}}),
            "bad_request",
            "logprobs not supported",
        ),
        (Reply(200, {"object": "chat.completion"}), "bad_response", "without a `choices` list"),
        (
            Reply(200, {"choices": [{"logprobs": {"content": [{"token": 1}]}}]}),
            "bad_response",
            "unexpected shape",
        ),
    ],
    ids=["429", "500", "401", "404", "400", "no-choices", "bad-shape"],
)
async def test_both_transports_fail_the_same_way(reply: Reply, reason: str, text: str) -> None:
    answers, _ = await grade_both([reply] * 4, max_retries=0)
    for transport, answer in answers.items():
        assert isinstance(answer, JudgeError), (transport, answer)
        assert answer.reason == reason and text in str(answer), (transport, str(answer))
    assert answers["lean"].retryable == answers["sdk"].retryable


async def test_lean_images_refused_fall_back_to_placeholders_like_the_sdk() -> None:
    from PIL import Image

    from agent_monitor.images import load_image

    rubric = load_criteria("robot")
    frame = load_image(Image.new("RGB", (8, 8), (0, 0, 255)))
    p = build_prompt("Pick up the cup.", rubric, [Step(1, "moved", (frame,))], rubric.criteria[0])
    with scripted_server() as server:
        server.add(
            Reply(400, {"error": {"message": "m is not a multimodal model"}}),
            chat_reply(chat_choice([("K", DIST)])),
        )
        async with OpenAIJudge(server.url, model="m") as judge:
            resp = await judge.grade(JudgeRequest(p))
    assert resp.images_dropped == 1 and not judge.sends_images("m")
    # first with the image part
    assert isinstance(server.requests[0]["messages"][1]["content"], list)
    # then the placeholder text
    assert isinstance(server.requests[1]["messages"][1]["content"], str)


async def test_lean_keeps_connections_alive_and_bounds_them() -> None:
    with scripted_server() as server:
        server.default = chat_reply(chat_choice([("K", DIST)]))
        async with OpenAIJudge(server.url, model="m", concurrency=3) as judge:
            await asyncio.gather(*(judge.grade(JudgeRequest(prompt())) for _ in range(30)))
            pool = judge._transport.pool
            # the 30 grades, and /v1/models asked for the context
            assert pool is not None and pool.requests == 31
            assert pool.opened <= 6  # at most 2 x concurrency, reused for the rest


@contextmanager
def closing_server() -> Iterator[tuple[str, list[int]]]:
    """An HTTP/1.1 server that answers one request per connection and then closes it without
    saying so."""
    body = json.dumps(chat_reply(chat_choice([("K", DIST)])).body).encode()
    head = (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                headers, _, rest = data.partition(b"\r\n\r\n")
                length = int(
                    next(
                        h.split(b":")[1]
                        for h in headers.split(b"\r\n")
                        if h.lower().startswith(b"content-length")
                    )
                )
                while len(rest) < length:
                    rest += conn.recv(65536)
                # keep-alive by HTTP/1.1's default, then closed: a stale idle connection
                conn.sendall(head + body)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", accepted
    finally:
        stop.set()
        t.join(5)
        sock.close()


async def test_lean_retries_a_request_on_a_fresh_connection_when_an_idle_one_was_closed() -> None:
    with closing_server() as (url, accepted):
        # The context set: the server is not asked for it (this one answers every request with a
        # completion).
        async with OpenAIJudge(url, model="m", max_retries=0, context_tokens=8192) as judge:
            for _ in range(3):
                await asyncio.sleep(0.05)  # the server has closed the previous connection by now
                resp = await judge.grade(JudgeRequest(prompt()))
                assert resp.samples[0]
    assert len(accepted) == 3  # a new connection each time, and no call failed for the stale one


async def test_lean_timeout_and_refused_connection_are_judge_errors() -> None:
    with scripted_server() as server:
        server.add(Reply(body={}, delay_s=2.0))
        async with OpenAIJudge(server.url, model="m", timeout_s=0.3, max_retries=0) as judge:
            with pytest.raises(JudgeError) as e:
                await judge.grade(JudgeRequest(prompt()))
        assert e.value.reason == "timeout" and e.value.retryable
    async with OpenAIJudge("http://127.0.0.1:9/v1", model="m", max_retries=0) as judge:
        with pytest.raises(JudgeError) as e:
            await judge.grade(JudgeRequest(prompt()))
    assert e.value.reason == "connection" and (
        "cannot reach the judge server at http://127.0.0.1:9/v1 "
    ) in str(e.value)
    assert str(e.value).count("127.0.0.1:9") == 1  # the server named once


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_error_status_on_models_is_a_judge_error_on_both_transports(
    transport: str,
) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NoModels(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"error": {"message": "no models here"}}'
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NoModels)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/v1"
        async with OpenAIJudge(url, transport=transport, max_retries=0) as judge:  # type: ignore[arg-type]
            with pytest.raises(JudgeError) as e:
                await judge.resolve_model()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (
        e.value.reason == "not_found" and "no models here" in str(e.value) and not e.value.retryable
    )
