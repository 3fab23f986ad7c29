"""The NATS users of `stateblock up` and the chart against a real nats-server: each
component's user does what its service does, and the server refuses it the rest (a registry
write by the gateway, a block published by the readout, another user's replies, a stream
changed or deleted); a client without a user's password is not let in at all."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import nats
import nats.js.errors as js_errors
import pytest
from nats.js.api import StreamConfig

from gateway.idempotency import KvKeyStore
from readout_svc.advisories import advisory_subject
from registry import Registry
from stateblock.app import nats_auth
from stateblock.app.nats_server import NatsProcess, start_nats_server, stop_nats_server
from stateblock.app.stack import StackThread, UpConfig
from stateblock.nats_client import NatsOptions, NatsUnreachable, connect, inbox_prefix
from stateblock.protocol import streams
from stateblock.protocol.tokens import read_token
from stateblock.runtime import ConfigError
from tests.unit.deploy.chart import of_kind, render

REGISTRY_KEY = "$KV.STATEBLOCK_REGISTRY.b-forged"
BLOCK_SUBJECT = streams.blocks_subject("stateblock-reference")


@dataclass
class Client:
    nc: nats.NATS
    errors: list[str] = field(default_factory=list)

    @property
    def js(self):
        return self.nc.jetstream(timeout=1.0)

    async def refused(self, call: Callable[[], Awaitable[object]], subject: str) -> None:
        """`call` fails, and the server said why: a permissions violation naming `subject`."""
        with pytest.raises((nats.errors.Error, js_errors.Error, TimeoutError)):
            await call()
        await self.violation(subject)

    async def violation(self, subject: str) -> None:
        for _ in range(50):
            if any("permissions violation" in e and subject.lower() in e for e in self.errors):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation for {subject}: {self.errors}")


async def login(url: str, user: str | None = None, password: str | None = None) -> Client:
    client = Client(nats.NATS())

    async def on_error(e: Exception) -> None:
        client.errors.append(str(e).lower())

    auth = {} if user is None else {"user": user, "password": password}
    if user is not None:
        auth["inbox_prefix"] = inbox_prefix(user)
    await client.nc.connect(
        url, error_cb=on_error, allow_reconnect=False, connect_timeout=2.0, **auth
    )
    return client


@pytest.fixture
def passwords(tmp_path) -> dict[str, str]:
    files = nats_auth.password_files(tmp_path / "data")
    return {user: read_token(path) for user, path in files.items()}


@pytest.fixture
async def server(tmp_path, passwords) -> AsyncIterator[NatsProcess]:
    """A server with the stack's users, its streams and buckets made by the admin."""
    process = start_nats_server(tmp_path / "nats", authorization=nats_auth.authorization(passwords))
    admin = await login(process.url, nats_auth.ADMIN, passwords[nats_auth.ADMIN])
    js = admin.nc.jetstream()
    await streams.ensure_streams(js)
    await Registry.open(js)
    await KvKeyStore.open(js, ttl_s=60.0)
    await streams.ensure_readout_consumer(js, "stateblock-reference", ack_wait_s=5.0, max_deliver=2)
    await admin.nc.close()
    yield process
    stop_nats_server(process, timeout_s=5)


@pytest.fixture
async def users(server, passwords) -> AsyncIterator[dict[str, Client]]:
    clients = {u: await login(server.url, u, passwords[u]) for u in passwords}
    yield clients
    for client in clients.values():
        await client.nc.close()


async def test_a_client_without_a_users_password_is_not_let_in(server, passwords):
    for user, password in [
        (None, None),
        (nats_auth.GATEWAY, "not-the-password"),
        (nats_auth.GATEWAY, passwords[nats_auth.READOUT]),  # another user's password
    ]:
        with pytest.raises((nats.errors.Error, OSError)):
            client = await login(server.url, user, password)
            await client.nc.close()
    for user in nats_auth.COMPONENTS:
        client = await login(server.url, user, passwords[user])
        assert client.nc.is_connected
        await client.nc.close()


async def test_a_service_refused_at_login_names_its_user_and_the_settings(server, tmp_path):
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-gateways-password\n")
    options = NatsOptions.of(
        server.url, {}, user=nats_auth.GATEWAY, password_file=wrong, start_attempts=1,
        reconnect_wait_s=0.05,
    )  # fmt: skip
    with pytest.raises(NatsUnreachable, match="refused user 'gateway'.*NATS_PASSWORD_FILE"):
        await connect(options, "gateway")
    with pytest.raises(ConfigError, match="go together"):
        NatsOptions.of(server.url, {"STATEBLOCK_NATS_USER": nats_auth.GATEWAY})


