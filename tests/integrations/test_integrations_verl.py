"""verl's custom reward function contract, as verl calls it, against `make_compute_score`.

verl itself needs torch and a GPU stack to import, so its calls are reproduced here from
volcengine/verl at b178a3cd56f58b2d502255daba591e92833930a7:
- `verl/utils/import_utils.py::load_module`: a file path is loaded with `spec_from_file_location`
  under a name of its own; `pkg://a.b` is `importlib.import_module("a.b")`;
- `verl/trainer/ppo/reward.py::get_custom_reward_fn`: `inspect.iscoroutinefunction(raw_fn)` picks
  `_call_with_kwargs_async` (awaited) over `_call_with_kwargs` (run in an executor), with the
  config's `reward_kwargs` merged into the call's keywords;
- `verl/experimental/reward_loop/reward_manager/naive.py::NaiveRewardManager.run_single`: keywords
  `data_source`, `solution_str`, `ground_truth`, `extra_info`; a dict's "score" is the reward, its
  other keys `reward_extra_info`; a float is the reward (and `acc`);
- `verl/experimental/reward_loop/reward_loop.py::compute_rm_score`: each extra key's column is
  `[info[key] for info in infos]` with the keys of the first sample.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import textwrap
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.integrations import RewardUnavailable, split_turns
from agent_monitor.integrations.verl import make_compute_score
from agent_monitor.scale import LETTERS
from agent_monitor.testing import FakeJudge


def _load_module(module_path: str) -> Any:
    """verl's `load_module`, as read at b178a3cd (file paths and pkg:// paths)."""
    if module_path.startswith("pkg://"):
        return importlib.import_module(module_path[len("pkg://") :].replace("/", "."))
    if module_path.startswith("file://"):
        module_path = module_path[len("file://") :]
    if not os.path.exists(module_path):
        raise FileNotFoundError(f"Custom module file not found: {module_path=}")
    spec = importlib.util.spec_from_file_location(
        f"custom_module_{hash(os.path.abspath(module_path))}", module_path
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _call_with_kwargs_async(
    raw_fn: Any, extra_kwargs: dict[str, Any], *args: Any, **kwargs: Any
) -> Any:
    return await raw_fn(*args, **{**kwargs, **extra_kwargs})


def _call_with_kwargs(raw_fn: Any, extra_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    return raw_fn(*args, **{**kwargs, **extra_kwargs})


def get_custom_reward_fn(config: dict[str, Any]) -> Any:
    """verl's `get_custom_reward_fn`: path + name from `custom_reward_function`, reward_kwargs
    merged."""
    cfg = config.get("custom_reward_function") or {}
    raw_fn = getattr(_load_module(cfg["path"]), cfg["name"])
    reward_kwargs = dict(cfg.get("reward_kwargs", {}))
    if not inspect.iscoroutinefunction(raw_fn):
        return partial(_call_with_kwargs, raw_fn, reward_kwargs), False
    return partial(_call_with_kwargs_async, raw_fn, reward_kwargs), True


async def run_single(
    compute_score: Any,
    is_async: bool,
    data_source: str,
    response_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any],
) -> dict[str, Any]:
    """`NaiveRewardManager.run_single`'s call and its reading of the answer."""
    loop = asyncio.get_running_loop()
    if is_async:
        result = await compute_score(
            data_source=data_source,
            solution_str=response_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )
    else:
        result = await loop.run_in_executor(
            None,
            lambda: compute_score(
                data_source=data_source,
                solution_str=response_str,
                ground_truth=ground_truth,
                extra_info=extra_info,
            ),
        )
    reward_extra_info: dict[str, Any] = {}
    if isinstance(result, dict):
        score = result["score"]
        reward_extra_info.update(result)
    else:
        score = result
        reward_extra_info["acc"] = score
    return {"reward_score": score, "reward_extra_info": reward_extra_info}


REWARD_FILE = """
from agent_monitor.integrations.verl import make_compute_score
from agent_monitor.testing import FakeJudge

def _answer(prompt):
    # A judge that reads the trajectory: "tests pass" is near done, a failed step fails the judge.
    text = prompt.text()
    if "JUDGE-DOWN" in text:
        raise FakeJudge.failure("server_error")
    return "S" if "tests pass" in text else "C"

compute_score = make_compute_score(judge=FakeJudge(_answer), infra_reward={infra})
"""

CHATML = (
    "<|im_start|>assistant\nI will run the tests.<|im_end|>\n"
    "<|im_start|>tool\n3 failed<|im_end|>\n"
    "<|im_start|>assistant\nFixed the off-by-one; tests pass.<|im_end|>"
)


def _reward_file(tmp_path: Path, infra: str = "None") -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE.format(infra=infra)))
    return str(path)


async def test_verl_loads_it_as_async_and_reads_the_dict_form(tmp_path: Path) -> None:
    config = {
        "custom_reward_function": {
            "path": _reward_file(tmp_path),
            "name": "compute_score",
            "reward_kwargs": {},
        }
    }
    fn, is_async = get_custom_reward_fn(config)
    assert is_async, (
        "verl must see an async def, else it runs the coroutine function in an executor"
    )
    out = await run_single(
        fn, is_async, "swe", CHATML, "all tests pass", {"question": "Fix the failing test"}
    )
    assert out["reward_score"] == pytest.approx(LETTERS.index("S") / 19)
    info = out["reward_extra_info"]
    assert info["stop_kind"] == "judged" and info["steps"] == 3 and info["reason"] == ""
    assert info["progress"] == out["reward_score"]


