"""Every fault of issue 39 in one run, on the stack as deployed (one process per service,
bench/procs.py): under a mixed load (tests/chaos/mixed.py: short, long, deep, bursts of one
key, clients that disconnect) the registry is poisoned (garbage bytes and forged claims,
before a claim and over a live one), commits and rejections are forged and blocks tampered
and duplicated, payload objects are deleted before their block is read, readout workers are
SIGKILLed or SIGSTOPped the moment they claim a deep block (mid-readout: the registry says
when), and nats-server and the capture are SIGKILLed and started again at once, as
`stateblock up`'s supervisor does. The figures come from the clients and from the registry:
lease takeovers and lost-claim commits are counted, not assumed. Small in CI; the 1,000-request
run of docs/RELIABILITY.md is STATEBLOCK_CHAOS_SCALE=full."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from bench.procs import ProcStack, ProcStackConfig
from stateblock.protocol.keys import TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import REFERENCE_BASE
from tests.chaos.conftest import report, scale
from tests.chaos.faults import ClaimSniper, PayloadDeleter, Poisoner
from tests.chaos.load import Forger
from tests.chaos.mixed import (
    DEEP,
    DEEP_TOKENS,
    LONG,
    SHORT,
    MixedLoad,
    client_figures,
    registry_figures,
)
from tests.integration.test_request_path import in_process_answer

pytestmark = pytest.mark.chaos
LEASE_S, ACK_WAIT_S = 2.0, 4.0
RECOVERY_S = 5.0  # issue 39: requests succeed again this soon after nats-server is killed
METRICS = ("stateblock_claims_lost", "stateblock_registry_untrusted_entries",
           "stateblock_duplicate_deliveries_dropped", "stateblock_blocks_rejected")  # fmt: skip


def expected_texts(serving_model, engine):
    def text(prompt: str, depth: int) -> str:
        ids = in_process_answer(serving_model, engine, prompt, depth)
        return serving_model.tokenizer.decode(ids, skip_special_tokens=True)

    known = {(p, 8): text(p, 8) for p in [*SHORT, LONG]} | {
        (DEEP, DEEP_TOKENS): text(DEEP, DEEP_TOKENS)
    }

    def expected(body: dict) -> list[str]:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        return [known[(p, body["max_tokens"])] for p in prompts]

    return expected


def _stack(tmp_path, decoder_dir) -> ProcStack:
    return ProcStack(
        ProcStackConfig(
            data_dir=tmp_path / "procs",
            model_name=MODEL,
            base_dir=REFERENCE_BASE,
            decoder_dir=decoder_dir,
            device="cpu",
            capture_dtype="float32",
            engine="reference",
            workers=1,
            readout_procs=2,
            nats_max_payload=1 << 20,  # a long prompt's rows go to the object store
            ready_timeout_s=180.0,
            extra_env={
                "STATEBLOCK_LEASE_S": str(LEASE_S),
                "STATEBLOCK_ACK_WAIT_S": str(ACK_WAIT_S),
                "STATEBLOCK_RETRY_DELAY_S": "0.2",
            },
        )
    )


def _kill_and_restart(stack: ProcStack, name: str, lock: threading.Lock) -> tuple[float, float]:
    """(killed, back): the service started again at once, as `stateblock up` does its
    nats-server, and `back` once its port (nats) or gRPC health (capture) answers."""
    with lock:  # never while the sniper restarts a readout process
        t = time.monotonic()
        stack.signal(name, signal.SIGKILL)
        stack.restart(name)
    return t, time.monotonic()


def test_mixed_faults_under_load(decoder_dir, serving_model, engine, tmp_path):
    n, nats_kills = scale(70, 1000), scale(1, 3)
    shots = scale(1, 6)  # of each: SIGKILL readout-0, SIGSTOP readout-1, mid-readout
    expected = expected_texts(serving_model, engine)
    probe_text = expected({"prompt": SHORT[0], "max_tokens": 8})[0]
    stack = _stack(tmp_path, decoder_dir)
    url = stack.start()
    lock = threading.Lock()
    aims = [("readout-0", signal.SIGKILL), ("readout-1", signal.SIGSTOP)] * shots
    sniper = ClaimSniper(stack.nats_url, aims, depth=DEEP_TOKENS, send=stack.signal,
                         restart=stack.restart, lock=lock, hold_s=LEASE_S + ACK_WAIT_S + 1.0,
                         every_s=scale(3.0, 10.0))  # fmt: skip
    injectors = {
        "forger": Forger(stack.nats_url, every=5),
        "poisoner": Poisoner(stack.nats_url, every=4),
        "payloads": PayloadDeleter(stack.nats_url, every=2),
        "sniper": sniper,
    }
    for injector in injectors.values():
        injector.start()
    load = MixedLoad(url, MODEL, limit=n, threads=2).start()
    t_start = time.monotonic()
    try:
        kills, probed = _kills_under_load(stack, load, lock, nats_kills, probe_text)
        answers = load.join()
        done = {k: v.stop() for k, v in injectors.items()}
        metrics = stack.scrape(METRICS)
        trust = TrustStore.from_dir(tmp_path / "procs" / "readout-keys")
        registry = registry_figures(stack.nats_url, trust, sniper.shots)
    finally:
        for injector in injectors.values():
            injector.stop()
        stack.stop()
    forged_text = serving_model.tokenizer.decode([7, 7, 7], skip_special_tokens=True)
    figures = client_figures(answers, expected, forged_text)
    figures["duration_s"] = round(time.monotonic() - t_start, 1)
    figures["faults"] = done | {k: len(v) for k, v in kills.items()}
    figures |= _recovery_figures(answers, kills, probed)
    figures["registry"] = {k: v for k, v in registry.items() if k != "shots"}
    # a shot landed mid-readout when the block's commit came under a takeover (attempt > 1):
    # by the other process, or by the killed one restarted (the same worker id)
    figures["shots"] = [
        {k: v for k, v in s.items() if k != "at"} | {"taken_over": s["attempt"] > 1}
        for s in registry["shots"]
    ]
    figures["metrics"] = {k[0]: v for k, v in metrics.items()}
    probes = sum(a is not None for answered in probed.values() for a in answered)
    answered = figures["requests"] - figures["lost"] + probes
    figures["double_committed"] = registry["committed_blocks"] - answered
    report("mixed_faults", figures)
    assert figures["requests"] == n, figures
    assert figures["wrong"] == 0 and figures["forged_served"] == 0, figures
    assert figures["lost"] == 0 and figures["bursts_split"] == 0, figures
    assert figures["non_503_failures"] == 0, figures
    assert figures["executed_503"] == 0, figures
    assert figures["clean_503"] <= max(1, n // 100), figures
    assert registry["commits_in_one_key"] <= 1, figures
    # one committed block per answered request: none lost, none read out twice
    assert figures["double_committed"] == 0, figures
    recovery = figures["recovery_s"]
    assert all(r is not None and r <= RECOVERY_S for r in recovery["nats"]), recovery
    # the sniper's faults landed mid-readout: another worker took the lease over and committed
    assert sum(s["taken_over"] for s in figures["shots"]) >= 1, figures
    assert figures["faults"]["payloads"]["deleted"] >= 1, figures
    assert figures["faults"]["poisoner"]["garbage_before_claim"] >= 1, figures


Kills = dict[str, list[tuple[float, float]]]  # service -> (killed, back) for each kill
Probed = dict[str, list[float | None]]  # service -> when each kill's probe was answered


def _kills_under_load(stack: ProcStack, load: MixedLoad, lock: threading.Lock,
                      nats_kills: int, probe_text: str) -> tuple[Kills, Probed]:  # fmt: skip
    """nats-server SIGKILLed `nats_kills` times and the capture once, spread over the load,
    each started again at once and probed with a request of its own once it is back."""
    kills: Kills = {"nats": [], "capture": []}
    probed: Probed = {"nats": [], "capture": []}
    steps = [("nats", (i + 1) / (nats_kills + 2)) for i in range(nats_kills)]
    steps.insert(len(steps) // 2 + 1, ("capture", (nats_kills + 1) / (nats_kills + 2) - 0.05))
    for name, at in sorted(steps, key=lambda s: s[1]):
        load.wait_for(int(load.limit * at), timeout_s=600)
        kills[name].append(_kill_and_restart(stack, name, lock))
        key = f"probe-{name}-{len(kills[name])}"
        probed[name].append(load.probe(key, probe_text))
    return kills, probed


def _recovery_figures(answers, kills: Kills, probed: Probed) -> dict:
    """recovery_s: seconds from each kill until a request sent once the service was back
    was answered (requests succeed again); first_load_answer_s: until the load's first
    answer after it, reported only (the load's clients may be held by other faults)."""
    return {
        "recovery_s": {
            name: [
                None if a is None else round(a - t[0], 3)
                for t, a in zip(ts, probed[name], strict=True)
            ]  # fmt: skip
            for name, ts in kills.items()
        },
        "first_load_answer_s": {
            name: [_first_answer_after(answers, *t) for t in ts] for name, ts in kills.items()
        },
    }


def _first_answer_after(answers, killed: float, back: float) -> float | None:
    """Seconds from a kill to the first answer given once the service is back (an answer
    in between may have needed nothing of it)."""
    done = [a.done for a in answers if a.status == 200 and a.done >= back]
    return round(min(done) - killed, 3) if done else None
