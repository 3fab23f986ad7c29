"""Prose tasks (issue 41): prompts in plain English over passages of the prose corpus, most of
them with an answer the prompt decides, and plain continuations.

    repeat         Repeat this sentence: <s>                      s
    next_sentence  <passage> Quote the sentence that comes after "<s_i>".          s_(i+1)
    next_word      <passage> Which word comes after "<w>" in this text?            the next word
    question       <passage> Which sentence of this text contains the word "<w>"?  that sentence
    continue       <passage>                                      the base's own continuation

A passage is a run of 2-5 consecutive sentences of one document. For the four determined
families the true answer is a function of the prompt (a quoted sentence occurs once in its
passage, a word once, so the answer is unique); for `continue` the text's own next 1-4
sentences are kept as `answer`, which tunes the base to continue a passage and stop, but the
teacher is always the base's greedy answer. Examples come from the documents of one split of the
corpus (`corpus.py` splits by a hash of the document id), so a held-out prompt quotes only
held-out text; `generate` is deterministic given its documents and seed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from stateblock.train.corpus import read_documents

DETERMINED = ("repeat", "next_sentence", "next_word", "question")
FAMILIES = (*DETERMINED, "continue")
MIN_WORDS, MAX_WORDS = 4, 30  # a sentence outside these is never quoted or asked for
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_EDGE = re.compile(r"^\W+|\W+$")


@dataclass(frozen=True)
class Example:
    family: str
    prompt: str
    answer: str  # the truth of a determined family; the text's own next sentence for continue
    doc: str  # the document's id

    @property
    def determined(self) -> bool:
        return self.family in DETERMINED


def sentences(document: str) -> list[str]:
    """The document's sentences in order (paragraphs one a line, each cut after . ! ?)."""
    out = []
    for paragraph in document.split("\n"):
        out += [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]
    return out


def _plain(s: str) -> bool:
    """A sentence worth quoting: 4-30 words, from a capital letter to . ! or ? (so a passage
    of them splits back into the same sentences), no quotation marks of its own (the
    prompts quote with them), mostly letters."""
    words = len(s.split())
    letters = sum(c.isalpha() or c == " " for c in s)
    ends = s[0].isupper() and s[-1] in ".!?"
    return MIN_WORDS <= words <= MAX_WORDS and ends and '"' not in s and letters >= 0.8 * len(s)


def _word(w: str) -> str:
    return _EDGE.sub("", w)


def _passage(rng: random.Random, sents: list[str]) -> tuple[int, int] | None:
    """A run [a, b) of 2-5 plain sentences, or None when the document has none."""
    runs, start = [], None
    for i, s in enumerate([*sents, ""]):
        if i < len(sents) and _plain(s):
            start = i if start is None else start
        elif start is not None:
            if i - start >= 2:
                runs.append((start, i))
            start = None
    if not runs:
        return None
    lo, hi = rng.choice(runs)
    n = rng.randint(2, min(5, hi - lo))
    a = rng.randint(lo, hi - n)
    return a, a + n


def _once(text: str) -> set[str]:
    """The stripped, lower-cased words of 3+ letters that occur once in `text`."""
    counts: dict[str, int] = {}
    for w in text.split():
        counts[_word(w).lower()] = counts.get(_word(w).lower(), 0) + 1
    return {w for w, c in counts.items() if c == 1 and len(w) >= 3 and w.isalpha()}


def _unique_words(text: str) -> list[tuple[str, str]]:
    """(word, the word after it) for each word that occurs once in `text`."""
    once = _once(text)
    words = [_word(w) for w in text.split()]
    return [(w, nxt) for w, nxt in zip(words, words[1:], strict=False)
            if w.lower() in once and nxt]  # fmt: skip


def repeat(rng: random.Random, sents: list[str], a: int, b: int) -> tuple[str, str] | None:
    s = sents[rng.randrange(a, b)]
    return f"Repeat this sentence: {s}", s


def next_sentence(rng: random.Random, sents: list[str], a: int, b: int) -> tuple[str, str] | None:
    i = rng.randrange(a, b - 1)
    text = " ".join(sents[a:b])
    if text.count(sents[i]) != 1:
        return None
    return f'{text}\nQuote the sentence that comes after "{sents[i]}".', sents[i + 1]


def next_word(rng: random.Random, sents: list[str], a: int, b: int) -> tuple[str, str] | None:
    text = " ".join(sents[a:b])
    pairs = _unique_words(text)
    if not pairs:
        return None
    w, nxt = rng.choice(pairs)
    return f'{text}\nWhich word comes after "{w}" in this text?', nxt


