"""Stop strings and stop token ids, applied to a whole answer block as vLLM applies them
token by token: the answer ends at the first match, `finish_reason` "stop", `stop_reason`
naming it. The readout reads every position at once, so the cut is made here, before any
text is decoded for a client or streamed: nothing past a stop ever leaves the gateway."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM more


@dataclass(frozen=True)
class StopSpec:
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's extension

    def __bool__(self) -> bool:
        return bool(self.strings or self.token_ids)


@dataclass(frozen=True)
class Cut:
    token_ids: tuple[int, ...]
    text: str
    stop_reason: str | int | None  # the matched string or token id; None: no stop matched


def apply_stops(ids: Sequence[int], decode: Callable[[Sequence[int]], str], spec: StopSpec) -> Cut:
    """The answer up to the first stop token id, then up to the first stop string in its
    text. The token ids kept for a string stop are the shortest prefix whose text holds the
    match (the token that completed it included), as a token-by-token server would have
    generated them."""
    ids = tuple(ids)
    reason: str | int | None = None
    stop_ids = set(spec.token_ids)
    for i, token in enumerate(ids):
        if token in stop_ids:
            ids, reason = ids[:i], token
            break
    text = decode(ids)
    found = [(text.find(s), s) for s in spec.strings if s and s in text]
    if not found:
        return Cut(ids, text, reason)
    pos, match = min(found)  # the earliest match; the first listed on a tie
    end = pos + len(match)
    # the shortest prefix of ids whose text already holds the whole match: decoding a
    # longer prefix only appends, so the predicate is monotone and a bisection finds it
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= end and match in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    kept = text[: end if spec.include_stop_str_in_output else pos]
    return Cut(ids[:lo], kept, match)
