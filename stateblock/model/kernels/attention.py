"""The mixer's prefix-causal attention as one Triton kernel, fp32 in and out, TF32 dots.

The readout mixer runs in fp32 (docs/PARITY.md: bf16 or fp16 anywhere in the decoder
flips tokens), and fp32 is where PyTorch's SDPA has no tensor-core kernel: it takes the
memory-efficient SIMT path, most of the fp32 decoder's time at D=8192 (docs/BENCHMARKS.md).
This kernel is flash attention (online softmax, scores never leave the chip) over fp32
tiles whose two products run as TF32 tensor-core dots ("tf32") or exact fp32 ("ieee"). The
precision is the caller's: an argument, or `dot_precision` around the call (a context
variable, so one thread's choice never leaks into another's, unlike torch's process-wide
fp32 matmul switch), or else what torch's fp32 matmuls use now.

The mask is PrefixCausal's: query t sees the n_prefix leading keys (the latents) and the
keys of positions <= t, i.e. key j is visible to query t iff j <= n_prefix + t. Key blocks
wholly below the block's first query's horizon run unmasked; only the blocks on the
diagonal pay for the mask, and blocks past the last query's horizon are never loaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

try:  # Triton is optional: CI and the CPU path never import it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["available", "dot_precision", "prefix_causal_attention", "resolve_precision"]

BLOCK_M, BLOCK_N = 128, 64  # queries per program, keys per step
NUM_WARPS, NUM_STAGES = 4, 2
MASKED = -1.0e38  # finite: a fully masked row (query padding) never makes inf - inf


def available(device: torch.device | str | None = None) -> bool:
    """True when the kernel can run: Triton importable and a CUDA device present."""
    if triton is None or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


DOT_PRECISIONS = ("tf32", "ieee")
_DOT_PRECISION: ContextVar[str | None] = ContextVar("stateblock_dot_precision", default=None)


@contextmanager
def dot_precision(precision: str) -> Iterator[None]:
    """The kernel's dot precision for calls in this block, in this thread (or task) only."""
    if precision not in DOT_PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {DOT_PRECISIONS}")
    token = _DOT_PRECISION.set(precision)
    try:
        yield
    finally:
        _DOT_PRECISION.reset(token)


def resolve_precision(precision: str | None = None) -> str:
    """The argument, else `dot_precision`'s, else what torch's fp32 matmuls use now ("ieee"
    at "highest", else "tf32")."""
    precision = precision or _DOT_PRECISION.get()
    if precision is None:
        precision = "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    if precision not in DOT_PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {DOT_PRECISIONS}")
    return precision


if triton is not None:
    _MASKED = tl.constexpr(MASKED)  # a jitted function reads module globals only as constexpr

    @triton.jit
    def _attend(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, offs_n, start_n, n_keys, horizon_base,
        stride_kn, stride_vn, qk_scale, MASK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One key block folded into the running (max, sum, acc) of the online softmax."""
        keys = start_n + offs_n
        k_ok = keys < n_keys
        k = tl.load(k_ptrs + start_n * stride_kn, mask=k_ok[:, None], other=0.0)  # (BN, hd)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN) log2 units
        if MASK:  # key j visible to query t iff j <= n_prefix + t
            ok = (keys[None, :] <= horizon_base + offs_m[:, None]) & k_ok[None, :]
            qk = tl.where(ok, qk, _MASKED)
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=k_ok[:, None], other=0.0)  # (BN, hd)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _prefix_causal_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr,  # q, o: (B, H, Nq, hd) by strides; k, v: (B, H, Nk, hd)
        n_q, n_prefix, n_heads, qk_scale,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q_rows = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
        q = tl.load(
            q_rows + offs_m[:, None] * stride_qm + offs_d[None, :],
            mask=offs_m[:, None] < n_q,
            other=0.0,
        )  # (BM, hd)
        k_ptrs = (
            k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh
            + offs_n[:, None] * stride_kn + offs_d[None, :]
        )  # fmt: skip
        v_ptrs = (
            v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh
            + offs_n[:, None] * stride_vn + offs_d[None, :]
        )  # fmt: skip
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        n_keys = n_prefix + n_q
        # every query of this block sees keys < n_prefix + first query + 1: no mask there
        first = pid_m * BLOCK_M
        full_end = (n_prefix + first + 1) // BLOCK_N * BLOCK_N
        # the last query of the block sees keys <= n_prefix + last query: nothing beyond
        last = tl.minimum(first + BLOCK_M, n_q) - 1
        end = tl.minimum(n_prefix + last + 1, n_keys)
        for start_n in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, offs_n, start_n, n_keys, n_prefix,
                stride_kn, stride_vn, qk_scale, False, PRECISION,
            )  # fmt: skip
        for start_n in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, offs_n, start_n, n_keys, n_prefix,
                stride_kn, stride_vn, qk_scale, True, PRECISION,
            )  # fmt: skip
        out = acc / l_i[:, None]
        o_rows = o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
        tl.store(
            o_rows + offs_m[:, None] * stride_om + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=offs_m[:, None] < n_q,
        )


def prefix_causal_attention(
    q: Tensor,  # (B, H, Nq, hd) fp32, unit stride along hd
    k: Tensor,  # (B, H, n_prefix + Nq, hd) fp32, likewise
    v: Tensor,  # (B, H, n_prefix + Nq, hd) fp32, likewise
    n_prefix: int,
    *,
    out: Tensor | None = None,  # (B, H, Nq, hd) by strides, e.g. a transpose of (B, Nq, H, hd)
    precision: str | None = None,  # "tf32" / "ieee"; None: see resolve_precision
) -> Tensor:
    """softmax(q k^T / sqrt(hd) under PrefixCausal(n_prefix)) v; the (B, H, Nq, hd) output.

    Host work is shape arithmetic only (no sync), so it can be captured in a CUDA graph
    once compiled. `out` lets the caller receive the heads already interleaved, so the
    output projection reads them without a transpose copy.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    b, h, n_q, hd = q.shape
    if k.shape != (b, h, n_prefix + n_q, hd) or v.shape != k.shape:
        raise ValueError(f"keys {tuple(k.shape)} / values {tuple(v.shape)} do not fit q {q.shape}")
    if q.dtype != torch.float32 or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"fp32 q, k, v only (got {q.dtype}, {k.dtype}, {v.dtype})")
    if hd < 16 or hd & (hd - 1) or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError(f"head dim must be a power of two >= 16 with unit stride (got {hd})")
    precision = resolve_precision(precision)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.shape != q.shape or out.stride(-1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out {tuple(out.shape)} does not fit q {tuple(q.shape)}")
    grid = (triton.cdiv(n_q, BLOCK_M), b * h)
    _prefix_causal_kernel[grid](
        q, k, v, out,
        n_q, n_prefix, h, math.log2(math.e) / math.sqrt(hd),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=hd, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=precision,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out
