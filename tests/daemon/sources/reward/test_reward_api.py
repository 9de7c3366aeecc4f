"""The reward endpoints: a real daemon answering requests built exactly as OpenRLHF's and slime's
clients build them.

Neither framework installs without a GPU stack (torch, vLLM / SGLang, Megatron), so their client
calls are reproduced here with the same library (aiohttp), the same payload and the same handling of
the answer:

- OpenRLHF/OpenRLHF@3c3be6234e0cb353e76bb8019947db9dfe99fca7, openrlhf/utils/agent.py,
  `SingleTurnAgentExecutor._fetch_rewards_via_http` and its `_post_request` (one ClientSession per
  try, `ClientTimeout(total=180)`, `raise_for_status`, 5 tries 1 s apart), then `execute` reading
  `rewards` / `scores` / `extra_logs` (each extra log becomes `torch.tensor([value])`:
  openrlhf/trainer/ppo_utils/samples_generator.py);
- THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515, slime/rollout/rm_hub/__init__.py,
  `remote_rm` (a shared session, `ClientTimeout(total=120)`, `raise_for_status`, the JSON answer is
  the reward).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.calibration import Calibration, Family, Point, Sample
from agent_monitor.daemon import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    MemoryStore,
    Monitor,
    MonitorConfig,
    RewardApiSettings,
    RewardSource,
    Route,
)
from agent_monitor.daemon.sources.reward._api import pass_probability
from agent_monitor.daemon.sources.reward._steps import from_messages, from_text
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.scale import LETTERS
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings
from tests.brokers import Mosquitto
from tests.daemon.test_daemon_mqtt import harness

pytestmark = pytest.mark.timeout(60)

CHATML = (
    "<|im_start|>system\nYou are a coding agent.<|im_end|>\n"
    "<|im_start|>user\nMake the failing test in calc.py pass.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
RESPONSE = (
    'I will read the file.<tool_call>{"name": "cat", "arguments": {"path": '
    '"calc.py"}}</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>def add(a, b): return a - b</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nFixed: add returns a + b; the test passes.<|im_end|>"
)


def by_steps(prompt: Prompt) -> str:
    """One letter per step seen: a 2-step rollout scores C (2/19), a 3-step one D."""
    return LETTERS[min(prompt.step, 19)]


@asynccontextmanager
async def daemon(
    judge: FakeJudge, settings: RewardApiSettings | None = None, **config: Any
) -> AsyncIterator[tuple[Monitor, RewardSource, str, CollectorRegistry]]:
    """A monitor with the reward endpoints on its metrics port's server (as `serve --reward-api`
    builds it)."""
    registry = CollectorRegistry()
    http = HttpServer(registry, port=0)
    source = RewardSource(
        http, settings or RewardApiSettings(reward_api=True, timeout_s=20), registry=registry
    )
    await http.bind()
    mon = Monitor(
        MonitorConfig(**config),
        judge=judge,
        store=MemoryStore(),
        registry=registry,
        sources=[source],
        http=http,
    )
    source.calibration = mon.calibration
    async with mon:
        # the source mounts its routes when its task starts
        await asyncio.wait_for(source.ready.wait(), 10)
        yield mon, source, http.url.rstrip("/"), registry


async def openrlhf_fetch(
    url: str, queries: list[str], prompts: list[str], labels: list[Any]
) -> list[Any]:
    """OpenRLHF's `_fetch_rewards_via_http` with one server, as written
    (openrlhf/utils/agent.py@3c3be62)."""
    timeout = aiohttp.ClientTimeout(total=180)
    payload = {"query": queries, "prompts": prompts, "labels": labels}

    async def _post_request(url: str, data: dict[str, Any], try_max_times: int = 5) -> Any:
        for _ in range(try_max_times):
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session:  # noqa: SIM117 (as OpenRLHF wrote it)
                    async with session.post(url, json=data) as response:
                        response.raise_for_status()
                        return await response.json()
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
        raise RuntimeError(
            f"Request error for {try_max_times} times, returning None. Please check the API server."
        )

    return list(await asyncio.gather(asyncio.create_task(_post_request(url, payload))))


async def slime_remote_rm(rm_url: str, prompt: Any, response: str, label: Any) -> Any:
    """slime's `remote_rm`, one try (slime/rollout/rm_hub/__init__.py@624b824)."""
    payload = {"prompt": prompt, "response": response, "label": label}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(  # noqa: SIM117
        connector=aiohttp.TCPConnector(limit=64), timeout=timeout
    ) as session:
        async with session.post(rm_url, json=payload) as resp:
            resp.raise_for_status()
            return await resp.json()


