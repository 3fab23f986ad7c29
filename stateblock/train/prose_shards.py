"""The prose base's data for a GPU stage (`prose_stage.py`): each split of the corpus tokenised
(every document `<bos> ... <eos>`, as `prose_data.encode_documents` does) into a uint16 array,
the tokenizer beside them, and the counts that turn a held-out loss into bits per byte and
per word.

    python -m stateblock.train.prose_shards --corpus data/prose --tokenizer DIR --out .gpu_prose

OUT/train.npy and OUT/heldout.npy (numpy uint16, the id streams), OUT/tokenizer/ (the
`from_pretrained` files) and OUT/meta.json (per split: documents, tokens, UTF-8 bytes and
whitespace words of the text; the tokenizer's vocabulary, special ids and sha256).

A corpus whose train ids and text do not fit one device call together travels without
OUT/train.npy (bench/prose_prepare.sh); on the machine `--splits train --tokenizer
OUT/tokenizer` makes it again from the text, and fails unless the tokenizer is the one
meta.json names and the ids are as many as it counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from stateblock.train import prose_data
from stateblock.train.corpus import read_documents

SPLITS = ("train", "heldout")


def write_shards(corpus: Path, tokenizer: Path, out: Path, splits=SPLITS) -> dict:
    """Tokenise `corpus`'s `splits` with `tokenizer` into `out`; returns meta.json's dict.
    Given fewer than every split, meta.json is there already and must agree (module doc)."""
    from transformers import AutoTokenizer

    if Path(tokenizer).resolve() != (out / "tokenizer").resolve():
        prose_data.copy_tokenizer(tokenizer, out / "tokenizer")
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"), local_files_only=True)
    if len(tok) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"{tokenizer}: {len(tok)} tokens do not fit uint16 ids")
    tok_bytes = (out / "tokenizer" / "tokenizer.json").read_bytes()
    meta = {
        "vocab_size": len(tok),
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "tokenizer_sha256": hashlib.sha256(tok_bytes).hexdigest(),
        "splits": {},
    }
    before = read_meta(out) if tuple(splits) != SPLITS else None
    if before is not None and before["tokenizer_sha256"] != meta["tokenizer_sha256"]:
        raise ValueError(f"{out}: the tokenizer is not the one meta.json counted with")
    for split in splits:
        ids, counts = _encode_split(tok, corpus / f"{split}.txt")
        counted = before["splits"].get(split) if before else None
        if counted is not None and counted != counts:
            raise ValueError(f"{split}: {counts} against meta.json's {counted}")
        np.save(out / f"{split}.npy", ids)
        meta["splits"][split] = counts
    if before is not None:
        meta["splits"] = {**before["splits"], **meta["splits"]}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _encode_split(tok, text: Path) -> tuple[np.ndarray, dict]:
    """A split's ids (uint16) and its counts."""
    docs = read_documents(text)
    if not docs:
        raise ValueError(f"{text}: no documents")
    ids = prose_data.encode_documents(tok, docs).numpy().astype(np.uint16)
    return ids, {
        "documents": len(docs),
        "tokens": int(ids.size),
        "bytes": sum(len(d.encode()) for d in docs),
        "words": sum(len(d.split()) for d in docs),
    }


def load_split(data: Path, split: str) -> torch.Tensor:
    """A split's id stream as int32 (what indexing and the embedding take)."""
    return torch.from_numpy(np.load(data / f"{split}.npy").astype(np.int32))


def read_meta(data: Path) -> dict:
    path = data / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{data}: no meta.json (python -m "
                                "stateblock.train.prose_shards writes it)")  # fmt: skip
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stateblock.train.prose_shards",
                                 description=__doc__.splitlines()[0])  # fmt: skip
    ap.add_argument("--corpus", required=True, help="train.txt and heldout.txt (corpus build)")
    ap.add_argument("--tokenizer", required=True, help="the prose tokenizer's directory")
    ap.add_argument("--out", required=True, help="the folder a device call carries")
    ap.add_argument("--splits", default=",".join(SPLITS),
                    help="the splits to tokenise (fewer than all: meta.json must agree)")  # fmt: skip
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = tuple(x for x in SPLITS if x in a.splits.split(","))
    meta = write_shards(Path(a.corpus), Path(a.tokenizer), out, splits)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    meta["folder_mb"] = round(size / 1e6, 2)
    json.dump(meta, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
