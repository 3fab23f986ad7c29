"""The capture's base forward alone, as a cohort runs it: milliseconds and model TFLOP/s at
each lane count, against the GEMM rate a load run's forwards must reach.

The load bench sees a forward only through the GPU's busy fraction and the cohort's cycle
(docs/BENCHMARKS.md, "Against the 200 requests/s target"); this times `capture()` on
(lanes, width) batches of random ids back to back, with nothing else on the device, so a
load run's cycle splits into the forward's own time and the rest. Model FLOPs are
2 x the matmul parameters x padded tokens: the embedding is a lookup and the output head
runs on one position (`logits_to_keep=1`), so neither counts; the attention's own, about
3 % at 512, is left out.

With --profile-lanes N, one more forward of N lanes runs under torch's profiler and its
device time is split by kind of kernel (matmul, attention, the compiler's fused Triton
kernels, the rest), with the longest kernels: where the forward's time goes besides its
matmuls.

With --gemm-lanes N, the device's own matmul rate at the forward's shapes: one layer's
projections (each Linear's (in, out)) as plain `torch.mm` on N x width tokens, timed alone,
and one 8192^3 product; their rate is what the forward's "of GEMM" share is measured
against on this machine (the 755 TFLOP/s a flag can give is the smoke bench's, on an H200).

    python -m bench.forward_rate --out OUT [--lanes 1,8,16,30,32] [--width 512] \\
        [--compile off|default|reduce-overhead] [--profile-lanes 30] [--gemm-lanes 30] \\
        [--unmasked] [--rope-table] [--sdpa-backend cudnn|efficient|flash|math] \\
        [--gemm-backends TRITON] [--scale full] [--device cuda]

--sdpa-backend pins the attention's kernel family: which one is fastest for the base's
grouped key/value heads, and whether the kernel before it (the rotary embedding, and the
keys and values repeated for each query head where the kernel cannot group them) shrinks.

--gemm-backends sets the matmul kernels a `max-autotune` compile chooses among (inductor's
`max_autotune_gemm_backends`): `TRITON` alone makes every matmul one of inductor's Triton
templates, into which it can fuse the pointwise kernel after it (the SiLU x up product, the
residual adds), which cuBLAS cannot take; the forward's time says whether the fusion pays
for the templates' own rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.models import SCALES, build_llama
from bench.prefill import time_prefill
from bench.variants import add_variant_flags, apply_variants, variant_config


def matmul_params(model) -> int:
    """The parameters every token multiplies through: all but the embedding and the head."""
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant figures: a rate of the tiny CPU scale (thousandths of a
    TFLOP/s) keeps its digits where a fixed number of decimals would round it to zero."""
    return float(f"{x:.{digits}g}")


def rates(rows: list[dict], params: int, peak_tflops: float | None) -> list[dict]:
    """Each timing with its tokens, model TFLOP/s and (given a peak) its share of it."""
    out = []
    for r in rows:
        tokens = r["lanes"] * r["padded_width"]
        tflops = 2 * params * tokens / (r["median_ms"] / 1e3) / 1e12
        row = {**r, "tokens": tokens, "tflops": sig(tflops)}
        if peak_tflops:
            row["of_peak"] = sig(tflops / peak_tflops, 3)
        out.append(row)
    return out


