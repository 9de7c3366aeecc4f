"""Two ways to keep a KV prefix per run in one llama.cpp context, timed on the packaged Gemma 3
270M.

- sequences: every run its own sequence id in one unified KV cache (`n_seq_max` runs);
  nothing is copied, but each decode attends over every run's cells (masked, still computed).
- states (what `LlamaCppJudge` does): the context holds one run; switching runs saves the
  context's KV state to memory and restores the next run's (`llama_state_seq_get/set_data`).

Both decode the same work: `--runs` runs of a `--prefix`-token prompt, then for each run a
`--suffix`-token continuation (the next step of a run, as a judge call sees it), round robin.
Reported: seconds for the continuations (the prefixes are set-up), and for states the copy
time alone. Random token ids stand in for prompts: only the cost is measured here, the
exactness of restored states is tested in tests/judges/test_llamacpp.py.

    .venv/bin/python bench/kv_designs.py [--runs 8] [--prefix 3500] [--suffix 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time
from typing import Any

import llama_cpp
from _common import configure_logs, gemma_path, kv_line, load1


def new_context(model: Any, n_ctx: int, n_seq: int) -> Any:
    """A context with a full-size sliding-window cache, unified across `n_seq` sequences."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = 512
    params.n_ubatch = 512
    params.n_seq_max = n_seq
    params.kv_unified = True
    params.swa_full = True
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit(f"cannot create a context of {n_ctx} tokens for {n_seq} sequences")
    return ctx


def decode(ctx: Any, tokens: list[int], start: int, seq: int) -> None:
    """Decode `tokens` at positions start..

    of sequence `seq`, 512 at a time, logits for the last one.
    """
    batch = llama_cpp.llama_batch_init(512, 0, 1)
    try:
        for at in range(0, len(tokens), 512):
            chunk = tokens[at : at + 512]
            batch.n_tokens = len(chunk)
            for i, t in enumerate(chunk):
                batch.token[i] = t
                batch.pos[i] = start + at + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = at + i == len(tokens) - 1
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed (context full?)")
    finally:
        llama_cpp.llama_batch_free(batch)


def sequences(model: Any, prompts: list[list[int]], suffixes: list[list[list[int]]]) -> float:
    """Seconds for the continuations with one sequence per run in one unified cache."""
    n = len(prompts)
    total = sum(len(p) + sum(len(s) for s in ss) for p, ss in zip(prompts, suffixes, strict=True))
    ctx = new_context(model, total + 512, n)
    try:
        lengths = []
        for seq, p in enumerate(prompts):
            decode(ctx, p, 0, seq)
            lengths.append(len(p))
        start = time.perf_counter()
        for r in range(len(suffixes[0])):
            for seq in range(n):
                decode(ctx, suffixes[seq][r], lengths[seq], seq)
                lengths[seq] += len(suffixes[seq][r])
        return time.perf_counter() - start
    finally:
        llama_cpp.llama_free(ctx)


def states(
    model: Any, prompts: list[list[int]], suffixes: list[list[list[int]]]
) -> tuple[float, float]:
    """Seconds for the continuations with one run in the context at a time, switching by saved
    states."""
    longest = max(len(p) + sum(len(s) for s in ss) for p, ss in zip(prompts, suffixes, strict=True))
    ctx = new_context(model, longest + 512, 1)
    memory = llama_cpp.llama_get_memory(ctx)
    saved: dict[int, Any] = {}
    copying = 0.0

    def save(seq: int) -> None:
        nonlocal copying
        t = time.perf_counter()
        size = llama_cpp.llama_state_seq_get_size(ctx, -1)
        buf = (ctypes.c_uint8 * size)()
        llama_cpp.llama_state_seq_get_data(ctx, buf, size, -1)
        saved[seq] = buf
        copying += time.perf_counter() - t

    def restore(seq: int) -> None:
        nonlocal copying
        t = time.perf_counter()
        llama_cpp.llama_memory_clear(memory, True)
        buf = saved.pop(seq)
        llama_cpp.llama_state_seq_set_data(ctx, buf, len(buf), 0)
        copying += time.perf_counter() - t

    try:
        lengths = []
        for seq, p in enumerate(prompts):
            llama_cpp.llama_memory_clear(memory, True)
            decode(ctx, p, 0, 0)
            save(seq)
            lengths.append(len(p))
        copying = 0.0
        start = time.perf_counter()
        active = None
        for r in range(len(suffixes[0])):
            for seq in range(len(prompts)):
                if active is not None:
                    save(active)
                restore(seq)
                decode(ctx, suffixes[seq][r], lengths[seq], 0)
                lengths[seq] += len(suffixes[seq][r])
                active = seq
        return time.perf_counter() - start, copying
    finally:
        llama_cpp.llama_free(ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=3500, help="tokens of each run's prompt so far")
    ap.add_argument("--suffix", type=int, default=300, help="tokens each continuation adds")
    ap.add_argument("--rounds", type=int, default=2, help="continuations per run")
    ap.add_argument(
        "--sequences-first", action="store_true", help="time sequences before states (load drifts)"
    )
    args = ap.parse_args()
    configure_logs("error")
    # kept referenced: llama.cpp holds only its pointer
    quiet = llama_cpp.llama_log_callback(lambda *_: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    print(
        f"load {load1()}; {args.runs} runs x {args.prefix}-token prefixes, {args.rounds} x "
        f"{args.suffix} tokens each"
    )
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False  # as LlamaCppJudge loads it (no weight repacking)
    model = llama_cpp.llama_model_load_from_file(gemma_path().encode(), params)
    rng = random.Random(7)
    # ordinary text tokens, away from the special ones at the ends of Gemma's vocabulary
    vocab = 200_000

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    prompts = [ids(args.prefix) for _ in range(args.runs)]
    suffixes = [[ids(args.suffix) for _ in range(args.rounds)] for _ in range(args.runs)]
    try:
        if args.sequences_first:
            sq = sequences(model, prompts, suffixes)
            print(f"  sequences: {sq:6.1f} s for the continuations", flush=True)
        st, copy = states(model, prompts, suffixes)
        print(
            f"  states:    {st:6.1f} s for the continuations ({copy:.2f} s of it saving and "
            "restoring)",
            flush=True,
        )
        if not args.sequences_first:
            sq = sequences(model, prompts, suffixes)
            print(f"  sequences: {sq:6.1f} s for the continuations", flush=True)
    finally:
        llama_cpp.llama_model_free(model)
    print(f"load {load1()}; sequences take {sq / st:.2f}x the time of states")
    print(
        kv_line(
            runs=args.runs, states_s=st, copy_s=copy, sequences_s=sq, sequences_over_states=sq / st
        )
    )


if __name__ == "__main__":
    main()
