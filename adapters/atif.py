"""ATIF trajectories (Harbor / Terminal-Bench, and converted variants) as monitor runs: task, agent
steps, outcome.

    from agent_monitor.adapters.atif import iter_atif, load_atif

    run = load_atif("trajectory.json") run.task, run.outcome # the first user message; "success" /
    "failure" / a number / None [s.text for s in run.steps] # agent steps in order: message + tool
    calls + observations for run in iter_atif("runs/"): # every *.json under a folder, sorted
        ...

Reads the fields ATIF writers have in common and tolerates the rest: no timestamps, no tool calls,
no observation, message content as a string or a list of parts, tool arguments as an object or a
JSON string, observation contents that are JSON-encoded shell results (`{"returncode", "output"}`,
as mini-swe-agent conversions write them), a bare trajectory (`{"schema_version", "steps"}`) or one
wrapped in a trial record with its `reward`. A missing reward is an unknown outcome (None), never a
failure.

`python -m agent_monitor.adapters.atif PATH` lists the runs; with `--broker URL` it replays them to
a live monitor (one run per file, its steps paced by their recorded timestamps with `--speed`),
stopping a run when the monitor aborts it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

if TYPE_CHECKING:
    from agent_monitor.wire import MonitorClient, Run

DEFAULT_MAX_CHARS = 6000
"""Each tool call's arguments and each observation is clipped to this many characters (head and
tail kept)."""

Outcome: TypeAlias = Literal["success", "failure"] | float | None

# A message that is only `$<digits>` is an unresolved reference left by some exporters (Terminus 2
# runs exported through a deduplicating serializer have `"message": "$32"`): it says nothing, so it
# is dropped.
_PLACEHOLDER = re.compile(r"\$\d+")


class AtifError(ValueError):
    """A file or object that is not an ATIF trajectory this reader understands; the message says
    why."""


@dataclass(frozen=True, slots=True)
class AtifStep:
    """One agent step as a monitor sees it: its text and, when recorded, its UNIX time."""

    text: str
    ts: float | None = None
    step_id: int | str | None = None
    """The trajectory's own id of the step (`step_id`), for tracing a score back to the file."""

    @property
    def time(self) -> datetime | None:
        """`ts` as an aware UTC datetime, or None."""
        return None if self.ts is None else datetime.fromtimestamp(self.ts, UTC)


@dataclass(frozen=True, slots=True)
class AtifRun:
    """A recorded run: the task, the agent's steps in order, and how it ended."""

    name: str
    task: str
    steps: tuple[AtifStep, ...]
    outcome: Outcome
    """`success` for reward 1, `failure` for reward 0, another reward as a float, None when
    unknown."""
    reward: float | None = None
    schema_version: str | None = None
    agent: str | None = None
    """The agent's name and model when the file says (`terminus-2 (gemini/gemini-2.5-pro)`)."""
    path: Path | None = field(default=None, compare=False)

    @property
    def texts(self) -> list[str]:
        """The steps' texts, in order (what `track(task, steps)` takes)."""
        return [s.text for s in self.steps]


# -- reading --


def clip(text: str, limit: int) -> str:
    """Head and tail of `text` within about `limit` characters: a command's start says what ran,
    its end how."""
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def _content_text(content: object) -> str:
    """Text of a message or observation content: a string, a list of parts, or anything else
    JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping):
                kind = part.get("type")
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif (
                    kind in ("image", "image_url", "input_image")
                    or "image" in part
                    or "image_url" in part
                ):
                    parts.append("[image]")
                elif part.get("content") is not None:
                    parts.append(_content_text(part["content"]))
        return "\n".join(p for p in parts if p)
    if isinstance(content, Mapping):
        if isinstance(content.get("text"), str):
            return str(content["text"])
        return json.dumps(content, ensure_ascii=False, default=str)
    return str(content)


def _shell_result(text: str) -> str | None:
    """A JSON-encoded shell result (`{"returncode", "output"}` and kin) as readable text, or None
    if it is not one."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        data = json.loads(stripped)
    except ValueError:
        return None
    if not isinstance(data, Mapping) or not (
        {"output", "output_head", "output_tail"} & data.keys()
    ):
        return None
    lines: list[str] = []
    if isinstance(data.get("output"), str):
        lines.append(data["output"].rstrip("\n"))
    if isinstance(data.get("output_head"), str) or isinstance(data.get("output_tail"), str):
        elided = data.get("elided_chars")
        lines.append(str(data.get("output_head") or "").rstrip("\n"))
        lines.append(f"[... {elided if isinstance(elided, int) else 'some'} characters elided ...]")
        lines.append(str(data.get("output_tail") or "").rstrip("\n"))
    if data.get("exception_info"):
        lines.append(f"[error: {data['exception_info']}]")
    if isinstance(data.get("returncode"), int) and not isinstance(data.get("returncode"), bool):
        lines.append(f"[exit code {data['returncode']}]")
    return "\n".join(line for line in lines if line)


