"""Captured rows as tensors and as the bytes a state block carries.

The envelope (stateblock.protocol) signs and verifies bytes and knows dtypes by code only,
so it needs no torch; this module is the one place rows cross between the two.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from stateblock.protocol import envelope, layouts
from stateblock.protocol.layouts import LayoutError
from stateblock.v1 import block_pb2 as pb

_DTYPES: dict[int, torch.dtype] = {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
}


def torch_dtype(code: int) -> torch.dtype:
    if code not in _DTYPES:
        raise LayoutError(f"unknown dtype code {code}")
    return _DTYPES[code]


def rows_to_bytes(rows: Tensor) -> bytes:
    """Row-major element bytes; via uint8 because numpy has no bfloat16."""
    return rows.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def rows_view(rows: Tensor) -> memoryview:
    """The bytes `rows_to_bytes` returns, as a read-only view of the CPU rows: no copy when
    they are contiguous on the CPU already. The rows must not change while it is in use."""
    flat = rows.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy()).toreadonly()


# The host data plane's pieces: a few milliseconds of copy each, so a small block's copy
# queued behind a maximal one (176 MB) waits for one piece, not for the whole of it.
HOST_CHUNK_BYTES = 16 << 20
_ROWS_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def host_chunks(rows: Tensor, chunk_bytes: int = HOST_CHUNK_BYTES) -> Iterator[memoryview]:
    """The bytes `rows_view` gives, in order, as read-only views of at most `chunk_bytes`,
    each valid until the next is asked for. Rows on the CPU are sliced, not copied. Rows on
    a GPU are copied piece by piece into two pinned host buffers on the rows stream
    (`rows_stream`), the next piece's copy running while the caller reads this one."""
    flat = rows.detach().contiguous().view(-1).view(torch.uint8)  # (N,) the rows' bytes
    if flat.device.type == "cuda":
        yield from _device_chunks(flat, chunk_bytes)
        return
    view = memoryview(flat.to("cpu").numpy()).toreadonly()
    for start in range(0, len(view), chunk_bytes):
        yield view[start : start + chunk_bytes]


def _device_chunks(flat: Tensor, chunk_bytes: int) -> Iterator[memoryview]:
    stream = rows_stream(flat.device)
    stream.wait_stream(torch.cuda.current_stream(flat.device))  # the rows' writer
    size = min(chunk_bytes, flat.numel())
    starts = list(range(0, flat.numel(), chunk_bytes))
    # one buffer for rows of one piece (every small block), two to take turns otherwise
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in starts[:2]]

    def copy(i: int) -> tuple[Tensor, torch.cuda.Event]:
        piece = flat[starts[i] : starts[i] + chunk_bytes]
        host = buffers[i % 2][: piece.numel()]  # the buffer of piece i - 2, read by now
        with torch.cuda.stream(stream):
            host.copy_(piece, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return host, done

    try:
        pending = copy(0) if starts else None
        for i in range(len(starts)):
            assert pending is not None
            host, done = pending
            pending = copy(i + 1) if i + 1 < len(starts) else None
            done.synchronize()
            yield memoryview(host.numpy()).toreadonly()
    finally:  # a caller that stops early leaves no copy reading the rows or a buffer
        stream.synchronize()


def rows_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's stream for the rows' copies (into and out of an arena, and to the
    host in pieces) and their checksums, one per GPU, at the highest priority: their few
    small kernels go ahead of the forwards and readouts queued on the other streams instead
    of behind them, and no copy sits among those streams' kernels."""
    device = torch.device("cuda", torch.cuda._get_device_index(device, optional=True))
    stream = _ROWS_STREAMS.get(device)
    if stream is None:  # a priority past the range is the range's highest
        stream = _ROWS_STREAMS.setdefault(device, torch.cuda.Stream(device, priority=-(1 << 10)))
    return stream


def check_rows(rows: Tensor, layout: pb.Layout) -> None:
    """Raise LayoutError unless rows are (total_rows, hidden_size) of the layout's dtype."""
    if tuple(rows.shape) != (layout.total_rows, layout.hidden_size):
        raise LayoutError(f"rows {tuple(rows.shape)} do not match layout")
    if rows.dtype != torch_dtype(layout.dtype):
        raise LayoutError(f"rows are {rows.dtype}, layout says {torch_dtype(layout.dtype)}")


def rows_from_bytes(data: bytes | memoryview, layout: pb.Layout) -> Tensor:
    """The packed rows (total_rows, hidden_size) that rows_to_bytes wrote."""
    layouts.check_payload_size(data, layout)
    # bytearray: torch.frombuffer wants a writable buffer, and the tensor must own its copy.
    flat = torch.frombuffer(bytearray(data), dtype=torch_dtype(layout.dtype))
    return flat.view(layout.total_rows, layout.hidden_size)


def split_lanes(rows: Tensor, layout: pb.Layout) -> list[Tensor]:
    """Per-lane views [(row_count, hidden_size)] of packed rows (a lane that reads another
    lane's rows, `rows_of_lane`, gets that lane's view)."""
    return [rows[at.row_offset : at.row_offset + at.row_count] for at in layouts.lane_rows(layout)]


def block_rows(block: envelope.VerifiedBlock | envelope.HeaderVerified) -> Tensor:
    """A verified block's rows (total_rows, hidden_size), CPU, of the layout's dtype."""
    return rows_from_bytes(block.data, block.header.layout)


def block_lanes(block: envelope.VerifiedBlock | envelope.HeaderVerified) -> list[Tensor]:
    """A verified block's rows, lane by lane [(row_count, hidden_size)]."""
    return split_lanes(block_rows(block), block.header.layout)