async def test_reward_kwargs_and_reward_model_keywords_are_taken(tmp_path: Path) -> None:
    # verl adds reward_router_address / reward_model_tokenizer with a reward model, and the config's
    # kwargs.
    config = {
        "custom_reward_function": {
            "path": _reward_file(tmp_path),
            "name": "compute_score",
            "reward_kwargs": {
                "reward_router_address": "127.0.0.1:1",
                "reward_model_tokenizer": None,
            },
        }
    }
    fn, is_async = get_custom_reward_fn(config)
    out = await run_single(fn, is_async, "swe", "looked around", None, {"task": "Fix it"})
    assert out["reward_score"] == pytest.approx(LETTERS.index("C") / 19)


async def test_a_failed_judge_is_no_reward(tmp_path: Path) -> None:
    fn, is_async = get_custom_reward_fn(
        {"custom_reward_function": {"path": _reward_file(tmp_path), "name": "compute_score"}}
    )
    with pytest.raises(RewardUnavailable, match="server_error") as e:
        await run_single(fn, is_async, "swe", "JUDGE-DOWN", None, {"task": "Fix it"})
    assert e.value.stop_kind == "infra" and e.value.reason == "server_error"


async def test_infra_reward_answers_a_marked_number_with_the_same_keys(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    fn, is_async = get_custom_reward_fn(
        {
            "custom_reward_function": {
                "path": _reward_file(tmp_path / "a", infra="0.0"),
                "name": "compute_score",
            }
        }
    )
    judged = await run_single(fn, is_async, "swe", CHATML, None, {"task": "Fix it"})
    failed = await run_single(fn, is_async, "swe", "JUDGE-DOWN", None, {"task": "Fix it"})
    assert failed["reward_score"] == 0.0
    assert failed["reward_extra_info"]["stop_kind"] == "infra"
    assert failed["reward_extra_info"]["reason"] == "server_error"
    assert failed["reward_extra_info"]["progress"] is None
    # compute_rm_score's columns: the first sample's keys, read from every sample.
    infos = [judged["reward_extra_info"], failed["reward_extra_info"]]
    columns = {key: [info[key] for info in infos] for key in infos[0]}
    assert columns["stop_kind"] == ["judged", "infra"]


async def test_pkg_path_and_float_form() -> None:
    module = _load_module("pkg://agent_monitor.integrations.verl")
    fn = module.make_compute_score(judge=FakeJudge(["K"]), form="float", criteria="progress")
    assert inspect.iscoroutinefunction(fn)
    out = await run_single(
        fn, True, "gsm8k", "step one\n\nstep two", "42", {"question": "What is 6*7?"}
    )
    assert out == {
        "reward_score": pytest.approx(10 / 19),
        "reward_extra_info": {"acc": pytest.approx(10 / 19)},
    }


async def test_blocking_form_for_the_legacy_reward_managers() -> None:
    # use_reward_loop=False: verl/workers/reward_manager/naive.py calls compute_score(...) and uses
    # the result.
    fn = make_compute_score(judge=FakeJudge(["K"]), blocking=True)
    assert not inspect.iscoroutinefunction(fn)
    out = await run_single(fn, False, "gsm8k", "step one", None, {"question": "What is 6*7?"})
    assert out["reward_score"] == pytest.approx(10 / 19)
    assert fn(data_source="gsm8k", solution_str="x", ground_truth=None, extra_info={"task": "t"})[
        "score"
    ] == (pytest.approx(10 / 19))


async def test_no_task_is_a_clear_error() -> None:
    fn = make_compute_score(judge=FakeJudge(["K"]))
    with pytest.raises(ValueError, match=r"extra_info\['task'\]"):
        await fn(data_source="gsm8k", solution_str="x", ground_truth=None, extra_info={})


def test_make_compute_score_checks_its_options() -> None:
    with pytest.raises(ValueError, match="form="):
        make_compute_score(judge=FakeJudge(["K"]), form="list")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        make_compute_score(judge=FakeJudge(["K"]), repeets=2)


def test_split_turns_rules_and_bounds() -> None:
    assert split_turns(CHATML)[1] == "tool\n3 failed<|im_end|>"
    tools = 'thinking<tool_call>{"name": "ls"}</tool_call><tool_response>a.py</tool_response>done'
    assert split_turns(tools) == [
        "thinking",
        '<tool_call>{"name": "ls"}</tool_call>',
        "<tool_response>a.py</tool_response>done",
    ]
    assert split_turns("a\n\nb\n \nc") == ["a", "b", "c"]
    many = "\n\n".join(f"p{i}" for i in range(100))
    steps = split_turns(many, max_steps=5)
    assert len(steps) == 5 and steps[-1].startswith("p4") and steps[-1].endswith("p99")
    assert split_turns("x" * 50, max_chars=10) == ["x" * 10]
    with pytest.raises(ValueError, match="max_steps"):
        split_turns("x", max_steps=0)


async def test_compute_score_is_keyword_only_as_the_docs_show_it() -> None:
    """verl calls it with keywords; a positional call fails at once, naming the problem (not a
    wrong score)."""
    from agent_monitor.integrations.verl import make_compute_score
    from agent_monitor.testing import FakeJudge

    compute_score = make_compute_score(judge=FakeJudge(["P"]), infra_reward=0.0)
    with pytest.raises(TypeError, match="positional"):
        await compute_score("swe", "ran the tests", None)  # type: ignore[misc,call-arg]
