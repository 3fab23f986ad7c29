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


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 37 * 2688, 512 * 2688 + 3])
def test_the_one_kernel_checksum_is_the_reference_sums(n):
    """The Triton kernel's four sums against the PyTorch reference's, over block edges and
    a partial last block, the top bit of the words set in some (the 0xFFFF mask)."""
    from stateblock.model.kernels import checksum
    from stateblock.model.slots import _LANES, _checksum_sums

    if not checksum.available(torch.device("cuda")):
        pytest.skip("needs Triton")
    gen = torch.Generator().manual_seed(n)
    words = torch.randint(-(1 << 15), 1 << 15, (n,), generator=gen, dtype=torch.int16).cuda()
    assert torch.equal(checksum.checksum_sums(words, _LANES), _checksum_sums(words))


def test_a_checksum_after_the_copys_event_waits_for_the_copy_alone():
    """Rows copied on the rows stream with an event: the checksum after that event is the
    rows' own, while a long matmul is still queued on the caller's stream."""
    from stateblock.model.rows import rows_stream

    rows = torch.randn(512, 2688, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    source = rows.cuda()
    torch.cuda.synchronize()
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(4):
        busy = busy @ busy  # queued on the caller's stream
    side = rows_stream(source.device)
    assert side is rows_stream(torch.device("cuda", source.device.index))  # one per GPU
    assert side.priority < torch.cuda.current_stream().priority  # ahead of the default
    with torch.cuda.stream(side):
        copy = source.clone()
    ready = torch.cuda.Event()
    ready.record(side)
    assert rows_checksum(copy, ready) == rows_checksum(rows)
    torch.cuda.synchronize()


@pytest.mark.parametrize("chunk_bytes", [4096, 1_000_003, 64 << 20])
def test_rows_copied_in_pieces_from_the_gpu_are_their_bytes(chunk_bytes):
    """The host plane's copy: pinned pieces on the rows stream, two buffers taking turns,
    the rows written just before on another stream; the pieces are the rows' bytes."""
    from stateblock.model.rows import host_chunks, rows_view

    rows = torch.randn(700, 2688, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    writer = torch.cuda.Stream()
    with torch.cuda.stream(writer):
        on_device = torch.empty_like(rows, device="cuda")
        torch.cuda._sleep(50_000_000)  # the copy must wait for this stream's write
        on_device.copy_(rows.cuda(non_blocking=False))
        pieces = b"".join(bytes(p) for p in host_chunks(on_device, chunk_bytes))
    assert pieces == bytes(rows_view(rows))
