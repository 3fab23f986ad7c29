"""One padded cohort through the decoder and the vocabulary top-2: the pure, shape-static
function every CUDA graph of the torch engine records (and its eager path runs), with the
precision switch and the fused head it uses; and `sample_lanes`, the sampling lanes'
selection on the hidden states it returns. `stateblock.engines.torch_engine` holds the
engine around them (buckets, graphs, staging)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor

from stateblock.engines.base import TOP_K_SAMPLE, LaneRequest, lane_filters
from stateblock.model.decoder import ReadoutDecoder
from stateblock.model.kernels.attention import dot_precision
from stateblock.model.vocab import (
    candidate_mask,
    chunked_topk,
    first_eos,
    gumbel_noise,
    gumbel_pick,
)

MATMUL_PRECISIONS = ("highest", "high")  # torch's names: fp32, TF32 (10 mantissa bits)


@contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """torch.set_float32_matmul_precision for the block, restored after; untouched when it
    already holds. The switch is process-wide (so "high" is an opt-in, see TorchEngine), and
    a CUDA graph keeps the kernels chosen while it was recorded, so holding it over recording
    and eager runs is enough."""
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision {precision!r} is not one of {MATMUL_PRECISIONS}")
    before = torch.get_float32_matmul_precision()
    if before == precision:  # the default path: the switch is never touched
        yield
        return
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def fused_head(lm_head: Tensor, out_weight: Tensor, dtype: torch.dtype, chunk: int = 16384):
    """lm_head @ out.weight: (V, d_base) @ (d_base, d_r) -> (V, d_r), accumulated in fp64
    (exact whatever torch's TF32 switch says, and no switch flipped), then `dtype`. Chunked
    over V so the fp64 temporary stays a few hundred MB at the full scale (start-up only)."""
    w = out_weight.double()
    return torch.cat([(c.double() @ w).to(dtype) for c in lm_head.split(chunk)])


GREEDY_DTYPES = {"bfloat16": torch.bfloat16}  # fp16: torch_engine's "Greedy fast path"
GREEDY_OFF = "float32"  # greedy_dtype that keeps every cohort on the exact path


def greedy_path(
    decoder: ReadoutDecoder, lm_head: Tensor, *, fused: bool, dtype: torch.dtype | str | None
) -> tuple[ReadoutDecoder, Tensor, Tensor | None] | None:
    """The greedy fast path's (decoder, head, guess table) in `dtype`, or None (off)."""
    if dtype is None or dtype in (GREEDY_OFF, torch.float32):
        return None
    dtype = GREEDY_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in GREEDY_DTYPES.values():
        raise ValueError(
            f"greedy_dtype must be one of {sorted(GREEDY_DTYPES)} or {GREEDY_OFF!r}, not {dtype}"
        )
    fast = copy.deepcopy(decoder).to(dtype)
    head = fused_head(lm_head, decoder.out.weight, dtype) if fused else lm_head.to(dtype)
    table = fused_head(lm_head, decoder.guess_in.weight.t(), dtype) if decoder.cfg.refine else None
    return fast, head, table


def lanes_on(lanes: Sequence[LaneRequest], device: torch.device | str) -> list[LaneRequest]:
    """The lanes with their rows on `device`, each distinct rows moved once: lanes of one
    prompt (`n` > 1) read the same rows of their block (`Lane.rows_of_lane`)."""
    moved: dict[tuple[int, tuple[int, ...]], Tensor] = {}
    out = []
    for lane in lanes:
        key = (lane.rows.data_ptr(), tuple(lane.rows.shape))
        if key not in moved:
            moved[key] = lane.rows.to(device)
        out.append(replace(lane, rows=moved[key]))
    return out


def stage_lanes(lanes: Sequence[LaneRequest], rows: Tensor, lens: Tensor, depths: Tensor) -> None:
    """Copy the lanes into (K, P, d) / (K,) buffers; filler rows and lanes are zeros."""
    d_base = rows.shape[-1]
    for lane in lanes:
        if lane.rows.dim() != 2 or lane.rows.shape[1] != d_base:
            raise ValueError(f"lane rows {tuple(lane.rows.shape)} are not (P, {d_base})")
    rows.zero_()
    for i, lane in enumerate(lanes):  # over the bus in the block's dtype, widened on device
        rows[i, : lane.rows.shape[0]].copy_(lane.rows.to(rows.device))
    lens.fill_(1)  # a filler lane reads one zero row: no empty softmax, no NaN
    lens[: len(lanes)].copy_(torch.tensor([lane.rows.shape[0] for lane in lanes]))
    depths.zero_()
    depths[: len(lanes)].copy_(torch.tensor([lane.depth for lane in lanes]))


def readout_step(
    decoder: ReadoutDecoder,
    head: Tensor,  # (V, d_base) the resident lm_head, or (V, d_r) the fused head
    rows: Tensor,  # (K, P, d_base)
    prompt_lens: Tensor,  # (K,) int64
    positions: Tensor,  # (K, D) int64
    depths: Tensor,  # (K,) int64
    *,
    eos_token_id: int,
    top2_fn,
    autocast: torch.dtype | None = None,
    precision: str = "highest",
    attention: str = "sdpa",
    fused: bool = False,
    kernel_precision: str = "ieee",
    guess_table: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One padded cohort -> h (K, D, head width), top-2 values and ids (K, D, 2), EOS (K,),
    and every position's log-sum-exp over the vocabulary (K, D), from the top-2's own pass.

    Pure and shape-static: the body of every CUDA graph and of the eager path. The logits
    are h @ head.T: the decoder's hidden states against the lm_head, or, when `fused`, the
    mixer's normed output against the fused head (`fused_head`). `autocast`:
    the CUDA autocast dtype of the decoder (the top-2 runs outside it); `precision`: torch's
    fp32 matmul precision for the decoder's linears ("high" = TF32, process-wide while it
    runs; see `matmul_precision`); `attention`: the decoder's attention ("sdpa" or "fused",
    see Attention); `kernel_precision`: the fused attention kernel's dots ("tf32"/"ieee");
    `guess_table`: for a refining decoder, lm_head @ guess_in.weight.T (V, d_r), the
    embedding of every token its first guess can pick (`fused_head` builds it).
    """
    guess = None
    if decoder.cfg.refine:
        if guess_table is None:
            raise ValueError("a refining decoder needs its guess table")

        def guess(hm: Tensor) -> Tensor:  # the same top-2 as the answer's, top-1 gathered
            x = (hm if fused else decoder.out(hm)).to(head.dtype)
            k, d, dim = x.shape
            _, ids = top2_fn(x.reshape(k * d, dim), head)[:2]
            return guess_table.index_select(0, ids[:, 0]).view(k, d, -1)

    # cache_enabled=False: cached weight casts would outlive a CUDA-graph recording
    on = autocast is not None
    amp = torch.autocast("cuda", dtype=autocast or torch.float16, enabled=on, cache_enabled=False)
    with amp, matmul_precision(precision), dot_precision(kernel_precision):
        stage = decoder.mixed if fused else decoder.hidden
        h = stage(rows, prompt_lens, positions, impl=attention, guess=guess)
    h = h.to(head.dtype)
    k, d, dim = h.shape
    # (K*D, 2) fp32, int64, and the log-sum-exp (K*D,) of the same pass
    top_v, top_i, lse = top2_fn(h.reshape(k * d, dim), head, lse=True)
    top_v, top_i = top_v.view(k, d, 2), top_i.view(k, d, 2)
    valid = positions < depths.unsqueeze(1)  # (K, D): padding positions never stop a lane
    eos_pos = first_eos(top_i[..., 0], valid, eos_token_id)
    return h, top_v, top_i, eos_pos, lse.view(k, d)


def sample_lanes(
    lanes: Sequence[LaneRequest],
    sampled: list[int],
    h: Tensor,  # (Kb, D, d_base)
    tokens: Tensor,  # (K, D)
    eos: Tensor,  # (K,)
    chosen: Tensor,  # (K, D) the emitted tokens' logits
    depth: int,
    *,
    head: Tensor,
    n_chunks: int,
    eos_token_id: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked top-8 + Gumbel selection for the sampling lanes, as in the reference."""
    dev = h.device
    idx = torch.tensor(sampled, device=dev)
    temp = torch.tensor([lanes[i].temperature for i in sampled], device=dev)
    # per-lane noise from the lane's seed; gumbel_noise draws a row-major stream, so the
    # first positions match the reference's (max depth, 8) draw at any padded depth
    noise = torch.stack([gumbel_noise((depth, TOP_K_SAMPLE), lanes[i].seed) for i in sampled])
    top_v, top_i = chunked_topk(h[idx], head, n_chunks, TOP_K_SAMPLE)
    positions = torch.arange(depth, device=dev).expand(len(sampled), depth)
    keep = candidate_mask(
        top_v, top_i, temp, lane_filters([lanes[i] for i in sampled], dev), positions, eos_token_id
    )
    pick = gumbel_pick(top_v, temp, noise.to(dev), keep)  # (S, D, 1)
    picked = torch.gather(top_i, -1, pick).squeeze(-1)  # (S, D)
    depths = torch.tensor([lanes[i].depth for i in sampled], device=dev)
    valid = positions < depths.unsqueeze(1)
    tokens, eos, chosen = tokens.clone(), eos.clone(), chosen.clone()
    tokens[idx] = picked
    chosen[idx] = torch.gather(top_v, -1, pick).squeeze(-1).to(chosen.dtype)
    eos[idx] = first_eos(picked, valid, eos_token_id)
    return tokens, eos, chosen
