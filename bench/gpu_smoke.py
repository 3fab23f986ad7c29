"""GPU smoke of the `torch` readout engine: correctness checks, then timings, as JSON.

`python -m bench.gpu_smoke --out DIR` on one CUDA GPU (made for an H200, ~2-4 minutes).
0. the machine (bench/machine.py): copy bandwidth, and the host CPU's costs on one block;
1. checks (shared with the GPU tests of tests/unit/engines/test_torch_engine.py (CPU) and tests/gpu/test_torch_engine_gpu.py; --skip-checks): the
   Triton top-2 vs torch.topk at V=131072, d=2688 and on exact ties; the engine (bf16,
   CUDA graphs) vs the reference engine on the shipped model modulo near-ties; graph
   replay vs eager;
2. bf16 GEMM rate, so the lm_head GEMM floor is 2*D*d*V / rate;
3. fused top-2 vs `(h @ lm_head.T).topk(2)` at D in {256, 1024, 2048, 8192, 65536}, and a
   few tile configurations of the kernel (--sweep full: the ones that lost, too);
4. the whole engine readout with a random decoder (d_base 2688, V 131072, defaults for the
   rest): K=1 at each D, K in {1, 2, 4, 8} at D=8192 with peak extra memory, the variants
   (the lm_head GEMM instead of the fused head, earlier precisions, bf16 decoder, fp16
   autocast), and the eager reference (SDPA and explicit attention) at K=8, D=8192;
5. --audit: the parity audit of the engine as it serves (plain greedy cohorts on its bf16
   copy; the others on fp32 linears with TF32 dots in the fused attention and the fused
   fp32 head, exact dots where log-probabilities are asked), with every cohort exact, with
   its linears in TF32 too, and with the fused head in bf16.
Every result is written to DIR/smoke.json as soon as it exists. Times: CUDA events, warm-up
then the median of 20. Imports the repo, torch and triton only.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from bench.gpu_checks import (
    D_BASE,
    V,
    check_engine_parity,
    check_fused_attention,
    check_fused_attention_rope,
    check_graph_vs_eager,
    check_logprob_precision,
    check_random_decoder_parity,
    check_top2_kernel,
    random_weights,
    shipped_rows,
)
from bench.machine import copy_gbs, cuda_ms, gemm_tflops, host_costs
from stateblock.model.kernels.top2 import Top2Config, default_tiles

# every cohort on the exact fp32 path: the default engine runs plain greedy lanes on its bf16
# copy, so the exact path's own variants and audits turn that off to measure what they name
EXACT = {"greedy_dtype": "float32"}


def import_engine():
    """stateblock.engines.torch_engine: the service stack must be importable (on the GPU machine,
    `bench/gpu_env.sh` installs its wheels)."""
    import stateblock.engines.torch_engine as et

    return et


# -- timing -------------------------------------------------------------------------------
def audit_default(**options) -> dict:
    """`stateblock audit --engine torch --device cuda`: the engine as it serves, the shipped
    model, the audit's default depths and prompts, against the fp32 reference."""
    from stateblock.engines import create_engine
    from stateblock.model.loading import load_serving_model
    from stateblock.runtime import DEFAULT_MODEL_NAME, REFERENCE_BASE, REFERENCE_DECODER
    from stateblock.tools import audit

    t0 = time.perf_counter()
    model = load_serving_model(DEFAULT_MODEL_NAME, REFERENCE_BASE, REFERENCE_DECODER, device="cuda")
    if options:
        from stateblock.engines.torch_engine import TorchEngine

        engine = TorchEngine.load(model, "cuda", **options)
    else:
        engine = create_engine("torch", model, "cuda")
    report = audit.parity_audit(model, engine, create_engine("reference", model, "cuda"))
    report["engine_settings"] = {
        "attention": engine.attention,
        "linears": engine._precision,
        "kernel_dots": engine._kernel_precision,
        "head": engine.head,
        "head_dtype": str(engine._head.dtype),
        "greedy_dtype": str(engine._greedy[1].dtype) if engine._greedy else None,
    }
    report["wall_s"] = time.perf_counter() - t0
    return report


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


