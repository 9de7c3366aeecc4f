"""Judge over the Gemini API (Google AI Studio or Vertex AI) through the `google-genai` SDK."""

from __future__ import annotations

import asyncio
import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import google.auth.exceptions
from google import genai
from google.genai import errors, types

from ..images import Frame
from ..progress import Usage
from ..prompts import Prompt, TextPart
from .base import (
    BaseJudge,
    JudgeError,
    JudgeRequest,
    JudgeResponse,
    Sample,
    answer_sample,
    batches,
    context_refusal,
    drawn_letter,
    retry_after_seconds,
    tally,
)

MAX_CANDIDATES = 8
"""The most candidates one generateContent request may ask for (the API's `candidateCount`
limit)."""


class GeminiJudge(BaseJudge):
    """Grade with a Gemini model, reading `logprobsResult.topCandidates` at the letter position.

    - `api_key` (or GEMINI_API_KEY / GOOGLE_API_KEY in the environment) for the
      Gemini Developer API; `vertexai=True` with `project`/`location` and
      Application Default Credentials for Vertex AI.
    - `base_url` points the SDK elsewhere (a proxy, or a local test server);
      `api_version` overrides the SDK's default API version.
    - `max_output_tokens` defaults to 1: the letter is the first token. Raise it
      for a model that writes something first; the reader takes the first
      generated token that is exactly a scale letter.
    - `thinking_budget=0` turns thinking off, so the one output token is the
      answer (2.5 Flash and Flash-Lite). Models that always think (2.5 Pro)
      reject 0: pass None and a larger `max_output_tokens`.
    - `vision=False` sends frames as text placeholders; results then count
      them in `images_dropped`.

    - `logprobs=False` is for models that return no logprobs (the API refuses
      `responseLogprobs` for some): each repeat's letter distribution is then
      estimated from `samples` answers drawn at `sample_temperature`, as
      `OpenAIJudge(logprobs=False)` does: answers that are not exactly a letter
      count against the mass, and the sampling error is added to the result's
      uncertainty (`source="sampled"`). Draws go `candidate_count` at a time
      (at most 8 per request).

    K repeats (or draws) go as one request with `candidate_count=K` (at most 8);
    if the API rejects that (Gemini 2.0 and 3 models answer 400 "Multiple
    candidates is not enabled for this model") or returns fewer candidates, the
    rest go as separate requests (and the judge remembers not to ask for several
    again).
    """

    name = "gemini"

    def __init__(
        self,
        model: str = "gemini-2.5-flash",
        api_key: str | None = None,
        *,
        vertexai: bool = False,
        project: str | None = None,
        location: str | None = None,
        base_url: str | None = None,
        api_version: str | None = None,
        max_output_tokens: int = 1,
        top_logprobs: int = 20,
        temperature: float = 0.0,
        thinking_budget: int | None = 0,
        vision: bool = True,
        logprobs: bool = True,
        samples: int = 20,
        sample_temperature: float = 1.0,
        supports_candidates: bool | None = None,
        client: genai.Client | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        concurrency: int = 8,
        context_tokens: int | None = None,
    ) -> None:
        super().__init__(
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            concurrency=concurrency,
            context_tokens=context_tokens,
        )
        if not model:
            raise ValueError("GeminiJudge needs a model name, e.g. model='gemini-2.5-flash'")
        if max_output_tokens < 1 or not 1 <= top_logprobs <= 20:
            raise ValueError("GeminiJudge needs max_output_tokens >= 1 and 1 <= top_logprobs <= 20")
        if samples < 1:
            raise ValueError(
                f"GeminiJudge samples={samples}; use 1 or more answers per "
                "repeat (with logprobs=False)"
            )
        self._owns_client = client is None
        if client is None:
            http = types.HttpOptions(base_url=base_url, api_version=api_version)
            try:
                client = genai.Client(
                    api_key=api_key,
                    vertexai=vertexai,
                    project=project,
                    location=location,
                    http_options=http,
                )
            except (ValueError, google.auth.exceptions.GoogleAuthError) as e:
                raise ValueError(
                    f"cannot create the Gemini client ({e}); pass api_key= or set GEMINI_API_KEY, "
                    "or use vertexai=True with project=, location= and Application Default "
                    "Credentials"
                ) from None
        self.client = client
        self.model = model
        self.max_output_tokens = max_output_tokens
        self.top_logprobs = top_logprobs
        self.temperature = temperature
        self.thinking_budget = thinking_budget
        self.vision = vision
        self.logprobs = logprobs
        self.samples = samples
        self.sample_temperature = sample_temperature
        self.supports_candidates = supports_candidates
        self._context_asked = context_tokens is not None
        """Whether the API was asked for the model's input token limit (a setting wins: then it
        is not asked)."""

    async def aclose(self) -> None:
        """Close the async HTTP client, if this judge created it (an injected client stays its
        owner's)."""
        if not self._owns_client:
            return
        close = getattr(self.client.aio, "aclose", None)  # older SDKs have no AsyncClient.aclose
        if close is not None:
            await close()

    @property
    def answer_tokens(self) -> int:
        """Tokens an answer may take: `max_output_tokens`."""
        return self.max_output_tokens

    async def ask_context(self) -> None:
        """Take the model's input token limit (`models.get`) as the judge's context, once; unknown
        when not said.

        A setting wins; an API that does not answer (a proxy without the models endpoint) is not an
        error.
        """
        if self._context_asked:
            return
        self._context_asked = True
        try:
            info = await self.client.aio.models.get(model=self.model)
        # any failure: the context stays unknown (learned from a refusal, if one comes)
        except Exception:
            return
        limit = info.input_token_limit
        if isinstance(limit, int) and limit > 0 and self.context_tokens is None:
            self.context_tokens = limit

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        await self.ask_context()
        if not self.logprobs:
            return await self._sampled(request)
        samples, usage = await self._chunk(request.prompt, request.repeats)
        return JudgeResponse(
            samples=tuple(samples),
            model=self.model,
            usage=usage,
            images_dropped=0 if self.vision else request.prompt.image_count,
        )

    async def _chunk(self, prompt: Prompt, k: int) -> tuple[list[Sample], Usage]:
        """k samples (repeats, or draws without logprobs): as one request for up to 8, the rest
        one by one."""
        ask = min(k, MAX_CANDIDATES) if self.supports_candidates is not False else 1
        # Some models refuse candidateCount > 1 with a 400; single requests still work.
        samples, usage, batch = await self._repeats(k, ask, lambda n: self._request(prompt, n))
        if batch is not None:
            self.supports_candidates = batch
        return samples, usage

    async def _sampled(self, request: JudgeRequest) -> JudgeResponse:
        """Estimate each repeat's letter distribution from `samples` sampled answers."""
        draws: list[Sample] = []
        usage = Usage()
        chunks = batches(request.repeats * self.samples, MAX_CANDIDATES)
        for got, u in await asyncio.gather(*(self._chunk(request.prompt, n) for n in chunks)):
            draws.extend(got)
            usage += u
        return JudgeResponse(
            samples=tally(draws, request.repeats, self.samples),
            model=self.model,
            usage=usage,
            draws=self.samples,
            images_dropped=0 if self.vision else request.prompt.image_count,
        )

    def _config(self, prompt: Prompt, n: int) -> types.GenerateContentConfig:
        return types.GenerateContentConfig(
            system_instruction=prompt.instructions,
            # Without logprobs the fields are left out, not sent false: a model that refuses them
            # refuses both.
            response_logprobs=True if self.logprobs else None,
            logprobs=self.top_logprobs if self.logprobs else None,
            max_output_tokens=self.max_output_tokens,
            temperature=self.temperature if self.logprobs else self.sample_temperature,
            candidate_count=n,
            thinking_config=(
                types.ThinkingConfig(thinking_budget=self.thinking_budget)
                if self.thinking_budget is not None
                else None
            ),
            # Per request, so it holds for injected clients too: the SDK must not retry (BaseJudge
            # does, once), and its own timeout also tells the server when to give up
            # (X-Server-Timeout).
            http_options=types.HttpOptions(
                retry_options=types.HttpRetryOptions(attempts=1),
                timeout=math.ceil(self.timeout_s * 1000),
            ),
        )

    def _contents(self, prompt: Prompt) -> list[types.Content]:
        parts: list[types.Part] = []
        for p in prompt.parts:
            if isinstance(p, TextPart):
                parts.append(types.Part(text=p.text))
            elif self.vision:
                parts.append(types.Part.from_bytes(data=p.frame.data, mime_type=p.frame.mime))
            else:
                parts.append(types.Part(text=Frame.describe(p.frame) + "\n"))
        return [types.Content(role="user", parts=parts)]

    async def _request(
        self, prompt: Prompt, n: int
    ) -> tuple[list[Mapping[str, float] | None], Usage]:
        try:
            resp = await self.client.aio.models.generate_content(
                model=self.model, contents=self._contents(prompt), config=self._config(prompt, n)
            )
        except Exception as e:
            mapped = _judge_error(e)
            if mapped is None:
                raise
            raise mapped from None
        candidates = list(resp.candidates or [])
        if not candidates:
            feedback = resp.prompt_feedback
            if feedback is not None and feedback.block_reason is not None:
                why = getattr(feedback.block_reason, "value", feedback.block_reason)
                if feedback.block_reason_message:
                    why = f"{why}: {feedback.block_reason_message}"
                raise JudgeError(
                    "blocked",
                    f"Gemini blocked the prompt ({why}); check the trajectory text and images, "
                    "or the model's safety settings",
                )
            # An answer with nothing in it: one empty repeat, so the caller asks again for the rest.
            return [None], _usage(resp)
        if not self.logprobs:
            return [drawn_letter(_text(c)) for c in candidates], _usage(resp)
        return [_sample(c) for c in candidates], _usage(resp)


