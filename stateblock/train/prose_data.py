"""The prose base's text for `base_ddp --corpus`: the corpus's documents tokenised once (each
`<bos> ... <eos>`, so the base learns to end a document) into one id stream per split, random
windows of it as training batches (nanoGPT's `get_batch`), and held-out perplexity over
consecutive windows.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

import torch

from stateblock.train.corpus import read_documents

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(src: str | Path, dst: Path) -> None:
    """The prose tokenizer's files (`prose_tokenizer.py`) into the base directory."""
    missing = [f for f in TOKENIZER_FILES if not (Path(src) / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: no {', '.join(missing)} (python -m "
                                "stateblock.train.prose_tokenizer writes them)")  # fmt: skip
    dst.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(Path(src) / f, dst / f)


def ids_path(text: Path, tok_dir: Path) -> Path:
    """Where a split's token ids are cached: the run directory (beside the base directory,
    never in it), named for the text file and keyed by its size, its modification time and
    the tokenizer, so another corpus or tokenizer is never read from a stale cache."""
    st = text.stat()
    key = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes())
    key.update(f"{text.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return tok_dir.parent / f"{text.stem}-{key.hexdigest()[:12]}.ids.pt"


def encode_documents(tok, docs: list[str]) -> torch.Tensor:
    """Documents as one int32 stream, each `<bos> ... <eos>`."""
    encoded = tok.backend_tokenizer.encode_batch_fast(docs, add_special_tokens=False)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    return torch.cat([torch.tensor([bos, *e.ids, eos], dtype=torch.int32) for e in encoded])


def encode_split(tok, text: Path, tok_dir: Path) -> Path:
    """A split's documents as one int32 stream, each `<bos> ... <eos>`, cached at
    `ids_path` (written once, by rank 0; the other ranks and the loader workers map it)."""
    cache = ids_path(text, tok_dir)
    if not cache.exists():
        docs = read_documents(text)
        if not docs:
            raise ValueError(f"{text}: no documents")
        stream = encode_documents(tok, docs)
        tmp = cache.with_suffix(".tmp")
        torch.save(stream, tmp)
        tmp.rename(cache)
    return cache


class TextWindows(torch.utils.data.IterableDataset):
    """Endless batches of `batch` random windows of `seq_len` tokens: (ids, labels), the
    labels the next token at every position, as `base_ddp.Stream` yields them."""

    def __init__(self, ids_path: Path, seq_len: int, batch: int, seed: str) -> None:
        self.ids_path, self.seq_len, self.batch, self.seed = ids_path, seq_len, batch, seed

    def __iter__(self):
        data = torch.load(self.ids_path, mmap=True)
        if len(data) <= self.seq_len + 1:
            raise ValueError(f"{self.ids_path}: {len(data)} tokens, fewer than a window")
        wi = torch.utils.data.get_worker_info()
        key = hashlib.sha256(f"{self.seed}-{wi.id if wi else 0}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "big"))
        offsets = torch.arange(self.seq_len + 1)
        while True:
            starts = torch.randint(len(data) - self.seq_len - 1, (self.batch, 1), generator=g)
            w = data[starts + offsets].long()
            yield w[:, :-1].contiguous(), w[:, 1:].contiguous()


@torch.no_grad()
def heldout_loss(model, ids: torch.Tensor, seq_len: int, device, max_tokens: int = 0,
                 batch: int = 16) -> dict:  # fmt: skip
    """Mean next-token loss (nats) and perplexity over consecutive windows of the held-out
    stream (its first `max_tokens` predictions, 0: all)."""
    n = len(ids) - 1 if not max_tokens else min(len(ids) - 1, max_tokens)
    windows = [(s, min(seq_len, n - s)) for s in range(0, n, seq_len)]
    total, count = 0.0, 0
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda"))
    for k in range(0, len(windows), batch):
        group = windows[k : k + batch]
        w = max(length for _, length in group)
        x = torch.zeros((len(group), w), dtype=torch.long)
        y = torch.full((len(group), w), -100, dtype=torch.long)
        for r, (s, length) in enumerate(group):
            x[r, :length] = ids[s : s + length]
            y[r, :length] = ids[s + 1 : s + 1 + length]
        with amp:
            logits = model(input_ids=x.to(device)).logits
        total += torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum"
        ).item()
        count += int((y != -100).sum())
    nll = total / max(1, count)
    return {"tokens": count, "nll": round(nll, 4), "perplexity": round(math.exp(nll), 2)}
