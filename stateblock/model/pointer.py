"""Where the base looks as it starts its answer: every attention head's probabilities from each
prompt's last position, taken during the capture's one forward.

A head that copies attends where its copy begins (on the prose base, one head finds the span of
`repeat` and `next_sentence` in 0.96 of held-out prompts), which the copy head reads as a bonus
(`copy_head.CopyHead.point_bonus`). Pre-hooks on a Llama-family model's attention modules see
each layer's normed input and rotary tables; the last position's query against every key is one
(H, P) product a lane, so no attention implementation has to give up its fused kernel and no
(P, P) map is made.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from stateblock.model.capture import backbone, capture


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention module, first layer first (Llama-family layouts)."""
    layers = getattr(backbone(model), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise TypeError(f"{type(model).__name__}: no decoder layers with self_attn to read")
    return [layer.self_attn for layer in layers]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary positions in the Llama convention (halves, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def last_position_maps(
    attn: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, last: Tensor
) -> Tensor:
    """(B, H, P) float32: the attention probabilities of each head's query at position last
    (B,) over positions 0..last, from the layer's normed input hidden (B, P, d) and its rotary
    tables cos, sin (B or 1, P, head_dim)."""
    b, p, _ = hidden.shape
    hd = attn.head_dim
    lanes = torch.arange(b, device=hidden.device)
    cos, sin = cos.expand(b, -1, -1), sin.expand(b, -1, -1)
    q = attn.q_proj(hidden[lanes, last]).view(b, -1, hd)  # (B, H, hd)
    q = _rotate(q, cos[lanes, last][:, None], sin[lanes, last][:, None])
    k = attn.k_proj(hidden).view(b, p, -1, hd)  # (B, P, H_kv, hd)
    k = _rotate(k, cos[:, :, None], sin[:, :, None])
    k = k.repeat_interleave(q.shape[1] // k.shape[2], dim=2)  # (B, P, H, hd): grouped queries
    s = torch.einsum("bhd,bphd->bhp", q.float(), k.float()) * attn.scaling
    after = torch.arange(p, device=hidden.device).view(1, 1, p) > last.view(b, 1, 1)
    return s.masked_fill(after, float("-inf")).softmax(-1)


@contextlib.contextmanager
def recording(model: nn.Module, last: Tensor) -> Iterator[list[Tensor]]:
    """While open, each forward of `model` on this thread appends every layer's
    `last_position_maps` (B, H, P) to the yielded list, first layer first."""
    sink: list[Tensor] = []
    thread = threading.get_ident()

    def hook(attn: nn.Module, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != thread:  # another thread's forward of the same model
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        sink.append(last_position_maps(attn, hidden, cos, sin, last))

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True) for m in attention_modules(model)
    ]
    try:
        yield sink
    finally:
        for h in handles:
            h.remove()


def map_count(model: nn.Module) -> int:
    """How many maps `capture_pointing` gives a lane: one per layer and attention head."""
    return len(attention_modules(model)) * model.config.num_attention_heads


@torch.no_grad()
def capture_pointing(
    model: nn.Module,
    input_ids: Tensor,
    prompt_lens: Tensor,
    attention_mask: Tensor | None = None,
    *,
    maps: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """One forward: the final hidden rows (B, P, d_base), as `capture` gives them, and with
    `maps` the base's attention maps from each prompt's last position (B, L * H, P) float32,
    zero past it (None without). input_ids right-padded, prompt_lens (B,)."""
    if not maps:
        return capture(model, input_ids, attention_mask), None
    with recording(model, (prompt_lens - 1).to(input_ids.device)) as sink:
        rows = capture(model, input_ids, attention_mask)
    if len(sink) != len(attention_modules(model)):
        raise RuntimeError(f"{len(sink)} attention maps recorded for one forward")
    return rows, torch.cat(sink, dim=1)
