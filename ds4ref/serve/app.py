"""The OpenAI-compatible HTTP API (FastAPI) over a Runner.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both optionally
streamed as server-sent events ending with `data: [DONE]`), GET /v1/models,
POST /tokenize, POST /detokenize, GET /health, GET /metrics. Every invalid
request is answered 400 with an OpenAI-style error body naming the field; a
full waiting queue is 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..console import plural
from ..scheduler.request import FinishEvent, Refused, Request, Sampling, TokenEvent
from ..scheduler.scheduler import QueueFull
from .chat import DSML, ChatTemplateError, encode_chat, encode_prompt, thinking_requested
from .protocol import U64, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .runner import Runner, ServerShuttingDown, StreamAborted
from .text import CONTENT, REASONING, Delta, TextAssembler, TokenInfo
from .structured import GrammarConstraint, StructuredOutputError, structured_output
from .tool_grammar import forced_tool_calls
from .tools import ToolCall, ToolCallStream

log = logging.getLogger("ds4ref.serve")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
MAX_PROMPT_CHARS_PER_TOKEN = 256    # longer text is refused before tokenising it
RETRY_AFTER_S = 1
MAX_BODY_BYTES = 64 << 20           # a 1M-token prompt as a JSON id list is ~8 MB
BODY_TIMEOUT_S = 60.0               # for the whole body: 64 MiB at ~1 MiB/s, and a trickle ends too
LINGER_S = 1.0                      # a body over the cap is read and dropped this long before the 413


@dataclass
class ServerState:
    runner: Runner
    tokenizer: Any
    model_name: str
    max_context: int
    vocab_size: int
    chat_version: str = "original"     # whose chat rules prompts follow (gguf.version.chat_version)
    banner: str = ""
    plan: str = ""                     # the memory plan's line (paging.plan.summary)
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    pool_tokens: Optional[int] = None  # KV pool size: a default max_tokens is clamped to fit it
    api_key: Optional[str] = None      # required as `Authorization: Bearer ...` on /v1/* when set
    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*" for any); none = no CORS headers
    created: int = field(default_factory=lambda: int(time.time()))


# ---- errors ------------------------------------------------------------------------

class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: str = "invalid_request_error",
                 headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# pydantic union branch tags ("str", "list[int]", "function-after[...]") are not field names
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_path(loc: tuple) -> Optional[str]:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part not in _TYPE_TAGS and not any(c in part for c in "[-"):
            path += f".{part}" if path else part
    return path or None


def _plain_message(error: dict) -> str:
    """pydantic's message without its own prefixes ("Value error, ...")."""
    ctx_error = (error.get("ctx") or {}).get("error")
    if isinstance(ctx_error, Exception):
        return str(ctx_error)
    msg = str(error.get("msg", "invalid"))
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return msg


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    param = _param_path(tuple(errors[0].get("loc", ())))
    msgs = []
    for e in errors[:3]:
        where = _param_path(tuple(e.get("loc", ()))) or "body"
        msgs.append(f"{where}: {_plain_message(e)}")
    if any(e.get("type") == "json_invalid" for e in errors):
        return APIError(400, "the request body is not valid JSON", None, "invalid_json")
    if param is None and errors[0].get("type") in ("model_attributes_type", "dict_type", "missing"):
        return APIError(400, "the request body must be a JSON object, sent with Content-Type: "
                             "application/json", None, "invalid_body")
    return APIError(400, "; ".join(msgs), param, "invalid_value")


# ---- turning a validated body into an engine Request ------------------------------------

def _sampling(state: "ServerState", body: Union[CompletionRequest, ChatCompletionRequest],
              logprobs: Optional[int]) -> Sampling:
    bias = body.bias_pairs()
    bad = next((t for t, _ in bias if t >= state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"logit_bias names token {bad}, outside the vocabulary (0..{state.vocab_size - 1})",
                       "logit_bias", "invalid_token")
    return Sampling(
        temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p, min_p=body.min_p,
        seed=None if body.seed is None else body.seed & U64,  # negative seeds as two's complement
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logprobs=logprobs, logit_bias=bias)


def _check_prompt(state: ServerState, ids: list[int], param: str) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", param, "empty_prompt")
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{state.vocab_size - 1})",
                       param, "invalid_token")
    if len(ids) >= state.max_context:
        raise APIError(400, f"the prompt has {plural(len(ids), 'token')}; the context limit is "
                            f"{plural(state.max_context, 'token')}", param, "context_length_exceeded")


