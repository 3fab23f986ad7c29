"""A layout's offsets: each lane's rows its own, at the cumulative offset, or an earlier lane's
(`n` > 1 answers of one prompt), which the payload then holds once."""

from __future__ import annotations

import pytest

from stateblock.protocol import layouts
from stateblock.v1 import block_pb2 as pb


def layout_of(counts, owners=None, ids=None) -> pb.Layout:
    return layouts.make_layout(
        "r", counts, [4] * len(counts), hidden_size=8, dtype="float32", prompt_ids=ids,
        row_owners=owners,
    )  # fmt: skip


def test_lanes_that_read_an_earlier_lane_s_rows_add_none():
    layout = layout_of([3, 2, 3, 3], owners=[0, 1, 0, 0])
    assert [lane.row_offset for lane in layout.lanes] == [0, 3, 0, 0]
    assert layout.total_rows == 5
    assert layouts.row_owners(layout) == (0, 1, 0, 0)
    plain = layout_of([3, 2, 3])
    assert [lane.row_offset for lane in plain.lanes] == [0, 3, 5] and plain.total_rows == 8
    assert layouts.row_owners(plain) == (0, 1, 2)
    assert layouts.layout_digest(layout) != layouts.layout_digest(layout_of([3, 2, 3, 3]))


@pytest.mark.parametrize(
    "owners, why",
    [([1, 1], "earlier owner"), ([0, 0, 1], "earlier owner"), ([0, 2, 2], "earlier owner")],
)
def test_an_owner_must_be_an_earlier_owning_lane(owners, why):
    with pytest.raises(layouts.LayoutError, match=why):
        layout_of([2] * len(owners), owners=owners)


def test_a_lane_that_shares_rows_must_share_their_count_and_prompt():
    with pytest.raises(layouts.LayoutError, match="neither the cumulative"):
        layout_of([3, 2], owners=[0, 0])  # 2 rows cannot be lane 0's 3
    with pytest.raises(layouts.LayoutError, match="not its prompt ids"):
        layout_of([2, 2], owners=[0, 0], ids=[[1, 2], [1, 3]])
    shared = layout_of([2, 2], owners=[0, 0], ids=[[1, 2], [1, 2]])
    assert shared.total_rows == 2


def test_a_forged_offset_or_total_is_refused():
    layout = layout_of([3, 2, 3], owners=[0, 1, 0])
    layout.lanes[2].row_offset = 1  # inside lane 0's rows, not at their start
    with pytest.raises(layouts.LayoutError, match="neither the cumulative"):
        layouts.check_layout(layout)
    layout = layout_of([3, 2, 3], owners=[0, 1, 0])
    layout.total_rows = 8  # as if lane 2 had rows of its own
    with pytest.raises(layouts.LayoutError, match="total_rows 8"):
        layouts.check_layout(layout)
