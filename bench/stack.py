"""The whole request path in this process for the bench, on any device, with probes.

The stack is the one composition root's (`stateblock.app.stack.StackThread`), handed the
`ServingModel` and engine the bench built on the GPU, with a NATS connection per service.
Two probes see each request from outside the services, without changing them:
- `TimedEngine` wraps the readout engine (perf_counter around each readout call);
- `KvProbe`, a NATS subscription on the registry bucket's subject, sees each claim and
  commit as it lands (a commit names its request id).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import nats

from registry import parse_update, updates_subject
from stateblock.app.stack import UpConfig
from stateblock.engines import LaneRequest, LaneResult, ReadoutEngine
from stateblock.protocol import envelope
from stateblock.v1 import commit_pb2


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


async def subscribe_probe(nats_url: str, probe: KvProbe) -> nats.NATS:
    """A connection of the probe's own on the registry bucket's subject; drain it to stop."""
    nc = await nats.connect(nats_url, name="bench-probe")
    await nc.subscribe(updates_subject(), cb=probe.on_msg)
    return nc


def bench_stack_config(
    data_dir: Path,
    model_name: str,
    *,
    workers: int = 2,
    batch_window_s: float | None = None,
    capture_compile: str = "off",
    nats_max_payload: int | None = 8 << 20,  # None: the server's 1 MiB default
    blocks_storage: str = "file",
    forward_state_digest: str = envelope.DEFAULT_FORWARD_STATE_ALGORITHM,
    data_plane: str = "bus",  # "local": `stateblock up`'s, the rows in the capture's slots
) -> UpConfig:
    """The embedded stack as the benches run it: free ports, a connection per service."""
    return UpConfig.on_free_ports(
        data_dir,
        workers=workers,
        model_name=model_name,
        batch_window_s=batch_window_s,
        capture_compile=capture_compile,
        nats_max_payload=nats_max_payload,
        blocks_storage=blocks_storage,
        forward_state_digest=forward_state_digest,
        data_plane=data_plane,
        request_timeout_s=120.0,
        grace_s=2.0,
        connection_per_service=True,
    )


class CompletionError(RuntimeError):
    """A reply other than 200; `status` is its HTTP status."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:500]!r}")
        self.status = status


class CompletionsClient:
    """One keep-alive HTTP connection to /v1/completions (stdlib: nothing to carry)."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)

    def complete(
        self, model: str, prompt: str | list[str], max_tokens: int, n: int | None = None
    ) -> dict:
        """One greedy completion of exactly max_tokens (of each prompt, given a list); `n`
        answers (lanes) a prompt only when given."""
        fields = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if n is not None:
            fields["n"] = n
        body = json.dumps(fields)
        self._conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise CompletionError(resp.status, data)
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
