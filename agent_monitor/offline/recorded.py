"""Recorded runs: read finished trajectories (ATIF and a plain JSON form) into task, steps and
outcome."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ..extractors import clip_middle

DEFAULT_MAX_STEP_CHARS = 6000


class RecordedRunError(ValueError):
    """A file that is not a recorded run this reader understands."""


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """One agent step of a recorded run, as the judge will see it."""

    text: str
    timestamp: datetime | None = None
    images: tuple[bytes, ...] = ()
    """Encoded camera frames that go with the step (robot episodes); the judge sees them by the
    frame budget."""


@dataclass(frozen=True, slots=True)
class RecordedRun:
    """A finished run: its task, agent steps in order, and outcome (1 success, 0 failure, None
    unknown)."""

    name: str
    task: str
    steps: tuple[RecordedStep, ...]
    outcome: float | None


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _shell_result(text: str) -> str:
    """A JSON-encoded shell result (`{"returncode", "output"}`, as mini-swe-agent records) as
    plain text."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return text
    try:
        data = json.loads(stripped)
    except ValueError:
        return text
    if not isinstance(data, Mapping) or not isinstance(data.get("output"), str):
        return text
    out = data["output"].rstrip("\n")
    code = data.get("returncode")
    return (
        f"{out}\n[exit code {code}]"
        if isinstance(code, int) and not isinstance(code, bool)
        else out
    )


def _atif_step(step: Mapping[str, Any], limit: int) -> str:
    parts: list[str] = []
    msg = step.get("message")
    # Some exports leave unresolved references ("$31") as the message: not text a judge should read.
    if msg and not re.fullmatch(r"\s*\$\d+\s*", str(msg)):
        parts.append(str(msg).strip())
    for call in step.get("tool_calls") or []:
        if not isinstance(call, Mapping):
            continue
        args = call.get("arguments")
        if isinstance(args, Mapping) and ("keystrokes" in args or "command" in args):
            parts.append("$ " + str(args.get("keystrokes", args.get("command", ""))).strip())
        else:
            name = call.get("function_name") or call.get("tool_name") or "tool"
            parts.append(f"{name}({json.dumps(args, ensure_ascii=False, default=str)})")
    obs = step.get("observation")
    results = obs.get("results") if isinstance(obs, Mapping) else None
    for r in results or []:
        if isinstance(r, Mapping) and r.get("content") is not None:
            parts.append(
                "Observation:\n" + clip_middle(_shell_result(str(r["content"])).strip(), limit)
            )
    return "\n".join(p for p in parts if p)


def _outcome(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("success", "pass", "passed"):
        return 1.0
    if value in ("failure", "fail", "failed"):
        return 0.0
    return None


def parse_recorded(
    data: Mapping[str, Any], *, name: str = "run", max_step_chars: int = DEFAULT_MAX_STEP_CHARS
) -> RecordedRun:
    """Read a recorded run from its JSON object (ATIF `trajectory.steps`, or `task` + `steps`)."""
    traj = data.get("trajectory")
    if isinstance(traj, Mapping) and isinstance(traj.get("steps"), list):
        raw = [s for s in traj["steps"] if isinstance(s, Mapping)]
        users = [s for s in raw if s.get("source") == "user" and s.get("message")]
        task = str(
            data.get("task")
            or (users[0]["message"] if users else "")
            or data.get("task_name")
            or ""
        )
        steps = tuple(
            RecordedStep(_atif_step(s, max_step_chars), _time(s.get("timestamp")))
            for s in raw
            if s.get("source") == "agent"
        )
        outcome = _outcome(data.get("reward", data.get("outcome")))
    elif isinstance(data.get("steps"), list):
        task = str(data.get("task") or "")
        steps = tuple(
            RecordedStep(
                clip_middle(s if isinstance(s, str) else str(s.get("text", "")), max_step_chars),
                _time(s.get("ts")) if isinstance(s, Mapping) else None,
            )
            for s in data["steps"]
        )
        outcome = _outcome(data.get("outcome", data.get("reward")))
    else:
        raise RecordedRunError(
            f"{name}: neither ATIF (trajectory.steps) nor plain (task, steps) JSON"
        )
    if not task.strip():
        raise RecordedRunError(f"{name}: no task text (no 'task' field and no user step)")
    steps = tuple(s for s in steps if s.text.strip())
    return RecordedRun(
        name=str(data.get("trial_name") or data.get("name") or name),
        task=task,
        steps=steps,
        outcome=outcome,
    )


def load_recorded(path: str | Path, *, max_step_chars: int = DEFAULT_MAX_STEP_CHARS) -> RecordedRun:
    """Read one recorded run from a JSON file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise RecordedRunError(f"cannot read {p}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        kind = " (a PNG image)" if e.object[:4] == b"\x89PNG" else ""
        raise RecordedRunError(
            f"{p} is not a text file{kind}: byte {e.object[e.start]:#04x} at offset {e.start} "
            "is not UTF-8; "
            "a recorded run is a JSON file (see `agent-monitor replay --help`)"
        ) from None
    except json.JSONDecodeError as e:
        raise RecordedRunError(f"{p} is not JSON: {e}") from None
    if not isinstance(data, Mapping):
        raise RecordedRunError(f"{p}: expected a JSON object")
    return parse_recorded(data, name=p.stem, max_step_chars=max_step_chars)


def _json_files(root: Path) -> Iterator[Path]:
    """Every *.json under `root`, symlinked folders followed (each real folder once: no loop)."""
    seen: set[str] = set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        yield from (Path(folder) / n for n in names if n.endswith(".json"))


def iter_recorded(
    path: str | Path, *, max_step_chars: int = DEFAULT_MAX_STEP_CHARS
) -> Iterator[RecordedRun]:
    """Recorded runs in a file, or in every *.json under a folder (sorted)."""
    p = Path(path)
    files = sorted(_json_files(p)) if p.is_dir() else [p]
    for f in files:
        yield load_recorded(f, max_step_chars=max_step_chars)
