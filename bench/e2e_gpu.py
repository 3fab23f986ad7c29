"""End-to-end readout latency vs autoregressive decoding of the same base, on one GPU.

`python -m bench.e2e_gpu --out DIR [--scale full|tiny] [--engine torch|reference] [--n 50]`

1. Builds (bench/models.py, random weights, nothing downloaded) the 2.9 B Llama-shaped base
   on the device, saves it in bf16 with its tokenizer, and a matching readout decoder.
2. Capture-only prefill of the base (before the stack compiles it on another thread).
3. Serves that in-memory model through the whole request path in this process (nats-server,
   capture, readout workers, gateway; bench/stack.py) and sends N sequential
   /v1/completions requests: a 512-token prompt, max_tokens 1014, temperature 0. Every
   request must come back with all 1014 tokens (finish_reason "length"). Latency p50/p90
   and a per-request breakdown from the services' histograms plus two probes.
4. Capture-only prefill of a NemotronH-shaped hybrid.
5. HF `generate` of the same base for the same 1014 tokens: eager, then static cache +
   torch.compile (each in its own process, capped); seconds per answer and per token; the
   ratios.
Results go to DIR/e2e.json after every measurement; a markdown summary is printed last.
The full run is budgeted (--budget-s, default 520 s): a stage that would not fit is skipped
and the reason recorded, never silently.

On the GPU machine (no network, no nats-py there): `bench/prepare_wheels.sh` here first,
then carry ".whl" and run
  source bench/gpu_env.sh || exit 1; PYTHONUNBUFFERED=1 python3 -m bench.e2e_gpu --out $OUT
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.models import NEMOTRON, SCALES, bench_prompt, n_params
from bench.prefill import measure_hybrid_prefill, measure_prefill
from bench.report import Report, markdown, ms_summary, ratios

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "stateblock-bench"
CAPTURE = "stateblock_capture_seconds_sum"
READOUT = "stateblock_readout_seconds_sum"
REQUEST = "stateblock:e2e_request_latency_seconds_sum"
# Distributions whose versions go into the report: on the GPU machine the service ones come
# from the carried wheels (bench/gpu_env.sh), the rest from its image.
VERSIONS = ("torch", "transformers", "triton", "protobuf", "grpcio", "nats-py", "fastapi",
            "pydantic")  # fmt: skip
# What the services do not measure themselves, and how this bench stands in for it.
NOTES = [
    "No service metric covers the bus (publish -> worker fetch), block verification, the "
    "claim, the commit write or the gateway's KV watch. 'ingress_bus_claim' is inferred as "
    "(readout start - request sent) - capture service time; 'commit' and 'response' come "
    "from a NATS probe on the registry's KV subject.",
    "Readout start/end times come from a wrapper around the engine (the worker only "
    "observes a histogram, with no per-request time or exemplar).",
    "The HTTP response carries no timing fields (no server-timing header, no block id).",
    "'gateway', 'http_overhead', 'claim_to_readout' and 'readout_histogram' are other views "
    "of the same requests, not part of the partition. 'claim_to_readout' is the readout's "
    "start less the claim's KV write: negative when the readout (begun beside the claim) "
    "starts before the claim is stored.",
    "Requests set ignore_eos (vLLM's extension) so every answer reads all max_tokens "
    "positions; every answer is checked to hold max_tokens tokens.",
]


STAGES = (  # (prefix, histogram, stages): the services' stage metrics, per request
    ("capture", "stateblock_capture_stage_seconds",
     ("tokenize", "forward", "reserve", "sign", "publish")),
    ("worker", "stateblock_readout_stage_seconds",
     ("verify", "claim", "readout", "digest", "digest_wait", "commit", "ack")),
)  # fmt: skip
# the label sets beside `stage`: by route (a request in a cohort or in parts, a block read
# whole or in parts)
ROUTES = dict.fromkeys(("capture", "worker"), ({"route": "cohort"}, {"route": "parts"}))


def run_e2e(args, scale, client, serving, engine, metrics, probe) -> dict:
    """N sequential requests after a warm-up; latency and its breakdown per request."""
    from bench.stack import sequential_completions

    def hist(name: str, labels: dict | None = None) -> float:
        return metrics.get_sample_value(name, labels) or 0.0

    def sums() -> tuple[float, float, float]:
        return (
            hist(CAPTURE),
            hist(READOUT),
            hist(REQUEST, {"model_name": serving.name, "outcome": "ok"}),
        )

    def stage_sums() -> dict[str, float]:
        """The services' own stage histograms (sum per stage), as `capture.forward`, ..."""
        return {
            f"{svc}.{stage}": sum(
                hist(f"{metric}_sum", {"stage": stage, **route}) for route in ROUTES[svc]
            )
            for svc, metric, stages in STAGES
            for stage in stages
        }

    def acked() -> float:  # the worker observes its stages after the ack, past the reply
        return sum(
            hist("stateblock_readout_stage_seconds_count", {"stage": "ack", **route})
            for route in ROUTES["worker"]
        )

    rng = random.Random(args.seed)
    prompt_len, depth = args.prompt_len, args.max_tokens
    keys = ("e2e", "capture", "ingress_bus_claim", "readout", "commit", "response", "gateway",
            "http_overhead", "claim_to_readout", "readout_histogram")  # fmt: skip
    samples: dict[str, list[float]] = {k: [] for k in keys}
    completion, prompt_tokens, finish = [], [], {}
    errors: list[str] = []
    prompts = (bench_prompt(rng, prompt_len, scale.vocab_size) for _ in range(args.warmup + args.n))

    def snapshot() -> tuple:
        return sums(), len(engine.calls), stage_sums(), acked()

    for i, r, t0, t1, (before, calls, stages_before, acks) in sequential_completions(
        client, MODEL_NAME, prompts, depth, errors, snapshot
    ):
        if i < args.warmup:
            continue
        cap, read, req = (a - b for a, b in zip(sums(), before, strict=True))
        rid = r["id"].split("-", 1)[1]
        for _ in range(1000):  # the probe's copy of the commit can land just after the reply
            if rid in probe.block_of:
                break
            time.sleep(0.001)
        for _ in range(1000):
            if acked() > acks:
                break
            time.sleep(0.001)
        for key, value in stage_sums().items():
            samples.setdefault(key, []).append(value - stages_before[key])
        block = probe.block_of.get(rid)
        if block is None or len(engine.calls) != calls + 1:
            errors.append(f"request {rid}: no probe commit or not one readout call")
            continue
        r0, r1 = engine.calls[calls]
        t_commit, t_claim = probe.committed[block], probe.claimed.get(block, r0)
        for key, value in (
            ("e2e", t1 - t0), ("capture", cap), ("ingress_bus_claim", r0 - t0 - cap),
            ("readout", r1 - r0), ("commit", t_commit - r1), ("response", t1 - t_commit),
            ("gateway", req), ("http_overhead", (t1 - t0) - req),
            ("claim_to_readout", r0 - t_claim), ("readout_histogram", read),
        ):  # fmt: skip
            samples[key].append(value)
        choice = r["choices"][0]
        completion.append(r["usage"]["completion_tokens"])
        prompt_tokens.append(r["usage"]["prompt_tokens"])
        finish[choice["finish_reason"]] = finish.get(choice["finish_reason"], 0) + 1
    out: dict = {"n_ok": len(samples["e2e"]), "errors": errors[:5], "n_errors": len(errors)}
    if not samples["e2e"]:
        return out
    out.update(
        prompt_tokens=sorted(set(prompt_tokens)),
        completion_tokens={"min": min(completion), "max": max(completion)},
        all_full_depth=all(c == depth for c in completion),
        finish_reasons=finish,
        latency=ms_summary(samples["e2e"]),
        breakdown={k: ms_summary(v) for k, v in samples.items() if k != "e2e"},
        partition="e2e = capture + ingress_bus_claim + readout + commit + response",
    )
    return out


