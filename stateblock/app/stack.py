"""The one composition root: nats-server + capture + N readout workers + gateway.

`stateblock up`, the benches, the determinism audit and the test fixtures all assemble the
request path here. Everything but nats-server runs in this process on one event loop: the
base model is loaded once and shared by the capture service (its forward) and the readout
engine (its lm_head). Each service is the same async context manager its own `python -m`
entry point uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import nats
import structlog
from prometheus_client import CollectorRegistry

from stateblock import runtime, settings
from stateblock.app import nats_auth
from stateblock.app.nats_server import NatsServerLost, supervised_nats_server
from stateblock.app.plan import IN_PROCESS, WIRING, Ports, StackPlan, Wiring
from stateblock.nats_client import NatsOptions, NatsState, connect, drain_or_close
from stateblock.protocol import streams
from stateblock.settings import CAPTURE, GATEWAY, READOUT, Setting

if TYPE_CHECKING:
    from readout_svc.config import ReadoutServiceConfig
    from stateblock.engines import ReadoutEngine
    from stateblock.model.loading import ServingModel
    from stateblock.protocol.keys import Signer, TrustStore

log = structlog.get_logger("stateblock.up")
T = TypeVar("T")


@dataclass(frozen=True)
class UpConfig:
    data_dir: Path = settings.DATA_DIR.default
    host: str = settings.GATEWAY_HOST.default_for(settings.UP)
    http_port: int = settings.HTTP_PORT.default
    grpc_port: int = settings.GRPC_PORT.default
    capture_port: int = 0
    workers: int | None = settings.WORKERS.default  # None: the readout chooses by its engine
    model_name: str = settings.MODEL_NAME.default
    base_dir: Path = settings.BASE_DIR.default
    decoder_dir: Path = settings.DECODER_DIR.default
    engine: str = settings.ENGINE.default
    # None: start our own nats-server in data_dir; or a list
    nats_url: str | None = settings.NATS_URL.default_for(settings.UP)
    # copies of every stream and bucket (3 on a 3-node cluster)
    nats_replicas: int = settings.NATS_REPLICAS.default
    api_key: str | None = field(default=None, repr=False)  # required on the API when set
    nats_max_payload: int | None = None
    request_timeout_s: float = settings.REQUEST_TIMEOUT_S.default
    grace_s: float = 5.0
    blocks_storage: str = settings.BLOCKS_STORAGE.default  # the blocks work queue
    forward_state_digest: str = settings.FORWARD_STATE_DIGEST.default  # the blocks' row hash
    batch_window_s: float | None = None  # None: the capture service's default
    capture_compile: str | None = settings.CAPTURE_COMPILE.default  # None: per device
    # local: the rows stay on the capture's device in a slot pool this process's workers read
    data_plane: str = settings.DATA_PLANE.default_for(settings.UP)
    # `cpu`, `cuda` or `auto` (a CUDA device where there is one): where the model is loaded
    # when none is handed to the stack; on a GPU the base model is bfloat16 unless set, and
    # engine `auto` is `torch` (`reference` on the CPU)
    device: str = "cpu"
    # every other setting a service reads that `up` neither reads itself nor wires (its
    # STATEBLOCK_* variables, `environment_settings`): each given to the services reading it
    service_settings: Mapping[Setting, str] = field(default_factory=dict)
    # One NATS connection per service, as separate processes have (the benches): on a
    # shared one the capture's publish ack queues behind the delivery of the same block
    # to a worker, both read by one client loop. Always so on the stack's own nats-server,
    # where each service is its own NATS user.
    connection_per_service: bool = False

    @classmethod
    def on_free_ports(cls, data_dir: Path, **kw: Any) -> UpConfig:
        """The stack in `data_dir` with its HTTP and gRPC ports free ones (the benches', the
        determinism audit's and the tests' stacks)."""
        return cls(data_dir=data_dir, http_port=0, grpc_port=0, **kw)

    def plan(self) -> StackPlan:
        """The stack `stateblock up` runs: every service in this process."""
        values = {
            settings.NATS_REPLICAS: self.nats_replicas,
            settings.MODEL_NAME: self.model_name,
            settings.BASE_DIR: self.base_dir,
            settings.DECODER_DIR: self.decoder_dir,
            settings.GRACE_S: self.grace_s,
            settings.ENGINE: self.engine,
            settings.WORKERS: self.workers,
            settings.REQUEST_TIMEOUT_S: self.request_timeout_s,
            settings.API_KEY: self.api_key,
            settings.BLOCKS_STORAGE: self.blocks_storage,
            settings.FORWARD_STATE_DIGEST: self.forward_state_digest,
            settings.CAPTURE_COMPILE: self.capture_compile,
            settings.BATCH_WINDOW_S: self.batch_window_s,  # None: the capture's default
            settings.DATA_PLANE: self.data_plane,
            settings.DEVICE: resolve_device(self.device),
        }
        on_gpu = values[settings.DEVICE] != "cpu"
        if on_gpu:  # a GPU's dtype, unless the settings say one
            values[settings.CAPTURE_DTYPE] = "bfloat16"
        if self.engine == "auto":  # the GPU's fast path there, the reference on the CPU
            fast = on_gpu and not self._reads_prompt_ids()  # which the torch engine does not
            values[settings.ENGINE] = "torch" if fast else "reference"
        values.update(self.service_settings)
        return StackPlan(
            data_dir=self.data_dir.resolve(),
            placement=IN_PROCESS,
            nats_url=self.nats_url,
            nats_max_payload=self.nats_max_payload,
            host=self.host,
            ports=Ports(http=self.http_port, grpc=self.grpc_port, capture=(self.capture_port,)),
            values=values,
        )

    def _reads_prompt_ids(self) -> bool:
        from stateblock.protocol.manifest import MANIFEST, read_manifest, reads_prompt_ids

        found = (Path(self.decoder_dir) / MANIFEST).exists()  # a missing one fails later, clearly
        return found and reads_prompt_ids(read_manifest(self.decoder_dir))

    def check(self) -> StackPlan:
        """The plan, with every service's config read from it as the service will read it
        (provisional wiring in the data dir); raises runtime.ConfigError or ValueError, so a
        setting no service could start with stops `up` before anything starts."""
        plan = self.plan()
        d = plan.data_dir
        wiring = Wiring(plan.nats_url or runtime.DEFAULT_NATS_URL, d / "keys", d / "readout-keys",
                        d / "capture-token", capture_port=1)  # fmt: skip
        for service in plan.services():
            if service.component in settings.SERVICES:
                plan.config(service, wiring)
        return plan


@dataclass(frozen=True)
class StackUrls:
    http: str
    grpc: str
    nats: str
    key_id: str
    # resolves when the stack's own nats-server exited and could not be restarted (None
    # when the stack uses a NATS it did not start)
    nats_lost: asyncio.Future[NatsServerLost] | None = field(default=None, compare=False)
    # `nats` with the admin user's password in it (tools and tests; no service uses it):
    # the stack's own nats-server admits its users only; `nats` itself on another NATS
    nats_admin: str = field(default="", repr=False)


@dataclass(frozen=True)
class _Credentials:
    """The stack's keys and token, generated in its data dir on first run."""

    key_dir: Path  # the capture's block-signing key
    signer: Signer
    trust: TrustStore
    readout_key_dir: Path  # the readout's commit-signing key
    readout_signer: Signer
    readout_trust: TrustStore
    token_file: Path  # the gateway's credential at the capture
    nats_passwords: dict[str, Path]  # each component's (and the admin's) at its own NATS


