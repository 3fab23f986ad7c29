"""Answer ids to text (and /tokenize's text to ids) in the gateway, with the `tokenizers`
library alone (no transformers, no torch): every Hugging Face fast tokenizer directory has
the tokenizer.json it reads."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

# transformers' clean_up_tokenization: spaces a word-piece tokenizer left before punctuation
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class Detokenizer:
    """`decode(ids, skip_special_tokens=True)` and `encode(text)` as transformers' fast
    tokenizer does them."""

    def __init__(self, tokenizer: Tokenizer, *, clean_up_spaces: bool = False) -> None:
        self._tok = tokenizer
        self._clean = clean_up_spaces

    @classmethod
    def load(cls, base_dir: str | Path) -> Detokenizer:
        d = Path(base_dir)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {d} (STATEBLOCK_BASE_DIR)")
        config_path = d / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        clean = bool(config.get("clean_up_tokenization_spaces", False))
        return cls(Tokenizer.from_file(str(d / "tokenizer.json")), clean_up_spaces=clean)

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included (as a transformers tokenizer's len)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean:
            for a, b in _CLEANUPS:
                text = text.replace(a, b)
        return text