class Report:
    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "smoke.json"
        self.data: dict = {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        print(f"[{key}] {json.dumps(value, default=str)[:300]}", flush=True)

    def run(self, key: str, fn) -> object:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - record and go on with the next measurement
            traceback.print_exc()
            value = {"error": f"{type(e).__name__}: {e}"}
        self.put(key, value)
        free()
        return value


UNGROUPED = Top2Config(tma=True, group_rows=-1)  # < 0: the wave-fill split, no groups
GROUPED_SWEEP = [  # row-block groups whose h tiles fit in L2 (Top2Config.group_rows)
    Top2Config(tma=True, group_rows=32, n_split=4),
    Top2Config(tma=True, group_rows=8, n_split=16),
    Top2Config(tma=True, group_rows=16, n_split=4),
]


def time_top2(rep: Report, rate: float, full_sweep: bool = False):
    """The fused kernel against the floor at each D, over a sweep of tile shapes (each with
    the default split rule); returns the tiles fastest at D=8192."""
    from stateblock.model.kernels.top2 import default_config, top2_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(V, D_BASE, generator=g, device="cuda") * 0.05).bfloat16()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sweep = [  # (block_n, block_v, block_k, warps, stages); the default split rule each
        Top2Config(tma=True),
        UNGROUPED,
        Top2Config(128, 256, 64, 8, 4, tma=True),
        Top2Config(tma=True, persistent=True),
        Top2Config(128, 256, 64, 8, 4, tma=True, persistent=True),
    ]
    if full_sweep:  # the shapes that lost on the H200 (docs/BENCHMARKS.md)
        sweep += [
            Top2Config(128, 256, 64, 8, 4),
            Top2Config(256, 128, 64, 8, 3),
            Top2Config(256, 128, 64, 8, 3, tma=True),
            Top2Config(128, 128, 64, 4, 4, tma=True),
        ]
    best: dict[int, tuple[float, Top2Config | None]] = {}
    for d in (256, 1024, 2048, 8192, 8 * 8192):
        h = torch.randn(d, D_BASE, generator=g, device="cuda").bfloat16()
        floor = 2 * d * D_BASE * V / (rate * 1e12) * 1e3
        row = {"floor_ms": floor, "plain_ms": cuda_ms(lambda h=h: (h @ w.t()).topk(2, dim=-1))}
        row["default"] = str(default_config(d, V, n_sm))
        row["fused_ms"] = cuda_ms(lambda h=h: top2_triton(h, w))
        best[d] = (row["fused_ms"], None)  # None: the engine's own default_tiles
        for tiles in sweep + (GROUPED_SWEEP if d >= 8192 else []):
            cfg = tiles if tiles.n_split else default_config(d, V, n_sm, tiles)
            key = f"{cfg.block_n}x{cfg.block_v}x{cfg.block_k}_w{cfg.num_warps}_s{cfg.num_stages}"
            key += ("_tma" if cfg.tma else "") + ("_persistent" if cfg.persistent else "")
            key += f"_group{cfg.group_rows}" if cfg.group_rows else ""
            try:
                ms = cuda_ms(lambda h=h, c=cfg: top2_triton(h, w, c))
            except Exception as e:  # noqa: BLE001 - a configuration may not fit the chip
                row[key] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            row[f"{key}_split{cfg.n_split}_ms"] = ms
            if ms < best[d][0] and not tiles.n_split:  # the engine's tiles keep the auto split
                best[d] = (ms, tiles)
        row["fused_over_floor"] = row["fused_ms"] / floor
        row["best_ms"], row["best_tiles"] = best[d][0], str(best[d][1])
        row["best_over_floor"] = best[d][0] / floor
        rep.put(f"top2_D{d}", row)
        del h
    return best[8192][1]


def measure_readout(et, eng, rows, k: int, d: int, weights: int, rate: float) -> dict:
    """K lanes of depth d (lane i reads rows[i]) on a random decoder that never stops: the
    readout and its graph replay against the lm_head GEMM floor (2*K*d*d_base*V at `rate`
    TFLOP/s), and the peak memory beyond `weights` bytes (what the shape's capture added)."""
    from stateblock.engines import LaneRequest

    lanes = [LaneRequest(rows=rows[i], depth=d) for i in range(k)]
    torch.cuda.reset_peak_memory_stats()
    res = eng.readout(lanes)  # captures the shape if warm_up did not
    assert all(len(r.token_ids) == d for r in res), "random decoder stopped early"
    # graphs are keyed by (shape, kernel dot precision) since logprob lanes got their own;
    # plain greedy lanes run the greedy fast path's graph where the engine has one
    shape = eng._shape(lanes)[0]
    graph, _ = eng._graphs.get((shape, et.GREEDY)) or eng._graphs[shape, eng._kernel_precision]
    floor = 2 * k * d * D_BASE * V / (rate * 1e12) * 1e3
    row = {
        "readout_ms": cuda_ms(lambda: eng.readout(lanes)),
        "replay_ms": cuda_ms(graph.replay),
        "floor_ms": floor,
        "peak_extra_gib": (torch.cuda.max_memory_allocated() - weights) / 2**30,
    }
    row["readout_over_floor"] = row["readout_ms"] / floor
    return row