async def test_the_gateway_reads_the_registry_and_cannot_write_it_or_publish(users):
    gateway, admin = users[nats_auth.GATEWAY], users[nats_auth.ADMIN]
    registry = await gateway.js.key_value("STATEBLOCK_REGISTRY")
    with pytest.raises(js_errors.KeyNotFoundError):  # a read: answered
        await registry.get("b-1")
    requests = await gateway.js.key_value("STATEBLOCK_REQUESTS")
    assert await requests.create("k-1", b"record") > 0  # its idempotency keys
    await gateway.nc.flush()
    assert not gateway.errors
    await gateway.refused(lambda: registry.put("b-forged", b"x"), REGISTRY_KEY)
    await gateway.refused(lambda: gateway.js.publish(BLOCK_SUBJECT, b"x"), BLOCK_SUBJECT)
    # nothing was stored
    admin_registry = await admin.js.key_value("STATEBLOCK_REGISTRY")
    with pytest.raises(js_errors.KeyNotFoundError):
        await admin_registry.get("b-forged")
    assert (await admin.js.stream_info(streams.BLOCKS_STREAM)).state.messages == 0


async def test_the_capture_publishes_blocks_and_cannot_write_the_registry(users):
    capture = users[nats_auth.CAPTURE]
    ack = await capture.js.publish(BLOCK_SUBJECT, b"block", headers={"Nats-Msg-Id": "b-1"})
    assert ack.stream == streams.BLOCKS_STREAM
    objects = await capture.js.object_store(streams.PAYLOAD_BUCKET)
    await objects.put("b-1", b"rows" * 1000)
    await capture.nc.flush()
    assert not capture.errors
    await capture.refused(lambda: capture.js.key_value("STATEBLOCK_REGISTRY"),
                          "$JS.API.STREAM.INFO.KV_STATEBLOCK_REGISTRY")  # fmt: skip
    await capture.refused(lambda: capture.js.publish(REGISTRY_KEY, b"x"), REGISTRY_KEY)
    await capture.refused(
        lambda: capture.js.publish(streams.rejected_subject("x"), b"x"), "stateblock.rejected.x"
    )


async def test_the_readout_claims_and_reads_but_cannot_publish_a_block(users):
    readout, capture = users[nats_auth.READOUT], users[nats_auth.CAPTURE]
    # the advisory listener: a block out of deliveries is read back by its sequence
    await readout.nc.subscribe(advisory_subject(streams.BLOCKS_STREAM, "readout-x"), queue="q")
    ack = await capture.js.publish(BLOCK_SUBJECT, b"block", headers={"Nats-Msg-Id": "b-2"})
    assert (await readout.js.get_msg(streams.BLOCKS_STREAM, ack.seq)).data == b"block"
    await (await capture.js.object_store(streams.PAYLOAD_BUCKET)).put("b-2", b"rows")
    psub = await readout.js.pull_subscribe_bind(
        "readout-stateblock-reference", streams.BLOCKS_STREAM
    )
    (msg,) = await psub.fetch(1, timeout=2.0)
    assert msg.data == b"block"
    await msg.ack_sync(timeout=2.0)
    dead = await readout.js.publish(streams.rejected_subject("signature"), b"block")
    assert dead.stream == streams.REJECTED_STREAM
    objects = await readout.js.object_store(streams.PAYLOAD_BUCKET)
    assert (await objects.get("b-2")).data == b"rows"
    await objects.delete("b-2")
    registry = await readout.js.key_value("STATEBLOCK_REGISTRY")
    assert await registry.create("b-2", b"claim") > 0
    await readout.nc.flush()
    assert not readout.errors  # all of the above was allowed
    await readout.refused(lambda: readout.js.publish(BLOCK_SUBJECT, b"x"), BLOCK_SUBJECT)
    await readout.refused(
        lambda: readout.js.publish("$O.STATEBLOCK_PAYLOADS.C.x", b"x"), "$o.stateblock_payloads.c.x"
    )


async def test_no_user_changes_or_deletes_a_stream(users):
    config = StreamConfig(name=nats_auth.REGISTRY, subjects=["$KV.STATEBLOCK_REGISTRY.>"])
    for user in nats_auth.COMPONENTS:
        client = users[user]
        await client.refused(
            lambda c=client: c.js.delete_stream(streams.BLOCKS_STREAM),
            f"$JS.API.STREAM.DELETE.{streams.BLOCKS_STREAM}",
        )
        await client.refused(
            lambda c=client: c.js.update_stream(config),
            f"$JS.API.STREAM.UPDATE.{nats_auth.REGISTRY}",
        )


async def test_no_user_reads_another_users_replies(users):
    gateway = users[nats_auth.GATEWAY]
    for subject in ("_INBOX.>", f"{inbox_prefix(nats_auth.READOUT)}.>", ">"):
        await gateway.nc.subscribe(subject)
        await gateway.violation(subject)


async def test_the_embedded_stack_admits_its_users_only(stack):
    data_dir = stack.config.data_dir
    with pytest.raises((nats.errors.Error, OSError)):
        client = await login(stack.urls.nats)
        await client.nc.close()
    for path in [*(data_dir / "nats-users").iterdir(), data_dir / "nats.conf"]:
        assert path.stat().st_mode & 0o777 == 0o600, path
    admin = await nats.connect(stack.urls.nats_admin)
    assert (await admin.jetstream().stream_info(streams.BLOCKS_STREAM)).config.name
    await admin.close()


