"""`agent-monitor judge-server` on the real packaged Gemma 3 270M (and SmolLM2 for a chat template).

Everything here runs the command as a user does (a subprocess on a free port,
`tests/llama_models.judge_server`) and talks to it over HTTP: OpenAI's logprobs shapes, prefix reuse
per slot (`cached_tokens`), the same letter logprobs as the in-process judge, the bad-request and
busy answers, the crash report of its supervisor, and `serve --judge openai` scoring steps published
over a real Mosquitto against it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.criteria import load_criteria
from agent_monitor.judges.base import JudgeRequest
from agent_monitor.judges.llamacpp import LlamaCppJudge
from agent_monitor.judges.openai import OpenAIJudge
from agent_monitor.prompts import Prompt, Step, build_prompt
from tests.brokers import Mosquitto
from tests.llama_models import Server, free_port, judge_server, smollm2_path

pytest.importorskip("llama_cpp")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::agent_monitor.judges.llamacpp.TinyJudgeWarning"),
]

TASK = (
    "Make the failing unit test tests/test_parse.py::test_dates pass without breaking the "
    "other tests."
)
ACTIONS = [
    "$ pytest tests/test_parse.py -q\n1 failed: test_dates AssertionError: expected "
    "2024-01-02, got 2024-02-01",
    "$ sed -n 1,40p parse.py\nparse_date() calls datetime.strptime(s, '%Y-%d-%m')",
    "$ apply patch: parse.py uses '%Y-%m-%d'\npatched 1 file",
    "$ pytest tests/test_parse.py -q\n5 passed in 0.12s",
]


def prompt_at(n: int) -> Prompt:
    rubric = load_criteria(None)
    return build_prompt(
        TASK, rubric, [Step(i + 1, ACTIONS[i]) for i in range(n)], rubric.criteria[0]
    )


def call(
    server: Server, path: str, body: object | None = None, *, raw: bytes | None = None
) -> tuple[int, Any]:
    """One request; (status, JSON answer), error statuses included."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(server.url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=240) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def gemma() -> Iterator[Server]:
    with judge_server(n_ctx=2048, args=["--queue", "0"]) as server:
        yield server


def test_models_and_props_name_the_model_and_its_context(gemma: Server) -> None:
    status, models = call(gemma, "/v1/models")
    assert status == 200
    (entry,) = models["data"]
    assert entry["id"] == "gemma-3-270m-q4_k_m" and entry["max_model_len"] == 2048
    status, props = call(gemma, "/props")
    assert status == 200 and props["n_ctx"] == props["default_generation_settings"]["n_ctx"] == 2048
    assert props["total_slots"] == 1


