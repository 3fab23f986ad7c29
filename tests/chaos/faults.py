"""Faults aimed from the bus, beside the chaos suite's load: an untrusted client that poisons
the registry (garbage bytes and claims signed by a key nobody trusts), one that deletes
payload objects before any worker reads them, and a sniper that SIGKILLs or SIGSTOPs a
readout process the moment the registry shows it claimed a deep block, so the fault lands
while that worker holds the claim mid-readout, not whenever a clock says. Each runs its own
event loop and NATS connection in a thread and counts what it did; `registry_figures` reads
back from the registry what the faults did to the blocks."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable

import nats

from registry import DEFAULT_BUCKET, parse_update
from stateblock.protocol import envelope, outcomes, streams
from stateblock.protocol.keys import Signer
from stateblock.v1 import commit_pb2 as pb

KV_SUBJECT = f"$KV.{DEFAULT_BUCKET}.>"
OBJECT_META_SUBJECT = f"$O.{streams.PAYLOAD_BUCKET}.M.>"
GARBAGE = b"\xff\x00 no registry entry \x13\x37"


class BusClient:
    """A thread with its own event loop and NATS connection, handing every message on
    `subjects` to `handle`; NATS down or a message it cannot use only counts an error."""

    subjects: tuple[str, ...] = ()

    def __init__(self, nats_url: str) -> None:
        self.url = nats_url
        self.counts: dict[str, int] = {"errors": 0}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self):
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError(f"{type(self).__name__} did not subscribe")
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(30)
        return dict(self.counts)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    async def _main(self) -> None:
        nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        self.js = nc.jetstream()
        queue: asyncio.Queue = asyncio.Queue()
        for subject in self.subjects:
            await nc.subscribe(subject, cb=queue.put)
        await self.opened()
        self._ready.set()
        while not self._stop.is_set():
            try:
                msg = await asyncio.wait_for(queue.get(), 0.2)
            except TimeoutError:
                continue
            try:
                await self.handle(msg)
            except Exception:  # noqa: BLE001 - NATS down, a forger's message: go on
                self.count("errors")
        await self.closing()
        await nc.close()

    async def opened(self) -> None: ...

    async def closing(self) -> None: ...

    async def handle(self, msg) -> None: ...


def _genuine_claim(msg) -> pb.RegistryEntry | None:
    """The claim a registry write carries, if a readout worker (not a forger) wrote it."""
    try:
        _, entry = parse_update(msg.subject, msg.data, msg.headers)
    except Exception:  # noqa: BLE001 - garbage: the poisoner's own
        return None
    if entry is None or entry.state != pb.CLAIM_STATE_CLAIMED or entry.worker_id == "forger":
        return None
    return entry


class Poisoner(BusClient):
    """For every `every`-th block, before any worker claims it, stores under its registry
    key either bytes that are no registry entry or a claim signed by a key nobody trusts
    with an hour-long lease (in turn); and for every `every`-th genuine first claim, stores
    bytes over it while its holder reads (its commit then loses the compare-and-swap and
    the block is read again). None of it may fail or change a genuine answer."""

    subjects = (streams.blocks_subject(">"), KV_SUBJECT)

    def __init__(self, nats_url: str, every: int = 4) -> None:
        super().__init__(nats_url)
        self.every, self._blocks, self._claims = every, 0, 0
        self.key = Signer.generate()  # trusted by nobody
        self.counts |= {"garbage_before_claim": 0, "forged_claims": 0, "garbage_over_claim": 0}

    async def handle(self, msg) -> None:
        if msg.subject.startswith("$KV."):
            entry = _genuine_claim(msg)
            if entry is not None and entry.attempt == 1:
                self._claims += 1
                if self._claims % self.every == 0:
                    await self.js.publish(msg.subject, GARBAGE)
                    self.count("garbage_over_claim")
            return
        if msg.headers and msg.headers.get("Forged"):
            return
        self._blocks += 1
        if self._blocks % self.every:
            return
        block, _ = envelope.parse_wire(msg.data)
        block_id = block.header.block_id
        if (self._blocks // self.every) % 2:
            await self.js.publish(f"$KV.{DEFAULT_BUCKET}.{block_id}", GARBAGE)
            self.count("garbage_before_claim")
            return
        entry = pb.RegistryEntry(state=pb.CLAIM_STATE_CLAIMED, block_id=block_id,
                                 worker_id="forger", attempt=1)  # fmt: skip
        entry.lease_expires_at.FromSeconds(int(time.time()) + 3600)
        outcomes.sign_claim(entry, self.key)
        await self.js.publish(f"$KV.{DEFAULT_BUCKET}.{block_id}", entry.SerializeToString())
        self.count("forged_claims")


class PayloadDeleter(BusClient):
    """Deletes every `every`-th payload object the moment its put completes, before the
    block naming it is even published, so the worker that reads the block finds no rows.
    At most one deletion per `quiet_s`: the gateway's capture of the same request again
    (its next object) is left alone, so each request meets this fault once at most."""

    subjects = (OBJECT_META_SUBJECT,)

    def __init__(self, nats_url: str, every: int = 2, quiet_s: float = 3.0) -> None:
        super().__init__(nats_url)
        self.every, self.quiet_s = every, quiet_s
        self._seen, self._last = 0, 0.0
        self.counts |= {"objects_seen": 0, "deleted": 0}

    async def opened(self) -> None:
        self._objects = await streams.payload_store(self.js)

    async def handle(self, msg) -> None:
        info = json.loads(msg.data)
        if info.get("deleted"):
            return
        self._seen += 1
        self.count("objects_seen")
        now = time.monotonic()
        if self._seen % self.every or now - self._last < self.quiet_s:
            return
        self._last = now
        await self._objects.delete(info["name"])
        self.count("deleted")


def process_of(worker_id: str) -> str:
    """The ProcStack service a readout worker runs in ("readout-0-w0" -> "readout-0")."""
    return worker_id.rsplit("-w", 1)[0]


class ClaimSniper(BusClient):
    """Watches the blocks and the registry; when a readout worker stores its first claim on
    a block whose answer is at least `depth` deep, its process gets the next signal of
    `aims` ({process: signal}, taken in turn) at once, while that worker holds the claim and
    its readout runs: SIGKILL, then `restart(process)`; SIGSTOP, then SIGCONT after
    `hold_s` (past its lease and ack_wait, so the block is taken over and its own commit
    loses). `lock` keeps each shot, a kill to its restart or a stop to its SIGCONT, apart
    from the test's other kills: a ProcStack restart fails while another service is down,
    and a recovery timed from a nats-server kill would count the stopped worker's hold; a
    claim seen while it is held is let go."""

    subjects = (streams.blocks_subject(">"), KV_SUBJECT)

    def __init__(self, nats_url: str, aims: list[tuple[str, int]], *, depth: int,
                 send: Callable[[str, int], None], restart: Callable[[str], None],
                 lock: threading.Lock, hold_s: float, every_s: float) -> None:  # fmt: skip
        super().__init__(nats_url)
        self.aims, self.depth, self.hold_s, self.every_s = list(aims), depth, hold_s, every_s
        self._send, self._restart, self._lock = send, restart, lock
        self._deep: set[str] = set()
        self._last = 0.0
        self._busy = False
        self.shots: list[dict] = []

    async def handle(self, msg) -> None:
        if not msg.subject.startswith("$KV."):
            block, _ = envelope.parse_wire(msg.data)
            if max((lane.answer_depth for lane in block.header.layout.lanes), default=0) >= (
                self.depth
            ):
                self._deep.add(block.header.block_id)
            return
        entry = _genuine_claim(msg)
        if entry is None or entry.attempt != 1 or entry.block_id not in self._deep:
            return
        process = process_of(entry.worker_id)
        aimed = [i for i, (name, _) in enumerate(self.aims) if name == process]
        if self._busy or not aimed or time.monotonic() - self._last < self.every_s:
            return
        name, sig = self.aims[aimed[0]]
        if not self._lock.acquire(blocking=False):
            self.count("let_go")
            return
        self.aims.pop(aimed[0])
        self._send(name, sig)  # at once: the claim is seconds old at most
        self._busy, self._last = True, time.monotonic()
        self.shots.append({"block_id": entry.block_id, "process": name,
                           "signal": signal.Signals(sig).name, "at": time.monotonic()})  # fmt: skip
        asyncio.get_running_loop().create_task(self._after(name, sig))

    async def _after(self, name: str, sig: int) -> None:
        try:
            if sig == signal.SIGKILL:
                await asyncio.to_thread(self._restart, name)
            else:
                await asyncio.sleep(self.hold_s)
                self._send(name, signal.SIGCONT)
        finally:
            self._lock.release()
            self._busy = False

    async def closing(self) -> None:
        while self._busy:  # a stopped process is woken, a killed one restarted
            await asyncio.sleep(0.1)
