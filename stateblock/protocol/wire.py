"""The canonical StateBlock encoding, written and read around the rows.

A block on the wire is `serialize_block(block)`: the header field, then the payload field
holding the inline rows (2.75 MB at full scale). Through protobuf the rows are copied into
the message and out again on each side; here the header alone goes through protobuf and
the rows are framed by hand, so they are copied once when sending and not at all when
reading. The bytes are the protobuf encoding's own (tests/unit/protocol/test_envelope.py compares them),
and anything not in exactly this shape is left to the protobuf parser.
"""

from __future__ import annotations

# Keys (field number << 3 | 2, length-delimited) of the encoding's three fields:
# StateBlock.header = 1, StateBlock.payload = 2, Payload.inline_rows = 1.
HEADER_KEY, PAYLOAD_KEY, INLINE_ROWS_KEY = b"\x0a", b"\x12", b"\x0a"
_MAX_VARINT_BYTES = 10


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_size(size: int) -> int:
    """Bytes of a length-delimited field with a one-byte key and `size` bytes of value."""
    return 1 + len(varint(size)) + size


def inline_size(header_size: int, rows_size: int) -> int:
    """len(encode_inline(header, rows)) for a header of header_size serialised bytes."""
    return _field_size(header_size) + _field_size(_field_size(rows_size))


def encode_inline(header: bytes, rows: bytes | memoryview) -> bytes:
    """A StateBlock of the serialised header and inline rows; the rows are copied once."""
    rows_key = INLINE_ROWS_KEY + varint(len(rows))
    payload_size = len(rows_key) + len(rows)
    return b"".join(
        (HEADER_KEY, varint(len(header)), header, PAYLOAD_KEY, varint(payload_size), rows_key, rows)
    )


def _read_field(data: memoryview, pos: int, key: bytes) -> tuple[int, int] | None:
    """(start, end) of the value of the length-delimited field with `key` at `pos`, or None
    if it is not there or runs past the data."""
    if data[pos : pos + 1] != key:
        return None
    size, shift, pos = 0, 0, pos + 1
    for _ in range(_MAX_VARINT_BYTES):
        if pos >= len(data):
            return None
        byte = data[pos]
        pos += 1
        size |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return (pos, pos + size) if pos + size <= len(data) else None
    return None


def split_inline(data: bytes) -> tuple[memoryview, memoryview] | None:
    """(header bytes, rows), both views of `data`, if it is exactly a header field followed
    by a payload field of inline rows; None for anything else (parse it with protobuf)."""
    view = memoryview(data)
    header = _read_field(view, 0, HEADER_KEY)
    payload = header and _read_field(view, header[1], PAYLOAD_KEY)
    rows = payload and _read_field(view, payload[0], INLINE_ROWS_KEY)
    if not (rows and payload[1] == len(view) and rows[1] == payload[1]):
        return None
    return view[header[0] : header[1]], view[rows[0] : rows[1]]