def time_engine(rep: Report, et, rate: float, tiles=None) -> None:
    """K=1 at every depth on one warmed engine; then K in {1, 2, 4, 8} at D=8192, each on a
    fresh engine over the same weights, so its peak counts only its own graph pool, static
    buffers and capture-time eager run beyond the resident weights. `tiles`: the engine's
    top-2 tile shape (the split still follows each shape)."""
    dec, lm_head, eos = random_weights()
    ident = et.ModelIdentity("bench", b"", b"", b"")

    def engine(decoder=dec, **options):
        options.setdefault("top2_config", tiles)
        opts = et.TorchEngineOptions(device="cuda", **options)
        return et.TorchEngine(decoder, lm_head, ident, eos_token_id=eos, options=opts)

    rows = [torch.randn(500, D_BASE).bfloat16() for _ in range(8)]  # on the CPU, as blocks come

    def measure(eng, k: int, d: int, weights: int) -> dict:
        return measure_readout(et, eng, rows, k, d, weights, rate)

    eng = engine()
    free()
    weights = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    eng.warm_up()
    rep.put("engine_warm_up", {"s": time.perf_counter() - t0, "shapes": len(eng.recorded_shapes)})
    for d in (256, 1024, 2048, 8192):
        rep.run(f"engine_K1_D{d}", lambda d=d, e=eng, w=weights: measure(e, 1, d, w))
    rep.run("engine_parts_K1_D8192", lambda: engine_parts(et, dec, lm_head, rows[0], tiles))
    del eng
    free()
    # the trades the engine does not take (docs/PARITY.md): its decoder in bf16, or under
    # fp16 autocast; each on a copy, since the engine converts its decoder in place. These
    # and the variants below change the exact path, so they run on it (EXACT)
    for key, precision in (
        ("engine_bf16_decoder_K1_D8192", {"decoder_dtype": torch.bfloat16, **EXACT}),
        ("engine_fp16_autocast_K1_D8192", {"autocast": torch.float16, **EXACT}),
    ):
        variant = engine(copy.deepcopy(dec), warm_shapes=(), **precision)
        rep.run(key, lambda e=variant, w=weights: measure(e, 1, 8192, w))
        del variant
        free()
    # the plain engine (the lm_head GEMM after an fp32 decoder with SDPA), the lm_head GEMM
    # after the served decoder, the decoder's linears in TF32 too (torch's process-wide
    # switch), and the fused head in bf16
    old_head = {"head": "lm_head", **EXACT}
    for key, options in (
        ("engine_lm_head_fp32_sdpa", {**old_head, "attention": "sdpa", "kernel_precision": "ieee"}),
        ("engine_lm_head", old_head),
        ("engine_tf32_linears", {"matmul_precision": "high", **EXACT}),
        ("engine_fused_bf16", {"head_dtype": torch.bfloat16, **EXACT}),
        # the default runs plain greedy cohorts on a bf16 copy (decoder, fused head, guess
        # table); this is every cohort on the exact fp32 path
        ("engine_exact", EXACT),
    ):
        variant = engine(warm_shapes=(), **options)
        for d in (1024, 8192):
            rep.run(f"{key}_K1_D{d}", lambda d=d, e=variant, w=weights: measure(e, 1, d, w))
        del variant
        free()
    for prefix, options in (
        ("engine_fresh", {}),
        ("engine_lm_head_fresh", old_head),
        ("engine_exact_fresh", EXACT),
    ):
        for k in (1, 2, 4, 8) if not options else (1, 8):
            eng = engine(warm_shapes=(), **options)
            free()
            weights = torch.cuda.memory_allocated()
            rep.run(f"{prefix}_K{k}_D8192", lambda e=eng, k=k, w=weights: measure(e, k, 8192, w))
            del eng
            free()
        one, eight = rep.data.get(f"{prefix}_K1_D8192", {}), rep.data.get(f"{prefix}_K8_D8192", {})
        if "readout_ms" in one and "readout_ms" in eight:
            rep.put(f"{prefix}_k8_over_k1", eight["readout_ms"] / one["readout_ms"])
    # the latents-only decoder (ReadoutConfig's defaults), for comparison
    seed_arch = engine(random_weights({})[0], warm_shapes=(), **EXACT)
    free()
    w0 = torch.cuda.memory_allocated()  # its weights (the K=8 peak also holds K=1's graph)
    for k in (1, 8):
        rep.run(f"engine_latents_only_K{k}_D8192", lambda e=seed_arch, k=k: measure(e, k, 8192, w0))
    del seed_arch
    free()
    rep.run("reference_sdpa_K8_D8192", lambda: eager_reference(dec, lm_head, rows, "sdpa"))
    rep.run("reference_explicit_K8_D8192", lambda: eager_reference(dec, lm_head, rows, "explicit"))


