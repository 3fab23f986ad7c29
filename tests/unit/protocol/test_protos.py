"""The stateblock.v1 protos: buf lint, buf format, and checked-in generated code not stale."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stateblock.tools import protogen

REPO = protogen.REPO_ROOT


def buf_binary() -> str:
    # The buf-bin wheel installs the binary beside the interpreter (the venv's bin dir).
    beside = Path(sys.executable).parent / "buf"
    found = str(beside) if beside.exists() else shutil.which("buf")
    if found is None:
        pytest.fail("buf not found: install the dev extra (buf-bin)")
    return found


def run_buf(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    # A private cache dir: buf must not need a writable $HOME in CI.
    env = {**os.environ, "BUF_CACHE_DIR": str(cache)}
    return subprocess.run(
        [buf_binary(), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_buf_lint(tmp_path):
    result = run_buf("lint", cache=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_format(tmp_path):
    result = run_buf("format", "--diff", "--exit-code", cache=tmp_path)
    assert result.returncode == 0, "run `buf format -w`:\n" + result.stdout + result.stderr


# The released API (tests/data/protos-v1-baseline.binpb, `buf build -o` of the protos before
# this list began) and every break from it made on purpose; any other break fails.
BASELINE = REPO / "tests" / "data" / "protos-v1-baseline.binpb"
INTENDED_BREAKS = {
    # max_tokens travels once: as the lane's answer_depth (field 3 reserved)
    'block.proto: Previously present field "3" with name "max_tokens" on message '
    '"SamplingParams" was deleted.',
}


def test_buf_breaking_reports_only_the_intended_changes(tmp_path):
    result = run_buf("breaking", "--against", str(BASELINE), cache=tmp_path)
    found = set()
    for line in result.stdout.splitlines():
        path, _, rest = line.partition(":")
        found.add(f"{Path(path).name}: {rest.split(':', 2)[-1]}")
    assert found == INTENDED_BREAKS, result.stdout + result.stderr


def test_generated_code_is_current(tmp_path):
    fresh = protogen.generate(tmp_path)
    checked_in = protogen.generated_files(REPO)
    assert fresh == checked_in, (
        "generated file set differs: run `python -m stateblock.tools.protogen`"
    )
    stale = [p for p in fresh if (tmp_path / p).read_bytes() != (REPO / p).read_bytes()]
    assert not stale, f"stale generated code {stale}: run `python -m stateblock.tools.protogen`"


def test_every_proto_is_generated():
    names = {p.stem for p in protogen.proto_files()}
    assert names == {"block", "capture", "commit", "gateway"}
    for name in names:
        assert (REPO / protogen.PACKAGE_DIR / f"{name}_pb2.py").exists()


def test_generated_modules_import_and_round_trip():
    from stateblock.v1 import block_pb2, capture_pb2_grpc, commit_pb2, gateway_pb2_grpc

    assert hasattr(gateway_pb2_grpc, "GatewayStub") and hasattr(capture_pb2_grpc, "CaptureStub")
    lane = block_pb2.Lane(request_id="r", lane_index=0, row_offset=0, row_count=3, answer_depth=8)
    layout = block_pb2.Layout(lanes=[lane], total_rows=3, hidden_size=16)
    assert block_pb2.Layout.FromString(layout.SerializeToString()) == layout
    answer = commit_pb2.LaneAnswer(token_ids=[5, 6], eos_pos=2, top2_margins=[0.5, 1.5])
    assert commit_pb2.LaneAnswer.FromString(answer.SerializeToString()) == answer
