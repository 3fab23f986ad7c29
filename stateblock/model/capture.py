"""Capture: one forward of any Hugging Face causal LM, its final hidden rows taken by a hook.

No `generate`, no all-layer `output_hidden_states`: a forward hook on the backbone (the
module that applies the final norm) records `last_hidden_state`, and the LM head runs on
one row only (`logits_to_keep=1`), so a 131k vocabulary costs nothing here.
The hook writes into a request-scoped sink, never a process-wide stash: the seed's
original stash raced under concurrent traffic.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn


def backbone(model: nn.Module) -> nn.Module:
    """The module whose output is the final (normed) hidden state."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise TypeError(f"{type(model).__name__} has no backbone to hook (base_model)")
    return base


def lm_head_weight(model: nn.Module) -> Tensor:
    """The resident output embedding (V, d_base), bound by reference, never copied."""
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embedding")
    return head.weight


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_backbone(
    model: nn.Module,
    backend: str = "inductor",
    *,
    size_oblivious: bool = False,
    deterministic: bool = True,
) -> None:
    """Compile the backbone's forward in place (`torch.compile`, shapes symbolic).

    `backend` is a torch.compile backend ("inductor", "aot_eager", ...) or one of inductor's
    modes (COMPILE_MODES). "reduce-overhead" replays each shape as one CUDA graph: a 28-layer
    eager forward is bound by Python launching its ~500 kernels, not by the GPU. Its outputs
    live in the graph's pool until the next replay; the capture hook copies its rows out
    at once, and a later read of an overwritten output raises instead of returning them.

    Lanes and width are symbolic (`dynamic=True`): one graph serves every width bucket and
    lane count above one, and lanes == 1 would get a second (dynamo specializes sizes of 1),
    whose kernels may round otherwise: the capture service never runs one lane compiled
    (capture_svc.config.MIN_COMPILED_LANES), so a model compiles once. "reduce-overhead"
    still records one CUDA graph per concrete (lanes, width) shape on that shape's first
    calls: `warm_up` makes them all before a request arrives.

    `size_oblivious`: one lane runs the same symbolic graph as the rest (no second graph).
    The lane count is marked unbacked on every call (dynamo then has no value to specialize
    1 on) and the positions are made inside the compiled region, where transformers'
    batch-size check compares the lane count with itself. torch's own switch for this
    (`backed_size_oblivious`) still guards lanes >= 2 on the GPU image's torch 2.11, and its
    graph stopped inductor's Triton generator there (docs/BENCHMARKS.md). The settings the
    compile needs (`compile_settings`) are applied here and on every thread that runs the
    backbone through `capture` (a backbone already compiled with `backend` returns early
    and keeps the settings it was compiled with). `deterministic=False` lets inductor
    time its kernels' candidate configurations (autotuning): for benches that measure what
    that would give; a service never passes it (`compile_settings`).

    Only `forward` is replaced: the capture hook lives on the module and runs in
    `Module.__call__`, outside the compiled region, so every capture still records through
    its own request-scoped hook.
    """
    bb = backbone(model)
    if getattr(bb, "_stateblock_compiled", None) == backend:
        return
    bb._stateblock_settings = compile_settings(deterministic)
    apply_compile_settings(bb)
    eager = bb.forward
    target = _positioned(eager) if size_oblivious else eager
    if backend in COMPILE_MODES:
        compiled = torch.compile(target, mode=backend, dynamic=True)
    else:
        compiled = torch.compile(target, backend=backend, dynamic=True)
    bb.forward = _unbacked_lanes(compiled) if size_oblivious else compiled
    bb._stateblock_eager_forward = eager
    bb._stateblock_compiled = backend


