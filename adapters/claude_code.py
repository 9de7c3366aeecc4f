"""Claude Code hooks: every tool use of a session becomes a monitor step, and an abort blocks the
next tool call.

Install (hooks in `.claude/settings.json`; `python -m agent_monitor.adapters.claude_code
--print-settings` prints the block below, also shipped as `claude_code_settings.json`):

    {"env": {"AGENT_MONITOR_BROKER": "mqtt://127.0.0.1:1883"},
     "hooks": {"UserPromptSubmit": [{"hooks": [{"type": "command", "command": "python -m
     agent_monitor.adapters.claude_code"}]}],
               "PreToolUse":  [{"matcher": "*", "hooks": [... same command ...]}],
               "PostToolUse": [{"matcher": "*", "hooks": [... same command ...]}],
               "SessionStart": [...], "SessionEnd": [...]}}

Each hook runs this module as a new process with the event's JSON on stdin (`session_id`,
`hook_event_name`, `cwd`, and per event `prompt`, `tool_name`, `tool_input`, `tool_response`):

- `UserPromptSubmit`: the first prompt of a session starts run `session_id` with the prompt as its
  task; a later prompt is a step (`user: ...`); a prompt after an abort starts a fresh run
  `session_id.2` (then `.3`, ...).
- `PostToolUse`: publishes `TOOL input` + `-> response` (clipped) as the run's next step; a session
  whose run has not started (no prompt hook) starts lazily with `AGENT_MONITOR_TASK` or a generic
  task.
- `PreToolUse`: reads the run's retained signal (`agents/{run_id}/signal`); if it is `abort`, the
  tool call is blocked with a reason telling Claude to stop. Default: exit code 2 with the reason on
  stderr (Claude Code blocks the tool call and shows the reason to Claude; the long-standing
  documented behaviour). `AGENT_MONITOR_CLAUDE_BLOCK=json` answers with JSON on stdout instead:
  `hookSpecificOutput.permissionDecision = "deny"` with `permissionDecisionReason`, plus
  `"continue": false` and `stopReason`, which stops Claude altogether. Once aborted, later calls are
  blocked without asking the broker again.
- `SessionStart` starts the run at once when `AGENT_MONITOR_TASK` is set; `SessionEnd` ends the run
  (a session resumed later continues as a fresh run `session_id.N`). Other events (`Stop`,
  `Notification`) do nothing.

Step indices stay consistent across the separate hook processes: a small JSON state file per session
(run id, task, next index, aborted) under `AGENT_MONITOR_CLAUDE_STATE` (default
`$XDG_STATE_HOME/agent-monitor/claude-code`), read and written under an exclusive lock; a step's
index is used up only once the step was handed to the MQTT client (a broker that is down uses up
nothing). Every hook re-sends the run's identical `start`, which the monitor ignores as a
re-delivery, so each process can publish on its own connection. Everything fails open: a broker that
is down or a payload that cannot be read costs a warning on stderr and exit code 0, never a blocked
tool or a stuck session.

Environment: `AGENT_MONITOR_BROKER` (default mqtt://127.0.0.1:1883), `AGENT_MONITOR_TOPIC_PREFIX`
(agents), `AGENT_MONITOR_POLICY` (a JSON object, e.g. `{"abort_below": 0.15}`),
`AGENT_MONITOR_CRITERIA` (a bundled rubric name), `AGENT_MONITOR_TASK`, `AGENT_MONITOR_CLAUDE_BLOCK`
(`exit2` or `json`), `AGENT_MONITOR_SIGNAL_WAIT` (seconds to wait for the retained signal, 0.3),
`AGENT_MONITOR_CONNECT_TIMEOUT` (3), `AGENT_MONITOR_MAX_CHARS` (4000 per step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

DEFAULT_BROKER = "mqtt://127.0.0.1:1883"
HOOK_COMMAND = "python -m agent_monitor.adapters.claude_code"
EXIT_BLOCK = 2
"""Claude Code's blocking exit code: for PreToolUse, the tool call is blocked and stderr is shown
to Claude."""


def settings_snippet(command: str = HOOK_COMMAND, broker: str = DEFAULT_BROKER) -> dict[str, Any]:
    """The `.claude/settings.json` block that runs this hook on every event it handles."""
    hook = [{"type": "command", "command": command, "timeout": 15}]
    return {
        "env": {"AGENT_MONITOR_BROKER": broker},
        "hooks": {
            "SessionStart": [{"hooks": hook}],
            "UserPromptSubmit": [{"hooks": hook}],
            "PreToolUse": [{"matcher": "*", "hooks": hook}],
            "PostToolUse": [{"matcher": "*", "hooks": hook}],
            "SessionEnd": [{"hooks": hook}],
        },
    }


# -- configuration --


@dataclass(frozen=True)
class Config:
    broker: str = DEFAULT_BROKER
    prefix: str = "agents"
    state_dir: Path = Path(".")
    policy: dict[str, Any] | None = None
    criteria: str | None = None
    task: str | None = None
    block_mode: str = "exit2"
    signal_wait: float = 0.3
    connect_timeout: float = 3.0
    max_chars: int = 4000

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        state = env.get("AGENT_MONITOR_CLAUDE_STATE") or str(
            Path(env.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
            / "agent-monitor"
            / "claude-code"
        )
        policy = None
        if raw := env.get("AGENT_MONITOR_POLICY"):
            try:
                policy = json.loads(raw)
            except ValueError:
                policy = None
            if not isinstance(policy, dict):
                raise ValueError(
                    "AGENT_MONITOR_POLICY must be a JSON object, e.g. "
                    f'{{"abort_below": 0.15}}: {raw!r}'
                )
        block = (env.get("AGENT_MONITOR_CLAUDE_BLOCK") or "exit2").strip().lower()
        if block not in ("exit2", "json"):
            raise ValueError(f"AGENT_MONITOR_CLAUDE_BLOCK must be exit2 or json, not {block!r}")
        return cls(
            broker=env.get("AGENT_MONITOR_BROKER") or DEFAULT_BROKER,
            prefix=env.get("AGENT_MONITOR_TOPIC_PREFIX") or "agents",
            state_dir=Path(state),
            policy=policy,
            criteria=env.get("AGENT_MONITOR_CRITERIA") or None,
            task=env.get("AGENT_MONITOR_TASK") or None,
            block_mode=block,
            signal_wait=float(env.get("AGENT_MONITOR_SIGNAL_WAIT") or 0.3),
            connect_timeout=float(env.get("AGENT_MONITOR_CONNECT_TIMEOUT") or 3.0),
            max_chars=int(env.get("AGENT_MONITOR_MAX_CHARS") or 4000),
        )


# -- per-session state, shared by the hook processes --


@dataclass
class SessionState:
    session_id: str
    run_id: str
    generation: int = 1
    task: str | None = None
    policy: dict[str, Any] | None = None
    criteria: str | None = None
    next_index: int = 1
    aborted: bool = False
    abort_reason: str | None = None
    ended: bool = False

    @property
    def started(self) -> bool:
        return self.task is not None

    def successor(self) -> SessionState:
        """A fresh run for the same session (after an abort or an end): run id
        `{session}.{generation}`."""
        gen = self.generation + 1
        return SessionState(
            session_id=self.session_id, run_id=f"{_safe(self.session_id)}.{gen}", generation=gen
        )


def _safe(name: str) -> str:
    """A run id / file name from a session id: one topic level of A-Z a-z 0-9 . _ : - (not
    starting with _)."""
    return re.sub(r"[^A-Za-z0-9._:-]+", "-", name).strip("-_")[:120] or "session"


@contextlib.contextmanager
def _locked(path: Path, timeout: float = 10.0) -> Iterator[None]:
    """An exclusive lock on `path` across processes (fcntl where there is one, else an atomic
    mkdir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows
        lockdir = path.with_suffix(".lockdir")
        deadline = time.monotonic() + timeout
        while True:
            try:
                lockdir.mkdir()
                break
            except FileExistsError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lockdir} is held by another hook process") from None
                time.sleep(0.01)
        try:
            yield
        finally:
            lockdir.rmdir()
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


