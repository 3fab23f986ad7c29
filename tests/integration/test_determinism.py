"""The determinism gate on the real request path: blocks captured by the embedded stack,
published to JetStream, committed by its readout workers, tapped, re-read and re-run."""

from __future__ import annotations

import json

import nats
import pytest
import structlog
import torch

from registry import Registry
from stateblock.app import determinism as det
from stateblock.app.cli import main
from stateblock.engines import create_engine
from stateblock.model.capture import capture
from stateblock.model.loading import load_base
from stateblock.model.rows import block_rows, rows_to_bytes
from stateblock.protocol import envelope, locator
from stateblock.protocol.keys import TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import REFERENCE_BASE
from stateblock.train import tasks
from stateblock.v1 import block_pb2 as block_pb
from tests.unit.tools.test_audit import perturbed_engine

PROMPTS = [e.prompt for e in tasks.generate(3, split="heldout", seed=5)]
DEPTH = 24


@pytest.fixture
async def nc(stack):
    conn = await nats.connect(stack.urls.nats_admin)
    yield conn
    await conn.close()


@pytest.fixture
def trust(stack) -> TrustStore:
    return TrustStore.from_dir(stack.config.data_dir / "keys")


async def test_committed_blocks_reread_and_resubmitted_pass(stack, nc, trust, serving_model):
    engine = create_engine("reference", serving_model)  # not the workers' instance
    report = await det.determinism_audit(
        nc, engine, trust, grpc_target=stack.urls.grpc, model=MODEL, prompts=PROMPTS, depth=DEPTH
    )
    assert report["gate"] == "PASS", report["blockers"]
    rereads = [c for c in report["checks"] if c["kind"] == "reread"]
    assert len(rereads) == 2 * len(PROMPTS)  # the first round and the resubmission
    assert all(c["outcome"] == "same_output" for c in rereads)
    assert all(c["forward_state_digest"] == c["rerun_forward_state_digest"] for c in rereads)
    resubmits = [c for c in report["checks"] if c["kind"] == "resubmit"]
    assert len(resubmits) == len(PROMPTS) and all(c["block_id"] != c["other"] for c in resubmits)
    assert all(c["outcome"] in det.PASSING for c in resubmits)


async def test_same_rows_read_differently_fail(stack, nc, trust, serving_model):
    # Other decoder weights over byte-identical rows: only the readout can have changed.
    broken = perturbed_engine(serving_model)
    report = await det.determinism_audit(
        nc,
        broken,
        trust,
        grpc_target=stack.urls.grpc,
        model=MODEL,
        prompts=PROMPTS[:2],
        depth=DEPTH,
        resubmit=False,
    )
    assert report["gate"] == "FAIL" and report["counts"] == {"readout_nondeterminism": 2}
    assert len(report["blockers"]) == 2
    for c, blocker in zip(report["checks"], report["blockers"], strict=True):
        assert c["block_id"] in blocker and "same forward-state digest" in blocker


async def test_recaptured_rows_that_change_the_answer_are_upstream(stack, nc, trust, serving_model):
    """A real committed block against a re-capture of its prompt by another base checkpoint
    (final-norm weights changed): rows and answer change together, so the origin is before
    the readout boundary."""
    engine = create_engine("reference", serving_model)
    registry = await Registry.open(nc.jetstream())
    async with det.BlockTap.open(nc) as tap:
        (request_id,) = await det.send_prompts(stack.urls.grpc, MODEL, PROMPTS[:1], DEPTH, 30.0)
        await tap.wait_for([request_id], 10.0)
        block_id = tap.by_request[request_id]
        commit = await det.committed(registry, block_id, 10.0)
        assert (await det.reread(tap, commit, engine, trust)).outcome == "same_output"
        stored = tap.verified(block_id, trust)
    other_base, tok = load_base(REFERENCE_BASE)
    norm = other_base.model.norm.weight
    norm.mul_(1 + 0.5 * torch.randn(norm.shape, generator=torch.Generator().manual_seed(0)))
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    rows = capture(other_base, ids)[0]  # (P, d_base): same prompt, other base weights
    assert rows.shape == block_rows(stored).shape and not torch.equal(rows, block_rows(stored))
    recaptured = envelope.VerifiedBlock(header=stored.header, data=rows_to_bytes(rows))
    rerun = det.rerun_commit(recaptured, engine)
    assert rerun.forward_state_digest != commit.forward_state_digest
    assert rerun.output_digest != commit.output_digest
    assert det.classify(commit, rerun) == det.Outcome.UPSTREAM


