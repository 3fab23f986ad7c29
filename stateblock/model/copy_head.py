"""The readout's copy head: answer tokens pointed at in the prompt, beside the vocabulary.

A readout reaches a prompt token only through a captured row, whose final hidden state is the
base's guess at the token after it, so answers that repeat a span of the prompt are spelled
badly. The copy head scores every prompt position for every answer position (queries from the
readout's state, keys from the decoder's projected row plus the lm_head rows of the row's
token and of the one before it, rotary positions on both sides) and mixes:

    gate      g * softmax(vocab) + (1 - g) * softmax(positions), g a learned sigmoid
    joint     one softmax over [vocab logits ; position scores]: a token's positions add up
    twin      joint, plus a second score per position for the row's token without its leading
              space (a byte-level BPE spells a word that starts an answer without it: " the"
              in a passage is `the` after `<ans>`), where the vocabulary has that spelling
    gatetwin  gate, its position softmax over twin's two scores a position

With `guess` G > 0, the base's own G likeliest first answer tokens (its last row through the
lm_head: the teacher's greedy answer starts with the first of them) join the candidates, each
scored from the readout's state, the token's lm_head row and the last row, plus a learned
multiple of the base's log-probability of it; their key sits at position 0, so the rotary
query learns at which answer positions the base's guess applies.

With `follow`, a refinement pass's position scores gain two learned bonuses: where the prompt
token before a position is the previous pass's token one answer position back (or its twin),
and where the two tokens before it match the previous pass's two; an induction head made
explicit, so a span once entered is followed token by token. Position t reads the previous
pass at t-1 and t-2 only: prefix-causal still holds.

With `span`, a refinement pass's position scores also gain a learned multiple of the previous
pass's consensus on where a copied span starts: each answer position t' <= t votes for the
start p' - t' with its copy probability of position p', and position p at t gets the mean
vote for start p - t. An answer that copies one contiguous span then points at the same
diagonal from every position, however common its tokens; prefix-causal still holds.

With `match`, every pass's position scores gain learned bonuses by how long a run of tokens
just before the span's start repeats elsewhere in the prompt (`repeat_runs`): at answer
position t, position p reads the runs ending one and two tokens before p - t. A passage
quoted in the instruction marks where it ends in the passage, and the text after it there is
what `next_sentence` copies; the quote's own last token may merge with its closing mark, so
the run ending two tokens back counts too. A function of the prompt and t alone. With
`match_ends`, a run that stops there (the next position's run is no longer: `run_ends`)
gets bonuses of its own: a quote longer than `match` tokens saturates the run over its last
stretch, and only its end is followed by the copied text.

With `point` A > 0, every pass's position scores gain where the base itself looks as it starts
its answer: A maps of its attention from the prompt's last position (one a head,
`stateblock.model.pointer`), mixed by a learned softmax over the heads into one distribution,
read as a log-probability at the span's start p - t (and a second mixture at the token before
it), times a learned weight. A head that copies attends where its copy begins; on the prose
base one head finds the span of `repeat` and `next_sentence` in 0.96 of held-out prompts. A
weight a head would put the maps' log-probabilities on a scale of ten nats, which the
bonuses' rate turns into noise; a mixture of distributions keeps one scalar for the scale.

A pass's mixture is a `parts` tuple: ("base", logits) without a copy head, ("gate", logits,
g, attention, ids) or ("joint", logits, scores, ids), with ids (K, C) the token each scored
candidate stands for. `log_probs` builds the (K, D, V) mixture (training, small vocabularies);
`target_log_probs` gathers the loss's terms without it; `mixture_topk` serves a mixture's
top-k from the vocabulary's chunked top-k and log-sum-exp, so no (K, D, V) tensor is resident.
docs/QUALITY.md has the ablation that chose `twin`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from stateblock.model.rotary import rope_tables, rotate

MODES = ("gate", "joint", "twin", "gatetwin")
SPACE = "\u0120"  # the byte-level BPE's mark of a leading space
NEG = float("-inf")


def space_twins(vocab: dict[str, int], size: int | None = None) -> Tensor:
    """(V,) the id of each token's spelling without its leading space, -1 where the token has
    no leading space or the vocabulary lacks the shorter spelling."""
    twins = torch.full((size or max(vocab.values()) + 1,), -1, dtype=torch.long)
    for text, i in vocab.items():
        if text.startswith(SPACE) and text[1:] in vocab and i < twins.shape[0]:
            twins[i] = vocab[text[1:]]
    return twins


def token_pairs(head: Tensor, ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The lm_head rows of each prompt token and of the token before it (zeros before the
    first), in `dtype`: ids (K, P) -> (K, P, d_base) each."""
    emb = head[ids].to(dtype)
    return emb, torch.cat([torch.zeros_like(emb[:, :1]), emb[:, :-1]], dim=1)