def _credentials(data_dir: Path) -> _Credentials:
    from stateblock.protocol.keys import TrustStore, load_or_generate_signer
    from stateblock.protocol.tokens import load_or_generate_token

    key_dir, readout_key_dir = data_dir / "keys", data_dir / "readout-keys"
    token_file = data_dir / "capture-token"
    load_or_generate_token(token_file)
    return _Credentials(
        key_dir=key_dir,
        signer=load_or_generate_signer(key_dir),
        trust=TrustStore.from_dir(key_dir),
        readout_key_dir=readout_key_dir,
        readout_signer=load_or_generate_signer(readout_key_dir),
        readout_trust=TrustStore.from_dir(readout_key_dir),
        token_file=token_file,
        nats_passwords=nats_auth.password_files(data_dir),
    )


def credentials_wiring(data_dir: Path, nats_url: str) -> Wiring:
    """The wiring of a stack in `data_dir`: its keys and token generated there on first run
    (before any service reads its trust store), and its NATS."""
    return _wiring(_credentials(data_dir), nats_url)


def _wiring(creds: _Credentials, nats_url: str) -> Wiring:
    return Wiring(nats_url, creds.key_dir, creds.readout_key_dir, creds.token_file)


def resolve_device(device: str) -> str:
    """`auto`: `cuda` where torch sees a CUDA device, else `cpu`; `cpu`, `cuda` and `cuda:N`
    as given, when this machine has that device; raises runtime.ConfigError otherwise."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise runtime.ConfigError(f"STATEBLOCK_DEVICE={device!r} must be auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available() or int(index or 0) >= torch.cuda.device_count():
        raise runtime.ConfigError(
            f"STATEBLOCK_DEVICE={device}: this machine has no such CUDA device"
        )
    return device


def environment_settings(environ: Mapping[str, str]) -> dict[Setting, str]:
    """`UpConfig.service_settings` from `environ`: the STATEBLOCK_* variables set there of
    the settings a service reads that `up` neither reads itself (its flags, NATS login,
    event loop) nor wires (ports, keys, addresses)."""
    return {
        setting: environ[setting.name]
        for setting in settings.SETTINGS
        if environ.get(setting.name)
        and set(setting.readers) & set(settings.SERVICES)
        and settings.UP not in setting.readers
        and setting not in WIRING
    }


async def _served(
    plan: StackPlan,
    readout: ReadoutServiceConfig,
    model: ServingModel | None,
    engine: ReadoutEngine | None,
) -> tuple[ServingModel, ReadoutEngine]:
    """The given model and engine, else the plan's base model on its device (in its capture
    dtype) and its engine there with the readout's engine settings."""
    from stateblock.engines import create_engine, require_engine
    from stateblock.model.loading import load_serving_model, parse_dtype

    if engine is None:
        require_engine(readout.engine)
    if model is None:
        dtype = parse_dtype(plan.value(settings.CAPTURE_DTYPE))
        model = await asyncio.to_thread(
            load_serving_model, readout.model_name, readout.base_dir, readout.decoder_dir,
            device=readout.device, dtype=dtype,
        )  # fmt: skip
    if engine is None:
        engine = create_engine(readout.engine, model, readout.device, **readout.engine_kwargs())
    return model, engine


