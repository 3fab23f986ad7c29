"""What both DDP trainers (`base_ddp`, `readout_ddp`) run on: this process's place in a
torchrun job, the model replicated over it, loaders, a run's plan (its step count from its
measured pace, and when it stops), the learning-rate schedule, and their shared flags."""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm


def log(*a):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*a, flush=True)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun job (or the whole job, without torchrun)."""

    ddp: bool
    rank: int
    world: int
    device: str


def init_ranks(device: str) -> Ranks:
    """Join torchrun's process group when launched by it; bind this rank's GPU."""
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    local = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = True
        # cuDNN's fused attention (PyTorch's first choice on Hopper) builds an execution plan
        # on the host for every new shape, and a batch's shape is new nearly every step: the
        # readout trainer's profile (H200) had 180 ms a step of CPU in it, 37 % of the wall.
        # Flash and memory-efficient attention need no plan.
        torch.backends.cuda.enable_cudnn_sdp(False)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return Ranks(ddp, rank, world, local)


def data_parallel(model: torch.nn.Module, r: Ranks) -> torch.nn.Module:
    if not r.ddp:
        return model
    ids = [r.device] if r.device.startswith("cuda") else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def ranks_agree(model: torch.nn.Module, r: Ranks) -> bool:
    """Whether every rank ends holding the same weights (a collective: every rank calls it).

    DDP keeps replicas equal only by averaging every gradient; a parameter outside the
    graph, or a rank that stepped once more, leaves rank 0's checkpoint one replica of
    several. The fingerprint (sum, sum of squares, an index-weighted sum, in float64) is
    compared exactly: equal gradients and one optimizer give bitwise-equal weights."""
    if not r.ddp:
        return True
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    idx = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(97)
    mine = torch.stack([flat.sum(), flat.square().sum(), (flat * idx).sum()]).to(r.device)
    every = [torch.empty_like(mine) for _ in range(r.world)]
    dist.all_gather(every, mine)
    return all(torch.equal(e, every[0]) for e in every)


def leave(r: Ranks) -> None:
    """End the process: out of the process group, then out at once (the loader's worker
    processes can hold the interpreter's exit on some platforms)."""
    if r.ddp:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


def loader(ds: torch.utils.data.IterableDataset, workers: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers, prefetch_factor=8 if workers else None
    )


class Plan:
    """A run's step count, planned from its pace (steps 100 to 300 of the run, past the
    warm-up) to fill `plan_minutes` (default `minutes`), and taken from rank 0 by every rank;
    until then `start + fallback`. `resumed_total`: a resumed run keeps its plan. The run
    itself stops after `minutes` (a schedule longer than one run spans several: a device call
    lasts at most 10 minutes, the cosine need not)."""

    def __init__(self, r: Ranks, start: int, resumed_total: int | None, minutes: float,
                 max_steps: int, fallback: int, plan_minutes: float | None = None) -> None:  # fmt: skip
        self.r, self.start, self.total = r, start, resumed_total
        self.minutes, self.max_steps, self.fallback = minutes, max_steps, fallback
        self.plan_minutes = plan_minutes or minutes
        self.t0 = self._t100 = self._tlog = time.perf_counter()
        self.losses: list[float] = []  # every 25th step's
        # rank 0's progress bar: steps against the plan (the fallback until it is planned)
        self.bar = tqdm(desc="train", unit="step", initial=start, mininterval=10,
                        total=resumed_total or start + fallback, disable=r.rank != 0)  # fmt: skip

    def update(self, opt, params, loss: torch.Tensor, step: int, note: str) -> None:
        """One optimizer step (clipped at 1), the loss kept every 25 steps and a line of
        metrics every 20 s; `step` is the count after this one, `note` ends the line."""
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        self.bar.update()
        if step % 25 == 0:
            self.losses.append(loss.item())
            self.bar.set_postfix(loss=f"{self.losses[-1]:.4f}", refresh=False)
        if time.perf_counter() - self._tlog > 20:
            self._tlog = time.perf_counter()
            recent = self.losses[-8:]
            log(
                f"step {step}/{self.total} loss {sum(recent) / max(1, len(recent)):.4f} "
                f"lr {opt.param_groups[0]['lr']:.2e} t {self._tlog - self.t0:.0f}s {note}"
            )

    def steps(self, step: int) -> int:
        """Called before each step: the planned total so far (the schedule's length)."""
        if self.total is None and step - self.start == 300:
            pace = (time.perf_counter() - self._t100) / 200
            left = self.plan_minutes * 60 - (time.perf_counter() - self.t0)
            total = min(self.start + self.max_steps, step + int(left / pace))
            if self.r.ddp:  # every rank takes rank 0's plan
                tt = torch.tensor([total], device=self.r.device)
                dist.broadcast(tt, 0)
                total = int(tt.item())
            self.total = self.bar.total = total
            log(f"pace {pace * 1000:.1f} ms/step -> total {total} steps")
        if step - self.start == 100:
            self._t100 = time.perf_counter()
        return self.total if self.total is not None else self.start + self.fallback

    def done(self, step: int) -> bool:
        if self._done(step):
            self.bar.close()
            return True
        return False

    def _done(self, step: int) -> bool:
        """Called after each step: the plan or max_steps reached, or the clock out. A run
        that ends before its schedule stops at `minutes`; one whose plan fills its minutes
        gets 30 s of grace past them, then stops too: a pace measured at steps 100-300 can
        fall later (runs sharing a GPU: a base stage planned 6.3 minutes ran 9.2)."""
        if (self.total is not None and step >= self.total) or step - self.start >= self.max_steps:
            return True
        short = self.plan_minutes > self.minutes  # this run ends before its schedule does
        late = time.perf_counter() - self.t0 > self.minutes * 60 + (0 if short else 30)
        if self.r.ddp:  # every rank takes rank 0's clock, every 10th step
            if step % 10:
                return False
            flag = torch.tensor([int(late)], device=self.r.device)
            dist.broadcast(flag, 0)
            late = bool(flag.item())
        if late:
            why = "end of this run's" if short else "wall-clock stop past the plan's"
            log(f"{why} {self.minutes} min at step {step}/{self.total}")
        return late


def lr_at(step, total, base, warmup):
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def ddp_parser(
    module: str, doc: str, *, minutes: float, batch: tuple[int, str], lr: float, warmup: int
) -> argparse.ArgumentParser:
    """The flags both DDP trainers take: the run's budget, its batches and loaders, the
    optimizer's schedule, the task weights and the device; each trainer's own defaults."""
    ap = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = ap.add_argument
    add("--minutes", type=float, default=minutes, help="wall-clock budget of this run")
    add("--max-steps", type=int, default=10**9, help="steps of this run at most")
    add("--budget", type=int, default=65536, help="padded tokens a batch, per GPU")
    add("--max-batch", type=int, default=batch[0], help=batch[1])
    add("--pool", type=int, default=3000, help="fresh prompts a loader worker draws at a time")
    add("--workers", type=int, default=6, help="loader worker processes per GPU (0: inline)")
    add("--lr", type=float, default=lr, help="peak learning rate")
    add("--warmup", type=int, default=warmup, help="warm-up steps")
    add("--seed", type=int, default=0, help="random seed")
    add("--reschedule", action="store_true", help="resumed state: new warmup+cosine over this run")
    add("--weights", default="{}", help='family sampling weights, JSON ({"sort": 2})')
    add("--device", default="cuda", help="cuda (DDP over torchrun's ranks) or cpu")
    return ap
