"""StateBlock envelope: round trip, every tamper rejected with its reason, key handling."""

from __future__ import annotations

import hashlib
import os
import stat

import blake3
import pytest
import torch

from stateblock.model.rows import (
    block_lanes,
    block_rows,
    check_rows,
    rows_from_bytes,
    rows_to_bytes,
    rows_view,
)
from stateblock.protocol import envelope, layouts
from stateblock.protocol.envelope import BlockRejected, RejectReason
from stateblock.protocol.keys import (
    Signer,
    TrustStore,
    generate_keypair,
    key_id,
    load_or_generate_signer,
)
from stateblock.protocol.layouts import LayoutError
from stateblock.v1 import block_pb2 as pb

NOW = 1_800_000_000.0
IDENTITY = envelope.ModelIdentity("tiny", b"\x01" * 32, b"\x02" * 32, b"\x03" * 32)


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer.generate()


@pytest.fixture(scope="module")
def trust(signer: Signer) -> TrustStore:
    return TrustStore([signer.public_key])


def lanes_of(dtype=torch.float32, counts=(3, 5)) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(c, 4).to(dtype) for c in counts]


def seal(
    signer: Signer, dtype=torch.float32, counts=(3, 5), depths=(8, 16), **kw
) -> envelope.SealedBlock:
    layout = layouts.make_layout("req-1", counts, depths, hidden_size=4, dtype=dtype)
    return envelope.seal_block(
        layout,
        rows_view(torch.cat(lanes_of(dtype, counts))),
        request_id="req-1",
        identity=IDENTITY,
        sampling=[pb.SamplingParams(temperature=0.0) for _ in depths],
        signer=signer,
        ttl_s=30,
        now=NOW,
        **kw,
    )


def make_block(signer: Signer, dtype=torch.float32, counts=(3, 5), depths=(8, 16)):
    """The block as a protobuf message, and its lanes' rows."""
    return seal(signer, dtype, counts, depths).message(), lanes_of(dtype, counts)


def resign(block: pb.StateBlock, signer: Signer) -> None:
    envelope.sign_header(block.header, signer)


def reject_reason(block: pb.StateBlock, trust: TrustStore, now: float = NOW + 1, **kw) -> str:
    with pytest.raises(BlockRejected) as info:
        envelope.verify(block, trust, now, **kw)
    return info.value.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_through_bytes(signer, trust, dtype):
    block, lanes = make_block(signer, dtype)
    parsed = envelope.parse_block(envelope.serialize_block(block))
    verified = envelope.verify(parsed, trust, NOW + 1)
    assert block_rows(verified).dtype == dtype
    for got, want in zip(block_lanes(verified), lanes, strict=True):
        assert torch.equal(got, want)
    h = verified.header
    assert h.layout.total_rows == 8 and [lane.row_offset for lane in h.layout.lanes] == [0, 3]
    assert h.key_id == signer.key_id and h.block_id and h.model == "tiny"
    assert h.forward_state_digest == envelope.forward_state_digest(rows_to_bytes(torch.cat(lanes)))
    assert h.expires_at.ToSeconds() == NOW + 30


def test_forward_state_digest_is_blake3_by_default_and_names_its_hash(signer, trust):
    block, lanes = make_block(signer)
    data = rows_to_bytes(torch.cat(lanes))
    assert block.header.forward_state_algorithm == pb.DIGEST_ALGORITHM_BLAKE3
    assert block.header.forward_state_digest == blake3.blake3(data).digest()
    # the same rows sealed as SHA-256 verify too, and their digest is SHA-256's
    sha = seal(signer, digest_algorithm=pb.DIGEST_ALGORITHM_SHA256).message()
    assert sha.header.forward_state_digest == hashlib.sha256(data).digest()
    assert envelope.verify(sha, trust, NOW + 1).header.forward_state_algorithm == (
        pb.DIGEST_ALGORITHM_SHA256
    )
    # BLAKE3 over a large input spreads over cores; the digest is the one-core one
    big = os.urandom(3 << 20)
    assert envelope.forward_state_digest(big) == blake3.blake3(big).digest()
    assert envelope.forward_state_algorithm(" SHA256 ") == pb.DIGEST_ALGORITHM_SHA256
    with pytest.raises(ValueError, match="not one of: blake3, sha256"):
        envelope.forward_state_algorithm("md5")


