"""What every service process shares: env-var parsing, logging, shutdown, metrics serving.

Configs are read once in `main()` from `STATEBLOCK_*` variables through these helpers and
passed down; nothing here is a module-level singleton.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import structlog
import structlog.tracebacks
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from stateblock.protocol import tokens

try:
    import uvloop
except ImportError:  # not built for this platform (Windows): asyncio's own loop serves
    uvloop = None

REPO = Path(__file__).resolve().parent.parent
# The shipped reference pair, package data of `stateblock` (pyproject.toml): found beside this
# module in a checkout (stateblock/reference links to models/reference), an editable install
# and an installed wheel alike.
REFERENCE = Path(__file__).resolve().parent / "reference"
REFERENCE_BASE = REFERENCE / "base"
REFERENCE_DECODER = REFERENCE / "decoder"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_MODEL_NAME = "stateblock-reference"
# Matches the Helm chart's terminationGracePeriodSeconds minus headroom for nc.drain().
DEFAULT_GRACE_S = 10.0
# readiness fails when NATS (or the gateway's capture) has not answered a round trip in this
# long; each is probed every half of it (stateblock.nats_client.probing)
DEFAULT_READY_TIMEOUT_S = 2.0
# The capture's and the worker's stage histograms share buckets, so one request's stages
# read side by side (from sub-millisecond: a block's digest, claim and ack are that short).
STAGE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
# The event loop is asked to wake every LOOP_LAG_PERIOD_S; how late it wakes is how long
# something held it (a synchronous call on the loop, the GIL held by another thread).
LOOP_LAG_PERIOD_S = 0.01
LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


def stage_histogram(
    name: str, help_: str, registry: CollectorRegistry, labels: tuple[str, ...] = ()
) -> Histogram:
    """A service's time by stage (label `stage`, then `labels`), in STAGE_BUCKETS_S."""
    return Histogram(name, help_, ["stage", *labels], buckets=STAGE_BUCKETS_S, registry=registry)


class ConfigError(ValueError):
    """A STATEBLOCK_* variable that cannot be used; the service refuses to start."""


def capture_token(path: Path | None) -> str | None:
    """The capture token in the file STATEBLOCK_CAPTURE_TOKEN_FILE names (None: no file
    named), read once at start-up; a ConfigError naming the variable when it holds none."""
    if path is None:
        return None
    try:
        return tokens.read_token(path)
    except ValueError as e:
        raise ConfigError(f"STATEBLOCK_CAPTURE_TOKEN_FILE: {e}") from None


class Env:
    """Typed reads of STATEBLOCK_<NAME> from one mapping (os.environ by default)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if environ is None else environ

    def _raw(self, name: str) -> str | None:
        value = self._env.get(f"STATEBLOCK_{name}")
        return None if value is None or value == "" else value

    def str(self, name: str, default: str) -> str:
        raw = self._raw(name)
        return default if raw is None else raw

    def optional_str(self, name: str) -> str | None:
        return self._raw(name)

    def optional_path(self, name: str) -> Path | None:
        raw = self._raw(name)
        return None if raw is None else Path(raw)

    def path(self, name: str, default: Path) -> Path:
        raw = self._raw(name)
        return default if raw is None else Path(raw)

    def int(self, name: str, default: int, *, minimum: int | None = None) -> int:
        raw = self._raw(name)
        try:
            value = default if raw is None else int(raw)
        except ValueError as e:
            raise ConfigError(f"STATEBLOCK_{name}={raw!r} is not an integer") from e
        if minimum is not None and value < minimum:
            raise ConfigError(f"STATEBLOCK_{name}={value} is below {minimum}")
        return value

    def float(
        self, name: str, default: float, *, positive: bool = True, zero_ok: bool = False
    ) -> float:
        raw = self._raw(name)
        try:
            value = default if raw is None else float(raw)
        except ValueError as e:
            raise ConfigError(f"STATEBLOCK_{name}={raw!r} is not a number") from e
        if zero_ok and value == 0:
            return value
        if positive and not value > 0:
            raise ConfigError(f"STATEBLOCK_{name}={value} must be positive")
        return value


# gRPC servers bind their port alone: with SO_REUSEPORT (grpc's default) a second instance
# on the same port would silently take a share of the calls instead of failing to start.
GRPC_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


class _Undecodable:
    def __init__(self, error: Exception) -> None:
        self.error = error


def _refuse_undecodable():
    """A server interceptor: a request whose bytes do not parse as the method's message is
    INVALID_ARGUMENT with the parse error, not grpc's UNKNOWN "Exception deserializing"."""
    import grpc

    async def abort(request: _Undecodable, context) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.error}"
        )

    class RefuseUndecodable(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, handler_call_details):
            handler = await continuation(handler_call_details)
            if handler is None or handler.request_streaming or not handler.request_deserializer:
                return handler
            parse = handler.request_deserializer

            def deserialize(data: bytes):
                try:
                    return parse(data)
                except Exception as e:  # noqa: BLE001 - any parse failure is the client's
                    return _Undecodable(e)

            if handler.unary_unary is not None:
                inner = handler.unary_unary

                async def unary_unary(request, context):
                    if isinstance(request, _Undecodable):
                        await abort(request, context)
                    return await inner(request, context)

                return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await abort(request, context)
                async for reply in inner_stream(request, context):
                    yield reply

            return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)

    return RefuseUndecodable()


