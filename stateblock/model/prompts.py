"""Prompt encoding for any Hugging Face tokenizer, on the capture's hot path."""

from __future__ import annotations


class PromptEncoder:
    """`tok(prompt)["input_ids"]`, straight from the Rust backend when that is the same call.

    For a plain fast tokenizer, `tok(prompt)` sets the backend to no truncation, no padding
    and the tokenizer's `split_special_tokens`, then runs `encode_batch([prompt])`, which
    also computes character offsets the capture never reads. `encode_batch_fast` is that
    call without the offsets: the same ids (special tokens included), in about half the
    time (docs/BENCHMARKS.md). A tokenizer class that overrides the encoding,
    or a backend left in another state, goes through `tok(prompt)` as before.
    """

    def __init__(self, tok) -> None:
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

        self._tok = tok
        plain = (
            isinstance(tok, PreTrainedTokenizerFast)
            and type(tok).__call__ is PreTrainedTokenizerBase.__call__
            and type(tok)._encode_plus is PreTrainedTokenizerFast._encode_plus
        )
        backend = getattr(tok, "backend_tokenizer", None) if plain else None
        self._backend = backend if hasattr(backend, "encode_batch_fast") else None

    @property
    def direct(self) -> bool:
        """Whether prompts skip the transformers call (as long as the backend stays plain)."""
        return self._backend is not None and self._backend_is_plain()

    def _backend_is_plain(self) -> bool:
        b = self._backend
        return (
            b.truncation is None
            and b.padding is None
            and b.encode_special_tokens == self._tok.split_special_tokens
        )

    def __call__(self, prompt: str) -> list[int]:
        if self._backend is None or not self._backend_is_plain():
            return list(self._tok(prompt)["input_ids"])
        return self._backend.encode_batch_fast([prompt])[0].ids