async def post(
    url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    kind = headers or {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=kind) as r:
        text = await r.text()
        try:
            data = json.loads(text)
        except ValueError:
            data = text
        return r.status, data, dict(r.headers)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


# -- step splitting --


def test_a_chatml_query_splits_into_the_task_and_one_step_per_turn_and_tool_call() -> None:
    r = from_text(CHATML + RESPONSE, prompt=CHATML, max_steps=64)
    assert r.task == "Make the failing test in calc.py pass."
    assert len(r.steps) == 2 and r.rule == "tool_calls"
    # the result joins it
    assert r.steps[0].startswith("I will read the file.<tool_call>") and "a - b" in r.steps[0]
    assert r.steps[1] == "Fixed: add returns a + b; the test passes."
    # system prompt aside
    assert "<|im_end|>" not in "".join(r.steps) and "coding agent" not in "".join(r.steps)


def test_plain_text_is_one_step_and_too_many_steps_are_joined_into_the_last() -> None:
    r = from_text("The answer is 4.", prompt="What is 2 + 2?", max_steps=64)
    assert (r.task, r.steps, r.rule) == ("What is 2 + 2?", ("The answer is 4.",), "whole")
    calls = "".join(f"<tool_call>{i}</tool_call>" for i in range(10))
    r = from_text(calls, prompt="do it", max_steps=3)
    assert len(r.steps) == 3 and r.steps[2].count("<tool_call>") == 8


def test_chat_messages_split_like_the_proxy_splits_a_conversation() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "a.txt b.txt"},
    ]
    r = from_messages(messages, response="There are two files.", max_steps=64)
    assert r.task == "List the files."
    assert r.steps == ("[tool call] ls({})\n[tool result] a.txt b.txt", "There are two files.")


# -- the endpoints, called as the trainers call them --


async def test_openrlhf_gets_rewards_scores_and_numeric_extra_logs() -> None:
    judge = FakeJudge(by_steps)
    async with daemon(judge) as (_, source, url, registry):
        (answer,) = await openrlhf_fetch(
            f"{url}/get_reward", [CHATML + RESPONSE], [CHATML], ["a + b"]
        )
    assert set(answer) == {"rewards", "scores", "extra_logs"}
    assert answer["rewards"] == answer["scores"] == [pytest.approx(2 / 19)]  # two steps: C
    # Every extra log is a list of numbers (OpenRLHF makes torch.tensor([value]) of each).
    for values in answer["extra_logs"].values():
        assert all(isinstance(v, (int, float)) for v in values)
    assert answer["extra_logs"]["steps"] == [2] and answer["extra_logs"]["stop_judged"] == [0]
    # One judge call for the whole rollout (final shape): it saw the task, both steps and the label.
    (prompt,) = judge.prompts
    text = "".join(p.text for p in prompt.parts if hasattr(p, "text")) + prompt.instructions
    assert "Make the failing test in calc.py pass." in text and "Fixed: add returns a + b" in text
    assert (
        sample(
            registry, "agent_monitor_reward_requests_total", endpoint="/get_reward", status="200"
        )
        == 1
    )
    assert source.statistics().inflight == 0