def question(rng: random.Random, sents: list[str], a: int, b: int) -> tuple[str, str] | None:
    text = " ".join(sents[a:b])
    once = _once(text)
    i = rng.randrange(a, b)
    mine = [_word(w) for w in sents[i].split()]
    mine = [w for w in mine if w.lower() in once]
    if not mine:
        return None
    w = rng.choice(mine)
    return f'{text}\nWhich sentence of this text contains the word "{w}"?', sents[i]


def continuation(rng: random.Random, sents: list[str], a: int, b: int) -> tuple[str, str] | None:
    """The passage alone; its answer the text's next 1-4 sentences (what tuning teaches the
    base to write before `<eos>`: answers of a few tokens to a few hundred)."""
    if b >= len(sents) or not _plain(sents[b]):
        return None
    return " ".join(sents[a:b]), " ".join(sents[b : b + rng.randint(1, 4)])


MAKERS: dict[str, Callable] = {
    "repeat": repeat,
    "next_sentence": next_sentence,
    "next_word": next_word,
    "question": question,
    "continue": continuation,
}


def doc_id(document: str) -> str:
    """A document's id in a split file (which holds no ids): a hash of its text."""
    return hashlib.sha256(document.encode()).hexdigest()[:16]


def generate(
    documents: list[str], n: int, *, seed: int | str, weights: dict[str, float] | None = None
) -> list[Example]:
    """n distinct examples over `documents`, drawn by seed: a document, a family (by
    `weights`, every family 1 unless given), a passage of it. Draws that cannot make the
    family's prompt there are redrawn; at most 50 draws an example."""
    docs = [(doc_id(d), sentences(d)) for d in documents]
    names = list(FAMILIES)
    w = [(weights or {}).get(f, 1.0) for f in names]
    rng = random.Random(f"prose-tasks:{seed}")
    seen: set[str] = set()
    out: list[Example] = []
    misses = 0
    while len(out) < n:
        if misses > 50 * (len(out) + 1):
            raise ValueError(f"{len(documents)} documents make only {len(out)} of {n} examples")
        ident, sents = rng.choice(docs)
        family = rng.choices(names, w)[0]
        run = _passage(rng, sents)
        made = MAKERS[family](rng, sents, *run) if run else None
        if made is None or made[0] in seen:
            misses += 1
            continue
        seen.add(made[0])
        out.append(Example(family, made[0], made[1], ident))
    return out


def _shard(args: tuple[list[str], int, str, dict[str, float] | None]) -> list[Example]:
    documents, n, seed, weights = args
    return generate(documents, n, seed=seed, weights=weights)


def generate_sharded(
    documents: list[str],
    n: int,
    *,
    seed: int,
    weights: dict[str, float] | None = None,
    workers: int = 1,
) -> list[Example]:
    """`generate` over `workers` shards of the documents (every workers-th one) in as many
    processes: the tuning prompts of a GPU call, hundreds of thousands, are made there in
    seconds. Each shard makes its share and 1 % more; the shards' examples are taken in
    turn, a prompt two shards both made (a sentence in two documents) once, the first n.
    One worker is `generate` itself."""
    if workers <= 1:
        return generate(documents, n, seed=seed, weights=weights)
    from concurrent.futures import ProcessPoolExecutor

    share = -(-n // workers) * 101 // 100 + 1
    jobs = [(documents[k::workers], share, f"{seed}:{k}", weights) for k in range(workers)]
    with ProcessPoolExecutor(workers) as pool:
        shards = list(pool.map(_shard, jobs))
    out: list[Example] = []
    seen: set[str] = set()
    for row in zip(*shards, strict=True):
        for ex in row:
            if ex.prompt not in seen and len(out) < n:
                seen.add(ex.prompt)
                out.append(ex)
    if len(out) < n:
        raise ValueError(f"{workers} shards made only {len(out)} of {n} distinct examples")
    return out


def from_corpus(
    corpus: str | Path, split: str, n: int, seed: int, weights=None, workers: int = 1
) -> list[Example]:
    """`generate` (`generate_sharded` with workers > 1) over one split file of a corpus
    directory (train.txt or heldout.txt)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    documents = read_documents(Path(corpus) / f"{split}.txt")
    return generate_sharded(documents, n, seed=seed, weights=weights, workers=workers)


def write(examples: list[Example], path: str | Path) -> None:
    """JSONL, gzipped when the name ends in .gz (a GPU call carries the train prompts)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(asdict(e), ensure_ascii=False) + "\n" for e in examples).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)


def read(path: str | Path) -> list[Example]:
    data = Path(path).read_bytes()
    text = (gzip.decompress(data) if Path(path).suffix == ".gz" else data).decode()
    return [Example(**json.loads(line)) for line in text.splitlines() if line.strip()]