def base_guess(last: Tensor, head: Tensor, g: int) -> tuple[Tensor, Tensor]:
    """The base's top-g first answer tokens and their log-probabilities, in fp32: last
    (K, d_base) the prompt's last row -> ids (K, g), log-probs (K, g)."""
    lp = (last.float() @ head.float().t()).log_softmax(-1)  # (K, V)
    v, i = lp.topk(g, dim=-1)
    return i, v


def position_probs(a: Tensor, p: int, twin: bool) -> Tensor:
    """A pass's copy probabilities over its P prompt positions (K, D, P), from its candidate
    scores a (K, D, C): a softmax over the positions' scores (both spellings with twins,
    folded), vocabulary and guesses left out."""
    pr = a[..., : 2 * p if twin else p].float().softmax(-1)
    return pr[..., :p] + pr[..., p:] if twin else pr


def span_vote(pos: Tensor) -> Tensor:
    """(K, D, P): at answer position t and prompt position p, the mean over t' <= t of the
    copy probability pos (K, D, P) that position t' gave to p - t + t' (the start p - t, 0
    where p < t or p - t + t' is past the prompt)."""
    _, d, p = pos.shape
    t = torch.arange(d, device=pos.device).view(-1, 1)
    start = torch.arange(p, device=pos.device).view(1, -1)
    at = start + t  # (D, P): position t' reads start s at s + t'
    on_start = pos.gather(-1, at.clamp_max(p - 1).expand_as(pos)) * (at < p)  # (K, D, S)
    mean = on_start.cumsum(1) / (t + 1)  # (K, D, S): the vote of positions 0..t
    back = start - t  # (D, P): position p at t is start p - t
    return mean.gather(-1, back.clamp_min(0).expand_as(mean)) * (back >= 0)


def repeat_runs(ids: Tensor, lens: Tensor, most: int) -> Tensor:
    """(K, P): at each position p, how many tokens just before p (at most `most`) also stand,
    in order, just before some other position q of the prompt: ids (K, P), lens (K,)."""
    k, p = ids.shape
    valid = torch.arange(p, device=ids.device).view(1, -1) < lens.view(-1, 1)  # (K, P)
    eq = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    eq &= ~torch.eye(p, dtype=torch.bool, device=ids.device)  # (K, P, Q), never p itself
    alive = torch.ones_like(eq)
    runs = torch.zeros(k, p, dtype=torch.long, device=ids.device)
    for n in range(1, min(most, p) + 1):  # alive[p, q]: the n tokens before p and q agree
        alive[:, n:, n:] &= eq[:, :-n, :-n]
        alive[:, n - 1, :] = False  # fewer than n tokens before p or q
        alive[:, :, n - 1] = False
        runs += alive.any(-1)  # the longest run over q is >= n
    return runs


def run_ends(runs: Tensor, most: int) -> Tensor:
    """(K, P) bool: a run ends at p - 1 and goes no further (the run ending at p is not
    longer, nor are both `most`); runs (K, P) from `repeat_runs`; one at the last position
    ends there."""
    nxt = torch.cat([runs[:, 1:], torch.zeros_like(runs[:, :1])], -1)
    return (runs > 0) & ~((nxt > runs) | ((runs == most) & (nxt == most)))


