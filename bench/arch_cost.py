"""Readout cost of decoder architectures at the seed's scale, as JSON (one CUDA GPU, ~30 s).

`python -m bench.arch_cost --out DIR [--arm NAME=JSON ...]`: for each arm, a random decoder
(d_base 2688, V 131072; `recipe.DECODER_CONFIG` with the arm's overrides) in the torch engine
as it serves, timed at K=1 and K=8 lanes of depth 8192 against the lm_head GEMM floor
(2*K*D*d*V at the measured bf16 GEMM rate), with the peak memory beyond the resident weights.
It is how the ablation log prices an architecture before a build stage buys it (deeper
refinement stacks, more latent slots: docs/QUALITY.md). Times: CUDA events, warm-up then the
median of 20 (bench/machine.py), as `bench.gpu_smoke` times the engine (its
`measure_readout`); the engine captures each shape on its first readout.

A decoder that reads the prompt's token ids (a copy head: the prose readout's, issue 41) is
served by the reference engine alone, so such an arm, or one that says `"engine":
"reference"`, is timed there (eager, bf16, prompts of 500 random tokens), beside the shipped
decoder on the same engine for the ratio: the copy head's (K, D, 2P) scores a pass are the
cost the vocabulary's GEMM floor does not count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# the decoder architectures docs/QUALITY.md compares: the shipped one, deeper stacks, wider latents
DEFAULT_ARMS = {
    "shipped": {},
    "mixer3_ref2": {"n_mixer": 3, "n_ref_mixer": 2},
    "ref3": {"n_ref_mixer": 3},
    "latent128": {"n_latent": 128},
    "latent256": {"n_latent": 256},
    "shipped_reference": {"engine": "reference"},
    # the prose readout's copy head (prose_readout.PROSE_COPY)
    "prose_copy": {"copy": "twin", "copy_guess": 4, "copy_follow": True, "copy_span": True,
                   "copy_match": 16, "copy_match_ends": True},
}  # fmt: skip
DEPTH = 8192


def parse_arm(text: str) -> tuple[str, dict]:
    """`NAME=JSON` -> (NAME, overrides of recipe.DECODER_CONFIG)."""
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--arm wants NAME=JSON, got {text!r}")
    try:
        value = json.loads(overrides)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--arm {name}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--arm {name}: overrides must be a JSON object")
    return name, value


def on_reference(overrides: dict) -> bool:
    """Whether an arm is timed on the reference engine (it says so, or reads token ids)."""
    return overrides.get("engine") == "reference" or bool(
        overrides.get("copy") or overrides.get("row_tokens")
    )


def measure_reference(dec, lm_head, eos: int, rows: list[torch.Tensor], rate: float) -> dict:
    """The reference engine at K=1 and K=8 lanes of depth DEPTH, each lane's prompt ids random
    (never EOS), against the same GEMM floor, with the peak memory beyond the weights."""
    from bench.gpu_checks import D_BASE, V
    from bench.machine import cuda_ms
    from stateblock.engines import LaneRequest
    from stateblock.engines.reference import ReferenceEngine
    from stateblock.protocol.envelope import ModelIdentity

    dec = dec.to(lm_head.dtype)  # as ReferenceEngine.load builds it: in the lm_head's dtype
    eng = ReferenceEngine(dec, lm_head, ModelIdentity("bench", b"", b"", b""), eos_token_id=eos,
                          device="cuda")  # fmt: skip
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(eos + 1, V, (r.shape[0],), generator=gen) for r in rows]
    out: dict = {"params": sum(p.numel() for p in dec.parameters()), "engine": "reference"}
    for k in (1, 8):
        lanes = [LaneRequest(rows=rows[i], depth=DEPTH, prompt_ids=ids[i]) for i in range(k)]
        torch.cuda.reset_peak_memory_stats()
        floor = 2 * k * DEPTH * D_BASE * V / (rate * 1e12) * 1e3
        ms = cuda_ms(lambda lanes=lanes: eng.readout(lanes), iters=5, warmup=1)
        out[f"K{k}_D{DEPTH}"] = {
            "readout_ms": ms, "floor_ms": floor, "readout_over_floor": ms / floor,
            "peak_extra_gib": (torch.cuda.max_memory_allocated() - weights) / 2**30,
        }  # fmt: skip
    return out


def measure_arm(overrides: dict, rate_tflops: float, rows: list[torch.Tensor]) -> dict:
    import stateblock.engines.torch_engine as et
    from bench.gpu_checks import random_weights
    from bench.gpu_smoke import measure_readout
    from stateblock.train.recipe import DECODER_CONFIG

    arch = {k: v for k, v in overrides.items() if k != "engine"}
    dec, lm_head, eos = random_weights({**DECODER_CONFIG, **arch})
    if on_reference(overrides):
        return measure_reference(dec, lm_head, eos, rows, rate_tflops)
    ident = et.ModelIdentity("bench", b"", b"", b"")
    opts = et.TorchEngineOptions(device="cuda", warm_shapes=())
    eng = et.TorchEngine(dec, lm_head, ident, eos_token_id=eos, options=opts)
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    row: dict = {"params": sum(p.numel() for p in dec.parameters())}
    for k in (1, 8):  # each shape captured on its first readout
        row[f"K{k}_D{DEPTH}"] = measure_readout(et, eng, rows, k, DEPTH, weights, rate_tflops)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="writes OUT/arch_cost.json")
    ap.add_argument(
        "--arm", type=parse_arm, action="append", default=[],
        help="NAME=JSON overrides of the shipped decoder config (default: the logged arms)",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("arch_cost needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.gpu_checks import D_BASE
    from bench.machine import gemm_tflops

    arms = dict(a.arm) or DEFAULT_ARMS
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "arch_cost.json"
    doc: dict = {"gpu": torch.cuda.get_device_name(0), "gemm_tflops": gemm_tflops(), "arms": {}}
    rows = [torch.randn(500, D_BASE).bfloat16() for _ in range(8)]  # on the CPU, as blocks come
    for name, overrides in arms.items():
        t0 = time.perf_counter()
        doc["arms"][name] = {
            "overrides": overrides,
            **measure_arm(overrides, doc["gemm_tflops"], rows),
        }
        doc["arms"][name]["s"] = time.perf_counter() - t0
        path.write_text(json.dumps(doc, indent=2) + "\n")  # each arm as soon as it exists
        print(name, json.dumps(doc["arms"][name]), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
