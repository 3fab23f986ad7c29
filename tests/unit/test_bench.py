"""CPU dry run of the GPU end-to-end bench: tiny random models, the real stack and nats-server."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PARTITION = ("capture", "ingress_bus_claim", "readout", "commit", "response")


@pytest.mark.slow
def test_e2e_bench_tiny_dry_run(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.e2e_gpu", "--out", str(out), "--work-dir",
           str(tmp_path / "work"), "--scale", "tiny", "--engine", "reference", "--n", "3",
           "--warmup", "1", "--device", "cpu"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "e2e.json").read_text())
    cfg = doc["config"]
    depth, prompt_len = cfg["max_tokens"], cfg["prompt_len"]

    for key in ("build_s", "save_s", "stack_start_s", "params", "base_bytes"):
        assert doc["setup"][key] > 0, key

    e2e = doc["e2e"]
    assert e2e["n_ok"] == 3 and e2e["n_errors"] == 0, e2e["errors"]
    assert e2e["all_full_depth"] and e2e["completion_tokens"] == {"min": depth, "max": depth}
    assert e2e["finish_reasons"] == {"length": 3}
    assert e2e["prompt_tokens"] == [prompt_len]
    for key in ("p50_ms", "p90_ms", "mean_ms"):
        assert e2e["latency"][key] > 0
    for span in (*PARTITION, "gateway", "readout_histogram"):
        assert e2e["breakdown"][span]["p50_ms"] > 0, span
    # the readout starts beside the claim, so it may begin before the claim is stored
    assert math.isfinite(e2e["breakdown"]["claim_to_readout"]["p50_ms"])
    # the spans partition each request's latency, so their means add up to the e2e mean
    total = sum(e2e["breakdown"][span]["mean_ms"] for span in PARTITION)
    assert math.isclose(total, e2e["latency"]["mean_ms"], rel_tol=1e-6)

    # the services' stage histograms, per request: capture's stages make its span (a
    # place for the rows is reserved at once on the bus: no time to speak of there)
    stages = ("tokenize", "forward", "sign", "publish")
    for stage in stages:
        assert e2e["breakdown"][f"capture.{stage}"]["p50_ms"] > 0, stage
    stages += ("reserve",)
    capture = sum(e2e["breakdown"][f"capture.{stage}"]["mean_ms"] for stage in stages)
    # the stages are the capture's span but for the untimed glue between them (a
    # tenth of a millisecond or so, which is over 2 % of a 5 ms tiny capture)
    total = e2e["breakdown"]["capture"]["mean_ms"]
    assert math.isclose(capture, total, rel_tol=0.02, abs_tol=0.5), (capture, total)
    for stage in ("verify", "claim", "readout", "digest", "commit", "ack"):
        assert e2e["breakdown"][f"worker.{stage}"]["p50_ms"] > 0, stage

    eager = doc["ar"]["eager"]
    assert eager["tokens"] == depth and eager["all_counts_exact"]
    assert eager["answer_s"] > 0 and eager["per_token_ms"] > 0
    assert "no CUDA device" in doc["ar"]["compiled"]["skipped"]  # skipped, and says why
    assert any(s.startswith("ar compiled:") for s in doc["skipped"])
    assert doc["ratios"]["ar_eager_answer_over_e2e_p50"] > 0

    for name in ("llama", "nemotron"):
        prefill = doc["prefill"][name]
        assert prefill["median_ms"] > 0 and prefill["rows_finite"], name
    assert "e2e readout vs AR" in proc.stdout


def test_e2e_bench_process_stack_tiny(tmp_path):
    """`--processes`: nats-server and the three services as their own processes (`python -m
    ...` configured by STATEBLOCK_* variables), measured from outside: the client's clock
    and each service's stage histograms, scraped from its /metrics around every request."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.e2e_gpu", "--out", str(out), "--work-dir",
           str(tmp_path / "work"), "--scale", "tiny", "--engine", "reference", "--n", "3",
           "--warmup", "1", "--device", "cpu", "--processes", "--nemotron", "none",
           "--ar-eager-repeats", "0", "--blocks-storage", "memory"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "e2e.json").read_text())
    assert doc["config"]["stack"] == "processes"
    e2e = doc["e2e"]
    assert e2e["n_ok"] == 3 and e2e["n_errors"] == 0, e2e["errors"]
    assert e2e["all_full_depth"]
    stages = ("tokenize", "forward", "reserve", "sign", "publish")
    capture = sum(e2e["breakdown"][f"capture.{s}"]["mean_ms"] for s in stages)
    # the stages are the capture's span but for the untimed glue between them (a
    # tenth of a millisecond or so, which is over 2 % of a 5 ms tiny capture)
    total = e2e["breakdown"]["capture"]["mean_ms"]
    assert math.isclose(capture, total, rel_tol=0.02, abs_tol=0.5), (capture, total)
    for stage in ("verify", "claim", "readout", "digest", "commit", "ack"):
        assert e2e["breakdown"][f"worker.{stage}"]["p50_ms"] > 0, stage
    assert 0 < e2e["breakdown"]["outside"]["p50_ms"] < e2e["latency"]["p50_ms"]
    # the stage stopped what it started: no nats-server is left on this run's store
    store = str(tmp_path / "work" / "procs" / "nats")
    left = [p for p in Path("/proc").glob("[0-9]*") if store in _cmdline(p)]
    assert not left, left


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile, or not ours to read
        return ""


