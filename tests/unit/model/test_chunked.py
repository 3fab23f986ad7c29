"""A long lane captured a chunk at a time (stateblock.model.chunked) on the shipped base."""

import pytest
import torch

from stateblock.model.capture import backbone, capture, use_unmasked_causal_attention
from stateblock.model.chunked import (
    ChunkedLane,
    ChunkRunner,
    cache_keyword,
    new_cache,
    span_lengths,
)
from stateblock.model.loading import load_base
from tests.helpers import REFERENCE_BASE
from tests.unit.model.test_capture import tiny_nemotron_h


@pytest.fixture(scope="module")
def base():
    model, _ = load_base(REFERENCE_BASE, dtype=torch.float32)
    use_unmasked_causal_attention(model)  # as served: no mask unless one is passed
    return model


def chunked_rows(model, ids, chunk: int | None = None, runner: ChunkRunner | None = None):
    lane = ChunkedLane(model, ids, chunk, runner=runner)
    outs = [lane.step() for _ in range(lane.steps)]
    assert all(o is None for o in outs[:-1]) and lane.finished
    return outs[-1]


def interleaved(lanes: list[ChunkedLane]) -> list[torch.Tensor]:
    """Each lane's rows, their chunks run in turn: a chunk of each unfinished lane a round."""
    out: list = [None] * len(lanes)
    while not all(lane.finished for lane in lanes):
        for i, lane in enumerate(lanes):
            if not lane.finished:
                out[i] = lane.step()
    return out


@pytest.mark.parametrize("chunk", [7, 64, 100, 299])
def test_chunks_give_the_rows_of_one_forward(base, chunk):
    """Every chunk size, a last chunk shorter than the rest included: the lane's rows equal
    the one forward's up to rounding (the attention split otherwise); a chunk's queries see
    the earlier positions through the cache and their own causally."""
    ids = torch.randint(3, 60, (1, 300), generator=torch.Generator().manual_seed(1))
    whole = capture(base, ids)  # (1, 300, d)
    rows = chunked_rows(base, ids, chunk)
    assert rows.shape == whole.shape
    torch.testing.assert_close(rows, whole, atol=1e-3, rtol=1e-3)
    # the same prompt in the same chunks: the same rows, bit for bit
    assert torch.equal(rows, chunked_rows(base, ids, chunk))


def test_a_chunk_needs_its_mask(base):
    """What the chunk's all-ones mask is for: without one the served model's unmasked causal
    path hands SDPA `is_causal`, which aligns a chunk's queries with the cache's first
    positions; the rows then come out wrong."""
    ids = torch.randint(3, 60, (1, 96), generator=torch.Generator().manual_seed(2))
    whole = capture(base, ids)
    forward, cache = backbone(base).forward, new_cache(base, 96)
    key = cache_keyword(forward)
    with torch.no_grad():
        first = forward(input_ids=ids[:, :48], use_cache=True, **{key: cache}).last_hidden_state
        second = forward(input_ids=ids[:, 48:], use_cache=True, **{key: cache}).last_hidden_state
    torch.testing.assert_close(first, whole[:, :48], atol=1e-3, rtol=1e-3)
    assert (second - whole[:, 48:]).abs().max() > 0.1


def test_a_lane_refuses_what_it_cannot_run(base):
    ids = torch.ones(1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="one lane"):
        ChunkedLane(base, torch.ones(2, 10, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="at least 1"):
        ChunkedLane(base, ids, 0)
    lane = ChunkedLane(base, ids, 16)
    assert lane.steps == 1 and lane.step().shape == (1, 10, base.config.hidden_size)
    with pytest.raises(RuntimeError, match="every chunk"):
        lane.step()


def test_a_hybrid_base_is_refused():
    """NemotronH's Mamba layers carry a state no KV cache holds."""
    with pytest.raises(ValueError, match="cannot be captured in chunks"):
        new_cache(tiny_nemotron_h(), 64)


def test_the_cache_keyword_follows_the_forward_s_signature():
    def newer(input_ids=None, cache=None, **kwargs):
        pass

    def older(input_ids=None, past_key_values=None, **kwargs):
        pass

    assert cache_keyword(newer) == "cache" and cache_keyword(older) == "past_key_values"


def test_a_runner_s_caches_are_allocated_once_and_written_in_place(base):
    """The static caches: one a span (the chunk, twice it, ... up to the lane rounded up to
    whole chunks), laid out when the runner is made; every chunk writes its keys and values
    into the same tensors, against the shortest span holding it."""
    ids = torch.randint(3, 60, (1, 90), generator=torch.Generator().manual_seed(3))
    runner = ChunkRunner(base, 32, 90)  # 32 + 32 + 26 positions, spans of 32, 64 and 96
    assert runner.spans == (32, 64, 96) and span_lengths(32, 512) == [32, 64, 128, 256, 512]
    tensors = [[id(t) for t in span.kv] for span in runner._spans]
    assert [span.kv[0].shape[-2] for span in runner._spans] == [32, 64, 96]
    rows = chunked_rows(base, ids, runner=runner)
    assert [[id(t) for t in span.kv] for span in runner._spans] == tensors
    torch.testing.assert_close(rows, capture(base, ids), atol=1e-3, rtol=1e-3)


def test_lanes_sharing_a_runner_get_their_rows_alone_bit_for_bit(base):
    """One runner (chunks of 16 against caches of 16, 32, 64 and 128) for lanes of several
    lengths, run one after another and with their chunks interleaved: each lane's rows are
    those it gets through a runner of its own, bit for bit, whatever ran before it or between
    its chunks (its keys and values are put aside and back)."""
    gen = torch.Generator().manual_seed(4)
    lanes = [torch.randint(3, 60, (1, n), generator=gen) for n in (100, 37, 128, 16)]
    runner = ChunkRunner(base, 16, 120)
    assert runner.cache_len == 128 and runner.spans == (16, 32, 64, 128)  # whole chunks
    alone = [chunked_rows(base, ids, runner=ChunkRunner(base, 16, 128)) for ids in lanes]
    after = [chunked_rows(base, ids, runner=runner) for ids in lanes]
    torch.testing.assert_close(alone[0], capture(base, lanes[0]), atol=1e-3, rtol=1e-3)
    mixed = interleaved([ChunkedLane(base, ids, runner=runner) for ids in lanes])
    for a, b, c in zip(alone, after, mixed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_runner_refuses_a_lane_longer_than_its_cache(base):
    runner = ChunkRunner(base, 16, 40)  # a cache of 48
    with pytest.raises(ValueError, match="longer than the chunk runner's cache"):
        ChunkedLane(base, torch.ones(1, 49, dtype=torch.long), runner=runner)
    with pytest.raises(ValueError, match="does not fit"):
        runner.step(object(), torch.ones(1, 17, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="at least 1"):
        ChunkRunner(base, 0, 40)
