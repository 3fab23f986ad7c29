"""The `ipc` data plane's handle on a CUDA GPU: a capture's arena shared once, and another
process (the readout's) opening it and copying two blocks' rows out, bit for bit, their
checksum the one the capture signed. Skipped cleanly without a GPU."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from stateblock.model.arena import DeviceArena, ipc_placement, rows_nbytes, share
from stateblock.model.slots import rows_checksum
from stateblock.protocol import layouts, locator

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, needs_cuda]

READER = """
import sys
from stateblock.model.arena import copy_rows
from stateblock.model.slots import rows_checksum
from stateblock.v1 import block_pb2 as pb
for line in sys.stdin:
    where_hex, layout_hex = line.split()
    where = pb.RowsLocator.FromString(bytes.fromhex(where_hex))
    layout = pb.Layout.FromString(bytes.fromhex(layout_hex))
    rows = copy_rows(where.cuda_ipc, layout)
    print(rows.device, rows_checksum(rows).hex(), flush=True)
"""


async def test_another_process_reads_the_rows_of_each_block_from_the_shared_arena():
    arena = DeviceArena(64 << 20, device="cuda", slots=4)
    try:
        shared, lines, sums = share(arena), [], []
        assert shared.mem_handle and shared.device_uuid
        for seed, (n, width) in enumerate([(512, 2688), (37, 2688)]):
            gen = torch.Generator().manual_seed(seed)
            rows = torch.randn(n, width, generator=gen).to(torch.bfloat16).cuda()
            layout = layouts.make_layout(
                f"r{seed}", [n], [8], hidden_size=width, dtype=torch.bfloat16
            )
            offset = await arena.reserve(f"b{seed}", rows_nbytes(layout), time.time() + 60, 1)
            arena.fill(offset, f"b{seed}", rows)
            where = locator.ipc_locator(ipc_placement(), shared, offset)
            lines.append(f"{where.SerializeToString().hex()} {layout.SerializeToString().hex()}")
            sums.append(rows_checksum(rows).hex())
        out = subprocess.run(
            [sys.executable, "-c", READER], input="\n".join(lines) + "\n",
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        got = [line.split() for line in out.stdout.splitlines()]
        assert [s for _, s in got] == sums, out.stderr
        assert all(device.startswith("cuda") for device, _ in got)
    finally:
        arena.close()