def grpc_server(interceptors=(), *, max_connection_age_s: float = 0.0):
    """A grpc.aio server as every service runs one: its port alone (no SO_REUSEPORT), and
    undecodable requests refused as INVALID_ARGUMENT. With `max_connection_age_s` a client's
    connection is closed (GOAWAY) after that long, calls in flight given as long again, so
    clients resolve the address again and reach replicas that came up since."""
    import grpc

    options = list(GRPC_SERVER_OPTIONS)
    if max_connection_age_s > 0:
        age_ms = int(max_connection_age_s * 1000)
        options += [("grpc.max_connection_age_ms", age_ms),
                    ("grpc.max_connection_age_grace_ms", age_ms)]  # fmt: skip
    return grpc.aio.server(interceptors=[_refuse_undecodable(), *interceptors], options=options)


def grpc_bind(server, host: str, port: int, what: str, tls: tuple[Path, Path] | None = None) -> int:
    """Bind the port (TLS from (certificate, key) PEM files when given), with a port in use
    as one clear error (grpc says 0 or raises)."""
    try:
        if tls is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            import grpc

            cert, key = (Path(f).read_bytes() for f in tls)
            credentials = grpc.ssl_server_credentials([(key, cert)])
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError as e:
        raise OSError(f"{what}: cannot listen on {host}:{port} (in use?)") from e
    if bound == 0:
        raise OSError(f"{what}: cannot listen on {host}:{port} (in use?)")
    return bound


def check_redelivery(ack_wait_s: float, request_timeout_s: float) -> None:
    """Redelivery well inside the request deadline: a block a dead worker held is redelivered
    after ack_wait_s and must still be read before its request gives up."""
    if 2 * ack_wait_s > request_timeout_s:
        raise ConfigError(
            f"STATEBLOCK_ACK_WAIT_S={ack_wait_s:g} must be at most half of "
            f"STATEBLOCK_REQUEST_TIMEOUT_S={request_timeout_s:g}: a block a dead worker held "
            "is redelivered only after it"
        )


def model_name(name: str) -> str:
    """STATEBLOCK_MODEL_NAME: any Hugging Face-style name ("org/model-v2.1"); its NATS token
    is derived from it (stateblock.protocol.streams.model_token)."""
    if not name or len(name) > 256 or any(c.isspace() or not c.isprintable() for c in name):
        raise ConfigError(
            f"STATEBLOCK_MODEL_NAME={name!r} must be 1 to 256 printable characters, no spaces"
        )
    return name


def blocks_storage(value: str) -> str:
    """STATEBLOCK_BLOCKS_STORAGE: the blocks work queue's JetStream storage."""
    from stateblock.protocol.streams import BLOCKS_STORAGE

    if value not in BLOCKS_STORAGE:
        choices = " or ".join(repr(k) for k in BLOCKS_STORAGE)
        raise ConfigError(f"STATEBLOCK_BLOCKS_STORAGE={value!r} must be {choices}")
    return value


def data_plane(value: str) -> str:
    """STATEBLOCK_DATA_PLANE: how a block's rows travel (stateblock.protocol.locator)."""
    from stateblock.protocol.locator import DATA_PLANES

    if value not in DATA_PLANES:
        raise ConfigError(f"STATEBLOCK_DATA_PLANE={value!r} must be {', '.join(DATA_PLANES)}")
    return value


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit
_TRIM_THRESHOLD = 1 << 30


def keep_freed_buffers() -> bool:
    """Have glibc serve multi-MB buffers from the heap and keep freed ones (process-wide,
    idempotent; False where libc is not glibc).

    Every request copies its state block, 2.75 MB at the full scale, a few times (rows to
    bytes, protobuf, the NATS command, the parse on the worker). By default glibc maps each
    such buffer fresh and unmaps it when freed, so every copy pays a page fault per 4 KiB
    page: under those defaults, most of nats-py's publish command build (docs/BENCHMARKS.md,
    the CPU wire section)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )


def configure_logging(level: str = "info") -> None:
    """structlog JSON lines on stderr; request_id / block_id come from bound contextvars."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            # tracebacks as data, without their frames' locals: those hold block headers,
            # signatures and rows, which no log line may carry
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        # Not cached: a cached logger keeps the stream and config of its first call, so a
        # later configure (a CLI run inside tests, a level change) would not reach it.
        cache_logger_on_first_use=False,
    )


