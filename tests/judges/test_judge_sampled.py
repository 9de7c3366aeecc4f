"""Judges without logprobs: the letter distribution estimated from sampled answers, with its
sampling error."""

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest

from agent_monitor import AsyncProgressTracker, OpenAIJudge
from agent_monitor.scale import LETTERS
from tests.openai_server import Reply, ScriptedServer, scripted_server

# The scripted judge's answer distribution: 10% of answers are not a letter at all.
TRUE = {"E": 0.3, "K": 0.4, "R": 0.2, "Sure": 0.1}
LETTER_P = {k: v / 0.9 for k, v in TRUE.items() if k in LETTERS}
TRUE_MEAN = sum(p * LETTERS.index(t) / 19 for t, p in LETTER_P.items())
TRUE_STD = math.sqrt(sum(p * (LETTERS.index(t) / 19 - TRUE_MEAN) ** 2 for t, p in LETTER_P.items()))


def sampler(seed: int) -> Any:
    rng = random.Random(seed)
    tokens, weights = zip(*TRUE.items(), strict=True)

    def answer(body: dict[str, Any]) -> Reply:
        n = body.get("n", 1)
        draws = rng.choices(tokens, weights, k=n)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": t + ("." if i % 3 == 0 else "")},
                "logprobs": None,
                "finish_reason": "stop",
            }
            for i, t in enumerate(draws)
        ]
        return Reply(
            body={
                "id": "s",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": choices,
                "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n},
            }
        )

    return answer


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


@pytest.mark.parametrize("k", [10, 100, 1000])
async def test_sampled_expectation_converges_within_the_stated_error(
    server: ScriptedServer, k: int
) -> None:
    server.default = sampler(seed=k)
    judge = OpenAIJudge(base_url=server.url, model="m", logprobs=False, samples=k)
    t = AsyncProgressTracker("task", judge=judge, min_mass=0.5)
    p = await t.update("did a thing")
    assert p.ok and p.score is not None
    c = p.criteria["task_progress"]
    assert c.source == "sampled"
    assert c.mass == pytest.approx(0.9, abs=4 * math.sqrt(0.09 / k) + 1e-9)
    stated = TRUE_STD / math.sqrt(0.9 * k)
    assert c.sampling_error == pytest.approx(stated, rel=0.5)
    assert abs(p.score - TRUE_MEAN) <= 4 * stated  # within the stated sampling error
    assert p.uncertainty == pytest.approx(
        math.sqrt(c.dispersion**2 + c.sampling_error**2), rel=1e-6
    )
    reqs = server.requests
    assert all("logprobs" not in r and r["temperature"] == 1.0 for r in reqs)
    assert sorted(r.get("n", 1) for r in reqs) == sorted(
        [128] * (k // 128) + ([k % 128] if k % 128 else [])
    )
    assert p.to_json()["criteria"]["task_progress"]["source"] == "sampled"


async def test_error_shrinks_as_samples_grow(server: ScriptedServer) -> None:
    errors = []
    for k in (10, 1000):
        server.default = sampler(seed=7)
        t = AsyncProgressTracker(
            "task", judge=OpenAIJudge(base_url=server.url, model="m", logprobs=False, samples=k)
        )
        errors.append((await t.update("x")).criteria["task_progress"].sampling_error)
    assert errors[1] < errors[0] / 5


async def test_server_without_n_gets_one_request_per_sample(server: ScriptedServer) -> None:
    inner = sampler(seed=1)
    server.default = lambda body: inner({**body, "n": 1})  # ignores n, like many chat endpoints
    judge = OpenAIJudge(base_url=server.url, model="m", logprobs=False, samples=6)
    t = AsyncProgressTracker("task", judge=judge, min_mass=0.1)
    p = await t.update("x")
    assert (
        len(server.requests) == 6
        and judge.supports_n is False
        and p.criteria["task_progress"].mass > 0
    )


async def test_answers_that_are_never_letters_fail_loudly(server: ScriptedServer) -> None:
    server.default = lambda body: Reply(
        body={
            "id": "s",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "The answer is K"},
                    "finish_reason": "stop",
                }
                for i in range(body.get("n", 1))
            ],
        }
    )
    t = AsyncProgressTracker(
        "task", judge=OpenAIJudge(base_url=server.url, model="m", logprobs=False, samples=5)
    )
    p = await t.update("x")
    assert not p.ok and p.score is None and p.reason == "no_letter"
