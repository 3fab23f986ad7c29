"""GPU smoke of the `torch` readout engine: correctness checks, then timings, as JSON.

`python -m bench.gpu_smoke --out DIR` on one CUDA GPU (made for an H200, ~2-4 minutes).
1. checks (shared with the GPU tests of tests/test_engine_torch.py): the Triton top-2 vs
   torch.topk at V=131072, d=2688 and on exact ties; the engine (bf16, CUDA graphs) vs the
   reference engine on the shipped model modulo near-ties; graph replay vs eager;
2. bf16 GEMM rate, so the lm_head GEMM floor is 2*D*d*V / rate;
3. fused top-2 vs `(h @ lm_head.T).topk(2)` at D in {256, 1024, 2048, 8192}, and a few tile
   configurations of the kernel;
4. the whole engine readout with a random decoder (d_base 2688, V 131072, defaults for the
   rest): K=1 at each D, K in {1, 2, 4, 8} at D=8192 with peak extra memory, and the eager
   reference (SDPA and explicit attention) at K=8, D=8192.
Every result is written to DIR/smoke.json as soon as it exists. Times: CUDA events, warm-up
then the median of 20. Imports the repo, torch and triton only.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

NEAR_TIE = 0.05  # DESIGN.md: reference top-1 minus top-2 margin under which a flip is allowed
V, D_BASE = 131072, 2688
ITERS, WARMUP = 20, 3


def import_engine():
    """readout_svc.engine_torch: the service stack must be importable (on the GPU machine,
    `bench/gpu_env.sh` installs its wheels)."""
    import readout_svc.engine_torch as et

    return et


# -- checks (also run by the GPU tests) ----------------------------------------------------
def check_top2_kernel(
    n: int, vocab: int, dim: int, seed: int, ties: bool = False, cfg=None, device: str = "cuda"
):
    """Kernel vs an fp32 torch.topk: the chosen ids' logits within 1e-3 relative of the true
    top-1 / top-2; on exact ties (integer inputs), exactly the lowest ids."""
    from stateblock.triton_top2 import top2_triton

    g = torch.Generator(device=device).manual_seed(seed)
    if ties:  # small integers: exact products and sums, many exactly equal logits
        h = torch.randint(-2, 3, (n, dim), generator=g, device=device).bfloat16()
        w = torch.randint(-1, 2, (vocab, dim), generator=g, device=device).bfloat16()
        w[vocab // 2 :] = w[: vocab - vocab // 2].clone()  # ties across tiles and splits
    else:
        h = torch.randn(n, dim, generator=g, device=device).bfloat16()
        w = (torch.randn(vocab, dim, generator=g, device=device) * 0.05).bfloat16()
    val, idx = top2_triton(h, w, cfg)
    logits = h.float() @ w.float().t()  # (n, V) fp32 truth
    if ties:
        ref_v, ref_i = torch.sort(logits, dim=-1, descending=True, stable=True)
        assert torch.equal(idx, ref_i[:, :2]), "exact ties: not the lowest ids"
        assert torch.equal(val, ref_v[:, :2])
        return {
            "n": n,
            "vocab": vocab,
            "dim": dim,
            "ties": True,
            "tied_rows": int((ref_v[:, 0] == ref_v[:, 1]).sum()),
        }
    true_v, true_i = logits.topk(2, dim=-1)
    assert bool(((idx >= 0) & (idx < vocab)).all()), "ids out of range: unwritten output?"
    assert bool((idx[:, 0] != idx[:, 1]).all())
    chosen = logits.gather(1, idx)  # the truth at the kernel's ids
    rel = ((true_v - chosen) / true_v.abs().clamp_min(1e-6)).max().item()
    val_err = ((val - true_v).abs() / true_v.abs().clamp_min(1e-6)).max().item()
    assert rel < 1e-3 and val_err < 1e-3, (rel, val_err)
    return {
        "n": n,
        "vocab": vocab,
        "dim": dim,
        "id_mismatch_frac": (idx != true_i).float().mean().item(),
        "chosen_rel_gap_max": rel,
        "value_rel_err_max": val_err,
    }


def compare_near_ties(ref, out) -> dict:
    """Lane results: any token or EOS difference must sit where the reference's margin is
    under NEAR_TIE. Returns counts; raises AssertionError on a real mismatch."""
    stats = {"positions": 0, "mismatches": 0, "near_tie_mismatches": 0, "worst_margin": 0.0}
    for a, b in zip(ref, out, strict=True):
        n = min(len(a.token_ids), len(b.token_ids))
        stats["positions"] += n
        diffs = [t for t in range(n) if a.token_ids[t] != b.token_ids[t]]
        if a.eos_pos != b.eos_pos:
            diffs.append(min(a.eos_pos, b.eos_pos))
        for t in diffs:
            stats["mismatches"] += 1
            m = a.margins[t]
            stats["worst_margin"] = max(stats["worst_margin"], m)
            stats["near_tie_mismatches"] += m < NEAR_TIE
    assert stats["mismatches"] == stats["near_tie_mismatches"], stats
    return stats


def shipped_engines(served, device: str = "cuda", **options):
    """TorchEngine (bf16, CUDA graphs) and a bf16 ReferenceEngine sharing its weights."""
    from readout_svc.engine import ReferenceEngine
    from readout_svc.engine_torch import TorchEngine

    eng = TorchEngine.load(served, device, **options)
    ref = ReferenceEngine(
        eng._decoder, eng._lm_head, served.identity, eos_token_id=eng._eos, device=device
    )
    return eng, ref


def check_engine_parity(served, rows: list[torch.Tensor], device: str = "cuda") -> dict:
    from readout_svc.engine import LaneRequest

    eng, ref = shipped_engines(served, device)
    eng.warm_up()
    depths = [1, 40, 300, 64, 16, 600, 1000, 2600, 2000]  # 9 lanes: cohorts of 8 and 1
    lanes = [LaneRequest(rows=rows[i % len(rows)], depth=d) for i, d in enumerate(depths)]
    greedy = compare_near_ties(ref.readout(lanes), eng.readout(lanes))
    single = compare_near_ties(ref.readout(lanes[7:8]), eng.readout(lanes[7:8]))
    sampled = [LaneRequest(rows=rows[0], depth=500, temperature=0.8, seed=3)]
    a, b = ref.readout(sampled)[0], eng.readout(sampled)[0]
    n = min(len(a.token_ids), len(b.token_ids))
    agree = sum(x == y for x, y in zip(a.token_ids[:n], b.token_ids[:n], strict=True)) / max(1, n)
    return {"greedy": greedy, "single_lane": single, "sampled_agreement": agree}


def check_graph_vs_eager(served, rows: list[torch.Tensor], device: str = "cuda") -> dict:
    from readout_svc.engine import LaneRequest
    from readout_svc.engine_torch import TorchEngine

    graphed, _ = shipped_engines(served, device)
    eager = TorchEngine(
        graphed._decoder,
        graphed._lm_head,
        served.identity,
        eos_token_id=graphed._eos,
        device=device,
        cuda_graphs=False,
    )
    cohorts = [  # several buckets in turn: the shared pool and static buffers are reused
        [LaneRequest(rows=rows[0], depth=200)],
        [LaneRequest(rows=r, depth=d) for r, d in zip(rows[:3], [900, 17, 400], strict=True)],
        [LaneRequest(rows=rows[1], depth=3000, temperature=0.7, seed=9)],
        [LaneRequest(rows=rows[0], depth=200)],
    ]
    first = None
    for lanes in cohorts:
        a, b = graphed.readout(lanes), eager.readout(lanes)
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids and x.eos_pos == y.eos_pos
            assert (
                max((abs(p - q) for p, q in zip(x.margins, y.margins, strict=True)), default=0)
                < 1e-3
            )
        first = first or a
    assert graphed.readout(cohorts[0]) == first  # a replay after other shapes: same answer
    return {"shapes": [str(s) for s in graphed.captured_shapes]}


def check_random_decoder_parity(et) -> dict:
    """At full size (d_base 2688, V 131072; random weights, EOS never wins): the engine vs
    the reference over every position of two lanes, modulo near-ties."""
    from readout_svc.engine import LaneRequest, ReferenceEngine

    dec, lm_head, eos = random_weights()
    ident = et.ModelIdentity("bench", b"", b"", b"")
    eng = et.TorchEngine(dec, lm_head, ident, eos_token_id=eos, device="cuda", warm_shapes=())
    ref = ReferenceEngine(dec, lm_head, ident, eos_token_id=eos, device="cuda")
    g = torch.Generator().manual_seed(5)
    lanes = [
        LaneRequest(rows=torch.randn(p, D_BASE, generator=g).bfloat16(), depth=d)
        for p, d in [(300, 2048), (512, 1500)]
    ]
    stats = compare_near_ties(ref.readout(lanes), eng.readout(lanes))
    assert stats["positions"] == 2048 + 1500, stats
    return stats


def shipped_rows(served) -> list[torch.Tensor]:
    """Captured rows of 9 held-out prompts: one per family, then two with answers of
    ~1,850 and ~2,480 tokens, so the parity check compares thousands of positions."""
    from stateblock import tasks

    examples = tasks.per_family(1, split="heldout", seed=7)
    examples += [e for e in tasks.per_family(3, split="heldout", seed=11) if len(e.answer) > 1800]
    return [served.prompt_rows(ex.prompt) for ex in examples]


# -- timing -------------------------------------------------------------------------------
def cuda_ms(fn, iters: int = ITERS, warmup: int = WARMUP) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemm_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)  # random: zeros run fast
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def copy_gbs() -> dict:
    """Copy bandwidth, GB/s (1e9): device to device (read + write counted), and host to
    device / device to host of a 2.75 MB block (the e2e bench's 512 x 2688 bf16 rows) from
    pinned and from pageable memory, as the readout worker and capture copy them."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    out = {"d2d": 2 * n / (cuda_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9}
    block = 512 * 2688 * 2
    dev = torch.empty(block, dtype=torch.uint8, device="cuda")
    for name, host in (
        ("pinned", torch.empty(block, dtype=torch.uint8, pin_memory=True)),
        ("pageable", torch.empty(block, dtype=torch.uint8)),
    ):
        out[f"h2d_{name}_block"] = block / (cuda_ms(lambda h=host: dev.copy_(h)) * 1e-3) / 1e9
        out[f"d2h_{name}_block"] = block / (cuda_ms(lambda h=host: h.copy_(dev)) * 1e-3) / 1e9
    return out


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


def time_top2(rep: Report, rate: float):
    """The fused kernel against the floor at each D, over a sweep of tile shapes (each with
    the default split rule); returns the tiles fastest at D=8192."""
    from stateblock.triton_top2 import Top2Config, default_config, top2_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(V, D_BASE, generator=g, device="cuda") * 0.05).bfloat16()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    sweep = [  # (block_n, block_v, block_k, warps, stages); the default split rule each
        Top2Config(128, 256, 64, 8, 4),
        Top2Config(256, 128, 64, 8, 3),
        Top2Config(tma=True),
        Top2Config(128, 256, 64, 8, 4, tma=True),
        Top2Config(256, 128, 64, 8, 3, tma=True),
        Top2Config(128, 128, 64, 4, 4, tma=True),
        Top2Config(tma=True, persistent=True),
        Top2Config(128, 256, 64, 8, 4, tma=True, persistent=True),
    ]
    best: dict[int, tuple[float, Top2Config | None]] = {}
    for d in (256, 1024, 2048, 8192, 8 * 8192):
        h = torch.randn(d, D_BASE, generator=g, device="cuda").bfloat16()
        floor = 2 * d * D_BASE * V / (rate * 1e12) * 1e3
        row = {"floor_ms": floor, "plain_ms": cuda_ms(lambda h=h: (h @ w.t()).topk(2, dim=-1))}
        row["default"] = str(default_config(d, V, n_sm))
        row["fused_ms"] = cuda_ms(lambda h=h: top2_triton(h, w))
        best[d] = (row["fused_ms"], None)  # None: the engine's own default_tiles
        for tiles in sweep:
            cfg = default_config(d, V, n_sm, tiles)
            key = f"{cfg.block_n}x{cfg.block_v}x{cfg.block_k}_w{cfg.num_warps}_s{cfg.num_stages}"
            key += ("_tma" if cfg.tma else "") + ("_persistent" if cfg.persistent else "")
            try:
                ms = cuda_ms(lambda h=h, c=cfg: top2_triton(h, w, c))
            except Exception as e:  # noqa: BLE001 - a configuration may not fit the chip
                row[key] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            row[f"{key}_split{cfg.n_split}_ms"] = ms
            if ms < best[d][0]:
                best[d] = (ms, tiles)
        row["fused_over_floor"] = row["fused_ms"] / floor
        row["best_ms"], row["best_tiles"] = best[d][0], str(best[d][1])
        row["best_over_floor"] = best[d][0] / floor
        rep.put(f"top2_D{d}", row)
        del h
    return best[8192][1]


