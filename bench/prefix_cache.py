"""Judge cost with a real prefix cache: our prefix-stable prompt layout against the reference
library's own.

Starts `agent-monitor judge-server` with the packaged Gemma 3 270M, replays a recorded run
step by step through `AsyncProgressTracker` + `OpenAIJudge`, once with our
layout (instructions, task, criteria, steps; "n steps so far" and the criterion
last) and once with the BASELINE a user of the reference library runs: its
online `ProgressTracker.update` prompt (llm-as-a-verifier/llm-as-a-verifier,
`llm_verifier/progress.py` at commit 115de30: `build_progress_prompt(problem,
format_steps(steps), k, [k])`), ported here by layout with our own wording of
the same length (see `reference_prompt`): the evaluator preamble, the task,
then a trajectory header that names the step count ("Agent trajectory (k agent
steps ...)"), the steps as "=== Agent Step i ===" blocks, and the checkpoint
block after them. Its instructions and task are a stable prefix; the header
changes with every step, so nothing after it is reused. Same recorded steps
(after the same extractors), same judge class, same server; the baseline is
read at one token after the answer cue, as ours (upstream generates the
`<c1>` tag first: that only adds output tokens to its cost).

Reported: per-update latency at the first and last step for both, prompt tokens
sent, tokens the server actually evaluated (each answer's
`usage.prompt_tokens_details.cached_tokens` says how much of the prompt its slot
kept in the KV cache), and the share of each prompt that is a prefix of the next
one, on the server's own token ids (`POST /tokenize`).

    .venv/bin/python bench/prefix_cache.py [--run FILE] [--max-steps 30]

The server is judge-server (one slot, weight repacking off), not `llama_cpp.server`: the latter
repacks weights, which crashes some AVX-512 CPUs, and computes a log-softmax over every prompt
position of every logprobs request (O(prompt length x vocabulary) per call, cached prefix or not).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import REPO, cleanup_on_sigterm, configure_logs, judge_server, kv_line, load1

from agent_monitor import (
    AsyncProgressTracker,
    JudgeRequest,
    JudgeResponse,
    Prompt,
    build_prompt,
    load_criteria,
)
from agent_monitor.judges.openai import OpenAIJudge
from agent_monitor.offline.recorded import RecordedRun, load_recorded
from agent_monitor.prompts import Step, TextPart

DEFAULT_RUN = (
    REPO.parent / "shared" / "data" / "atif" / "pytorch-model-cli" / "success_trajectory.json"
)
FALLBACK_RUN = REPO / "tests" / "fixtures" / "atif_reverse_string.json"

# The reference library's online prompt, by layout (llm_verifier/progress.py, build_progress_prompt,
# commit 115de30): the parts in its order and about its lengths, in our own words (its text is not
# copied here).
_REF_PREAMBLE = (
    "You are a strict, skeptical judge of an agent's attempt at a task. Agents often claim "
    "success while "
    "their environment still shows errors, change the wrong thing, or never run the check "
    "the task asks "
    "for. Believe the observed output, not what the agent says about it."
)
_REF_SCORING = """You will score the trajectory at {n} CHECKPOINTS. The score measures ONE thing:

    "Given all the agent has done up to and including this step, would its CURRENT state pass the
    task's hidden grader (produce the files, output or behaviour the task requires)?"

Use the 20-letter A..T scale:
  A = certainly NO: nothing useful done yet, or the agent is on a clearly wrong path.
  B-G = leaning NO: some work exists but key parts are missing or broken.
  H-M = unsure: a plausible solution is forming, but nothing convincing has verified it.
  N-S = leaning YES: the right artifacts look in place and partial checks have passed, with small doubts.
  T = essentially certain YES: the agent ran the relevant check and its output matches what the task asks.