async def _nats(
    stack: AsyncExitStack, plan: StackPlan, creds: _Credentials
) -> tuple[str, asyncio.Future[NatsServerLost] | None]:
    """The plan's NATS URL, starting the stack's own server (restarted on its port and
    store whenever it exits, admitting the stack's NATS users only) when the plan names
    none."""
    if plan.nats_url is not None:
        return plan.nats_url, None
    supervisor = await stack.enter_async_context(
        supervised_nats_server(
            plan.data_dir,
            max_payload=plan.nats_max_payload,
            authorization=nats_auth.server_authorization(creds.nats_passwords),
        )
    )
    url = supervisor.server.url
    # a store from an earlier version: what only the admin may change, before the services
    admin = await nats.connect(nats_auth.login_url(url, creds.nats_passwords[nats_auth.ADMIN]))
    try:
        if await streams.upgrade_blocks_stream(admin.jetstream()):
            log.info("blocks stream upgraded", change="per-message TTL on")
    finally:
        await admin.close()
    return url, supervisor.lost


class _Connections:
    """One NATS connection for the stack, or one per service (`connection_per_service`, and
    always with `logins`: each service connects as its own user, its password in the file
    `logins[service]`)."""

    def __init__(
        self,
        stack: AsyncExitStack,
        url: str,
        metrics: CollectorRegistry,
        per_service: bool,
        logins: dict[str, Path] | None = None,
    ) -> None:
        self._stack, self._url, self._metrics = stack, url, metrics
        self._per_service, self._logins = per_service or logins is not None, logins
        self._conns: list[tuple[nats.NATS, NatsState]] = []

    async def __call__(self, service: str) -> tuple[nats.NATS, NatsState]:
        if self._conns and not self._per_service:
            return self._conns[0]
        login = (
            {}
            if self._logins is None
            else {"user": service, "password_file": self._logins[service]}
        )
        options = NatsOptions.of(self._url, **login)
        # the first connection's state is the stack's metric; health follows each one
        first = not self._conns
        state = NatsState.with_metrics("stateblock", self._metrics) if first else NatsState(service)
        nc = await connect(options, f"stateblock-{service}", state)
        self._stack.push_async_callback(drain_or_close, nc)
        self._conns.append((nc, state))
        return self._conns[-1]


