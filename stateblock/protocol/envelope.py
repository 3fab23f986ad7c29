"""The StateBlock envelope: build, sign, serialise, parse and verify.

The header is signed (Ed25519, signature field cleared, deterministic protobuf encoding)
and commits to the payload through `forward_state_digest`, so the payload may travel
inline or through the object store without re-signing. `verify` checks in the order of the
request path: well-formed, trusted key, signature, expiry, layout digest, forward-state
digest; the first failure raises `BlockRejected(reason)`, whose reason names the
`stateblock.rejected.<reason>` subject. `verify_header` stops before the digest and
`HeaderVerified.confirm` finishes, so a worker can hash while it claims and reads out.

At full scale a block carries 2.75 MB of rows, so the services keep them out of protobuf
messages: `seal_block` hashes the rows where they lie and `SealedBlock.wire` frames them
into the message bytes; `parse_wire` parses the header alone and leaves the rows a view of
the received bytes (`stateblock.protocol.wire`). The bytes and the outcome are those of
`serialize_block` and `parse_block`, which stay the definition.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import blake3
from cryptography.exceptions import InvalidSignature
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from stateblock.protocol import locator, wire
from stateblock.protocol.ids import uuid7
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.protocol.layouts import (
    LayoutError,
    check_layout,
    check_payload_size,
    layout_digest,
)
from stateblock.v1 import block_pb2 as pb

DIGEST_BYTES = 32  # SHA-256 and BLAKE3 alike

# The forward-state digest's hash by configuration name. BLAKE3 is the default: over a
# full-scale block's 2.75 MB it takes a quarter of SHA-256's time on one core, and the
# capture must hash before it can sign (docs/BENCHMARKS.md). SHA-256 stays readable (and
# is what a header without the field means).
FORWARD_STATE_ALGORITHMS: dict[str, int] = {
    "blake3": pb.DIGEST_ALGORITHM_BLAKE3,
    "sha256": pb.DIGEST_ALGORITHM_SHA256,
}
DEFAULT_FORWARD_STATE_ALGORITHM = "blake3"
_DEFAULT_ALGORITHM = FORWARD_STATE_ALGORITHMS[DEFAULT_FORWARD_STATE_ALGORITHM]
# BLAKE3 spreads an input this large over the cores (rayon); below it one core is faster.
_BLAKE3_THREADS_FROM = 1 << 20
# Domain separation: a header signature can never be replayed as a signature over
# anything else this key might sign.
SIGNING_CONTEXT = b"stateblock.v1.StateBlockHeader\x00"


class RejectReason(StrEnum):
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_KEY = "unknown_key"
    EXPIRED = "expired"
    LAYOUT_DIGEST = "layout_digest"
    FORWARD_STATE_DIGEST = "forward_state_digest"
    MALFORMED = "malformed"
    # a located block's rows are gone or are other rows (its slot freed or reused, its
    # region gone or cut short): lost on this host, not forged
    ROWS_MISSING = "rows_missing"


class BlockRejected(Exception):
    """A block that must be terminated, never retried: retrying cannot make it valid.

    `authentic`: the header's signature verified and the failure is the signed block's own
    (expired, a layout its signer got wrong), so the request it names may be told. False
    wherever a forger could be the cause (a header or rows that do not verify): such a
    failure must not end the genuine request the block claims to belong to."""

    def __init__(self, reason: RejectReason, detail: str = "", *, authentic: bool = False) -> None:
        self.reason = RejectReason(reason)
        self.detail = detail
        self.authentic = authentic
        super().__init__(f"{self.reason}: {detail}" if detail else str(self.reason))


def forward_state_algorithm(name: str) -> int:
    """The DigestAlgorithm of a configuration name ("blake3", "sha256"); ValueError if unknown."""
    try:
        return FORWARD_STATE_ALGORITHMS[name.strip().lower()]
    except KeyError:
        known = ", ".join(FORWARD_STATE_ALGORITHMS)
        raise ValueError(f"forward-state digest {name!r} is not one of: {known}") from None


def forward_state_hasher(algorithm: int = _DEFAULT_ALGORITHM, nbytes: int = 0) -> Any:
    """A hasher (`update(chunk)`, `digest()`) of the rows' bytes under `algorithm` (a
    DigestAlgorithm; UNSPECIFIED is SHA-256, what headers from before the field carry),
    for rows of `nbytes` that arrive in pieces: fed in order, it gives forward_state_digest
    of their whole. Both hashes release the GIL, so this may run in a thread beside the
    event loop."""
    if algorithm == pb.DIGEST_ALGORITHM_BLAKE3:
        threads = blake3.blake3.AUTO if nbytes >= _BLAKE3_THREADS_FROM else 1
        return blake3.blake3(max_threads=threads)
    if algorithm in (pb.DIGEST_ALGORITHM_SHA256, pb.DIGEST_ALGORITHM_UNSPECIFIED):
        return hashlib.sha256()
    raise ValueError(f"unknown forward-state digest algorithm {algorithm}")


def forward_state_digest(data: bytes | memoryview, algorithm: int = _DEFAULT_ALGORITHM) -> bytes:
    """The captured rows' bytes in layout order under `algorithm` (forward_state_hasher)."""
    hasher = forward_state_hasher(algorithm, memoryview(data).nbytes)
    hasher.update(data)
    return hasher.digest()


