"""Throughput under load: the per-service stack on one GPU, against batched AR decoding.

`python -m bench.load_gpu --out DIR` (= `stateblock bench load`):

1. Builds the bench-scale base and decoder (bench/models.py: random weights, seeded, nothing
   downloaded) and starts the stack as deployed, one process per service (bench/procs.py),
   nats-server with its monitoring port; or, with --placement in-process, one `stateblock up`.
2. For each answer depth (default 256 and 1,014 tokens): a reference pass first, each of
   the --prompts distinct prompts sent alone; then for each client count C (default 1, 8,
   32, 64, 128) C threads send `/v1/completions` back to back for --level-s seconds
   (prompt 512 tokens, temperature 0, ignore_eos). Per level: requests/s and answer
   tokens/s over the window in which all C clients were sending, p50/p90/p99 latency,
   errors by HTTP status, how many answers differ from the same prompt's answer alone
   (batch invariance), and where the time goes (bench/load_probes.py): CPU cores per
   process, the services' stage histograms, GPU busy, bytes/s through nats-server.
3. The same base's batched AR decode (bench/ar_decode.py, HF `generate`, static cache +
   torch.compile on CUDA) at each batch size of --ar-batches, in its own process.
4. With --big-clients B, after the levels on the same stack: the fairness level
   (bench/load_fairness.py): small requests alone, then beside B clients sending maximal
   requests (the longest prompt, `n` lanes, the deepest answer the stack accepts).
5. With --stall-clients N: a second stack whose capture compiles (--stall-compile), one
   level of N clients: what a compile on the request path does under load.
Writes DIR/load.json after every step, then DIR/load.md and DIR/load.png. --budget-s caps
the whole run: a step that would not fit is skipped and the reason recorded.

On the GPU machine: `bash bench/prepare_wheels.sh` here, carry the wheels, then
`source bench/gpu_env.sh && python3 -m bench.load_gpu --out $OUT`.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench import load_probes
from bench.ar_decode import batches_in_process
from bench.latency_cpu import pct
from bench.machine import mps_daemon_running
from bench.models import SCALES, bench_prompt
from bench.procs import ProcStack, ProcStackConfig
from bench.report import Report
from bench.stack import CompletionError, CompletionsClient
from capture_svc.config import default_compile
from stateblock.app.plan import IN_PROCESS, PROCESSES

MODEL_NAME = "stateblock-bench"


def env_pair(text: str) -> tuple[str, str]:
    """--env's STATEBLOCK_X=V as (name, value)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for load.json/.md/.png")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--levels", type=ints, default=[1, 8, 32, 64, 128], help="client counts")
    ap.add_argument("--depths", type=ints, default=[256, 1014], help="answer tokens")
    ap.add_argument("--level-s", type=float, default=6.0,
                    help="seconds each level's clients keep starting requests")  # fmt: skip
    ap.add_argument("--max-requests", type=int, default=0,
                    help="at most this many requests a level (0: no cap)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=64,
                    help="distinct prompts, each sent alone once a depth (the reference)")  # fmt: skip
    ap.add_argument("--prompt-len", type=int, default=None, help="default: the scale's")
    ap.add_argument("--n", type=int, default=None,
                    help="the OpenAI `n` of every load-level request: its prompt's answers, "
                         "lanes the capture runs forward once (default: left out, one)")  # fmt: skip
    ap.add_argument("--workers", type=int, default=None,
                    help="readout workers a process (default: the readout's, by its engine)")  # fmt: skip
    ap.add_argument("--readout-procs", type=int, default=1, help="readout processes")
    ap.add_argument("--captures", type=int, default=1, help="capture processes on the GPU")
    ap.add_argument("--placement", choices=[PROCESSES, IN_PROCESS], default=PROCESSES,
                    help="a process per service, or one `stateblock up` (`local` rows)")  # fmt: skip
    ap.add_argument("--engine", default=None, help="readout engine (default: torch on CUDA)")
    ap.add_argument("--capture-compile", default=None,
                    help="the capture's torch.compile (default: the service's, `default` on "
                         "a GPU and `off` on the CPU)")  # fmt: skip
    ap.add_argument("--env", action="append", default=[], metavar="STATEBLOCK_X=V", type=env_pair,
                    help="a setting for every service, e.g. STATEBLOCK_CAPTURE_COHORT_LANES=32")  # fmt: skip
    ap.add_argument("--blocks-storage", choices=["file", "memory"], default="file")
    ap.add_argument("--ar-batches", type=ints, default=[64, 1, 8, 32, 128],
                    help="AR batch sizes, timed in this order ('' for none)")  # fmt: skip
    ap.add_argument("--ar-mode", choices=["auto", "compiled", "eager"], default="auto",
                    help="auto: compiled on CUDA, eager elsewhere")  # fmt: skip
    ap.add_argument("--ar-new-tokens", type=int, default=256)
    ap.add_argument("--ar-repeats", type=int, default=2)
    ap.add_argument("--ar-reserve-s", type=float, default=None,
                    help="seconds kept for the AR step (default: 150 on CUDA, 60 elsewhere)")  # fmt: skip
    ap.add_argument("--ratio-clients", type=int, default=64,
                    help="the level and AR batch whose answer tokens/s are compared")  # fmt: skip
    ap.add_argument("--profile-clients", type=int, default=0,
                    help="py-spy each service at this level of the first depth (0: none)")  # fmt: skip
    ap.add_argument("--stall-clients", type=int, default=0, help="0: no compile-stall level")
    ap.add_argument("--stall-compile", default="reduce-overhead")
    ap.add_argument("--big-clients", type=int, default=0,
                    help="the fairness level: clients sending maximal requests (0: none)")  # fmt: skip
    ap.add_argument("--fairness-requests", type=int, default=40,
                    help="small requests alone, then as many beside the big clients")  # fmt: skip
    ap.add_argument("--big-prompt-len", type=int, default=None,
                    help="default: the stack's STATEBLOCK_PROMPT_LEN_MAX")  # fmt: skip
    ap.add_argument("--big-n", type=int, default=None,
                    help="lanes of a big request, a distinct prompt each; default: "
                         "STATEBLOCK_MAX_LANES")  # fmt: skip
    ap.add_argument("--big-max-tokens", type=int, default=None,
                    help="default: the stack's STATEBLOCK_ANSWER_DEPTH_MAX")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=540.0, help="whole-run time budget")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work-dir", type=Path, default=None, help="models; default a /tmp dir")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# what a request's answer counts as when its `n` greedy answers of one prompt differ
