"""A long lane's capture a chunk of positions at a time, through a KV cache (chunked prefill).

One forward over a lane of 4,096 tokens holds the device for its whole run: a kernel is not
preempted, so a small request's forward beside it waits for the lane's kernels one by one
(docs/BENCHMARKS.md). Run a chunk at a time, the lane gives the device back between chunks:
chunk i attends to its own positions causally and to every earlier position through the
cache, so the rows are those of the one forward up to rounding (the attention is split
differently), and the same prompt always runs the same chunks, so its rows do not depend on
what ran beside it.

The chunks run the backbone's eager forward (a compiled backbone's graph was traced
without a cache), at fixed shapes (`ChunkRunner`): `chunk` positions (the last chunk padded,
its pad rows dropped) against the shortest of a few static caches (transformers'
StaticCache; the chunk, twice it, ... up to the longest lane rounded up to whole chunks) that
holds them, so a chunk attends over at most twice the positions written so far, the ones not
yet written masked out by causality. On CUDA each of those forwards is recorded once as a
CUDA graph and a chunk replays one: launched eagerly, a chunk of 512 positions of the 2.9 B
bench base spent about 41 ms in Python launching kernels that ran in a fraction of that
(`bench.chunk_cost`, docs/BENCHMARKS.md), holding the capture process's interpreter lock
against the cohorts' forwards all that time. The caches are allocated once and written in
place, where a growing cache would allocate every layer's keys and values anew each chunk.
Lanes share a runner: a lane whose chunks interleave with another's has its written keys and
values put aside when the other takes the caches and put back at its turn, and a lane's
prefix moves to the next cache when it outgrows one.

A chunk passes an all-ones attention mask: without one the unmasked causal path
(`use_unmasked_causal_attention`) would hand SDPA `is_causal`, which aligns a chunk's
queries with the cache's first positions instead of its last.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
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


def kv_tensors(cache: Any) -> list[Tensor]:
    """Every layer's keys and values tensors of a static cache, (1, kv_heads, L, head_dim)
    each, once its first update has laid them out."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def seek(cache: Any, start: Tensor) -> None:
    """Each layer's write position set to `start` (a 0-d tensor): transformers' StaticCache
    of 5.2x writes a chunk's keys where its own counter (`cumulative_length`) says, not at
    `cache_position`; a cache shared by lanes, or rewound, must be told where. Done on the
    device, so a recorded chunk does it too. Earlier layers without the counter write at
    `cache_position` and need nothing."""
    for layer in cache.layers:
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, Tensor):
            counter.copy_(start)


@dataclass
class _Span:
    """One cache length a chunk can run against: its static cache, the all-ones mask of
    that length, and on CUDA its recorded forward and that forward's output buffer."""

    cache: Any
    mask: Tensor  # (1, L)
    graph: Any = None
    out: Tensor | None = None  # (1, C, d)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @property
    def kv(self) -> list[Tensor]:
        return kv_tensors(self.cache)