def _text(candidate: types.Candidate) -> str:
    """A candidate's answer text (thought summaries left out; nothing for a candidate stopped for
    safety)."""
    parts = candidate.content.parts if candidate.content is not None else None
    return "".join(p.text for p in parts or [] if p.text and not p.thought)


def _sample(candidate: types.Candidate) -> Sample:
    """Candidate tokens and logprobs at the answer position (see `answer_sample`)."""
    result = candidate.logprobs_result
    if result is None:
        return None
    chosen = [(c.token or "", c.log_probability) for c in result.chosen_candidates or []]
    top = [
        [(c.token, c.log_probability) for c in t.candidates or [] if c.token is not None]
        for t in result.top_candidates or []
    ]
    if not chosen and top:
        chosen = [("", None)]  # top candidates without the chosen token: read position 0
    # The chosen token may be missing from the top candidates (the API says so); answer_sample adds
    # it.
    return answer_sample(chosen, top)


def _usage(resp: types.GenerateContentResponse) -> Usage:
    u = resp.usage_metadata
    if u is None:
        return Usage()
    # Thinking tokens are billed as output.
    output = (u.candidates_token_count or 0) + (u.thoughts_token_count or 0)
    return Usage(
        input_tokens=u.prompt_token_count or 0,
        cached_input_tokens=u.cached_content_token_count or 0,
        output_tokens=output,
    )