DIFFERING_CHOICES = "<the request's answers of one prompt differ>"


class Level:
    """C client threads sending back to back until `stop_at` or `stop` is set; every outcome
    kept. n: the OpenAI `n` field of every request (lanes a request), left out when None."""

    def __init__(
        self,
        url: str,
        prompts: list[str] | list[list[str]],
        depth: int,
        max_requests: int,
        n: int | None = None,
    ) -> None:
        self.url, self.prompts, self.depth, self.n = url, prompts, depth, n
        self.max_requests = max_requests
        self.stop = threading.Event()
        self.sent = 0  # requests begun: each counted once its send time is taken
        self._next = itertools.count()
        self._lock = threading.Lock()
        # (prompt index, sent, replied, answer text or None, completion tokens, error key)
        self.results: list[tuple[int, float, float, str | None, int, str | None]] = []
        self.error_examples: dict[str, str] = {}  # error key: its first message

    def lanes(self, k: int) -> int:
        """Answers a request of prompt k asks for: `n` for each of its prompts (a prompt may
        be a list of them, as the OpenAI API takes)."""
        prompt = self.prompts[k]
        return (self.n or 1) * (len(prompt) if isinstance(prompt, list) else 1)

    def _client(self, stop_at: float) -> None:
        client = CompletionsClient(self.url, timeout=300.0)
        try:
            while time.perf_counter() < stop_at and not self.stop.is_set():
                i = next(self._next)
                if self.max_requests and i >= self.max_requests:
                    return
                error = self._one(client, i % len(self.prompts))
                if error is not None and not error.isdigit():
                    client.close()  # not an HTTP reply: the connection starts afresh
                    client = CompletionsClient(self.url, timeout=300.0)
        finally:
            client.close()

    def _one(self, client: CompletionsClient, k: int) -> str | None:
        """One request of prompt k; its error key (HTTP status or exception name) or None."""
        t0 = time.perf_counter()
        with self._lock:
            self.sent += 1
        text, tokens, error, message = None, 0, None, ""
        try:
            r = client.complete(MODEL_NAME, self.prompts[k], self.depth, self.n)
            text, tokens = r["choices"][0]["text"], r["usage"]["completion_tokens"]
            if isinstance(self.prompts[k], str) and len({c["text"] for c in r["choices"]}) > 1:
                text = DIFFERING_CHOICES  # greedy answers of one prompt: never its reference
        except CompletionError as e:
            error, message = str(e.status), str(e)
        except Exception as e:  # noqa: BLE001 - counted by kind, the run goes on
            error, message = type(e).__name__, str(e)[:500]
        with self._lock:
            self.results.append((k, t0, time.perf_counter(), text, tokens, error))
            if error is not None:
                self.error_examples.setdefault(error, message)
        return error

    def run(self, clients: int, seconds: float) -> tuple[float, float]:
        """(start, stop): the time in which every client was starting requests."""
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        threads = [
            threading.Thread(target=self._client, args=(stop_at,), daemon=True)
            for _ in range(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return t0, stop_at


def rates(ok: list[tuple], t0: float, t1: float) -> tuple[float, float, float]:
    """(window seconds, requests/s, answer tokens/s) in the steady state: between the first
    and the last reply that came while every client was still sending (t0..t1), counting
    the replies after the first. The ramp (all clients start at once, nothing is answered
    for a latency) and the drain (fewer clients in flight) stay out. Fewer than two such
    replies: every reply over the time from t0 to the last."""
    done = sorted((r[2], r[4]) for r in ok if t0 < r[2] <= t1)
    if len(done) >= 2 and done[-1][0] > done[0][0]:
        window = done[-1][0] - done[0][0]
        return window, (len(done) - 1) / window, sum(n for _, n in done[1:]) / window
    if not ok:
        return t1 - t0, 0.0, 0.0
    window = max(r[2] for r in ok) - t0
    return window, len(ok) / window, sum(r[4] for r in ok) / window


def summarize(level: Level, clients: int, t0: float, t1: float, refs: dict) -> dict:
    """The level's steady-state rates, latency of every request, errors, invariance."""
    ok = [r for r in level.results if r[5] is None]
    window, req_per_s, tok_per_s = rates(ok, t0, t1)
    errors: dict[str, int] = {}
    for r in level.results:
        if r[5] is not None:
            errors[r[5]] = errors.get(r[5], 0) + 1
    differing = [r[0] for r in ok if refs.get(r[0]) is not None and r[3] != refs[r[0]]]
    out = {
        "clients": clients,
        "depth": level.depth,
        "n": len(level.results),
        "n_ok": len(ok),
        "n_errors": sum(errors.values()),
        "errors_by_status": errors,
        "error_examples": level.error_examples,
        "window_s": round(window, 3),
        "req_per_s": round(req_per_s, 2),
        "tok_per_s": round(tok_per_s, 1),
        "all_full_depth": all(r[4] == level.depth * level.lanes(r[0]) for r in ok),
        "invariance": {"checked": sum(1 for r in ok if r[0] in refs),
                       "differing": len(differing), "prompts": sorted(set(differing))[:8]},
    }  # fmt: skip
    if ok:
        ms = [1000.0 * (r[2] - r[1]) for r in ok]
        out["latency_ms"] = {f"p{q}": round(pct(ms, q), 2) for q in (50, 90, 99)}
        out["latency_ms"].update(mean=round(sum(ms) / len(ms), 2), max=round(max(ms), 2))
    return out


def reference_pass(url: str, prompts: list[str], depth: int) -> tuple[dict[int, str], dict]:
    """Each prompt alone, one at a time: {prompt index: answer}, and the pass's summary."""
    level = Level(url, prompts, depth, max_requests=len(prompts))
    t0, t1 = level.run(1, float("inf"))
    refs = {r[0]: r[3] for r in level.results if r[5] is None}
    return refs, summarize(level, 1, t0, t1, {})


def measure_level(stack: ProcStack, gpu, url, prompts, depth, clients, args, refs) -> dict:
    """One level with the probes read around it."""
    level = Level(url, prompts, depth, args.max_requests, n=args.n)
    pids = {**stack.pids(), "bench-clients": os.getpid()}
    profiles = None
    if clients == args.profile_clients and depth == args.depths[0]:
        services = {k: v for k, v in pids.items() if k not in ("bench-clients", "nats")}
        profiles = load_probes.Profiles(args.out, services, args.level_s)
    cpu0, varz0 = load_probes.cpu_snapshot(pids), load_probes.varz(stack.nats_monitor_url)
    hist0 = stack.scrape(load_probes.FAMILIES)
    w0 = time.perf_counter()
    if profiles is not None:
        profiles.start()
    t0, t1 = level.run(clients, args.level_s)
    wall = time.perf_counter() - w0
    cpu1, varz1 = load_probes.cpu_snapshot(pids), load_probes.varz(stack.nats_monitor_url)
    time.sleep(0.2)  # a worker observes its stages just after its ack, past the reply
    out = summarize(level, clients, t0, t1, refs)
    cores = load_probes.cores_used(cpu0, cpu1, wall)
    rate = len([r for r in level.results if r[5] is None]) / wall
    out.update(
        wall_s=round(wall, 3),
        cpu_cores=cores,
        # CPU time a request costs each process: its ceiling on one core is 1000 / this
        cpu_ms_per_request={k: round(1000.0 * v / rate, 2) for k, v in cores.items()}
        if rate
        else {},
        gpu_busy_pct=gpu.mean(w0, w0 + wall) if gpu is not None else None,
        nats=load_probes.nats_rates(varz0, varz1, wall),
        stages=load_probes.stages(hist0, hist1 := stack.scrape(load_probes.FAMILIES), wall),
        compiled_after_warmup=load_probes.compiled(hist0, hist1),
    )
    if profiles is not None:
        out["profiles"] = profiles.finish()
    return out


def start_stack(args, paths: dict, device: str, compile_mode: str, name: str, left) -> tuple:
    """The stack over the saved models, a process per service or one `stateblock up`
    process (--placement); (stack, gateway URL, start seconds)."""
    cuda = device.startswith("cuda")
    config = ProcStackConfig(
        data_dir=Path(paths["work"]) / name,
        model_name=MODEL_NAME,
        base_dir=Path(paths["base"]),
        decoder_dir=Path(paths["decoder"]),
        device=device,
        capture_dtype="bfloat16" if cuda else "float32",
        engine=args.engine,
        workers=args.workers,
        readout_procs=args.readout_procs,
        captures=args.captures,
        capture_compile=compile_mode,
        blocks_storage=args.blocks_storage,
        ready_timeout_s=max(30.0, left()),
        nats_monitor=args.placement == PROCESSES,  # `stateblock up`'s own server has none
        extra_env=dict(args.env),
        placement=args.placement,
    )
    stack = ProcStack(config)
    t0 = time.perf_counter()
    url = stack.start()
    return stack, url, round(time.perf_counter() - t0, 1)


def run_depths(args, stack, url, gpu, report: Report, left, reserve: float) -> dict:
    """Every depth: its reference pass, then each level that fits the budget; returns
    {depth: (prompts, references)} for the stall level."""
    scale, rng = SCALES[args.scale], random.Random(args.seed)
    kept = {}
    for depth in args.depths:
        prompts = [
            bench_prompt(rng, args.prompt_len, scale.vocab_size) for _ in range(args.prompts)
        ]
        refs, ref_summary = reference_pass(url, prompts, depth)
        kept[depth] = (prompts, refs)
        entry = report.doc["load"][str(depth)] = {"reference": ref_summary, "levels": []}
        for clients in args.levels:
            if left() - reserve < args.level_s + 10.0:
                report.doc["skipped"].append(f"depth {depth}, {clients} clients: budget")
                continue
            row = measure_level(stack, gpu, url, prompts, depth, clients, args, refs)
            entry["levels"].append(row)
            report.write()
            print(json.dumps({k: row.get(k) for k in ("depth", "clients", "req_per_s",
                  "tok_per_s", "latency_ms", "n_errors", "gpu_busy_pct")}), flush=True)  # fmt: skip
    return kept


def stall_level(args, paths, device, gpu, kept: dict, left) -> dict:
    """A second stack whose capture compiles on the request path; one level, compared with
    the first stack's references (the same weights, the capture uncompiled)."""
    depth = args.depths[0]
    prompts, refs = kept[depth]
    stack, url, start_s = start_stack(args, paths, device, args.stall_compile, "procs-stall",
                                      lambda: left() - args.level_s - 70.0)  # fmt: skip
    try:
        row = measure_level(stack, gpu, url, prompts, depth, args.stall_clients, args, refs)
    finally:
        stack.stop()
    return dict(row, capture_compile=args.stall_compile, stack_start_s=start_s)


def fairness_level(args, stack, url: str, kept: dict, report: Report, left_s: float) -> None:
    """With --big-clients: small requests alone, then beside maximal ones (load_fairness)."""
    from bench import load_fairness

    depth = args.depths[0]
    if not args.big_clients or depth not in kept:
        return
    if left_s < 30.0:
        report.doc["skipped"].append(f"fairness level: {left_s:.0f} s left")
        return
    prompts, refs = kept[depth]
    report.set("fairness", load_fairness.measure(stack, url, prompts, refs, depth, args))
    f = report.doc["fairness"]
    print(json.dumps({k: f[k] for k in ("big", "p50_ratio", "p99_ratio", "meets_target")}),
          flush=True)  # fmt: skip


def build_models(args, work: Path, device: str, report: Report) -> dict:
    """The base and decoder saved under `work`; nothing kept in this process's memory."""
    from bench.models import build_base_and_decoder, n_params

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    base = build_base_and_decoder(SCALES[args.scale], work, device, seed=args.seed, dtype=dtype)
    setup = dict(base.timings, params=n_params(base.model), work_dir=str(work))
    paths = {"work": str(work), "base": str(base.base_dir), "decoder": str(base.decoder_dir)}
    del base  # the services load the files; the AR decode builds its own
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    report.set("setup", setup)
    return paths


def ratio(doc: dict, clients: int) -> dict:
    """Answer tokens/s of the stack at `clients` over batched AR at batch `clients`, where
    both ran at the same answer length."""
    ar = doc.get("ar", {})
    depth = ar.get("new_tokens")
    batch = ar.get("batches", {}).get(str(clients), {})
    levels = doc.get("load", {}).get(str(depth), {}).get("levels", [])
    level = next((r for r in levels if r["clients"] == clients), None)
    if level is None or "tokens_per_s" not in batch:
        return {}
    return {
        "clients": clients,
        "depth": depth,
        "stack_tok_per_s": level["tok_per_s"],
        "ar_tok_per_s": round(batch["tokens_per_s"], 1),
        "stack_over_ar": round(level["tok_per_s"] / batch["tokens_per_s"], 2),
    }


def quiet() -> None:
    import logging

    import structlog
    from transformers.utils import logging as hf_logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def run(args, device: str, report: Report, work: Path, deadline: float) -> None:
    def left() -> float:
        return deadline - time.perf_counter()

    cuda = device.startswith("cuda")
    reserve = args.ar_reserve_s if args.ar_reserve_s is not None else (150.0 if cuda else 60.0)
    reserve = reserve if args.ar_batches else 0.0
    gpu = load_probes.GpuBusy()
    report.doc["config"]["gpu_busy_sampled"] = gpu.start()
    try:
        paths = build_models(args, work, device, report)
        stack, url, start_s = start_stack(args, paths, device, args.capture_compile, "procs", left)
        report.doc["setup"]["stack_start_s"] = start_s
        try:
            kept = run_depths(args, stack, url, gpu, report, left, reserve)
            fairness_level(args, stack, url, kept, report, left() - reserve)
        finally:
            stack.stop()
        stall_s = args.level_s + 150.0 if args.stall_clients else 0.0
        report.set("ar", batches_in_process(args, device, left() - stall_s - 10.0))
        report.set("ratio", ratio(report.doc, args.ratio_clients))
        if args.stall_clients and left() > stall_s:
            report.set("stall", stall_level(args, paths, device, gpu, kept, left))
        elif args.stall_clients:
            report.doc["skipped"].append(f"stall level: {left():.0f} s left")
    finally:
        gpu.stop()


def main(argv: list[str] | None = None) -> int:
    from bench.e2e_gpu import environment
    from bench.load_report import markdown, plot
    from stateblock.engines import require_engine

    t_start = time.perf_counter()
    args = parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    args.engine = args.engine or ("torch" if device.startswith("cuda") else "reference")
    args.capture_compile = args.capture_compile or default_compile(device)
    args.prompt_len = args.prompt_len or SCALES[args.scale].prompt_len
    require_engine(args.engine)  # fail closed before minutes of model building
    quiet()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="stateblock-load-"))
    config = dict(environment(args, device), stack=args.placement, model_name=MODEL_NAME,
                  mps=mps_daemon_running())  # fmt: skip
    report = Report(args.out / "load.json", {"config": config, "load": {}, "skipped": []})
    try:
        run(args, device, report, work, t_start + args.budget_s)
    finally:
        report.doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        report.write()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    text = markdown(report.doc)
    (args.out / "load.md").write_text(text + "\n")
    plotted = plot(report.doc, args.out / "load.png")
    print(text + ("" if plotted else "\n(no plot: matplotlib is not installed)"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