def _positioned(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The backbone's forward with each lane's positions 0..P-1 made inside it: given none,
    transformers broadcasts (1, P) ones and branches on B != 1; given them from outside,
    it compares their lane count with the ids' (two unbacked sizes it cannot prove equal)."""

    def run(input_ids: Tensor, **kwargs: Any) -> Any:
        b, p = input_ids.shape
        kwargs["position_ids"] = torch.arange(p, device=input_ids.device).expand(b, p)
        return forward(input_ids=input_ids, **kwargs)

    return run


def _unbacked_lanes(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` called with the ids' lane dimension marked unbacked: no graph of its own
    for one lane."""
    from torch._dynamo.decorators import mark_unbacked

    def run(input_ids: Tensor, **kwargs: Any) -> Any:
        mark_unbacked(input_ids, 0)
        return compiled(input_ids, **kwargs)

    return run


def compile_settings(deterministic: bool = True) -> tuple[tuple[object, str, object], ...]:
    """(config module, name, value) of each torch setting a compiled backbone needs."""
    import torch._dynamo
    import torch._inductor.config

    dynamo = torch._dynamo.config
    settings: list[tuple[object, str, object]] = [
        # one CUDA graph per bucketed shape is the design, not a symptom to warn about
        (torch._inductor.config.triton, "cudagraph_dynamic_shape_warn_limit", None),
    ]
    # headroom over dynamo's default for a caller that runs shapes outside the buckets
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name):
            settings.append((dynamo, name, max(getattr(dynamo, name), 256)))
    # Inductor times a kernel's candidate configs on its first run and keeps the fastest: a
    # choice that follows the GPU's load at that moment, so two processes compiling one model
    # can round differently and a prompt's answer would depend on the replica that took it.
    # Deterministic mode picks every config without timing.
    if hasattr(torch._inductor.config, "deterministic"):
        settings.append((torch._inductor.config, "deterministic", deterministic))
    return tuple(settings)


_applied = threading.local()


def apply_compile_settings(bb: nn.Module) -> None:
    """The compiled backbone's settings on this thread. torch keeps a setting made in code per
    thread (its config modules hold them in context variables): made once where the backbone
    was compiled, it would not reach the forward threads that run, and compile, its graphs."""
    settings = getattr(bb, "_stateblock_settings", None)
    if settings is None or getattr(_applied, "settings", None) is settings:
        return
    for module, name, value in settings:
        setattr(module, name, value)
    _applied.settings = settings


UNMASKED_SDPA = "stateblock_causal_sdpa"


def _causal_mask_or_none(*args, **kwargs):
    """transformers' SDPA mask, but none for a batch without a padding mask: SDPA then runs
    its causal kernel (`is_causal`) instead of reading a (B, 1, P, P) mask."""
    from transformers.masking_utils import sdpa_mask

    if not args and kwargs.get("attention_mask") is None and kwargs.get("local_size") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def use_unmasked_causal_attention(model: nn.Module) -> bool:
    """SDPA attention whose mask is left out where the batch has no padding mask, as the
    capture's right-padded cohorts have not. Eager transformers already leaves it out; while
    dynamo traces, the installed transformers (torch before 2.14) always builds the mask,
    which sends a compiled forward to a masked attention kernel and adds the mask's own
    construction (docs/BENCHMARKS.md, "The compiled forward split by kernel"). Returns
    whether the model now runs it: one on another attention than transformers' SDPA is left
    as it is."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) not in (
        "sdpa",
        UNMASKED_SDPA,
    ):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(UNMASKED_SDPA, ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(UNMASKED_SDPA, _causal_mask_or_none)
    model.set_attn_implementation(UNMASKED_SDPA)
    return True


@functools.cache
def _materialize() -> Callable[[Tensor], Tensor]:
    """`stateblock::materialize`, a copy inductor keeps as its own buffer (defined once)."""

    @torch.library.custom_op("stateblock::materialize", mutates_args=())
    def materialize(x: Tensor) -> Tensor:
        return x.clone()

    @materialize.register_fake
    def _(x: Tensor) -> Tensor:
        return torch.empty_like(x)

    return materialize


def use_rope_table(model: nn.Module) -> bool:
    """The rotary embedding's cos and sin computed once a forward. Compiled, inductor fuses
    them into every layer's rotary kernel, which then evaluates cos and sin again for each
    element of each head in each layer (in float32); here they pass through
    `stateblock::materialize`, so they are a table the layers read. The
    table holds them in the model's dtype, as eager transformers does, so the compiled rows
    move by that rounding. Returns whether the model has such an embedding."""
    rope = getattr(backbone(model), "rotary_emb", None)
    if rope is None or getattr(rope, "_stateblock_table", False):
        return rope is not None
    table, materialize = rope.forward, _materialize()

    def forward(x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = table(x, position_ids)  # (B, P, head_dim) each
        return materialize(cos), materialize(sin)

    rope.forward, rope._stateblock_table = forward, True
    return True


def compile_as_served(
    model: nn.Module, backend: str, *, size_oblivious: bool = False, rope_table: bool = False
) -> None:
    """The backbone compiled as the capture service runs it: SDPA without the causal mask a
    traced forward would build (`use_unmasked_causal_attention`), the rotary's cos and sin
    as a table with `rope_table` (`use_rope_table`), then `compile_backbone`. The service
    and the quality report's served rows both go through here."""
    use_unmasked_causal_attention(model)
    if rope_table:
        use_rope_table(model)
    compile_backbone(model, backend, size_oblivious=size_oblivious)


def use_compile_cache(directory: Path) -> None:
    """Keep inductor's caches (compiled graphs, Triton kernels, autotuning results) in
    `directory`, made if missing, so a process that compiles the same model on the same
    machine again loads them instead of compiling. Process-wide, as inductor reads it:
    call before the first compile."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory.resolve())
    os.environ.pop("TRITON_CACHE_DIR", None)  # Triton's then lives under inductor's


def compile_cache_counts() -> dict[str, int]:
    """This process's compiled-graph cache lookups so far: inductor's FX graphs and
    AOTAutograd's, hits and misses."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aotautograd_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aotautograd_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }


def graphs_compiled() -> int:
    """The graphs dynamo has compiled in this process so far (every backend, every model)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# a shape's first call runs eagerly in the CUDA graph pool (cudagraph trees' warm-up), its
# second records the graph, the third replays it: after these a request only replays
WARM_RUNS = 3


@torch.no_grad()
def warm_up(
    model: nn.Module,
    shapes: Sequence[tuple[int, int]],
    *,
    pad_id: int,
    runs: int = WARM_RUNS,
    on_shape: Callable[[int, int, float], None] | None = None,
) -> None:
    """Run every (lanes, width) shape `runs` times through the forward, as a request runs it
    (right-padded ids, no mask), so compiling and graph recording happen here. `on_shape`
    hears each shape's (lanes, width, seconds)."""
    device = next(model.parameters()).device
    for lanes, width in shapes:
        t0 = time.perf_counter()
        ids = torch.full((lanes, width), pad_id, dtype=torch.long, device=device)
        for _ in range(runs):
            capture(model, ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if on_shape is not None:
            on_shape(lanes, width, time.perf_counter() - t0)


def uncompile_backbone(model: nn.Module) -> None:
    """Undo `compile_backbone` (a no-op on an eager backbone) and drop dynamo's caches: a
    model compiled on one thread (a bench's prefill, without CUDA graphs) that a stack then
    compiles again on its capture service's forward thread."""
    import torch._dynamo

    bb = backbone(model)
    eager = bb.__dict__.pop("_stateblock_eager_forward", None)
    if eager is None:
        return
    bb.forward = eager
    del bb._stateblock_compiled, bb._stateblock_settings
    torch._dynamo.reset()


@torch.no_grad()
def capture(
    model: nn.Module,
    input_ids: Tensor,  # (B, P) right-padded
    attention_mask: Tensor | None = None,  # (B, P); the serving path passes none
    *,
    on_rows: Callable[[Tensor], None] | None = None,
) -> Tensor:
    """One forward; returns the final hidden rows (B, P, d_base).

    Right-padded ids need no mask: the base models are causal, so a valid row never sees a
    pad column, and without a mask Hugging Face SDPA takes its causal (flash) path instead
    of building a (B, 1, P, P) mask. The rows at pad columns are garbage; callers drop them.
    A mask still passes through for callers that left-pad or want the masked reference.

    `on_rows` sees the rows inside the hook, before anyone else: the capture registry
    uses it to verify the request identity and layout at the moment of recording. Several
    threads may run forwards of one model at once: each call's hook takes only the output
    of its own thread's forward.
    """
    sink: list[Tensor] = []
    thread = threading.get_ident()

    def hook(_module: nn.Module, _args: tuple, output) -> None:
        if threading.get_ident() != thread:  # another thread's forward of the same model
            return
        rows = output[0] if isinstance(output, tuple) else output.last_hidden_state
        if on_rows is not None:
            on_rows(rows)
        sink.append(rows)

    bb = backbone(model)
    apply_compile_settings(bb)
    handle = bb.register_forward_hook(hook)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
              logits_to_keep=1)  # fmt: skip
    finally:
        handle.remove()
    if len(sink) != 1:
        raise RuntimeError(f"capture hook fired {len(sink)} times for one forward")
    return sink[0]


def pad_lanes(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Per-lane rows [(P_i, d)] -> padded (K, P_max, d) and prompt_lens (K,)."""
    lens = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
    out = rows[0].new_zeros(len(rows), int(lens.max()), rows[0].shape[-1])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out, lens


def pack_lanes(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Per-lane rows -> packed (total_rows, d) and cumulative-sum offsets (K + 1,)."""
    counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return torch.cat(rows, dim=0), offsets


def unpack_lanes(packed: Tensor, offsets: Tensor) -> list[Tensor]:
    """Inverse of pack_lanes; checks total_rows == sum(row_count)."""
    if int(offsets[-1]) != packed.shape[0]:
        raise ValueError(f"layout says {int(offsets[-1])} rows, payload has {packed.shape[0]}")
    return [packed[int(a) : int(b)] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