async def test_slime_gets_a_bare_number_or_a_dict_and_chat_message_prompts_work() -> None:
    async with daemon(FakeJudge(by_steps)) as (_, _, url, _):
        reward = await slime_remote_rm(f"{url}/slime/reward", CHATML, RESPONSE, "a + b")
        assert reward == pytest.approx(2 / 19)
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        assert await slime_remote_rm(f"{url}/slime/reward", messages, "4", "4") == pytest.approx(
            1 / 19
        )
        d = await slime_remote_rm(f"{url}/slime/reward?form=dict", messages, "4", "4")
    assert (
        d["reward"] == pytest.approx(1 / 19)
        and d["stop_kind"] is None
        and d["verdict"] == "continue"
    )


async def test_native_dense_scores_every_prefix_and_gives_each_steps_delta() -> None:
    judge = FakeJudge(by_steps)
    async with daemon(judge) as (_, _, url, _):
        status, a, _ = await post(
            f"{url}/v1/score",
            json.dumps(
                {
                    "task": "Sort the list",
                    "steps": ["read it", {"text": "sorted it"}, "checked"],
                    "shape": "dense",
                }
            ).encode(),
        )
    assert status == 200, a
    assert [s["step"] for s in a["steps"]] == [1, 2, 3] and judge.calls_made == 3
    assert a["steps"][0]["delta"] is None
    assert [s["delta"] for s in a["steps"][1:]] == [pytest.approx(1 / 19)] * 2
    assert (
        a["reward"] == pytest.approx(1 / 19)
        and a["score"] == pytest.approx(3 / 19)
        and a["shape"] == "dense"
    )
    assert a["progress"]["ok"] is True and a["uncertainty"] is not None


async def test_a_judged_abort_says_judged_in_the_answer() -> None:
    policy = Policy(abort_below=0.5, min_steps=1, patience=1)
    async with daemon(FakeJudge(lambda p: "B"), policy=policy) as (_, _, url, _):
        status, a, _ = await post(
            f"{url}/v1/score", json.dumps({"task": "t", "steps": ["a", "b"]}).encode()
        )
    assert status == 200 and a["verdict"] == "abort" and a["stop_kind"] == "judged"
    assert a["progress"]["decision"]["stop_kind"] == "judged"  # the progress message says it too


# -- failures --


async def test_a_failed_judge_is_a_retryable_503_never_a_score_and_the_retry_rescores_only_it() -> (
    None
):
    calls: list[str] = []

    def judge_fn(prompt: Prompt) -> Any:
        text = "".join(getattr(p, "text", "") for p in prompt.parts)
        calls.append(text)
        if "flaky" in text and sum("flaky" in c for c in calls) == 1:
            return FakeJudge.failure("server_error")
        return "K"

    async with daemon(FakeJudge(judge_fn)) as (_, _, url, registry):
        body = {
            "query": ["first answer", "flaky answer", "third answer"],
            "prompts": ["q1", "q2", "q3"],
        }
        status, a, headers = await post(f"{url}/get_reward", json.dumps(body).encode())
        assert status == 503 and headers.get("Retry-After") == "1"
        assert a["stop_kind"] == "infra" and a["failed"] == [1] and "rewards" not in a
        # OpenRLHF retries the whole batch: only the failed rollout is scored again.
        before = len(calls)
        (answer,) = await openrlhf_fetch(
            f"{url}/get_reward", body["query"], body["prompts"], [None] * 3
        )
        assert len(calls) == before + 1
        assert answer["rewards"] == [pytest.approx(10 / 19)] * 3
        assert sample(registry, "agent_monitor_reward_rollouts_total", outcome="infra") == 1
        assert sample(registry, "agent_monitor_reward_rollouts_total", outcome="cached") == 2
        # slime: a failed judge is an error status (slime retries it), not a reward.
        calls.clear()
        status, a, _ = await post(
            f"{url}/slime/reward",
            json.dumps({"prompt": "p", "response": "flaky", "label": None}).encode(),
        )
        assert status == 503 and a["stop_kind"] == "infra"


