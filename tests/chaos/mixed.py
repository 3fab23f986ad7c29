"""The mixed-fault load: client threads sending `/v1/completions` of five kinds, each with an
Idempotency-Key, retrying only what is safe to retry (503, 504, no answer) with the same key,
and the figures docs/RELIABILITY.md reports, from the clients' side and from the registry.

- short: one of five prompts, 8 tokens;
- long: a prompt of ~1,200 tokens, whose rows go to the payload object store;
- deep: eight lanes of 4,096 tokens each, a readout long enough to be caught mid-way;
- burst: one key sent by three clients at once (all must get the one answer);
- disconnect: the client closes its connection at a random moment within the capture's
  time, then sends the key again until answered (one readout, never two).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import nats

from registry import Registry
from stateblock.protocol import outcomes
from stateblock.protocol.keys import TrustStore
from stateblock.v1 import commit_pb2 as pb
from tests.chaos.load import registry_keys

SHORT = ["copy: abc", "reverse: hello", "sort: banana", "copy: stateblock", "add: 12+30"]
LONG = "copy: " + "abcdefgh" * 150  # ~1,200 tokens: 1.2 MB of float32 rows, over 1 MiB
DEEP, DEEP_LANES, DEEP_TOKENS = "copy: deep", 8, 4096
BURST = 3
# the 503 that follows a published block (its key points at it): every other 503 is sent
# before anything ran (the capture unreachable, its publish failed, the key store down)
EXECUTED_503 = "registry unavailable"


def kind_of(i: int) -> str:
    if i % 25 == 12:
        return "deep"
    return {1: "long", 4: "burst", 7: "disconnect"}.get(i % 10, "short")


def request_of(i: int, model: str) -> tuple[str, dict]:
    kind = kind_of(i)
    if kind == "deep":
        return kind, {"model": model, "prompt": [DEEP] * DEEP_LANES, "max_tokens": DEEP_TOKENS}
    prompt = LONG if kind == "long" else SHORT[i % len(SHORT)]
    return kind, {"model": model, "prompt": prompt, "max_tokens": 8}


@dataclass(frozen=True)
class Answer:
    index: int
    kind: str
    key: str
    body: dict
    status: int  # of the last attempt; 0: no answer at all
    response: dict | None  # the 200's body
    sent: float
    done: float
    statuses: tuple[int, ...]  # every attempt's, in order
    errors: tuple[str, ...]  # every failed attempt's body or exception
    twins: tuple[dict, ...] = ()  # a burst's other answers (200 bodies or None)


@dataclass
class MixedLoad:
    url: str
    model: str
    limit: int
    threads: int = 2
    timeout_s: float = 60.0
    retry_for_s: float = 120.0
    seed: int = 0
    answers: list[Answer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sent: int = 0

    def start(self) -> MixedLoad:
        self._rng = random.Random(self.seed)
        self._pool = ThreadPoolExecutor(self.threads * (BURST + 1))
        self._futures = [self._pool.submit(self._client) for _ in range(self.threads)]
        return self

    def join(self) -> list[Answer]:
        for f in self._futures:
            f.result()
        self._pool.shutdown()
        return sorted(self.answers, key=lambda a: a.index)

    def wait_for(self, n: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.answers)} of {n} requests answered")
            time.sleep(0.05)

    def _next(self) -> int | None:
        with self._lock:
            if self._sent >= self.limit:
                return None
            self._sent += 1
            return self._sent - 1

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
            while (i := self._next()) is not None:
                kind, body = request_of(i, self.model)
                key = f"mixed-{self.seed}-{i}"
                if kind == "burst":
                    answer = self._burst(i, body, key)
                elif kind == "disconnect":
                    with self._lock:
                        after_s = self._rng.uniform(0.005, 0.25)
                    answer = self._send(http, i, kind, body, key, disconnect_after_s=after_s)
                else:
                    answer = self._send(http, i, kind, body, key)
                with self._lock:
                    self.answers.append(answer)

    def probe(self, key: str, expected: str) -> float | None:
        """A short request (SHORT[0]) under its own key, sent again every 0.1 s while it is
        safe to, and checked against `expected`; the monotonic time of its answer, None if
        none came within retry_for_s. Sent once a killed service is back, it says when
        requests succeed again, which the load's own clients may not: both can be held at
        that moment by faults aimed at them (a sniped deep block waits out its lease, a long
        one whose payload was deleted is captured again)."""
        body = {"model": self.model, "prompt": SHORT[0], "max_tokens": 8}
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
            answer = self._send(http, -1, "probe", body, key, pause_s=0.1)
        assert answer.status in (0, 200, 503, 504), answer.errors[-1:]  # only the safe ones
        if answer.status != 200:
            return None
        assert texts(answer.response) == [expected], answer.response
        return answer.done

    def _burst(self, i: int, body: dict, key: str) -> Answer:
        def one(_: int) -> Answer:
            with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
                return self._send(http, i, "burst", body, key)

        first, *rest = list(self._pool.map(one, range(BURST)))
        return Answer(**{**first.__dict__, "twins": tuple(a.response for a in rest)})

    def _send(self, http: httpx.Client, i: int, kind: str, body: dict, key: str,
              disconnect_after_s: float | None = None, pause_s: float = 0.3) -> Answer:  # fmt: skip
        headers = {"Idempotency-Key": key}
        t0 = time.monotonic()
        statuses: list[int] = []
        errors: list[str] = []
        if disconnect_after_s is not None:  # the client gives up and closes the connection
            try:
                http.post("/v1/completions", json=body, headers=headers,
                          timeout=disconnect_after_s)  # fmt: skip
                statuses.append(-1)  # answered before it could go away
            except httpx.TimeoutException:
                statuses.append(-2)
        while True:
            try:
                r = http.post("/v1/completions", json=body, headers=headers)
                statuses.append(r.status_code)
                if r.status_code == 200:
                    return Answer(i, kind, key, body, 200, r.json(), t0, time.monotonic(),
                                  tuple(statuses), tuple(errors))  # fmt: skip
                errors.append(r.text[:300])
                safe = r.status_code in (503, 504)
            except httpx.HTTPError as e:
                statuses.append(0)
                errors.append(repr(e))
                safe = True
            if not safe or time.monotonic() - t0 > self.retry_for_s:
                return Answer(i, kind, key, body, statuses[-1], None, t0, time.monotonic(),
                              tuple(statuses), tuple(errors))  # fmt: skip
            time.sleep(pause_s)


def texts(response: dict | None) -> list[str] | None:
    if response is None:
        return None
    return [c["text"] for c in sorted(response["choices"], key=lambda c: c["index"])]


def client_figures(answers: list[Answer], expected: Callable[[dict], list[str]],
                   forged_text: str) -> dict:  # fmt: skip
    """Requests, correct, wrong, lost, forged-served, the clean 503s and latency."""
    ok = [a for a in answers if a.status == 200]
    wrong = [a for a in ok if texts(a.response) != expected(a.body)]
    bursts = [a for a in answers if a.kind == "burst"]
    split = [a for a in bursts if any(t is None or t["id"] != a.response["id"] or
                                      texts(t) != texts(a.response) for t in a.twins)]  # fmt: skip
    served_forged = [a for a in ok if forged_text in (texts(a.response) or [])]
    e503 = [
        e
        for a in answers
        for s, e in zip([s for s in a.statuses if s not in (-1, -2, 200)], a.errors, strict=False)
        if s == 503
    ]
    latencies = sorted(a.done - a.sent for a in ok)
    by_kind = {k: sum(a.kind == k for a in answers) for k in
               ("short", "long", "deep", "burst", "disconnect")}  # fmt: skip
    return {
        "requests": len(answers),
        "by_kind": by_kind,
        "correct": len(ok) - len(wrong),
        "wrong": len(wrong),
        "lost": len(answers) - len(ok),
        "lost_statuses": sorted({a.status for a in answers if a.status != 200}),
        "lost_samples": sorted({a.errors[-1] for a in answers if a.status != 200})[:3],
        "forged_served": len(served_forged),
        "bursts_split": len(split),  # a burst whose clients did not all get the one answer
        "disconnected": sum(-2 in a.statuses for a in answers),
        "retried": sum(len([s for s in a.statuses if s >= 0]) > 1 for a in answers),
        "clean_503": len(e503),
        "executed_503": sum(EXECUTED_503 in e for e in e503),
        "non_503_failures": sum(s not in (-1, -2, 200, 503) for a in answers for s in a.statuses),
        "p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "max_latency_s": round(latencies[-1], 2) if latencies else None,
    }


def registry_figures(nats_url: str, trust: TrustStore, shots: list[dict]) -> dict:
    """Read back from the registry (every key's kept revisions): blocks committed (one per
    request, or one ran twice), genuine rejections by reason, commits made under a takeover
    (attempt > 1), and for each sniper shot who committed the block under which attempt."""

    async def read() -> dict:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            registry = await Registry.open(js, outcome_trust=trust)
            committed: dict[str, pb.RegistryEntry] = {}
            rejected: dict[str, int] = {}
            out = {"keys": 0, "commits_in_one_key": 0, "takeover_commits": 0}
            for key in await registry_keys(js):
                out["keys"] += 1
                genuine = []
                for entry in await registry.history(key):
                    try:
                        record = outcomes.outcome_of(entry, trust, key)
                    except outcomes.UntrustedOutcome:
                        continue
                    if record is not None:
                        genuine.append((entry, record))
                commits = [(e, r) for e, r in genuine if isinstance(r, pb.Commit)]
                out["commits_in_one_key"] = max(out["commits_in_one_key"], len(commits))
                if commits:
                    committed[key] = commits[0][0]
                    out["takeover_commits"] += commits[0][0].attempt > 1
                for _, r in genuine:
                    if isinstance(r, pb.Rejection):
                        rejected[r.reason] = rejected.get(r.reason, 0) + 1
            out |= {"committed_blocks": len(committed), "rejected": rejected}
            out["shots"] = [  # the commit's attempt: > 1, made under a takeover
                {**s, "committed_by": committed[s["block_id"]].worker_id,
                 "attempt": committed[s["block_id"]].attempt}
                if s["block_id"] in committed else {**s, "committed_by": None, "attempt": 0}
                for s in shots
            ]  # fmt: skip
            return out
        finally:
            await nc.close()

    return asyncio.run(read())
