"""The readout decoder's layers: RMSNorm, a SwiGLU MLP, multi-head attention with its three
implementations, the pre-norm block, and the prefix-causal mask the mixer attends under."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from stateblock.model.rotary import rotate

if TYPE_CHECKING:
    from stateblock.model.decoder import ReadoutConfig

Rotation = tuple[Tensor, Tensor, Tensor, Tensor]  # q cos, q sin, k cos, k sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        hidden = dim * ratio
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass(frozen=True)
class PrefixCausal:
    """The mixer's mask without its (Nq, n_prefix + Nq) tensor: query t sees the n_prefix
    leading keys (the latents) and the keys of positions <= t."""

    n_prefix: int

    def dense(self, nq: int, device: torch.device) -> Tensor:
        causal = torch.ones(nq, nq, dtype=torch.bool, device=device).tril()
        prefix = torch.ones(nq, self.n_prefix, dtype=torch.bool, device=device)
        return torch.cat([prefix, causal], dim=1)  # (Nq, n_prefix + Nq)


def prefix_causal_sdpa(q: Tensor, k: Tensor, v: Tensor, n_prefix: int) -> Tensor:
    """SDPA under PrefixCausal as plain causal attention: n_prefix zero queries in front make
    the problem square, where is_causal means exactly that mask, and are dropped after. The
    kernels then skip the masked half of the blocks and take no mask tensor (flash in
    bf16), at the price of n_prefix extra query rows (64 of 8,256 at D=8192)."""
    q = F.pad(q, (0, 0, n_prefix, 0))  # (K, H, n_prefix + Nq, hd)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, n_prefix:]


class Attention(nn.Module):
    """Multi-head attention with two implementations over the same weights.

    `explicit` is MatMul/Softmax (what the ONNX graph contains, and it builds the full
    score tensor); `sdpa` is scaled_dot_product_attention, which on the GPU never
    materialises the (queries x keys) scores: the K=8 x D=8192 memory wall of the seed;
    `fused` is `sdpa` except for the mixer's PrefixCausal attention, which runs the fp32
    flash kernel of `stateblock.model.kernels.attention` (CUDA + Triton, fp32 only: SDPA has no
    tensor-core kernel for fp32).
    """

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        k, n, d = x.shape
        return x.view(k, n, self.n_heads, d // self.n_heads).transpose(1, 2)  # (K, H, n, hd)

    def forward(
        self,
        xq: Tensor,
        xkv: Tensor,
        mask: Tensor | PrefixCausal | None,
        impl: str,
        rot: Rotation | None = None,
    ) -> Tensor:
        # xq: (K, Nq, d), xkv: (K, Nk, d), mask: bool broadcastable to (K, 1, Nq, Nk), True = attend
        # (or, for sdpa, a PrefixCausal standing for it); rot: rotary tables for q and k
        q, k, v = self._heads(self.wq(xq)), self._heads(self.wk(xkv)), self._heads(self.wv(xkv))
        if rot is not None:
            q, k = rotate(q, rot[0], rot[1]), rotate(k, rot[2], rot[3])
        if impl == "fused" and isinstance(mask, PrefixCausal):
            from stateblock.model.kernels.attention import prefix_causal_attention

            kk, nq, d = xq.shape
            out = torch.empty(
                kk, nq, self.n_heads, d // self.n_heads, dtype=q.dtype, device=q.device
            )
            prefix_causal_attention(q, k, v, mask.n_prefix, out=out.transpose(1, 2))
            return self.wo(out.view(kk, nq, d))  # heads already interleaved: no transpose copy
        if impl == "sdpa" and isinstance(mask, PrefixCausal):
            y = prefix_causal_sdpa(q, k, v, mask.n_prefix)
        elif impl in ("sdpa", "fused"):  # fused: only the mixer's attention has a kernel
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif impl == "explicit":  # a dense mask only: `hidden` builds it once for all layers
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (K,H,Nq,Nk)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            y = torch.matmul(torch.softmax(scores, dim=-1), v)
        else:
            raise ValueError(f"unknown attention implementation {impl!r}")
        kk, h, n, hd = y.shape
        return self.wo(y.transpose(1, 2).reshape(kk, n, h * hd))  # (K, Nq, d)


class Block(nn.Module):
    """Pre-norm attention + MLP; the keys/values are whatever the caller passes."""

    def __init__(self, cfg: ReadoutConfig) -> None:
        super().__init__()
        self.norm_q = RMSNorm(cfg.d_r, cfg.norm_eps)
        self.norm_kv = RMSNorm(cfg.d_r, cfg.norm_eps)
        self.attn = Attention(cfg.d_r, cfg.n_heads)
        self.norm_mlp = RMSNorm(cfg.d_r, cfg.norm_eps)
        self.mlp = MLP(cfg.d_r, cfg.mlp_ratio)

    def forward(
        self,
        x: Tensor,
        kv: Tensor,
        mask: Tensor | PrefixCausal | None,
        impl: str,
        rot: Rotation | None = None,
    ) -> Tensor:
        x = x + self.attn(self.norm_q(x), self.norm_kv(kv), mask, impl, rot)
        return x + self.mlp(self.norm_mlp(x))