def along_span(per: Tensor, positions: Tensor) -> Tensor:
    """(K, D, P): per (K, P) read at each answer position t for position p at p - t, the
    start of a span that reaches p at t; 0 where p - t is before the prompt."""
    start = torch.arange(per.shape[1], device=per.device) - positions[..., None]  # (K, D, P)
    got = per[:, None].expand(-1, positions.shape[1], -1).gather(-1, start.clamp_min(0))
    return got * (start >= 0)


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x (K, N, d) rotated by integer positions (K, N)."""
    cos, sin = rope_tables(positions, x.shape[-1], theta)
    return rotate(x, cos, sin)


class CopyHead(nn.Module):
    def __init__(
        self,
        d_r: int,
        d_base: int,
        mode: str,
        theta: float = 10000.0,
        bias: float | None = None,
        guess: int = 0,
        follow: bool = False,
        span: bool = False,
        match: int = 0,
        match_ends: bool = False,
        point: int = 0,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"copy mode {mode!r}: choose from {MODES}")
        self.mode, self.d, self.theta = mode, d_r, theta
        self.gated, self.twin = mode in ("gate", "gatetwin"), mode in ("twin", "gatetwin")
        self.q = nn.Linear(d_r, d_r, bias=False)
        self.k = nn.Linear(d_r, d_r, bias=False)
        self.tok = nn.Linear(d_base, d_r, bias=False)  # the row's own token
        self.prev = nn.Linear(d_base, d_r, bias=False)  # the token before it: induction
        if self.gated:
            self.gate = nn.Linear(d_r, 1)
        # joint, twin: a learned offset of every position's score against the vocabulary's
        # logits, from `bias` (none without one)
        self.bias = None if bias is None or self.gated else nn.Parameter(torch.tensor(bias))
        if self.twin:
            self.q_twin = nn.Linear(d_r, d_r, bias=False)
        self.n_guess = guess
        if guess:  # the base's own top-G first tokens as candidates
            self.q_guess = nn.Linear(d_r, d_r, bias=False)
            self.g_row = nn.Linear(d_r, d_r, bias=False)  # the prompt's last row
            self.g_lp = nn.Parameter(torch.tensor(1.0))  # weight of the base's log-prob
        self.follow = follow
        if follow:  # bonuses of a one-token and a two-token match with the previous pass
            self.w_follow = nn.Parameter(torch.tensor([2.0, 2.0]))
        self.span = span
        if span:  # the weight of the previous pass's vote on a span's start
            self.w_span = nn.Parameter(torch.tensor(4.0))
        self.match, self.match_ends = match, match_ends
        if match:  # a bonus by repeated run length (0..match), ending 1 and 2 tokens back;
            # with match_ends, a second row of them for the runs that stop there
            self.w_match = nn.Parameter(torch.zeros(2, (1 + match_ends) * (match + 1)))
        self.n_point = point
        if point:  # each map's share of the mixtures at a span's start and the token before,
            # and each mixture's weight
            self.w_point = nn.Parameter(torch.zeros(2, point))
            self.w_point_scale = nn.Parameter(torch.zeros(2))

    def scores(
        self, h, rows, ids, lens, head, positions, twins, guess=None, prev=None, runs=None,
        point=None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """(scores (K, D, C), candidate ids (K, C)): h (K, D, d_r) the pass's normed state,
        rows (K, P, d_r) the decoder's projected rows, ids (K, P) the prompt (padding past
        lens (K,)), head (V, d_base), positions (K, D), twins (V,), guess the base's guess
        (ids (K, G), log-probs (K, G), the last projected row (K, d_r); with n_guess), prev
        what the previous pass read (tokens (K, D), position probabilities (K, D, P) or None;
        with follow or span; None in the first pass), runs the prompt's `repeat_runs` (K, P)
        (with match; the same for every pass, so computed once a forward), point the base's
        attention maps (K, A, P) (with n_point: `pointer.capture_pointing`). C is P, 2P with
        twins, plus G; a padding position or a missing twin scores -inf (its id is then 0)."""
        emb, before = token_pairs(head, ids, h.dtype)  # (K, P, d_base) each
        k, p = ids.shape
        idx = torch.arange(p, device=ids.device)
        key = rope(self.k(rows.to(h.dtype)) + self.tok(emb) + self.prev(before),
                   idx.expand(k, -1), self.theta)  # fmt: skip
        key = key.transpose(1, 2) / math.sqrt(self.d)  # (K, d_r, P)
        off = 0.0 if self.bias is None else self.bias

        def score(q: nn.Linear) -> Tensor:  # (K, D, P), both sides rotated
            return rope(q(h), positions, self.theta) @ key + off

        valid = (idx.view(1, -1) < lens.view(-1, 1))[:, None]  # (K, 1, P)
        a, cand = score(self.q).masked_fill(~valid, NEG), ids
        if self.follow and prev is not None:
            a = a + self.follow_bonus(ids, twins, prev[0]).to(a.dtype)
        vote = None  # what both spellings of a position gain
        if self.span and prev is not None:
            vote = self.w_span * span_vote(prev[1]).to(a.dtype)  # (K, D, P)
        if self.match:
            if runs is None:
                raise ValueError("this copy head reads the prompt's repeated runs: pass `runs`")
            m = self.match_bonus(runs, positions).to(a.dtype)
            vote = m if vote is None else vote + m
        if self.n_point:
            if point is None:
                raise ValueError("this copy head reads the base's attention maps: pass `point`")
            m = self.point_bonus(point, positions).to(a.dtype)
            vote = m if vote is None else vote + m
        if vote is not None:
            a = a + vote
        if self.twin:
            tw = twins[ids]  # (K, P)
            b = score(self.q_twin).masked_fill(~valid | (tw < 0)[:, None], NEG)
            b = b if vote is None else b + vote
            a, cand = torch.cat([a, b], -1), torch.cat([ids, tw.clamp_min(0)], -1)
        if self.n_guess:
            if guess is None:
                raise ValueError("this copy head scores the base's guess: pass `guess`")
            g = self.guess_scores(h, head, positions, *guess) + off
            a, cand = torch.cat([a, g], -1), torch.cat([cand, guess[0]], -1)
        return a, cand

    def follow_bonus(self, ids: Tensor, twins: Tensor, prev: Tensor) -> Tensor:
        """(K, D, P): w0 where the prompt token before position p is the previous pass's
        token at t-1 (as spelled, or its twin), plus w1 where the two before p are its two at
        t-1 and t-2. ids (K, P) the prompt, prev (K, D)."""

        def back(x: Tensor, n: int, fill: int) -> Tensor:  # x shifted n along its last dim
            return torch.cat([torch.full_like(x[:, :n], fill), x[:, :-n]], -1)

        def match(n: int) -> Tensor:  # prompt token at p-n vs the pass's token at t-n
            p, t = back(ids, n, -1), back(prev, n, -2)[..., None]  # (K, P), (K, D, 1)
            return (p[:, None] == t) | (back(twins[ids], n, -1)[:, None] == t)

        one = match(1)
        two = one & match(2)
        return self.w_follow[0] * one + self.w_follow[1] * two

    def match_bonus(self, runs: Tensor, positions: Tensor) -> Tensor:
        """(K, D, P): at answer position t, w[0][run ending at p - t - 1] + w[1][run ending
        at p - t - 2] (runs (K, P): `repeat_runs`, the run ending at p - 1; 0 where p - t is
        before the prompt)."""
        idx = runs
        if self.match_ends:  # runs that stop there index their own bonuses
            idx = runs + (self.match + 1) * run_ends(runs, self.match).long()
        two = torch.cat([torch.zeros_like(idx[:, :1]), idx[:, :-1]], -1)  # ending at p - 2
        return along_span(self.w_match[0][idx] + self.w_match[1][two], positions)

    def point_bonus(self, point: Tensor, positions: Tensor) -> Tensor:
        """(K, D, P): at answer position t, s0 log M0(p - t) + s1 log M1(p - t - 1), M_i the
        base's attention maps point (K, A, P) mixed by softmax(w_point[i]), s the scales."""
        mix = torch.einsum("ia,kap->kip", self.w_point.softmax(-1), point.float())  # (K, 2, P)
        logm = mix.clamp_min(1e-6).log()
        before = torch.cat([torch.full_like(logm[:, 1, :1], math.log(1e-6)), logm[:, 1, :-1]], -1)
        per = self.w_point_scale[0] * logm[:, 0] + self.w_point_scale[1] * before
        return along_span(per, positions)

    def guess_scores(self, h, head, positions, gids, glp, last) -> Tensor:
        """(K, D, G): the base's guesses gids (K, G) scored at every answer position; the key
        unrotated (position 0), so the query's rotation alone says how far into the answer."""
        key = self.g_row(last.to(h.dtype))[:, None] + self.tok(head[gids].to(h.dtype))
        q = rope(self.q_guess(h), positions, self.theta)  # (K, D, d_r)
        return q @ key.transpose(1, 2) / math.sqrt(self.d) + self.g_lp * glp[:, None].to(q.dtype)

    def forward(
        self, h, vocab_logits, rows, ids, lens, head, positions, twins, guess=None, prev=None,
        runs=None, point=None,
    ):  # fmt: skip
        """One pass's parts (see the module's doc) from its vocabulary logits (K, D, V)."""
        a, cand = self.scores(h, rows, ids, lens, head, positions, twins, guess, prev, runs,
                              point)  # fmt: skip
        if self.gated:
            return ("gate", vocab_logits, self.gate(h), a.softmax(-1), cand)
        return ("joint", vocab_logits, a, cand)