# substrings of a kernel's (or, on the CPU, an operator's) name, lower case, in the order
# tried: flash attention kernels may also name a GEMM
KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::matmul", "aten::linear")),
    ("fused (triton)", ("triton",)),
)  # fmt: skip


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def split_by_kind(kernels: list[tuple[str, float]], top: int = 10) -> dict:
    """(name, self microseconds) of each kernel -> ms and share by kind, and the longest."""
    total = sum(us for _, us in kernels) or 1.0
    kinds: dict[str, float] = {}
    for name, us in kernels:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + us
    longest = sorted(kernels, key=lambda k: -k[1])[:top]
    return {
        "total_ms": round(total / 1e3, 3),
        "kinds": {k: {"ms": round(us / 1e3, 3), "share": round(us / total, 3)}
                  for k, us in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "longest": [{"name": n[:120], "ms": round(us / 1e3, 3), "kind": kernel_kind(n)}
                    for n, us in longest],
    }  # fmt: skip


def profile_forward(model, width: int, lanes: int, device: str) -> dict:
    """One forward of `lanes` x `width` under torch's profiler: its device kernels' time
    (its operators' on the CPU), split by kind."""
    from torch.profiler import ProfilerActivity, profile

    from stateblock.model.capture import capture

    cuda = device.startswith("cuda")
    ids = torch.randint(4, model.config.vocab_size, (lanes, width), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode():
        capture(model, ids)  # compiled: the shape's first call is not the one profiled
        with profile(activities=activities) as prof:
            capture(model, ids)
            if cuda:
                torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if cuda and on_device:
            kernels.append((e.key, float(getattr(e, "self_device_time_total", 0.0))))
        elif not cuda and e.key.startswith("aten::"):
            kernels.append((e.key, float(e.self_cpu_time_total)))
    return {"lanes": lanes, "width": width, **split_by_kind(kernels)}


def layer_shapes(model) -> list[tuple[str, int, int]]:
    """(name, in, out) of each Linear in the first decoder layer: the matmuls every token
    runs once a layer."""
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0"))
    return [(n, m.in_features, m.out_features) for n, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear)]  # fmt: skip


def gemm_rates(model, tokens: int, device: str, repeats: int, square: int = 8192) -> dict:
    """The matmul rate at one layer's projection shapes on `tokens` rows, each and summed as
    the forward runs them (each once a token), and at `square`^3."""
    from bench.machine import gemm_tflops

    dtype = next(model.parameters()).dtype
    shapes, total_s, total_flop = [], 0.0, 0.0
    for name, k, n in layer_shapes(model):
        tflops = gemm_tflops(dtype, tokens, k, n, device, repeats)
        flop = 2.0 * tokens * k * n
        s = flop / tflops / 1e12
        shapes.append({"name": name, "m": tokens, "k": k, "n": n, "ms": sig(s * 1e3),
                       "tflops": sig(tflops)})  # fmt: skip
        total_s, total_flop = total_s + s, total_flop + flop
    return {
        "tokens": tokens,
        "shapes": shapes,
        "layer_tflops": sig(total_flop / total_s / 1e12),
        "square": square,
        "square_tflops": sig(gemm_tflops(dtype, square, square, square, device, repeats)),
    }


def markdown(doc: dict) -> str:
    c = doc["config"]
    lines = [
        f"### The base forward alone ({c['scale']}, {c['device_name']}, compile `{c['compile']}`"
        + (" autotuned" if c.get("autotune") else "")
        + f", attention `{c.get('attention')}`)",
        f"{c['params']:,} matmul parameters (embedding and head left out); model FLOPs "
        "2 x those x lanes x width"
        + (f"; peak {c['peak_tflops']} TFLOP/s" if c["peak_tflops"] else ""),
        "",
        "| lanes | width | ms a forward | TFLOP/s | of peak | of this layer's matmuls |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["forwards"]:
        share = f"{r['of_peak']:.0%}" if "of_peak" in r else "-"
        gemm = f"{r['of_gemm']:.0%}" if "of_gemm" in r else "-"
        lines.append(
            f"| {r['lanes']} | {r['padded_width']} | {r['median_ms']:.1f} | {r['tflops']:.1f} "
            f"| {share} | {gemm} |"
        )
    prof = doc.get("profile")
    if prof:
        lines += ["", f"One forward of {prof['lanes']} x {prof['width']} profiled: "
                  f"{prof['total_ms']:.1f} ms of kernels", "",
                  "| kind | ms | share |", "|---|---:|---:|"]  # fmt: skip
        lines += [f"| {k} | {v['ms']:.2f} | {v['share']:.0%} |" for k, v in prof["kinds"].items()]
        lines += ["", "| longest kernels | kind | ms |", "|---|---|---:|"]
        lines += [f"| `{k['name'][:80]}` | {k['kind']} | {k['ms']:.2f} |" for k in prof["longest"]]
    gemm = doc.get("gemm")
    if gemm:
        lines += ["", f"Plain matmuls on {gemm['tokens']:,} tokens at one layer's shapes: "
                  f"{gemm['layer_tflops']:.1f} TFLOP/s together; {gemm['square']}^3: "
                  f"{gemm['square_tflops']:.1f}", "",
                  "| projection | k x n | ms | TFLOP/s |", "|---|---|---:|---:|"]  # fmt: skip
        lines += [f"| {g['name']} | {g['k']} x {g['n']} | {g['ms']:.3f} | {g['tflops']:.1f} |"
                  for g in gemm["shapes"]]  # fmt: skip
    return "\n".join(lines) + "\n"


# each SDPA kernel family and the switch that lets SDPA use it (process-wide)
SDPA_BACKENDS = {
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    "flash": torch.backends.cuda.enable_flash_sdp,
    "math": torch.backends.cuda.enable_math_sdp,
}


def only_sdpa_backend(name: str) -> None:
    """Let SDPA use only `name`'s kernels, process-wide, and compile into a fresh cache: the
    kernel is picked when a graph is traced, and a graph cached by an earlier process (the
    compile cache outlives it) would keep the kernel it was traced with."""
    import tempfile

    from stateblock.model.capture import use_compile_cache

    for backend, enable in SDPA_BACKENDS.items():
        enable(backend == name)
    use_compile_cache(Path(tempfile.mkdtemp(prefix="forward-rate-cache-")))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for forward_rate.json/.md")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--lanes", default="1,8,16,30,32", help="lane counts, in this order")
    ap.add_argument("--width", type=int, default=512,
                    help="prompt length, padded to its bucket as the capture pads it")  # fmt: skip
    ap.add_argument("--compile", default="off", help="off, or a torch.compile backend / mode")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's measured bf16 GEMM rate (the smoke bench's)")  # fmt: skip
    ap.add_argument("--profile-lanes", type=int, default=0,
                    help="profile one forward of this many lanes (0: none)")  # fmt: skip
    ap.add_argument("--gemm-lanes", type=int, default=0,
                    help="time plain matmuls at one layer's shapes on this many lanes")  # fmt: skip
    ap.add_argument("--gemm-square", type=int, default=8192, help="and one n^3 product")
    add_variant_flags(ap)
    ap.add_argument("--gemm-backends", default=None,
                    help="the matmul kernels a max-autotune compile chooses among, e.g. TRITON "
                         "(inductor's max_autotune_gemm_backends; default: its own)")  # fmt: skip
    ap.add_argument("--sdpa-backend", choices=sorted(SDPA_BACKENDS), default=None,
                    help="the one SDPA kernel family the forward may use (default: torch's "
                         "choice), compiled into a fresh compile cache")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sdpa_backend:
        only_sdpa_backend(args.sdpa_backend)
    if args.gemm_backends:
        from torch._inductor import config as inductor_config

        inductor_config.max_autotune_gemm_backends = args.gemm_backends
    model = build_llama(SCALES[args.scale], args.device)
    apply_variants(model, args, ap)
    if args.compile != "off":
        from stateblock.model.capture import compile_backbone

        compile_backbone(model, args.compile, deterministic=not args.autotune)
    lanes = [int(x) for x in args.lanes.split(",") if x]
    timed = [time_prefill(model, args.width, args.device, args.repeats, n, lanes=n) for n in lanes]
    params = matmul_params(model)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    doc = {
        "config": {
            "scale": args.scale, "width": args.width, "compile": args.compile,
            **variant_config(args),
            "params": params, "peak_tflops": args.peak_tflops, "device_name": device_name,
            "attention": model.config._attn_implementation,
            "sdpa_backend": args.sdpa_backend or "torch's choice",
            "gemm_backends": args.gemm_backends or "inductor's default",
        },
        "forwards": rates(timed, params, args.peak_tflops),
    }  # fmt: skip
    width = timed[0]["padded_width"] if timed else args.width
    if args.profile_lanes:
        doc["profile"] = profile_forward(model, width, args.profile_lanes, args.device)
    if args.gemm_lanes:
        doc["gemm"] = gemm_rates(
            model, args.gemm_lanes * width, args.device, args.repeats, args.gemm_square
        )
        for r in doc["forwards"]:  # the forward against plain matmuls of its shapes, here
            r["of_gemm"] = sig(r["tflops"] / doc["gemm"]["layer_tflops"], 3)
    (out / "forward_rate.json").write_text(json.dumps(doc, indent=2))
    (out / "forward_rate.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
