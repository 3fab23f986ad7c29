"""Capture-only prefill timings: the e2e base, and a NemotronH-shaped hybrid base."""

from __future__ import annotations

import importlib.util
import statistics
import time

import torch

from bench.models import build_nemotron, n_params, sync
from bench.report import Report
from capture_svc.config import CUDA_GRAPH_MODES


def failure(e: BaseException) -> dict:
    """A stage that broke: recorded, and the run goes on to the next stage."""
    return {"failed": f"{type(e).__name__}: {e}"[:2000]}


def time_prefill(
    model, prompt_len: int, device: str, repeats: int, seed: int, lanes: int = 1
) -> dict:
    """`capture()` over `lanes` prompts padded as the capture service pads them, as one
    cohort; median of repeats."""
    from capture_svc.batcher import bucket_width
    from stateblock.model.capture import capture

    width = bucket_width(prompt_len)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (lanes, width), generator=gen).to(device)
    with torch.inference_mode():
        for _ in range(3):  # a compiled backbone compiles (and records its graphs) here
            capture(model, ids)
        runs = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            rows = capture(model, ids)
            sync(device)
            runs.append(time.perf_counter() - t0)
    return {
        "prompt_len": prompt_len,
        "lanes": lanes,
        "padded_width": width,
        "compiled": getattr(model.base_model, "_stateblock_compiled", None) or "off",
        "rows_finite": bool(torch.isfinite(rows.float()).all()),
        "params": n_params(model),
        "median_ms": 1000.0 * statistics.median(runs),
        "runs_ms": [1000.0 * r for r in runs],
    }


def nemotron_prefill(args, preset: str, device: str) -> dict:
    t0 = time.perf_counter()
    hybrid = build_nemotron(preset, device, args.seed)
    build_s = time.perf_counter() - t0
    try:
        p = time_prefill(hybrid, args.prompt_len, device, args.prefill_repeats, args.seed)
        return dict(
            p,
            preset=preset,
            build_s=build_s,
            pattern=hybrid.config.hybrid_override_pattern,
            mamba_kernels=importlib.util.find_spec("mamba_ssm") is not None,
        )
    finally:
        del hybrid
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def measure_prefill(args, base, device: str, report: Report, left) -> None:
    """The base's eager (and, where it can, compiled) prefill through `capture()`.

    Run before the e2e stack: the stack's compiled capture records CUDA graphs on its forward
    thread, and touching the same model or dynamo from this thread after that thread is gone
    can crash the process (a segfault in about one run of six, after the stack had stopped
    and before a prefill stage that followed it)."""
    prefill: dict = report.doc.setdefault("prefill", {})
    try:
        prefill["llama"] = time_prefill(
            base.model, args.prompt_len, device, args.prefill_repeats, args.seed
        )
    except Exception as e:
        prefill["llama"] = failure(e)
    if args.capture_compile in CUDA_GRAPH_MODES:
        # inductor's CUDA-graph trees live in the thread that first records one (the capture
        # service's forward thread, next); recording on this thread first would bind them here
        prefill["llama_compiled"] = {
            "skipped": "CUDA-graph trees are bound to the capture service's forward thread "
            "in this process; the service's capture span is the compiled figure"
        }
    elif args.capture_compile != "off" and left() > 150:
        from stateblock.model.capture import compile_backbone, uncompile_backbone

        try:  # the same forward compiled, as STATEBLOCK_CAPTURE_COMPILE does in the service
            compile_backbone(base.model, args.capture_compile)
            prefill["llama_compiled"] = time_prefill(
                base.model, args.prompt_len, device, args.prefill_repeats, args.seed
            )
        except Exception as e:
            prefill["llama_compiled"] = failure(e)
        finally:
            uncompile_backbone(base.model)  # the stack compiles it again on its own thread
    _note_skipped(report, prefill)


def measure_hybrid_prefill(args, nemotron: str, device: str, report: Report, left) -> None:
    """The NemotronH-shaped hybrid's prefill through `capture()` (a model of its own)."""
    prefill: dict = report.doc.setdefault("prefill", {})
    if nemotron == "none":
        prefill["nemotron"] = {"skipped": "--nemotron none"}
    elif left() < 90:
        prefill["nemotron"] = {"skipped": f"{left():.0f} s left of the budget"}
    else:
        try:
            prefill["nemotron"] = nemotron_prefill(args, nemotron, device)
        except Exception as e:  # e.g. another transformers' NemotronH config or forward
            prefill["nemotron"] = failure(e)
    _note_skipped(report, {"nemotron": prefill["nemotron"]})


def _note_skipped(report: Report, measured: dict) -> None:
    report.doc["skipped"] += [f"prefill {k}: {v.get('skipped') or v.get('failed')}"
                              for k, v in measured.items() if "median_ms" not in v]  # fmt: skip
    report.write()
