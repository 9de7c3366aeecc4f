"""Judge over any OpenAI-compatible API (OpenAI, vLLM, SGLang, llama.cpp) through the `openai`
SDK."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import openai
import structlog
from openai import AsyncOpenAI

from .._runtime.http_client import WireConnectionError, WirePool, WireReply, WireTimeout
from ..images import Frame
from ..progress import Usage
from ..prompts import ImagePart, Prompt, TextPart
from ..scale import BINARY_TOKENS, LETTERS
from ._openai_transport import LeanTransport, SdkTransport, StatusError, Transport, sdk_error
from .base import (
    BaseJudge,
    JudgeError,
    JudgeRequest,
    JudgeResponse,
    Sample,
    answer_sample,
    batches,
    drawn_letter,
    tally,
)

log = structlog.get_logger("agent_monitor.judges.openai")

_T = TypeVar("_T")


class OpenAIJudge(BaseJudge):
    """Grade with an OpenAI-compatible server, reading `top_logprobs` at the letter position.

    - `api="chat"` (default): chat completions with `logprobs`/`top_logprobs`;
      hosted OpenAI, vLLM, SGLang, llama.cpp servers with a chat template.
    - `api="completions"`: `/v1/completions` with integer `logprobs` on the
      plain-text prompt, for models without a chat template (llama.cpp).
    - `prefill`: text put in an open assistant turn (vLLM/SGLang
      `continue_final_message`), so the next token is the letter.
    - `constrain=True` asks vLLM to restrict the answer to the 20 letters.
    - `vision`: True sends images as `image_url` parts (a server that refuses
      them fails the call with `bad_request`), False sends text placeholders.
      None (default) sends images; when the server answers that the model does
      not take images (`refuses_images`: a clear message, not any 4xx/5xx), the
      request is resent with placeholders and that model gets placeholders for
      `vision_retry_s` (600 s), with a warning, before images are tried again.
      A 5xx, a timeout or a lost connection is retried like any other failure
      and never turns images off. A result scored without its frames says how
      many it missed (`JudgeResponse.images_dropped`, `Progress.images_dropped`).
    - `logprobs=False` is for servers that return no logprobs (e.g. Anthropic's
      OpenAI-compatible endpoint): each repeat's letter distribution is then
      estimated from `samples` answers drawn at `sample_temperature` (batched
      with `n` up to `max_batch` where the server allows), answers that are not
      exactly a letter count against the mass, and the sampling error is added
      to the result's uncertainty (`source="sampled"`).
    - `max_tokens` defaults to 1: the letter is the first token generated. Raise
      it for hosted models that may emit something before the letter; the
      reader takes the first generated token that is exactly a letter.

    - `run_key_field` names the request body field that carries the request's
      `run_key` (the run the call belongs to) as a cache hint that never enters
      the prompt, hashed (`run_hint`: stable per run, and no run id leaves the
      machine). "auto" (default) sends it as `prompt_cache_key` to hosted
      OpenAI's chat API (api.openai.com), which routes requests by a hash of the prompt's
      first ~256 tokens, the same rubric instructions for every run, and takes
      the key to spread runs over its cache machines; to other servers nothing
      (vLLM's and SGLang's prefix caches are keyed by the tokens alone, and
      llama.cpp's llama-server picks a slot by prompt similarity). Name a field
      (e.g. "user", which every OpenAI-compatible server accepts) to send it
      there; None never sends it.

    - `transport`: "lean" (the default, unless a `client` is given) sends each
      request as one JSON body over pooled keep-alive HTTP/1.1 connections;
      "sdk" goes through the `openai` SDK's endpoints (`client`, or one made
      from `base_url`/`api_key`), for what only it does (Azure clients, custom
      HTTP settings): measured with `bench/judge_cpu.py`, several times the CPU
      per call. Both send the same request body, and the reply is read by one
      reader, as plain JSON, the fields it needs and no others (the transports
      are in `_openai_transport`; this class decides what to ask and reads it).

    The model is read from `/v1/models` when not given. K repeats go as one
    request with `n=K`; a server that returns fewer choices gets the rest as
    separate requests (and is remembered as not supporting `n`).
    """

    name = "openai"

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        *,
        api: Literal["chat", "completions"] = "chat",
        max_tokens: int = 1,
        top_logprobs: int = 20,
        temperature: float = 0.0,
        prefill: str | None = None,
        constrain: bool = False,
        vision: bool | None = None,
        vision_retry_s: float = 600.0,
        logprobs: bool = True,
        samples: int = 20,
        sample_temperature: float = 1.0,
        max_batch: int = 128,
        supports_n: bool | None = None,
        extra_body: Mapping[str, Any] | None = None,
        run_key_field: str | None = "auto",
        client: AsyncOpenAI | None = None,
        transport: Literal["lean", "sdk"] | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        concurrency: int = 8,
        context_tokens: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            concurrency=concurrency,
            context_tokens=_context_setting(context_tokens),
        )
        if vision_retry_s <= 0:
            raise ValueError(f"vision_retry_s={vision_retry_s}; use a number of seconds > 0")
        if api not in ("chat", "completions"):
            raise ValueError(f"api={api!r}; use 'chat' or 'completions'")
        if max_tokens < 1 or not 0 <= top_logprobs <= 20:
            raise ValueError("OpenAIJudge needs max_tokens >= 1 and 0 <= top_logprobs <= 20")
        if samples < 1 or max_batch < 1:
            raise ValueError("OpenAIJudge needs samples >= 1 and max_batch >= 1")
        if transport not in (None, "lean", "sdk"):
            raise ValueError(
                f"transport={transport!r}; use 'lean', 'sdk' or None (lean "
                "unless a client is given)"
            )
        if transport == "lean" and client is not None:
            raise ValueError(
                "transport='lean' sends its own requests: pass base_url and api_key, not client="
            )
        self.transport: Literal["lean", "sdk"] = transport or (
            "sdk" if client is not None else "lean"
        )
        """How requests go out: "lean" (pooled HTTP/1.1, JSON read as is) or "sdk" (the `openai`
        SDK)."""
        self._owns_client = client is None
        if client is None:
            if api_key is None and base_url is not None and not os.environ.get("OPENAI_API_KEY"):
                api_key = "not-needed"  # local servers (vLLM, llama.cpp) accept any key
            # Our own retry loop handles 429/5xx with backoff and Retry-After; SDK retries would
            # multiply it.
            client = AsyncOpenAI(
                base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s
            )
        self.client = client
        """The SDK client: the server's URL and key, the reachability check, and the SDK
        transport's requests."""
        self._transport: Transport = (
            SdkTransport(client, self.base_url)
            if self.transport == "sdk"
            else LeanTransport(self.base_url, client.api_key, self)
        )
        self.model = model or ""
        self.api = api
        self.max_tokens = max_tokens
        self.top_logprobs = top_logprobs
        self.temperature = temperature
        self.prefill = prefill
        self.constrain = constrain
        self.vision = vision
        self.vision_retry_s = vision_retry_s
        self.clock = clock
        # Per model: when images may be tried again after the server said the model takes none.
        self._no_images_until: dict[str, float] = {}
        self.logprobs = logprobs
        self.samples = samples
        self.sample_temperature = sample_temperature
        self.max_batch = max_batch
        self.supports_n = supports_n
        self.extra_body = dict(extra_body or {})
        if run_key_field == "auto":
            host = urllib.parse.urlsplit(str(self.client.base_url)).hostname or ""
            run_key_field = (
                "prompt_cache_key" if host == "api.openai.com" and api == "chat" else None
            )
        if run_key_field is not None and not run_key_field.isidentifier():
            raise ValueError(
                f"run_key_field={run_key_field!r}; use a body field name such as 'user', or None"
            )
        self.run_key_field = run_key_field
        """The body field that carries each request's run key (None: not sent)."""
        self._model_lock = asyncio.Lock()
        self._context_asked = context_tokens is not None
        """Whether the server was asked for its context (a setting wins: then it is not asked)."""

    async def aclose(self) -> None:
        """Close the transport's connections, and the SDK client if this judge made it (a client
        passed in stays)."""
        await self._transport.aclose()
        if self._owns_client:
            await self.client.close()

    @property
    def base_url(self) -> str:
        """The server's base URL as the client uses it (errors name it)."""
        return str(self.client.base_url).rstrip("/")

    async def check_reachable(self) -> None:
        """Raise JudgeError("connection") when nothing answers at `base_url` (one try, no retries).

        Any HTTP answer counts as reachable (some servers have no `/models`): this is the start-up
        check for a judge whose model is given, so a dead URL is said at once, not after a first
        step's retries.
        """
        try:
            await self.client.models.with_raw_response.list()
        except openai.APIConnectionError as e:
            raise sdk_error(e, self.base_url) from None
        except openai.OpenAIError:
            pass

    @property
    def answer_tokens(self) -> int:
        """Tokens an answer may take: `max_tokens`."""
        return self.max_tokens

    async def resolve_model(self) -> str:
        """The model id, read from `/v1/models` when it was not given; the judge's context too,
        where the server says.

        The context (`context_tokens`, unless set) is vLLM's `max_model_len` in the model's
        `/v1/models` entry, else llama.cpp's llama-server `/props` (`n_ctx`); asked once, and a
        server that says neither (or fails to answer) leaves it unknown, never an error when the
        model is given.
        """
        if self.model and self._context_asked:
            return self.model
        async with self._model_lock:
            if not self.model:
                try:
                    reply = await self._transport.send("/models", None)
                except StatusError as e:
                    raise e.judge_error() from None
                # Read as plain JSON on both transports: the SDK's model list crashes on a reply of
                # another shape.
                data = _reply_object(reply, self.base_url).get("data")
                if not isinstance(data, list):
                    raise _not_openai(reply, self.base_url, "a JSON object without a `data` list")
                ids = [
                    m["id"]
                    for m in data
                    if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]
                ]
                if not ids:
                    raise JudgeError(
                        "no_model", f"{self.base_url}/models lists no model; pass model="
                    )
                self.model = ids[0]
                if not self._context_asked:
                    self._context_asked = True
                    await self._ask_context(data)
            if not self._context_asked:
                self._context_asked = True
                await self._ask_context(None)
        return self.model

    async def _ask_context(self, models: list[Any] | None) -> None:
        """Read the server's context from `/v1/models` (`models`: its entries, None to ask), else
        `/props`.

        A server that says nothing, or fails to answer, leaves it unknown: never an error.
        """
        if models is None:
            try:
                body = json.loads((await self._transport.send("/models", None)).body)
            except (JudgeError, StatusError, ValueError):
                body = None
            data = body.get("data") if isinstance(body, dict) else None
            models = data if isinstance(data, list) else []
        if self._context_from(models):
            return
        if urllib.parse.urlsplit(self.base_url).hostname == "api.openai.com":
            return  # hosted OpenAI says no context anywhere: nothing more to ask
        tokens = await _props_context(self.base_url, self.client.api_key, self.timeout_s)
        if tokens is not None and self.context_tokens is None:
            self.context_tokens = tokens
            log.info(
                "judge_context",
                judge=self.name,
                model=self.model,
                context_tokens=tokens,
                source="/props",
            )

    def _context_from(self, entries: list[Any]) -> bool:
        """Take the context from the model's `/v1/models` entry (vLLM's `max_model_len`); whether
        it said one."""
        for entry in entries:
            if isinstance(entry, dict) and entry.get("id") == self.model:
                tokens = _positive(entry.get("max_model_len"))
                if tokens is not None:
                    if self.context_tokens is None:  # a setting, or a learned refusal, wins
                        self.context_tokens = tokens
                        log.info(
                            "judge_context",
                            judge=self.name,
                            model=self.model,
                            context_tokens=tokens,
                            source="/models",
                        )
                    return True
        return False

    async def summarise(
        self, text: str, *, max_tokens: int, model: str | None = None
    ) -> tuple[str, Usage]:
        """One text completion of `text` (an LLM digest's summary of a folded chunk), by `model` on
        this server.

        `model` None is the judge's own. The judge's API is used (chat: `text` as the user's
        message), at temperature 0 and without `extra_body` (its fields shape the grading answer: a
        grammar, guided choice); one attempt within `timeout_s`, its failure a JudgeError.
        """
        name = model or await self.resolve_model()
        common: dict[str, Any] = {"model": name, "max_tokens": max_tokens, "temperature": 0.0}
        if self.api == "completions":
            path, body = "/completions", {"prompt": text, **common}
        else:
            path, body = (
                "/chat/completions",
                {"messages": [{"role": "user", "content": text}], **common},
            )
        try:
            async with asyncio.timeout(self.timeout_s):
                reply = await self._transport.send(path, body)
        except TimeoutError:
            raise JudgeError(
                "timeout", f"no summary within {self.timeout_s:g} s", retryable=True
            ) from None
        except StatusError as e:
            raise e.judge_error() from None
        data = _reply_object(reply, self.base_url)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices:
            raise _not_openai(reply, self.base_url, "a JSON object without a `choices` list")
        if self.api == "completions":
            out = self._read(lambda: str(choices[0].get("text") or ""))
        else:
            out = self._read(lambda: str((choices[0].get("message") or {}).get("content") or ""))
        return out, self._read(lambda: _usage_of(data))

    def _read(self, read: Callable[[], _T]) -> _T:
        """Read the parsed reply's choices; a reply of another shape is `bad_response`, not a
        crash."""
        try:
            return read()
        except (AttributeError, TypeError, ValueError, LookupError) as e:
            raise JudgeError(
                "bad_response",
                f"{self.base_url} answered choices of an unexpected shape "
                f"({type(e).__name__}: {e}); "
                "is it an OpenAI-compatible server? check base_url (it usually ends in /v1)",
            ) from None

    def sends_images(self, model: str) -> bool:
        """Whether a request for `model` goes out with its images now (chat API; False while its
        refusal cools down)."""
        if self.api != "chat" or self.vision is False:
            return False
        if self.vision:
            return True
        until = self._no_images_until.get(model)
        return until is None or self.clock() >= until

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        model = await self.resolve_model()
        dropped: list[int] = []  # per request answered: image parts sent as placeholders
        if not self.logprobs:
            return await self._sampled(request, model, dropped)
        k = request.repeats
        samples, usage, batch = await self._repeats(
            k,
            k if self.supports_n is not False else 1,
            lambda n: self._request(request.prompt, model, n, dropped, request.run_key),
        )
        if batch is not None:
            self.supports_n = batch
        return JudgeResponse(
            samples=tuple(samples), model=model, usage=usage, images_dropped=max(dropped, default=0)
        )

    async def _sampled(
        self, request: JudgeRequest, model: str, dropped: list[int]
    ) -> JudgeResponse:
        """Estimate each repeat's letter distribution from `samples` sampled answers."""

        async def chunk(n: int) -> tuple[list[Sample], Usage, bool | None]:
            ask = n if self.supports_n is not False else 1
            return await self._repeats(
                n, ask, lambda m: self._request(request.prompt, model, m, dropped, request.run_key)
            )

        draws: list[Sample] = []
        usage = Usage()
        sizes = batches(request.repeats * self.samples, self.max_batch)
        for got, u, batch in await asyncio.gather(*(chunk(n) for n in sizes)):
            draws.extend(got)
            usage += u
            if batch is not None:
                self.supports_n = batch
        return JudgeResponse(
            samples=tally(draws, request.repeats, self.samples),
            model=model,
            usage=usage,
            draws=self.samples,
            images_dropped=max(dropped, default=0),
        )

    async def _request(
        self, prompt: Prompt, model: str, n: int, dropped: list[int], run_key: str | None = None
    ) -> tuple[list[Sample], Usage]:
        images = prompt.image_count
        if not (images and self.sends_images(model)):
            answer = await self._send(prompt, model, n, images=False, run_key=run_key)
            dropped.append(images)
            return answer
        try:
            answer = await self._send(prompt, model, n, images=True, run_key=run_key)
        except ImagesRefused as e:
            if self.vision:
                # asked for explicitly: a refusal is the caller's failure to see, never a silent
                # fallback
                raise
            self._images_off(model, e)
            answer = await self._send(prompt, model, n, images=False, run_key=run_key)
            dropped.append(images)
            return answer
        if self._no_images_until.pop(model, None) is not None:
            log.info("judge_takes_images_again", judge=self.name, model=model)
        dropped.append(0)
        return answer

    def _images_off(self, model: str, e: ImagesRefused) -> None:
        self._no_images_until[model] = self.clock() + self.vision_retry_s
        log.warning(
            "judge_refuses_images",
            judge=self.name,
            model=model,
            error=e.server_message,
            retry_in_s=self.vision_retry_s,
            hint="its requests carry text placeholders for the frames until then; "
            "pass vision=False to silence this, or use a vision model",
        )

    async def _send(
        self, prompt: Prompt, model: str, n: int, *, images: bool, run_key: str | None = None
    ) -> tuple[list[Sample], Usage]:
        """One request for `n` answers: its body built, sent by the transport, its reply read as
        plain JSON."""
        path, body = self._body(prompt, model, n, images=images, run_key=run_key)
        try:
            reply = await self._transport.send(path, body)
        except StatusError as e:
            if images and refuses_images(e.status, e.server_message):
                raise ImagesRefused(e.status, e.server_message) from None
            raise e.judge_error() from None
        data = _reply_object(reply, self.base_url)
        choices = data.get("choices")
        if not isinstance(choices, list):
            raise _not_openai(reply, self.base_url, "a JSON object without a `choices` list")
        if not self.logprobs:  # each draw is {letter: 0.0}, or {} when it is not a letter
            if self.api == "completions":
                texts = self._read(lambda: [str(c.get("text") or "") for c in choices])
            else:
                texts = self._read(
                    lambda: [str((c.get("message") or {}).get("content") or "") for c in choices]
                )
            return [drawn_letter(t) for t in texts], self._read(lambda: _usage_of(data))
        read = _completion_sample if self.api == "completions" else _chat_sample
        if choices and all(isinstance(c, Mapping) and _without_logprobs(c) for c in choices):
            # An answer with text and no logprobs is no score, and no passing failure: the server is
            # set up so (vLLM's --max-logprobs 0, llama.cpp's server without n_probs). A failed
            # call, with the fix.
            raise JudgeError("no_logprobs", no_logprobs_fix(self.base_url))
        return self._read(lambda: [read(c) for c in choices]), self._read(lambda: _usage_of(data))

    def _body(
        self, prompt: Prompt, model: str, n: int, *, images: bool, run_key: str | None
    ) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of one request (the same on both transports)."""
        extra = dict(self.extra_body)
        if self.run_key_field is not None and run_key is not None:
            # a field the caller set in extra_body wins
            extra.setdefault(self.run_key_field, run_hint(run_key))
        temperature = self.temperature if self.logprobs else self.sample_temperature
        common: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": temperature,
        }
        if n > 1:
            common["n"] = n
        body: dict[str, Any]
        if self.api == "completions":
            path, body = "/completions", {"prompt": prompt.text(), **common}
            if self.logprobs:
                body["logprobs"] = self.top_logprobs
        else:
            path, body = (
                "/chat/completions",
                {"messages": self._messages(prompt, images=images), **common},
            )
            if self.logprobs:
                body.update(logprobs=True, top_logprobs=self.top_logprobs)
                if self.prefill is not None:
                    extra.update(continue_final_message=True, add_generation_prompt=False)
                if self.constrain:
                    extra["guided_choice"] = list(
                        BINARY_TOKENS if prompt.scale == "binary" else LETTERS
                    )
        body.update(extra)  # as the SDK's extra_body: merged into the body, a caller's field wins
        return path, body

    def _messages(self, prompt: Prompt, *, images: bool) -> list[dict[str, Any]]:
        content: str | list[dict[str, Any]]
        if images:
            content = [_part(p) for p in prompt.parts]
        else:
            # Plain string content: every OpenAI-compatible server and chat template accepts it.
            content = "".join(
                p.text if isinstance(p, TextPart) else Frame.describe(p.frame) + "\n"
                for p in prompt.parts
            )
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": prompt.instructions},
            {"role": "user", "content": content},
        ]
        if self.prefill is not None:
            messages.append({"role": "assistant", "content": self.prefill})
        return messages


class ImagesRefused(JudgeError):
    """The server answered that the model takes no images (a `bad_request`: resending the same
    images cannot help)."""

    def __init__(self, status: int, server_message: str) -> None:
        super().__init__(
            "bad_request",
            f"HTTP {status}: the judge model refuses images ({server_message}); "
            "use a vision model, or vision=None to send text placeholders instead",
        )
        self.server_message = server_message


# What servers answer when the model takes no images, as their code or their users' reports show it:
# - OpenAI, 400: "Invalid content type. image_url is only supported by certain models."
#   (quoted in vllm-project/vllm#11629, browser-use/web-ui#274)
# - vLLM, 400: "<model> is not a multimodal model" (studio-dots-ai/dots.ocr#61,
#   vllm-project/vllm#23402), and
#   "At most 0 image(s) may be provided in one prompt." when image inputs are limited to 0
#   (--limit-mm-per-prompt, --language-model-only); "At most 1 image(s)" is a different complaint.
# - llama.cpp llama-server without --mmproj: "image input is not supported - hint: if this is
#   unexpected,
# you may need to provide the mmproj" (tools/server/server-common.cpp), thrown as
# std::runtime_error, which its ex_wrapper turns into HTTP 500.
# - llama-cpp-python's llama_cpp.server with a text chat format, 500: 'can only concatenate str (not
#   "list")
#   to str' (abetlen/llama-cpp-python#1168): it cannot take content parts at all; plain text works.
# - SGLang, Ollama and gateways word it in their own ways; no verbatim string was found for SGLang,
#   so the
# generic "does not support image(s)/vision/multimodal" and "image(s)/vision/multimodal ... not
# supported" forms cover them.
_NO_IMAGES = re.compile(
    r"image_url is only supported by certain models"
    r"|is not a multimodal model"
    r"|at most 0 image\(s\) may be provided"
    r"|image input is not supported"
    r'|can only concatenate str \(not "list"\) to str'
    r"|(?:does not|doesn't|do not) support (?:images?|vision|multi-?modal)\b"
    r"|(?:image|vision|multi-?modal)(?:s| inputs?)? (?:is|are) not (?:supported|enabled)",
    re.IGNORECASE,
)


async def _props_context(base_url: str, api_key: str | None, timeout_s: float) -> int | None:
    """llama.cpp llama-server's context (`n_ctx` of `/props`, at the server's root), or None when
    it says none."""
    parts = urllib.parse.urlsplit(base_url)
    path = parts.path.rstrip("/").removesuffix("/v1")
    root = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
    headers = {"Accept": "application/json", "User-Agent": "agent-monitor"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    pool = WirePool(root, headers=headers, max_connections=1)
    try:
        reply = await pool.request("GET", "/props", None, timeout_s=min(timeout_s, 10.0))
        body = json.loads(reply.body) if reply.status == 200 else None
    except (WireTimeout, WireConnectionError, ValueError):
        return None  # not a llama-server, or it did not answer: the context stays unknown
    finally:
        await pool.aclose()
    if not isinstance(body, dict):
        return None
    settings = body.get("default_generation_settings")
    nested = settings.get("n_ctx") if isinstance(settings, dict) else None
    return _positive(body.get("n_ctx")) or _positive(nested)


def _positive(value: object) -> int | None:
    """A count a server reported: a positive integer, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _context_setting(tokens: int | None) -> int | None:
    """A context set by the user, checked."""
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
    ):
        raise ValueError(
            f"context_tokens={tokens!r}; use the judge's context window in tokens (>= 1), or None"
        )
    return tokens