def test_a_header_without_the_algorithm_is_sha256(signer, trust):
    # headers from before the field: UNSPECIFIED reads as SHA-256
    block = seal(signer, digest_algorithm=pb.DIGEST_ALGORITHM_SHA256).message()
    block.header.ClearField("forward_state_algorithm")
    resign(block, signer)
    assert envelope.verify(block, trust, NOW + 1).header.forward_state_algorithm == 0
    # a BLAKE3 digest under no algorithm is a SHA-256 mismatch, not accepted
    b3 = seal(signer).message()
    b3.header.ClearField("forward_state_algorithm")
    resign(b3, signer)
    assert reject_reason(b3, trust) == RejectReason.FORWARD_STATE_DIGEST


def test_the_algorithm_is_signed_and_an_unknown_one_is_malformed(signer, trust):
    block, _ = make_block(signer)
    block.header.forward_state_algorithm = pb.DIGEST_ALGORITHM_SHA256
    assert reject_reason(block, trust) == RejectReason.BAD_SIGNATURE
    block.header.forward_state_algorithm = 7  # a value this build does not know
    resign(block, signer)
    with pytest.raises(BlockRejected, match="unknown forward_state_algorithm 7") as info:
        envelope.verify(block, trust, NOW + 1)
    assert info.value.reason == RejectReason.MALFORMED


def test_serialisation_is_deterministic(signer):
    block, _ = make_block(signer)
    again = envelope.parse_block(envelope.serialize_block(block))
    assert envelope.serialize_block(again) == envelope.serialize_block(block)
    assert layouts.layout_digest(again.header.layout) == block.header.layout_digest


def test_flipped_payload_byte(signer, trust):
    block, _ = make_block(signer)
    data = bytearray(block.payload.inline_rows)
    data[5] ^= 0x01
    block.payload.inline_rows = bytes(data)
    assert reject_reason(block, trust) == RejectReason.FORWARD_STATE_DIGEST


def rename_request(h: pb.StateBlockHeader) -> None:
    h.request_id = "req-2"
    for lane in h.layout.lanes:
        lane.request_id = "req-2"


@pytest.mark.parametrize(
    "tamper",
    [
        lambda h: setattr(h, "model", "other"),
        rename_request,
        lambda h: h.sampling[0].__setattr__("temperature", 1.0),
        lambda h: h.expires_at.FromSeconds(int(NOW) + 3600),
        lambda h: setattr(h, "decoder_digest", b"\x09" * 32),
        lambda h: setattr(h, "forward_state_digest", b"\x00" * 32),
    ],
    ids=["model", "request_id", "sampling", "expires_at", "decoder", "forward_state_digest"],
)
def test_changed_header_field(signer, trust, tamper):
    block, _ = make_block(signer)
    envelope.verify(block, trust, NOW + 1)
    tamper(block.header)
    assert reject_reason(block, trust) == RejectReason.BAD_SIGNATURE


def test_changed_layout_without_resigning_is_bad_signature(signer, trust):
    block, _ = make_block(signer)
    block.header.layout.lanes[0].answer_depth = 4096
    assert reject_reason(block, trust) == RejectReason.BAD_SIGNATURE


def test_layout_digest_mismatch_under_a_valid_signature(signer, trust):
    # A trusted signer that changed the layout after digesting it (a capture bug).
    block, _ = make_block(signer)
    block.header.layout.lanes[1].answer_depth = 4096
    resign(block, signer)
    assert reject_reason(block, trust) == RejectReason.LAYOUT_DIGEST


def test_unknown_key(signer):
    block, _ = make_block(signer)
    assert reject_reason(block, TrustStore()) == RejectReason.UNKNOWN_KEY
    other = Signer.generate()
    resign(block, other)  # validly signed, by a key nobody trusts
    assert reject_reason(block, TrustStore([signer.public_key])) == RejectReason.UNKNOWN_KEY


