"""How a torch readout engine runs (`TorchEngineOptions`), the device it may run on, and
the shape buckets its cohorts are padded to.

Shapes. A cohort of at most K_MAX lanes is one enqueue: lanes, prompt rows and answer
depth are each padded up to a bucket, so a handful of fixed shapes cover all traffic.
- depth buckets (256, 1024, 2048, 4096, 8192): exact, because the mixer is prefix-causal
  (position t sees latents and positions <= t), so the positions added by padding cannot
  change the ones read; positions >= a lane's depth are masked out of the EOS scan.
- prompt buckets (64 ... 4096): padded rows are zeros and masked out of the pooling by
  prompt_lens, as in the reference's own right padding.
- lane buckets (1, 2, 4, 8), one graph per bucket rather than one max-K graph with masking:
  a single request (K=1) then pays for one lane, not eight. Filler lanes read one zero row
  at depth 0 and are dropped.
A shape beyond the largest bucket still runs, eagerly at its exact size (no graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stateblock.model.kernels.top2 import Top2Config

LANE_BUCKETS = (1, 2, 4, 8)
PROMPT_BUCKETS = (64, 256, 512, 1024, 2048, 4096)
DEPTH_BUCKETS = (256, 1024, 2048, 4096, 8192)
WARM_PROMPT = 512  # the prompt_len profile's typical value


class EngineUnavailable(RuntimeError):
    """The engine cannot run on the requested device."""


@dataclass(frozen=True)
class Shape:
    lanes: int
    prompt: int
    depth: int


def bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n; None when n is beyond them all (or there are none)."""
    return next((b for b in buckets if b >= n), None)


def require_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineUnavailable(
            f"readout engine 'torch' asked for device {str(dev)!r}, but torch sees no CUDA "
            f"device (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            "set STATEBLOCK_DEVICE=cpu to run it on the CPU"
        )
    if dev.type not in ("cuda", "cpu"):
        raise EngineUnavailable(f"readout engine 'torch' runs on cuda or cpu, not {dev.type!r}")
    return dev


@dataclass(frozen=True)
class TorchEngineOptions:
    """How a TorchEngine runs: device, shape buckets, graphs and precisions.

    None picks the device's default (see the module docstring): buckets, CUDA graphs, the
    fused head and attention, TF32 kernel dots and the bf16 greedy path on a GPU; exact
    shapes, eager fp32 and no fast path on the CPU.
    """

    device: str | torch.device = "cpu"
    lane_buckets: Sequence[int] | None = None
    prompt_buckets: Sequence[int] | None = None
    depth_buckets: Sequence[int] | None = None
    cuda_graphs: bool | None = None
    warm_shapes: Sequence[Shape] | None = None
    top2_config: Top2Config | None = None
    decoder_dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    matmul_precision: str = "highest"
    kernel_precision: str | None = None
    logprob_precision: str = "ieee"
    attention: str | None = None
    head: str | None = None
    head_dtype: torch.dtype = torch.float32
    greedy_dtype: torch.dtype | str | None = None
