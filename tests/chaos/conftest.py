"""The chaos suite's fixtures: the integration suite's test decoder, a 3-node JetStream
cluster, and the scale (STATEBLOCK_CHAOS_SCALE=full for the documented long run)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from stateblock.app.nats_server import (
    NatsProcess,
    start_nats_cluster,
    stop_nats_server,
    wait_for_jetstream,
)
from tests.integration.conftest import decoder_dir, engine, serving_model  # noqa: F401

FULL = os.environ.get("STATEBLOCK_CHAOS_SCALE") == "full"


def scale(small: int, full: int) -> int:
    return full if FULL else small


@pytest.fixture
def cluster(tmp_path) -> Iterator[list[NatsProcess]]:
    """Three nats-servers routed on loopback; the list is updated as tests restart nodes."""
    nodes = start_nats_cluster(tmp_path / "cluster")
    asyncio.run(wait_for_jetstream([n.url for n in nodes]))
    yield nodes
    for node in nodes:
        stop_nats_server(node, timeout_s=5)


def report(name: str, figures: dict) -> None:
    """Appended to STATEBLOCK_CHAOS_REPORT (a JSON-lines file) when set."""
    path = os.environ.get("STATEBLOCK_CHAOS_REPORT")
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps({"test": name, "full": FULL, **figures}) + "\n")
