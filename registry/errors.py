"""The registry's error tree. NATS errors are translated here once, raised `from` the cause."""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every registry failure."""


class ClaimLost(RegistryError):
    """The claim's revision is no longer the key's: another worker took over (or committed)."""

    def __init__(self, block_id: str, worker_id: str) -> None:
        self.block_id = block_id
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id} lost its claim on block {block_id}")


class AlreadyClaimed(RegistryError):
    """Another worker holds a live lease on the block."""

    def __init__(self, block_id: str, holder: str, lease_left_s: float = 0.0) -> None:
        self.block_id = block_id
        self.holder = holder
        self.lease_left_s = lease_left_s  # until the holder's lease lapses (if not renewed)
        super().__init__(f"block {block_id} is claimed by {holder}")


class AlreadyCommitted(RegistryError):
    """The block has its outcome (committed, or rejected): a redelivery to ack and drop."""

    def __init__(self, block_id: str) -> None:
        self.block_id = block_id
        super().__init__(f"block {block_id} is already committed")


class RevisionConflict(RegistryError):
    """Compare-and-swap kept losing races on one key; nothing was written."""


class CommitTimeout(RegistryError, TimeoutError):
    """No commit for the block before the deadline (the gateway's DEADLINE_EXCEEDED)."""


class RegistryUnavailable(RegistryError):
    """NATS could not be reached or refused the request (the gateway's UNAVAILABLE)."""