@asynccontextmanager
async def running_stack(
    config: UpConfig,
    *,
    metrics: CollectorRegistry | None = None,
    model: ServingModel | None = None,
    engine: ReadoutEngine | None = None,
) -> AsyncIterator[StackUrls]:
    """Every service of the request path, ready when this yields; stopped in reverse order.

    `model` and `engine`, when given, are served instead of loading config.base_dir on
    config.device with config.engine (the GPU benches build both themselves)."""
    from capture_svc.server import running_capture
    from gateway.server import running_gateway
    from readout_svc.server import running_readout

    plan = (config if engine is None else dataclasses.replace(config, engine=engine.name)).plan()
    metrics = CollectorRegistry() if metrics is None else metrics
    plan.data_dir.mkdir(parents=True, exist_ok=True)
    creds = _credentials(plan.data_dir)
    async with AsyncExitStack() as stack:
        nats_url, nats_lost = await _nats(stack, plan, creds)
        wiring = _wiring(creds, nats_url)
        model, engine = await _served(
            plan, plan.config(plan.service(READOUT), wiring), model, engine
        )
        own_nats = plan.nats_url is None  # its users: one per service
        logins = creds.nats_passwords if own_nats else None
        connection = _Connections(stack, nats_url, metrics, config.connection_per_service, logins)
        await stack.enter_async_context(runtime.loop_lag(metrics))  # the services' one loop
        nc, state = await connection(CAPTURE)
        capture = await stack.enter_async_context(
            running_capture(
                plan.config(plan.service(CAPTURE), wiring),
                nc=nc, model=model, signer=creds.signer, metrics=metrics, nats_state=state,
            )
        )  # fmt: skip
        await stack.enter_async_context(
            running_readout(
                plan.config(plan.service(READOUT), wiring),
                nc=(await connection(READOUT))[0], engine=engine, trust=creds.trust,
                signer=creds.readout_signer, metrics=metrics, slots=capture.slots,
            )
        )  # fmt: skip
        nc, state = await connection(GATEWAY)
        wiring = dataclasses.replace(wiring, capture_port=capture.port)  # when the plan said 0
        gateway = await stack.enter_async_context(
            running_gateway(
                plan.config(plan.service(GATEWAY), wiring),
                nc=nc, nats_state=state, metrics=metrics, tokenizer=model.tokenizer,
                readout_trust=creds.readout_trust,
            )
        )  # fmt: skip
        yield StackUrls(
            http=f"http://{config.host}:{gateway.http_port}",
            grpc=f"{config.host}:{gateway.grpc_port}",
            nats=nats_url,
            key_id=creds.signer.key_id,
            nats_lost=nats_lost,
            nats_admin=(
                nats_auth.login_url(nats_url, creds.nats_passwords[nats_auth.ADMIN])
                if own_nats
                else nats_url
            ),
        )


async def up(config: UpConfig, on_ready: Callable[[StackUrls], None]) -> None:
    """Run the stack in the foreground until SIGINT/SIGTERM; raises NatsServerLost (after
    stopping the services) if its own nats-server died and could not be restarted."""
    shutdown = runtime.shutdown_event()
    async with running_stack(config) as urls:
        on_ready(urls)
        stopped = asyncio.ensure_future(shutdown.wait())
        ends = {stopped} if urls.nats_lost is None else {stopped, urls.nats_lost}
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if urls.nats_lost is not None and urls.nats_lost.done():
            raise urls.nats_lost.result()


class StackThread:
    """running_stack() on a background event loop, so synchronous callers (tests, benchmarks)
    can start it, call it with any client, and stop it."""

    def __init__(
        self,
        config: UpConfig,
        *,
        metrics: CollectorRegistry | None = None,
        model: ServingModel | None = None,
        engine: ReadoutEngine | None = None,
    ) -> None:
        self.config = config
        self.urls: StackUrls | None = None
        self.metrics = metrics
        self._served = {"model": model, "engine": engine}
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="stack", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with running_stack(self.config, metrics=self.metrics, **self._served) as urls:
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

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the stack's event loop (a probe's subscription, say)."""
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            # a hang here has only been seen on a GPU, where a second look costs device time:
            # every thread's stack goes to stderr first, so the one run explains itself
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            raise RuntimeError(f"stack did not stop within {timeout:g} s")