def ar_child(args, device: str, mode: str, repeats: int, cap_s: float, log: Path,
             budget_s: float | None = None) -> dict:  # fmt: skip
    """bench.ar_decode --mode MODE in its own process, killed at cap_s; a timed answer that
    would end past budget_s (from the child's start) is not begun."""
    out_json = log.with_suffix(".json")
    cmd = [sys.executable, "-m", "bench.ar_decode", "--mode", mode, "--scale", args.scale,
           "--device", device, "--prompt-len", str(args.prompt_len), "--new-tokens",
           str(args.max_tokens), "--repeats", str(repeats), "--seed", str(args.seed),
           "--out", str(out_json)]  # fmt: skip
    if budget_s is not None:
        cmd += ["--budget-s", f"{budget_s:.1f}"]
    t0 = time.perf_counter()
    with log.open("wb") as f:
        try:
            subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=cap_s)
        except subprocess.TimeoutExpired:
            reason = f"stopped at the {cap_s:.0f} s cap"
            partial = json.loads(out_json.read_text()) if out_json.exists() else {}
            if "answer_s" in partial:  # done, but the process was still exiting
                return dict(partial, note=f"finished; the process exit {reason}")
            runs = partial.get("runs_s", [])
            if not runs:
                what = "compile + first answers" if mode == "compiled" else "warm-up"
                return {"skipped": f"{what}: {reason}", "partial": partial}
            answer = statistics.median(runs)  # the answers it did time count
            return dict(partial, note=f"{reason} after {len(runs)} answer(s)", answer_s=answer,
                        per_token_ms=1000.0 * answer / args.max_tokens, repeats=len(runs),
                        tokens=partial["counts"][-1],
                        all_counts_exact=all(n == args.max_tokens for n in partial["counts"]))  # fmt: skip
    if not out_json.exists():
        tail = log.read_text(errors="replace")[-2000:]
        return {"failed": f"exit without a result; log tail:\n{tail}"}
    result = json.loads(out_json.read_text())
    result["process_s"] = time.perf_counter() - t0
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for e2e.json and logs")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--engine", default=None, help="readout engine (default: torch on CUDA)")
    ap.add_argument("--n", type=int, default=50, help="timed requests")
    ap.add_argument("--warmup", type=int, default=5, help="untimed requests first")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: the scale's")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the scale's")
    ap.add_argument("--workers", type=int, default=2, help="readout workers")
    ap.add_argument("--batch-window-ms", type=float, default=None,
                    help="capture batch window (default: the capture service's)")  # fmt: skip
    ap.add_argument("--nats-max-payload", type=int, default=8 << 20)
    ap.add_argument(
        "--capture-compile", default="off", help="capture: torch.compile backend or mode"
    )
    ap.add_argument("--blocks-storage", choices=["file", "memory"], default="file")
    ap.add_argument(
        "--data-plane",
        choices=["bus", "local"],
        default="bus",
        help="the in-process stack's rows: over NATS (the figures so far) or in the capture's "
        "slot pool on the GPU (`stateblock up`'s default)",
    )
    ap.add_argument(
        "--forward-state-digest",
        choices=["blake3", "sha256"],
        default="blake3",
        help="the capture's row hash (sha256: what a header without the field means)",
    )
    ap.add_argument(
        "--matmul-precision",
        choices=["highest", "high"],
        default="highest",
        help="torch engine: the decoder's linears in fp32, or TF32 (STATEBLOCK_MATMUL_PRECISION)",
    )
    ap.add_argument(
        "--greedy-dtype", choices=["", "bfloat16", "float32"], default="",
        help="torch engine: plain greedy cohorts in this dtype (STATEBLOCK_GREEDY_DTYPE)",
    )  # fmt: skip
    ap.add_argument(
        "--processes", action="store_true", help="one process per service, not one event loop"
    )
    ap.add_argument(
        "--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
        help="base and rows dtype (auto: bf16 on CUDA, fp32 on the CPU)",
    )  # fmt: skip
    ap.add_argument("--nemotron", choices=[*sorted(NEMOTRON), "none"], default=None)
    ap.add_argument("--prefill-repeats", type=int, default=5)
    ap.add_argument("--ar-eager-repeats", type=int, default=1)
    ap.add_argument("--ar-compiled", choices=["auto", "on", "off"], default="auto",
                    help="auto: on with CUDA only (CPU compile takes minutes)")  # fmt: skip
    ap.add_argument("--ar-compiled-repeats", type=int, default=3)
    ap.add_argument("--ar-compiled-cap-s", type=float, default=270.0)
    ap.add_argument("--budget-s", type=float, default=520.0, help="whole-run time budget")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work-dir", type=Path, default=None, help="models; default a /tmp dir")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for dist in VERSIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def environment(args, device: str) -> dict:
    """The run's settings and software, first in the report."""
    cuda = device.startswith("cuda")
    name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    plain = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    scale = SCALES[args.scale]
    return dict(
        plain,
        device=device,
        device_name=name,
        llama=scale.llama,
        vocab_size=scale.vocab_size,
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        versions=versions(),
    )