@torch.inference_mode()
def engine_parts(et, decoder, lm_head, rows, tiles) -> dict:
    """Where one lane's D=8192 readout goes, eagerly: the decoder (to its hidden rows, or
    to the mixer's output for the fused head), then the top-2 (lm_head, or fused head)."""
    from stateblock.model.kernels.top2 import top2_triton

    x = rows.cuda()[None].float()  # (1, P, d_base), in the decoder's dtype
    lens = torch.full((1,), x.shape[1], device="cuda")
    pos = torch.arange(8192, device="cuda")[None]
    guess = decoder.guess_embed(lm_head) if decoder.cfg.refine else None  # the eager guess
    h = decoder.hidden(x, lens, pos, impl="sdpa", guess=guess).to(lm_head.dtype)[0]  # (D, d_base)
    m = decoder.mixed(x, lens, pos, impl="sdpa", guess=guess)[0]  # (D, d_r)
    head = et.fused_head(lm_head, decoder.out.weight, torch.float32)

    def decoder_ms(stage, linears: str, impl: str) -> float:
        def run():
            with et.matmul_precision(linears), et.dot_precision("tf32"):
                stage(x, lens, pos, impl=impl, guess=guess)

        return cuda_ms(run)

    tf32 = replace(tiles or default_tiles(m.device, torch.float32), block_k=32, precision="tf32")
    return {
        "hidden_fp32_sdpa_ms": decoder_ms(decoder.hidden, "highest", "sdpa"),
        "hidden_fused_ms": decoder_ms(decoder.hidden, "highest", "fused"),
        "mixed_fused_ms": decoder_ms(decoder.mixed, "highest", "fused"),  # the default
        "mixed_fused_tf32_linears_ms": decoder_ms(decoder.mixed, "high", "fused"),
        "top2_lm_head_ms": cuda_ms(lambda: top2_triton(h, lm_head, tiles)),
        "top2_fused_tf32_ms": cuda_ms(lambda: top2_triton(m, head, tf32)),  # the default
        "top2_fused_bf16_ms": cuda_ms(lambda: top2_triton(m.bfloat16(), head.bfloat16(), tiles)),
    }


def time_attention() -> dict:
    """The mixer's attention alone at D=8192 (8 heads of 32, 64 latents in front): the fused
    kernel (TF32 and exact dots) against SDPA in fp32 (memory-efficient, no tensor cores)
    and in bf16 (flash), over K=1 and K=8 lanes."""
    from stateblock.model.kernels.attention import prefix_causal_attention
    from stateblock.model.layers import prefix_causal_sdpa

    def lanes(k: int) -> dict:
        q = torch.randn(k, 8, 8192, 32, device="cuda")
        kv = torch.randn(k, 8, 64 + 8192, 32, device="cuda")
        qb, kb = q.bfloat16(), kv.bfloat16()
        row = {
            f"fused_{p}_ms": cuda_ms(
                lambda p=p: prefix_causal_attention(q, kv, kv, 64, precision=p)
            )
            for p in ("tf32", "ieee")
        }
        row["sdpa_fp32_ms"] = cuda_ms(lambda: prefix_causal_sdpa(q, kv, kv, 64))
        row["sdpa_bf16_ms"] = cuda_ms(lambda: prefix_causal_sdpa(qb, kb, kb, 64))
        flops = 4 * k * 8 * 32 * (8192 * 64 + 8192 * 8193 / 2)
        row["fused_tf32_tflops"] = flops / (row["fused_tf32_ms"] * 1e-3) / 1e12
        return row

    return {f"K{k}": lanes(k) for k in (1, 8)}


