"""OpenAI-compatible wire types (pydantic): the OpenAI fields both APIs take and vLLM's
extensions (`_Request`, in the OpenAI reference's order), then each API's own.

Types are strict: a string where a number belongs is a 400, not a silent coercion. A known
field the readout cannot honour with a non-default value is refused (`refusals`: a 400
naming it and why); unknown extra fields are accepted and logged at WARNING, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# int or float, never a string (pydantic's strict float still takes ints)
Number = Annotated[float, Field(strict=True)]


_PENALTY = (
    "a one-pass readout reads every position at once: there are no earlier tokens to penalise"
)
# field -> (is it at its default, why a one-pass readout refuses any other value)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (lambda v: v in (None, 0), _PENALTY),
    "presence_penalty": (lambda v: v in (None, 0), _PENALTY),
    "repetition_penalty": (lambda v: v in (None, 1), _PENALTY),
    "logit_bias": (
        lambda v: not v,
        "the vocabulary pass keeps the top candidates, not biased logits",
    ),
    "suffix": (
        lambda v: v is None,
        "a readout reads forward from the prompt: nothing can follow a suffix",
    ),
    "response_format": (
        lambda v: v is None or (isinstance(v, dict) and v.get("type") in (None, "text")),
        "a one-pass readout has no constrained decoding",
    ),
    "tools": (lambda v: not v, "this server has no tool-call parser"),
    "tool_choice": (lambda v: v in (None, "none"), "this server has no tool-call parser"),
}
ROLES = ("system", "developer", "user", "assistant")


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    # the OpenAI fields of both APIs
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    # chat: deprecated by OpenAI for max_completion_tokens, still sent by many clients
    max_tokens: StrictInt | None = None
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    response_format: dict[str, Any] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    user: StrictStr | None = None

    # vLLM's extensions, in both APIs
    ignore_eos: StrictBool = False  # read all max_tokens positions
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    top_k: StrictInt | None = None
    min_p: Number | None = None
    min_tokens: StrictInt | None = None
    repetition_penalty: Number | None = None

    def unknown_fields(self) -> list[str]:
        """Fields this server does not know (accepted, and logged)."""
        return sorted((self.model_extra or {}).keys())

    def refusals(self) -> list[tuple[str, str]]:
        """(field, why) for each known field set to a value a block readout cannot honour."""
        out = []
        for name, (is_default, why) in REFUSED.items():
            if name in type(self).model_fields and not is_default(getattr(self, name)):
                out.append((name, why))
        if getattr(self, "best_of", None) not in (None, self.n or 1):
            out.append(("best_of", "best_of must equal n: choices carry no score to rank them"))
        return out

    def logprob_count(self) -> int | None:
        """How many top candidates' log-probabilities (None: no log-probabilities)."""
        return None

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling filters both APIs share, as `sampling_params` takes them."""
        return {
            "logprobs": self.logprob_count(),
            "ignore_eos": self.ignore_eos,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
        }

    def stop_spec(self) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
        stop = self.stop
        strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        return strings, tuple(self.stop_token_ids or ()), bool(self.include_stop_str_in_output)


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
    # text, texts, or (as vLLM takes them) one prompt's token ids or several prompts'
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None

    def logprob_count(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    model: StrictStr
    logprobs: StrictBool | None = None
    max_completion_tokens: StrictInt | None = None
    tool_choice: Any = None
    tools: list[Any] | None = None
    top_logprobs: StrictInt | None = None

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):  # the legacy completions shape
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that matched


class _Generated(BaseModel):
    """The fields every response and stream chunk of both APIs has, in OpenAI's order; each
    kind narrows `object` and `choices` (and chat's whole response, `usage`)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list
    usage: Usage | None = None


class CompletionResponse(_Generated):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    stop_reason: str | int | None = None


class ChatCompletionResponse(_Generated):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Generated):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "stateblock"
    root: str | None = None
    max_model_len: int | None = None  # prompt + answer tokens, as vLLM reports it
    # stateblock's: the answer envelope (max_tokens per choice) and choices per request
    max_answer_tokens: int | None = None
    max_choices: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):  # vLLM's /tokenize, prompt form
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