def test_the_embedded_stack_answers_through_the_object_store(
    decoder_dir, serving_model, engine, tmp_path
):
    """A block over max_payload under the users' permissions: the capture puts its rows
    object, a worker reads it, commits and deletes it, and the answer comes back."""
    config = UpConfig(
        data_dir=tmp_path / "stack", http_port=0, grpc_port=0, workers=1,
        decoder_dir=decoder_dir, nats_max_payload=16 * 1024, request_timeout_s=30.0,
        data_plane="bus",  # rows over max_payload: the object store
    )  # fmt: skip
    stack = StackThread(config, model=serving_model, engine=engine)
    urls = stack.start()
    try:
        body = {"model": "stateblock-reference", "prompt": "copy: " + "abcdefgh" * 5,
                "max_tokens": 8}  # fmt: skip
        reply = httpx.post(f"{urls.http}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"]

        async def objects_written() -> int:
            admin = await nats.connect(urls.nats_admin)
            try:
                return (await admin.jetstream().stream_info(nats_auth.PAYLOADS)).state.last_seq
            finally:
                await admin.close()

        assert asyncio.run(objects_written()) > 0
    finally:
        stack.stop()


async def test_the_charts_users_connect_with_their_own_secrets_only(tmp_path):
    """The chart's server side (auth.conf, included as the bundled NATS includes it) admits
    each component with the password in its own Secret, with the same permissions."""
    secrets = of_kind(render(), "Secret")
    auth = tmp_path / "stateblock-auth" / "auth.conf"
    auth.parent.mkdir()
    auth.write_text(secrets["sb-stateblock-nats-auth"]["stringData"]["auth.conf"])
    process = start_nats_server(
        tmp_path / "nats-config", authorization="include ../stateblock-auth/auth.conf"
    )
    try:
        clients = {}
        for user in nats_auth.COMPONENTS:
            data = secrets[f"sb-stateblock-nats-{user}"]["data"]
            clients[user] = await login(
                process.url, user, base64.b64decode(data["password"]).decode()
            )
        other = base64.b64decode(secrets["sb-stateblock-nats-readout"]["data"]["password"])
        with pytest.raises((nats.errors.Error, OSError)):
            await login(process.url, nats_auth.GATEWAY, other.decode())
        gateway = clients[nats_auth.GATEWAY]
        await gateway.refused(lambda: gateway.js.publish(BLOCK_SUBJECT, b"x"), BLOCK_SUBJECT)
        for client in clients.values():
            await client.nc.close()
    finally:
        stop_nats_server(process, timeout_s=5)


async def test_a_blocks_stream_from_before_message_ttl_is_upgraded_by_the_admin_alone(
    server, passwords
):
    """A store from an earlier version: the capture, which may not change a stream, stops
    at start-up saying what to run; the admin's upgrade (what `stateblock up` does before
    its services start) turns the TTL on, blocks kept, and the capture starts."""
    admin = await login(server.url, nats_auth.ADMIN, passwords[nats_auth.ADMIN])
    capture = await login(server.url, nats_auth.CAPTURE, passwords[nats_auth.CAPTURE])
    try:
        old = (await admin.js.stream_info(streams.BLOCKS_STREAM)).config
        await admin.js.delete_stream(streams.BLOCKS_STREAM)
        await admin.js.add_stream(dataclasses.replace(old, allow_msg_ttl=None))
        await admin.js.publish(streams.blocks_subject("m"), b"queued before")
        with pytest.raises(streams.StreamConflict, match="--allow-msg-ttl"):
            await streams.ensure_streams(capture.js, dead_letters=False)
        assert await streams.upgrade_blocks_stream(admin.js)
        assert not await streams.upgrade_blocks_stream(admin.js)  # once
        await streams.ensure_streams(capture.js, dead_letters=False)
        info = await admin.js.stream_info(streams.BLOCKS_STREAM)
        assert info.config.allow_msg_ttl and info.state.messages == 1
    finally:
        await admin.nc.close()
        await capture.nc.close()


def test_up_on_a_store_from_before_message_ttl_upgrades_it_and_starts(decoder_dir, tmp_path):
    config = UpConfig(data_dir=tmp_path / "up", http_port=0, grpc_port=0, workers=1,
                      decoder_dir=decoder_dir, request_timeout_s=30.0)  # fmt: skip

    async def make_it_old(admin_url: str) -> None:
        nc = await nats.connect(admin_url)
        js = nc.jetstream()
        old = (await js.stream_info(streams.BLOCKS_STREAM)).config
        await js.delete_stream(streams.BLOCKS_STREAM)
        await js.add_stream(dataclasses.replace(old, allow_msg_ttl=None))
        await nc.close()

    async def allows_ttl(admin_url: str) -> bool:
        nc = await nats.connect(admin_url)
        info = await nc.jetstream().stream_info(streams.BLOCKS_STREAM)
        await nc.close()
        return bool(info.config.allow_msg_ttl)

    first = StackThread(config)
    urls = first.start(timeout=120)
    asyncio.run(make_it_old(urls.nats_admin))
    first.stop()
    again = StackThread(config)
    urls = again.start(timeout=120)  # the capture's own user could not have changed it
    try:
        assert asyncio.run(allows_ttl(urls.nats_admin))
    finally:
        again.stop()
