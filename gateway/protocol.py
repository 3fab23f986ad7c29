"""OpenAI-compatible wire types (pydantic), in the OpenAI reference's field order.

Types are strict: a string where a number belongs is a 400, not a silent coercion. Fields
this server does not implement are accepted and logged as ignored (`ignored_fields`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# int or float, never a string (pydantic's strict float still takes ints)
Number = Annotated[float, Field(strict=True)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """Extra fields, and known OpenAI fields set to something this server cannot honour."""
        ignored = sorted((self.model_extra or {}).keys())
        return ignored + [
            name for name in self._unsupported() if getattr(self, name, None) is not None
        ]

    def _unsupported(self) -> tuple[str, ...]:
        return ()


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class CompletionRequest(_Request):
    model: StrictStr
    prompt: StrictStr | list[StrictStr]
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: StrictInt | None = None
    max_tokens: StrictInt | None = None
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    suffix: StrictStr | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: read all max_tokens positions

    def _unsupported(self) -> tuple[str, ...]:
        return ("best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                "presence_penalty", "stop", "suffix", "top_p")  # fmt: skip


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    model: StrictStr
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: StrictBool | None = None
    max_completion_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None  # deprecated by OpenAI, still sent by many clients
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: read all max_tokens positions

    def _unsupported(self) -> tuple[str, ...]:
        return ("frequency_penalty", "logit_bias", "logprobs", "presence_penalty", "stop", "top_p")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "stateblock"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
