"""A long lane's capture a chunk of positions at a time, through a KV cache (chunked prefill).

One forward over a lane of 4,096 tokens holds the device for its whole run: a kernel is not
preempted, so a small request's forward beside it waits for the lane's kernels one by one
(docs/BENCHMARKS.md). Run a chunk at a time, the lane gives the device back between chunks:
chunk i attends to its own positions causally and to every earlier position through the
cache, so the rows are those of the one forward up to rounding (the attention is split
differently), and the same prompt always runs the same chunks, so its rows do not depend on
what ran beside it.

The chunks run the backbone's eager forward: a compiled backbone's graph was traced without
a cache, and a chunk of a few thousand tokens is bound by its GEMMs, not by launching them.
A chunk passes an all-ones attention mask: without one the unmasked causal path
(`use_unmasked_causal_attention`) would hand SDPA `is_causal`, which aligns a chunk's
queries with the cache's first positions instead of its last.

The cache is static (transformers' StaticCache): allocated once a lane, its length the lane's
rounded up to whole chunks, and written in place at each chunk's positions (`cache_position`),
where a growing cache would allocate every layer's keys and values anew each chunk. Lanes of
one rounded length ask the allocator for the same blocks, which it then hands back from its
cache. Each chunk attends over the whole static length, the positions not yet written masked
out by causality.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from stateblock.model.capture import apply_compile_settings, backbone


def eager_backbone(model: nn.Module) -> Any:
    """The backbone's forward as built, uncompiled (a compiled one keeps it aside)."""
    bb = backbone(model)
    return bb.__dict__.get("_stateblock_eager_forward", bb.forward)


def cache_keyword(forward: Any) -> str:
    """The name the backbone takes its KV cache by: `cache` in newer transformers 5,
    `past_key_values` before (a wrong name would vanish into **kwargs unread)."""
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model: nn.Module, max_len: int) -> Any:
    """An empty KV cache of `max_len` positions for this model (transformers' StaticCache,
    laid out from its config). A model whose layers are not all attention (a Mamba hybrid)
    needs a state no KV cache holds: refused here, before a request relies on it."""
    from transformers import StaticCache

    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "model_type", "") == "nemotron_h" or not kinds <= {"full_attention"}:
        raise ValueError(
            f"{type(model).__name__} ({getattr(config, 'model_type', '?')}) has layers a KV "
            "cache does not hold: its long lanes cannot be captured in chunks"
        )
    return StaticCache(config=config, max_cache_len=max_len)


class ChunkedLane:
    """One lane (1, P) captured `chunk` positions a step; `step` returns the lane's rows
    (1, P, d_base) at its last step and None before."""

    def __init__(self, model: nn.Module, input_ids: Tensor, chunk: int) -> None:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"a chunked lane is one lane (1, P), got {tuple(input_ids.shape)}")
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 position, got {chunk}")
        self._model = model
        self._forward = eager_backbone(model)
        self._keyword = cache_keyword(self._forward)
        self._ids = input_ids  # (1, P)
        self._chunk = chunk
        self._cache_len = self.steps * chunk  # whole chunks: few distinct sizes to allocate
        self._cache = new_cache(model, self._cache_len)
        # every chunk attends over the whole cache; causality masks what is not written yet
        self._mask = torch.ones(1, self._cache_len, dtype=torch.long, device=input_ids.device)
        self._rows: list[Tensor] = []  # (1, chunk, d) each
        self.seen = 0  # positions captured so far

    @property
    def length(self) -> int:
        return self._ids.shape[1]

    @property
    def steps(self) -> int:
        return -(-self.length // self._chunk)

    @property
    def finished(self) -> bool:
        return self.seen >= self.length

    @torch.no_grad()
    def step(self) -> Tensor | None:
        if self.finished:
            raise RuntimeError("every chunk of this lane has run")
        apply_compile_settings(backbone(self._model))
        end = min(self.seen + self._chunk, self.length)
        ids = self._ids[:, self.seen : end]  # (1, C)
        positions = torch.arange(self.seen, end, device=ids.device)  # (C,)
        out = self._forward(
            input_ids=ids,
            attention_mask=self._mask,  # (1, L)
            position_ids=positions[None],  # (1, C): where transformers reads the positions
            cache_position=positions,  # and where older releases read them
            use_cache=True,
            **{self._keyword: self._cache},
        )
        self._rows.append(out.last_hidden_state)
        self.seen = end
        if not self.finished:
            return None
        rows = torch.cat(self._rows, dim=1)  # (1, P, d)
        self._rows, self._cache = [], None  # the cache's memory goes back now, not at GC
        return rows
