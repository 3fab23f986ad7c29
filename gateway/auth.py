"""The API key check both transports share."""

from __future__ import annotations

import hmac


def bearer_ok(header: str | bytes | None, api_key: str) -> bool:
    """`Bearer <api_key>`, compared in constant time."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), api_key)
