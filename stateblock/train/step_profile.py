"""Where a training step's time goes: `--profile-steps N` runs torch.profiler over N steps of
a trainer once it is past its first steps (allocator warm-up, Triton and cuDNN autotuning)
and writes OUT/profile.txt: the window's wall time per step, the device's busy time per step
(the sum of kernel self times: how far from GPU-bound the step is), and the top operators by
self device time and by self host time.

Why: a readout trainer run can use as little as 15-30 % of an H200 (nvidia-smi every 10 s)
while its loader workers make batches far faster than it takes them; the step's host work is
the next speed-up, and this says which. The profiler adds host overhead of its own, so the
wall time it reports is an upper bound.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def _device_us(evt) -> float:
    # the attribute's name moved from cuda to device across torch releases
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, name, None)
        if v is not None:
            return float(v)
    return 0.0


class StepProfile:
    """Call `before(i)` ahead of each step, i = the steps this run has done, and `close(i)`
    after the last: a run that ends inside the window still stops the profiler (one left
    running crashes the interpreter at exit) and reports the steps it saw."""

    def __init__(self, n_steps: int, out: Path, start: int = 50) -> None:
        self.n, self.out, self.start = n_steps, out, start
        self.done = n_steps <= 0
        self._prof: profile | None = None
        self._t0 = 0.0

    def before(self, i: int) -> None:
        if self.done:
            return
        if i == self.start:
            acts = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=acts)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        elif i == self.start + self.n:
            self.close(i)

    def close(self, i: int) -> None:
        if self._prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        steps = max(1, i - self.start)
        self.out.write_text(self.report(self._prof, wall, steps))
        self._prof, self.done = None, True

    def report(self, prof: profile, wall: float, steps: int) -> str:
        events = prof.key_averages()
        busy = sum(_device_us(e) for e in events) / 1e3  # ms, kernels' self time
        per = 1e3 * wall / steps
        lines = [
            f"{steps} steps from step {self.start} of this run: {per:.1f} ms/step wall, "
            f"device busy {busy / steps:.1f} ms/step ({busy / (1e3 * wall):.0%} of the wall)",
            "",
        ]
        sorts = ["self_cpu_time_total"]
        if busy:
            sorts.insert(0, "self_cuda_time_total")
        for key in sorts:
            lines += [f"top operators by {key}", events.table(sort_by=key, row_limit=25), ""]
        return "\n".join(lines)
