"""Helpers of the fixed-set distillation (`stateblock train --prompts`) and the quality
report: encoding suite examples, and the step planning and schedule of `distill`. The shipped
base model itself is trained by `base_ddp` (the recipe in `recipe.py`).
"""

from __future__ import annotations

import math

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


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
