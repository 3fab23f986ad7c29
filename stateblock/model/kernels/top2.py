"""Fused vocabulary projection + running top-2: the lm_head GEMM whose logits stay on chip.

`top2(h, lm_head)` returns the two largest logits of `h @ lm_head.T` per row and their
vocabulary ids. On a CUDA device with Triton, one kernel streams lm_head tiles through
shared memory, accumulates each (rows x vocab) logit tile in registers (fp32) and folds it
into a per-row running top-2; the (N, V) logits are never written to device memory. Where
Triton or a GPU is missing, the same signature runs the chunked PyTorch projection of
`stateblock.model.vocab` (the CPU fallback; also the reference the kernel is tested against).

Tie rule: on exactly equal logits the lowest vocabulary id wins. torch.topk does not
promise any order among ties (on the CPU it returns [2, 4] for [1, 3, 3, 2, 3]), so the
kernel follows the one rule that is deterministic and cheap on chip, and the tests compare
ids only where the values are distinct.

Split-V: when the rows alone cannot fill the GPU (D=256 gives two row blocks of 128 on 132
multiprocessors), the vocabulary is cut into `n_split` ranges, each program writes the
top-2 of its range, and `merge_top2` folds the (n_split, N, 2) candidates in a second,
tiny pass. Programs that share a vocabulary range run side by side (row blocks vary
fastest in launch order), so each lm_head tile is read from DRAM about once and then hit
in L2 by the other row blocks; from 16 row blocks up, launch groups of 16 row blocks x 8
ranges also keep the h tiles those programs re-read in L2 (`Top2Config.group_rows`).

Inputs: bf16/fp16 (the lm_head) or fp32 with TF32 or exact dots (the torch engine's fused
head, lm_head @ out.weight, whose d is the decoder's 256 rather than 2,688).

Log-probabilities (`lse=True`): the same tile loop also folds each row's running max and
sum of exponentials (online softmax), so the log-sum-exp of the whole vocabulary comes out
of the one pass and a logit's exact log-probability is logit - lse. Each split writes its
partial log-sum-exp and `merge_top2`'s caller folds them with one logsumexp over splits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from stateblock.model.vocab import chunked_topk_lse

try:  # Triton is optional: CI and the CPU path never import it
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    TensorDescriptor = None

__all__ = [
    "Top2Config",
    "available",
    "default_config",
    "default_tiles",
    "merge_top2",
    "top2",
    "top2_reference",
]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NO_ID = 2**62  # id of an empty slot; larger than any vocabulary id, so it never wins a tie


def available(device: torch.device | str | None = None) -> bool:
    """True when the Triton kernel can run: Triton importable and a CUDA device present."""
    if triton is None or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


@dataclass(frozen=True)
class Top2Config:
    block_n: int = 128  # rows of h per program (the MMA M side)
    block_v: int = 256  # vocabulary rows of one lm_head tile (the MMA N side)
    block_k: int = 64  # hidden-dimension step of the dot
    num_warps: int = 8
    num_stages: int = 3  # software-pipelining depth of the tile loads
    n_split: int = 0  # vocabulary ranges, one program column each; 0: default_config's
    # tiles fetched by the TMA copy engine from host-made tensor descriptors (Hopper+):
    # no address arithmetic or masks in the loop and fewer registers; chosen by the sweep
    tma: bool = False
    # one program per multiprocessor striding over (row block, split) items: no partial
    # last wave (K=8 x D=8192 is 512 items, 3.9 waves on 132 SMs); chosen by the sweep
    persistent: bool = False
    # row blocks per launch group (0: no groups): the programs in flight then cover
    # group_rows row blocks x n_split vocabulary ranges instead of ~n_sm row blocks of one
    # range, so the h tiles they re-read per vocabulary tile stay in L2 (K=8 x D=8192:
    # 132 row blocks of 688 KB in flight is 90 MB, over the H200's 50 MB L2)
    group_rows: int = 0  # with n_split=0: 0 lets default_config group, -1 never groups
    # fp32 inputs only: "tf32" tensor-core dots (10-bit mantissas, fp32 accumulation) or
    # "ieee" (exact fp32, no tensor cores); bf16/fp16 inputs always accumulate in fp32
    precision: str = "tf32"


WAVE_FILL = 0.95  # accept the fewest splits whose last wave of programs is this full
# From 16 row blocks up: groups of 16 row blocks x 8 vocabulary ranges, 128 items, about
# one wave on an H200 whose in-flight h tiles (11 MB) and lm_head tiles (11 MB) share L2.
# Measured faster than ungrouped launches at D=8192 and K*D=65536 (docs/BENCHMARKS.md).
GROUP_ROWS, GROUP_SPLIT = 16, 8


@functools.lru_cache(maxsize=256)  # eager callers pay this loop per call otherwise
def default_config(
    n_rows: int, vocab: int, n_sm: int, tiles: Top2Config | None = None
) -> Top2Config:
    """`tiles` (default: Hopper matmul tiles 128x256x64, 8 warps, 3 stages, ~147 KB of
    shared memory, one program per multiprocessor) with, from GROUP_ROWS row blocks up,
    groups of GROUP_ROWS row blocks x GROUP_SPLIT splits; below, the fewest vocabulary
    splits that fill the multiprocessors' waves (>= WAVE_FILL). Each program streams >= 4
    lm_head tiles.

    H200 (132 SMs): D=256 -> 2 row blocks x 64 splits; D=1024 -> 8 x 16; D=2048 and up ->
    groups of 16 x 8 (D=2048 is one group: the same items as 16 x 8 without groups).
    """
    tiles = tiles or Top2Config()
    row_blocks = math.ceil(n_rows / tiles.block_n)
    max_split = max(1, math.ceil(vocab / (tiles.block_v * 4)))
    if row_blocks >= GROUP_ROWS and tiles.group_rows == 0:
        return replace(tiles, n_split=min(GROUP_SPLIT, max_split), group_rows=GROUP_ROWS)
    best, best_fill = replace(tiles, n_split=1), 0.0
    for n_split in range(1, max_split + 1):
        cfg = replace(tiles, n_split=n_split)
        waves = row_blocks * _vocab_per_split(vocab, cfg)[1] / n_sm
        fill = waves / math.ceil(waves)
        if fill >= WAVE_FILL:
            return cfg
        if fill > best_fill:
            best, best_fill = cfg, fill
    return best


def default_tiles(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Top2Config:
    """128x256 tiles, 128 bytes of d per step (64 bf16, 32 fp32: the widest row a swizzled
    TMA box takes); fetched by TMA on Hopper and later (faster than pointer loads at D=8192
    on the H200: docs/BENCHMARKS.md)."""
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return Top2Config(block_k=128 // dtype.itemsize, tma=hopper)


def _vocab_per_split(vocab: int, cfg: Top2Config) -> tuple[int, int]:
    """(ids per split, rounded to whole tiles; the number of non-empty splits)."""
    per = math.ceil(math.ceil(vocab / cfg.n_split) / cfg.block_v) * cfg.block_v
    return per, math.ceil(vocab / per)


# -- the PyTorch path ---------------------------------------------------------------------
def top2_reference(
    h: Tensor, lm_head: Tensor, n_chunks: int = 8, *, lse: bool = False
) -> tuple[Tensor, ...]:
    """Chunked matmul + running top-2 (stateblock.model.vocab): h (N, d), lm_head (V, d) ->
    values (N, 2) float32, ids (N, 2) int64 (and, with lse, the rows' log-sum-exp (N,)
    float32). Logits are in h's dtype, as in the decoder."""
    v, i, z = chunked_topk_lse(h, lm_head, n_chunks, 2)
    return (v.float(), i, z) if lse else (v.float(), i)


