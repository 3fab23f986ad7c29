"""Readout engine time per answer depth on the CPU (`python -m bench.engines_cpu`).

One packed enqueue of K lanes of captured rows, read at each depth by each engine; the
median of `--repeats` timed runs after one warm-up run. The engines compute every position
up to the depth whatever the answer's EOS, so the time depends on the depth alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from stateblock.engines import LaneRequest, create_engine
from stateblock.model.loading import load_serving_model
from stateblock.runtime import DEFAULT_MODEL_NAME, REFERENCE_BASE, REFERENCE_DECODER
from stateblock.train import tasks


def captured_lanes(model, k: int, seed: int) -> list[torch.Tensor]:
    """Rows of K held-out prompts, one capture each: (P_i, d_base)."""
    return [model.prompt_rows(ex.prompt) for ex in tasks.generate(k, split="heldout", seed=seed)]


def time_engine(engine, rows: list[torch.Tensor], depth: int, repeats: int) -> list[float]:
    lanes = [LaneRequest(rows=r, depth=depth) for r in rows]
    engine.readout(lanes)  # warm-up: allocator, ORT's first-run planning
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.readout(lanes)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="reference,onnx")
    ap.add_argument("--depths", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--lanes", type=int, default=1, help="K lanes per enqueue")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch/ORT threads (0: default)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--base-dir", type=Path, default=REFERENCE_BASE)
    ap.add_argument("--decoder-dir", type=Path, default=REFERENCE_DECODER)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = load_serving_model(DEFAULT_MODEL_NAME, a.base_dir, a.decoder_dir)
    rows = captured_lanes(model, a.lanes, a.seed)
    depths = [int(d) for d in a.depths.split(",")]
    report: dict = {
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpu_count": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "lanes": a.lanes,
        "prompt_lens": [int(r.shape[0]) for r in rows],
        "repeats": a.repeats,
        "ms": {},
    }
    for name in a.engines.split(","):
        engine = create_engine(name, model)
        report["ms"][name] = {}
        for d in depths:
            times = time_engine(engine, rows, d, a.repeats)
            report["ms"][name][str(d)] = round(statistics.median(times) * 1e3, 1)
            print(f"{name:10s} D={d:5d}  {report['ms'][name][str(d)]:9.1f} ms", flush=True)
    names = list(report["ms"])
    print("\n| depth | " + " | ".join(f"{n} (ms)" for n in names) + " |")
    print("|---:|" + "---:|" * len(names))
    for d in depths:
        print(f"| {d} | " + " | ".join(f"{report['ms'][n][str(d)]:.1f}" for n in names) + " |")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