def run_hint(run_key: str) -> str:
    """What a server is sent for a run key: 32 hex digits of its SHA-256, the same for every call
    of the run."""
    return hashlib.sha256(run_key.encode("utf-8")).hexdigest()[:32]


def refuses_images(status: int, message: str) -> bool:
    """Whether an HTTP error answer says the model takes no images (then resending without images
    helps).

    Only a clear answer counts: a 4xx other than 408/429, or a 500 (llama.cpp's servers answer this
    refusal with 500), whose message says so. Overload (502-504), timeouts, rate limits and other
    errors say nothing about images and are retried instead.
    """
    if not (400 <= status < 500 and status not in (408, 429)) and status != 500:
        return False
    return _NO_IMAGES.search(message) is not None


def _part(p: TextPart | ImagePart) -> dict[str, Any]:
    if isinstance(p, TextPart):
        return {"type": "text", "text": p.text}
    return {"type": "image_url", "image_url": {"url": p.frame.data_url()}}


def _reply_object(reply: WireReply, where: str) -> dict[str, Any]:
    """A reply's body as a JSON object; `bad_response` when it is anything else (HTML, a list)."""
    try:
        body = json.loads(reply.body)
    except ValueError:  # not JSON at all (JSONDecodeError, or undecodable bytes)
        body = None
    if not isinstance(body, dict):
        raise _not_openai(reply, where, "not a JSON object")
    return body


