"""Helpers of the fixed-set distillation (`stateblock train --prompts`) and the quality
report: encoding suite examples, and the step planning and schedule of `distill`. The shipped
base model itself is trained by `base_ddp` (the recipe in `recipe.py`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from stateblock.train import tasks


def encode_examples(tok, examples: list[tasks.Example]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with <bos>..<ans>, answer ids without EOS) per example."""
    prompts = tok([e.prompt for e in examples])["input_ids"]
    answers = tok([e.answer for e in examples], add_special_tokens=False)["input_ids"]
    return list(zip(prompts, answers, strict=True))


def fit_steps(planned: int, step: int, spent: float, pace: float, max_minutes: float) -> int:
    """The step count that fits a wall-clock budget: `spent` seconds so far, `pace` seconds a
    step measured after start-up. Re-planned once, before warm-up ends, so the cosine
    schedule still anneals."""
    if max_minutes <= 0 or pace <= 0:
        return planned
    return max(step + 1, min(planned, step + int((max_minutes * 60 - spent) / pace)))


class StepPlan:
    """A run's step count fitted to `max_minutes` of wall clock, planned twice: at step
    `first` from the pace after its first eighth (start-up excluded), and again a quarter
    of the way on (`first` steps on at least) from the pace since `first`, which early steps can
    overstate (new shapes, allocations: on the H200 the prose tuning's first plan used 36 s
    of its 90). Both come before the cosine's second half, so the schedule still anneals.
    A resumed run (`start` > 0) keeps the step count it saved."""

    def __init__(
        self,
        planned: int,
        first: int,
        max_minutes: float,
        start: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.planned, self.steps, self._first, self._clock = planned, planned, first, clock
        self._max = max_minutes if start == 0 else 0.0
        self._warm = max(1, first // 8)
        self._second = -1
        self._t0 = clock()
        self._at: dict[int, float] = {}

    def plan(self, step: int) -> int:
        """The step count to run; call before each step (it plans where one is due)."""
        if self._max <= 0 or step not in (self._warm, self._first, self._second):
            return self.steps
        now = self._at[step] = self._clock()
        if step == self._warm:
            return self.steps
        since = self._warm if step == self._first else self._first
        pace = (now - self._at[since]) / (step - since)
        self.steps = fit_steps(self.planned, step, now - self._t0, pace, self._max)
        if step == self._first:
            on = max(self._first, (self.steps - self._first) // 4)
            self._second = min(self.steps - 1, self._first + on)
        return self.steps


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