def log_probs(parts: tuple) -> Tensor:
    """The mixture's log-probabilities over the vocabulary (K, D, V)."""
    if parts[0] == "base":
        return parts[1].log_softmax(-1)
    if parts[0] == "gate":
        _, lv, g, attn, ids = parts
        lv, g, attn = lv.float(), g.float(), attn.float()
        copy = torch.zeros_like(lv).scatter_add(-1, ids[:, None].expand_as(attn), attn)
        mix = torch.sigmoid(g) * lv.softmax(-1) + torch.sigmoid(-g) * copy
        return mix.clamp_min(1e-30).log()
    _, lv, a, ids = parts
    lv, a = lv.float(), a.float()
    lse = torch.logsumexp(torch.cat([lv, a], -1), -1, keepdim=True)
    copy = torch.zeros_like(lv).scatter_add(-1, ids[:, None].expand_as(a), (a - lse).exp())
    return ((lv - lse).exp() + copy).clamp_min(1e-30).log()


def target_log_probs(parts: tuple, tgt: Tensor) -> Tensor:
    """log p(target) of a copy mixture (K, D), gathered: no (K, D, V) mixture built."""
    t = tgt.clamp_min(0)
    lv, ids = parts[1].float(), parts[-1]  # a bf16 autocast's logits: the loss in fp32
    hit = ids[:, None, :] == t[..., None]  # (K, D, C): the candidates standing for the target
    if parts[0] == "gate":
        g, attn = parts[2].squeeze(-1).float(), parts[3].float()
        lvt = lv.log_softmax(-1).gather(-1, t[..., None]).squeeze(-1)
        ct = (attn * hit).sum(-1).clamp_min(1e-30).log()
        return torch.logaddexp(F.logsigmoid(g) + lvt, F.logsigmoid(-g) + ct)
    a = parts[2].float()
    lse = torch.logsumexp(torch.cat([lv, a], -1), -1)
    at = a.masked_fill(~hit, NEG)
    return torch.logsumexp(torch.cat([lv.gather(-1, t[..., None]), at], -1), -1) - lse


