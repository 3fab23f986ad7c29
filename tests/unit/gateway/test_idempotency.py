"""Idempotency keys through GatewayService with an in-memory key store: a retry gets the
first request's answer and never runs twice; a key reused with other parameters is refused;
a first request that never ran gives its key back."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from gateway.errors import BlockRejected, InvalidRequest, ReadoutFailed, Unavailable
from gateway.idempotency import Record, store_key
from gateway.params import GenerateParams, PromptSpec, check, make_sampling
from tests.unit.gateway.conftest import MODEL


class MemoryKeys:
    def __init__(self) -> None:
        self.records: dict[str, tuple[Record, int]] = {}
        self.revision = 0

    async def create(self, key, record):
        if key in self.records:
            return None
        self.revision += 1
        self.records[key] = (record, self.revision)
        return self.revision

    async def get(self, key):
        return self.records.get(key)

    async def update(self, key, record, revision):
        if key not in self.records or self.records[key][1] != revision:
            return None
        self.revision += 1
        self.records[key] = (record, self.revision)
        return self.revision

    async def delete(self, key):
        self.records.pop(key, None)


@pytest.fixture
def keyed(service):
    service._keys = MemoryKeys()
    return service


def params(prompt="copy: ab", temperature=None):
    """The request as an edge's conversion gives it to `generate`."""
    p = GenerateParams(
        model=MODEL, inputs=(PromptSpec(prompt=prompt),), sampling=make_sampling(temperature, None)
    )
    return functools.partial(check, p)


async def test_a_retry_gets_the_first_answer_and_runs_nothing(keyed, fakes):
    capture, _ = fakes
    first = await keyed.generate(params(), api="t", idempotency_key="k1")
    again = await keyed.generate(params(), api="t", idempotency_key="k1")
    assert len(capture.calls) == 1
    assert again.request_id == first.request_id and again.choices == first.choices
    other = await keyed.generate(params(), api="t", idempotency_key="k2")
    assert len(capture.calls) == 2 and other.request_id != first.request_id


async def test_concurrent_retries_share_one_run(keyed, fakes):
    capture, _ = fakes
    results = await asyncio.gather(
        *(keyed.generate(params(), api="t", idempotency_key="same") for _ in range(5))
    )
    assert len(capture.calls) == 1
    assert len({g.request_id for g in results}) == 1


async def test_a_key_reused_with_other_parameters_is_refused(keyed):
    await keyed.generate(params("copy: ab"), api="t", idempotency_key="k")
    with pytest.raises(InvalidRequest) as e:
        await keyed.generate(params("copy: cd"), api="t", idempotency_key="k")
    assert e.value.code == "idempotency_key_reused"


async def test_a_first_request_that_never_ran_gives_its_key_back(keyed, fakes):
    capture, _ = fakes
    capture.error = Unavailable("capture unreachable")
    with pytest.raises(Unavailable):
        await keyed.generate(params(), api="t", idempotency_key="k")
    capture.error = None
    g = await keyed.generate(params(), api="t", idempotency_key="k")  # the retry runs it
    assert len(capture.calls) == 1 and g.choices


async def test_nats_trouble_at_the_keys_is_a_503_never_a_500(monkeypatch):
    """The key store's NATS calls are retried through an election, then a 503 (nothing has
    run yet): a raw nats TimeoutError never escapes as a plain-text 500."""
    import nats

    from gateway import idempotency

    class DownKv:
        calls = 0

        async def create(self, key, value):
            DownKv.calls += 1
            raise nats.errors.TimeoutError

    monkeypatch.setattr(idempotency, "RETRY_S", 0.5)
    store = idempotency.KvKeyStore(DownKv())
    with pytest.raises(Unavailable, match="idempotency keys unreachable"):
        await store.create("k", Record("r", "f"))
    assert DownKv.calls >= 2  # repeated before giving up

    class TakenKv:  # JetStream's answers are not trouble: a key that exists, one that does not
        async def create(self, key, value):
            raise nats.js.errors.KeyWrongLastSequenceError

        async def get(self, key):
            raise nats.js.errors.KeyNotFoundError

        async def update(self, key, value, last):
            raise nats.js.errors.KeyWrongLastSequenceError

    store = idempotency.KvKeyStore(TakenKv())
    assert await store.create("k", Record("r", "f")) is None
    assert await store.get("k") is None
    assert await store.update("k", Record("r", "f"), 3) is None


