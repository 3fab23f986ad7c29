"""The NATS users of a deployment: one per component, each allowed the subjects it uses.

`stateblock up` writes the users into the `authorization` block of the nats-server it
starts (passwords generated under its data dir); the Helm chart renders the same table into
its NATS server's configuration (`deploy/helm/stateblock/files/nats-permissions.json`, which
a test compares with `PERMISSIONS`). What each permission still allows its holder is in
docs/RELIABILITY.md.

The subjects: a JetStream API call is a request on `$JS.API.<verb>.<stream>...`, so an
allow list names the verbs and the streams (a KV bucket `B` is the stream `KV_B`, an object
bucket `O` the stream `OBJ_O`). A service may CREATE what it uses (at start-up, when it does
not exist yet: creating an existing stream with another configuration is refused by the
server), never UPDATE or DELETE a stream. Replies (JetStream's answers, publish acks,
deliveries to a pull or ordered consumer) come on the user's own inboxes,
`_INBOX_<user>.>` (`stateblock.nats_client.inbox_prefix`): no user can read another's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gateway.idempotency import BUCKET as REQUESTS_BUCKET
from registry.registry import DEFAULT_BUCKET as REGISTRY_BUCKET
from stateblock.nats_client import inbox_prefix
from stateblock.protocol import streams
from stateblock.protocol.tokens import load_or_generate_token, read_token

CAPTURE, READOUT, GATEWAY = "capture", "readout", "gateway"
COMPONENTS = (CAPTURE, READOUT, GATEWAY)
ADMIN = "admin"  # every subject: operators and the audit tools, never a service

BLOCKS, REJECTED = streams.BLOCKS_STREAM, streams.REJECTED_STREAM
PAYLOADS = f"OBJ_{streams.PAYLOAD_BUCKET}"
REGISTRY, REQUESTS = f"KV_{REGISTRY_BUCKET}", f"KV_{REQUESTS_BUCKET}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def as_config(self) -> dict:
        return {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }


def _api(verb: str, *streams_: str) -> list[str]:
    return [f"$JS.API.{verb}.{s}" for s in streams_]


def _ephemeral(stream: str) -> str:
    """An ordered consumer's creation (a KV watch, an object's chunks)."""
    return f"$JS.API.CONSUMER.CREATE.{stream}"


def _permissions(user: str, publish: list[str], subscribe: list[str] = ()) -> Permissions:
    return Permissions(tuple(publish), (f"{inbox_prefix(user)}.>", *subscribe))


PERMISSIONS: dict[str, Permissions] = {
    # publishes blocks, and the rows of a block over max_payload as a payload object; hears
    # the readers' releases of its arena's spans
    CAPTURE: _permissions(CAPTURE, [
        *_api("STREAM.INFO", BLOCKS, PAYLOADS),
        *_api("STREAM.CREATE", BLOCKS, PAYLOADS),
        streams.blocks_subject(">"),
        f"$O.{streams.PAYLOAD_BUCKET}.>",
        f"$JS.API.STREAM.MSG.GET.{PAYLOADS}",  # a put looks for the object's meta first
    ], [
        streams.release_subject(">"),  # `ipc`: the spans its readers are done with
    ]),
    # consumes and acks blocks, reads and deletes their payload objects, claims and commits in
    # the registry, dead-letters what it cannot vouch for, ends blocks out of deliveries
    READOUT: _permissions(READOUT, [
        *_api("STREAM.INFO", BLOCKS, REJECTED, PAYLOADS, REGISTRY),
        *_api("STREAM.CREATE", BLOCKS, REJECTED, PAYLOADS, REGISTRY),
        f"$JS.API.CONSUMER.INFO.{BLOCKS}.*",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{BLOCKS}.*",
        f"$JS.API.CONSUMER.MSG.NEXT.{BLOCKS}.*",
        f"$JS.ACK.{BLOCKS}.>",
        f"$JS.API.STREAM.MSG.GET.{BLOCKS}",
        _ephemeral(PAYLOADS),
        "$JS.API.STREAM.NAMES",  # nats-py's object get finds the chunks' stream by subject
        # a read block's object deleted: its meta marked, its chunks purged
        f"$O.{streams.PAYLOAD_BUCKET}.M.>",
        f"$JS.API.STREAM.PURGE.{PAYLOADS}",
        f"$JS.API.STREAM.MSG.GET.{PAYLOADS}",
        f"$KV.{REGISTRY_BUCKET}.>",
        f"$JS.API.STREAM.MSG.GET.{REGISTRY}",
        streams.rejected_subject(">"),
        streams.release_subject(">"),  # `ipc`: a read block's span freed in the capture
    ], [
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{BLOCKS}.>",
    ]),
    # follows the registry's stored writes, reads a key's history, keeps idempotency keys
    GATEWAY: _permissions(GATEWAY, [
        *_api("STREAM.INFO", REGISTRY, REQUESTS),
        *_api("STREAM.CREATE", REGISTRY, REQUESTS),
        _ephemeral(REGISTRY),
        f"$JS.API.STREAM.MSG.GET.{REGISTRY}",
        f"$KV.{REQUESTS_BUCKET}.>",
        f"$JS.API.STREAM.MSG.GET.{REQUESTS}",
    ]),
}  # fmt: skip


def authorization(passwords: Mapping[str, str]) -> str:
    """nats-server's `authorization` block (JSON is NATS configuration): each user of
    `passwords` with its permissions; ADMIN, when given, with every subject."""
    users = []
    for user, password in passwords.items():
        entry = {"user": user, "password": password}
        if user != ADMIN:
            entry["permissions"] = PERMISSIONS[user].as_config()
        users.append(entry)
    return f"authorization: {json.dumps({'users': users}, indent=2)}\n"


def table_json() -> str:
    """The permission table as the chart reads it (files/nats-permissions.json)."""
    table = {user: p.as_config() for user, p in PERMISSIONS.items()}
    return json.dumps(table, indent=2, sort_keys=True) + "\n"


def password_files(data_dir: Path) -> dict[str, Path]:
    """Each user's password file under data_dir/nats-users (0600), written on first run."""
    files = {user: data_dir / "nats-users" / user for user in (*COMPONENTS, ADMIN)}
    for path in files.values():
        load_or_generate_token(path)
    return files


def server_authorization(files: Mapping[str, Path]) -> str:
    """`authorization` for the users of `password_files`, with the passwords they hold."""
    return authorization(
        {user: read_token(path, "NATS password file") for user, path in files.items()}
    )


def login_url(url: str, password_file: Path, user: str = ADMIN) -> str:
    """`url` (nats://host:port) carrying `user` and its password, for a plain nats.connect."""
    password = read_token(password_file, "NATS password file")
    return url.replace("nats://", f"nats://{user}:{password}@", 1)
