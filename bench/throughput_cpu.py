"""Throughput against the number of readout workers on the CPU (`python -m bench.throughput_cpu`).

For each worker count, a fresh embedded stack (nats-server, capture, W readout workers,
gateway) in this process, and C client threads sending `/v1/completions` back to back
until N requests are answered. Reported: answered requests per second and the latency
percentiles under that load. The readout is the heavy step here (64 positions through the
decoder vs a 9-token prefill), so it is what extra workers can spread over the cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import structlog
import torch

from bench.latency_cpu import embedded_stack, pct
from stateblock.runtime import DEFAULT_MODEL_NAME


def run_load(url: str, body: dict, n: int, concurrency: int) -> tuple[float, list[float]]:
    """(wall seconds, per-request latencies) for n requests from `concurrency` threads."""
    counter = iter(range(n))
    lock = threading.Lock()
    latencies: list[float] = []

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120.0) as http:
            while True:
                with lock:
                    if next(counter, None) is None:
                        return
                t0 = time.perf_counter()
                r = http.post("/v1/completions", json=body)
                r.raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    return time.perf_counter() - t0, latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4", help="readout worker counts to compare")
    ap.add_argument("--concurrency", type=int, default=8, help="client threads")
    ap.add_argument("-n", "--requests", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt", default="copy: hello")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(args.threads)
    body = {"model": DEFAULT_MODEL_NAME, "prompt": args.prompt, "max_tokens": args.max_tokens}
    results = []
    for workers in (int(w) for w in args.workers.split(",")):
        with embedded_stack(workers) as urls:
            run_load(urls.http, body, args.warmup, args.concurrency)
            wall, lat = run_load(urls.http, body, args.requests, args.concurrency)
        row = {
            "workers": workers,
            "requests": len(lat),
            "req_per_s": round(len(lat) / wall, 1),
            "p50_ms": round(pct(lat, 50) * 1e3, 1),
            "p90_ms": round(pct(lat, 90) * 1e3, 1),
            "mean_ms": round(statistics.fmean(lat) * 1e3, 1),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} at {torch.get_num_threads()} thread(s); "
        f"{args.concurrency} client threads, prompt {args.prompt!r}, max_tokens {args.max_tokens}"
    )
    print("\n| readout workers | req/s | p50 (ms) | p90 (ms) |\n|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['workers']} | {r['req_per_s']} | {r['p50_ms']} | {r['p90_ms']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
