"""What one long lane costs captured whole and in chunks (`stateblock.model.chunked`), on the
bench-scale base: per chunk the host time to launch it (until `step` returns) and the device
time to finish it, beside the whole lane's one eager forward; eagerly and, on CUDA, replayed
from the runner's CUDA graph. Answers whether a chunked part
is bound by the device or by the Python that launches its kernels (issue 38's fairness).

    python -m bench.chunk_cost --out DIR [--scale full] [--prompt-len 4096] [--chunks 512,1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.load_gpu import ints
from bench.models import SCALES, build_llama, sync
from stateblock.model.capture import capture
from stateblock.model.chunked import ChunkedLane, ChunkRunner


def whole(model, ids: torch.Tensor, device: str, repeats: int) -> dict:
    """The lane's one eager forward: ms, median of repeats (after one warm run)."""
    capture(model, ids)
    runs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        capture(model, ids)
        sync(device)
        runs.append(1000 * (time.perf_counter() - t0))
    return {"ms": round(statistics.median(runs), 2)}


def chunked(model, ids: torch.Tensor, chunk: int, device: str, repeats: int,
            graph: bool = False) -> dict:  # fmt: skip
    """The lane in chunks through one runner (with `graph`, its CUDA graph replayed): per
    chunk the launch (host) and finish (host + device) ms, median over repeats, and the whole
    lane's ms; the rows' mean abs difference from the whole forward's."""
    runner = ChunkRunner(model, chunk, ids.shape[1], graph=graph)
    ChunkedLane(model, ids, runner=runner).step()  # first-call costs out of the timings
    launch: list[list[float]] = []
    done: list[list[float]] = []
    totals, rows = [], None
    for _ in range(repeats):
        lane, la, do = ChunkedLane(model, ids, runner=runner), [], []
        sync(device)
        t_start = time.perf_counter()
        while not lane.finished:
            t0 = time.perf_counter()
            rows = lane.step()
            la.append(1000 * (time.perf_counter() - t0))
            sync(device)
            do.append(1000 * (time.perf_counter() - t0))
        totals.append(1000 * (time.perf_counter() - t_start))
        launch.append(la)
        done.append(do)
    ref = capture(model, ids)
    return {
        "chunk": chunk,
        "graphed": runner.graphed,
        "steps": len(launch[0]),
        "launch_ms": [round(statistics.median(c), 2) for c in zip(*launch, strict=True)],
        "done_ms": [round(statistics.median(c), 2) for c in zip(*done, strict=True)],
        "total_ms": round(statistics.median(totals), 2),
        "rows_mean_abs_diff": float((rows.float() - ref.float()).abs().mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--chunks", type=ints, default=[512, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    scale = SCALES[args.scale]
    model = build_llama(scale, args.device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, scale.vocab_size, (1, args.prompt_len), generator=gen).to(args.device)
    with torch.inference_mode():
        doc = {
            "scale": args.scale,
            "prompt_len": args.prompt_len,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "whole": whole(model, ids, args.device, args.repeats),
            "chunked": [chunked(model, ids, c, args.device, args.repeats) for c in args.chunks],
            "graphed": [
                chunked(model, ids, c, args.device, args.repeats, graph=True)
                for c in args.chunks
                if args.device == "cuda"
            ],
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunk_cost.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