def random_weights() -> tuple:
    from stateblock.readout import ReadoutConfig, ReadoutDecoder

    torch.manual_seed(0)
    eos = 2
    dec = ReadoutDecoder(ReadoutConfig(d_base=D_BASE, vocab_size=V, eos_token_id=eos))
    lm_head = (torch.randn(V, D_BASE, device="cuda") * 0.05).bfloat16()
    lm_head[eos] = 0  # EOS logit exactly 0 < the top-1: every lane reads its whole depth
    # fp32 like the engine's decoder (it would convert it in place anyway); lm_head in bf16
    return dec.cuda().float().eval().requires_grad_(False), lm_head, eos


def time_engine(rep: Report, et, rate: float, tiles=None) -> None:
    """K=1 at every depth on one warmed engine; then K in {1, 2, 4, 8} at D=8192, each on a
    fresh engine over the same weights, so its peak counts only its own graph pool, static
    buffers and capture-time eager run beyond the resident weights. `tiles`: the engine's
    top-2 tile shape (the split still follows each shape)."""
    from readout_svc.engine import LaneRequest

    dec, lm_head, eos = random_weights()
    ident = et.ModelIdentity("bench", b"", b"", b"")

    def engine(decoder=dec, **options):
        return et.TorchEngine(
            decoder, lm_head, ident, eos_token_id=eos, device="cuda", top2_config=tiles, **options
        )

    rows = [torch.randn(500, D_BASE).bfloat16() for _ in range(8)]  # on the CPU, as blocks come

    def measure(eng, k: int, d: int, weights: int) -> dict:
        lanes = [LaneRequest(rows=rows[i], depth=d) for i in range(k)]
        torch.cuda.reset_peak_memory_stats()
        res = eng.readout(lanes)  # captures the shape if warm_up did not
        assert all(len(r.token_ids) == d for r in res), "random decoder stopped early"
        graph, _ = eng._graphs[eng._shape(lanes)[0]]
        floor = 2 * k * d * D_BASE * V / (rate * 1e12) * 1e3
        row = {
            "readout_ms": cuda_ms(lambda: eng.readout(lanes)),
            "replay_ms": cuda_ms(graph.replay),
            "floor_ms": floor,
            "peak_extra_gib": (torch.cuda.max_memory_allocated() - weights) / 2**30,
        }
        row["readout_over_floor"] = row["readout_ms"] / floor
        return row

    eng = engine()
    free()
    weights = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    eng.warm_up()
    rep.put("engine_warm_up", {"s": time.perf_counter() - t0, "shapes": len(eng.captured_shapes)})
    for d in (256, 1024, 2048, 8192):
        rep.run(f"engine_K1_D{d}", lambda d=d, e=eng, w=weights: measure(e, 1, d, w))
    rep.run("engine_parts_K1_D8192", lambda: engine_parts(dec, lm_head, rows[0], tiles))
    del eng
    free()
    # the trades the engine does not take (docs/PARITY.md): its decoder in bf16, or under
    # fp16 autocast; each on a copy, since the engine converts its decoder in place
    for key, precision in (
        ("engine_bf16_decoder_K1_D8192", {"decoder_dtype": torch.bfloat16}),
        ("engine_fp16_autocast_K1_D8192", {"autocast": torch.float16}),
    ):
        variant = engine(copy.deepcopy(dec), warm_shapes=(), **precision)
        rep.run(key, lambda e=variant, w=weights: measure(e, 1, 8192, w))
        del variant
        free()
    for k in (1, 2, 4, 8):
        eng = engine(warm_shapes=())
        free()
        weights = torch.cuda.memory_allocated()
        rep.run(f"engine_fresh_K{k}_D8192", lambda e=eng, k=k, w=weights: measure(e, k, 8192, w))
        del eng
        free()
    one, eight = (
        rep.data.get("engine_fresh_K1_D8192", {}),
        rep.data.get("engine_fresh_K8_D8192", {}),
    )
    if "readout_ms" in one and "readout_ms" in eight:
        rep.put("k8_over_k1", eight["readout_ms"] / one["readout_ms"])
    rep.run("reference_sdpa_K8_D8192", lambda: eager_reference(dec, lm_head, rows, "sdpa"))
    rep.run("reference_explicit_K8_D8192", lambda: eager_reference(dec, lm_head, rows, "explicit"))