def mixture_topk(
    top_v: Tensor,
    top_i: Tensor,
    lse_v: Tensor,
    cand_v: Tensor,
    a: Tensor,
    cand: Tensor,
    k: int,
    gate: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A copy mixture's top-k (values (K, D, k) as logits against `lse`, ids) and its
    log-sum-exp (K, D), from the vocabulary's top-k (top_v, top_i (K, D, k)) and log-sum-exp
    lse_v (K, D), the vocabulary logits of the candidates cand_v (K, D, C), their scores a
    (K, D, C) and ids cand (K, C); for a gated mixture, its gate logit (K, D, 1) (the values
    are then log-probabilities and lse 0).

    A token outside the candidates keeps its vocabulary term, monotone in its logit, so the
    mixture's top-k lies in the vocabulary's top-k and the candidates; a token's value is
    logaddexp(its vocabulary term, the log-sum-exp of its candidates' copy terms). Candidates
    repeating an earlier one or a vocabulary top-k id are dropped before the top-k (ties:
    vocabulary ids first, then the earlier position)."""
    top_v, cand_v, a = top_v.float(), cand_v.float(), a.float()
    if gate is None:  # joint: one softmax over [vocabulary ; candidates]
        lse = torch.logaddexp(lse_v.float(), torch.logsumexp(a, -1))
    else:  # g * softmax(vocabulary) + (1 - g) * softmax(candidates), in log space
        on, off = F.logsigmoid(gate.float()), F.logsigmoid(-gate.float())
        top_v, cand_v = on + top_v - lse_v[..., None], on + cand_v - lse_v[..., None]
        a, lse = off + a.log_softmax(-1), torch.zeros_like(lse_v, dtype=torch.float32)
    amax = a.amax(-1, keepdim=True).clamp_min(-1e30)  # all -inf (no prompt): keep it finite
    ea = torch.exp(a - amax)  # (K, D, C)
    same = (cand[:, :, None] == cand[:, None, :]).to(ea.dtype)  # (K, C, C)
    mass = torch.log(ea @ same) + amax  # (K, D, C): each candidate's token's whole copy mass
    cand_mix = torch.logaddexp(cand_v, mass)
    in_top = top_i[..., :, None] == cand[:, None, None, :]  # (K, D, k, C)
    top_mass = torch.log((in_top * ea[:, :, None, :]).sum(-1)) + amax  # (K, D, k)
    top_mix = torch.logaddexp(top_v, top_mass)
    earlier = torch.ones_like(same, dtype=torch.bool).tril(-1)  # [p, p']: p' < p
    dup = ((same > 0) & earlier).any(-1)[:, None].expand_as(a) | in_top.any(-2)  # (K, D, C)
    vals = torch.cat([top_mix, cand_mix.masked_fill(dup, NEG)], -1)
    ids = torch.cat([top_i, cand[:, None].expand_as(a)], -1)
    v, sel = torch.topk(vals, k, dim=-1)
    return v, torch.gather(ids, -1, sel), lse
