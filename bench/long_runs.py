"""Long runs at a constant cost per step: a 1,000-step run against an HTTP judge, bounded layout vs
the whole run.

One run of `--steps` steps of `--step-bytes` bytes, scored at every step by the tracker
(`ProgressTracker`'s core, the path the daemon's scorers take) through `OpenAIJudge` against a
scripted OpenAI-compatible judge in a process of its own. The judge answers a letter with logprobs
and refuses, with OpenAI's 400 context-length message, a prompt over its context (counted at 3 bytes
per token, a real tokenizer's rate on agent text). Per layout and context: bytes per scoring, the
monitor's CPU per scoring by 100-step bucket, the share of steps scored, RSS, and what the judge
reads anew per scoring (beyond the common prefix with the previous prompt) summed over the run,
against the run's own text. "whole" is the layout without a budget (the judge's context unknown and
no `prompt_budget`): the whole run at every step, as before issue 42 (with the short tail).
"bounded" gives the judge its context.

`--recorded DIR` instead reports on recorded runs (Terminal-Bench 2.1): the judge's re-read over a
run that fits its context, and the share of steps an 8,192-token judge can score with the whole run
vs the bounded layout, with prompt tokens counted by the packaged Gemma tokenizer (no model
evaluated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import resource
import statistics
import time
from typing import Any

from _common import configure_logs, free_port, load1, proc_status_kb, wait_port

from agent_monitor import (
    AsyncProgressTracker,
    JudgeRequest,
    JudgeResponse,
    OpenAIJudge,
    load_criteria,
)
from agent_monitor.prompts import PromptWindow, Step

SERVER_BYTES_PER_TOKEN = 3.0


def _serve(port: int, context: int, ready: Any) -> None:
    """The judge's process: answers every chat completion with `K`, or 400 when the body passes
    its context."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "K"},
        "logprobs": {
            "content": [
                {"token": "K", "logprob": 0.0, "top_logprobs": [{"token": "K", "logprob": 0.0}]}
            ]
        },
        "finish_reason": "length",
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            tokens = int(len(body) / SERVER_BYTES_PER_TOKEN)
            if tokens > context:
                msg = (
                    f"This model's maximum context length is {context} tokens. However, you "
                    f"requested {tokens} "
                    "tokens in the messages. Please reduce the length of the messages."
                )
                self._send(
                    400, {"error": {"message": msg, "type": "invalid_request_error", "code": None}}
                )
                return
            usage = {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1}
            self._send(
                200,
                {
                    "id": "c",
                    "object": "chat.completion",
                    "model": "scripted",
                    "choices": [choice],
                    "usage": usage,
                },
            )

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    httpd.daemon_threads = True
    ready.set()
    httpd.serve_forever(poll_interval=0.05)


def common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of two strings (binary search over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def step_text(i: int, size: int, rng: random.Random) -> str:
    """A coding agent's step of about `size` bytes: a command, output lines, sometimes a test
    summary."""
    head = f"$ python -m pytest -q tests/test_part_{i % 17}.py\nObservation:\n"
    lines = []
    while sum(len(x) + 1 for x in lines) < size - len(head) - 60:
        lines.append(
            f"tests/test_part_{i % 17}.py::test_case_{rng.randrange(10**6)} "
            f"{rng.choice(['PASSED', 'FAILED'])}"
        )
    return (
        head + "\n".join(lines) + f"\n{i % 9} failed, {9 - i % 9} passed in "
        f"0.{i % 10}s\n[exit code {int(i % 9 > 0)}]"
    )


class Recorder:
    """Wraps a judge: the text of every prompt sent, for bytes and re-read per scoring."""

    def __init__(self, judge: OpenAIJudge) -> None:
        self.judge = judge
        self.sizes: list[int] = []
        self.reread = 0
        self._prev = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.judge, name)

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        text = request.prompt.text()
        self.sizes.append(len(text.encode()))
        self.reread += len(text) - common_prefix(self._prev, text)
        self._prev = text
        return await self.judge.grade(request)


