"""CPU per judge call through `OpenAIJudge`: the lean HTTP path against the OpenAI SDK path, same
run, same server.

A scripted OpenAI-compatible server in a process of its own answers every chat completion with a
realistic reply (one generated token with 20 `top_logprobs`, usage with cached tokens) after
`--latency` seconds. This process grades the same prompts through `OpenAIJudge(transport="sdk")`
(the `openai` SDK: request options, headers, httpx; the raw reply read as a dict) and
`OpenAIJudge(transport="lean")` (one JSON body over pooled keep-alive HTTP/1.1, the reply read as
a dict), alternating rounds so both see the same machine. The prompt is built by the real prompt
builder from a 12-step trajectory of ~400 characters a step (what a mid-run scoring sends).

What it measures: this process's CPU (user + system, `time.process_time`) per graded call, which
is everything the monitor spends on one judge call (prompt rendering, request build, HTTP, JSON,
logprob extraction, the retry/limit wrapper), and the wall time per call with `--concurrency` in
flight. The server's CPU is not counted (another process). Bounded by this machine's cores when
other work runs: the load average is printed at the start and the end.

    .venv/bin/python bench/judge_cpu.py [--calls 400] [--rounds 3] [--concurrency 8] [--latency 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import time
from typing import Any

from _common import free_port, kv_line, load1, wait_port

from agent_monitor import OpenAIJudge
from agent_monitor.criteria import load_criteria
from agent_monitor.judges.base import JudgeRequest
from agent_monitor.prompts import Step, build_prompt
from agent_monitor.scale import LETTERS

TASK = (
    "Make the failing test pass in the repository: find the bug in the parser, fix it, "
    "and run the test suite."
)
STEP = (
    "$ python -m pytest -q tests/test_parser.py\n"
    "F.F...                                                                   [100%]\n"
    "FAILED tests/test_parser.py::test_nested - AssertionError: expected 3 tokens, got 2\n"
    "$ sed -n 40,80p parser.py\n    def tokens(self, text):\n        out = []\n        for "
    "part in text.split():\n"
    "            out.append(part)\n        return out\n"
)


def _serve(port: int, latency_s: float, ready: Any) -> None:
    """The server's process: a threaded HTTP/1.1 server with one realistic reply for every
    completion."""
    import signal
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    signal.signal(
        signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start()
    )
    weights = [math.exp(-0.35 * i) for i in range(20)]
    total = sum(weights)
    tops = [
        {"token": letter, "logprob": math.log(w / total), "bytes": list(letter.encode())}
        for letter, w in zip("KJLIMHNGOFPEQDRCSBTA", weights, strict=True)
    ]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "K"},
        "logprobs": {
            "content": [
                {"token": "K", "logprob": tops[0]["logprob"], "bytes": [75], "top_logprobs": tops}
            ]
        },
        "finish_reason": "length",
    }
    body = json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "scripted",
            "choices": [choice],
            "usage": {
                "prompt_tokens": 1800,
                "completion_tokens": 1,
                "total_tokens": 1801,
                "prompt_tokens_details": {"cached_tokens": 1700},
            },
        }
    ).encode()
    models = json.dumps(
        {"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "bench"}]}
    )

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, data: bytes) -> None:
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def do_GET(self) -> None:
            self._send(models.encode())

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if latency_s:
                time.sleep(latency_s)
            self._send(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    httpd.daemon_threads = True
    ready.set()
    httpd.serve_forever(poll_interval=0.05)


async def _round(
    judge: OpenAIJudge, requests: list[JudgeRequest], concurrency: int
) -> tuple[float, float]:
    """Grade every request with `concurrency` in flight; (CPU seconds, wall seconds) of this
    process."""
    queue = list(reversed(requests))

    async def worker() -> None:
        while queue:
            r = queue.pop()
            resp = await judge.grade(r)
            # a real answer each time, or the bench is wrong
            assert resp.samples and resp.samples[0], resp

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.process_time() - cpu0, time.perf_counter() - t0


async def _main(args: argparse.Namespace, url: str) -> None:
    rubric = load_criteria("progress")
    steps = [Step(i, f"step {i}\n{STEP}") for i in range(1, 13)]
    prompts = [build_prompt(TASK, rubric, steps, rubric.criteria[0])]
    requests = [JudgeRequest(prompts[0], run_key=f"run-{i % 40}") for i in range(args.calls)]
    judges = {
        t: OpenAIJudge(url, model="scripted", transport=t, concurrency=args.concurrency)
        for t in ("sdk", "lean")
    }
    cpu: dict[str, float] = dict.fromkeys(judges, 0.0)
    wall: dict[str, float] = dict.fromkeys(judges, 0.0)
    for judge in judges.values():  # warm-up: connections, caches, imports
        await _round(judge, requests[:40], args.concurrency)
    for _ in range(args.rounds):
        for t, judge in judges.items():
            c, w = await _round(judge, requests, args.concurrency)
            cpu[t] += c
            wall[t] += w
    for judge in judges.values():
        await judge.aclose()
    n = args.calls * args.rounds
    per = {t: 1000 * cpu[t] / n for t in judges}
    print(f"prompt: {len(prompts[0].text())} characters, {len(LETTERS)} letters, top_logprobs 20")
    for t in judges:
        print(
            f"{t:>5}: {per[t]:.3f} ms CPU per call, {1000 * wall[t] / n:.3f} ms wall per call "
            f"({args.concurrency} in flight)"
        )
    print(
        kv_line(
            sdk_cpu_ms=round(per["sdk"], 3),
            lean_cpu_ms=round(per["lean"], 3),
            ratio=round(per["sdk"] / per["lean"], 2),
            calls=n,
            concurrency=args.concurrency,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--latency", type=float, default=0.0)
    args = p.parse_args()
    print(f"load average at start: {load1()}")
    ctx = mp.get_context("spawn")
    port = free_port()
    ready = ctx.Event()
    proc = ctx.Process(target=_serve, args=(port, args.latency, ready), daemon=True)
    proc.start()
    try:
        ready.wait(30)
        wait_port(port)
        asyncio.run(_main(args, f"http://127.0.0.1:{port}/v1"))
    finally:
        proc.terminate()
        proc.join(10)
    print(f"load average at end: {load1()}")


if __name__ == "__main__":
    main()