def _max_new_tokens(state: ServerState, n_prompt: int, asked: Optional[int], default: Optional[int],
                    param: str) -> int:
    room = state.max_context - n_prompt
    if asked is None and state.pool_tokens is not None:
        room = max(1, min(room, state.pool_tokens - n_prompt + 1))  # a lone sequence's whole pool
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise APIError(400, f"{param}={asked} plus the prompt's {plural(n_prompt, 'token')} exceeds the context "
                            f"limit of {plural(state.max_context, 'token')}", param, "context_length_exceeded")
    return asked


async def _tokenize(fn: Callable[[], list[int]], param: str, n_chars: int, state: ServerState) -> list[int]:
    if n_chars > state.max_context * MAX_PROMPT_CHARS_PER_TOKEN:
        raise APIError(400, f"the prompt text ({n_chars} characters) cannot fit the context limit of "
                            f"{state.max_context} tokens", param, "context_length_exceeded")
    try:
        # off the event loop: a long prompt must not hold up the other streams
        return await asyncio.to_thread(fn)
    except ChatTemplateError as e:
        raise APIError(400, str(e), e.param, "invalid_messages") from None
    except ValueError as e:  # TokenizerError: e.g. lone surrogates UTF-8 cannot hold
        raise APIError(400, f"cannot tokenize the prompt: {e}", param, "invalid_prompt") from None
    except Exception as e:  # anything else is ours: no library internals in the answer
        # an exception's message may quote the prompt: the traceback only at debug level
        log.error("tokenizing a prompt failed (%s); --log-level debug logs the traceback", type(e).__name__)
        log.debug("tokenizing a prompt failed", exc_info=True)
        raise APIError(400, "cannot tokenize the prompt", param, "invalid_prompt") from None


async def _chat_prompt(state: ServerState, body: ChatCompletionRequest
                       ) -> tuple[list[int], bool, Optional[GrammarConstraint]]:
    """A chat request's prompt ids, whether it thinks, and its constraint: response_format's,
    or a forced tool_choice's."""
    thinking = thinking_requested(body.chat_template_kwargs, body.reasoning_effort,
                                  body.thinking.model_dump() if body.thinking else None)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = body.tools_for_prompt()
    if body.forces_tool_call() and body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "a forced tool_choice makes the answer a tool call: response_format cannot "
                            "constrain it too", "tool_choice", "invalid_value")
    try:
        constraint, schema = structured_output(state.tokenizer, body.response_format, thinking)
        constraint = constraint or await asyncio.to_thread(  # a large tool list takes a while to compile
            forced_tool_calls, state.tokenizer, tools, body.tool_choice, body.parallel_tool_calls is not False,
            thinking)
    except StructuredOutputError as e:
        raise APIError(400, str(e), e.param, e.code) from None
    n_chars = sum(len(json.dumps(m, ensure_ascii=False)) for m in messages + (tools or []))
    ids = await _tokenize(lambda: encode_chat(state.tokenizer, messages, thinking, tools=tools,
                                              reasoning_effort=body.reasoning_effort, response_format=schema,
                                              version=state.chat_version),
                          "messages", n_chars, state)
    return ids, thinking, constraint


def _check_model(state: ServerState, model: Optional[str]) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {model!r} is not served here; this server serves {state.model_name!r}",
                       "model", "model_not_found")


# ---- one generation ------------------------------------------------------------------------------

