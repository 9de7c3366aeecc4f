"""docs/rl.md's curl examples, run as written with the real `curl` against a monitor serving the
reward endpoints.

The monitor's judge is the real OpenAIJudge over the scripted OpenAI-compatible HTTP server, so the
judge calls counted are HTTP requests: `--reward-shape final` makes one per rollout with the default
rubric, as the docs' table says.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import subprocess

import pytest

from agent_monitor.judges.openai import OpenAIJudge
from tests.daemon.sources.reward.test_reward_api import daemon
from tests.openai_server import chat_choice, chat_reply, scripted_server
from tests.paths import REPO

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        shutil.which("curl") is None, reason="curl is not installed (apt-get install curl)"
    ),
]
PAGE = REPO / "docs" / "rl.md"


def curl_lines() -> list[str]:
    """The curl commands of docs/rl.md's shell blocks (continuations joined)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.DOTALL):
        out += [
            line.strip()
            for line in block.replace("\\\n", " ").splitlines()
            if line.startswith("curl ")
        ]
    return out


async def test_the_curl_examples_get_rewards_and_a_wrong_path_is_404() -> None:
    lines = curl_lines()
    assert len(lines) == 4
    with scripted_server() as server:
        server.default = chat_reply(chat_choice([("K", {"K": 1.0})]))  # 10/19
        judge = OpenAIJudge(base_url=server.url, model="scripted-model")
        async with daemon(judge) as (_, _, url, _):  # type: ignore[arg-type]
            answers = []
            for line in lines:
                argv = shlex.split(line.replace("http://127.0.0.1:9464", url), comments=True)
                before = len(server.requests)
                done = await asyncio.to_thread(
                    subprocess.run, argv, capture_output=True, text=True, timeout=30
                )
                assert done.returncode == 0, (line, done.stderr)
                answers.append((done.stdout, len(server.requests) - before))
        await judge.aclose()
    (score, calls), (openrlhf, calls2), (slime, calls3), (wrong, calls4) = answers
    # final: one call a rollout
    assert json.loads(score)["reward"] == pytest.approx(10 / 19) and calls == 1
    assert json.loads(openrlhf)["rewards"] == [pytest.approx(10 / 19)] and calls2 == 1
    assert json.loads(slime)["reward"] == pytest.approx(10 / 19) and calls3 == 1
    assert (
        wrong.startswith("HTTP/1.1 404")
        and "POST routes here: /get_reward" in wrong
        and calls4 == 0
    )
