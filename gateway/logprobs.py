"""Log-probabilities in the OpenAI shapes: the legacy completions object (tokens,
token_logprobs, top_logprobs, text_offset) and chat's `content` list. The values come
from the commit (exact: the readout's vocabulary pass folds a log-sum-exp), the token
strings from the tokenizer, one token at a time, as vLLM writes them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway import protocol as p
from gateway.generation import TokenLogprob

TokenText = Callable[[int], str]


def completion_logprobs(
    lps: Sequence[TokenLogprob], token_text: TokenText, offset: int = 0
) -> p.CompletionLogprobs:
    """`offset`: where the first token's text starts in the choice's text (an echo's length,
    or the text already streamed)."""
    tokens = [token_text(t.token_id) for t in lps]
    starts = []
    for text in tokens:
        starts.append(offset)
        offset += len(text)
    return p.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[t.logprob for t in lps],
        top_logprobs=[{token_text(i): lp for i, lp in t.top} for t in lps],
        text_offset=starts,
    )


def chat_logprobs(lps: Sequence[TokenLogprob], token_text: TokenText) -> p.ChatLogprobs:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return p.ChatLogprobs(
        content=[
            p.ChatTokenLogprob(
                **entry(t.token_id, t.logprob),
                top_logprobs=[p.TopLogprob(**entry(i, lp)) for i, lp in t.top],
            )
            for t in lps
        ]
    )
