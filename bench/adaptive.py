"""The adaptive judge schedule over MQTT with a live daemon: the same aborts for fewer judge tokens?

A `Monitor` (in this process) on a private Mosquitto, its judge a `ReplayJudge` replaying the
packaged local judge's recorded answers on the 32 shared recorded runs
(tests/fixtures/adaptive/answers.json.gz, recorded by bench/adaptive_record.py, steps capped at 16
per run). A harness publishes every run's steps over MQTT, step i of every live run and then waits
for each run's message for step i (a score, or under "adaptive" with --heartbeat the last score
republished), so both schedules see the same cadence; a run told to abort gets no more steps; each
run ends with its outcome. Per schedule and abort threshold it prints judge calls and tokens (from
the progress messages), the aborts and their steps, and adaptive's saving beside "every" in the same
process, with the load average.

Two judges, both shown by default (`--judges recorded,decisive`): the recorded tiny judge, whose
scores sit at the threshold (the unfavourable case for "adaptive": nearly every step is near a
line), and a decisive judge (a `FakeJudge` that knows each run's outcome: failing runs score 0,
successful ones 0.9), whose scores sit far from it (the favourable case: only failing runs need
scoring at every step).

    python bench/adaptive.py [--abort-below 0.12,0.13] [--margin 2] [--max-gap 4] [--judges
    recorded,decisive]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiomqtt
from _common import REPO, cleanup_on_sigterm, configure_logs, load1, mosquitto

from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.offline.recorded import iter_recorded
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.scale import LETTERS
from agent_monitor.testing import FakeJudge, ReplayJudge
from agent_monitor.wire import BrokerSettings

FIXTURE = REPO / "tests" / "fixtures" / "adaptive" / "answers.json.gz"


def decisive(runs: list[Any]) -> FakeJudge:
    """A judge that knows each run's outcome (by its first step's text): failures score 0,
    successes 0.9."""
    marks = [(r.steps[0].text[:300], (r.outcome or 0) >= 0.5) for r in runs if r.steps]

    def answer(prompt: Prompt) -> str:
        text = prompt.prefix_text()
        ok = next((good for mark, good in marks if mark in text), True)
        return LETTERS[round(0.9 * (len(LETTERS) - 1))] if ok else LETTERS[0]

    return FakeJudge(answer, record=False)


async def one(
    broker_url: str,
    port: int,
    runs: list[Any],
    policy: Policy,
    answers: Path,
    dump: dict[str, Any] | None = None,
    *,
    judge_kind: str = "recorded",
) -> dict[str, Any]:
    """Every run through a fresh monitor under `policy`: tokens, calls, scorings, aborts (run ->
    step)."""
    judge: ReplayJudge | FakeJudge = (
        ReplayJudge.load(answers) if judge_kind == "recorded" else decisive(runs)
    )
    min_mass = judge.min_mass if isinstance(judge, ReplayJudge) else None
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker_url),
        client_id=f"bench-adaptive-{time.monotonic_ns()}",
        policy=policy,
        heartbeat=True,
        max_concurrency=4,
        min_mass=min_mass,
    )
    seen: dict[str, list[dict[str, Any]]] = defaultdict(list)
    aborts: dict[str, int] = {}
    changed = asyncio.Event()
    async with (
        Monitor(config, judge=judge),
        aiomqtt.Client("127.0.0.1", port, identifier="bench-harness") as c,
    ):
        await c.subscribe("agents/+/progress", qos=1)
        await c.subscribe("agents/+/signal", qos=1)

        async def collect() -> None:
            async for m in c.messages:
                _, run, kind = m.topic.value.split("/")
                body = bytes(m.payload) if isinstance(m.payload, (bytes, bytearray)) else b""
                if not body:
                    continue
                data = json.loads(body)
                if m.retain:
                    continue  # an earlier monitor's retained signal: not this pass's
                if kind == "progress":
                    seen[run].append(data)
                elif data.get("signal") == "abort":
                    aborts.setdefault(run, data["step"])
                changed.set()

        task = asyncio.create_task(collect())
        tag = policy.schedule[0] + str(time.monotonic_ns() % 10**6)  # run ids of their own per pass
        names = [f"{tag}-r{i}" for i in range(len(runs))]

        def reached(run: str, i: int) -> bool:
            return (
                any(p["step"] + (p.get("age_steps") or 0) >= i for p in seen[run]) or run in aborts
            )

        async def until(check: Any) -> None:
            while not check():
                changed.clear()
                await asyncio.wait_for(changed.wait(), 60)

        t0 = time.monotonic()
        for name, run in zip(names, runs, strict=True):
            await c.publish(f"agents/{name}/start", json.dumps({"task": run.task}), qos=1)
        for i in range(1, max(len(r.steps) for r in runs) + 1):
            live = [
                (n, r)
                for n, r in zip(names, runs, strict=True)
                if i <= len(r.steps) and n not in aborts
            ]
            for n, r in live:
                await c.publish(
                    f"agents/{n}/step", json.dumps({"index": i, "text": r.steps[i - 1].text}), qos=1
                )
            await until(lambda i=i, live=live: all(reached(n, i) for n, _ in live))
        for n, r in zip(names, runs, strict=True):
            outcome = "success" if (r.outcome or 0) >= 0.5 else "failure"
            await c.publish(f"agents/{n}/end", json.dumps({"outcome": outcome}), qos=1)
        await until(
            lambda: all(
                n in aborts
                or any(p["step"] == len(r.steps) and not p.get("heartbeat") for p in seen[n])
                for n, r in zip(names, runs, strict=True)
            )
        )
        wall = time.monotonic() - t0
        task.cancel()
    if dump is not None:
        dump.update({n.split("-", 1)[1]: seen[n] for n in names})
    scored = [p for n in names for p in seen[n] if not p.get("heartbeat")]
    return {
        "tokens": sum(p["tokens"]["input"] + p["tokens"]["output"] for p in scored),
        "calls": sum(p["calls"] for p in scored),
        "scorings": len(scored),
        "heartbeats": sum(bool(p.get("heartbeat")) for n in names for p in seen[n]),
        "aborts": {n.split("-", 1)[1]: aborts[n] for n in names if n in aborts},
        "wall_s": wall,
    }


def _cut(runs: list[Any], steps: int) -> list[Any]:
    import dataclasses

    return [dataclasses.replace(r, steps=r.steps[:steps]) for r in runs]


async def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", default="/work/shared/data")
    ap.add_argument("--answers", default=str(FIXTURE))
    ap.add_argument("--abort-below", default="0.12,0.13", help="comma-separated thresholds to try")
    ap.add_argument("--margin", type=float, default=2.0)
    ap.add_argument("--max-gap", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=16)
    ap.add_argument("--min-steps", type=int, default=3)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument(
        "--judges", default="recorded,decisive", help="recorded (scores at the threshold), decisive"
    )
    a = ap.parse_args()
    configure_logs("error")
    runs = _cut(list(iter_recorded(a.data)), a.max_steps)
    print(
        f"load average at start: {load1()}; {len(runs)} runs, "
        f"{sum(len(r.steps) for r in runs)} steps"
    )
    print(
        f"{'judge':<9} {'abort_below':>11} {'schedule':<9} {'scorings':>8} {'beats':>5} "
        f"{'calls':>5} "
        f"{'tokens':>8} {'wall s':>6}  aborts (run@step)"
    )
    with mosquitto() as broker:
        for kind, t in (
            (k, float(x)) for k in a.judges.split(",") for x in a.abort_below.split(",")
        ):
            got = {}
            for schedule in ("every", "adaptive"):
                pol = Policy(
                    abort_below=t,
                    min_steps=a.min_steps,
                    patience=a.patience,
                    schedule=schedule,  # type: ignore[arg-type]
                    max_gap=a.max_gap,
                    margin=a.margin,
                )
                r = got[schedule] = await one(
                    broker.url, broker.port, runs, pol, Path(a.answers), judge_kind=kind
                )
                ab = ", ".join(f"{n}@{s}" for n, s in r["aborts"].items()) or "none"
                print(
                    f"{kind:<9} {t:>11.3f} {schedule:<9} {r['scorings']:>8} "
                    f"{r['heartbeats']:>5} {r['calls']:>5} "
                    f"{r['tokens']:>8} {r['wall_s']:>6.1f}  {len(r['aborts'])}: {ab}",
                    flush=True,
                )
            e, d = got["every"], got["adaptive"]
            same = set(e["aborts"]) == set(d["aborts"])
            within = same and all(
                0 <= d["aborts"][n] - s <= a.max_gap for n, s in e["aborts"].items()
            )
            saved = 1 - d["tokens"] / e["tokens"] if e["tokens"] else float("nan")
            print(
                f"{kind:<9} {'':>11} adaptive: {'same runs' if same else 'DIFFERENT runs'} "
                "aborted"
                f"{', within max_gap' if within else ''}; judge tokens {saved:.1%} fewer",
                flush=True,
            )
    print(f"load average at end: {load1()}")
    return 0


if __name__ == "__main__":
    cleanup_on_sigterm()
    sys.exit(asyncio.run(main()))
