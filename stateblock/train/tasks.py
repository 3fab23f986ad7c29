"""The synthetic task suite: seeded prompts with exact answers, 1 to ~3,000 tokens long.

Every family is a pure function of its prompt, so the ground truth is exact and the base
model's own greedy answer can be checked against it. The train / held-out split is a
hash of the prompt text: a prompt can never be in both.
"""

from __future__ import annotations

import hashlib
import math
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass

LETTERS = string.ascii_lowercase
MAX_ANSWER = 3072  # longest supervised answer, in tokens (one char = one token)


@dataclass(frozen=True)
class Example:
    family: str
    prompt: str
    answer: str


def _loguniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))) if hi > lo else lo


def _word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def copy(rng: random.Random) -> Example:
    s = _word(rng, 1, 32)
    return Example("copy", f"copy: {s}", s)


def reverse(rng: random.Random) -> Example:
    s = _word(rng, 1, 32)
    return Example("reverse", f"reverse: {s}", s[::-1])


def sort(rng: random.Random) -> Example:
    s = _word(rng, 1, 32)
    return Example("sort", f"sort: {s}", "".join(sorted(s)))


def add(rng: random.Random) -> Example:
    a = rng.randint(0, 10 ** rng.randint(1, 5) - 1)
    b = rng.randint(0, 10 ** rng.randint(1, 5) - 1)
    return Example("add", f"add: {a}+{b}", str(a + b))


def recall(rng: random.Random) -> Example:
    keys = rng.sample(LETTERS, rng.randint(2, 8))
    vals = [str(rng.randint(0, 999)) for _ in keys]
    q = rng.randrange(len(keys))
    pairs = ";".join(f"{k}={v}" for k, v in zip(keys, vals, strict=True))
    return Example("recall", f"recall: {pairs} ?{keys[q]}", vals[q])


def count(rng: random.Random) -> Example:
    # zero-padded three-digit columns: "017 018 ... 342", 4 tokens a number
    n = _loguniform(rng, 1, (MAX_ANSWER + 1) // 4)
    a = rng.randint(0, 1000 - n)
    nums = " ".join(f"{i:03d}" for i in range(a, a + n))
    return Example("count", f"count: {a:03d} {a + n - 1:03d}", nums)


def repeat(rng: random.Random) -> Example:
    pat = _word(rng, 1, 6)
    total = _loguniform(rng, len(pat), MAX_ANSWER)
    n = max(1, total // len(pat))
    return Example("repeat", f"repeat: {pat} {n}", pat * n)


FAMILIES: dict[str, Callable[[random.Random], Example]] = {
    f.__name__: f for f in (copy, reverse, sort, add, recall, count, repeat)
}
LONG_FAMILIES = ("count", "repeat")


def is_heldout(prompt: str, fraction: int = 10) -> bool:
    """One prompt in `fraction` is held out, decided by its text alone."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % fraction == 0


def generate(
    n: int,
    *,
    split: str,
    seed: int,
    families: tuple[str, ...] | None = None,
    weights: dict[str, float] | None = None,
) -> list[Example]:
    """n distinct examples of one split ("train" or "heldout"), reproducible from seed."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    names = list(families or FAMILIES)
    w = [(weights or {}).get(f, 1.0) for f in names]
    rng = random.Random(f"{seed}:{split}")
    seen: set[str] = set()
    out: list[Example] = []
    for ex in _stream(rng, names, w):
        if ex.prompt in seen or is_heldout(ex.prompt) != (split == "heldout"):
            continue
        seen.add(ex.prompt)
        out.append(ex)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


def _stream(rng: random.Random, names: list[str], w: list[float]) -> Iterator[Example]:
    while True:
        yield FAMILIES[rng.choices(names, w)[0]](rng)


def per_family(n_each: int, *, split: str, seed: int) -> list[Example]:
    """n_each examples of every family, for reports."""
    return [ex for f in FAMILIES for ex in generate(n_each, split=split, seed=seed, families=(f,))]
