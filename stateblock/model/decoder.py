"""The readout decoder: a whole answer block read from one captured forward state.

One execution, no loop over answer positions: captured rows are pooled into M latent
slots, repaired twice, and every answer position (a functional sinusoid of its index)
attends over [latents ; earlier answer positions] before a chunked projection against
the base model's resident lm_head picks the top-2 tokens. docs/ARCHITECTURE.md places it among the engines.

Two options (docs/QUALITY.md has their ablations): `row_attn`, where each mixer layer also
attends to every captured row, with row positions counted from both ends of the prompt
(a copied or reversed span is then one fixed offset away); and `refine`, a fixed number of
in-graph passes in which the first guess re-enters as token embeddings (the lm_head rows
of the guessed ids, projected) and a second mixer stack (`n_ref_mixer` layers, by default
as many as the first) corrects it. Both keep the prefix-causal contract: position t's token
depends on positions <= t only.

Two more read the prompt's token ids beside its rows: `copy`, a copy head over the prompt's
positions mixed with the vocabulary (`stateblock.model.copy_head`), and `row_tokens`, each row
given its own token and the one before it (`pass_parts` trains them, `forward(...,
prompt_ids=)` serves them; `stateblock.model.id_reading` holds those paths). Their blocks
carry the ids (Lane.prompt_token_ids); the reference engine serves them, the torch and ONNX
engines refuse them at start-up.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from stateblock.model.copy_head import MODES as COPY_MODES
from stateblock.model.copy_head import (
    CopyHead,
    base_guess,
    repeat_runs,
    token_pairs,
)
from stateblock.model.id_reading import GuessFn, IdReading
from stateblock.model.layers import Block, PrefixCausal, RMSNorm, Rotation
from stateblock.model.rotary import rope_tables, rotate
from stateblock.model.vocab import (
    NO_EOS,
    TOP_K_SAMPLE,
    Filters,
    ReadoutOut,
    candidate_mask,
    chunked_topk,
    chunked_topk_lse,
    first_eos,
    gumbel_pick,
)

__all__ = [
    "NO_EOS",
    "ReadoutConfig",
    "ReadoutDecoder",
    "ReadoutOut",
    "position_features",
    "rope_tables",
    "rotate",
]


def _decimal_harmonic_periods() -> tuple[float, ...]:
    # Integer periods n * 10^m: digit-structured and periodic answers (columns of numbers,
    # repeated patterns) become exactly representable at any depth, which geometric
    # (transformer-paper) frequencies only approximate and lose after a few thousand steps.
    return tuple(float(n * 10**m) for m in range(4) for n in range(2, 17) if n * 10**m <= 16384)


@dataclass
class ReadoutConfig:
    d_base: int  # hidden size of the base model (rows and lm_head width)
    vocab_size: int  # base model vocabulary (lm_head rows)
    eos_token_id: int
    d_r: int = 256  # readout width
    n_latent: int = 64  # M learned latent slots
    n_heads: int = 8
    n_mixer: int = 1  # mixer layers; the seed uses one
    mlp_ratio: int = 4
    n_chunks: int = 8  # vocabulary chunks of the projection
    pos_periods: tuple[float, ...] = field(default_factory=_decimal_harmonic_periods)
    norm_eps: float = 1e-5
    row_attn: bool = False  # mixer layers also cross-attend to every captured row
    refine: int = 0  # in-graph refinement passes over the readout's own first guess
    n_ref_mixer: int = 0  # layers of the refinement stack; 0 = n_mixer
    rope: bool = False  # rotary (relative) positions in the mixer and row attention
    rope_theta: float = 10000.0
    copy: str = ""  # a copy head's mode (stateblock.model.copy_head.MODES), "" for none
    row_tokens: bool = False  # each row also carries its own token and the one before it
    copy_guess: int = 0  # the base's top-G first tokens join the copy head's candidates
    copy_follow: bool = False  # a refinement's copy scores follow the previous pass's tokens
    copy_span: bool = False  # ... and its vote on where a copied span starts
    copy_match: int = 0  # copy scores gain a bonus by repeated runs up to this long; 0: none
    copy_match_ends: bool = False  # ... and one of their own for runs that stop there
    copy_point: int = 0  # copy scores gain a mix of this many of the base's attention maps

    def __post_init__(self) -> None:
        self.pos_periods = tuple(float(p) for p in self.pos_periods)
        if self.d_r % self.n_heads:
            raise ValueError(f"d_r={self.d_r} is not divisible by n_heads={self.n_heads}")
        if self.n_mixer < 1 or self.n_latent < 1 or self.n_chunks < 1:
            raise ValueError("n_mixer, n_latent and n_chunks must be positive")
        if self.refine < 0 or self.n_ref_mixer < 0:
            raise ValueError(f"refine={self.refine}, n_ref_mixer={self.n_ref_mixer} must be >= 0")
        if self.rope and (self.head_dim % 2 or self.n_heads < 2):
            raise ValueError("rope needs an even head dimension and at least 2 heads")
        if self.copy and self.copy not in COPY_MODES:
            raise ValueError(f"copy={self.copy!r}: choose from {COPY_MODES} or '' for none")
        if self.copy_guess < 0 or (self.copy_guess and not self.copy):
            raise ValueError(f"copy_guess={self.copy_guess} needs a copy head and must be >= 0")
        if self.copy_match < 0 or (self.copy_match and not self.copy):
            raise ValueError(f"copy_match={self.copy_match} needs a copy head and must be >= 0")
        if self.copy_match_ends and not self.copy_match:
            raise ValueError("copy_match_ends needs copy_match")
        if self.copy_point < 0 or (self.copy_point and not self.copy):
            raise ValueError(f"copy_point={self.copy_point} needs a copy head and must be >= 0")
        if (self.copy_follow or self.copy_span) and not (self.copy and self.refine):
            raise ValueError("copy_follow and copy_span need a copy head and a refinement pass")

    @property
    def head_dim(self) -> int:
        return self.d_r // self.n_heads

    @property
    def ref_layers(self) -> int:
        return self.n_ref_mixer or self.n_mixer

    @property
    def n_pos_features(self) -> int:
        return 2 * len(self.pos_periods)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pos_periods"] = list(self.pos_periods)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ReadoutConfig:
        return cls(**{k: (tuple(v) if k == "pos_periods" else v) for k, v in d.items()})


def position_features(positions: Tensor, periods: Tensor) -> Tensor:
    """Sinusoids of integer position indices. (..., ) -> (..., 2 * n_periods)."""
    pos = positions.to(torch.float32).unsqueeze(-1)  # (..., 1)
    # reduce modulo the period first: the phase stays exact for any depth in fp32
    phase = torch.remainder(pos, periods) / periods  # (..., n_periods)
    angle = phase * (2.0 * math.pi)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)


class Context(NamedTuple):
    """What every answer position reads: the repaired latents and the projected rows."""

    lat: Tensor  # (K, M, d_r)
    rows: Tensor  # (K, P, d_r) rows in readout width, positions from both ends added
    row_mask: Tensor  # (K, 1, 1, P) bool, True = a real row of the lane's prompt
    prompt_lens: Tensor  # (K,)
    prompt_ids: Tensor | None = None  # (K, P) the prompt's tokens: a copy head points at them
    guess: tuple | None = None  # the base's top-G first tokens (copy_head.base_guess) + last row
    runs: Tensor | None = None  # (K, P) with copy_match: the prompt's copy_head.repeat_runs
    point: Tensor | None = None  # (K, A, P) with copy_point: pointer.capture_pointing's maps


class ReadoutDecoder(IdReading, nn.Module):
    def __init__(self, cfg: ReadoutConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer(
            "periods", torch.tensor(cfg.pos_periods, dtype=torch.float32), persistent=False
        )
        # context pooling and projection: d_base -> d_r, then M slots attend over the rows
        self.ctx_in = nn.Linear(cfg.d_base, cfg.d_r, bias=False)
        self.ctx_pos = nn.Linear(cfg.n_pos_features, cfg.d_r, bias=False)
        self.latent = nn.Parameter(torch.randn(cfg.n_latent, cfg.d_r) * 0.02)
        self.pool = Block(cfg)
        # two-stage latent repair: residual self-attention refinements of the latent
        self.repair = nn.ModuleList([Block(cfg) for _ in range(2)])
        # answer positions: a linear map of functional sinusoids, no position table
        self.pos_in = nn.Linear(cfg.n_pos_features, cfg.d_r, bias=False)
        self.mixer = nn.ModuleList([Block(cfg) for _ in range(cfg.n_mixer)])
        self.norm_out = RMSNorm(cfg.d_r, cfg.norm_eps)
        self.out = nn.Linear(cfg.d_r, cfg.d_base, bias=False)
        if cfg.row_attn:
            # a row's distance from the prompt's end: reversal and suffix reads become one
            # fixed offset away, which the sinusoids turn into one fixed rotation
            self.ctx_end = nn.Linear(cfg.n_pos_features, cfg.d_r, bias=False)
            self.row_cross = nn.ModuleList([Block(cfg) for _ in range(cfg.n_mixer)])
        if cfg.refine:
            # the guessed tokens enter through the lm_head's own rows (no vocabulary-sized
            # table of the decoder's): embedding = guess_in(lm_head[id])
            self.guess_in = nn.Linear(cfg.d_base, cfg.d_r, bias=False)
            self.ref_mixer = nn.ModuleList([Block(cfg) for _ in range(cfg.ref_layers)])
            if cfg.row_attn:
                self.ref_cross = nn.ModuleList([Block(cfg) for _ in range(cfg.ref_layers)])
            self.ref_norm = RMSNorm(cfg.d_r, cfg.norm_eps)
        if cfg.row_tokens:  # the lm_head rows of a row's token and of the token before it,
            # from zero: the decoder starts as it would without them and learns to read them
            self.row_tok = nn.Linear(cfg.d_base, cfg.d_r, bias=False)
            self.row_prev = nn.Linear(cfg.d_base, cfg.d_r, bias=False)
            nn.init.zeros_(self.row_tok.weight)
            nn.init.zeros_(self.row_prev.weight)
        if cfg.copy:
            self.copy_head = CopyHead(cfg.d_r, cfg.d_base, cfg.copy, cfg.rope_theta,
                                      guess=cfg.copy_guess, follow=cfg.copy_follow,
                                      span=cfg.copy_span, match=cfg.copy_match,
                                      match_ends=cfg.copy_match_ends,
                                      point=cfg.copy_point)  # fmt: skip
            # each token's spelling without its leading space (copy_head.space_twins, from
            # the tokenizer when the decoder is made): saved with the weights, so the
            # decoder's digest binds it
            self.register_buffer("twins", torch.full((cfg.vocab_size,), -1, dtype=torch.long))

    # -- pure stages -------------------------------------------------------------------
    def context(
        self,
        rows: Tensor,
        prompt_lens: Tensor,
        impl: str = "sdpa",
        prompt_ids: Tensor | None = None,
        lm_head: Tensor | None = None,
        point: Tensor | None = None,
    ) -> Context:
        """Captured rows -> repaired latents and projected rows. rows (K, P, d_base), prompt_lens (K,);
        with row_tokens, prompt_ids (K, P) and the lm_head (V, d_base) that spells them; with
        copy_point, the base's attention maps point (K, A, P)."""
        if self.cfg.copy_point and (point is None or point.shape[1] != self.cfg.copy_point):
            got = None if point is None else tuple(point.shape)
            raise ValueError(f"this decoder reads {self.cfg.copy_point} of the base's attention "
                             f"maps from the prompt's last position (K, A, P); got {got}")  # fmt: skip
        k, p, _ = rows.shape
        idx = torch.arange(p, device=rows.device)
        ctx = self.ctx_in(rows.to(self.ctx_in.weight.dtype))  # (K, P, d_r)
        ctx = ctx + self.ctx_pos(position_features(idx, self.periods).to(ctx.dtype))
        if self.cfg.row_tokens:  # a row is the base's guess at the next token: add its own
            emb, prev = token_pairs(lm_head, prompt_ids, ctx.dtype)  # (K, P, d_base) each
            ctx = ctx + self.row_tok(emb) + self.row_prev(prev)
        row_mask = (idx.unsqueeze(0) < prompt_lens.unsqueeze(1)).view(k, 1, 1, p)
        lat = self.latent.unsqueeze(0).expand(k, -1, -1)  # (K, M, d_r)
        lat = self.pool(lat, ctx, row_mask, impl)
        for stage in self.repair:
            lat = stage(lat, lat, None, impl)
        if self.cfg.row_attn:
            from_end = prompt_lens.unsqueeze(1) - 1 - idx.unsqueeze(0)  # (K, P), < 0 on padding
            ctx = ctx + self.ctx_end(position_features(from_end, self.periods).to(ctx.dtype))
        guess = None
        if self.cfg.copy_guess:  # the base's own first-token guess, from its last row
            last = torch.arange(k, device=rows.device), prompt_lens - 1
            gids, glp = base_guess(rows[last], lm_head, self.cfg.copy_guess)
            guess = (gids, glp, ctx[last])
        runs = None
        if self.cfg.copy_match:  # the prompt's repeated runs, read by every pass's copy head
            runs = repeat_runs(prompt_ids, prompt_lens, self.cfg.copy_match)
        return Context(lat, ctx, row_mask, prompt_lens, prompt_ids, guess, runs, point)

    def encode(self, rows: Tensor, prompt_lens: Tensor, impl: str = "sdpa") -> Tensor:
        """Captured rows -> repaired latent. rows (K, P, d_base), prompt_lens (K,) -> (K, M, d_r)."""
        return self.context(rows, prompt_lens, impl).lat

    def _rotations(self, c: Context, positions: Tensor) -> tuple[Rotation, Rotation] | None:
        """Rotary tables (rope): the mixer's (queries at their answer positions, keys: the
        latents unrotated, then the answer positions) and the row attention's (half the heads
        count rows from the prompt's start, half from its end), so "the row t + c" and "the
        row t + c from the end" are the same direction at every t: copies and reversals."""
        if not self.cfg.rope:
            return None
        hd, theta, h = self.cfg.head_dim, self.cfg.rope_theta, self.cfg.n_heads
        k, m = c.lat.shape[0], c.lat.shape[1]
        qc, qs = rope_tables(positions, hd, theta)  # (K, D, hd)
        qc, qs = qc.unsqueeze(1), qs.unsqueeze(1)  # (K, 1, D, hd)
        zeros = torch.zeros(k, m, dtype=positions.dtype, device=positions.device)
        kc, ks = rope_tables(torch.cat([zeros, positions], dim=1), hd, theta)  # (K, M + D, hd)
        mixer = (qc, qs, kc.unsqueeze(1), ks.unsqueeze(1))
        p = c.rows.shape[1]
        idx = torch.arange(p, device=positions.device)
        start = idx.view(1, 1, p).expand(k, h // 2, p)
        end = (c.prompt_lens.view(k, 1, 1) - 1 - idx.view(1, 1, p)).expand(k, h - h // 2, p)
        rc, rs = rope_tables(torch.cat([start, end], dim=1), hd, theta)  # (K, H, P, hd)
        return mixer, (qc, qs, rc, rs)

    def _stack(
        self,
        layers: nn.ModuleList,
        cross: nn.ModuleList | None,
        h: Tensor,
        c: Context,
        mask: Tensor | PrefixCausal,
        impl: str,
        rots: tuple[Rotation, Rotation] | None = None,
    ) -> Tensor:
        mix_rot, row_rot = rots if rots is not None else (None, None)
        for j, layer in enumerate(layers):
            h = layer(h, torch.cat([c.lat, h], dim=1), mask, impl, mix_rot)
            if cross is not None:  # rows are all before the answer: no causality to keep
                h = cross[j](h, c.rows, c.row_mask, impl, row_rot)
        return h

    def hidden(
        self,
        rows: Tensor,
        prompt_lens: Tensor,
        positions: Tensor,
        impl: str = "sdpa",
        guess: GuessFn | None = None,
    ) -> Tensor:
        """Answer-position states in lm_head space. positions (K, D) -> (K, D, d_base)."""
        return self.out(self.mixed(rows, prompt_lens, positions, impl, guess))

    def passes(
        self,
        rows: Tensor,
        prompt_lens: Tensor,
        positions: Tensor,
        impl: str = "sdpa",
        guess: GuessFn | None = None,
    ) -> list[Tensor]:
        """The normed state of every pass: [first guess, refinement 1, ...], each (K, D, d_r).

        `guess` maps a pass's states to the embeddings of its argmax tokens (`guess_embed`
        does it against the lm_head); refinement needs one."""
        if self.reads_ids:  # rows alone would silently drop what it was trained to read
            raise ValueError("this decoder reads the prompt's token ids: forward or pass_parts")
        return self.passes_from(self.context(rows, prompt_lens, impl), positions, impl, guess)

    def passes_from(
        self, c: Context, positions: Tensor, impl: str = "sdpa", guess: GuessFn | None = None
    ) -> list[Tensor]:
        """`passes` from a context already made: latents (K, M, d_r), rows (K, P, d_r)."""
        m = c.lat.shape[1]
        d = positions.shape[1]
        h0 = self.pos_in(position_features(positions, self.periods).to(c.lat.dtype))  # (K, D, d_r)
        # Prefix-causal: every position sees all latents and the positions up to itself, so
        # position t's token does not depend on how deep the caller reads. max_tokens
        # truncation and depth-bucket padding are then exact, not approximations. The
        # explicit path (the ONNX graph's) gets the dense (D, M + D) mask.
        mask: Tensor | PrefixCausal = PrefixCausal(m)
        if impl == "explicit":
            mask = mask.dense(d, h0.device)
        cross = self.row_cross if self.cfg.row_attn else None
        rots = self._rotations(c, positions)
        h = self.norm_out(self._stack(self.mixer, cross, h0, c, mask, impl, rots))
        out = [h]
        if self.cfg.refine and guess is None:
            raise ValueError("a refining decoder needs a guess function (guess_embed)")
        ref_cross = self.ref_cross if self.cfg.refine and self.cfg.row_attn else None
        for _ in range(self.cfg.refine):  # a fixed number of passes, one shared stack
            # each position's guess is its own argmax: prefix-causal still holds
            x = h0 + guess(h).to(h.dtype) + h
            h = self.ref_norm(self._stack(self.ref_mixer, ref_cross, x, c, mask, impl, rots))
            out.append(h)
        return out

    def mixed(
        self,
        rows: Tensor,
        prompt_lens: Tensor,
        positions: Tensor,
        impl: str = "sdpa",
        guess: GuessFn | None = None,
    ) -> Tensor:
        """The normed output of the last pass, before the linear `out` map into lm_head
        space: (K, D, d_r).

        `out` has no bias and nothing follows it but the lm_head, so the logits are also
        mixed @ (lm_head @ out.weight).T, a (V, d_r) head: the torch engine's fused head."""
        return self.passes(rows, prompt_lens, positions, impl, guess)[-1]

    def guess_embed(self, lm_head: Tensor) -> GuessFn:
        """The refinement's guess against the resident lm_head: top-1 of each position
        (chunked, as served), then guess_in(lm_head[id]). (K, D, d_r) -> (K, D, d_r)."""

        def guess(h: Tensor) -> Tensor:
            _, ids = chunked_topk(self.out(h).to(lm_head.dtype), lm_head, self.cfg.n_chunks, 1)
            emb = lm_head[ids[..., 0]]  # (K, D, d_base), a gather: no copy of the head
            return self.guess_in(emb.to(self.guess_in.weight.dtype))

        return guess

    def forward(
        self,
        rows: Tensor,  # (K, P, d_base), lanes padded to the longest prompt
        prompt_lens: Tensor,  # (K,) int64
        positions: Tensor,  # (K, D) int64, normally arange(D) per lane
        depths: Tensor,  # (K,) int64, answer positions read per lane (<= D)
        lm_head: Tensor,  # (V, d_base), the base model's resident output embedding
        eos_token_id: Tensor | int | None = None,
        temperature: Tensor | None = None,  # (K,) float; 0 = argmax
        noise: Tensor | None = None,  # (K, D, TOP_K_SAMPLE) Gumbel noise for sampling
        impl: str = "sdpa",
        filters: Filters | None = None,  # top_k / top_p / min_p / min_tokens, with temperature
        prompt_ids: Tensor | None = None,  # (K, P) the prompts' tokens: a copy head's candidates
        point: Tensor | None = None,  # (K, A, P) the base's attention maps, with copy_point
    ) -> ReadoutOut:
        k_top = 2 if temperature is None else TOP_K_SAMPLE
        if self.reads_ids:
            top_v, top_i, lse = self._read_top(
                rows, prompt_lens, positions, lm_head, prompt_ids, impl, k_top, point
            )
        else:
            guess = self.guess_embed(lm_head) if self.cfg.refine else None
            h = self.hidden(rows, prompt_lens, positions, impl, guess).to(lm_head.dtype)
            top_v, top_i, lse = chunked_topk_lse(h, lm_head, self.cfg.n_chunks, k_top)  # (K, D, k)
        margin = (top_v[..., 0] - top_v[..., 1]).float()
        tokens, chosen = top_i[..., 0], top_v[..., 0]
        eos = self.cfg.eos_token_id if eos_token_id is None else eos_token_id
        if temperature is not None:
            if noise is None:
                raise ValueError("sampling needs an explicit noise tensor")
            keep = None
            if filters is not None:
                keep = candidate_mask(top_v, top_i, temperature, filters, positions, eos)
            pick = gumbel_pick(top_v, temperature, noise, keep)  # (K, D, 1)
            tokens = torch.gather(top_i, -1, pick).squeeze(-1)
            chosen = torch.gather(top_v, -1, pick).squeeze(-1)
        valid = positions < depths.unsqueeze(1)  # (K, D)
        eos_pos = first_eos(tokens, valid, eos)
        top1_lp = top_v[..., 0].float() - lse
        token_lp = chosen.float() - lse
        return ReadoutOut(tokens, top_i[..., 0], top_i[..., 1], margin, eos_pos, top1_lp, token_lp)

    def logits(self, rows: Tensor, prompt_lens: Tensor, positions: Tensor, lm_head: Tensor):
        """Full logits for training on small vocabularies. (K, D, V); never on the serve path."""
        return self.pass_logits(rows, prompt_lens, positions, lm_head)[-1]

    def pass_logits(
        self, rows: Tensor, prompt_lens: Tensor, positions: Tensor, lm_head: Tensor
    ) -> list[Tensor]:
        """Full logits of every pass, for training: [(K, D, V)], first guess first. The
        refinement reads the previous pass's argmax, detached (trained on its own guesses)."""
        head = lm_head.to(self.out.weight.dtype)

        def guess(h: Tensor) -> Tensor:
            ids = (self.out(h) @ head.t()).argmax(-1).detach()  # (K, D)
            return self.guess_in(head[ids])

        states = self.passes(rows, prompt_lens, positions, guess=guess if self.cfg.refine else None)
        return [self.out(h) @ head.t() for h in states]
