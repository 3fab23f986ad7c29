"""The compare-and-swap block registry on a JetStream KV bucket (docs/ARCHITECTURE.md, "The request path")."""

from registry.errors import (
    AlreadyClaimed,
    AlreadyCommitted,
    ClaimLost,
    CommitTimeout,
    RegistryError,
    RegistryUnavailable,
    RevisionConflict,
)
from registry.registry import (
    DEFAULT_BUCKET,
    FINAL_STATES,
    Claim,
    Registry,
    parse_update,
    updates_subject,
)

__all__ = [
    "DEFAULT_BUCKET",
    "FINAL_STATES",
    "AlreadyClaimed",
    "AlreadyCommitted",
    "Claim",
    "ClaimLost",
    "CommitTimeout",
    "Registry",
    "RegistryError",
    "RegistryUnavailable",
    "RevisionConflict",
    "parse_update",
    "updates_subject",
]