@torch.inference_mode()
def eager_reference(decoder, lm_head, rows, impl: str) -> dict:
    k, d = 8, 8192
    x = torch.stack(rows[:k]).cuda().float()  # (K, P, d_base), in the decoder's dtype
    lens = torch.full((k,), x.shape[1], device="cuda")
    pos = torch.arange(d, device="cuda").expand(k, d)
    depths = torch.full((k,), d, device="cuda")
    free()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        ms = cuda_ms(lambda: decoder(x, lens, pos, depths, lm_head, impl=impl), iters=3, warmup=1)
    except torch.cuda.OutOfMemoryError as e:
        return {"oom": str(e)[:300]}
    return {"ms": ms, "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--sweep", choices=("short", "full"), default="short", help="top-2 tiles")
    ap.add_argument("--audit", action="store_true", help="parity audit of the default engine")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_smoke needs a CUDA GPU")
        return 2
    rep = Report(args.out)
    et = import_engine()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None  # the engine then runs the chunked PyTorch top-2

    props = torch.cuda.get_device_properties(0)
    rep.put(
        "env",
        {
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
            "triton": triton_version,
            "python": sys.version.split()[0],
            "top2_backend": "triton" if et.available("cuda") else "torch-chunked",
        },
    )
    t0 = time.perf_counter()
    rep.run("copy_gbs", copy_gbs)  # first: docs/BENCHMARKS.md needs it whatever else runs
    rep.run("host_costs", host_costs)
    if not args.skip_checks:
        for n in (256, 1024):
            rep.run(f"check_top2_N{n}", lambda n=n: check_top2_kernel(n, V, D_BASE, seed=n))
        rep.run("check_top2_ties", lambda: check_top2_kernel(300, 5000, 200, seed=1, ties=True))
        rep.run("check_top2_ties_split", lambda: check_top2_kernel(16, 70000, 64, 2, ties=True))
        from stateblock.model.kernels.top2 import Top2Config

        tma = Top2Config(tma=True)
        rep.run("check_top2_N1024_tma", lambda: check_top2_kernel(1024, V, D_BASE, 3, cfg=tma))
        rep.run("check_top2_ties_tma", lambda: check_top2_kernel(300, 5000, 200, 1, True, tma))
        rep.run(
            "check_top2_ties_split_tma",
            lambda: check_top2_kernel(
                16, 70000, 64, 2, True, Top2Config(32, 64, 64, 4, 3, tma=True)
            ),
        )
        from stateblock.model.loading import load_serving_model

        # paths, not stateblock.runtime: that module needs structlog and prometheus_client
        shipped = Path(__file__).resolve().parent.parent / "models" / "reference"
        served = load_serving_model("stateblock-reference", shipped / "base", shipped / "decoder")
        rows = shipped_rows(served)
        rep.run("check_engine_parity", lambda: check_engine_parity(served, rows))
        rep.run(
            "check_engine_parity_exact",
            lambda: check_engine_parity(served, rows, **EXACT),
        )
        rep.run("check_graph_vs_eager", lambda: check_graph_vs_eager(served, rows))
        rep.run("check_logprob_precision", lambda: check_logprob_precision(served, rows))
        rep.run("check_random_decoder_parity", lambda: check_random_decoder_parity(et))
    rep.run("check_fused_attention", check_fused_attention)
    rep.run("check_fused_attention_rope", check_fused_attention_rope)
    rate = rep.run("gemm_tflops", gemm_tflops)
    rate = rate if isinstance(rate, float) else 790.0
    rep.run("gemm_tf32_tflops", lambda: gemm_tflops(torch.float32))
    tiles = time_top2(rep, rate, args.sweep == "full")
    rep.run("attention_D8192", time_attention)
    time_engine(rep, et, rate, tiles)
    if args.audit:
        rep.run("audit_default", audit_default)
        # the trades of the exact path, audited on it (plain lanes would take the bf16 copy)
        rep.run("audit_exact", lambda: audit_default(**EXACT))
        rep.run("audit_tf32_linears", lambda: audit_default(matmul_precision="high", **EXACT))
        rep.run("audit_fused_bf16", lambda: audit_default(head_dtype=torch.bfloat16, **EXACT))
    rep.put("wall_s", time.perf_counter() - t0)
    print("\nsummary (ms)")
    for key, row in rep.data.items():
        if isinstance(row, dict) and ("fused_ms" in row or "readout_ms" in row or "ms" in row):
            cols = {k: v for k, v in row.items() if isinstance(v, float)}
            print(f"  {key:28s} " + "  ".join(f"{k}={v:.3f}" for k, v in cols.items()))
        elif key.startswith("check_"):
            print(f"  {key:28s} {'FAIL ' + row['error'] if 'error' in row else 'ok'}")
    failed = [k for k, v in rep.data.items() if k.startswith("check_") and "error" in v]
    print(f"checks failed: {failed or 'none'}; json: {rep.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