class ChunkRunner:
    """A chunk's forward at fixed shapes: (1, chunk) ids at positions start.. against a
    static cache of the shortest span (chunk x 1, 2, 4, ... up to `max_len` rounded up to
    whole chunks) that holds them, so a chunk attends over at most twice the positions written
    so far. With `graph` (CUDA only) each span's forward is recorded once as a CUDA graph and
    each chunk replays one: one launch instead of every layer's kernels. One lane at a time
    holds the caches; `step` hands them over (a lane's written keys and values put aside,
    another's put back, or moved to a longer span)."""

    def __init__(self, model: nn.Module, chunk: int, max_len: int, *, pad_id: int = 0,
                 graph: bool = False) -> None:  # fmt: skip
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 position, got {chunk}")
        self.chunk = chunk
        self.cache_len = -(-max_len // chunk) * chunk
        self._model = model
        self._forward = eager_backbone(model)
        self._keyword = cache_keyword(self._forward)
        device = next(model.parameters()).device
        self._ids = torch.full((1, chunk), pad_id, dtype=torch.long, device=device)  # (1, C)
        self._offsets = torch.arange(chunk, device=device)  # (C,)
        self._positions = self._offsets.clone()  # (C,): start + offsets
        self._spans = [
            _Span(new_cache(model, n), torch.ones(1, n, dtype=torch.long, device=device))
            for n in span_lengths(chunk, self.cache_len)
        ]
        self._holder: tuple[weakref.ref, _Span] | None = None  # the lane the caches hold
        # other lanes' written keys and values, set aside while another held the caches
        self._saved: weakref.WeakKeyDictionary[Any, list[Tensor]] = weakref.WeakKeyDictionary()
        for span in self._spans:  # lays each cache out (transformers makes it at first use)
            if graph:
                self._record(span, device)
            else:
                self._run(span)

    @property
    def graphed(self) -> bool:
        return all(span.graph is not None for span in self._spans)

    @property
    def spans(self) -> tuple[int, ...]:
        return tuple(span.length for span in self._spans)

    @torch.no_grad()
    def _run(self, span: _Span) -> Tensor:
        seek(span.cache, self._positions[0])
        out = self._forward(
            input_ids=self._ids,
            attention_mask=span.mask,  # (1, L): causality masks what is not written yet
            position_ids=self._positions[None],  # (1, C): where transformers reads positions
            cache_position=self._positions,  # and where older releases read them
            use_cache=True,
            **{self._keyword: span.cache},
        )
        return out.last_hidden_state  # (1, C, d)

    def _record(self, span: _Span, device: torch.device) -> None:
        """Warm the forward on a side stream (the cache's layout, cuBLAS's workspaces), then
        record it; other threads' work on the device stays out of the graph."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(span)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            span.out = self._run(span)
        span.graph = graph

    def _hand_over(self, lane: Any, span: _Span, start: int) -> None:
        """`span`'s cache made to hold `lane`'s first `start` positions."""
        held = (None, None) if self._holder is None else (self._holder[0](), self._holder[1])
        other, other_span = held
        if other is lane:
            if other_span is not span and start:  # a longer span: the prefix moves up
                for t, src in zip(span.kv, other_span.kv, strict=True):
                    t[:, :, :start].copy_(src[:, :, :start])
        else:
            if other is not None and not other.finished and other.seen:
                self._saved[other] = [t[:, :, : other.seen].clone() for t in other_span.kv]
            saved = self._saved.pop(lane, None)
            if saved is not None:
                for t, prefix in zip(span.kv, saved, strict=True):
                    t[:, :, :start].copy_(prefix)
        self._holder = (weakref.ref(lane), span)

    @torch.no_grad()
    def step(self, lane: Any, ids: Tensor, start: int) -> Tensor:
        """`lane`'s rows (1, n, d) of ids (1, n), n <= chunk, at positions start..start +
        n - 1, their keys and values written into the cache; a short chunk's pad rows
        dropped. The lane has run its first `start` positions through this runner."""
        n = ids.shape[1]
        if n > self.chunk or start + self.chunk > self.cache_len:
            raise ValueError(
                f"a chunk of {n} at {start} does not fit chunks of {self.chunk} in a cache "
                f"of {self.cache_len}"
            )
        span = next(s for s in self._spans if s.length >= start + self.chunk)
        self._hand_over(lane, span, start)
        self._ids[:, :n].copy_(ids)
        torch.add(self._offsets, start, out=self._positions)
        if span.graph is not None:
            span.graph.replay()
            out = span.out
        else:
            apply_compile_settings(backbone(self._model))
            out = self._run(span)
        assert out is not None
        return out[:, :n].clone()


def span_lengths(chunk: int, cache_len: int) -> list[int]:
    """chunk, 2 chunk, 4 chunk, ... below cache_len, then cache_len."""
    lengths, n = [], chunk
    while n < cache_len:
        lengths.append(n)
        n *= 2
    return [*lengths, cache_len]


class ChunkedLane:
    """One lane (1, P) captured a chunk of positions a step through a `ChunkRunner` (shared,
    or the lane's own, sized to it); `step` returns the lane's rows (1, P, d_base) at its
    last step and None before."""

    def __init__(self, model: nn.Module, input_ids: Tensor, chunk: int | None = None, *,
                 runner: ChunkRunner | None = None) -> None:  # fmt: skip
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"a chunked lane is one lane (1, P), got {tuple(input_ids.shape)}")
        if runner is None:
            if chunk is None or chunk < 1:
                raise ValueError(f"chunk must be at least 1 position, got {chunk}")
            runner = ChunkRunner(model, chunk, input_ids.shape[1])
        if input_ids.shape[1] > runner.cache_len:
            raise ValueError(
                f"a lane of {input_ids.shape[1]} positions is longer than the chunk runner's "
                f"cache ({runner.cache_len})"
            )
        self._runner = runner
        self._ids = input_ids  # (1, P)
        self._rows: list[Tensor] = []  # (1, chunk, d) each
        self.seen = 0  # positions captured so far

    @property
    def length(self) -> int:
        return self._ids.shape[1]

    @property
    def steps(self) -> int:
        return -(-self.length // self._runner.chunk)

    @property
    def finished(self) -> bool:
        return self.seen >= self.length

    @torch.no_grad()
    def step(self) -> Tensor | None:
        if self.finished:
            raise RuntimeError("every chunk of this lane has run")
        end = min(self.seen + self._runner.chunk, self.length)
        self._rows.append(self._runner.step(self, self._ids[:, self.seen : end], self.seen))
        self.seen = end
        if not self.finished:
            return None
        rows = torch.cat(self._rows, dim=1)  # (1, P, d)
        self._rows = []
        return rows