def serve_and_measure(args, scale, base, device: str, report: Report, left) -> None:
    """The stack on the in-memory base; the e2e requests; the stack stopped again."""
    from bench.procs import engine_options

    if args.processes:  # the deployment's shape: a process per service, from the saved files
        from bench.procs import serve_processes

        return serve_processes(args, scale, base, device, report, MODEL_NAME)
    from prometheus_client import CollectorRegistry

    from bench.models import serving_model
    from bench.stack import (
        CompletionsClient,
        KvProbe,
        TimedEngine,
        bench_stack_config,
        subscribe_probe,
    )
    from stateblock.app.stack import StackThread
    from stateblock.engines import create_engine

    setup = report.doc["setup"]
    t0 = time.perf_counter()
    serving = serving_model(MODEL_NAME, base)
    inner = create_engine(args.engine, serving, device, **engine_options(args))
    engine = TimedEngine(inner)
    setup["serving_checks_and_engine_load_s"] = time.perf_counter() - t0
    setup["engine_top2_backend"] = getattr(inner, "top2_backend", None)
    block_bytes = args.prompt_len * serving.hidden_size * serving.lm_head.element_size()
    inline = block_bytes + 65536 < args.nats_max_payload
    from capture_svc.config import CaptureConfig

    window_ms = args.batch_window_ms
    if window_ms is None:
        window_ms = 1000.0 * CaptureConfig().batch_window_s
    report.doc["config"].update(
        block_payload_bytes=block_bytes,
        payload_path="slot"
        if args.data_plane == "local"
        else "inline"
        if inline
        else "object store",
        effective_batch_window_ms=window_ms,
        capture_compile=args.capture_compile,
        blocks_storage=args.blocks_storage,
        forward_state_digest=args.forward_state_digest,
        data_plane=args.data_plane,
    )
    metrics, probe = CollectorRegistry(), KvProbe()
    stack_cfg = bench_stack_config(
        Path(setup["work_dir"]) / "stack",
        serving.name,
        workers=args.workers,
        batch_window_s=None if args.batch_window_ms is None else args.batch_window_ms / 1000.0,
        nats_max_payload=args.nats_max_payload,
        capture_compile=args.capture_compile,
        blocks_storage=args.blocks_storage,
        forward_state_digest=args.forward_state_digest,
        data_plane=args.data_plane,
    )
    t0 = time.perf_counter()
    stack = StackThread(stack_cfg, metrics=metrics, model=serving, engine=engine)
    urls = stack.start(timeout=max(60.0, left()))
    probe_nc = stack.call(subscribe_probe(urls.nats_admin, probe))
    setup["stack_start_s"] = time.perf_counter() - t0  # engine + capture warm-ups included
    report.write()
    client = CompletionsClient(urls.http, timeout=120.0)
    try:
        report.set("e2e", run_e2e(args, scale, client, serving, engine, metrics, probe))
    finally:
        client.close()
        stack.call(probe_nc.drain())
        stack.stop(timeout=60.0)
        # the stack may have compiled this model on its forward thread: nothing here runs it
        # again (the AR decodes build their own, each in its own process)
    if device.startswith("cuda"):
        setup["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30


def measure_ar(args, device: str, report: Report, deadline: float, left) -> None:
    compiled = args.ar_compiled == "on" or (args.ar_compiled == "auto" and device != "cpu")
    reserve = min(args.ar_compiled_cap_s, 120.0) if compiled else 5.0
    ar: dict = {}
    budget = deadline - reserve - time.perf_counter()
    if budget < 10.0:
        ar["eager"] = {"skipped": f"{left():.0f} s left of the budget"}
    else:  # the child's build and warm-up count in its budget; 30 s for its exit
        ar["eager"] = ar_child(args, device, "eager", args.ar_eager_repeats, budget + 30.0,
                               args.out / "ar_eager.log", budget_s=budget)  # fmt: skip
    report.set("ar", ar)
    cap = min(args.ar_compiled_cap_s, left() - 10.0)
    if args.ar_compiled == "off":
        ar["compiled"] = {"skipped": "--ar-compiled off"}
    elif not compiled:
        ar["compiled"] = {"skipped": "no CUDA device: torch.compile of the decode step takes "
                          "~50 s for the tiny model on this CPU; --ar-compiled on runs it"}  # fmt: skip
    elif cap < 60.0:
        ar["compiled"] = {"skipped": f"{left():.0f} s left of the budget, under a 60 s minimum"}
    else:
        ar["compiled"] = ar_child(args, device, "compiled", args.ar_compiled_repeats, cap,
                                  args.out / "ar_compiled.log")  # fmt: skip
    report.doc["skipped"] += [f"ar {k}: {v.get('skipped') or v.get('failed')}"
                              for k, v in ar.items() if "answer_s" not in v]  # fmt: skip
    report.set("ar", ar)


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    # one process crashed once (SIGSEGV) between its timed requests and the AR decode: a
    # crash prints every thread's Python stack to stderr (the log a device run returns)
    faulthandler.enable()
    args = parse_args(argv)
    deadline = t_start + args.budget_s

    def left() -> float:
        return deadline - time.perf_counter()

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    args.engine = args.engine or ("torch" if cuda else "reference")
    scale = SCALES[args.scale]
    args.prompt_len = args.prompt_len or scale.prompt_len
    args.max_tokens = args.max_tokens or scale.max_tokens
    nemotron = args.nemotron or ("8b" if args.scale == "full" else "tiny")

    import logging

    import structlog
    from transformers.utils import logging as hf_logging

    from bench.models import build_base_and_decoder
    from stateblock.engines import require_engine

    require_engine(args.engine)  # fail closed before minutes of model building
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if not cuda:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="stateblock-bench-"))
    config = dict(environment(args, device), nemotron=nemotron)
    report = Report(args.out / "e2e.json", {"config": config, "notes": NOTES, "skipped": []})
    doc = report.doc
    try:
        # bf16 weights either way; the CPU serves them in fp32 (bf16 matmuls are slow there)
        dtype = torch.bfloat16 if cuda else torch.float32
        if args.dtype != "auto":
            dtype = getattr(torch, args.dtype)
        base = build_base_and_decoder(scale, work, device, seed=args.seed, dtype=dtype)
        size = sum(p.stat().st_size for p in base.base_dir.glob("*.safetensors"))
        report.set(
            "setup",
            dict(
                base.timings, params=n_params(base.model), work_dir=str(work), base_bytes=size
            ),  # fmt: skip
        )
        measure_prefill(args, base, device, report, left)  # before the stack records CUDA graphs
        serve_and_measure(args, scale, base, device, report, left)
        measure_hybrid_prefill(args, nemotron, device, report, left)
        measure_ar(args, device, report, deadline, left)
        report.set("ratios", ratios(doc))
    finally:
        doc["elapsed_s"] = time.perf_counter() - t_start
        report.write()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(doc), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
