"""verifiers 0.4: a real multi-turn rollout (scripted model, scripted user) ended by agent-monitor's
stop hook.

The rollout runs through verifiers' own eval runner (`verifiers.v1.cli.eval.runner.run_eval`, its
in-process path), its interception server, `RolloutSession.refused()` (where `@stop`s run) and
`Task.score` (where rewards run); the hooks are plugged by configuration, as a user would
(`--env.taskset.task.stops.agent_monitor.fn ...`). The model is a scripted OpenAI-compatible server.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.scale import LETTERS
from tests import paths
from tests.openai_server import Reply, ScriptedServer, scripted_server

vf = pytest.importorskip(
    "verifiers.v1",
    reason="verifiers 0.4 is not installed: `make test-verifiers` runs this "
    "test in a venv of its own",
)

FIXTURES = paths.FIXTURES / "verifiers_env"
TASKSET = "am-monitor-taskset"


@pytest.fixture
def taskset_module() -> Iterator[Any]:
    sys.path.insert(0, str(FIXTURES))
    try:
        import am_monitor_taskset

        am_monitor_taskset.reset()
        yield am_monitor_taskset
    finally:
        sys.path.remove(str(FIXTURES))


def _replies(texts: list[str]) -> Callable[[dict[str, Any]], Reply]:
    """The scripted model: its n-th reply of a rollout is texts[n] (counted from the assistant
    turns it was sent)."""

    def reply(body: dict[str, Any]) -> Reply:
        n = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        text = texts[min(n, len(texts) - 1)]
        return Reply(
            body={
                "id": f"c{n}",
                "object": "chat.completion",
                "created": 0,
                "model": "scripted-model",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
        )

    return reply


async def _rollout(server: ScriptedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    monkeypatch.setenv("AM_SCRIPTED_KEY", "unused")
    config = EvalConfig(
        env={
            "taskset": {
                "id": TASKSET,
                "task": {
                    "stops": {"agent_monitor": {"fn": "am_monitor_taskset:stop"}},
                    "rewards": {"agent_monitor": {"fn": "am_monitor_taskset:reward"}},
                },
            },
            "agent": {
                "max_turns": 8,
                "runtime": {"type": "subprocess"},
                "timeout": {"rollout": 60, "scoring": 30},
            },
        },
        select={"limit": 1},
        num_rollouts=1,
        push=False,
        client={"base_url": server.url, "api_key_var": "AM_SCRIPTED_KEY"},
        rich=None,
        output_dir=tmp_path,
        run={"dir": "run"},
        model="scripted-model",
    )
    records = await run_eval(config)
    traces = [t for r in records for t in r.traces]
    assert len(traces) == 1
    return traces[0]


async def test_a_judged_abort_ends_the_rollout_with_the_reward_earned(
    taskset_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scripted_server() as server:
        server.default = _replies(
            ["I read calc.py", "stuck on the import", "stuck again", "still stuck", "fixed"]
        )
        trace = await _rollout(server, tmp_path, monkeypatch)
    info = trace.info["agent_monitor"]
    # Turns 2 and 3 were poor (patience 2 from min_steps 2): the stop before the 4th model call
    # fired.
    assert trace.stop_condition == "agent_monitor"
    assert trace.num_turns == 3 and info["step"] == 3 and info["turns"] == 3
    assert info["stop"] and info["stop_kind"] == "judged" and info["signal"] == "abort"
    assert len(server.requests) == 3, "the model was never asked for a 4th turn"
    reward = trace.rewards["agent_monitor"]
    assert reward is not None and reward.score == pytest.approx(LETTERS.index("B") / 19)
    assert taskset_module.hooks.statistics().rollouts == 0, (
        "the rollout's tracker is freed when it is scored"
    )


async def test_a_judge_outage_never_stops_the_rollout(
    taskset_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = [
        "I read calc.py",
        "JUDGE-DOWN",
        "stuck",
        "JUDGE-DOWN",
        "ran the tests",
        "fixed",
        "done",
        "done",
        "done",
    ]
    with scripted_server() as server:
        server.default = _replies(texts)
        trace = await _rollout(server, tmp_path, monkeypatch)
    info = trace.info["agent_monitor"]
    # Eight turns (the turn limit), never stopped by the monitor, though two judge calls failed.
    assert trace.stop_condition != "agent_monitor" and trace.num_turns == 8
    assert info["stop_kind"] == "judged" and not info["stop"]
    assert trace.rewards["agent_monitor"].score == pytest.approx(LETTERS.index("K") / 19)
    assert json.dumps(info)  # plain JSON in the trace's info
    stats = taskset_module.hooks.statistics()
    assert stats.turns == 8 and stats.infra == 2 and stats.stops == 0


async def test_a_failed_last_judgement_is_no_reward(
    taskset_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scripted_server() as server:
        server.default = _replies(["I read calc.py", "fixed", *["JUDGE-DOWN"] * 7])
        trace = await _rollout(server, tmp_path, monkeypatch)
    # The rollout ran to its limit; its reward could not be judged, so verifiers records a failed
    # scoring (the trainer drops the trace) instead of a number.
    assert trace.num_turns == 8 and trace.info["agent_monitor"]["stop_kind"] == "infra"
    assert trace.rewards.get("agent_monitor") is None
    assert not trace.ok and any("no reward" in str(e) for e in trace.errors)
