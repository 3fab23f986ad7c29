"""Autoregressive decoding of the bench base model: the loop the readout replaces, timed.

HF `generate`, greedy, exactly `new_tokens` tokens (min_new_tokens = max_new_tokens):
- eager: dynamic cache, compilation disabled;
- compiled: static cache, and generate compiles the decode step itself (transformers'
  auto-compile for a static cache; torch.compile, mode reduce-overhead on CUDA).
`--batches 64,1,8` times a batch of distinct prompts at each size in turn, in one process
(the load bench's comparison: answer tokens/s of batched AR against the served stack).
Both run in their own process (`python -m bench.ar_decode`): the caller caps the compile
time with a timeout and records a skip instead of running out the clock, and the eager decode
never touches a model that an in-process stack compiled on another thread (its CUDA graph
trees belong to that thread; reusing the model after such a stack crashed a bench once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from bench.models import SCALES, build_llama, sync

REPO = Path(__file__).resolve().parent.parent


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def prompt_ids(prompt_len: int, vocab_size: int, device, seed: int, batch: int = 1) -> torch.Tensor:
    """`batch` distinct random prompts of prompt_len ids, each after <bos>."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab_size, (batch, prompt_len), generator=gen)
    ids[:, 0] = 1  # <bos>
    return ids.to(device)


def _compile_config(device: torch.device):
    from transformers import CompileConfig

    if device.type == "cuda":
        return CompileConfig()  # transformers' default: inductor, reduce-overhead
    config = CompileConfig(mode="default")  # no CUDA graphs off the GPU
    config._compile_all_devices = True  # auto-compile is CUDA-only unless asked
    return config


