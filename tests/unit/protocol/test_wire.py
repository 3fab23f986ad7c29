"""The block's wire encoding without protobuf copies: the same bytes as protobuf's own
encoding when sealing, the same outcome as protobuf's parse when reading, for every input."""

from __future__ import annotations

import pytest
import torch

from stateblock.model.rows import block_lanes, block_rows, rows_to_bytes, rows_view
from stateblock.protocol import envelope, layouts, wire
from stateblock.protocol.envelope import BlockRejected, RejectReason
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.v1 import block_pb2 as pb

NOW = 1_800_000_000.0
IDENTITY = envelope.ModelIdentity("tiny", b"\x01" * 32, b"\x02" * 32, b"\x03" * 32)
SIGNER = Signer.generate()
TRUST = TrustStore([SIGNER.public_key])


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def seal(rows: torch.Tensor, counts: tuple[int, ...] | None = None) -> envelope.SealedBlock:
    counts = counts or (rows.shape[0],)
    layout = layouts.make_layout(
        "req-1", counts, [8] * len(counts), hidden_size=rows.shape[1], dtype=rows.dtype
    )
    sampling = [pb.SamplingParams(temperature=0.5, seed=i) for i in range(len(counts))]
    return envelope.seal_block(
        layout,
        rows_view(rows),
        request_id="req-1",
        identity=IDENTITY,
        sampling=sampling,
        signer=SIGNER,
        ttl_s=30,
        now=NOW,
    )


def protobuf_wire(sealed: envelope.SealedBlock) -> bytes:
    """The definition: the whole block through protobuf, rows inline."""
    block = pb.StateBlock(header=sealed.header, payload=pb.Payload(inline_rows=bytes(sealed.rows)))
    return envelope.serialize_block(block)


