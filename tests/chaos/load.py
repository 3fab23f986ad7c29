"""Load and faults for the chaos suite: client threads sending requests through the real
stack, every outcome recorded with its times, and the figures docs/RELIABILITY.md reports."""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from nats.js import JetStreamContext

from registry import DEFAULT_BUCKET
from stateblock.app.nats_server import NatsProcess, restart_nats_server


async def registry_keys(js: JetStreamContext, bucket: str = DEFAULT_BUCKET) -> list[str]:
    """Every key the registry holds, from the subjects its stream counts on the server.
    nats-py's `kv.keys()` lists through a watcher that can take its end-of-listing marker
    before the entries it was sent, so on a busy machine it lists part of a bucket, or
    none of it (NoKeysError)."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    return sorted(s.removeprefix(prefix) for s in (info.state.subjects or {}))


@dataclass(frozen=True)
class Outcome:
    index: int
    prompt: str
    sent: float  # monotonic
    done: float
    status: int  # HTTP status, 0 when the request never got an answer (a transport error)
    text: str | None
    error: str | None = None
    attempts: int = 1  # sends, retries of a 503 / transport error included


@dataclass
class Load:
    """`threads` clients, each sending `prompts` round-robin until stopped or `limit` sent."""

    url: str
    model: str
    prompts: Sequence[str]
    max_tokens: int = 8
    threads: int = 2
    limit: int | None = None
    timeout_s: float = 60.0
    # a client that retries what is safe to retry with the same Idempotency-Key (503 "not
    # executed", 504 "no answer yet", no answer at all: the key never runs it twice), until
    # retry_for_s after its first send
    retry_for_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sent: int = 0

    def _next(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or (self.limit is not None and self._sent >= self.limit):
                return None
            self._sent += 1
            return self._sent - 1

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
            while (i := self._next()) is not None:
                prompt = self.prompts[i % len(self.prompts)]
                out = self._send(http, i, prompt)
                with self._lock:
                    self.outcomes.append(out)

    def _send(self, http: httpx.Client, i: int, prompt: str) -> Outcome:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens}
        headers = {"Idempotency-Key": f"chaos-{id(self)}-{i}"}
        t0 = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            try:
                r = http.post("/v1/completions", json=body, headers=headers)
                if r.status_code == 200:
                    text = r.json()["choices"][0]["text"]
                    return Outcome(i, prompt, t0, time.monotonic(), 200, text, None, attempts)
                out = Outcome(i, prompt, t0, time.monotonic(), r.status_code, None,
                              r.text[:200], attempts)  # fmt: skip
                safe = r.status_code in (503, 504)
            except httpx.HTTPError as e:
                out = Outcome(i, prompt, t0, time.monotonic(), 0, None, repr(e), attempts)
                safe = True
            if not safe or time.monotonic() - t0 > self.retry_for_s or self._stop.is_set():
                return out
            time.sleep(0.5)

    def start(self) -> Load:
        self._pool = ThreadPoolExecutor(self.threads)
        self._futures = [self._pool.submit(self._client) for _ in range(self.threads)]
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        return self.join()

    def join(self) -> list[Outcome]:
        for f in self._futures:
            f.result()
        self._pool.shutdown()
        return sorted(self.outcomes, key=lambda o: o.index)

    def wait_for(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.outcomes)} of {n} requests answered")
            time.sleep(0.05)


def kill(node: NatsProcess) -> float:
    """SIGKILL a nats-server (no goodbye to its peers); returns when."""
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait()
    return time.monotonic()


def summary(outcomes: Sequence[Outcome], expected: Callable[[str], str]) -> dict:
    """The figures: requests, errors, wrong answers, latency and the longest stall (the
    longest time between two successive answers)."""
    ok = [o for o in outcomes if o.status == 200]
    wrong = [o for o in ok if o.text != expected(o.prompt)]
    done = sorted(o.done for o in ok)
    gaps = [b - a for a, b in zip(done, done[1:], strict=False)]
    latencies = sorted(o.done - o.sent for o in ok)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": len(outcomes) - len(ok),
        "error_statuses": sorted({o.status for o in outcomes if o.status != 200}),
        "error_samples": sorted({o.error for o in outcomes if o.error})[:3],
        "retried": sum(o.attempts > 1 for o in outcomes),
        "wrong": len(wrong),
        "p50_s": round(statistics.median(latencies), 4) if latencies else None,
        "max_latency_s": round(latencies[-1], 3) if latencies else None,
        "longest_stall_s": round(max(gaps), 3) if gaps else None,
    }


__all__ = ["Load", "Outcome", "kill", "restart_nats_server", "summary"]


class Forger:
    """An untrusted NATS client beside the load: it reads every block on the bus and, for
    every `every`-th one, publishes an exact copy again, stores a commit and a rejection of its
    own under the block's id (signed by a key nobody trusts) and republishes the block with
    its signed header tampered. None of it may fail or change a genuine request's answer."""

    def __init__(self, nats_url: str, every: int = 3) -> None:
        from stateblock.protocol.keys import Signer

        self.url, self.every = nats_url, every
        self.key = Signer.generate()
        self.forged = {"commits": 0, "rejections": 0, "blocks": 0, "duplicates": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Forger:
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        return dict(self.forged)

    def _run(self) -> None:
        import asyncio

        asyncio.run(self._main())

    async def _main(self) -> None:
        import asyncio

        import nats

        nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        seen = 0
        queue: asyncio.Queue = asyncio.Queue()
        await nc.subscribe("stateblock.blocks.>", cb=queue.put)
        while not self._stop.is_set():
            try:
                msg = await asyncio.wait_for(queue.get(), 0.2)
            except TimeoutError:
                continue
            if msg.headers and msg.headers.get("Forged"):
                continue
            seen += 1
            if seen % self.every == 0:
                try:
                    await self._forge(nc, msg)
                except Exception:  # noqa: BLE001 - NATS down: the forger waits like anyone
                    pass
        await nc.close()

    async def _forge(self, nc, msg) -> None:
        from stateblock.protocol import envelope, outcomes
        from stateblock.v1 import commit_pb2 as pb

        js = nc.jetstream()
        # an exact copy under a new message id (past JetStream's duplicate window): a second
        # delivery of a genuine block, which must not be answered twice
        await js.publish(msg.subject, msg.data,
                         headers={"Nats-Msg-Id": f"again-{id(msg)}", "Forged": "1"})  # fmt: skip
        self.forged["duplicates"] += 1
        block, rows = envelope.parse_wire(msg.data)
        header = block.header
        subject = f"$KV.STATEBLOCK_REGISTRY.{header.block_id}"
        lane = pb.LaneAnswer(lane_index=0, token_ids=[7, 7, 7], eos_pos=3)
        commit = pb.Commit(block_id=header.block_id, request_id=header.request_id,
                           lanes=[lane], worker_id="forger")  # fmt: skip
        outcomes.sign(commit, self.key)
        entry = pb.RegistryEntry(state=pb.CLAIM_STATE_COMMITTED, block_id=header.block_id)
        entry.commit.CopyFrom(commit)
        await js.publish(subject, entry.SerializeToString())
        self.forged["commits"] += 1
        rejection = pb.Rejection(block_id=header.block_id, request_id=header.request_id,
                                 reason="bad_signature", worker_id="forger")  # fmt: skip
        outcomes.sign(rejection, self.key)
        entry = pb.RegistryEntry(state=pb.CLAIM_STATE_REJECTED, block_id=header.block_id)
        entry.rejection.CopyFrom(rejection)
        await js.publish(subject, entry.SerializeToString())
        self.forged["rejections"] += 1
        header.sampling[0].temperature = 1.9  # the signature no longer covers the header
        if rows is not None:
            block.payload.inline_rows = bytes(rows)
        await js.publish(msg.subject, envelope.serialize_block(block),
                         headers={"Nats-Msg-Id": f"forged-{header.block_id}", "Forged": "1"})  # fmt: skip
        self.forged["blocks"] += 1
