"""Where a block's rows travel: the header's `RowsLocator` and the placement's subject.

The signed header always goes over JetStream; the rows go by the transport the placement
allows (`STATEBLOCK_DATA_PLANE`, chosen at start-up): the bus (the block's Payload, any
host), `local` (a slot of an in-process slot pool, the rows on the capture's device),
`host` (a shared region of this host) or `ipc` (a span of the capture's device arena, shared
through CUDA IPC with the processes of this host). Rows that stay on a host can be read only by the
workers of that placement, so their headers are published on the placement's own subject
(`streams.placement_subject`), under the model's, and consumed through a consumer of their
own: a worker that could not reach the rows never receives the block.
"""

from __future__ import annotations

import re

from stateblock.v1 import block_pb2 as pb

BUS, LOCAL, HOST, CUDA_IPC = "bus", "local", "host", "ipc"
DATA_PLANES = {
    BUS: pb.TRANSPORT_BUS,
    LOCAL: pb.TRANSPORT_LOCAL,
    HOST: pb.TRANSPORT_HOST,
    CUDA_IPC: pb.TRANSPORT_CUDA_IPC,
}
# Transports whose rows stay on this host.
ON_HOST = frozenset({pb.TRANSPORT_LOCAL, pb.TRANSPORT_HOST, pb.TRANSPORT_CUDA_IPC})
PLACEMENT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a subject token


def transport(header: pb.StateBlockHeader) -> int:
    """The header's transport: TRANSPORT_BUS without a locator (blocks from before it)."""
    kind = header.locator.transport if header.HasField("locator") else pb.TRANSPORT_BUS
    return pb.TRANSPORT_BUS if kind == pb.TRANSPORT_UNSPECIFIED else kind


def on_host(header: pb.StateBlockHeader) -> bool:
    return transport(header) in ON_HOST


def slot_locator(kind: str, placement: str, slot: int, region: str = "") -> pb.RowsLocator:
    """The locator of rows in `slot` of the pool `placement` (a subject token)."""
    if DATA_PLANES.get(kind) not in ON_HOST:
        raise ValueError(f"{kind!r} rows are not in a slot")
    if not PLACEMENT.match(placement):
        raise ValueError(f"placement {placement!r} is not a subject token")
    return pb.RowsLocator(
        transport=DATA_PLANES[kind], placement=placement, slot=slot, region=region
    )


def ipc_locator(placement: str, shared: pb.CudaIpcRows, offset: int) -> pb.RowsLocator:
    """The locator of rows at `offset` of the shared arena `shared` (arena.share)."""
    if not PLACEMENT.match(placement):
        raise ValueError(f"placement {placement!r} is not a subject token")
    ipc = pb.CudaIpcRows()
    ipc.CopyFrom(shared)
    ipc.rows_offset_bytes = offset
    return pb.RowsLocator(transport=pb.TRANSPORT_CUDA_IPC, placement=placement, cuda_ipc=ipc)
