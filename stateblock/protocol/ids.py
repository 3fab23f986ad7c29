"""Time-ordered ids (UUIDv7, RFC 9562) for requests and blocks.

Python 3.11 has no uuid.uuid7; time-ordered ids keep KV keys and logs sortable by arrival.
"""

from __future__ import annotations

import os
import time
import uuid


def uuid7(unix_ms: int | None = None) -> str:
    ms = time.time_ns() // 1_000_000 if unix_ms is None else unix_ms
    rand = int.from_bytes(os.urandom(10), "big")  # 80 random bits, 74 of them used
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= ((rand >> 62) & 0xFFF) << 64  # rand_a, 12 bits
    value |= 0b10 << 62  # RFC 9562 variant
    value |= rand & ((1 << 62) - 1)  # rand_b, 62 bits
    return str(uuid.UUID(int=value))
