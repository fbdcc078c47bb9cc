"""OpenAI-compatible request bodies (pydantic) and error bodies.

Unknown extra fields are accepted and ignored (clients send e.g. ``user``); known
fields are validated, and features this server does not offer (``n > 1``,
``logprobs``, ``echo``, penalties, ``logit_bias``, ``best_of > 1``, ``suffix``, tool
calling, ``response_format`` other than text) are refused with a 400 naming the field
instead of being silently ignored.
Extension: ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids`` to
the choice (non-streamed) or ``token_ids`` to each streamed chunk's choice.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

MAX_STOP = 16
MAX_STOP_LEN = 256

# Features this server does not offer: field -> (accepted values, error message).
# Anything else is refused with a 400 naming the field (never silently ignored).
_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "n": ((1,), "only n=1 is supported"),
    "logprobs": ((None, False, 0), "logprobs are not supported"),
    "presence_penalty": ((0.0,), "penalties are not supported (only 0)"),
    "frequency_penalty": ((0.0,), "penalties are not supported (only 0)"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "echo": ((False,), "echo is not supported"),
    "suffix": ((None, ""), "suffix is not supported"),
    # chat: tool calling and structured output (refused rather than silently ignored)
    "tools": ((None, []), "tools are not supported (tool schemas are not rendered into the prompt)"),
    "tool_choice": ((None, "none", "auto"), "tool_choice is not supported (no tools)"),
    "functions": ((None, []), "functions are not supported"),
    "function_call": ((None, "none", "auto"), "function_call is not supported"),
    "response_format": ((None, {"type": "text"}), "only response_format {\"type\": \"text\"} is supported"),
}


def _check_supported(value, field: str):
    """Return ``value`` if ``field`` accepts it (table ``_UNSUPPORTED``).

    ``logprobs`` and ``logit_bias`` come back as None (their accepted values all mean
    "off"). Raises ValueError with the field's message otherwise (a 400 naming the field).
    """
    allowed, message = _UNSUPPORTED[field]
    if value not in allowed:
        raise ValueError(message)
    return None if field in ("logprobs", "logit_bias") else value


class APIError(Exception):
    """An HTTP error with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    return_token_ids: bool = False  # extension (as in vLLM): token ids in each choice

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are supported")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop sequences are limited to {MAX_STOP_LEN} characters")
        if any(s == "" for s in stops):  # as `dspine generate --stop ''`: refused, never dropped silently
            raise ValueError("an empty stop sequence would match before any text; leave it out")
        return stops

    @field_validator("n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "best_of")
    @classmethod
    def _unsupported(cls, v, info):
        return _check_supported(v, info.field_name)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    # token ids are JSON integers: true or 1.0 is refused, not read as 1 (strict)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """One message for every malformed prompt (pydantic's union errors name the wrong type)."""
        def ids(x) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or ids(v):
            return v
        if isinstance(v, list) and all(isinstance(x, str) for x in v) or (
                isinstance(v, list) and all(ids(x) for x in v)):
            return v
        raise ValueError("prompt must be a string, a list of token ids (JSON integers), or a list holding one "
                         "of those")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported (n=1, no prompt batches)")
            v = v[0]
        return v

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported_completion(cls, v, info):
        return _check_supported(v, info.field_name)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    @field_validator("tools", "tool_choice", "functions", "function_call", "response_format")
    @classmethod
    def _unsupported_chat(cls, v, info):
        return _check_supported(v, info.field_name)

    @model_validator(mode="after")
    def _max(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def field_of(loc: tuple) -> str:
    """Dotted field name of a pydantic error location, without 'body' and type tags."""
    parts = [str(p) for p in loc if p not in ("body",)]
    # drop union-branch tags such as 'str', 'list[int]', 'function-after[...]'
    keep = [p for p in parts if not (("[" in p and "]" in p) or p in ("str", "int", "float", "bool"))]
    return ".".join(keep) or "body"
