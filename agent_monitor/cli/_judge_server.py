"""`agent-monitor judge-server`: a local GGUF judge behind an OpenAI-compatible HTTP API.

The command supervises: the server and its model run in a child process, and when llama.cpp's native
code kills that child with a signal (SIGSEGV, SIGBUS, SIGILL) the command says so, with the known
cause and the way around it, instead of leaving clients with a dropped connection; it then exits
with 128 + the signal number, as a shell reports such a death.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from types import FrameType

from ..daemon import JudgeServer, JudgeServerSettings
from ..judges.llamacpp import crash_explanation
from ._flags import add_flags, build, flag_name

_CHILD = "--serve-in-this-process"


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    command: Callable[..., argparse.ArgumentParser],
    environ: Mapping[str, str],
) -> None:
    """Register `judge-server` (`command` is the CLI's subcommand factory)."""
    p = command(
        sub,
        "judge-server",
        "serve a local GGUF judge (default: the packaged Gemma 3 270M) over an "
        "OpenAI-compatible HTTP API",
        "Built as --judge local builds its model (llama.cpp's weight repacking off, which "
        "crashes some AVX-512 "
        "CPUs): point serve at it with --judge openai --judge-url http://HOST:PORT/v1. "
        "Routes: GET /v1/models, "
        "GET /props, GET /health, POST /tokenize, POST /v1/completions, POST "
        "/v1/chat/completions (logprobs, "
        "top_logprobs, max_tokens, n); usage.prompt_tokens_details.cached_tokens is the "
        "prompt prefix a slot kept.",
    )
    add_flags(p, JudgeServerSettings, environ, title="judge server")
    p.add_argument(_CHILD, action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Run the server in a child process and report how it ended (or, as that child, serve)."""
    settings = build(JudgeServerSettings, args)
    if getattr(args, _CHILD[2:].replace("-", "_")):
        return _serve(settings)
    return _supervise(settings)


def _supervise(settings: JudgeServerSettings) -> int:
    cmd = [sys.executable, "-m", "agent_monitor", "judge-server", _CHILD]
    for f in dataclasses.fields(JudgeServerSettings):
        value = getattr(settings, f.name)
        if value is not None:
            cmd += [flag_name(f), str(value)]
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def forward(signum: int, _frame: FrameType | None) -> None:
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    code = child.wait()
    why = crash_explanation(code, f"agent-monitor judge-server (pid {child.pid})")
    if why is not None:
        print(f"agent-monitor: {why}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def _serve(settings: JudgeServerSettings) -> int:
    _die_with_parent()
    try:
        server = JudgeServer.load(settings)
    except (OSError, ImportError, ValueError) as e:
        print(f"agent-monitor: judge-server cannot load its model: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(server))
    finally:
        server.close()


def _die_with_parent() -> None:
    """Have the kernel stop this child when its supervisor dies (Linux), so a killed supervisor
    leaves no server."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() == 1:  # the supervisor was gone before the request took effect
        raise SystemExit(0)


async def _run(server: JudgeServer) -> int:
    try:
        await server.open()
    except OSError as e:
        where = f"{server.settings.host}:{server.settings.port}"
        print(f"agent-monitor: judge-server cannot listen on {where}: {e}", file=sys.stderr)
        return 2
    m = server.model
    print(
        f"judge-server: {m.model_id} at {server.url}/v1 ({len(m.slots)} slot(s), n_ctx {m.n_ctx})",
        flush=True,
    )
    await server.serve()
    return 0