CALIBRATION RULES:
  * Effort, exploring, the number of steps and confident narration are NOT progress. An agent that ran
    twenty commands and still lacks the right output deserves a score near A.
  * Be skeptical by default. You cannot see the grader. A result without a real check should not go
    past about K, and even a checked-looking one should rarely pass about R unless the check clearly
    matches the task's stated success criterion.
  * The agent's own declarations ("done!", "all tests pass") are NO evidence. Score the actual actions
    and the actual output you can see.

EXPECTED PATTERNS: successive checkpoints need not rise.
  * On a trajectory that really solves the task, scores usually rise from A toward T.
  * On a trajectory committed to a WRONG approach, scores should level off once the wrong artifact exists.
  * If the agent breaks something that worked, scores should FALL.

The checkpoints to score are:
{checkpoints}

Score each checkpoint ON ITS OWN from the agent's best attempt at that point. Output EXACTLY {n} lines
and nothing else, in the format:
{tags}

where each LETTER is one letter from A to T."""


def reference_prompt(task: str, steps: list[str], step: int, criterion: str) -> Prompt:
    """The reference library's online prompt after `step` steps, as a Prompt (what its
    ProgressTracker sends)."""
    trajectory = "".join(
        f"=== Agent Step {i} ===\n{text.strip()}\n\n" for i, text in enumerate(steps[:step], 1)
    )
    head = (
        f"**Task instruction:**\n{task.strip()}\n\n"
        f"**Agent trajectory ({step} agent steps; each step is one action by the agent, with "
        "its observed output):**\n"
        f"{trajectory}"
    )
    scoring = _REF_SCORING.format(
        n=1,
        checkpoints=f"  Checkpoint 1 = state right after Agent Step {step}",
        tags="<c1>LETTER</c1>",
    )
    return Prompt(
        _REF_PREAMBLE, (TextPart(head),), (TextPart(scoring + "\n\n<c1>"),), criterion, step
    )


class LayoutJudge(OpenAIJudge):
    """OpenAIJudge that sends our prompt (`ours`) or the reference library's for the same steps,
    and remembers it."""

    def __init__(
        self, layout: str, task: str = "", steps: list[str] | None = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.layout = layout
        self.task = task
        self.steps = steps or []
        self.sent: list[Prompt] = []

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        p = request.prompt
        prompt = (
            p
            if self.layout == "ours"
            else reference_prompt(self.task, self.steps, p.step, p.criterion)
        )
        self.sent.append(prompt)
        return await super().grade(dataclasses.replace(request, prompt=prompt))


@dataclass
class Update:
    step: int
    latency_s: float
    prompt_tokens: int
    kept: int | None
    evaluated: int | None
    ok: bool
    score: float | None
    reason: str | None


@dataclass
class Phase:
    layout: str
    updates: list[Update] = field(default_factory=list)

    def at(self, step: int) -> Update | None:
        return next((u for u in self.updates if u.step == step), None)


def post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as resp:
        return json.loads(resp.read())


def tokenize(base: str, text: str) -> list[int]:
    return list(post_json(base + "/tokenize", {"content": text})["tokens"])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def all_prompts(run: RecordedRun, n: int) -> dict[str, list[str]]:
    """The prompt text each layout sends at steps 1..n (what `api=completions` posts)."""
    rubric = load_criteria(None)
    steps: list[Step] = [
        Step(index=i + 1, text=rubric.extractors(s.text)) for i, s in enumerate(run.steps[:n])
    ]
    texts = [s.text for s in steps]
    out: dict[str, list[str]] = {"ours": [], "baseline": []}
    for k in range(1, n + 1):
        for c in rubric.judged:
            p = build_prompt(run.task, rubric, steps[:k], c)
            out["ours"].append(p.text())
            out["baseline"].append(reference_prompt(run.task, texts, k, c.name).text())
    return out


async def warm_up(judge: LayoutJudge) -> None:
    """One unrelated short prompt, so the server's slot holds nothing useful when a phase starts."""
    model = await judge.resolve_model()
    await judge.client.completions.create(
        model=model, prompt="Warm-up: say A.", max_tokens=1, temperature=0.0
    )


