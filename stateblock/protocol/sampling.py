"""The sampling contract, one type end to end: the proto's `SamplingParams`.

The gateway builds it from the HTTP or gRPC request, the capture copies it per lane into
the signed block header, the readout engines read it from there. It is checked in one
place (`check_lane`) against one set of limits (`Limits`, read once per service from the
same STATEBLOCK_* variables, declared in `stateblock.settings`). The answer depth
(`max_tokens`) is not a sampling parameter: it travels as the lane's `max_tokens` in the
capture request and as the layout's `answer_depth` in the block, once each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stateblock.v1 import block_pb2 as pb

NO_EOS = 1 << 20  # EOS position reported when no position emitted EOS
TOP_K_SAMPLE = 8  # the decoder's Gumbel top-k width: sampling draws among the top 8
MAX_TEMPERATURE = 2.0  # the OpenAI range
SEED_LIMIT = 1 << 64
MAX_CHARS_PER_TOKEN = 16
MAX_LOGPROBS = 2  # top candidates with log-probabilities: the top-2 pass keeps two
K_MAX = 8  # lanes per request (prompts x n) and per cohort: one packed forward, one enqueue

SamplingParams = pb.SamplingParams


class InvalidSampling(ValueError):
    """A request the readout cannot serve as asked; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        self.param = param
        super().__init__(message)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; every service reads the same variables."""

    max_lanes: int = K_MAX  # prompts x n per request, lanes per cohort
    prompt_len_max: int = 4096  # tokens per prompt
    answer_depth_max: int = 8192  # the answer envelope: max_tokens per lane

    @property
    def prompt_chars_max(self) -> int:
        """A bound on a prompt's characters checked before tokenising: no tokenizer in use
        packs more than MAX_CHARS_PER_TOKEN characters a token, so a longer text is over
        prompt_len_max whatever it tokenises to, and is refused without the cost."""
        return self.prompt_len_max * MAX_CHARS_PER_TOKEN


def sampling_params(
    temperature: float | None = None,
    seed: int | None = None,
    *,
    ignore_eos: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    min_tokens: int | None = None,
    logprobs: int | None = None,
) -> pb.SamplingParams:
    """The params from an API's fields (None: unset); what the wire cannot carry is
    refused here, everything else by `check_lane`. top_k -1 and 0 both mean "all", as in
    vLLM."""
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise InvalidSampling("seed must be a non-negative 64-bit integer.", "seed")
    if top_k is not None and not -1 <= top_k <= TOP_K_SAMPLE:
        raise InvalidSampling(
            f"top_k must be -1 or 0 (all) or at most the readout's {TOP_K_SAMPLE} sampling "
            f"candidates, got {top_k}.",
            "top_k",
        )
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidSampling(
            f"logprobs must be between 0 and {MAX_LOGPROBS}: the readout's vocabulary pass "
            f"keeps the top {MAX_LOGPROBS} candidates of each position, got {logprobs}.",
            "logprobs",
        )
    if min_tokens is not None and not 0 <= min_tokens < 1 << 32:
        raise InvalidSampling(f"min_tokens must be >= 0, got {min_tokens}.", "min_tokens")
    t = 0.0 if temperature is None else temperature
    return pb.SamplingParams(
        temperature=t,
        seed=seed,
        ignore_eos=ignore_eos,
        top_k=max(0, top_k or 0),
        top_p=top_p,
        min_p=min_p or 0.0,
        min_tokens=min_tokens or 0,
        logprobs=logprobs,
    )


def seed_of(s: pb.SamplingParams) -> int | None:
    return s.seed if s.HasField("seed") else None


def with_seed_offset(s: pb.SamplingParams, offset: int) -> pb.SamplingParams:
    """The params of the offset-th copy of a lane (n > 1): a seeded request stays
    reproducible while its copies differ."""
    out = pb.SamplingParams()
    out.CopyFrom(s)
    if s.HasField("seed"):
        out.seed = (s.seed + offset) % SEED_LIMIT
    return out


def check_prompt_text(text: str, limits: Limits, param: str) -> None:
    """Raise InvalidSampling for a text no prompt may be: one that cannot be UTF-8 (a lone
    surrogate from a JSON escape), or longer than any prompt_len_max-token prompt."""
    if len(text) > limits.prompt_chars_max:
        raise InvalidSampling(
            f"the prompt is {len(text)} characters, over the {limits.prompt_chars_max} that "
            f"can fit in the prompt_len maximum of {limits.prompt_len_max} tokens.",
            param,
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidSampling(
            f"the prompt is not valid Unicode (position {e.start}: a lone surrogate).", param
        ) from e


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    """Raise InvalidSampling unless every id names a token of a `vocab_size` vocabulary: a
    tokenizer takes ids as C integers and a tensor indexes rows by them, so no id outside
    [0, vocab_size) may reach either (a JSON integer has no bound at all)."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise InvalidSampling(
            f"token id {bad} is outside the vocabulary of {vocab_size} (ids 0 to "
            f"{vocab_size - 1}).",
            param,
        )


def check_lane_count(n_lanes: int, limits: Limits) -> None:
    if not 1 <= n_lanes <= limits.max_lanes:
        raise InvalidSampling(
            f"{n_lanes} answers per request; between 1 and {limits.max_lanes} allowed.", "n"
        )


def check_lane(s: pb.SamplingParams, max_tokens: int, limits: Limits) -> None:
    """Raise InvalidSampling unless one lane's depth and sampling can be served."""
    if not 1 <= max_tokens <= limits.answer_depth_max:
        raise InvalidSampling(
            f"max_tokens must be between 1 and the answer envelope of "
            f"{limits.answer_depth_max}, got {max_tokens}.",
            "max_tokens",
        )
    if not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= MAX_TEMPERATURE):
        raise InvalidSampling(
            f"temperature must be between 0 and {MAX_TEMPERATURE}, got {s.temperature}.",
            "temperature",
        )
    if s.top_k > TOP_K_SAMPLE:
        raise InvalidSampling(
            f"top_k must be at most the readout's {TOP_K_SAMPLE} sampling candidates, "
            f"got {s.top_k}.",
            "top_k",
        )
    if s.HasField("top_p") and not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
        raise InvalidSampling(f"top_p must be in (0, 1], got {s.top_p}.", "top_p")
    if not (math.isfinite(s.min_p) and 0.0 <= s.min_p <= 1.0):
        raise InvalidSampling(f"min_p must be in [0, 1], got {s.min_p}.", "min_p")
    if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
        raise InvalidSampling(
            f"logprobs must be at most {MAX_LOGPROBS}, got {s.logprobs}.", "logprobs"
        )
    if s.min_tokens > max_tokens:
        raise InvalidSampling(
            f"min_tokens ({s.min_tokens}) must not exceed max_tokens ({max_tokens}).",
            "min_tokens",
        )