class StateStore:
    """One JSON file per session under a directory, with a lock file beside it."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def path(self, session_id: str) -> Path:
        return self.dir / f"{_safe(session_id)}.json"

    def lock(self, session_id: str) -> contextlib.AbstractContextManager[None]:
        return _locked(self.dir / f"{_safe(session_id)}.lock")

    def load(self, session_id: str) -> SessionState:
        try:
            data = json.loads(self.path(session_id).read_text(encoding="utf-8"))
            return SessionState(**data)
        except (OSError, ValueError, TypeError):  # none yet, or unreadable: a fresh state
            return SessionState(session_id=session_id, run_id=_safe(session_id))

    def save(self, state: SessionState) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.path(state.session_id)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(state)), encoding="utf-8")
        os.replace(tmp, p)  # atomic: a reader never sees half a file

    def prune(self, max_age_s: float = 7 * 86400) -> None:
        """Forget sessions untouched for `max_age_s` (their state and lock files)."""
        cutoff = time.time() - max_age_s
        with contextlib.suppress(OSError):
            for p in self.dir.iterdir():
                if p.suffix in (".json", ".lock", ".tmp"):
                    with contextlib.suppress(OSError):
                        if p.stat().st_mtime < cutoff:
                            p.unlink()


# -- step text --


def _clip(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def _json(value: object) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def tool_step(
    tool_name: str, tool_input: object, tool_response: object, max_chars: int = 4000
) -> str:
    """One tool use as the judge should read it: what was asked, and what came back (each
    clipped)."""
    half = max(200, max_chars // 2)
    args = tool_input if isinstance(tool_input, Mapping) else {}
    resp = tool_response if isinstance(tool_response, Mapping) else {}
    lines: list[str] = []
    if tool_name == "Bash" and isinstance(args.get("command"), str):
        lines.append(_clip("$ " + args["command"], half))
        if resp:
            out = "\n".join(
                s
                for s in (
                    str(resp.get("stdout") or "").rstrip(),
                    f"stderr: {str(resp['stderr']).rstrip()}" if resp.get("stderr") else "",
                    "[interrupted]" if resp.get("interrupted") else "",
                )
                if s
            )
            lines.append("-> " + _clip(out or "(no output)", half))
        elif tool_response is not None:
            lines.append("-> " + _clip(_json(tool_response), half))
        return "\n".join(lines)
    if tool_name in ("Write", "Edit", "MultiEdit", "NotebookEdit") and (
        args.get("file_path") or args.get("notebook_path")
    ):
        path = args.get("file_path") or args.get("notebook_path")
        lines.append(f"{tool_name} {path}")
        if isinstance(args.get("old_string"), str):
            lines.append(_clip("- " + args["old_string"], half // 2))
        if isinstance(args.get("new_string"), str):
            lines.append(_clip("+ " + args["new_string"], half // 2))
        if isinstance(args.get("content"), str):
            lines.append(_clip(args["content"], half))
        for edit in args.get("edits") or []:
            if isinstance(edit, Mapping):
                lines.append(
                    _clip(
                        f"- {edit.get('old_string', '')}\n+ {edit.get('new_string', '')}", half // 2
                    )
                )
        if isinstance(args.get("new_source"), str):
            lines.append(_clip(args["new_source"], half))
        # The response repeats the file (originalFile) and the patch: only an error is worth the
        # tokens.
        if isinstance(tool_response, str) and tool_response.strip():
            lines.append("-> " + _clip(tool_response, half))
        elif resp.get("error"):
            lines.append("-> error: " + _clip(_json(resp["error"]), half))
        return _clip("\n".join(lines), max_chars)
    if tool_name == "Read" and isinstance(args.get("file_path"), str):
        lines.append(f"Read {args['file_path']}")
        file = resp.get("file") if isinstance(resp.get("file"), Mapping) else None
        content = (
            file.get("content")
            if file
            else resp.get("content", tool_response if isinstance(tool_response, str) else None)
        )
        if content is not None:
            lines.append("-> " + _clip(_json(content), half))
        return "\n".join(lines)
    lines.append(
        _clip(f"{tool_name} {_json(tool_input) if tool_input is not None else ''}".rstrip(), half)
    )
    if tool_response is not None:
        lines.append("-> " + _clip(_json(tool_response), half))
    return "\n".join(lines)


# -- the hook --


class Hook:
    """Handles one hook event; returns the process exit code, writing Claude Code's answer to
    stdout/stderr."""

    def __init__(self, config: Config, stdout: IO[str], stderr: IO[str]) -> None:
        self.config = config
        self.store = StateStore(config.state_dir)
        self.out = stdout
        self.err = stderr

    def warn(self, message: str) -> None:
        print(f"agent-monitor hook: {message}", file=self.err)

    def handle(self, payload: Mapping[str, Any]) -> int:
        event = str(payload.get("hook_event_name") or "")
        session = payload.get("session_id")
        if not isinstance(session, str) or not session:
            self.warn(f"no session_id in the {event or 'hook'} payload; nothing sent")
            return 0
        if event == "PreToolUse":
            return self.pre_tool_use(session)
        if event.startswith("PostToolUse"):
            return self.post_tool_use(session, payload)
        if event == "UserPromptSubmit":
            return self.user_prompt(session, payload)
        if event == "SessionStart":
            return self.session_start(session)
        if event == "SessionEnd":
            return self.session_end(session)
        return 0  # Stop, Notification, ...: nothing to do

    # events

    def session_start(self, session: str) -> int:
        self.store.prune()
        if self.config.task is None:
            return 0  # the first prompt will be the task
        with self.store.lock(session):
            state = self.store.load(session)
            if state.ended:
                state = state.successor()  # a resumed session after its end: a new run
            if not state.started:
                self._publish(state, None, task=self.config.task)
        return 0

    def user_prompt(self, session: str, payload: Mapping[str, Any]) -> int:
        prompt = str(payload.get("prompt") or "").strip()
        if not prompt:
            return 0
        text = _clip(f"user: {prompt}", self.config.max_chars)
        meta = {"event": "UserPromptSubmit"}
        with self.store.lock(session):
            state = self.store.load(session)
            if state.started and (state.aborted or state.ended):
                if not state.ended:
                    self._end(state)  # the aborted run is over; the user's new prompt is a new run
                state = state.successor()
            if not state.started:
                # The first prompt is the task (unless AGENT_MONITOR_TASK gives one; then it is a
                # step).
                self._publish(
                    state,
                    text if self.config.task else None,
                    task=self.config.task or prompt,
                    meta=meta,
                )
            else:
                self._publish(state, text, meta=meta)
        return 0

    def post_tool_use(self, session: str, payload: Mapping[str, Any]) -> int:
        name = str(payload.get("tool_name") or "tool")
        response = payload.get("tool_response", payload.get("error"))
        text = tool_step(name, payload.get("tool_input"), response, self.config.max_chars)
        with self.store.lock(session):
            state = self.store.load(session)
            if state.aborted:
                return 0  # the monitor no longer judges this run
            if state.ended:
                state = state.successor()
            task = None if state.started else (self.config.task or self._generic_task(payload))
            self._publish(state, text, task=task, meta={"tool": name})
        return 0

    def pre_tool_use(self, session: str) -> int:
        with self.store.lock(session):
            state = self.store.load(session)
        if not state.started or state.ended:
            return 0  # nothing judged for this run yet
        if not state.aborted:
            signal = self._read_signal(state)
            if signal is None or signal.signal != "abort":
                return 0
            with self.store.lock(session):
                state = self.store.load(session)
                state.aborted = True
                state.abort_reason = self._abort_text(signal.step, signal.score, signal.reason)
                self.store.save(state)
        return self._block(state.abort_reason or "the progress monitor aborted this run")

    def session_end(self, session: str) -> int:
        with self.store.lock(session):
            state = self.store.load(session)
            if state.started and not state.ended:
                self._end(state)
                state.ended = True
                self.store.save(state)
        return 0

    # helpers

    @staticmethod
    def _generic_task(payload: Mapping[str, Any]) -> str:
        cwd = payload.get("cwd")
        return (
            f"Complete the user's request in the Claude Code session in {cwd}."
            if cwd
            else ("Complete the user's request in this Claude Code session.")
        )

    @staticmethod
    def _abort_text(step: int | None, score: float | None, reason: str) -> str:
        where = f" at step {step}" if step is not None else ""
        how = f" (score {score:.2f})" if score is not None else ""
        return (
            f"Blocked by agent-monitor: the progress monitor aborted this run{where}{how}: "
            f"{reason}. "
            "Do not call more tools; stop and tell the user what you did and that the run "
            "was stopped."
        )

    def _block(self, reason: str) -> int:
        if self.config.block_mode == "json":
            answer = {
                "continue": False,
                "stopReason": reason,
                "hookSpecificOutput": {
                    "hookEventName": "PreToolUse",
                    "permissionDecision": "deny",
                    "permissionDecisionReason": reason,
                },
            }
            print(json.dumps(answer), file=self.out)
            return 0
        print(reason, file=self.err)
        return EXIT_BLOCK

    def _client(self) -> Any:
        from agent_monitor.wire import MonitorClient

        return MonitorClient(
            self.config.broker,
            prefix=self.config.prefix,
            client_id=f"claude-code-hook-{uuid.uuid4().hex[:12]}",
            connect_timeout=self.config.connect_timeout,
            ack_timeout=self.config.connect_timeout,
        )

    def _start(self, client: Any, state: SessionState) -> Any:
        assert state.task is not None
        return client.start_run(
            state.run_id, task=state.task, policy=state.policy, criteria=state.criteria
        )

    def _publish(
        self,
        state: SessionState,
        text: str | None,
        *,
        task: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Start the run if `task` is given, send `text` as its next step, and save the state
        (under the lock)."""
        fresh = not state.started
        if fresh:
            if task is None:
                return  # cannot happen through handle(); nothing to attach a step to
            state.task, state.policy, state.criteria = (
                task,
                self.config.policy,
                self.config.criteria,
            )
        try:
            with self._client() as client:
                run = self._start(client, state)  # the same start as before: ignored by the monitor
                if text is not None:
                    run.step(text, index=state.next_index, meta=meta)
        except Exception as e:  # fail open: the session goes on without the monitor
            self.warn(f"could not reach the monitor at {self.config.broker}: {e}")
            if fresh:
                state.task = None  # not started after all; the next hook tries again
            return
        if text is not None:
            state.next_index += 1
        self.store.save(state)

    def _end(self, state: SessionState) -> None:
        try:
            with self._client() as client:
                self._start(client, state).end()
        except Exception as e:
            self.warn(f"could not end run {state.run_id} on the monitor: {e}")

    def _read_signal(self, state: SessionState) -> Any:
        """The run's latest retained signal (SignalOut), or None when there is none or the broker
        is away."""
        try:
            with self._client() as client:
                run = self._start(client, state)
                # Mosquitto sends a retained message right after the SUBACK, usually before
                # start_run returns.
                deadline = time.monotonic() + self.config.signal_wait
                while run.signal is None and time.monotonic() < deadline:
                    time.sleep(0.005)
                return run.signal
        except Exception as e:
            self.warn(f"could not read the monitor's signal at {self.config.broker}: {e}")
            return None