EVENT_LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def event_loop_choice(env: Mapping[str, str] | None = None) -> str:
    """`STATEBLOCK_EVENT_LOOP`: "uvloop" or "asyncio" ("auto", the default: uvloop where
    it is installed). Raises ConfigError for another value, or uvloop where it is missing."""
    from stateblock.settings import EVENT_LOOP

    value = EVENT_LOOP.read(env).strip().lower() or EVENT_LOOP.default
    if value not in EVENT_LOOPS:
        raise ConfigError(f"STATEBLOCK_EVENT_LOOP={value!r}: one of {', '.join(EVENT_LOOPS)}")
    if value == "auto":
        return "uvloop" if uvloop is not None else "asyncio"
    if value == "uvloop" and uvloop is None:
        raise ConfigError("STATEBLOCK_EVENT_LOOP=uvloop, but uvloop is not installed")
    return value


def run(main: Coroutine[Any, Any, T], env: Mapping[str, str] | None = None) -> T:
    """`asyncio.run(main)` on the event loop `event_loop_choice` names.

    uvloop (libuv; what vLLM's and uvicorn's servers run on) moves a 2.75 MB state block
    through a socket with fewer copies and loop turns than asyncio's selector loop (the
    publish-to-worker hop: docs/BENCHMARKS.md). grpc.aio, nats-py and uvicorn all run on it.
    """
    try:
        choice = event_loop_choice(env)
    except ConfigError:
        main.close()  # never awaited: say so quietly, not as a RuntimeWarning
        raise
    if choice == "uvloop":
        assert uvloop is not None
        return uvloop.run(main)
    return asyncio.run(main)


def service_started(log_level: str) -> tuple[asyncio.Event, CollectorRegistry]:
    """What a service process's main sets up first: its logs, the event SIGINT or SIGTERM
    sets, and the registry its metrics go in (call from inside the running loop)."""
    configure_logging(log_level)
    return shutdown_event(), CollectorRegistry()


def discard_outcome(future: asyncio.Future) -> None:
    """A done callback for a future whose outcome nobody awaits any more: its exception is
    retrieved, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


def drained(queue: asyncio.Queue) -> list:
    """What is left in `queue`, taken out of it."""
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def stop_serving(
    tasks: Sequence[asyncio.Task],
    why: str,
    waiting: Callable[[], Iterable[Any]],
    *started: asyncio.Task,
) -> None:
    """Stop the tasks that serve a queue and the tasks they `started`, then fail each item
    `waiting()` gives (what still waits, asked once they have stopped) through its `future`
    with RuntimeError(why): no caller waits on a stopped loop. A serving task's own error,
    when it died of one, is raised."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, *started, return_exceptions=True)
    for item in waiting():
        if not item.future.done():
            item.future.set_exception(RuntimeError(why))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()


def shutdown_event() -> asyncio.Event:
    """An Event set by SIGINT or SIGTERM (call from inside the running loop)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


@asynccontextmanager
async def loop_lag(
    metrics: CollectorRegistry, period_s: float = LOOP_LAG_PERIOD_S
) -> AsyncIterator[Histogram]:
    """`stateblock_event_loop_lag_seconds` of this process's event loop, observed every
    `period_s` while the block runs: a request's latency beside a stall it did not cause
    shows up here as one late wake-up."""
    lag = Histogram(
        "stateblock_event_loop_lag_seconds",
        f"How late the event loop woke from a {period_s * 1000:g} ms sleep: how long it was "
        "held (a synchronous call on the loop, or the GIL held by another thread).",
        buckets=LOOP_LAG_BUCKETS_S,
        registry=metrics,
    )

    async def watch() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(period_s)
            lag.observe(max(0.0, loop.time() - t0 - period_s))

    task = asyncio.create_task(watch(), name="loop-lag")
    try:
        yield lag
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@asynccontextmanager
async def metrics_server(
    metrics: CollectorRegistry, port: int | None, host: str = "127.0.0.1"
) -> AsyncIterator[int | None]:
    """Serve /metrics of `registry` on its own port (services without an HTTP app)."""
    if port is None:
        yield None
        return
    server, thread = start_http_server(port, addr=host, registry=metrics)
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        await asyncio.to_thread(thread.join, 5)
