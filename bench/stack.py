"""The whole request path in this process for the bench, on any device, with probes.

The same services as `stateblock.app.stack.running_stack` (a nats-server, capture, readout
workers, gateway; a NATS connection each), but handed a prebuilt `ServingModel` and engine:
`running_stack` loads the base from disk onto the CPU (UpConfig has no device or dtype),
and the bench serves the model it built on the GPU. Two probes see each request from
outside the services, without changing them:
- `TimedEngine` wraps the readout engine (perf_counter around each readout call);
- `KvProbe`, a NATS subscription on the registry bucket's subject, sees each claim and
  commit as it lands (a commit names its request id).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import nats
from prometheus_client import CollectorRegistry

from registry import parse_update, updates_subject
from stateblock import runtime
from stateblock.engines import LaneRequest, LaneResult, ReadoutEngine
from stateblock.model.loading import ServingModel
from stateblock.v1 import commit_pb2


@dataclass(frozen=True)
class BenchStackConfig:
    data_dir: Path
    workers: int = 2
    batch_window_s: float | None = None  # None: the capture service's default
    capture_compile: str = "off"  # torch.compile backend for the base forward
    nats_max_payload: int | None = 8 << 20  # None: the server's 1 MiB default
    request_timeout_s: float = 120.0
    grace_s: float = 2.0
    blocks_storage: str = "file"  # the blocks work queue: "file" or "memory"


class TimedEngine:
    """The engine, with (start, end) perf_counter times of every readout call."""

    def __init__(self, inner: ReadoutEngine) -> None:
        self._inner = inner
        self.name = inner.name
        self.identity = inner.identity
        self.calls: list[tuple[float, float]] = []

    def warm_up(self) -> None:
        self._inner.warm_up()

    def readout(self, lanes: Sequence[LaneRequest]) -> list[LaneResult]:
        t0 = time.perf_counter()
        out = self._inner.readout(lanes)
        self.calls.append((t0, time.perf_counter()))
        return out


class KvProbe:
    """perf_counter arrival time of each block's claim and commit; request id -> block id."""

    def __init__(self) -> None:
        self.claimed: dict[str, float] = {}
        self.committed: dict[str, float] = {}
        self.block_of: dict[str, str] = {}

    async def on_msg(self, msg) -> None:
        t = time.perf_counter()
        _, entry = parse_update(msg.subject, msg.data, msg.headers)
        if entry is None:  # a delete (released claim) or purge
            return
        if entry.state == commit_pb2.CLAIM_STATE_CLAIMED:
            self.claimed.setdefault(entry.block_id, t)
        elif entry.state == commit_pb2.CLAIM_STATE_COMMITTED:
            self.committed.setdefault(entry.block_id, t)
            self.block_of[entry.commit.request_id] = entry.block_id