def _error_types(*names: tuple[str, str]) -> tuple[type[BaseException], ...]:
    """The exception classes that exist among (module, class) pairs; the SDK may run on httpx,
    httpx2 or aiohttp."""
    found: list[type[BaseException]] = []
    for module, attr in names:
        try:
            cls = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


_TIMEOUT_ERRORS = _error_types(
    ("httpx", "TimeoutException"), ("httpx2", "TimeoutException"), ("aiohttp", "ServerTimeoutError")
)
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    google.auth.exceptions.TransportError,
    *_error_types(
        ("httpx", "TransportError"), ("httpx2", "TransportError"), ("aiohttp", "ClientError")
    ),
)


def _judge_error(e: Exception) -> JudgeError | None:
    """The JudgeError for an exception out of the SDK, or None for one that is not a judge
    failure (a bug)."""
    if isinstance(e, errors.APIError):
        return _api_error(e)
    if isinstance(e, errors.UnknownApiResponseError):
        return JudgeError(
            "bad_response", f"the Gemini server sent a reply that is not JSON: {e}; check base_url"
        )
    if isinstance(e, _TIMEOUT_ERRORS):
        return JudgeError("timeout", "the Gemini server did not answer in time", retryable=True)
    if isinstance(e, _CONNECTION_ERRORS):
        return JudgeError("connection", f"cannot reach the Gemini server: {e!r}", retryable=True)
    if isinstance(e, google.auth.exceptions.GoogleAuthError):
        return JudgeError(
            "auth", f"Google credentials failed: {e}; check Application Default Credentials"
        )
    return None


def _api_error(e: errors.APIError) -> JudgeError:
    status = e.code
    message = e.message or e.status or str(e)
    hint = _retry_after(getattr(e.response, "headers", None) or {}, e.details)
    if status == 429:
        return JudgeError("rate_limited", f"HTTP 429: {message}", retryable=True, retry_after=hint)
    if status >= 500 or status == 408:
        return JudgeError(
            "server_error", f"HTTP {status}: {message}", retryable=True, retry_after=hint
        )
    # An invalid API key comes back as 400 INVALID_ARGUMENT with reason API_KEY_INVALID, not as 401.
    if status in (401, 403) or "API_KEY_INVALID" in str(e.details):
        return JudgeError(
            "auth",
            f"HTTP {status}: {message}; check api_key / GEMINI_API_KEY or the Google credentials",
        )
    if status == 404:
        return JudgeError("not_found", f"HTTP 404: {message}; check the model name and base_url")
    return context_refusal(status, message) or JudgeError(
        "bad_request", f"HTTP {status}: {message}"
    )


def _retry_after(headers: Mapping[str, str], details: Any) -> float | None:
    """The server's wait hint in seconds: a Retry-After header, else the body's
    google.rpc.RetryInfo."""
    hint = retry_after_seconds(headers)
    if hint is not None:
        return hint
    # The Gemini API sends no Retry-After; it puts {"@type": ".../google.rpc.RetryInfo",
    # "retryDelay": "37s"} in error.details.
    return _retry_info(details)


def _retry_info(details: Any) -> float | None:
    body = details.get("error", details) if isinstance(details, Mapping) else None
    items = body.get("details") if isinstance(body, Mapping) else None
    if not isinstance(items, Sequence):
        return None
    for item in items:
        if isinstance(item, Mapping) and str(item.get("@type", "")).endswith(
            "google.rpc.RetryInfo"
        ):
            delay = str(item.get("retryDelay", ""))
            try:
                return max(0.0, float(delay.removesuffix("s")))
            except ValueError:
                return None
    return None