class Generation:
    """One request's life: submit, read events, turn tokens into text, cancel if abandoned."""

    def __init__(self, state: ServerState, request: Request, stop_strings: list[str], thinking: bool,
                 want_logprobs: bool, skip_special: bool = True, parse_tools: bool = False,
                 single_tool_call: bool = False) -> None:
        self.state, self.request = state, request
        self.text = TextAssembler(state.tokenizer, stop_strings, thinking,
                                  _skipped_tokens(state.tokenizer, skip_special, parse_tools))
        # The DSML token stays in the text for the tool-call parser, which then drops it from content.
        self.tools = ToolCallStream(parse_tools, (DSML,) if skip_special else (), single_tool_call)
        self.answer = ""  # answer text sent so far (after stop strings and tool calls)
        self.want_logprobs = want_logprobs
        self.tokens: list[TokenInfo] = []
        self.finish_reason: Optional[str] = None
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache served (known at the FinishEvent)
        self.drafts = (0, 0)    # speculative decoding: drafts proposed, accepted (known at the FinishEvent)
        self.arrived = time.monotonic()
        self._stream = None
        self._first: Optional[list] = None  # events read before a stream's response started
        self._closed = False
        self._engine_done = False  # a FinishEvent arrived: nothing left to cancel

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    async def start(self, param: str) -> None:
        runner, metrics = self.state.runner, self.state.runner.metrics
        try:
            self._stream = await runner.submit(self.request)
        except Refused as e:
            metrics.requests.inc("refused")
            raise APIError(400, str(e), param, "prompt_refused") from None
        except QueueFull as e:
            metrics.requests.inc("queue_full")
            raise APIError(503, f"server busy: {e}", None, "queue_full", "server_busy",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ServerShuttingDown as e:
            metrics.requests.inc("unavailable")
            raise shutting_down(e) from None
        except StreamAborted as e:
            metrics.requests.inc("unavailable")
            raise APIError(503, str(e), None, "unavailable", "server_error",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        metrics.requests.inc("accepted")
        metrics.prompt_tokens.inc(by=self.prompt_tokens)

    async def first_events(self, http: HTTPRequest) -> None:
        """Wait for the first events before a stream's response starts: a request the shutdown
        aborts before then (still queued, or prefilling) gets its status, 503 with Retry-After,
        and one the engine ends with an error its 500, not a 200 stream that carries the error.
        A client that leaves meanwhile is cancelled."""
        work = asyncio.ensure_future(self._stream.next_events())
        watch = asyncio.ensure_future(_until_disconnect(http))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                raise APIError(499, "client disconnected", None, "client_closed")
            self._first = work.result()
            failed = next((ev for ev in self._first if isinstance(ev, FinishEvent) and ev.reason == "error"), None)
            if failed is not None and not any(isinstance(ev, TokenEvent) for ev in self._first):
                # ended before its first token: the status and body of a request that never streamed
                self._engine_done = True
                raise engine_failure(failed)
        except ServerShuttingDown as e:
            self.close()
            raise shutting_down(e) from None
        except StreamAborted:
            pass  # sticky: the stream's first read raises it again and ends with its error event
        except BaseException:
            self.close()
            raise
        finally:
            work.cancel()
            watch.cancel()

    async def _next_events(self) -> list:
        if self._first is not None:
            batch, self._first = self._first, None
            return batch
        return await self._stream.next_events()

    async def events(self) -> AsyncIterator[tuple[list[Delta], list[TokenInfo]]]:
        """(text deltas, new tokens) per batch of events, until the request ends.
        Raises APIError: 503 if the server is shutting down, 500 if the engine failed or the
        runner gave up on us."""
        while self.finish_reason is None:
            try:
                batch = await self._next_events()
            except ServerShuttingDown as e:
                self.finish_reason = "error"
                raise shutting_down(e) from None
            except StreamAborted as e:
                self.finish_reason = "error"
                raise APIError(500, f"generation aborted: {e}", None, "aborted", "server_error") from None
            deltas: list[Delta] = []
            infos: list[TokenInfo] = []
            for ev in batch:
                if isinstance(ev, TokenEvent):
                    if self.completion_tokens == 0:
                        self.state.runner.metrics.ttft_seconds.observe(time.monotonic() - self.arrived)
                    self.completion_tokens += 1
                    info = self._token_info(ev) if self.want_logprobs else None
                    deltas += self._answer(self.text.push(ev.token))
                    if info is not None:
                        infos.append(info)
                        self.tokens.append(info)
                    if self.text.stopped:
                        self.finish_reason = "stop"
                        self.close(count_as="stop")  # frees the slot at the next step
                        break
                elif isinstance(ev, FinishEvent):
                    self._engine_done = True
                    self.cached_tokens, self.drafts = ev.cached_tokens, (ev.draft_tokens, ev.accepted_drafts)
                    if ev.reason == "error":
                        self.finish_reason = "error"
                        raise engine_failure(ev)
                    if ev.reason == "cancelled":
                        self.finish_reason = "error"
                        raise APIError(500, "the request was cancelled by the server", None, "cancelled",
                                       "server_error")
                    self.finish_reason = ev.reason
                    self.completion_tokens = ev.completion_tokens  # the stop/EOS token counts too
                    deltas += self._answer(self.text.finish(), final=True)
                    if self.tools.calls:
                        self.finish_reason = "tool_calls"
                    break
            yield deltas, infos
            if self.finish_reason == "stop" and not self._engine_done:
                await self._until_engine_done(batch)
            # next_events returns at once while events are queued: without this a
            # request that never waits would keep the loop (and /health) from running
            await asyncio.sleep(0)

    async def _until_engine_done(self, batch: list) -> None:
        """After a stop string: read on to the engine's FinishEvent (the pass that frees the
        slot), which alone says how many prompt tokens came from the prefix cache."""
        try:
            while True:
                finish = next((ev for ev in batch if isinstance(ev, FinishEvent)), None)
                if finish is not None:
                    self._engine_done, self.cached_tokens = True, finish.cached_tokens
                    self.drafts = (finish.draft_tokens, finish.accepted_drafts)
                    return
                batch = await self._stream.next_events()
        except StreamAborted:  # the runner went away: the answer stands, cached tokens unknown
            pass

    def _answer(self, deltas: list[Delta], final: bool = False) -> list[Delta]:
        """Answer deltas through the tool-call stream (reasoning passes untouched)."""
        out = []
        for d in deltas:
            text = self.tools.feed(d.text) if d.channel == CONTENT else d.text
            if text:
                out.append(Delta(d.channel, text))
        if final:
            tail = self.tools.finish()
            if tail:
                out.append(Delta(CONTENT, tail))
        self.answer += "".join(d.text for d in out if d.channel == CONTENT)
        return out

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls

    def _token_info(self, ev: TokenEvent) -> TokenInfo:
        tok = self.state.tokenizer
        top = [(int(t), tok.decode([int(t)]), float(lp)) for t, lp in (ev.top_logprobs or [])]
        return TokenInfo(ev.token, tok.decode([ev.token]), ev.logprob, top, len(self.text.answer),
                         tok.decode_bytes([ev.token]))

    def close(self, count_as: str = "cancelled") -> None:
        """Cancel the request unless the engine already finished it. Idempotent."""
        if self._stream is not None and not self._closed:
            self._closed = True
            if not self._engine_done:
                self.state.runner.cancel(self.request.req_id, count_as)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                **({"completion_tokens_details": {"accepted_prediction_tokens": self.drafts[1],
                                                  "rejected_prediction_tokens": self.drafts[0] - self.drafts[1]}}
                   if self.drafts[0] else {})}


def _skipped_tokens(tokenizer: Any, skip_special: bool, parse_tools: bool) -> frozenset:
    """Added tokens that produce no text: all of them with skip_special_tokens, except
    the DSML token when tool calls are parsed (the parser needs it)."""
    if not skip_special:
        return frozenset()
    keep = {tokenizer.token_to_id(DSML)} if parse_tools else set()
    return frozenset(i for i in tokenizer.added.values() if i not in keep)


async def _until_disconnect(http: HTTPRequest) -> None:
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return


async def collect(gen: Generation, http: HTTPRequest) -> tuple[str, str]:
    """Run a non-streaming generation to its end; (reasoning, answer). A client
    that disconnects first gets its request cancelled."""
    async def drain() -> None:
        async for _ in gen.events():
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(_until_disconnect(http))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            log.info("request %d: client disconnected, cancelling", gen.request.req_id)
            work.cancel()
            raise APIError(499, "client disconnected", None, "client_closed")
        work.result()  # re-raise APIError
        return gen.text.reasoning, gen.answer
    finally:
        watch.cancel()
        gen.close()


class CancellingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the stream ends: done,
    client disconnected (Starlette cancels the sender), or server shutdown."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- response shapes ---------------------------------------------------------------------------

def _token_keys(tokenizer: Any, ids: list[int]) -> dict[int, str]:
    """A distinct text key per token id: its text when it is whole UTF-8, else its bytes
    spelled `bytes:\\xNN...` (vLLM's convention); a text already taken by another id
    becomes `token_id:N`."""
    keys: dict[int, str] = {}
    for i in ids:
        raw = tokenizer.decode_bytes([i])
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            key = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        keys[i] = f"token_id:{i}" if key in keys.values() else key
    return keys


def _completion_logprobs(infos: list[TokenInfo], tokenizer: Any) -> Optional[dict]:
    if not infos:
        return None
    tokens, tops = [], []
    for i in infos:
        keys = _token_keys(tokenizer, [i.token] + [t for t, _, _ in i.top])
        top = {keys[t]: lp for t, _, lp in i.top}
        top[keys[i.token]] = i.logprob  # the chosen token is always listed, with its own value
        tokens.append(keys[i.token])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [i.logprob for i in infos], "top_logprobs": tops,
            "text_offset": [i.offset for i in infos]}


