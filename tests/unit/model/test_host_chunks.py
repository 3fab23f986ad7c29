"""The host data plane's rows in pieces: the pieces are the rows' bytes in order, none over
its bound, and hashed piece by piece they give the whole rows' digest."""

from __future__ import annotations

import pytest
import torch

from stateblock.model.rows import host_chunks, rows_view
from stateblock.protocol import envelope
from stateblock.v1 import block_pb2 as pb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 96, 97, 10_000])
def test_the_pieces_are_the_rows_bytes_in_order(dtype, chunk_bytes):
    rows = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    pieces = [bytes(p) for p in host_chunks(rows, chunk_bytes)]
    assert b"".join(pieces) == bytes(rows_view(rows))
    assert all(0 < len(p) <= chunk_bytes for p in pieces)
    assert len(pieces) == -(-rows.numel() * rows.element_size() // chunk_bytes)


def test_rows_not_contiguous_give_their_packed_bytes():
    rows = torch.randn(8, 6).t()  # (6, 8), column-major in memory
    assert b"".join(host_chunks(rows, 13)) == bytes(rows_view(rows))


def test_no_rows_give_no_pieces():
    assert list(host_chunks(torch.zeros(0, 8), 16)) == []


@pytest.mark.parametrize("algorithm", [pb.DIGEST_ALGORITHM_BLAKE3, pb.DIGEST_ALGORITHM_SHA256])
def test_hashed_in_pieces_the_digest_is_the_whole_rows(algorithm):
    rows = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    whole = envelope.forward_state_digest(rows_view(rows), algorithm)
    nbytes = rows.numel() * rows.element_size()
    hasher = envelope.forward_state_hasher(algorithm, nbytes)
    for piece in host_chunks(rows, 1000):
        hasher.update(piece)
    assert hasher.digest() == whole
    rows[299, 63] += 1
    assert envelope.forward_state_digest(rows_view(rows), algorithm) != whole


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown forward-state digest algorithm"):
        envelope.forward_state_hasher(99)
