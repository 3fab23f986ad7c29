"""`stateblock audit`: the parity rules on hand-built results, planted divergences and EOS
failures through real engines on the shipped model, and the determinism rule on real
blocks and commits (no NATS here; the service path is in tests/integration)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from readout_svc.records import commit_record
from stateblock.app import determinism as det
from stateblock.app.cli import main
from stateblock.engines import LaneRequest, LaneResult, ReferenceEngine, create_engine
from stateblock.model.checkpoint import load_decoder
from stateblock.model.loading import load_serving_model
from stateblock.model.rows import block_rows, rows_view
from stateblock.model.vocab import NO_EOS
from stateblock.protocol import envelope, layouts
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME
from stateblock.tools import audit
from stateblock.v1 import block_pb2
from stateblock.v1 import commit_pb2 as pb
from tests.helpers import REFERENCE_BASE, REFERENCE_DECODER

EOS = 2
DEPTHS = (16, 64)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(2)
    return load_serving_model(DEFAULT_MODEL_NAME, REFERENCE_BASE, REFERENCE_DECODER)


@pytest.fixture(scope="module")
def reference(model):
    return create_engine("reference", model)


def perturbed_engine(model, scale: float = 20.0, seed: int = 0) -> ReferenceEngine:
    """The reference engine class over decoder weights with noise added to the output
    projection: what a broken export or a wrong kernel would do. (The shipped decoder's
    top-1 margins are about 13 logits: noise of 4 standard deviations flips no token.)"""
    decoder, manifest = load_decoder(
        model.decoder_dir, base_dir=model.base_dir, lm_head=model.lm_head
    )
    gen = torch.Generator().manual_seed(seed)
    w = decoder.out.weight
    w.add_(torch.randn(w.shape, generator=gen) * scale * w.std())
    engine = ReferenceEngine(
        decoder,
        model.lm_head,
        model.identity,
        eos_token_id=manifest["decoder_config"]["eos_token_id"],
    )
    engine.name = "perturbed"
    return engine


class PlantedEngine:
    """The reference answers with one lane per enqueue edited at its most confident
    position, at the chosen depths only: `flip` changes that token, `stop` emits EOS there.
    The audit reads each depth twice (plain lanes, then lanes asking for log-probabilities):
    `read` picks which read is edited ("logprobs" always, for mode `logprob`)."""

    def __init__(
        self, inner: ReferenceEngine, *, mode: str, depths: tuple[int, ...], read: str = "plain"
    ) -> None:
        self.inner, self.mode, self.depths = inner, mode, depths
        self.read = "logprobs" if mode == "logprob" else read
        self.name = f"planted-{mode}"
        self.identity = inner.identity
        self.planted: list[tuple[int, float]] = []  # (position, reference margin)

    def warm_up(self) -> None:
        self.inner.warm_up()

    def readout(self, lanes) -> list[LaneResult]:
        out = self.inner.readout(lanes)
        read = "logprobs" if lanes[0].sampling.HasField("logprobs") else "plain"
        if lanes[0].depth not in self.depths or read != self.read:
            return out
        i = next(i for i, r in enumerate(out) if len(r.token_ids) >= 2)
        r = out[i]
        t = max(range(len(r.token_ids)), key=lambda p: r.margins[p])
        self.planted.append((t, r.margins[t]))
        toks = list(r.token_ids)
        if self.mode == "flip":
            toks[t] = next(v for v in (toks[t] + 1, toks[t] + 2) if v != EOS) % 64
            out[i] = dataclasses.replace(r, token_ids=tuple(toks))
        elif self.mode == "logprob":  # same tokens, one log-probability 0.01 nats off
            top1 = list(r.logprobs.top1)
            top1[t] -= 0.01
            out[i] = dataclasses.replace(
                r, logprobs=dataclasses.replace(r.logprobs, top1=tuple(top1))
            )
        else:
            out[i] = LaneResult(tuple(toks[:t]), t, r.margins[: t + 1])
        return out


def lane(tokens, eos=NO_EOS, margins=None) -> LaneResult:
    n = len(tokens) + (eos != NO_EOS)
    return LaneResult(tuple(tokens), eos, tuple(margins or [1.0] * n))


# -- the rules, on hand-built results ----------------------------------------------------


def test_identical_lanes_and_eos_agreement_on_absence():
    same = audit.compare_lane(0, lane([5, 6, 7]), lane([5, 6, 7]), eos_token_id=EOS)
    assert same.mismatch is None and same.eos == "agree_absent"
    ended = audit.compare_lane(0, lane([5, 6], eos=2), lane([5, 6], eos=2), eos_token_id=EOS)
    assert ended.mismatch is None and ended.eos == "agree"
    section = audit.depth_report([lane([5, 6, 7])] * 2, [lane([5, 6, 7])] * 2, eos_token_id=EOS)
    assert section["eos_parity"] == "agree_absent" and section["eos_absent_both"] == 2
    assert section["eos_ref"] == [NO_EOS, NO_EOS] and section["exact_match"] == 1.0


def test_near_tie_mismatch_passes_but_a_later_confident_one_does_not():
    ref = lane([5, 6, 7, 8], margins=[1.0, 0.01, 1.0, 2.0])
    near = audit.compare_lane(3, ref, lane([5, 9, 7, 8]), eos_token_id=EOS).mismatch
    assert near["class"] == "near_tie" and near["position"] == 1 and near["ref_margin"] == 0.01
    assert (near["prompt"], near["ref_token"], near["engine_token"], near["n_differ"]) == (
        3,
        6,
        9,
        1,
    )
    # not autoregressive: the near-tie at 1 does not excuse the difference at 3
    both = audit.compare_lane(3, ref, lane([5, 9, 7, 1]), eos_token_id=EOS).mismatch
    assert both["class"] == "divergence" and both["position"] == 1
    assert (both["worst_position"], both["worst_ref_margin"], both["n_differ"]) == (3, 2.0, 2)
    report = {"16": audit.depth_report([ref], [lane([5, 9, 7, 1])], eos_token_id=EOS)}
    assert report["16"]["non_near_tie"] == 1
    (blocker,) = audit.blockers(report)
    assert blocker.startswith("depth 16: divergence") and "prompt 0 pos 3" in blocker


def test_eos_rule_excuses_only_a_near_tie_at_the_earlier_eos():
    ref = lane([5, 6, 7], eos=3, margins=[1.0, 1.0, 0.02, 0.03])
    early = lane([5, 6], eos=2)  # stops where the reference margin is 0.02
    c = audit.compare_lane(0, ref, early, eos_token_id=EOS)
    assert c.eos == "near_tie" and c.mismatch["class"] == "near_tie"
    assert (c.mismatch["ref_token"], c.mismatch["engine_token"]) == (7, EOS)
    section = audit.depth_report([ref], [early], eos_token_id=EOS)
    assert section["eos_parity"] == "agree_except_near_ties" and not audit.blockers({"8": section})
    # the engine runs past the reference's EOS, decided at position 3 (margin 0.03): excused
    c = audit.compare_lane(0, ref, lane([5, 6, 7, 9, 9]), eos_token_id=EOS)
    assert c.eos == "near_tie" and c.mismatch["position"] == 3 and c.mismatch["n_differ"] == 2
    confident = lane([5, 6, 7, 8], eos=4, margins=[1.0] * 5)
    c = audit.compare_lane(0, confident, lane([5], eos=1), eos_token_id=EOS)
    assert c.eos == "mismatch"
    section = audit.depth_report([confident], [lane([5], eos=1)], eos_token_id=EOS)
    kinds = [b.split(":")[1].strip() for b in audit.blockers({"8": section})]
    assert kinds == ["divergence", "eos_parity"]


# -- real engines on the shipped model ---------------------------------------------------


def test_reference_against_itself_passes(model, reference):
    report = audit.parity_audit(
        model, create_engine("reference", model), reference, depths=DEPTHS, n_prompts=6
    )
    assert report["gate"] == "PASS" and report["blockers"] == []
    for depth in ("16", "64"):
        d = report["depths"][depth]
        assert d["exact_match"] == 1.0 and d["mismatches"] == [] and d["non_near_tie"] == 0
        assert d["eos_ref"] == d["eos_engine"] and len(d["eos_ref"]) == 6
        assert d["distinct4_ref"] == d["distinct4_engine"] and d["distinct4_delta"] == 0.0
        assert d["logprob_max_abs_error"] == 0.0  # every lane carried log-probabilities
    # real answers end inside 64 positions; at 16 some are cut, and say so with the sentinel
    assert any(e != NO_EOS for e in report["depths"]["64"]["eos_ref"])
    assert report["depths"]["64"]["eos_parity"] in ("agree", "agree_absent")


def test_planted_divergence_fails_the_gate_at_its_depth(model, reference):
    planted = PlantedEngine(reference, mode="flip", depths=(64,))
    report = audit.parity_audit(model, planted, reference, depths=DEPTHS, n_prompts=6, lanes=3)
    assert all(m >= audit.NEAR_TIE for _, m in planted.planted)  # confident, by choice
    assert report["gate"] == "FAIL" and report["depths"]["16"]["mismatches"] == []
    d = report["depths"]["64"]
    assert d["non_near_tie"] == len(planted.planted) == 2  # one per enqueue of 3 lanes
    assert [m["position"] for m in d["mismatches"]] == [t for t, _ in planted.planted]
    assert d["eos_parity"] != "mismatch" and d["exact_match"] == round(4 / 6, 4)
    (blocker,) = report["blockers"]
    assert blocker.startswith("depth 64: divergence: 2 lane(s)")


def test_a_divergence_on_the_logprob_read_alone_fails_the_gate(model, reference):
    """An engine that runs log-probability lanes differently (the torch engine's exact-dot
    graphs) is held to the token gate on that read too."""
    planted = PlantedEngine(reference, mode="flip", depths=(64,), read="logprobs")
    report = audit.parity_audit(model, planted, reference, depths=DEPTHS, n_prompts=6, lanes=3)
    d = report["depths"]["64"]
    assert d["exact_match"] == 1.0 and d["logprob_read"]["non_near_tie"] == 2
    (blocker,) = report["blockers"]
    assert blocker.startswith("depth 64: logprob read: 2 divergent lane(s)")


def test_a_log_probability_off_by_a_hundredth_fails_the_gate(model, reference):
    planted = PlantedEngine(reference, mode="logprob", depths=(64,))
    report = audit.parity_audit(model, planted, reference, depths=DEPTHS, n_prompts=6)
    assert report["depths"]["16"]["logprob_max_abs_error"] == 0.0
    assert report["depths"]["64"]["logprob_max_abs_error"] == pytest.approx(0.01, abs=1e-6)
    assert report["depths"]["64"]["exact_match"] == 1.0  # the tokens all agree
    (blocker,) = report["blockers"]
    assert blocker.startswith("depth 64: logprobs:")


def test_planted_early_eos_fails_eos_parity_at_every_depth(model, reference):
    planted = PlantedEngine(reference, mode="stop", depths=DEPTHS)
    report = audit.parity_audit(model, planted, reference, depths=DEPTHS, n_prompts=6)
    assert report["gate"] == "FAIL"
    for depth in ("16", "64"):
        assert report["depths"][depth]["eos_mismatch"] == 1
        assert report["depths"][depth]["eos_parity"] == "mismatch"
    kinds = sorted(tuple(b.split(":")[:2]) for b in report["blockers"])
    assert kinds == [
        ("depth 16", " divergence"),
        ("depth 16", " eos_parity"),
        ("depth 64", " divergence"),
        ("depth 64", " eos_parity"),
    ]


def test_perturbed_decoder_weights_fail_with_divergences(model, reference):
    report = audit.parity_audit(
        model, perturbed_engine(model), reference, depths=(64,), n_prompts=6
    )
    assert report["gate"] == "FAIL" and report["depths"]["64"]["non_near_tie"] > 0
    assert any(b.startswith("depth 64: divergence") for b in report["blockers"])


class DepthLimitedEngine(PlantedEngine):
    """An engine that cannot serve a depth (say, past its compiled buckets)."""

    def readout(self, lanes) -> list[LaneResult]:
        if lanes[0].depth in self.depths:
            raise RuntimeError(f"no bucket for depth {lanes[0].depth}")
        return self.inner.readout(lanes)


def test_an_engine_failing_at_one_depth_is_a_blocker_not_a_crash(model, reference):
    limited = DepthLimitedEngine(reference, mode="none", depths=(64,))
    report = audit.parity_audit(model, limited, reference, depths=DEPTHS, n_prompts=2)
    assert report["gate"] == "FAIL" and report["depths"]["16"]["exact_match"] == 1.0
    (blocker,) = report["blockers"]
    assert blocker.startswith("depth 64: error") and "no bucket for depth 64" in blocker
    assert "| 64 | 2 | error |" in audit.markdown(report, "x")


def test_cli_writes_json_plot_and_markdown(tmp_path, capsys):
    out = tmp_path / "audit.json"
    args = ["audit", "--engine", "reference", "--depths", "16,32", "--n-prompts", "3"]
    args += ["--device", "cpu", "--json", str(out), "--plot", str(tmp_path / "a.png")]
    assert main([*args, "--markdown", str(tmp_path / "a.md")]) == 0
    report = json.loads(out.read_text())
    assert report["gate"] == "PASS" and list(report["depths"]) == ["16", "32"]
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert "**Gate: PASS**" in (tmp_path / "a.md").read_text()
    capsys.readouterr()
    assert main(["audit", "--engine", "no-such-engine"]) == 2
    assert "unknown readout engine" in capsys.readouterr().err


# -- the determinism rule on real blocks and commits -------------------------------------


def test_classify_is_origin_aware():
    def commit(out: bytes, state: bytes) -> pb.Commit:
        return pb.Commit(output_digest=out * 32, forward_state_digest=state * 32)

    assert det.classify(commit(b"a", b"s"), commit(b"a", b"t")) == det.Outcome.SAME_OUTPUT
    assert det.classify(commit(b"a", b"s"), commit(b"b", b"t")) == det.Outcome.UPSTREAM
    assert (
        det.classify(commit(b"a", b"s"), commit(b"b", b"s")) == det.Outcome.READOUT_NONDETERMINISM
    )
    # digests of two hashes say nothing about the rows: neither a pass nor a readout failure
    sha = commit(b"b", b"t")
    sha.forward_state_algorithm = block_pb2.DIGEST_ALGORITHM_SHA256
    blake = commit(b"a", b"s")
    blake.forward_state_algorithm = block_pb2.DIGEST_ALGORITHM_BLAKE3
    assert det.classify(blake, sha) == det.Outcome.INCOMPARABLE
    assert det.classify(commit(b"a", b"s"), sha) == det.Outcome.UPSTREAM  # unset is SHA-256
    report = det.gate([det.check("resubmit", blake, sha)])
    assert report["gate"] == "FAIL" and "nothing shows" in report["blockers"][0]


def _block(model, prompt: str, signer: Signer, depth: int = 32) -> envelope.VerifiedBlock:
    rows = model.prompt_rows(prompt)
    layout = layouts.make_layout("req-1", [rows.shape[0]], [depth], hidden_size=rows.shape[1],
                             dtype=rows.dtype)  # fmt: skip
    block = envelope.seal_block(
        layout,
        rows_view(rows),
        request_id="req-1",
        identity=model.identity,
        sampling=[block_pb2.SamplingParams()],
        signer=signer,
        ttl_s=60,
    ).message()
    return envelope.verify(block, TrustStore([signer.public_key]))


def test_rerun_of_a_block_drives_all_three_outcomes(model, reference):
    signer = Signer.generate()
    block = _block(model, "copy: determinism", signer)
    original = commit_record(block.header, reference.readout(det.lane_requests(block)), "w0")
    again = det.rerun_commit(block, create_engine("reference", model))
    assert det.classify(original, again) == det.Outcome.SAME_OUTPUT
    assert again.forward_state_digest == original.forward_state_digest
    # the same rows through other weights: only the readout changed -> FAIL
    broken = det.rerun_commit(block, perturbed_engine(model))
    assert broken.output_digest != original.output_digest
    assert det.classify(original, broken) == det.Outcome.READOUT_NONDETERMINISM
    # a re-captured block with other rows: the change is upstream of the readout -> PASS
    # (another task, so any decoder answers it differently)
    other = det.rerun_commit(_block(model, "reverse: determinism", signer), reference)
    assert other.output_digest != original.output_digest
    assert det.classify(original, other) == det.Outcome.UPSTREAM
    checks = [
        det.check("reread", original, again),
        det.check("reread", original, broken),
        det.check("resubmit", original, other, other="b2"),
    ]
    report = det.gate(checks)
    assert report["gate"] == "FAIL" and report["counts"] == {
        "same_output": 1,
        "readout_nondeterminism": 1,
        "upstream": 1,
    }
    (blocker,) = report["blockers"]
    assert block.header.block_id in blocker and "readout_nondeterminism" in blocker
    assert det.gate(checks[::2])["gate"] == "PASS"
    assert det.gate([])["gate"] == "FAIL"  # nothing re-read proves nothing


def test_unseeded_sampling_is_not_expected_to_reproduce():
    header = block_pb2.StateBlockHeader(
        sampling=[block_pb2.SamplingParams(temperature=0.8), block_pb2.SamplingParams()]
    )
    assert not det.reproducible(header)
    header.sampling[0].seed = 7
    assert det.reproducible(header)


def test_lane_requests_follow_the_layout(model):
    block = _block(model, "sort: cab", Signer.generate(), depth=12)
    (req,) = det.lane_requests(block)
    assert isinstance(req, LaneRequest) and req.depth == 12 and req.seed is None
    assert torch.equal(req.rows, block_rows(block))