async def test_one_infra_failure_in_a_group_stops_only_that_rollout() -> None:
    def judge_fn(prompt: Prompt) -> Any:
        text = "".join(getattr(p, "text", "") for p in prompt.parts)
        return FakeJudge.failure("timeout") if "flaky" in text else ("R" if "good" in text else "M")

    policy = {"keep_top": 1, "prune_margin": 0.05, "min_steps": 1, "patience": 1}
    async with daemon(FakeJudge(judge_fn)) as (_, _, url, _):
        bodies = [
            {
                "task": "Sort",
                "group": "g1",
                "policy": policy,
                "steps": [f"{kind} attempt"],
                "shape": "dense",
            }
            for kind in ("good", "flaky", "fine")
        ]
        answers = await asyncio.gather(
            *(post(f"{url}/v1/score", json.dumps(b).encode()) for b in bodies)
        )
    (s1, good, _), (s2, flaky, _), (s3, fine, _) = answers
    assert s2 == 503 and flaky["stop_kind"] == "infra"
    assert (
        s1 == s3 == 200 and good["stop_kind"] is None and good["reward"] == pytest.approx(17 / 19)
    )
    assert fine["score"] == pytest.approx(12 / 19) and fine["stop_kind"] in (None, "judged")
    assert good["verdict"] != "abort"  # the failed sibling counted nothing against the leader


async def test_bad_bodies_are_4xx_with_a_reason_and_counted() -> None:
    settings = RewardApiSettings(reward_api=True, max_body_bytes=4096, max_batch=2)
    async with daemon(FakeJudge(by_steps), settings) as (_, _, url, registry):
        cases = [
            ("/get_reward", b"{not json", 400, "bad_json"),
            ("/get_reward", b"[1, 2]", 400, "bad_body"),
            ("/get_reward", b'{"query": "one string"}', 400, "bad_body"),
            ("/get_reward", b'{"query": ["a"], "prompts": ["x", "y"]}', 400, "bad_body"),
            ("/get_reward", b'{"query": ["a", "b", "c"]}', 413, "batch_too_large"),
            ("/get_reward", b'{"query": [""]}', 422, "bad_rollout"),
            ("/slime/reward", b'{"prompt": "p"}', 400, "bad_body"),
            ("/v1/score", b'{"task": "t"}', 400, "bad_body"),
            ("/v1/score", b'{"task": "t", "steps": ["a"], "shape": "sharp"}', 400, "bad_shape"),
            ("/v1/score", b'{"run_id": "nobody"}', 404, "not_live"),
        ]
        for path, body, status, reason in cases:
            got, answer, _ = await post(url + path, body)
            assert got == status, (path, body, answer)
            assert isinstance(answer, dict) and answer["error"]
            assert (
                sample(registry, "agent_monitor_reward_refused_total", endpoint=path, reason=reason)
                >= 1
            )
        # Over the body bound: refused before it is read, counted.
        got, answer, _ = await post(url + "/get_reward", b'{"query": ["' + b"x" * 8000 + b'"]}')
        assert got == 413 and "4096" in answer
        assert sample(
            registry,
            "agent_monitor_reward_refused_total",
            endpoint="/get_reward",
            reason="body_too_large",
        )
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/get_reward") as r:
                assert r.status == 405 and r.headers["Allow"] == "POST"
            async with s.post(url + "/slime/reward", data=_chunks()) as r:  # no Content-Length: 411
                assert r.status == 411
            async with s.get(url + "/metrics") as r:  # the metrics port still serves its own routes
                assert r.status == 200 and "agent_monitor_reward_refused_total" in await r.text()