def _chat_logprobs(infos: list[TokenInfo], tokenizer: Any) -> Optional[dict]:
    if not infos:
        return None

    def entry(token: int, text: str, lp: Optional[float]) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(tokenizer.decode_bytes([token]))}

    return {"content": [dict(entry(i.token, i.text, i.logprob),
                             top_logprobs=[entry(t, text, lp) for t, text, lp in i.top]) for i in infos]}


def _error_event(e: APIError) -> str:
    return sse(e.body())


def shutting_down(exc: ServerShuttingDown) -> APIError:
    """A request the shutdown ended: retryable, on another server or this one restarted."""
    return APIError(503, f"generation aborted: {exc}", None, "server_shutting_down", "server_error",
                    {"Retry-After": str(RETRY_AFTER_S)})


def engine_failure(ev: FinishEvent) -> APIError:
    """A request the engine ended with an error: its own failure by its code (non_finite_values:
    its values overflowed), else the pass it ran in failed."""
    if ev.error_code:
        return APIError(500, ev.message, None, ev.error_code, "server_error")
    return APIError(500, f"engine error: {ev.message}", None, "engine_error", "server_error")


def internal_error(exc: BaseException) -> APIError:
    """What a client sees of a bug: OpenAI-shaped, naming the exception."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error", "server_error")


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Read each request's whole body before the app sees it, and refuse it with 413
    once it passes max_bytes (announced by Content-Length, or counted as chunks of a
    chunked body arrive) or with 408 if it is not complete within timeout_s (a client
    that announces more than it sends would otherwise hold its connection forever).
    The app then gets the body in one message and `receive` as before (disconnects).

    A pure ASGI middleware: Starlette's BaseHTTPMiddleware would get in the way of
    disconnect detection on streams.
    """

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(413, f"request body over {self.max_bytes} bytes (or a bad Content-Length)",
                               "body_too_large", scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except _BodyTooLarge:
            await self._refuse(413, f"request body over {self.max_bytes} bytes", "body_too_large",
                               scope, receive, send)
            return
        except asyncio.TimeoutError:
            await self._refuse(408, f"the request body did not arrive within {self.timeout_s:g} s",
                               "body_timeout", scope, receive, send)
            return
        if body is not None:  # None: the client left mid-body, nobody to answer
            await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive) -> Optional[bytes]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _discard_rest(receive)
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(status: int, message: str, code: str, scope, receive, send) -> None:
        # close the connection: what the client still sends is not read
        err = APIError(status, message, None, code, headers={"Connection": "close"})
        await err.response()(scope, receive, send)