def _arguments(value: object) -> object:
    """Tool-call arguments as an object when they are a JSON string (OpenAI style), else as they
    are."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, Mapping) else value
    return value


def _tool_call(call: Mapping[str, Any], limit: int) -> str:
    args = _arguments(call.get("arguments", call.get("input")))
    if isinstance(args, Mapping):
        for key in ("keystrokes", "command", "cmd"):
            if isinstance(args.get(key), str):
                return clip("$ " + args[key].strip(), limit)
    name = call.get("function_name") or call.get("tool_name") or call.get("name") or "tool"
    if args is None:
        return f"{name}()"
    rendered = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False, default=str)
    return clip(f"{name}({rendered})", limit)


def _results(obs: object) -> list[object]:
    """An observation's results, whatever its shape: `{"results": [...]}`, one `{"content":
    ...}`, a string, a list."""
    if obs is None:
        return []
    if isinstance(obs, Mapping):
        results = obs.get("results", [obs] if "content" in obs else [])
    elif isinstance(obs, str):
        results = [obs]
    else:
        results = obs
    if not isinstance(results, Sequence) or isinstance(results, str | bytes):
        return []
    return list(results)


def _observation(result: object, limit: int) -> str:
    text = _content_text(result.get("content") if isinstance(result, Mapping) else result)
    text = (_shell_result(text) or text).strip()
    return "Observation:\n" + clip(text, limit) if text else ""


def _timestamp(value: object) -> float | None:
    """UNIX seconds from an ISO 8601 string (naive means UTC) or a number; None if absent or
    unreadable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        dt = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def step_text(step: Mapping[str, Any], *, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """One agent step as text: its message, then each tool call (a shell command as `$ cmd`) with
    its observation.

    An observation goes right after the call it answers (by `source_call_id`, or by position when
    the step has as many results as calls); results that match no call come last.
    """
    parts: list[str] = []
    message = _content_text(step.get("message", step.get("content"))).strip()
    if message and not _PLACEHOLDER.fullmatch(message):
        parts.append(clip(message, max_chars))
    raw_calls = step.get("tool_calls")
    calls = [c for c in raw_calls if isinstance(c, Mapping)] if isinstance(raw_calls, list) else []
    results = _results(step.get("observation"))
    ids = [c.get("tool_call_id", c.get("id")) for c in calls]
    by_id: dict[object, list[object]] = {}
    rest: list[object] = []
    for r in results:
        source = r.get("source_call_id") if isinstance(r, Mapping) else None
        if source is not None and source in ids:
            by_id.setdefault(source, []).append(r)
        else:
            rest.append(r)
    if not by_id and len(rest) == len(calls):  # no ids: the n-th result answers the n-th call
        paired, rest = [[r] for r in rest], []
    else:
        paired = [by_id.get(i, []) if i is not None else [] for i in ids]
    for call, answers in zip(calls, paired, strict=True):
        parts.append(_tool_call(call, max_chars))
        parts.extend(_observation(r, max_chars) for r in answers)
    parts.extend(_observation(r, max_chars) for r in rest)
    return "\n".join(p for p in parts if p)


def outcome_of(reward: object) -> Outcome:
    """reward 1 -> success, 0 -> failure, another number -> itself, a pass/fail word -> that,
    else None."""
    if isinstance(reward, bool):
        return "success" if reward else "failure"
    if isinstance(reward, int | float):
        if reward != reward or reward in (float("inf"), float("-inf")):  # NaN or infinite: unknown
            return None
        if reward == 1:
            return "success"
        if reward == 0:
            return "failure"
        return float(reward)
    if isinstance(reward, str):
        word = reward.strip().lower()
        if word in ("success", "pass", "passed", "resolved", "true"):
            return "success"
        if word in ("failure", "fail", "failed", "unresolved", "false"):
            return "failure"
        try:
            return outcome_of(float(word))
        except ValueError:
            return None
    return None


def _reward(data: Mapping[str, Any]) -> object:
    for key in ("reward", "outcome", "score"):
        if data.get(key) is not None:
            return data[key]
    verifier = data.get("verifier_result")  # Harbor's trial result.json
    if isinstance(verifier, Mapping):
        rewards = verifier.get("rewards")
        if isinstance(rewards, Mapping) and rewards.get("reward") is not None:
            return rewards["reward"]
        return verifier.get("reward")
    return None


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and value == value:
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _agent(traj: Mapping[str, Any]) -> str | None:
    agent = traj.get("agent")
    if not isinstance(agent, Mapping):
        return None
    name, model = agent.get("name"), agent.get("model_name")
    if name and model:
        return f"{name} ({model})"
    return str(name or model) if (name or model) else None


def parse_atif(
    data: Mapping[str, Any], *, name: str = "run", max_chars: int = DEFAULT_MAX_CHARS
) -> AtifRun:
    """An AtifRun from a trajectory's JSON object: a trial record with `trajectory`, or a bare
    trajectory."""
    traj = data.get("trajectory")
    if not isinstance(traj, Mapping):
        traj = data if isinstance(data.get("steps"), list) else None
    if traj is None or not isinstance(traj.get("steps"), list):
        raise AtifError(f"{name}: not an ATIF trajectory (no trajectory.steps list)")
    raw = [s for s in traj["steps"] if isinstance(s, Mapping)]
    users = [_content_text(s.get("message")).strip() for s in raw if s.get("source") == "user"]
    users = [u for u in users if u and not _PLACEHOLDER.fullmatch(u)]
    task = str(
        data.get("task") or data.get("instruction") or (users[0] if users else "") or ""
    ).strip()
    if not task and data.get("task_name"):
        task = f"Task: {data['task_name']}"  # better than nothing: the judge at least sees its name
    if not task:
        raise AtifError(
            f"{name}: no task (no user step with a message, no task or task_name field)"
        )
    steps: list[AtifStep] = []
    for s in raw:
        if s.get("source") != "agent":
            continue
        text = step_text(s, max_chars=max_chars)
        # a step with nothing to show cannot be sent (the protocol refuses empty steps)
        if text.strip():
            sid = s.get("step_id")
            steps.append(
                AtifStep(
                    text,
                    _timestamp(s.get("timestamp")),
                    sid if isinstance(sid, int | str) else None,
                )
            )
    reward = _reward(data)
    version = traj.get("schema_version")
    return AtifRun(
        name=str(data.get("trial_name") or data.get("name") or name),
        task=task,
        steps=tuple(steps),
        outcome=outcome_of(reward),
        reward=_number(reward),
        schema_version=str(version) if version is not None else None,
        agent=_agent(traj),
    )


def load_atif(path: str | Path, *, max_chars: int = DEFAULT_MAX_CHARS) -> AtifRun:
    """Read one ATIF trajectory file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise AtifError(f"cannot read {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise AtifError(f"{p} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise AtifError(f"{p} is not JSON: {e}") from None
    if not isinstance(data, Mapping):
        raise AtifError(f"{p}: expected a JSON object, found {type(data).__name__}")
    run = parse_atif(data, name=p.stem, max_chars=max_chars)
    return AtifRun(
        run.name,
        run.task,
        run.steps,
        run.outcome,
        run.reward,
        run.schema_version,
        run.agent,
        path=p,
    )


def iter_atif(
    path: str | Path,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    on_error: Literal["raise", "skip"] = "raise",
) -> Iterator[AtifRun]:
    """The runs in a file, or in every *.json under a folder (recursively, sorted by path).

    With `on_error="skip"`, files that are not ATIF trajectories (a folder's other JSON files) are
    skipped.
    """
    p = Path(path)
    if not p.exists():
        raise AtifError(f"{p} does not exist")
    files = sorted(p.rglob("*.json")) if p.is_dir() else [p]
    for f in files:
        try:
            yield load_atif(f, max_chars=max_chars)
        except AtifError:
            if on_error == "raise":
                raise


# -- replaying to a live monitor --


def publish(
    run: AtifRun,
    client: MonitorClient,
    *,
    run_id: str | None = None,
    policy: Mapping[str, float | int | None] | None = None,
    criteria: str | None = None,
    speed: float | None = None,
    max_gap_s: float = 5.0,
    send_outcome: bool = True,
) -> tuple[Run, int]:
    """Replay a recorded run to a monitor through `client`; return the Run and the number of steps
    sent.

    `speed` paces the steps by their recorded timestamps (2.0 = twice as fast; each wait capped at
    `max_gap_s`); None sends them at once. The replay stops early when the monitor's signal is
    `abort` (the run is then ended without an outcome, as a harness that stopped would); otherwise
    it ends with the recorded outcome (`send_outcome=False` leaves it out, e.g. to see what the
    monitor says on its own).
    """
    rid = run_id or _run_id(run.name)
    live = client.start_run(rid, task=run.task, policy=policy, criteria=criteria)
    sent = 0
    previous: float | None = None
    for step in run.steps:
        if live.should_abort:
            break
        if speed and previous is not None and step.ts is not None:
            time.sleep(min(max(0.0, (step.ts - previous) / speed), max_gap_s))
        previous = step.ts if step.ts is not None else previous
        live.step(step.text)
        sent += 1
    aborted = live.should_abort
    live.end(None if aborted or not send_outcome else run.outcome)
    return live, sent


def _run_id(name: str) -> str:
    """A valid run id (one topic level of A-Z a-z 0-9 . _ : -, not starting with _) from a run's
    name."""
    rid = re.sub(r"[^A-Za-z0-9._:-]+", "-", name).strip("-_")[:128]
    return rid or "atif-run"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m agent_monitor.adapters.atif",
        description="List ATIF trajectories as monitor runs, or replay them to a live "
        "monitor (--broker).",
    )
    ap.add_argument("path", help="an ATIF trajectory (.json) or a folder of them")
    ap.add_argument(
        "--broker", help="replay to the monitor behind this MQTT broker (mqtt://host:port)"
    )
    ap.add_argument(
        "--speed", type=float, default=None, help="pace steps by their timestamps, this much faster"
    )
    ap.add_argument("--abort-below", type=float, default=None, help="policy for the replayed runs")
    ap.add_argument(
        "--skip-invalid", action="store_true", help="skip files that are not ATIF trajectories"
    )
    ap.add_argument(
        "--json", action="store_true", help="one JSON object per run (task, steps, outcome)"
    )
    args = ap.parse_args(argv)
    try:
        runs = list(iter_atif(args.path, on_error="skip" if args.skip_invalid else "raise"))
    except AtifError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.broker is None:
        for r in runs:
            if args.json:
                row: dict[str, Any] = {
                    "name": r.name,
                    "task": r.task,
                    "outcome": r.outcome,
                    "reward": r.reward,
                }
                row["steps"] = [{"text": s.text, "ts": s.ts} for s in r.steps]
                print(json.dumps(row, ensure_ascii=False))
            else:
                print(
                    f"{r.name}\t{len(r.steps)} "
                    f"steps\toutcome={r.outcome}\t{r.task.splitlines()[0][:80]}"
                )
        return 0
    from agent_monitor.wire import MonitorClient

    policy = {"abort_below": args.abort_below} if args.abort_below is not None else None
    try:
        with MonitorClient(args.broker) as client:
            for r in runs:
                live, sent = publish(r, client, policy=policy, speed=args.speed)
                state = "aborted by the monitor" if live.should_abort else f"outcome={r.outcome}"
                print(f"{live.run_id}\t{sent}/{len(r.steps)} steps sent\t{state}")
    except (ConnectionError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