def test_cli_embedded_determinism_gate(decoder_dir, tmp_path, capsys):
    out = tmp_path / "determinism.json"
    logging = structlog.get_config()
    try:
        rc = main(
            ["audit", "--determinism", "--decoder", str(decoder_dir), "--n-prompts", "2"]
            + ["--depth", "16", "--device", "cpu", "--json", str(out)]
        )
    finally:
        structlog.configure(**logging)  # the CLI reconfigures logging for its own run
    report = json.loads(out.read_text())
    assert rc == 0 and report["gate"] == "PASS", report["blockers"]
    assert report["counts"] == {"same_output": 6}  # 4 re-reads and 2 resubmissions
    assert report["settings"]["blocks_tapped"] == 4
    assert json.loads(capsys.readouterr().out)["gate"] == "PASS"


async def audit_one_prompt(stack, decoder_dir) -> dict:
    """The audit of a running `stateblock up`: one prompt driven through its gateway."""
    return await det.external_determinism(
        stack.urls.nats_admin,
        base_dir=stack.config.base_dir,
        decoder_dir=decoder_dir,
        engine_name="reference",
        trusted_keys=stack.config.data_dir / "keys",
        grpc_target=stack.urls.grpc,
        prompts=PROMPTS[:1],
        depth=DEPTH,
        resubmit=False,
        listen_s=0.2,
    )


async def test_external_deployment_is_tapped_and_driven(stack, decoder_dir, tmp_path):
    report = await audit_one_prompt(stack, decoder_dir)
    assert report["gate"] == "PASS" and report["counts"] == {"same_output": 1}
    with pytest.raises(ValueError, match="no trusted public keys"):
        await det.external_determinism(
            stack.urls.nats_admin,
            base_dir=stack.config.base_dir,
            decoder_dir=decoder_dir,
            engine_name="reference",
            trusted_keys=tmp_path,  # no *.pub: every signature would fail
            grpc_target=None,
            prompts=[],
            depth=DEPTH,
        )


@pytest.mark.parametrize("plane", ["host", "local"])
async def test_an_audit_reads_host_blocks_and_says_why_not_local_ones(plane, decoder_dir, tmp_path):
    """`host`: the tap copies the rows from the block's shared-memory region as it arrives
    (the worker unlinks it on commit) and the re-read passes. `local`: the rows stay in the
    capture's slot pool, which no other process reads: each block is unavailable, and says
    why, and a gate with nothing re-read fails."""
    from stateblock.app.stack import StackThread, UpConfig

    config = UpConfig(
        data_dir=tmp_path / "stack", http_port=0, grpc_port=0, workers=1,
        decoder_dir=decoder_dir, request_timeout_s=30.0, data_plane=plane,
    )  # fmt: skip
    runner = StackThread(config)
    runner.start()
    try:
        report = await audit_one_prompt(runner, decoder_dir)
    finally:
        runner.stop()
    if plane == "host":
        assert report["gate"] == "PASS" and report["counts"] == {"same_output": 1}, report
    else:
        assert report["gate"] == "FAIL" and report["counts"] == {"unavailable": 1}
        assert "slot pool" in report["checks"][0]["detail"]


@pytest.mark.parametrize(
    "where,says",
    [
        (locator.slot_locator(locator.LOCAL, "a-pool", 0), "slot pool"),
        (locator.ipc_locator("ipc-host", block_pb.CudaIpcRows(pool="a-pool"), 0), "GPU arena"),
    ],
    ids=["local", "ipc"],
)
def test_the_tap_says_why_rows_kept_in_a_capture_are_out_of_its_reach(where, says):
    rows, reason = det.region_rows(block_pb.StateBlockHeader(locator=where))
    assert rows is None and says in reason
