"""The prose base's data for a GPU stage (`prose_stage.py`): each split of the corpus tokenised
once on the CPU (every document `<bos> ... <eos>`, as `prose_data.encode_documents` does) into
a uint16 array, the tokenizer beside them, and the counts that turn a held-out loss into bits
per byte and per word. A device call carries the folder; nothing is tokenised there.

    python -m stateblock.train.prose_shards --corpus data/prose --tokenizer DIR --out .gpu_prose

OUT/train.npy and OUT/heldout.npy (numpy uint16, the id streams), OUT/tokenizer/ (the
`from_pretrained` files) and OUT/meta.json (per split: documents, tokens, UTF-8 bytes and
whitespace words of the text; the tokenizer's vocabulary, special ids and sha256).
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


def write_shards(corpus: Path, tokenizer: Path, out: Path) -> dict:
    """Tokenise `corpus`'s two splits with `tokenizer` into `out`; returns meta.json's dict."""
    from transformers import AutoTokenizer

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
    for split in SPLITS:
        docs = read_documents(corpus / f"{split}.txt")
        if not docs:
            raise ValueError(f"{corpus / split}.txt: no documents")
        ids = prose_data.encode_documents(tok, docs).numpy().astype(np.uint16)
        np.save(out / f"{split}.npy", ids)
        meta["splits"][split] = {
            "documents": len(docs),
            "tokens": int(ids.size),
            "bytes": sum(len(d.encode()) for d in docs),
            "words": sum(len(d.split()) for d in docs),
        }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


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
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = write_shards(Path(a.corpus), Path(a.tokenizer), out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    meta["folder_mb"] = round(size / 1e6, 2)
    json.dump(meta, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
