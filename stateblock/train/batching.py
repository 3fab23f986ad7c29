"""Token-budget batching shared by base-model training, teacher generation and distillation."""

from __future__ import annotations

import random
from collections.abc import Sequence


def budget_batches(
    lengths: Sequence[int], budget: int, *, max_batch: int = 1024, seed: int | None = None
) -> list[list[int]]:
    """Index batches of similar length with (batch size x longest) <= budget.

    Sorting by length keeps padding small; shuffling the batch order (when seeded) keeps
    training from seeing all short answers first.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[i]  # ascending order: the newest is the longest
        if cur and (longest * (len(cur) + 1) > budget or len(cur) >= max_batch):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    if seed is not None:
        random.Random(seed).shuffle(batches)
    return batches
