"""The prose base's tokenizer: byte-level BPE (Hugging Face `tokenizers`) trained on the
corpus's train split, saved in the `from_pretrained` layout of the reference tokenizer
(`tokenizer.py`): the same special tokens at the same ids, `<bos>` before and `<ans>` after
an encoded prompt, the same chat template, so `stateblock.model.loading` loads it unchanged.

    python -m stateblock.train.prose_tokenizer --corpus data/prose --out runs/prose/base

Byte-level: every string encodes (no unknown token is ever produced) and decodes back to
itself exactly. `<eos>` ends every document in the base's training text, so the base learns
to emit it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from stateblock.train.corpus import read_documents
from stateblock.train.tokenizer import ANS, BOS, SPECIALS, save_tokenizer

VOCAB_SIZE = 16_384


def train_bpe(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens, the five specials first (ids 0-4)."""
    if not len(SPECIALS) + 256 < vocab_size:
        raise ValueError(f"vocab_size must exceed {len(SPECIALS) + 256} (specials + bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {ANS}", special_tokens=[(BOS, ids[BOS]), (ANS, ids[ANS])]
    )
    return tok


def save_bpe(tok: Tokenizer, out_dir: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) in `out_dir`."""
    save_tokenizer(out_dir, tok)


def measure(tok: Tokenizer, texts: list[str]) -> dict:
    """Tokens per whitespace word, bytes and characters per token, over `texts` encoded
    without specials; `roundtrip`: how many decode back to themselves exactly."""
    enc = tok.encode_batch(texts, add_special_tokens=False)
    tokens = sum(len(e.ids) for e in enc)
    words = sum(len(t.split()) for t in texts)
    nbytes = sum(len(t.encode()) for t in texts)
    back = tok.decode_batch([e.ids for e in enc], skip_special_tokens=False)
    return {
        "documents": len(texts),
        "tokens": tokens,
        "tokens_per_word": round(tokens / max(1, words), 4),
        "bytes_per_token": round(nbytes / max(1, tokens), 4),
        "chars_per_token": round(sum(map(len, texts)) / max(1, tokens), 4),
        "roundtrip": sum(b == t for b, t in zip(back, texts, strict=True)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stateblock.train.prose_tokenizer",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--corpus", default="data/prose", help="the corpus directory (corpus.py)")
    ap.add_argument("--out", required=True, help="the base directory the tokenizer goes into")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="tokens, specials included")
    a = ap.parse_args(argv)
    corpus, out = Path(a.corpus), Path(a.out)
    tok = train_bpe(read_documents(corpus / "train.txt"), a.vocab_size)
    save_bpe(tok, out)
    stats = {"vocab_size": tok.get_vocab_size(), "corpus": str(corpus),
             "heldout": measure(tok, read_documents(corpus / "heldout.txt"))}  # fmt: skip
    (out / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