def test_key_id_swapped_to_a_trusted_key(signer, trust):
    block, _ = make_block(Signer.generate())
    block.header.key_id = signer.key_id  # claims the trusted key, signed by another
    assert reject_reason(block, trust) == RejectReason.BAD_SIGNATURE


def test_expired(signer, trust):
    block, _ = make_block(signer)
    envelope.verify(block, trust, NOW + 29.9)
    assert reject_reason(block, trust, now=NOW + 30) == RejectReason.EXPIRED


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.ClearField("header"),
        lambda b: b.ClearField("payload"),
        lambda b: b.header.layout.lanes[0].__setattr__("request_id", "someone-else"),
        lambda b: b.header.layout.__setattr__("total_rows", 9),
        lambda b: b.header.layout.lanes[1].__setattr__("row_offset", 2),
        lambda b: b.header.sampling.pop(),
        lambda b: b.header.__setattr__("layout_digest", b"short"),
    ],
    ids=["no-header", "no-payload", "foreign-lane", "total-rows", "offset", "sampling", "digest"],
)
def test_malformed(signer, trust, mutate):
    block, _ = make_block(signer)
    mutate(block)
    assert reject_reason(block, trust) == RejectReason.MALFORMED


def test_unparseable_bytes_are_malformed():
    with pytest.raises(BlockRejected) as info:
        envelope.parse_block(b"\xff\xff\xff")
    assert info.value.reason == RejectReason.MALFORMED


def test_payload_size_that_disagrees_with_a_signed_layout(signer, trust):
    block, _ = make_block(signer)
    block.payload.inline_rows = block.payload.inline_rows[:-4]
    block.header.forward_state_digest = envelope.forward_state_digest(block.payload.inline_rows)
    resign(block, signer)
    assert reject_reason(block, trust) == RejectReason.MALFORMED


def test_layout_invariants():
    layout = layouts.make_layout("r", [2, 3, 4], [1, 1, 1], hidden_size=8, dtype=torch.float16)
    assert layout.total_rows == 9 == sum(lane.row_count for lane in layout.lanes)
    assert [lane.row_offset for lane in layout.lanes] == [0, 2, 5]
    layout.total_rows = 10
    with pytest.raises(LayoutError, match="total_rows"):
        layouts.check_layout(layout)
    with pytest.raises(LayoutError):
        layouts.make_layout("r", [2, 0], [1, 1], hidden_size=8, dtype=torch.float32)
    with pytest.raises(LayoutError):
        layouts.make_layout("r", [2], [1], hidden_size=8, dtype=torch.int64)


def test_a_layout_carries_its_prompts_ids_signed_and_checked(signer, trust):
    """Lane.prompt_token_ids (a decoder that reads the prompt's ids): one a row, on every
    lane or none, in the layout's digest, and handed to the engine with the rows."""
    from stateblock.engines.base import lane_requests

    plain = layouts.make_layout("r", [2, 3], [4, 4], hidden_size=8, dtype=torch.float32)
    ids = [[5, 6], [7, 8, 9]]
    layout = layouts.make_layout("r", [2, 3], [4, 4], hidden_size=8, dtype=torch.float32,
                                 prompt_ids=ids)  # fmt: skip
    assert [list(lane.prompt_token_ids) for lane in layout.lanes] == ids
    assert layouts.layout_digest(layout) != layouts.layout_digest(plain)
    short = pb.Layout()
    short.CopyFrom(layout)
    del short.lanes[1].prompt_token_ids[-1]
    with pytest.raises(LayoutError, match="2 prompt ids for 3 rows"):
        layouts.check_layout(short)
    del short.lanes[1].prompt_token_ids[:]
    with pytest.raises(LayoutError, match="carrying its prompt ids"):
        layouts.check_layout(short)
    with pytest.raises(LayoutError, match="prompts' ids"):
        layouts.make_layout("r", [2, 3], [4, 4], hidden_size=8, dtype=torch.float32,
                            prompt_ids=ids[:1])  # fmt: skip
    rows = [torch.randn(2, 8), torch.randn(3, 8)]

    def verified(lay: pb.Layout):
        sealed = envelope.seal_block(lay, rows_view(torch.cat(rows)), request_id="r",
                                     identity=IDENTITY, signer=signer, ttl_s=30, now=NOW,
                                     sampling=[pb.SamplingParams() for _ in rows])  # fmt: skip
        wire = envelope.serialize_block(sealed.message())
        return envelope.verify(envelope.parse_block(wire), trust, NOW + 1)

    got = lane_requests(verified(layout))
    assert [r.prompt_ids.tolist() for r in got] == ids
    assert all(torch.equal(r.rows, w) for r, w in zip(got, rows, strict=True))
    assert all(r.prompt_ids is None for r in lane_requests(verified(plain)))