async def test_a_key_left_by_a_request_that_never_ran_lapses_with_its_deadline(keyed, fakes):
    """A first request whose 503 could not give its key back (NATS down) leaves a record
    without a block id; once that request's deadline has passed a retry runs it, once."""
    import time

    from gateway.idempotency import store_key
    from gateway.service import fingerprint

    capture, _ = fakes
    p = params()
    stored = store_key(MODEL, "k-lapsed")
    checked = p(keyed)
    fp = fingerprint(checked, checked.max_tokens)
    await keyed._keys.create(stored, Record("dead", fp, expires_at=time.time() - 1))
    g = await keyed.generate(p, api="t", idempotency_key="k-lapsed")
    assert len(capture.calls) == 1 and g.request_id != "dead"
    again = await keyed.generate(p, api="t", idempotency_key="k-lapsed")
    assert len(capture.calls) == 1 and again.request_id == g.request_id


async def test_our_own_create_whose_reply_was_lost_is_ours():
    from gateway.idempotency import claim_or_follow

    keys = MemoryKeys()
    mine = Record("me", "fp")
    await keys.create("k", mine)  # landed; the reply was lost, so the caller asks again
    action, revision = await claim_or_follow(keys, "k", mine, deadline=1e18)
    assert action == "run" and revision == 1


def reject_blocks(commits, reasons: dict[str, str]) -> None:
    """The fake registry keeps a signed rejection with the given reason for those blocks."""
    answer = commits.watch_commit

    async def watch(block_id, timeout):
        if block_id in reasons:
            await asyncio.sleep(0.01)  # the outcome comes after the capture's reply
            raise BlockRejected(block_id, reasons[block_id])
        return await answer(block_id, timeout)

    commits.watch_commit = watch


async def test_a_retry_of_a_request_whose_block_was_rejected_runs_it_anew(keyed, fakes):
    """An answer is given at most once per key; a first run that ended in a signed rejection
    (its block out of deliveries) gave none, so the retry runs the request again."""
    capture, commits = fakes
    reject_blocks(commits, {"block-1": "max_deliveries"})
    with pytest.raises(ReadoutFailed):
        await keyed.generate(params(), api="t", idempotency_key="k-rej")
    g = await keyed.generate(params(), api="t", idempotency_key="k-rej")
    assert len(capture.calls) == 2 and g.choices  # ran anew, answered
    again = await keyed.generate(params(), api="t", idempotency_key="k-rej")
    assert len(capture.calls) == 2 and again.request_id == g.request_id  # and only once


@pytest.mark.parametrize("reason", ["object_missing", "expired"])
async def test_a_block_rejected_not_for_the_request_is_captured_again(keyed, fakes, reason):
    """Its payload lost or expired unread: the request captures again as a new block (a
    capture id of its own: the plan table refuses one twice) and answers under its one
    request id; a retry sent meanwhile follows it to the new block."""
    capture, commits = fakes
    reject_blocks(commits, {"block-1": reason})
    first, retry = await asyncio.gather(
        keyed.generate(params(), api="t", idempotency_key="k-again"),
        keyed.generate(params(), api="t", idempotency_key="k-again"),
    )
    assert first.request_id == retry.request_id and first.choices == retry.choices
    assert [call[0] for call in capture.calls][0] == first.request_id
    assert len(capture.calls) == 2 and capture.calls[1][0] != first.request_id
    later = await keyed.generate(params(), api="t", idempotency_key="k-again")
    assert later.request_id == first.request_id and len(capture.calls) == 2


async def test_captures_again_at_most_twice(keyed, fakes):
    capture, commits = fakes
    reject_blocks(commits, {f"block-{i}": "object_missing" for i in range(1, 7)})
    with pytest.raises(ReadoutFailed, match="object_missing"):
        await keyed.generate(params(), api="t")
    assert len(capture.calls) == 3
    # the owner gave up: a retry with the key runs it anew at once, not at the deadline
    with pytest.raises(ReadoutFailed):
        await keyed.generate(params(), api="t", idempotency_key="k-lost")
    assert len(capture.calls) == 6
    record, _ = keyed._keys.records[store_key(MODEL, "k-lost")]
    assert record.block_id == "block-6" and record.expires_at <= time.time()
    g = await keyed.generate(params(), api="t", idempotency_key="k-lost")
    assert len(capture.calls) == 7 and g.choices


async def test_a_rejection_that_describes_the_request_is_a_400(keyed, fakes):
    capture, commits = fakes
    reject_blocks(commits, {"block-1": "limits"})
    with pytest.raises(InvalidRequest) as e:
        await keyed.generate(params(), api="t")
    assert e.value.code == "limits" and len(capture.calls) == 1