def merge_top2(vals: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Fold per-split candidates into one top-2, lowest id on exact ties.

    vals (S, N, 2) float32, ids (S, N, 2) int64 -> (N, 2), (N, 2). Max/min reductions
    only: no sort whose tie order is unspecified, and it replays inside a CUDA graph.
    """
    s, n, _ = vals.shape
    v = vals.permute(1, 0, 2).reshape(n, 2 * s)  # (N, 2S)
    i = ids.permute(1, 0, 2).reshape(n, 2 * s)
    no_id = torch.full_like(i, NO_ID)
    v1 = v.max(dim=-1, keepdim=True).values  # (N, 1)
    i1 = torch.where(v == v1, i, no_id).min(dim=-1, keepdim=True).values
    rest = torch.where(i == i1, torch.full_like(v, float("-inf")), v)
    v2 = rest.max(dim=-1, keepdim=True).values
    i2 = torch.where(rest == v2, i, no_id).min(dim=-1, keepdim=True).values
    return torch.cat([v1, v2], dim=-1), torch.cat([i1, i2], dim=-1)


# -- the Triton kernel --------------------------------------------------------------------
if triton is not None:
    _NO_ID = tl.constexpr(NO_ID)  # a jitted kernel reads module globals only as constexpr

    @triton.jit
    def _load_tiles(
        h_ptr,
        w_ptr,
        row0,
        v0,
        rows,
        cols,
        col_ok,
        row_ok,
        k0,
        ks,
        dim,
        stride_h,
        stride_w,
        EVEN_K: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """The (BLOCK_N, BLOCK_K) tile of h and the (BLOCK_V, BLOCK_K) tile of lm_head at k0.

        TMA: h_ptr / w_ptr are tensor descriptors and the copy engine fetches the boxes;
        it zero-fills whatever lies past the rows, the vocabulary or d, so no masks."""
        if TMA:
            a = h_ptr.load([row0, k0])
            b = w_ptr.load([v0, k0])
        else:
            kk = k0 + ks
            h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_h
            w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
            if EVEN_K:
                a = tl.load(h_rows + kk[None, :], mask=row_ok[:, None], other=0.0)
                b = tl.load(w_rows + kk[None, :], mask=col_ok[:, None], other=0.0)
            else:
                k_ok = kk[None, :] < dim
                a = tl.load(h_rows + kk[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
                b = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
        return a, b

    @triton.jit
    def _fold_tile(acc, col_ok, lanes, v0, best1, id1, best2, id2):
        """Fold one (BLOCK_N, BLOCK_V) logit tile into the running top-2 of each row."""
        acc = tl.where(col_ok[None, :], acc, float("-inf"))
        # tile top-2: max with the leftmost index on ties, then again without it
        t1, j1 = tl.max(acc, axis=1, return_indices=True, return_indices_tie_break_left=True)
        acc = tl.where(lanes[None, :] == j1[:, None], float("-inf"), acc)
        t2, j2 = tl.max(acc, axis=1, return_indices=True, return_indices_tie_break_left=True)
        g1 = (v0 + j1).to(tl.int64)
        g2 = (v0 + j2).to(tl.int64)
        # the running ids are all lower than this tile's, so on equal values the running
        # entry wins (>=): "lowest id wins" holds across tiles too
        keep = best1 >= t1
        new2 = tl.where(keep, tl.maximum(best2, t1), tl.maximum(best1, t2))
        new_id2 = tl.where(keep, tl.where(best2 >= t1, id2, g1), tl.where(best1 >= t2, id1, g2))
        return tl.where(keep, best1, t1), tl.where(keep, id1, g1), new2, new_id2

    @triton.jit
    def _top2_block(
        h_ptr,
        w_ptr,
        val_ptr,
        idx_ptr,
        lse_ptr,
        pid_n,  # row block
        pid_s,  # vocabulary split
        n_rows,
        vocab,
        dim,
        v_per_split,
        stride_h,
        stride_w,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        TMA: tl.constexpr,
        FP32: tl.constexpr,
        PRECISION: tl.constexpr,
        WITH_LSE: tl.constexpr,
    ):
        """One work item: the top-2 of BLOCK_N rows over one vocabulary split (and, with
        WITH_LSE, their log-sum-exp over it)."""
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        lanes = tl.arange(0, BLOCK_V)
        ks = tl.arange(0, BLOCK_K)
        v_lo = pid_s * v_per_split

        best1 = tl.full([BLOCK_N], float("-inf"), tl.float32)
        best2 = tl.full([BLOCK_N], float("-inf"), tl.float32)
        id1 = tl.full([BLOCK_N], _NO_ID, tl.int64)
        id2 = tl.full([BLOCK_N], _NO_ID, tl.int64)
        run_m = tl.full([BLOCK_N], float("-inf"), tl.float32)  # online softmax: max, sum
        run_s = tl.zeros([BLOCK_N], dtype=tl.float32)
        # splits are whole tiles, so only the last one crosses V (the mask clips it)
        for v0 in range(v_lo, v_lo + v_per_split, BLOCK_V):
            cols = v0 + lanes
            col_ok = cols < vocab
            acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
            for k0 in range(0, dim, BLOCK_K):
                a, b = _load_tiles(
                    h_ptr,
                    w_ptr,
                    pid_n * BLOCK_N,
                    v0,
                    rows,
                    cols,
                    col_ok,
                    row_ok,
                    k0,
                    ks,
                    dim,
                    stride_h,
                    stride_w,
                    EVEN_K,
                    TMA,
                )
                if FP32:
                    acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(a, tl.trans(b), acc)  # (BLOCK_N, BLOCK_V) fp32, on chip
            if WITH_LSE:  # every tile has a valid column: tile_m is finite
                masked = tl.where(col_ok[None, :], acc, float("-inf"))
                new_m = tl.maximum(run_m, tl.max(masked, axis=1))
                p = tl.exp(masked - new_m[:, None])
                run_s = run_s * tl.exp(run_m - new_m) + tl.sum(p, axis=1)
                run_m = new_m
            best1, id1, best2, id2 = _fold_tile(acc, col_ok, lanes, v0, best1, id1, best2, id2)

        if WITH_LSE:
            tl.store(lse_ptr + pid_s * n_rows + rows, run_m + tl.log(run_s), mask=row_ok)
        out = (pid_s * n_rows + rows) * 2
        tl.store(val_ptr + out, best1, mask=row_ok)
        tl.store(val_ptr + out + 1, best2, mask=row_ok)
        tl.store(idx_ptr + out, id1, mask=row_ok)
        tl.store(idx_ptr + out + 1, id2, mask=row_ok)

    @triton.jit
    def _work_item(w, n_row_blocks, n_split, GROUP_ROWS: tl.constexpr):
        """Work item w -> (row block, split). Plain: row blocks vary fastest. Grouped: item
        w falls in group w // (GROUP_ROWS * n_split) of GROUP_ROWS row blocks (fewer in the
        last), whose items cover its row blocks (fastest) x every split."""
        if GROUP_ROWS == 0:
            return w % n_row_blocks, w // n_row_blocks
        per_group = GROUP_ROWS * n_split
        first = (w // per_group) * GROUP_ROWS
        rows_here = tl.minimum(n_row_blocks - first, GROUP_ROWS)
        r = w % per_group
        return first + r % rows_here, r // rows_here

    @triton.jit
    def _top2_kernel(
        h_ptr,  # (N, d) bf16/fp16/fp32, unit stride along d (a TMA descriptor when TMA)
        w_ptr,  # (V, d) same dtype, unit stride along d (likewise)
        val_ptr,  # (S, N, 2) float32
        idx_ptr,  # (S, N, 2) int64
        lse_ptr,  # (S, N) float32, written only WITH_LSE
        n_rows,
        vocab,
        dim,
        v_per_split,
        stride_h,
        stride_w,
        n_row_blocks,
        n_split,
        n_work,  # n_row_blocks * S work items
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,  # dim % BLOCK_K == 0: no mask along d (2688 = 42 * 64)
        TMA: tl.constexpr,
        PERSISTENT: tl.constexpr,  # one program per SM striding over the work items
        GROUP_ROWS: tl.constexpr,  # see Top2Config.group_rows
        FP32: tl.constexpr,  # fp32 inputs: dots at PRECISION
        PRECISION: tl.constexpr,
        WITH_LSE: tl.constexpr,  # also the log-sum-exp of each row over its split
    ):
        # items in launch order: the ones in flight share lm_head tiles (and, grouped, h
        # tiles) through L2
        if PERSISTENT:
            for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
                pid_n, pid_s = _work_item(w, n_row_blocks, n_split, GROUP_ROWS)
                _top2_block(
                    h_ptr, w_ptr, val_ptr, idx_ptr, lse_ptr, pid_n, pid_s,
                    n_rows, vocab, dim, v_per_split, stride_h, stride_w,
                    BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, TMA, FP32, PRECISION, WITH_LSE,
                )  # fmt: skip
        else:
            pid_n, pid_s = _work_item(tl.program_id(0), n_row_blocks, n_split, GROUP_ROWS)
            _top2_block(
                h_ptr, w_ptr, val_ptr, idx_ptr, lse_ptr, pid_n, pid_s,
                n_rows, vocab, dim, v_per_split, stride_h, stride_w,
                BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, TMA, FP32, PRECISION, WITH_LSE,
            )  # fmt: skip


def top2_triton(
    h: Tensor, lm_head: Tensor, cfg: Top2Config | None = None, *, lse: bool = False
) -> tuple[Tensor, ...]:
    """The fused kernel: h (N, d), lm_head (V, d) (bf16/fp16/fp32, one dtype) -> (N, 2)
    float32, (N, 2) int64 (and, with lse, the rows' log-sum-exp (N,) float32).

    Host work is shape arithmetic only (no sync), so it can be captured in a CUDA graph
    once the kernel is compiled. Also runs on CPU tensors under TRITON_INTERPRET=1.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, d = h.shape
    vocab, d_w = lm_head.shape
    if d != d_w or h.stride(1) != 1 or lm_head.stride(1) != 1:
        raise ValueError(f"need unit-stride rows of one width, got {h.shape}, {lm_head.shape}")
    if h.dtype != lm_head.dtype or h.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"h and lm_head must share a dtype of {KERNEL_DTYPES}: {h.dtype}, {lm_head.dtype}"
        )
    n_sm = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 4
    if cfg is None or cfg.n_split == 0:  # the split that fills this GPU for these rows
        cfg = default_config(n, vocab, n_sm, cfg or default_tiles(h.device, h.dtype))
    if cfg.block_k * h.dtype.itemsize > 128:  # a swizzled TMA box row, and shared memory
        cfg = replace(cfg, block_k=128 // h.dtype.itemsize)  # (fp32 at 64: 288 KB > 227 KB)
    if cfg.precision not in ("tf32", "ieee"):
        raise ValueError(f"precision {cfg.precision!r} is not 'tf32' or 'ieee'")
    per, n_split = _vocab_per_split(vocab, cfg)
    vals = torch.empty(n_split, n, 2, dtype=torch.float32, device=h.device)
    ids = torch.empty(n_split, n, 2, dtype=torch.int64, device=h.device)
    lses = torch.empty(n_split if lse else 1, n if lse else 1, dtype=torch.float32, device=h.device)
    row_blocks = triton.cdiv(n, cfg.block_n)
    n_work = row_blocks * n_split
    grid = (min(n_sm, n_work) if cfg.persistent else n_work,)
    a, b = h, lm_head
    if cfg.tma:
        a = TensorDescriptor.from_tensor(h, [cfg.block_n, cfg.block_k])
        b = TensorDescriptor.from_tensor(lm_head, [cfg.block_v, cfg.block_k])
    _top2_kernel[grid](
        a,
        b,
        vals,
        ids,
        lses,
        n,
        vocab,
        d,
        per,
        h.stride(0),
        lm_head.stride(0),
        row_blocks,
        n_split,
        n_work,
        BLOCK_N=cfg.block_n,
        BLOCK_V=cfg.block_v,
        BLOCK_K=cfg.block_k,
        EVEN_K=d % cfg.block_k == 0,
        TMA=cfg.tma,
        PERSISTENT=cfg.persistent,
        GROUP_ROWS=max(0, cfg.group_rows),
        FP32=h.dtype == torch.float32,
        PRECISION=cfg.precision,
        WITH_LSE=lse,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    v, i = (vals[0], ids[0]) if n_split == 1 else merge_top2(vals, ids)
    if not lse:
        return v, i
    return v, i, lses[0] if n_split == 1 else torch.logsumexp(lses, dim=0)


def top2(
    h: Tensor,
    lm_head: Tensor,
    *,
    n_chunks: int = 8,
    cfg: Top2Config | None = None,
    lse: bool = False,
) -> tuple[Tensor, ...]:
    """Top-2 logits of h @ lm_head.T: (N, d), (V, d) -> (N, 2) float32, (N, 2) int64, and
    with lse the rows' log-sum-exp (N,) float32.

    The fused kernel on CUDA bf16/fp16/fp32 with Triton; the chunked PyTorch path otherwise.
    """
    if available(h.device) and h.dtype in KERNEL_DTYPES:
        return top2_triton(h, lm_head, cfg, lse=lse)
    return top2_reference(h, lm_head, n_chunks, lse=lse)
