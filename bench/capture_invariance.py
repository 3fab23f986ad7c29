"""Is the capture's compiled forward batch-invariant? One prompt's rows at every lane count.

The load bench found greedy answers under a `reduce-overhead` capture differing from the
same prompt alone (docs/BENCHMARKS.md, issue 38), while the eager capture keeps them
identical. A prompt alone runs at lanes == 1, which dynamo compiles as a graph of its own
(it specializes sizes of 1); with company it runs the symbolic-lanes graph. This bench
puts one prompt in lane 0 of cohorts of 1, 2, 4, ... lanes (the rest other prompts) and
compares its rows bit for bit: eager against eager, compiled against compiled, and each
against the eager lane alone, for the modes asked. Seconds on the H200; also runs on the CPU
at a small scale.

    python -m bench.capture_invariance --scale full --modes off,reduce-overhead
    python -m bench.capture_invariance --scale full --modes off,default --size-oblivious
        # a lone lane through the cohorts' graph (STATEBLOCK_CAPTURE_MIN_LANES=1)
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.models import SCALES, bench_prompt, bench_tokenizer, build_llama, sync
from bench.variants import add_variant_flags, apply_variants, variant_config
from stateblock.model.capture import (
    capture,
    compile_backbone,
    graphs_compiled,
    uncompile_backbone,
)


def cohort(tok, prompts: list[str], lanes: int, width: int, device) -> torch.Tensor:
    """(lanes, width) right-padded ids: prompt 0 in lane 0, then the others in turn."""
    ids = torch.full((lanes, width), tok.pad_token_id or 0, dtype=torch.long)
    for i in range(lanes):
        row = tok(prompts[i % len(prompts)])["input_ids"][:width]
        ids[i, : len(row)] = torch.tensor(row)
    return ids.to(device)


def lane0_rows(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.inference_mode():
        return capture(model, ids)[0, :n].float().cpu()


def compare(rows: dict[int, torch.Tensor], against: torch.Tensor) -> dict:
    return {
        str(k): {"identical": bool(torch.equal(v, against)),
                 "max_abs": float((v - against).abs().max())}
        for k, v in rows.items()
    }  # fmt: skip


def run_mode(model, tok, prompts, lanes, width, device, mode: str, oblivious: bool,
             autotune: bool = False) -> dict:  # fmt: skip
    """Lane 0's rows at each lane count under one compile mode ("off": eager)."""
    n = len(tok(prompts[0])["input_ids"][:width])
    t0, graphs = time.perf_counter(), graphs_compiled()
    if mode != "off":
        compile_backbone(model, mode, size_oblivious=oblivious, deterministic=not autotune)
    rows = {}
    for k in lanes:
        ids = cohort(tok, prompts, k, width, device)
        for _ in range(3):  # cudagraph trees: warm-up, record, replay
            rows[k] = lane0_rows(model, ids, n)
    sync(device)
    out = {"seconds": round(time.perf_counter() - t0, 1), "rows": rows,
           "graphs": graphs_compiled() - graphs}  # fmt: skip
    uncompile_backbone(model)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--modes", default="off,reduce-overhead")
    ap.add_argument("--lanes", default="1,2,4,8,16,32")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size-oblivious", action="store_true",
                    help="compile as STATEBLOCK_CAPTURE_MIN_LANES=1 does: one lane runs the "
                         "symbolic-lanes graph")  # fmt: skip
    add_variant_flags(ap)
    ap.add_argument("--out", default=None, help="a JSON file for the result")
    args = ap.parse_args(argv)
    scale = SCALES[args.scale]
    lanes = [int(x) for x in args.lanes.split(",")]
    rng = random.Random(0)
    prompts = [bench_prompt(rng, args.width, scale.vocab_size) for _ in range(max(lanes))]
    tok = bench_tokenizer(scale.vocab_size)
    model = build_llama(scale, args.device, seed=0)
    if args.device == "cpu":
        model = model.float()
    apply_variants(model, args, ap)
    modes = args.modes.split(",")
    results = {m: run_mode(model, tok, prompts, lanes, args.width, args.device, m,
                            args.size_oblivious, args.autotune) for m in modes}  # fmt: skip
    alone = results["off"]["rows"].get(1) if "off" in results else None
    report = {"scale": args.scale, "device": args.device, "width": args.width,
              "size_oblivious": args.size_oblivious, **variant_config(args),
              "modes": {}}  # fmt: skip
    for mode, r in results.items():
        rows = r["rows"]
        entry = {"seconds": r["seconds"], "graphs": r["graphs"],
                 "vs_own_lanes_1": compare(rows, rows[lanes[0]])}  # fmt: skip
        if len(lanes) > 1:
            entry["vs_own_lanes_2"] = compare(rows, rows[lanes[1]])
        if alone is not None:
            entry["vs_eager_alone"] = compare(rows, alone)
        report["modes"][mode] = entry
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