def test_api_fidelity_draws_its_own_prompts_of_every_family():
    """The bench's prompts come from its own draw (not the suite's generator): all nine
    families, every one solvable, reproducible from the seed."""
    from bench.api_fidelity import draw
    from stateblock.train import tasks

    prompts = draw(7)
    assert len(prompts) == 63 and prompts == draw(7) and prompts != draw(8)
    assert {p.split(":")[0] for p in prompts} == set(tasks.FAMILIES)
    assert all(tasks.solve(p) for p in prompts)
    assert any(len(tasks.solve(p)) > 1024 for p in prompts)  # long answers included


def test_ar_decode_process_begins_no_answer_past_its_budget(tmp_path):
    """The e2e bench runs each AR decode as its own process with the time it has left: at
    no budget the child warms up, estimates, and says it skipped rather than run over."""
    out = tmp_path / "ar.json"
    cmd = [sys.executable, "-m", "bench.ar_decode", "--scale", "tiny", "--device", "cpu",
           "--mode", "eager", "--repeats", "2", "--budget-s", "0", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["warmup_s"] > 0 and "answer_s" not in result
    assert "past the time budget" in result["skipped"]


def test_arch_cost_reads_its_arms_and_says_it_needs_a_gpu(tmp_path):
    """The architecture-cost bench takes NAME=JSON arms, refuses malformed ones with the
    reason, and on a machine without CUDA exits 2 saying so rather than time the CPU."""
    import argparse

    from bench.arch_cost import DEFAULT_ARMS, on_reference, parse_arm

    assert parse_arm('deep={"n_ref_mixer": 3}') == ("deep", {"n_ref_mixer": 3})
    # a decoder reading token ids is served by the reference engine alone: it is timed there
    assert on_reference(DEFAULT_ARMS["prose_copy"]) and on_reference({"row_tokens": True})
    assert on_reference(DEFAULT_ARMS["shipped_reference"]) and not on_reference({})
    for bad in ("deep", '={"n_mixer": 3}', "deep=[3]", "deep={"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_arm(bad)
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine times the arms (bench, not a unit test)")
    cmd = [sys.executable, "-m", "bench.arch_cost", "--out", str(tmp_path), "--arm", "s={}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "arch_cost.json").exists()


def service_logs(work: Path) -> dict[str, str]:
    """The last lines of each service's log under `work`: why a stack's requests failed."""
    return {p.name: "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted(work.rglob("*.log"))}  # fmt: skip


@pytest.mark.slow
def test_load_bench_tiny_end_to_end(tmp_path):
    """`stateblock bench load` at the tiny scale on the CPU: the per-service stack under two
    client levels, every answer checked against the same prompt sent alone, the probes of
    where the time goes, and batched AR at two batch sizes with the stack/AR ratio."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "stateblock.app.cli", "bench", "load", "--out", str(out),
           "--work-dir", str(work), "--scale", "tiny", "--device", "cpu", "--levels", "1,2",
           "--depths", "16", "--level-s", "1", "--max-requests", "8", "--prompts", "3",
           "--ar-batches", "2,1", "--ar-new-tokens", "16", "--ar-repeats", "1",
           "--ratio-clients", "2", "--n", "2", "--budget-s", "240"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "load.json").read_text())
    assert doc["config"]["stack"] == "processes" and doc["skipped"] == []
    assert doc["config"]["n"] == 2  # two answers a request: all_full_depth counts 2 x 16
    # unset, the capture's compile is the service's on this device; no MPS daemon here
    assert doc["config"]["capture_compile"] == "off" and doc["config"]["mps"] is False
    assert doc["setup"]["stack_start_s"] > 0

    depth = doc["load"]["16"]
    ref = depth["reference"]
    assert ref["n_ok"] == 3 and ref["n_errors"] == 0, (ref, service_logs(work))
    assert [level["clients"] for level in depth["levels"]] == [1, 2]
    for level in depth["levels"]:
        assert 0 < level["n_ok"] == level["n"] <= 8 and level["errors_by_status"] == {}
        assert level["req_per_s"] > 0 and level["tok_per_s"] > 0 and level["all_full_depth"]
        lat = level["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        # every answer was compared with its prompt's answer alone
        inv = level["invariance"]
        assert inv["checked"] == level["n_ok"] and 0 <= inv["differing"] <= inv["checked"]
        assert set(level["cpu_cores"]) == {"nats", "capture", "readout", "gateway",
                                           "bench-clients"}  # fmt: skip
        assert level["cpu_cores"]["capture"] > 0
        assert level["gpu_busy_pct"] is None  # no nvidia-smi here
        assert level["nats"]["in_bytes_per_s"] > 0 and level["nats"]["out_bytes_per_s"] > 0
        for stage in ("capture.forward", "capture.publish", "worker.readout", "worker.commit"):
            assert level["stages"][stage]["n"] >= level["n_ok"], stage
        assert level["stages"]["capture.cohort_lanes"]["mean_lanes"] >= 1
        assert level["stages"]["worker.cohort_blocks"]["mean_blocks"] >= 1
        assert level["compiled_after_warmup"] == 0  # eager here: nothing compiles

    ar = doc["ar"]
    assert ar["mode"] == "eager" and set(ar["batches"]) == {"1", "2"}
    for batch, result in ar["batches"].items():
        assert result["batch"] == int(batch) and result["tokens"] == 16
        assert result["tokens_per_s"] > 0
    assert doc["ratio"]["clients"] == 2 and doc["ratio"]["stack_over_ar"] > 0
    table = (out / "load.md").read_text()
    assert "| clients | requests | req/s |" in table and "differing / checked" in table
    assert "`n` 2 (a request's answers of its prompt)" in table
    assert 0 < (out / "load.png").stat().st_size < 100_000


@pytest.mark.slow
def test_load_bench_fairness_level_tiny(tmp_path):
    """--big-clients 1: small requests alone, then beside a client sending maximal requests
    (prompt, `n` and max_tokens from the limits the stack runs with, set here by --env);
    every request answered, the ratio of the p99s computed, the tables written."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "stateblock.app.cli", "bench", "load", "--out", str(out),
           "--scale", "tiny", "--device", "cpu", "--levels", "", "--depths", "16",
           "--prompts", "3", "--ar-batches", "", "--big-clients", "1",
           "--fairness-requests", "8", "--env", "STATEBLOCK_PROMPT_LEN_MAX=200",
           "--env", "STATEBLOCK_ANSWER_DEPTH_MAX=160", "--env",
           "STATEBLOCK_CAPTURE_COHORT_TOKENS=1024", "--budget-s", "240"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "load.json").read_text())
    f = doc["fairness"]
    assert f["limits"] == {"prompt_len_max": 200, "max_lanes": 8, "answer_depth_max": 160}
    assert f["big"] == {"prompt_len": 200, "n": 8, "max_tokens": 160}
    assert f["small"] == {"prompt_len": 48, "depth": 16, "requests": 8}
    for phase in ("alone", "beside"):
        row = f[phase]
        assert row["n"] == row["n_ok"] == 8 and row["errors_by_status"] == {}, phase
        assert row["all_full_depth"] and row["invariance"]["checked"] == 8, phase
        lat = row["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"], phase
    assert 0 <= f["beside"]["beside_big"] <= 8
    worst = f["beside"]["slowest"]
    assert len(worst) == 3  # the slowest is the max, each rounded on its own
    assert abs(worst[0]["ms"] - f["beside"]["latency_ms"]["max"]) <= 0.1
    assert all(w["from_big_send_ms"] is not None for w in worst)
    big = f["big_requests"]
    assert big["n"] >= 1 and big["n_ok"] == big["n"] and big["errors_by_status"] == {}
    assert big["all_full_depth"]  # 8 lanes x 160 tokens each
    ratio = f["beside"]["latency_ms"]["p99"] / f["alone"]["latency_ms"]["p99"]
    assert f["p99_ratio"] == round(ratio, 2) and f["target_p99_ratio"] == 2.0
    assert f["meets_target"] == (f["p99_ratio"] <= 2.0)
    assert f["stages_beside"]["capture.forward"]["n"] >= 8 + big["n"]
    alone = f["stages_alone"]
    assert alone["capture.forward"]["n"] >= 8 and alone["worker.readout"]["n"] >= 8
    assert "Alone: " in (out / "load.md").read_text()  # the stages alone beside those beside
    for st in (f["stages_beside"], alone):  # the forward stage's parts, a request each
        assert st["capture.forward_wait"]["n"] == st["capture.forward_run"]["n"] > 0
        assert st["capture.forward_run"]["mean_ms"] <= st["capture.forward"]["mean_ms"]
    assert "waiting for a forward" in (out / "load.md").read_text()
    # by route: the small requests in cohorts, the maximal ones (8 x 256 > 1,024 tokens) in parts
    beside = f["stages_beside"]
    assert beside["capture.forward.cohort"]["n"] >= 8 and beside["capture.forward.parts"]["n"] >= 1
    assert (beside["capture.forward.cohort"]["n"] + beside["capture.forward.parts"]["n"]
            == beside["capture.forward"]["n"])  # fmt: skip
    assert "the small requests (in cohorts): " in (out / "load.md").read_text()
    assert beside["worker.readout.cohort"]["n"] >= 8
    table = (out / "load.md").read_text()
    assert "**Fairness**" in table and "| small, beside 1 big | 8 |" in table
    # every process's event loop watched over both phases (a 10 ms sleep: many wake-ups)
    for phase in ("loop_lag_alone", "loop_lag_beside"):
        assert set(f[phase]) == {"capture0", "readout0", "gateway"}, phase
        assert all(lag["wakeups"] >= 5 for lag in f[phase].values()), f[phase]
    assert "Event loops woken late" in table


def test_the_slowest_small_requests_are_placed_against_the_big_ones():
    """`slowest`: the k longest small requests, each with the signed ms from the nearest big
    request's send and reply to its own send."""
    from bench.load_fairness import slowest
    from bench.load_gpu import Level

    big, small = Level("u", ["p"], 1, 0), Level("u", ["p"], 1, 0)
    big.results = [(0, 10.0, 12.0, "", 1, None), (0, 12.1, 14.0, "", 1, None)]
    small.results = [(0, 11.0, 11.03, "", 1, None), (0, 12.05, 12.15, "", 1, None),
                     (0, 13.9, 13.96, "", 1, None)]  # fmt: skip
    assert slowest(small, big, k=2) == [
        {"ms": 100.0, "from_big_send_ms": -50.0, "from_big_reply_ms": 50.0},
        {"ms": 60.0, "from_big_send_ms": 1800.0, "from_big_reply_ms": -100.0},
    ]
    assert slowest(small, Level("u", ["p"], 1, 0), k=1)[0]["from_big_reply_ms"] is None


def test_loop_stalls_count_the_late_wakeups_between_two_readings():
    """`loop_stalls`: per process, wake-ups over the window, those over 10 and 50 ms late,
    and the bucket bound the latest stayed within."""
    from bench.load_probes import loop_stalls

    inf = float("inf")
    before = {"capture0": {0.005: 10, 0.01: 10, 0.05: 10, inf: 10}}
    after = {
        "capture0": {0.005: 100, 0.01: 105, 0.05: 107, inf: 108},  # 98: 3 over 10, 1 over 50
        "gateway": {0.005: 4, 0.01: 4, 0.05: 4, inf: 4},  # no earlier reading: all counted
        "readout0": {0.005: 0, 0.01: 0, 0.05: 0, inf: 0},  # nothing seen: left out
    }
    assert loop_stalls(before, after) == {
        "capture0": {"wakeups": 98, "over_10ms": 3, "over_50ms": 1, "worst_ms": "inf"},
        "gateway": {"wakeups": 4, "over_10ms": 0, "over_50ms": 0, "worst_ms": 5.0},
    }


def test_load_bench_fairness_shape_defaults_to_the_stack_limits():
    """The maximal request takes the limits the services run with (the defaults, or what
    --env sets), unless an argument says otherwise."""
    from bench.load_fairness import big_shape
    from bench.load_gpu import parse_args

    args = parse_args(["--out", "x", "--big-clients", "1"])
    assert big_shape(args)["limits"] == {"prompt_len_max": 4096, "max_lanes": 8,
                                         "answer_depth_max": 8192}  # fmt: skip
    assert {k: big_shape(args)[k] for k in ("prompt_len", "n", "max_tokens")} == {
        "prompt_len": 4096, "n": 8, "max_tokens": 8192}  # fmt: skip
    args = parse_args(["--out", "x", "--env", "STATEBLOCK_MAX_LANES=4", "--big-max-tokens",
                       "1014", "--env", "STATEBLOCK_PROMPT_LEN_MAX=512"])  # fmt: skip
    shape = big_shape(args)
    assert (shape["prompt_len"], shape["n"], shape["max_tokens"]) == (512, 4, 1014)
    assert shape["limits"]["answer_depth_max"] == 8192


def test_load_bench_counts_answers_that_differ_from_the_prompt_alone():
    """The invariance count: an answer that differs from its prompt's reference is counted;
    a failed request is an error by status, not a differing answer."""
    from bench.load_gpu import Level, summarize

    level = Level("http://127.0.0.1:1", ["p0", "p1"], depth=4, max_requests=0)
    level.results = [
        (0, 0.0, 0.1, "a b c d", 4, None),
        (1, 0.0, 0.2, "x x x x", 4, None),  # p1 alone answered "e f g h"
        (0, 0.1, 0.3, "a b c d", 4, None),
        (1, 0.2, 0.4, None, 0, "504"),
    ]
    row = summarize(level, 2, 0.0, 0.4, {0: "a b c d", 1: "e f g h"})
    assert row["invariance"] == {"checked": 3, "differing": 1, "prompts": [1]}
    assert row["errors_by_status"] == {"504": 1} and row["n_ok"] == 3
    # the steady state: the replies after the first, over the time from the first reply
    assert row["req_per_s"] == 10.0 and row["tok_per_s"] == 40.0


def test_load_bench_balances_over_capture_and_readout_processes(tmp_path):
    """--captures 2 --readout-procs 2: the gateway balances over both captures (round-robin
    over grpc's ipv4: address list), both readout processes take blocks, and the stage
    histograms are summed over the processes (every request counted once)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "stateblock.app.cli", "bench", "load", "--out", str(out),
           "--scale", "tiny", "--device", "cpu", "--levels", "4", "--depths", "16",
           "--level-s", "2", "--max-requests", "16", "--prompts", "2", "--ar-batches", "",
           "--captures", "2", "--readout-procs", "2", "--workers", "1", "--budget-s", "240"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (level,) = json.loads((out / "load.json").read_text())["load"]["16"]["levels"]
    assert 0 < level["n_ok"] == level["n"] <= 16 and level["invariance"]["differing"] == 0
    cores = level["cpu_cores"]
    names = ("capture-0", "capture-1", "readout-0", "readout-1")
    assert set(names) <= set(cores) and min(cores[n] for n in names) > 0
    assert level["stages"]["capture.forward"]["n"] == level["stages"]["worker.readout"]["n"]
    assert level["stages"]["capture.forward"]["n"] >= level["n_ok"]


def test_capture_invariance_bench_on_the_cpu(tmp_path):
    """bench.capture_invariance at the tiny scale: the eager capture gives lane 0 the same
    rows at 1, 2 and 4 lanes (the batch invariance the load bench relies on), and the
    compiled mode is compared the same way."""
    out = tmp_path / "inv.json"
    cmd = [sys.executable, "-m", "bench.capture_invariance", "--scale", "tiny", "--device",
           "cpu", "--modes", "off,aot_eager", "--lanes", "1,2,4", "--width", "32",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"off", "aot_eager"}
    for lanes in ("1", "2", "4"):
        assert modes["off"]["vs_own_lanes_1"][lanes]["identical"]
        assert "identical" in modes["aot_eager"]["vs_eager_alone"][lanes]
    assert modes["aot_eager"]["graphs"] == 2  # one lane is a graph of its own
    proc = subprocess.run([*cmd, "--size-oblivious", "--rope-table"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["size_oblivious"] and report["modes"]["aot_eager"]["graphs"] == 1
    assert report["rope_table"]  # the table keeps a lane's rows the same in any company
    assert all(v["identical"] for v in report["modes"]["aot_eager"]["vs_own_lanes_1"].values())


async def test_regions_bench_frees_every_region_it_wrote(tmp_path):
    from bench.regions_cpu import run

    result = await run(writers=12, limit=4, per_writer=3, read_rate=2000.0, size=64)
    assert result["regions"] == 36 and result["regions_per_s"] > 0
    assert result["left_on_disk"] == 0 and result["held_after"] == 0


def test_unpack_writes_each_packed_file_once_beside_itself(tmp_path):
    import gzip
    import lzma

    from bench.unpack import unpack

    (tmp_path / "corpus").mkdir()
    (tmp_path / "base.part0.safetensors.xz").write_bytes(lzma.compress(b"weights"))
    (tmp_path / "corpus" / "train.txt.gz").write_bytes(gzip.compress(b"One. Two."))
    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / "readout" / "tasks").mkdir(parents=True)
    (tmp_path / "readout" / "tasks" / "heldout.jsonl.gz").write_bytes(gzip.compress(b"{}"))
    (tmp_path / "readout" / "teacher").mkdir()
    (tmp_path / "readout" / "teacher" / "train.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    written = unpack(tmp_path)
    assert sorted(p.name for p in written) == ["base.part0.safetensors", "train.jsonl", "train.txt"]
    assert not (tmp_path / "readout" / "tasks" / "heldout.jsonl").exists()  # read packed
    assert (tmp_path / "base.part0.safetensors").read_bytes() == b"weights"
    assert (tmp_path / "corpus" / "train.txt").read_bytes() == b"One. Two."
    assert unpack(tmp_path) == []  # a second call finds nothing to do


def test_a_profile_is_read_as_threads_and_top_frames(tmp_path):
    """bench.load_probes.top_frames: py-spy's collapsed stacks (`thread;frame;...;leaf N`)
    as shares of every sample, by thread and by (thread, leaf frame)."""
    from bench.load_probes import Profiles, top_frames

    path = tmp_path / "pyspy-capture.txt"
    path.write_text(
        "thread (1): MainThread;run (a.py:1);sign (keys.py:9) 6\n"
        "thread (1): MainThread;run (a.py:1);publish (p.py:3) 2\n"
        "thread (2): capture-fwd_0;forward (m.py:5);linear (l.py:7) 12\n"
        "not a stack line\n"
    )
    got = top_frames(path, n=2)
    assert got["samples"] == 20
    assert got["threads"] == [["thread (2): capture-fwd_0", 0.6], ["thread (1): MainThread", 0.4]]
    assert got["top"] == [
        ["thread (2): capture-fwd_0 :: linear (l.py:7)", 0.6],
        ["thread (1): MainThread :: sign (keys.py:9)", 0.3],
    ]
    profiles = Profiles(tmp_path, {"capture": 1}, 1.0)
    profiles._exe = None  # as where py-spy is not installed: the level is measured as any other
    profiles.start()
    assert profiles.finish() == {"skipped": "py-spy is not on the PATH"}


def test_forward_rate_pins_one_sdpa_kernel_family_and_compiles_it_afresh(tmp_path, monkeypatch):
    """--sdpa-backend lets SDPA use that family alone and points the compile cache at a
    fresh directory (a cached graph would keep the kernel it was traced with); the flags
    are the process's, so they are put back here. --rope-table is recorded."""
    import os

    import torch

    from bench.forward_rate import SDPA_BACKENDS, main

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
              cuda.flash_sdp_enabled(), cuda.math_sdp_enabled())  # fmt: skip
    try:
        main(["--out", str(tmp_path), "--scale", "tiny", "--device", "cpu", "--lanes", "2",
              "--width", "16", "--repeats", "1", "--sdpa-backend", "math",
              "--rope-table"])  # fmt: skip
        now = (cuda.cudnn_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
               cuda.flash_sdp_enabled(), cuda.math_sdp_enabled())  # fmt: skip
        assert now == (False, False, False, True)
        assert "forward-rate-cache-" in os.environ["TORCHINDUCTOR_CACHE_DIR"]
    finally:
        for enable, on in zip(SDPA_BACKENDS.values(), before, strict=True):
            enable(on)
    doc = json.loads((tmp_path / "forward_rate.json").read_text())
    assert doc["config"]["sdpa_backend"] == "math" and doc["forwards"][0]["median_ms"] > 0
    assert doc["config"]["rope_table"] is True


def test_forward_rate_gemm_backends_reach_the_compile(tmp_path):
    """--gemm-backends sets the matmul kernels a max-autotune compile chooses among: on the
    CPU inductor has no Triton template, so `TRITON` alone leaves it no choice, and it says
    so (on a GPU the same flag times the Triton templates with their epilogues fused)."""
    cmd = [sys.executable, "-m", "bench.forward_rate", "--out", str(tmp_path), "--scale", "tiny",
           "--device", "cpu", "--compile", "max-autotune-no-cudagraphs", "--autotune",
           "--gemm-backends", "TRITON", "--lanes", "2", "--width", "16", "--repeats", "1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "NoValidChoicesError" in proc.stderr, proc.stderr[-2000:]
    assert "max_autotune_gemm_backends" in proc.stderr
    assert not (tmp_path / "forward_rate.json").exists()


def test_forward_rate_times_each_lane_count_and_its_share_of_the_peak(tmp_path):
    """The base forward alone at each lane count (tiny scale, CPU), and the rate arithmetic:
    2 x parameters x lanes x width over the forward's time."""
    from bench.forward_rate import main, rates

    main(["--out", str(tmp_path), "--scale", "tiny", "--device", "cpu", "--lanes", "1,4",
          "--width", "32", "--repeats", "2", "--peak-tflops", "100",
          "--profile-lanes", "4", "--gemm-lanes", "2", "--gemm-square", "64"])  # fmt: skip
    doc = json.loads((tmp_path / "forward_rate.json").read_text())
    gemm = doc["gemm"]  # one layer's projections as plain matmuls on 2 x 32 tokens
    assert gemm["tokens"] == 64 and gemm["square"] == 64 and gemm["square_tflops"] > 0
    names = [g["name"] for g in gemm["shapes"]]
    assert len(names) == 7 and any(n.endswith("q_proj") for n in names)
    flop = sum(2 * 64 * g["k"] * g["n"] for g in gemm["shapes"])
    seconds = sum(g["ms"] for g in gemm["shapes"]) / 1e3
    assert gemm["layer_tflops"] == pytest.approx(flop / seconds / 1e12, rel=0.05)
    prof = doc["profile"]  # the CPU's operators stand in for a GPU's kernels
    assert (prof["lanes"], prof["width"]) == (4, 32) and prof["kinds"]["matmul"]["ms"] > 0
    assert sum(k["ms"] for k in prof["kinds"].values()) == pytest.approx(prof["total_ms"], abs=0.01)
    assert [(r["lanes"], r["tokens"]) for r in doc["forwards"]] == [(1, 32), (4, 128)]
    vocab, hidden = 2048, 64  # the tiny scale's: its embedding and head are not matmuls
    assert doc["config"]["params"] == 336_192 - 2 * vocab * hidden
    assert all(r["median_ms"] > 0 and r["tflops"] > 0 for r in doc["forwards"])
    assert "| 4 | 32 |" in (tmp_path / "forward_rate.md").read_text()
    assert all(r["of_gemm"] > 0 for r in doc["forwards"])
    (row,) = rates([{"lanes": 30, "padded_width": 512, "median_ms": 200.0}], 2_901_300_864, 755.0)
    # to four significant figures (three for the share): a tiny rate keeps its digits
    assert row["tflops"] == pytest.approx(2 * 2_901_300_864 * 15_360 / 0.2 / 1e12, rel=1e-4)
    assert row["tflops"] == 445.6 and row["of_peak"] == 0.59
    (tiny,) = rates([{"lanes": 1, "padded_width": 32, "median_ms": 900.0}], 74_048, None)
    assert tiny["tflops"] == pytest.approx(2 * 74_048 * 32 / 0.9 / 1e12, rel=1e-3)
    assert tiny["tflops"] > 0  # 5.3e-6: three decimals would have made it 0


def test_a_profiled_forward_splits_its_kernels_by_kind():
    from bench.forward_rate import kernel_kind, split_by_kind

    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert kernel_kind("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNN") == "matmul"
    assert kernel_kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == (
        "attention"
    )
    assert kernel_kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "fused (triton)"
    assert kernel_kind("void at::native::elementwise_kernel<128, 4>") == "other"
    split = split_by_kind([("gemm_a", 3000.0), ("flash_fwd", 500.0), ("triton_poi", 1500.0),
                           ("gemm_b", 5000.0)], top=2)  # fmt: skip
    assert split["total_ms"] == 10.0
    assert split["kinds"]["matmul"] == {"ms": 8.0, "share": 0.8}
    assert list(split["kinds"]) == ["matmul", "fused (triton)", "attention"]
    assert [k["name"] for k in split["longest"]] == ["gemm_b", "gemm_a"]


def test_an_mps_daemon_is_seen_by_its_control_pipe(tmp_path, monkeypatch):
    from bench.machine import mps_daemon_running

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_daemon_running()
    (tmp_path / "control").touch()  # the daemon's named pipe, as `-d` leaves it
    assert mps_daemon_running()


def test_the_captures_allocator_events_over_a_level_are_reported():
    """bench.load_probes.stages: the capture's CUDA allocator counters (scraped with their
    `event` label) become the level's deltas, and the report says them."""
    from bench.load_probes import ALLOCATOR, stages
    from bench.load_report import saturation

    name = ALLOCATOR + "_total"
    before = {(name, "retry"): 2.0, (name, "device_sync"): 5.0}
    after = {(name, "retry"): 3.0, (name, "device_sync"): 9.0, (name, "oom"): 0.0}
    got = stages(before, after, wall=1.0)
    assert got == {"capture.allocator": {"retry": 1, "device_sync": 4, "oom": 0}}
    row = {"clients": 4, "req_per_s": 1.0, "gpu_busy_pct": None, "cpu_cores": {}, "nats": {},
           "stages": got}  # fmt: skip
    assert "4 device_sync, 0 oom, 1 retry" in "\n".join(saturation(row))


def test_chunk_cost_times_a_lane_whole_and_in_chunks(tmp_path):
    """`bench.chunk_cost` on the tiny scale: a chunk's launch and finish times each step, the
    lane's total, and rows that match the whole forward's."""
    from bench import chunk_cost

    argv = ["--out", str(tmp_path), "--scale", "tiny", "--prompt-len", "40", "--chunks",
            "16,40", "--repeats", "1", "--device", "cpu"]  # fmt: skip
    assert chunk_cost.main(argv) == 0
    doc = json.loads((tmp_path / "chunk_cost.json").read_text())
    assert doc["whole"]["ms"] > 0
    three, one = doc["chunked"]
    assert (three["steps"], one["steps"]) == (3, 1)  # 16 + 16 + 8 positions; one of 40
    for c in (three, one):
        assert len(c["launch_ms"]) == len(c["done_ms"]) == c["steps"]
        assert all(0 < a <= d for a, d in zip(c["launch_ms"], c["done_ms"], strict=True))
        assert c["rows_mean_abs_diff"] < 1e-4