async def _serve(
    config: BenchStackConfig,
    model: ServingModel,
    engine: ReadoutEngine,
    metrics: CollectorRegistry,
    probe: KvProbe,
    ready,
    stop: asyncio.Event,
) -> None:
    from capture_svc.config import CaptureConfig
    from capture_svc.server import running_capture
    from gateway.config import GatewayConfig
    from gateway.server import running_gateway
    from readout_svc.config import ReadoutServiceConfig
    from readout_svc.server import running_readout
    from stateblock.app.stack import nats_server
    from stateblock.protocol.keys import TrustStore, load_or_generate_signer

    data_dir = config.data_dir.resolve()
    key_dir = data_dir / "keys"
    signer = load_or_generate_signer(key_dir)
    trust = TrustStore.from_dir(key_dir)
    common = dict(model_name=model.name, base_dir=model.base_dir, decoder_dir=model.decoder_dir)
    window = {} if config.batch_window_s is None else {"batch_window_s": config.batch_window_s}
    async with AsyncExitStack() as stack:
        proc = await stack.enter_async_context(
            nats_server(data_dir, max_payload=config.nats_max_payload)
        )
        # one connection per service, as separate processes would have: on a shared one the
        # capture's publish ack queues behind the 2.75 MB delivery of the same block to the
        # worker, both read by one client loop
        conns = {}
        for name in ("capture", "readout", "gateway"):
            conns[name] = await nats.connect(proc.url, name=f"bench-{name}")
            stack.push_async_callback(conns[name].drain)
        probe_nc = await nats.connect(proc.url, name="bench-probe")
        stack.push_async_callback(probe_nc.drain)
        await probe_nc.subscribe(updates_subject(), cb=probe.on_msg)
        capture = await stack.enter_async_context(
            running_capture(
                CaptureConfig(
                    nats_url=proc.url, host="127.0.0.1", port=0, key_dir=key_dir,
                    grace_s=config.grace_s, compile=config.capture_compile, **window, **common,
                    blocks_storage=config.blocks_storage,
                ),
                nc=conns["capture"], model=model, signer=signer, metrics=metrics,
            )
        )  # fmt: skip
        await stack.enter_async_context(
            running_readout(
                ReadoutServiceConfig(
                    nats_url=proc.url, engine=engine.name, trusted_keys_dir=key_dir,
                    workers=config.workers, grace_s=config.grace_s, **common,
                    blocks_storage=config.blocks_storage,  # must match capture's
                ),
                nc=conns["readout"], engine=engine, trust=trust, metrics=metrics,
            )
        )  # fmt: skip
        gateway = await stack.enter_async_context(
            running_gateway(
                GatewayConfig(
                    nats_url=proc.url, capture_target=f"127.0.0.1:{capture.port}",
                    host="127.0.0.1", http_port=0, grpc_port=0,
                    request_timeout_s=config.request_timeout_s, grace_s=config.grace_s, **common,
                ),
                nc=conns["gateway"], metrics=metrics, tokenizer=model.tokenizer,
            )
        )  # fmt: skip
        ready(f"http://127.0.0.1:{gateway.http_port}")
        await stop.wait()


class BenchStack:
    """The services on a background event loop; `start()` returns the gateway's HTTP URL."""

    def __init__(
        self,
        config: BenchStackConfig,
        model: ServingModel,
        engine: ReadoutEngine,
        metrics: CollectorRegistry,
        probe: KvProbe,
    ) -> None:
        self._args = (config, model, engine, metrics, probe)
        self._ready = threading.Event()
        self._url: str | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="bench-stack", daemon=True)

    def _on_ready(self, url: str) -> None:
        self._url = url
        self._ready.set()

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await _serve(*self._args, self._on_ready, self._stop)

        try:
            runtime.run(main())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    def start(self, timeout: float) -> str:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the stack did not start within {timeout:g} s")
        if self._error is not None:
            raise RuntimeError("the stack failed to start") from self._error
        assert self._url is not None
        return self._url

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the stack did not stop within {timeout:g} s")


class CompletionsClient:
    """One keep-alive HTTP connection to /v1/completions (stdlib: nothing to carry)."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)

    def complete(self, model: str, prompt: str, max_tokens: int) -> dict:
        body = json.dumps(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }  # fmt: skip
        )
        self._conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:500]!r}")
        return json.loads(data)

    def close(self) -> None:
        self._conn.close()


def sequential_completions(
    client: CompletionsClient,
    model: str,
    prompts: Iterable[str],
    max_tokens: int,
    errors: list[str],
    snapshot: Callable[[], object] = lambda: None,
) -> Iterator[tuple[int, dict, float, float, object]]:
    """One request at a time: (index, response, sent, replied, snapshot taken just before
    sending) for each that succeeds. Failures go to `errors`; the third ends the run."""
    for i, prompt in enumerate(prompts):
        before = snapshot()
        t0 = time.perf_counter()
        try:
            r = client.complete(model, prompt, max_tokens)
        except Exception as e:
            errors.append(repr(e))
            if len(errors) >= 3:
                return
            continue
        yield i, r, t0, time.perf_counter(), before