@dataclass(frozen=True)
class ModelIdentity:
    """What the block was captured for; a worker serving other pieces must not read it."""

    model: str
    base_model_digest: bytes
    lm_head_digest: bytes
    decoder_digest: bytes


def _timestamp(unix_s: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(round(unix_s * 1e9))
    return ts


def signing_bytes(header: pb.StateBlockHeader) -> bytes:
    """What the signature covers: the header with signature cleared, deterministically."""
    unsigned = pb.StateBlockHeader()
    unsigned.CopyFrom(header)
    unsigned.ClearField("signature")
    return SIGNING_CONTEXT + unsigned.SerializeToString(deterministic=True)


def sign_header(header: pb.StateBlockHeader, signer: Signer) -> None:
    header.key_id = signer.key_id
    header.signature = signer.sign(signing_bytes(header))


@dataclass(frozen=True)
class SealedBlock:
    """A signed header and its rows, kept apart until they go on the wire.

    `rows` is a read-only view of the captured rows (`rows_view`) that the header's
    forward_state_digest was computed over; `wire()` is `serialize_block(message())`.
    """

    header: pb.StateBlockHeader
    rows: memoryview

    def message(self) -> pb.StateBlock:
        """The block with its rows inline, as a protobuf message (a copy of the rows)."""
        block = pb.StateBlock(header=self.header)
        block.payload.inline_rows = self.rows.tobytes()
        return block

    def wire_size(self) -> int:
        """len(self.wire()), without building it."""
        return wire.inline_size(self.header.ByteSize(), len(self.rows))

    def wire(self) -> bytes:
        """The block with its rows inline, serialised (`stateblock.protocol.wire`: the rows are
        copied once, into the message bytes)."""
        return wire.encode_inline(self.header.SerializeToString(deterministic=True), self.rows)

    def object_wire(self, bucket: str, name: str) -> bytes:
        """The block with an ObjectRef payload, for rows that go through the object store.

        The header is untouched, so the signature still holds: it commits to the rows
        through forward_state_digest, which the worker checks after fetching the object.
        The ref's digest is that same digest: it was computed over these rows when sealing.
        """
        ref = pb.ObjectRef(
            bucket=bucket,
            name=name,
            digest=self.header.forward_state_digest,
            size=len(self.rows),
        )
        return serialize_block(
            pb.StateBlock(header=self.header, payload=pb.Payload(object_ref=ref))
        )


def seal_block(
    layout: pb.Layout,
    rows: bytes | memoryview,  # (total_rows, hidden_size) elements packed in layout order
    *,
    request_id: str,
    digest_algorithm: int = _DEFAULT_ALGORITHM,
    **signing: Any,
) -> SealedBlock:
    """Digest and sign the rows; they stay where they are (see `SealedBlock`). `signing`:
    the rest of `signed_header`'s keywords (identity, sampling, signer, ttl_s, ...)."""
    data = memoryview(rows).cast("B")  # bytes, whatever view of them was handed in
    check_layout(layout, request_id)
    check_payload_size(data, layout)
    digest = forward_state_digest(data, digest_algorithm)
    header = signed_header(layout, digest, digest_algorithm, request_id=request_id, **signing)
    return SealedBlock(header, data)


def signed_header(
    layout: pb.Layout,
    digest: bytes,
    algorithm: int,
    *,
    request_id: str,
    identity: ModelIdentity,
    sampling: Sequence[pb.SamplingParams],
    signer: Signer,
    ttl_s: float,
    block_id: str | None = None,
    now: float | None = None,
    locator: pb.RowsLocator | None = None,
) -> pb.StateBlockHeader:
    """The signed header of rows whose digest is computed already (`seal_block` for bytes;
    stateblock.protocol.locator for rows that stay where they were captured)."""
    check_layout(layout, request_id)
    if len(sampling) != len(layout.lanes):
        raise LayoutError(f"{len(sampling)} sampling params for {len(layout.lanes)} lanes")
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    now = time.time() if now is None else now
    header = pb.StateBlockHeader(
        request_id=request_id,
        block_id=block_id or uuid7(),
        model=identity.model,
        layout=layout,
        layout_digest=layout_digest(layout),
        forward_state_digest=digest,
        forward_state_algorithm=algorithm,
        base_model_digest=identity.base_model_digest,
        lm_head_digest=identity.lm_head_digest,
        decoder_digest=identity.decoder_digest,
        sampling=sampling,
        created_at=_timestamp(now),
        expires_at=_timestamp(now + ttl_s),
        locator=locator,
    )
    sign_header(header, signer)
    return header


def serialize_block(block: pb.StateBlock) -> bytes:
    return block.SerializeToString(deterministic=True)


def parse_block(data: bytes) -> pb.StateBlock:
    block = pb.StateBlock()
    try:
        block.ParseFromString(data)
    except DecodeError as e:
        raise BlockRejected(RejectReason.MALFORMED, f"not a StateBlock: {e}") from e
    return block


def parse_wire(data: bytes) -> tuple[pb.StateBlock, memoryview | None]:
    """`parse_block`, leaving inline rows in `data`: (the block without its payload, a view
    of the rows) for the canonical encoding (header, then a payload of inline rows, nothing
    else: what `serialize_block` writes), whose protobuf parse would copy the rows into the
    message and out again; anything else is `(parse_block(data), None)`. Pass the view to
    `verify` as `payload`."""
    split = wire.split_inline(data)
    if split is None:
        return parse_block(data), None
    header, rows = split
    block = pb.StateBlock()
    block.header.SetInParent()  # present even when empty, as the full parse leaves it
    try:
        block.header.ParseFromString(header)
    except DecodeError as e:
        raise BlockRejected(RejectReason.MALFORMED, f"not a StateBlock: {e}") from e
    return block, rows


@dataclass(frozen=True)
class VerifiedBlock:
    header: pb.StateBlockHeader
    data: bytes | memoryview  # the rows' bytes, of the layout's size (stateblock.model.rows)


@dataclass(frozen=True)
class HeaderVerified:
    """A block whose signed header passed every check (`verify_header`) and whose rows have
    the layout's size, but whose rows are not yet matched against `forward_state_digest`.

    It exists so a worker can hash the rows (megabytes at full scale, in a thread: both
    hashes release the GIL) while it claims and runs the readout, and commit
    only after `confirm()`. Nothing built from it may leave the worker before that.
    """

    header: pb.StateBlockHeader
    data: bytes | memoryview  # the payload bytes the digest covers, of the layout's size

    def confirm(self) -> VerifiedBlock:
        """The last check of `verify`: raise BlockRejected unless the rows match the digest."""
        _check_forward_state(self.header, self.data)
        return VerifiedBlock(header=self.header, data=self.data)


def _check_forward_state(header: pb.StateBlockHeader, data: bytes | memoryview) -> None:
    if forward_state_digest(data, header.forward_state_algorithm) != header.forward_state_digest:
        raise BlockRejected(RejectReason.FORWARD_STATE_DIGEST, f"block {header.block_id}")


_READABLE_ALGORITHMS = frozenset(FORWARD_STATE_ALGORITHMS.values()) | {
    pb.DIGEST_ALGORITHM_UNSPECIFIED,
    pb.DIGEST_ALGORITHM_SLOT_CHECKSUM,
}


def _check_well_formed(block: pb.StateBlock, *, rows_apart: bool) -> None:
    if not block.HasField("header"):
        raise BlockRejected(RejectReason.MALFORMED, "no header")
    header = block.header
    try:
        check_layout(header.layout, header.request_id)
    except LayoutError as e:
        raise BlockRejected(RejectReason.MALFORMED, str(e)) from e
    if len(header.sampling) != len(header.layout.lanes):
        raise BlockRejected(RejectReason.MALFORMED, "sampling params do not match lanes")
    if not header.block_id or not header.request_id:
        raise BlockRejected(RejectReason.MALFORMED, "missing block_id or request_id")
    if not (header.HasField("created_at") and header.HasField("expires_at")):
        raise BlockRejected(RejectReason.MALFORMED, "missing created_at / expires_at")
    for name in ("layout_digest", "forward_state_digest"):
        if len(getattr(header, name)) != DIGEST_BYTES:
            raise BlockRejected(
                RejectReason.MALFORMED, f"{name} is not a {DIGEST_BYTES}-byte digest"
            )
    if header.forward_state_algorithm not in _READABLE_ALGORITHMS:
        raise BlockRejected(
            RejectReason.MALFORMED,
            f"unknown forward_state_algorithm {header.forward_state_algorithm}",
        )
    on_host = locator.on_host(header)
    if header.forward_state_algorithm == pb.DIGEST_ALGORITHM_SLOT_CHECKSUM and not on_host:
        raise BlockRejected(RejectReason.MALFORMED, "the slot checksum is for rows on this host")
    if on_host:
        if block.payload.WhichOneof("location") is not None:
            raise BlockRejected(RejectReason.MALFORMED, "rows on this host and a payload")
    elif block.payload.WhichOneof("location") is None and not rows_apart:
        raise BlockRejected(RejectReason.MALFORMED, "no payload")


def verify(
    block: pb.StateBlock,
    trust_store: TrustStore,
    now: float | None = None,
    *,
    payload: bytes | memoryview | None = None,
) -> VerifiedBlock:
    """Check everything a worker must before it commits; raise BlockRejected on the first failure.

    `payload` is the rows when they are not in the message: the fetched object for an
    ObjectRef payload, or the inline rows `parse_wire` split off (the block then has no
    payload). It is ignored for a block that holds its rows inline.
    """
    return verify_header(block, trust_store, now, payload=payload).confirm()


def verify_signature(block: pb.StateBlock, trust_store: TrustStore) -> pb.StateBlockHeader:
    """The header, if a trusted key signed it: enough to say which request a block belongs
    to (no expiry, no rows), for ending a block nobody will read. Raises BlockRejected."""
    _check_well_formed(block, rows_apart=True)
    _check_signed(block.header, trust_store)
    return block.header


def _check_signed(header: pb.StateBlockHeader, trust_store: TrustStore) -> None:
    public_key = trust_store.get(header.key_id)
    if public_key is None:
        raise BlockRejected(RejectReason.UNKNOWN_KEY, f"key id {header.key_id!r} is not trusted")
    try:
        public_key.verify(header.signature, signing_bytes(header))
    except InvalidSignature as e:
        raise BlockRejected(RejectReason.BAD_SIGNATURE, f"block {header.block_id}") from e


def verify_header(
    block: pb.StateBlock,
    trust_store: TrustStore,
    now: float | None = None,
    *,
    payload: bytes | memoryview | None = None,
) -> HeaderVerified:
    """`verify` up to the forward-state digest: well-formed, trusted key, signature, expiry,
    layout digest, and rows of the layout's size; `.confirm()` checks the digest."""
    header = trusted_header(block, trust_store, now, rows_apart=payload is not None)
    if locator.on_host(header):
        raise BlockRejected(RejectReason.MALFORMED, "its rows are not on the bus")
    data = _payload_bytes(block, payload)
    try:
        check_payload_size(data, header.layout)
    except LayoutError as e:
        # Rows of another size than the signed layout's: if they are not the signed rows
        # either, that is the reason (as when the digest came first); otherwise a trusted
        # signer described rows it did not send.
        _check_forward_state(header, data)
        raise BlockRejected(RejectReason.MALFORMED, str(e), authentic=True) from e
    return HeaderVerified(header=header, data=data)


def trusted_header(
    block: pb.StateBlock, trust_store: TrustStore, now: float | None = None, *, rows_apart: bool
) -> pb.StateBlockHeader:
    """The header, once well-formed, signed by a trusted key, unexpired and of a matching
    layout digest; its rows are the caller's to check. Raises BlockRejected."""
    _check_well_formed(block, rows_apart=rows_apart)
    header = block.header
    _check_signed(header, trust_store)
    # Only signed fields are trusted from here on.
    now = time.time() if now is None else now
    if now * 1e9 >= header.expires_at.ToNanoseconds():
        expired = f"expired at {header.expires_at.ToJsonString()}"
        raise BlockRejected(RejectReason.EXPIRED, expired, authentic=True)
    if layout_digest(header.layout) != header.layout_digest:
        raise BlockRejected(RejectReason.LAYOUT_DIGEST, f"block {header.block_id}", authentic=True)
    return header


def _payload_bytes(block: pb.StateBlock, fetched: bytes | memoryview | None) -> bytes | memoryview:
    location = block.payload.WhichOneof("location")
    if location == "inline_rows":
        return block.payload.inline_rows
    if location is None:  # rows split off by parse_wire (checked in _check_well_formed)
        assert fetched is not None
        return fetched
    ref = block.payload.object_ref
    if ref.digest != block.header.forward_state_digest:
        raise BlockRejected(RejectReason.FORWARD_STATE_DIGEST, "object digest != forward state")
    if fetched is None:
        raise ValueError("object-store payload: fetch the object and pass payload=")
    return fetched
