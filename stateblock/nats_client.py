"""Every service's NATS connection: a list of servers, reconnecting for as long as the
service runs, and a connection state the health endpoints and metrics follow.

nats-py stops reconnecting after 60 attempts by default (about two minutes), after which a
service stays up but dead. Here the first connection is bounded (a start-up that cannot
reach NATS fails with one clear line), and once connected the client reconnects forever,
moving to any live server of the cluster; while it is disconnected health says NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import nats
import nats.js.errors
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from stateblock import runtime, settings
from stateblock.protocol import tokens

log = structlog.get_logger("stateblock.nats")


class NatsUnreachable(ConnectionError):
    """No server of the list answered at start-up."""


def inbox_prefix(user: str) -> str:
    """Where a client of NATS user `user` gets its replies: its own inboxes, so that a user
    allowed to subscribe there reads no other user's replies (JetStream deliveries
    included)."""
    return f"_INBOX_{user}"


def parse_servers(value: str) -> tuple[str, ...]:
    """STATEBLOCK_NATS_URL: one URL or a comma-separated list (a cluster's nodes)."""
    servers = tuple(s.strip() for s in value.split(",") if s.strip())
    if not servers:
        raise ValueError("no NATS server URL")
    for s in servers:
        if "://" not in s:
            raise ValueError(f"NATS server {s!r} is not a URL (nats://host:port)")
    return servers


@dataclass(frozen=True)
class NatsOptions:
    servers: tuple[str, ...]
    connect_timeout_s: float = 2.0
    start_attempts: int = 3  # per server, at start-up only; then reconnect forever
    # between attempts at one server: a restarted nats-server is back in a fraction of a
    # second, and every client's first attempt comes too soon for it
    reconnect_wait_s: float = 0.5
    creds_file: Path | None = None  # a NATS .creds file (JWT + NKey seed)
    user: str | None = None  # a NATS user, with the password in password_file
    password_file: Path | None = field(default=None, repr=False)
    tls_ca_file: Path | None = None  # verify the servers' TLS certificates against this CA
    tls_cert_file: Path | None = None  # this client's certificate, for mutual TLS
    tls_key_file: Path | None = None

    @classmethod
    def of(cls, url: str, environ: Mapping[str, str] | None = None, **kw) -> NatsOptions:
        """The servers of `url`, with the credentials and TLS files STATEBLOCK_NATS_CREDS,
        _NATS_USER and _NATS_PASSWORD_FILE, _NATS_TLS_CA, _NATS_TLS_CERT and _NATS_TLS_KEY
        name (every service reads the same)."""
        declared = {
            "creds_file": settings.NATS_CREDS,
            "user": settings.NATS_USER,
            "password_file": settings.NATS_PASSWORD_FILE,
            "tls_ca_file": settings.NATS_TLS_CA,
            "tls_cert_file": settings.NATS_TLS_CERT,
            "tls_key_file": settings.NATS_TLS_KEY,
        }
        files = {field: s.read(environ) for field, s in declared.items()}
        files = {field: path for field, path in files.items() if path is not None}
        options = cls(servers=parse_servers(url), **{**files, **kw})
        if (options.user is None) != (options.password_file is None):
            raise runtime.ConfigError(
                "STATEBLOCK_NATS_USER and STATEBLOCK_NATS_PASSWORD_FILE go together"
            )
        return options

    def user_password(self) -> tuple[str, str] | None:
        """The user and the password its file holds (None without a user); ConfigError
        naming the file when it holds no password."""
        if self.user is None or self.password_file is None:
            return None
        try:
            password = tokens.read_token(self.password_file, "NATS password file")
        except ValueError as e:
            raise runtime.ConfigError(f"STATEBLOCK_NATS_PASSWORD_FILE: {e}") from None
        return self.user, password

    def tls_context(self) -> ssl.SSLContext | None:
        if self.tls_ca_file is None and self.tls_cert_file is None:
            return None
        context = ssl.create_default_context(
            cafile=str(self.tls_ca_file) if self.tls_ca_file else None
        )
        if self.tls_cert_file is not None:
            context.load_cert_chain(str(self.tls_cert_file), str(self.tls_key_file or ""))
        return context


@dataclass
class NatsState:
    """Whether the connection is up, for health checks; listeners hear every change."""

    name: str
    connected: bool = False
    listeners: list[Callable[[bool], Awaitable[None]]] = field(default_factory=list)
    _gauge: Gauge | None = None
    _disconnects: Counter | None = None

    @classmethod
    def with_metrics(cls, name: str, metrics: CollectorRegistry) -> NatsState:
        state = cls(name)
        state._gauge = Gauge(
            "stateblock_nats_connected", "1 while the NATS connection is up.", registry=metrics
        )
        state._disconnects = Counter(
            "stateblock_nats_disconnects", "NATS disconnections seen.", registry=metrics
        )
        return state

    async def set(self, connected: bool) -> None:
        if connected == self.connected:
            return
        self.connected = connected
        if self._gauge is not None:
            self._gauge.set(1 if connected else 0)
        if not connected and self._disconnects is not None:
            self._disconnects.inc()
        for listener in self.listeners:
            await listener(connected)


# What a JetStream call may answer while a stream's leader is being elected, or the
# connection is moving to another node: the same call may succeed a moment later.
TRANSIENT = (
    TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)

# JetStream's err_code 10158 (HTTP-like code 409), "duplicate message id is in process": a
# publish repeated under the same Nats-Msg-Id while a clustered stream's leader is still
# applying the first copy, whose ack was lost to an election. The first copy lands (its
# block commits while the retry is refused), and the same publish
# a moment later gets the duplicate ack: a delay, not an answer.
DUPLICATE_IN_PROCESS = 10158

T = TypeVar("T")


def transient(e: BaseException) -> bool:
    """A failure the same call may not meet a moment later: TRANSIENT, or a bare JetStream API
    error from a server mid-election (the 3-node chaos test saw a publish answered
    `APIError()` while the stream's leader was being killed): a plain APIError or ServerError
    without a code, with a 5xx / 408, or DUPLICATE_IN_PROCESS. Its subclasses are answers
    about the caller's request (bad request, not found, every key-value error: a lost
    compare-and-swap, a missing key) and are never retried."""
    if isinstance(e, TRANSIENT):
        return True
    if type(e) in (nats.js.errors.APIError, nats.js.errors.ServerError):
        if e.err_code == DUPLICATE_IN_PROCESS:
            return True
        return e.code is None or e.code >= 500 or e.code == 408
    return False


def describe(e: BaseException) -> str:
    """An error for a log line or a status reason: a JetStream API error's repr is a bare
    `APIError()`, its str carries the code, err_code and description."""
    if isinstance(e, nats.js.errors.APIError):
        return str(e)
    return repr(e)


async def retry_transient(
    call: Callable[[], Awaitable[T]], *, within_s: float, what: str, pause_s: float = 0.2
) -> T:
    """`call()` again after a transient JetStream failure until `within_s` has passed; the
    last failure is raised. Only for calls that are safe to repeat (a publish with a
    Nats-Msg-Id, a read, a compare-and-swap whose loser learns it lost)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    attempt = 0
    while True:
        try:
            return await call()
        except (*TRANSIENT, nats.js.errors.APIError) as e:
            if not transient(e):
                raise
            attempt += 1
            if loop.time() + pause_s >= deadline:
                raise
            log.info("jetstream call retried", what=what, attempt=attempt, error=type(e).__name__,
                     code=getattr(e, "code", None))  # fmt: skip
            await asyncio.sleep(pause_s * (0.5 + random.random()))


LIVENESS = "liveness"  # the health service name liveness probes ask


class Readiness:
    """Whether a service can take work now: its NATS connection up (the `NatsState`, when
    it has one) and every probed dependency answering (`probing`). A stalled nats-server
    keeps its TCP connection up and answers nothing, so the connection state alone never
    sees it. Listeners hear each change of `ready`."""

    def __init__(self, nats_state: NatsState | None = None) -> None:
        self._nats = nats_state
        self._failing: dict[str, str] = {}  # dependency -> why it is not answering
        self.listeners: list[Callable[[bool], Awaitable[None]]] = []
        self._said = self.ready
        if nats_state is not None:
            nats_state.listeners.append(lambda _connected: self._changed())

    @property
    def ready(self) -> bool:
        return (self._nats is None or self._nats.connected) and not self._failing

    @property
    def why(self) -> str:
        """What is not answering, for a health body ("" while ready)."""
        reasons = [] if self._nats is None or self._nats.connected else ["nats: disconnected"]
        reasons += [f"{name}: {why}" for name, why in sorted(self._failing.items())]
        return "; ".join(reasons)

    async def report(self, dependency: str, failure: str | None) -> None:
        """The latest probe of `dependency`: None when it answered in time."""
        before = self._failing.get(dependency)
        if failure is None:
            self._failing.pop(dependency, None)
        else:
            self._failing[dependency] = failure
        if before is None and failure is not None:
            log.warning("dependency not answering", dependency=dependency, why=failure)
        elif before is not None and failure is None:
            log.info("dependency answering again", dependency=dependency)
        await self._changed()

    async def _changed(self) -> None:
        ready = self.ready
        if ready != self._said:
            self._said = ready
            for listener in self.listeners:
                await listener(ready)


async def round_trip(nc: nats.NATS, timeout_s: float) -> None:
    """A PING the server answers with a PONG within timeout_s, else TimeoutError. Not
    `nc.flush(timeout)`: on its timeout it cancels the PONG's future, and the PONG that
    arrives later raises InvalidStateError in nats-py's read loop, which ends it (seen on
    nats-py 2.16 after a SIGSTOP): a connection that never reads again. This PONG's future
    is left to resolve whenever the PONG comes."""
    if not nc.is_connected:
        raise ConnectionError("not connected")
    pong = asyncio.get_running_loop().create_future()
    await nc._send_ping(pong)
    done, _ = await asyncio.wait({pong}, timeout=timeout_s)
    if not done:
        raise TimeoutError(f"no PONG within {timeout_s:g}s")


# a dependency's probe: returns once it answered, raises when it did not
Probe = Callable[[float], Awaitable[None]]
FAILING_PAUSE_S = 0.1  # between the probes of a dependency that is not answering


async def _probe_forever(readiness: Readiness, name: str, probe: Probe, timeout_s: float):
    task = asyncio.current_task()
    while True:
        try:
            await asyncio.wait_for(probe(timeout_s), timeout_s)
            failure = None
        except TimeoutError:
            failure = f"no answer within {timeout_s:g}s"
        except Exception as e:  # any failure to answer is a reason to be unready
            failure = describe(e)
        # A cancel that arrives in the loop turn the probe answers is lost by Python 3.11's
        # wait_for (it returns the probe's result); the task still says it is being
        # cancelled, so it stops here rather than probe on past its context's exit.
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        await readiness.report(name, failure)
        # while it fails, a probe is nearly always waiting: the first answer ends the stall
        await asyncio.sleep(timeout_s / 2 if failure is None else FAILING_PAUSE_S)


@asynccontextmanager
async def probing(
    readiness: Readiness, probes: Mapping[str, Probe], timeout_s: float
) -> AsyncIterator[Readiness]:
    """Each probe runs every timeout_s / 2 in a task of its own, with timeout_s to answer,
    and reports to `readiness` until the context exits: a stall shows within about
    1.5 x timeout_s, and the first answer after it ends it (a failing dependency is probed
    again at once)."""
    tasks = [
        asyncio.create_task(_probe_forever(readiness, name, probe, timeout_s), name=f"probe-{name}")
        for name, probe in probes.items()
    ]
    try:
        yield readiness
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def follow_in_health(servicer, names: tuple[str, ...], readiness: Readiness | None) -> None:
    """A gRPC health servicer says SERVING under `names` only while the service is ready
    (always, without a Readiness: an in-process test's). Its LIVENESS service says SERVING
    while the process answers at all: an outage takes a pod out of service, it does not
    restart it."""
    from grpc_health.v1 import health_pb2

    await servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)

    async def follow(ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        for name in names:
            await servicer.set(name, status)

    if readiness is not None:
        readiness.listeners.append(follow)
    await follow(readiness is None or readiness.ready)


def fail_requests_in_flight(nc: nats.NATS) -> int:
    """Fail every request waiting for a reply when the connection drops, as its timeout
    would (nats.errors.TimeoutError: its outcome unknown), and return how many. Their
    replies were addressed to the lost connection and never come, yet nats-py keeps each
    waiting its whole timeout (a JetStream call's is 5 s): a readout worker whose claim was
    in flight at a nats-server restart sat idle that long. Every caller already treats a
    timeout as "maybe landed"; the retried ones go out once the connection is back.
    nats-py (2.12 to 2.16) keeps the waiting replies in `_resp_map`; the test of a request
    in flight at a server kill (tests/integration/test_nats_client.py) fails if a later one
    does not."""
    waiting = getattr(nc, "_resp_map", None) or {}
    failed = 0
    for future in list(waiting.values()):
        if not future.done():
            future.set_exception(nats.errors.TimeoutError())
            failed += 1
    return failed


async def connect(options: NatsOptions, name: str, state: NatsState | None = None) -> nats.NATS:
    """A connection that reconnects forever once made; NatsUnreachable if none can be made."""
    state = state or NatsState(name)
    refused: list[str] = []  # the server's answer to our login, when it refused it

    async def on_error(e: Exception) -> None:
        # one line per error, no traceback: an outage is expected, not a bug
        log.warning("nats error", client=name, error=f"{type(e).__name__}: {e}")
        if "authorization violation" in str(e).lower():
            refused.append(str(e))

    async def on_disconnected() -> None:
        if nc.is_closed or nc.is_draining:  # our own shutdown, not an outage
            return
        failed = fail_requests_in_flight(nc)
        log.warning("nats disconnected", client=name, requests_failed=failed)
        await state.set(False)

    async def on_reconnected() -> None:
        log.info("nats reconnected", client=name, server=nc.connected_url.netloc)
        await state.set(True)

    login = options.user_password()
    auth = {} if login is None else {
        "user": login[0], "password": login[1], "inbox_prefix": inbox_prefix(login[0])
    }  # fmt: skip
    nc = nats.NATS()
    # nats-py can wait forever after some failures (a TLS certificate it does not trust):
    # the start-up is bounded here as well as by its attempts
    budget = (options.connect_timeout_s + options.reconnect_wait_s) * options.start_attempts
    budget = budget * len(options.servers) + 2.0
    try:
        await asyncio.wait_for(
            nc.connect(
                servers=list(options.servers),
                name=name,
                connect_timeout=options.connect_timeout_s,
                reconnect_time_wait=options.reconnect_wait_s,
                max_reconnect_attempts=options.start_attempts,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                user_credentials=str(options.creds_file) if options.creds_file else None,
                tls=options.tls_context(),
                **auth,
            ),
            budget,
        )
    except (nats.errors.NoServersError, OSError, TimeoutError) as e:
        await nc.close()
        if refused:
            who = f"user {options.user!r}" if options.user else "a client without a user"
            raise NatsUnreachable(
                f"NATS at {', '.join(options.servers)} refused {who} (Authorization "
                "Violation; STATEBLOCK_NATS_USER, STATEBLOCK_NATS_PASSWORD_FILE)"
            ) from e
        raise NatsUnreachable(
            f"no NATS server reachable at {', '.join(options.servers)} "
            f"({type(e).__name__}; STATEBLOCK_NATS_URL)"
        ) from e
    # From here on, never give up: a service outliving a long NATS outage must come back.
    nc.options["max_reconnect_attempts"] = -1
    await state.set(True)
    return nc


async def connected(
    stack: AsyncExitStack, url: str, name: str, metrics: CollectorRegistry
) -> tuple[nats.NATS, NatsState]:
    """A service process's connection (its state counted in `metrics`), drained when
    `stack` exits, and that state."""
    state = NatsState.with_metrics(name, metrics)
    nc = await connect(NatsOptions.of(url), name, state)
    stack.push_async_callback(nc.drain)
    return nc, state


async def drain_or_close(nc: nats.NATS) -> None:
    """Drain a connection on shutdown; one without a server (reconnecting) has nothing it
    could flush, and nats-py refuses to drain it, so it is closed."""
    if nc.is_connected:
        await nc.drain()
        return
    try:
        await nc.close()
    except (RuntimeError, OSError) as e:  # nats-py writes what was pending to the dead socket
        log.warning("nats connection closed without its pending writes", error=repr(e))
