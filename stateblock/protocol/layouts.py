"""A block's layout: where each lane's rows lie in its packed payload, of which dtype, and
the digest the signed header commits to. The envelope (`stateblock.protocol.envelope`)
signs and checks bytes; the tensors are `stateblock.model.rows`'s business."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from stateblock.v1 import block_pb2 as pb

# Element dtypes by wire code: (name, bytes per element). The tensors themselves are
# stateblock.model.rows's business.
DTYPES: dict[int, tuple[str, int]] = {
    pb.DTYPE_FLOAT32: ("float32", 4),
    pb.DTYPE_FLOAT16: ("float16", 2),
    pb.DTYPE_BFLOAT16: ("bfloat16", 2),
}
_DTYPE_CODES = {name: code for code, (name, _) in DTYPES.items()}


class LayoutError(ValueError):
    """A layout that breaks its invariants (offsets, total_rows, lane identity, ...)."""


def dtype_code(dtype: object) -> int:
    """The wire code of a dtype given by name ("bfloat16") or by anything that prints as
    one (torch.bfloat16 prints "torch.bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_CODES:
        raise LayoutError(f"unsupported capture dtype {dtype}")
    return _DTYPE_CODES[name]


def itemsize(code: int) -> int:
    if code not in DTYPES:
        raise LayoutError(f"unknown dtype code {code}")
    return DTYPES[code][1]


def check_payload_size(data: bytes | memoryview, layout: pb.Layout) -> None:
    """Raise LayoutError unless data holds exactly the layout's rows."""
    expected = layout.total_rows * layout.hidden_size * itemsize(layout.dtype)
    if len(data) != expected:
        raise LayoutError(f"payload has {len(data)} bytes, layout needs {expected}")


def make_layout(
    request_id: str,
    row_counts: Sequence[int],
    answer_depths: Sequence[int],
    *,
    hidden_size: int,
    dtype: object,  # a name or a torch dtype, see dtype_code
    capture_mode: int = pb.CAPTURE_MODE_FINAL_HIDDEN,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    row_owners: Sequence[int] | None = None,
) -> pb.Layout:
    """One lane per row count (each lane's prompt length), offsets as the cumulative sum, in
    lane order; with `prompt_ids`, each lane's prompt tokens (a decoder that reads them).
    `row_owners[i]` is the lane whose rows lane i reads: itself, or an earlier lane of the
    same prompt (`n` > 1: the block holds its rows once, and lane i none of its own,
    `rows_of_lane` set). Without it every lane holds its own rows."""
    k = len(row_counts)
    if len(answer_depths) != k:
        raise LayoutError(f"{k} row counts but {len(answer_depths)} answer depths")
    if prompt_ids is not None and len(prompt_ids) != k:
        raise LayoutError(f"{k} row counts but {len(prompt_ids)} prompts' ids")
    owners = list(range(k)) if row_owners is None else list(row_owners)
    if len(owners) != k or any(not 0 <= o <= i or owners[o] != o for i, o in enumerate(owners)):
        raise LayoutError(f"row owners {owners} for {k} lanes: each an earlier owner or itself")
    layout = pb.Layout(hidden_size=hidden_size, dtype=dtype_code(dtype), capture_mode=capture_mode)
    offset = 0
    for i, (count, depth) in enumerate(zip(row_counts, answer_depths, strict=True)):
        lane = layout.lanes.add(request_id=request_id, lane_index=i, row_offset=offset,
                                answer_depth=depth)  # fmt: skip
        if owners[i] != i:
            if count != row_counts[owners[i]]:
                raise LayoutError(
                    f"lane {i} has {count} rows, its rows' lane {row_counts[owners[i]]}"
                )
            lane.rows_of_lane = owners[i]
            continue
        lane.row_count = count
        lane.prompt_token_ids.extend(() if prompt_ids is None else prompt_ids[i])
        offset += count
    layout.total_rows = offset
    check_layout(layout, request_id)
    return layout


def row_owners(layout: pb.Layout) -> tuple[int, ...]:
    """Each lane's lane whose rows it reads: itself, or its `rows_of_lane`."""
    return tuple(
        lane.rows_of_lane if lane.HasField("rows_of_lane") else i
        for i, lane in enumerate(layout.lanes)
    )


def lane_rows(layout: pb.Layout) -> list[pb.Lane]:
    """Each lane's lane that holds its rows and prompt ids (itself, or its rows_of_lane)."""
    return [layout.lanes[o] for o in row_owners(layout)]


def check_layout(layout: pb.Layout, request_id: str | None = None) -> None:
    """Raise LayoutError unless the layout is consistent (and, if given, all request_id's)."""
    if not layout.lanes:
        raise LayoutError("layout has no lanes")
    if layout.hidden_size <= 0:
        raise LayoutError("hidden_size must be positive")
    itemsize(layout.dtype)
    if layout.capture_mode == pb.CAPTURE_MODE_UNSPECIFIED:
        raise LayoutError("capture_mode is unspecified")
    offset = 0
    for i, lane in enumerate(layout.lanes):
        if request_id is not None and lane.request_id != request_id:
            raise LayoutError(f"lane {i} belongs to {lane.request_id!r}, not {request_id!r}")
        if lane.lane_index != i:
            raise LayoutError(f"lane {i} has lane_index {lane.lane_index}")
        if lane.answer_depth <= 0:
            raise LayoutError(f"lane {i} has answer depth {lane.answer_depth}")
        if lane.row_offset != offset:
            raise LayoutError(f"lane {i} row_offset {lane.row_offset} != cumulative {offset}")
        if lane.HasField("rows_of_lane"):
            _check_reader(layout, i)
            continue
        if lane.row_count <= 0:
            raise LayoutError(f"lane {i} has row_count {lane.row_count}")
        if len(lane.prompt_token_ids) not in (0, lane.row_count):
            raise LayoutError(
                f"lane {i} has {len(lane.prompt_token_ids)} prompt ids for {lane.row_count} rows"
            )
        if bool(lane.prompt_token_ids) != bool(layout.lanes[0].prompt_token_ids):
            raise LayoutError(f"lane {i} differs from lane 0 in carrying its prompt ids")
        offset += lane.row_count
    if layout.total_rows != offset:
        raise LayoutError(f"total_rows {layout.total_rows} != sum(row_count) {offset}")


def _check_reader(layout: pb.Layout, i: int) -> None:
    """Lane i reads an earlier lane's rows: one that holds its own, and none of i's own."""
    lane, j = layout.lanes[i], layout.lanes[i].rows_of_lane
    if j >= i or layout.lanes[j].HasField("rows_of_lane"):
        raise LayoutError(f"lane {i} reads lane {j}'s rows: not an earlier lane with rows")
    if lane.row_count or lane.prompt_token_ids:
        raise LayoutError(f"lane {i} reads lane {j}'s rows and has rows or prompt ids of its own")


def layout_digest(layout: pb.Layout) -> bytes:
    return hashlib.sha256(layout.SerializeToString(deterministic=True)).digest()
