"""The OpenAI-compatible HTTP API: request and response models, error bodies.

Requests are validated strictly (a string is never read as a number; unknown fields are refused
with an error naming them, as OpenAI does), except chat messages, whose extra fields go to the
chat template untouched. Responses follow OpenAI's shapes so the official SDKs parse them.
Tools and tool calls: ``rollout.gateway.tools``.
"""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker.messages import MAX_SAFE_INT, ToolCall

MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# -- requests -------------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """A chat message as clients send it; fields beyond these are kept for the template."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined, no null fields."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        else:
            out["content"] = self.content
        return out


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for function names."""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """A JSON Schema of an object, as OpenAI takes: checked as far as the template and the
        model read it (its type, properties and required names)."""
        if value is None:
            return value
        if value.get("type", "object") != "object":
            raise ValueError(f"a parameters schema must be of type 'object', not {value['type']!r}")
        properties = value.get("properties", {})
        if not isinstance(properties, dict) or not all(
            isinstance(p, dict) for p in properties.values()
        ):
            raise ValueError("'properties' must map each parameter name to a JSON Schema object")
        required = value.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("'required' must be a list of parameter names")
        return value


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=128)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=MAX_SAFE_INT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _only_sampled_logprob(cls, value: int | None) -> int | None:
        if value:
            raise ValueError(
                "top_logprobs > 0 is not supported: only the sampled token's logprob is returned"
            )
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _token_ids(cls, value: str | list[int]) -> str | list[int]:
        if isinstance(value, list) and any(not 0 <= t < 2**31 for t in value):
            raise ValueError("token ids must be in [0, 2^31)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _only_sampled_logprob(cls, value: int | None) -> int | None:
        if value:
            raise ValueError(
                "logprobs > 0 is not supported: only the sampled token's logprob is returned "
                "(use logprobs=0)"
            )
        return value


# -- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


FinishReasonOut = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonOut


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(ToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonOut | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonOut | None = None


class Completion(BaseModel):
    """A text completion, or (``usage`` None until the last) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "seamlessflow"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def to_json(model: BaseModel) -> str:
    """A response body: null fields left out, as the OpenAI SDKs read them as absent."""
    return model.model_dump_json(exclude_none=True)
