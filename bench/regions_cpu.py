"""The host data plane's region bound at saturation (`python -m bench.regions_cpu`).

A capture whose every region is unread makes each new block wait for a reader. Here C
writer tasks reserve and write regions against a bound of L, and one reader frees them in
order at R regions a second, all on one event loop as in the capture process. Reported:
regions a second and the process's CPU milliseconds a region. The reader's rate bounds the
first; the second is what the capture's event loop pays to wait, the cost the bound must
keep small, since that loop also serves every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import time
from pathlib import Path

from stateblock.model.shm import SHM_DIR, HostRegions, unlink_region


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run(writers: int, limit: int, per_writer: int, read_rate: float, size: int) -> dict:
    with tempfile.TemporaryDirectory(dir=SHM_DIR if SHM_DIR.is_dir() else None) as d:
        regions = HostRegions(limit, 600.0, shm_dir=Path(d))
        queue: asyncio.Queue[str] = asyncio.Queue()
        total = writers * per_writer

        async def writer(w: int) -> None:
            for i in range(per_writer):
                name = await regions.reserve(f"b{w}-{i}", time.time() + 600, 600.0)
                regions.write(name, b"\0" * size)
                await queue.put(name)

        async def reader() -> None:
            for _ in range(total):
                name = await queue.get()
                await asyncio.sleep(1.0 / read_rate)
                unlink_region(name, Path(d))

        c0, t0 = cpu_s(), time.perf_counter()
        await asyncio.gather(reader(), *(writer(w) for w in range(writers)))
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        left, held = len(list(Path(d).iterdir())), regions.held()
    return {
        "writers": writers, "limit": limit, "regions": total, "read_rate": read_rate,
        "regions_per_s": round(total / wall, 1), "cpu_ms_per_region": round(cpu / total * 1e3, 3),
        "left_on_disk": left, "held_after": held,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=128, help="requests waiting at once")
    ap.add_argument("--limit", type=int, default=64, help="STATEBLOCK_DATA_PLANE_SLOTS")
    ap.add_argument("--per-writer", type=int, default=16)
    ap.add_argument("--read-rate", type=float, default=1000.0, help="regions freed a second")
    ap.add_argument("--size", type=int, default=4096, help="bytes a region")
    args = ap.parse_args()
    result = asyncio.run(run(args.writers, args.limit, args.per_writer, args.read_rate, args.size))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