def test_build_rejects_rows_that_do_not_match_the_layout(signer):
    layout = layouts.make_layout("r", [2, 3], [4, 4], hidden_size=4, dtype=torch.float32)
    sampling = [pb.SamplingParams(), pb.SamplingParams()]
    common = dict(request_id="r", identity=IDENTITY, sampling=sampling, signer=signer, ttl_s=1)
    with pytest.raises(LayoutError, match="payload has 96 bytes, layout needs 80"):
        envelope.seal_block(layout, rows_view(torch.zeros(6, 4)), **common)
    with pytest.raises(LayoutError, match="do not match"):
        check_rows(torch.zeros(6, 4), layout)
    with pytest.raises(LayoutError, match="payload has 40 bytes"):  # float16 rows, float32 layout
        envelope.seal_block(layout, rows_view(torch.zeros(5, 4, dtype=torch.float16)), **common)
    with pytest.raises(LayoutError, match="are torch.float16"):  # caught before sealing
        check_rows(torch.zeros(5, 4, dtype=torch.float16), layout)
    with pytest.raises(LayoutError, match="belongs"):
        envelope.seal_block(
            layout, rows_view(torch.zeros(5, 4)), **{**common, "request_id": "other"}
        )


def test_object_payload(signer, trust):
    sealed = seal(signer)
    data = envelope.parse_block(sealed.object_wire("STATEBLOCK_PAYLOADS", sealed.header.block_id))
    assert data.header == sealed.header and not data.payload.HasField("inline_rows")
    ref = data.payload.object_ref
    assert ref.name == sealed.header.block_id and ref.size == len(sealed.rows)
    assert ref.digest == blake3.blake3(sealed.rows).digest()  # the forward-state digest
    rows = sealed.rows.tobytes()
    verified = envelope.verify(data, trust, NOW + 1, payload=rows)
    assert torch.equal(block_rows(verified), rows_from_bytes(rows, sealed.header.layout))
    corrupted = bytearray(rows)
    corrupted[0] ^= 0xFF
    got = reject_reason(data, trust, payload=bytes(corrupted))
    assert got == RejectReason.FORWARD_STATE_DIGEST


def test_generate_keypair_and_trust_store(tmp_path):
    files = generate_keypair(tmp_path)
    generate_keypair(tmp_path)
    assert files.private_path.name == f"{files.key_id}.key"
    assert stat.S_IMODE(os.stat(files.private_path).st_mode) == 0o600
    signer = Signer.load(files.private_path)
    assert signer.key_id == files.key_id == key_id(signer.public_key)
    assert len(files.key_id) == 16
    store = TrustStore.from_dir(tmp_path)
    assert len(store) == 2 and files.key_id in store
    block, _ = make_block(signer)
    envelope.verify(block, store, NOW + 1)


def test_trust_store_ignores_file_names(tmp_path):
    files = generate_keypair(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "0000000000000000.pub").write_bytes(files.public_path.read_bytes())
    assert list(TrustStore.from_dir(tmp_path / "b")) == [files.key_id]


def test_load_or_generate_signer_is_stable(tmp_path):
    first = load_or_generate_signer(tmp_path / "keys")
    assert load_or_generate_signer(tmp_path / "keys").key_id == first.key_id


def test_a_key_dir_without_a_key_that_cannot_be_written_is_a_clear_error(tmp_path):
    (tmp_path / "not-a-dir").write_text("a file where the key directory should be")
    with pytest.raises(ValueError, match="holds no private key"):
        load_or_generate_signer(tmp_path / "not-a-dir" / "keys")