def _not_openai(reply: WireReply, where: str, what: str) -> JudgeError:
    """`bad_response` for a reply that is no OpenAI API answer: what came back, and from where."""
    kind = reply.headers.get("content-type", "no content type").split(";")[0].strip()
    start = reply.body[:60].decode("utf-8", errors="replace")
    return JudgeError(
        "bad_response",
        f"{reply.url} answered HTTP {reply.status} {kind} {start!r} ({what}): {where} does not "
        "look like an OpenAI-compatible server; check base_url (it usually ends in /v1)",
    )


def no_logprobs_fix(url: str) -> str:
    """What to do about a judge server that answers without logprobs: the message of
    `no_logprobs`."""
    return (
        f"{url} answered without logprobs, so its answers cannot be scored; let it return "
        "them (vLLM: "
        "--max-logprobs 20; llama.cpp's server: it returns them when asked for n_probs / "
        "top_logprobs, so check "
        "the server and any proxy in between), or pass --judge-sampled to score sampled "
        "letters instead "
        "(slower, coarser: several answers a step)"
    )


def _without_logprobs(choice: Mapping[str, Any]) -> bool:
    """Whether a choice carries generated text but no logprobs for it (the server did not return
    them)."""
    lp = choice.get("logprobs")
    text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
    if not text:
        return False  # nothing generated: `no_answer`, as before
    if not isinstance(lp, Mapping):
        return True
    return not (lp.get("content") or lp.get("tokens"))