async def one_run(url: str, context: int, layout: str, steps: list[str]) -> dict[str, Any]:
    judge = OpenAIJudge(base_url=url, model="scripted", max_retries=0)
    if layout == "bounded":
        judge.context_tokens = context
    rec = Recorder(judge)
    tracker = AsyncProgressTracker(
        "Make every test in tests/ pass.", judge=rec, criteria=load_criteria(None)
    )
    cpu: list[float] = []
    ok = []
    rss = []
    for i, text in enumerate(steps, 1):
        t0 = time.process_time()
        p = await tracker.update(text)
        cpu.append(time.process_time() - t0)
        ok.append(p.ok)
        if i % 100 == 0:
            rss.append(proc_status_kb() // 1024)
    await judge.aclose() if hasattr(judge, "aclose") else None
    buckets = [statistics.mean(cpu[k : k + 100]) * 1000 for k in range(0, len(cpu), 100)]
    run_text = sum(len(s) for s in steps)
    return {
        "layout": layout,
        "context": context,
        "scored": sum(ok[1:]) / max(1, len(ok) - 1),
        "first_fail": next((i for i, x in enumerate(ok, 1) if not x), None),
        "bytes_first": rec.sizes[0],
        "bytes_max": max(rec.sizes),
        "bytes_total": sum(rec.sizes),
        "cpu_ms": buckets,
        "reread_x": rec.reread / run_text,
        "rss_mb": rss,
        "compactions": tracker.window.compactions,
    }


def live(args: argparse.Namespace) -> None:
    rng = random.Random(42)
    steps = [step_text(i, args.step_bytes, rng) for i in range(1, args.steps + 1)]
    print(
        f"load average (1 min) at start: {load1()}; {args.steps} steps of {args.step_bytes} bytes"
    )
    for context in (8192, 131072):
        port = free_port()
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=_serve, args=(port, context, ready), daemon=True)
        proc.start()
        try:
            ready.wait(30)
            wait_port(port)
            for layout in args.layouts.split(","):
                r = asyncio.run(one_run(f"http://127.0.0.1:{port}/v1", context, layout, steps))
                cpu = " ".join(f"{x:.1f}" for x in r["cpu_ms"])
                print(
                    f"context {context:>6} {layout:>7}: scored {r['scored']:.1%} (first "
                    "failure at step "
                    f"{r['first_fail']}), request {r['bytes_first']:,} B at step 1, max "
                    f"{r['bytes_max']:,} B, total "
                    f"{r['bytes_total'] / 1e6:,.1f} MB; CPU ms/scoring by 100 steps: {cpu} "
                    "(last/first "
                    f"{r['cpu_ms'][-1] / r['cpu_ms'][0]:.2f}x); re-read {r['reread_x']:.2f}x "
                    "the run's text; RSS MB "
                    f"{r['rss_mb'][0]}..{r['rss_mb'][-1]}; compactions {r['compactions']}; "
                    f"load {load1()}",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.join(10)
    print(
        f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB; load at "
        f"end: {load1()}"
    )


def recorded(args: argparse.Namespace) -> None:
    from _common import gemma_path
    from llama_cpp import Llama

    from agent_monitor.offline.recorded import iter_recorded

    tok = Llama(model_path=gemma_path(), vocab_only=True, verbose=False)

    def count(text: str) -> int:
        return len(tok.tokenize(text.encode(), add_bos=True, special=False))

    print(f"load average (1 min) at start: {load1()}")
    rubric = load_criteria(None)
    crit = rubric.criteria[0]
    context = 8192
    rows = []
    for run in iter_recorded(args.recorded):
        if "terminal-bench-2.1" not in args.recorded and "__" not in run.name:
            continue
        steps = [Step(i, s.text) for i, s in enumerate(run.steps, 1)]
        whole = PromptWindow(run.task, rubric)
        bounded = PromptWindow(run.task, rubric)
        prev, reread, fit_whole, fit_bounded, over = "", 0, 0, 0, 0
        # The whole-run prompt's tokens: its head and tail once, each step's block once (additive,
        # so O(run)).
        first = whole.build(steps, crit, n=1).text()
        base = count(first) - count(f"\n### Step 1\n{steps[0].shown}\n")
        total = base
        for n in range(1, len(steps) + 1):
            text = whole.build(steps, crit, n=n).text()
            reread += len(text) - common_prefix(prev, text)
            prev = text
            if n > 1:
                total += count(f"\n### Step {n}\n{steps[n - 1].shown}\n")
            fit_whole += total <= context
            b = bounded.build(steps, crit, n=n, budget=context - 128).text()
            real = count(b)
            fit_bounded += real <= context
            over = max(over, real)
        rows.append(
            (
                run.name,
                len(steps),
                total,
                reread / len(prev),
                fit_whole / len(steps),
                fit_bounded / len(steps),
                over,
                bounded.compactions,
            )
        )
        print(
            f"{run.name}: {len(steps)} steps, whole-run prompt {total:,} tokens at the end; "
            f"re-read {reread / len(prev):.3f}x the "
            "final prompt (whole layout); steps an 8,192-token judge can score: whole "
            f"{fit_whole / len(steps):.0%}, bounded "
            f"{fit_bounded / len(steps):.0%} (largest bounded prompt {over:,} tokens, "
            f"{bounded.compactions} compactions)",
            flush=True,
        )
    fits = [r for r in rows if r[2] <= context]
    print(
        f"{len(rows)} runs, {sum(r[2] > context for r in rows)} over 8,192 tokens; re-read "
        "over runs that fit: "
        + (f"{min(r[3] for r in fits):.3f}-{max(r[3] for r in fits):.3f}x" if fits else "none fits")
        + "; re-read over all runs "
        f"{min(r[3] for r in rows):.3f}-{max(r[3] for r in rows):.3f}x; steps scored at "
        "8K: "
        f"whole {statistics.mean(r[4] for r in rows):.1%}, bounded "
        f"{statistics.mean(r[5] for r in rows):.1%}; "
        f"load at end {load1()}"
    )


def compare(args: argparse.Namespace) -> None:
    """The packaged judge's scores with the whole prompt vs the bounded one (an 8,192-token
    judge's budget)."""
    from _common import gemma_path

    from agent_monitor.judges.llamacpp import LlamaCppJudge
    from agent_monitor.offline.evaluate import spearman
    from agent_monitor.offline.recorded import load_recorded

    print(f"load average (1 min) at start: {load1()}")
    # A 16K context: the whole prompts of these runs (under 8,192 real tokens) are never folded
    # under its budget.
    judge = LlamaCppJudge(gemma_path(), n_ctx=16384)
    judge.context_tokens = 16384
    diffs: list[float] = []
    whole_all: list[float] = []
    bounded_all: list[float] = []
    start = time.perf_counter()
    # one loop for every scoring: the in-process judge is bound to its first
    loop = asyncio.new_event_loop()
    for path in args.compare:
        run = load_recorded(path)
        scores: dict[str, list[float | None]] = {}
        trackers = {
            layout: AsyncProgressTracker(
                run.task, judge=judge, prompt_budget=budget, run_id=f"{run.name}-{layout}"
            )
            for layout, budget in (("whole", None), ("bounded", 8192 - 128))
        }

        async def go(t: AsyncProgressTracker, texts: list[str]) -> list[float | None]:
            return [(await t.update(text)).score for text in texts]

        for layout, t in trackers.items():
            scores[layout] = loop.run_until_complete(go(t, [s.text for s in run.steps]))
        folds = trackers["bounded"].window.compactions
        pairs = [
            (a, b)
            for a, b in zip(scores["whole"], scores["bounded"], strict=True)
            if a is not None and b is not None
        ]
        diffs.extend(abs(a - b) for a, b in pairs)
        whole_all.extend(a for a, _ in pairs)
        bounded_all.extend(b for _, b in pairs)
        print(
            f"{run.name}: {len(run.steps)} steps, {folds} compactions under the 8K budget; "
            "mean |whole - bounded| "
            f"{statistics.mean(abs(a - b) for a, b in pairs):.3f} over {len(pairs)} steps; "
            "rank agreement "
            f"(Spearman) {spearman([a for a, _ in pairs], [b for _, b in pairs])}",
            flush=True,
        )
    judge.close()
    loop.close()
    print(
        f"all: mean absolute difference {statistics.mean(diffs):.3f} over {len(diffs)} steps, "
        "Spearman "
        f"{spearman(whole_all, bounded_all)}; {time.perf_counter() - start:.0f} s; load at "
        f"end {load1()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--step-bytes", type=int, default=4096)
    ap.add_argument("--layouts", default="bounded,whole")
    ap.add_argument(
        "--recorded",
        metavar="DIR",
        help="report on recorded runs instead (e.g. ../shared/data/terminal-bench-2.1)",
    )
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN",
        help="recorded runs to score whole and bounded (Gemma)",
    )
    args = ap.parse_args()
    configure_logs("error")
    if args.compare:
        compare(args)
    elif args.recorded:
        recorded(args)
    else:
        live(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
