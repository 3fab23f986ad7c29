"""Where the time goes under load, seen from outside the services (`bench.load_gpu`).

- CPU cores each process used: utime + stime from /proc/<pid>/stat over the wall time;
- GPU busy: `nvidia-smi --query-gpu=utilization.gpu -lms` sampled in a thread;
- bytes through NATS: nats-server's `/varz` (in_bytes, out_bytes) before and after;
- the services' stage histograms: per request the mean of each stage, and its sum over the
  wall time, the number of requests in that stage at once on average (Little's law).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from contextlib import contextmanager

# what the load bench scrapes: the procs.SCRAPED histograms, the capture's lanes per forward
# and its forwards that compiled after the warm-up
COMPILED = "stateblock_capture_compiled_after_warmup"
ALLOCATOR = "stateblock_capture_cuda_allocator"  # its events: capture_svc.service.AllocatorEvents
FAMILIES = (
    "stateblock_capture_seconds",
    "stateblock_capture_stage_seconds",
    "stateblock_capture_cohort_lanes",
    "stateblock_readout_stage_seconds",
    "stateblock_readout_cohort_blocks",
    COMPILED,
    ALLOCATOR,
)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14 and 15


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        seconds = cpu_seconds(pid)
        if seconds is not None:
            out[name] = seconds
    return out


def cores_used(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """{process: CPU cores used on average over `wall`}."""
    return {n: round((after[n] - before[n]) / wall, 3) for n in after if n in before}


class GpuBusy:
    """nvidia-smi's utilization.gpu every `interval_ms`, kept with the arrival time."""

    def __init__(self, interval_ms: int = 100) -> None:
        self.interval_ms = interval_ms
        self.times: list[float] = []
        self.values: list[float] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """False where there is no nvidia-smi (the CPU): nothing is sampled."""
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return False
        cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
               "--loop-ms", str(self.interval_ms), "--id=0"]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, name="gpu-busy", daemon=True)
        self._thread.start()
        return True

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                value = float(line.strip())
            except ValueError:  # a header or "[N/A]"
                continue
            self.times.append(time.perf_counter())
            self.values.append(value)

    def mean(self, t0: float, t1: float) -> float | None:
        """Mean utilisation (%) of the samples that arrived between t0 and t1."""
        i, j = bisect_left(self.times, t0), bisect_right(self.times, t1)
        window = self.values[i:j]
        return round(sum(window) / len(window), 1) if window else None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
        if self._thread is not None:
            self._thread.join(5)


def varz(url: str | None) -> dict[str, int]:
    """nats-server's traffic counters; {} without a monitoring URL."""
    if url is None:
        return {}
    with urllib.request.urlopen(f"{url}/varz", timeout=5) as r:
        doc = json.loads(r.read())
    return {k: int(doc[k]) for k in ("in_bytes", "out_bytes", "in_msgs", "out_msgs")}


def nats_rates(before: dict[str, int], after: dict[str, int], wall: float) -> dict:
    """Bytes and messages per second through nats-server (in: published to it; out:
    delivered by it)."""
    return {f"{k}_per_s": round((after[k] - before[k]) / wall, 1) for k in after if k in before}


def stage_key(name: str, stage: str) -> str:
    base = name.removeprefix("stateblock_").rsplit("_", 1)[0]  # drop _sum / _count
    prefix = {
        "capture_seconds": "capture",
        "capture_stage_seconds": "capture",
        "capture_cohort_lanes": "capture.cohort_lanes",
        "readout_stage_seconds": "worker",
        "readout_cohort_blocks": "worker.cohort_blocks",
    }[base]
    return f"{prefix}.{stage}" if stage else prefix


def stages(before: dict, after: dict, wall: float) -> dict:
    """{stage: {n, mean_ms, in_flight}} over one level; the cohort histogram gives forwards
    (n) and mean lanes per forward instead."""
    out: dict[str, dict] = {}
    for (name, stage), value in after.items():
        if name == ALLOCATOR + "_total":  # the capture's allocator events over the level
            n = value - before.get((name, stage), 0.0)
            out.setdefault("capture.allocator", {})[stage] = int(n)
        if not name.endswith("_sum"):
            continue
        count_key = (name.removesuffix("_sum") + "_count", stage)
        n = after.get(count_key, 0.0) - before.get(count_key, 0.0)
        total = value - before.get((name, stage), 0.0)
        if n <= 0:
            continue
        key = stage_key(name, stage)
        if key == "capture.cohort_lanes":
            out[key] = {"forwards": int(n), "mean_lanes": round(total / n, 2),
                        "forwards_per_s": round(n / wall, 1)}  # fmt: skip
        elif key == "worker.cohort_blocks":
            out[key] = {"executions": int(n), "mean_blocks": round(total / n, 2),
                        "executions_per_s": round(n / wall, 1)}  # fmt: skip
        else:
            out[key] = {"n": int(n), "mean_ms": round(1000.0 * total / n, 3),
                        "in_flight": round(total / wall, 3)}  # fmt: skip
    return out