def main(
    argv: Sequence[str] | None = None,
    *,
    stdin: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m agent_monitor.adapters.claude_code",
        description="A Claude Code hook: publish tool uses to agent-monitor, block tool "
        "calls when it aborts the run.",
    )
    ap.add_argument(
        "--broker", help="MQTT broker URL (default: $AGENT_MONITOR_BROKER or mqtt://127.0.0.1:1883)"
    )
    ap.add_argument("--state-dir", help="per-session state (default: $AGENT_MONITOR_CLAUDE_STATE)")
    ap.add_argument(
        "--block-mode", choices=("exit2", "json"), help="how to block a tool call on abort"
    )
    ap.add_argument(
        "--print-settings", action="store_true", help="print the .claude/settings.json hooks block"
    )
    args = ap.parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    if args.print_settings:
        print(
            json.dumps(
                settings_snippet(
                    broker=args.broker or env.get("AGENT_MONITOR_BROKER") or DEFAULT_BROKER
                ),
                indent=2,
            )
        )
        return 0
    from ._cli import quiet_logs

    quiet_logs()
    for flag, name in (
        (args.broker, "AGENT_MONITOR_BROKER"),
        (args.state_dir, "AGENT_MONITOR_CLAUDE_STATE"),
        (args.block_mode, "AGENT_MONITOR_CLAUDE_BLOCK"),
    ):
        if flag:
            env[name] = flag
    try:
        config = Config.from_env(env)
    except ValueError as e:
        print(f"agent-monitor hook: {e}", file=sys.stderr)
        return 0  # a misconfigured monitor must not block the session
    raw = (stdin or sys.stdin).read()
    try:
        payload = json.loads(raw)
    except ValueError:
        print(
            "agent-monitor hook: stdin is not the hook's JSON payload; nothing sent",
            file=sys.stderr,
        )
        return 0
    if not isinstance(payload, Mapping):
        print("agent-monitor hook: the payload is not a JSON object; nothing sent", file=sys.stderr)
        return 0
    return Hook(config, sys.stdout, sys.stderr).handle(payload)


if __name__ == "__main__":
    sys.exit(main())
