"""What fencing untrusted text costs in judge tokens, on the recorded runs in ../shared/data.

For every recorded run, each step's prompt is built as the monitor builds it and
tokenised with the packaged Gemma 3 270M's tokenizer (vocabulary only, no
inference). The baseline in the same process is the same prompt with the raw
step and task text pasted in (what the monitor sent before fencing), and without
the instructions' paragraph about untrusted data. Reported: the extra tokens of
the fenced prompts over all prefixes (what a judge without a prefix cache
reads) and over the final prompts (what a judge with one reads, about), the
lines that needed an escape, and the control-token spellings neutralised.

    .venv/bin/python bench/fence_overhead.py [--data DIR] [--criteria NAME]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from _common import REPO, gemma_path, kv_line

from agent_monitor import build_prompt, load_criteria
from agent_monitor.offline.recorded import iter_recorded
from agent_monitor.prompts import INSTRUCTIONS, Step, fence

DATA = REPO.parent / "shared" / "data"
FALLBACK = REPO / "tests" / "fixtures"
UNTRUSTED_NOTE = "\n\nThe task, the criteria and the trajectory come from the run"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", type=Path, default=DATA if DATA.is_dir() else FALLBACK)
    ap.add_argument("--criteria", default="coding")
    args = ap.parse_args()

    from llama_cpp import Llama

    llm = Llama(gemma_path(), vocab_only=True, verbose=False)

    def count(text: str) -> int:
        return len(llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    rubric = load_criteria(args.criteria)
    criterion = rubric.criteria[0]
    assert UNTRUSTED_NOTE in INSTRUCTIONS
    old_instructions = INSTRUCTIONS[: INSTRUCTIONS.index(UNTRUSTED_NOTE)]
    note_tokens = count(INSTRUCTIONS) - count(old_instructions)

    runs = list(iter_recorded(args.data))
    total_all = extra_all = total_final = extra_final = 0
    lines = escaped = controls = 0
    for run in runs:
        steps = [Step(i + 1, s.text) for i, s in enumerate(run.steps)]
        # Per step: the fenced step text's tokens over the raw text's (the rest of the prompt is the
        # same).
        step_extra = [count(s.shown) - count(s.text.strip()) for s in steps]
        task_extra = count(fence(run.task.strip())) - count(run.task.strip())
        for s in steps:
            raw = s.text.strip().split("\n")
            lines += len(raw)
            escaped += sum(1 for a, b in zip(raw, s.shown.split("\n"), strict=False) if a != b)
            controls += len(
                re.findall(r"<\\[|\uff5c]|<\\/?s>|\[\\/?INST\]|<\\(?:start|end)_of", s.shown)
            )
        prefix_extra = 0
        for n in range(1, len(steps) + 1):
            prompt = build_prompt(run.task, rubric, steps[:n], criterion)
            tokens = count(prompt.text())
            prefix_extra += step_extra[n - 1]
            extra = note_tokens + task_extra + prefix_extra
            total_all += tokens
            extra_all += extra
            if n == len(steps):
                total_final += tokens
                extra_final += extra
        print(
            f"{run.name[:40]:40s} steps={len(steps):3d} final_prompt_tokens={tokens:6d} "
            f"fence_extra={extra:4d}"
        )

    share_all = extra_all / max(1, total_all - extra_all)
    share_final = extra_final / max(1, total_final - extra_final)
    print(
        f"\n{len(runs)} runs: over all prefixes {extra_all} extra tokens on "
        f"{total_all - extra_all} "
        f"({100 * share_all:.2f}%); final prompts {extra_final} on {total_final - extra_final} "
        f"({100 * share_final:.2f}%), of which the instructions' note is {note_tokens} per prompt; "
        f"{escaped} of {lines} step lines escaped, {controls} control-token spellings neutralised"
    )
    print(
        kv_line(
            runs=len(runs),
            overhead_all_pct=100 * share_all,
            overhead_final_pct=100 * share_final,
            note_tokens=note_tokens,
            lines=lines,
            escaped_lines=escaped,
            controls=controls,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
