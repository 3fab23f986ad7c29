"""What the registry stores for a block, signed by the readout worker that wrote it: a claim
(whose lease other workers respect), then a commit or a rejection (the block's outcome,
checked by the gateway before any client sees it).

The registry is a JetStream KV bucket any NATS client with write access could publish to,
so workers and the gateway believe only what a trusted readout key signed
(docs/ARCHITECTURE.md, "Outcomes"). Each kind of record has its own signing domain: a
signature over one can never be replayed as a signature over another, or over a block
header.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from google.protobuf.message import Message

from stateblock.protocol.keys import Signer, TrustStore
from stateblock.v1 import commit_pb2 as pb

COMMIT_CONTEXT = b"stateblock.v1.Commit\x00"
REJECTION_CONTEXT = b"stateblock.v1.Rejection\x00"
CLAIM_CONTEXT = b"stateblock.v1.Claim\x00"


class UntrustedOutcome(Exception):
    """A registry record that no trusted readout key signed (or that names another block)."""


class UntrustedClaim(Exception):
    """A claimed registry entry that no trusted readout key signed for its block: no lease."""


def _signing_bytes(record: Message, context: bytes) -> bytes:
    unsigned = type(record)()
    unsigned.CopyFrom(record)
    unsigned.ClearField("signature")
    return context + unsigned.SerializeToString(deterministic=True)


def _context(record: pb.Commit | pb.Rejection) -> bytes:
    return COMMIT_CONTEXT if isinstance(record, pb.Commit) else REJECTION_CONTEXT


def sign(record: pb.Commit | pb.Rejection, signer: Signer) -> None:
    """Set key_id and signature in place."""
    record.key_id = signer.key_id
    record.signature = signer.sign(_signing_bytes(record, _context(record)))


def verify(record: pb.Commit | pb.Rejection, trust: TrustStore, block_id: str) -> None:
    """Raise UntrustedOutcome unless a trusted key signed this record for block_id."""
    kind = type(record).__name__.lower()
    _verify_signed(record, trust, block_id, _context(record), UntrustedOutcome,
                   (f"{kind} for", f"{kind} of"))  # fmt: skip


def _verify_signed(
    record: pb.Commit | pb.Rejection | pb.RegistryEntry,
    trust: TrustStore,
    block_id: str,
    context: bytes,
    untrusted: type[Exception],
    names: tuple[str, str],
) -> None:
    """Raise `untrusted` unless a trusted key signed `record` under `context` for block_id;
    `names`: how its messages name the record's key ("commit for") and block ("commit of")."""
    stored, about = names
    if record.block_id != block_id:
        raise untrusted(f"{stored} {record.block_id!r} stored under {block_id!r}")
    public_key = trust.get(record.key_id)
    if public_key is None:
        raise untrusted(f"{about} block {block_id}: key {record.key_id!r} not trusted")
    try:
        public_key.verify(record.signature, _signing_bytes(record, context))
    except InvalidSignature as e:
        raise untrusted(f"{about} block {block_id}: bad signature") from e


def outcome_of(
    entry: pb.RegistryEntry, trust: TrustStore, block_id: str
) -> pb.Commit | pb.Rejection | None:
    """The block's signed, trusted outcome from its registry entry; None while it has none
    (claimed, released). Raises UntrustedOutcome for a record no trusted key signed."""
    if entry.state == pb.CLAIM_STATE_COMMITTED:
        verify(entry.commit, trust, block_id)
        return entry.commit
    if entry.state == pb.CLAIM_STATE_REJECTED:
        verify(entry.rejection, trust, block_id)
        return entry.rejection
    return None


def sign_claim(entry: pb.RegistryEntry, signer: Signer) -> None:
    """Sign a claimed entry in place (key_id and signature), as `sign` does an outcome."""
    entry.key_id = signer.key_id
    entry.signature = signer.sign(_signing_bytes(entry, CLAIM_CONTEXT))


def verify_claim(entry: pb.RegistryEntry, trust: TrustStore, block_id: str) -> None:
    """Raise UntrustedClaim unless `entry` is a claim a trusted key signed for block_id."""
    if entry.state != pb.CLAIM_STATE_CLAIMED:
        raise UntrustedClaim(f"entry of block {block_id} is not a claim")
    _verify_signed(entry, trust, block_id, CLAIM_CONTEXT, UntrustedClaim, ("claim on", "claim on"))
