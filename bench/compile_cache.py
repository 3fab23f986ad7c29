"""A compiled capture's start-up, from nothing and again from its compile cache
(`python -m bench.compile_cache`).

Each run is a fresh process, as a restarted capture is: it builds the bench base, keeps
inductor's caches in one directory (`STATEBLOCK_CAPTURE_COMPILE_CACHE`), compiles the
backbone and runs the warm-up over every (lane bucket, width bucket) shape the capture's
config reaches (the service's own `warm_shapes`). The first run starts from an empty
directory; the later ones find what it left. Reported per run: the warm-up's seconds and its
compiled-graph cache hits and misses. The capture is SERVING only after its warm-up, so
this is the start-up a compiled capture pays, first and after a restart.

    python -m bench.compile_cache --scale full --mode reduce-overhead --prompt-len-max 512
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.models import SCALES, build_llama, sync
from capture_svc.batcher import warm_shapes
from capture_svc.config import CaptureConfig
from stateblock.model.capture import (
    compile_backbone,
    compile_cache_counts,
    use_compile_cache,
    warm_up,
)


def shapes_of(mode: str, prompt_len_max: int, lane_buckets: str, cohort_lanes: int) -> list:
    """The shapes the capture service warms up for these settings."""
    config = CaptureConfig.from_env({
        "STATEBLOCK_CAPTURE_COMPILE": mode,
        "STATEBLOCK_PROMPT_LEN_MAX": str(prompt_len_max),
        "STATEBLOCK_CAPTURE_LANE_BUCKETS": lane_buckets,
        "STATEBLOCK_CAPTURE_COHORT_LANES": str(cohort_lanes),
    })  # fmt: skip
    return warm_shapes(config.warm_lane_buckets, config.limits.prompt_len_max, config.cohort)


def child(args: argparse.Namespace) -> dict:
    """One start-up: build, compile with the cache, warm every shape."""
    use_compile_cache(args.cache)
    model = build_llama(SCALES[args.scale], args.device, seed=0)
    if args.device == "cpu":
        model = model.float()
    shapes = shapes_of(args.mode, args.prompt_len_max, args.lane_buckets, args.cohort_lanes)
    t0 = time.perf_counter()
    compile_backbone(model, args.mode)
    warm_up(model, shapes, pad_id=0)
    sync(args.device)
    return {"warm_up_s": round(time.perf_counter() - t0, 2), "shapes": len(shapes),
            **compile_cache_counts()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", default=None, help="default: reduce-overhead on CUDA, else inductor")
    ap.add_argument("--prompt-len-max", type=int, default=512)
    ap.add_argument("--lane-buckets", default="1,2,4,8,16,32")
    ap.add_argument("--cohort-lanes", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2, help="start-ups; the first from nothing")
    ap.add_argument("--cache", type=Path, default=None, help="default: a new temp directory")
    ap.add_argument("--out", type=Path, default=None, help="a JSON file for the result")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.mode = args.mode or ("reduce-overhead" if args.device.startswith("cuda") else "inductor")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as tmp:
        args.cache = args.cache or Path(tmp)
        runs = []
        for _ in range(args.runs):
            cmd = [sys.executable, "-m", "bench.compile_cache", "--child",
                   *(argv if argv is not None else sys.argv[1:]), "--cache", str(args.cache),
                   "--mode", args.mode, "--device", args.device]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    report = {"scale": args.scale, "device": args.device, "mode": args.mode,
              "prompt_len_max": args.prompt_len_max, "lane_buckets": args.lane_buckets,
              "runs": runs}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
