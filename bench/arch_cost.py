"""Readout cost of decoder architectures at the seed's scale, as JSON (one CUDA GPU, ~30 s).

`python -m bench.arch_cost --out DIR [--arm NAME=JSON ...]`: for each arm, a random decoder
(d_base 2688, V 131072; `recipe.DECODER_CONFIG` with the arm's overrides) in the torch engine
as it serves, timed at K=1 and K=8 lanes of depth 8192 against the lm_head GEMM floor
(2*K*D*d*V at the measured bf16 GEMM rate), with the peak memory beyond the resident weights.
It is how the ablation log prices an architecture before a build stage buys it (deeper
refinement stacks, more latent slots: docs/QUALITY.md). Times: CUDA events, warm-up then the
median of 20 (bench/machine.py), as `bench.gpu_smoke` times the engine (its
`measure_readout`); the engine captures each shape on its first readout.
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
}
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


def measure_arm(overrides: dict, rate_tflops: float, rows: list[torch.Tensor]) -> dict:
    import stateblock.engines.torch_engine as et
    from bench.gpu_checks import random_weights
    from bench.gpu_smoke import measure_readout
    from stateblock.train.recipe import DECODER_CONFIG

    dec, lm_head, eos = random_weights({**DECODER_CONFIG, **overrides})
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
