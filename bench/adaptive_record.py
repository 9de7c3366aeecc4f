"""Record the packaged local judge's answers on the shared recorded runs, once, for the
adaptive-schedule fixture.

    python bench/adaptive_record.py /work/shared/data tests/fixtures/adaptive/answers.json.gz
    --max-steps 12

Every prefix of every run is scored with every step (schedule `every`) through `eval`'s score cache,
the local judge wrapped so each answer (its letter probabilities and token counts) is kept by
prompt. `ReplayJudge.load` replays them: the adaptive schedule's prompts are a subset of these (the
same prefixes), so a replay of either schedule needs no model. Slow on a shared CPU: `--max-steps`
bounds it (say which in the docs).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from agent_monitor.judges import JudgeError, JudgeRequest, JudgeResponse
from agent_monitor.judges.llamacpp import LlamaCppJudge
from agent_monitor.offline.evaluate import ScoreCache, score_runs
from agent_monitor.offline.recorded import iter_recorded
from agent_monitor.testing import ReplayJudge, prompt_key, record_answer, save_answers


class Recording:
    """A judge that asks another and keeps each answer for `ReplayJudge`."""

    def __init__(self, inner: LlamaCppJudge, out: Path) -> None:
        self.inner, self.out = inner, out
        self.name = inner.name
        self.model = inner.model
        self.min_mass = inner.min_mass
        self.answers: dict[str, dict[str, Any]] = {}

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        """Ask the inner judge; keep its answer (or the reason it failed: the replay fails
        alike)."""
        try:
            r = await self.inner.grade(request)
        except JudgeError as e:
            self.answers[prompt_key(request.prompt)] = {"error": e.reason}
            raise
        key, value = record_answer(request.prompt, r)
        self.answers[key] = value
        return r

    async def aclose(self) -> None:
        """Close the inner judge."""
        await self.inner.aclose()


async def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--max-steps", type=int, default=12)
    ap.add_argument("--cache", default="/tmp/adaptive/record-cache.sqlite3")
    ap.add_argument(
        "--n-ctx",
        type=int,
        default=8192,
        help="the local judge's context (long prefixes overflow 8192)",
    )
    ap.add_argument(
        "--merge",
        help="answers recorded before (their prefixes are cache hits: only the rest is asked)",
    )
    a = ap.parse_args()
    runs = list(iter_recorded(a.data))
    judge = Recording(LlamaCppJudge(n_ctx=a.n_ctx, timeout_s=600.0), Path(a.out))
    if a.merge:
        judge.answers.update(ReplayJudge.load(a.merge).answers)
    cache = ScoreCache(a.cache)
    t0 = time.monotonic()
    done = [0]

    def step(run: Any, p: Any) -> None:
        done[0] += 1
        print(
            f"{time.monotonic() - t0:7.1f}s {done[0]} {run.name} step {p.step} score {p.score}",
            flush=True,
        )
        if done[0] % 20 == 0:
            save_answers(
                a.out, judge.answers, model=str(judge.inner.model), min_mass=judge.inner.min_mass
            )

    try:
        await score_runs(runs, judge=judge, max_steps=a.max_steps, cache=cache, on_step=step)  # type: ignore[arg-type]
    finally:
        cache.close()
        save_answers(
            a.out, judge.answers, model=str(judge.inner.model), min_mass=judge.inner.min_mass
        )
        await judge.aclose()
    print(
        f"recorded {len(judge.answers)} answers in {time.monotonic() - t0:.0f}s to {a.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
