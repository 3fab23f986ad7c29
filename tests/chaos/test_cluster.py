"""Beyond one NATS server: the stack on a 3-node JetStream cluster with every stream and
bucket replicated three times, under load while nodes die and come back. Small in CI; the
figures of docs/RELIABILITY.md come from STATEBLOCK_CHAOS_SCALE=full."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from registry import DEFAULT_BUCKET, Registry, RegistryError
from stateblock.app.nats_server import restart_nats_server, stop_nats_server
from stateblock.app.stack import StackThread, UpConfig
from stateblock.protocol import streams
from stateblock.protocol.streams import StreamConflict
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.v1 import commit_pb2
from tests.chaos.conftest import report, scale
from tests.chaos.load import Load, kill, registry_keys, summary
from tests.integration.test_request_path import in_process_answer

pytestmark = pytest.mark.chaos
PROMPTS = ["copy: abc", "reverse: hello", "sort: banana", "copy: stateblock", "add: 12+30"]
REGISTRY_STREAM = f"KV_{DEFAULT_BUCKET}"


async def _info(urls: list[str], stream: str):
    nc = await nats.connect(urls, max_reconnect_attempts=2, connect_timeout=1)
    try:
        return await nc.jetstream(timeout=2).stream_info(stream)
    finally:
        await nc.close()


def leader_of(urls: list[str], stream: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = asyncio.run(_info(urls, stream))
            if info.cluster and info.cluster.leader:
                return info.cluster.leader
        except Exception:  # noqa: BLE001 - no leader yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no leader for {stream} within {timeout_s:g} s")
        time.sleep(0.1)


def new_leader_after(urls: list[str], stream: str, old: str) -> tuple[str, float]:
    t0 = time.monotonic()
    while (leader := leader_of(urls, stream)) == old:
        time.sleep(0.05)
    return leader, time.monotonic() - t0


async def test_replicas_are_applied_everywhere_and_checked(cluster):
    urls = [n.url for n in cluster]
    nc = await nats.connect(urls)
    try:
        js = nc.jetstream()
        await streams.ensure_streams(js, replicas=3)
        await Registry.open(js, replicas=3)
        for name in (
            streams.BLOCKS_STREAM,
            streams.REJECTED_STREAM,
            f"OBJ_{streams.PAYLOAD_BUCKET}",
            REGISTRY_STREAM,
        ):
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, name
            assert len(info.cluster.replicas) == 2  # the leader's two followers
        with pytest.raises(StreamConflict, match="has 3 replica.*asks for 1"):
            await streams.ensure_streams(js, replicas=1)
        with pytest.raises(StreamConflict, match=REGISTRY_STREAM):
            await Registry.open(js, replicas=1)
    finally:
        await nc.close()


def _stack(tmp_path, decoder_dir, urls) -> StackThread:
    config = UpConfig(
        data_dir=tmp_path / "stack",
        http_port=0,
        grpc_port=0,
        workers=2,
        decoder_dir=decoder_dir,
        nats_url=",".join(urls),
        nats_replicas=3,
        request_timeout_s=30.0,
    )
    return StackThread(config)


def _expected(serving_model, engine):
    texts = {}
    for prompt in PROMPTS:
        ids = in_process_answer(serving_model, engine, prompt, 8)
        texts[prompt] = serving_model.tokenizer.decode(ids, skip_special_tokens=True)
    return texts.get


def _committed(urls: list[str], expect: int, timeout_s: float = 30.0) -> int:
    """Blocks the registry holds a commit for: one per answered request, or a request ran
    twice (or its answer came from nowhere). Read once the cluster answers again, and again
    while the count is short of `expect`: right after the last restart a listing can come
    back partial (a CI run counted 10 of 40 once, through nats-py's `kv.keys()`); a commit truly missing stays missing
    until the deadline, and one too many is returned at once."""

    async def count_once() -> int:
        nc = await nats.connect(urls)
        try:
            registry = await Registry.open(nc.jetstream())
            keys = await registry_keys(nc.jetstream())
            entries = [await registry.get(key) for key in keys]
            return sum(
                e is not None and e.state == commit_pb2.CLAIM_STATE_COMMITTED for e in entries
            )
        finally:
            await nc.close()

    async def count() -> int:
        deadline = time.monotonic() + timeout_s
        while True:  # the node restarted last may still be joining: ask again
            try:
                got = await count_once()
                if got >= expect or time.monotonic() > deadline:
                    return got
            except (RegistryError, TimeoutError, nats.errors.Error):
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.5)

    return asyncio.run(count())


def test_killing_the_stream_leader_and_the_registry_leader_under_load(
    cluster, decoder_dir, serving_model, engine, tmp_path
):
    """SIGKILL the blocks stream's leader, bring it back, then the registry bucket's: every
    request is answered, correctly, once; requests during an election are only delayed."""
    urls = [n.url for n in cluster]
    stack = _stack(tmp_path, decoder_dir, urls)
    http = stack.start(timeout=120).http
    n = scale(40, 400)
    load = Load(http, MODEL, PROMPTS, threads=2, limit=n).start()
    elections = {}
    try:
        for i, stream in enumerate((streams.BLOCKS_STREAM, REGISTRY_STREAM)):
            load.wait_for(n * (i + 1) // 3)
            old = leader_of(urls, stream)
            victim = next(j for j, node in enumerate(cluster) if node.server_name == old)
            kill(cluster[victim])
            leader, took = new_leader_after(
                [u for u in urls if u != cluster[victim].url], stream, old
            )
            elections[stream] = {
                "killed": old,
                "new_leader": leader,
                "new_leader_s": round(took, 3),
            }
            time.sleep(1.0)
            cluster[victim] = restart_nats_server(cluster[victim])
        outcomes = load.join()
    finally:
        stack.stop()
    figures = summary(outcomes, _expected(serving_model, engine))
    figures |= {"elections": elections, "committed": _committed(urls, n)}
    report("kill_stream_and_registry_leaders", figures)
    assert figures["requests"] == n and figures["errors"] == 0, figures
    assert figures["wrong"] == 0, figures
    assert figures["committed"] == n, figures  # one commit per request: none lost, none twice


def test_rolling_restart_of_every_node_under_load(
    cluster, decoder_dir, serving_model, engine, tmp_path
):
    """Each node stopped and started in turn while requests flow: none fails."""
    urls = [n.url for n in cluster]
    stack = _stack(tmp_path, decoder_dir, urls)
    http = stack.start(timeout=120).http
    n = scale(40, 400)
    load = Load(http, MODEL, PROMPTS, threads=2, limit=n).start()
    try:
        for i in range(len(cluster)):
            load.wait_for(n * (i + 1) // 4)
            stop_nats_server(cluster[i])
            time.sleep(1.0)
            cluster[i] = restart_nats_server(cluster[i])
            leader_of(urls, streams.BLOCKS_STREAM)  # the cluster has a leader again
        outcomes = load.join()
    finally:
        stack.stop()
    figures = summary(outcomes, _expected(serving_model, engine)) | {
        "committed": _committed(urls, n)
    }
    report("rolling_restart", figures)
    assert figures["requests"] == n and figures["errors"] == 0, figures
    assert figures["wrong"] == 0 and figures["committed"] == n, figures