async def _discard_rest(receive) -> None:
    """Read and drop what the client is still sending, for up to LINGER_S. Closing a
    socket with unread input makes the kernel send a reset, which can destroy the 413
    before the client has read it; a client that keeps sending past LINGER_S is cut."""
    async def drain() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drain(), LINGER_S)


def _replay(body: bytes, receive):
    """A `receive` that hands out the buffered body once, then what the client sends next."""
    delivered = False

    async def replay():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class CountErrors:
    """Count every error response by HTTP status (ds4_http_errors_total), whichever layer sent it."""

    def __init__(self, app, metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        async def counting_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.http_errors.inc(str(message["status"]))
            await send(message)
        await self.app(scope, receive, counting_send if scope["type"] == "http" else send)


OPEN_PATHS = ("/health", "/metrics")  # for probes and scrapers: counts and states, no request text


class RequireAPIKey:
    """`Authorization: Bearer KEY` on every path but OPEN_PATHS (and CORS preflights); 401 in
    OpenAI's shape otherwise. The answer never quotes the header, nor the key."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                               None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- the app -------------------------------------------------------------------------------------

def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.runner.alive:
            state.runner.start()
        try:
            yield
        finally:
            state.runner.stop()
            log.info("runner stopped")

    app = FastAPI(title="ds4ref", version="0.1.0", lifespan=lifespan)
    # added last = outermost: errors are counted, then CORS answers preflights, then the key is checked
    app.add_middleware(BodyLimit, max_bytes=state.max_body_bytes, timeout_s=state.body_timeout_s)
    if state.api_key:
        app.add_middleware(RequireAPIKey, key=state.api_key)
    if state.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(CountErrors, metrics=state.runner.metrics)
    app.state.ds4 = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def _internal(_: HTTPRequest, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets the usual error body, not plain text
        return internal_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), None, None, kind, getattr(exc, "headers", None)).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        r = state.runner
        if not r.alive:
            return JSONResponse({"status": "error", "error": r.error or "runner stopped"}, status_code=503)
        return JSONResponse({"status": "ok", "running": r.stats.get("running", 0),
                             "waiting": r.stats.get("waiting", 0)})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.runner.metrics.render(state.runner.stats),
                                 media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "ds4ref",
                "max_model_len": state.max_context}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        _check_model(state, model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        _check_model(state, body.model)
        if isinstance(body.prompt, str):
            text = body.prompt
            ids = await _tokenize(lambda: encode_prompt(state.tokenizer, text, body.parse_special), "prompt",
                                  len(text), state)
        else:
            ids = list(body.prompt)
        _check_prompt(state, ids, "prompt")
        req = Request(ids, _max_new_tokens(state, len(ids), body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                                           "max_tokens"),
                      _sampling(state, body, body.logprobs), stop_ids=tuple(body.stop_ids()),
                      ignore_eos=body.ignore_eos)
        gen = Generation(state, req, body.stop_strings(), False, body.logprobs is not None, body.skip_special_tokens)
        await gen.start("prompt")
        head = {"id": f"cmpl-{req.req_id}", "object": "text_completion", "created": int(time.time()),
                "model": state.model_name}
        if body.stream:
            await gen.first_events(http)
            return CancellingStreamingResponse(_completion_stream(gen, head, body.include_usage), gen.close)
        _, answer = await collect(gen, http)
        return dict(head, choices=[{"index": 0, "text": answer, "logprobs": _completion_logprobs(gen.tokens, state.tokenizer),
                                    "finish_reason": gen.finish_reason}], usage=gen.usage())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        _check_model(state, body.model)
        ids, thinking, constraint = await _chat_prompt(state, body)
        tools = body.tools_for_prompt()
        _check_prompt(state, ids, "messages")
        asked, which = ((body.max_completion_tokens, "max_completion_tokens")
                        if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        req = Request(ids, _max_new_tokens(state, len(ids), asked, None, which), _sampling(state, body, logprobs),
                      stop_ids=tuple(body.stop_ids()), ignore_eos=body.ignore_eos, constraint=constraint)
        gen = Generation(state, req, body.stop_strings(), thinking, body.logprobs, body.skip_special_tokens,
                         parse_tools=tools is not None, single_tool_call=body.parallel_tool_calls is False)
        await gen.start("messages")
        head = {"id": f"chatcmpl-{req.req_id}", "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name}
        if body.stream:
            await gen.first_events(http)
            return CancellingStreamingResponse(_chat_stream(gen, head, body.include_usage), gen.close)
        reasoning, answer = await collect(gen, http)
        message = {"role": "assistant", "content": answer if answer or not gen.tool_calls else None}
        if thinking:
            message["reasoning_content"] = reasoning
        if gen.tool_calls:
            message["tool_calls"] = [c.openai() for c in gen.tool_calls]
        return dict(head, choices=[{"index": 0, "message": message, "logprobs": _chat_logprobs(gen.tokens, state.tokenizer),
                                    "finish_reason": gen.finish_reason}], usage=gen.usage())

    # ---- tokenizer endpoints (vLLM's and llama.cpp's servers have the same) ----

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt (a text) and messages (a chat)", None, "invalid_value")
        if body.messages is not None:
            for name in ("parse_special", "add_special_tokens"):
                if getattr(body, name):
                    raise APIError(400, f"{name} applies to a prompt only: a chat's control tokens come from "
                                        "its template, never from its text", name, "invalid_value")
            ids, _, _ = await _chat_prompt(state, body)
        else:
            text = body.prompt
            ids = await _tokenize(lambda: encode_prompt(state.tokenizer, text, body.parse_special is not False,
                                                        body.add_special_tokens is not False),
                                  "prompt", len(text), state)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(state, body.model)
        n = state.tokenizer.vocab_size
        bad = next(((k, t) for k, t in enumerate(body.tokens) if not 0 <= t < n), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad[0]}] is {bad[1]}, outside the vocabulary (0..{n - 1})", "tokens",
                           "invalid_token")
        # off the event loop: a long list must not hold up the other streams
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}

    return app


async def _sse_frame(gen: Generation, head: dict, include_usage: bool, body: AsyncIterator[str]) -> AsyncIterator[str]:
    """What both streams share: the body's chunks, the usage chunk if asked, an error
    as an event, and the closing [DONE]."""
    try:
        async for chunk in body:
            yield chunk
        if include_usage:
            yield sse(dict(head, choices=[], usage=gen.usage()))
    except APIError as e:
        yield _error_event(e)
    except Exception as e:  # noqa: BLE001 - a bug must still end the stream as the protocol says
        log.exception("request %d failed", gen.request.req_id)
        yield _error_event(internal_error(e))
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


def _completion_stream(gen: Generation, head: dict, include_usage: bool) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}

    def chunk(text: str, logprobs: Optional[dict], finish: Optional[str]) -> str:
        return sse(dict(head, choices=[{"index": 0, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish}], **extra))

    async def body() -> AsyncIterator[str]:
        async for deltas, infos in gen.events():
            text = "".join(d.text for d in deltas if d.channel == CONTENT)
            if text or infos:
                yield chunk(text, _completion_logprobs(infos, gen.state.tokenizer), None)
        yield chunk("", None, gen.finish_reason)

    return _sse_frame(gen, head, include_usage, body())


def _chat_stream(gen: Generation, head: dict, include_usage: bool) -> AsyncIterator[str]:
    head = dict(head, object="chat.completion.chunk")
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, logprobs: Optional[dict] = None, finish: Optional[str] = None) -> str:
        return sse(dict(head, choices=[{"index": 0, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": finish}], **extra))

    async def body() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        async for deltas, infos in gen.events():
            delta: dict = {}
            reasoning = "".join(d.text for d in deltas if d.channel == REASONING)
            content = "".join(d.text for d in deltas if d.channel == CONTENT)
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            if delta or infos:
                yield chunk(delta, _chat_logprobs(infos, gen.state.tokenizer))
        for k, call in enumerate(gen.tool_calls):  # known only once the block has closed well-formed
            for delta in call.stream_deltas(k):
                yield chunk({"tool_calls": [delta]})
        yield chunk({}, None, gen.finish_reason)

    return _sse_frame(gen, head, include_usage, body())
