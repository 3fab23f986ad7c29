"""A layout's lanes: each holds its rows at the cumulative offset, or reads an earlier lane's
(`rows_of_lane`: `n` > 1 answers of one prompt), which the payload then holds once; either
way total_rows == sum(row_count)."""

from __future__ import annotations

import pytest
import torch

from stateblock.model.rows import split_lanes
from stateblock.protocol import layouts
from stateblock.v1 import block_pb2 as pb


def layout_of(counts, owners=None, ids=None) -> pb.Layout:
    return layouts.make_layout(
        "r", counts, [4] * len(counts), hidden_size=8, dtype="float32", prompt_ids=ids,
        row_owners=owners,
    )  # fmt: skip


def test_lanes_that_read_an_earlier_lane_s_rows_hold_none():
    layout = layout_of([3, 2, 3, 3], owners=[0, 1, 0, 0])
    assert [lane.row_offset for lane in layout.lanes] == [0, 3, 5, 5]
    assert [lane.row_count for lane in layout.lanes] == [3, 2, 0, 0]
    assert [lane.HasField("rows_of_lane") for lane in layout.lanes] == [False, False, True, True]
    assert layout.total_rows == 5
    assert layouts.row_owners(layout) == (0, 1, 0, 0)
    rows = torch.arange(5 * 8, dtype=torch.float32).view(5, 8)
    lanes = split_lanes(rows, layout)
    assert [lane.tolist() for lane in lanes] == [
        r.tolist() for r in (rows[:3], rows[3:], rows[:3], rows[:3])
    ]
    plain = layout_of([3, 2, 3])
    assert [lane.row_offset for lane in plain.lanes] == [0, 3, 5] and plain.total_rows == 8
    assert layouts.row_owners(plain) == (0, 1, 2)
    assert layouts.layout_digest(layout) != layouts.layout_digest(layout_of([3, 2, 3, 3]))


def test_a_reader_carries_no_prompt_ids_of_its_own():
    layout = layout_of([2, 2], owners=[0, 0], ids=[[1, 2], [1, 2]])
    assert list(layout.lanes[1].prompt_token_ids) == [] and layout.total_rows == 2
    assert [list(lane.prompt_token_ids) for lane in layouts.lane_rows(layout)] == [[1, 2]] * 2


@pytest.mark.parametrize("owners", [[1, 1], [0, 0, 1], [0, 2, 2]])
def test_an_owner_must_be_an_earlier_lane_with_rows(owners):
    with pytest.raises(layouts.LayoutError, match="earlier owner"):
        layout_of([2] * len(owners), owners=owners)


def test_a_reader_must_have_its_rows_lane_s_length():
    with pytest.raises(layouts.LayoutError, match="lane 1 has 2 rows"):
        layout_of([3, 2], owners=[0, 0])


@pytest.mark.parametrize(
    "forge, why",
    [
        (lambda lay: setattr(lay.lanes[2], "rows_of_lane", 2), "not an earlier lane"),
        (lambda lay: setattr(lay.lanes[3], "rows_of_lane", 2), "not an earlier lane"),
        (lambda lay: setattr(lay.lanes[2], "row_count", 3), "of its own"),
        (lambda lay: lay.lanes[2].prompt_token_ids.append(1), "of its own"),
        (lambda lay: setattr(lay.lanes[3], "row_offset", 0), "!= cumulative"),
        (lambda lay: setattr(lay, "total_rows", 8), "total_rows 8"),
        (lambda lay: lay.lanes[1].ClearField("row_count"), "row_count 0"),
    ],
)
def test_a_forged_layout_is_refused(forge, why):
    layout = layout_of([3, 2, 3, 3], owners=[0, 1, 0, 0])
    forge(layout)
    with pytest.raises(layouts.LayoutError, match=why):
        layouts.check_layout(layout)
