"""Vocabulary-side stages of the readout: chunked projection, running top-k, EOS scan, sampling.

Pure tensor functions with fixed chunk counts, so they export to ONNX and compile as-is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# re-exported: the decoder's outputs speak them
from stateblock.protocol.sampling import NO_EOS, TOP_K_SAMPLE  # noqa: F401


class ReadoutOut(NamedTuple):
    tokens: Tensor  # (K, D) int64: the emitted ids (top-1, or the sampled id)
    top1: Tensor  # (K, D) int64
    top2: Tensor  # (K, D) int64
    margin: Tensor  # (K, D) float32: top-1 minus top-2 logit
    eos_pos: Tensor  # (K,) int64: first EOS among valid positions, else NO_EOS
    # exact log-probabilities under the raw logits (before temperature and filters), as
    # vLLM reports them by default; the runner-up's is top1_logprob - margin
    top1_logprob: Tensor  # (K, D) float32
    token_logprob: Tensor  # (K, D) float32: of the emitted token


def chunk_bounds(vocab: int, n_chunks: int) -> list[tuple[int, int]]:
    # ceil without negation: under ONNX tracing vocab is a traced size, and the TorchScript
    # exporter turns floor division of a negative int into truncation (chunk ends one short)
    size = (vocab + n_chunks - 1) // n_chunks
    return [(s, min(s + size, vocab)) for s in range(0, vocab, size)]


def chunked_topk(h: Tensor, lm_head: Tensor, n_chunks: int, k: int) -> tuple[Tensor, Tensor]:
    """Top-k of h @ lm_head.T without the full (..., V) logits ever resident.

    h (K, D, d), lm_head (V, d) -> values (K, D, k) descending, ids (K, D, k) int64.
    Each chunk's top-k is merged into the running top-k; only a (K, D, V/n_chunks)
    slab exists at a time.
    """
    v, i, _ = chunked_topk_lse(h, lm_head, n_chunks, k)
    return v, i


def chunked_topk_lse(
    h: Tensor, lm_head: Tensor, n_chunks: int, k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """`chunked_topk` plus the log-sum-exp of every row's logits (K, D) float32, folded
    chunk by chunk in the same pass (online softmax): a logit's exact log-probability is
    then logit - lse, and the full logits are still never resident."""
    run_v: Tensor | None = None
    run_i: Tensor | None = None
    run_m: Tensor | None = None  # running max (K, D), fp32
    run_s: Tensor | None = None  # running sum of exp(logit - run_m)
    for lo, hi in chunk_bounds(lm_head.shape[0], n_chunks):
        logits = torch.matmul(h, lm_head[lo:hi].t())  # (K, D, Vc)
        kc = min(k, hi - lo)
        v, i = torch.topk(logits, kc, dim=-1)
        i = i + lo
        m = v[..., 0].float()  # the chunk's max is its top-1
        s = torch.exp(logits.float() - m.unsqueeze(-1)).sum(-1)
        if run_v is None:
            run_v, run_i, run_m, run_s = v, i, m, s
            continue
        new_m = torch.maximum(run_m, m)
        run_s = run_s * torch.exp(run_m - new_m) + s * torch.exp(m - new_m)
        run_m = new_m
        cat_v = torch.cat([run_v, v], dim=-1)  # running ids are lower: on ties they win,
        cat_i = torch.cat([run_i, i], dim=-1)  # as in a full-vocabulary topk
        run_v, sel = torch.topk(cat_v, min(k, cat_v.shape[-1]), dim=-1)
        run_i = torch.gather(cat_i, -1, sel)
    assert run_v is not None and run_i is not None and run_m is not None and run_s is not None
    return run_v, run_i, run_m + torch.log(run_s)


def first_eos(tokens: Tensor, valid: Tensor, eos_token_id: Tensor | int) -> Tensor:
    """First valid position whose token is EOS, else NO_EOS. (K, D) -> (K,)."""
    d = tokens.shape[-1]
    idx = torch.arange(d, device=tokens.device).expand_as(tokens)
    hit = (tokens == eos_token_id) & valid
    return torch.where(hit, idx, torch.full_like(idx, NO_EOS)).min(dim=-1).values


class Filters(NamedTuple):
    """Per-lane candidate filters (each (K,)); the defaults keep every candidate."""

    top_k: Tensor  # int64, 0 = all
    top_p: Tensor  # float32, 1 = all
    min_p: Tensor  # float32, 0 = all
    min_tokens: Tensor  # int64, EOS suppressed at positions < min_tokens


def no_filters(k: int, device=None) -> Filters:
    return Filters(
        torch.zeros(k, dtype=torch.int64, device=device),
        torch.ones(k, dtype=torch.float32, device=device),
        torch.zeros(k, dtype=torch.float32, device=device),
        torch.zeros(k, dtype=torch.int64, device=device),
    )


def candidate_mask(
    top_v: Tensor,  # (K, D, k) sorted descending
    top_i: Tensor,  # (K, D, k)
    temperature: Tensor,  # (K,)
    filters: Filters,
    positions: Tensor,  # (K, D)
    eos_token_id: Tensor | int,
) -> Tensor:
    """(K, D, k) bool: the candidates a lane may emit, in vLLM's order: EOS masked before
    min_tokens, then top-k among the rest, then top-p over the survivors' probabilities
    (renormalised: the top-k candidates are all the readout keeps), then min-p (a ratio to
    the best, which renormalising leaves unchanged). The best survivor is always kept."""
    k = top_v.shape[-1]
    early = positions < filters.min_tokens.view(-1, 1)  # (K, D)
    keep = ~((top_i == eos_token_id) & early.unsqueeze(-1))
    rank = torch.cumsum(keep.to(torch.int64), dim=-1) - 1  # rank among the kept
    kk = torch.where(filters.top_k > 0, filters.top_k, torch.full_like(filters.top_k, k))
    keep = keep & (rank < kk.view(-1, 1, 1))
    t = torch.clamp(temperature.to(torch.float32), min=1e-6).view(-1, 1, 1)
    logits = torch.where(keep, top_v.to(torch.float32) / t, torch.full_like(t, float("-inf")))
    prob = torch.softmax(logits, dim=-1)  # (K, D, k), 0 where dropped
    before = torch.cumsum(prob, dim=-1) - prob  # mass of the better survivors
    top_p = filters.top_p.to(torch.float32).view(-1, 1, 1)
    keep = keep & ((before < top_p) | (top_p >= 1.0))
    best = prob.max(dim=-1, keepdim=True).values
    min_p = filters.min_p.to(torch.float32).view(-1, 1, 1)
    return keep & ((prob >= min_p * best) | (min_p <= 0.0))


def gumbel_pick(
    top_v: Tensor,
    temperature: Tensor,
    noise: Tensor,
    keep: Tensor | None = None,
) -> Tensor:
    """Top-k Gumbel-max sampling with explicit noise; temperature 0 is exact argmax.

    top_v (K, D, k) sorted descending; temperature (K,); noise (K, D, k) standard Gumbel;
    keep (K, D, k) bool, the candidates allowed (`candidate_mask`). Returns the picked
    candidate's index (K, D, 1).
    """
    t = temperature.to(top_v.dtype).view(-1, 1, 1)  # (K, 1, 1)
    k = top_v.shape[-1]
    scores = top_v / torch.clamp(t, min=1e-6) + noise[..., :k].to(top_v.dtype)
    # where t == 0 the scores are the sorted logits themselves: argmax is index 0, the top-1
    scores = torch.where(t > 0, scores, top_v)
    if keep is not None:  # at t == 0 the first allowed candidate: the filtered argmax
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.argmax(scores, dim=-1, keepdim=True)  # (K, D, 1)


def gumbel_select(
    top_v: Tensor,
    top_i: Tensor,
    temperature: Tensor,
    noise: Tensor,
    keep: Tensor | None = None,
) -> Tensor:
    """The ids `gumbel_pick` picks: (K, D)."""
    return torch.gather(top_i, -1, gumbel_pick(top_v, temperature, noise, keep)).squeeze(-1)


def gumbel_noise(shape: tuple[int, ...], seed: int | None, device=None) -> Tensor:
    """Standard Gumbel noise; a seed makes it (and so the sampled answer) reproducible."""
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    u = torch.rand(shape, generator=gen).clamp_(1e-10, 1.0 - 1e-7)
    return (-torch.log(-torch.log(u))).to(device)


def distinct_n(tokens: list[int], n: int = 4) -> float | None:
    """Distinct n-grams over all n-grams of one answer; None when it has fewer than n tokens."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None
