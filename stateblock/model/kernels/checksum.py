"""The slot checksum's four sums in one pass over the rows (`stateblock.model.slots`).

Written in PyTorch the checksum is about 25 kernels over int64 copies of the rows; on a GPU
busy with forwards and readouts each of them waits for room on the multiprocessors, so a
block's checksum took milliseconds of queueing for microseconds of work. Here one program
per block of words loads its 16-bit words once, forms the four position weights in
registers, and adds its four partial sums into the output with integer atomics. Integer
sums (mod 2**64) are the same in any order, so the result is the reference's bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton is optional: CI and the CPU path never import it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

BLOCK = 4096


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _lane(w, idx, a: tl.constexpr, b: tl.constexpr, p: tl.constexpr):
        return tl.sum(w * ((idx * a + b) % p), axis=0)

    @triton.jit
    def _checksum_kernel(
        words_ptr, n, out_ptr,
        A0: tl.constexpr, B0: tl.constexpr, P0: tl.constexpr,
        A1: tl.constexpr, B1: tl.constexpr, P1: tl.constexpr,
        A2: tl.constexpr, B2: tl.constexpr, P2: tl.constexpr,
        A3: tl.constexpr, B3: tl.constexpr, P3: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < n
        raw = tl.load(words_ptr + idx, mask=mask, other=0)  # int16
        w = (raw.to(tl.int64) & 0xFFFF) + 1
        w = tl.where(mask, w, 0)
        tl.atomic_add(out_ptr + 0, _lane(w, idx, A0, B0, P0))
        tl.atomic_add(out_ptr + 1, _lane(w, idx, A1, B1, P1))
        tl.atomic_add(out_ptr + 2, _lane(w, idx, A2, B2, P2))
        tl.atomic_add(out_ptr + 3, _lane(w, idx, A3, B3, P3))


def checksum_sums(words: Tensor, lanes: tuple[tuple[int, int, int], ...]) -> Tensor:
    """(4,) int64 on the words' device: sum_i (w_i + 1) * ((i * a + b) mod p) per lane, for
    `words` (n,) int16 contiguous on a CUDA device, in one kernel."""
    if not available(words.device):
        raise RuntimeError("the checksum kernel needs Triton and a CUDA device")
    assert words.dtype == torch.int16 and words.is_contiguous() and len(lanes) == 4
    out = torch.zeros(4, dtype=torch.int64, device=words.device)
    n = words.numel()
    if n:
        flat = [v for lane in lanes for v in lane]
        _checksum_kernel[(triton.cdiv(n, BLOCK),)](words, n, out, *flat, BLOCK=BLOCK)
    return out
