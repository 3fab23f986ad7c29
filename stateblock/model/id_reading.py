"""The readout decoder's paths that read the prompt's token ids beside its rows (a copy head,
`ReadoutConfig.copy`, or rows carrying their tokens, `row_tokens`): the served top-k of a
pass's mixture, the refinement's guess from it, and every pass's mixture for training. A
mixin of `ReadoutDecoder` (stateblock.model.decoder), which owns the layers these read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stateblock.model.copy_head import log_probs, mixture_topk, position_probs
from stateblock.model.vocab import chunked_topk_lse

if TYPE_CHECKING:
    from stateblock.model.decoder import Context

# the refinement's input: normed states (K, D, d_r) -> the guessed tokens' embeddings (K, D, d_r)
GuessFn = Callable[[Tensor], Tensor]


class IdReading:
    @property
    def reads_ids(self) -> bool:
        return bool(self.cfg.copy or self.cfg.row_tokens)

    def read_topk(
        self,
        h: Tensor,
        c: Context,
        positions: Tensor,
        lm_head: Tensor,
        k: int,
        prev=None,
        seen: list | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """A pass's top-k (values, ids (K, D, k)) and log-sum-exp (K, D) from its normed state
        h (K, D, d_r): the vocabulary's, or the copy mixture's (prev: what the previous pass
        read, `_read_of`; `seen` gets this pass's); no (K, D, V) tensor."""
        hv = self.out(h).to(lm_head.dtype)  # (K, D, d_base)
        top_v, top_i, lse_v = chunked_topk_lse(hv, lm_head, self.cfg.n_chunks, k)
        if not self.cfg.copy:
            return top_v, top_i, lse_v
        # the candidates' scores a (K, D, C) and ids cand (K, C)
        a, cand = self.copy_head.scores(h, c.rows, c.prompt_ids, c.prompt_lens, lm_head,
                                        positions, self.twins, c.guess, prev, c.runs,
                                        c.point)  # fmt: skip
        cand_v = torch.matmul(hv, lm_head[cand].transpose(1, 2))  # (K, D, C)
        gate = self.copy_head.gate(h) if self.copy_head.gated else None  # (K, D, 1)
        out = mixture_topk(top_v, top_i, lse_v, cand_v, a, cand, k, gate)
        if seen is not None:
            seen.append(self._read_of(out[1][..., 0], a, c.prompt_ids.shape[1]))
        return out

    def _read_of(self, ids: Tensor, a: Tensor, p: int) -> tuple:
        """What a pass read, for the next one: its tokens (K, D), and with copy_span its copy
        probabilities over the P prompt positions (K, D, P) from its scores a (K, D, C)."""
        if not self.cfg.copy_span:
            return ids, None
        return ids, position_probs(a, p, self.copy_head.twin)

    def read_guess(self, c: Context, positions: Tensor, lm_head: Tensor, seen: list) -> GuessFn:
        """The refinement's guess: the pass's top-1 (`read_topk`), embedded; what each pass
        read appended to `seen` (the next pass's copy_follow and copy_span read it)."""

        def guess(h: Tensor) -> Tensor:
            prev = seen[-1] if seen else None
            _, ids, _ = self.read_topk(h, c, positions, lm_head, 1, prev, seen)
            return self.guess_in(lm_head[ids[..., 0]].to(self.guess_in.weight.dtype))

        return guess

    def _id_context(self, rows, prompt_lens, impl, prompt_ids, lm_head, point=None) -> Context:
        if prompt_ids is None:
            raise ValueError(
                "this decoder (a copy head or row tokens) reads the prompt's token ids"
            )
        return self.context(rows, prompt_lens, impl, prompt_ids, lm_head, point)

    def _read_top(
        self, rows, prompt_lens, positions, lm_head, prompt_ids, impl: str, k: int, point=None
    ):
        c = self._id_context(rows, prompt_lens, impl, prompt_ids, lm_head, point)
        seen: list[tuple] = []  # what each pass read, for the next (copy_follow, copy_span)
        guess = self.read_guess(c, positions, lm_head, seen) if self.cfg.refine else None
        h = self.passes_from(c, positions, impl, guess)[-1]
        return self.read_topk(h, c, positions, lm_head, k, seen[-1] if seen else None)

    def pass_parts(
        self,
        rows: Tensor,
        prompt_lens: Tensor,
        positions: Tensor,
        lm_head: Tensor,
        prompt_ids: Tensor | None = None,
        point: Tensor | None = None,
    ) -> list[tuple]:
        """Every pass's distribution for training, as copy_head parts: [("base", (K, D, V))]
        without a copy head. A refinement reads the previous pass's argmax. point: the base's
        attention maps (K, A, P), with copy_point."""
        if not self.reads_ids:
            return [("base", lg) for lg in self.pass_logits(rows, prompt_lens, positions, lm_head)]
        head = lm_head.to(self.out.weight.dtype)
        c = self._id_context(rows, prompt_lens, "sdpa", prompt_ids, head, point)

        def parts(h: Tensor, prev: Tensor | None) -> tuple:
            lv = self.out(h) @ head.t()  # (K, D, V)
            if not self.cfg.copy:
                return ("base", lv)
            return self.copy_head(h, lv, c.rows, prompt_ids, prompt_lens, head, positions,
                                  self.twins, c.guess, prev, c.runs, c.point)  # fmt: skip

        seen: list[tuple] = []  # what each pass read, for the next (copy_follow, copy_span)

        def guess(h: Tensor) -> Tensor:
            with torch.no_grad():  # (K, D), trained on its own guesses
                part = parts(h, seen[-1] if seen else None)
                ids = log_probs(part).argmax(-1)
                if part[0] == "base":
                    seen.append((ids, None))
                else:  # the copy scores: the joint's, or the gate's from its softmax
                    a = part[2] if part[0] == "joint" else part[3].clamp_min(1e-30).log()
                    seen.append(self._read_of(ids, a, prompt_ids.shape[1]))
            return self.guess_in(head[seen[-1][0]])

        states = self.passes_from(c, positions, "sdpa", guess if self.cfg.refine else None)
        return [parts(h, seen[i - 1] if i else None) for i, h in enumerate(states)]