async def test_with_a_token_a_request_without_it_is_401_and_the_url_can_carry_it() -> None:
    settings = RewardApiSettings(reward_api=True, token="s3cret")
    async with daemon(FakeJudge(by_steps), settings) as (_, _, url, registry):
        body = json.dumps({"prompt": "p", "response": "r", "label": None}).encode()
        status, a, _ = await post(f"{url}/slime/reward", body)
        assert status == 401 and "--reward-token" in a["error"]
        assert (await post(f"{url}/slime/reward?token=wrong", body))[0] == 401
        assert (
            sample(
                registry,
                "agent_monitor_reward_refused_total",
                endpoint="/slime/reward",
                reason="unauthorized",
            )
            == 2
        )
        # As the trainers send it: the token in --rm-url's query; or a bearer header.
        assert await slime_remote_rm(
            f"{url}/slime/reward?token=s3cret", "p", "r", None
        ) == pytest.approx(1 / 19)
        status, _, _ = await post(f"{url}/slime/reward", body, {"Authorization": "Bearer s3cret"})
        assert status == 200


async def _chunks() -> AsyncIterator[bytes]:
    yield b'{"prompt": "p", '
    yield b'"response": "r"}'


async def test_refused_input_in_native_steps_is_422_naming_what_was_wrong() -> None:
    async with daemon(FakeJudge(by_steps)) as (_, _, url, _):
        status, a, _ = await post(
            f"{url}/v1/score", json.dumps({"task": "t", "steps": [{"txt": "typo"}]}).encode()
        )
    assert status == 422 and "refused" in a["error"]


async def test_the_route_seam_mounts_unmounts_and_survives_a_failing_handler() -> None:
    seen: list[HttpRequest] = []
    refused: list[str] = []

    async def echo(req: HttpRequest) -> HttpResponse:
        seen.append(req)
        if req.body == b"boom":
            raise RuntimeError("a bug in a handler")
        return HttpResponse(201, req.body, "text/plain")

    async with HttpServer(CollectorRegistry(), port=0) as http:
        http.mount("/echo", Route(echo, max_body_bytes=16, on_refused=refused.append))
        with pytest.raises(ValueError, match="served already"):
            http.mount("/metrics", Route(echo))
        url = http.url + "echo"
        assert (await post(f"{url}?a=1", b"hello", {"X-Test": "yes"}))[:2] == (201, "hello")
        assert (seen[0].method, seen[0].query, seen[0].headers["x-test"]) == ("POST", "a=1", "yes")
        assert (await post(url, b"boom"))[0] == 500  # logged; the server goes on
        assert (await post(url, b"x" * 17))[0] == 413 and refused == ["body_too_large"]
        http.unmount("/echo")
        # a path nobody serves now: a wrong path, not a wrong method
        assert (await post(url, b"hello"))[0] == 404
        assert http.statistics().refused == {"body_too_large": 1, "path": 1}


# -- calibrated rewards --


def test_the_pass_probability_comes_from_the_familys_ended_runs() -> None:
    family = Family("f", "fake-1", "r")
    cal = Calibration()
    assert pass_probability(cal, family, 0.9)[0] is None
    for i in range(40):
        final = i / 40
        cal.add(Sample(f"r{i}", family, final >= 0.5, (Point(1, final, 0.01),)))
    high, why = pass_probability(cal, family, 0.95)
    low, _ = pass_probability(cal, family, 0.05)
    assert (
        high is not None and low is not None and high > 0.8 > 0.2 > low and "40 ended runs" in why
    )


