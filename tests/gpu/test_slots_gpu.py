"""The local data plane's slot checksum on a CUDA GPU: computed on the device, the same 32
bytes as over the same rows in host memory (a host-plane reader checks them there), and
chosen for rows kept on the device. Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from stateblock.model.slots import rows_checksum, rows_digest, slot_algorithm
from stateblock.v1 import block_pb2 as pb

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_device_checksum_is_the_host_checksum(dtype):
    rows = torch.randn(512, 2688, generator=torch.Generator().manual_seed(0)).to(dtype)
    on_device = rows.cuda()
    assert rows_checksum(on_device) == rows_checksum(rows)
    on_device[3, 7] += 1
    assert rows_checksum(on_device) != rows_checksum(rows)


def test_rows_on_the_device_carry_the_checksum_and_host_rows_the_hash():
    rows = torch.randn(4, 8)
    assert slot_algorithm(rows.cuda(), pb.DIGEST_ALGORITHM_BLAKE3) == (
        pb.DIGEST_ALGORITHM_SLOT_CHECKSUM
    )
    assert slot_algorithm(rows, pb.DIGEST_ALGORITHM_BLAKE3) == pb.DIGEST_ALGORITHM_BLAKE3
    assert rows_digest(rows.cuda(), pb.DIGEST_ALGORITHM_SLOT_CHECKSUM) == rows_checksum(rows)
