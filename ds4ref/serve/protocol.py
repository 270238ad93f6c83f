"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Types are strict (a JSON string is never coerced to a number, a float never to
an int) and NaN/Infinity are refused, so every malformed field is reported as a
400 naming that field. Every field of OpenAI's API is declared: those ds4ref
cannot honour are refused with a 400 naming them (never silently ignored);
fields no API defines are ignored, as most OpenAI-compatible servers do. Checks that need the model (token ids in range, context length)
happen in app.py once the prompt is tokenised.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationInfo, field_validator

MAX_STOP = 16          # OpenAI allows 4 stop strings; DeepSeek's API 16
MAX_STOP_CHARS = 4096  # all stop strings together; matching is linear, this bounds its memory
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_TOP_LOGPROBS = 20  # what the OpenAI API allows
U64 = (1 << 64) - 1

TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 31) - 1)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Optional[StrictStr] = None
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=1 << 30)]] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1, le=1 << 30)] = 0   # 0 or -1 = off
    min_p: Probability = 0.0
    seed: Optional[Annotated[StrictInt, Field(ge=-(1 << 63), le=U64)]] = None
    stop: Optional[Union[StrictStr, list[Union[StrictStr, TokenId]]]] = None
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=MAX_STOP)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    logit_bias: Optional[dict[StrictStr, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]] = None
    skip_special_tokens: StrictBool = True

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_ids(cls, bias: Optional[dict]) -> Optional[dict]:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids written as decimal strings, got {key!r}")
        return bias

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: Any) -> Any:
        items = [stop] if isinstance(stop, str) else (stop or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(isinstance(s, str) and s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        total = sum(len(s) for s in items if isinstance(s, str))
        if total > MAX_STOP_CHARS:
            raise ValueError(f"stop strings total {total} characters; at most {MAX_STOP_CHARS} are allowed")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, opts: Optional[StreamOptions], info: ValidationInfo) -> Any:
        # fields validate in declaration order, so `stream` is already in info.data
        if opts is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return opts

    def stop_strings(self) -> list[str]:
        items = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in items if isinstance(s, str)]

    def stop_ids(self) -> list[int]:
        items = [] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in items if isinstance(s, int)] + list(self.stop_token_ids or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is text or a list of token ids (a batch of one is accepted)."""
    prompt: Union[StrictStr, list[TokenId], list[StrictStr], list[list[TokenId]]]
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None
    parse_special: StrictBool = True  # false: added-token strings in a text prompt are text (untrusted text)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported (n=1)")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, best_of: Optional[int]) -> Optional[int]:
        if best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: Optional[str]) -> Optional[str]:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix


class TextPart(_Strict):
    type: StrictStr
    text: Optional[StrictStr] = None
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[StrictStr, list[TextPart]]] = None
    name: Optional[StrictStr] = None
    reasoning_content: Optional[StrictStr] = None
    reasoning: Optional[StrictStr] = None
    tool_calls: Optional[list[Any]] = None
    tool_call_id: Optional[StrictStr] = None
    prefix: StrictBool = False


class ThinkingOption(_Strict):
    type: Literal["enabled", "disabled"]


class FunctionDef(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: StrictStr


class NamedTool(_Strict):
    """tool_choice naming the function the answer must call."""
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: StrictStr = "response"
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[StrictStr] = None
    strict: Optional[StrictBool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


# OpenAI fields ds4ref cannot honour; present with another value than these, they are refused.
UNSUPPORTED_CHAT_FIELDS = {
    "audio": (None,), "prediction": (None,), "web_search_options": (None,), "functions": (None,),
    "function_call": (None,), "modalities": (None, ["text"]), "store": (None, False),
    "verbosity": (None,), "service_tier": (None, "auto", "default"),
}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=1 << 30)]] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "max"]] = None
    thinking: Optional[ThinkingOption] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedTool]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    response_format: Optional[ResponseFormat] = None
    # accepted, no effect on generation: they label or route requests elsewhere
    metadata: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[StrictStr] = None
    safety_identifier: Optional[StrictStr] = None
    # known OpenAI fields that are refused unless absent (UNSUPPORTED_CHAT_FIELDS)
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    modalities: Optional[Any] = None
    store: Optional[Any] = None
    verbosity: Optional[Any] = None
    service_tier: Optional[Any] = None

    @field_validator(*UNSUPPORTED_CHAT_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = UNSUPPORTED_CHAT_FIELDS[info.field_name]
        if value not in allowed:
            extra = f" (only {', '.join(repr(a) for a in allowed if a is not None)})" if len(allowed) > 1 else ""
            raise ValueError(f"{info.field_name} is not supported by this server{extra}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any, info: ValidationInfo) -> Any:
        # fields validate in declaration order: `tools` is in info.data when it was valid
        tools = info.data.get("tools") or []
        if (choice == "required" or isinstance(choice, NamedTool)) and not tools:
            raise ValueError("tool_choice 'required' or a named function needs tools to call")
        if isinstance(choice, NamedTool) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among "
                             f"the tools")
        return choice

    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedTool)

    @field_validator("response_format")
    @classmethod
    def _schema_given(cls, fmt: Optional[ResponseFormat]) -> Optional[ResponseFormat]:
        if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or
                                                              fmt.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return fmt

    @field_validator("chat_template_kwargs")
    @classmethod
    def _thinking_is_bool(cls, kw: Optional[dict]) -> Optional[dict]:
        for key in ("thinking", "enable_thinking"):
            if kw and key in kw and not isinstance(kw[key], bool):
                raise ValueError(f"chat_template_kwargs.{key} must be a boolean")
        return kw

    def tools_for_prompt(self) -> Optional[list[dict]]:
        """Tool definitions to render, none when tool_choice is "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: Optional[int], info: ValidationInfo) -> Optional[int]:
        if top is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs: true")
        return top

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(ChatCompletionRequest):
    """POST /tokenize: a text `prompt` (vLLM's and llama.cpp's fields) or a chat (the chat fields,
    rendered as /v1/chat/completions renders them); app.py checks that exactly one is given."""
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    prompt: Optional[StrictStr] = None
    parse_special: Optional[StrictBool] = None       # prompt only; default true
    add_special_tokens: Optional[StrictBool] = None  # prompt only: BOS first; default true


class DetokenizeRequest(_Strict):
    """POST /detokenize."""
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]