async def test_calibrated_rewards_fall_back_to_the_final_score_until_the_family_is_calibrated() -> (
    None
):
    body = json.dumps(
        {"task": "t", "family": "sorting", "steps": ["a"], "shape": "calibrated"}
    ).encode()
    async with daemon(FakeJudge(lambda p: "S")) as (mon, _, url, registry):
        status, a, _ = await post(f"{url}/v1/score", body)
        assert status == 200 and a["shape"] == "final" and "not calibrated" in a["note"]
        assert a["reward"] == a["score"] == pytest.approx(18 / 19)
        assert sample(registry, "agent_monitor_reward_calibration_fallbacks_total") == 1
        # The family's ended runs: those that ended near 0.95 passed.
        family = Family("sorting", a["progress"]["model"], a["progress"]["rubric"])
        for i in range(30):
            final = i / 30
            mon.calibration.add(Sample(f"old-{i}", family, final > 0.6, (Point(1, final, 0.01),)))
        # not the cached answer
        status, a, _ = await post(f"{url}/v1/score", body.replace(b'["a"]', b'["b"]'))
    assert status == 200 and a["shape"] == "calibrated" and "30 ended runs" in a["note"]
    assert a["reward"] > 0.8 and a["score"] == pytest.approx(18 / 19)


# -- a live run over MQTT --


async def test_a_live_mqtt_run_is_scored_by_id_and_its_signal_says_judged(
    broker: Mosquitto,
) -> None:
    registry = CollectorRegistry()
    http = HttpServer(registry, port=0)
    source = RewardSource(http, RewardApiSettings(reward_api=True), registry=registry)
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=Policy(abort_below=0.3, min_steps=1, patience=1),
    )
    async with (
        Monitor(
            config, judge=FakeJudge(lambda p: "B"), registry=registry, sources=[source], http=http
        ),
        harness(broker.port) as h,
    ):
        await asyncio.wait_for(source.ready.wait(), 10)
        await h.publish("live-1", "start", {"task": "Make the test pass"})
        await h.publish("live-1", "step", {"index": 1, "text": "ran pytest"})
        await h.until(lambda: bool(h.seen[("live-1", "signal")]))
        status, a, _ = await post(f"{http.url}v1/score", json.dumps({"run_id": "live-1"}).encode())
    signal = h.seen[("live-1", "signal")][-1]
    assert signal["signal"] == "abort" and signal["stop_kind"] == "judged"
    assert status == 200 and a["live"] is True and a["score"] == pytest.approx(1 / 19)
    assert (
        a["verdict"] == "abort"
        and a["stop_kind"] == "judged"
        and [s["step"] for s in a["steps"]] == [1]
    )


# -- as a user runs it --


def test_serve_reward_api_answers_openrlhf_with_the_real_http_judge(broker: Mosquitto) -> None:
    from tests.brokers import free_port
    from tests.cli.test_serve_cli import serve, serve_once, wait_serving
    from tests.openai_server import chat_choice, chat_reply, scripted_server

    done = serve_once(
        "--judge",
        "openai",
        "--judge-url",
        "http://127.0.0.1:1/v1",
        "--broker",
        broker.url,
        "--reward-api",
    )
    assert (
        done.returncode == 2
        and ("--reward-api serves the reward endpoints on the metrics port") in done.stderr
    )
    done = serve_once(
        "--judge",
        "openai",
        "--judge-url",
        "http://127.0.0.1:1/v1",
        "--broker",
        broker.url,
        "--metrics-port",
        "9",
        "--cluster",
        "redis://127.0.0.1:1",
        "--reward-api",
    )
    assert (
        done.returncode == 2
        and "--reward-api runs on one monitor, not in --cluster mode" in done.stderr
    )
    port = free_port()
    with scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("K", {"K": 0.8, "L": 0.2})]))
        args = [
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--metrics-port",
            str(port),
        ]
        with serve(*args, "--reward-api") as proc:
            lines = wait_serving(proc)
            assert f"reward endpoints http://127.0.0.1:{port}/get_reward" in lines[-1]
            (answer,) = asyncio.run(
                openrlhf_fetch(
                    f"http://127.0.0.1:{port}/get_reward", [CHATML + RESPONSE], [CHATML], [None]
                )
            )
    assert answer["rewards"] == answer["scores"] == [pytest.approx((0.8 * 10 + 0.2 * 11) / 19)]
