"""A request's answer as the gateway's logic returns it and both APIs render it: the
choices, their log-probabilities and usage (`Generation`), and a stream's pieces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One returned token's exact log-probability and the top candidates' (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class ChoiceResult:
    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" (EOS or a stop) or "length" (max_tokens)
    eos_pos: int
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # when asked for (SamplingParams.logprobs): one per returned token
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Generation:
    request_id: str
    model: str
    created: int
    choices: tuple[ChoiceResult, ...]
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Piece:
    """One stream chunk of one choice; the last of each choice carries finish_reason."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    first: int = 0  # the offset of token_ids in the choice's: where its logprobs start