async def replay(
    layout: str, run: RecordedRun, n: int, server: Any, args: argparse.Namespace, score_at: set[int]
) -> Phase:
    texts = [load_criteria(None).extractors(s.text) for s in run.steps[:n]]
    judge = LayoutJudge(
        layout,
        run.task,
        texts,
        base_url=server.url + "/v1",
        api=args.api,
        timeout_s=args.timeout,
        max_retries=0,
    )
    phase = Phase(layout)
    try:
        await warm_up(judge)
        tracker = AsyncProgressTracker(
            run.task, judge=judge, min_mass=args.min_mass, run_id=f"bench-{layout}"
        )
        for i, s in enumerate(run.steps[:n], start=1):
            await tracker.add(s.text)
            if i not in score_at:
                continue
            t0 = time.perf_counter()
            p = await tracker.score(i)
            latency = time.perf_counter() - t0
            # What the server's slot kept of the prompt(s), as each answer's usage says.
            kept = p.usage.cached_input_tokens
            evaluated = p.usage.input_tokens - kept
            phase.updates.append(
                Update(i, latency, p.usage.input_tokens, kept, evaluated, p.ok, p.score, p.reason)
            )
            tag = f"{p.score:.3f}" if p.score is not None else f"failed ({p.reason})"
            print(
                f"  {layout:<8} step {i:>2}: {latency:6.2f} s, {p.usage.input_tokens:>5} "
                "prompt tokens, "
                f"{evaluated if evaluated is not None else '?':>5} evaluated, score {tag}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        await judge.aclose()
    return phase


def parse_steps(spec: str, n: int) -> set[int]:
    if spec == "all":
        return set(range(1, n + 1))
    # first, last and two between: a baseline call does not depend on earlier ones
    if spec == "auto":
        return {1, max(1, round(n / 3)), max(1, round(2 * n / 3)), n}
    picked = {int(x) for x in spec.split(",") if x.strip()}
    return {min(max(1, x), n) for x in picked} | {1, n}


async def main_async(args: argparse.Namespace) -> int:
    path = Path(args.run) if args.run else (DEFAULT_RUN if DEFAULT_RUN.is_file() else FALLBACK_RUN)
    run = load_recorded(path)
    n = min(args.max_steps, len(run.steps))
    load0 = load1()
    print(
        f"run {path.name} ({run.name}): {len(run.steps)} agent steps, replaying {n}; "
        f"agent-monitor judge-server, one slot, --n-ctx {args.n_ctx}, api={args.api}",
        file=sys.stderr,
        flush=True,
    )
    with judge_server(args=["--n-ctx", str(args.n_ctx)]) as server:
        # Prefix shares on the server's token ids, for every step of both layouts (nothing is
        # generated).
        texts = await asyncio.to_thread(all_prompts, run, n)
        tokens = {
            k: [await asyncio.to_thread(tokenize, server.url, t) for t in v]
            for k, v in texts.items()
        }
        longest = max(len(t) for v in tokens.values() for t in v)
        if longest >= args.n_ctx:
            raise SystemExit(
                f"the longest prompt is {longest} tokens, over --n-ctx "
                f"{args.n_ctx}: lower --max-steps"
            )
        shares = {
            k: [common_prefix(a, b) / len(a) for a, b in itertools.pairwise(v)]
            for k, v in tokens.items()
        }
        totals = {k: sum(len(t) for t in v) for k, v in tokens.items()}
        # What a prefix-caching server evaluates when every step is scored in order: each prompt
        # less the prefix it shares with the previous one.
        to_eval = {
            k: len(v[0]) + sum(len(b) - common_prefix(a, b) for a, b in itertools.pairwise(v))
            for k, v in tokens.items()
        }
        # One untimed cold call of each layout's step-1 prompt: the first real request after
        # start-up runs ~1 s slower than later cold ones, which would flatter whichever layout goes
        # first.
        for layout in ("ours", "baseline"):
            body = {"prompt": texts[layout][0], "max_tokens": 1, "temperature": 0.0, "logprobs": 20}
            await asyncio.to_thread(post_json, server.url + "/v1/completions", body)
        print("one untimed step-1 call per layout done", file=sys.stderr, flush=True)
        phases = {
            "ours": await replay("ours", run, n, server, args, set(range(1, n + 1))),
            "baseline": await replay(
                "baseline", run, n, server, args, parse_steps(args.baseline_steps, n)
            ),
        }
        died = server.process.poll() is not None
        peak_rss_mb = 0.0 if died else server.peak_rss_kb() / 1024
        if died:
            print(
                f"{server.crash() or 'judge-server died'} during the "
                f"benchmark:\n{server.log()[-2000:]}",
                file=sys.stderr,
            )

    ours, base = phases["ours"], phases["baseline"]
    # Gemma 270M often puts little mass on the letters (low_mass): a score failure, not a failed
    # call.
    errors = [
        u
        for ph in phases.values()
        for u in ph.updates
        if not u.ok and u.reason not in ("low_mass", "no_letter")
    ]
    if errors:
        print(
            f"WARNING: {len(errors)} judge calls failed ({errors[0].reason}); latencies are "
            "not comparable"
        )
    print(
        f"\nprefix cache: {run.name}, {n} steps, Gemma 3 270M Q4_K_M on agent-monitor "
        "judge-server (2 cores); baseline: the"
    )
    print(
        "reference library's own online prompt layout (llm_verifier/progress.py at "
        "115de30, ported by layout)"
    )
    print(
        f"{'step':>4} {'prompt tok':>10} | {'ours s':>7} {'evaluated':>9} {'kept':>6} | "
        f"{'base tok':>8} {'base s':>7} {'evaluated':>9} {'kept':>6}"
    )
    for i in range(1, n + 1):
        o, b = ours.at(i), base.at(i)
        if o is None:
            continue
        line = (
            f"{i:>4} {o.prompt_tokens:>10} | {o.latency_s:>7.2f} {o.evaluated or 0:>9} "
            f"{o.kept or 0:>6} |"
        )
        if b is not None:
            line += (
                f" {b.prompt_tokens:>8} {b.latency_s:>7.2f} {b.evaluated or 0:>9} {b.kept or 0:>6}"
            )
        print(line)

    def ratio(ph: Phase) -> float:
        first, last = ph.at(1), ph.at(n)
        return (
            last.latency_s / first.latency_s if first and last and first.latency_s else float("nan")
        )

    o_first, o_last, b_first, b_last = ours.at(1), ours.at(n), base.at(1), base.at(n)
    assert o_first and o_last and b_first and b_last
    sent = {k: sum(u.prompt_tokens for u in ph.updates) for k, ph in phases.items()}
    evaluated = {k: sum(u.evaluated or 0 for u in ph.updates) for k, ph in phases.items()}
    server_kept = {
        k: sum(u.kept or 0 for u in ph.updates[1:])
        / max(1, sum(u.prompt_tokens for u in ph.updates[1:]))
        for k, ph in phases.items()
    }
    reuse = statistics.fmean(shares["ours"]) if shares["ours"] else float("nan")
    base_reuse = statistics.fmean(shares["baseline"]) if shares["baseline"] else float("nan")
    print()
    print(
        f"latency step 1 -> {n}: ours {o_first.latency_s:.2f} -> {o_last.latency_s:.2f} s "
        f"({ratio(ours):.2f}x), ",
        end="",
    )
    print(f"baseline {b_first.latency_s:.2f} -> {b_last.latency_s:.2f} s ({ratio(base):.2f}x)")
    slowest = max(ours.updates, key=lambda u: u.latency_s)
    print(
        f"ours slowest update: step {slowest.step}, {slowest.latency_s:.2f} s "
        f"({slowest.evaluated} tokens evaluated); "
        f"last step: baseline / ours = {b_last.latency_s / o_last.latency_s:.2f}x"
    )
    scored_base = sorted(u.step for u in base.updates)
    print(
        f"prompt tokens sent: ours {sent['ours']} over {len(ours.updates)} updates; baseline "
        f"{sent['baseline']} over "
        f"{len(base.updates)} updates (steps {','.join(map(str, scored_base))}); "
        f"either layout at every step: ours {totals['ours']}, baseline {totals['baseline']}"
    )
    print(
        f"tokens the server evaluated: ours {evaluated['ours']} "
        f"({evaluated['ours'] / max(1, sent['ours']):.1%} of sent), "
        f"baseline {evaluated['baseline']} "
        f"({evaluated['baseline'] / max(1, sent['baseline']):.1%} of sent)"
    )
    print(
        "share of each prompt that is a prefix of the next (server token ids, mean over "
        f"steps 1..{n - 1}): "
        f"ours {reuse:.3f} (min {min(shares['ours'], default=float('nan')):.3f}), baseline "
        f"{base_reuse:.3f}; "
        f"kept by the server's KV cache (steps 2..): ours {server_kept['ours']:.3f}, baseline "
        f"{server_kept['baseline']:.3f}"
    )
    print(
        "tokens to evaluate with every step scored in order (from the token ids): ours "
        f"{to_eval['ours']}, "
        f"baseline {to_eval['baseline']} ({to_eval['baseline'] / max(1, to_eval['ours']):.1f}x)"
    )
    print(
        f"server peak RSS {peak_rss_mb:.0f} MB; machine load (1-min average) at start "
        f"{load0}, at end {load1()}"
    )
    print(
        kv_line(
            steps=n,
            ours_last_over_first=ratio(ours),
            baseline_last_over_first=ratio(base),
            speedup_last_step=b_last.latency_s / o_last.latency_s,
            prefix_reuse=reuse,
            baseline_prefix_reuse=base_reuse,
            ours_first_s=o_first.latency_s,
            ours_last_s=o_last.latency_s,
            ours_max_over_first=slowest.latency_s / o_first.latency_s,
            baseline_first_s=b_first.latency_s,
            baseline_last_s=b_last.latency_s,
            ours_tokens_sent=sent["ours"],
            ours_tokens_evaluated=evaluated["ours"],
            baseline_tokens_sent=sent["baseline"],
            baseline_tokens_evaluated=evaluated["baseline"],
            baseline_tokens_every_step=totals["baseline"],
            ours_tokens_to_evaluate=to_eval["ours"],
            baseline_tokens_to_evaluate=to_eval["baseline"],
            server="judge-server",
            failed_calls=len(errors),
            server_peak_rss_mb=round(peak_rss_mb),
        )
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument(
        "--run",
        help=f"recorded run (ATIF or plain JSON); default {DEFAULT_RUN} or the bundled fixture",
    )
    ap.add_argument(
        "--max-steps",
        type=int,
        default=30,
        help="replay at most this many agent steps (default 30)",
    )
    ap.add_argument("--n-ctx", type=int, default=8192, help="server context size (default 8192)")
    ap.add_argument(
        "--api", choices=["completions", "chat"], default="completions", help="OpenAIJudge api"
    )
    ap.add_argument(
        "--baseline-steps",
        default="auto",
        help="steps the baseline scores: 'auto' (default: 1, n/3, 2n/3, n), 'all', or a "
        "comma list (1 and n\n"
        "are always included). A baseline call reuses only the instructions whatever came "
        "before it, so a\n"
        "sample shows its growth at a fraction of the time ('all' takes ~8 min on 18 steps here)",
    )
    ap.add_argument(
        "--min-mass",
        type=float,
        default=0.05,
        help="letter mass floor (Gemma 270M puts ~0.1 on letters)",
    )
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="per-call judge timeout in seconds"
    )
    args = ap.parse_args()
    cleanup_on_sigterm()
    configure_logs("error")  # the per-step lines on stderr already say which calls failed, and why
    if args.max_steps < 2:
        ap.error("--max-steps must be at least 2")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
