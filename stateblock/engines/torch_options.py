"""How a torch readout engine runs (`TorchEngineOptions`), the device it may run on, and
the shape buckets its cohorts are padded to.

Shapes. A cohort of at most K_MAX lanes is one enqueue: lanes, prompt rows and answer
depth are each padded up to a bucket, so a handful of fixed shapes cover all traffic.
- depth buckets (256, 1024, 2048, 4096, 8192): exact, because the mixer is prefix-causal
  (position t sees latents and positions <= t), so the positions added by padding cannot
  change the ones read; positions >= a lane's depth are masked out of the EOS scan.
- prompt buckets (64 ... 4096): padded rows are zeros and masked out of the pooling by
  prompt_lens, as in the reference's own right padding.
- lanes: every execution at a depth bucket runs with the same number of lanes
  (`execution_lanes`: the most of (1, 2, 4, 8) within LANE_POSITIONS answer positions,
  8 lanes up to depth 1,024, one at 8,192), however many lanes came together; filler lanes
  read one zero row at depth 0 and are dropped. A lane's kernels (GEMM tiles, attention
  splits) are chosen by the shape, and on a GPU they differ between shapes in their float
  sums: with the shape fixed by the depth alone, a lane's answer is the same bits alone as
  in company. (A lane bucket chosen by the lanes' count would change a lane's shape with
  its company, and on the H200 that changes greedy answers: docs/BENCHMARKS.md.)
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
LANE_POSITIONS = 8192  # answer positions (lanes x depth bucket) an execution reads at most


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


def reachable_shapes(
    prompt_max: int, depth_max: int, lane_b: Sequence[int], prompt_b: Sequence[int],
    depth_b: Sequence[int],
) -> tuple[Shape, ...]:  # fmt: skip
    """Every bucketed shape a lane of at most `prompt_max` rows and `depth_max` answer
    positions can run at: each prompt bucket up to prompt_max's, each depth bucket up to
    depth_max's, at that depth's execution lanes (longer lanes run eagerly, unbucketed)."""
    top_p = bucket(prompt_max, prompt_b) or max(prompt_b, default=0)
    top_d = bucket(depth_max, depth_b) or max(depth_b, default=0)
    return tuple(
        Shape(execution_lanes(d, lane_b), p, d)
        for d in depth_b
        if d <= top_d
        for p in prompt_b
        if p <= top_p
    )


def execution_lanes(depth_bucket: int, lane_buckets: Sequence[int]) -> int:
    """The lanes every execution at `depth_bucket` runs with: the largest lane bucket whose
    lanes x depth stay within LANE_POSITIONS (the smallest when none does). It depends on
    the depth alone, never on how many lanes came together."""
    fits = [k for k in lane_buckets if k * depth_bucket <= LANE_POSITIONS]
    return max(fits, default=min(lane_buckets))


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
    # (prompt rows, answer depth) at most a request brings: warm_up then records every
    # bucketed shape up to them at every precision path, so no request records a graph
    warm_up_to: tuple[int, int] | None = None
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