def _chat_sample(choice: Mapping[str, Any]) -> Sample:
    """A chat choice's answer, read from the reply's JSON as it is: the top logprobs of each
    generated token."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, Mapping) else None
    content = content or []
    return answer_sample(
        [(c["token"], c["logprob"]) for c in content],
        [[(t["token"], t["logprob"]) for t in c.get("top_logprobs") or []] for c in content],
    )


def _completion_sample(choice: Mapping[str, Any]) -> Sample:
    """A completion choice's answer, read from the reply's JSON as it is (integer `logprobs`'
    token lists)."""
    lp = choice.get("logprobs")
    if not isinstance(lp, Mapping) or not lp.get("tokens"):
        return None
    tokens = lp["tokens"]
    chosen = lp.get("token_logprobs") or [None] * len(tokens)
    return answer_sample(
        list(zip(tokens, chosen, strict=False)),
        [list((d or {}).items()) for d in lp.get("top_logprobs") or []],
    )


def _usage_of(body: Mapping[str, Any]) -> Usage:
    """A reply's usage (prompt, cached and completion tokens), read from its JSON."""
    u = body.get("usage")
    if not isinstance(u, Mapping):
        return Usage()
    details = u.get("prompt_tokens_details")
    cached = (details.get("cached_tokens") if isinstance(details, Mapping) else None) or 0
    return Usage(
        input_tokens=int(u.get("prompt_tokens") or 0),
        cached_input_tokens=int(cached),
        output_tokens=int(u.get("completion_tokens") or 0),
    )
