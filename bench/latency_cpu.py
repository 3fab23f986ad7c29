"""End-to-end vs in-process latency on the CPU, for one prompt (`python -m bench.latency_cpu`).

HTTP: the embedded stack (nats-server, capture, readout workers, gateway) in this process on a
background event loop, N sequential /v1/completions requests through the openai client.
In-process: the same prompt through `stateblock.model.capture.capture` + the readout engine, padded
as the capture service pads it. The difference of the p50s is the serving overhead.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog
import torch

from capture_svc.batcher import bucket_width
from stateblock import settings
from stateblock.app.stack import StackThread, StackUrls, UpConfig
from stateblock.engines import LaneRequest, create_engine
from stateblock.model.loading import ServingModel, load_serving_model
from stateblock.runtime import DEFAULT_MODEL_NAME, REFERENCE_BASE, REFERENCE_DECODER


def timed(fn: Callable[[], object], n: int, warmup: int) -> tuple[list[float], object]:
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def pct(xs: list[float], q: float) -> float:
    return (
        statistics.quantiles(xs, n=100, method="inclusive")[round(q) - 1] if len(xs) > 1 else xs[0]
    )


@contextmanager
def embedded_stack(
    workers: int,
    base_dir: Path = REFERENCE_BASE,
    decoder_dir: Path = REFERENCE_DECODER,
    data_plane: str = settings.DATA_PLANE.default_for(settings.UP),
) -> Iterator[StackUrls]:
    """The embedded stack on free ports in a throwaway data dir, stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="stateblock-bench-") as tmp:
        stack = StackThread(
            UpConfig.on_free_ports(
                Path(tmp),
                workers=workers,
                base_dir=base_dir,
                decoder_dir=decoder_dir,
                data_plane=data_plane,
            )
        )
        urls = stack.start(timeout=120.0)
        try:
            yield urls
        finally:
            stack.stop()


def in_process_fn(model: ServingModel, engine, prompt: str, max_tokens: int) -> Callable[[], str]:
    def run() -> str:
        with torch.inference_mode():
            rows = model.prompt_rows(prompt, pad_to=bucket_width)
        (result,) = engine.readout([LaneRequest(rows=rows, depth=max_tokens)])
        return model.tokenizer.decode(list(result.token_ids), skip_special_tokens=True)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="copy: hello")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-n", "--requests", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch default); 1 by default: on a small shared CPU, "
        "a multi-threaded main-thread forward can be ~100x slower than a 1-thread one",
    )
    ap.add_argument("--workers", type=int, default=2, help="readout workers in the stack")
    ap.add_argument(
        "--data-plane",
        choices=("bus", "local"),
        default=settings.DATA_PLANE.default_for(settings.UP),
        help="how the stack's rows travel (STATEBLOCK_DATA_PLANE; `stateblock up`: local)",
    )
    ap.add_argument("--base-dir", type=Path, default=REFERENCE_BASE)
    ap.add_argument("--decoder-dir", type=Path, default=REFERENCE_DECODER)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.threads:
        torch.set_num_threads(args.threads)

    import openai

    with embedded_stack(args.workers, args.base_dir, args.decoder_dir, args.data_plane) as urls:
        client = openai.OpenAI(base_url=f"{urls.http}/v1", api_key="unused", max_retries=0)

        def http_call() -> str:
            r = client.completions.create(
                model=DEFAULT_MODEL_NAME, prompt=args.prompt, max_tokens=args.max_tokens
            )
            return r.choices[0].text

        http_times, http_text = timed(http_call, args.requests, args.warmup)

    model = load_serving_model(DEFAULT_MODEL_NAME, args.base_dir, args.decoder_dir)
    engine = create_engine("reference", model)
    engine.warm_up()
    local = in_process_fn(model, engine, args.prompt, args.max_tokens)
    local_times, local_text = timed(local, args.requests, args.warmup)

    ms = 1000.0
    rows = [
        (f"HTTP /v1/completions (embedded stack, data plane {args.data_plane})", http_times),
        ("in-process capture + decoder", local_times),
    ]
    print(
        f"prompt={args.prompt!r} max_tokens={args.max_tokens} n={args.requests} "
        f"warmup={args.warmup} torch_threads={torch.get_num_threads()}"
    )
    print(
        f"machine: processor={platform.processor() or platform.machine()!r} "
        f"cpu_count={os.cpu_count()} python={platform.python_version()} torch={torch.__version__}"
    )
    print()
    print("| path | p50 (ms) | p90 (ms) | mean (ms) |")
    print("|---|---:|---:|---:|")
    for name, t in rows:
        print(
            f"| {name} | {pct(t, 50) * ms:.1f} | {pct(t, 90) * ms:.1f} | "
            f"{statistics.fmean(t) * ms:.1f} |"
        )
    print()
    print(
        f"p50 difference (HTTP - in-process): {(pct(http_times, 50) - pct(local_times, 50)) * ms:.1f} ms"
    )
    print(f"answers agree: {http_text == local_text}")


if __name__ == "__main__":
    main()