# row sizes whose length fields take 1, 2 and 3 varint bytes, on both sides of each step
@pytest.mark.parametrize("n_bytes", [0, 1, 126, 127, 128, 129, 16_383, 16_384, 2**21 + 5])
def test_encode_inline_is_the_protobuf_encoding(n_bytes):
    header = seal(randn(3, 4)).header
    rows = bytes(range(256)) * (n_bytes // 256) + bytes(n_bytes % 256)
    want = envelope.serialize_block(
        pb.StateBlock(header=header, payload=pb.Payload(inline_rows=rows))
    )
    got = wire.encode_inline(header.SerializeToString(deterministic=True), memoryview(rows))
    assert got == want
    assert wire.inline_size(header.ByteSize(), n_bytes) == len(want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sealed_block_wire_is_protobufs_own(dtype):
    rows = randn(7, 96).to(dtype)
    sealed = seal(rows, counts=(3, 4))
    built = sealed.message()
    assert sealed.wire() == protobuf_wire(sealed) == envelope.serialize_block(built)
    assert sealed.wire_size() == len(sealed.wire())
    assert bytes(sealed.rows) == rows_to_bytes(rows)
    assert sealed.header.forward_state_digest == envelope.forward_state_digest(rows_to_bytes(rows))


def test_rows_view_of_rows_that_are_not_contiguous():
    rows = randn(96, 7).t()  # (7, 96), column-major storage
    assert not rows.is_contiguous()
    sealed = seal(rows)
    assert bytes(sealed.rows) == rows_to_bytes(rows)
    block, view = envelope.parse_wire(sealed.wire())
    assert torch.equal(block_rows(envelope.verify(block, TRUST, NOW + 1, payload=view)), rows)
    with pytest.raises(TypeError):  # read-only: the digest was taken over these bytes
        sealed.rows[0] = 1


def test_parse_wire_splits_the_canonical_encoding_without_copying():
    rows = randn(12, 64)
    data = seal(rows, counts=(5, 7)).wire()
    block, view = envelope.parse_wire(data)
    full = envelope.parse_block(data)
    assert block.HasField("header") and block.header == full.header
    assert block.payload.WhichOneof("location") is None  # the rows stay in `data`
    assert isinstance(view, memoryview) and view.obj is data
    assert bytes(view) == full.payload.inline_rows
    verified = envelope.verify(block, TRUST, NOW + 1, payload=view)
    assert torch.equal(block_rows(verified), block_rows(envelope.verify(full, TRUST, NOW + 1)))
    assert [r.shape[0] for r in block_lanes(verified)] == [5, 7]


def _key(field: int) -> bytes:
    return bytes([field << 3 | 2])


def _field(field: int, value: bytes) -> bytes:
    return _key(field) + wire.varint(len(value)) + value


VARIANT = seal(randn(4, 8))


def _variants() -> dict[str, bytes]:
    """Encodings protobuf reads, some valid and some not, that are not the canonical shape."""
    sealed = VARIANT
    header = sealed.header.SerializeToString(deterministic=True)
    rows = bytes(sealed.rows)
    payload = _field(1, rows)
    ref = pb.ObjectRef(bucket="b", name="n", digest=sealed.header.forward_state_digest)
    canonical = sealed.wire()
    return {
        "canonical": canonical,
        "rows one byte short, framed": _field(1, header) + _field(2, _field(1, rows[:-1])),
        "payload first": _field(2, payload) + _field(1, header),
        "header twice (merged)": _field(1, header) + _field(1, b"") + _field(2, payload),
        "unknown field after": canonical + _field(9, b"x"),
        "header again after the rows (merged)": canonical
        + _field(1, pb.StateBlockHeader(model="other").SerializeToString()),
        "payload twice (last wins)": _field(1, header)
        + _field(2, _field(1, b"zz"))
        + _field(2, payload),
        "rows twice in the payload (last wins)": _field(1, header)
        + _field(2, _field(1, b"zz") + payload),
        "rows then an unknown field in the payload": _field(1, header)
        + _field(2, payload + _field(7, b"x")),
        "object ref": envelope.serialize_block(
            pb.StateBlock(header=sealed.header, payload=pb.Payload(object_ref=ref))
        ),
        "no payload": _field(1, header),
        "empty": b"",
        "header that is not a header": _field(1, b"\xff\xff\xff") + _field(2, payload),
        "truncated rows": canonical[:-1],
        "length past the end": canonical[: len(header) + 2] + b"\x12\xff\xff\xff\x7f",
        "garbage": b"\xff\xff\xff",
        "non-minimal length varint": _key(1)
        + bytes([len(header) & 0x7F | 0x80, len(header) >> 7 | 0x80, 0])
        + header
        + _field(2, payload),
    }


@pytest.mark.parametrize("name", list(_variants()))
def test_parse_wire_agrees_with_the_protobuf_parse(name):
    data = _variants()[name]
    try:
        want = envelope.parse_block(data)
    except BlockRejected as e:
        with pytest.raises(BlockRejected) as info:
            envelope.parse_wire(data)
        assert info.value.reason == e.reason == RejectReason.MALFORMED
        return
    block, view = envelope.parse_wire(data)
    if view is None:
        assert block == want
    else:  # split: the header parsed alone, the rows a view
        assert block.header == want.header and bytes(view) == want.payload.inline_rows
    # and verify decides the same on both
    outcomes = []
    for blk, payload in ((want, None), (block, view)):
        if blk.payload.WhichOneof("location") == "object_ref":
            payload = bytes(VARIANT.rows)  # the fetched object
        try:
            outcomes.append(block_rows(envelope.verify(blk, TRUST, NOW + 1, payload=payload)))
        except BlockRejected as e:
            outcomes.append(e.reason)
    if isinstance(outcomes[0], torch.Tensor):
        assert torch.equal(outcomes[0], outcomes[1])
    else:
        assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(
    ("where", "reason"),
    [(lambda data: len(data) - 3, RejectReason.FORWARD_STATE_DIGEST),
     (lambda data: data.find(b"tiny"), RejectReason.BAD_SIGNATURE)],
    ids=["a row byte", "the model name in the header"],
)  # fmt: skip
def test_tampered_bytes_are_rejected_through_the_split(where, reason):
    data = bytearray(seal(randn(6, 16)).wire())
    data[where(data)] ^= 0x01
    block, view = envelope.parse_wire(bytes(data))
    with pytest.raises(BlockRejected) as info:
        envelope.verify(block, TRUST, NOW + 1, payload=view)
    assert info.value.reason == reason


def test_a_header_only_block_without_rows_is_malformed():
    block, _ = envelope.parse_wire(seal(randn(2, 4)).wire())
    with pytest.raises(BlockRejected) as info:
        envelope.verify(block, TRUST, NOW + 1)  # the split rows not passed on
    assert info.value.reason == RejectReason.MALFORMED