def generate_once(model: nn.Module, ids: torch.Tensor, new_tokens: int, compiled: bool):
    """(seconds, tokens generated) for one greedy answer of exactly new_tokens tokens."""
    kwargs: dict = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        min_new_tokens=new_tokens,
        max_new_tokens=new_tokens,
        pad_token_id=model.config.pad_token_id,
    )
    if compiled:
        kwargs.update(cache_implementation="static", compile_config=_compile_config(ids.device))
    else:
        kwargs.update(disable_compile=True)
    sync(ids.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    sync(ids.device)
    return time.perf_counter() - t0, int(out.shape[1] - ids.shape[1])


def _graphs() -> int | None:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # a private counter: report nothing rather than fail the bench
        return None


def time_ar(
    model: nn.Module,
    prompt_len: int,
    new_tokens: int,
    *,
    compiled: bool,
    repeats: int,
    seed: int = 0,
    deadline: float | None = None,
    progress: Callable[[dict], None] | None = None,
    batch: int = 1,
) -> dict:
    """Warm up, then up to `repeats` timed answers (fewer if `deadline`, a perf_counter
    time, would be passed); median seconds per answer and per token. `progress` sees the
    partial result after the warm-up and after each answer. With `batch` > 1 an answer is
    `batch` prompts decoded together; tokens_per_s counts every row's tokens."""
    progress = progress or (lambda _out: None)
    ids = prompt_ids(prompt_len, model.config.vocab_size, _device(model), seed, batch)
    out: dict = {"mode": "compiled" if compiled else "eager", "prompt_len": prompt_len,
                 "batch": batch}  # fmt: skip
    t0 = time.perf_counter()
    if compiled:
        # the first answer compiles and records CUDA graphs; the second runs warm
        out["compile_and_first_answer_s"], _ = generate_once(model, ids, new_tokens, True)
        generate_once(model, ids, new_tokens, True)
        out["dynamo_unique_graphs"] = graphs = _graphs()
        if graphs == 0:
            out["warning"] = "no graph was compiled: the answers ran eagerly"
        estimate = None
    else:
        warm = min(16, new_tokens)
        warm_s, _ = generate_once(model, ids, warm, False)
        estimate = warm_s / warm * new_tokens  # a lower bound: later steps see a longer cache
    out["warmup_s"] = time.perf_counter() - t0
    progress(out)
    runs: list[float] = []
    counts: list[int] = []
    for _ in range(repeats):
        expect = statistics.median(runs) if runs else estimate
        if deadline is not None and expect is not None and time.perf_counter() + expect > deadline:
            break
        seconds, n = generate_once(model, ids, new_tokens, compiled)
        runs.append(seconds)
        counts.append(n)
        progress(dict(out, runs_s=runs, counts=counts))
    if not runs:
        out["skipped"] = f"an answer would take ~{estimate:.0f} s, past the time budget"
        return out
    answer = statistics.median(runs)
    out.update(
        tokens=counts[-1],
        all_counts_exact=all(n == new_tokens for n in counts),
        repeats=len(runs),
        runs_s=runs,
        counts=counts,
        answer_s=answer,
        per_token_ms=1000.0 * answer / new_tokens,
        tokens_per_s=batch * new_tokens / answer,
    )
    return out


def time_ar_batches(model: nn.Module, args, deadline: float | None, write) -> dict:
    """time_ar at each of args.batches in turn; a batch whose warm-up would likely end past
    `deadline` (the last one's warm-up taken as the estimate) is skipped and said so."""
    done: dict[str, dict] = {}
    warmup_s = 0.0
    for batch in args.batches:
        if deadline is not None and time.perf_counter() + warmup_s > deadline:
            done[str(batch)] = {"batch": batch, "skipped": "past the time budget"}
            continue

        def progress(partial: dict, b: int = batch) -> None:
            write({"batches": {**done, str(b): partial}})

        done[str(batch)] = result = time_ar(
            model, args.prompt_len, args.new_tokens, compiled=args.mode == "compiled",
            repeats=args.repeats, seed=args.seed, deadline=deadline, progress=progress,
            batch=batch,
        )  # fmt: skip
        warmup_s = result["warmup_s"]
        write({"batches": done})
    return {"batches": done}


def batches_in_process(args, device: str, budget_s: float) -> dict:
    """This module's --batches in its own process, for the load bench (`args`: its ar_*
    options, scale, prompt_len, seed and out), killed past budget_s + 30 s."""
    mode = args.ar_mode
    if mode == "auto":
        mode = "compiled" if device.startswith("cuda") else "eager"
    out = {"mode": mode, "new_tokens": args.ar_new_tokens, "prompt_len": args.prompt_len}
    if not args.ar_batches:
        return dict(out, skipped="--ar-batches ''")
    if budget_s < 20.0:
        return dict(out, skipped=f"{budget_s:.0f} s left of the budget")
    result, log = args.out / "ar_batches.json", args.out / "ar_batches.log"
    cmd = [sys.executable, "-m", "bench.ar_decode", "--mode", mode, "--scale", args.scale,
           "--device", device, "--prompt-len", str(args.prompt_len), "--new-tokens",
           str(args.ar_new_tokens), "--repeats", str(args.ar_repeats), "--seed",
           str(args.seed), "--batches", ",".join(map(str, args.ar_batches)), "--budget-s",
           f"{budget_s:.1f}", "--out", str(result)]  # fmt: skip
    with log.open("wb") as f:
        try:
            subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                           timeout=budget_s + 30.0)  # fmt: skip
        except subprocess.TimeoutExpired:
            out["note"] = f"stopped at {budget_s + 30.0:.0f} s; the batches it finished count"
    if not result.exists():
        return dict(out, failed=log.read_text(errors="replace")[-1500:])
    return dict(out, **json.loads(result.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", choices=["eager", "compiled"], default="compiled")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default=None,
                    help="comma-separated batch sizes, timed in this order (default: one prompt)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="no timed answer that would end past this many seconds from the start")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="JSON result")
    args = ap.parse_args()
    deadline = None if args.budget_s is None else time.perf_counter() + args.budget_s
    scale = SCALES[args.scale]
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = build_llama(scale, args.device, args.seed)
    if torch.device(args.device).type == "cpu":
        model = model.float()  # bf16 matmuls are slow on most CPUs
    build_s = time.perf_counter() - t0

    def write(result: dict) -> None:  # atomic: the caller may kill this process any time
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(result, build_s=build_s), indent=2))
        tmp.replace(args.out)

    args.prompt_len = args.prompt_len or scale.prompt_len
    args.new_tokens = args.new_tokens or scale.max_tokens
    if args.batches:
        args.batches = [int(b) for b in args.batches.split(",")]
        write(time_ar_batches(model, args, deadline, write))
        return
    result = time_ar(
        model,
        args.prompt_len,
        args.new_tokens,
        compiled=args.mode == "compiled",
        repeats=args.repeats,
        seed=args.seed,
        deadline=deadline,
        progress=write,
    )
    write(result)


if __name__ == "__main__":
    main()
