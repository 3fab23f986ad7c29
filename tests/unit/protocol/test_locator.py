"""The rows' locator in the signed header: a header without one is the bus; rows on this
host go with a header alone, and the slot checksum goes with them only."""

from __future__ import annotations

import pytest

from stateblock.protocol import envelope, layouts, locator, streams
from stateblock.protocol.envelope import BlockRejected, RejectReason
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.v1 import block_pb2 as pb

NOW = 1_800_000_000.0
IDENTITY = envelope.ModelIdentity("tiny", b"\x01" * 32, b"\x02" * 32, b"\x03" * 32)
SIGNER = Signer.generate()
TRUST = TrustStore([SIGNER.public_key])


def header(algorithm=pb.DIGEST_ALGORITHM_SLOT_CHECKSUM, where=None) -> pb.StateBlockHeader:
    layout = layouts.make_layout("req-1", [3], [8], hidden_size=4, dtype="float32")
    return envelope.signed_header(
        layout, b"\x07" * 32, algorithm, request_id="req-1", identity=IDENTITY,
        sampling=[pb.SamplingParams()], signer=SIGNER, ttl_s=60.0, now=NOW,
        locator=where if where is not None else locator.slot_locator("local", "pool1", 2),
    )  # fmt: skip


def test_a_header_without_a_locator_is_the_bus():
    assert locator.transport(pb.StateBlockHeader()) == pb.TRANSPORT_BUS
    unspecified = pb.StateBlockHeader(locator=pb.RowsLocator())
    assert locator.transport(unspecified) == pb.TRANSPORT_BUS and not locator.on_host(unspecified)


def test_a_slot_header_verifies_alone_and_its_locator_is_signed():
    block = pb.StateBlock(header=header())
    got = envelope.trusted_header(block, TRUST, NOW + 1, rows_apart=True)
    assert locator.on_host(got) and got.locator.slot == 2 and got.locator.placement == "pool1"
    block.header.locator.slot = 3  # pointed at other rows after signing
    with pytest.raises(BlockRejected) as e:
        envelope.trusted_header(block, TRUST, NOW + 1, rows_apart=True)
    assert e.value.reason == RejectReason.BAD_SIGNATURE


def test_the_slot_checksum_is_malformed_on_the_bus_and_rows_on_host_take_no_payload():
    bus = pb.StateBlock(header=header(where=pb.RowsLocator(transport=pb.TRANSPORT_BUS)))
    bus.payload.inline_rows = b"\0" * 48
    with pytest.raises(BlockRejected, match="slot checksum") as e:
        envelope.verify_header(bus, TRUST, NOW + 1)
    assert e.value.reason == RejectReason.MALFORMED
    both = pb.StateBlock(header=header())
    both.payload.inline_rows = b"\0" * 48
    with pytest.raises(BlockRejected, match="payload"):
        envelope.trusted_header(both, TRUST, NOW + 1, rows_apart=True)
    with pytest.raises(BlockRejected, match="not on the bus"):  # the bus path refuses it
        envelope.verify_header(pb.StateBlock(header=header()), TRUST, NOW + 1, payload=b"x")


def test_a_hash_may_go_with_rows_on_host():
    block = pb.StateBlock(header=header(algorithm=pb.DIGEST_ALGORITHM_BLAKE3))
    assert envelope.trusted_header(block, TRUST, NOW + 1, rows_apart=True).locator.slot == 2


def test_placements_are_subject_tokens_under_the_model_s_subject():
    assert streams.placement_subject("m", "abc") == "stateblock.blocks.m.abc"
    assert streams.placement_durable("m", "abc") == "readout-m-abc"
    for bad in ("a.b", "a b", "*", ">", ""):
        with pytest.raises(ValueError):
            streams.placement_subject("m", bad)
        with pytest.raises(ValueError):
            locator.slot_locator("local", bad, 0)
    with pytest.raises(ValueError):
        locator.slot_locator("bus", "abc", 0)
