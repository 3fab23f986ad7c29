"""Shared fixtures: a real nats-server with JetStream, one per test, on a free port."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import structlog

from stateblock.app.nats_server import NatsProcess, stop_nats_server
from stateblock.app.nats_server import start_nats_server as start_nats_server_process

# the torch engine's fixtures (served, reference, engine, captured): its CPU and GPU tests
pytest_plugins = ["tests.engine_fixtures"]


@pytest.fixture
def start_nats_server(tmp_path_factory) -> Iterator[Callable[..., NatsProcess]]:
    """Factory: start(max_payload=None) -> a running JetStream server (the same code as
    `stateblock up`'s, stateblock.app.nats_server); all stopped at teardown."""
    started: list[NatsProcess] = []

    def start(*, max_payload: int | None = None) -> NatsProcess:
        server = start_nats_server_process(tmp_path_factory.mktemp("nats"), max_payload=max_payload)
        started.append(server)
        return server

    yield start
    for server in started:
        stop_nats_server(server, timeout_s=5)


@pytest.fixture
def nats_server(start_nats_server) -> NatsProcess:
    return start_nats_server()


@pytest.fixture
def nats_url(nats_server: NatsProcess) -> str:
    return nats_server.url


@pytest.fixture(autouse=True)
def restore_structlog_config() -> Iterator[None]:
    """CLI commands under test reconfigure structlog onto the test's captured stderr; put
    the previous configuration back so later tests never log into a closed capture."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
