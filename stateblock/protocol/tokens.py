"""The internal token a caller of the capture service presents: a shared secret in a file.

The gateway sends it as `authorization: Bearer <token>` metadata on every Capture call; the
capture compares it in constant time. A token file holds one line of at least MIN_CHARS
printable characters; `stateblock up` writes one (mode 0600) on first run, and its NATS
users' passwords in the same shape.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path

METADATA_KEY = "authorization"
MIN_CHARS = 16  # a generated token has 43 (32 random bytes, URL-safe base64)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def read_token(path: Path, what: str = "capture token file") -> str:
    """The token in `path`, surrounding whitespace removed; ValueError naming the file (as
    `what`) when it cannot be read or is too short to be a secret."""
    try:
        token = Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path} cannot be read: {e}") from e
    if len(token) < MIN_CHARS or not token.isprintable() or " " in token:
        raise ValueError(
            f"{what} {path} must hold one token of at least {MIN_CHARS} "
            "printable characters without spaces"
        )
    return token


def load_or_generate_token(path: Path) -> str:
    """The token in `path`, written there first (0600 from creation) when there is none."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return read_token(path)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents `token`."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def presented_ok(value: str | bytes | None, token: str) -> bool:
    """Whether an `authorization` metadata value is `Bearer <token>`, in constant time."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, given = (value or "").partition(" ")
    presented = given.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented, token.encode())


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
