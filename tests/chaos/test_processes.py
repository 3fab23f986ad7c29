"""The stack as deployed, one process per service (nats-server, capture, two readout
processes, gateway), under load while its processes are killed, stopped and restarted:
a readout process SIGKILLed and restarted, another SIGSTOPped past its lease and ack_wait
(its block is redelivered to the other; when it wakes its claim is gone), the capture
SIGKILLed and restarted, and nats-server SIGKILLed, down for a while (more than two minutes
at full scale) and restarted on its store. The clients retry only what is safe to retry
(503 "not executed", 504, or no answer) with the same Idempotency-Key, as a careful client
does: the key gives at most one answer, and runs anew a request whose block was rejected.
Small in CI; docs/RELIABILITY.md has the full-scale figures (STATEBLOCK_CHAOS_SCALE=full)."""

from __future__ import annotations

import signal
import time

import pytest

from bench.procs import ProcStack, ProcStackConfig
from stateblock.protocol.keys import TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import REFERENCE_BASE
from tests.chaos.conftest import FULL, report, scale
from tests.chaos.load import Forger, Load, registry_keys, summary
from tests.chaos.test_cluster import PROMPTS, _expected

pytestmark = pytest.mark.chaos
LEASE_S, ACK_WAIT_S = 2.0, 4.0  # short, so a stopped worker's block comes back soon


def _committed(nats_url: str, trust) -> dict[str, int]:
    """Registry entries by what they hold: commits a readout key signed (one per answered
    request, or a request ran twice), and anything else (a forger's, or unfinished)."""
    import asyncio

    import nats

    from registry import DEFAULT_BUCKET
    from stateblock.protocol import outcomes
    from stateblock.v1 import commit_pb2

    async def count() -> dict[str, int]:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            kv = await js.key_value(DEFAULT_BUCKET)
            out = {"signed_commits": 0, "other": 0}
            for key in await registry_keys(js):
                entry = commit_pb2.RegistryEntry.FromString((await kv.get(key)).value)
                try:
                    record = outcomes.outcome_of(entry, trust, key)
                    signed = isinstance(record, commit_pb2.Commit)
                except outcomes.UntrustedOutcome:
                    signed = False
                out["signed_commits" if signed else "other"] += 1
            return out
        finally:
            await nc.close()

    return asyncio.run(count())


def _first_answer_after(outcomes, t: float) -> float | None:
    done = [o.done for o in outcomes if o.status == 200 and o.done > t]
    return round(min(done) - t, 3) if done else None


def test_process_faults_under_load(decoder_dir, serving_model, engine, tmp_path):
    n = scale(60, 1000)
    outage_s = 150.0 if FULL else 5.0
    stack = ProcStack(
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
            ready_timeout_s=180.0,
            extra_env={
                "STATEBLOCK_LEASE_S": str(LEASE_S),
                "STATEBLOCK_ACK_WAIT_S": str(ACK_WAIT_S),
                "STATEBLOCK_RETRY_DELAY_S": "0.2",
            },
        )
    )
    url = stack.start()
    forger = Forger(stack.nats_url).start()  # an untrusted client forging beside the load
    load = Load(url, MODEL, PROMPTS, threads=2, limit=n, retry_for_s=outage_s + 60.0).start()
    faults: dict[str, dict] = {}
    try:
        load.wait_for(n // 6, timeout_s=300)
        t = time.monotonic()
        stack.signal("readout-0", signal.SIGKILL)
        time.sleep(1.0)
        stack.restart("readout-0")
        faults["readout_sigkill"] = {"at": t}

        load.wait_for(2 * n // 6, timeout_s=300)
        t = time.monotonic()
        stack.signal("readout-1", signal.SIGSTOP)
        time.sleep(LEASE_S + ACK_WAIT_S + 1.0)
        stack.signal("readout-1", signal.SIGCONT)
        faults["readout_sigstop"] = {"at": t, "stopped_s": LEASE_S + ACK_WAIT_S + 1.0}

        load.wait_for(3 * n // 6, timeout_s=300)
        t = time.monotonic()
        stack.signal("capture", signal.SIGKILL)
        time.sleep(1.0)
        stack.restart("capture")  # returns once its gRPC port is open again
        faults["capture_sigkill"] = {"at": t, "restarted": time.monotonic()}

        load.wait_for(4 * n // 6, timeout_s=300)
        t = time.monotonic()
        stack.signal("nats", signal.SIGKILL)
        time.sleep(outage_s)
        stack.restart("nats")
        faults["nats_sigkill"] = {"at": t, "outage_s": outage_s, "restarted": time.monotonic()}
        outcomes = load.join()
        forged = forger.stop()
        trust = TrustStore.from_dir(tmp_path / "procs" / "readout-keys")
        registry = _committed(stack.nats_url, trust)
    finally:
        load.stop()  # a no-op once joined; ends the clients when a fault step failed
        forger.stop()
        stack.stop()
    figures = summary(outcomes, _expected(serving_model, engine))
    figures["registry"] = registry
    figures["forged"] = forged
    for name in ("capture_sigkill", "nats_sigkill"):
        faults[name]["first_answer_after_restart_s"] = _first_answer_after(
            outcomes, faults[name]["restarted"]
        )
    start = min(o.sent for o in outcomes)
    figures["faults"] = {
        k: {kk: (round(v - start, 2) if kk in ("at", "restarted") else v) for kk, v in f.items()}
        for k, f in faults.items()
    }
    figures["error_rate"] = round(figures["errors"] / max(1, figures["requests"]), 4)
    report("process_faults", figures)
    assert figures["requests"] == n, figures
    assert figures["wrong"] == 0, figures
    assert figures["errors"] == 0, figures  # every request answered, retries allowed
    assert forged["commits"] > 0 and forged["blocks"] > 0, figures  # the forger was busy
    # none answered twice: at most one signed commit per answered request (a block that
    # expired in the outage ends rejected and its retry runs anew: "other"; so does a
    # forger's write that landed after a genuine commit, the documented limit of
    # signatures that NATS permissions on $KV.STATEBLOCK_REGISTRY.> close)
    assert registry["signed_commits"] <= figures["ok"], figures