@torch.inference_mode()
def engine_parts(decoder, lm_head, rows, tiles) -> dict:
    """Where one lane's D=8192 readout goes: the decoder's hidden rows, then the top-2."""
    from stateblock.triton_top2 import top2_triton

    x = rows.cuda()[None].float()  # (1, P, d_base), in the decoder's dtype
    lens = torch.full((1,), x.shape[1], device="cuda")
    pos = torch.arange(8192, device="cuda")[None]
    h = decoder.hidden(x, lens, pos, impl="sdpa").to(lm_head.dtype)[0]  # (D, d_base)
    return {
        "hidden_ms": cuda_ms(lambda: decoder.hidden(x, lens, pos, impl="sdpa")),
        "top2_ms": cuda_ms(lambda: top2_triton(h, lm_head, tiles)),
    }


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
    if not args.skip_checks:
        for n in (256, 1024):
            rep.run(f"check_top2_N{n}", lambda n=n: check_top2_kernel(n, V, D_BASE, seed=n))
        rep.run("check_top2_ties", lambda: check_top2_kernel(300, 5000, 200, seed=1, ties=True))
        rep.run("check_top2_ties_split", lambda: check_top2_kernel(16, 70000, 64, 2, ties=True))
        from stateblock.triton_top2 import Top2Config

        tma = Top2Config(tma=True)
        rep.run("check_top2_N1024_tma", lambda: check_top2_kernel(1024, V, D_BASE, 3, cfg=tma))
        rep.run("check_top2_ties_tma", lambda: check_top2_kernel(300, 5000, 200, 1, True, tma))
        rep.run(
            "check_top2_ties_split_tma",
            lambda: check_top2_kernel(
                16, 70000, 64, 2, True, Top2Config(32, 64, 64, 4, 3, tma=True)
            ),
        )
        from stateblock.serving import load_serving_model

        # paths, not stateblock.runtime: that module needs structlog and prometheus_client
        shipped = Path(__file__).resolve().parent.parent / "models" / "reference"
        served = load_serving_model("stateblock-reference", shipped / "base", shipped / "decoder")
        rows = shipped_rows(served)
        rep.run("check_engine_parity", lambda: check_engine_parity(served, rows))
        rep.run("check_graph_vs_eager", lambda: check_graph_vs_eager(served, rows))
        rep.run("check_random_decoder_parity", lambda: check_random_decoder_parity(et))
    rate = rep.run("gemm_tflops", gemm_tflops)
    rep.run("copy_gbs", copy_gbs)
    rate = rate if isinstance(rate, float) else 790.0
    tiles = time_top2(rep, rate)
    time_engine(rep, et, rate, tiles)
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