@contextmanager
def stage_window(stack) -> Iterator[dict]:
    """The services' stages (`stages`) over the block it wraps, in the dict it yields under
    "stages" once the block is over (a worker observes its stages just after its ack, past
    the reply: read 0.2 s later)."""
    seen: dict = {}
    lags = getattr(stack, "loop_lag", dict)  # the in-process bench stack has no processes
    lag_before, before, t0 = lags(), stack.scrape(FAMILIES), time.perf_counter()
    yield seen
    wall = time.perf_counter() - t0
    time.sleep(0.2)
    seen["stages"] = stages(before, stack.scrape(FAMILIES), wall)
    seen["loop_lag"] = loop_stalls(lag_before, lags())


def loop_stalls(before: dict, after: dict) -> dict:
    """{process: {wakeups, over_10ms, over_50ms, worst_ms}} of its event loop between two
    `ProcStack.loop_lag` readings: how often it woke over 10 and 50 ms late, and the bucket
    bound the latest wake-up stayed within (inf: over the last bound)."""
    out = {}
    for name, buckets in after.items():
        seen = {le: n - before.get(name, {}).get(le, 0.0) for le, n in buckets.items()}
        total = seen.get(float("inf"), 0.0)
        if total <= 0:
            continue
        worst = min(le for le, n in seen.items() if n >= total)
        out[name] = {
            "wakeups": int(total),
            "over_10ms": int(total - seen.get(0.01, total)),
            "over_50ms": int(total - seen.get(0.05, total)),
            "worst_ms": worst * 1000 if worst != float("inf") else "inf",
        }
    return out


def compiled(before: dict, after: dict) -> int:
    """Forwards over one level that compiled a graph after the warm-up (0 is the design)."""
    key = (COMPILED + "_total", "")
    return int(after.get(key, 0.0) - before.get(key, 0.0))


class Profiles:
    """py-spy samples of the services' Python stacks over one level (--profile-clients):
    one collapsed-stack file a process (`pyspy-<name>.txt`, each thread while it runs, not
    while it sleeps or waits), its samples by thread, and the top functions by own samples. An
    optional probe: without py-spy on the PATH (or allowed to read the processes) the report
    says so and the level is measured as any other."""

    def __init__(self, out_dir, pids: dict[str, int], seconds: float, rate: int = 200) -> None:
        self._exe = shutil.which("py-spy")
        self._out, self._pids, self._seconds, self._rate = out_dir, pids, seconds, rate
        self._procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        if self._exe is None:
            return
        for name, pid in self._pids.items():
            cmd = [self._exe, "record", "--pid", str(pid), "--duration", f"{self._seconds:.0f}",
                   "--rate", str(self._rate), "--format", "raw", "--threads",
                   "--nonblocking", "--output", str(self._out / f"pyspy-{name}.txt")]  # fmt: skip
            self._procs[name] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )

    def finish(self) -> dict:
        """{process: its top functions by own samples, or why it has none}."""
        if self._exe is None:
            return {"skipped": "py-spy is not on the PATH"}
        out = {}
        for name, proc in self._procs.items():
            try:
                _, err = proc.communicate(timeout=self._seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                err = "py-spy did not finish"
            path = self._out / f"pyspy-{name}.txt"
            out[name] = top_frames(path) if path.is_file() else {"error": (err or "")[-400:]}
        return out


def top_frames(path, n: int = 25) -> dict:
    """A collapsed-stack file's samples, and its top `n` leaf frames by share of them (the
    thread's name kept: `thread;frame;...;leaf count`)."""
    leaves: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        key = f"{frames[0]} :: {frames[-1]}"
        leaves[key] = leaves.get(key, 0) + int(count)
        threads[frames[0]] = threads.get(frames[0], 0) + int(count)
        total += int(count)

    def shares(counts: dict[str, int], k: int) -> list:
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:k]
        return [[name, round(v / max(total, 1), 4)] for name, v in top]

    return {"samples": total, "threads": shares(threads, 12), "top": shares(leaves, n)}
