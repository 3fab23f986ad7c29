"""free_port: ports a stopped server can take again, out of the way of outgoing connections."""

from __future__ import annotations

import socket

from stateblock.app import nats_server
from stateblock.app.nats_server import free_port


def _ephemeral() -> range:
    low, high = (int(v) for v in nats_server._EPHEMERAL.read_text().split())
    return range(low, high + 1)


def test_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if nats_server._EPHEMERAL.exists():
        assert not any(p in _ephemeral() for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_held_by_another_socket_is_not_handed_out(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(nats_server, "_outside_ephemeral", lambda: [range(taken, taken + 1)])
        port = free_port()  # the only candidate is taken: the kernel's pick instead
        assert port != taken