def test_completions_logprobs_shape_and_prefix_reuse(gemma: Server) -> None:
    first, second = prompt_at(2).text(), prompt_at(3).text()
    assert second.startswith(prompt_at(2).prefix_text())
    status, a = call(
        gemma,
        "/v1/completions",
        {"prompt": first, "max_tokens": 1, "logprobs": 5, "temperature": 0},
    )
    assert status == 200, a
    (choice,) = a["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 1
    top = lp["top_logprobs"][0]
    assert 1 <= len(top) <= 5 and all(v <= 0 for v in top.values())
    values = list(top.values())
    assert values == sorted(values, reverse=True)  # likeliest first
    # Greedy: the chosen token is the likeliest, with the same logprob; the text is that token.
    assert lp["tokens"][0] == next(iter(top)) and math.isclose(lp["token_logprobs"][0], values[0])
    assert choice["text"] == lp["tokens"][0] and choice["finish_reason"] == "length"
    usage = a["usage"]
    assert usage["completion_tokens"] == 1 and usage["total_tokens"] == usage["prompt_tokens"] + 1
    # The next step's prompt extends this one's head: the slot keeps that prefix and evaluates the
    # rest.
    status, b = call(
        gemma,
        "/v1/completions",
        {"prompt": second, "max_tokens": 1, "logprobs": 5, "temperature": 0},
    )
    assert status == 200, b
    kept = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0.5 * usage["prompt_tokens"] < kept < b["usage"]["prompt_tokens"]
    # The same prompt again: nothing evaluated, the same answer.
    status, c = call(
        gemma,
        "/v1/completions",
        {"prompt": second, "max_tokens": 1, "logprobs": 5, "temperature": 0},
    )
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == c["usage"]["prompt_tokens"]
    assert c["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
    print(
        f"\njudge-server prefix reuse: {kept} of {b['usage']['prompt_tokens']} prompt tokens kept"
    )


async def test_letter_logprobs_match_the_in_process_judge(gemma: Server) -> None:
    # Built the same way (repacking off, full-size sliding-window cache), the server's top logprobs
    # at the answer position are the in-process judge's exact letter logprobs for the same prompt.
    prompt = prompt_at(4)
    async with OpenAIJudge(base_url=gemma.url + "/v1", api="completions", timeout_s=240) as remote:
        served = await remote.grade(JudgeRequest(prompt))
    local = LlamaCppJudge(n_ctx=2048)
    try:
        exact = (await local.grade(JudgeRequest(prompt))).samples[0]
    finally:
        await local.aclose()
    got = served.samples[0]
    assert isinstance(got, dict) and isinstance(exact, dict)
    shared = [t for t in got if t in exact]
    assert shared, f"no letter in the server's top 20: {sorted(got, key=got.__getitem__)[-5:]}"
    for token in shared:
        assert math.isclose(got[token], exact[token], abs_tol=1e-3), (
            token,
            got[token],
            exact[token],
        )
    print(f"\nserver vs in-process letter logprobs agree on {len(shared)} letter tokens")


def test_bad_requests_are_400s_that_say_what_is_wrong(gemma: Server) -> None:
    status, err = call(gemma, "/v1/completions", raw=b'{"prompt": "x",')
    assert status == 400 and "not valid JSON" in err["error"]["message"]
    status, err = call(gemma, "/v1/completions", {"prompt": 3})
    assert status == 400 and "`prompt` must be a string" in err["error"]["message"]
    status, err = call(gemma, "/v1/completions", {"prompt": "x", "logprobs": 50})
    assert status == 400 and "`logprobs`" in err["error"]["message"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    status, err = call(
        gemma, "/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]}
    )
    assert status == 400 and "image input is not supported" in err["error"]["message"]
    status, err = call(gemma, "/v1/completions", {"prompt": "word " * 3000, "max_tokens": 1})
    assert status == 400 and "maximum context length is 2048 tokens" in err["error"]["message"]
    status, err = call(gemma, "/v1/nothing", {})
    assert status == 404 and "POST /v1/completions" in err["error"]["message"]
    assert call(gemma, "/health")[0] == 200  # and the server goes on


def test_a_request_past_the_queue_is_a_503_while_the_slot_works(gemma: Server) -> None:
    # One slot, --queue 0: while a cold ~1,700-token prompt is evaluated, a second request is
    # refused at once.
    filler = " ".join(f"line {i}: collected item ok." for i in range(180))
    slow: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: slow.update(
            r=call(gemma, "/v1/completions", {"prompt": filler, "max_tokens": 1})
        )
    )
    worker.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    status, err = call(gemma, "/v1/completions", {"prompt": "Say A.", "max_tokens": 1})
    refused_in = time.monotonic() - t0
    worker.join()
    assert slow["r"][0] == 200, slow
    assert status == 503 and "every slot is busy" in err["error"]["message"], err
    assert refused_in < 1.0


def test_chat_logprobs_shape_with_a_chat_template() -> None:
    with judge_server(smollm2_path(), n_ctx=2048) as server:
        body = {
            "messages": [
                {"role": "system", "content": "Answer with one letter."},
                {"role": "user", "content": "A or B?"},
            ],
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 3,
            "temperature": 0,
        }
        status, a = call(server, "/v1/chat/completions", body)
        assert status == 200, a
        (choice,) = a["choices"]
        content = choice["logprobs"]["content"]
        assert 1 <= len(content) <= 2 and choice["message"]["role"] == "assistant"
        for entry in content:
            assert entry["logprob"] <= 0 and bytes(entry["bytes"]).decode() == entry["token"]
            assert len(entry["top_logprobs"]) == 3
            assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
        assert content[0]["token"] == content[0]["top_logprobs"][0]["token"]  # greedy
        # A control token's spelling in a message is text, not a turn: the prompt is longer than the
        # marker.
        status, b = call(
            server,
            "/v1/chat/completions",
            {**body, "messages": [{"role": "user", "content": "<|im_end|>"}]},
        )
        status_plain, c = call(
            server, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": ""}]}
        )
        assert status == status_plain == 200
        assert b["usage"]["prompt_tokens"] > c["usage"]["prompt_tokens"] + 1


def _child_pid(pid: int) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.1)
    raise AssertionError(f"judge-server (pid {pid}) started no child")


def test_a_model_process_killed_by_a_signal_is_reported_with_its_cause() -> None:
    # judge-server runs its model in a child; a crash in llama.cpp's native code kills that child
    # with a signal. Stand in for the crash with a real SIGSEGV: the command names it, the cause and
    # the way around.
    with pytest.raises(RuntimeError) as caught, judge_server(n_ctx=256) as server:
        # The test helper turns the client's dropped connection into the same report.
        child = _child_pid(server.process.pid)
        os.kill(child, signal.SIGSEGV)
        server.process.wait(30)
        call(server, "/v1/models")
    message = str(caught.value)
    assert server.process.returncode == 128 + signal.SIGSEGV
    assert (
        "died from SIGSEGV" in message
        and "weight repacking" in message
        and "judge-server" in message
    )
    # The supervisor's own line (it names the child it ran), in the server's log the error quotes.
    assert (
        f"agent-monitor: agent-monitor judge-server (pid {child}) died from SIGSEGV (signal 11)"
    ) in message


@pytest.mark.timeout(600)  # two steps, each given up to 240 s on a loaded machine
def test_serve_scores_published_steps_with_a_real_model_behind_judge_server(
    broker: Mosquitto,
) -> None:
    from tests.cli.test_serve_cli import Watch, pub, serve, wait_serving

    with (
        judge_server(n_ctx=4096) as judge,
        serve(
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url + "/v1",
            "--judge-timeout",
            "240",
            "--min-mass",
            "0.001",
            "--metrics-port",
            "0",
        ) as proc,
    ):
        wait_serving(proc, timeout=60)
        with Watch(broker.port, "agents/real-1/#") as out:
            pub(broker.port, "agents/real-1/start", json.dumps({"task": TASK}))
            for i, text in enumerate(ACTIONS[:2], start=1):
                pub(broker.port, "agents/real-1/step", json.dumps({"index": i, "text": text}))
                out.until(
                    lambda m, i=i: m[0] == "agents/real-1/progress" and m[1]["step"] == i,
                    timeout=240,
                )
        progress = [p for t, p in out.seen if t.endswith("/progress")]
    assert [p["step"] for p in progress] == [1, 2]
    for p in progress:
        assert p["ok"], p
        assert 0.0 <= p["score"] <= 1.0 and 0.0 < p["mass"] <= 1.0
        assert p["model"] == "gemma-3-270m-q4_k_m" and p["tokens"]["input"] > 0
    # The second step's prompt shares the first's head: the server kept it.
    assert progress[1]["tokens"]["cached_input"] > 0
    print(
        f"\nserve + judge-server: scores {[round(p['score'], 3) for p in progress]}, mass "
        f"{[p['mass'] for p in progress]}"
    )


def test_judge_server_refuses_a_missing_model_file_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_monitor",
            "judge-server",
            "--model",
            str(tmp_path / "none.gguf"),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no GGUF model file at" in done.stderr
