"""Captured rows as tensors and as the bytes a state block carries.

The envelope (stateblock.protocol) signs and verifies bytes and knows dtypes by code only,
so it needs no torch; this module is the one place rows cross between the two.
"""

from __future__ import annotations

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
